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
     order's id with another body (it must be parked, changing nothing);
  5. check: every order once, one ledger entry per order with its amount,
     every delivery acked, every replay equal to the stored result, the
     queue empty, the altered copy in the parking queue with its reason.

Then the cases around it: a stalled holder fenced off; a late copy after the
key's result expired, while the service remembers the key (re-executed under
the next fencing token: the same body rewrites the same rows, another body is
parked) and after it forgot the key (token 1 again: the same body completes
with the ledger's receipt, nothing written; another body is parked); a
ledger outage longer than the retry budget (parked, then moved back by the
operator's script and applied once); the delivery limit dead-lettering into
the parking queue; Purge alone against the operator's procedure.

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

import sqlite3

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
N_ORDERS = int(os.environ.get("N_ORDERS", "60"))
N_DUPLICATES = int(os.environ.get("N_DUPLICATES", "15"))
PREFETCH = 8
LEASE_SECONDS = 2  # a killed consumer's leases run out quickly
RETRY_DELAYS = [0.2, 0.4]  # a small budget: two retries, then parked
DELIVERY_LIMIT = 5  # above the three kills of the first test
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
def reaping_server(tmp_path):
    """A server whose reaper runs every second (the default is every minute),
    remembering completed keys as by default (7 days past their Complete),
    and refusing late retries unless a Claim says otherwise
    (IDEMPOTENCY_LATE_RETRY=refuse): the consumer pins late_retry="reexecute",
    so its late copies are re-executed whatever the server's or the
    namespace's policy (issue 33, defect 6)."""
    data_dir = tmp_path / "service"
    data_dir.mkdir()
    env = {"IDEMPOTENCY_REAPER_INTERVAL": "1s", "IDEMPOTENCY_LATE_RETRY": "refuse"}
    with ServerProcess.start(data_dir=data_dir, env=env) as server:
        server.data_dir = data_dir
        yield server


@pytest.fixture
def forgetting_server(tmp_path):
    """The same, remembering nothing past a result's retention
    (IDEMPOTENCY_REMEMBER_FOR=0s): what any server does past a key's horizon."""
    data_dir = tmp_path / "service"
    data_dir.mkdir()
    env = {"IDEMPOTENCY_REAPER_INTERVAL": "1s", "IDEMPOTENCY_REMEMBER_FOR": "0s"}
    with ServerProcess.start(data_dir=data_dir, env=env) as server:
        server.data_dir = data_dir
        yield server


def record_rows(server, key: str) -> int:
    """How many rows the server's SQLite store holds for the key (0: reaped)."""
    db = sqlite3.connect(f"file:{server.data_dir / 'idempotency.db'}?mode=ro", uri=True, timeout=5)
    try:
        return db.execute("SELECT count(*) FROM idempotency_records WHERE namespace = ? AND key = ?",
                          (consumer_module.NAMESPACE, key)).fetchone()[0]
    finally:
        db.close()


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
    """The consumer's queues as topology.py declares them, deleted at the end."""
    name = f"orders-test-{uuid.uuid4().hex[:12]}"

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


def retry_and_main_depths(queue: str) -> dict:
    return {q: queue_depth(q) for q in topology.queue_names(queue, RETRY_DELAYS) if q != topology.parking_queue(queue)}


def parked(queue: str) -> list:
    """Take every message out of the parking queue: (message_id, headers, body)."""
    async def drain(channel):
        dlq = await channel.declare_queue(topology.parking_queue(queue), passive=True)
        out = []
        while True:
            message = await dlq.get(fail=False, no_ack=True)
            if message is None:
                return out
            out.append((message.message_id, dict(message.headers or {}), message.body))

    return asyncio.run(amqp(drain))


async def fetch(url: str, sql: str):
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetch(sql)
    finally:
        await conn.close()


# -- the consumer process -----------------------------------------------------
class ConsumerRun:
    def __init__(self, tmp_path, name, server, orders_db, queue, journal, kill_at=None, pause_at=None,
                 prefetch=PREFETCH, retention=3600):
        self.log_path = tmp_path / f"consumer-{name}.log"
        env = dict(os.environ)
        env.update(
            AMQP_URL=AMQP_URL,
            QUEUE=queue,
            PREFETCH=str(prefetch),
            ORDERS_DATABASE_URL=orders_db,
            IDEMPOTENCY_TARGET=server.target,
            LEASE_SECONDS=str(LEASE_SECONDS),
            RETENTION_SECONDS=str(retention),
            WAIT_SECONDS="20",
            RETRY_DELAYS=",".join(str(d) for d in RETRY_DELAYS),
            DELIVERY_LIMIT=str(DELIVERY_LIMIT),
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
        # once that order is done: the ledger holds it with another body, so it
        # is parked before any Claim (issue 33, defect 9).
        conflict_id = "ord-0000"
        wait_for(lambda: any(e["message_id"] == conflict_id and e["event"] == "ack" for e in read_journal(journal)),
                 60, f"{conflict_id} to be acked")
        tampered = dict(orders[conflict_id], amount_cents=orders[conflict_id]["amount_cents"] + 1)
        publish(queue_name, [(conflict_id, "conflict", json.dumps(tampered, sort_keys=True).encode())])

        def all_settled():
            entries = read_journal(journal)
            acked = {(e["message_id"], e["copy"]) for e in entries if e["event"] == "ack"}
            rejected = {(e["message_id"], e["copy"]) for e in entries if e["event"] == "park"}
            return expected <= acked and (conflict_id, "conflict") in rejected

        wait_for(all_settled, 90, "every delivery to be acked and the conflicting one parked")
    finally:
        code = final.stop()
    assert code == 0, f"the final consumer exited with {code}\n{final.log()}"
    assert retry_and_main_depths(queue_name) == {q: 0 for q in retry_and_main_depths(queue_name)}
    [(parked_id, parked_headers, parked_body)] = parked(queue_name)
    assert (parked_id, parked_headers["x-test-copy"], parked_headers[topology.PARKED_REASON]) == (
        conflict_id, "conflict", "conflicts_with_applied_order")
    assert json.loads(parked_body)["amount_cents"] == orders[conflict_id]["amount_cents"] + 1

    entries = read_journal(journal)
    acks = defaultdict(list)
    for e in entries:
        if e["event"] == "ack":
            acks[e["message_id"]].append(e)
    rejects = [e for e in entries if e["event"] == "park"]
    assert [(e["message_id"], e["copy"], e["reason"]) for e in rejects] == [(conflict_id, "conflict", "conflicts_with_applied_order")]
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


def test_fenced_writes_never_overwrite_a_newer_token_or_another_body(orders_db):
    """The guard alone: after a write under token 5, the same body under 4 or
    5 writes nothing and returns the rows as they stand (the receipt a late
    copy completes with); another body is refused under any token, even 9
    (LedgerConflict); the same body under 7 takes the rows over, leaving one
    order and one ledger entry."""

    async def scenario():
        pool = await asyncpg.create_pool(orders_db, min_size=1, max_size=2)
        try:
            async with pool.acquire() as conn:
                await conn.execute((HERE / "schema.sql").read_text())
            order = {"order_id": "ord-x", "customer": "c", "amount_cents": 500}
            fp = consumer_module.fingerprint(b"body-500")
            first, wrote_first = await consumer_module.apply_order(pool, order, "ord-x", fp, 5)
            older = await consumer_module.apply_order(pool, order, "ord-x", fp, 4)
            equal = await consumer_module.apply_order(pool, order, "ord-x", fp, 5)
            other = consumer_module.fingerprint(b"body-999")
            for token in (1, 5, 9):
                with pytest.raises(consumer_module.LedgerConflict):
                    await consumer_module.apply_order(pool, dict(order, amount_cents=999), "ord-x", other, token)
            newer, wrote_newer = await consumer_module.apply_order(pool, order, "ord-x", fp, 7)
            async with pool.acquire() as conn:
                rows = await conn.fetch(
                    "SELECT o.amount_cents, o.fencing, l.entry_id, l.amount_cents AS ledger_amount, l.fencing AS ledger_fencing"
                    " FROM orders o JOIN ledger l USING (order_id)")
                runs = await conn.fetch("SELECT fencing FROM effect_runs ORDER BY run_id")
            return (first, wrote_first), older, equal, (newer, wrote_newer), [dict(r) for r in rows], [r["fencing"] for r in runs]
        finally:
            await pool.close()

    (first, wrote_first), older, equal, (newer, wrote_newer), rows, runs = asyncio.run(scenario())
    assert wrote_first and wrote_newer
    assert older == (first, False) and equal == (first, False)
    assert first == {"order_id": "ord-x", "amount_cents": 500, "ledger_entry": first["ledger_entry"], "fencing": 5}
    assert newer == dict(first, fencing=7)
    assert rows == [{"amount_cents": 500, "fencing": 7, "entry_id": first["ledger_entry"],
                     "ledger_amount": 500, "ledger_fencing": 7}]
    assert runs == [5, 7]


@pytest.mark.parametrize(
    "phase, runs",
    [
        # Stalled after Claim: its effect comes too late and writes nothing
        # (the rows carry token 2); its Complete is refused.
        ("after_claim", [2]),
        # Stalled after its effect: its Complete comes too late and is refused.
        ("after_effect", [1, 2]),
    ],
)
def test_stalled_holder_is_fenced_off(tmp_path, server, orders_db, queue_name, phase, runs):
    """A consumer that stalls past its lease (SIGSTOP) while a second copy of
    its message is taken over by another consumer: when it resumes, its late
    effect (token 1) writes nothing, and its late Complete is refused by the
    service (LeaseLost); it sends its copy to the retry queue, and the retry
    is a replay."""
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
    assert parked(queue_name) == []

    [second] = entries("ack", "2")
    assert (second["replayed"], second["receipt"]["fencing"], second["pid"]) == (False, 2, takeover.process.pid)
    retries = entries("retry", "1")
    assert [(e["reason"], e["attempt"], e["pid"]) for e in retries] == [("LeaseLost", 1, stalled.process.pid)], \
        read_journal(journal)
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
    env = dict(os.environ, AMQP_URL=AMQP_URL, QUEUE=queue_name, DELIVERY_LIMIT=str(DELIVERY_LIMIT),
               RETRY_DELAYS=",".join(str(d) for d in RETRY_DELAYS))  # publish.py declares the queues too
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


def order_body(order_id: str, amount: int, customer: str = "c-late") -> bytes:
    return json.dumps({"order_id": order_id, "customer": customer, "amount_cents": amount}, sort_keys=True).encode()


def order_rows(orders_db: str) -> list:
    return [dict(r) for r in asyncio.run(fetch(
        orders_db, "SELECT o.order_id, o.amount_cents, o.fencing, o.updated_at, l.entry_id, "
                   "l.amount_cents AS ledger_amount, l.fencing AS ledger_fencing "
                   "FROM orders o JOIN ledger l USING (order_id) ORDER BY order_id"))]


def effect_runs(orders_db: str) -> list:
    return [r["fencing"] for r in asyncio.run(fetch(orders_db, "SELECT fencing FROM effect_runs ORDER BY run_id"))]


def remembered(server, key: str, token: int):
    """The key's Get while the service remembers it (its result expired):
    STATE_ABSENT with remembered_until set, under the last lease's token."""
    with IdempotencyClient(server.target) as client:
        record = client.get(consumer_module.NAMESPACE, key)
    if record.state is State.ABSENT and record.remembered_until is not None:
        assert record.fencing_token == token, record
        return record
    return None


def test_late_copy_within_remember_for_is_re_executed_under_the_next_token(
        tmp_path, reaping_server, orders_db, queue_name):
    """Issue 24. An order completes with a 1 s retention; the result expires
    and the service remembers the key (7 days by default), so a late copy is
    re-executed: CLAIMED under the NEXT fencing token, with completed_at.
    (a) The same body again: the guarded write rewrites the same rows under
        token 2 (one order, one ledger entry, the same amount and entry), and
        Complete stores that receipt; the consumer logs the late retry.
    (b) Another body under the same order id, once the result expired again,
        twice: the ledger holds the order with another body, so both are
        parked as conflicts_with_applied_order before any Claim; the key stays
        remembered under token 2 with the first body's fingerprint, and the
        rows stay as (a) left them.
    (c) Issue 33, defect 9: a copy of the first body after those conflicts is
        a duplicate, acked (re-executed under token 3, rewriting the same
        rows). It was parked as fingerprint_mismatch: the conflicting copies
        were Claimed, refused by the guard, and released, leaving the key
        holding their fingerprint.
    (d) The same when the service does hold another body's fingerprint (a
        conflicting copy Claimed and released elsewhere: the test does it):
        the copy of the applied body is told FINGERPRINT_MISMATCH, finds its
        own body in the ledger, and is acked as a duplicate, not parked."""
    server = reaping_server
    journal = tmp_path / "journal.jsonl"
    key = derive_key("orders", "ord-late")
    run = ConsumerRun(tmp_path, "late", server, orders_db, queue_name, journal, retention=1)

    def events(event, copy):
        return [e for e in read_journal(journal) if e["event"] == event and e["copy"] == copy]

    try:
        publish(queue_name, [("ord-late", "first", order_body("ord-late", 500))])
        wait_for(lambda: events("ack", "first"), 30, "the first copy to be acked")
        [first] = events("ack", "first")
        assert (first["replayed"], first["wrote"], first["late_retry"], first["receipt"]["fencing"]) == (
            False, True, None, 1)
        [before] = order_rows(orders_db)
        marker = wait_for(lambda: remembered(server, key, 1), 30, "the result to expire, the key remembered")

        # (a) the same body, within remember_for
        publish(queue_name, [("ord-late", "same", order_body("ord-late", 500))])
        wait_for(lambda: events("ack", "same"), 30, "the late copy with the same body to be acked")
        [same] = events("ack", "same")
        assert (same["replayed"], same["wrote"]) == (False, True)
        assert same["late_retry"] == marker.completed_at.isoformat()
        assert same["receipt"] == {**first["receipt"], "fencing": 2}  # the same entry, the next token
        with IdempotencyClient(server.target) as client:
            record = client.get(consumer_module.NAMESPACE, key)
        assert (record.state, record.fencing_token, json.loads(record.response)) == (
            State.COMPLETED, 2, same["receipt"])
        [after] = order_rows(orders_db)
        assert {k: after[k] for k in ("order_id", "amount_cents", "entry_id", "ledger_amount")} == {
            k: before[k] for k in ("order_id", "amount_cents", "entry_id", "ledger_amount")}
        assert (after["fencing"], after["ledger_fencing"]) == (2, 2)
        assert effect_runs(orders_db) == [1, 2]  # run twice, one order and one entry
        wait_for(lambda: remembered(server, key, 2), 30, "the result to expire again")

        # (b) another body under the same order id, twice
        publish(queue_name, [("ord-late", "other-1", order_body("ord-late", 999)),
                             ("ord-late", "other-2", order_body("ord-late", 999))])
        wait_for(lambda: events("park", "other-1") and events("park", "other-2"), 30,
                 "both copies with another body to be parked")
        with IdempotencyClient(server.target) as client:
            record = client.get(consumer_module.NAMESPACE, key)
        # No Claim for them: still remembered under token 2, the first body's fingerprint.
        assert (record.state, record.fencing_token, record.fingerprint) == (
            State.ABSENT, 2, fingerprint(order_body("ord-late", 500)))

        # (c) the first body again, after the conflicts
        publish(queue_name, [("ord-late", "same-again", order_body("ord-late", 500))])
        wait_for(lambda: events("ack", "same-again") or events("park", "same-again"), 30,
                 "the copy of the applied body to be settled")
        assert not events("park", "same-again"), events("park", "same-again")
        [again] = events("ack", "same-again")
        assert (again["replayed"], again["wrote"], again["receipt"]) == (False, True, {**first["receipt"], "fencing": 3})
        wait_for(lambda: remembered(server, key, 3), 30, "the result to expire again")

        # (d) the service holds another body's fingerprint (Claimed and released elsewhere)
        with IdempotencyClient(server.target) as client:
            other = client.claim(consumer_module.NAMESPACE, key, fingerprint=fingerprint(order_body("ord-late", 999)),
                                 lease_ttl=30, late_retry="reexecute")
            assert (other.claimed, other.fencing_token) == (True, 4)
            client.release(consumer_module.NAMESPACE, key, other.lease_token)
        publish(queue_name, [("ord-late", "same-released", order_body("ord-late", 500))])
        wait_for(lambda: events("ack", "same-released") or events("park", "same-released"), 30,
                 "the copy of the applied body to be settled")
        assert not events("park", "same-released"), events("park", "same-released")
        [dup] = events("ack", "same-released")
        assert (dup["replayed"], dup["wrote"], dup["duplicate_of_ledger"]) == (True, False, True)
        assert dup["receipt"] == {**first["receipt"], "fencing": 3}
    finally:
        assert run.stop() == 0, run.log()
    [after] = order_rows(orders_db)
    assert (after["amount_cents"], after["ledger_amount"], after["entry_id"], after["fencing"]) == (
        500, 500, before["entry_id"], 3)
    assert effect_runs(orders_db) == [1, 2, 3]
    entries = read_journal(journal)
    assert [(e["event"], e["copy"], e.get("reason")) for e in entries[:2]] == [("ack", "first", None), ("ack", "same", None)]
    assert sorted((e["event"], e["copy"], e.get("reason")) for e in entries[2:4]) == [
        ("park", "other-1", "conflicts_with_applied_order"), ("park", "other-2", "conflicts_with_applied_order")]
    assert [(e["event"], e["copy"]) for e in entries[4:]] == [("ack", "same-again"), ("ack", "same-released")]
    dlq = parked(queue_name)
    assert sorted((m, h["x-test-copy"], h[topology.PARKED_REASON], json.loads(b)["amount_cents"]) for m, h, b in dlq) == [
        ("ord-late", "other-1", "conflicts_with_applied_order", 999),
        ("ord-late", "other-2", "conflicts_with_applied_order", 999)]
    assert all("500 cents, fencing token 2" in h[topology.PARKED_DETAIL] for _, h, _ in dlq)
    assert retry_and_main_depths(queue_name) == {q: 0 for q in retry_and_main_depths(queue_name)}
    log = run.log()
    assert (f"message ord-late: a late retry (completed before at {marker.completed_at.isoformat()}, its result "
            "expired): re-executed under fencing token 2, rewrote the same rows, acked") in log


def test_late_copy_after_the_service_forgot_the_key(tmp_path, forgetting_server, orders_db, queue_name):
    """Issue 26, defect 1, and issue 24 past the horizon. An order completes
    with a 1 s retention on a server that remembers nothing past it; its
    record expires and the reaper deletes it, so the next Claim of the key
    starts again at fencing token 1, the token the rows already carry.
    (a) The same body again: completed with the receipt the ledger holds (the
        one the first copy stored), acked; nothing written twice.
    (b) Another body under the same order id, after the next reaping, twice:
        the ledger holds the order with another body, so both are parked in
        <queue>.dlq as conflicts_with_applied_order before any Claim; the
        amount is never overwritten."""
    server = forgetting_server
    journal = tmp_path / "journal.jsonl"
    key = derive_key("orders", "ord-late")
    run = ConsumerRun(tmp_path, "late", server, orders_db, queue_name, journal, retention=1)

    def events(event, copy):
        return [e for e in read_journal(journal) if e["event"] == event and e["copy"] == copy]

    def wait_reaped():
        wait_for(lambda: record_rows(server, key) == 0, 30, "the record to expire and be reaped")

    try:
        publish(queue_name, [("ord-late", "first", order_body("ord-late", 500))])
        wait_for(lambda: events("ack", "first"), 30, "the first copy to be acked")
        [first] = events("ack", "first")
        assert (first["replayed"], first["wrote"], first["receipt"]["fencing"]) == (False, True, 1)
        rows_before = order_rows(orders_db)
        wait_reaped()

        # (a) the same body, after the reaping
        publish(queue_name, [("ord-late", "same", order_body("ord-late", 500))])
        wait_for(lambda: events("ack", "same"), 30, "the late copy with the same body to be acked")
        [same] = events("ack", "same")
        assert (same["replayed"], same["wrote"], same["late_retry"], same["receipt"]) == (
            False, False, None, first["receipt"])
        with IdempotencyClient(server.target) as client:
            record = client.get(consumer_module.NAMESPACE, key)
        assert (record.state, record.fencing_token, json.loads(record.response)) == (
            State.COMPLETED, 1, first["receipt"])  # token 1 again: the restart case
        assert order_rows(orders_db) == rows_before  # updated_at too: not even rewritten
        assert effect_runs(orders_db) == [1]
        wait_reaped()

        # (b) another body under the same order id, twice
        publish(queue_name, [("ord-late", "other-1", order_body("ord-late", 999)),
                             ("ord-late", "other-2", order_body("ord-late", 999))])
        wait_for(lambda: events("park", "other-1") and events("park", "other-2"), 30,
                 "both copies with another body to be parked")
    finally:
        assert run.stop() == 0, run.log()
    assert order_rows(orders_db) == rows_before
    assert effect_runs(orders_db) == [1]
    entries = read_journal(journal)
    assert [(e["event"], e["copy"], e.get("reason")) for e in entries[:2]] == [("ack", "first", None), ("ack", "same", None)]
    # The two other-body copies are handled concurrently: either is parked first.
    assert sorted((e["event"], e["copy"], e.get("reason")) for e in entries[2:]) == [
        ("park", "other-1", "conflicts_with_applied_order"), ("park", "other-2", "conflicts_with_applied_order")]
    dlq = parked(queue_name)
    assert sorted((m, h["x-test-copy"], h[topology.PARKED_REASON], json.loads(b)["amount_cents"]) for m, h, b in dlq) == [
        ("ord-late", "other-1", "conflicts_with_applied_order", 999),
        ("ord-late", "other-2", "conflicts_with_applied_order", 999)]
    assert all("500 cents" in h[topology.PARKED_DETAIL] for _, h, _ in dlq)
    assert retry_and_main_depths(queue_name) == {q: 0 for q in retry_and_main_depths(queue_name)}
    log = run.log()
    assert "message ord-late: already applied under fencing token 1 (the service had forgotten the key); " \
           "completed with that receipt, acked" in log


def test_ledger_outage_longer_than_the_retry_budget_is_parked_then_applied_once(tmp_path, server, orders_db, queue_name):
    """Issue 26, defect 4. The ledger table is gone (renamed) while an order
    arrives: each attempt fails, goes to the retry queue of its backoff step
    (0.2 s, then 0.4 s), and when the budget of two retries is spent the order
    is parked in <queue>.dlq as retries_exhausted; nothing is lost and nothing
    was applied. The operator brings the table back and moves the message
    back with requeue_parked.py: applied once."""
    journal = tmp_path / "journal.jsonl"
    run = ConsumerRun(tmp_path, "outage", server, orders_db, queue_name, journal)
    try:
        wait_for(lambda: "consuming" in run.log(), 30, "the consumer to start (its schema applied)")
        asyncio.run(fetch(orders_db, "ALTER TABLE ledger RENAME TO ledger_offline"))
        publish(queue_name, [("ord-outage", "1", order_body("ord-outage", 777))])
        wait_for(lambda: any(e["event"] == "park" for e in read_journal(journal)), 30, "the order to be parked")
        entries = read_journal(journal)
        assert [(e["event"], e.get("attempt"), e["reason"]) for e in entries] == [
            ("retry", 1, "UndefinedTableError"), ("retry", 2, "UndefinedTableError"), ("park", None, "retries_exhausted")]
        assert retry_and_main_depths(queue_name) == {q: 0 for q in retry_and_main_depths(queue_name)}
        assert queue_depth(topology.parking_queue(queue_name)) == 1
        assert asyncio.run(fetch(orders_db, "SELECT count(*) AS n FROM orders"))[0]["n"] == 0
        with IdempotencyClient(server.target) as client:
            record = client.get(consumer_module.NAMESPACE, derive_key("orders", "ord-outage"))
        assert (record.state, record.fencing_token) == (State.RELEASED, 3)  # three attempts, each released

        # The operator: the ledger is back; move the parked order back.
        asyncio.run(fetch(orders_db, "ALTER TABLE ledger_offline RENAME TO ledger"))
        listing = subprocess.run([sys.executable, str(HERE / "requeue_parked.py")], capture_output=True, text=True,
                                 env=dict(os.environ, AMQP_URL=AMQP_URL, QUEUE=queue_name), check=True, timeout=30)
        assert listing.stdout.splitlines() == ["parked\tord-outage\tretries_exhausted"]
        moved = subprocess.run([sys.executable, str(HERE / "requeue_parked.py"), "--move", "--reason", "retries_exhausted"],
                               capture_output=True, text=True, env=dict(os.environ, AMQP_URL=AMQP_URL, QUEUE=queue_name),
                               check=True, timeout=30)
        assert moved.stdout.splitlines() == ["moved\tord-outage\tretries_exhausted"]
        wait_for(lambda: any(e["event"] == "ack" for e in read_journal(journal)), 30, "the moved order to be acked")
    finally:
        assert run.stop() == 0, run.log()
    [ack] = [e for e in read_journal(journal) if e["event"] == "ack"]
    assert (ack["wrote"], ack["receipt"]["amount_cents"], ack["receipt"]["fencing"]) == (True, 777, 4)
    rows = order_rows(orders_db)
    assert [(r["order_id"], r["amount_cents"], r["ledger_amount"], r["fencing"]) for r in rows] == [("ord-outage", 777, 777, 4)]
    assert effect_runs(orders_db) == [4]
    assert queue_depth(topology.parking_queue(queue_name)) == 0


def test_delivery_limit_dead_letters_into_the_parking_queue(queue_name):
    """The main queue is a durable quorum queue whose delivery limit
    dead-letters into <queue>.dlq. What counts toward the limit, on the
    broker the tests run (issue 33, defect 4): a message given back
    DELIVERY_LIMIT + 1 times, alternately by basic.reject with requeue (what
    the consumers do when they cannot publish a retry copy) and by closing the
    channel that holds it unacked (a consumer that died), lands there, with
    RabbitMQ's x-death saying why: both count on every version. basic.nack
    with requeue counts before RabbitMQ 4.3 and not from 4.3 on (the limit
    then reads failed deliveries only): the test asserts what the broker's
    version says. Declaring the queue as classic, or non-durable, is refused:
    the broker holds these arguments."""

    async def give_back(connection, channel, message_id: str, how) -> tuple:
        """Publish a message, give it back with how(connection, message) until
        it leaves the queue (at most DELIVERY_LIMIT + 2 times): (returns, its
        dead-lettered copy or None)."""
        await channel.default_exchange.publish(
            aio_pika.Message(b"{}", message_id=message_id, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
            routing_key=queue_name)
        dlq = await channel.declare_queue(topology.parking_queue(queue_name), passive=True)
        returns = 0
        deadline = time.monotonic() + 30
        while returns <= DELIVERY_LIMIT + 1 and time.monotonic() < deadline:
            holder = await connection.channel()
            queue = await holder.declare_queue(queue_name, passive=True)
            message = await queue.get(fail=False)
            if message is None:
                await holder.close()
                dead = await dlq.get(fail=False, no_ack=True)
                if dead is not None:
                    return returns, dead
                await asyncio.sleep(0.05)
                continue
            await how(holder, message, returns)
            returns += 1
        queue = await channel.declare_queue(queue_name, passive=True)
        await queue.purge()
        return returns, None

    async def reject_or_die(holder, message, n):
        if n % 2 == 0:
            await message.reject(requeue=True)
        await holder.close()  # odd: closed holding it unacked, as a dying consumer

    async def nack(holder, message, n):
        await message.nack(requeue=True)
        await holder.close()

    async def scenario():
        connection = await aio_pika.connect(AMQP_URL)
        try:
            version = connection.transport.connection.server_properties["version"]
            version = version.decode() if isinstance(version, bytes) else version
            channel = await connection.channel()
            return (version, await give_back(connection, channel, "poison", reject_or_die),
                    await give_back(connection, channel, "nacked", nack))
        finally:
            await connection.close()

    version, (returns, dead), (nack_returns, nack_dead) = asyncio.run(scenario())
    print(f"RabbitMQ {version}")
    assert returns == DELIVERY_LIMIT + 1
    assert dead is not None and dead.message_id == "poison"
    assert dead.headers["x-first-death-reason"] == "delivery_limit"
    if tuple(int(p) for p in version.split(".")[:2]) < (4, 3):
        # Every return counts: nack with requeue too.
        assert (nack_returns, nack_dead is not None and nack_dead.message_id) == (DELIVERY_LIMIT + 1, "nacked")
    else:
        # A nack with requeue is not a failed delivery: never dead-lettered.
        assert (nack_returns, nack_dead) == (DELIVERY_LIMIT + 2, None)

    for durable, arguments in ((True, {"x-queue-type": "classic"}), (False, {"x-queue-type": "quorum"})):
        async def redeclare(channel):
            await channel.declare_queue(queue_name, durable=durable, arguments=arguments)

        with pytest.raises(aio_pika.exceptions.ChannelPreconditionFailed):
            asyncio.run(amqp(redeclare))


def test_purge_alone_does_not_rerun_a_guarded_effect(tmp_path, server, orders_db, queue_name):
    """Purge makes the key claimable again, but the ledger is the effect's own
    record: the same body after a Purge takes the key under the next token and
    rewrites the same row (one order, one ledger entry, same amount); another
    body after a Purge is parked (the ledger refuses it). The operator's
    procedure to run an order again with a corrected body: void the rows, Purge
    the key, publish the corrected order: applied under the next token."""
    journal = tmp_path / "journal.jsonl"
    key = derive_key("orders", "ord-purge")
    run = ConsumerRun(tmp_path, "purge", server, orders_db, queue_name, journal)

    def acks(copy):
        return [e for e in read_journal(journal) if e["event"] == "ack" and e["copy"] == copy]

    try:
        with IdempotencyClient(server.target) as client:
            publish(queue_name, [("ord-purge", "first", order_body("ord-purge", 100))])
            wait_for(lambda: acks("first"), 30, "the first copy to be acked")
            assert client.purge(consumer_module.NAMESPACE, key, reason="test: purge alone").purged

            publish(queue_name, [("ord-purge", "again", order_body("ord-purge", 100))])
            wait_for(lambda: acks("again"), 30, "the same body after the Purge to be acked")
            [again] = acks("again")
            assert (again["wrote"], again["receipt"]["amount_cents"], again["receipt"]["fencing"]) == (True, 100, 2)
            assert [(r["amount_cents"], r["fencing"]) for r in order_rows(orders_db)] == [(100, 2)]

            assert client.purge(consumer_module.NAMESPACE, key, reason="test: purge, another body").purged
            publish(queue_name, [("ord-purge", "corrected", order_body("ord-purge", 150))])
            wait_for(lambda: [e for e in read_journal(journal) if e["event"] == "park"], 30, "the other body to be parked")
            assert [(r["amount_cents"], r["fencing"]) for r in order_rows(orders_db)] == [(100, 2)]
            assert [(h[topology.PARKED_REASON]) for _, h, _ in parked(queue_name)] == ["conflicts_with_applied_order"]

            # The procedure: void the rows (here: delete them, in one
            # transaction), Purge the key, publish the corrected order.
            asyncio.run(fetch(orders_db, "WITH l AS (DELETE FROM ledger WHERE order_id = 'ord-purge') "
                                         "DELETE FROM orders WHERE order_id = 'ord-purge'"))
            client.purge(consumer_module.NAMESPACE, key, reason="test: rerun with the corrected amount")
            publish(queue_name, [("ord-purge", "rerun", order_body("ord-purge", 150))])
            wait_for(lambda: acks("rerun"), 30, "the corrected order to be acked")
            [rerun] = acks("rerun")
            assert (rerun["wrote"], rerun["receipt"]["amount_cents"]) == (True, 150)
            record = client.get(consumer_module.NAMESPACE, key)
            assert (record.state, json.loads(record.response)) == (State.COMPLETED, rerun["receipt"])
    finally:
        assert run.stop() == 0, run.log()
    assert [(r["amount_cents"], r["ledger_amount"]) for r in order_rows(orders_db)] == [(150, 150)]


#: Bodies a consumer must refuse, each with the reason it is parked with
#: (issue 33, defects 1 and 2): int() read 12.99 as 12 and true as 1, and
#: 1e400 (inf) or NaN raised out of the handler, leaving the message unacked.
POISON = [
    ("ord-fraction", b'{"order_id": "ord-fraction", "customer": "c", "amount_cents": 12.99}',
     "amount_cents must be an integer number of cents within +-(2^53 - 1), not 12.99"),
    ("ord-float", b'{"order_id": "ord-float", "customer": "c", "amount_cents": 1299.0}',
     "amount_cents must be an integer number of cents within +-(2^53 - 1), not 1299.0"),
    ("ord-bool", b'{"order_id": "ord-bool", "customer": "c", "amount_cents": true}',
     "amount_cents must be an integer number of cents within +-(2^53 - 1), not true"),
    ("ord-string", b'{"order_id": "ord-string", "customer": "c", "amount_cents": "1299"}',
     'amount_cents must be an integer number of cents within +-(2^53 - 1), not "1299"'),
    ("ord-huge", b'{"order_id": "ord-huge", "customer": "c", "amount_cents": 1e400}',
     "amount_cents must be an integer number of cents within +-(2^53 - 1), not 1E+400"),
    ("ord-big", b'{"order_id": "ord-big", "customer": "c", "amount_cents": 9007199254740992}',
     "amount_cents must be an integer number of cents within +-(2^53 - 1), not 9007199254740992"),
    ("ord-nan", b'{"order_id": "ord-nan", "customer": "c", "amount_cents": NaN}',
     "not JSON: NaN is not a JSON number"),
    ("ord-inf", b'{"order_id": "ord-inf", "customer": "c", "amount_cents": -Infinity}',
     "not JSON: -Infinity is not a JSON number"),
    ("ord-customer", b'{"order_id": "ord-customer", "customer": 42, "amount_cents": 5}',
     "customer must be a non-empty string, not a JSON number"),
]


def test_poison_amounts_are_parked_and_the_queue_goes_on(tmp_path, server, orders_db, queue_name):
    """Issue 33, defects 1 and 2. Amounts that are not an integer number of
    cents (12.99, 1299.0, true, "1299", 1e400, 2^53) and non-finite numbers
    (NaN, -Infinity, which Python's json reads) are parked as not_an_order
    with the reason, without a Claim; an order published behind them is
    applied, and the consumer keeps running."""
    journal = tmp_path / "journal.jsonl"
    publish(queue_name, [(oid, oid, body) for oid, body, _ in POISON]
            + [("ord-good", "ord-good", order_body("ord-good", 1299))])
    run = ConsumerRun(tmp_path, "poison", server, orders_db, queue_name, journal)
    try:
        wait_for(lambda: {e["copy"] for e in read_journal(journal)} >= {oid for oid, _, _ in POISON} | {"ord-good"},
                 30, "every message to be parked or acked")
        assert run.process.poll() is None, run.log()
    finally:
        assert run.stop() == 0, run.log()
    entries = read_journal(journal)
    assert sorted((e["copy"], e["event"], e.get("reason")) for e in entries) == sorted(
        [(oid, "park", "not_an_order") for oid, _, _ in POISON] + [("ord-good", "ack", None)])
    dlq = {h["x-test-copy"]: (h[topology.PARKED_REASON], h[topology.PARKED_DETAIL], body) for _, h, body in parked(queue_name)}
    assert dlq == {oid: ("not_an_order", detail, body) for oid, body, detail in POISON}
    assert [(r["order_id"], r["amount_cents"], r["ledger_amount"]) for r in order_rows(orders_db)] == [
        ("ord-good", 1299, 1299)]
    with IdempotencyClient(server.target) as client:  # nothing was claimed for them
        for oid, _, _ in POISON:
            assert client.get(consumer_module.NAMESPACE, derive_key("orders", oid)).state is State.ABSENT


def test_a_purged_key_is_forgotten_after_the_reaper(tmp_path, reaping_server, orders_db, queue_name):
    """Issue 33, defect 8: what Purge leaves behind, as docs/recipes.md now
    says. On a server that refuses late retries and reaps every second, an
    order completes (its result stored for an hour) and is purged: right
    away a Claim with late_retry="refuse" would be CLAIMED (the test's Get
    shows the record expired, not remembered), and once the reaper ran the
    key is forgotten: no row, no marker. The same body then Claims token 1
    again (the counter does not go on past the reaper), writes nothing and is
    acked with the rows as its receipt: one order, one ledger entry."""
    server = reaping_server
    journal = tmp_path / "journal.jsonl"
    key = derive_key("orders", "ord-reaped")
    run = ConsumerRun(tmp_path, "reaped", server, orders_db, queue_name, journal)

    def acks(copy):
        return [e for e in read_journal(journal) if e["event"] == "ack" and e["copy"] == copy]

    try:
        publish(queue_name, [("ord-reaped", "first", order_body("ord-reaped", 100))])
        wait_for(lambda: acks("first"), 30, "the first copy to be acked")
        [first] = acks("first")
        rows_before = order_rows(orders_db)
        with IdempotencyClient(server.target) as client:
            purged = client.purge(consumer_module.NAMESPACE, key, reason="test: purge, then the reaper")
            assert (purged.purged, purged.previous_state) == (True, State.COMPLETED)
            got = client.get(consumer_module.NAMESPACE, key)
            assert (got.state, got.remembered_until) == (State.ABSENT, None)  # expired, not remembered
        wait_for(lambda: record_rows(server, key) == 0, 30, "the reaper to delete the purged row")

        publish(queue_name, [("ord-reaped", "again", order_body("ord-reaped", 100))])
        wait_for(lambda: acks("again"), 30, "the same body after the Purge and the reaper to be acked")
    finally:
        assert run.stop() == 0, run.log()
    [again] = acks("again")
    assert (again["replayed"], again["wrote"], again["late_retry"], again["receipt"]) == (False, False, None, first["receipt"])
    with IdempotencyClient(server.target) as client:
        record = client.get(consumer_module.NAMESPACE, key)
    assert (record.state, record.fencing_token) == (State.COMPLETED, 1)  # token 1 again
    assert order_rows(orders_db) == rows_before
    assert effect_runs(orders_db) == [1]
