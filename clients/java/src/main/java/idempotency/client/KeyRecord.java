package idempotency.client;

import java.time.Instant;

/**
 * What Get found: the state of a key's record and, when there is one, its
 * fencing token, fingerprint, stored response and times (null when unset).
 *
 * @param checkpoint IN_PROGRESS and RELEASED only: the last checkpoint saved
 *     (with ExtendLease or Release); null when there is none
 * @param checkpointFencingToken the fencing token of the lease that saved it; 0 when there is none
 */
public record KeyRecord(
    State state,
    long fencingToken,
    byte[] fingerprint,
    byte[] response,
    Instant leaseExpiresAt,
    Instant expiresAt,
    Instant createdAt,
    Instant updatedAt,
    byte[] checkpoint,
    long checkpointFencingToken) {}
