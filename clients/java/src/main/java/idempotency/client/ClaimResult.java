package idempotency.client;

import java.time.Duration;
import java.time.Instant;

/**
 * What a Claim found. {@code outcome} says which fields are set: a lease
 * ({@code leaseToken}, {@code fencingToken}, {@code leaseExpiresAt}) when
 * CLAIMED; {@code leaseExpiresAt} and {@code retryAfter} when IN_PROGRESS; the
 * stored {@code response} when COMPLETED. Unset times are null, an unset
 * token is "", an unset response is empty.
 */
public record ClaimResult(
    Outcome outcome,
    String leaseToken,
    long fencingToken,
    Instant leaseExpiresAt,
    byte[] response,
    Instant expiresAt,
    Duration retryAfter) {

  /** True when this Claim won the lease. */
  public boolean claimed() {
    return outcome == Outcome.CLAIMED;
  }

  /** The fencing token as an unsigned number (the proto's uint64), for logs and downstream checks. */
  public String fencingTokenUnsigned() {
    return Long.toUnsignedString(fencingToken);
  }
}
