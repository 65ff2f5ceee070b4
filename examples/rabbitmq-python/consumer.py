"""An order consumer for RabbitMQ, exactly-once with idempotency-service.

Each message is an order: {"order_id": "...", "customer": "...", "amount_cents": 1234}.
Its effect is an order row plus a ledger row, written in this consumer's own
PostgreSQL database in one transaction, guarded by the lease's fencing token
and by the body's fingerprint.

    for each delivery (manual acks, prefetch > 1, handled concurrently):
      key         = derive_key("orders", message_id)     stable across redeliveries
      fingerprint = fingerprint(body)                    same id, other body: parked
      once(key):  Claim -> CLAIMED: run the effect (fenced), Complete with its receipt
                        -> COMPLETED: the stored receipt (a replay); nothing runs
                        -> IN_PROGRESS: wait for the other lease (up to WAIT_SECONDS)
      ack only after once() returned; a failure goes to a retry queue (backoff),
      then, when the retry budget is spent, to the parking queue <queue>.dlq

The queues (topology.py): <queue> is a quorum queue with a delivery limit and
<queue>.dlq as its dead-letter target; <queue>.retry.<delay> hold a failed
message for its backoff, then RabbitMQ dead-letters it back into <queue>.

Configuration (environment):
  AMQP_URL              amqp://guest:guest@127.0.0.1:5672/
  QUEUE                 orders                  (declared with topology.py if absent)
  PREFETCH              10                      unacked deliveries in flight
  ORDERS_DATABASE_URL   postgres://postgres@127.0.0.1:5432/orders   (this consumer's own database)
  IDEMPOTENCY_TARGET    127.0.0.1:50051
  LEASE_SECONDS         30      lease per message; once()'s heartbeat extends it every 10 s while the effect runs
  RETENTION_SECONDS     259200  how long a completed message's receipt is kept and replayed (3 days;
                                shorter than the server's remember_for, 7 days: docs/recipes.md)
  WAIT_SECONDS          45      how long a delivery waits on another consumer's live lease (more than a lease)
  RETRY_DELAYS          1,5,30,120,600,600,600   backoff before each retry, in seconds (then parked)
  DELIVERY_LIMIT        20      redeliveries after a crash before RabbitMQ dead-letters a message

For the test only (tests/test_exactly_once.py):
  CONSUMER_JOURNAL      a file to append one JSON line per ack, retry or park
  CONSUMER_KILL_AT      PHASE:N  SIGKILL this process when the Nth message reaches
                        PHASE: after_claim (lease held, before the effect),
                        after_effect (effect committed, before Complete),
                        after_complete (Complete done, before the ack)
  CONSUMER_PAUSE_AT     PHASE:N  SIGSTOP this process there instead (a consumer
                        that stalls past its lease; the test sends SIGCONT)
"""

from __future__ import annotations

import asyncio
import decimal
import json
import logging
import os
import pathlib
import signal
import sys
from typing import Any, Optional, Set

import aio_pika
import asyncpg

import topology
from idempotency_client import (
    AsyncIdempotencyClient,
    FingerprintMismatch,
    derive_key,
    fingerprint,
)

log = logging.getLogger("orders-consumer")

#: The namespace of this consumer's keys in the idempotency service.
NAMESPACE = "orders-consumer"

HERE = pathlib.Path(__file__).resolve().parent

# The effect, in one transaction. Both upserts carry the lease's fencing token
# and only overwrite a row written under an OLDER token and for the SAME body
# (its SHA-256, the fingerprint the Claim carried):
# - a rerun by a newer lease rewrites the same values: the previous holder
#   died after the commit, before Complete; or the copy is a late retry, which
#   the service re-executes under the next token while it remembers the key
#   (its result expired, the key completed less than IDEMPOTENCY_REMEMBER_FOR
#   ago, 7 days by default): still one order, one ledger entry;
# - a write by an older or equal lease writes nothing: it is a holder that
#   stalled past its lease (its Complete will be refused), or a copy that
#   arrived after the service forgot the key (past that horizon its record is
#   deleted and the next one starts again at token 1). apply_order() then
#   returns the row that is there as the receipt, and Complete decides;
# - a different body under an order id already applied never overwrites it,
#   whatever its token (a re-executed late retry is not checked against the
#   first body's fingerprint, and a forgotten key has none; the row has it):
#   LedgerConflict, and the message is parked.
UPSERT_ORDER = """
INSERT INTO orders (order_id, customer, amount_cents, message_id, body_sha256, fencing)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (order_id) DO UPDATE
   SET customer = EXCLUDED.customer,
       amount_cents = EXCLUDED.amount_cents,
       message_id = EXCLUDED.message_id,
       fencing = EXCLUDED.fencing,
       updated_at = now()
 WHERE orders.fencing < EXCLUDED.fencing
   AND orders.body_sha256 = EXCLUDED.body_sha256
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

# The rows as they stand, when the guard wrote nothing.
CURRENT_ORDER = """
SELECT o.order_id, o.amount_cents, o.body_sha256, o.fencing, l.entry_id
  FROM orders o JOIN ledger l USING (order_id)
 WHERE o.order_id = $1
