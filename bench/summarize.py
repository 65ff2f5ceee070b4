#!/usr/bin/env python3
"""Turns the points of one bench/compare.sh run into its tables.

    bench/summarize.py OUT_DIR
    bench/summarize.py --other-load POINT_JSON   (how disturbed one point was)

Reads OUT_DIR/points/*.json (one per pgbench or service point, with the CPU
and memory compare.sh recorded around it), the pgbench outputs and
per-transaction logs, and the load generator's JSON results. Writes
OUT_DIR/summary.md (printed too) and OUT_DIR/summary.json, and exits 1 when a
point failed, reported errors, or lacks a number.
"""

import glob
import json
import os
import re
import sys

# The service scenario, the pgbench yardstick the issue names, and the pgbench
# script with the statements the service sends today for the same operation.
PAIRS = [
    ("claim", "Claim, fresh key", "claim", "claim-as-sent"),
    ("claim-complete", "Claim+Complete cycle", "claim-complete", "claim-complete-as-sent"),
    ("duplicate", "duplicate Claim (replay)", "duplicate-upsert", "duplicate-as-sent"),
    # Keys per second on both sides: ClaimBatch of 100 against one statement
    # claiming 64 keys (the yardstick; the service sends FETCH_MANY then
    # TRY_CLAIM_MANY, for which there is no separate script).
    ("claim-batch", "ClaimBatch of 100, keys", "claim-unnest64", "claim-unnest64"),
]
KEYS_PER_STATEMENT = {"claim-unnest64": 64}


def percentile(sorted_values, q):
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, int(round(q * len(sorted_values) + 0.5)) - 1))
    return sorted_values[index]


def relocate(point):
    """Finds the point's files beside its JSON, so that a results folder can
    be moved or copied and summarized again."""
    here = os.path.dirname(point["path"])
    for field in ("output", "log_prefix", "bench_json"):
        if field in point:
            point[field] = os.path.join(here, os.path.basename(point[field]))


def read_pgbench(point, problems):
    name = f"pgbench {point['scenario']} c{point['level']}"
    try:
        text = open(point["output"]).read()
    except OSError:
        problems.append(f"{name}: no output")
        return
    tps = re.search(r"^tps = ([0-9.]+) \(without initial connection time\)", text, re.M)
    done = re.search(r"^number of transactions actually processed: (\d+)", text, re.M)
    failed = re.search(r"^number of failed transactions: (\d+)", text, re.M)
    if point["exit_status"] != 0 or not tps or not done:
        problems.append(f"{name}: failed or incomplete (exit {point['exit_status']}): {point['output']}")
        return
    if failed and int(failed.group(1)) > 0:
        problems.append(f"{name}: {failed.group(1)} failed transactions")
    per = KEYS_PER_STATEMENT.get(point["scenario"], 1)
    point["ops"] = int(done.group(1)) * per
    point["rate"] = float(tps.group(1)) * per
    latencies = []
    for path in glob.glob(point["log_prefix"] + ".*"):
        with open(path) as log:
            for line in log:
                fields = line.split()
                if len(fields) >= 3:
                    latencies.append(int(fields[2]))
    if latencies:
        latencies.sort()
        percentiles = {
            "p50_us": percentile(latencies, 0.50),
            "p99_us": percentile(latencies, 0.99),
            "max_us": latencies[-1],
        }
        # Kept in the point's file: compare.sh deletes the logs afterwards.
        saved = json.load(open(point["path"]))
        saved["latency"] = percentiles
        with open(point["path"], "w") as f:
            json.dump(saved, f)
    else:
        percentiles = point.get("latency")
    if not percentiles:
        problems.append(f"{name}: no per-transaction log")
        return
    point.update(percentiles)


