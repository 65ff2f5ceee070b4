// The stream, the durable pull consumer and the dead-letter stream, with the
// settings the README discusses. Each is created only when missing: an
// existing one is left as it is (change those with the nats CLI or your IaC).
import { AckPolicy, DeliverPolicy, nanos, type JetStreamManager } from "nats";

/**
 * The consumer's defaults, the numbers of docs/recipes.md's table: ack_wait
 * 30 s (the lease is 30 s too: lease <= ack_wait), max_deliver 20 (with the
 * nak backoff of consumer.ts, about 83 min of retries before a message is
 * parked).
 */
export const DEFAULT_ACK_WAIT_MS = 30_000;
export const DEFAULT_MAX_DELIVER = 20;

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
    ack_wait: nanos(options.ackWaitMs ?? DEFAULT_ACK_WAIT_MS),
    max_deliver: options.maxDeliver ?? DEFAULT_MAX_DELIVER,
    backoff: options.backoffMs?.map((ms) => nanos(ms)),
    max_ack_pending: options.maxAckPending ?? 1_000,
  });
}

/** The advisories JetStream publishes when it gives up on a message of `stream`, for any consumer. */
export function deadLetterSubjects(stream: string): string[] {
  return [
    // the message ran out of deliveries (max_deliver): a failure that outlasted the retry budget
    `$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.${stream}.*`,
    // a consumer term()ed it: a body it cannot read, or another body under a completed event id
    `$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.${stream}.*`,
  ];
}

/**
 * The dead-letter stream: it keeps every advisory of a message that JetStream
 * stopped delivering (stream sequence, consumer, deliveries), so that nothing
 * is dropped silently. The advisory names the message; the message itself
 * stays in `stream` (keep the stream's max_age longer than the time you allow
 * for a re-drive). Advisories are plain NATS messages: a stream captures them
 * even while no dead-letter tool runs.
 */
export async function ensureDeadLetterStream(jsm: JetStreamManager, options: { name: string; stream: string }): Promise<void> {
  if (await exists(() => jsm.streams.info(options.name))) return;
  await jsm.streams.add({ name: options.name, subjects: deadLetterSubjects(options.stream) });
}
