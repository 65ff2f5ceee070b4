// The errors a caller can act on: one class per gRPC status the service uses,
// plus once()'s own outcomes (InProgress, FingerprintMismatch, LeaseLost).
import { status, type ServiceError } from "@grpc/grpc-js";

/** Base class of every error thrown by this package. */
export class IdempotencyError extends Error {
  /** The gRPC status code behind the error, when a call failed. */
  readonly code: status | undefined;
  /** How many attempts the call made (retries included), when a call failed. */
  readonly attempts: number | undefined;

  constructor(message: string, options?: { code?: status; cause?: unknown; attempts?: number }) {
    super(message, options?.cause === undefined ? undefined : { cause: options.cause });
    this.name = new.target.name;
    this.code = options?.code;
    this.attempts = options?.attempts;
  }
}

/** INVALID_ARGUMENT: a field is missing, too long or malformed; the message names the field. Nothing changed. */
export class InvalidArgument extends IdempotencyError {}

/** NOT_FOUND: complete, release or extendLease on a key that does not exist or whose record expired. */
export class KeyNotFound extends IdempotencyError {}

/** FAILED_PRECONDITION: the lease token is not the key's current one (lost, released, or the key completed). */
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

/** RESOURCE_EXHAUSTED: over the caller's rate limit, or too many calls in flight on the server; already retried within the call's timeout. */
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
 * once(): the lease was lost while the work ran (the heartbeat's ExtendLease or
 * the final Complete answered FAILED_PRECONDITION or NOT_FOUND), so the result
 * was NOT stored: someone else may be doing the work. `cause` is the underlying error.
 */
export class LeaseLost extends IdempotencyError {}

const BY_CODE = new Map<status, new (message: string, options?: { code?: status; cause?: unknown; attempts?: number }) => IdempotencyError>([
  [status.INVALID_ARGUMENT, InvalidArgument],
  [status.NOT_FOUND, KeyNotFound],
  [status.FAILED_PRECONDITION, LeaseNotCurrent],
  [status.UNAVAILABLE, Unavailable],
  [status.DEADLINE_EXCEEDED, Unavailable],
  [status.UNAUTHENTICATED, Unauthenticated],
  [status.PERMISSION_DENIED, PermissionDenied],
  [status.RESOURCE_EXHAUSTED, ResourceExhausted],
]);

/**
 * The typed error for one item of a batch that answers each item with its own
 * status (CompleteBatch): the class the single call would have thrown.
 */
export function fromItemStatus(code: number, message: string, method: string, index: number): IdempotencyError {
  const Class = BY_CODE.get(code) ?? IdempotencyError;
  const name = status[code] ?? `status ${code}`;
  return new Class(`${method}: items[${index}]: ${name}: ${message || name}`, { code });
}

/** The typed error for a failed call, after `attempts` attempts. */
export function fromServiceError(error: ServiceError, method: string, attempts = 1): IdempotencyError {
  const Class = BY_CODE.get(error.code) ?? IdempotencyError;
  const name = status[error.code] ?? String(error.code);
  const tries = attempts > 1 ? ` (after ${attempts} attempts)` : "";
  return new Class(`${method}: ${name}: ${error.details || error.message}${tries}`, { code: error.code, cause: error, attempts });
}
