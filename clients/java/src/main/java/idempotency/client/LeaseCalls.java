package idempotency.client;

import java.time.Duration;
import java.time.Instant;

/**
 * The calls once() makes, as {@link IdempotencyClient} has them: {@link Once}
 * needs these and nothing else, so the client uses Once and not the reverse.
 */
interface LeaseCalls {
  ClaimResult claim(String namespace, String key, ClaimOptions options);

  Instant complete(String namespace, String key, String leaseToken, byte[] response, Duration retention);

  void release(String namespace, String key, String leaseToken, byte[] checkpoint);

  Instant extendLease(String namespace, String key, String leaseToken, Duration leaseTtl, byte[] checkpoint,
      Duration timeout);

  /** Each call's deadline, unless the call sets its own. */
  Duration callTimeout();
}