def read_service(point, problems):
    name = f"service {point['label']} c{point['level']}"
    try:
        result = json.load(open(point["bench_json"]))
    except (OSError, ValueError):
        problems.append(f"{name}: no result (exit {point['exit_status']}): {point['output']}")
        return
    point["result"] = result
    if result["errors_total"] > 0:
        problems.append(f"{name}: {result['errors_total']} errors {result['errors']} {result['error_samples']}")
    if result["ops"] == 0:
        problems.append(f"{name}: no operation completed")
    point["ops"] = result["ops"]
    # keys/s for claim-batch (ops/s times the batch size), ops/s otherwise.
    point["rate"] = result.get("keys_per_s", result["ops_per_s"])
    op = result["latency_us"].get(f"op:{point['scenario']}", {})
    point["p50_us"] = op.get("p50")
    point["p99_us"] = op.get("p99")
    point["max_us"] = op.get("max")
    claim = result["latency_us"].get("Claim", {})
    point["claim_p50_us"] = claim.get("p50")
    point["claim_p99_us"] = claim.get("p99")


def cpu_per_op(point):
    """Microseconds of CPU per operation: the machine, PostgreSQL, the server,
    the client (pgbench or the load generator), and the rest (other
    processes: anything else running on the machine during the point).

    CPU is counted over compare.sh's window and operations over the
    client's, which differ slightly, so both are taken as rates."""
    rate, wall = point.get("rate"), point.get("wall_s")
    if not rate or not wall:
        return None

    def per(ticks):
        return None if ticks is None else ticks / point["clk_tck"] / wall / rate * 1e6

    machine, pg, server = per(point["machine_ticks"]), per(point["pg_ticks"]), per(point["server_ticks"])
    client = None
    result = point.get("result")
    if result is not None and result.get("client_cpu_s") is not None:
        # The load generator measured itself over its own window.
        client = result["client_cpu_s"] / result["elapsed_s"] / rate * 1e6
    elif result is None and point.get("client_cpu_s") is not None:
        client = point["client_cpu_s"] / wall / rate * 1e6
    other = None
    if None not in (machine, pg, client):
        other = machine - pg - (server or 0) - client
    return {"total": machine, "postgres": pg, "server": server, "client": client, "other": other}


def other_load(point):
    """Share of the machine's CPU (all cores) taken by other processes during
    the point, in percent: high values mean the point was disturbed."""
    cpu = point.get("cpu_us_per_op") if point else None
    if not cpu or cpu.get("other") is None:
        return None
    return max(0.0, 100 * cpu["other"] * point["rate"] / (point["cpus"] * 1e6))


def fsync_ms(point):
    """Mean WAL fsync during the point, in ms (None when nothing was synced)."""
    if not point or not point.get("wal_syncs"):
        return None
    return point["wal_sync_ms"] / point["wal_syncs"]


def fmt(value, digits=0):
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}"


def ms(us):
    return "n/a" if us is None else f"{us / 1000:.2f}"


def ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def print_other_load(path):
    """For compare.sh: how disturbed one point was (percent), or -1."""
    point = json.load(open(path))
    point["path"] = path
    relocate(point)
    (read_pgbench if point["source"] == "pgbench" else read_service)(point, [])
    point["cpu_us_per_op"] = cpu_per_op(point)
    load = other_load(point)
    print(-1 if load is None else round(load))


