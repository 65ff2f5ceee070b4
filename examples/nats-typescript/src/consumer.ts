// A JetStream pull consumer made exactly-once with idempotency-service.
//
// Per message (handleMessage):
//   parse the event; its key is deriveKey("orders", event_id): the event's
//   id from the body, never the stream sequence or the delivery count (a
//   redelivery keeps the sequence, a re-published duplicate gets a new one).
//
//   once() Claims the key, then by outcome:
//     CLAIMED       run the work; a heartbeat extends the lease (ExtendLease)
//                   and tells JetStream the message is being worked on
//                   (msg.working(), which restarts ack_wait); write the effect
//                   under the fencing guard (ledger.ts); Complete; then ack.
//                   A late retry (the receipt expired, the service remembers
//                   the event and re-executes it: lease.completedBefore is
//                   set) is the same, under the next fencing token: the guard
//                   rewrites the same row; the report says `late_retry`.
//     COMPLETED     the replay: ack; the stored receipt is the result.
//     IN_PROGRESS   another delivery of the same event is being worked on
//                   (JetStream redelivered it after ack_wait, or the event was
//                   published twice): nak with a delay of the time left on
//                   that lease, at least the backoff step and at most its
//                   last, so the copy comes back later and is replayed or
//                   taken over.
//     FINGERPRINT_MISMATCH  the event id came back with another body: term
//                   (never redeliver); the first body's effect stands. The
//                   ledger row refuses another body the same way before the
//                   Claim, however late it comes (once the receipt expired
//                   the service re-executes a late copy without comparing
//                   fingerprints, and forgets the event past its horizon; the
//                   row does neither).
//
//   Every nak waits the backoff step of its delivery (nakDelayMs: 1 s, 5 s,
//   30 s, 2 min, then 5 min by default), and every delivery counts against
//   the consumer's max_deliver. A message that runs out of deliveries, or is
//   term()ed, is parked, not lost: JetStream publishes an advisory naming its
//   stream sequence, which the dead-letter stream keeps (jetstream.ts,
//   deadletter.ts), and the message itself stays in the stream.
//
//   The ack follows Complete, never precedes it. When Complete is refused
//   (LeaseLost: FAILED_PRECONDITION or NOT_FOUND, because our lease ran out and
//   another attempt took the key over), the message is NOT acked: nak, and the
//   redelivery finds out whether the other attempt completed (replay, ack) or
//   died (its lease runs out, a takeover). When Complete fails for a transient
//   reason (UNAVAILABLE), nak too: the effect is in, and the redelivery either
//   replays (the Complete landed) or takes over once our lease is gone and
//   rewrites the same row under the next fencing token. When the work throws,
//   once() Releases the key and the message is nak'ed for a retry.
//
//   A body that cannot be read, or whose key cannot be derived, is term()ed
//   without a Claim: redelivering it cannot help.
import { setTimeout as sleep } from "node:timers/promises";
import type { Pool } from "pg";
import type { Consumer, JsMsg } from "nats";
import {
  deriveKey,
  fingerprint,
  FingerprintMismatch,
  InProgress,
  LeaseLost,
  type IdempotencyClient,
  type Lease,
} from "idempotency-client";
import { applyEffect, currentRow, type EffectResult, type Receipt } from "./ledger";

/** The first field of every key: the publisher's name for its events. */
export const SOURCE = "orders";

/** The message body. */
export interface OrderEvent {
  event_id: string;
  account: string;
  amount_cents: number;
  /** How long the (simulated) work takes, in ms: the test makes some events slower than ack_wait. */
  work_ms?: number;
}

