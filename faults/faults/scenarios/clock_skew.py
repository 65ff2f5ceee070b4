"""Clock skew: 3 replicas on one PostgreSQL under libfaketime (preloaded), an hour apart
(replica0 at -1h, replica1 on the real clock, replica2 at +1h).

The database's clock decides every lease and expiry, so no lease is taken
over early (nor an hour late), and no result is reaped early. Checked by:
- each replica's clock really is off (its log timestamps against ours);
- the workload across the three replicas (vanishing consumers' leases run
  out and are taken over on other replicas): the checker's counts are 0, no
  call fails;
- a probe (faults/infra/clock.py skew_probe): for every ordered pair of
  replicas, a key claimed on one with a 2 s lease and abandoned is claimed on
  the other every 100 ms. The takeover must come no earlier than the lease's
  lease_expires_at, by the database clock (the new lease's start, its
  lease_expires_at - ttl) and by ours, and within ~1.5 s after it; fencing
  +1; the abandoned holder's Complete refused; every timestamp returned is
  real time + the TTL (not an hour off); results completed with a 30 min
  retention survive the +1h replica's reaper (interval 1 s);
- health stays SERVING on every replica throughout (faketime shifts the
  monotonic clock too; tokio's timers keep their length): a probe every
  0.2 s, asked again with 2 s when it had no answer within 0.5 s (counted
  in the notes); any answer but SERVING, or none within the 2 s, fails.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Dict, List, Optional

from faults.infra import clock
from faults.scenario import Env, Scenario

#: replica index -> faketime offset
OFFSETS = {0: "-1h", 1: "+0", 2: "+1h"}
NAMES = {0: "minus1h", 1: "real", 2: "plus1h"}
#: the health watcher's probe (s); one that gets no answer in time
#: (DEADLINE_EXCEEDED: a fresh channel, and this event loop shared with the
#: workload, on a loaded machine) is asked again with HEALTH_RETRY_TIMEOUT,
#: and that answer is the one counted
HEALTH_TIMEOUT = 0.5
HEALTH_RETRY_TIMEOUT = 2.0


class ClockSkew(Scenario):
    name = "clock_skew"
    description = ("3 replicas under libfaketime at -1h, real time and +1h on one PostgreSQL; leases "
                   "abandoned on one replica and taken over on another")
    replicas = 3
    store = "postgres"
    #: probe rounds (keys per ordered pair of replicas)
    ci_rounds = 1
    rounds = 3
    #: the probe's lease (s)
    probe_lease_s = 2.0

    def available(self) -> Optional[str]:
        return clock.missing()

    async def prepare(self, env: Env) -> None:
        # libfaketime preloaded into the server itself (LD_PRELOAD, FAKETIME),
        # not the `faketime` command as a wrapper: that one forks and does not
        # pass signals on, so stopping the replica would leave the server running.
        for index, offset in OFFSETS.items():
            env.replica_envs.setdefault(index, {}).update(clock.preload_env(offset))
        env.note("offsets", {NAMES[i]: o for i, o in OFFSETS.items()})

    async def _measure_offsets(self, env: Env) -> Dict[str, Optional[float]]:
        """Each replica's clock minus ours, from the timestamp of the line it
        logs for a Get we send it (the line is written after the Get
        started and before our answer arrives)."""
        from idempotency_client.aio import AsyncIdempotencyClient

        measured: Dict[str, Optional[float]] = {}
        for index, replica in enumerate(env.replicas):
            async with AsyncIdempotencyClient(replica.target, timeout=5) as client:
                before = time.time()
                await client.get(f"faults-{self.name}-clock", f"clock-{index}")
                after = time.time()
            await asyncio.sleep(0.05)  # the log line is flushed
            stamp = clock.last_log_time(replica.log)
            if stamp is None:
                measured[NAMES[index]] = None
                continue
            at = stamp.timestamp()
            # The replica's clock read, by our clock, between before and after.
            expected = clock.offset_seconds(OFFSETS[index])
            off = at - (before + after) / 2
            measured[NAMES[index]] = round(off, 3)
            env.log(f"{replica.name} ({OFFSETS[index]}): clock off by {off:+.3f} s "
                    f"(expected {expected:+.0f} s)")
        return measured

    async def inject(self, env: Env) -> None:
        env.note("clock_offsets_s", await self._measure_offsets(env))
        health: Dict[str, Dict[str, int]] = {NAMES[i]: {} for i in range(len(env.replicas))}
        late: Dict[str, int] = {NAMES[i]: 0 for i in range(len(env.replicas))}
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                for i, replica in enumerate(env.replicas):
                    status = await replica.health(timeout=HEALTH_TIMEOUT)
                    if status == "DEADLINE_EXCEEDED":
                        # Not an answer: what the replica says is what counts.
                        late[NAMES[i]] += 1
                        status = await replica.health(timeout=HEALTH_RETRY_TIMEOUT)
                    health[NAMES[i]][status] = health[NAMES[i]].get(status, 0) + 1
                await asyncio.sleep(0.2)

        rounds = self.ci_rounds if env.ci else self.rounds
        env.note("probe_rounds", rounds)
        watcher = asyncio.create_task(watch())
        env.mark("fault")
        try:
            result = await clock.skew_probe(
                {NAMES[i]: r.target for i, r in enumerate(env.replicas)},
                namespace=f"faults-{self.name}-probe",
                rounds=rounds,
                lease_s=self.probe_lease_s,
                reaper_wait_s=2.5 * env.workload.reaper_interval,
            )
            env.mark("healed")
            # Health keeps being watched until the load ends.
            await env.sleep_load(env.load_left())
        finally:
            stop.set()
            await watcher
        env.note("probe", result.summary())
        env.note("health", health)
        env.note(f"health_asked_again_after_{HEALTH_TIMEOUT:g}s", late)
        env.note("replicas_alive", [r.running() for r in env.replicas])
        env.log(f"probe: {result.takeovers} takeovers, violations {result.violations()}")

    def expect(self, report) -> List[str]:
        failures = []
        notes = report.notes
        offsets = notes.get("clock_offsets_s") or {}
        for index, name in NAMES.items():
            want = clock.offset_seconds(OFFSETS[index])
            got = offsets.get(name)
            if got is None or abs(got - want) > 5:
                failures.append(f"{name}'s clock is off by {got} s, not {want:+.0f} s: faketime did not apply")
        probe = notes.get("probe") or {}
        pairs = len(NAMES) * (len(NAMES) - 1)
        rounds = notes.get("probe_rounds", 0)
        if probe.get("takeovers") != pairs * rounds:
            failures.append(f"the probe took over {probe.get('takeovers')} leases, not {pairs * rounds}")
        for name in ("early_takeovers", "late_takeovers", "wrong_timestamps", "stale_completes_accepted",
                     "fencing_not_increasing", "reaped_early", "errors"):
            if probe.get(name):
                failures.append(f"probe {name}: {probe[name]} (e.g. {probe.get('examples')})")
        for name, statuses in (notes.get("health") or {}).items():
            if set(statuses) != {"SERVING"}:
                failures.append(f"{name}'s health answered {statuses} (only SERVING expected)")
        if not all(notes.get("replicas_alive") or [False]):
            failures.append(f"a replica exited: {notes.get('replicas_alive')}")
        if report.failed_calls:
            failures.append(f"{report.failed_calls} workload calls failed with no fault but the skew: "
                            f"{report.errors}")
        failed_attempts = {c: n for c, n in report.attempt_errors.items()
                           if c in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "INTERNAL", "UNKNOWN")}
        if failed_attempts:
            failures.append(f"attempts failed: {failed_attempts}")
        return failures


SCENARIO = ClockSkew()
