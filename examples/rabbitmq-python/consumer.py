"""An order consumer for RabbitMQ, exactly-once with idempotency-service.

Each message is an order: {"order_id": "...", "customer": "...", "amount_cents": 1234}.
Its effect is an order row plus a ledger row, written in this consumer's own
PostgreSQL database in one transaction and guarded by the lease's fencing token.

    for each delivery (manual acks, prefetch > 1, handled concurrently):
      key         = derive_key("orders", message_id)     stable across redeliveries
      fingerprint = fingerprint(body)                    same id, other body: rejected
      once(key):  Claim -> CLAIMED: run the effect (fenced), Complete with its receipt
                        -> COMPLETED: the stored receipt (a replay); nothing runs
                        -> IN_PROGRESS: wait for the other lease (up to WAIT_SECONDS)
      ack only after once() returned; nack (requeue) when it raised

Configuration (environment):
  AMQP_URL              amqp://guest:guest@127.0.0.1:5672/
  QUEUE                 orders                  (declared durable if absent)
  PREFETCH              10                      unacked deliveries in flight
  ORDERS_DATABASE_URL   postgres://postgres@127.0.0.1:5432/orders   (this consumer's own database)
  IDEMPOTENCY_TARGET    127.0.0.1:50051
  LEASE_SECONDS         30      lease per message; once()'s heartbeat extends it while the effect runs
  RETENTION_SECONDS     604800  how long a completed message's receipt is kept and replayed (7 days)
  WAIT_SECONDS          60      how long a redelivery waits on another consumer's live lease

For the test only (tests/test_exactly_once.py):
  CONSUMER_JOURNAL      a file to append one JSON line per ack, nack or reject
  CONSUMER_KILL_AT      PHASE:N  SIGKILL this process when the Nth message reaches
                        PHASE: after_claim (lease held, before the effect),
                        after_effect (effect committed, before Complete),
                        after_complete (Complete done, before the ack)
  CONSUMER_PAUSE_AT     PHASE:N  SIGSTOP this process there instead (a consumer
                        that stalls past its lease; the test sends SIGCONT)
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pathlib
import signal
import sys
from typing import Any, Optional, Set

import aio_pika
import asyncpg

from idempotency_client import (
    AsyncIdempotencyClient,
    FingerprintMismatch,
    IdempotencyError,
    InProgress,
    LeaseLost,
    derive_key,
    fingerprint,
)

log = logging.getLogger("orders-consumer")

#: The namespace of this consumer's keys in the idempotency service.
NAMESPACE = "orders-consumer"

HERE = pathlib.Path(__file__).resolve().parent

# The effect, in one transaction. Both upserts carry the lease's fencing token
# and only overwrite a row written under an OLDER token: a rerun by a newer
# lease (the previous holder died after the commit, before Complete) rewrites
# the same values; a write by an older lease (a holder that stalled past its
# lease) changes nothing, and the transaction is rolled back.
UPSERT_ORDER = """
INSERT INTO orders (order_id, customer, amount_cents, message_id, fencing)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (order_id) DO UPDATE
   SET customer = EXCLUDED.customer,
       amount_cents = EXCLUDED.amount_cents,
       message_id = EXCLUDED.message_id,
       fencing = EXCLUDED.fencing,
       updated_at = now()
 WHERE orders.fencing < EXCLUDED.fencing
RETURNING order_id
"""

UPSERT_LEDGER = """
INSERT INTO ledger (order_id, amount_cents, fencing)
VALUES ($1, $2, $3)
ON CONFLICT (order_id) DO UPDATE
   SET amount_cents = EXCLUDED.amount_cents,
       fencing = EXCLUDED.fencing
 WHERE ledger.fencing < EXCLUDED.fencing
