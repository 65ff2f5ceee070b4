"""The order consumer against real RabbitMQ, PostgreSQL and idempotency-service,
killed with SIGKILL at each dangerous point and restarted.

  1. start the service (embedded store, free port), create the consumer's own
     database orders_<random>, declare a queue orders-test-<random>;
  2. publish N orders, some twice (same message id, same body);
  3. run the consumer as a separate process three times, each run killing
     itself (SIGKILL) at the Nth message (N drawn at random) reaching a phase:
     after Claim, after the effect (before Complete), after Complete (before
     the ack); RabbitMQ requeues whatever was unacked;
  4. run it once more to the end; meanwhile publish one message that reuses an
     order's id with another body (it must be rejected, changing nothing);
  5. check: every order once, one ledger entry per order with its amount,
     every delivery acked, every replay equal to the stored result, the
     queue empty.

TEST_SEED fixes the random kill points (printed on every run); N_ORDERS and
N_DUPLICATES change the sizes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict

import aio_pika
import asyncpg
import pytest

from idempotency_client import IdempotencyClient, State, derive_key
from idempotency_client.testing import ServerProcess

HERE = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
import consumer as consumer_module  # noqa: E402

AMQP_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
POSTGRES = os.environ.get("ORDERS_POSTGRES", "postgres://postgres@127.0.0.1:5432").rstrip("/")
N_ORDERS = int(os.environ.get("N_ORDERS", "60"))
N_DUPLICATES = int(os.environ.get("N_DUPLICATES", "15"))
PREFETCH = 8
LEASE_SECONDS = 2  # a killed consumer's leases run out quickly
PHASES = ("after_claim", "after_effect", "after_complete")


def wait_for(condition, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


# -- fixtures: the service, the consumer's database, the queue ----------------
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
    url = f"{POSTGRES}/{name}"
    try:
        yield url
    finally:
        asyncio.run(admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


async def amqp(fn):
    connection = await aio_pika.connect(AMQP_URL)
    try:
        channel = await connection.channel()  # publisher confirms on
        return await fn(channel)
    finally:
        await connection.close()


@pytest.fixture
def queue_name():
    name = f"orders-test-{uuid.uuid4().hex[:12]}"

    async def declare(channel):
        await channel.declare_queue(name, durable=True)

    async def delete(channel):
        await channel.queue_delete(name)

    try:
        asyncio.run(amqp(declare))
    except OSError as error:
        pytest.fail(f"RabbitMQ at {AMQP_URL} is not usable: {error}")
    try:
        yield name
    finally:
        asyncio.run(amqp(delete))


def publish(queue: str, messages: list) -> None:
    async def send(channel):
        for message_id, copy, body in messages:
            await channel.default_exchange.publish(
                aio_pika.Message(
                    body,
                    message_id=message_id,
                    content_type="application/json",
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    headers={"x-test-copy": copy},
                ),
                routing_key=queue,
            )

    asyncio.run(amqp(send))


def queue_depth(queue: str) -> int:
    async def depth(channel):
        declared = await channel.declare_queue(queue, passive=True)
        return declared.declaration_result.message_count

    return asyncio.run(amqp(depth))


async def fetch(url: str, sql: str):
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetch(sql)
    finally:
        await conn.close()


# -- the consumer process -----------------------------------------------------
class ConsumerRun:
    def __init__(self, tmp_path, name, server, orders_db, queue, journal, kill_at=None, pause_at=None,
                 prefetch=PREFETCH):
        self.log_path = tmp_path / f"consumer-{name}.log"
        env = dict(os.environ)
        env.update(
            AMQP_URL=AMQP_URL,
            QUEUE=queue,
            PREFETCH=str(prefetch),
            ORDERS_DATABASE_URL=orders_db,
            IDEMPOTENCY_TARGET=server.target,
            LEASE_SECONDS=str(LEASE_SECONDS),
            RETENTION_SECONDS="3600",
            WAIT_SECONDS="20",
            CONSUMER_JOURNAL=str(journal),
        )
        env.pop("CONSUMER_KILL_AT", None)
        env.pop("CONSUMER_PAUSE_AT", None)
        if kill_at:
            env["CONSUMER_KILL_AT"] = kill_at
        if pause_at:
            env["CONSUMER_PAUSE_AT"] = pause_at
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(HERE / "consumer.py")], env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"consumer still running after {timeout} s\n--- its log ---\n{self.log()}")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # in case it is stopped
            self.process.send_signal(signal.SIGTERM)
        return self.wait(30)

    def stopped(self) -> bool:
        """True while the process is stopped by SIGSTOP (state T in /proc)."""
        try:
            stat = pathlib.Path(f"/proc/{self.process.pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


def read_journal(path: pathlib.Path) -> list:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- the test -----------------------------------------------------------------
def test_orders_exactly_once_through_kills(tmp_path, server, orders_db, queue_name):
    seed = int(os.environ.get("TEST_SEED") or random.randrange(1 << 30))
    print(f"TEST_SEED={seed}")
    rng = random.Random(seed)

    # N orders; N_DUPLICATES of them published a second time (same message id,
    # same bytes), some right after the first copy (so both are in flight at
    # once), some much later.
    orders = {}
    for i in range(N_ORDERS):
        order_id = f"ord-{i:04d}"
        orders[order_id] = {"order_id": order_id, "customer": f"cust-{rng.randrange(7)}", "amount_cents": rng.randrange(100, 100000)}
    bodies = {oid: json.dumps(order, sort_keys=True).encode() for oid, order in orders.items()}
    messages = [(oid, "1", bodies[oid]) for oid in orders]
    for oid in rng.sample(sorted(orders)[1:], N_DUPLICATES):
        first = next(i for i, m in enumerate(messages) if m[0] == oid)
        messages.insert(rng.randint(first + 1, len(messages)), (oid, "2", bodies[oid]))
    publish(queue_name, messages)
    expected = {(oid, copy) for oid, copy, _ in messages}

    journal = tmp_path / "journal.jsonl"
    runs = []
    for phase in PHASES:
        kill_at = f"{phase}:{rng.randint(2, 6)}"
        run = ConsumerRun(tmp_path, phase, server, orders_db, queue_name, journal, kill_at)
        runs.append(run)
        code = run.wait(60)
        assert code == -signal.SIGKILL, f"the consumer ({kill_at}) exited with {code}, not SIGKILL\n{run.log()}"
        assert f"SIGKILL at {phase}" in run.log()
        print(f"killed at {kill_at}; acked so far: {len(read_journal(journal))}")

    final = ConsumerRun(tmp_path, "final", server, orders_db, queue_name, journal)
    runs.append(final)
    try:
        # A message reusing the first order's id with another body, published
        # once that order is done: its fingerprint differs, so it is rejected.
        conflict_id = "ord-0000"
        wait_for(lambda: any(e["message_id"] == conflict_id and e["event"] == "ack" for e in read_journal(journal)),
                 60, f"{conflict_id} to be acked")
        tampered = dict(orders[conflict_id], amount_cents=orders[conflict_id]["amount_cents"] + 1)
        publish(queue_name, [(conflict_id, "conflict", json.dumps(tampered, sort_keys=True).encode())])

        def all_settled():
            entries = read_journal(journal)
            acked = {(e["message_id"], e["copy"]) for e in entries if e["event"] == "ack"}
            rejected = {(e["message_id"], e["copy"]) for e in entries if e["event"] == "reject"}
            return expected <= acked and (conflict_id, "conflict") in rejected

        wait_for(all_settled, 90, "every delivery to be acked and the conflicting one rejected")
    finally:
        code = final.stop()
    assert code == 0, f"the final consumer exited with {code}\n{final.log()}"
    assert queue_depth(queue_name) == 0

    entries = read_journal(journal)
    acks = defaultdict(list)
    for e in entries:
        if e["event"] == "ack":
            acks[e["message_id"]].append(e)
    rejects = [e for e in entries if e["event"] == "reject"]
    assert [(e["message_id"], e["copy"], e["reason"]) for e in rejects] == [(conflict_id, "conflict", "fingerprint_mismatch")]
    assert not any(e["copy"] == "conflict" for e in entries if e["event"] == "ack")

    # The consumer's database: every order once, one ledger entry per order,
    # with its amount, written under the lease that completed.
    order_rows = asyncio.run(fetch(orders_db, "SELECT order_id, customer, amount_cents, message_id, fencing FROM orders"))
    ledger_rows = asyncio.run(fetch(orders_db, "SELECT entry_id, order_id, amount_cents, fencing FROM ledger"))
    runs_rows = asyncio.run(fetch(orders_db, "SELECT order_id, fencing FROM effect_runs ORDER BY run_id"))
    assert sorted(r["order_id"] for r in order_rows) == sorted(orders)
    assert sorted(r["order_id"] for r in ledger_rows) == sorted(orders)
    ledger = {r["order_id"]: r for r in ledger_rows}
    effect_runs = defaultdict(list)
    for r in runs_rows:
        effect_runs[r["order_id"]].append(r["fencing"])

    with IdempotencyClient(server.target) as client:
        for row in order_rows:
            oid = row["order_id"]
            order = orders[oid]
            assert (row["customer"], row["amount_cents"], row["message_id"]) == (order["customer"], order["amount_cents"], oid)
            entry = ledger[oid]
            assert entry["amount_cents"] == order["amount_cents"]
            assert entry["fencing"] == row["fencing"]
            # Reruns (after a kill between the effect and Complete) each ran
            # under a newer lease; the last one is what the rows hold.
            assert effect_runs[oid] == sorted(set(effect_runs[oid])), (oid, effect_runs[oid])
            assert effect_runs[oid][-1] == row["fencing"]

            # The service holds the receipt of the lease that wrote the rows.
            record = client.get(consumer_module.NAMESPACE, derive_key("orders", oid))
            assert record.state is State.COMPLETED, (oid, record)
            stored = json.loads(record.response)
            assert stored == {"order_id": oid, "amount_cents": order["amount_cents"],
                              "ledger_entry": entry["entry_id"], "fencing": row["fencing"]}

            # Every ack of every copy saw that same receipt (a replay returns
            # the stored result); at most one of them is the run that
            # completed; a second copy is always acked on a replay.
            copies = {copy for m, copy, _ in messages if m == oid}
            assert {e["copy"] for e in acks[oid]} == copies
            assert all(e["receipt"] == stored for e in acks[oid]), (oid, acks[oid], stored)
            assert sum(not e["replayed"] for e in acks[oid]) <= 1, acks[oid]
            if len(copies) == 2:
                assert any(e["replayed"] for e in acks[oid]), acks[oid]

    # The kills did hit: the effect ran again after the after-effect kill (a
    # newer lease rewrote the same rows), and replays happened.
    reruns = {oid: f for oid, f in effect_runs.items() if len(f) > 1}
    assert reruns, "no effect ran twice: the after_effect kill did not leave an uncompleted effect"
    replays = sum(e["replayed"] for es in acks.values() for e in es)
    assert replays >= N_DUPLICATES
    print(f"{len(orders)} orders, {len(messages)} deliveries published, {replays} replays, "
          f"effect re-run under a newer lease for {sorted(reruns)}")


def test_stale_lease_write_is_rejected(orders_db):
    """The fencing guard alone: a write under an older token than the row's
    changes nothing and raises StaleLease; a newer token takes the row over,
    leaving one order and one ledger entry."""

    async def scenario():
        pool = await asyncpg.create_pool(orders_db, min_size=1, max_size=2)
        try:
            async with pool.acquire() as conn:
                await conn.execute((HERE / "schema.sql").read_text())
            order = {"order_id": "ord-x", "customer": "c", "amount_cents": 500}
            first = await consumer_module.apply_order(pool, order, "ord-x", 5)
            with pytest.raises(consumer_module.StaleLease):
                await consumer_module.apply_order(pool, dict(order, amount_cents=999), "ord-x", 4)
            with pytest.raises(consumer_module.StaleLease):
                await consumer_module.apply_order(pool, order, "ord-x", 5)  # the same token again
            newer = await consumer_module.apply_order(pool, order, "ord-x", 7)
            async with pool.acquire() as conn:
                rows = await conn.fetch(
                    "SELECT o.amount_cents, o.fencing, l.entry_id, l.amount_cents AS ledger_amount, l.fencing AS ledger_fencing"
                    " FROM orders o JOIN ledger l USING (order_id)")
                runs = await conn.fetch("SELECT fencing FROM effect_runs ORDER BY run_id")
            return first, newer, [dict(r) for r in rows], [r["fencing"] for r in runs]
        finally:
            await pool.close()

    first, newer, rows, runs = asyncio.run(scenario())
    assert first["ledger_entry"] == newer["ledger_entry"]
    assert rows == [{"amount_cents": 500, "fencing": 7, "entry_id": first["ledger_entry"],
                     "ledger_amount": 500, "ledger_fencing": 7}]
    assert runs == [5, 7]


@pytest.mark.parametrize(
    "phase, refusal, runs",
    [
        # Stalled after Claim: its effect comes too late and is fenced off.
        ("after_claim", "StaleLease", [2]),
        # Stalled after its effect: its Complete comes too late and is refused.
        ("after_effect", "LeaseLost", [1, 2]),
    ],
)
def test_stalled_holder_is_fenced_off(tmp_path, server, orders_db, queue_name, phase, refusal, runs):
    """A consumer that stalls past its lease (SIGSTOP) while a second copy of
    its message is taken over by another consumer: when it resumes, its late
    effect (token 1) is refused by the guard, or its late Complete by the
    service; it nacks, and the redelivery of its copy is a replay."""
    order = {"order_id": "ord-stale", "customer": "c", "amount_cents": 4200}
    body = json.dumps(order, sort_keys=True).encode()
    journal = tmp_path / "journal.jsonl"

    def entries(event, copy):
        return [e for e in read_journal(journal) if e["event"] == event and e["copy"] == copy]

    publish(queue_name, [("ord-stale", "1", body)])
    # Prefetch 1: while it holds copy 1, RabbitMQ gives it nothing else.
    stalled = ConsumerRun(tmp_path, "stalled", server, orders_db, queue_name, journal,
                          pause_at=f"{phase}:1", prefetch=1)
    takeover = None
    try:
        wait_for(stalled.stopped, 30, "the first consumer to stop itself")
        publish(queue_name, [("ord-stale", "2", body)])
        takeover = ConsumerRun(tmp_path, "takeover", server, orders_db, queue_name, journal)
        wait_for(lambda: entries("ack", "2"), 30, "the second copy to be acked")
        stalled.process.send_signal(signal.SIGCONT)
        wait_for(lambda: entries("ack", "1"), 30, "the first copy to be acked after the stalled consumer resumed")
    finally:
        codes = [run.stop() for run in (stalled, takeover) if run is not None]
    assert codes == [0, 0], f"{codes}\n{stalled.log()}"
    assert queue_depth(queue_name) == 0

    [second] = entries("ack", "2")
    assert (second["replayed"], second["receipt"]["fencing"], second["pid"]) == (False, 2, takeover.process.pid)
    nacks = entries("nack", "1")
    assert [(e["reason"], e["pid"]) for e in nacks] == [(refusal, stalled.process.pid)], read_journal(journal)
    assert all(e["replayed"] and e["receipt"] == second["receipt"] for e in entries("ack", "1"))

    rows = asyncio.run(fetch(orders_db, "SELECT o.amount_cents, o.fencing, l.amount_cents AS ledger_amount, "
                             "l.fencing AS ledger_fencing FROM orders o JOIN ledger l USING (order_id)"))
    assert [dict(r) for r in rows] == [{"amount_cents": 4200, "fencing": 2, "ledger_amount": 4200, "ledger_fencing": 2}]
    effect_runs = asyncio.run(fetch(orders_db, "SELECT fencing FROM effect_runs ORDER BY run_id"))
    assert [r["fencing"] for r in effect_runs] == runs


def test_readme_by_hand(tmp_path, server, orders_db, queue_name):
    """The README's by-hand steps: publish.py twice with the same order; the
    consumer applies it once and acks the second copy on a replay."""
    journal = tmp_path / "journal.jsonl"
    run = ConsumerRun(tmp_path, "by-hand", server, orders_db, queue_name, journal)
    env = dict(os.environ, AMQP_URL=AMQP_URL, QUEUE=queue_name)
    try:
        for _ in range(2):
            subprocess.run([sys.executable, str(HERE / "publish.py"), "ord-1", "c1", "1250"],
                           env=env, check=True, capture_output=True, timeout=30)
        wait_for(lambda: len(read_journal(journal)) == 2, 30, "both copies to be acked")
    finally:
        assert run.stop() == 0, run.log()
    log = run.log()
    assert "message ord-1: applied under fencing token 1, acked" in log
    assert "message ord-1: replayed the stored receipt, acked" in log
    rows = asyncio.run(fetch(orders_db, "SELECT o.amount_cents, l.amount_cents AS ledger_amount, o.fencing "
                             "FROM orders o JOIN ledger l USING (order_id)"))
    assert [dict(r) for r in rows] == [{"amount_cents": 1250, "ledger_amount": 1250, "fencing": 1}]
