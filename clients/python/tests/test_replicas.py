"""Several replicas: two servers on one PostgreSQL database, the client given
both addresses. A replica stopped between two calls of one once(), one that
stays down, and a rolling restart (SIGTERM, start again on the same port, one
replica after the other) under a running once() loop: the caller's code sees
no error, and every piece of work runs once. Duplicates waiting on one
replica for a holder on the other learn of its Complete or Release through
the database's feed."""

import asyncio
import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from idempotency_client import AsyncIdempotencyClient, IdempotencyClient, Outcome, State
from idempotency_client.testing import ServerProcess, create_postgres_database, drop_postgres_database
from interceptors import BeforeFirst, Counting
from poll import until


@pytest.fixture(scope="module")
def replica_pair(tmp_path_factory):
    url = create_postgres_database()
    servers = []
    try:
        for name in ("replica-a", "replica-b"):
            servers.append(ServerProcess.start(data_dir=tmp_path_factory.mktemp(name), database_url=url))
        yield servers
    finally:
        for server in servers:
            server.stop()
        drop_postgres_database(url)


@pytest.fixture
def replicas(replica_pair):
    """Both replicas up at the start of each test, whatever the last one did."""
    for server in replica_pair:
        if server.process.poll() is not None:
            server.restart()
    return replica_pair


@pytest.mark.parametrize("victim", [0, 1])
def test_a_replica_stopped_between_two_calls_of_one_once(replicas, namespace, victim):
    counting = Counting()
    calls = []

    def work():
        # The Claim has been answered; the Complete is next.
        replicas[victim].stop()
        calls.append(1)
        return {"charged": True}

    with IdempotencyClient([server.target for server in replicas], interceptors=[counting]) as client:
        with client.once(namespace, "order-1") as run:
            assert run(work) == {"charged": True}
        assert calls == [1]
        record = client.get(namespace, "order-1")
        assert record.state is State.COMPLETED
        assert client.once(namespace, "order-1").run(work) == {"charged": True}  # replayed
    assert calls == [1]
    assert counting.count("Claim") >= 1 and counting.count("Complete") >= 1


def test_a_complete_sent_to_a_replica_that_just_stopped_is_retried_on_the_other(replicas, namespace, caplog):
    # A new client starts its calls on each address in turn: the Claim on the
    # first replica, the Complete on the second, which stops as it is sent.
    stopper = BeforeFirst("Complete", replicas[1].stop)
    with IdempotencyClient([server.target for server in replicas], interceptors=[stopper]) as client:
        for channel in client._endpoints.channels:  # both connected: the turns decide
            grpc.channel_ready_future(channel).result(timeout=10)
        with caplog.at_level(logging.DEBUG, logger="idempotency_client"):
            assert client.once(namespace, "k").run(lambda: "ok") == "ok"
        assert client.get(namespace, "k").state is State.COMPLETED
    retried = f"idempotency: Complete attempt 1 on {replicas[1].target} failed (UNAVAILABLE"
    assert any(record.getMessage().startswith(retried) for record in caplog.records)
    assert stopper.attempts[:3] == [
        ("Claim", grpc.StatusCode.OK),
        ("Complete", grpc.StatusCode.UNAVAILABLE),
        ("Complete", grpc.StatusCode.OK),
    ]


def test_calls_keep_working_while_one_replica_is_down(replicas, namespace):
    replicas[1].stop()
    counting = Counting()
    with IdempotencyClient([server.target for server in replicas], interceptors=[counting]) as client:
        started = time.monotonic()
        for index in range(20):
            assert client.once(namespace, f"k{index}").run(lambda: index) == index
        elapsed = time.monotonic() - started
    assert counting.count(code=grpc.StatusCode.OK) == 40  # a Claim and a Complete each
    # Once its channel is known to fail, the stopped replica is passed over.
    assert counting.count(code=grpc.StatusCode.UNAVAILABLE) <= 10
    assert elapsed < 10


async def test_the_async_client_rides_over_a_stopped_replica(replicas, namespace):
    calls = []

    async def work():
        replicas[0].stop()
        calls.append(1)
        return "ok"

    async with AsyncIdempotencyClient([server.target for server in replicas]) as client:
        async with client.once(namespace, "k") as run:
            assert await run(work) == "ok"
        assert (await client.get(namespace, "k")).state is State.COMPLETED
        for index in range(5):
            claim = await client.claim(namespace, f"more-{index}")
            await client.complete(namespace, f"more-{index}", claim.lease_token, b"")
    assert calls == [1]


