"""The rounds of bench/wait.sh, their accounting, and the table.

    python run.py --target 127.0.0.1:PORT --admin-url postgres://…/postgres --database DB \
        --server-pid PID [--postmaster-pid PID] --out DIR [--rounds N] [--smoke] …

A round: the holder (this process) Claims a fresh key, the duplicates (in
--processes worker processes, duplicates.py) start their Claims on it, the
holder Completes --work-ms after its Claim returned; each duplicate's final
answer is timed from the moment the holder's Complete returned. Rounds
alternate between waiting and polling (calls.py), each pair followed by a
floor round (the holder Completes at once, then each duplicate sends one
plain Claim, timed from when they were told to start); before them,
unrecorded warm-up rounds of both, and holder-only rounds (no duplicates),
which measure what the holder itself costs the database.

Around each round: pg_stat_statements of the bench database (read from the
postgres database, so the reading never counts itself), the server's CPU
(utime + stime from /proc/PID/stat), PostgreSQL's (the postmaster's children
alive, plus its reaped children) and the generator's own (every process's
user + system CPU, every thread).

Writes DIR/rounds.jsonl (every round), DIR/statements.md (each statement the
service ran, per mode), DIR/results.json and DIR/summary.md (the table).
Exits non-zero when a duplicate ends with anything but the holder's stored
response, a call fails, or a figure is missing; never on the targets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pathlib
import sys
import time
import uuid

import asyncpg
import grpc
from idempotency.v1 import idempotency_pb2 as pb
from idempotency.v1 import idempotency_pb2_grpc as pb_grpc

import calls

HERE = pathlib.Path(__file__).resolve().parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
MODES = ("wait", "poll")
MODE_NAMES = {
    "wait": "waiting (Claim with wait)",
    "poll": "polling (the helpers' backoff)",
    "replay": "floor: Claims of a completed key",
}

# Issue 23's targets.
TARGET_LAST_P99_MS = 20.0
TARGET_STATEMENTS = 2.0
TARGET_RATIO = 10.0
#: Set from --quiet-percent.
QUIET_PERCENT = 15.0


# --- Readings ----------------------------------------------------------------------


def process_ticks(pid: int) -> int:
    """utime + stime of a process (every thread), in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def machine_ticks() -> int:
    """Busy clock ticks of the whole machine, every CPU (compare.sh's)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return sum(int(fields[i]) for i in (1, 2, 3, 6, 7, 8))


def machine_busy_idle() -> tuple:
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return sum(int(fields[i]) for i in (1, 2, 3, 6, 7, 8)), int(fields[4]) + int(fields[5])


async def wait_quiet(percent: float, budget: float) -> float:
    """Waits, at most budget seconds, until the machine's CPU was under
    percent busy over 100 ms (this project's builds and tests share the
    machine; a round beside a compiler is noise). Between rounds the bench's
    own processes are idle, so what is busy is someone else. Returns the last
    busy share seen."""
    until = time.monotonic() + budget
    while True:
        b0, i0 = machine_busy_idle()
        await asyncio.sleep(0.1)
        b1, i1 = machine_busy_idle()
        total = (b1 - b0) + (i1 - i0)
        busy = 100.0 * (b1 - b0) / total if total > 0 else 0.0
        if busy < percent or time.monotonic() >= until:
            return busy


def postgres_ticks(postmaster: int) -> int:
    """All of PostgreSQL: the postmaster with its reaped children, and its
    children alive now (compare.sh's pg_ticks)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        pid, parent = int(entry), int(fields[1])
        if pid == postmaster:
            total += sum(int(x) for x in fields[11:15])
        elif parent == postmaster:
            total += int(fields[11]) + int(fields[12])
    return total


def category(query: str) -> str:
    """What a statement is for. health, feed and timers run on timers whatever
    the load (the health check's SELECT 1 each second; the purge feed's
    heartbeat, and acknowledgements, on the replay cache's channel; the
    reaper's DELETE and the records gauge's statements); listen is the feed's
    LISTEN/UNLISTEN. Everything else is counted as the calls' statements
    (the gauge's BEGIN and COMMIT too, once a minute: too rare to matter)."""
    text = " ".join(query.split())
    if text in ("SELECT 1", "SELECT $1"):
        return "health"
    if "reap_at" in text or "set_config(" in text or "FROM pg_class" in text or "count(*)" in text:
        return "timers"
    if text.startswith("SELECT pg_notify($1, $2)") and "idempotency_records" not in text:
        return "feed"
    if text.upper().startswith(("LISTEN", "UNLISTEN")):
        return "listen"
    return "calls"


class Statements:
    """pg_stat_statements of one database, read from another."""

    def __init__(self, connection: asyncpg.Connection, dbid: int):
        self.connection = connection
        self.dbid = dbid

    async def read(self) -> dict:
        rows = await self.connection.fetch(
            "SELECT queryid, sum(calls)::int8 AS calls, sum(rows)::int8 AS rows, min(query) AS query"
            " FROM pg_stat_statements WHERE dbid = $1 GROUP BY queryid",
            self.dbid,
        )
        return {row["queryid"]: (row["calls"], row["rows"], row["query"]) for row in rows}


def statements_delta(before: dict, after: dict) -> dict:
    delta = {}
    for queryid, (calls_, rows, query) in after.items():
        c0, r0, _ = before.get(queryid, (0, 0, query))
        if calls_ - c0 or rows - r0:
            delta[queryid] = (calls_ - c0, rows - r0, query)
    return delta


# --- The duplicates' processes --------------------------------------------------------


class Workers:
    def __init__(self, processes: list):
        self.processes = processes

    @classmethod
    async def start(cls, target: str, namespace: str, counts: list, connections: int) -> "Workers":
        processes = []
        for count in counts:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                str(HERE / "duplicates.py"),
                "--target", target,
                "--namespace", namespace,
                "--count", str(count),
                "--connections", str(connections),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                limit=64 * 1024 * 1024,
            )
            processes.append(process)
        workers = cls(processes)
        for process in processes:
            ready = await workers._read(process, 60)
            if not ready.get("ready"):
                raise RuntimeError(f"a duplicates process did not start: {ready}")
            process.bench_pid = ready["pid"]
        return workers

    async def _read(self, process, timeout: float) -> dict:
        line = await asyncio.wait_for(process.stdout.readline(), timeout)
        if not line:
            raise RuntimeError(f"a duplicates process exited (status {await process.wait()})")
        return json.loads(line)

    def send(self, command: dict) -> None:
        data = (json.dumps(command) + "\n").encode()
        for process in self.processes:
            process.stdin.write(data)

    async def reports(self, timeout: float) -> list:
        return await asyncio.gather(*(self._read(p, timeout) for p in self.processes))

    async def stop(self) -> None:
        for process in self.processes:
            if process.returncode is None:
                try:
                    process.stdin.write(b'{"quit": true}\n')
                    await process.stdin.drain()
                    process.stdin.close()
                except (BrokenPipeError, ConnectionResetError):
                    pass
        for process in self.processes:
            try:
                await asyncio.wait_for(process.wait(), 10)
            except asyncio.TimeoutError:
                process.kill()
                await process.wait()


