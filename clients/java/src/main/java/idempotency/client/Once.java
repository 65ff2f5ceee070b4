package idempotency.client;

import java.time.Duration;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.ScheduledFuture;
import java.util.concurrent.TimeUnit;
import java.util.function.Function;
import java.util.function.Supplier;
import java.util.logging.Level;
import java.util.logging.Logger;

/**
 * The lifecycle behind {@code once()}: Claim, then by outcome
 *
 * <ul>
 *   <li>CLAIMED: run the work with a {@link Lease} (its checkpoint, a heartbeat
 *       extending it); when the work returns, Complete with its bytes; when it
 *       throws, Release (with the last checkpoint it asked to save) and rethrow;
 *       when the lease was lost meanwhile, never Complete: LeaseLost.
 *   <li>COMPLETED: the stored bytes (the replay); the work does not run.
 *   <li>FINGERPRINT_MISMATCH: FingerprintMismatch.
 *   <li>EXPIRED: a late retry refused: ResultExpired (the key completed, its result is gone).
 *   <li>IN_PROGRESS: with WAIT, the Claim itself waited on the server (it asks
 *       to wait up to what is left of the wait timeout) and is sent again when
 *       the server's own cap cut the wait short; against a server that ignores
 *       the request (no {@code waited} in its answer) Claim again with backoff.
 *       InProgress when the wait timeout runs out, or at once with THROW.
 * </ul>
 */
final class Once {
  private static final Logger LOG = Logger.getLogger(IdempotencyClient.class.getName());
  private static final Duration FIRST_POLL = Duration.ofMillis(100);
  private static final Duration MIN_POLL = Duration.ofMillis(10);

  private final LeaseCalls calls;
  private final Supplier<ScheduledExecutorService> heartbeats;

  Once(LeaseCalls calls, Supplier<ScheduledExecutorService> heartbeats) {
    this.calls = calls;
    this.heartbeats = heartbeats;
  }

  OnceResult run(String namespace, String key, byte[] fingerprint, Function<Lease, byte[]> work, OnceOptions options) {
    boolean waitMode = options.onInProgress() == OnceOptions.OnInProgress.WAIT;
    long deadline = System.nanoTime() + options.waitTimeout().toNanos();
    // True until a server's answer shows it ignored the request to wait.
    boolean serverWaits = waitMode;
    ClaimOptions claimOptions = ClaimOptions.defaults()
        .fingerprint(fingerprint).leaseTtl(options.leaseTtl()).retention(options.retention())
        .lateRetry(options.lateRetry());
    for (int polls = 0; ; ) {
      long remaining = deadline - System.nanoTime();
      boolean asked = serverWaits && remaining > 0;
      // A new lease token per Claim (the client makes one), the same on each retry of it.
      ClaimResult claim = calls.claim(namespace, key, claimOptions.waitFor(asked ? Duration.ofNanos(remaining) : null));
      switch (claim.outcome()) {
        case CLAIMED:
          return runClaimed(namespace, key, claim, work, options);
        case COMPLETED:
          return new OnceResult(claim.response(), true, claim);
        case FINGERPRINT_MISMATCH:
          throw new IdempotencyException.FingerprintMismatch(
              namespace + "/" + key + ": the key was seen with another payload fingerprint");
        case EXPIRED:
          throw new IdempotencyException.ResultExpired(
              namespace + "/" + key + ": completed at " + claim.completedAt()
                  + ", its result has expired (a late retry, refused)",
              claim.completedAt(), claim.fencingToken());
        case IN_PROGRESS:
          break;
        default:
          throw new IdempotencyException("Claim: unexpected outcome " + claim.outcome(), null, null);
      }
      if (!waitMode) {
        throw inProgress(namespace, key, claim, null);
      }
      if (asked && claim.waited() == null) {
        serverWaits = false; // a server that predates waiting: poll from now on
      }
      remaining = deadline - System.nanoTime();
      if (remaining <= 0) {
        throw inProgress(namespace, key, claim, options.waitTimeout());
      }
      if (serverWaits && claim.waited() != null && !claim.waited().isZero()) {
        continue; // the server's wait ended before ours (its cap, a drain): ask again
      }
      // Polling, or the server answered at once (its limit of waiters).
      sleep(nextPoll(polls++, claim, remaining));
    }
  }

  private static IdempotencyException.InProgress inProgress(String namespace, String key, ClaimResult claim,
      Duration waited) {
    return new IdempotencyException.InProgress(
        namespace + "/" + key + ": another claimant holds the lease"
            + (waited != null ? " (waited " + waited + ")" : "")
            + " (retry after " + claim.retryAfter() + ")",
        claim.retryAfter(), claim.leaseExpiresAt());
  }

