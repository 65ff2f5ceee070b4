package idempotency.client;

import io.grpc.Status;
import java.time.Duration;
import java.util.EnumSet;
import java.util.Objects;
import java.util.Set;
import java.util.concurrent.ThreadLocalRandom;

/**
 * How a client retries a failed call ({@code IdempotencyClient.builder(t).retry(policy)}).
 * Immutable; each method with an argument returns a changed copy:
 * {@code RetryPolicy.defaults().maxAttempts(5).perAttemptTimeout(Duration.ofSeconds(2))}.
 *
 * <p>An attempt that fails with one of {@link #retryableCodes()} is tried
 * again, on the next address when the client has several, after a pause drawn
 * with full jitter from a capped exponential:
 *
 * <pre>
 * pause(n) = uniform(0, min(maxBackoff, initialBackoff * multiplier^(n - 1)))   for the n-th retry
 * </pre>
 *
 * as long as attempts are left ({@link #maxAttempts()} counts the first) and
 * the call's overall deadline (the client's {@code callTimeout}, or the call's
 * own timeout) leaves time for another. Each attempt gets the time left, or
 * {@link #perAttemptTimeout()} when that is shorter, so that an attempt that
 * hangs (DEADLINE_EXCEEDED) leaves time for the next.
 *
 * <p>Every RPC is safe to repeat: Claim because the client sends its own lease
 * token (new per Claim, the same on each retry of it) and the server answers a
 * repeated token with the same lease ({@link ClaimResult#retried()});
 * Complete, Release and ExtendLease because repeating one that succeeded
 * answers OK; Get changes nothing; Purge answers false the second time.
 *
 * <p>The defaults (those of the Python and TypeScript clients) ride out a
 * replica's restart: 9 retries, pauses of about 4.6 s in all on average (9.2 s
 * at most), cut short by the call's deadline (10 s unless set).
 */
public final class RetryPolicy {
  /**
   * What is retried by default: the server or its store is unreachable or
   * restarting (UNAVAILABLE), over a rate limit or the server's limit of calls
   * in flight (RESOURCE_EXHAUSTED), an attempt's deadline passed
   * (DEADLINE_EXCEEDED). Never a verdict on the request (INVALID_ARGUMENT,
   * NOT_FOUND, FAILED_PRECONDITION, UNAUTHENTICATED, PERMISSION_DENIED, ...).
   */
  public static final Set<Status.Code> RETRYABLE_CODES = Set.copyOf(
      EnumSet.of(Status.Code.UNAVAILABLE, Status.Code.RESOURCE_EXHAUSTED, Status.Code.DEADLINE_EXCEEDED));

  private static final RetryPolicy DEFAULTS = new RetryPolicy(
      10, Duration.ofMillis(50), Duration.ofSeconds(2), 2.0, null, RETRYABLE_CODES);

  private final int maxAttempts;
  private final Duration initialBackoff;
  private final Duration maxBackoff;
  private final double multiplier;
  private final Duration perAttemptTimeout;
  private final Set<Status.Code> retryableCodes;

  private RetryPolicy(int maxAttempts, Duration initialBackoff, Duration maxBackoff, double multiplier,
      Duration perAttemptTimeout, Set<Status.Code> retryableCodes) {
    if (maxAttempts < 1) {
      throw new IllegalArgumentException("RetryPolicy: maxAttempts must be >= 1");
    }
    if (initialBackoff.isNegative() || maxBackoff.isNegative()) {
      throw new IllegalArgumentException("RetryPolicy: backoffs must be >= 0");
    }
    if (!(multiplier >= 1.0) || Double.isInfinite(multiplier)) {
      throw new IllegalArgumentException("RetryPolicy: multiplier must be a finite number >= 1");
    }
    if (perAttemptTimeout != null && (perAttemptTimeout.isNegative() || perAttemptTimeout.isZero())) {
      throw new IllegalArgumentException("RetryPolicy: perAttemptTimeout must be > 0 (or null)");
    }
    this.maxAttempts = maxAttempts;
    this.initialBackoff = initialBackoff;
    this.maxBackoff = maxBackoff;
    this.multiplier = multiplier;
    this.perAttemptTimeout = perAttemptTimeout;
    this.retryableCodes = Set.copyOf(retryableCodes);
  }

