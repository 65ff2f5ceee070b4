// What a call takes, and the part of the client that once() uses.
//
// The options of each RPC (and the retry options inside them) and LeaseCalls,
// the calls once() makes, live here so that once.ts depends on this module and
// not on client.ts: client.ts uses once.ts (client.once() runs runOnce), and
// the dependency goes that one way.
import type { ClaimResult, CompleteResult, ExtendLeaseResult, LateRetry } from "./types";
import type { ServerWaits } from "./waiting";

/**
 * How a call is retried after UNAVAILABLE, RESOURCE_EXHAUSTED or
 * DEADLINE_EXCEEDED: up to maxAttempts attempts, all within the call's
 * timeout; before attempt n+1 a pause drawn uniformly from
 * [0, min(maxBackoffMs, initialBackoffMs * multiplier^(n-1))] (full jitter).
 */
export interface RetryOptions {
  /** Attempts in all, the first included (default 10); 1 turns retries off. */
  maxAttempts?: number;
  /** The cap of the first pause, in milliseconds (default 50). */
  initialBackoffMs?: number;
  /** No pause is longer than this (default 2000). */
  maxBackoffMs?: number;
  /** Each pause's cap is the previous one's times this (default 2). */
  multiplier?: number;
  /**
   * Each attempt's own deadline, in milliseconds; default: none, an attempt
   * may use all the time left of the call's timeout. Shorter, an attempt that
   * hangs (DEADLINE_EXCEEDED) leaves time for another, on another replica.
   */
  perAttemptTimeoutMs?: number;
}

export interface Logger {
  warn(message: string): void;
}

export interface CallOptions {
  /** This call's deadline (all its attempts), in milliseconds; default: the client's timeoutMs. */
  timeoutMs?: number;
  /** This call's retry policy, over the client's; `false`: try once. */
  retry?: RetryOptions | false;
}

export interface ClaimOptions extends CallOptions {
  /** The payload's fingerprint (e.g. fingerprint(body)); empty or omitted: don't check. */
  fingerprint?: Uint8Array;
  /** The lease's length if this Claim wins; the server's default when omitted. */
  leaseTtlMs?: number;
  /** How long a completed result is kept and replayed; the server's default when omitted. */
  retentionMs?: number;
  /**
   * The lease token this Claim asks for (32 lowercase hex characters, from a
   * CSPRNG, new for every logical Claim). Default: a new one per claim() call,
   * sent with each of its attempts, so that a retry after a lost answer gets the
   * same lease back (`retried: true`).
   */
  leaseToken?: string;
  /**
   * When another holder has a live lease, wait for it on the server (up to
   * this many milliseconds) instead of answering IN_PROGRESS at once:
   * COMPLETED with its result when it completes, CLAIMED when it releases or
   * its lease runs out and this Claim takes the key, IN_PROGRESS when the wait
   * runs out. The wait ends before the call's timeout (with time left for the
   * answer), and perAttemptTimeoutMs does not cut it short. The result's
   * `waitedMs` says how long the server waited; null when the server predates
   * waiting (it ignored the request). Omitted or 0: no waiting.
   */
  waitMs?: number;
  /**
   * What to do when the key is remembered (completed, its result expired):
   * "reexecute" claims it anew (CLAIMED with `completedAt` set, the next
   * fencing token), "refuse" answers EXPIRED. Omitted: the namespace's policy,
   * else the server's (reexecute unless configured).
   */
  lateRetry?: LateRetry;
}

export interface ReleaseOptions extends CallOptions {
  /** A checkpoint to save with the release, for the next holder; omitted: the one saved before stays. */
  checkpoint?: Uint8Array | string;
}

export interface CompleteOptions extends CallOptions {
  retentionMs?: number;
}

export interface ExtendLeaseOptions extends CallOptions {
  leaseTtlMs?: number;
  /**
   * A checkpoint to save under the lease (how far the work got), replacing the
   * one saved before; a Claim that takes the key over receives it. Omitted: the
   * one saved before stays. At most the server's limit (64 KiB unless configured).
   */
  checkpoint?: Uint8Array | string;
}

/** The options of claimBatch() and completeBatch(). */
export interface BatchOptions extends CallOptions {
  /**
   * Ask for each item's own error (ClaimBatchRequest and
   * CompleteBatchRequest.item_errors): when some items' keys cannot be reached
   * and the others can (on Citus, the worker holding them is down), those
   * items are answered with their error (claimBatch: a FailedClaim, `ok:
   * false`, outcome UNSPECIFIED; completeBatch: `ok: false` with Unavailable)
   * and every other item is answered. The call still rejects when every item
   * failed, or for its own reasons (an invalid item, permission, the
   * deadline). Default false: any such failure rejects the whole call, as
   * with servers that predate the field (they ignore it). On one PostgreSQL
   * and on SQLite every key is reached or none is, so it changes nothing there.
   */
  itemErrors?: boolean;
}

export interface PurgeOptions extends CallOptions {
  /** Why, for the server's log (an incident or ticket reference); at most 256 bytes. */
  reason?: string;
}

/**
 * The calls once() makes on a client, as IdempotencyClient has them (it
 * implements this interface, so the compiler checks that they stay alike).
 */
export interface LeaseCalls {
  readonly timeoutMs: number;
  readonly logger: Logger;
  /** What Claims that asked to wait have shown of the servers: once() polls while they ignore `wait`. */
  readonly waitSupport: ServerWaits;
  claim(namespace: string, key: string, options?: ClaimOptions): Promise<ClaimResult>;
  complete(
    namespace: string,
    key: string,
    leaseToken: string,
    response?: Uint8Array | string,
    options?: CompleteOptions,
  ): Promise<CompleteResult>;
  release(namespace: string, key: string, leaseToken: string, options?: ReleaseOptions): Promise<void>;
  extendLease(namespace: string, key: string, leaseToken: string, options?: ExtendLeaseOptions): Promise<ExtendLeaseResult>;
}