RETURNING entry_id
"""

RECORD_RUN = "INSERT INTO effect_runs (order_id, fencing, pid) VALUES ($1, $2, $3)"


class StaleLease(Exception):
    """A newer lease holder already wrote this order: our write was rejected."""


class BadMessage(Exception):
    """A message this consumer can never process (not JSON, fields missing)."""


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


# -- test hooks -----------------------------------------------------------
class KillSwitch:
    """CONSUMER_KILL_AT=PHASE:N: SIGKILL this process when the Nth message
    reaches PHASE. No cleanup runs: the AMQP connection drops, RabbitMQ
    requeues every unacked delivery, and the leases run out on their own.
    CONSUMER_PAUSE_AT=PHASE:N: SIGSTOP it there instead (until SIGCONT)."""

    def __init__(self, kill: Optional[str], pause: Optional[str] = None):
        self.points = {}  # phase -> [signal, at, count]
        for name, spec, signum in (("KILL", kill, signal.SIGKILL), ("PAUSE", pause, signal.SIGSTOP)):
            if spec:
                phase, _, n = spec.partition(":")
                if phase not in ("after_claim", "after_effect", "after_complete"):
                    raise SystemExit(f"CONSUMER_{name}_AT: unknown phase {phase!r}")
                self.points[phase] = [signum, int(n or 1), 0]

    def reached(self, phase: str, message_id: str) -> None:
        point = self.points.get(phase)
        if point is None:
            return
        point[2] += 1
        if point[2] == point[1]:
            name = signal.Signals(point[0]).name
            log.warning("test hook: %s at %s of message %s (#%d)", name, phase, message_id, point[2])
            sys.stderr.flush()
            os.kill(os.getpid(), point[0])


class Journal:
    """CONSUMER_JOURNAL: one JSON line per ack, nack or reject, written after
    it (the test reads it to check replays)."""

    def __init__(self, path: Optional[str]):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None

    def write(self, **entry: Any) -> None:
        if self.fd is not None:
            os.write(self.fd, (json.dumps(entry, sort_keys=True) + "\n").encode())


# -- the effect -----------------------------------------------------------
async def apply_order(pool: asyncpg.Pool, order: dict, message_id: str, fencing: int) -> dict:
    """Write the order and its ledger entry in one transaction, fenced by the
    lease's token. Returns the receipt that once() stores and replays."""
    async with pool.acquire() as conn:
        async with conn.transaction():
            if await conn.fetchval(
                UPSERT_ORDER, order["order_id"], order["customer"], order["amount_cents"], message_id, fencing
            ) is None:
                raise StaleLease(f"order {order['order_id']}: a newer lease than {fencing} wrote it")
            entry_id = await conn.fetchval(UPSERT_LEDGER, order["order_id"], order["amount_cents"], fencing)
            if entry_id is None:
                raise StaleLease(f"ledger of {order['order_id']}: a newer lease than {fencing} wrote it")
            await conn.execute(RECORD_RUN, order["order_id"], fencing, os.getpid())
    return {
        "order_id": order["order_id"],
        "amount_cents": order["amount_cents"],
        "ledger_entry": entry_id,
        "fencing": fencing,
    }


def parse(message: aio_pika.abc.AbstractIncomingMessage) -> tuple[str, dict]:
    """The message's stable id and its order. The id is the message_id property
    the publisher set, else the order id in the body: never the delivery tag or
    anything else that changes between deliveries."""
    try:
        order = json.loads(message.body)
        order = {
            "order_id": str(order["order_id"]),
            "customer": str(order["customer"]),
            "amount_cents": int(order["amount_cents"]),
        }
    except (ValueError, KeyError, TypeError) as error:
        raise BadMessage(f"not an order: {error}") from None
    return message.message_id or order["order_id"], order


