package idempotency.client;

import java.time.Duration;

/**
 * The optional parts of a Claim. Immutable; each method with an argument
 * returns a changed copy:
 * {@code client.claim(ns, key, ClaimOptions.defaults().fingerprint(fp).waitFor(Duration.ofSeconds(5)))}.
 */
public final class ClaimOptions {
  private static final ClaimOptions DEFAULTS = new ClaimOptions(null, null, null, null, null, null, null);

  private final byte[] fingerprint;
  private final Duration leaseTtl;
  private final Duration retention;
  private final String leaseToken;
  private final Duration waitFor;
  private final Duration timeout;
  private final LateRetry lateRetry;

  private ClaimOptions(byte[] fingerprint, Duration leaseTtl, Duration retention, String leaseToken, Duration waitFor,
      Duration timeout, LateRetry lateRetry) {
    this.fingerprint = fingerprint;
    this.leaseTtl = leaseTtl;
    this.retention = retention;
    this.leaseToken = leaseToken;
    this.waitFor = waitFor;
    this.timeout = timeout;
    this.lateRetry = lateRetry;
  }

  /** No fingerprint, the server's lease and retention, a new lease token, no waiting, the client's timeout. */
  public static ClaimOptions defaults() {
    return DEFAULTS;
  }

  /** The payload's fingerprint (at most 64 bytes); null or empty: no check. */
  public ClaimOptions fingerprint(byte[] fingerprint) {
    return new ClaimOptions(fingerprint == null ? null : fingerprint.clone(), leaseTtl, retention, leaseToken,
        waitFor, timeout, lateRetry);
  }

  /** The lease length if this Claim wins; null: the server's default (30 s unless configured). */
  public ClaimOptions leaseTtl(Duration leaseTtl) {
    return new ClaimOptions(fingerprint, leaseTtl, retention, leaseToken, waitFor, timeout, lateRetry);
  }

  /** How long the completed result is kept; null: the server's default (24 h unless configured). */
  public ClaimOptions retention(Duration retention) {
    return new ClaimOptions(fingerprint, leaseTtl, retention, leaseToken, waitFor, timeout, lateRetry);
  }

  /**
   * The lease token this Claim sends (32 lowercase hex characters). Null
   * (default): a new one from {@link IdempotencyClient#newLeaseToken()}. Set
   * it only to retry one logical Claim yourself; never reuse one across Claims.
   */
  public ClaimOptions leaseToken(String leaseToken) {
    return new ClaimOptions(fingerprint, leaseTtl, retention, leaseToken, waitFor, timeout, lateRetry);
  }

  /**
   * How long the Claim may wait on the server for another holder's live lease
   * to end (ClaimRequest.wait): it then answers COMPLETED with the stored
   * result, or CLAIMED when the holder released or its lease ran out, or
   * IN_PROGRESS when the wait ran out. Null or zero (default): answer at once.
   * The server caps it (its IDEMPOTENCY_MAX_WAIT setting); the
   * call's deadline is the timeout plus this wait. A server that predates the
   * field answers at once and leaves {@link ClaimResult#waited()} null.
   */
  public ClaimOptions waitFor(Duration waitFor) {
    return new ClaimOptions(fingerprint, leaseTtl, retention, leaseToken, waitFor, timeout, lateRetry);
  }

  /** The call's overall deadline, retries included (the wait comes on top); null: the client's callTimeout. */
  public ClaimOptions timeout(Duration timeout) {
    return new ClaimOptions(fingerprint, leaseTtl, retention, leaseToken, waitFor, timeout, lateRetry);
  }

  public byte[] fingerprint() {
    return fingerprint == null ? null : fingerprint.clone();
  }

  public Duration leaseTtl() {
    return leaseTtl;
  }

  public Duration retention() {
    return retention;
  }

  public String leaseToken() {
    return leaseToken;
  }

  public Duration waitFor() {
    return waitFor;
  }

  /**
   * What to do if the key is remembered (completed, its result expired):
   * {@link LateRetry#REEXECUTE} (CLAIMED with {@link ClaimResult#completedAt()}
   * set) or {@link LateRetry#REFUSE} ({@link Outcome#EXPIRED}). Null
   * (default): the namespace's policy, else the server's (re-execute unless
   * configured).
   */
  public ClaimOptions lateRetry(LateRetry lateRetry) {
    return new ClaimOptions(fingerprint, leaseTtl, retention, leaseToken, waitFor, timeout, lateRetry);
  }

  public Duration timeout() {
    return timeout;
  }

  public LateRetry lateRetry() {
    return lateRetry;
  }

  /** True when the Claim asks to wait (a wait above zero). */
  boolean waits() {
    return waitFor != null && !waitFor.isNegative() && !waitFor.isZero();
  }
}