# --- One round ----------------------------------------------------------------------


class Bench:
    def __init__(self, args, stub, workers: Workers, statements: Statements):
        self.args = args
        self.stub = stub
        self.workers = workers
        self.statements = statements
        self.failures: list = []

    async def round(self, number: int, mode: str) -> dict:
        args = self.args
        key = f"{mode}-{number}-{uuid.uuid4().hex[:12]}"
        response = os.urandom(args.response_bytes)
        stmts_before = await self.statements.read()
        server_before = process_ticks(args.server_pid)
        pg_before = postgres_ticks(args.postmaster_pid) if args.postmaster_pid else None
        holder_cpu_before = time.process_time()
        machine_before = machine_ticks()
        wall_before = time.monotonic()

        claim = await self.stub.Claim(
            pb.ClaimRequest(namespace=args.namespace, key=key), timeout=calls.CALL_TIMEOUT_SECONDS
        )
        claimed_at = time.monotonic()
        if claim.outcome != pb.OUTCOME_CLAIMED:
            raise RuntimeError(f"round {number}: the holder's Claim of a fresh key answered {calls.outcome_name(claim.outcome)}")
        command = {"round": number, "mode": mode, "key": key, "expected": response.hex()}
        if mode in MODES:
            self.workers.send(command)
            await asyncio.sleep(max(0.0, claimed_at + args.work_ms / 1000 - time.monotonic()))
        complete_sent = time.monotonic()
        await self.stub.Complete(
            pb.CompleteRequest(namespace=args.namespace, key=key, lease_token=claim.lease_token, response=response),
            timeout=calls.CALL_TIMEOUT_SECONDS,
        )
        completed = time.monotonic()
        if mode == "replay":
            # The floor: the duplicates' Claims of a key already completed,
            # timed from this moment (one answer each, from the replay cache
            # after the first read).
            command["mode"] = "poll"
            completed = time.monotonic()
            self.workers.send(command)
        reports = await self.workers.reports(calls.WAIT_TIMEOUT_SECONDS + 30) if mode != "holder" else []

        wall_after = time.monotonic()
        machine_after = machine_ticks()
        holder_cpu_after = time.process_time()
        server_after = process_ticks(args.server_pid)
        pg_after = postgres_ticks(args.postmaster_pid) if args.postmaster_pid else None
        stmts_after = await self.statements.read()

        answers = [answer for report in reports for answer in report["answers"]]
        for report in reports:
            if report["round"] != number:
                raise RuntimeError(f"round {number}: a duplicates process answered for round {report['round']}")
        for answer in answers:
            problem = answer["error"] or (
                "" if answer["outcome"] == "OUTCOME_COMPLETED" and answer["response_ok"]
                else f"ended with {answer['outcome']}" + ("" if answer["response_ok"] else " and another response")
            )
            if problem:
                self.failures.append(f"round {number} ({mode}): a duplicate {problem}")
        return {
            "round": number,
            "mode": mode,
            "key": key,
            "claim_sent": wall_before,
            "claimed_at": claimed_at,
            "complete_sent": complete_sent,
            "completed": completed,
            "wall": wall_after - wall_before,
            "server_ticks": server_after - server_before,
            "postgres_ticks": None if pg_before is None else pg_after - pg_before,
            "machine_ticks": machine_after - machine_before,
            "holder_cpu": holder_cpu_after - holder_cpu_before,
            "duplicates_cpu": sum(r["cpu_end"] - r["cpu_start"] for r in reports),
            "duplicates_cpu_per_process": [r["cpu_end"] - r["cpu_start"] for r in reports],
            # First to last final answer within each process: with answers
            # sent at once, what the process itself takes to take them in.
            "spread_per_process": [
                max(a["answered"] for a in r["answers"]) - min(a["answered"] for a in r["answers"]) for r in reports
            ],
            "statements": [
                {"queryid": q, "calls": c, "rows": r, "query": text}
                for q, (c, r, text) in statements_delta(stmts_before, stmts_after).items()
            ],
            "answers": answers,
        }


