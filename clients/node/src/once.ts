// Run a piece of work once per key: the lifecycle every caller would otherwise rewrite.
//
// Claim, then by outcome:
//   CLAIMED              run the work while a heartbeat extends the lease; on
//                        success Complete with the serialised result, when the
//                        work throws Release (so the next delivery retries,
//                        with the last checkpoint the work saved) and rethrow;
//                        if the lease was lost meanwhile, never Complete and
//                        throw LeaseLost. The work gets the checkpoint an
//                        earlier holder saved (lease.checkpoint) and saves its
//                        own with lease.saveCheckpoint(data).
//   COMPLETED            the replay: the stored result, deserialised; the work does not run.
//   FINGERPRINT_MISMATCH throw FingerprintMismatch.
//   EXPIRED              (only with lateRetry "refuse", the once()'s or the
//                        namespace's) the key completed before and its result
//                        expired: throw ResultExpired (completedAt,
//                        fencingToken); the work does not run. With
//                        "reexecute" (the server's default) such a late retry
//                        is CLAIMED instead: the work runs, and
//                        lease.completedBefore says when the key completed.
//   IN_PROGRESS          another holder has the key. onInProgress "wait" (the
//                        default): the Claim itself waits on the server
//                        (ClaimRequest.wait, up to waitTimeoutMs in all, each
//                        Claim within the call's timeout) and comes back with
//                        the holder's stored result (the replay) or the lease
//                        (it released, or its lease ran out: run the work);
//                        when waitTimeoutMs runs out, throw InProgress.
//                        Against a server that predates waiting
//                        (ClaimResponse.waited unset) it polls instead, and
//                        the client remembers that. "poll": Claim again with
//                        backoff (100 ms doubling, never past retryAfterMs nor
//                        waitTimeoutMs). "throw": throw InProgress at once.
import type { LeaseCalls } from "./calls";
import {
  FingerprintMismatch,
  IdempotencyError,
  InProgress,
  KeyNotFound,
  LeaseLost,
  LeaseNotCurrent,
  ResultExpired,
} from "./errors";
import { lateRetryValue, type ClaimResult, type Claimed, type InProgressClaim, type LateRetry } from "./types";
import { FIRST_POLL_MS, MIN_WAIT_MS, serverWaited } from "./waiting";

/** How once() turns the work's result into Complete's response bytes and back. */
export interface Serializer<T> {
  serialize(value: T): Uint8Array;
  deserialize(data: Buffer): T;
}

/** Compact UTF-8 JSON: what the Python client's once() stores too. `undefined` is stored as null. */
export const JSON_SERIALIZER: Serializer<any> = {
  serialize: (value) => Buffer.from(JSON.stringify(value === undefined ? null : value), "utf8"),
  deserialize: (data) => JSON.parse(data.toString("utf8")),
};

/** The result is already bytes (a rendered HTTP body, a protobuf message). */
export const BYTES_SERIALIZER: Serializer<Uint8Array> = {
  serialize: (value) => {
    if (!(value instanceof Uint8Array)) throw new TypeError("BYTES_SERIALIZER: the result must be bytes");
    return value;
  },
  deserialize: (data) => data,
};

export interface OnceOptions<T> {
  /** The payload's fingerprint (e.g. fingerprint(body)): a different one for the same key throws FingerprintMismatch. */
  fingerprint?: Uint8Array;
  /** The lease's length; the server's default (30 s) when omitted. */
  leaseTtlMs?: number;
  /** How long the result is kept and replayed; the server's default when omitted. */
  retentionMs?: number;
  /**
   * When another claimant holds the lease: "wait" for it on the server
   * (default; polls against a server that predates waiting), "poll" (Claim
   * again with backoff), or "throw" InProgress at once.
   */
  onInProgress?: "wait" | "poll" | "throw";
  /** How long to wait on another claimant before throwing InProgress (default 30 s). */
  waitTimeoutMs?: number;
  /** Default: JSON. */
  serializer?: Serializer<T>;
  /** Extend the lease while the work runs (default true). */
  heartbeat?: boolean;
  /** Default: a third of leaseTtlMs (of 30 s when that is omitted). */
  heartbeatIntervalMs?: number;
  /**
   * A late retry (the key completed before, its result expired, the server
   * still remembers it): "reexecute" runs the work again (lease.completedBefore
   * says when the key completed), "refuse" throws ResultExpired. Omitted: the
   * namespace's policy, else the server's (reexecute unless configured).
   */
  lateRetry?: LateRetry;
}

