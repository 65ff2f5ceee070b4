#!/usr/bin/env python3
"""Turns the points of one bench/large-table.sh run into its tables.

    bench/large-table.py OUT_DIR

Reads OUT_DIR/run.json (the settings), OUT_DIR/points/*.json (one per point,
with the load generator's JSON beside it) and OUT_DIR/tables/*.json (the
table's sizes and statistics per step, the fills and the expiry schedules).
Writes OUT_DIR/summary.md (printed too) and OUT_DIR/summary.json, and exits 1
when a point failed, reported errors, or a number is missing.
"""

import json
import os
import statistics
import sys

# The issues' targets: issue 13 asked 0.8x at 50 million rows, issue 24 asks
# 0.9x with the markers in the table.
CLAIM_COMPLETE_RATIO = 0.9
EXPIRY_RATE_TARGET = 5000
# A reaper that keeps pace leaves no expired row waiting much longer than one
# of its intervals; one that falls behind leaves rows waiting most of the window.
PACE_INTERVALS = 1.5


def load(path, problems, what):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        problems.append(f"{what}: missing or unreadable {path}")
        return None


def read_point(out, step, scenario, problems):
    """The point's figures: rate, p50/p99 (µs) and the script's readings."""
    name = f"{scenario}-{step}"
    point = load(os.path.join(out, "points", f"{name}.json"), problems, name)
    if point is None:
        return None
    # Beside the point's JSON, so that a results folder can be moved.
    bench_json = os.path.join(out, "points", os.path.basename(point["bench_json"]))
    result = load(bench_json, problems, f"{name} (exit {point['exit_status']}, see {point['output']})")
    if result is None:
        return None
    if point["exit_status"] != 0:
        problems.append(f"{name}: the load generator exited {point['exit_status']}: {point['output']}")
    if result["errors_total"] > 0:
        problems.append(f"{name}: {result['errors_total']} errors {result['errors']} {result['error_samples']}")
    if result["ops"] == 0:
        problems.append(f"{name}: no operation completed")
    op = result["latency_us"].get(f"op:{scenario}", {})
    point["rate"] = result["keys_per_s"] if scenario == "claim-batch" else result["ops_per_s"]
    point["ops"] = result["ops"]
    point["p50_us"] = op.get("p50")
    point["p99_us"] = op.get("p99")
    if point["p50_us"] is None or point["p99_us"] is None:
        problems.append(f"{name}: no latency for op:{scenario}")
    point["result"] = result
    return point


def reaper_figures(point, run, problems, name):
    """The reaper's work in the window against the expiries the schedule put
    in it: records to turn into markers (or to delete, without markers) and
    markers past their horizon to delete."""
    window = point["window_end"] - point["window_start"]
    deleted = point["reaper_deleted_end"] - point["reaper_deleted_start"]
    remembered = point.get("reaper_remembered_end", 0) - point.get("reaper_remembered_start", 0)
    start, rows, rate = point["expiry_start"], point["expiry_rows"], point["expiry_rate"]
    marker_rows = point.get("marker_expiry_rows", 0)
    end = start + max(rows, marker_rows) / rate

    def in_window(n):
        overlap = max(0.0, min(start + n / rate, point["window_end"]) - max(start, point["window_start"]))
        return rate * overlap

    expired = in_window(rows)             # records
    horizons = in_window(marker_rows)     # markers
    # With markers, the records become markers and the markers are deleted;
    # without, the records are deleted.
    work, done = expired + horizons, deleted + remembered
    figures = {
        "window_s": round(window, 3),
        "deleted": deleted,
        "deleted_per_s": deleted / window,
        "remembered": remembered,
        "remembered_per_s": remembered / window,
        "expired_in_window": round(expired),
        "expired_per_s": expired / window,
        "horizons_in_window": round(horizons),
        "horizons_per_s": horizons / window,
        "done_per_s": done / window,
        "due_per_s": work / window,
        "ratio": (done / work) if work else None,
        "covered": start <= point["window_start"] and end >= point["window_end"],
        "backlog_start_rows": point["backlog_start_rows"],
        "backlog_end_rows": point["backlog_end_rows"],
        "backlog_end_oldest_s": point["backlog_end_oldest_s"],
        "backlog_end_records": point.get("backlog_end_records"),
        "backlog_end_markers": point.get("backlog_end_markers"),
        "backlog_end_records_oldest_s": point.get("backlog_end_records_oldest_s"),
        "backlog_end_markers_oldest_s": point.get("backlog_end_markers_oldest_s"),
    }
    if not expired:
        problems.append(f"{name}: no expiry fell in the window")
    return figures


