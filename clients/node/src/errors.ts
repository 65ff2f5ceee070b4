// The errors a caller can act on: one class per gRPC status the service uses,
// plus once()'s own outcomes (InProgress, FingerprintMismatch, LeaseLost,
// ResultExpired).
//
// Every error from a failed call carries what the server said about it in the
// standard google.rpc error details (details.ts): `reason`, the stable
// ErrorInfo reason ("LEASE_LOST", "KEY_EXPIRED", "STORE_UNAVAILABLE", ...),
// `domain`, `metadata`, `retryDelayMs` (RetryInfo: how long to wait before the
// same call can succeed) and `field` (the field an INVALID_ARGUMENT names).
// They are undefined (metadata empty) when the status carried no details: a
// call that never reached the service (the client's own deadline, a refused
// connection), a proxy's answer, or a server that predates them.
import { status, type ServiceError } from "@grpc/grpc-js";
import { DOMAIN, NO_DETAILS, detailsOf, type ErrorDetails } from "./details";

export interface ErrorOptions {
  code?: status;
  cause?: unknown;
  attempts?: number;
  details?: ErrorDetails;
}

/** Base class of every error thrown by this package. */
export class IdempotencyError extends Error {
  /** The gRPC status code behind the error, when a call failed. */
  readonly code: status | undefined;
  /** How many attempts the call made (retries included), when a call failed. */
  readonly attempts: number | undefined;
  /** The google.rpc details of the status (NO_DETAILS when it carried none). */
  readonly details: ErrorDetails;

  constructor(message: string, options?: ErrorOptions) {
    super(message, options?.cause === undefined ? undefined : { cause: options.cause });
    this.name = new.target.name;
    this.code = options?.code;
    this.attempts = options?.attempts;
    this.details = options?.details ?? NO_DETAILS;
  }

  /**
   * ErrorInfo's reason: "LEASE_LOST", "KEY_EXPIRED", "RATE_LIMITED", ... (the
   * proto's ErrorReason names without their prefix); undefined when the status
   * carried no details.
   */
  get reason(): string | undefined {
    return this.details.reason;
  }

  /** ErrorInfo's domain ("idempotency-service"); undefined without details. */
  get domain(): string | undefined {
    return this.details.domain;
  }

  /** ErrorInfo's metadata (empty when there is none). */
  get metadata(): Readonly<Record<string, string>> {
    return this.details.metadata;
  }

  /**
   * RetryInfo's delay in milliseconds: how long to wait before the same call
   * can succeed (UNAVAILABLE, RESOURCE_EXHAUSTED, ABORTED); undefined when the
   * server gave none (retrying the same call cannot help).
   */
  get retryDelayMs(): number | undefined {
    return this.details.retryDelayMs;
  }

  /** INVALID_ARGUMENT: the field the server refused, as the proto names it ("key", "items[3].lease_ttl"); undefined otherwise. */
  get field(): string | undefined {
    return this.details.fieldViolations[0]?.field ?? this.details.metadata.field;
  }
}

/** INVALID_ARGUMENT: a field is missing, too long or malformed; the message names the field. Nothing changed. */
export class InvalidArgument extends IdempotencyError {}

/**
 * NOT_FOUND: complete, release or extendLease on a key that does not exist or
 * whose record expired (reason NOT_FOUND), or that is remembered (KeyExpired,
 * reason KEY_EXPIRED).
 */
export class KeyNotFound extends IdempotencyError {}

function rfc3339(value: string | undefined): Date | undefined {
  if (!value) return undefined;
  const date = new Date(value);
  return Number.isNaN(date.getTime()) ? undefined : date;
}

/**
 * NOT_FOUND with reason KEY_EXPIRED: the key was completed, its result
 * expired, and the server still remembers it (until rememberedUntil). The
 * effect happened; there is nothing to complete, release or extend.
 */
export class KeyExpired extends KeyNotFound {
  /** When the key was completed (ErrorInfo's `completed_at`). */
  get completedAt(): Date | undefined {
    return rfc3339(this.metadata.completed_at);
  }

  /** Until when the server remembers the key (`remembered_until`). */
  get rememberedUntil(): Date | undefined {
    return rfc3339(this.metadata.remembered_until);
  }
}

/**
 * FAILED_PRECONDITION: the lease token is not the key's current one; `reason`
 * says which: LEASE_LOST (another claimant took the key), LEASE_RELEASED (this
 * lease was released), KEY_COMPLETED (the key is completed).
 */