/** What the work receives when this attempt holds the lease. */
export interface Lease {
  leaseToken: string;
  /** Hand it to downstream writes so they can reject an older lease holder. */
  fencingToken: bigint;
  leaseExpiresAt: Date;
  /**
   * A late retry run again (the key completed before, its result expired, the
   * server remembered it and re-executes): when the key completed. null otherwise.
   */
  completedBefore: Date | null;
  /** Aborted (with a LeaseLost reason) when the heartbeat finds the lease gone: stop the work early. */
  signal: AbortSignal;
  /**
   * The last checkpoint: the one an earlier holder of the key saved (a worker
   * that died or failed midway), how far the work got, to resume from; after
   * saveCheckpoint(), the one this work saved. null when the work starts afresh.
   */
  checkpoint: Buffer | null;
  /**
   * The fencing token of the lease that saved `checkpoint` (lower than
   * fencingToken when an earlier holder saved it); null when there is none.
   */
  checkpointFencingToken: bigint | null;
  /**
   * Save how far the work got (bytes, or a string as UTF-8; at most the
   * server's limit, 64 KiB unless configured), replacing the checkpoint saved
   * before, and extend the lease: one ExtendLease. If this worker dies, the
   * next holder of the key gets it as `lease.checkpoint`. Rejects with
   * LeaseLost (and aborts `signal`) when the lease is gone; Complete discards it.
   */
  saveCheckpoint(data: Uint8Array | string): Promise<void>;
}

export interface OnceResult<T> {
  value: T;
  /** True when the work was done before and `value` is the stored result. */
  replayed: boolean;
  /** The Claim that won the lease, or the one that found the stored result. */
  claim: ClaimResult;
}

const DEFAULT_WAIT_TIMEOUT_MS = 30_000;
/** The server's default lease when the caller sets none; only used to pace the heartbeat. */
const SERVER_DEFAULT_LEASE_MS = 30_000;
/** First pause while polling another claimant; doubles on each attempt. */
const FIRST_WAIT_MS = FIRST_POLL_MS;

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

function leaseGone(error: unknown): error is LeaseNotCurrent | KeyNotFound {
  return error instanceof LeaseNotCurrent || error instanceof KeyNotFound;
}

/**
 * How long to wait before claiming again: exponential from 100 ms, so an early
 * Complete is seen soon, but never past the other lease's expiry (retryAfterMs)
 * nor past the caller's waitTimeoutMs.
 */
export function nextPause(attempt: number, claim: InProgressClaim, remainingMs: number): number {
  const pause = Math.min(FIRST_WAIT_MS * 2 ** attempt, Math.max(claim.retryAfterMs, 10));
  return Math.max(0, Math.min(pause, remainingMs));
}

