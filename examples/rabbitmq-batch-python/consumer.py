"""An order consumer for RabbitMQ that works in batches: ClaimBatch, the
effects, CompleteBatch, and an ack per message.

The same orders, keys, fingerprints, ledger and queues as
examples/rabbitmq-python (whose consumer takes one message at a time with
once()); a batch costs two calls to the service instead of two per message.

    collect up to BATCH_SIZE deliveries (prefetch = BATCH_SIZE), or what came
    within BATCH_WAIT_SECONDS of the first one
    for each: key = derive_key("orders", message_id), fingerprint = fingerprint(body)
              (exactly the single-message path: clients/KEYS.md)
    ClaimBatch(all of them)   -> per item, in order:
      CLAIMED               the effect runs (fenced by the token, guarded by the body);
                            with completed_at set, a late retry (the receipt expired,
                            the service remembers the key and re-executes it under
                            the next token): the effect rewrites the same rows, logged
      COMPLETED             a replay: ack with the stored receipt; nothing runs
      FINGERPRINT_MISMATCH  another body under this id: parked
      IN_PROGRESS           the same key earlier in this batch (a duplicate in the
                            batch): settled with that item; else another consumer
                            holds it: sent to the retry queue, not acked as done
    heartbeat: ExtendLease every lease of the batch every LEASE_SECONDS / 3
    while the effects run
    CompleteBatch(every item whose effect succeeded) -> per item: OK: ack;
      an error (the lease was lost): retry, and the retry's Claim decides
    an effect that failed: Release that key, retry (or park: LedgerConflict)

Configuration (environment), as examples/rabbitmq-python/consumer.py, plus:
  BATCH_SIZE            50      most messages in a batch; also the prefetch
  BATCH_WAIT_SECONDS    0.2     how long a batch waits for more after its first message
  AMQP_URL, QUEUE (orders), ORDERS_DATABASE_URL, IDEMPOTENCY_TARGET,
  LEASE_SECONDS (30), RETENTION_SECONDS (259200: 3 days), RETRY_DELAYS, DELIVERY_LIMIT

For the test only (tests/test_batches.py):
  CONSUMER_JOURNAL      a file to append one JSON line per ack, retry or park
  CONSUMER_KILL_AT      PHASE:N  SIGKILL this process when the Nth batch reaches
                        PHASE: after_claim, after_effect, after_complete (before the acks)
  CONSUMER_SLOW_ORDER   ORDER_ID:SECONDS  that order's effect takes that much longer
  CONSUMER_EXTEND_LATENCY  SECONDS  each ExtendLease waits that long first (a service far away)
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
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import aio_pika
import asyncpg

import topology
from idempotency_client import (
    AsyncIdempotencyClient,
    ClaimItem,
    CompleteItem,
    IdempotencyError,
    KeyNotFound,
    LeaseNotCurrent,
    Outcome,
    derive_key,
    fingerprint,
)

log = logging.getLogger("orders-batch-consumer")

#: The same namespace as the single-message consumer: the two are two ways of
#: running one service, and a message either completed replays for the other.
NAMESPACE = "orders-consumer"

HERE = pathlib.Path(__file__).resolve().parent

# The effect: the same guarded upserts as examples/rabbitmq-python/consumer.py
# (see the comments there): a row is overwritten only by a newer fencing token
# and the same body (a takeover, or a late retry re-executed under the next
# token); an equal or older token writes nothing and gets the rows as its
# receipt (a stalled holder, or a copy after the service forgot the key, whose
# token restarted at 1); another body under an applied order id is
# LedgerConflict.
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

CURRENT_ORDER = """
SELECT o.order_id, o.amount_cents, o.body_sha256, o.fencing, l.entry_id
  FROM orders o JOIN ledger l USING (order_id)
 WHERE o.order_id = $1
