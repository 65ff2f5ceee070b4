"""What the citus_* scenarios share (issue 21): a Citus cluster of their own
(faults/infra/citus.py: a coordinator and two workers on free ports, the
database `idempotency` with the citus extension on every node, the workers
registered), the replicas pointed at the coordinator (they migrate, and
their migration distributes idempotency_records by key over 32 shards), and
the rule that they run only where Citus is installed.

Citus is never installed by the project. Where `$(pg_config
--pkglibdir)/citus.so` is absent, each Citus scenario prints one line
saying so and is reported as not run (neither passed nor failed);
FAULTS_CITUS=1 requires Citus (its absence fails the run), FAULTS_CITUS=0
leaves the scenarios out.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import time
from typing import Dict, List, Optional

from faults.infra import citus
from faults.scenario import Env, Scenario

#: codes a call may fail with while a Citus node is down
EXPECTED_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED")


class CitusScenario(Scenario):
    """Base of the citus_* scenarios: the cluster, its notes and its cleanup."""

    store = "postgres"
    own_database = True  # the Citus coordinator's
    replicas = 3
    #: settings of every node over faults/infra/citus.py's
    cluster_settings: Dict[str, object] = {}

    def __init__(self) -> None:
        self.cluster: Optional[citus.CitusCluster] = None

    def not_run(self) -> Optional[str]:
        wanted = citus.wanted()
        if wanted is False:
            return "FAULTS_CITUS=0"
        if wanted is True:
            return None  # required: available() fails the run when it is absent
        reason = citus.missing()
        return f"{reason} (FAULTS_CITUS=1 makes its absence a failure)" if reason else None

    def available(self) -> Optional[str]:
        reason = citus.missing()
        return f"FAULTS_CITUS=1 but {reason}" if reason else None

    async def prepare(self, env: Env) -> None:
        swept = await asyncio.to_thread(citus.sweep)  # what a killed run left
        if swept:
            env.note("swept", swept)
        self.cluster = citus.CitusCluster(workers=2, database="idempotency", settings=self.cluster_settings)
        env.add_cleanup(lambda: self._remove(env))
        started = time.monotonic()
        await asyncio.to_thread(self.cluster.start)
        env.database_url = self.cluster.url()
        env.note("citus", self.cluster.version)
        env.note("cluster_ready_s", round(time.monotonic() - started, 1))

    async def distributed(self, env: Env) -> Dict[str, int]:
        """After the replicas' start: the shards per node (port), and a note
        of them and of the nodes' ports."""
        cluster = self.cluster
        shards = await asyncio.to_thread(cluster.shards_by_port)
        env.note("nodes", {node.name: node.port for node in cluster.nodes})
        env.note("shards_by_node", {self.node_name(port): n for port, n in shards.items()})
        return shards

    def give_replicas(self, env: Env, nodes) -> None:
        """Before the replicas start: replica i is given nodes[i mod len]
        (its DATABASE_URL), noted as replicas_on."""
        given = [nodes[i % len(nodes)] for i in range(self.replicas)]
        for i, node in enumerate(given):
            env.replica_envs[i] = {"DATABASE_URL": node.url(self.cluster.database) + "?sslmode=disable"}
        env.note("replicas_on", [node.name for node in given])

    def node_name(self, port: int) -> str:
        return next((n.name for n in self.cluster.nodes if n.port == port), str(port)) if self.cluster else str(port)

    async def cleanup(self, env: Env) -> None:
        await asyncio.to_thread(self._remove, env)

    def _remove(self, env: Env) -> None:
        """Copies each node's PostgreSQL log into the run's logs/citus/, then
        stops the three clusters and deletes their folder."""
        cluster, self.cluster = self.cluster, None
        if cluster is None:
            return
        logs = env.tmpdir / "logs" / "citus"
        try:
            logs.mkdir(parents=True, exist_ok=True)
            for name, path in cluster.logs().items():
                shutil.copy(path, logs / name)
        except OSError:
            pass
        cluster.remove()


