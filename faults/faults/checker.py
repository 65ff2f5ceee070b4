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
                   answered OK, one of those attempted)
fencing            two leases of one key with the same fencing token, or a
                   lease granted after another one's Claim had returned with a
                   fencing token not higher
stuck_keys         keys neither COMPLETED nor claimable at the final Claim
                   (after every lease and a reaper interval ran out)
no_answer          calls that had not returned NO_ANSWER_GRACE seconds after
                   their deadline

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
