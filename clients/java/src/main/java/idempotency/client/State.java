package idempotency.client;

/** The state of a key's record, as Get reports it (the proto's State). */
public enum State {
  /** No record, or an expired one. */
  ABSENT,
  /** Claimed and not yet completed or released (the lease may have run out). */
  IN_PROGRESS,
  /** Completed: the stored response is replayed to every Claim until it expires. */
  COMPLETED,
  /** Released after a failed attempt: the next Claim takes it. */
  RELEASED,
  /** A state this client does not know (a newer server). */
  UNKNOWN;

  static State of(idempotency.v1.Idempotency.State state) {
    switch (state) {
      case STATE_ABSENT:
        return ABSENT;
      case STATE_IN_PROGRESS:
        return IN_PROGRESS;
      case STATE_COMPLETED:
        return COMPLETED;
      case STATE_RELEASED:
        return RELEASED;
      default:
        return UNKNOWN;
    }
  }
}