def odd_codes(report) -> List[str]:
    """Failures for calls or attempts that ended in a code other than OK, a
    verdict, or EXPECTED_CODES (INTERNAL: the service took a Citus error for a bug)."""
    verdicts = ("OK", "FAILED_PRECONDITION", "NOT_FOUND", "ALREADY_EXISTS", "ABORTED")
    failures = []
    odd = {c: n for c, n in report.errors.items() if c not in EXPECTED_CODES + verdicts}
    if odd:
        texts = sorted({f"{c['code']}: {c.get('error', '')}" for c in report.history.calls
                        if c["code"] in odd})[:3] if report.history else []
        failures.append(f"calls failed with unexpected codes: {odd}; the service said: {texts} "
                        "(the replicas' logs: faults/out/<name>.logs/)")
    odd = {c: n for c, n in report.attempt_errors.items() if c not in EXPECTED_CODES + verdicts}
    if odd:
        failures.append(f"attempts failed with unexpected codes: {odd}")
    return failures


class _Prober:
    """What both kinds of probes share: the keys each group may still use
    (`keys[group]`, each used once), the rows recorded, and the task that
    sends a probe every `every` seconds until `stop`."""

    #: seconds between probes, unless given
    every = 0.1

    def __init__(self, env: Env, keys: Dict[str, List[str]], namespace: str, every: Optional[float] = None,
                 timeout: float = 3.0):
        self.env = env
        self.keys = {group: iter(list(ks)) for group, ks in keys.items()}
        self.namespace = namespace
        self.every = self.every if every is None else every
        self.timeout = timeout
        self.rows: List[dict] = []
        self._stop = asyncio.Event()
        self._task: Optional[asyncio.Task] = None

    def start(self):
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        raise NotImplementedError


class Probes(_Prober):
    """Claims of fresh keys, one every `every` seconds per group of keys (no
    retries, one replica each time, round-robin), recorded: (start, end,
    group, code, error text). `keys[group]` lists keys that group may use
    (each used once)."""


    async def _run(self) -> None:
        from idempotency_client import AsyncIdempotencyClient, IdempotencyError

        env = self.env
        clients = [AsyncIdempotencyClient(r.target, timeout=self.timeout, retry=None) for r in env.replicas]
        turn = itertools.count()
        pending = set()

        async def one(group: str, key: str) -> None:
            client = clients[next(turn) % len(clients)]
            row = {"start": env.now(), "group": group, "key": key}
            try:
                await client.claim(self.namespace, key, lease_ttl=1.0)
                row["code"] = "OK"
            except IdempotencyError as error:
                row["code"] = error.code.name if error.code is not None else type(error).__name__
                row["error"] = str(error)[:300]
            except Exception as error:  # the probe itself must not stop the run
                row["code"] = type(error).__name__
                row["error"] = str(error)[:300]
            row["end"] = env.now()
            self.rows.append(row)

        try:
            while not self._stop.is_set():
                for group, keys in self.keys.items():
                    key = next(keys, None)
                    if key is not None:
                        task = asyncio.create_task(one(group, key))
                        pending.add(task)
                        task.add_done_callback(pending.discard)
                try:
                    await asyncio.wait_for(self._stop.wait(), self.every)
                except asyncio.TimeoutError:
                    pass
            if pending:
                await asyncio.wait(pending, timeout=self.timeout + 2)
        finally:
            for task in list(pending):
                task.cancel()
            for client in clients:
                try:
                    await client.close()
                except Exception:
                    pass

    def first_ok(self, group: str, after: float) -> Optional[float]:
        """When the first probe of `group` started at or after `after` answered OK."""
        return min((r["end"] for r in self.rows if r["group"] == group and r["start"] >= after
                    and r["code"] == "OK"), default=None)

    def window(self, group: str, start: float, end: float) -> List[dict]:
        """The probes of `group` that started and ended within [start, end]."""
        return [r for r in self.rows if r["group"] == group and start <= r["start"] and r["end"] <= end]

    @staticmethod
    def tally(rows: List[dict]) -> Dict[str, object]:
        codes: Dict[str, int] = {}
        for r in rows:
            codes[r["code"]] = codes.get(r["code"], 0) + 1
        ok = codes.get("OK", 0)
        return {"probes": len(rows), "ok": ok, "ok_share": round(ok / len(rows), 4) if rows else None,
                "codes": codes}


