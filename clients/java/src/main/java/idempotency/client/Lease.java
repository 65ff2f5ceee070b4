package idempotency.client;

/**
 * The lease once() holds while the work runs. Pass {@link #fencingToken()} to
 * downstream writes so that they can reject an older holder's; call
 * {@link #checkLease()} between steps of long work to stop early when the
 * heartbeat found the lease gone.
 *
 * <p>Resumable work: {@link #checkpoint()} is what an earlier holder of the
 * key saved before it failed or died (how far the work got), and
 * {@link #saveCheckpoint(byte[])} saves this holder's progress, so that whoever
 * takes the key over after it resumes from there.
 */
public final class Lease {
  /** How a checkpoint is saved under this lease: ExtendLease with the checkpoint. */
  interface CheckpointSaver {
    void save(byte[] data);
  }

  private final String namespace;
  private final String key;
  private final ClaimResult claim;
  private final CheckpointSaver saver;
  private volatile Throwable lost;
  private byte[] checkpoint;
  private long checkpointFencingToken;
  /** The last checkpoint the work asked to save, saved or not: a Release after a failure carries it. */
  private byte[] lastAsked;

  Lease(String namespace, String key, ClaimResult claim, CheckpointSaver saver) {
    this.namespace = namespace;
    this.key = key;
    this.claim = claim;
    this.saver = saver;
    this.checkpoint = claim.checkpoint();
    this.checkpointFencingToken = claim.checkpointFencingToken();
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

  /**
   * When the key was completed before, for a late retry re-executed (the key
   * was remembered after its result expired: the effect ran once already, at
   * that time); null otherwise.
   */
  public java.time.Instant previouslyCompletedAt() {
    return claim.completedAt();
  }

  /**
   * The last checkpoint: the one an earlier holder of the key saved (received
   * with the Claim), or, after {@link #saveCheckpoint(byte[])}, the one this
   * work saved; null when there is none (start from the beginning).
   */
  public synchronized byte[] checkpoint() {
    return checkpoint == null ? null : checkpoint.clone();
  }

  /**
   * The fencing token of the lease {@link #checkpoint()} was saved under
   * (lower than {@link #fencingToken()} when an earlier holder saved it); 0
   * when there is no checkpoint.
   */
  public synchronized long checkpointFencingToken() {
    return checkpointFencingToken;
  }

  /**
   * Saves how far the work got (at most the server's limit: 64 KiB unless
   * configured) under the lease, replacing the last one, and extends the lease
   * (one ExtendLease). If this worker dies, whoever claims the key next
   * receives it as {@link #checkpoint()}; when the work throws, once()'s
   * Release carries the last one asked for, even if its save failed.
   * Complete discards it.
   *
   * @throws IdempotencyException.LeaseLost the lease is no longer ours; stop,
   *     someone else may be doing the work
   * @throws IdempotencyException another failure of the ExtendLease, after its retries
   */
  public synchronized void saveCheckpoint(byte[] data) {
    if (data == null) {
      throw new NullPointerException("saveCheckpoint(): the checkpoint must not be null");
    }
    if (lost != null) {
      throw new IdempotencyException.LeaseLost(
          namespace + "/" + key + ": the lease was lost; the checkpoint was not saved", lost);
    }
    byte[] copy = data.clone();
    lastAsked = copy;
    try {
      saver.save(copy);
    } catch (IdempotencyException.KeyNotFound | IdempotencyException.LeaseNotCurrent gone) {
      markLost(gone);
      throw new IdempotencyException.LeaseLost(
          namespace + "/" + key + ": the lease was lost; the checkpoint was not saved", gone);
    }
    checkpoint = copy;
    checkpointFencingToken = claim.fencingToken();
  }

  /** True when the heartbeat's ExtendLease (or a checkpoint's) found the lease gone: the result will not be stored. */
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
    if (lost == null) {
      lost = cause;
    }
  }

  synchronized byte[] lastAskedCheckpoint() {
    return lastAsked;
  }
}
