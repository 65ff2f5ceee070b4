package idempotency.client;

import java.time.Instant;

/**
 * What Get found: the state of a key's record and, when there is one, its
 * fencing token, fingerprint, stored response and times (null when unset).
 */
public record KeyRecord(
    State state,
    long fencingToken,
    byte[] fingerprint,
    byte[] response,
    Instant leaseExpiresAt,
    Instant expiresAt,
    Instant createdAt,
    Instant updatedAt) {}
