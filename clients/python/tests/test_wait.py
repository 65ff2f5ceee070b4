"""Waiting for the holder (ClaimRequest.wait), through both clients, against a
real server: once() meets another holder and its one Claim waits on the
server for the stored result or the lease, instead of polling; claim(wait=)
and ClaimResult.waited; and the fallback to polling against a server that
ignores the field (WaitClearingRelay stands in for one)."""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import grpc
import pytest

from idempotency_client import (
    AsyncIdempotencyClient,
    IdempotencyClient,
    InvalidArgument,
    Outcome,
    RetryPolicy,
    State,
)
from interceptors import AsyncCounting, Counting
from poll import until, until_async
from relay import WaitClearingRelay

#: Concurrent duplicates of one key in each test.
WAITERS = 16

#: How long the holder's work takes once every duplicate has sent its Claim.
HOLDER_WORK_SECONDS = 0.2


class Work:
    """A piece of work that counts its runs (thread-safe)."""

    def __init__(self, result):
        self.result = result
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self):
        with self._lock:
            self.calls += 1
        return self.result


class Holder:
    """A once() on another client whose work starts, then waits until it is
    told to go on, works HOLDER_WORK_SECONDS and returns `result` (or raises
    when `fail`): the holder the duplicates meet."""

    def __init__(self, client, namespace, key, result, fail=False):
        self.started = threading.Event()
        self.go = threading.Event()
        self.runs = 0
        self.result = result
        self.fail = fail
        self.outcome = None
        self._thread = threading.Thread(target=self._run, args=(client, namespace, key), daemon=True)
        self._thread.start()
        assert self.started.wait(10), "the holder's work never started"

    def _work(self):
        self.runs += 1
        self.started.set()
        assert self.go.wait(30)
        time.sleep(HOLDER_WORK_SECONDS)  # the work itself
        if self.fail:
            raise RuntimeError("the holder failed")
        return self.result

    def _run(self, client, namespace, key):
        try:
            self.outcome = client.once(namespace, key).run(self._work)
        except Exception as error:  # noqa: BLE001 - the test inspects it
            self.outcome = error

    def finish(self):
        self.go.set()
        self._thread.join(30)
        assert not self._thread.is_alive()


def once_with_run(client, namespace, key, work, **options):
    with client.once(namespace, key, **options) as run:
        value = run(work)
    return value, run


def duplicates(client, namespace, key, work, count=WAITERS, **options):
    """`count` concurrent once() calls of one key, each on its own thread."""
    pool = ThreadPoolExecutor(count)
    futures = [pool.submit(once_with_run, client, namespace, key, work, **options) for _ in range(count)]
    return pool, futures


@pytest.mark.postgres
def test_duplicates_wait_for_a_holder_that_completes_and_all_replay_its_result(server, other_client, namespace):
    counting = Counting()
    holder = Holder(other_client, namespace, "k", {"receipt": "r-1"})
    work = Work({"receipt": "duplicate"})
    with IdempotencyClient(server.target, interceptors=[counting]) as client:
        pool, futures = duplicates(client, namespace, "k", work)
        until(lambda: counting.sent("Claim") >= WAITERS, what="every duplicate's Claim sent")
        holder.finish()
        results = [future.result(timeout=30) for future in futures]
        pool.shutdown()
        assert client.server_waits is True

    assert holder.outcome == {"receipt": "r-1"} and holder.runs == 1
    assert work.calls == 0
    assert [value for value, _ in results] == [{"receipt": "r-1"}] * WAITERS
    assert all(run.replayed for _, run in results)
    # Each duplicate asked to wait, the server answered saying how long it
    # waited, and one Claim each was enough: no poll loop.
    assert all(run.claim.waited is not None for _, run in results)
    assert all(request.HasField("wait") for method, request in counting.requests if method == "Claim")
    assert counting.count("Claim") == WAITERS


@pytest.mark.postgres
def test_when_the_holder_fails_and_releases_one_duplicate_takes_the_key_and_runs_the_work(
    server, other_client, namespace
):
    counting = Counting()
    holder = Holder(other_client, namespace, "k", None, fail=True)
    work = Work("done by a duplicate")
    with IdempotencyClient(server.target, interceptors=[counting]) as client:
        pool, futures = duplicates(client, namespace, "k", work)
        until(lambda: counting.sent("Claim") >= WAITERS, what="every duplicate's Claim sent")
        holder.finish()
        results = [future.result(timeout=30) for future in futures]
        pool.shutdown()

    assert isinstance(holder.outcome, RuntimeError)
    assert work.calls == 1
    assert [value for value, _ in results] == ["done by a duplicate"] * WAITERS
    assert sorted(run.replayed for _, run in results) == [False] + [True] * (WAITERS - 1)
    assert all(run.claim.waited is not None for _, run in results)
    assert counting.count("Claim") == WAITERS
    with IdempotencyClient(server.target) as client:
        record = client.get(namespace, "k")
    assert record.state is State.COMPLETED and record.fencing_token == 2


