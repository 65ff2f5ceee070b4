"""Publish one order to the consumer's queue, with its order id as message_id.

    python publish.py ord-1 c1 1250            # AMQP_URL and QUEUE as for consumer.py

Run it twice with the same arguments: the second copy is a duplicate (same
message id, same body) and the consumer acks it with the stored receipt.
"""

import asyncio
import json
import os
import sys

import aio_pika

import topology


async def publish(order_id: str, customer: str, amount_cents: int) -> None:
    url = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
    queue = os.environ.get("QUEUE", "orders")
    body = json.dumps({"order_id": order_id, "customer": customer, "amount_cents": amount_cents}, sort_keys=True)
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()  # publisher confirms: publish() waits for the broker's
        # The same declaration as the consumer's (RabbitMQ refuses another).
        await topology.declare(channel, queue, topology.retry_delays(), topology.delivery_limit())
        await channel.default_exchange.publish(
            aio_pika.Message(
                body.encode(),
                message_id=order_id,  # the stable id the consumer derives its key from
                content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            routing_key=queue,
        )
    finally:
        await connection.close()
    print(f"published {body} to {queue}")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: publish.py ORDER_ID CUSTOMER AMOUNT_CENTS")
    asyncio.run(publish(sys.argv[1], sys.argv[2], int(sys.argv[3])))