export class LeaseNotCurrent extends IdempotencyError {}

/**
 * UNAVAILABLE or DEADLINE_EXCEEDED: the service or its store cannot be reached.
 * The client has already retried within the call's timeout (see `attempts`).
 */
export class Unavailable extends IdempotencyError {}

/** UNAUTHENTICATED: no credentials, a token the policy does not know, or a client certificate whose CN is not in it. */
export class Unauthenticated extends IdempotencyError {}

/** PERMISSION_DENIED: the policy does not grant the caller this RPC or namespace (for a batch: any item's). Nothing changed. */
export class PermissionDenied extends IdempotencyError {}

/**
 * RESOURCE_EXHAUSTED: over the caller's rate limit (reason RATE_LIMITED), or too
 * many calls in flight on the server (OVERLOADED); already retried within the
 * call's timeout, never sooner than retryDelayMs.
 */
export class ResourceExhausted extends IdempotencyError {}

/** once(): the key was already seen with another payload fingerprint. Nothing changed. */
export class FingerprintMismatch extends IdempotencyError {}

/** once(): another claimant holds the key's lease (and, when waiting, still held it at waitTimeoutMs). */
export class InProgress extends IdempotencyError {
  constructor(
    message: string,
    readonly retryAfterMs: number,
    readonly leaseExpiresAt: Date | null,
  ) {
    super(message);
  }
}

/**
 * once() with lateRetry "refuse": the key was completed before (completedAt),
 * its stored result has expired, and the server still remembers it
 * (OUTCOME_EXPIRED). The effect happened; the result is gone, so there is
 * nothing to replay. `fencingToken` is the last lease's. The work did not run.
 */
export class ResultExpired extends IdempotencyError {
  constructor(
    message: string,
    readonly completedAt: Date | null,
    readonly fencingToken: bigint,
  ) {
    super(message);
  }
}

/**
 * once(): the lease was lost while the work ran (the heartbeat's ExtendLease or
 * the final Complete answered FAILED_PRECONDITION or NOT_FOUND), so the result
 * was NOT stored: someone else may be doing the work. `cause` is the underlying error.
 */
export class LeaseLost extends IdempotencyError {}

const BY_CODE = new Map<status, new (message: string, options?: ErrorOptions) => IdempotencyError>([
  [status.INVALID_ARGUMENT, InvalidArgument],
  [status.NOT_FOUND, KeyNotFound],
  [status.FAILED_PRECONDITION, LeaseNotCurrent],
  [status.UNAVAILABLE, Unavailable],
  [status.DEADLINE_EXCEEDED, Unavailable],
  [status.UNAUTHENTICATED, Unauthenticated],
  [status.PERMISSION_DENIED, PermissionDenied],
  [status.RESOURCE_EXHAUSTED, ResourceExhausted],
]);

function classOf(code: number, reason: string | undefined) {
  if (code === status.NOT_FOUND && reason === "KEY_EXPIRED") return KeyExpired;
  return BY_CODE.get(code) ?? IdempotencyError;
}

/**
 * The typed error for one item of a batch that answers each item with its own
 * status (CompleteBatch, and either batch with itemErrors): the class the
 * single call would have thrown, with the item's reason and retry delay
 * (CompleteResult's or ItemError's reason and retry_after; no other details).
 */
export function fromItemStatus(
  code: number,
  message: string,
  method: string,
  index: number,
  reason = "",
  retryDelayMs?: number,
): IdempotencyError {
  const Class = classOf(code, reason || undefined);
  const name = status[code] ?? `status ${code}`;
  const details: ErrorDetails | undefined =
    reason || retryDelayMs !== undefined
      ? Object.freeze({ ...NO_DETAILS, reason: reason || undefined, domain: DOMAIN, retryDelayMs })
      : undefined;
  return new Class(`${method}: items[${index}]: ${name}: ${message || name}`, { code, details });
}

/** The typed error for a failed call, after `attempts` attempts, with its status's google.rpc details. */
export function fromServiceError(error: ServiceError, method: string, attempts = 1, details?: ErrorDetails): IdempotencyError {
  const decoded = details ?? detailsOf(error.metadata);
  const Class = classOf(error.code, decoded.reason);
  const name = status[error.code] ?? String(error.code);
  const tries = attempts > 1 ? ` (after ${attempts} attempts)` : "";
  return new Class(`${method}: ${name}: ${error.details || error.message}${tries}`, {
    code: error.code,
    cause: error,
    attempts,
    details: decoded,
  });
}
