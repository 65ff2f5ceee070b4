// The consumer as a program: pull from a durable JetStream consumer, write the
// ledger in its own PostgreSQL database, dedup through idempotency-service.
// One JSON line per delivery on stdout. SIGTERM or SIGINT: stop pulling,
// finish the messages in hand, exit 0.
//
//   NATS_URL              default nats://127.0.0.1:4222
//   STREAM, CONSUMER      the stream and its durable pull consumer (created beforehand, see README)
//   IDEMPOTENCY_TARGET    the service, host:port (default 127.0.0.1:50051)
//   IDEMPOTENCY_TOKEN     a bearer token, when the service has an access policy
//   LEDGER_DATABASE_URL   the consumer's own PostgreSQL database
//   NAMESPACE             default orders-ledger
//   WORKER                default <hostname>-<pid>
//   CONCURRENCY           messages worked on at once (default 4)
//   LEASE_MS              default 30000
//   RETENTION_MS          default 259200000 (3 days; shorter than the server's remember_for, 7 days)
//   HEARTBEAT             1 (default) or 0
//   TOUCH_MESSAGE         1 (default): msg.working() with each heartbeat; 0: let ack_wait expire (to show redelivery)
//   NAK_BACKOFF_MS        the nak delay per delivery, comma-separated, the last repeating
//                         (default 1000,5000,30000,120000,300000; see nakDelayMs in consumer.ts)
import { hostname } from "node:os";
import { connect, millis } from "nats";
import { Pool } from "pg";
import { IdempotencyClient } from "idempotency-client";
import { ensureLedger } from "./ledger";
import { checkSettings, DEFAULT_NAK_BACKOFF_MS, runWorker, type ConsumerSettings } from "./consumer";

function env(name: string, fallback?: string): string {
  const value = process.env[name];
  if (value !== undefined && value !== "") return value;
  if (fallback !== undefined) return fallback;
  throw new Error(`${name} is required`);
}

function intEnv(name: string, fallback: number): number {
  const text = env(name, String(fallback));
  const value = Number(text);
  if (!Number.isSafeInteger(value)) throw new Error(`${name}: an integer is required, got ${text}`);
  return value;
}

function backoffEnv(name: string, fallback: readonly number[]): number[] {
  const text = env(name, fallback.join(","));
  const steps = text.split(",").map((step) => Number(step.trim()));
  if (steps.length === 0 || !steps.every((step) => Number.isSafeInteger(step) && step > 0)) {
    throw new Error(`${name}: positive integers (ms), comma-separated, are required, got ${text}`);
  }
  return steps;
}

async function main(): Promise<void> {
  const streamName = env("STREAM");
  const consumerName = env("CONSUMER");
  const nc = await connect({ servers: env("NATS_URL", "nats://127.0.0.1:4222"), name: "orders-ledger" });
  const js = nc.jetstream();
  const jsm = await nc.jetstreamManager();
  const consumer = await js.consumers.get(streamName, consumerName);
  const info = await consumer.info();
  const stream = await jsm.streams.info(streamName);

  const settings: ConsumerSettings = {
    namespace: env("NAMESPACE", "orders-ledger"),
    worker: env("WORKER", `${hostname()}-${process.pid}`),
    leaseTtlMs: intEnv("LEASE_MS", 30_000),
    retentionMs: intEnv("RETENTION_MS", 3 * 24 * 3600 * 1000),
    ackWaitMs: millis(info.config.ack_wait ?? 30_000_000_000),
    heartbeat: env("HEARTBEAT", "1") !== "0",
    touchMessage: env("TOUCH_MESSAGE", "1") !== "0",
    nakBackoffMs: backoffEnv("NAK_BACKOFF_MS", DEFAULT_NAK_BACKOFF_MS),
  };
  for (const problem of checkSettings(
    {
      ackWaitMs: settings.ackWaitMs,
      maxDeliver: info.config.max_deliver ?? -1,
      backoffMs: info.config.backoff?.map((n) => millis(n)),
      duplicateWindowMs: millis(stream.config.duplicate_window),
      maxAgeMs: millis(stream.config.max_age),
    },
    settings,
  )) {
    console.error(`warning: ${problem}`);
  }

  const token = process.env.IDEMPOTENCY_TOKEN || undefined;
  const client = new IdempotencyClient(env("IDEMPOTENCY_TARGET", "127.0.0.1:50051"), { token });
  const concurrency = intEnv("CONCURRENCY", 4);
  const pool = new Pool({ connectionString: env("LEDGER_DATABASE_URL"), max: concurrency, application_name: settings.worker });
  // An idle connection that breaks (the ledger restarts, fails over) is an
  // 'error' event on the pool, which would otherwise end the process. The
  // next query opens a new one; a query that fails naks its message.
  pool.on("error", (error) => console.error(`${settings.worker}: ledger connection lost: ${error.message}`));
  await ensureLedger(pool);

  const worker = runWorker(consumer, { client, pool, settings }, {
    concurrency,
    onReport: (report) => process.stdout.write(`${JSON.stringify(report)}\n`),
  });
  let stopping: Promise<void> | undefined;
  const stop = () => (stopping ??= worker.stop());
  process.once("SIGTERM", stop);
  process.once("SIGINT", stop);
  console.error(`${settings.worker}: consuming ${streamName}/${consumerName} (ack_wait ${settings.ackWaitMs} ms, lease ${settings.leaseTtlMs} ms)`);
  process.stdout.write(`${JSON.stringify({ worker: settings.worker, ready: true })}\n`);

  try {
    await worker.finished;
  } finally {
    await nc.drain();
    await pool.end();
    client.close();
  }
}

main().then(
  () => process.exit(0),
  (error) => {
    console.error(error);
    process.exit(1);
  },
);
