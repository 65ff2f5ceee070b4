"""The consumer's queues, declared the same way by the consumer, publish.py
and the tests (RabbitMQ refuses a second declaration with other arguments).

    <queue>               the orders: a quorum queue (durable, replicated), with a
                          delivery limit and <queue>.dlq as its dead-letter target
    <queue>.retry.<delay> one per backoff step: a message waits there for <delay>
                          (the queue's message TTL), then RabbitMQ dead-letters it
                          back into <queue>
    <queue>.dlq           the parking queue: nothing in it expires; an operator
                          reads it (see the README's "Parked messages")

Why a retry queue instead of nack(requeue=True): a requeued message is
delivered again at once, so a ledger outage of a minute burns through any
delivery limit in seconds, and the message is gone. Through the retry queues
each failure waits a little longer (RETRY_DELAYS), and when the budget is
spent the message is parked with its reason, never dropped.

Why the delivery limit still: a failure the consumer sees is acked after the
retry copy is published, so it never counts; what counts is a redelivery
after a consumer or its channel died holding the message (a crash, an OOM
kill), and a basic.reject with requeue (what the consumer does when it cannot
publish the retry copy). On RabbitMQ before 4.3 (the tests run 3.10) every
return counts, basic.nack with requeue and consumer_timeout included; from
4.3 a basic.nack with requeue and a consumer_timeout do not, which is why the
consumer rejects rather than nacks (tests: the delivery limit test). 20 lets a message live through 19 of those, the
innocent ones prefetched next to a poison message included, before RabbitMQ
dead-letters it into <queue>.dlq (with its x-death header saying
delivery_limit).
"""

from __future__ import annotations

import os
from typing import List, Sequence

import aio_pika

#: Backoff between attempts, in seconds: 7 retries, 32 min 36 s in all. A
#: database failover or a deploy is ridden out several times over, and the
#: whole budget outlasts RabbitMQ's consumer_timeout (30 min), so a copy that
#: waits on a live holder is not parked while the holder can still finish.
DEFAULT_RETRY_DELAYS = (1, 5, 30, 120, 600, 600, 600)

#: Redeliveries after a consumer died holding the message (RabbitMQ 4's default).
DEFAULT_DELIVERY_LIMIT = 20

#: Headers this consumer sets on the copies it republishes.
RETRY_ATTEMPT = "x-retry-attempt"  # how many retries this copy has had
PARKED_REASON = "x-parked-reason"  # why it was parked (a word, for alerts and scripts)
PARKED_DETAIL = "x-parked-detail"  # the error, for the operator
PARKED_FROM = "x-parked-from"  # the queue it was consumed from


def retry_delays() -> List[float]:
    """RETRY_DELAYS (comma-separated seconds), else the defaults."""
    value = os.environ.get("RETRY_DELAYS")
    if not value:
        return list(DEFAULT_RETRY_DELAYS)
    return [float(part) for part in value.split(",") if part.strip()]


def delivery_limit() -> int:
    return int(os.environ.get("DELIVERY_LIMIT") or DEFAULT_DELIVERY_LIMIT)


def delay_name(seconds: float) -> str:
    """30 -> "30s", 120 -> "2m", 0.25 -> "250ms": the suffix of a retry queue."""
    ms = round(seconds * 1000)
    if ms % 60000 == 0:
        return f"{ms // 60000}m"
    if ms % 1000 == 0:
        return f"{ms // 1000}s"
    return f"{ms}ms"


def retry_queue(queue: str, seconds: float) -> str:
    return f"{queue}.retry.{delay_name(seconds)}"


def parking_queue(queue: str) -> str:
    return f"{queue}.dlq"


def queue_names(queue: str, delays: Sequence[float]) -> List[str]:
    """Every queue declare() declares (for a test's cleanup)."""
    retries = sorted({retry_queue(queue, d) for d in delays})
    return [queue, parking_queue(queue), *retries]


#: Dead-lettering at least once (RabbitMQ 3.10 and later, quorum queues): a
#: message is removed from its queue only once the dead-letter target
#: confirmed it, so one dead-lettered while <queue>.dlq is missing, or during
#: a node's crash, is kept and dead-lettered again (after a restart, at
#: once). The default, at most once, drops it. It requires overflow
#: reject-publish (with drop-head RabbitMQ falls back to at most once).
AT_LEAST_ONCE = {"x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"}


async def declare(
    channel: aio_pika.abc.AbstractChannel,
    queue: str,
    delays: Sequence[float],
    limit: int,
) -> aio_pika.abc.AbstractQueue:
    """Declare the queues (idempotent with the same arguments) and return the
    main one."""
    dlq = parking_queue(queue)
    await channel.declare_queue(dlq, durable=True, arguments={"x-queue-type": "quorum"})
    main = await channel.declare_queue(
        queue,
        durable=True,
        arguments={
            "x-queue-type": "quorum",
            "x-delivery-limit": limit,
            "x-dead-letter-exchange": "",  # the default exchange: routed by queue name
            "x-dead-letter-routing-key": dlq,
            **AT_LEAST_ONCE,
        },
    )
    for seconds in sorted(set(delays)):
        await channel.declare_queue(
            retry_queue(queue, seconds),
            durable=True,
            arguments={
                # A quorum queue too: its expired messages are dead-lettered
                # back into <queue> at least once, as the main queue's are.
                "x-queue-type": "quorum",
                # Every message in one retry queue has the same TTL, so they
                # expire in order at the head (per-message TTLs of different
                # lengths in one queue would wait behind each other).
                "x-message-ttl": round(seconds * 1000),
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": queue,
                **AT_LEAST_ONCE,
            },
        )
    return main
