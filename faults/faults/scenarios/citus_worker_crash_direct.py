"""citus_worker_crash with the replicas given the workers (issue 31): replica
i is given worker i mod 3 of [worker1, worker2, coordinator], so one replica's
own node is the one that crashes. Every replica sends each key's statement
straight to the worker holding the key (IDEMPOTENCY_CITUS_DIRECT), so the
keys on the live worker keep answering through every replica, the one whose
node crashed included; the crashed worker's keys answer UNAVAILABLE, then
recover. The measurements and expectations are citus_worker_crash's.

Runs only where Citus is installed (scenarios/_citus.py)."""

from faults.scenario import Env
from faults.scenarios.citus_worker_crash import CitusWorkerCrash


class CitusWorkerCrashDirect(CitusWorkerCrash):
    name = "citus_worker_crash_direct"
    description = ("Citus: replicas given the workers and the coordinator; one worker stopped with pg_ctl stop "
                   "-m immediate under load; the live worker's keys answer through every replica, the crashed "
                   "one's answer UNAVAILABLE, then recover")

    async def prepare(self, env: Env) -> None:
        await super().prepare(env)
        self.give_replicas(env, self.cluster.workers + [self.cluster.coordinator])


SCENARIO = CitusWorkerCrashDirect()
