// Create the stream, the durable pull consumer and the dead-letter stream when missing.
//
//   NATS_URL          default nats://127.0.0.1:4222
//   STREAM            default ORDERS
//   SUBJECTS          the stream's subjects, comma-separated (default orders.>)
//   DUPLICATE_WINDOW_MS  default 120000
//   CONSUMER          default ledger
//   FILTER_SUBJECT    the consumer's subject (default: the whole stream)
//   ACK_WAIT_MS       default 30000
//   MAX_DELIVER       default 20
//   DEAD_LETTER_STREAM  default <STREAM>_DEADLETTER
import { connect } from "nats";
import { DEFAULT_ACK_WAIT_MS, DEFAULT_MAX_DELIVER, ensureConsumer, ensureDeadLetterStream, ensureStream } from "./jetstream";

async function main(): Promise<void> {
  const env = (name: string, fallback: string) => process.env[name] || fallback;
  const stream = env("STREAM", "ORDERS");
  const durable = env("CONSUMER", "ledger");
  const nc = await connect({ servers: env("NATS_URL", "nats://127.0.0.1:4222") });
  try {
    const jsm = await nc.jetstreamManager();
    await ensureStream(jsm, {
      name: stream,
      subjects: env("SUBJECTS", "orders.>").split(","),
      duplicateWindowMs: Number(env("DUPLICATE_WINDOW_MS", "120000")),
    });
    await ensureConsumer(jsm, stream, {
      durable,
      filterSubject: process.env.FILTER_SUBJECT || undefined,
      ackWaitMs: Number(env("ACK_WAIT_MS", String(DEFAULT_ACK_WAIT_MS))),
      maxDeliver: Number(env("MAX_DELIVER", String(DEFAULT_MAX_DELIVER))),
    });
    const deadLetters = env("DEAD_LETTER_STREAM", `${stream}_DEADLETTER`);
    await ensureDeadLetterStream(jsm, { name: deadLetters, stream });
    const info = await jsm.consumers.info(stream, durable);
    console.log(
      `stream ${stream}, consumer ${durable}: ack_wait ${info.config.ack_wait! / 1e6} ms, max_deliver ${info.config.max_deliver}, dead letters ${deadLetters}`,
    );
  } finally {
    await nc.close();
  }
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
