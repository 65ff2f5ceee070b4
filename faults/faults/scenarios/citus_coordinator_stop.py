"""The Citus coordinator stopped while calls go on (issue 31): a
coordinator and two workers of the harness's own (faults/infra/citus.py),
the replicas given the workers (replica i the worker i mod 2), the
coordinator stopped (pg_ctl stop -m fast) for 30 s (5 s with --ci) under
load, then started again.

Each replica sends every key's statement straight to the worker holding the
key's shard (IDEMPOTENCY_CITUS_DIRECT, on by default), and its health check
asks the worker it was given, so nothing on the call path needs the
coordinator: every Claim, Complete, Release and ExtendLease started while it
is down must answer as if it were up (no UNAVAILABLE at all), and health
stays SERVING. What does need it (migrations, Purge, the purge feed) is not
in the workload; the replay caches stop answering from memory while the feed
is gone, which costs reads, not answers.

Measured, besides the workload's history:
- probes: a Claim of a fresh key every 50 ms (no retries, one replica each
  time, round-robin, 2 s deadline), from before the stop to after the
  restart: during the outage, the share answered OK and their codes;
- the workload's attempts started during the outage: how many, and their
  codes.

Runs only where Citus is installed (scenarios/_citus.py)."""

import asyncio
import collections

from faults.scenario import Env
from faults.scenarios._citus import CitusScenario, Probes, odd_codes


class CitusCoordinatorStop(CitusScenario):
    name = "citus_coordinator_stop"
    description = ("Citus: replicas given the workers; the coordinator stopped for 30 s (5 s with --ci) under "
                   "load; every call answers as if it were up, health stays SERVING")
    ci_duration = 9.0
    workload = {"duration": 36.0}
    #: seconds the coordinator stays down (--ci: ci_outage)
    outage = 30.0
    ci_outage = 5.0

    def __init__(self) -> None:
        super().__init__()
        self._window = None

    async def prepare(self, env: Env) -> None:
        await super().prepare(env)
        self.give_replicas(env, self.cluster.workers)

    async def inject(self, env: Env) -> None:
        self._window = None
        await self.distributed(env)
        coordinator = self.cluster.coordinator
        probes = Probes(env, {"any": (f"probe-{i}" for i in range(100000))}, "faults-citus-probe",
                        every=0.05, timeout=2.0).start()
        try:
            await env.sleep_load(1.5)
            outage = self.ci_outage if env.ci else self.outage
            fault = env.mark("fault")
            await asyncio.to_thread(coordinator.stop, "fast")
            env.log(f"coordinator (port {coordinator.port}) stopped -m fast for {outage:.0f} s")
            statuses = []
            deadline = fault + outage
            while env.now() < deadline:
                statuses.append(await asyncio.gather(*(r.health() for r in env.replicas)))
                await asyncio.sleep(min(0.5, max(0.0, deadline - env.now())))
            restart = env.now()
            await asyncio.to_thread(coordinator.start)
            env.mark("healed")
            await asyncio.sleep(1.0)
        finally:
            await probes.stop()
        env.note("outage_s", round(restart - fault, 3))
        env.note("health_during_outage", dict(collections.Counter(s for row in statuses for s in row)))
        env.note("probes_during_outage", Probes.tally(probes.window("any", fault, restart)))
        env.note("probe_errors", sorted({r.get("error", "")[:200] for r in probes.rows if r["code"] != "OK"})[:5])
        self._window = (fault, restart)

    def expect(self, report):
        failures = odd_codes(report)
        if self._window is None:
            return failures + ["the coordinator was never stopped"]
        fault, restart = self._window
        during = collections.Counter(a["code"] for a in report.history.attempts if fault <= a["start"] < restart)
        report.notes["attempts_during_outage"] = dict(during)
        if not during:
            failures.append("no attempt of the workload started while the coordinator was down")
        failed = report.failed_attempts_after_by_code(fault)
        report.notes["failed_attempts_from_the_stop"] = failed
        if failed:
            failures.append(f"{sum(failed.values())} attempts failed from the coordinator's stop on: {failed}")
        probes = report.notes["probes_during_outage"]
        if not probes["probes"] or probes["ok_share"] != 1.0:
            failures.append(f"{probes['ok_share']} of {probes['probes']} probes answered OK while the coordinator "
                            f"was down ({probes['codes']}), all expected")
        health = report.notes["health_during_outage"]
        if set(health) != {"SERVING"}:
            failures.append(f"health while the coordinator was down: {health}, SERVING only expected")
        return failures


SCENARIO = CitusCoordinatorStop()
