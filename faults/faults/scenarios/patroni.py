"""Automatic failover with Patroni (issue 21): the leader node killed under
load; 0 acknowledged completions lost, and the time until the replicas
serve again beside Patroni's ttl.

Debian's packages (faults/infra/patroni.py, installed when missing): etcd
(one member), two Patroni nodes in `synchronous_mode_strict` (the standby
is the synchronous one: a COMMIT returns once it has flushed the WAL), and
HAProxy in front, routing to the node whose Patroni answers `/primary`
with 200 (checked every 500 ms, down after 3 failures, up after 2: Patroni's
example configuration, at 500 ms instead of 3 s). The
replicas' DATABASE_URL names HAProxy. Everything listens on free ports of
127.0.0.1; ttl 10 s, loop_wait 1 s, retry_timeout 3 s
(FAULTS_PATRONI_TTL changes the ttl).

FAULTS_PATRONI_HAPROXY_RISE=1 marks the new primary up after one check:
Patroni's /primary answers 200 from its promote request on, ~0.1 s before
PostgreSQL has left recovery, and a check in that gap sends the replicas'
connections to a read-only server; the service then answered INTERNAL
("cannot execute SELECT in a read-only transaction", SQLSTATE 25006) where
UNAVAILABLE was due (1 run of 5 with rise 1, on 2 December 2026). The run fails
on any code other than UNAVAILABLE, DEADLINE_EXCEEDED, FAILED_PRECONDITION.

Under load the leader node dies: SIGKILL to its Patroni and to its
postmaster's process group (backends and walsenders with it). The standby's
Patroni takes the leader key once the dead leader's lease has run out (the
ttl) and promotes its PostgreSQL; HAProxy's check then finds it. In
synchronous_mode_strict the new primary has no synchronous standby: its
`synchronous_standby_names` is `*`, so it answers reads but every COMMIT
waits. The killed node's Patroni is started again once the standby holds
the leader key (as its supervisor would bring the node back): it does crash
recovery, pg_rewind against the new primary, and streams as the
synchronous standby; the waiting commits then return.

Measured from the kill: `promoted` (the standby's /primary answers 200),
`serving` (every replica answers health SERVING again, after the
promotion), `calls_ok` (every replica answered a Claim of a fresh key, a
write, without retries: probes every 250 ms on each replica), `healed` (the
old leader is the synchronous standby in Patroni's view, /sync 200).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import time
from typing import Dict, Optional

from faults.infra import patroni
from faults.scenario import Env, Scenario

#: codes a call may fail with while there is no primary or commits wait
EXPECTED_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "FAILED_PRECONDITION")


class PatroniFailover(Scenario):
    name = "patroni"
    description = ("Patroni (etcd, HAProxy on /primary), 2 nodes in synchronous_mode_strict: the leader's "
                   "Patroni and postmaster SIGKILLed under load; time until the replicas serve again vs the ttl")
    replicas = 3
    store = "postgres"
    own_database = True  # the Patroni cluster's, through HAProxy
    ci_duration = 4.0
    workload = {"lease_ttl": 3.0, "call_timeout": 15.0}

    def __init__(self) -> None:
        self.ttl = int(os.environ.get("FAULTS_PATRONI_TTL", "10") or 10)
        self.loop_wait = 1
        self.retry_timeout = 3
        #: HAProxy's checks that mark the new primary up (FAULTS_PATRONI_HAPROXY_RISE)
        self.haproxy_rise = int(os.environ.get("FAULTS_PATRONI_HAPROXY_RISE", "2") or 2)
        self.cluster: Optional[patroni.PatroniCluster] = None

    def available(self):
        try:
            patroni.ensure_packages()
        except RuntimeError as error:
            return str(error)
        return None

    async def prepare(self, env: Env) -> None:
        swept = await asyncio.to_thread(patroni.sweep)  # what a killed run left
        if swept:
            env.note("swept", swept)
        self.cluster = patroni.PatroniCluster(nodes=2, ttl=self.ttl, loop_wait=self.loop_wait,
                                              retry_timeout=self.retry_timeout,
                                              haproxy={"rise": self.haproxy_rise})
        env.add_cleanup(lambda: self._remove(env))
        started = time.monotonic()
        await asyncio.to_thread(self.cluster.start)
        roles = await asyncio.to_thread(self.cluster.wait_synchronous)
        await asyncio.to_thread(self.cluster.psql, "CREATE DATABASE idempotency")
        env.database_url = self.cluster.url("idempotency")
        env.note("versions", patroni.versions())
        env.note("patroni", {"ttl_s": self.ttl, "loop_wait_s": self.loop_wait,
                             "retry_timeout_s": self.retry_timeout, "synchronous_mode_strict": True,
                             "haproxy_check": f"OPTIONS /primary every 500 ms, fall 3, rise {self.haproxy_rise}"})
        env.note("members_before", roles)
        env.note("cluster_ready_s", round(time.monotonic() - started, 1))

    async def inject(self, env: Env) -> None:
        cluster = self.cluster
        await env.sleep_load(2.0)
        leader = await asyncio.to_thread(cluster.leader)
        if leader is None:
            raise RuntimeError("no leader before the fault")
        standby = next(n for n in cluster.nodes if n is not leader)
        if not await asyncio.to_thread(standby.is_sync_standby):
            raise RuntimeError(f"{standby.name} is not the synchronous standby before the fault")

        kill = env.mark("fault")
        pids = await asyncio.to_thread(leader.crash)
        env.log(f"{leader.name} killed (patroni {pids['patroni']}, postmaster {pids['postmaster']})")
        probes = asyncio.create_task(self._write_probes(env, timeout=self.ttl + 60))
        not_serving = asyncio.create_task(env.wait_health("NOT_SERVING", timeout=self.ttl + 30))
        serving_task = None
        try:
            promoted = await self._until(env, standby.is_primary, self.ttl + 60,
                                         f"{standby.name} never became primary")
            env.history.mark("promoted", promoted)
            env.log(f"{standby.name} primary after {promoted - kill:.2f} s (ttl {self.ttl} s)")
            # From the promotion on, each replica's first SERVING; meanwhile the
            # supervisor brings the killed node back.
            serving_task = asyncio.create_task(self._serving_after(env, timeout=self.ttl + 60))
            await asyncio.to_thread(leader.start)
            restarted = env.now()
            env.history.mark("restarted", restarted)
            not_serving_at = await not_serving
            serving = await serving_task
            env.history.mark("serving", max(serving.values()))
            calls_ok = await probes
            env.history.mark("calls_ok", max(calls_ok.values()))
            healed = await self._until(env, leader.is_sync_standby, 60,
                                       f"{leader.name} never rejoined as synchronous standby")
            env.history.mark("healed", healed)
        finally:
            for task in (probes, not_serving, serving_task):
                if task is not None:
                    task.cancel()
        env.note("ttl_s", self.ttl)
        env.note("killed", {"node": leader.name, **pids})
        env.note("health_not_serving_after_kill_s", round(not_serving_at - kill, 3))
        env.note("promoted_after_kill_s", round(promoted - kill, 3))
        env.note("restarted_after_kill_s", round(restarted - kill, 3))
        env.note("serving_after_kill_s", {name: round(t - kill, 3) for name, t in serving.items()})
        env.note("calls_ok_after_kill_s", {name: round(t - kill, 3) for name, t in calls_ok.items()})
        again = max(max(serving.values()), max(calls_ok.values()))
        env.note("replicas_serve_again_after_kill_s", round(again - kill, 3))
        env.note("rejoined_sync_after_kill_s", round(healed - kill, 3))
        env.note("members_after", {m["name"]: f"{m.get('role')}/{m.get('state')}/tl{m.get('timeline')}"
                                   for m in await asyncio.to_thread(cluster.members)})
        env.log(f"every replica SERVING {max(serving.values()) - kill:.2f} s, writes OK "
                f"{max(calls_ok.values()) - kill:.2f} s after the kill (ttl {self.ttl} s); "
                f"{leader.name} synchronous standby again after {healed - kill:.2f} s")

    @staticmethod
    async def _until(env: Env, predicate, timeout: float, message: str) -> float:
        """Polls predicate() (blocking, off the loop) every 50 ms; the env
        time it first held."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await asyncio.to_thread(predicate):
                return env.now()
            await asyncio.sleep(0.05)
        raise RuntimeError(message)

    async def _serving_after(self, env: Env, timeout: float) -> Dict[str, float]:
        """Each replica's first health SERVING from now on (env time)."""
        async def one(replica):
            await replica.wait_serving(timeout)
            return replica.name, env.now()
        return dict(await asyncio.gather(*(one(r) for r in env.replicas)))

    async def _write_probes(self, env: Env, timeout: float) -> Dict[str, float]:
        """For each replica, a Claim of a fresh key (no retries) every 250 ms
        from the kill on, each allowed 5 s, until one answers OK; the env
        time of that answer, per replica."""
        from idempotency_client import AsyncIdempotencyClient

        counter = itertools.count()
        deadline = time.monotonic() + timeout

        async def one(replica) -> tuple:
            done = asyncio.Event()
            first: list = []
            async with AsyncIdempotencyClient(replica.target, timeout=5, retry=None) as client:
                async def attempt() -> None:
                    try:
                        await client.claim("faults-patroni-probe", f"{replica.name}-{next(counter)}",
                                           lease_ttl=1.0)
                    except Exception:
                        return
                    if not first:
                        first.append(env.now())
                    done.set()

                tasks = set()
                while not done.is_set():
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{replica.name}: no write answered OK within {timeout:.0f} s of the kill")
                    task = asyncio.create_task(attempt())
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    try:
                        await asyncio.wait_for(done.wait(), 0.25)
                    except asyncio.TimeoutError:
                        pass
                for task in list(tasks):
                    task.cancel()
            return replica.name, first[0]

        return dict(await asyncio.gather(*(one(r) for r in env.replicas)))

    def expect(self, report):
        failures = []
        for mark in ("promoted", "serving", "calls_ok", "healed"):
            if report.mark(mark) is None:
                failures.append(f"no '{mark}' mark: the failover did not complete")
        odd = {c: n for c, n in report.errors.items() if c not in EXPECTED_CODES}
        if odd:
            failures.append(f"calls failed with unexpected codes: {odd}")
        promoted = report.notes.get("promoted_after_kill_s")
        if promoted is not None and promoted < self.ttl - self.loop_wait - self.retry_timeout:
            failures.append(f"promoted {promoted} s after the kill, before the leader's lease (ttl {self.ttl} s) "
                            "could have run out")
        return failures

    async def cleanup(self, env: Env) -> None:
        await asyncio.to_thread(self._remove, env)

    def _remove(self, env: Env) -> None:
        """Copies the logs (etcd, HAProxy, each node's Patroni and PostgreSQL)
        into the run's logs/, then kills everything and deletes the folder."""
        cluster, self.cluster = self.cluster, None
        if cluster is None:
            return
        logs = env.tmpdir / "logs" / "patroni"
        try:
            logs.mkdir(parents=True, exist_ok=True)
            for name, path in cluster.logs().items():
                shutil.copy(path, logs / name)
        except OSError:
            pass
        cluster.remove()


SCENARIO = PatroniFailover()