@pytest.mark.postgres
def test_when_the_holder_vanishes_exactly_one_duplicate_runs_the_work_after_its_lease_runs_out(
    server, other_client, namespace
):
    counting = Counting()
    vanished = other_client.claim(namespace, "k", lease_ttl=1)  # never completed nor released
    assert vanished.outcome is Outcome.CLAIMED
    work = Work("taken over")
    with IdempotencyClient(server.target, interceptors=[counting]) as client:
        pool, futures = duplicates(client, namespace, "k", work)
        results = [future.result(timeout=30) for future in futures]
        pool.shutdown()

    assert work.calls == 1
    assert [value for value, _ in results] == ["taken over"] * WAITERS
    assert sorted(run.replayed for _, run in results) == [False] + [True] * (WAITERS - 1)
    assert all(run.claim.waited is not None for _, run in results)
    assert counting.count("Claim") == WAITERS


@pytest.mark.postgres
async def test_async_duplicates_wait_for_a_holder_that_completes(server, namespace):
    counting = AsyncCounting()
    work = Work("duplicate")
    async with AsyncIdempotencyClient(server.target) as holder_client, AsyncIdempotencyClient(
        server.target, interceptors=[counting]
    ) as client:
        holder = await holder_client.claim(namespace, "k", lease_ttl=30)

        async def duplicate():
            async with client.once(namespace, "k") as run:
                value = await run(work)
            return value, run

        tasks = [asyncio.create_task(duplicate()) for _ in range(WAITERS)]

        async def all_sent():
            return counting.sent("Claim") >= WAITERS

        await until_async(all_sent, what="every duplicate's Claim sent")
        await asyncio.sleep(HOLDER_WORK_SECONDS)  # the holder's work
        await holder_client.complete(namespace, "k", holder.lease_token, b'"the holder\'s"')
        results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert client.server_waits is True

    assert work.calls == 0
    assert [value for value, _ in results] == ["the holder's"] * WAITERS
    assert all(run.replayed and run.claim.waited is not None for _, run in results)
    assert counting.count("Claim") == WAITERS


@pytest.mark.postgres
async def test_async_duplicates_take_over_from_a_holder_that_releases(server, namespace):
    counting = AsyncCounting()
    work = Work("done by a duplicate")
    async with AsyncIdempotencyClient(server.target) as holder_client, AsyncIdempotencyClient(
        server.target, interceptors=[counting]
    ) as client:
        holder = await holder_client.claim(namespace, "k", lease_ttl=30)

        async def duplicate():
            async with client.once(namespace, "k") as run:
                value = await run(work)
            return value, run

        tasks = [asyncio.create_task(duplicate()) for _ in range(WAITERS)]

        async def all_sent():
            return counting.sent("Claim") >= WAITERS

        await until_async(all_sent, what="every duplicate's Claim sent")
        await holder_client.release(namespace, "k", holder.lease_token)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 30)

    assert work.calls == 1
    assert [value for value, _ in results] == ["done by a duplicate"] * WAITERS
    assert sorted(run.replayed for _, run in results) == [False] + [True] * (WAITERS - 1)
    assert counting.count("Claim") == WAITERS


# --- claim(wait=) and ClaimResult.waited ------------------------------------------------


@pytest.mark.postgres
def test_a_claim_that_asks_to_wait_says_how_long_it_waited(client, other_client, namespace):
    assert client.claim(namespace, "plain").waited is None  # did not ask
    fresh = client.claim(namespace, "fresh", wait=5)
    assert fresh.outcome is Outcome.CLAIMED
    assert fresh.waited == timedelta(0)  # nothing to wait for

    other_client.claim(namespace, "held", lease_ttl=30)
    held = client.claim(namespace, "held", wait=0.3)
    assert held.outcome is Outcome.IN_PROGRESS
    assert held.waited > timedelta(0)
    assert held.retry_after is not None and held.lease_expires_at is not None


@pytest.mark.postgres
def test_a_waiting_claim_gets_the_result_the_holder_completes_meanwhile(client, other_client, namespace):
    holder = other_client.claim(namespace, "k", lease_ttl=30)
    counting = Counting()
    with IdempotencyClient(client.targets, interceptors=[counting]) as waiting, ThreadPoolExecutor(1) as pool:
        future = pool.submit(waiting.claim, namespace, "k", wait=20)
        until(lambda: counting.sent("Claim") == 1, what="the waiting Claim sent")
        other_client.complete(namespace, "k", holder.lease_token, b"stored")
        claim = future.result(timeout=30)
    assert claim.outcome is Outcome.COMPLETED
    assert claim.response == b"stored"
    assert claim.waited is not None
    assert counting.count("Claim") == 1


