package idempotency.client;

/**
 * What a Claim of a remembered key does (the proto's LateRetry): a key that
 * was completed, whose result's retention ended, and of which the server
 * keeps a compact marker (fingerprint, fencing token, when it completed)
 * until its horizon ({@code IDEMPOTENCY_REMEMBER_FOR} after its Complete, 7
 * days unless configured, or the namespace's {@code remember_for}). Unset
 * (null in {@link ClaimOptions#lateRetry} and {@link OnceOptions#lateRetry}):
 * the namespace's policy, else the server's (re-execute unless configured).
 */
public enum LateRetry {
  /**
   * Claim the key anew with the next fencing token (never 1 again):
   * {@link Outcome#CLAIMED} with {@link ClaimResult#completedAt()} set
   * ({@link ClaimResult#reexecuted()}), so the caller knows the effect ran before.
   */
  REEXECUTE,
  /**
   * Answer {@link Outcome#EXPIRED} (once(): {@link IdempotencyException.ResultExpired}),
   * changing nothing.
   */
  REFUSE;

  idempotency.v1.Idempotency.LateRetry toProto() {
    return this == REEXECUTE
        ? idempotency.v1.Idempotency.LateRetry.LATE_RETRY_REEXECUTE
        : idempotency.v1.Idempotency.LateRetry.LATE_RETRY_REFUSE;
  }
}
