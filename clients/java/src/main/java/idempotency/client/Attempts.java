package idempotency.client;

import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import java.time.Duration;
import java.util.logging.Level;
import java.util.logging.Logger;

/**
 * The bookkeeping of one call's attempts under a {@link RetryPolicy}: how long
 * the next may take, and whether a failure is worth another (and after what
 * pause). One per call; not shared between threads.
 */
final class Attempts {
  private static final Logger LOG = Logger.getLogger(IdempotencyClient.class.getName());

  /** An attempt is not started with less time than this left before the deadline. */
  static final Duration MIN_ATTEMPT = Duration.ofMillis(50);

  private final RetryPolicy policy;
  private final long deadline;
  private final Duration extraPerAttempt;
  private int made;

  /**
   * @param timeout the call's overall deadline, from now
   * @param extraPerAttempt added to the policy's per-attempt timeout: the time
   *     a waiting Claim may spend waiting on the server (zero for other calls)
   */
  Attempts(RetryPolicy policy, Duration timeout, Duration extraPerAttempt) {
    this.policy = policy;
    this.deadline = System.nanoTime() + timeout.toNanos();
    this.extraPerAttempt = extraPerAttempt;
  }

  /** Attempts made so far. */
  int made() {
    return made;
  }

  /** The deadline of the next attempt, in nanoseconds from now (at least 1). */
  long attemptTimeoutNanos() {
    long remaining = Math.max(deadline - System.nanoTime(), 1);
    Duration perAttempt = policy.perAttemptTimeout();
    if (perAttempt == null) {
      return remaining;
    }
    return Math.min(remaining, perAttempt.plus(extraPerAttempt).toNanos());
  }

  /**
   * After a failed attempt: the pause before the next one, or null when the
   * failure is final (not retryable, no attempt left, or no time left). The
   * pause is the policy's backoff, or the status's RetryInfo delay when that
   * is longer (no retry when the deadline leaves no room for that delay). A
   * retry is logged at FINE on the client's logger.
   */
  Duration pauseAfter(StatusRuntimeException error, String rpc, String target) {
    made++;
    Status status = error.getStatus();
    if (!policy.retryable(status.getCode()) || made >= policy.maxAttempts()) {
      return null;
    }
    long pause = policy.backoff(made).toNanos();
    // The server's advice (google.rpc.RetryInfo) is the least pause: it knows
    // when the rate limit allows the next call, or the store may be back.
    Duration retryDelay = IdempotencyException.Details.of(error).retryDelay;
    long atLeast = retryDelay == null ? 0 : retryDelay.toNanos();
    pause = Math.max(pause, atLeast);
    // A pause that would leave too little time is cut short, so that the
    // last attempt still happens before the deadline; but never below the
    // server's delay: then the call fails now.
    long room = deadline - System.nanoTime() - MIN_ATTEMPT.toNanos();
    if (room <= 0 || atLeast > room) {
      return null;
    }
    Duration chosen = Duration.ofNanos(Math.min(pause, room));
    if (LOG.isLoggable(Level.FINE)) {
      LOG.fine(String.format("idempotency: %s attempt %d on %s failed (%s: %s); retrying in %.3f s",
          rpc, made, target, status.getCode(), status.getDescription(), chosen.toNanos() / 1e9));
    }
    return chosen;
  }
}
