"""Clocks an hour apart: libfaketime (Debian's `faketime`) preloaded into a
replica (LD_PRELOAD + FAKETIME, preload_env()), a check that the wrapped binary's clock really moved (its
log timestamps), and a probe that would catch any decision a replica takes by
its own clock instead of the database's.

libfaketime with a relative offset ("-1h", "+1h") shifts CLOCK_REALTIME and
also the monotonic clocks (CLOCK_MONOTONIC, CLOCK_BOOTTIME read the faked
wall-clock value, advancing at the real rate), so intervals measured inside
the process (tokio timers, Instant, the health check period, timeouts) keep
their length; only absolute wall-clock readings are an hour off.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Dict, List, Optional

from idempotency_client import Outcome
from idempotency_client.aio import AsyncIdempotencyClient
from idempotency_client.errors import IdempotencyError

_TS = re.compile(rb"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)Z")


def ensure_faketime() -> str:
    """The faketime command, installed from Debian when missing (root)."""
    found = shutil.which("faketime")
    if found:
        return found
    subprocess.run(["apt-get", "install", "-y", "-qq", "faketime"], check=False,
                   capture_output=True, timeout=300)
    found = shutil.which("faketime")
    if not found:
        subprocess.run(["apt-get", "update", "-qq"], check=False, capture_output=True, timeout=300)
        subprocess.run(["apt-get", "install", "-y", "-qq", "faketime"], check=True,
                       capture_output=True, timeout=300)
        found = shutil.which("faketime")
    if not found:
        raise FileNotFoundError("faketime is not installed and apt-get could not install it")
    return found


def wrapper(offset: str) -> List[str]:
    """The command prefix that runs a program `offset` off the real clock
    ("-1h", "+1h", "+0"); [] for no offset.

    Beware: the `faketime` command forks and waits for its child without
    passing signals on, so a SIGTERM or SIGKILL sent to its PID leaves the
    program running (an orphan). Replicas use preload_env() instead."""
    if offset in ("", "0", "+0", "-0"):
        return []
    return [ensure_faketime(), "-f", offset]


def missing() -> Optional[str]:
    """Why libfaketime cannot be used here (a scenario's available()),
    or None."""
    try:
        ensure_faketime()
    except Exception as error:
        return f"faketime (Debian's package) is missing: {error}"
    return None


def library() -> str:
    """The path of libfaketime.so.1 (Debian's faketime package)."""
    ensure_faketime()
    import glob

    for pattern in ("/usr/lib/*/faketime/libfaketime.so.1", "/usr/lib/faketime/libfaketime.so.1",
                    "/usr/local/lib/faketime/libfaketime.so.1"):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    raise FileNotFoundError("libfaketime.so.1 not found (Debian's faketime package)")


def preload_env(offset: str) -> Dict[str, str]:
    """Settings that put a program `offset` off the real clock with
    libfaketime preloaded into the program itself (what `faketime -f` does,
    minus its forking parent): the process started is the server, so
    signals reach it. {} for no offset."""
    if offset in ("", "0", "+0", "-0"):
        return {}
    return {"LD_PRELOAD": library(), "FAKETIME": offset}


def offset_seconds(offset: str) -> float:
    """'-1h' -> -3600.0, '+30m' -> 1800.0, '+0' -> 0."""
    match = re.fullmatch(r"([+-]?)(\d+(?:\.\d+)?)([smhd]?)", offset.strip())
    if not match:
        raise ValueError(f"unsupported faketime offset {offset!r}")
    sign = -1.0 if match.group(1) == "-" else 1.0
    unit = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(3)]
    return sign * float(match.group(2)) * unit


def first_log_time(log_path) -> Optional[datetime]:
    """The timestamp of the first line of a replica's text log (UTC)."""
    try:
        with open(log_path, "rb") as log:
            for line in log:
                match = _TS.match(line)
                if match:
                    text = match.group(1).decode()
                    if "." in text:
                        head, frac = text.split(".")
                        text = f"{head}.{frac[:6]}"
                        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=timezone.utc)
                    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc)
    except OSError:
        return None
    return None