def main():
    if sys.argv[1] == "--other-load":
        print_other_load(sys.argv[2])
        return
    out = sys.argv[1]
    problems = []
    points = []
    for path in sorted(glob.glob(os.path.join(out, "points", "*.json"))):
        if path.endswith(".bench.json"):
            continue
        point = json.load(open(path))
        point["path"] = path
        relocate(point)
        (read_pgbench if point["source"] == "pgbench" else read_service)(point, problems)
        point["cpu_us_per_op"] = cpu_per_op(point)
        points.append(point)

    pgb = {(p["scenario"], p["level"]): p for p in points if p["source"] == "pgbench"}
    svc = {(p["label"], p["level"]): p for p in points if p["source"] == "service"}
    levels = sorted({p["level"] for p in points})
    machine = open(os.path.join(out, "machine.txt")).read().strip()
    lines = ["# idempotency-service against pgbench", "", "```", machine, "```", ""]

    lines += [
        "## Throughput (operations per second; ratio = service / pgbench)",
        "",
        "The last columns tell how comparable each pair is: the mean WAL fsync (ms) during the yardstick's and the service's points, and the share of the machine's CPU that other processes took meanwhile. Where they differ, the disk or a neighbour, not the code, moved the ratio.",
        "",
        "| operation | callers | pgbench clients | pgbench yardstick | service | ratio | pgbench, statements the service sends | ratio | fsync ms pgbench / service | other load % pgbench / service |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    comparisons = []
    for label, title, yardstick, as_sent in PAIRS:
        for level in levels:
            s, y, a = svc.get((label, level)), pgb.get((yardstick, level)), pgb.get((as_sent, level))
            if not (s or y or a):
                continue
            row = {
                "operation": label,
                "level": level,
                "pgbench_clients": (y or a or {}).get("clients"),
                "pgbench": (y or {}).get("rate"),
                "pgbench_as_sent": (a or {}).get("rate"),
                "service": (s or {}).get("rate"),
            }
            row["ratio"] = ratio(row["service"], row["pgbench"])
            row["ratio_as_sent"] = ratio(row["service"], row["pgbench_as_sent"])
            row["fsync_ms_pgbench"] = fsync_ms(y)
            row["fsync_ms_service"] = fsync_ms(s)
            row["other_load_pgbench"] = other_load(y)
            row["other_load_service"] = other_load(s)
            comparisons.append(row)
            lines.append(
                f"| {title} | {level} | {row['pgbench_clients'] or 'n/a'} | {fmt(row['pgbench'])} ({yardstick}) "
                f"| {fmt(row['service'])} | {fmt(row['ratio'], 2)}x | {fmt(row['pgbench_as_sent'])} ({as_sent}) "
                f"| {fmt(row['ratio_as_sent'], 2)}x | {fmt(row['fsync_ms_pgbench'], 2)} / {fmt(row['fsync_ms_service'], 2)} "
                f"| {fmt(row['other_load_pgbench'])} / {fmt(row['other_load_service'])} |"
            )
    lines.append("")

    lines += [
        "## Latency per operation (ms; pgbench per transaction, service per operation as the caller sees it)",
        "",
        "| operation | callers | pgbench p50 | service p50 | ratio | pgbench p99 | service p99 | service max |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, title, yardstick, _ in PAIRS:
        for level in levels:
            s, y = svc.get((label, level)), pgb.get((yardstick, level))
            if not (s or y):
                continue
            s, y = s or {}, y or {}
            lines.append(
                f"| {title} | {level} | {ms(y.get('p50_us'))} | {ms(s.get('p50_us'))} "
                f"| {fmt(ratio(s.get('p50_us'), y.get('p50_us')), 2)}x | {ms(y.get('p99_us'))} "
                f"| {ms(s.get('p99_us'))} | {ms(s.get('max_us'))} |"
            )
    lines.append("")

    lines += [
        "## pgbench alone",
        "",
        "| statements | clients | per second | p50 ms | p99 ms | CPU µs/op: PostgreSQL | pgbench | other | fsync ms | other load % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (scenario, level), p in sorted(pgb.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        cpu = p.get("cpu_us_per_op") or {}
        unit = " keys" if scenario in KEYS_PER_STATEMENT else ""
        lines.append(
            f"| {scenario} | {p['clients']} | {fmt(p.get('rate'))}{unit} | {ms(p.get('p50_us'))} "
            f"| {ms(p.get('p99_us'))} | {fmt(cpu.get('postgres'))} | {fmt(cpu.get('client'))} | {fmt(cpu.get('other'))} "
            f"| {fmt(fsync_ms(p), 2)} | {fmt(other_load(p))} |"
        )
    lines.append("")

    lines += [
        "## The service: memory and CPU per operation",
        "",
        "RSS and its high-water mark (VmHWM) are read from /proc after each point; one server process serves every point in order, so VmHWM is the peak so far.",
        "",
        "| scenario | callers | per second | server RSS MiB | server VmHWM MiB | CPU µs/op: PostgreSQL | server | load generator | other | fsync ms | other load % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (label, level), p in sorted(svc.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        cpu = p.get("cpu_us_per_op") or {}
        rss = p.get("server_rss_kib")
        hwm = p.get("server_hwm_kib")
        lines.append(
            f"| {label} | {level} | {fmt(p.get('rate'))} | {fmt(rss and rss / 1024, 1)} | {fmt(hwm and hwm / 1024, 1)} "
            f"| {fmt(cpu.get('postgres'))} | {fmt(cpu.get('server'))} | {fmt(cpu.get('client'))} | {fmt(cpu.get('other'))} "
            f"| {fmt(fsync_ms(p), 2)} | {fmt(other_load(p))} |"
        )
    lines.append("")

    info_levels = [lvl for lvl in levels if ("claim-complete-info", lvl) in svc]
    if info_levels:
        lines += [
            "## The per-call log line (Claim+Complete on two servers, back to back: RUST_LOG=warn, then the default info)",
            "",
            "| callers | warn /s | info /s | info / warn | server CPU µs/op, warn | info |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for level in info_levels:
            i = svc[("claim-complete-info", level)]
            w = svc.get(("claim-complete-warn", level), {})
            lines.append(
                f"| {level} | {fmt(w.get('rate'))} | {fmt(i.get('rate'))} | {fmt(ratio(i.get('rate'), w.get('rate')), 2)}x "
                f"| {fmt((w.get('cpu_us_per_op') or {}).get('server'))} | {fmt((i.get('cpu_us_per_op') or {}).get('server'))} |"
            )
        lines.append("")

    # The targets, from this run's numbers.
    def at(table, key, field):
        return (table.get(key) or {}).get(field)

    targets = []
    t_level = 64 if 64 in levels else (max(levels) if levels else None)
    cycle = ratio(at(svc, ("claim-complete", t_level), "rate"), at(pgb, ("claim-complete", t_level), "rate"))
    targets.append((f"Claim+Complete cycles at {t_level} callers >= 1.0x pgbench claim+complete (aim 1.5x)",
                    cycle, cycle is not None and cycle >= 1.0))
    dup = ratio(at(svc, ("duplicate", t_level), "rate"), at(pgb, ("duplicate-upsert", t_level), "rate"))
    targets.append((f"duplicate Claims at {t_level} callers >= 1.0x pgbench duplicate upsert (aim 2x)",
                    dup, dup is not None and dup >= 1.0))
    batch = ratio(at(svc, ("claim-batch", t_level), "rate"), at(pgb, ("claim-unnest64", t_level), "rate"))
    targets.append((f"ClaimBatch of 100 keys at {t_level} callers >= 0.8x pgbench 64-key unnest keys/s",
                    batch, batch is not None and batch >= 0.8))
    lowest = min(levels) if levels else None
    p50 = ratio(at(svc, ("claim", lowest), "claim_p50_us"), at(pgb, ("claim", lowest), "p50_us"))
    targets.append((f"Claim p50 at {lowest} caller within 1.5x pgbench single-claim p50", p50, p50 is not None and p50 <= 1.5))
    p99 = at(svc, ("claim", lowest), "claim_p99_us")
    targets.append((f"Claim p99 at {lowest} caller under 5 ms (value in ms)", p99 and p99 / 1000, p99 is not None and p99 < 5000))
    top = max(levels) if levels else None
    hwm = max((p.get("server_hwm_kib") or 0 for p in svc.values()), default=0) / 1024 or None
    targets.append((f"server memory under 64 MiB with {top} callers (peak VmHWM, MiB)", hwm, hwm is not None and hwm < 64))
    lines += ["## The issue's targets, from this run", "", "| target | measured | met |", "|---|---:|---|"]
    for text, value, met in targets:
        verdict = "n/a" if met is None else ("yes" if met else "no")
        lines.append(f"| {text} | {fmt(value, 2)} | {verdict} |")
    lines.append("")

    if problems:
        lines += ["## Problems", ""] + [f"- {p}" for p in problems] + [""]

    text = "\n".join(lines)
    print(text)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(
            {
                "comparisons": comparisons,
                "targets": [{"target": t, "value": v, "met": m} for t, v, m in targets],
                "points": points,
                "problems": problems,
            },
            f,
            indent=2,
            default=str,
        )
    if problems:
        print(f"summarize: {len(problems)} problems", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