"""

RECORD_RUN = "INSERT INTO effect_runs (order_id, fencing, pid) VALUES ($1, $2, $3)"


# The order row alone, for the check before the Claim.
APPLIED_ORDER = "SELECT order_id, amount_cents, body_sha256, fencing FROM orders WHERE order_id = $1"


async def applied_rows(pool: asyncpg.Pool, order_id: str, sql: str = CURRENT_ORDER):
    """The order as the ledger holds it (None: not applied)."""
    async with pool.acquire() as conn:
        return await conn.fetchrow(sql, order_id)


def receipt_of(row) -> dict:
    """The receipt of the rows as they stand: what a Complete stores for them."""
    return {"order_id": row["order_id"], "amount_cents": row["amount_cents"], "ledger_entry": row["entry_id"],
            "fencing": row["fencing"]}


def conflict_detail(row, order: dict) -> str:
    return (f"order {row['order_id']} was applied with another body ({row['amount_cents']} cents, "
            f"fencing token {row['fencing']}); this one ({order['amount_cents']} cents) is not applied")


class StaleLease(Exception):
    """The guard refused our write but the rows could not be read back (a bug)."""


class LedgerConflict(Exception):
    """This order id was applied with another body: never overwritten, parked."""


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
    """CONSUMER_JOURNAL: one JSON line per ack, retry or park, written after
    it (the test reads it to check replays)."""

    def __init__(self, path: Optional[str]):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None

    def write(self, **entry: Any) -> None:
        if self.fd is not None:
            os.write(self.fd, (json.dumps(entry, sort_keys=True) + "\n").encode())


# -- the effect -----------------------------------------------------------
async def apply_order(
    pool: asyncpg.Pool, order: dict, message_id: str, body_sha256: bytes, fencing: int
) -> tuple[dict, bool]:
    """Write the order and its ledger entry in one transaction, fenced by the
    lease's token and the body's fingerprint. Returns the receipt that once()
    stores and replays, and whether this call wrote the rows (False: they were
    there already, written under a token >= ours for this same body, and the
    receipt describes them). Raises LedgerConflict when the order id was
    applied with another body."""
    async with pool.acquire() as conn:
        async with conn.transaction():
            order_id = order["order_id"]
            if await conn.fetchval(
                UPSERT_ORDER, order_id, order["customer"], order["amount_cents"], message_id, body_sha256, fencing
            ) is None:
                row = await conn.fetchrow(CURRENT_ORDER, order_id)
                if row is None:
                    raise StaleLease(f"order {order_id}: the guard refused the write but there is no row")
                if bytes(row["body_sha256"]) != body_sha256:
                    raise LedgerConflict(conflict_detail(row, order))
                return receipt_of(row), False
            entry_id = await conn.fetchval(UPSERT_LEDGER, order_id, order["amount_cents"], fencing)
            if entry_id is None:
                raise StaleLease(f"ledger of {order_id}: a newer lease than {fencing} wrote it")
            await conn.execute(RECORD_RUN, order_id, fencing, os.getpid())
    receipt = {"order_id": order_id, "amount_cents": order["amount_cents"], "ledger_entry": entry_id, "fencing": fencing}
    return receipt, True


#: The largest amount accepted, in cents: what every JSON parser reads exactly
#: (2^53 - 1), well within the bigint columns.
MAX_AMOUNT_CENTS = 2**53 - 1


def _refuse_constant(name: str):
    # Python's json reads NaN, Infinity and -Infinity, which are not JSON.
    raise BadMessage(f"not JSON: {name} is not a JSON number")


def _text(order: dict, field: str) -> str:
    value = order.get(field)
    if not isinstance(value, str) or not value:
        got = "missing or null" if value is None else "a JSON " + (
            "string" if isinstance(value, str) else "boolean" if isinstance(value, bool)
            else "number" if isinstance(value, (int, decimal.Decimal)) else "object" if isinstance(value, dict)
            else "array")
        raise BadMessage(f"{field} must be a non-empty string, not {got}")
    try:
        value.encode("utf-8")  # a lone surrogate (\\ud800) is not text
    except UnicodeEncodeError:
        raise BadMessage(f"{field} is not valid Unicode") from None
    return value


def parse_order(body: bytes) -> dict:
    """The order in a message body, strictly: an object with order_id and
    customer (non-empty strings) and amount_cents, an integer number of cents
    (minor units) within +-(2^53 - 1). Nothing is coerced: 12.99, 1299.0,
    "1299", true, 1e400, NaN are refused (int() would read 12.99 as 12 and
    true as 1; 1e400 is a float overflow). Raises BadMessage with the reason."""
    try:
        # Floats parsed as Decimal (1e400 stays finite and is then refused
        # below, instead of becoming inf); NaN/Infinity refused outright.
        order = json.loads(body, parse_float=decimal.Decimal, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as error:  # not UTF-8, not JSON, nested too deep
        raise BadMessage(f"not JSON: {error}"[:200]) from None
    if not isinstance(order, dict):
        raise BadMessage("not an order: the body is not a JSON object")
    amount = order.get("amount_cents")
    # bool is a subclass of int: true must not be read as 1 cent.
    if type(amount) is not int or abs(amount) > MAX_AMOUNT_CENTS:
        shown = "missing" if "amount_cents" not in order else (
            str(amount) if isinstance(amount, decimal.Decimal) else json.dumps(amount))[:40]
        raise BadMessage(f"amount_cents must be an integer number of cents within +-(2^53 - 1), not {shown}")
    return {"order_id": _text(order, "order_id"), "customer": _text(order, "customer"), "amount_cents": amount}


def parse(message: aio_pika.abc.AbstractIncomingMessage) -> tuple[str, dict]:
    """The message's stable id and its order. The id is the message_id property
    the publisher set, else the order id in the body: never the delivery tag or
    anything else that changes between deliveries."""
    order = parse_order(message.body)
    return message.message_id or order["order_id"], order


# -- the consumer -----------------------------------------------------------
class Consumer:
    def __init__(
        self,
        idem: AsyncIdempotencyClient,
        pool: asyncpg.Pool,
        kill: KillSwitch,
        journal: Journal,
        channel: aio_pika.abc.AbstractChannel,
        queue: str,
    ):
        self.idem = idem
        self.pool = pool
        self.kill = kill
        self.journal = journal
        self.channel = channel
        self.queue = queue
        self.lease = env_float("LEASE_SECONDS", 30)
        self.retention = env_float("RETENTION_SECONDS", 3 * 24 * 3600)
        self.wait = env_float("WAIT_SECONDS", 45)
        self.delays = topology.retry_delays()

    async def handle(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        copy = (message.headers or {}).get("x-test-copy")
        try:
            message_id, order = parse(message)
        except BadMessage as error:
            log.error("delivery %s: %s; parking it", message.delivery_tag, error)
            await self.park(message, None, copy, "not_an_order", str(error))
            return
        key = derive_key("orders", message_id)
        body_sha256 = fingerprint(message.body)  # SHA-256 of the body, as the Claim carries it
        wrote = []
        # Another body under an order id the ledger holds is parked BEFORE any
        # Claim. Claimed, it would be re-executed once the first body's result
        # expired (or, past the key's horizon, claimed as new), refused by the
        # guard (LedgerConflict), and once() would release the key holding
        # ITS fingerprint: every later copy of the applied body would then be
        # told FINGERPRINT_MISMATCH and parked instead of acked.
        try:
            row = await applied_rows(self.pool, order["order_id"], APPLIED_ORDER)
        except Exception as error:  # the database is unreachable: as any failure, retry later
            log.warning("message %s: reading the ledger: %s: %s; retrying later", message_id,
                        type(error).__name__, error)
            await self.retry(message, message_id, copy, type(error).__name__, str(error))
            return
        if row is not None and bytes(row["body_sha256"]) != body_sha256:
            detail = conflict_detail(row, order)
            log.error("message %s: %s; parking it", message_id, detail)
            await self.park(message, message_id, copy, "conflicts_with_applied_order", detail)
            return
        try:
            async with self.idem.once(
                NAMESPACE,
                key,
                fingerprint=body_sha256,
                lease_ttl=self.lease,
                retention=self.retention,
                wait_timeout=self.wait,
                # late_retry pinned, not left to the namespace or the server: the effect is
                # guarded (fencing token and body), so a late copy (its result expired, the
                # key remembered) is re-executed under the next token and rewrites its own
                # rows: one effect, and the late retry is logged. A server or namespace set
                # to refuse would otherwise answer EXPIRED, and the copy would go round the
                # retry queues to the parking queue instead of being acked.
                late_retry="reexecute",
            ) as run:
                if not run.replayed:
                    self.kill.reached("after_claim", message_id)
                receipt = await run(self.effect, order, message_id, body_sha256, run.fencing_token, wrote)
            if not run.replayed:
                self.kill.reached("after_complete", message_id)
        except FingerprintMismatch:
            # The service holds another body's fingerprint for this id. If the
            # ledger holds THIS body, this is a copy of the applied order (the
            # record was claimed with another body since: a conflicting copy
            # that raced the check above, or one handled by an earlier version
            # of this consumer): a duplicate, acked with the rows as receipt.
            try:
                row = await applied_rows(self.pool, order["order_id"])
            except Exception as error:
                await self.retry(message, message_id, copy, type(error).__name__, str(error))
                return
            if row is not None and bytes(row["body_sha256"]) == body_sha256:
                await self.ack_duplicate(message, message_id, copy, receipt_of(row))
                return
            # Otherwise the same message id with another body, while the
            # first one's record lives: never processable. Parked, not dropped.
            log.error("message %s: another body was processed under this id; parking it", message_id)
            await self.park(message, message_id, copy, "fingerprint_mismatch",
                            "the idempotency service holds another body's fingerprint for this message id")
            return
        except LedgerConflict as error:
            # The same, found by the ledger: the first body's result expired,
            # so the Claim could not tell (a late retry is re-executed without
            # comparing fingerprints; a forgotten key has none). once()
            # released the key; nothing was written.
            log.error("message %s: %s; parking it", message_id, error)
            await self.park(message, message_id, copy, "conflicts_with_applied_order", str(error))
            return
        except Exception as error:
            # Not done, or not recorded as done: another consumer still holds
            # the lease after WAIT_SECONDS (InProgress), the lease was lost
            # (LeaseLost), the Claim or the Complete failed (IdempotencyError),
            # or the effect raised (the ledger is down; once() released the
            # key). Retry after a backoff; the retry's Claim tells what
            # happened: a replay if the Complete did land, else a new lease.
            log.warning("message %s: %s: %s; retrying later", message_id, type(error).__name__, error)
            await self.retry(message, message_id, copy, type(error).__name__, str(error))
            return
        try:
            await message.ack()
        except Exception as error:  # the channel closed under us: it is redelivered, and replays
            log.warning("message %s: ack failed (%s); the redelivery will replay", message_id, error)
            return
        # A late retry: the key completed before (at completed_at) and its
        # result expired, and the service re-executed it under the next
        # token. Worth a line: it means the retention is shorter than the
        # span over which copies still come.
        late = None if run.replayed else run.claim.completed_at
        if run.replayed:
            how = "replayed the stored receipt"
        elif late is not None:
            how = (f"a late retry (completed before at {late.isoformat()}, its result expired): re-executed "
                   f"under fencing token {run.fencing_token}, " + ("rewrote the same rows" if wrote[-1] else
                   f"the rows stand under fencing token {receipt['fencing']}"))
        elif wrote[-1]:
            how = f"applied under fencing token {receipt['fencing']}"
        else:
            how = (f"already applied under fencing token {receipt['fencing']} (the service had forgotten the key); "
                   "completed with that receipt")
        log.info("message %s: %s, acked", message_id, how)
        self.journal.write(
            event="ack",
            message_id=message_id,
            copy=copy,
            replayed=run.replayed,
            wrote=bool(not run.replayed and wrote[-1]),
            late_retry=late.isoformat() if late is not None else None,
            redelivered=message.redelivered,
            receipt=receipt,
            pid=os.getpid(),
        )

    async def ack_duplicate(self, message, message_id: str, copy, receipt: dict) -> None:
        """A copy of an order the ledger holds with this very body, which the
        service cannot replay (its record holds another body's fingerprint):
        acked as the duplicate it is, with the rows as its receipt."""
        try:
            await message.ack()
        except Exception as error:
            log.warning("message %s: ack failed (%s); the redelivery will be handled again", message_id, error)
            return
        log.info("message %s: a copy of the order the ledger holds (the service holds another body's fingerprint "
                 "for it); acked as a duplicate", message_id)
        self.journal.write(event="ack", message_id=message_id, copy=copy, replayed=True, wrote=False,
                           late_retry=None, redelivered=message.redelivered, receipt=receipt, pid=os.getpid(),
                           duplicate_of_ledger=True)

    async def effect(self, order: dict, message_id: str, body_sha256: bytes, fencing: int, wrote: list) -> dict:
        receipt, applied = await apply_order(self.pool, order, message_id, body_sha256, fencing)
        wrote.append(applied)
        self.kill.reached("after_effect", message_id)
        return receipt

    # -- retry and park: republish a copy, then ack the delivery -------------
    async def retry(self, message, message_id, copy, reason: str, detail: str) -> None:
        """Send the message to the retry queue of its next backoff step, or
        park it when the budget is spent. Never nack(requeue=True): that
        redelivers at once and spends the delivery limit in seconds."""
        attempt = int((message.headers or {}).get(topology.RETRY_ATTEMPT) or 0)
        if attempt >= len(self.delays):
            await self.park(message, message_id, copy, "retries_exhausted",
                            f"{attempt} retries; the last failure: {reason}: {detail}")
            return
        target = topology.retry_queue(self.queue, self.delays[attempt])
        if await self.republish(message, target, {topology.RETRY_ATTEMPT: attempt + 1}):
            self.journal.write(event="retry", reason=reason, attempt=attempt + 1, message_id=message_id,
                               copy=copy, pid=os.getpid())

    async def park(self, message, message_id, copy, reason: str, detail: str) -> None:
        """Put the message in <queue>.dlq with why, for an operator."""
        headers = {topology.PARKED_REASON: reason, topology.PARKED_DETAIL: detail[:1000],
                   topology.PARKED_FROM: self.queue}
        if await self.republish(message, topology.parking_queue(self.queue), headers):
            self.journal.write(event="park", reason=reason, message_id=message_id, copy=copy, pid=os.getpid())

    async def republish(self, message, queue: str, extra_headers: dict) -> bool:
        """Publish a copy (publisher confirms: publish() returns once the broker
        has it), then ack the delivery. A crash between the two leaves two
        copies, which the key makes harmless. If the publish fails, the
        delivery is rejected back into its queue (basic.reject, requeue: it
        counts against the delivery limit on every RabbitMQ version), so
        nothing is lost either way."""
        headers = {k: v for k, v in (message.headers or {}).items() if k != "x-delivery-count"}
        headers.update(extra_headers)
        try:
            await self.channel.default_exchange.publish(
                aio_pika.Message(
                    message.body,
                    headers=headers,
                    message_id=message.message_id,
                    content_type=message.content_type,
                    correlation_id=message.correlation_id,
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                routing_key=queue,
            )
        except Exception as error:
            log.error("delivery %s: publishing to %s failed (%s); requeueing it", message.delivery_tag, queue, error)
            try:
                # reject, not nack: from RabbitMQ 4.3 only basic.reject with
                # requeue counts toward x-delivery-limit (basic.nack with
                # requeue does not); before 4.3 both do.
                await message.reject(requeue=True)
            except Exception:
                pass  # the channel is gone: RabbitMQ requeues it anyway
            return False
        try:
            await message.ack()
        except Exception as error:
            log.warning("delivery %s: ack after publishing to %s failed (%s); a copy comes back",
                        message.delivery_tag, queue, error)
        return True


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

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    connection = await aio_pika.connect_robust(amqp_url)
    in_flight: Set[asyncio.Task] = set()

    try:
        channel = await connection.channel()  # publisher confirms: retry and park copies are confirmed
        await channel.set_qos(prefetch_count=prefetch)
        queue = await topology.declare(channel, queue_name, topology.retry_delays(), topology.delivery_limit())
        consumer = Consumer(idem, pool, hooks, Journal(os.environ.get("CONSUMER_JOURNAL")), channel, queue_name)

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            task = asyncio.current_task()
            in_flight.add(task)
            try:
                await consumer.handle(message)
            finally:
                in_flight.discard(task)

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
