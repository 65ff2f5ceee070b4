package idempotency.client;

/** What a Claim found (the proto's Outcome). Losing a race is an outcome, never an error. */
public enum Outcome {
  /** The caller now holds the lease: do the work, then Complete or Release. */
  CLAIMED,
  /** Another claimant holds a live lease; see {@link ClaimResult#retryAfter()}. */
  IN_PROGRESS,
  /** The work was done already: {@link ClaimResult#response()} is the stored result (the replay). */
  COMPLETED,
  /** The key's record carries another payload fingerprint. Nothing changed. */
  FINGERPRINT_MISMATCH,
  /**
   * A late retry refused ({@link LateRetry#REFUSE}): the key was completed at
   * {@link ClaimResult#completedAt()}, its result has expired, and the server
   * still remembers it. The effect happened; the result is gone; nothing
   * changed. {@link ClaimResult#fencingToken()} is the last lease's.
   */
  EXPIRED,
  /** An outcome this client does not know (a newer server). */
  UNKNOWN;

  static Outcome of(idempotency.v1.Idempotency.Outcome outcome) {
    switch (outcome) {
      case OUTCOME_CLAIMED:
        return CLAIMED;
      case OUTCOME_IN_PROGRESS:
        return IN_PROGRESS;
      case OUTCOME_COMPLETED:
        return COMPLETED;
      case OUTCOME_FINGERPRINT_MISMATCH:
        return FINGERPRINT_MISMATCH;
      case OUTCOME_EXPIRED:
        return EXPIRED;
      default:
        return UNKNOWN;
    }
  }
}
