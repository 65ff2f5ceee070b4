// Typed results of the RPCs, the items of the batch calls, and their conversion from the wire.
import type { ClaimResponse__Output } from "./generated/idempotency/v1/ClaimResponse";
import type { ItemError__Output } from "./generated/idempotency/v1/ItemError";
import type { CompleteResult__Output } from "./generated/idempotency/v1/CompleteResult";
import type { PurgeResponse__Output } from "./generated/idempotency/v1/PurgeResponse";
import type { GetResponse__Output } from "./generated/idempotency/v1/GetResponse";
import type { Duration } from "./generated/google/protobuf/Duration";
import type { Timestamp__Output } from "./generated/google/protobuf/Timestamp";
import type { Duration__Output } from "./generated/google/protobuf/Duration";
import type { LateRetry as WireLateRetry } from "./generated/idempotency/v1/LateRetry";
import { IdempotencyError, fromItemStatus } from "./errors";

/** What a Claim found (proto enum idempotency.v1.Outcome, without its prefix). */
export const Outcome = {
  /** You hold the lease: do the work, then complete() or release(). */
  CLAIMED: "CLAIMED",
  /** Another claimant holds a live lease: try again after retryAfterMs. */
  IN_PROGRESS: "IN_PROGRESS",
  /** The work was done already: response is the stored result (the replay). */
  COMPLETED: "COMPLETED",
  /** The key was seen with another payload fingerprint; nothing changed. */
  FINGERPRINT_MISMATCH: "FINGERPRINT_MISMATCH",
  /**
   * Only for a Claim whose late-retry policy is "refuse": the key was completed
   * (completedAt), its result expired, and the server still remembers it. The
   * effect happened; the result is gone. Nothing changed.
   */
  EXPIRED: "EXPIRED",
  /**
   * Only on an item of claimBatch(items, { itemErrors: true }) whose Claim
   * failed while the others were answered: see FailedClaim. claim() never
   * answers it.
   */
  UNSPECIFIED: "UNSPECIFIED",
} as const;
export type Outcome = (typeof Outcome)[keyof typeof Outcome];

/**
 * What a Claim of a remembered key does (proto enum idempotency.v1.LateRetry):
 * a key is remembered once its completed result's retention is over, until its
 * horizon (IDEMPOTENCY_REMEMBER_FOR after its Complete, 7 days unless
 * configured, or the namespace's `remember_for`).
 */
export const LateRetry = {
  /** Claim the key anew with the next fencing token: CLAIMED with completedAt set. */
  REEXECUTE: "reexecute",
  /** Answer EXPIRED, changing nothing. */
  REFUSE: "refuse",
} as const;
export type LateRetry = (typeof LateRetry)[keyof typeof LateRetry];

/** The wire value of a lateRetry option (undefined: unset, the namespace's or the server's policy). */
export function lateRetryValue(value: LateRetry | undefined): WireLateRetry {
  switch (value) {
    case undefined:
      return "LATE_RETRY_UNSPECIFIED";
    case "reexecute":
      return "LATE_RETRY_REEXECUTE";
    case "refuse":
      return "LATE_RETRY_REFUSE";
    default:
      throw new TypeError(`lateRetry must be "reexecute" or "refuse", got ${String(value)}`);
  }
}

/** The state of a key's record as get() reports it (proto enum idempotency.v1.State). */
export const State = {
  ABSENT: "ABSENT",
  IN_PROGRESS: "IN_PROGRESS",
  COMPLETED: "COMPLETED",
  RELEASED: "RELEASED",
} as const;
export type State = (typeof State)[keyof typeof State];

/** You hold the lease. */
export interface Claimed {
  outcome: "CLAIMED";
  /** Always true: the Claim was answered (false only on a FailedClaim of claimBatch with itemErrors). */
  ok: true;
  /** The lease's secret (32 lowercase hex characters): pass it to complete, release and extendLease. */
  leaseToken: string;
  /** One more than the key's previous Claim; hand it to downstream writes so they can reject an older holder. */
  fencingToken: bigint;
  leaseExpiresAt: Date;
  /** When the record expires if nobody completes it. */
  expiresAt: Date | null;
  /**
   * The last checkpoint an earlier holder saved on the key (extendLease or
   * release with `checkpoint`): resume the work from it. null when none was
   * saved since the key was last absent or completed.
   */
  checkpoint: Buffer | null;
  /** The fencing token of the lease that saved the checkpoint; null when there is none. */
  checkpointFencingToken: bigint | null;
  /** True when this repeats the lease an earlier attempt with the same lease token won (a retried Claim whose answer was lost). */
  retried: boolean;
  /** See ClaimWaited. */
  waitedMs: number | null;
  /**
   * Set when this Claim took over a remembered key (a late retry, re-executed):
   * when the key was completed before. The effect ran once already and its
   * result is gone; fencingToken continues from the earlier leases'. null otherwise.
   */
  completedAt: Date | null;
}

