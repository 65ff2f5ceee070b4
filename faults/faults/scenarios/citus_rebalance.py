"""A Citus rebalance under load (issue 31): a coordinator and two workers of
the harness's own, the replicas given worker1, worker2 and the coordinator;
the table in 4 shards; worker2 is marked to hold no shards (citus_set_node_property(…,
'shouldhaveshards', false)) and citus_rebalance_start() moves its shards to
worker1 by logical replication while the workload runs (wal_level =
logical on every node), then citus_rebalance_wait() waits for the moves.

Each replica sends each key's statement to the node its shard map (read
every 10 s) places the key on. During and after the moves that map is
stale: a statement sent to the node a shard left is routed on by Citus from
there. So no call may fail, nothing may be lost, and a claimed key may never
be claimed again by another caller (the checker's counts).

Measured: how long the rebalance took, the shards per node before and
after, and the workload's attempts during the rebalance by code.

Runs only where Citus is installed (scenarios/_citus.py)."""

import asyncio
import collections

from faults.scenario import Env
from faults.scenarios._citus import CitusScenario, odd_codes


class CitusRebalance(CitusScenario):
    name = "citus_rebalance"
    description = ("Citus: citus_rebalance_start() drains worker2's shards onto worker1 under load, replicas "
                   "given both workers and the coordinator; no call fails, nothing lost or claimed twice")
    ci_duration = 16.0
    workload = {"duration": 25.0}
    #: 4 shards, so that 2 move (each move by logical replication takes a
    #: few seconds whatever its size)
    cluster_settings = {"wal_level": "logical", "max_wal_senders": 20, "max_replication_slots": 20,
                        "citus.shard_count": 4}

    def __init__(self) -> None:
        super().__init__()
        self._window = None

    async def prepare(self, env: Env) -> None:
        await super().prepare(env)
        self.give_replicas(env, self.cluster.workers + [self.cluster.coordinator])

    async def inject(self, env: Env) -> None:
        self._window = None
        cluster = self.cluster
        before = await self.distributed(env)
        drained = cluster.workers[1]
        await env.sleep_load(1.5)
        start = env.mark("fault")
        await asyncio.to_thread(
            cluster.psql,
            f"SELECT citus_set_node_property('{cluster.host}', {drained.port}, 'shouldhaveshards', false);"
            " SELECT citus_rebalance_start(shard_transfer_mode := 'force_logical');"
            " SELECT citus_rebalance_wait();",
            None, 300)
        end = env.mark("healed")
        env.log(f"rebalance done in {end - start:.2f} s")
        after = await asyncio.to_thread(cluster.shards_by_port)
        env.note("rebalance_s", round(end - start, 3))
        env.note("shards_before", {self.node_name(p): n for p, n in before.items()})
        env.note("shards_after", {self.node_name(p): n for p, n in after.items()})
        self._window = (start, end)
        await env.sleep_load(2.0)

    def expect(self, report):
        failures = odd_codes(report)
        if self._window is None:
            return failures + ["the rebalance never ran"]
        start, end = self._window
        during = collections.Counter(a["code"] for a in report.history.attempts if start <= a["start"] < end)
        report.notes["attempts_during_rebalance"] = dict(during)
        if not during:
            failures.append("no attempt of the workload started during the rebalance")
        failed = report.failed_attempts_after_by_code(start)
        report.notes["failed_attempts_from_the_rebalance"] = failed
        if failed:
            failures.append(f"{sum(failed.values())} attempts failed from the rebalance's start on: {failed}")
        after = report.notes.get("shards_after", {})
        if set(after) != {"worker1"}:
            failures.append(f"shards after the rebalance: {after}, all on worker1 expected")
        return failures


SCENARIO = CitusRebalance()