def size_text(n):
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def ms(us):
    return "–" if us is None else f"{us / 1000:.2f}"


def ratio(a, b):
    return None if a is None or not b else a / b


def ratio_text(r):
    return "–" if r is None else f"{r:.2f}x"


def main():
    out = sys.argv[1]
    problems = []
    run = load(os.path.join(out, "run.json"), problems, "run settings")
    if run is None:
        print("\n".join(problems), file=sys.stderr)
        return 1
    steps = ["empty"] + [str(size) for size in run["sizes"]]
    rows = []
    for step in steps:
        entry = {"step": step}
        entry["before"] = load(os.path.join(out, "tables", f"{step}-before.json"), problems, f"{step} table before")
        entry["after"] = load(os.path.join(out, "tables", f"{step}-after.json"), problems, f"{step} table after")
        if step != "empty":
            entry["fill"] = load(os.path.join(out, "tables", f"fill-{step}.json"), problems, f"{step} fill")
        for scenario in ("claim-complete", "duplicate", "claim-batch"):
            entry[scenario] = read_point(out, step, scenario, problems)
        cc = entry["claim-complete"]
        if step != "empty" and cc is not None:
            if "expiry_start" not in cc:
                problems.append(f"claim-complete-{step}: no expiry schedule")
            else:
                entry["reaper"] = reaper_figures(cc, run, problems, f"claim-complete-{step}")
        rows.append(entry)

    base = rows[0]
    # The baseline's Claim+Complete again after the largest step.
    again = None
    if run.get("repeat_baseline"):
        again = read_point(out, "empty-after", "claim-complete", problems)
    # Alternating rounds on the largest table and the empty one.
    rounds = []
    for i in range(1, run.get("rounds", 0) + 1):
        large = read_point(out, f"round{i}-large", "claim-complete", problems)
        empty = read_point(out, f"round{i}-empty", "claim-complete", problems)
        rounds.append({
            "round": i,
            "order": "large, empty" if i % 2 else "empty, large",
            "large_rate": large and large["rate"], "empty_rate": empty and empty["rate"],
            "large_p99_us": large and large["p99_us"], "empty_p99_us": empty and empty["p99_us"],
            "ratio": ratio(large and large["rate"], empty and empty["rate"]),
            "p99_ratio": ratio(large and large["p99_us"], empty and empty["p99_us"]),
        })
    round_ratios = [r["ratio"] for r in rounds if r["ratio"] is not None]
    rounds_median = statistics.median(round_ratios) if round_ratios and len(round_ratios) == len(rounds) else None

    def rate(entry, scenario):
        point = entry.get(scenario)
        return None if point is None else point["rate"]

    markers_per_live = run.get("markers_per_live", 0)
    lines = [
        f"Table growth: Claim+Complete at {run['callers']} callers for {run['window_s']} s while "
        f"{run['expiry_rate']} records/s expire"
        + (f" and as many markers reach their horizon ({markers_per_live} markers per live record in each step's rows)"
           if markers_per_live else " (no markers)")
        + f" (reaper every {run['reaper_interval']}), duplicates at "
        f"{run['callers']} callers and ClaimBatch of {run['batch_size']} at {run['batch_callers']} callers "
        f"for {run['seconds']} s each; ratios against the empty table.",
        "",
        "| rows (records + markers) | table | indexes | claim+complete/s | vs empty | p50 ms | p99 ms | p99 vs empty "
        "| reaper: markers made/s, rows deleted/s | due/s (records, markers) | ratio | backlog at end (records, markers, oldest s) "
        "| duplicates/s | vs empty | ClaimBatch keys/s | vs empty | autovacuum runs |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for entry in rows:
        before, after = entry["before"], entry["after"]
        cc = entry.get("claim-complete")
        reaper = entry.get("reaper")
        cells = ["empty (100 rows)"]
        if entry["step"] != "empty":
            cells[0] = f"{int(entry['step']):,}"
            if before and "marker_rows" in before:
                cells[0] += f" ({before['fill_rows']:,} + {before['marker_rows']:,})"
        if before:
            cells += [size_text(before["table_bytes"]), size_text(sum(before["indexes"].values()))]
        else:
            cells += ["?", "?"]
        cc_rate = rate(entry, "claim-complete")
        cells += [
            "?" if cc_rate is None else f"{cc_rate:,.0f}",
            ratio_text(ratio(cc_rate, rate(base, "claim-complete"))),
            ms(cc and cc["p50_us"]),
            ms(cc and cc["p99_us"]),
            ratio_text(ratio(cc and cc["p99_us"], base.get("claim-complete") and base["claim-complete"]["p99_us"])),
        ]
        if reaper:
            records, markers = reaper["backlog_end_records"], reaper["backlog_end_markers"]
            cells += [
                f"{reaper['remembered_per_s']:,.0f}, {reaper['deleted_per_s']:,.0f}",
                f"{reaper['due_per_s']:,.0f} ({reaper['expired_per_s']:,.0f}, {reaper['horizons_per_s']:,.0f})"
                + ("" if reaper["covered"] else " (partial)"),
                ratio_text(reaper["ratio"]),
                (f"{reaper['backlog_end_rows']:,}" if records is None else f"{records:,}, {markers:,}")
                + f", {reaper['backlog_end_oldest_s']:.0f}",
            ]
        else:
            cells += ["–", "–", "–", "–"]
        for scenario in ("duplicate", "claim-batch"):
            r = rate(entry, scenario)
            cells += ["?" if r is None else f"{r:,.0f}", ratio_text(ratio(r, rate(base, scenario)))]
        if before and after:
            runs = after["autovacuum_count"] - before["autovacuum_count"]
            analyses = after["autoanalyze_count"] - before["autoanalyze_count"]
            text = f"{runs} (analyze {analyses})"
            if after["autovacuum_running"]:
                text += ", one running at the end"
            cells.append(text)
        else:
            cells.append("?")
        lines.append("| " + " | ".join(cells) + " |")
    if again is not None:
        cells = ["empty again, after the largest step", "", "", f"{again['rate']:,.0f}",
                 ratio_text(ratio(again["rate"], rate(base, "claim-complete"))), ms(again["p50_us"]),
                 ms(again["p99_us"]), ratio_text(ratio(again["p99_us"], base.get("claim-complete")
                                                       and base["claim-complete"]["p99_us"]))]
        cells += ["–"] * 9
        lines.append("| " + " | ".join(cells) + " |")

    if rounds:
        lines += [
            "",
            f"Rounds: Claim+Complete at {run['callers']} callers for {run['round_seconds']} s on the largest table "
            f"({int(rows[-1]['step']):,} rows, nothing expiring) and on the empty table, alternating.",
            "",
            "| round | order | largest table /s | empty table /s | ratio | p99 ms largest / empty | p99 ratio |",
            "|---:|---|---:|---:|---:|---:|---:|",
        ]
        for r in rounds:
            lines.append(
                f"| {r['round']} | {r['order']} | "
                + ("?" if r["large_rate"] is None else f"{r['large_rate']:,.0f}") + " | "
                + ("?" if r["empty_rate"] is None else f"{r['empty_rate']:,.0f}") + " | "
                + f"{ratio_text(r['ratio'])} | {ms(r['large_p99_us'])} / {ms(r['empty_p99_us'])} | "
                + f"{ratio_text(r['p99_ratio'])} |")
        p99_ratios = [r["p99_ratio"] for r in rounds if r["p99_ratio"] is not None]
        p99_median = statistics.median(p99_ratios) if p99_ratios else None
        lines.append(f"| median | | | | {ratio_text(rounds_median)} | | {ratio_text(p99_median)} |")

    # The table per step: every index, the tuples and autovacuum.
    lines += [
        "",
        "| rows | when | table | " + "indexes (each) | live tuples | dead tuples | autovacuum / autoanalyze runs | last autovacuum |",
        "|---:|---|---:|---|---:|---:|---|---|",
    ]
    for entry in rows:
        for when in ("before", "after"):
            t = entry[when]
            if not t:
                continue
            indexes = ", ".join(f"{name} {size_text(size)}" for name, size in sorted(t["indexes"].items()))
            lines.append(
                f"| {entry['step']} | {when} | {size_text(t['table_bytes'])} | {indexes} | {t['n_live_tup']:,} "
                f"| {t['n_dead_tup']:,} | {t['autovacuum_count']} / {t['autoanalyze_count']} "
                f"| {t['last_autovacuum'] or '–'} |"
            )

    # Where each point's pages came from: PostgreSQL's buffers, or outside
    # them (the OS cache or the disk). Older results folders lack the counts.
    lines += [
        "",
        "| rows | blocks read from outside shared_buffers per operation: claim+complete | duplicates | ClaimBatch (per key) "
        "| share of blocks found in shared_buffers: claim+complete | duplicates | ClaimBatch |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for entry in rows:
        reads, shares = [], []
        for scenario in ("claim-complete", "duplicate", "claim-batch"):
            point = entry.get(scenario)
            if not point or "blocks_read" not in point or not point.get("ops"):
                reads.append("n/a")
                shares.append("n/a")
                continue
            per = point["ops"] * (run["batch_size"] if scenario == "claim-batch" else 1)
            reads.append(f"{point['blocks_read'] / per:.2f}")
            total = point["blocks_read"] + point["blocks_hit"]
            shares.append("n/a" if total == 0 else f"{100 * point['blocks_hit'] / total:.1f}%")
        lines.append(f"| {entry['step']} | " + " | ".join(reads + shares) + " |")

    # The fills.
    fills = [entry["fill"] for entry in rows if entry.get("fill")]
    if fills:
        lines += ["", "| fill to | rows added | seconds | s per million rows added | clearing the previous step s "
                  "| insert s | indexes s | vacuum, checkpoint, restart s |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for fill in fills:
            lines.append(
                f"| {fill.get('rows', fill['fill_rows']):,} | {fill['rows_added']:,} | {fill['seconds']:.1f} "
                f"| {fill['seconds'] / fill['rows_added'] * 1e6:.1f} | {fill['clear_s']:.1f} | {fill['insert_s']:.1f} "
                f"| {fill['indexes_s']:.1f} | {fill['vacuum_checkpoint_restart_s']:.1f} |"
            )

    # The targets, at the largest size.
    largest = rows[-1]
    targets = []
    if len(rows) > 1:
        large_rate = rate(largest, "claim-complete")
        r = ratio(large_rate, rate(base, "claim-complete"))
        text = ratio_text(r)
        judged_r = r
        if again is not None:
            # Judged against the mean of the two empty-table runs around it.
            before_rate, after_rate = rate(base, "claim-complete"), again["rate"]
            judged_r = ratio(large_rate, None if before_rate is None else (before_rate + after_rate) / 2)
            text = (f"{ratio_text(judged_r)} against the mean of the empty table before and after "
                    f"({ratio_text(r)} against the one before, {ratio_text(ratio(large_rate, after_rate))} "
                    f"against the one after)")
        met = None if judged_r is None else judged_r >= CLAIM_COMPLETE_RATIO
        if rounds:
            text += f"; rounds: median {ratio_text(rounds_median)} ({', '.join(ratio_text(x) for x in round_ratios)})"
            met = None if met is None or rounds_median is None else met and rounds_median >= CLAIM_COMPLETE_RATIO
        targets.append({
            "target": f"claim+complete at {run['callers']} callers at {int(largest['step']):,} rows "
                      f"≥ {CLAIM_COMPLETE_RATIO}x the empty table's (issue: at 64 callers)",
            "value": None if judged_r is None else round(judged_r, 3),
            "value_against_before": None if r is None else round(r, 3),
            "rounds_median": None if rounds_median is None else round(rounds_median, 3),
            "met": met,
            "text": text,
        })
        reaper = largest.get("reaper")
        unjudged = []
        if run["expiry_rate"] < EXPIRY_RATE_TARGET:
            unjudged.append(f"the expiry rate is below {EXPIRY_RATE_TARGET:,}/s")
        if run["window_s"] < 2 * run["reaper_interval_s"]:
            unjudged.append("the window is shorter than 2 reaper intervals")
        if reaper is not None and not reaper["covered"]:
            unjudged.append("the expiries did not cover the window")
        judged = not unjudged
        limit = PACE_INTERVALS * run["reaper_interval_s"]
        if reaper is None:
            text, met = "?", None
        else:
            text = (f"oldest expired row {reaper['backlog_end_oldest_s']:.0f} s at the end "
                    f"(limit {limit:.0f} s); made {reaper['remembered_per_s']:,.0f} markers/s and deleted "
                    f"{reaper['deleted_per_s']:,.0f} rows/s against {reaper['expired_per_s']:,.0f} records/s "
                    f"expiring and {reaper['horizons_per_s']:,.0f} markers/s reaching their horizon")
            met = reaper["backlog_end_oldest_s"] <= limit if judged else None
            if not judged:
                text += "; not judged: " + " and ".join(unjudged)
        targets.append({
            "target": f"the reaper keeps pace with {EXPIRY_RATE_TARGET:,} expiries/s at {int(largest['step']):,} rows",
            "value": None if reaper is None else reaper["backlog_end_oldest_s"],
            "met": met,
            "text": text,
        })
        t = largest["before"]
        if t:
            indexes = sum(t["indexes"].values())
            count = int(largest["step"])
            kinds = (f" ({t['fill_rows']:,} records and {t['marker_rows']:,} markers)"
                     if "marker_rows" in t else "")
            targets.append({
                "target": f"the table's size at {count:,} rows{kinds}",
                "value": t["total_bytes"],
                "met": None,
                "text": (f"{size_text(t['total_bytes'])} in all: heap {size_text(t['table_bytes'])}, indexes "
                         f"{size_text(indexes)} ({', '.join(f'{k} {size_text(v)}' for k, v in sorted(t['indexes'].items()))}); "
                         f"{t['total_bytes'] / count:.0f} bytes a row"),
            })
        lines += ["", "| target | figure | met |", "|---|---|---|"]
        for t in targets:
            met_text = {True: "yes", False: "no", None: "measured" if "size" in t["target"] else "not judged"}[t["met"]]
            lines.append(f"| {t['target']} | {t['text']} | {met_text} |")

    notes = []
    for entry in rows:
        reaper = entry.get("reaper")
        if reaper and not reaper["covered"]:
            notes.append(f"{entry['step']}: the expiries did not cover the whole window (see tables/expiry-{entry['step']}.json)")
    notes.append("'rows' counts the fill (completed records and markers); the points of a step add their own rows "
                 "(fresh keys, 24 h retention), counted in the live tuples, and they are deleted before the next step's fill.")
    lines += [""] + [f"- {note}" for note in notes]

    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    summary = {
        "run": run,
        "steps": [{k: v for k, v in entry.items() if k not in ("claim-complete", "duplicate", "claim-batch")}
                  | {s: ({k: v for k, v in entry[s].items() if k != "result"} if entry.get(s) else None)
                     for s in ("claim-complete", "duplicate", "claim-batch")}
                  for entry in rows],
        "empty_after": None if again is None else {k: v for k, v in again.items() if k != "result"},
        "rounds": rounds,
        "rounds_median": rounds_median,
        "targets": targets,
        "problems": problems,
    }
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if problems:
        print("problems:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