export function parseEvent(data: Uint8Array): OrderEvent {
  const event = JSON.parse(Buffer.from(data).toString("utf8"));
  if (typeof event !== "object" || event === null || Array.isArray(event)) throw new Error("the body is not a JSON object");
  if (typeof event.event_id !== "string" || event.event_id === "") throw new Error("event_id: a non-empty string is required");
  if (typeof event.account !== "string" || event.account === "") throw new Error("account: a non-empty string is required");
  if (!Number.isSafeInteger(event.amount_cents)) throw new Error("amount_cents: an integer within +-(2^53 - 1) is required");
  if (event.work_ms !== undefined && !(Number.isSafeInteger(event.work_ms) && event.work_ms >= 0)) {
    throw new Error("work_ms: a non-negative integer is required");
  }
  return event as OrderEvent;
}

/** The key the service dedups on: the event, not the delivery. */
export function eventKey(eventId: string): string {
  return deriveKey(SOURCE, eventId);
}

/**
 * The fingerprint: the canonical JSON (clients/KEYS.md) of the fields the
 * effect is made of, never of the whole parsed body. Those fields are checked
 * strings and a safe integer, so it cannot throw; other fields of the body
 * (metadata, floats, integers beyond 2^53, which canonical JSON refuses) and
 * their order or spacing neither break it nor make a re-serialised copy look
 * like another event.
 */
export function eventFingerprint(event: OrderEvent): Buffer {
  return fingerprint({ event_id: event.event_id, account: event.account, amount_cents: event.amount_cents });
}

/** What handleMessage needs from a body; throws when the body is unusable (the message is then term()ed). */
export function readMessage(data: Uint8Array): { event: OrderEvent; key: string; fingerprint: Buffer } {
  const event = parseEvent(data);
  // deriveKey and fingerprint refuse text that is not valid Unicode (a lone
  // surrogate from a \ud800 escape): that body is unusable too.
  return { event, key: eventKey(event.event_id), fingerprint: eventFingerprint(event) };
}

/**
 * The nak delays, one per delivery (the last repeats): quick retries for a
 * blip, then minutes for an outage, never more than 5 min so that a recovered
 * dependency is used within 5 min. With max_deliver 20 a message that keeps
 * failing is retried for about 83 min (retryBudgetMs) and then parked.
 */
export const DEFAULT_NAK_BACKOFF_MS: readonly number[] = [1_000, 5_000, 30_000, 120_000, 300_000];

/** The nak delay after delivery number `delivery` (1 = the first). */
export function nakDelayMs(delivery: number, backoffMs: readonly number[] = DEFAULT_NAK_BACKOFF_MS): number {
  return backoffMs[Math.min(Math.max(delivery, 1), backoffMs.length) - 1];
}

/**
 * How long a message that fails every time keeps being retried before
 * JetStream gives up on it (max_deliver deliveries, each nak'ed after its
 * step; the advisory follows the last step): the outage it rides out.
 */
export function retryBudgetMs(maxDeliver: number, backoffMs: readonly number[] = DEFAULT_NAK_BACKOFF_MS): number {
  let budget = 0;
  for (let delivery = 1; delivery <= maxDeliver; delivery++) budget += nakDelayMs(delivery, backoffMs);
  return budget;
}

/** The ledger holds the event with another account or amount: refused like a fingerprint mismatch. */
export class OtherBody extends Error {
  override name = "OtherBody";
}

export interface ConsumerSettings {
  /** The service namespace: one per consumer purpose (two consumers doing different work on one event use two). */
  namespace: string;
  /** Which worker this is; written to the ledger and the logs. */
  worker: string;
  /** The lease. A live attempt keeps it by heartbeat; it only matters when the attempt dies or stalls. */
  leaseTtlMs: number;
  /** How long the result is kept and replayed: longer than any copy of the event can still arrive. */
  retentionMs: number;
  /** The consumer's ack_wait (read from the consumer's info by runWorker). */
  ackWaitMs: number;
  /** Extend the lease while the work runs (default true). Off only to show a lost lease. */
  heartbeat?: boolean;
  /** Call msg.working() with each heartbeat, so JetStream does not redeliver a message being worked on (default true). */
  touchMessage?: boolean;
  /** The nak delays by delivery count (DEFAULT_NAK_BACKOFF_MS when unset); see nakDelayMs. */
  nakBackoffMs?: readonly number[];
}

