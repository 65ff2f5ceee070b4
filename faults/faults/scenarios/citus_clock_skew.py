"""One Citus worker off the real clock (issue 31, "Whose clock"): a
coordinator and two workers of the harness's own, worker2's PostgreSQL
restarted under libfaketime (preloaded) 3 s behind the real clock (d = 3 s),
the replicas given worker1, worker2 and the coordinator. Each replica sends
a key's statements, Purge's included, straight to the worker holding the
key, so every call on a key reads that one worker's clock and the skew
moves none of them; the reaper reads the clock of the node its replica was
given, so it may reap a result up to d early, never late. Checked, for keys
on the skewed worker and on the other:

- each node's clock really is where it should be (worker2 3 s behind);
- Purge: a key completed with a 1 h retention and purged through each
  replica in turn is answered CLAIMED, never replayed, by the first Claim
  after the Purge returned, through every replica. Before issue 31 made
  Purge run on the key's worker, it ran on the coordinator and set the
  record's expiry to the coordinator's now(), which the skewed worker saw
  as d ahead: the purged result was replayed for d;
- a lease: a key claimed with a 2 s lease and abandoned through one
  replica, claimed every 100 ms through another: taken over no earlier
  than 2 s after the first Claim was answered by our clock (less 0.2 s for
  the answer's way back), and within 1.5 s after, with the next fencing
  token (no two clocks: d moves nothing);
- a retention: a result completed with a 6 s retention replays through
  every replica until at least 5.7 s after the Complete was answered by our
  clock (on worker2, 2.7 s: the bound d, from the reapers of replicas given
  the other nodes), never after 6.3 s, and is gone by 7.5 s;
- the workload (vanishing consumers' leases taken over on other replicas)
  with the checker's counts 0.

Runs only where Citus is installed (scenarios/_citus.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Dict, List, Optional

from faults.infra import clock
from faults.scenario import Env
from faults.scenarios._citus import CitusScenario, odd_codes

#: worker2's offset from the real clock (d = 3 s, behind)
OFFSET = "-3s"
SKEW_S = 3.0
#: keys probed on each worker
KEYS_PER_WORKER = 3
LEASE_S = 2.0
RETENTION_S = 6.0


class CitusClockSkew(CitusScenario):
    name = "citus_clock_skew"
    description = ("Citus: worker2 under libfaketime 3 s behind; replicas given worker1, worker2 and the "
                   "coordinator; Purge, a lease and a retention on keys of each worker, by the real clock")
    ci_duration = 12.0
    workload = {"duration": 24.0}

    def __init__(self) -> None:
        super().__init__()
        self._checked = False

    def available(self) -> Optional[str]:
        return super().available() or clock.missing()

    async def prepare(self, env: Env) -> None:
        await super().prepare(env)
        worker2 = self.cluster.workers[1]
        worker2.environment = clock.preload_env(OFFSET)
        await asyncio.to_thread(worker2.restart)
        await asyncio.to_thread(self.cluster.wait_accepting, worker2)
        env.note("offset", {worker2.name: OFFSET})
        self.give_replicas(env, self.cluster.workers + [self.cluster.coordinator])

    def _clock_offsets(self) -> Dict[str, float]:
        """Each node's now() minus ours, read through psql."""
        offsets = {}
        for node in self.cluster.nodes:
            before = time.time()
            at = float(self.cluster.psql("SELECT extract(epoch FROM clock_timestamp())", node=node))
            after = time.time()
            offsets[node.name] = round(at - (before + after) / 2, 2)
        return offsets

    def _keys(self, namespace_prefix: str) -> Dict[str, List[str]]:
        """KEYS_PER_WORKER keys on each worker, by name."""
        candidates = [f"{namespace_prefix}-{i}" for i in range(200)]
        ports = self.cluster.ports_of(candidates)
        names = {node.port: node.name for node in self.cluster.workers}
        keys: Dict[str, List[str]] = {name: [] for name in names.values()}
        for key in candidates:
            name = names.get(ports.get(key))
            if name and len(keys[name]) < KEYS_PER_WORKER:
                keys[name].append(key)
        return keys

    async def inject(self, env: Env) -> None:
        from idempotency_client.aio import AsyncIdempotencyClient

        await self.distributed(env)
        env.note("clock_offsets_s", await asyncio.to_thread(self._clock_offsets))
        namespace = f"faults-{self.name}"
        clients = [AsyncIdempotencyClient(r.target, timeout=5) for r in env.replicas]
        purge_replays: Dict[str, int] = {}
        purges: Dict[str, int] = {}
        leases: Dict[str, List[dict]] = {}
        retentions: Dict[str, List[dict]] = {}
        env.mark("fault")
        try:
            # Purge: completed through replica (p + 1), purged through p, then
            # claimed through every replica (the first from p + 2).
            keys = await asyncio.to_thread(self._keys, "purge")
            for worker, worker_keys in keys.items():
                purge_replays[worker] = 0
                purges[worker] = 0
                for key in worker_keys:
                    for p in range(len(clients)):
                        k = f"{key}-{p}"
                        writer = clients[(p + 1) % len(clients)]
                        claimed = await writer.claim(namespace, k, retention=3600)
                        await writer.complete(namespace, k, claimed.lease_token, b"before-purge")
                        purged = await clients[p].purge(namespace, k, reason="citus_clock_skew")
                        purges[worker] += int(purged.purged)
                        for i in range(len(clients)):
                            answer = await clients[(p + 2 + i) % len(clients)].claim(namespace, k)
                            if answer.response == b"before-purge":
                                purge_replays[worker] += 1
            # A lease, abandoned through one replica and taken over through
            # the next; a retention, watched through every replica: every
            # key at once.
            async def lease(n: int, key: str) -> dict:
                holder, taker = clients[n % 3], clients[(n + 1) % 3]
                first = await holder.claim(namespace, key, lease_ttl=LEASE_S)
                answered = time.monotonic()
                while True:
                    again = await taker.claim(namespace, key, lease_ttl=LEASE_S)
                    if again.claimed or time.monotonic() - answered > LEASE_S + 10:
                        break
                    await asyncio.sleep(0.1)
                return {"taken_over_after_s": round(time.monotonic() - answered, 3),
                        "claimed": again.claimed, "fencing": [first.fencing_token, again.fencing_token]}

            async def retention(key: str) -> dict:
                claimed = await clients[0].claim(namespace, key, retention=RETENTION_S)
                await clients[0].complete(namespace, key, claimed.lease_token, b"kept", retention=RETENTION_S)
                completed = time.monotonic()
                last_replay = first_gone = None
                while time.monotonic() - completed < RETENTION_S + 2.0:
                    for c in clients:
                        answer = await c.claim(namespace, key, lease_ttl=30)
                        at = time.monotonic() - completed
                        if answer.response == b"kept":
                            last_replay = at
                        elif first_gone is None:
                            first_gone = at
                    await asyncio.sleep(0.1)
                return {"last_replay_s": None if last_replay is None else round(last_replay, 3),
                        "first_gone_s": None if first_gone is None else round(first_gone, 3)}

            lease_keys = await asyncio.to_thread(self._keys, "lease")
            retention_keys = await asyncio.to_thread(self._keys, "retention")
            jobs = {}
            for worker in lease_keys:
                jobs[("lease", worker)] = asyncio.gather(
                    *(lease(n, key) for n, key in enumerate(lease_keys[worker])))
                jobs[("retention", worker)] = asyncio.gather(
                    *(retention(key) for key in retention_keys[worker]))
            done = dict(zip(jobs, await asyncio.gather(*jobs.values())))
            leases = {worker: rows for (kind, worker), rows in done.items() if kind == "lease"}
            retentions = {worker: rows for (kind, worker), rows in done.items() if kind == "retention"}
            env.mark("healed")
            await env.sleep_load(env.load_left())
        finally:
            for c in clients:
                await c.close()
        env.note("purges", purges)
        env.note("purged_results_replayed", purge_replays)
        env.note("leases", leases)
        env.note("retentions", retentions)
        self._checked = True

    def expect(self, report) -> List[str]:
        failures = odd_codes(report)
        if not self._checked:
            return failures + ["the probes never ran"]
        notes = report.notes
        offsets = notes.get("clock_offsets_s") or {}
        want = clock.offset_seconds(OFFSET)
        for name, got in offsets.items():
            expected = want if name == "worker2" else 0.0
            if abs(got - expected) > 2:
                failures.append(f"{name}'s clock is off by {got} s, not {expected:+.0f} s")
        purges = notes["purges"]
        for worker, replays in notes["purged_results_replayed"].items():
            if purges.get(worker) != KEYS_PER_WORKER * 3:
                failures.append(f"{worker}: {purges.get(worker)} of {KEYS_PER_WORKER * 3} Purges found the record")
            if replays:
                failures.append(f"{worker}: a purged result was replayed {replays} times after its Purge returned")
        for worker, rows in notes["leases"].items():
            for row in rows:
                after = row["taken_over_after_s"]
                if not row["claimed"]:
                    failures.append(f"{worker}: an abandoned lease was never taken over: {row}")
                elif after < LEASE_S - 0.2 or after > LEASE_S + 1.5:
                    failures.append(f"{worker}: a {LEASE_S} s lease was taken over after {after} s")
                elif row["fencing"][1] != row["fencing"][0] + 1:
                    failures.append(f"{worker}: fencing {row['fencing']} across the takeover")
        for worker, rows in notes["retentions"].items():
            # The reaper of a replica given another node reads that node's
            # clock: a result may go up to the skew early, never later.
            early = SKEW_S if worker == "worker2" else 0.0
            for row in rows:
                last, gone = row["last_replay_s"], row["first_gone_s"]
                if last is None or last < RETENTION_S - early - 0.3:
                    failures.append(f"{worker}: a {RETENTION_S} s result stopped replaying at {last} s")
                if gone is None or gone > RETENTION_S + 1.5 or (last is not None and last > RETENTION_S + 0.3):
                    failures.append(f"{worker}: a {RETENTION_S} s result replayed until {last} s, gone at {gone} s")
        return failures


SCENARIO = CitusClockSkew()
