"""Purges and out-of-band SQL DELETEs with the replay cache on (issue 22).

Three replicas on one PostgreSQL, the replay cache on (the default 16 MiB),
the usual workload running. Beside it, round workers each take keys of their
own (`round-NNNNNN`, namespace `faults-purge_replay-rounds`) through rounds:

1. Claim on replica A, Complete with a response unique to the lease;
2. two Claims on each other replica: both must replay it (the second, at
   least, from the cache);
3. the removal, every other round a different kind:
   - a **Purge** RPC on a random replica; once it answered OK, at once, a
     Claim on every replica and a ClaimBatch naming the key twice on one
     (concurrently): none may replay the result;
   - an **out-of-band SQL DELETE** of the completed row (asyncpg, straight to
     the scenario's PostgreSQL); once it committed, at once, a Claim on every
     other replica and a ClaimBatch (these may still replay within the
     documented bound: counted in `replays_within_bound_after_delete`), and
     3 s (the bound) + 50 ms after the commit, the same on every replica:
     none may replay the result;
4. a Claim that won the key after the removal Completes with a new response,
   and a Claim on every replica must replay that one.

Every call goes into the history (op, key, target, start, end, outcome,
response), every removal into History.removals with its start, its end (the
Purge's answer, the DELETE's commit) and the instant from which it is in force
(the Purge's answer; the commit + checker.OUT_OF_BAND_BOUND). The checker
counts a replay of a result the key no longer had as a wrong replay.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import urllib.request
from typing import Any, Dict, List, Optional

import asyncpg
from idempotency_client import IdempotencyError, Outcome
from idempotency_client.client import new_lease_token

from faults.checker import OUT_OF_BAND_BOUND, percentile
from faults.cluster import free_port
from faults.scenario import Env, Scenario
from faults.workload import CURRENT_CALL, NO_ANSWER_GRACE, make_client

NAMESPACE = "faults-purge_replay-rounds"
#: Purges started this long after the load began (the replicas SERVING just
#: before) are past the purger's listener window: their latency is reported apart.
WARM = 3.5


class PurgeReplay(Scenario):
    name = "purge_replay"
    description = ("replay cache on, 3 replicas: rounds of Complete, Claims on the others, then a Purge RPC or "
                   "an out-of-band SQL DELETE, then Claims on every replica; a replay of the removed result is "
                   "a wrong replay")
    workload = {"consumers": 8}
    ci_duration = 8.0
    #: concurrent round workers
    workers = 4

    async def prepare(self, env: Env) -> None:
        # Metrics on (a free port each) to read the cache's hits at the end:
        # without hits the rounds would prove nothing about the cache.
        self.metrics = []
        for i in range(self.replicas):
            addr = f"127.0.0.1:{free_port()}"
            env.replica_envs.setdefault(i, {})["IDEMPOTENCY_METRICS_ADDR"] = addr
            self.metrics.append(addr)
        self.tasks: List[asyncio.Task] = []

    # -- recorded calls ------------------------------------------------------
    async def call(self, env: Env, op: str, key: str, index: int, make, **extra):
        rec: Dict[str, Any] = {"id": next(self.ids), "op": op, "key": key, "who": "round",
                               "target": env.replicas[index].target, "start": env.now(),
                               "deadline": self.timeout, **extra}
        token = CURRENT_CALL.set(rec["id"])
        result = None
        try:
            result = await asyncio.wait_for(make(self.clients[index]), self.timeout + NO_ANSWER_GRACE)
            rec["code"] = "OK"
        except asyncio.TimeoutError:
            rec["code"] = "NO_ANSWER"
        except IdempotencyError as error:
            rec["code"] = error.code.name if error.code is not None else type(error).__name__
            rec["error"] = str(error)[:300]
        finally:
            CURRENT_CALL.reset(token)
            rec["end"] = env.now()
            env.history.calls.append(rec)
        return rec, result

    async def claim(self, env: Env, key: str, index: int):
        token = new_lease_token()
        rec, result = await self.call(env, "Claim", key, index,
                                      lambda c: c.claim(NAMESPACE, key, lease_ttl=30, lease_token=token),
                                      token=token)
        if result is not None:
            rec["outcome"] = result.outcome.name
            if result.outcome is Outcome.CLAIMED:
                rec["fence"] = result.fencing_token
                rec["lease"] = result.lease_token
            elif result.outcome is Outcome.COMPLETED:
                rec["response"] = result.response
        return rec, result

    async def complete(self, env: Env, key: str, index: int, lease: str, fence: int):
        response = f"{key}|{fence}|{lease[:12]}".encode()
        rec, _ = await self.call(env, "Complete", key, index,
                                 lambda c: c.complete(NAMESPACE, key, lease, response),
                                 lease=lease, fence=fence, response=response)
        return rec["code"] == "OK"

    async def claim_batch(self, env: Env, key: str, index: int) -> List[Dict[str, Any]]:
        """A ClaimBatch naming `key` twice; each item recorded as a Claim
        (via "ClaimBatch") with the batch's start and end."""
        tokens = [new_lease_token(), new_lease_token()]
        items = [{"namespace": NAMESPACE, "key": key, "lease_ttl": 30, "lease_token": t} for t in tokens]
        rec, results = await self.call(env, "ClaimBatch", key, index, lambda c: c.claim_batch(items))
        env.history.calls.remove(rec)  # its items stand for it
        recs = []
        for token, result in zip(tokens, results or [None, None]):
            item = dict(rec, id=next(self.ids), op="Claim", via="ClaimBatch", token=token)
            if result is not None:
                item["outcome"] = result.outcome.name
                if result.outcome is Outcome.CLAIMED:
                    item["fence"] = result.fencing_token
                    item["lease"] = result.lease_token
                elif result.outcome is Outcome.COMPLETED:
                    item["response"] = result.response
            env.history.calls.append(item)
            recs.append(item)
        return recs

    async def claim_everywhere(self, env: Env, key: str, indexes, batch: bool = False) -> List[Dict[str, Any]]:
        """A Claim on each replica of `indexes`, concurrently; with `batch`,
        also a ClaimBatch naming the key twice on a random one."""
        indexes = list(indexes)
        calls = [self.claim(env, key, i) for i in indexes]
        if batch:
            calls.append(self.claim_batch(env, key, random.choice(indexes)))
        recs: List[Dict[str, Any]] = []
        for got in await asyncio.gather(*calls):
            recs.extend(got if isinstance(got, list) else [got[0]])
        return recs

    # -- rounds ----------------------------------------------------------------
    async def round(self, env: Env, key: str, kind: str) -> None:
        n = len(env.replicas)
        a = random.randrange(n)
        others = [i for i in range(n) if i != a]
        rec, result = await self.claim(env, key, a)
        if result is None or result.outcome is not Outcome.CLAIMED:
            env.history.bump("round_claim_not_claimed")
            return
        if not await self.complete(env, key, a, result.lease_token, result.fencing_token):
            env.history.bump("round_complete_failed")
            return
        for _ in range(2):
            await self.claim_everywhere(env, key, others)
        removal: Dict[str, Any] = {"op": kind, "key": key}
        if kind == "Purge":
            p = random.randrange(n)
            removal.update(target=env.replicas[p].target, start=env.now())
            rec, _ = await self.call(env, "Purge", key, p,
                                     lambda c: c.purge(NAMESPACE, key, reason="faults purge_replay"))
            removal["end"] = removal["effective"] = rec["end"]
            if rec["code"] != "OK":
                env.history.bump("purge_failed")
                return  # not known to have removed anything
            env.history.removals.append(removal)
            self.purge_latencies.append((rec["start"], rec["end"]))
            self.rounds["Purge"] += 1
            after = await self.claim_everywhere(env, key, range(n), batch=True)
        else:
            removal["start"] = env.now()
            try:
                status = await self.db.execute(
                    "DELETE FROM idempotency_records WHERE namespace = $1 AND key = $2 AND state = 2",
                    NAMESPACE, key, timeout=10)
            except Exception as error:
                env.history.bump("delete_failed")
                env.log(f"DELETE of {key} failed: {error}")
                return
            removal["end"] = env.now()
            removal["effective"] = removal["end"] + OUT_OF_BAND_BOUND
            removal["rows"] = int(status.split()[-1])
            env.history.removals.append(removal)
            if removal["rows"] != 1:
                env.history.bump("delete_found_no_completed_row")
            self.rounds["DELETE"] += 1
            soon = await self.claim_everywhere(env, key, others, batch=True)
            replayed = sum(1 for r in soon if r.get("outcome") == "COMPLETED")
            self.within_bound += replayed
            await asyncio.sleep(max(0.0, removal["effective"] + 0.05 - env.now()))
            after = soon + await self.claim_everywhere(env, key, range(n), batch=True)
        # A Claim that won the key after the removal completes it anew; every
        # replica must then replay the new result.
        won = next((r for r in after if r.get("outcome") == "CLAIMED"), None)
        if won is None:
            env.history.bump("no_claim_won_after_removal")
            return
        index = [r.target for r in env.replicas].index(won["target"])
        if await self.complete(env, key, index, won["lease"], won["fence"]):
            await self.claim_everywhere(env, key, range(n))

    async def worker(self, env: Env, w: int) -> None:
        for r in itertools.count():
            if env.load_left() <= 0.5:
                return
            key = f"round-{w:02d}-{r:05d}"
            kind = "Purge" if r % 2 == 0 else "DELETE"
            if kind == "DELETE":
                # Its wait for the bound runs beside the next rounds.
                self.tasks.append(asyncio.create_task(self.round(env, key, kind)))
                await asyncio.sleep(0.05)
            else:
                await self.round(env, key, kind)

    async def inject(self, env: Env) -> None:
        self.ids = itertools.count(10 ** 9)
        self.timeout = 10.0
        self.rounds = {"Purge": 0, "DELETE": 0}
        self.purge_latencies: List[tuple] = []
        self.within_bound = 0
        self.clients = [make_client([r.target], env.history, env.workload) for r in env.replicas]
        self.db = await asyncpg.create_pool(env.database_url, min_size=1, max_size=self.workers, timeout=10)
        try:
            env.mark("rounds")
            await asyncio.gather(*(self.worker(env, w) for w in range(self.workers)))
            await asyncio.gather(*self.tasks)
            env.mark("rounds_done")
        finally:
            await self.db.close()
            for client in self.clients:
                for channel in [*client._unused_channels, *client._endpoints.channels]:
                    try:
                        await asyncio.wait_for(channel.close(grace=0), 5)
                    except Exception:
                        pass
        hits = await asyncio.to_thread(self.cache_hits)
        env.note("purge_rounds", self.rounds["Purge"])
        env.note("delete_rounds", self.rounds["DELETE"])
        lat = [end - start for start, end in self.purge_latencies]
        steady = [end - start for start, end in self.purge_latencies if start >= WARM]
        env.note("purge_ms", {"p50": _ms(percentile(lat, 50)), "p99": _ms(percentile(lat, 99)),
                              "max": _ms(max(lat) if lat else None)})
        # A purger whose listener has not been up for the whole window waits
        # the bound (README): the first Purges after the replicas started.
        env.note("purges_waiting_the_bound", sum(1 for s in lat if s >= OUT_OF_BAND_BOUND))
        env.note(f"purge_ms_from_{WARM:g}s", {"p50": _ms(percentile(steady, 50)), "p99": _ms(percentile(steady, 99)),
                                             "max": _ms(max(steady) if steady else None)})
        # The Claims the rule applies to: started once a removal of their key was in force.
        in_force: Dict[str, float] = {}
        for r in env.history.removals:
            in_force[r["key"]] = min(in_force.get(r["key"], float("inf")), r["effective"])
        env.note("claims_after_removal", sum(
            1 for c in env.history.calls
            if c["op"] == "Claim" and c["code"] == "OK" and c["start"] >= in_force.get(c["key"], float("inf"))))
        env.note("replays_within_bound_after_delete", self.within_bound)
        env.note("cache_hits", hits)

    def cache_hits(self) -> List[Optional[int]]:
        """Each replica's idempotency_replay_cache_lookups_total{result="hit"}."""
        hits = []
        for addr in self.metrics:
            try:
                text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=5).read().decode()
            except Exception:
                hits.append(None)
                continue
            value = None
            for line in text.splitlines():
                if line.startswith("idempotency_replay_cache_lookups_total") and 'result="hit"' in line:
                    value = int(float(line.rsplit(" ", 1)[-1]))
            hits.append(value)
        return hits

    def expect(self, report) -> List[str]:
        failures = []
        notes = report.notes
        if notes.get("purge_rounds", 0) < 10:
            failures.append(f"only {notes.get('purge_rounds')} Purge rounds")
        if notes.get("delete_rounds", 0) < 5:
            failures.append(f"only {notes.get('delete_rounds')} DELETE rounds")
        hits = notes.get("cache_hits") or []
        if not hits or any(not h for h in hits):
            failures.append(f"a replica's replay cache answered nothing (hits {hits}): the rounds prove nothing")
        for name in ("purge_failed", "delete_failed", "round_claim_not_claimed", "round_complete_failed",
                     "no_claim_won_after_removal", "delete_found_no_completed_row"):
            if report.counters.get(name):
                failures.append(f"{name}: {report.counters[name]}")
        if report.failed_calls:
            failures.append(f"{report.failed_calls} logical calls failed: {report.errors}")
        return failures


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else round(seconds * 1000, 1)


SCENARIO = PurgeReplay()