"""

RECORD_RUN = "INSERT INTO effect_runs (order_id, fencing, pid) VALUES ($1, $2, $3)"

# The order rows of a batch's order ids, for the check before ClaimBatch.
APPLIED_ORDERS = "SELECT order_id, amount_cents, body_sha256, fencing FROM orders WHERE order_id = ANY($1::text[])"


def conflict_detail(row, order: dict) -> str:
    return (f"order {row['order_id']} was applied with another body ({row['amount_cents']} cents, "
            f"fencing token {row['fencing']}); this one ({order['amount_cents']} cents) is not applied")


class LedgerConflict(Exception):
    """This order id was applied with another body: never overwritten, parked."""


class BadMessage(Exception):
    """A message this consumer can never process (not JSON, fields missing)."""


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


async def apply_order(
    pool: asyncpg.Pool, order: dict, message_id: str, body_sha256: bytes, fencing: int
) -> tuple[dict, bool]:
    """The order and its ledger entry in one transaction: (receipt, wrote)."""
    order_id = order["order_id"]
    async with pool.acquire() as conn:
        async with conn.transaction():
            if await conn.fetchval(
                UPSERT_ORDER, order_id, order["customer"], order["amount_cents"], message_id, body_sha256, fencing
            ) is None:
                row = await conn.fetchrow(CURRENT_ORDER, order_id)
                if row is None:
                    raise RuntimeError(f"order {order_id}: the guard refused the write but there is no row")
                if bytes(row["body_sha256"]) != body_sha256:
                    raise LedgerConflict(conflict_detail(row, order))
                receipt = {"order_id": order_id, "amount_cents": row["amount_cents"],
                           "ledger_entry": row["entry_id"], "fencing": row["fencing"]}
                return receipt, False
            entry_id = await conn.fetchval(UPSERT_LEDGER, order_id, order["amount_cents"], fencing)
            if entry_id is None:
                raise RuntimeError(f"ledger of {order_id}: a newer lease than {fencing} wrote it")
            await conn.execute(RECORD_RUN, order_id, fencing, os.getpid())
    return {"order_id": order_id, "amount_cents": order["amount_cents"], "ledger_entry": entry_id,
            "fencing": fencing}, True


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
    """The message's stable id (message_id, else the order id) and its order."""
    order = parse_order(message.body)
    return message.message_id or order["order_id"], order


# -- test hooks -------------------------------------------------------------
class KillSwitch:
    """CONSUMER_KILL_AT=PHASE:N: SIGKILL this process when the Nth batch reaches PHASE."""

    def __init__(self, spec: Optional[str]):
        self.phase, self.at, self.counts = None, 0, {}
        if spec:
            self.phase, _, n = spec.partition(":")
            if self.phase not in ("after_claim", "after_effect", "after_complete"):
                raise SystemExit(f"CONSUMER_KILL_AT: unknown phase {self.phase!r}")
            self.at = int(n or 1)

    def reached(self, phase: str) -> None:
        if phase != self.phase:
            return
        self.counts[phase] = self.counts.get(phase, 0) + 1
        if self.counts[phase] == self.at:
            log.warning("test hook: SIGKILL at %s of batch #%d", phase, self.at)
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)


class Journal:
    """CONSUMER_JOURNAL: one JSON line per ack, retry or park."""

    def __init__(self, path: Optional[str]):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None

    def write(self, **entry: Any) -> None:
        if self.fd is not None:
            os.write(self.fd, (json.dumps(entry, sort_keys=True) + "\n").encode())


# -- one batch ----------------------------------------------------------------
@dataclass
class Item:
    """One delivery of a batch and what became of it."""

    message: aio_pika.abc.AbstractIncomingMessage
    message_id: str
    order: dict
    key: str
    body_sha256: bytes
    claim: Any = None  # ClaimResult
    receipt: Optional[dict] = None
    wrote: bool = False
    #: The earlier item of this batch with the same key (a duplicate in the batch).
    leader: Optional["Item"] = None
    followers: List["Item"] = field(default_factory=list)
    #: How it ended: "ack", "retry" or "park" (set once).
    settled: Optional[str] = None

    @property
    def copy(self):
        return (self.message.headers or {}).get("x-test-copy")