# --- Figures --------------------------------------------------------------------------


def percentile(values: list, p: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def others_share(r: dict) -> float:
    """The share of the machine other processes took during a round."""
    ours = r["server_ticks"] + (r["postgres_ticks"] or 0) + (r["duplicates_cpu"] + r["holder_cpu"]) * CLK_TCK
    return max(0.0, r["machine_ticks"] - ours) / CLK_TCK / (r["wall"] * os.cpu_count())


def statement_totals(rounds: list) -> dict:
    """calls and rows per category over the rounds."""
    totals: dict = {}
    for round_ in rounds:
        for s in round_["statements"]:
            c = totals.setdefault(category(s["query"]), [0, 0])
            c[0] += s["calls"]
            c[1] += s["rows"]
    return totals


def figures(rounds: list, holder: dict, duplicates: int) -> dict:
    n = len(rounds)
    dups = n * duplicates
    last = [max(a["answered"] for a in r["answers"]) - r["completed"] for r in rounds]
    every = [a["answered"] - r["completed"] for r in rounds for a in r["answers"]]
    totals = statement_totals(rounds)
    calls_, rows = totals.get("calls", [0, 0])
    wall = sum(r["wall"] for r in rounds)
    waited = [a["waited"] for r in rounds for a in r["answers"]]
    generator_cpu = sum(r["duplicates_cpu"] + r["holder_cpu"] for r in rounds)
    pg_ticks = [r["postgres_ticks"] for r in rounds]
    others = (
        sum(r["machine_ticks"] - r["server_ticks"] - (r["postgres_ticks"] or 0) for r in rounds) / CLK_TCK
        - generator_cpu
    )
    disturbed = sum(1 for r in rounds if others_share(r) > 2 * QUIET_PERCENT / 100)
    return {
        "rounds": n,
        "duplicates": dups,
        "last_ms": {"p50": percentile(last, 50) * 1e3, "p99": percentile(last, 99) * 1e3, "max": max(last) * 1e3},
        "every_ms": {"p50": percentile(every, 50) * 1e3, "p99": percentile(every, 99) * 1e3},
        "answered_before_complete_returned": sum(1 for x in every if x < 0),
        "claims_per_duplicate": sum(a["claims"] for r in rounds for a in r["answers"]) / dups,
        "statements_per_duplicate": (calls_ - holder["calls"] * n) / dups,
        "rows_per_duplicate": (rows - holder["rows"] * n) / dups,
        "statements_raw": {k: {"calls": v[0], "rows": v[1]} for k, v in sorted(totals.items())},
        "feed_statements_per_second": totals.get("feed", [0, 0])[0] / wall,
        "server_cpu_us_per_duplicate": sum(r["server_ticks"] for r in rounds) / CLK_TCK / dups * 1e6,
        "server_cpu_us_per_duplicate_net": (sum(r["server_ticks"] for r in rounds) / CLK_TCK - holder["server_s"] * n)
        / dups * 1e6,
        "postgres_cpu_us_per_duplicate": None if None in pg_ticks else sum(pg_ticks) / CLK_TCK / dups * 1e6,
        "generator_cpu_us_per_duplicate": generator_cpu / dups * 1e6,
        "generator_cpu_share": generator_cpu / wall,
        "others_cpu_share": others / (wall * os.cpu_count()),
        "disturbed_rounds": disturbed,
        "generator_burst_ms_max": max(max(r["duplicates_cpu_per_process"]) for r in rounds) * 1e3,
        "spread_ms": {
            "p50": percentile([max(r["spread_per_process"]) for r in rounds], 50) * 1e3,
            "p99": percentile([max(r["spread_per_process"]) for r in rounds], 99) * 1e3,
        },
        "waited_unset": sum(1 for w in waited if w is None),
        "first_answer_in_progress": sum(1 for r in rounds for a in r["answers"] if a["first_in_progress"]),
        "started_after_complete": sum(1 for r in rounds for a in r["answers"] if a["first_sent"] >= r["complete_sent"]),
        "round_seconds_mean": wall / n,
        "pauses_seen": sorted({tuple(round(p, 3) for p in a["pauses"]) for r in rounds for a in r["answers"]}),
    }


def holder_costs(rounds: list) -> dict:
    n = len(rounds)
    totals = statement_totals(rounds)
    calls_, rows = totals.get("calls", [0, 0])
    return {
        "rounds": n,
        "calls": calls_ / n,
        "rows": rows / n,
        "server_s": sum(r["server_ticks"] for r in rounds) / CLK_TCK / n,
    }


def fmt(x, digits=2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:,.{digits}f}"


def summary(result: dict, smoke: bool) -> str:
    w, p, h = result["wait"], result["poll"], result["holder"]
    out = []
    out.append(
        f"{result['duplicates']} duplicates per round, work {result['work_ms']} ms, "
        f"{w['rounds']} waiting and {p['rounds']} polling rounds alternating "
        f"(after {result['warmup']} warm-up rounds of each and {h['rounds']} holder-only rounds); "
        f"duplicates in {result['processes']} processes x {result['connections']} connection(s)."
    )
    out.append("")
    out.append(
        "| mode | last answer after Complete p50 / p99 / max ms | every answer p50 / p99 ms "
        "| Claims per duplicate | statements per duplicate | rows per duplicate "
        "| server CPU µs per duplicate | PostgreSQL CPU µs per duplicate | generator CPU µs per duplicate |"
    )
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")

    def row(mode, f):
        out.append(
            f"| {MODE_NAMES[mode]} | {fmt(f['last_ms']['p50'], 1)} / {fmt(f['last_ms']['p99'], 1)} / {fmt(f['last_ms']['max'], 1)} "
            f"| {fmt(f['every_ms']['p50'], 1)} / {fmt(f['every_ms']['p99'], 1)} "
            f"| {fmt(f['claims_per_duplicate'])} | {fmt(f['statements_per_duplicate'], 3)} | {fmt(f['rows_per_duplicate'], 3)} "
            f"| {fmt(f['server_cpu_us_per_duplicate'], 0)} | {fmt(f['postgres_cpu_us_per_duplicate'], 0)} "
            f"| {fmt(f['generator_cpu_us_per_duplicate'], 0)} |"
        )

    row("wait", w)
    row("poll", p)

    def ratio(a, b):
        return None if a is None or b is None or b <= 0 else a / b

    r_stmt = ratio(p["statements_per_duplicate"], w["statements_per_duplicate"])
    r_rows = ratio(p["rows_per_duplicate"], w["rows_per_duplicate"])
    r_claims = ratio(p["claims_per_duplicate"], w["claims_per_duplicate"])
    r_cpu = ratio(p["server_cpu_us_per_duplicate"], w["server_cpu_us_per_duplicate"])
    out.append(
        f"| polling / waiting | {fmt(ratio(p['last_ms']['p50'], w['last_ms']['p50']), 1)}x (p50) | "
        f"| {fmt(r_claims, 1)}x | {fmt(r_stmt, 1)}x | {fmt(r_rows, 1)}x | {fmt(r_cpu, 1)}x | "
        f"{fmt(ratio(p['postgres_cpu_us_per_duplicate'], w['postgres_cpu_us_per_duplicate']), 1)}x | |"
    )
    row("replay", result["replay"])
    out.append("")
    out.append(
        "The floor row: in rounds of its own between the others, the holder Completes at once and then the "
        "duplicates send one plain Claim each; its times run from when they were told to start. It is what "
        "64 answers cost this generator, server and machine with nothing to wait for."
    )
    out.append(
        f"Holder-only rounds: {fmt(h['calls'])} statements ({fmt(h['rows'])} rows) and "
        f"{fmt(h['server_s'] * 1e6, 0)} µs of server CPU per round; subtracted from the statements and rows "
        f"above (the server CPU column is the whole round's; without the holder: waiting "
        f"{fmt(w['server_cpu_us_per_duplicate_net'], 0)}, polling {fmt(p['server_cpu_us_per_duplicate_net'], 0)} µs)."
    )
    for mode, f in (("wait", w), ("poll", p), ("replay", result["replay"])):
        raw = ", ".join(f"{k} {v['calls']} ({v['rows']} rows)" for k, v in f["statements_raw"].items())
        timing = (
            ""
            if mode == "replay"
            else f"answers before the Complete returned: {f['answered_before_complete_returned']}; "
            f"first Claim sent after the Complete: {f['started_after_complete']}; "
        )
        out.append(
            f"{MODE_NAMES[mode]}: statements in its rounds by kind: {raw}; feed {fmt(f['feed_statements_per_second'], 1)}/s; "
            f"mean round {fmt(f['round_seconds_mean'] * 1e3, 0)} ms; {timing}"
            f"generator: {fmt(f['generator_cpu_share'] * 100, 1)}% of one CPU over its rounds, the busiest process "
            f"{fmt(f['generator_burst_ms_max'], 1)} ms of CPU in its busiest round; first to last answer within "
            f"a process p50 / p99 {fmt(f['spread_ms']['p50'], 1)} / {fmt(f['spread_ms']['p99'], 1)} ms; "
            f"other processes (not the server, PostgreSQL or the generator): {fmt(f['others_cpu_share'] * 100, 0)}% of the machine, "
            f"over {fmt(2 * QUIET_PERCENT, 0)}% in {f['disturbed_rounds']} rounds."
        )
    complete_ms = {
        mode: [(r["completed"] - r["complete_sent"]) * 1e3 for r in result["rounds_" + mode]] for mode in MODES
    }
    out.append(
        "The holder's Complete took p50 / p99 "
        + "; ".join(
            f"{fmt(percentile(complete_ms[mode], 50), 1)} / {fmt(percentile(complete_ms[mode], 99), 1)} ms "
            f"in the {mode}ing rounds"
            for mode in MODES
        )
        + "."
    )
    pauses = p["pauses_seen"]
    out.append(f"Polling pauses seen (s): {', '.join(str(list(x)) for x in pauses[:6])}{' …' if len(pauses) > 6 else ''}")
    out.append("")

    if w["waited_unset"]:
        out.append(
            f"NOTE: the server ignored ClaimRequest.wait: `waited` was unset on {w['waited_unset']} of "
            f"{w['duplicates']} waiting duplicates' answers (a server that predates the field); those "
            "duplicates polled as the helpers would, so the waiting row measures polling."
        )
    elif w["first_answer_in_progress"]:
        out.append(
            f"NOTE: {w['first_answer_in_progress']} waiting duplicates were answered OUTCOME_IN_PROGRESS "
            "with `waited` set (the waiter limit, or the wait ran out) and Claimed again."
        )

    checks = [
        ("last answer within 20 ms of the Complete (p99)", w["last_ms"]["p99"], TARGET_LAST_P99_MS, "ms", lambda v, t: v <= t),
        ("at most 2 statements per waiting duplicate", w["statements_per_duplicate"], TARGET_STATEMENTS, "", lambda v, t: v <= t),
        ("at least 10x fewer statements than polling", r_stmt, TARGET_RATIO, "x", lambda v, t: v is not None and v >= t),
    ]
    out.append("Targets (issue 23)" + (" - smoke run: not judged" if smoke else "") + ":")
    for name, value, target, unit, ok in checks:
        if smoke:
            verdict = "(not judged)"
        elif value is None:
            verdict = "n/a (waiting ran no statements)" if name.startswith("at least") else "n/a"
        else:
            verdict = "met" if ok(value, target) else "MISSED"
        out.append(f"- {name}: {fmt(value)}{unit} (target {fmt(target, 0)}{unit}) {verdict}")
    return "\n".join(out) + "\n"


def statements_report(result_rounds: dict, duplicates: int) -> str:
    lines = ["# Statements per mode (calls and rows per round; per duplicate)", ""]
    for mode, rounds in result_rounds.items():
        n = len(rounds)
        per_query: dict = {}
        for r in rounds:
            for s in r["statements"]:
                e = per_query.setdefault(s["queryid"], [0, 0, s["query"]])
                e[0] += s["calls"]
                e[1] += s["rows"]
        lines.append(f"## {mode} ({n} rounds)")
        lines.append("")
        lines.append("| kind | calls/round | rows/round | calls/duplicate | statement |")
        lines.append("|---|---:|---:|---:|---|")
        for calls_, rows, query in sorted(per_query.values(), key=lambda e: -e[0]):
            text = " ".join(query.split())[:140].replace("|", "\\|")
            per_dup = calls_ / (n * duplicates) if duplicates and mode != "holder" else 0
            lines.append(f"| {category(query)} | {calls_ / n:.2f} | {rows / n:.2f} | {per_dup:.3f} | `{text}` |")
        lines.append("")
    return "\n".join(lines)


# --- Main -----------------------------------------------------------------------------


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True, help="host:port of the server")
    parser.add_argument("--admin-url", required=True, help="the cluster's postgres database")
    parser.add_argument("--database", required=True, help="the server's database")
    parser.add_argument("--server-pid", type=int, required=True)
    parser.add_argument("--postmaster-pid", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--namespace", default="bench-wait")
    parser.add_argument("--duplicates", type=int, default=64)
    parser.add_argument("--work-ms", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=200, help="measured rounds of each mode")
    parser.add_argument("--warmup", type=int, default=5, help="unrecorded rounds of each mode")
    parser.add_argument("--holder-rounds", type=int, default=20)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--connections", type=int, default=1, help="per process")
    parser.add_argument("--response-bytes", type=int, default=200)
    parser.add_argument("--quiet-percent", type=float, default=15.0)
    parser.add_argument("--quiet-wait", type=float, default=0.0, help="seconds per round pair, at most")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    global QUIET_PERCENT
    QUIET_PERCENT = args.quiet_percent
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    admin = await asyncpg.connect(args.admin_url)
    dbid = await admin.fetchval("SELECT oid FROM pg_database WHERE datname = $1", args.database)
    if dbid is None:
        raise SystemExit(f"no database {args.database}")
    statements = Statements(admin, dbid)
    await statements.read()  # fails here when pg_stat_statements is not loaded

    per = [args.duplicates // args.processes + (1 if i < args.duplicates % args.processes else 0) for i in range(args.processes)]
    per = [c for c in per if c > 0]
    workers = await Workers.start(args.target, args.namespace, per, args.connections)
    channel = grpc.aio.insecure_channel(args.target, options=[("grpc.use_local_subchannel_pool", 1)])
    await asyncio.wait_for(channel.channel_ready(), timeout=30)
    bench = Bench(args, pb_grpc.IdempotencyServiceStub(channel), workers, statements)

    rounds_file = (out / "rounds.jsonl").open("w")
    measured = {"wait": [], "poll": [], "replay": [], "holder": []}
    number = 0
    started = time.monotonic()
    try:
        for _ in range(args.warmup):
            for mode in MODES:
                number += 1
                await bench.round(number, mode)
        for _ in range(args.holder_rounds):
            number += 1
            measured["holder"].append(await bench.round(number, "holder"))
        for i in range(args.rounds):
            if args.quiet_wait > 0:
                await wait_quiet(args.quiet_percent, args.quiet_wait)
            for mode in MODES + ("replay",):
                number += 1
                r = await bench.round(number, mode)
                measured[mode].append(r)
                rounds_file.write(json.dumps(r) + "\n")
            if not args.smoke and (i + 1) % 50 == 0:
                print(f"[wait] {i + 1} of {args.rounds} round pairs, {time.monotonic() - started:.0f} s", file=sys.stderr)
    finally:
        rounds_file.close()
        await workers.stop()
        await channel.close()
        await admin.close()

    if bench.failures:
        for failure in bench.failures[:20]:
            print(f"[wait] error: {failure}", file=sys.stderr)
        print(f"[wait] error: {len(bench.failures)} duplicates ended wrongly", file=sys.stderr)
        return 1
    holder = holder_costs(measured["holder"])
    result = {
        "duplicates": args.duplicates,
        "work_ms": args.work_ms,
        "warmup": args.warmup,
        "processes": len(per),
        "connections": args.connections,
        "holder": holder,
        "wait": figures(measured["wait"], holder, args.duplicates),
        "poll": figures(measured["poll"], holder, args.duplicates),
        "replay": figures(measured["replay"], holder, args.duplicates),
        "seconds": time.monotonic() - started,
    }
    text = summary(dict(result, rounds_wait=measured["wait"], rounds_poll=measured["poll"]), args.smoke)
    (out / "results.json").write_text(json.dumps(result, indent=2, default=list) + "\n")
    (out / "summary.md").write_text(text)
    (out / "statements.md").write_text(statements_report(measured, args.duplicates))
    print(text)
    missing = [
        name
        for mode in MODES
        for name, value in (
            ("last", result[mode]["last_ms"]["p99"]),
            ("statements", result[mode]["statements_per_duplicate"]),
            ("server CPU", result[mode]["server_cpu_us_per_duplicate"]),
        )
        if value is None or (isinstance(value, float) and math.isnan(value))
    ]
    if missing:
        print(f"[wait] error: missing figures: {missing}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