export async function runOnce<T>(
  client: LeaseCalls,
  namespace: string,
  key: string,
  work: (lease: Lease) => T | Promise<T>,
  options: OnceOptions<T> = {},
): Promise<OnceResult<T>> {
  const serializer = options.serializer ?? (JSON_SERIALIZER as Serializer<T>);
  const onInProgress = options.onInProgress ?? "wait";
  lateRetryValue(options.lateRetry); // a TypeError now, not after the first Claim
  if (onInProgress !== "wait" && onInProgress !== "poll" && onInProgress !== "throw") {
    throw new TypeError('once(): onInProgress must be "wait", "poll" or "throw"');
  }
  const deadline = Date.now() + (options.waitTimeoutMs ?? DEFAULT_WAIT_TIMEOUT_MS);
  const where = `${namespace}/${key}`;
  // How long the next Claim asks the server to wait: what is left of
  // waitTimeoutMs (claim() keeps it within the call's timeout); undefined when
  // polling, or when the server is known to ignore it.
  const waitFor = (): number | undefined => {
    if (onInProgress !== "wait" || !client.waitSupport.worthAsking()) return undefined;
    const remaining = deadline - Date.now();
    return remaining >= MIN_WAIT_MS ? remaining : undefined;
  };

  for (let attempt = 0; ; ) {
    const claim = await client.claim(namespace, key, {
      fingerprint: options.fingerprint,
      leaseTtlMs: options.leaseTtlMs,
      retentionMs: options.retentionMs,
      waitMs: waitFor(),
      lateRetry: options.lateRetry,
    });
    switch (claim.outcome) {
      case "CLAIMED":
        return { value: await runClaimed(client, namespace, key, claim, work, serializer, options), replayed: false, claim };
      case "COMPLETED":
        return { value: serializer.deserialize(claim.response), replayed: true, claim };
      case "FINGERPRINT_MISMATCH":
        throw new FingerprintMismatch(`${where}: the key was seen with another payload fingerprint`);
      case "EXPIRED":
        throw new ResultExpired(
          `${where}: completed at ${claim.completedAt.toISOString()} and its result has expired` +
            " (a late retry, refused): the effect happened, there is nothing to replay",
          claim.completedAt,
          claim.fencingToken,
        );
      case "IN_PROGRESS": {
        const remaining = deadline - Date.now();
        if (onInProgress === "throw" || remaining <= 0) {
          const how = onInProgress === "throw" ? "in progress" : `still in progress after waiting ${options.waitTimeoutMs ?? DEFAULT_WAIT_TIMEOUT_MS} ms`;
          throw new InProgress(
            `${where}: ${how} (another claimant holds the lease; retry after ${claim.retryAfterMs} ms)`,
            claim.retryAfterMs,
            claim.leaseExpiresAt,
          );
        }
        // The server waited, and its wait ended with the call's timeout: wait again.
        if (serverWaited(claim)) continue;
        // It did not wait (it predates waiting, its waiter limit was reached,
        // or we poll): pause, then Claim again.
        await sleep(nextPause(attempt++, claim, remaining));
      }
    }
  }
}

