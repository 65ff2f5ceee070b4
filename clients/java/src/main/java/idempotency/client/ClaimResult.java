package idempotency.client;

import java.time.Duration;
import java.time.Instant;

/**
 * What a Claim found. {@code outcome} says which fields are set: a lease
 * ({@code leaseToken}, {@code fencingToken}, {@code leaseExpiresAt}, and the
 * {@code checkpoint} an earlier holder saved) when CLAIMED;
 * {@code leaseExpiresAt} and {@code retryAfter} when IN_PROGRESS; the stored
 * {@code response} when COMPLETED. Unset times are null, an unset token is "",
 * an unset response is empty.
 *
 * @param checkpoint CLAIMED only: the last checkpoint an earlier holder of the
 *     key saved (with ExtendLease or Release), to resume from; null when there
 *     is none (an empty one saved is an empty array)
 * @param checkpointFencingToken the fencing token of the lease that saved
 *     {@code checkpoint}; 0 when there is none
 * @param retried CLAIMED only: this answer repeats the lease of an earlier
 *     attempt with the same lease token, whose answer was lost (a retry)
 * @param waited how long the Claim waited on the server for another holder,
 *     when it asked to wait ({@link ClaimOptions#waitFor}); null when it did
 *     not ask, or when the server predates waiting and ignored the request
 * @param completedAt when the key was completed before: set on EXPIRED, and
 *     on CLAIMED when the Claim re-executed a late retry of a remembered key
 *     (the effect ran once already, and its result is gone; see
 *     {@link #reexecuted()}); null otherwise
 */
public record ClaimResult(
    Outcome outcome,
    String leaseToken,
    long fencingToken,
    Instant leaseExpiresAt,
    byte[] response,
    Instant expiresAt,
    Duration retryAfter,
    byte[] checkpoint,
    long checkpointFencingToken,
    boolean retried,
    Duration waited,
    Instant completedAt) {

  /** True when this Claim won the lease (or, {@code retried}, got its own lease back). */
  public boolean claimed() {
    return outcome == Outcome.CLAIMED;
  }

  /**
   * True when this Claim won the lease of a key that was completed before (at
   * {@link #completedAt()}) and whose result has expired: a late retry, re-executed.
   */
  public boolean reexecuted() {
    return outcome == Outcome.CLAIMED && completedAt != null;
  }

  /** The fencing token as an unsigned number (the proto's uint64), for logs and downstream checks. */
  public String fencingTokenUnsigned() {
    return Long.toUnsignedString(fencingToken);
  }
}
