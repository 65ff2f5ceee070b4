"""The workload with a history.

Simulated consumers (asyncio tasks) process events. Each event key is
delivered `deliveries` times, the first two at once (two consumers race for
it), the others a moment later. A consumer runs the client's once() helper
(AsyncOnce): it Claims the key (retry-safe: its own lease token, the same on
every attempt of that Claim), applies the effect, then Completes. A Claim that
meets another holder waits for it on the server (once()'s default,
ClaimRequest.wait) and comes back with its result or the lease. Some
consumers fail and Release (the work raises); some vanish after the Claim
(a plain Claim, then no Complete, no Release: the lease runs out and a waiting
Claim or a redelivery takes the key over). A delivery whose wait ran out
(InProgress) or whose call failed is redelivered later, as a broker would.

The effect is a row in a ledger table in a separate database (a fresh one on
the machine's main PostgreSQL), written only when its fencing token is higher
than any the ledger holds for the key: one guarded upsert; a refused write is
recorded, and its consumer Releases.

Every logical call is recorded (op, key, start, end, answer or error code,
attempts; once()'s calls through RecordedCalls; a Claim's `wait` and the
`waited` of its answer) and so is every attempt (a grpc.aio interceptor per
address: start, end, target, code), with times in seconds since the run
started (History.now()).
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import json
import logging
import os
import random
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable, Dict, List, Optional, Tuple

import asyncpg
import grpc
import grpc.aio
from idempotency_client import (
    BYTES,
    AsyncIdempotencyClient,
    AsyncOnce,
    FingerprintMismatch,
    IdempotencyError,
    InProgress,
    LeaseLost,
    Outcome,
    RetryPolicy,
)
from idempotency_client.channels import Endpoints, aio_endpoints
from idempotency_client.client import new_lease_token
from idempotency_client.once import Settings, wait_within

#: The logical call an attempt belongs to (set around each call).
CURRENT_CALL: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("faults_call", default=None)

#: A call that has not returned this long after its deadline has "no answer".
NO_ANSWER_GRACE = 2.0

#: The machine's PostgreSQL, where the ledger database is created.
MAIN_POSTGRES = "postgres://postgres@127.0.0.1:5432"


@dataclass
class Options:
    """The workload's knobs (a scenario sets some in `workload = {...}` or in
    prepare() through env.workload)."""

    #: concurrent consumers
    consumers: int = 16
    #: seconds of load (new events); the load also lasts until inject() returns
    duration: float = 5.0
    #: seconds of load after inject() returned (the recovery is measured there)
    tail: float = 1.0
    #: deliveries per event key (the first two concurrent)
    deliveries: int = 3
    #: lease of every Claim, seconds
    lease_ttl: float = 3.0
    #: each logical call's deadline (the client's timeout, retries included)
    call_timeout: float = 10.0
    #: share of claimed deliveries that fail and Release
    p_fail: float = 0.05
    #: share of claimed deliveries whose consumer vanishes (lease runs out)
    p_vanish: float = 0.03
    #: seconds of "work" between the Claim and the effect
    work: float = 0.002
    #: most event keys (None: as many as the duration allows)
    max_keys: Optional[int] = None
    #: after the load: how long deliveries still pending may take
    drain_timeout: float = 30.0
    #: the client's retry policy (None: the client's default)
    retry: Optional[RetryPolicy] = None
    #: reaper interval of the replicas (the final check waits that long too)
    reaper_interval: float = 1.0
    #: retention of every Claim and Complete, seconds (None: the server's
    #: default, 24 h); the checker looks for lost completions only within it
    retention: Optional[float] = None
    #: once()'s on_in_progress: "wait" (on the server: a Claim that meets a
    #: holder waits for its result or the lease), "poll", or "raise" (an
    #: IN_PROGRESS delivery is redelivered after retry_after, as a broker
    #: would: the workload before waiting Claims)
    on_in_progress: str = "wait"
    #: once()'s wait_timeout: how long a delivery waits for another holder in
    #: all (each Claim within call_timeout) before it is redelivered
    wait_timeout: float = 8.0


class History:
    """Everything that happened, in seconds since `t0` (time.monotonic())."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        self.calls: List[Dict[str, Any]] = []
        self.attempts: List[Dict[str, Any]] = []
        self.effects: List[Dict[str, Any]] = []
        self.marks: List[Tuple[str, float]] = []
        self.keys: List[str] = []
        self.final: Dict[str, Dict[str, Any]] = {}
        self.ledger: Dict[str, int] = {}
        self.load_end: Optional[float] = None
        #: True once the final Claim of every key ran (stuck keys are counted then)
        self.final_checked = False
        self.counters: Dict[str, int] = {}
        #: the workload's retention in seconds (None: 24 h, longer than any run)
        self.retention: Optional[float] = None
        #: what removed a key's record while the run went on (a Purge that
        #: answered OK, an out-of-band SQL DELETE that committed): {"op",
        #: "key", "start", "end", "effective", ...}; from `effective` on, no
        #: Claim may replay a result completed before `start` (the checker)
        self.removals: List[Dict[str, Any]] = []
        #: the workload's own failures (a consumer's handling of a delivery
        #: raised something it does not expect): each fails the scenario,
        #: since a workload that stops working proves nothing
        self.workload_errors: List[str] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def mark(self, name: str, at: Optional[float] = None) -> float:
        at = self.now() if at is None else at
        self.marks.append((name, at))
        return at

    def bump(self, name: str, by: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + by

    def dump(self, path) -> None:
        """JSON lines: marks, calls, attempts, effects, removals, final answers."""
        with open(path, "w") as out:
            for name, at in self.marks:
                out.write(json.dumps({"type": "mark", "name": name, "at": at}) + "\n")
            for kind, rows in (("call", self.calls), ("attempt", self.attempts), ("effect", self.effects),
                               ("removal", self.removals)):
                for row in rows:
                    out.write(json.dumps({"type": kind, **_jsonable(row)}) + "\n")
            for key, row in self.final.items():
                out.write(json.dumps({"type": "final", "key": key, **_jsonable(row)}) + "\n")


class NoAnswer(IdempotencyError):
    """A call once() made had not returned NO_ANSWER_GRACE seconds after its
    deadline (recorded as NO_ANSWER); once() sees it as a failed call."""


class WorkFailed(Exception):
    """The work failed on purpose (p_fail): once() Releases the key."""


class EffectRefused(Exception):
    """The ledger refused the effect (a newer lease wrote first), or failed
    (`retry`): once() Releases the key."""

    def __init__(self, retry: bool):
        super().__init__("ledger failed" if retry else "a newer lease wrote first")
        self.retry = retry


def _jsonable(row: Dict[str, Any]) -> Dict[str, Any]:
    return {k: (v.decode(errors="replace") if isinstance(v, bytes) else v) for k, v in row.items()}


class _Recorder(grpc.aio.UnaryUnaryClientInterceptor):
    """Records every attempt made on one address."""

    def __init__(self, history: History, target: str):
        self.history = history
        self.target = target

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        row = {"call": CURRENT_CALL.get(), "op": _method(client_call_details.method), "target": self.target,
               "start": self.history.now()}
        code = "UNKNOWN"
        try:
            call = await continuation(client_call_details, request)
            try:
                await call
                code = "OK"
            except grpc.aio.AioRpcError as error:
                code = error.code().name
            return call
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            row["end"] = self.history.now()
            row["code"] = code
            self.history.attempts.append(row)


def _method(method) -> str:
    if isinstance(method, bytes):
        method = method.decode()
    return method.rsplit("/", 1)[-1]


def make_client(targets: List[str], history: History, options: Options) -> AsyncIdempotencyClient:
    """An AsyncIdempotencyClient over `targets` whose every attempt is recorded
    (one channel per address, each with its own recording interceptor)."""
    kwargs = {"timeout": options.call_timeout}
    if options.retry is not None:
        kwargs["retry"] = options.retry
    client = AsyncIdempotencyClient(list(targets), **kwargs)
    unused = client._endpoints.channels
    endpoints = []
    for target in targets:
        endpoints.extend(aio_endpoints([target], None, None, [_Recorder(history, target)])._endpoints)
    if len(endpoints) > 1:
        for endpoint in endpoints:
            endpoint.channel.get_state(try_to_connect=True)
    client._endpoints = Endpoints(endpoints, lambda endpoint: endpoint.channel.get_state(try_to_connect=True))
    client._unused_channels = unused
    return client


class RecordedCalls:
    """The calls once() makes (idempotency_client's AsyncLeaseCalls), each
    made on the workload's client and recorded as a logical call of the
    history, the same as the calls the workload makes itself; a failed call
    raises its error to once() after it is recorded."""

    def __init__(self, workload: "Workload", who: str):
        self._workload = workload
        self._who = who
        self.timeout = workload.client.timeout
        #: shared with the client: what its Claims learned of waiting
        self.wait_support = workload.client.wait_support
        self._fence: Optional[int] = None

    async def claim(self, namespace, key, *, fingerprint=b"", lease_ttl=None, retention=None, wait=None,
                    late_retry=None):
        workload = self._workload
        token = new_lease_token()
        rec, result = await workload.call(
            "Claim", key, self._who,
            lambda: workload.client.claim(namespace, key, fingerprint=fingerprint, lease_ttl=lease_ttl,
                                          retention=retention, lease_token=token, wait=wait,
                                          late_retry=late_retry),
            raise_errors=True, token=token, wait=wait and wait_within(wait, self.timeout))
        workload._claimed(rec, result, asked_to_wait=wait is not None)
        if result.outcome is Outcome.CLAIMED:
            self._fence = result.fencing_token
        return result

    async def complete(self, namespace, key, lease_token, response=b"", *, retention=None):
        workload = self._workload
        _, result = await workload.call(
            "Complete", key, self._who,
            lambda: workload.client.complete(namespace, key, lease_token, response, retention=retention),
            raise_errors=True, lease=lease_token, fence=self._fence, response=response)
        return result

    async def release(self, namespace, key, lease_token, *, checkpoint=None):
        workload = self._workload
        await workload.call(
            "Release", key, self._who,
            lambda: workload.client.release(namespace, key, lease_token, checkpoint=checkpoint),
            raise_errors=True, lease=lease_token)

    async def extend_lease(self, namespace, key, lease_token, *, lease_ttl=None, checkpoint=None, timeout=None):
        workload = self._workload
        _, result = await workload.call(
            "ExtendLease", key, self._who,
            lambda: workload.client.extend_lease(namespace, key, lease_token, lease_ttl=lease_ttl,
                                                 checkpoint=checkpoint, timeout=timeout),
            raise_errors=True, lease=lease_token)
        return result


class Ledger:
    """The downstream the effects go to: a fresh database on the main
    PostgreSQL, one row per key, written only with a higher fencing token."""

    def __init__(self, base_url: str = MAIN_POSTGRES):
        self.base_url = base_url.rstrip("/")
        # The pid in the name lets a later run drop the ledger of a run that was killed.
        self.name = f"faults_ledger_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.pool: Optional[asyncpg.Pool] = None

    async def open(self) -> None:
        admin = await asyncpg.connect(f"{self.base_url}/postgres", timeout=10)
        try:
            for row in await admin.fetch("SELECT datname FROM pg_database WHERE datname LIKE 'faults\\_ledger\\_%'"):
                parts = row["datname"].split("_")
                if len(parts) == 4 and parts[2].isdigit() and not os.path.exists(f"/proc/{parts[2]}"):
                    await admin.execute(f'DROP DATABASE IF EXISTS "{row["datname"]}" WITH (FORCE)')
            await admin.execute(f"CREATE DATABASE {self.name}")
        finally:
            await admin.close()
        self.pool = await asyncpg.create_pool(f"{self.base_url}/{self.name}", min_size=2, max_size=8, timeout=10)
        await self.pool.execute(
            "CREATE TABLE ledger (key text PRIMARY KEY, fence bigint NOT NULL, worker text NOT NULL, "
            "applied int NOT NULL DEFAULT 1)"
        )

    async def apply(self, key: str, fence: int, worker: str) -> bool:
        """The guarded upsert: True when the write was accepted."""
        row = await self.pool.fetchrow(
            "INSERT INTO ledger (key, fence, worker) VALUES ($1, $2, $3) "
            "ON CONFLICT (key) DO UPDATE SET fence = EXCLUDED.fence, worker = EXCLUDED.worker, "
            "applied = ledger.applied + 1 WHERE ledger.fence < EXCLUDED.fence RETURNING fence",
            key, fence, worker, timeout=10,
        )
        return row is not None

    async def rows(self) -> Dict[str, int]:
        return {r["key"]: r["fence"] for r in await self.pool.fetch("SELECT key, fence FROM ledger")}

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
        try:
            admin = await asyncpg.connect(f"{self.base_url}/postgres", timeout=10)
            try:
                await admin.execute(f"DROP DATABASE IF EXISTS {self.name} WITH (FORCE)")
            finally:
                await admin.close()
        except Exception:  # best effort: the database is uniquely named
            pass


class Workload:
    """Runs the consumers against `targets` and records the history."""

    def __init__(self, targets: List[str], options: Options, history: History, ledger: Ledger,
                 namespace: Optional[str] = None):
        self.targets = list(targets)
        self.options = options
        self.history = history
        self.ledger = ledger
        self.namespace = namespace or f"faults-{uuid.uuid4().hex[:8]}"
        self.client: Optional[AsyncIdempotencyClient] = None
        self._ids = itertools.count(1)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pending = 0
        self._producing = True
        self._drained = asyncio.Event()
        self._timers: List[asyncio.TimerHandle] = []
        self._latest_lease_expiry = 0.0  # wall clock
        history.retention = options.retention

    # -- calls -------------------------------------------------------------
    async def call(self, op: str, key: str, who: str, make: Callable[[], Awaitable[Any]],
                   raise_errors: bool = False, **extra) -> Tuple[Dict[str, Any], Any]:
        """One logical call, recorded: (record, result or None). With
        raise_errors, a failed call raises its error (NoAnswer when it did
        not return in time) once it is recorded."""
        timeout = self.options.call_timeout
        rec: Dict[str, Any] = {"id": next(self._ids), "op": op, "key": key, "who": who,
                               "start": self.history.now(), "deadline": timeout, **extra}
        token = CURRENT_CALL.set(rec["id"])
        result = None
        try:
            result = await asyncio.wait_for(make(), timeout + NO_ANSWER_GRACE)
            rec["code"] = "OK"
        except asyncio.TimeoutError:
            rec["code"] = "NO_ANSWER"
            if raise_errors:
                raise NoAnswer(f"{op} {key}: no answer {NO_ANSWER_GRACE} s after the deadline")
        except asyncio.CancelledError:  # the run was aborted
            rec["code"] = "CANCELLED"
            rec["aborted"] = True
            raise
        except IdempotencyError as error:
            rec["code"] = error.code.name if error.code is not None else type(error).__name__
            rec["error"] = str(error)[:300]
            if raise_errors:
                raise
        finally:
            CURRENT_CALL.reset(token)
            rec["end"] = self.history.now()
            self.history.calls.append(rec)
        return rec, result

    def _claimed(self, rec: Dict[str, Any], result, asked_to_wait: bool = False) -> None:
        rec["outcome"] = result.outcome.name
        if asked_to_wait:
            # Claims that asked to wait: the server waited for a holder, answered
            # at once (nothing to wait for, or its waiter limit), or ignored the
            # field (a server that predates waiting: once() polls).
            if result.waited is None:
                self.history.bump("wait_claims_ignored")
            else:
                rec["waited"] = result.waited.total_seconds()
                self.history.bump("wait_claims_waited" if rec["waited"] > 0 else "wait_claims_at_once")
        if result.outcome is Outcome.CLAIMED:
            rec["fence"] = result.fencing_token
            rec["lease"] = result.lease_token
            rec["retried"] = result.retried
            if result.lease_expires_at is not None:
                self._latest_lease_expiry = max(self._latest_lease_expiry, result.lease_expires_at.timestamp())
        elif result.outcome is Outcome.COMPLETED:
            rec["response"] = result.response

    # -- deliveries --------------------------------------------------------
    def _deliver(self, key: str, delay: float = 0.0) -> None:
        self._pending += 1
        if delay <= 0:
            self._queue.put_nowait(key)
        else:
            self._timers.append(asyncio.get_running_loop().call_later(delay, self._queue.put_nowait, key))

    def _done(self) -> None:
        self._pending -= 1
        if self._pending == 0 and not self._producing:
            self._drained.set()

    async def _consumer(self, index: int) -> None:
        who = f"c{index}"
        while True:
            key = await self._queue.get()
            if key is None:
                return
            try:
                await self._handle(key, who)
            except Exception as error:  # the workload's own bug: recorded, the consumer goes on
                if len(self.history.workload_errors) < 20:
                    self.history.workload_errors.append(f"{type(error).__name__}: {error}"[:300])
            finally:
                self._done()

    async def _handle(self, key: str, who: str) -> None:
        o = self.options
        luck = random.random()
        if luck < o.p_vanish and self._producing:
            await self._vanish(key, who)
            return
        fail = o.p_vanish <= luck < o.p_vanish + o.p_fail
        ns = self.namespace

        async def work(*, run) -> bytes:
            if fail:
                self.history.bump("failed_work")
                raise WorkFailed()
            if o.work:
                await asyncio.sleep(o.work)
            fence, lease = run.fencing_token, run.claim.lease_token
            effect = {"key": key, "fence": fence, "lease": lease, "who": who, "start": self.history.now()}
            try:
                effect["accepted"] = await self.ledger.apply(key, fence, f"{who}/{lease[:8]}")
            except Exception as error:  # the ledger failed: the work failed
                effect["accepted"] = None
                effect["error"] = str(error)[:200]
            effect["end"] = self.history.now()
            self.history.effects.append(effect)
            if not effect["accepted"]:
                # A newer lease wrote already (ours ran out): give the key back.
                raise EffectRefused(retry=effect["accepted"] is None)
            return f"{key}|{fence}|{lease[:12]}".encode()

        settings = Settings(namespace=ns, key=key, lease_ttl=o.lease_ttl, retention=o.retention,
                            on_in_progress=o.on_in_progress, wait_timeout=o.wait_timeout, serializer=BYTES,
                            heartbeat=False)  # the lease is never extended: the work is short
        try:
            await AsyncOnce(RecordedCalls(self, who), settings).run(work)
        except InProgress as busy:
            # Another holder still had the key when the wait ran out (or at
            # once, with "raise"): not acked, the broker redelivers.
            self.history.bump("redelivered_in_progress")
            wait = busy.retry_after.total_seconds() if busy.retry_after is not None else 0.5
            self._deliver(key, min(max(wait, 0.05), o.lease_ttl + 0.5))
        except WorkFailed:
            self._deliver(key, 0.05)
        except EffectRefused as refused:
            if refused.retry:
                self._deliver(key, 0.2)
        except FingerprintMismatch:
            self.history.bump("unexpected_outcome")  # the workload sends no fingerprint
        except (LeaseLost, IdempotencyError):
            self._deliver(key, 0.2)  # a call failed (recorded): a redelivery replays or takes over
        # Otherwise: the work ran and was completed, or the stored result was
        # replayed; acked.

    async def _vanish(self, key: str, who: str) -> None:
        """A consumer that dies after its Claim: no effect, no Complete, no
        Release. The message was not acked: redelivered after the lease."""
        o = self.options
        ns = self.namespace
        token = new_lease_token()
        # It asks to wait as once() would: unless the server ignores it.
        asks = o.on_in_progress == "wait" and self.client.wait_support.worth_asking()
        wait = o.wait_timeout if asks else None
        rec, result = await self.call(
            "Claim", key, who, lambda: self.client.claim(ns, key, lease_ttl=o.lease_ttl, lease_token=token,
                                                      retention=o.retention, wait=wait),
            token=token, wait=wait and wait_within(wait, self.client.timeout))
        if result is None:
            self._deliver(key, 0.2)  # not acked: the broker redelivers
            return
        self._claimed(rec, result, asked_to_wait=wait is not None)
        if result.outcome is Outcome.COMPLETED:
            return  # the replay: ack
        if result.outcome is Outcome.IN_PROGRESS:
            self.history.bump("redelivered_in_progress")
            wait = result.retry_after.total_seconds() if result.retry_after is not None else 0.5
            self._deliver(key, min(max(wait, 0.05), o.lease_ttl + 0.5))
            return
        if result.outcome is not Outcome.CLAIMED:
            self.history.bump("unexpected_outcome")
            return
        self.history.bump("vanished")
        self._deliver(key, o.lease_ttl + 0.2)

    async def _producer(self) -> None:
        o = self.options
        n = 0
        while self._producing and (o.max_keys is None or n < o.max_keys):
            if self._queue.qsize() >= o.consumers:
                await asyncio.sleep(0.002)
                continue
            key = f"evt-{n:06d}"
            n += 1
            self.history.keys.append(key)
            for i in range(o.deliveries):
                self._deliver(key, 0.0 if i < 2 else random.uniform(0.05, 1.0))
            await asyncio.sleep(0)

    # -- the run -----------------------------------------------------------
    async def start(self) -> None:
        # once() logs a failed Release or heartbeat as a warning; the history
        # records every call already.
        logging.getLogger("idempotency_client").setLevel(logging.ERROR)
        self.client = make_client(self.targets, self.history, self.options)
        self._tasks = [asyncio.create_task(self._consumer(i)) for i in range(self.options.consumers)]
        self._producer_task = asyncio.create_task(self._producer())

    async def stop_load(self) -> None:
        """No new events; wait (at most drain_timeout) for the deliveries
        still pending, then stop the consumers."""
        self._producing = False
        self.history.load_end = self.history.mark("load_end")
        await self._producer_task
        if self._pending == 0:
            self._drained.set()
        try:
            await asyncio.wait_for(self._drained.wait(), self.options.drain_timeout)
        except asyncio.TimeoutError:
            self.history.bump("undrained_deliveries", self._pending)
        self.history.mark("drained")
        for timer in self._timers:
            timer.cancel()
        for _ in self._tasks:
            self._queue.put_nowait(None)
        done, pending = await asyncio.wait(self._tasks, timeout=self.options.call_timeout + NO_ANSWER_GRACE + 1)
        for task in pending:
            task.cancel()

    async def final_check(self, max_wait: float = 30.0) -> None:
        """Once every lease granted has run out and a reaper interval has
        passed: a Claim of every key (the final state). A key found CLAIMED is
        released again."""
        wait = self._latest_lease_expiry + self.options.reaper_interval + 0.5 - time.time()
        if wait > 0:
            await asyncio.sleep(min(wait, max_wait))
        self.history.mark("final_check")
        ns = self.namespace
        sem = asyncio.Semaphore(16)

        async def one(key: str) -> None:
            async with sem:
                token = new_lease_token()
                rec, result = await self.call(
                    "Claim", key, "final", lambda: self.client.claim(ns, key, lease_ttl=5, lease_token=token),
                    token=token, final=True)
                row: Dict[str, Any] = {"code": rec["code"], "start": rec["start"]}
                if result is not None:
                    self._claimed(rec, result)
                    row["outcome"] = result.outcome.name
                    row["response"] = result.response
                    if result.outcome is Outcome.CLAIMED:
                        row["fence"] = result.fencing_token
                        await self.call("Release", key, "final",
                                        lambda: self.client.release(ns, key, result.lease_token), final=True)
                self.history.final[key] = row

        await asyncio.gather(*(one(key) for key in self.history.keys))
        self.history.final_checked = True
        self.history.ledger = await self.ledger.rows()

    async def abort(self) -> None:
        """Stop everything at once (after a failure): producer, consumers, timers."""
        self._producing = False
        for timer in self._timers:
            timer.cancel()
        tasks = [t for t in [getattr(self, "_producer_task", None), *getattr(self, "_tasks", [])] if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            # A call stuck in grpc's cancellation must not hold the run up.
            await asyncio.wait(tasks, timeout=5)

    async def close(self) -> None:
        channels = list(getattr(self.client, "_unused_channels", []))
        if self.client is not None:
            channels += self.client._endpoints.channels
        for channel in channels:
            try:
                await asyncio.wait_for(channel.close(grace=0), 5)
            except Exception:
                pass
