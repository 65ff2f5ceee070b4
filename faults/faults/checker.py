"""The checker: reads a History (the calls, attempts, effects and the final
Claim of every key) and counts what must never happen. Each count must be 0:

effects_twice      a key whose ledger accepted two effects with one fencing
                   token, or an effect that started after a Complete of the key
                   was answered OK (the work ran again after it was done)
lost_completions   a key with a Complete answered OK, yet a later Claim (one
                   that started after that answer), the final one included,
                   did not answer COMPLETED
wrong_replays      a Claim answered COMPLETED with a response that is not the
                   one completed (the OK'd Complete's, or when no Complete was
                   answered OK, one of those attempted); or, for a key the
                   history records a removal of (History.removals: a Purge
                   that answered OK, an out-of-band SQL DELETE that committed),
                   a Claim that started once the removal was in force (the
                   Purge's answer; the DELETE's commit + OUT_OF_BAND_BOUND)
                   and replayed a result whose every Complete had ended before
                   the removal began: a result the key no longer has
fencing            two leases of one key with the same fencing token, or a
                   lease granted after another one's Claim had returned with a
                   fencing token not higher
stuck_keys         keys neither COMPLETED nor claimable at the final Claim
                   (after every lease and a reaper interval ran out)
no_answer          calls that had not returned NO_ANSWER_GRACE seconds after
                   their deadline

Keys with removals that are not workload keys (the purge_replay scenario's
rounds) are checked for wrong_replays, and for lost_completions between a
Complete answered OK and the key's next removal; the other counts assume
their keys are never removed. `python -m faults.checker` runs the checker's
self-test on synthetic histories (a stale replay is counted, a fresh one
not); `python -m faults.checker out/purge_replay.history.jsonl
--delete-bound 0` re-checks a recorded history with the DELETEs in force at
their commit (the negative control on real replays).

Also: calls, attempts, errors by code (logical calls and attempts), failed
attempts after a mark, latency, and the time to recover after "healed".
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .workload import NO_ANSWER_GRACE, History

#: The six counts, in the order reported.
COUNTS = ("effects_twice", "lost_completions", "wrong_replays", "fencing", "stuck_keys", "no_answer")

#: Codes that are a failure to answer (as opposed to a verdict such as
#: FAILED_PRECONDITION for a lease that ran out).
FAILURE_CODES = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "INTERNAL", "UNKNOWN", "CANCELLED",
                 "NO_ANSWER", "ABORTED", "DATA_LOSS"}


#: The documented bound for a change made in SQL (README, "The replay cache"):
#: every replica has forgotten the key at the latest this long after the
#: change committed. A Purge is in force from its answer.
OUT_OF_BAND_BOUND = 3.0


def stale_replays(key: str, claims: List[Dict[str, Any]], completes: List[Dict[str, Any]],
                  removals: List[Dict[str, Any]]) -> List[str]:
    """The Claims of `key` that replayed a result the key no longer had: each
    started at or after a removal's `effective` instant, and answered COMPLETED
    with a response whose every Complete (whatever its answer) had ended before
    that removal's `start`. A Complete that overlaps the removal is not
    ordered with it, and does not count."""
    found = []
    for c in claims:
        if c.get("outcome") != "COMPLETED":
            continue
        done = [k for k in completes if k.get("response") == c.get("response")]
        if not done:
            continue  # not a completed response at all: the other rule counts it
        for r in removals:
            if r["effective"] <= c["start"] and all(k["end"] < r["start"] for k in done):
                found.append(f"{key}: replay {c.get('response')!r} at {c['start']:.3f} "
                             f"({c.get('target', '?')}), completed at {max(k['end'] for k in done):.3f}, "
                             f"removed by {r['op']} {r['start']:.3f}-{r['end']:.3f}, "
                             f"in force from {r['effective']:.3f}")
                break
    return found


def percentile(values: List[float], p: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, int(round(p / 100 * (len(ordered) - 1)))))
    return ordered[index]


@dataclass
class Report:
    scenario: str
    counts: Dict[str, int]
    calls: int
    attempts: int
    keys: int
    errors: Dict[str, int]
    attempt_errors: Dict[str, int]
    failed_calls: int
    latency: Dict[str, Optional[float]]
    marks: Dict[str, List[float]]
    recovery_s: Optional[float]
    counters: Dict[str, int]
    load_s: float
    examples: Dict[str, List[str]] = field(default_factory=dict)
    #: what the scenario added (env.note(...)): RSS, time to SERVING, ...
    notes: Dict[str, Any] = field(default_factory=dict)
    #: the scenario's expectations that failed
    failures: List[str] = field(default_factory=list)
    command: str = ""
    history: Optional[History] = None

    @property
    def ok(self) -> bool:
        return not self.failures and all(v == 0 for v in self.counts.values())

    def mark(self, name: str) -> Optional[float]:
        """The last instant recorded under `name` (seconds since start)."""
        values = self.marks.get(name)
        return values[-1] if values else None

    def failed_attempts_after(self, at: Optional[float], codes=None) -> int:
        """Attempts that failed (a FAILURE_CODES code, or one of `codes`) and
        started at or after `at` (seconds since start), final check excluded."""
        if at is None or self.history is None:
            return 0
        codes = set(codes or FAILURE_CODES)
        return sum(1 for a in self.history.attempts if a["start"] >= at and a["code"] in codes)

    def failed_attempts_after_by_code(self, at: Optional[float]) -> Dict[str, int]:
        if at is None or self.history is None:
            return {}
        return dict(collections.Counter(
            a["code"] for a in self.history.attempts if a["start"] >= at and a["code"] in FAILURE_CODES))

    def summary(self) -> Dict[str, Any]:
        return {
            "scenario": self.scenario, "ok": self.ok, "counts": self.counts, "calls": self.calls,
            "attempts": self.attempts, "keys": self.keys, "errors": self.errors,
            "attempt_errors": self.attempt_errors, "failed_calls": self.failed_calls, "latency": self.latency,
            "marks": self.marks, "recovery_s": self.recovery_s, "counters": self.counters,
            "load_s": self.load_s, "notes": self.notes, "failures": self.failures, "examples": self.examples,
            "command": self.command,
        }


def check(history: History, scenario: str = "") -> Report:
    calls = history.calls
    by_key: Dict[str, List[Dict[str, Any]]] = collections.defaultdict(list)
    for call in calls:
        by_key[call["key"]].append(call)
    effects_by_key: Dict[str, List[Dict[str, Any]]] = collections.defaultdict(list)
    for effect in history.effects:
        effects_by_key[effect["key"]].append(effect)

    removals_by_key: Dict[str, List[Dict[str, Any]]] = collections.defaultdict(list)
    for removal in getattr(history, "removals", []):
        removals_by_key[removal["key"]].append(removal)

    counts = dict.fromkeys(COUNTS, 0)
    examples: Dict[str, List[str]] = collections.defaultdict(list)

    def count(name: str, example: str) -> None:
        counts[name] += 1
        if len(examples[name]) < 5:
            examples[name].append(example)

    for key in history.keys:
        key_calls = by_key.get(key, [])
        completes = [c for c in key_calls if c["op"] == "Complete"]
        ok_completes = [c for c in completes if c["code"] == "OK"]
        first_ok_end = min((c["end"] for c in ok_completes), default=None)
        claims = [c for c in key_calls if c["op"] == "Claim" and c["code"] == "OK"]

        # effects accepted twice
        accepted = [e for e in effects_by_key.get(key, []) if e.get("accepted")]
        fences = collections.Counter(e["fence"] for e in accepted)
        if any(n > 1 for n in fences.values()):
            count("effects_twice", f"{key}: fencing tokens accepted twice {dict(fences)}")
        elif first_ok_end is not None and any(
                first_ok_end < e["start"] < first_ok_end + (history.retention or float("inf")) - 1.0
                for e in accepted):
            count("effects_twice", f"{key}: an effect after the Complete answered OK at {first_ok_end:.3f}")

        # completions lost (within the retention, less a second of margin)
        if first_ok_end is not None:
            until = first_ok_end + history.retention - 1.0 if history.retention else float("inf")
            later = [c for c in claims if first_ok_end < c["start"] < until and c.get("outcome") != "COMPLETED"]
            final = history.final.get(key)
            if final is not None and final.get("start", 0.0) >= until:
                final = None  # the record may be gone: retention passed
            if later:
                count("lost_completions", f"{key}: completed at {first_ok_end:.3f}, then Claim at "
                                          f"{later[0]['start']:.3f} answered {later[0].get('outcome')}")
            elif final is not None and final.get("outcome") not in (None, "COMPLETED"):
                count("lost_completions", f"{key}: completed, final Claim answered {final.get('outcome')}")

        # wrong replays
        if key in removals_by_key:
            wrong_replays_removed(key, claims, completes, removals_by_key[key], count)
        else:
            if ok_completes:
                allowed = {c["response"] for c in ok_completes}
            else:
                allowed = {c["response"] for c in completes}
            for c in claims:
                if c.get("outcome") == "COMPLETED" and c.get("response") not in allowed:
                    count("wrong_replays", f"{key}: replay {c.get('response')!r} at {c['start']:.3f}, "
                                           f"completed {sorted(allowed)!r}")
            if len(allowed) > 1 and ok_completes:
                count("wrong_replays", f"{key}: two different responses completed OK {sorted(allowed)!r}")

        # fencing tokens unique and increasing
        leases: Dict[str, Dict[str, Any]] = {}
        for c in claims:
            if c.get("outcome") == "CLAIMED":
                first = leases.get(c["lease"])
                if first is None:
                    leases[c["lease"]] = {"fence": c["fence"], "start": c["start"], "end": c["end"]}
                elif first["fence"] != c["fence"]:
                    count("fencing", f"{key}: one lease, two fencing tokens {first['fence']} {c['fence']}")
        # With a short retention the record may expire and the count start
        # again at 1: only leases closer in time than the retention compare.
        window = history.retention - 1.0 if history.retention else float("inf")
        ordered = sorted(leases.values(), key=lambda l: l["start"])
        for i, a in enumerate(ordered):
            for b in ordered[i + 1:]:
                if a["fence"] == b["fence"] and b["start"] - a["start"] < window:
                    count("fencing", f"{key}: fencing token {a['fence']} granted to two leases "
                                     f"(at {a['start']:.3f} and {b['start']:.3f})")
        ordered = sorted(leases.values(), key=lambda l: l["end"])
        for a in ordered:
            for b in ordered:
                if a["end"] < b["start"] < a["end"] + window and a["fence"] >= b["fence"]:
                    count("fencing", f"{key}: lease granted at {b['start']:.3f} has fencing token "
                                     f"{b['fence']} <= {a['fence']} returned at {a['end']:.3f}")

        # stuck keys
        final = history.final.get(key)
        if history.final_checked and (final is None or final.get("outcome") not in ("COMPLETED", "CLAIMED")):
            count("stuck_keys", f"{key}: final Claim {final}")

    # Keys of their own with removals (not workload keys): wrong replays, and
    # completions lost between a Complete answered OK and the next removal.
    workload_keys = set(history.keys)
    for key, removals in removals_by_key.items():
        if key in workload_keys:
            continue
        key_calls = by_key.get(key, [])
        completes = [c for c in key_calls if c["op"] == "Complete"]
        claims = [c for c in key_calls if c["op"] == "Claim" and c["code"] == "OK"]
        wrong_replays_removed(key, claims, completes, removals, count)
        for k in completes:
            if k["code"] != "OK":
                continue
            until = min((r["start"] for r in removals if r["end"] > k["end"]), default=float("inf"))
            for c in claims:
                if k["end"] < c["start"] and c["end"] < until and c.get("outcome") != "COMPLETED":
                    count("lost_completions", f"{key}: completed at {k['end']:.3f}, then Claim at "
                                              f"{c['start']:.3f} answered {c.get('outcome')} "
                                              f"(next removal at {until:.3f})")
                    break

    for c in calls:
        if c["code"] == "NO_ANSWER" or c["end"] - c["start"] > c["deadline"] + NO_ANSWER_GRACE:
            count("no_answer", f"{c['op']} {c['key']} from {c['start']:.3f} to {c['end']:.3f}")

    load_calls = [c for c in calls if not c.get("final")]
    errors = collections.Counter(c["code"] for c in load_calls if c["code"] != "OK")
    attempt_errors = collections.Counter(a["code"] for a in history.attempts if a["code"] != "OK")
    latencies = [c["end"] - c["start"] for c in load_calls]
    marks: Dict[str, List[float]] = collections.defaultdict(list)
    for name, at in history.marks:
        marks[name].append(round(at, 3))

    report = Report(
        scenario=scenario,
        counts=counts,
        calls=len(load_calls),
        attempts=sum(1 for a in history.attempts),
        keys=len(history.keys),
        errors=dict(errors),
        attempt_errors=dict(attempt_errors),
        failed_calls=sum(n for code, n in errors.items() if code in FAILURE_CODES),
        latency={"p50": percentile(latencies, 50), "p99": percentile(latencies, 99),
                 "max": max(latencies) if latencies else None},
        marks=dict(marks),
        recovery_s=None,
        counters=dict(history.counters),
        load_s=round(history.load_end or 0.0, 3),
        examples=dict(examples),
        history=history,
    )
    report.recovery_s = recovery(history, marks)
    return report


def wrong_replays_removed(key, claims, completes, removals, count) -> None:
    """wrong_replays of a key with removals: a replay of a response no
    Complete of the key carried, or of one the key no longer had."""
    attempted = {c.get("response") for c in completes}
    for c in claims:
        if c.get("outcome") == "COMPLETED" and c.get("response") not in attempted:
            count("wrong_replays", f"{key}: replay {c.get('response')!r} at {c['start']:.3f}, "
                                   f"never completed")
    for example in stale_replays(key, claims, completes, removals):
        count("wrong_replays", example)


def recovery(history: History, marks: Dict[str, List[float]]) -> Optional[float]:
    """Time to recover: for each "healed" mark, how long after it attempts
    still failed (the end of the last failed attempt that ended after it and
    before the next "fault" mark), the longest of these; None without a "healed" mark."""
    heals = sorted(marks.get("healed", []))
    if not heals:
        return None
    faults = sorted(marks.get("fault", []))
    worst = 0.0
    for heal in heals:
        next_fault = min((f for f in faults if f > heal), default=float("inf"))
        failed = [a["end"] for a in history.attempts
                  if a["code"] in FAILURE_CODES and heal <= a["end"] < next_fault]
        if failed:
            worst = max(worst, max(failed) - heal)
    return round(worst, 3)


def self_test() -> None:
    """The removal rule on synthetic histories: a replay of a purged result
    after the Purge answered is counted, one of the result completed after
    it is not; after a DELETE, a replay within OUT_OF_BAND_BOUND is not
    counted and one after it is. Raises AssertionError on a miss."""

    def history(*rows, removals=()):
        h = History()
        h.calls = [dict(id=i, who="t", deadline=10.0, code="OK", **row) for i, row in enumerate(rows)]
        h.removals = list(removals)
        return h

    old, new = b"k|1|a", b"k|2|b"
    base = [dict(op="Claim", key="k", start=0.0, end=0.01, outcome="CLAIMED", fence=1, lease="a"),
            dict(op="Complete", key="k", start=0.02, end=0.03, response=old),
            dict(op="Claim", key="k", start=0.04, end=0.05, outcome="COMPLETED", response=old)]
    purge = dict(op="Purge", key="k", start=0.10, end=0.12, effective=0.12)
    delete = dict(op="DELETE", key="k", start=0.10, end=0.12, effective=0.12 + OUT_OF_BAND_BOUND)
    stale = dict(op="Claim", key="k", start=0.13, end=0.14, outcome="COMPLETED", response=old)
    cases = [
        ("no removal", history(*base), 0),
        ("replay of the purged result after the Purge answered", history(*base, stale, removals=[purge]), 1),
        ("replay of the purged result during the Purge", history(*base, dict(stale, start=0.11), removals=[purge]), 0),
        ("claim after the Purge answered CLAIMED, its result replayed", history(*base, dict(
            op="Claim", key="k", start=0.13, end=0.14, outcome="CLAIMED", fence=2, lease="b"), dict(
            op="Complete", key="k", start=0.15, end=0.16, response=new), dict(
            op="Claim", key="k", start=0.17, end=0.18, outcome="COMPLETED", response=new)), 0),
        ("replay within the bound after a DELETE", history(*base, stale, removals=[delete]), 0),
        ("replay after the bound after a DELETE", history(*base, dict(stale, start=3.2), removals=[delete]), 1),
        ("a response never completed", history(*base, dict(stale, response=b"x"), removals=[purge]), 1),
    ]
    for name, h, wrong in cases:
        report = check(h, "self-test")
        assert report.counts["wrong_replays"] == wrong, (name, report.counts, report.examples)
        others = {k: v for k, v in report.counts.items() if k != "wrong_replays" and v}
        assert not others, (name, others, report.examples)
    # A Claim between a Complete and the next removal must replay it.
    report = check(history(*base, dict(op="Claim", key="k", start=0.06, end=0.07, outcome="CLAIMED",
                                       fence=2, lease="c"), removals=[purge]), "self-test")
    assert report.counts["lost_completions"] == 1, report.counts
    print(f"checker self-test: {len(cases) + 1} synthetic histories, each counted as expected")


def load(path) -> History:
    """A History back from its JSON lines (History.dump); responses as bytes."""
    import json
    history = History()
    for line in open(path):
        row = json.loads(line)
        kind = row.pop("type")
        if kind == "mark":
            history.marks.append((row["name"], row["at"]))
        elif kind == "final":
            history.final[row.pop("key")] = row
        elif kind in ("call", "attempt", "effect", "removal"):
            if isinstance(row.get("response"), str):
                row["response"] = row["response"].encode()
            {"call": history.calls, "attempt": history.attempts, "effect": history.effects,
             "removal": history.removals}[kind].append(row)
    return history


def main(argv: List[str]) -> int:
    """python -m faults.checker: the self-test. With a history file
    (faults/out/NAME.history.jsonl): its wrong replays and lost completions of
    removed keys (workload keys are not listed in the file, so not checked);
    --delete-bound S takes each DELETE as in force S s after its commit
    instead of OUT_OF_BAND_BOUND (0: the negative control, every replay
    within the bound becomes a wrong replay)."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m faults.checker", description=main.__doc__)
    parser.add_argument("history", nargs="?")
    parser.add_argument("--delete-bound", type=float, default=None)
    args = parser.parse_args(argv)
    if args.history is None:
        self_test()
        return 0
    history = load(args.history)
    if args.delete_bound is not None:
        for removal in history.removals:
            if removal["op"] == "DELETE":
                removal["effective"] = removal["end"] + args.delete_bound
    report = check(history, args.history)
    print(f"{len(history.removals)} removals; counts: {report.counts}")
    for name, examples in report.examples.items():
        for example in examples:
            print(f"   {name}: {example}")
    return 0 if all(v == 0 for v in report.counts.values()) else 1


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1:]))