  /** 10 attempts, pauses capped at 50 ms doubling to 2 s, no per-attempt timeout, {@link #RETRYABLE_CODES}. */
  public static RetryPolicy defaults() {
    return DEFAULTS;
  }

  /** One attempt per call: no retry. */
  public static RetryPolicy none() {
    return DEFAULTS.maxAttempts(1);
  }

  /** Attempts in all, the first included (1: no retry). */
  public RetryPolicy maxAttempts(int maxAttempts) {
    return new RetryPolicy(maxAttempts, initialBackoff, maxBackoff, multiplier, perAttemptTimeout, retryableCodes);
  }

  /** The cap of the first pause (default 50 ms). */
  public RetryPolicy initialBackoff(Duration initialBackoff) {
    return new RetryPolicy(maxAttempts, Objects.requireNonNull(initialBackoff, "initialBackoff"), maxBackoff,
        multiplier, perAttemptTimeout, retryableCodes);
  }

  /** The cap of every pause (default 2 s). */
  public RetryPolicy maxBackoff(Duration maxBackoff) {
    return new RetryPolicy(maxAttempts, initialBackoff, Objects.requireNonNull(maxBackoff, "maxBackoff"),
        multiplier, perAttemptTimeout, retryableCodes);
  }

  /** How much the cap grows per retry (default 2). */
  public RetryPolicy multiplier(double multiplier) {
    return new RetryPolicy(maxAttempts, initialBackoff, maxBackoff, multiplier, perAttemptTimeout, retryableCodes);
  }

  /** How long one attempt may take; null (default): the time left of the call's deadline. */
  public RetryPolicy perAttemptTimeout(Duration perAttemptTimeout) {
    return new RetryPolicy(maxAttempts, initialBackoff, maxBackoff, multiplier, perAttemptTimeout, retryableCodes);
  }

  /** The status codes worth another attempt (default {@link #RETRYABLE_CODES}). */
  public RetryPolicy retryableCodes(Set<Status.Code> retryableCodes) {
    return new RetryPolicy(maxAttempts, initialBackoff, maxBackoff, multiplier, perAttemptTimeout,
        Objects.requireNonNull(retryableCodes, "retryableCodes"));
  }

  public int maxAttempts() {
    return maxAttempts;
  }

  public Duration initialBackoff() {
    return initialBackoff;
  }

  public Duration maxBackoff() {
    return maxBackoff;
  }

  public double multiplier() {
    return multiplier;
  }

  public Duration perAttemptTimeout() {
    return perAttemptTimeout;
  }

  public Set<Status.Code> retryableCodes() {
    return retryableCodes;
  }

  public boolean retryable(Status.Code code) {
    return retryableCodes.contains(code);
  }

  /** The longest pause before the {@code retry}-th retry (1 for the first). */
  public Duration backoffCap(int retry) {
    // In doubles, so that a large exponent saturates instead of overflowing.
    double cap = initialBackoff.toNanos() * Math.pow(multiplier, Math.max(retry - 1, 0));
    return Duration.ofNanos((long) Math.min((double) maxBackoff.toNanos(), cap));
  }

  /** The pause before the {@code retry}-th retry: full jitter, uniform in [0, cap]. */
  public Duration backoff(int retry) {
    long cap = backoffCap(retry).toNanos();
    return Duration.ofNanos(cap == 0 ? 0 : ThreadLocalRandom.current().nextLong(cap + 1));
  }

  @Override
  public String toString() {
    return "RetryPolicy[maxAttempts=" + maxAttempts + ", initialBackoff=" + initialBackoff + ", maxBackoff="
        + maxBackoff + ", multiplier=" + multiplier + ", perAttemptTimeout=" + perAttemptTimeout
        + ", retryableCodes=" + retryableCodes + "]";
  }
}