# -- the consumer -----------------------------------------------------------
class Consumer:
    def __init__(self, idem: AsyncIdempotencyClient, pool: asyncpg.Pool, kill: KillSwitch, journal: Journal):
        self.idem = idem
        self.pool = pool
        self.kill = kill
        self.journal = journal
        self.lease = env_float("LEASE_SECONDS", 30)
        self.retention = env_float("RETENTION_SECONDS", 7 * 24 * 3600)
        self.wait = env_float("WAIT_SECONDS", 60)

    async def handle(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        copy = (message.headers or {}).get("x-test-copy")
        try:
            message_id, order = parse(message)
        except BadMessage as error:
            log.error("rejecting delivery %s: %s", message.delivery_tag, error)
            await message.reject(requeue=False)  # dead-lettered if the queue has a DLX
            return
        key = derive_key("orders", message_id)
        try:
            async with self.idem.once(
                NAMESPACE,
                key,
                fingerprint=fingerprint(message.body),
                lease_ttl=self.lease,
                retention=self.retention,
                wait_timeout=self.wait,
            ) as run:
                if not run.replayed:
                    self.kill.reached("after_claim", message_id)
                receipt = await run(self.effect, order, message_id, run.fencing_token)
            if not run.replayed:
                self.kill.reached("after_complete", message_id)
        except FingerprintMismatch:
            # The same message id with another body: never processable.
            log.error("message %s: another body was processed under this id; rejecting", message_id)
            await message.reject(requeue=False)
            self.journal.write(event="reject", reason="fingerprint_mismatch", message_id=message_id, copy=copy, pid=os.getpid())
            return
        except (InProgress, LeaseLost, StaleLease, IdempotencyError) as error:
            # Not done, or not recorded as done: another consumer still holds the
            # lease, the lease was lost, our write was fenced off, or the Claim
            # or the Complete failed. Requeue; the redelivery's Claim tells what
            # happened: a replay if the Complete did land, else a new lease.
            log.warning("message %s: %s: %s; requeueing", message_id, type(error).__name__, error)
            await message.nack(requeue=True)
            self.journal.write(event="nack", reason=type(error).__name__, message_id=message_id, copy=copy, pid=os.getpid())
            return
        except Exception:
            # The effect raised (database down, a bug): once() released the key,
            # so the redelivery runs it again. Never leave a delivery unacked
            # without a nack: RabbitMQ would hold it until consumer_timeout.
            log.exception("message %s: the effect failed; requeueing", message_id)
            await message.nack(requeue=True)
            self.journal.write(event="nack", reason="error", message_id=message_id, copy=copy, pid=os.getpid())
            return
        try:
            await message.ack()
        except Exception as error:  # the channel closed under us: it is redelivered, and replays
            log.warning("message %s: ack failed (%s); the redelivery will replay", message_id, error)
            return
        log.info("message %s: %s, acked", message_id, "replayed the stored receipt" if run.replayed
                 else f"applied under fencing token {receipt['fencing']}")
        self.journal.write(
            event="ack",
            message_id=message_id,
            copy=copy,
            replayed=run.replayed,
            redelivered=message.redelivered,
            receipt=receipt,
            pid=os.getpid(),
        )

    async def effect(self, order: dict, message_id: str, fencing: int) -> dict:
        receipt = await apply_order(self.pool, order, message_id, fencing)
        self.kill.reached("after_effect", message_id)
        return receipt


async def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    amqp_url = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
    queue_name = os.environ.get("QUEUE", "orders")
    prefetch = int(os.environ.get("PREFETCH", "10"))
    database_url = os.environ.get("ORDERS_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/orders")
    target = os.environ.get("IDEMPOTENCY_TARGET", "127.0.0.1:50051")

    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=prefetch)
    async with pool.acquire() as conn:
        await conn.execute((HERE / "schema.sql").read_text())
    idem = AsyncIdempotencyClient(target)
    hooks = KillSwitch(os.environ.get("CONSUMER_KILL_AT"), os.environ.get("CONSUMER_PAUSE_AT"))
    consumer = Consumer(idem, pool, hooks, Journal(os.environ.get("CONSUMER_JOURNAL")))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    connection = await aio_pika.connect_robust(amqp_url)
    in_flight: Set[asyncio.Task] = set()

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        task = asyncio.current_task()
        in_flight.add(task)
        try:
            await consumer.handle(message)
        finally:
            in_flight.discard(task)

    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=prefetch)
        queue = await channel.declare_queue(queue_name, durable=True)
        tag = await queue.consume(on_message)  # manual acks (no_ack=False)
        log.info("consuming %s (prefetch %d, lease %.0f s)", queue_name, prefetch, consumer.lease)
        await stop.wait()
        # Graceful stop: no new deliveries, let the ones in flight finish (their
        # acks need the channel), then close; anything unacked is requeued.
        await queue.cancel(tag)
        if in_flight:
            await asyncio.wait(set(in_flight), timeout=consumer.wait + consumer.lease)
    finally:
        await connection.close()
        await idem.close()
        await pool.close()
    log.info("stopped")


if __name__ == "__main__":
    asyncio.run(main())