/** What the work is: here a sleep of event.work_ms that stops when the lease is lost. */
export type Work = (event: OrderEvent, signal: AbortSignal) => Promise<void>;

export const simulatedWork: Work = async (event, signal) => {
  if (event.work_ms) await sleep(event.work_ms, undefined, { signal });
};

export interface HandlerContext {
  client: IdempotencyClient;
  pool: Pool;
  settings: ConsumerSettings;
  work?: Work;
  /** Called once this attempt holds the lease (the test uses it to order its scenarios). */
  onClaimed?: (event: OrderEvent, lease: Lease) => void;
}

export type Outcome =
  | "completed" // this attempt did the work, Complete succeeded, acked
  | "replayed" // the key was completed before: acked, receipt is the stored one
  | "in-progress" // another attempt holds the lease: nak'ed with a delay
  | "mismatch" // the event id with another body: term'ed
  | "lease-lost" // the lease was lost (heartbeat or Complete refused): nak'ed, never acked
  | "failed" // the work or a call failed: nak'ed (once() released the key when the work threw)
  | "invalid"; // not an event: term'ed

/** One line of the consumer's log per delivery. */
export interface Report {
  worker: string;
  outcome: Outcome;
  event_id?: string;
  key?: string;
  stream_seq: number;
  /** JetStream's delivery count of this message (1 on the first delivery). */
  delivery: number;
  /** The fencing token of this attempt's lease, when it won one. */
  fencing?: string;
  /**
   * A late retry: when the event completed before (ISO 8601). Its receipt
   * expired and the service, which remembers the event, re-executed it under
   * the next fencing token. Worth counting: copies come later than the retention.
   */
  late_retry?: string;
  /** The effect write of this attempt, when it got that far. */
  effect?: { applied: boolean; row_fencing: string };
  /** The result: written (completed) or replayed. */
  receipt?: Receipt;
  /** in-progress, lease-lost, failed: how long the message was nak'ed for. */
  nak_delay_ms?: number;
  /** lease-lost, failed: the error, and the service's error under it (LeaseNotCurrent, KeyNotFound, ...). */
  error?: string;
  cause?: string;
  started_at: number;
  ended_at: number;
}

/** How often to heartbeat: well within both the lease and ack_wait. */
export function heartbeatIntervalMs(settings: ConsumerSettings): number {
  return Math.max(100, Math.floor(Math.min(settings.leaseTtlMs, settings.ackWaitMs) / 3));
}

/** Call msg.working() on a timer until stopped or the lease is lost. */
function touchWhileWorking(msg: JsMsg, signal: AbortSignal, intervalMs: number): () => void {
  const timer = setInterval(() => {
    if (!signal.aborted) msg.working();
  }, intervalMs);
  timer.unref();
  const stop = () => clearInterval(timer);
  signal.addEventListener("abort", stop, { once: true });
  return stop;
}

