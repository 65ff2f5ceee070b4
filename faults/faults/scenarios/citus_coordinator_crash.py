"""The Citus coordinator crashed (pg_ctl stop -m immediate) and restarted
under load, repeated every few seconds (issue 21): the pg_crash scenario on
a Citus coordinator and two workers of the harness's own
(faults/infra/citus.py), the replicas pointed at the coordinator. While it
is down calls wait for a connection (the DB timeout) and then answer
UNAVAILABLE; once health is SERVING again no attempt may fail until the
next crash. Also measured: from each restart,
the first Claim of a fresh key answered OK on every replica (no retries).
Runs only where Citus is installed (scenarios/_citus.py)."""

import asyncio

from faults.infra.pg import as_postgres
from faults.scenario import Env
from faults.scenarios._citus import CitusScenario, Probes, odd_codes
from faults.scenarios.pg_crash import PgCrash


class CitusCoordinatorCrash(CitusScenario, PgCrash):
    name = "citus_coordinator_crash"
    description = ("Citus: the coordinator stopped with pg_ctl stop -m immediate under load and restarted at "
                   "once, every ~3 s; 0 failed attempts once health is SERVING again")
    ci_duration = 6.0
    #: seconds of load between a SERVING and the next crash
    between = 2.0

    async def inject(self, env: Env) -> None:
        await self.distributed(env)
        coordinator = self.cluster.coordinator
        probes = Probes(env, {"write": (f"probe-{i}" for i in range(100000))}, "faults-citus-probe",
                        every=0.05, timeout=2.0).start()
        crashes = []
        try:
            await env.sleep_load(1.0)
            while True:
                fault = env.mark("fault")
                await env.sh(*as_postgres([str(coordinator.bin / "pg_ctl"), "-D", str(coordinator.data),
                                           "-m", "immediate", "-w", "-t", "60", "stop"]), check=False)
                await asyncio.to_thread(coordinator.start)
                healed = env.mark("healed")
                serving = await env.wait_serving(timeout=30)
                env.history.mark("serving", serving)
                ok = None
                while ok is None and env.now() < healed + 30:
                    await asyncio.sleep(0.05)
                    ok = probes.first_ok("write", healed)
                crashes.append({"down_s": round(healed - fault, 3),
                                "serving_after_restart_s": round(serving - healed, 3),
                                "write_ok_after_restart_s": None if ok is None else round(ok - healed, 3)})
                if env.load_left() < self.between + 2.0:
                    break
                await env.sleep_load(self.between)
        finally:
            await probes.stop()
        env.note("crashes", crashes)
        env.note("probes", Probes.tally(probes.rows))

    def expect(self, report):
        failures = PgCrash.expect(self, report) + odd_codes(report)
        for i, crash in enumerate(report.notes.get("crashes", [])):
            if crash.get("write_ok_after_restart_s") is None:
                failures.append(f"crash {i + 1}: no write answered OK within 30 s of the restart")
        return failures


SCENARIO = CitusCoordinatorCrash()
