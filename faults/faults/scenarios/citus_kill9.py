"""kill -9 of service replicas under load, on Citus (issue 21): the kill9
scenario with the replicas on a Citus coordinator and two workers of the
harness's own (faults/infra/citus.py). Runs only where Citus is installed
(scenarios/_citus.py); the project never installs it."""

from faults.scenarios._citus import CitusScenario, odd_codes
from faults.scenarios.kill9 import Kill9


class CitusKill9(CitusScenario, Kill9):
    name = "citus_kill9"
    description = ("Citus (a coordinator, 2 workers, 32 shards): SIGKILL of a random replica every ~1.5 s, "
                   "restarted at once (3 replicas on the coordinator)")

    async def inject(self, env) -> None:
        await self.distributed(env)
        await Kill9.inject(self, env)

    def expect(self, report):
        return Kill9.expect(self, report) + odd_codes(report)


SCENARIO = CitusKill9()