export async function handleMessage(msg: JsMsg, ctx: HandlerContext): Promise<Report> {
  const s = ctx.settings;
  const started_at = Date.now();
  const base = { worker: s.worker, stream_seq: msg.seq, delivery: msg.info.redeliveryCount, started_at };
  const done = (fields: Omit<Report, keyof typeof base | "ended_at">): Report => ({ ...base, ...fields, ended_at: Date.now() });

  let event: OrderEvent;
  let key: string;
  let eventFp: Buffer;
  try {
    ({ event, key, fingerprint: eventFp } = readMessage(msg.data));
  } catch (error) {
    // Redelivering a body that cannot be read cannot help. No reason string:
    // nats-server 2.9 takes "+TERM <reason>" for no ack at all and redelivers.
    msg.term();
    return done({ outcome: "invalid", error: (error as Error).message });
  }
  const work = ctx.work ?? simulatedWork;
  const interval = heartbeatIntervalMs(s);
  let fencing: bigint | undefined;
  let completedBefore: Date | null = null;
  let effect: EffectResult | undefined;
  const attempt = () => ({
    event_id: event.event_id,
    key,
    fencing: fencing?.toString(),
    ...(completedBefore ? { late_retry: completedBefore.toISOString() } : {}),
    effect: effect && { applied: effect.applied, row_fencing: effect.receipt.fencing },
  });

  try {
    // The ledger row outlives the service's record: once the receipt expired,
    // the service would re-execute another body under this id (a late retry
    // is not compared with the first fingerprint), or, past the event's
    // horizon, take it for a new event. The row still tells it apart:
    // refused before any Claim.
    const existing = await currentRow(ctx.pool, key);
    if (existing && (existing.account !== event.account || existing.amount_cents !== event.amount_cents)) {
      throw new OtherBody(`the ledger holds ${event.event_id} with another account or amount`);
    }
    const result = await ctx.client.onceWithDetails<Receipt>(
      s.namespace,
      key,
      async (lease) => {
        fencing = lease.fencingToken;
        completedBefore = lease.completedBefore;
        ctx.onClaimed?.(event, lease);
        const stopTouching = s.touchMessage === false ? () => undefined : touchWhileWorking(msg, lease.signal, interval);
        try {
          await work(event, lease.signal);
          // The heartbeat found the lease gone: someone else has the key now; write nothing.
          if (lease.signal.aborted) throw lease.signal.reason;
          effect = await applyEffect(ctx.pool, {
            eventKey: key,
            eventId: event.event_id,
            account: event.account,
            amountCents: event.amount_cents,
            fencing: lease.fencingToken,
            worker: s.worker,
          });
          // Stored by Complete and replayed to every later copy: the row as it stands.
          return effect.receipt;
        } finally {
          stopTouching();
        }
      },
      {
        fingerprint: eventFp,
        leaseTtlMs: s.leaseTtlMs,
        retentionMs: s.retentionMs,
        // Pinned, not left to the namespace or the server: the ledger guards
        // the effect (fencing token and body), so a late copy (its receipt
        // expired, the event remembered) is re-executed under the next token
        // and rewrites its own row: one effect, reported as late_retry.
        // Refused, once() would throw ResultExpired, and the copy would be
        // nak'ed until max_deliver parked it.
        lateRetry: "reexecute",
        onInProgress: "throw",
        heartbeat: s.heartbeat !== false,
        heartbeatIntervalMs: interval,
      },
    );
    msg.ack(); // only now: the result is stored, every later copy replays it
    return done({ ...attempt(), outcome: result.replayed ? "replayed" : "completed", receipt: result.value });
  } catch (error) {
    const backoff = s.nakBackoffMs ?? DEFAULT_NAK_BACKOFF_MS;
    const step = nakDelayMs(msg.info.redeliveryCount, backoff);
    if (error instanceof InProgress) {
      // Come back when the other lease would have run out, but no sooner
      // than this delivery's backoff step: a copy waiting on a long piece of
      // work must not spend its deliveries faster than a failure does.
      const delay = Math.max(100, Math.min(Math.max(error.retryAfterMs, step), backoff[backoff.length - 1]));
      msg.nak(delay);
      return done({ ...attempt(), outcome: "in-progress", nak_delay_ms: delay });
    }
    if (error instanceof FingerprintMismatch || error instanceof OtherBody) {
      msg.term(); // parked by the MSG_TERMINATED advisory; see deadletter.ts
      return done({ ...attempt(), outcome: "mismatch", error: error.message });
    }
    const cause = (error as Error).cause;
    const causeName = cause instanceof Error ? cause.name : undefined;
    msg.nak(step); // never ack what was not completed by this attempt
    return done({
      ...attempt(),
      outcome: error instanceof LeaseLost ? "lease-lost" : "failed",
      nak_delay_ms: step,
      error: `${(error as Error).name}: ${(error as Error).message}`,
      cause: causeName,
    });
  }
}