class BatchConsumer:
    def __init__(self, idem, pool, channel, queue: str, journal: Journal, kill: KillSwitch):
        self.idem = idem
        self.pool = pool
        self.channel = channel
        self.queue = queue
        self.journal = journal
        self.kill = kill
        self.lease = env_float("LEASE_SECONDS", 30)
        self.retention = env_float("RETENTION_SECONDS", 3 * 24 * 3600)
        self.delays = topology.retry_delays()
        self.batches = 0
        self.busy = False
        self.extend_latency = env_float("CONSUMER_EXTEND_LATENCY", 0)
        slow = os.environ.get("CONSUMER_SLOW_ORDER")
        self.slow = (slow.split(":")[0], float(slow.split(":")[1])) if slow else None

    async def handle_batch(self, messages: List[aio_pika.abc.AbstractIncomingMessage]) -> None:
        self.busy = True
        try:
            await self._handle_batch(messages)
        finally:
            self.busy = False

    async def _handle_batch(self, messages: List[aio_pika.abc.AbstractIncomingMessage]) -> None:
        self.batches += 1
        batch = self.batches
        items: List[Item] = []
        for message in messages:
            try:
                message_id, order = parse(message)
            except BadMessage as error:
                await self.park_message(message, None, "not_an_order", str(error))
                continue
            # Exactly the single-message path's key and fingerprint.
            items.append(Item(message, message_id, order, derive_key("orders", message_id), fingerprint(message.body)))
        if not items:
            return

        # Another body under an order id the ledger holds is parked BEFORE
        # ClaimBatch. Claimed, it would be re-executed once the first body's
        # result expired (or claimed as new past the key's horizon), refused
        # by the guard (LedgerConflict) and released, leaving the key holding
        # ITS fingerprint: later copies of the applied body would be told
        # FINGERPRINT_MISMATCH and parked instead of acked.
        try:
            async with self.pool.acquire() as conn:
                applied = {r["order_id"]: r for r in await conn.fetch(
                    APPLIED_ORDERS, sorted({item.order["order_id"] for item in items}))}
        except Exception as error:  # the database is unreachable: retry them all
            log.warning("batch %d: reading the ledger failed (%s); retrying all %d", batch, error, len(items))
            for item in items:
                await self.retry(item, type(error).__name__, str(error))
            return
        kept = []
        for item in items:
            row = applied.get(item.order["order_id"])
            if row is not None and bytes(row["body_sha256"]) != item.body_sha256:
                await self.park(item, "conflicts_with_applied_order", conflict_detail(row, item.order))
            else:
                kept.append(item)
        items = kept
        if not items:
            return

        # ClaimBatch: one answer per item, in order. The same key twice in the
        # batch is one lease: the first item wins it, the later ones are told
        # IN_PROGRESS (or FINGERPRINT_MISMATCH for another body).
        try:
            # late_retry pinned, not left to the namespace or the server: the effect is
            # guarded (fencing token and body), so a late copy (its result expired, the
            # key remembered) is re-executed under the next token and rewrites its own
            # rows: one effect, and the late retry is logged. A server or namespace set
            # to refuse would otherwise answer EXPIRED, and the copy would be sent
            # to the retry queues, then parked, instead of being acked.
            claims = await self.idem.claim_batch(
                [ClaimItem(NAMESPACE, item.key, fingerprint=item.body_sha256, lease_ttl=self.lease,
                           retention=self.retention, late_retry="reexecute") for item in items])
        except IdempotencyError as error:
            log.warning("batch %d: ClaimBatch failed (%s); retrying all %d", batch, error, len(items))
            for item in items:
                await self.retry(item, "ClaimBatch", str(error))
            return
        first_by_key: Dict[str, Item] = {}
        won: List[Item] = []
        for item, claim in zip(items, claims):
            item.claim = claim
            earlier = first_by_key.setdefault(item.key, item)
            if claim.outcome is Outcome.CLAIMED:
                won.append(item)
            elif claim.outcome is Outcome.COMPLETED:
                await self.ack(item, json.loads(claim.response), replayed=True)
            elif claim.outcome is Outcome.FINGERPRINT_MISMATCH:
                # If the ledger holds THIS body, the item is a copy of the
                # applied order whose record was since claimed with another
                # body (a conflicting copy that raced the check above, or one
                # handled by an earlier version of this consumer): acked as a
                # duplicate, with the rows as its receipt. Else: parked.
                row = await self.current_rows(item)
                if row is not None and bytes(row["body_sha256"]) == item.body_sha256:
                    await self.ack(item, {"order_id": row["order_id"], "amount_cents": row["amount_cents"],
                                          "ledger_entry": row["entry_id"], "fencing": row["fencing"]},
                                   replayed=True, duplicate_of_ledger=True)
                else:
                    await self.park(item, "fingerprint_mismatch",
                                    "the idempotency service holds another body's fingerprint for this message id")
            elif earlier is not item and earlier.claim.outcome is Outcome.CLAIMED \
                    and earlier.body_sha256 == item.body_sha256:
                # A duplicate inside this batch: it ends as its first copy does.
                item.leader = earlier
                earlier.followers.append(item)
            else:
                # Another consumer holds a live lease (a concurrent delivery of
                # the same message). Not done here: the retry's Claim will
                # replay its result, or take the key over if it died.
                await self.retry(item, "in_progress", f"another holder's lease, {claim.retry_after} left")
        log.info("batch %d: %d messages, %d claimed", batch, len(items), len(won))
        self.kill.reached("after_claim")
        if not won:
            return

        # The effects, while a heartbeat keeps every lease of the batch alive.
        heartbeat = asyncio.create_task(self.heartbeat(won))
        try:
            done: List[Item] = []
            for item in won:
                try:
                    if self.slow and item.order["order_id"] == self.slow[0]:
                        await asyncio.sleep(self.slow[1])
                    item.receipt, item.wrote = await apply_order(
                        self.pool, item.order, item.message_id, item.body_sha256, item.claim.fencing_token)
                    done.append(item)
                except Exception as error:  # the effect failed: give the key back, as once() does
                    await self.release(item)
                    if isinstance(error, LedgerConflict):
                        await self.park(item, "conflicts_with_applied_order", str(error))
                    else:
                        log.warning("order %s: %s: %s", item.message_id, type(error).__name__, error)
                        await self.retry(item, type(error).__name__, str(error))
            self.kill.reached("after_effect")

            # CompleteBatch: each item answered on its own.
            results = []
            if done:
                try:
                    results = await self.idem.complete_batch(
                        [CompleteItem(NAMESPACE, item.key, item.claim.lease_token,
                                      json.dumps(item.receipt, sort_keys=True).encode(), retention=self.retention)
                         for item in done])
                except IdempotencyError as error:
                    log.warning("batch %d: CompleteBatch failed (%s); retrying %d", batch, error, len(done))
                    for item in done:
                        await self.retry(item, "CompleteBatch", str(error))
                    done = []
        finally:
            heartbeat.cancel()
        self.kill.reached("after_complete")
        for item, result in zip(done, results):
            if result.ok:
                await self.ack(item, item.receipt, replayed=False)
            else:
                # NOT_FOUND / FAILED_PRECONDITION: the lease is no longer ours
                # (it ran out and another consumer took the key, or a Purge).
                # The effect is committed but the receipt is not ours to store:
                # retry, and the retry's Claim decides (a replay, or a takeover
                # whose guarded effect rewrites the same rows).
                await self.retry(item, type(result.error).__name__, str(result.error))

    async def heartbeat(self, items: List[Item]) -> None:
        """ExtendLease for every lease of the batch, every third of a lease,
        all of them at once: one after another, a round would take the batch
        size times a call's latency (50 x 20 ms is a second, 50 x 250 ms more
        than a 10 s lease), and the last leases would run out before their
        turn. A lease that is lost is only logged: that item's Complete will
        be refused, and it is retried."""
        lost = set()

        async def extend(item: Item) -> None:
            if self.extend_latency:  # test hook: a service that far away
                await asyncio.sleep(self.extend_latency)
            try:
                await self.idem.extend_lease(NAMESPACE, item.key, item.claim.lease_token, lease_ttl=self.lease,
                                             timeout=self.lease / 3)
            except (KeyNotFound, LeaseNotCurrent) as error:
                lost.add(item.key)
                log.warning("order %s: the lease was lost (%s)", item.message_id, error)
            except IdempotencyError as error:  # unreachable for now: try again next round
                log.warning("order %s: ExtendLease failed (%s)", item.message_id, error)

        while True:
            await asyncio.sleep(self.lease / 3)
            # released (retried or parked) already, or lost: not extended
            await asyncio.gather(*(extend(item) for item in items if item.key not in lost and not item.settled))

    async def current_rows(self, item: Item):
        """The item's order and ledger entry as they stand (None: not applied, or unreadable)."""
        try:
            async with self.pool.acquire() as conn:
                return await conn.fetchrow(CURRENT_ORDER, item.order["order_id"])
        except Exception as error:
            log.warning("order %s: reading the ledger failed (%s)", item.message_id, error)
            return None

    async def release(self, item: Item) -> None:
        try:
            await self.idem.release(NAMESPACE, item.key, item.claim.lease_token)
        except IdempotencyError as error:  # the lease runs out on its own
            log.warning("order %s: Release failed (%s)", item.message_id, error)

    # -- how an item ends: ack, retry, park; a duplicate in the batch follows --
    async def ack(self, item: Item, receipt: dict, *, replayed: bool, duplicate_of_ledger: bool = False) -> None:
        try:
            await item.message.ack()
        except Exception as error:  # the channel closed: it is redelivered, and replays
            log.warning("message %s: ack failed (%s)", item.message_id, error)
            return
        item.settled = "ack"
        # A late retry: the key completed before (completed_at) and its
        # receipt expired; the service re-executed it under the next token.
        late = None if replayed else item.claim.completed_at
        if duplicate_of_ledger:
            how = "a copy of the order the ledger holds (the service holds another body's fingerprint for it)"
        elif replayed:
            how = "replayed the stored receipt"
        elif late is not None:
            how = (f"a late retry (completed before at {late.isoformat()}, its result expired): re-executed "
                   f"under fencing token {item.claim.fencing_token}, " + ("rewrote the same rows" if item.wrote else
                   f"the rows stand under fencing token {receipt['fencing']}"))
        elif item.wrote:
            how = f"applied under fencing token {receipt['fencing']}"
        else:
            how = f"already applied under fencing token {receipt['fencing']}; completed with that receipt"
        log.info("message %s: %s, acked", item.message_id, how)
        self.journal.write(event="ack", message_id=item.message_id, copy=item.copy, replayed=replayed,
                           wrote=item.wrote and not replayed, in_batch_duplicate=item.leader is not None,
                           late_retry=late.isoformat() if late is not None else None,
                           duplicate_of_ledger=duplicate_of_ledger,
                           receipt=receipt, batch=self.batches, pid=os.getpid())
        for follower in item.followers:
            await self.ack(follower, receipt, replayed=True)

    async def retry(self, item: Item, reason: str, detail: str) -> None:
        attempt = int((item.message.headers or {}).get(topology.RETRY_ATTEMPT) or 0)
        if attempt >= len(self.delays):
            await self.park(item, "retries_exhausted", f"{attempt} retries; the last failure: {reason}: {detail}")
            return
        if await self.republish(item.message, topology.retry_queue(self.queue, self.delays[attempt]),
                                {topology.RETRY_ATTEMPT: attempt + 1}):
            item.settled = "retry"
            self.journal.write(event="retry", reason=reason, attempt=attempt + 1, message_id=item.message_id,
                               copy=item.copy, batch=self.batches, pid=os.getpid())
        for follower in item.followers:  # not done either: each copy comes back on its own
            await self.retry(follower, reason, detail)

    async def park(self, item: Item, reason: str, detail: str) -> None:
        log.error("message %s: %s; parking it", item.message_id, detail)
        if await self.park_message(item.message, item.message_id, reason, detail, item.copy):
            item.settled = "park"
        for follower in item.followers:
            await self.park(follower, reason, detail)

    async def park_message(self, message, message_id, reason: str, detail: str, copy=None) -> bool:
        headers = {topology.PARKED_REASON: reason, topology.PARKED_DETAIL: detail[:1000],
                   topology.PARKED_FROM: self.queue}
        if await self.republish(message, topology.parking_queue(self.queue), headers):
            self.journal.write(event="park", reason=reason, message_id=message_id, copy=copy,
                               batch=self.batches, pid=os.getpid())
            return True
        return False

    async def republish(self, message, queue: str, extra_headers: dict) -> bool:
        """A copy, confirmed by the broker, then the ack (see rabbitmq-python)."""
        headers = {k: v for k, v in (message.headers or {}).items() if k != "x-delivery-count"}
        headers.update(extra_headers)
        try:
            await self.channel.default_exchange.publish(
                aio_pika.Message(message.body, headers=headers, message_id=message.message_id,
                                 content_type=message.content_type, correlation_id=message.correlation_id,
                                 delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
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
                pass
            return False
        try:
            await message.ack()
        except Exception as error:
            log.warning("delivery %s: ack after publishing to %s failed (%s)", message.delivery_tag, queue, error)
        return True


async def collect(inbox: asyncio.Queue, size: int, wait: float) -> list:
    """The next batch: the first message (waiting for it as long as it takes),
    then whatever else arrives within `wait` seconds, up to `size`."""
    batch = [await inbox.get()]
    deadline = asyncio.get_running_loop().time() + wait
    while len(batch) < size:
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            break
        try:
            batch.append(await asyncio.wait_for(inbox.get(), remaining))
        except asyncio.TimeoutError:
            break
    return batch


async def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    amqp_url = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
    queue_name = os.environ.get("QUEUE", "orders")
    size = int(os.environ.get("BATCH_SIZE", "50"))
    wait = env_float("BATCH_WAIT_SECONDS", 0.2)
    database_url = os.environ.get("ORDERS_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/orders")
    target = os.environ.get("IDEMPOTENCY_TARGET", "127.0.0.1:50051")

    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    async with pool.acquire() as conn:
        await conn.execute((HERE / "schema.sql").read_text())
    idem = AsyncIdempotencyClient(target)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    connection = await aio_pika.connect_robust(amqp_url)
    try:
        channel = await connection.channel()  # publisher confirms: retry and park copies are confirmed
        # Prefetch = the batch size: RabbitMQ sends at most a batch of unacked
        # messages, and the next ones once this batch is acked.
        await channel.set_qos(prefetch_count=size)
        queue = await topology.declare(channel, queue_name, topology.retry_delays(), topology.delivery_limit())
        consumer = BatchConsumer(idem, pool, channel, queue_name, Journal(os.environ.get("CONSUMER_JOURNAL")),
                                 KillSwitch(os.environ.get("CONSUMER_KILL_AT")))
        inbox: asyncio.Queue = asyncio.Queue()
        tag = await queue.consume(inbox.put)  # manual acks; deliveries wait in the inbox
        log.info("consuming %s in batches of up to %d (%.2f s), lease %.0f s", queue_name, size, wait, consumer.lease)

        async def batches() -> None:
            while not stop.is_set():
                await consumer.handle_batch(await collect(inbox, size, wait))

        worker = asyncio.create_task(batches())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({worker, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if worker.done():
            worker.result()  # a bug: raise it
        # Graceful stop: no new deliveries; a batch being handled finishes (its
        # acks need the channel); one still being collected is dropped, and
        # what is left unacked is requeued when the channel closes.
        await queue.cancel(tag)
        if consumer.busy:
            await asyncio.wait({worker}, timeout=consumer.lease * 2)
        worker.cancel()
    finally:
        await connection.close()
        await idem.close()
        await pool.close()
    log.info("stopped")


if __name__ == "__main__":
    asyncio.run(main())
