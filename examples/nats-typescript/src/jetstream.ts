// The stream and the durable pull consumer, with the settings the README
// discusses. Both are created only when missing: an existing stream or
// consumer is left as it is (change those with the nats CLI or your IaC).
import { AckPolicy, DeliverPolicy, nanos, type JetStreamManager } from "nats";

export interface StreamOptions {
  name: string;
  subjects: string[];
  /** Publishes with the same Nats-Msg-Id within this window are stored once (JetStream's default: 2 min). */
  duplicateWindowMs?: number;
  /** How long messages are kept; 0: no limit. */
  maxAgeMs?: number;
}

export interface ConsumerOptions {
  durable: string;
  /** Only this subject of the stream; all of it when omitted. */
  filterSubject?: string;
  /** How long JetStream waits for an ack (or msg.working()) before redelivering. */
  ackWaitMs?: number;
  /** Deliveries per message, naks included; -1: unlimited. */
  maxDeliver?: number;
  /** Redelivery delays after ack_wait ran out, one per delivery (the last repeats); replaces ack_wait for them. */
  backoffMs?: number[];
  /** Messages delivered and not yet acked, across all workers. */
  maxAckPending?: number;
}

async function exists(lookup: () => Promise<unknown>): Promise<boolean> {
  try {
    await lookup();
    return true;
  } catch (error) {
    if (/not found/i.test((error as Error).message)) return false;
    throw error;
  }
}

export async function ensureStream(jsm: JetStreamManager, options: StreamOptions): Promise<void> {
  if (await exists(() => jsm.streams.info(options.name))) return;
  await jsm.streams.add({
    name: options.name,
    subjects: options.subjects,
    duplicate_window: nanos(options.duplicateWindowMs ?? 120_000),
    max_age: nanos(options.maxAgeMs ?? 0),
  });
}

export async function ensureConsumer(jsm: JetStreamManager, stream: string, options: ConsumerOptions): Promise<void> {
  if (await exists(() => jsm.consumers.info(stream, options.durable))) return;
  await jsm.consumers.add(stream, {
    durable_name: options.durable,
    filter_subject: options.filterSubject,
    ack_policy: AckPolicy.Explicit,
    deliver_policy: DeliverPolicy.All,
    ack_wait: nanos(options.ackWaitMs ?? 30_000),
    max_deliver: options.maxDeliver ?? 20,
    backoff: options.backoffMs?.map((ms) => nanos(ms)),
    max_ack_pending: options.maxAckPending ?? 1_000,
  });
}