def test_a_per_attempt_timeout_shorter_than_the_wait_does_not_cut_the_waiting_claim(
    server, other_client, namespace
):
    other_client.claim(namespace, "k", lease_ttl=30)
    counting = Counting()
    policy = RetryPolicy(per_attempt_timeout=0.1)
    with IdempotencyClient(server.target, retry=policy, timeout=5, interceptors=[counting]) as client:
        claim = client.claim(namespace, "k", wait=0.5)
    assert claim.outcome is Outcome.IN_PROGRESS
    assert claim.waited > timedelta(0)
    assert counting.attempts == [("Claim", grpc.StatusCode.OK)]


def test_a_negative_wait_is_refused_naming_the_field(client, namespace):
    with pytest.raises(InvalidArgument, match="wait"):
        client.claim(namespace, "k", wait=-1)


def test_once_with_poll_never_asks_the_server_to_wait(server, other_client, namespace):
    holder = other_client.claim(namespace, "k", lease_ttl=30)
    counting = Counting()
    with IdempotencyClient(server.target, interceptors=[counting]) as client, ThreadPoolExecutor(1) as pool:
        future = pool.submit(once_with_run, client, namespace, "k", Work("mine"), on_in_progress="poll")
        until(lambda: counting.count("Claim") >= 2, what="two Claims: polling")
        other_client.complete(namespace, "k", holder.lease_token, b'"theirs"')
        value, run = future.result(timeout=30)
        assert client.server_waits is None  # never asked
    assert value == "theirs" and run.replayed
    assert not any(request.HasField("wait") for method, request in counting.requests if method == "Claim")


# --- a server that predates `wait` --------------------------------------------------------


@pytest.mark.postgres
def test_against_a_server_that_ignores_wait_once_polls_and_the_client_remembers(server, other_client, namespace):
    counting = Counting()
    holder = other_client.claim(namespace, "k", lease_ttl=30)
    work = Work("mine")
    with WaitClearingRelay(server.target) as relay, IdempotencyClient(
        relay.target, interceptors=[counting]
    ) as client, ThreadPoolExecutor(1) as pool:
        future = pool.submit(once_with_run, client, namespace, "k", work)
        # It polls: Claim after Claim, each answered IN_PROGRESS at once.
        until(lambda: counting.count("Claim") >= 3, what="three Claims: polling")
        other_client.complete(namespace, "k", holder.lease_token, b'"theirs"')
        value, run = future.result(timeout=30)

        assert value == "theirs" and run.replayed and work.calls == 0
        assert run.claim.waited is None
        assert counting.count("Claim") >= 4  # three IN_PROGRESS, then the replay
        assert client.server_waits is False
        # Only the first Claim asked; the polls did not, and neither does the
        # next once() of this client.
        assert relay.claims_asking_to_wait == 1
        assert client.once(namespace, "another").run(Work(7)) == 7
        assert relay.claims_asking_to_wait == 1
        assert relay.claims == counting.count("Claim")


async def test_the_async_client_falls_back_to_polling_as_well(server, namespace):
    work = Work("mine")
    with WaitClearingRelay(server.target) as relay:
        async with AsyncIdempotencyClient(server.target) as holder_client, AsyncIdempotencyClient(
            relay.target
        ) as client:
            holder = await holder_client.claim(namespace, "k", lease_ttl=30)
            task = asyncio.create_task(client.once(namespace, "k").run(work))

            async def polled():
                return relay.claims >= 3

            await until_async(polled, what="three Claims: polling")
            await holder_client.complete(namespace, "k", holder.lease_token, b'"theirs"')
            assert await asyncio.wait_for(task, 30) == "theirs"
            assert client.server_waits is False
    assert work.calls == 0
    assert relay.claims_asking_to_wait == 1


def test_a_plain_claim_through_a_server_that_ignores_wait_has_no_waited(server, other_client, namespace):
    other_client.claim(namespace, "k", lease_ttl=30)
    with WaitClearingRelay(server.target) as relay, IdempotencyClient(relay.target) as client:
        claim = client.claim(namespace, "k", wait=5)
        assert claim.outcome is Outcome.IN_PROGRESS
        assert claim.waited is None
        assert client.server_waits is False


def test_a_client_that_saw_wait_ignored_asks_again_after_the_recheck_interval(monkeypatch):
    from idempotency_client import _lifecycle

    now = [1000.0]
    monkeypatch.setattr(_lifecycle.time, "monotonic", lambda: now[0])
    waits = _lifecycle.ServerWaits()
    assert waits.supported is None and waits.worth_asking()
    waits.saw(None)  # a server that predates waiting
    assert waits.supported is False and not waits.worth_asking()
    now[0] += _lifecycle.WAIT_RECHECK_SECONDS - 1
    assert not waits.worth_asking()
    now[0] += 1
    assert waits.worth_asking()
    waits.saw(timedelta(0))  # this one answers with `waited`
    assert waits.supported is True and waits.worth_asking()
