"""Move parked messages from <queue>.dlq back into <queue>, for an operator,
once the cause is fixed (the ledger is back, the consumer's bug is fixed).

    python requeue_parked.py                          # list what is parked (moves nothing back)
    python requeue_parked.py --move --reason retries_exhausted
    python requeue_parked.py --move --message-id ord-17

AMQP_URL and QUEUE as for consumer.py. Each moved message goes back with its
body and message_id, without the parking and retry headers, so it starts
with a fresh retry budget. Messages that do not match stay parked (they are
put back at the end of the parking queue, listing included). Every message is published with
publisher confirms before it is acked, so a crash midway leaves a copy in
both queues, never in neither; the copy's key makes it harmless.

Moving a message back is safe whatever happened to it: a duplicate of a
completed order replays, a new one applies once. What it does NOT do is make
a completed order run again; see the README's "Purge, and running an order
again".
"""

from __future__ import annotations

import argparse
import asyncio
import os

import aio_pika

import topology

#: Headers that describe a copy's past here; dropped when it is moved back.
DROPPED = (topology.PARKED_REASON, topology.PARKED_DETAIL, topology.PARKED_FROM, topology.RETRY_ATTEMPT,
           "x-death", "x-first-death-exchange", "x-first-death-queue", "x-first-death-reason",
           "x-delivery-count")


async def requeue(queue: str, *, move: bool, reason: str | None, message_id: str | None) -> list:
    """Go through the parking queue once; return (message_id, reason, moved) per message."""
    url = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
    dlq_name = topology.parking_queue(queue)
    seen = []
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()  # publisher confirms
        dlq = await channel.declare_queue(dlq_name, passive=True)
        for _ in range(dlq.declaration_result.message_count):
            message = await dlq.get(fail=False)
            if message is None:
                break
            headers = dict(message.headers or {})
            why = headers.get(topology.PARKED_REASON)
            if why is None and headers.get("x-first-death-reason"):  # dead-lettered by RabbitMQ
                why = str(headers["x-first-death-reason"])
            matches = move and (reason is None or why == reason) and (message_id is None or message.message_id == message_id)
            target = queue if matches else dlq_name
            if matches:
                headers = {k: v for k, v in headers.items() if k not in DROPPED}
            await channel.default_exchange.publish(
                aio_pika.Message(
                    message.body,
                    headers=headers,
                    message_id=message.message_id,
                    content_type=message.content_type,
                    correlation_id=message.correlation_id,
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                routing_key=target,
            )
            await message.ack()
            seen.append((message.message_id, why, matches))
    finally:
        await connection.close()
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--move", action="store_true", help="move the matching messages (else only list)")
    parser.add_argument("--reason", help="only messages parked for this reason (x-parked-reason)")
    parser.add_argument("--message-id", help="only this message id")
    args = parser.parse_args()
    queue = os.environ.get("QUEUE", "orders")
    for mid, why, moved in asyncio.run(requeue(queue, move=args.move, reason=args.reason, message_id=args.message_id)):
        print(f"{'moved' if moved else 'parked'}\t{mid}\t{why}")


if __name__ == "__main__":
    main()