/** Another claimant holds a live lease. */
export interface InProgressClaim {
  outcome: "IN_PROGRESS";
  /** Always true: the Claim was answered (false only on a FailedClaim of claimBatch with itemErrors). */
  ok: true;
  /** When the other claimant's lease runs out. */
  leaseExpiresAt: Date | null;
  /** The time left on the other claimant's lease. */
  retryAfterMs: number;
  expiresAt: Date | null;
  /** See ClaimWaited. */
  waitedMs: number | null;
}

/** The work was done already: the replay. */
export interface CompletedClaim {
  outcome: "COMPLETED";
  /** Always true: the Claim was answered (false only on a FailedClaim of claimBatch with itemErrors). */
  ok: true;
  /** The stored response (possibly empty). */
  response: Buffer;
  /** When the stored result expires. */
  expiresAt: Date | null;
  /** See ClaimWaited. */
  waitedMs: number | null;
}

/** The key was seen with another payload fingerprint. */
export interface FingerprintMismatchClaim {
  outcome: "FINGERPRINT_MISMATCH";
  /** Always true: the Claim was answered (false only on a FailedClaim of claimBatch with itemErrors). */
  ok: true;
  /** See ClaimWaited. */
  waitedMs: number | null;
}

/** A late retry refused (lateRetry "refuse"): the key completed before and its result expired. */
export interface ExpiredClaim {
  outcome: "EXPIRED";
  /** Always true: the Claim was answered (false only on a FailedClaim of claimBatch with itemErrors). */
  ok: true;
  /** When the key was completed. */
  completedAt: Date;
  /** The last lease's fencing token (the one that completed the key). */
  fencingToken: bigint;
  /** When the stored result expired. */
  expiresAt: Date | null;
  /** See ClaimWaited. */
  waitedMs: number | null;
}

/**
 * `waitedMs`, on every ClaimResult: for a Claim that asked to wait
 * (claim(ns, key, { waitMs })), how long the server made it wait for another
 * holder, in milliseconds (0: nothing to wait for, or the server's waiter
 * limit was reached). null when the Claim did not ask, or when the server
 * predates waiting and ignored the request.
 */
export type ClaimWaited = ClaimResult["waitedMs"];

/** What claim() returns: switch on `outcome` and TypeScript knows which fields are there. */
export type ClaimResult = Claimed | InProgressClaim | CompletedClaim | FingerprintMismatchClaim | ExpiredClaim;

/**
 * Only from claimBatch(items, { itemErrors: true }): an item whose Claim failed
 * while the others were answered (on Citus, the worker holding its key is
 * down). Nothing else is known of the key.
 */
export interface FailedClaim {
  outcome: "UNSPECIFIED";
  ok: false;
  /**
   * The error the item's own claim() would have rejected with: Unavailable
   * (code 14, reason STORE_UNAVAILABLE) with its retryDelayMs when the key
   * could not be reached, or an IdempotencyError with code 10 (ABORTED) when
   * it kept changing. Retrying the item is safe, with leaseToken.
   */
  error: IdempotencyError;
  /**
   * The lease token the item was sent with (its own, or the one the client
   * made for it): retry the item with it (`{ ...item, leaseToken }`), so that
   * a lease an attempt of this call may have taken after all is answered as
   * yours (`retried: true`), not as another holder's IN_PROGRESS.
   */
  leaseToken: string;
}

/**
 * One item's answer in claimBatch(items, { itemErrors: true }): a ClaimResult
 * (`ok: true`), or a FailedClaim (`ok: false`, outcome UNSPECIFIED).
 */
export type ClaimBatchResult = ClaimResult | FailedClaim;

export interface CompleteResult {
  /** Until then every Claim of the key replays the stored response. */
  expiresAt: Date;
}

/** One Claim of a claimBatch(): the arguments claim() takes. */
export interface ClaimItem {
  namespace: string;
  key: string;
  /** Default: a new one per item (see ClaimOptions.leaseToken). */
  leaseToken?: string;
  fingerprint?: Uint8Array;
  leaseTtlMs?: number;
  retentionMs?: number;
  /** See ClaimOptions.lateRetry. */
  lateRetry?: LateRetry;
}