class BatchProbes(_Prober):
    """ClaimBatch and CompleteBatch with item_errors, one pair every `every`
    seconds (no retries, one replica each time, round-robin): each batch
    names one fresh key of every group (`keys[group]`, each used once), and
    its claimed items are then completed in one CompleteBatch. Recorded per
    batch: (start, end, the call's own code, and per group the Claim item's
    and the Complete item's code: OK, or the item's status name)."""

    every = 0.2

    @staticmethod
    def _name(error) -> str:
        code = getattr(error, "code", None)
        return code.name if code is not None else type(error).__name__

    async def _run(self) -> None:
        from idempotency_client import AsyncIdempotencyClient, ClaimItem, CompleteItem, IdempotencyError

        env = self.env
        clients = [AsyncIdempotencyClient(r.target, timeout=self.timeout, retry=None) for r in env.replicas]
        turn = itertools.count()

        async def one(picked: Dict[str, str]) -> None:
            client = clients[next(turn) % len(clients)]
            groups = list(picked)
            row = {"start": env.now(), "keys": picked, "claim": {}, "complete": {}}
            try:
                claimed = await client.claim_batch(
                    [ClaimItem(self.namespace, picked[g], lease_ttl=5.0) for g in groups], item_errors=True)
                row["call"] = "OK"
                done = []
                for group, result in zip(groups, claimed):
                    row["claim"][group] = "OK" if result.ok else self._name(result.error)
                    if result.claimed:
                        done.append((group, CompleteItem(self.namespace, picked[group], result.lease_token, b"p")))
                if done:
                    try:
                        results = await client.complete_batch([item for _, item in done], item_errors=True)
                        for (group, _), result in zip(done, results):
                            row["complete"][group] = "OK" if result.ok else self._name(result.error)
                    except IdempotencyError as error:
                        for group, _ in done:
                            row["complete"][group] = "call " + self._name(error)
            except IdempotencyError as error:
                row["call"] = self._name(error)
                row["error"] = str(error)[:300]
            except Exception as error:  # the probe itself must not stop the run
                row["call"] = type(error).__name__
                row["error"] = str(error)[:300]
            row["end"] = env.now()
            self.rows.append(row)

        pending = set()
        try:
            while not self._stop.is_set():
                picked = {group: next(keys, None) for group, keys in self.keys.items()}
                if all(picked.values()):
                    task = asyncio.create_task(one(picked))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                try:
                    await asyncio.wait_for(self._stop.wait(), self.every)
                except asyncio.TimeoutError:
                    pass
            if pending:
                await asyncio.wait(pending, timeout=2 * self.timeout + 2)
        finally:
            for task in list(pending):
                task.cancel()
            for client in clients:
                try:
                    await client.close()
                except Exception:
                    pass

    def window(self, start: float, end: float) -> List[dict]:
        """The batches that started and ended within [start, end]."""
        return [r for r in self.rows if start <= r["start"] and r["end"] <= end]

    @staticmethod
    def tally(rows: List[dict]) -> Dict[str, object]:
        """How many batches; the calls' own codes; per group, the Claim and
        Complete items' codes."""
        out: Dict[str, object] = {"batches": len(rows), "calls": {}, "claim": {}, "complete": {}}
        for r in rows:
            out["calls"][r["call"]] = out["calls"].get(r["call"], 0) + 1
            for part in ("claim", "complete"):
                for group, code in r[part].items():
                    codes = out[part].setdefault(group, {})
                    codes[code] = codes.get(code, 0) + 1
        return out
