#!/usr/bin/env python3
"""Turns the points of one bench/compare.sh run into its tables.

    bench/summarize.py OUT_DIR
    bench/summarize.py --other-load POINT_JSON   (how disturbed one point was)
    bench/summarize.py --spread OUT_DIR...       (one operation's rate across runs)

Reads OUT_DIR/points/*.json (one per pgbench or service point, with the CPU,
memory and statement counts compare.sh recorded around it), the pgbench
outputs and per-transaction logs, and the load generator's JSON results.
Writes OUT_DIR/summary.md (printed too) and OUT_DIR/summary.json, and exits 1
when a point failed, reported errors, or lacks a number.
"""

import glob
import json
import os
import re
import sys

# The service's scenario, its title, the hand-written script (the yardstick)
# and the pgbench script of the store's own statements for one call.
OPERATIONS = [
    ("claim-complete", "Claim+Complete cycles", "claim-complete", "claim-complete-as-sent"),
    ("duplicate", "duplicate Claims (replays)", "duplicate", "duplicate-as-sent"),
    ("claim", "fresh Claims", "claim", "claim-as-sent"),
    ("claim-batch", "ClaimBatch of 100, keys (hand-written: 64-key upsert)", "claim-unnest64", None),
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
    name = f"pgbench {point.get('side', '')} {point['scenario']} c{point['level']}"
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
    point["transactions"] = int(done.group(1))
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


def statements_per_op(point):
    """Statements PostgreSQL ran per operation (pg_stat_statements), or None."""
    statements, ops = point.get("statements"), point.get("ops")
    if statements is None or not ops:
        return None
    # The counts cover compare.sh's window, the operations the client's.
    wall, rate = point.get("wall_s"), point.get("rate")
    if wall and rate:
        return statements / (wall * rate)
    return statements / ops


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


def times(value):
    """A ratio in bold with its x, or n/a (a floor whose CPU was too small to
    count, in a smoke run's short points)."""
    return "n/a" if value is None else f"**{value:,.2f}x**"


def ms(us):
    return "n/a" if us is None else f"{us / 1000:.2f}"


def ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def floors(svc, hw, problems):
    """One row per level that has a floor point: the server's CPU per RPC of
    the service (Claim+Complete at RUST_LOG=warn) and of both floors, the
    service's ratios to them, the cycle rates and PostgreSQL's CPU per cycle.
    A floor point without a server CPU or rate is a problem."""
    rows = []
    for level in sorted({lvl for label, lvl in svc if label.startswith("floor-")}):
        points = {
            "service": svc.get(("claim-complete", level)),
            "bare": svc.get(("floor-bare", level)),
            "database": svc.get(("floor-database", level)),
        }
        server, pg, rate = {}, {}, {}
        for side, p in points.items():
            cpu = (p or {}).get("cpu_us_per_op") or {}
            # Two RPCs per Claim+Complete cycle.
            server[side] = None if cpu.get("server") is None else cpu["server"] / 2
            pg[side] = cpu.get("postgres")
            rate[side] = (p or {}).get("rate")
            if side != "service" and p is not None and (server[side] is None or not rate[side]):
                problems.append(f"floor {side} c{level}: no server CPU or rate")
        y = hw.get(("claim-complete", level)) or {}
        pg["handwritten"] = (y.get("cpu_us_per_op") or {}).get("postgres")
        rows.append({
            "level": level,
            "server_us_per_rpc": server,
            "ratio_bare": ratio(server["service"], server["bare"]),
            "ratio_database": ratio(server["service"], server["database"]),
            "rate": rate,
            "pg_us_per_cycle": pg,
        })
    return rows


def load_point(path, problems):
    point = json.load(open(path))
    point["path"] = path
    relocate(point)
    (read_pgbench if point["source"] == "pgbench" else read_service)(point, problems)
    point["cpu_us_per_op"] = cpu_per_op(point)
    point["statements_per_op"] = statements_per_op(point)
    return point


def print_other_load(path):
    """For compare.sh: how disturbed one point was (percent), or -1."""
    load = other_load(load_point(path, []))
    print(-1 if load is None else round(load))


def load_run(out, problems):
    points = []
    for path in sorted(glob.glob(os.path.join(out, "points", "*.json"))):
        if path.endswith(".bench.json"):
            continue
        points.append(load_point(path, problems))
    handwritten = {(p["scenario"], p["level"]): p for p in points
                   if p["source"] == "pgbench" and p.get("side") == "handwritten"}
    as_sent = {(p["scenario"], p["level"]): p for p in points
               if p["source"] == "pgbench" and p.get("side") == "as-sent"}
    service = {(p["label"], p["level"]): p for p in points if p["source"] == "service"}
    return points, handwritten, as_sent, service


def print_spread(outs):
    """Claim+Complete at each level across several runs: min, max and the
    spread (max / min - 1), for the 'within 15% across three runs' target."""
    rates = {}
    for out in outs:
        _, handwritten, _, service = load_run(out, [])
        for (label, level), p in service.items():
            if label == "claim-complete" and p.get("rate"):
                hw = handwritten.get(("claim-complete", level), {}).get("rate")
                rates.setdefault(level, []).append((p["rate"], hw))
    print("| callers | runs | service cycles/s | spread | hand-written cycles/s | spread |")
    print("|---:|---:|---|---:|---|---:|")
    for level in sorted(rates):
        svc = [r for r, _ in rates[level]]
        hw = [h for _, h in rates[level] if h]
        spread = lambda xs: f"{(max(xs) / min(xs) - 1) * 100:.0f}%" if xs else "n/a"
        print(f"| {level} | {len(svc)} | {', '.join(fmt(r) for r in svc)} | {spread(svc)} "
              f"| {', '.join(fmt(r) for r in hw)} | {spread(hw)} |")


def main():
    if sys.argv[1] == "--other-load":
        print_other_load(sys.argv[2])
        return
    if sys.argv[1] == "--spread":
        print_spread(sys.argv[2:])
        return
    out = sys.argv[1]
    problems = []
    points, hw, sent, svc = load_run(out, problems)
    levels = sorted({p["level"] for p in points})
    machine = open(os.path.join(out, "machine.txt")).read().strip()
    lines = ["# idempotency-service against the SQL a team would write by hand", "", "```", machine, "```", ""]

    lines += [
        "## Against the hand-written SQL (ratio = service / hand-written)",
        "",
        "Per operation: throughput, latency as the caller sees it (pgbench per transaction, the load generator per operation), PostgreSQL's CPU per operation and the statements it ran per operation. The last column is pgbench running the statements the store sends for one call, one call at a time.",
        "",
        "| operation | callers | hand-written /s | service /s | ratio | p50 ms hand / service | p99 ms hand / service | p99 ratio | PostgreSQL CPU µs/op hand / service | ratio | statements/op hand / service | the store's statements alone /s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    comparisons = []
    for label, title, yardstick, store_script in OPERATIONS:
        for level in levels:
            s, y = svc.get((label, level)), hw.get((yardstick, level))
            a = sent.get((store_script, level)) if store_script else None
            if not (s or y):
                continue
            s, y, a = s or {}, y or {}, a or {}
            pg_s = (s.get("cpu_us_per_op") or {}).get("postgres")
            pg_y = (y.get("cpu_us_per_op") or {}).get("postgres")
            row = {
                "operation": label,
                "level": level,
                "handwritten": y.get("rate"),
                "service": s.get("rate"),
                "ratio": ratio(s.get("rate"), y.get("rate")),
                "p50_us": [y.get("p50_us"), s.get("p50_us")],
                "p99_us": [y.get("p99_us"), s.get("p99_us")],
                "p99_ratio": ratio(s.get("p99_us"), y.get("p99_us")),
                "pg_cpu_us": [pg_y, pg_s],
                "pg_cpu_ratio": ratio(pg_s, pg_y),
                "statements_per_op": [y.get("statements_per_op"), s.get("statements_per_op")],
                "as_sent": a.get("rate"),
            }
            comparisons.append(row)
            lines.append(
                f"| {title} | {level} | {fmt(row['handwritten'])} | {fmt(row['service'])} | **{fmt(row['ratio'], 2)}x** "
                f"| {ms(row['p50_us'][0])} / {ms(row['p50_us'][1])} | {ms(row['p99_us'][0])} / {ms(row['p99_us'][1])} "
                f"| {fmt(row['p99_ratio'], 2)}x | {fmt(pg_y)} / {fmt(pg_s)} | {fmt(row['pg_cpu_ratio'], 2)}x "
                f"| {fmt(row['statements_per_op'][0], 2)} / {fmt(row['statements_per_op'][1], 2)} | {fmt(row['as_sent'])} |"
            )
    lines.append("")

    lines += [
        "## Every point",
        "",
        "CPU per operation in µs (PostgreSQL, the server, the client: pgbench or the load generator, and other processes), tuples PostgreSQL read by sequential scan (a plan that lost its index shows here), the mean WAL fsync, and the share of the machine other processes took (a disturbed point). Server memory is read from /proc at the end of each point; each service point has a fresh server.",
        "",
        "| side | operation | callers | per second | p50 ms | p99 ms | max ms | CPU µs/op: PostgreSQL | server | client | other | statements/op | seq. tuples read | fsync ms | other load % | server RSS / peak MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in sorted(points, key=lambda p: (p["scenario"], p["level"], p["source"], p.get("side", ""))):
        cpu = p.get("cpu_us_per_op") or {}
        label = p.get("label", "")
        side = p.get("side") or (f"floor {label[6:]}" if label.startswith("floor-") else f"service {label}")
        unit = " keys" if p["scenario"] in KEYS_PER_STATEMENT or p["scenario"] == "claim-batch" else ""
        rss, hwm = p.get("server_rss_kib"), p.get("server_hwm_kib")
        memory = "" if rss is None else f"{rss / 1024:.1f} / {hwm / 1024:.1f}"
        lines.append(
            f"| {side} | {p['scenario']} | {p['level']} | {fmt(p.get('rate'))}{unit} | {ms(p.get('p50_us'))} "
            f"| {ms(p.get('p99_us'))} | {ms(p.get('max_us'))} | {fmt(cpu.get('postgres'))} | {fmt(cpu.get('server'))} "
            f"| {fmt(cpu.get('client'))} | {fmt(cpu.get('other'))} | {fmt(p.get('statements_per_op'), 2)} "
            f"| {fmt(p.get('seq_tuples_read'))} | {fmt(fsync_ms(p), 2)} | {fmt(other_load(p))} | {memory} |"
        )
    lines.append("")

    floor_rows = floors(svc, hw, problems)
    if floor_rows:
        lines += [
            "## The floors (Claim+Complete; ratio = service / floor)",
            "",
            "The server's CPU per RPC (its CPU per cycle / 2) for the service, idempotency-floor bare (fixed answers, no database) and idempotency-floor with a database (one prepared statement per RPC through sqlx: the hand-written upsert, then the guarded UPDATE), under the same load; then PostgreSQL's CPU per cycle for the service, the database floor and pgbench running the same hand-written statements.",
            "",
            "| callers | server CPU µs/RPC: service | bare floor | database floor | service / bare | service / database floor | cycles/s: service | bare | database floor | PostgreSQL CPU µs/cycle: service | database floor | hand-written (pgbench) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in floor_rows:
            lines.append(
                f"| {r['level']} | {fmt(r['server_us_per_rpc']['service'])} | {fmt(r['server_us_per_rpc']['bare'])} "
                f"| {fmt(r['server_us_per_rpc']['database'])} | {times(r['ratio_bare'])} | {times(r['ratio_database'])} "
                f"| {fmt(r['rate']['service'])} | {fmt(r['rate']['bare'])} | {fmt(r['rate']['database'])} "
                f"| {fmt(r['pg_us_per_cycle']['service'])} | {fmt(r['pg_us_per_cycle']['database'])} | {fmt(r['pg_us_per_cycle']['handwritten'])} |"
            )
        lines.append("")

    info_levels = [lvl for lvl in levels if ("claim-complete-info", lvl) in svc]
    if info_levels:
        lines += [
            "## The per-call log line (Claim+Complete, a server at RUST_LOG=warn, then one at the default info)",
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

    # Issue 13's targets, from this run's numbers.
    def row(operation, level):
        return next((c for c in comparisons if c["operation"] == operation and c["level"] == level), None)

    targets = []

    def target(text, value, threshold, at_most=False, unit="x"):
        met = None if value is None else (value <= threshold if at_most else value >= threshold)
        targets.append((text, value, met, unit))

    for level, floor in ((1, 0.6), (8, 1.0), (32, 1.5), (64, 1.5)):
        c = row("claim-complete", level)
        if c:
            target(f"Claim+Complete at {level} callers >= {floor}x the hand-written pair", c["ratio"], floor)
    c = row("claim-complete", 256)
    if c:
        p99 = c["p99_us"][1]
        target("Claim+Complete at 256 callers served with p99 under 50 ms (ms)", p99 and p99 / 1000, 50, True, " ms")
    for level, floor in ((1, 1.0), (64, 2.0)):
        c = row("duplicate", level)
        if c:
            target(f"duplicates at {level} callers >= {floor}x the hand-written upsert (aim 3x at 64)", c["ratio"], floor)
    for level in (8, 32, 64):
        c = row("claim-complete", level)
        if c:
            target(f"Claim+Complete p99 at {level} callers <= 1.5x the hand-written pair's", c["p99_ratio"], 1.5, True)
    for level in (1, 8):
        c = row("claim-complete", level)
        if c:
            target(f"PostgreSQL CPU per Claim+Complete at {level} callers <= 1.0x the hand-written pair's",
                   c["pg_cpu_ratio"], 1.0, True)
    top = max(levels) if levels else None
    hwm = max((p.get("server_hwm_kib") or 0 for p in svc.values()), default=0) / 1024 or None
    target(f"server memory under 64 MiB up to {top} callers (peak VmHWM of any point, MiB)", hwm, 64, True, " MiB")
    lines += ["## Issue 13's targets, from this run", "", "| target | measured | met |", "|---|---:|---|"]
    for text, value, met, unit in targets:
        verdict = "n/a" if met is None else ("yes" if met else "**no**")
        lines.append(f"| {text} | {fmt(value, 2)}{unit if value is not None else ''} | {verdict} |")
    lines.append("")

    # Issue 34's targets, from this run's numbers (a separate list, so issue
    # 13's stays as it was).
    issue_13 = len(targets)
    by_level = {r["level"]: r for r in floor_rows}
    for level in (8, 64):
        r = by_level.get(level)
        if r:
            target(f"server CPU per RPC at {level} callers <= 2x the bare floor's", r["ratio_bare"], 2.0, True)
            target(f"server CPU per RPC at {level} callers <= 1.5x the database floor's", r["ratio_database"], 1.5, True)
    for level, most in ((1, 1.0), (8, 1.0), (64, 0.5)):
        c = row("claim-complete", level)
        if c:
            target(f"PostgreSQL CPU per Claim+Complete at {level} callers <= {most}x the hand-written pair's",
                   c["pg_cpu_ratio"], most, True)
    for level, least in ((1, 0.6), (8, 0.8), (64, 1.3)):
        c = row("claim-complete", level)
        if c:
            target(f"Claim+Complete at {level} callers >= {least}x the hand-written pair", c["ratio"], least)
    for c in comparisons:
        if c["operation"] == "duplicate":
            target(f"duplicates at {c['level']} callers >= 2x the hand-written upsert", c["ratio"], 2.0)
    for level in (8, 64):
        c = row("claim-complete", level)
        if c:
            target(f"Claim+Complete p99 at {level} callers <= 1.5x the hand-written pair's", c["p99_ratio"], 1.5, True)
    if len(targets) > issue_13:
        lines += ["## Issue 34's targets, from this run", "", "| target | measured | met |", "|---|---:|---|"]
        for text, value, met, unit in targets[issue_13:]:
            verdict = "n/a" if met is None else ("yes" if met else "**no**")
            lines.append(f"| {text} | {fmt(value, 2)}{unit if value is not None else ''} | {verdict} |")
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
                "floors": floor_rows,
                "targets": [{"target": t, "value": v, "met": m} for t, v, m, _ in targets],
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