/** One Complete of a completeBatch(): the arguments complete() takes. */
export interface CompleteItem {
  namespace: string;
  key: string;
  leaseToken: string;
  response?: Uint8Array | string;
  retentionMs?: number;
}

/**
 * One item's answer in completeBatch(): what its own complete() would have
 * resolved to (`ok: true`, expiresAt) or rejected with (`ok: false`, error:
 * KeyNotFound, LeaseNotCurrent, ...; with itemErrors also Unavailable, code 14,
 * or code 10 ABORTED, with the item's retryDelayMs: retrying the item is safe).
 */
export type CompleteItemResult = { ok: true; expiresAt: Date } | { ok: false; error: IdempotencyError };

export interface PurgeResult {
  /** True when an unexpired record was purged; false when there was none. */
  purged: boolean;
  /** The state the purged record had; ABSENT when there was none. */
  previousState: State;
}

export interface ExtendLeaseResult {
  leaseExpiresAt: Date;
}

/**
 * A key's record as get() reports it; ABSENT leaves every other field null,
 * unless the key is remembered (rememberedUntil is set): then fencingToken,
 * fingerprint, expiresAt (when its result expired), createdAt and completedAt
 * describe it.
 */
export interface KeyRecord {
  state: State;
  fencingToken: bigint | null;
  fingerprint: Buffer | null;
  /** COMPLETED only. */
  response: Buffer | null;
  /** IN_PROGRESS only; may be in the past (the next Claim takes the lease). */
  leaseExpiresAt: Date | null;
  expiresAt: Date | null;
  createdAt: Date | null;
  updatedAt: Date | null;
  /** IN_PROGRESS and RELEASED only: the last checkpoint saved on the key; null when none. */
  checkpoint: Buffer | null;
  /** The fencing token of the lease that saved the checkpoint; null when there is none. */
  checkpointFencingToken: bigint | null;
  /** COMPLETED, and a remembered key: when it was completed. */
  completedAt: Date | null;
  /**
   * COMPLETED: until when the key will be remembered once its result expires
   * (null when the server remembers nothing past the retention). ABSENT: set
   * only for a remembered key; a Claim before then follows its late-retry policy.
   */
  rememberedUntil: Date | null;
}

export function toDuration(ms: number | undefined, field: string): Duration | null {
  if (ms === undefined) return null;
  if (typeof ms !== "number" || !Number.isFinite(ms)) {
    throw new TypeError(`${field}: expected milliseconds, got ${ms}`);
  }
  const sign = ms < 0 ? -1 : 1;
  const abs = Math.abs(ms);
  const seconds = Math.floor(abs / 1000);
  const nanos = Math.round((abs - seconds * 1000) * 1e6);
  return { seconds: sign * seconds, nanos: sign * nanos };
}

export function toDate(timestamp: Timestamp__Output | null | undefined): Date | null {
  if (!timestamp) return null;
  return new Date(Number(timestamp.seconds) * 1000 + Math.floor(timestamp.nanos / 1e6));
}

function toMs(duration: Duration__Output | null | undefined): number | null {
  if (!duration) return null;
  return Number(duration.seconds) * 1000 + duration.nanos / 1e6;
}

/** A checkpoint and its fencing token from the wire: fencing token 0 means none. */
function checkpointOf(data: Buffer | undefined, fencingToken: string | undefined): { checkpoint: Buffer | null; checkpointFencingToken: bigint | null } {
  const token = BigInt(fencingToken || "0");
  if (token === 0n) return { checkpoint: null, checkpointFencingToken: null };
  return { checkpoint: Buffer.from(data ?? Buffer.alloc(0)), checkpointFencingToken: token };
}

function required<T>(value: T | null, what: string): T {
  if (value === null) throw new IdempotencyError(`the server's answer lacks ${what}`);
  return value;
}