def last_log_time(log_path) -> Optional[datetime]:
    """The timestamp of the last timestamped line of a log."""
    last = None
    try:
        with open(log_path, "rb") as log:
            for line in log:
                match = _TS.match(line)
                if match:
                    last = match.group(1)
    except OSError:
        return None
    if last is None:
        return None
    text = last.decode()
    head, _, frac = text.partition(".")
    return datetime.strptime(f"{head}.{(frac or '0')[:6]}", "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=timezone.utc)


def measured_offset(log_path, started_real: float, seen_real: float) -> Optional[float]:
    """How far the replica's clock is from the real one, in seconds, from its
    log: its first line was written between `started_real` and `seen_real`
    (time.time() before the start and once it was SERVING). None when the
    log has no timestamp yet."""
    stamp = first_log_time(log_path)
    if stamp is None:
        return None
    at = stamp.timestamp()
    if at < started_real:
        return at - started_real
    if at > seen_real:
        return at - seen_real
    return 0.0


# ---------------------------------------------------------------------------
# The probe: leases taken over across replicas an hour apart.

@dataclass
class ProbeResult:
    """What the skew probe saw. Every list of violations must be empty."""
    takeovers: int = 0                      # leases taken over after their expiry
    early_takeovers: List[str] = field(default_factory=list)
    late_takeovers: List[str] = field(default_factory=list)   # > slack after the expiry
    wrong_timestamps: List[str] = field(default_factory=list)  # not by the database clock
    stale_completes_accepted: List[str] = field(default_factory=list)
    fencing_not_increasing: List[str] = field(default_factory=list)
    reaped_early: List[str] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)
    takeover_delay_ms: List[float] = field(default_factory=list)  # takeover - expiry, by the database clock

    def violations(self) -> Dict[str, int]:
        return {
            "early_takeovers": len(self.early_takeovers),
            "late_takeovers": len(self.late_takeovers),
            "wrong_timestamps": len(self.wrong_timestamps),
            "stale_completes_accepted": len(self.stale_completes_accepted),
            "fencing_not_increasing": len(self.fencing_not_increasing),
            "reaped_early": len(self.reaped_early),
            "errors": len(self.errors),
        }

    def summary(self) -> Dict[str, object]:
        delays = sorted(self.takeover_delay_ms)
        return {
            "takeovers": self.takeovers,
            **self.violations(),
            "takeover_after_expiry_ms_min": round(delays[0], 1) if delays else None,
            "takeover_after_expiry_ms_max": round(delays[-1], 1) if delays else None,
            "examples": (self.early_takeovers + self.late_takeovers + self.wrong_timestamps
                         + self.stale_completes_accepted + self.fencing_not_increasing
                         + self.reaped_early + self.errors)[:5],
        }


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=timezone.utc)


async def _takeover(result: ProbeResult, namespace: str, key: str, holder: AsyncIdempotencyClient,
                    holder_name: str, challenger: AsyncIdempotencyClient, challenger_name: str,
                    lease_s: float, poll_s: float, slack_s: float, clock_slack_s: float) -> None:
    """The holder claims `key` for `lease_s` and vanishes; the challenger
    claims it every `poll_s` until it gets the lease. It must get it no
    earlier than the holder's lease_expires_at (by the database clock: the
    new lease starts at its lease_expires_at - lease_s) and within
    `slack_s` after it; the holder's Complete afterwards must be refused."""
    where = f"{key} {holder_name}->{challenger_name}"
    sent = time.time()
    first = await holder.claim(namespace, key, lease_ttl=lease_s, retention=1800)
    got = time.time()
    if first.outcome is not Outcome.CLAIMED:
        result.errors.append(f"{where}: first Claim answered {first.outcome.name}")
        return
    expiry = first.lease_expires_at.timestamp()
    give_up = got + lease_s + slack_s + 5  # by the real clock, whatever the answers say
    # By the database clock, which is this machine's real clock: the lease
    # runs out lease_s after a moment between sent and got.
    if not (sent + lease_s - clock_slack_s <= expiry <= got + lease_s + clock_slack_s):
        result.wrong_timestamps.append(
            f"{where}: lease_expires_at {first.lease_expires_at.isoformat()} is not real time + {lease_s}s "
            f"(sent {_utc(sent).isoformat()})")
    while True:
        sent = time.time()
        answer = await challenger.claim(namespace, key, lease_ttl=lease_s, retention=1800)
        got = time.time()
        if answer.outcome is Outcome.CLAIMED:
            decided = answer.lease_expires_at.timestamp() - lease_s  # the database's now() at the takeover
            result.takeovers += 1
            result.takeover_delay_ms.append((decided - expiry) * 1000)
            if got < expiry or decided < expiry:
                result.early_takeovers.append(
                    f"{where}: taken over at {_utc(decided).isoformat()} (answer at {_utc(got).isoformat()}) "
                    f"before the lease's expiry {first.lease_expires_at.isoformat()}")
            elif decided > expiry + slack_s + poll_s:
                result.late_takeovers.append(
                    f"{where}: taken over {decided - expiry:.1f}s after the expiry")
            if answer.fencing_token != first.fencing_token + 1:
                result.fencing_not_increasing.append(
                    f"{where}: fencing {first.fencing_token} then {answer.fencing_token}")
            break
        if answer.outcome is Outcome.IN_PROGRESS:
            # Time left must be what the database says, not an hour off.
            if answer.lease_expires_at is not None and \
                    abs(answer.lease_expires_at.timestamp() - expiry) > 0.001:
                result.wrong_timestamps.append(
                    f"{where}: IN_PROGRESS names expiry {answer.lease_expires_at.isoformat()}, "
                    f"the lease's is {first.lease_expires_at.isoformat()}")
            if answer.retry_after is not None and \
                    not (-clock_slack_s <= answer.retry_after.total_seconds() <= lease_s + clock_slack_s):
                result.wrong_timestamps.append(f"{where}: retry_after {answer.retry_after}")
        else:
            result.errors.append(f"{where}: challenger's Claim answered {answer.outcome.name}")
            return
        if got > give_up:
            result.late_takeovers.append(
                f"{where}: still IN_PROGRESS {got - expiry:.1f}s after the lease's expiry "
                f"{first.lease_expires_at.isoformat()} (retry_after {answer.retry_after})")
            return
        await asyncio.sleep(poll_s)
    # The vanished holder comes back: its lease is gone, its Complete must fail.
    try:
        await holder.complete(namespace, key, first.lease_token, b"stale")
        result.stale_completes_accepted.append(f"{where}: the expired holder's Complete was accepted")
    except IdempotencyError:
        pass
    # The challenger completes with a retention (30 min) shorter than the skew:
    # a reaper on a clock an hour ahead that trusted its own clock would
    # delete it at once.
    done = await challenger.complete(namespace, key, answer.lease_token, f"done:{key}".encode(), retention=1800)
    now = time.time()
    if abs(done.expires_at.timestamp() - (now + 1800)) > clock_slack_s + 2:
        result.wrong_timestamps.append(f"{where}: Complete's expires_at {done.expires_at.isoformat()} "
                                       f"is not real time + 30 min")


