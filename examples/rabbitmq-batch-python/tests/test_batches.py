"""The batch consumer against real RabbitMQ, PostgreSQL and idempotency-service.

Each test starts the service (embedded store, a free port), creates the
consumer's database orders_<random> and the queues of orders-batch-<random>
(a retry budget of three short steps, a delivery limit of 5), publishes, and
runs consumer.py as a separate process with batches of up to 10 messages.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections import Counter

import aio_pika
import asyncpg
import pytest

from idempotency_client import IdempotencyClient, State, derive_key, fingerprint
from idempotency_client.testing import ServerProcess

HERE = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
import consumer as consumer_module  # noqa: E402
import topology  # noqa: E402

AMQP_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
POSTGRES = os.environ.get("ORDERS_POSTGRES", "postgres://postgres@127.0.0.1:5432").rstrip("/")
BATCH_SIZE = 10
LEASE_SECONDS = 2
RETRY_DELAYS = [0.3, 0.6, 1.2]
DELIVERY_LIMIT = 5
NAMESPACE = consumer_module.NAMESPACE


def wait_for(condition, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


@pytest.fixture
def server(tmp_path):
    data_dir = tmp_path / "service"
    data_dir.mkdir()
    with ServerProcess.start(data_dir=data_dir) as server:
        yield server


@pytest.fixture
def orders_db():
    name = f"orders_{uuid.uuid4().hex[:12]}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(f"{POSTGRES}/postgres")
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    try:
        asyncio.run(admin(f"CREATE DATABASE {name}"))
    except (OSError, asyncpg.PostgresError) as error:
        pytest.fail(f"PostgreSQL at {POSTGRES} is not usable: {error}")
    try:
        yield f"{POSTGRES}/{name}"
    finally:
        asyncio.run(admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


async def amqp(fn):
    connection = await aio_pika.connect(AMQP_URL)
    try:
        return await fn(await connection.channel())  # publisher confirms on
    finally:
        await connection.close()


@pytest.fixture
def queue_name():
    name = f"orders-batch-{uuid.uuid4().hex[:12]}"

    async def declare(channel):
        await topology.declare(channel, name, RETRY_DELAYS, DELIVERY_LIMIT)

    async def delete(channel):
        for queue in topology.queue_names(name, RETRY_DELAYS):
            await channel.queue_delete(queue)

    try:
        asyncio.run(amqp(declare))
    except OSError as error:
        pytest.fail(f"RabbitMQ at {AMQP_URL} is not usable: {error}")
    try:
        yield name
    finally:
        asyncio.run(amqp(delete))


def order_body(order_id: str, amount: int, customer: str = "c1") -> bytes:
    return json.dumps({"order_id": order_id, "customer": customer, "amount_cents": amount}, sort_keys=True).encode()


def publish(queue: str, messages: list) -> None:
    """messages: (message_id, copy, body)."""

    async def send(channel):
        for message_id, copy, body in messages:
            await channel.default_exchange.publish(
                aio_pika.Message(body, message_id=message_id, content_type="application/json",
                                 delivery_mode=aio_pika.DeliveryMode.PERSISTENT, headers={"x-test-copy": copy}),
                routing_key=queue,
            )

    asyncio.run(amqp(send))


def depths(queue: str) -> dict:
    async def depth(channel):
        out = {}
        for name in topology.queue_names(queue, RETRY_DELAYS):
            declared = await channel.declare_queue(name, passive=True)
            out[name] = declared.declaration_result.message_count
        return out

    return asyncio.run(amqp(depth))


def parked(queue: str) -> list:
    async def drain(channel):
        dlq = await channel.declare_queue(topology.parking_queue(queue), passive=True)
        out = []
        while (message := await dlq.get(fail=False, no_ack=True)) is not None:
            out.append((message.message_id, dict(message.headers or {}), message.body))
        return out

    return asyncio.run(amqp(drain))


def query(url: str, sql: str) -> list:
    async def run():
        conn = await asyncpg.connect(url)
        try:
            return [dict(r) for r in await conn.fetch(sql)]
        finally:
            await conn.close()

    return asyncio.run(run())


def rows(orders_db: str) -> dict:
    return {r["order_id"]: r for r in query(
        orders_db, "SELECT o.order_id, o.amount_cents, o.fencing, l.entry_id, l.amount_cents AS ledger_amount, "
                   "l.fencing AS ledger_fencing FROM orders o JOIN ledger l USING (order_id)")}


def effect_runs(orders_db: str) -> dict:
    out = {}
    for r in query(orders_db, "SELECT order_id, fencing FROM effect_runs ORDER BY run_id"):
        out.setdefault(r["order_id"], []).append(r["fencing"])
    return out


class ConsumerRun:
    def __init__(self, tmp_path, name, server, orders_db, queue, journal, **env_extra):
        self.log_path = tmp_path / f"consumer-{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("CONSUMER_")}
        env.update(
            AMQP_URL=AMQP_URL, QUEUE=queue, ORDERS_DATABASE_URL=orders_db, IDEMPOTENCY_TARGET=server.target,
            BATCH_SIZE=str(BATCH_SIZE), BATCH_WAIT_SECONDS="0.3", LEASE_SECONDS=str(LEASE_SECONDS),
            RETENTION_SECONDS="3600", RETRY_DELAYS=",".join(str(d) for d in RETRY_DELAYS),
            DELIVERY_LIMIT=str(DELIVERY_LIMIT), CONSUMER_JOURNAL=str(journal),
        )
        env.update(env_extra)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen([sys.executable, str(HERE / "consumer.py")], env=env,
                                            stdout=log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-8000:]

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"consumer still running after {timeout} s\n{self.log()}")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.wait(30)


def read_journal(path: pathlib.Path) -> list:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def settled(journal: pathlib.Path) -> Counter:
    """(message_id, copy) -> how many final events (ack or park) it has."""
    return Counter((e["message_id"], e["copy"]) for e in read_journal(journal) if e["event"] in ("ack", "park"))


def test_batches_apply_each_order_once(tmp_path, server, orders_db, queue_name):
    """30 orders published before the consumer starts, so they come in full
    batches. Three are published twice right behind themselves (a duplicate
    inside one batch: ClaimBatch gives the first copy the lease and the second
    IN_PROGRESS; the second is acked as a replay of the first's receipt), one
    once more with another body in the same batch (FINGERPRINT_MISMATCH:
    parked). Then copies of five completed orders (COMPLETED in ClaimBatch:
    replayed, nothing runs)."""
    journal = tmp_path / "journal.jsonl"
    orders = {f"ord-{i:03d}": 100 + i for i in range(30)}
    messages = []
    for oid, amount in orders.items():
        messages.append((oid, "1", order_body(oid, amount)))
        if oid in ("ord-003", "ord-014", "ord-025"):
            messages.append((oid, "dup", order_body(oid, amount)))
        if oid == "ord-007":
            messages.append((oid, "other", order_body(oid, 1)))
    publish(queue_name, messages)
    run = ConsumerRun(tmp_path, "main", server, orders_db, queue_name, journal)
    try:
        expected = {(m, c) for m, c, _ in messages}
        wait_for(lambda: set(settled(journal)) == expected, 60, "every message to be acked or parked")
        redelivered = ["ord-000", "ord-009", "ord-014", "ord-021", "ord-029"]
        publish(queue_name, [(oid, "late", order_body(oid, orders[oid])) for oid in redelivered])
        wait_for(lambda: all(settled(journal)[(oid, "late")] for oid in redelivered), 30,
                 "the redeliveries of completed orders to be acked")
    finally:
        assert run.stop() == 0, run.log()

    entries = read_journal(journal)
    assert max(settled(journal).values()) == 1  # each copy ended once
    acks = {(e["message_id"], e["copy"]): e for e in entries if e["event"] == "ack"}
    assert [(e["message_id"], e["copy"], e["reason"]) for e in entries if e["event"] == "park"] == [
        ("ord-007", "other", "fingerprint_mismatch")]
    assert not [e for e in entries if e["event"] == "retry"]
    # Batches were batches: the first one took BATCH_SIZE messages.
    batch_sizes = Counter(e["batch"] for e in entries if e["copy"] != "late")
    assert max(batch_sizes.values()) == BATCH_SIZE, batch_sizes

    table = rows(orders_db)
    runs = effect_runs(orders_db)
    with IdempotencyClient(server.target) as client:
        for oid, amount in orders.items():
            row = table[oid]
            assert (row["amount_cents"], row["ledger_amount"], row["fencing"]) == (amount, amount, 1)
            assert runs[oid] == [1]
            first = acks[(oid, "1")]
            assert (first["replayed"], first["wrote"]) == (False, True)
            receipt = {"order_id": oid, "amount_cents": amount, "ledger_entry": row["entry_id"], "fencing": 1}
            assert first["receipt"] == receipt
            record = client.get(NAMESPACE, derive_key("orders", oid))
            assert (record.state, json.loads(record.response), record.fingerprint) == (
                State.COMPLETED, receipt, fingerprint(order_body(oid, amount)))
            for copy in ("dup", "late"):
                if (oid, copy) in acks:
                    e = acks[(oid, copy)]
                    assert (e["replayed"], e["wrote"], e["receipt"]) == (True, False, receipt), e
    for oid in ("ord-003", "ord-014", "ord-025"):  # the duplicate was in its first copy's batch
        assert acks[(oid, "dup")]["in_batch_duplicate"] and acks[(oid, "dup")]["batch"] == acks[(oid, "1")]["batch"]
    assert not any(acks[(oid, "late")]["in_batch_duplicate"] for oid in redelivered)
    dlq = parked(queue_name)
    assert [(m, h["x-test-copy"], h[topology.PARKED_REASON]) for m, h, _ in dlq] == [("ord-007", "other", "fingerprint_mismatch")]
    assert depths(queue_name) == {q: 0 for q in topology.queue_names(queue_name, RETRY_DELAYS)}


def test_an_item_held_elsewhere_is_retried_not_acked(tmp_path, server, orders_db, queue_name):
    """A concurrent delivery elsewhere: the test holds the lease of one order
    (as another consumer would) when its batch is claimed. That item is
    IN_PROGRESS: it is sent to the retry queue, neither acked nor applied,
    while the rest of the batch is. The test releases its lease; the retry
    takes the key (token 2) and applies it."""
    journal = tmp_path / "journal.jsonl"
    key = derive_key("orders", "ord-held")
    with IdempotencyClient(server.target) as client:
        held = client.claim(NAMESPACE, key, fingerprint=fingerprint(order_body("ord-held", 50)), lease_ttl=60)
        assert held.claimed
        publish(queue_name, [("ord-a", "1", order_body("ord-a", 10)), ("ord-held", "1", order_body("ord-held", 50)),
                             ("ord-b", "1", order_body("ord-b", 20))])
        run = ConsumerRun(tmp_path, "held", server, orders_db, queue_name, journal)
        try:
            wait_for(lambda: [e for e in read_journal(journal) if e["event"] == "retry"], 30, "the held item's retry")
            wait_for(lambda: settled(journal)[("ord-a", "1")] and settled(journal)[("ord-b", "1")], 30,
                     "the rest of the batch")
            entries = read_journal(journal)
            assert [(e["message_id"], e["reason"], e["attempt"]) for e in entries if e["event"] == "retry"] == [
                ("ord-held", "in_progress", 1)]
            assert "ord-held" not in rows(orders_db)
            client.release(NAMESPACE, key, held.lease_token)
            wait_for(lambda: settled(journal)[("ord-held", "1")], 30, "the held order to be applied")
        finally:
            assert run.stop() == 0, run.log()
    [ack] = [e for e in read_journal(journal) if e["event"] == "ack" and e["message_id"] == "ord-held"]
    assert (ack["replayed"], ack["wrote"], ack["receipt"]["fencing"]) == (False, True, 2)
    assert sorted(rows(orders_db)) == ["ord-a", "ord-b", "ord-held"]
    assert parked(queue_name) == []


@pytest.mark.parametrize("remember", [True, False], ids=["remembered", "forgotten"])
def test_a_late_copy_after_the_receipt_expired(tmp_path, orders_db, queue_name, remember):
    """Two orders complete with a 1 s retention; then, in one batch, a late
    copy of the first (the same body) and another body under the second.
    remembered (the server's default: a key is remembered 7 days past its
    Complete): ClaimBatch re-executes the first under token 2, with
    completed_at, and it rewrites its rows with the same values (logged as a
    late retry); the second is parked before ClaimBatch, the ledger holding
    another body under its order id.
    forgotten (IDEMPOTENCY_REMEMBER_FOR=0s, as any server past a key's
    horizon; the reaper deletes the records): the first Claims token 1
    again, writes nothing and completes with the rows as its receipt; the
    second is parked. Then a copy of the second order's applied body: acked
    as the first copy was (issue 33, defect 9: it was parked as
    fingerprint_mismatch). One order and one ledger entry each, either way."""
    data_dir = tmp_path / "service"
    data_dir.mkdir()
    # A server refusing late retries unless a Claim says otherwise: the
    # consumer pins late_retry="reexecute" on every ClaimBatch item, so its
    # late copies are re-executed whatever the server's or the namespace's
    # policy (issue 33, defect 6).
    env = {"IDEMPOTENCY_REAPER_INTERVAL": "200ms", "IDEMPOTENCY_LATE_RETRY": "refuse"}
    if not remember:
        env["IDEMPOTENCY_REMEMBER_FOR"] = "0s"
    journal = tmp_path / "journal.jsonl"
    keys = {oid: derive_key("orders", oid) for oid in ("ord-late-1", "ord-late-2")}
    with ServerProcess.start(data_dir=data_dir, env=env) as server, IdempotencyClient(server.target) as client:

        def expired():
            """Every key's Get once its receipt expired and the service
            remembers it (remembered) or forgot it, its row deleted (forgotten)."""
            got = {oid: client.get(NAMESPACE, key) for oid, key in keys.items()}
            if remember:
                return got if all(r.state is State.ABSENT and r.remembered_until for r in got.values()) else None
            db = sqlite3.connect(f"file:{data_dir / 'idempotency.db'}?mode=ro", uri=True, timeout=5)
            try:
                left = db.execute("SELECT count(*) FROM idempotency_records").fetchone()[0]
            finally:
                db.close()
            return got if left == 0 else None

        run = ConsumerRun(tmp_path, "late", server, orders_db, queue_name, journal, RETENTION_SECONDS="1")
        try:
            publish(queue_name, [("ord-late-1", "first", order_body("ord-late-1", 500)),
                                 ("ord-late-2", "first", order_body("ord-late-2", 700))])
            wait_for(lambda: settled(journal)[("ord-late-1", "first")] and settled(journal)[("ord-late-2", "first")],
                     30, "the first copies")
            before = rows(orders_db)
            markers = wait_for(expired, 30, "the receipts to expire")
            if remember:
                assert {oid: r.fencing_token for oid, r in markers.items()} == {"ord-late-1": 1, "ord-late-2": 1}
            publish(queue_name, [("ord-late-1", "late", order_body("ord-late-1", 500)),
                                 ("ord-late-2", "late", order_body("ord-late-2", 999))])
            wait_for(lambda: settled(journal)[("ord-late-1", "late")] and settled(journal)[("ord-late-2", "late")],
                     30, "the late copies")
            records = {"ord-late-1": client.get(NAMESPACE, keys["ord-late-1"])}  # before its 1 s retention ends
            # Issue 33, defect 9: a copy of ord-late-2's applied body after the
            # conflict is a duplicate, acked. It was parked as
            # fingerprint_mismatch: the other body had been Claimed, refused by
            # the guard and released, leaving the key holding its fingerprint.
            publish(queue_name, [("ord-late-2", "again", order_body("ord-late-2", 700))])
            wait_for(lambda: settled(journal)[("ord-late-2", "again")], 30, "the copy of the applied body")
            records["ord-late-2"] = client.get(NAMESPACE, keys["ord-late-2"])
        finally:
            assert run.stop() == 0, run.log()
        token = 2 if remember else 1
    late = {e["message_id"]: e for e in read_journal(journal) if e["copy"] == "late"}
    [again] = [e for e in read_journal(journal) if e["copy"] == "again"]
    ack, park = late["ord-late-1"], late["ord-late-2"]
    assert (ack["event"], ack["replayed"], ack["wrote"], ack["receipt"]["fencing"]) == ("ack", False, remember, token)
    assert ack["late_retry"] == (markers["ord-late-1"].completed_at.isoformat() if remember else None)
    assert ack["receipt"]["ledger_entry"] == before["ord-late-1"]["entry_id"]
    assert (park["event"], park["reason"]) == ("park", "conflicts_with_applied_order")
    after = rows(orders_db)
    assert after["ord-late-1"] == {**before["ord-late-1"], "fencing": token, "ledger_fencing": token}
    assert after["ord-late-2"] == {**before["ord-late-2"], "fencing": token, "ledger_fencing": token}
    assert (again["event"], again["replayed"], again["wrote"], again["receipt"]) == (
        "ack", False, remember, {"order_id": "ord-late-2", "amount_cents": 700,
                                 "ledger_entry": before["ord-late-2"]["entry_id"], "fencing": token})
    runs = [1, 2] if remember else [1]
    assert effect_runs(orders_db) == {"ord-late-1": runs, "ord-late-2": runs}
    assert (records["ord-late-1"].state, records["ord-late-1"].fencing_token) == (State.COMPLETED, token)
    assert json.loads(records["ord-late-1"].response) == ack["receipt"]
    # The other body was parked before any Claim; the copy of the applied one completed.
    assert (records["ord-late-2"].state, records["ord-late-2"].fencing_token) == (State.COMPLETED, token)
    assert json.loads(records["ord-late-2"].response) == again["receipt"]
    [(message_id, headers, body)] = parked(queue_name)
    assert (message_id, headers["x-test-copy"], json.loads(body)["amount_cents"]) == ("ord-late-2", "late", 999)
    if remember:
        assert (f"message ord-late-1: a late retry (completed before at {ack['late_retry']}, its result expired): "
                "re-executed under fencing token 2, rewrote the same rows, acked") in run.log()
    else:
        assert "message ord-late-1: already applied under fencing token 1; completed with that receipt, acked" in run.log()


def test_a_long_batch_keeps_its_leases(tmp_path, server, orders_db, queue_name):
    """A batch of 10 whose work lasts 2.5 leases (one order's effect is
    slowed by 5 s, with 2 s leases), each ExtendLease 250 ms away: the
    heartbeat extends every lease of the batch at once, so a Claim of its
    keys made after the first lease would have run out still answers
    IN_PROGRESS, and every order is applied once under token 1. (Issue 33,
    defect 10: extended one after another, a round took 2.5 s, longer than a
    lease, and the later items' leases ran out.)"""
    journal = tmp_path / "journal.jsonl"
    ids = ["ord-slow"] + [f"ord-x{i}" for i in range(BATCH_SIZE - 1)]
    publish(queue_name, [(oid, "1", order_body(oid, 7)) for oid in ids])
    run = ConsumerRun(tmp_path, "slow", server, orders_db, queue_name, journal, CONSUMER_SLOW_ORDER="ord-slow:5",
                      CONSUMER_EXTEND_LATENCY="0.25")
    try:
        with IdempotencyClient(server.target) as client:
            first = {}

            def all_claimed():
                for oid in ids:
                    record = client.get(NAMESPACE, derive_key("orders", oid))
                    if record.state is not State.IN_PROGRESS:
                        return False
                    first[oid] = record.lease_expires_at
                return True

            wait_for(all_claimed, 30, "the batch to be claimed")
            # Wait until every first lease would have run out, then claim.
            wait_for(lambda: time.time() > max(t.timestamp() for t in first.values()) + 0.5, 10,
                     "the first leases' end")
            for oid in ids:
                other = client.claim(NAMESPACE, derive_key("orders", oid), fingerprint=fingerprint(order_body(oid, 7)))
                assert other.outcome.name == "IN_PROGRESS", (oid, other)
                assert other.lease_expires_at > first[oid], (oid, other.lease_expires_at, first[oid])
        wait_for(lambda: all(settled(journal)[(oid, "1")] for oid in ids), 30, "the batch to be acked")
    finally:
        assert run.stop() == 0, run.log()
    acks = [e for e in read_journal(journal) if e["event"] == "ack"]
    assert sorted((e["message_id"], e["wrote"], e["receipt"]["fencing"], e["batch"]) for e in acks) == [
        (oid, True, 1, 1) for oid in sorted(ids)]
    assert "the lease was lost" not in run.log()
    assert effect_runs(orders_db) == {oid: [1] for oid in ids}


def test_killed_mid_batch(tmp_path, server, orders_db, queue_name):
    """SIGKILL after the batch's effects committed, before CompleteBatch: the
    next run's ClaimBatch finds the leases still live (IN_PROGRESS: retry),
    then takes the keys over with token 2 and rewrites the same rows: one
    order and one ledger entry each, the effect run under tokens 1 then 2."""
    journal = tmp_path / "journal.jsonl"
    ids = [f"ord-k{i}" for i in range(5)]
    publish(queue_name, [(oid, "1", order_body(oid, 300 + i)) for i, oid in enumerate(ids)])
    killed = ConsumerRun(tmp_path, "killed", server, orders_db, queue_name, journal, CONSUMER_KILL_AT="after_effect:1")
    assert killed.wait(30) == -signal.SIGKILL, killed.log()
    assert read_journal(journal) == []
    run = ConsumerRun(tmp_path, "after", server, orders_db, queue_name, journal)
    try:
        wait_for(lambda: all(settled(journal)[(oid, "1")] for oid in ids), 30, "the batch to be acked")
    finally:
        assert run.stop() == 0, run.log()
    acks = {e["message_id"]: e for e in read_journal(journal) if e["event"] == "ack"}
    assert {oid: (acks[oid]["wrote"], acks[oid]["receipt"]["fencing"]) for oid in ids} == {oid: (True, 2) for oid in ids}
    table = rows(orders_db)
    assert {oid: (table[oid]["amount_cents"], table[oid]["ledger_fencing"]) for oid in ids} == {
        oid: (300 + i, 2) for i, oid in enumerate(ids)}
    assert effect_runs(orders_db) == {oid: [1, 2] for oid in ids}
    assert depths(queue_name) == {q: 0 for q in topology.queue_names(queue_name, RETRY_DELAYS)}


def test_ledger_outage_parks_the_batch(tmp_path, server, orders_db, queue_name):
    """The ledger table is gone while a batch arrives: each item's effect
    fails, its key is released, and it goes round the retry queues (each
    retry comes back in a batch of its own or with others); when the budget
    is spent every item is parked as retries_exhausted, none applied."""
    journal = tmp_path / "journal.jsonl"
    run = ConsumerRun(tmp_path, "outage", server, orders_db, queue_name, journal)
    try:
        wait_for(lambda: "consuming" in run.log(), 30, "the consumer to start (its schema applied)")
        query(orders_db, "ALTER TABLE ledger RENAME TO ledger_offline")
        publish(queue_name, [(f"ord-o{i}", "1", order_body(f"ord-o{i}", 5)) for i in range(3)])
        wait_for(lambda: len([e for e in read_journal(journal) if e["event"] == "park"]) == 3, 30,
                 "the three orders to be parked")
    finally:
        assert run.stop() == 0, run.log()
    entries = read_journal(journal)
    for i in range(3):
        mine = [(e["event"], e.get("attempt"), e["reason"]) for e in entries if e["message_id"] == f"ord-o{i}"]
        assert mine == [("retry", 1, "UndefinedTableError"), ("retry", 2, "UndefinedTableError"),
                        ("retry", 3, "UndefinedTableError"), ("park", None, "retries_exhausted")]
    assert sorted((m, h[topology.PARKED_REASON]) for m, h, _ in parked(queue_name)) == [
        (f"ord-o{i}", "retries_exhausted") for i in range(3)]
    with IdempotencyClient(server.target) as client:
        for i in range(3):
            record = client.get(NAMESPACE, derive_key("orders", f"ord-o{i}"))
            assert (record.state, record.fencing_token) == (State.RELEASED, 4)


#: Bodies the consumer must refuse, each with the reason it is parked with
#: (issue 33, defects 1 and 2): int() read 12.99 as 12 and true as 1, and
#: 1e400 (inf) raised out of the batch loop, so the consumer exited, and, run
#: again, exited again on the same message: one message stopped the queue.
POISON = [
    ("ord-fraction", b'{"order_id": "ord-fraction", "customer": "c", "amount_cents": 12.99}',
     "amount_cents must be an integer number of cents within +-(2^53 - 1), not 12.99"),
    ("ord-bool", b'{"order_id": "ord-bool", "customer": "c", "amount_cents": true}',
     "amount_cents must be an integer number of cents within +-(2^53 - 1), not true"),
    ("ord-string", b'{"order_id": "ord-string", "customer": "c", "amount_cents": "1299"}',
     'amount_cents must be an integer number of cents within +-(2^53 - 1), not "1299"'),
    ("ord-huge", b'{"order_id": "ord-huge", "customer": "c", "amount_cents": 1e400}',
     "amount_cents must be an integer number of cents within +-(2^53 - 1), not 1E+400"),
    ("ord-nan", b'{"order_id": "ord-nan", "customer": "c", "amount_cents": NaN}',
     "not JSON: NaN is not a JSON number"),
    ("ord-inf", b'{"order_id": "ord-inf", "customer": "c", "amount_cents": Infinity}',
     "not JSON: Infinity is not a JSON number"),
]


def test_poison_in_a_batch_is_parked_and_the_rest_applied(tmp_path, server, orders_db, queue_name):
    """Issue 33, defects 1 and 2. One batch holding amounts that are not an
    integer number of cents (12.99, true, "1299", 1e400) and non-finite
    numbers (NaN, Infinity) between two good orders: the bad ones are parked
    as not_an_order with the reason, without a Claim; the good ones in the
    same batch are applied; the consumer keeps running."""
    journal = tmp_path / "journal.jsonl"
    publish(queue_name, [("ord-good-1", "1", order_body("ord-good-1", 1299))]
            + [(oid, "1", body) for oid, body, _ in POISON]
            + [("ord-good-2", "1", order_body("ord-good-2", 5))])
    run = ConsumerRun(tmp_path, "poison", server, orders_db, queue_name, journal)
    try:
        wait_for(lambda: len(read_journal(journal)) >= len(POISON) + 2 or run.process.poll() is not None, 30,
                 "every message to be parked or acked")
        assert run.process.poll() is None, run.log()
    finally:
        assert run.stop() == 0, run.log()
    entries = read_journal(journal)
    assert sorted((e["event"], e.get("reason"), e["batch"]) for e in entries) == sorted(
        [("park", "not_an_order", 1)] * len(POISON) + [("ack", None, 1)] * 2)
    assert sorted(e["message_id"] for e in entries if e["event"] == "ack") == ["ord-good-1", "ord-good-2"]
    dlq = {m: (h[topology.PARKED_REASON], h[topology.PARKED_DETAIL], body) for m, h, body in parked(queue_name)}
    assert dlq == {oid: ("not_an_order", detail, body) for oid, body, detail in POISON}
    assert {oid: (r["amount_cents"], r["ledger_amount"]) for oid, r in rows(orders_db).items()} == {
        "ord-good-1": (1299, 1299), "ord-good-2": (5, 5)}
    with IdempotencyClient(server.target) as client:  # nothing was claimed for them
        for oid, _, _ in POISON:
            assert client.get(NAMESPACE, derive_key("orders", oid)).state is State.ABSENT
    assert depths(queue_name) == {q: 0 for q in topology.queue_names(queue_name, RETRY_DELAYS)}