async function runClaimed<T>(
  client: LeaseCalls,
  namespace: string,
  key: string,
  claim: Claimed,
  work: (lease: Lease) => T | Promise<T>,
  serializer: Serializer<T>,
  options: OnceOptions<T>,
): Promise<T> {
  const where = `${namespace}/${key}`;
  const heartbeat = new Heartbeat(client, namespace, key, claim.leaseToken, options);
  // The last checkpoint the work asked to save, for the Release if it fails.
  let lastCheckpoint: Buffer | undefined;
  let saving: Promise<void> = Promise.resolve();
  const saveCheckpoint = (data: Uint8Array | string): Promise<void> => {
    const bytes = typeof data === "string" ? Buffer.from(data, "utf8") : data;
    if (!(bytes instanceof Uint8Array)) {
      return Promise.reject(new TypeError("saveCheckpoint: the checkpoint must be bytes or a string"));
    }
    // One after the other, so that the last one saved is the last one asked for.
    const save = saving.catch(() => undefined).then(async () => {
      if (heartbeat.lost) {
        throw new LeaseLost(`${where}: the lease was lost; the checkpoint was not saved`, { cause: heartbeat.lost });
      }
      lastCheckpoint = Buffer.from(bytes);
      try {
        await client.extendLease(namespace, key, claim.leaseToken, { leaseTtlMs: options.leaseTtlMs, checkpoint: lastCheckpoint });
        lease.checkpoint = lastCheckpoint;
        lease.checkpointFencingToken = claim.fencingToken;
      } catch (error) {
        if (leaseGone(error)) {
          heartbeat.markLost(error);
          throw new LeaseLost(`${where}: the lease was lost; the checkpoint was not saved`, { cause: error });
        }
        throw error;
      }
    });
    saving = save;
    return save;
  };

  const lease: Lease = {
    leaseToken: claim.leaseToken,
    fencingToken: claim.fencingToken,
    leaseExpiresAt: claim.leaseExpiresAt,
    completedBefore: claim.completedAt,
    signal: heartbeat.signal,
    checkpoint: claim.checkpoint,
    checkpointFencingToken: claim.checkpointFencingToken,
    saveCheckpoint,
  };

  let value: T;
  let response: Uint8Array;
  try {
    value = await work(lease);
    await saving.catch(() => undefined);
    await heartbeat.stop();
    if (heartbeat.lost) {
      throw new LeaseLost(`${where}: the lease was lost while the work ran; the result was not stored`, {
        cause: heartbeat.lost,
      });
    }
    response = serializer.serialize(value);
  } catch (failure) {
    await saving.catch(() => undefined);
    await heartbeat.stop();
    if (!heartbeat.lost) {
      // Give the key back so the next delivery retries, with how far this
      // attempt got (a checkpoint whose ExtendLease failed is saved now);
      // never hide the failure.
      try {
        await client.release(namespace, key, claim.leaseToken, { checkpoint: lastCheckpoint });
      } catch (error) {
        client.logger.warn(`idempotency once(): Release after a failed attempt failed: ${(error as Error).message}`);
      }
    }
    throw failure;
  }

  try {
    await client.complete(namespace, key, claim.leaseToken, response, { retentionMs: options.retentionMs });
  } catch (error) {
    if (leaseGone(error)) {
      throw new LeaseLost(`${where}: the lease was lost before Complete; the result was not stored`, { cause: error });
    }
    throw error;
  }
  return value;
}

/** Extends the lease every interval until stopped, or until the server says it is gone. */
class Heartbeat {
  private readonly controller = new AbortController();
  private timer: NodeJS.Timeout | undefined;
  private inFlight: Promise<void> | undefined;
  private stopped = false;
  lost: IdempotencyError | undefined;

  constructor(
    private readonly client: LeaseCalls,
    private readonly namespace: string,
    private readonly key: string,
    private readonly leaseToken: string,
    private readonly options: OnceOptions<unknown>,
  ) {
    if (options.heartbeat === false) return;
    this.schedule(options.heartbeatIntervalMs ?? (options.leaseTtlMs ?? SERVER_DEFAULT_LEASE_MS) / 3);
  }

  get signal(): AbortSignal {
    return this.controller.signal;
  }

  private schedule(intervalMs: number): void {
    this.timer = setTimeout(() => {
      this.inFlight = this.beat(intervalMs).then(() => {
        if (!this.stopped && !this.lost) this.schedule(intervalMs);
      });
    }, intervalMs);
    this.timer.unref();
  }

  private async beat(intervalMs: number): Promise<void> {
    try {
      // Retries within about one interval (at least 1 s), not the client's
      // whole timeout: a beat that cannot get through in time is the next one's
      // job, and once() does not wait long for a beat in flight when the work ends.
      const timeoutMs = Math.min(this.client.timeoutMs, Math.max(intervalMs, 1000));
      await this.client.extendLease(this.namespace, this.key, this.leaseToken, { leaseTtlMs: this.options.leaseTtlMs, timeoutMs });
    } catch (error) {
      if (leaseGone(error)) {
        this.markLost(error);
      } else {
        // Transient: the lease may well still be ours, and the final Complete tells for sure.
        this.client.logger.warn(`idempotency heartbeat: ExtendLease failed: ${(error as Error).message}`);
      }
    }
  }

  markLost(error: LeaseNotCurrent | KeyNotFound): void {
    if (this.lost) return;
    this.lost = error;
    this.controller.abort(new LeaseLost(`${this.namespace}/${this.key}: the lease was lost`, { cause: error }));
  }

  async stop(): Promise<void> {
    this.stopped = true;
    clearTimeout(this.timer);
    await this.inFlight;
  }
}