async def skew_probe(targets: Dict[str, str], namespace: str, rounds: int = 2, lease_s: float = 2.0,
                     poll_s: float = 0.1, slack_s: float = 1.5, clock_slack_s: float = 1.0,
                     reaper_wait_s: float = 2.5, timeout: float = 10.0) -> ProbeResult:
    """For every ordered pair of replicas (name -> target), `rounds` keys:
    one claimed on the first, taken over on the second (see _takeover()).
    Then, after `reaper_wait_s` (more than two reaper intervals), every key
    must still replay its response through every replica."""
    result = ProbeResult()
    clients = {name: AsyncIdempotencyClient(target, timeout=timeout) for name, target in targets.items()}
    try:
        jobs = []
        keys = []
        for r in range(rounds):
            for a in clients:
                for b in clients:
                    if a == b:
                        continue
                    key = f"skew-{a}-{b}-{r}"
                    keys.append(key)
                    jobs.append(_takeover(result, namespace, key, clients[a], a, clients[b], b,
                                          lease_s, poll_s, slack_s, clock_slack_s))
        outcomes = await asyncio.gather(*jobs, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                result.errors.append(f"{type(outcome).__name__}: {outcome}")
        await asyncio.sleep(reaper_wait_s)
        for key in keys:
            for name, client in clients.items():
                try:
                    record = await client.get(namespace, key)
                except IdempotencyError as error:
                    result.errors.append(f"Get {key} on {name}: {error}")
                    continue
                if record.response != f"done:{key}".encode():
                    result.reaped_early.append(
                        f"{key} on {name}: {record.state.name}, response {record.response!r}")
    finally:
        for client in clients.values():
            await client.close()
    return result


# ---------------------------------------------------------------------------
# The probe's own test: it must catch a store that decides by its replica's
# clock. The embedded SQLite store does (it is single-instance, so it may):
# three replicas sharing one SQLite file, at -1h, real time and +1h, must
# show early and late takeovers, wrong timestamps and results reaped early.
#
#     cd faults && .venv/bin/python -m faults.infra.clock

async def negative_control() -> ProbeResult:
    import tempfile

    from ..cluster import Replica

    folder = tempfile.mkdtemp(prefix="faults-clock-negative-")
    replicas = [
        Replica({"DATABASE_URL": f"sqlite://{folder}/shared.db", "IDEMPOTENCY_REAPER_INTERVAL": "1s",
                 **preload_env(offset)}, name=name, log_dir=folder)
        for name, offset in (("minus1h", "-1h"), ("real", "+0"), ("plus1h", "+1h"))
    ]
    try:
        for replica in replicas:  # one at a time: the first creates the file
            await replica.start()
        return await skew_probe({r.name: r.target for r in replicas}, "negative", rounds=1)
    finally:
        for replica in replicas:
            replica.stop_now()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    import json
    import sys

    found = asyncio.run(negative_control())
    print(json.dumps(found.summary(), indent=1))
    caught = found.violations()
    ok = caught["early_takeovers"] > 0 and caught["wrong_timestamps"] > 0 and caught["reaped_early"] > 0
    print("the probe catches decisions by a replica's own clock" if ok else "the probe MISSED the skew")
    sys.exit(0 if ok else 1)
