package idempotency.client;

import java.time.Duration;

/**
 * How once() claims, waits and keeps its lease. Immutable; each method returns
 * a changed copy: {@code OnceOptions.defaults().leaseTtl(Duration.ofMinutes(2)).throwOnInProgress()}.
 */
public final class OnceOptions {
  /** What once() does when another claimant holds the lease. */
  public enum OnInProgress {
    /**
     * Wait for it, up to the wait timeout: every Claim asks the server to wait
     * (ClaimRequest.wait) for the holder to Complete (the stored result is
     * returned) or to Release or lose its lease (this call takes the key and
     * runs the work). Against a server that predates waiting (the answer's
     * {@code waited} unset), Claim again with backoff instead: 100 ms
     * doubling, never past retry_after nor the wait timeout.
     */
    WAIT,
    /** Throw {@link IdempotencyException.InProgress} at once. */
    THROW
  }

  private final Duration leaseTtl;
  private final Duration retention;
  private final OnInProgress onInProgress;
  private final Duration waitTimeout;
  private final boolean heartbeat;
  private final Duration heartbeatInterval;
  private final LateRetry lateRetry;

  private OnceOptions(Duration leaseTtl, Duration retention, OnInProgress onInProgress, Duration waitTimeout,
      boolean heartbeat, Duration heartbeatInterval, LateRetry lateRetry) {
    this.leaseTtl = leaseTtl;
    this.retention = retention;
    this.onInProgress = onInProgress;
    this.waitTimeout = waitTimeout;
    this.heartbeat = heartbeat;
    this.heartbeatInterval = heartbeatInterval;
    this.lateRetry = lateRetry;
  }

  /** The server's lease and retention, wait up to 30 s for another holder, heartbeat every lease/3. */
  public static OnceOptions defaults() {
    return new OnceOptions(null, null, OnInProgress.WAIT, Duration.ofSeconds(30), true, null, null);
  }

  /** The lease length (1 s to the server's maximum); null: the server's default (30 s unless configured). */
  public OnceOptions leaseTtl(Duration leaseTtl) {
    return new OnceOptions(leaseTtl, retention, onInProgress, waitTimeout, heartbeat, heartbeatInterval, lateRetry);
  }

  /** How long the result is kept and replayed; null: the server's default (24 h unless configured). */
  public OnceOptions retention(Duration retention) {
    return new OnceOptions(leaseTtl, retention, onInProgress, waitTimeout, heartbeat, heartbeatInterval, lateRetry);
  }

  public OnceOptions onInProgress(OnInProgress onInProgress) {
    return new OnceOptions(leaseTtl, retention, onInProgress, waitTimeout, heartbeat, heartbeatInterval, lateRetry);
  }

  /** Shorthand for {@code onInProgress(OnInProgress.THROW)}. */
  public OnceOptions throwOnInProgress() {
    return onInProgress(OnInProgress.THROW);
  }

  /** How long WAIT waits for another claimant before throwing InProgress (default 30 s; zero: do not wait). */
  public OnceOptions waitTimeout(Duration waitTimeout) {
    return new OnceOptions(leaseTtl, retention, onInProgress, waitTimeout, heartbeat, heartbeatInterval, lateRetry);
  }

  /** Whether to extend the lease (ExtendLease) while the work runs (default true). */
  public OnceOptions heartbeat(boolean heartbeat) {
    return new OnceOptions(leaseTtl, retention, onInProgress, waitTimeout, heartbeat, heartbeatInterval, lateRetry);
  }

  /** The heartbeat's period; null: a third of the lease (of 30 s when the lease is the server's default). */
  public OnceOptions heartbeatInterval(Duration heartbeatInterval) {
    return new OnceOptions(leaseTtl, retention, onInProgress, waitTimeout, heartbeat, heartbeatInterval, lateRetry);
  }

  /**
   * What once() does with a remembered key (completed, its result expired):
   * {@link LateRetry#REEXECUTE} runs the work again ({@link Lease#previouslyCompletedAt()}
   * says when the key was completed before), {@link LateRetry#REFUSE} throws
   * {@link IdempotencyException.ResultExpired} without running it. Null
   * (default): the namespace's policy, else the server's (re-execute unless configured).
   */
  public OnceOptions lateRetry(LateRetry lateRetry) {
    return new OnceOptions(leaseTtl, retention, onInProgress, waitTimeout, heartbeat, heartbeatInterval, lateRetry);
  }

  public LateRetry lateRetry() {
    return lateRetry;
  }

  public Duration leaseTtl() {
    return leaseTtl;
  }

  public Duration retention() {
    return retention;
  }

  public OnInProgress onInProgress() {
    return onInProgress;
  }

  public Duration waitTimeout() {
    return waitTimeout;
  }

  public boolean heartbeat() {
    return heartbeat;
  }

  /** The heartbeat period in effect, or null when the heartbeat is off. */
  public Duration effectiveHeartbeatInterval() {
    if (!heartbeat) {
      return null;
    }
    if (heartbeatInterval != null) {
      return heartbeatInterval;
    }
    return (leaseTtl != null ? leaseTtl : Duration.ofSeconds(30)).dividedBy(3);
  }
}