def test_a_rolling_restart_under_a_running_once_loop_raises_nothing(replicas, namespace):
    runs = Counter()
    completed = []
    errors = []
    stop = threading.Event()

    def work(key):
        runs[key] += 1
        return key

    def loop(client):
        index = 0
        while not stop.is_set():
            key = f"evt-{index}"
            try:
                assert client.once(namespace, key, lease_ttl=10).run(work, key) == key
                completed.append(key)
            except BaseException as error:  # anything at all reaching the caller's code
                errors.append(error)
            index += 1

    with IdempotencyClient([server.target for server in replicas]) as client:
        worker = threading.Thread(target=loop, args=(client,), name="once-loop")
        worker.start()
        try:
            until(lambda: len(completed) >= 10, timeout=20, what="the loop to run")
            for server in replicas:
                before = len(completed)
                server.restart()  # SIGTERM, wait for it to exit, start again on the same port
                assert len(completed) > before  # the loop went on while the replica was down
                after = len(completed)
                until(lambda: len(completed) >= after + 10, timeout=20, what="progress after a restart")
        finally:
            stop.set()
            worker.join(30)
        assert not worker.is_alive()
        assert errors == []
        assert completed and all(count == 1 for count in runs.values())
        for key in completed[:: max(1, len(completed) // 10)]:
            assert client.get(namespace, key).state is State.COMPLETED


async def test_a_rolling_restart_under_a_running_async_once_loop_raises_nothing(replicas, namespace):
    runs = Counter()
    completed = []
    errors = []
    stop = asyncio.Event()

    async def work(key):
        runs[key] += 1
        await asyncio.sleep(0)
        return key

    async def loop(client):
        index = 0
        while not stop.is_set():
            key = f"evt-{index}"
            try:
                assert await client.once(namespace, key, lease_ttl=10).run(work, key) == key
                completed.append(key)
            except BaseException as error:  # anything at all reaching the caller's code
                errors.append(error)
            index += 1

    async def until_completed(count):
        deadline = time.monotonic() + 20
        while len(completed) < count:
            assert time.monotonic() < deadline, f"only {len(completed)} completed"
            await asyncio.sleep(0.02)

    async with AsyncIdempotencyClient([server.target for server in replicas]) as client:
        task = asyncio.ensure_future(loop(client))
        try:
            await until_completed(10)
            for server in replicas:
                before = len(completed)
                await asyncio.to_thread(server.restart)  # the loop runs on meanwhile
                assert len(completed) > before
                await until_completed(len(completed) + 10)
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
        assert errors == []
        assert all(count == 1 for count in runs.values())


def test_a_restart_of_the_only_address_under_a_once_loop_raises_nothing(tmp_path, namespace):
    """One address (a load balancer, or a single replica): the retries wait
    out the restart within the calls' deadline."""
    runs = Counter()
    completed = []
    errors = []
    stop = threading.Event()

    def work(key):
        runs[key] += 1
        return key

    with ServerProcess.start(data_dir=tmp_path) as server:
        with IdempotencyClient(server.target) as client:

            def loop():
                index = 0
                while not stop.is_set():
                    key = f"evt-{index}"
                    try:
                        assert client.once(namespace, key).run(work, key) == key
                        completed.append(key)
                    except BaseException as error:
                        errors.append(error)
                    index += 1

            worker = threading.Thread(target=loop, name="once-loop")
            worker.start()
            try:
                until(lambda: len(completed) >= 10, timeout=20, what="the loop to run")
                server.restart()
                after = len(completed)
                until(lambda: len(completed) >= after + 10, timeout=20, what="progress after the restart")
            finally:
                stop.set()
                worker.join(30)
    assert errors == []
    assert all(count == 1 for count in runs.values())


@pytest.mark.parametrize("ending", ["complete", "release"])
def test_duplicates_waiting_on_one_replica_learn_of_a_holder_on_the_other(replicas, namespace, ending):
    holder_replica, waiting_replica = replicas
    duplicates = 16
    counting = Counting()
    runs = Counter()

    def work():
        runs["duplicate"] += 1
        return "done by a duplicate"

    def once_with_run(client):
        with client.once(namespace, "k") as run:
            value = run(work)
        return value, run

    with IdempotencyClient(holder_replica.target) as holder_client, IdempotencyClient(
        waiting_replica.target, interceptors=[counting]
    ) as client, ThreadPoolExecutor(duplicates) as pool:
        holder = holder_client.claim(namespace, "k", lease_ttl=30)
        assert holder.outcome is Outcome.CLAIMED
        futures = [pool.submit(once_with_run, client) for _ in range(duplicates)]
        until(lambda: counting.sent("Claim") >= duplicates, what="every duplicate's Claim sent")
        time.sleep(0.2)  # the holder's work
        if ending == "complete":
            holder_client.complete(namespace, "k", holder.lease_token, b'"done by the holder"')
        else:
            holder_client.release(namespace, "k", holder.lease_token)
        results = [future.result(timeout=30) for future in futures]
        assert client.server_waits is True

    expected = "done by the holder" if ending == "complete" else "done by a duplicate"
    assert [value for value, _ in results] == [expected] * duplicates
    assert runs["duplicate"] == (0 if ending == "complete" else 1)
    assert sum(not run.replayed for _, run in results) == runs["duplicate"]
    assert all(run.claim.waited is not None for _, run in results)
    assert counting.count("Claim") == duplicates  # one each: they waited, nobody polled
