// Publish one order event.
//
//   node dist/src/publish.js SUBJECT EVENT_ID ACCOUNT AMOUNT_CENTS [WORK_MS]
//
//   NATS_URL   default nats://127.0.0.1:4222
//   MSG_ID     a Nats-Msg-Id: the stream stores a second publish with the same
//              id within its duplicate_window only once (leave it unset to
//              publish a duplicate JetStream cannot see, as the service can)
//
// Prints the publish ack as JSON: {"stream":..,"seq":..,"duplicate":..}.
import { connect } from "nats";
import type { OrderEvent } from "./consumer";

async function main(): Promise<void> {
  const [subject, eventId, account, amount, workMs] = process.argv.slice(2);
  if (!subject || !eventId || !account || amount === undefined) {
    throw new Error("usage: publish.js SUBJECT EVENT_ID ACCOUNT AMOUNT_CENTS [WORK_MS]");
  }
  const event: OrderEvent = { event_id: eventId, account, amount_cents: Number(amount) };
  if (workMs !== undefined) event.work_ms = Number(workMs);
  const nc = await connect({ servers: process.env.NATS_URL || "nats://127.0.0.1:4222" });
  try {
    const msgID = process.env.MSG_ID || undefined;
    const ack = await nc.jetstream().publish(subject, Buffer.from(JSON.stringify(event)), msgID ? { msgID } : undefined);
    console.log(JSON.stringify({ stream: ack.stream, seq: ack.seq, duplicate: ack.duplicate }));
  } finally {
    await nc.close();
  }
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