export interface RunningWorker {
  /** Stop pulling, let the messages in hand finish, then resolve. */
  stop(): Promise<void>;
  /** Resolves when every loop has ended (after stop(), or when one failed). */
  finished: Promise<void>;
}

/**
 * Run `concurrency` loops, each pulling ONE message at a time with next() and
 * handling it before pulling another. No prefetching on purpose: a message
 * waiting in a client-side buffer ages against ack_wait as well.
 */
export function runWorker(
  consumer: Consumer,
  ctx: HandlerContext,
  options: { concurrency?: number; onReport?: (report: Report) => void } = {},
): RunningWorker {
  let stopping = false;
  const loop = async () => {
    while (!stopping) {
      const msg = await consumer.next({ expires: 1_000 });
      if (!msg) continue;
      const report = await handleMessage(msg, ctx);
      options.onReport?.(report);
    }
  };
  const loops = Array.from({ length: options.concurrency ?? 1 }, loop);
  const finished = Promise.all(loops).then(() => undefined);
  return {
    finished,
    stop: async () => {
      stopping = true;
      await finished;
    },
  };
}

/** The JetStream settings that matter here, in milliseconds. */
export interface JetStreamSettings {
  ackWaitMs: number;
  /** -1: unlimited. */
  maxDeliver: number;
  backoffMs?: number[];
  duplicateWindowMs: number;
  /** The stream's max_age; 0: unlimited. */
  maxAgeMs: number;
}

/**
 * The longest a copy of a message may still be delivered after the first
 * delivery, without msg.working(): every delivery may wait out its ack_wait
 * (or the consumer's backoff step) and then its nak delay.
 */
export function redeliverySpanMs(js: JetStreamSettings, nakBackoffMs: readonly number[] = DEFAULT_NAK_BACKOFF_MS): number {
  const waits = js.backoffMs && js.backoffMs.length > 0 ? js.backoffMs : [js.ackWaitMs];
  let span = 0;
  for (let i = 0; i < js.maxDeliver; i++) span += waits[Math.min(i, waits.length - 1)] + nakDelayMs(i + 1, nakBackoffMs);
  return span;
}

/**
 * What is wrong with a lease and retention for these JetStream settings
 * (empty when nothing): the rules of the README, as code.
 */
export function checkSettings(
  js: JetStreamSettings,
  s: Pick<ConsumerSettings, "leaseTtlMs" | "retentionMs" | "nakBackoffMs">,
): string[] {
  const problems: string[] = [];
  if (s.retentionMs < js.duplicateWindowMs) {
    problems.push(`retention (${s.retentionMs} ms) is shorter than the stream's duplicate_window (${js.duplicateWindowMs} ms)`);
  }
  if (js.maxDeliver > 0) {
    const span = redeliverySpanMs(js, s.nakBackoffMs);
    if (s.retentionMs < span) {
      problems.push(`retention (${s.retentionMs} ms) is shorter than the redelivery span (max_deliver x (ack_wait/backoff + nak delay) = ${span} ms)`);
    }
  } else {
    problems.push("max_deliver is unlimited: a message that always fails is retried forever and never parked in the dead-letter stream");
    if (js.maxAgeMs > 0 && s.retentionMs < js.maxAgeMs) {
      problems.push(`max_deliver is unlimited: retention (${s.retentionMs} ms) should cover the stream's max_age (${js.maxAgeMs} ms)`);
    }
  }
  if (js.maxAgeMs > 0 && js.maxAgeMs < s.retentionMs) {
    problems.push(`the stream's max_age (${js.maxAgeMs} ms) is shorter than the retention (${s.retentionMs} ms): a parked message may be gone before it is re-driven`);
  }
  if (s.leaseTtlMs < 1_000) problems.push("the service's shortest lease is 1 s");
  if (s.leaseTtlMs > js.ackWaitMs) {
    problems.push(`the lease (${s.leaseTtlMs} ms) is longer than ack_wait (${js.ackWaitMs} ms): a dead worker's redelivery finds the key in progress`);
  }
  return problems;
}