export function claimResult(message: ClaimResponse__Output): ClaimResult {
  const waitedMs = toMs(message.waited);
  switch (message.outcome) {
    case "OUTCOME_CLAIMED":
      return {
        outcome: "CLAIMED",
        ok: true,
        leaseToken: message.leaseToken,
        fencingToken: BigInt(message.fencingToken),
        leaseExpiresAt: required(toDate(message.leaseExpiresAt), "lease_expires_at"),
        expiresAt: toDate(message.expiresAt),
        ...checkpointOf(message.checkpoint, message.checkpointFencingToken),
        retried: message.retried === true,
        waitedMs,
        completedAt: toDate(message.completedAt),
      };
    case "OUTCOME_IN_PROGRESS":
      return {
        outcome: "IN_PROGRESS",
        ok: true,
        leaseExpiresAt: toDate(message.leaseExpiresAt),
        retryAfterMs: toMs(message.retryAfter) ?? 0,
        expiresAt: toDate(message.expiresAt),
        waitedMs,
      };
    case "OUTCOME_COMPLETED":
      return { outcome: "COMPLETED", ok: true, response: Buffer.from(message.response), expiresAt: toDate(message.expiresAt), waitedMs };
    case "OUTCOME_FINGERPRINT_MISMATCH":
      return { outcome: "FINGERPRINT_MISMATCH", ok: true, waitedMs };
    case "OUTCOME_EXPIRED":
      return {
        outcome: "EXPIRED",
        ok: true,
        completedAt: required(toDate(message.completedAt), "completed_at"),
        fencingToken: BigInt(message.fencingToken),
        expiresAt: toDate(message.expiresAt),
        waitedMs,
      };
    default:
      throw new IdempotencyError(`Claim: unexpected outcome ${message.outcome}`);
  }
}

/**
 * One item of a ClaimBatch's answer: its ClaimResult, or, for an item whose
 * Claim failed (ClaimResponse.error, sent only when the request asked for
 * item_errors), a FailedClaim with the error its own claim() would have
 * rejected with. `leaseToken`: the token the item was sent with.
 */
export function claimBatchResult(message: ClaimResponse__Output, index: number, leaseToken: string): ClaimBatchResult {
  if (message.error) return { outcome: "UNSPECIFIED", ok: false, error: itemError(message.error, "ClaimBatch", index), leaseToken };
  return claimResult(message);
}

function itemError(error: ItemError__Output, method: string, index: number): IdempotencyError {
  return fromItemStatus(error.code, error.message, method, index, error.reason, toMs(error.retryAfter) ?? undefined);
}

export function completeItemResult(message: CompleteResult__Output, index: number): CompleteItemResult {
  if (message.code === 0) {
    return { ok: true, expiresAt: required(toDate(message.expiresAt), `items[${index}].expires_at`) };
  }
  const retryDelayMs = toMs(message.retryAfter) ?? undefined;
  return { ok: false, error: fromItemStatus(message.code, message.message, "CompleteBatch", index, message.reason, retryDelayMs) };
}

export function purgeResult(message: PurgeResponse__Output): PurgeResult {
  const previousState = message.previousState.replace(/^STATE_/, "") as State | "UNSPECIFIED";
  if (previousState === "UNSPECIFIED") throw new IdempotencyError("Purge: unexpected state STATE_UNSPECIFIED");
  return { purged: message.purged, previousState };
}

export function keyRecord(message: GetResponse__Output): KeyRecord {
  const state = message.state.replace(/^STATE_/, "") as State | "UNSPECIFIED";
  if (state === "UNSPECIFIED") throw new IdempotencyError("Get: unexpected state STATE_UNSPECIFIED");
  if (state === "ABSENT") {
    const rememberedUntil = toDate(message.rememberedUntil);
    if (rememberedUntil === null) {
      return {
        state, fencingToken: null, fingerprint: null, response: null,
        leaseExpiresAt: null, expiresAt: null, createdAt: null, updatedAt: null,
        checkpoint: null, checkpointFencingToken: null, completedAt: null, rememberedUntil: null,
      };
    }
    return {
      state,
      fencingToken: BigInt(message.fencingToken),
      fingerprint: Buffer.from(message.fingerprint),
      response: null,
      leaseExpiresAt: null,
      expiresAt: toDate(message.expiresAt),
      createdAt: toDate(message.createdAt),
      updatedAt: toDate(message.updatedAt),
      checkpoint: null,
      checkpointFencingToken: null,
      completedAt: toDate(message.completedAt),
      rememberedUntil,
    };
  }
  return {
    state,
    fencingToken: BigInt(message.fencingToken),
    fingerprint: Buffer.from(message.fingerprint),
    response: state === "COMPLETED" ? Buffer.from(message.response) : null,
    leaseExpiresAt: toDate(message.leaseExpiresAt),
    expiresAt: toDate(message.expiresAt),
    createdAt: toDate(message.createdAt),
    updatedAt: toDate(message.updatedAt),
    ...(state === "COMPLETED"
      ? { checkpoint: null, checkpointFencingToken: null }
      : checkpointOf(message.checkpoint, message.checkpointFencingToken)),
    completedAt: toDate(message.completedAt),
    rememberedUntil: toDate(message.rememberedUntil),
  };
}
