package idempotency.client;

import java.time.Instant;

/**
 * What Get found: the state of a key's record and, when there is one, its
 * fencing token, fingerprint, stored response and times (null when unset).
 * A remembered key (completed, its result expired, its marker kept) is ABSENT
 * with {@link #remembered()} true: its fencing token, fingerprint,
 * {@code expiresAt} (when the result expired), {@code createdAt},
 * {@code completedAt} and {@code rememberedUntil} describe the marker.
 *
 * @param checkpoint IN_PROGRESS and RELEASED only: the last checkpoint saved
 *     (with ExtendLease or Release); null when there is none
 * @param checkpointFencingToken the fencing token of the lease that saved it; 0 when there is none
 * @param completedAt COMPLETED, or a remembered key: when it was completed
 * @param rememberedUntil COMPLETED: until when the key will be remembered once
 *     its result expires (null when nothing is remembered past the
 *     retention); ABSENT: set only for a remembered key
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
    long checkpointFencingToken,
    Instant completedAt,
    Instant rememberedUntil) {

  /** True for a remembered key: a Claim of it before {@link #rememberedUntil()} follows its late-retry policy. */
  public boolean remembered() {
    return state == State.ABSENT && rememberedUntil != null;
  }
}