  /** 100 ms doubling, so an early Complete is seen soon, never past the other lease's expiry nor the wait timeout. */
  static Duration nextPoll(int poll, ClaimResult claim, long remainingNanos) {
    long pause = FIRST_POLL.toNanos() << Math.min(poll, 20);
    if (claim.retryAfter() != null) {
      pause = Math.min(pause, Math.max(claim.retryAfter().toNanos(), MIN_POLL.toNanos()));
    }
    return Duration.ofNanos(Math.max(0, Math.min(pause, remainingNanos)));
  }

  private OnceResult runClaimed(String namespace, String key, ClaimResult claim, Function<Lease, byte[]> work,
      OnceOptions options) {
    Lease lease = new Lease(namespace, key, claim, data -> calls.extendLease(
        namespace, key, claim.leaseToken(), options.leaseTtl(), data, null));
    Heartbeat heartbeat = startHeartbeat(lease, options);
    byte[] value;
    try {
      value = work.apply(lease);
    } catch (RuntimeException | Error failure) {
      stop(heartbeat);
      releaseAfterFailure(lease, failure);
      throw failure;
    }
    stop(heartbeat);
    if (lease.isLost()) {
      throw new IdempotencyException.LeaseLost(
          namespace + "/" + key + ": the lease was lost while the work ran; the result was not stored",
          lease.lostCause());
    }
    byte[] response = value == null ? new byte[0] : value;
    try {
      calls.complete(namespace, key, claim.leaseToken(), response, options.retention());
    } catch (IdempotencyException.KeyNotFound | IdempotencyException.LeaseNotCurrent error) {
      throw new IdempotencyException.LeaseLost(
          namespace + "/" + key + ": the lease was lost before Complete; the result was not stored", error);
    }
    return new OnceResult(response, false, claim);
  }

  /** Gives the key back so the next delivery retries, from the last checkpoint; never hides the failure. */
  private void releaseAfterFailure(Lease lease, Throwable failure) {
    if (lease.isLost()) {
      return; // not ours any more: nothing to release
    }
    try {
      calls.release(lease.namespace(), lease.key(), lease.leaseToken(), lease.lastAskedCheckpoint());
    } catch (IdempotencyException error) {
      LOG.log(Level.WARNING, "idempotency once(): Release after a failed attempt failed: " + error.getMessage());
      failure.addSuppressed(error);
    }
  }

  /** Extends the lease every interval until stopped, or until the server says the lease is gone. */
  private final class Heartbeat implements Runnable {
    private final Lease lease;
    private final Duration leaseTtl;
    private final Duration timeout;
    private boolean stopped;
    private ScheduledFuture<?> future;

    Heartbeat(Lease lease, Duration leaseTtl, Duration timeout) {
      this.lease = lease;
      this.leaseTtl = leaseTtl;
      this.timeout = timeout;
    }

    @Override
    public synchronized void run() {
      if (stopped) {
        return;
      }
      try {
        calls.extendLease(lease.namespace(), lease.key(), lease.leaseToken(), leaseTtl, null, timeout);
      } catch (IdempotencyException.KeyNotFound | IdempotencyException.LeaseNotCurrent error) {
        lease.markLost(error);
        stopped = true;
        future.cancel(false);
      } catch (IdempotencyException error) {
        // Transient: the lease may well still be ours, and Complete tells for sure.
        LOG.log(Level.WARNING, "idempotency heartbeat: ExtendLease failed: " + error.getMessage());
      }
    }

    // Waits for a beat in flight (synchronized), so no ExtendLease follows.
    synchronized void stop() {
      stopped = true;
      future.cancel(false);
    }
  }

  private Heartbeat startHeartbeat(Lease lease, OnceOptions options) {
    Duration interval = options.effectiveHeartbeatInterval();
    if (interval == null) {
      return null;
    }
    // A beat's ExtendLease (retries included) ends about when the next is
    // due, so stopping the heartbeat never waits long.
    Duration bound = interval.compareTo(Duration.ofSeconds(1)) > 0 ? interval : Duration.ofSeconds(1);
    Duration timeout = bound.compareTo(calls.callTimeout()) < 0 ? bound : calls.callTimeout();
    Heartbeat heartbeat = new Heartbeat(lease, options.leaseTtl(), timeout);
    synchronized (heartbeat) {
      heartbeat.future = heartbeats.get().scheduleWithFixedDelay(
          heartbeat, interval.toNanos(), interval.toNanos(), TimeUnit.NANOSECONDS);
    }
    return heartbeat;
  }

  private static void stop(Heartbeat heartbeat) {
    if (heartbeat != null) {
      heartbeat.stop();
    }
  }

  static void sleep(Duration pause) {
    try {
      TimeUnit.NANOSECONDS.sleep(pause.toNanos());
    } catch (InterruptedException interrupted) {
      Thread.currentThread().interrupt();
      throw new IdempotencyException("interrupted", io.grpc.Status.Code.CANCELLED, interrupted);
    }
  }
}
