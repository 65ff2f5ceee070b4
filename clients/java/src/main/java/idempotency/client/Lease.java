package idempotency.client;

/**
 * The lease once() holds while the work runs. Pass {@link #fencingToken()} to
 * downstream writes so that they can reject an older holder's; call
 * {@link #checkLease()} between steps of long work to stop early when the
 * heartbeat found the lease gone.
 */
public final class Lease {
  private final String namespace;
  private final String key;
  private final ClaimResult claim;
  private volatile Throwable lost;

  Lease(String namespace, String key, ClaimResult claim) {
    this.namespace = namespace;
    this.key = key;
    this.claim = claim;
  }

  public String namespace() {
    return namespace;
  }

  public String key() {
    return key;
  }

  public String leaseToken() {
    return claim.leaseToken();
  }

  /** Increases on every successful Claim of the key (unsigned 64-bit in the proto). */
  public long fencingToken() {
    return claim.fencingToken();
  }

  public ClaimResult claim() {
    return claim;
  }

  /** True when the heartbeat's ExtendLease found the lease gone: the result will not be stored. */
  public boolean isLost() {
    return lost != null;
  }

  /** Throws {@link IdempotencyException.LeaseLost} when the lease is gone. */
  public void checkLease() {
    Throwable cause = lost;
    if (cause != null) {
      throw new IdempotencyException.LeaseLost(
          namespace + "/" + key + ": the lease was lost while the work ran", cause);
    }
  }

  Throwable lostCause() {
    return lost;
  }

  void markLost(Throwable cause) {
    lost = cause;
  }
}
