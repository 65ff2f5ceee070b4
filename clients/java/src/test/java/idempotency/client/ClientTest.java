package idempotency.client;

import java.nio.charset.StandardCharsets;
import java.nio.file.Path;
import java.time.Duration;
import java.time.Instant;
import java.util.UUID;
import java.util.concurrent.atomic.AtomicInteger;

/**
 * The Java client against a real idempotency-service:
 *
 *   java idempotency.client.ClientTest HOST:PORT clients/testdata/key_vectors.json \
 *       [TLS_HOST:PORT HEALTH_HOST:PORT CERT_DIR ORDERS_TOKEN]
 *
 * The optional part runs SecurityTest against a second server (TLS, access policy).
 *
 * Prints every failed check and exits 1 when there was one.
 */
public final class ClientTest {
  private static final Duration LEASE = Duration.ofSeconds(30);

  private final Check check = new Check();
  private final IdempotencyClient client;

  private ClientTest(IdempotencyClient client) {
    this.client = client;
  }

  public static void main(String[] args) throws Exception {
    if (args.length != 2 && args.length != 6) {
      System.err.println("usage: ClientTest HOST:PORT KEY_VECTORS_JSON [TLS_HOST:PORT HEALTH_HOST:PORT CERT_DIR TOKEN]");
      System.exit(2);
    }
    try (IdempotencyClient client = new IdempotencyClient(args[0])) {
      client.waitUntilServing(Duration.ofSeconds(60));
      ClientTest test = new ClientTest(client);
      KeysTest.run(test.check, Path.of(args[1]));
      test.runAll();
      if (args.length == 6) {
        test.run("security: tokens, TLS, mutual TLS",
            namespace -> SecurityTest.run(test.check, args[2], args[3], Path.of(args[4]), args[5]));
      }
      System.out.println("java client: " + test.check.passed + " checks passed, " + test.check.failed + " failed");
      System.exit(test.check.failed == 0 ? 0 : 1);
    }
  }

  private interface Case {
    void run(String namespace) throws Exception;
  }

  private void runAll() {
    run("claim, complete, replay", this::claimCompleteReplay);
    run("in progress", this::inProgress);
    run("fingerprint mismatch", this::fingerprintMismatch);
    run("release, extend, errors", this::releaseExtendAndErrors);
    run("once runs, then replays", this::onceRunsThenReplays);
    run("once: fingerprint mismatch", this::onceFingerprintMismatch);
    run("once: release on exception", this::onceReleasesOnException);
    run("once: in progress, throw", this::onceInProgressThrows);
    run("once: in progress, wait", this::onceWaitsForTheLease);
    run("once: lease lost before Complete", this::onceLeaseLostBeforeComplete);
    run("once: heartbeat keeps the lease", this::onceHeartbeatKeepsTheLease);
    run("once: heartbeat sees the lease lost", this::onceHeartbeatSeesTheLeaseLost);
  }

  private void run(String name, Case body) {
    int failedBefore = check.failed;
    long start = System.nanoTime();
    try {
      body.run("java-" + UUID.randomUUID().toString().substring(0, 12));
    } catch (Throwable unexpected) {
      check.failed++;
      System.out.println("FAIL " + name + ": " + unexpected);
      unexpected.printStackTrace(System.out);
    }
    System.out.printf("%s %s (%d ms)%n", check.failed == failedBefore ? "ok  " : "FAIL", name,
        (System.nanoTime() - start) / 1_000_000);
  }

  private static byte[] bytes(String text) {
    return text.getBytes(StandardCharsets.UTF_8);
  }

  private void claimCompleteReplay(String ns) {
    byte[] fp = Keys.fingerprint("payload");
    ClaimResult claim = client.claim(ns, "k1", fp, LEASE, null);
    check.equal("claim: outcome", Outcome.CLAIMED, claim.outcome());
    check.ok("claim: token is 32 hex characters", claim.leaseToken().matches("[0-9a-f]{32}"));
    check.equal("claim: fencing token", 1L, claim.fencingToken());
    check.ok("claim: lease expiry in the future", claim.leaseExpiresAt() != null && claim.leaseExpiresAt().isAfter(Instant.now()));

    KeyRecord record = client.get(ns, "k1");
    check.equal("get: in progress", State.IN_PROGRESS, record.state());
    check.equal("get: fingerprint kept", fp, record.fingerprint());

    Instant expires = client.complete(ns, "k1", claim.leaseToken(), bytes("{\"ok\":true}"));
    check.ok("complete: expiry in the future", expires != null && expires.isAfter(Instant.now()));
    check.equal("complete again: same expiry", expires, client.complete(ns, "k1", claim.leaseToken(), bytes("other")));

    ClaimResult replay = client.claim(ns, "k1", fp);
    check.equal("replay: outcome", Outcome.COMPLETED, replay.outcome());
    check.equal("replay: the stored response", bytes("{\"ok\":true}"), replay.response());
    check.equal("replay: no token", "", replay.leaseToken());
    check.equal("replay: expires_at", expires, replay.expiresAt());

    record = client.get(ns, "k1");
    check.equal("get: completed", State.COMPLETED, record.state());
    check.equal("get: response", bytes("{\"ok\":true}"), record.response());
    check.equal("get: absent key", State.ABSENT, client.get(ns, "nothing").state());
  }

  private void inProgress(String ns) {
    ClaimResult first = client.claim(ns, "k", null, LEASE, null);
    check.ok("first claim wins", first.claimed());
    ClaimResult second = client.claim(ns, "k");
    check.equal("second claim: in progress", Outcome.IN_PROGRESS, second.outcome());
    check.equal("second claim: no token", "", second.leaseToken());
    check.ok("second claim: retry_after within the lease", second.retryAfter() != null
        && !second.retryAfter().isNegative() && second.retryAfter().compareTo(LEASE) <= 0);
    check.equal("second claim: the first lease's expiry", first.leaseExpiresAt(), second.leaseExpiresAt());
  }

  private void fingerprintMismatch(String ns) {
    byte[] fp1 = Keys.fingerprint(bytes("one"));
    byte[] fp2 = Keys.fingerprint(bytes("two"));
    ClaimResult claim = client.claim(ns, "k", fp1);
    client.complete(ns, "k", claim.leaseToken(), bytes("r"));
    ClaimResult other = client.claim(ns, "k", fp2);
    check.equal("another fingerprint: mismatch", Outcome.FINGERPRINT_MISMATCH, other.outcome());
    check.equal("mismatch: nothing returned", 0, other.response().length);
    check.equal("same fingerprint: replay", Outcome.COMPLETED, client.claim(ns, "k", fp1).outcome());
    check.equal("no fingerprint: replay", Outcome.COMPLETED, client.claim(ns, "k").outcome());
  }

  private void releaseExtendAndErrors(String ns) {
    ClaimResult claim = client.claim(ns, "k", null, Duration.ofSeconds(5), null);
    Instant extended = client.extendLease(ns, "k", claim.leaseToken(), Duration.ofSeconds(60));
    check.ok("extendLease: later expiry", extended.isAfter(claim.leaseExpiresAt()));
    client.release(ns, "k", claim.leaseToken());
    check.equal("released", State.RELEASED, client.get(ns, "k").state());
    ClaimResult again = client.claim(ns, "k");
    check.ok("claimable again at once", again.claimed());
    check.equal("fencing token counts", 2L, again.fencingToken());
    check.throwsException("release with the old token", IdempotencyException.LeaseNotCurrent.class,
        () -> client.release(ns, "k", claim.leaseToken()));
    check.throwsException("complete with the old token", IdempotencyException.LeaseNotCurrent.class,
        () -> client.complete(ns, "k", claim.leaseToken(), bytes("x")));
    check.throwsException("complete an unknown key", IdempotencyException.KeyNotFound.class,
        () -> client.complete(ns, "unknown", "0123456789abcdef0123456789abcdef", bytes("x")));
    IdempotencyException.InvalidArgument invalid = check.throwsException("empty namespace",
        IdempotencyException.InvalidArgument.class, () -> client.claim("", "k"));
    check.ok("invalid argument names the field", invalid != null && invalid.getMessage().contains("namespace"));
    check.equal("status code", io.grpc.Status.Code.INVALID_ARGUMENT, invalid == null ? null : invalid.code());
    check.ok("purge: there was a record", client.purge(ns, "k", "java client test"));
    check.equal("purged: absent", State.ABSENT, client.get(ns, "k").state());
  }

  private void onceRunsThenReplays(String ns) {
    AtomicInteger runs = new AtomicInteger();
    String key = Keys.deriveKey("shop", "order-paid", "o-1");
    byte[] fp = Keys.fingerprint("order o-1");
    OnceResult first = client.onceWithDetails(ns, key, fp, () -> {
      runs.incrementAndGet();
      return bytes("charged");
    }, OnceOptions.defaults());
    check.equal("first: ran", 1, runs.get());
    check.ok("first: not replayed", !first.replayed());
    check.equal("first: value", bytes("charged"), first.value());
    check.equal("first: fencing token", 1L, first.claim().fencingToken());

    OnceResult second = client.onceWithDetails(ns, key, fp, () -> {
      runs.incrementAndGet();
      return bytes("charged twice");
    }, OnceOptions.defaults());
    check.equal("second: did not run", 1, runs.get());
    check.ok("second: replayed", second.replayed());
    check.equal("second: the stored value", bytes("charged"), second.value());
    check.equal("once(): the stored value", bytes("charged"), client.once(ns, key, fp, () -> bytes("no")));
  }

  private void onceFingerprintMismatch(String ns) {
    AtomicInteger runs = new AtomicInteger();
    client.once(ns, "k", Keys.fingerprint("a"), () -> bytes("a"));
    check.throwsException("other payload", IdempotencyException.FingerprintMismatch.class,
        () -> client.once(ns, "k", Keys.fingerprint("b"), () -> {
          runs.incrementAndGet();
          return bytes("b");
        }));
    check.equal("the work did not run", 0, runs.get());
  }

  private void onceReleasesOnException(String ns) {
    IllegalStateException boom = new IllegalStateException("downstream failed");
    RuntimeException thrown = check.throwsException("the work's exception", RuntimeException.class,
        () -> client.once(ns, "k", null, () -> {
          throw boom;
        }));
    check.ok("rethrown as it is", thrown == boom);
    check.equal("no suppressed Release error", 0, boom.getSuppressed().length);
    check.equal("the key was released", State.RELEASED, client.get(ns, "k").state());
    OnceResult retry = client.onceWithDetails(ns, "k", null, () -> bytes("second try"), OnceOptions.defaults());
    check.ok("the next delivery runs", !retry.replayed());
    check.equal("its fencing token", 2L, retry.claim().fencingToken());
    check.equal("and its result is stored", bytes("second try"), client.get(ns, "k").response());
  }

  private void onceInProgressThrows(String ns) {
    ClaimResult held = client.claim(ns, "k", null, LEASE, null);
    AtomicInteger runs = new AtomicInteger();
    IdempotencyException.InProgress error = check.throwsException("held elsewhere",
        IdempotencyException.InProgress.class,
        () -> client.once(ns, "k", null, () -> {
          runs.incrementAndGet();
          return bytes("x");
        }, OnceOptions.defaults().throwOnInProgress()));
    check.equal("the work did not run", 0, runs.get());
    check.ok("retry_after given", error != null && error.retryAfter() != null);
    check.equal("lease expiry given", held.leaseExpiresAt(), error == null ? null : error.leaseExpiresAt());
    check.equal("the lease is untouched", State.IN_PROGRESS, client.get(ns, "k").state());
  }

  private void onceWaitsForTheLease(String ns) {
    // Another claimant takes a 1 s lease and never completes: WAIT claims again
    // with backoff and wins the key once that lease ran out.
    ClaimResult held = client.claim(ns, "k", null, Duration.ofSeconds(1), null);
    check.ok("held", held.claimed());
    OnceResult result = client.onceWithDetails(ns, "k", null, () -> bytes("after the wait"),
        OnceOptions.defaults().waitTimeout(Duration.ofSeconds(10)));
    check.ok("ran after the other lease expired", !result.replayed() && !Instant.now().isBefore(held.leaseExpiresAt()));
    check.equal("fencing token 2", 2L, result.claim().fencingToken());

    // A short wait runs out: InProgress.
    client.claim(ns, "k2", null, LEASE, null);
    IdempotencyException.InProgress error = check.throwsException("the wait runs out",
        IdempotencyException.InProgress.class,
        () -> client.once(ns, "k2", null, () -> bytes("x"), OnceOptions.defaults().waitTimeout(Duration.ofMillis(300))));
    check.ok("InProgress says it waited", error != null && error.getMessage().contains("waited"));
  }

  private void onceLeaseLostBeforeComplete(String ns) {
    AtomicInteger runs = new AtomicInteger();
    IdempotencyException.LeaseLost lost = check.throwsException("purged while the work ran",
        IdempotencyException.LeaseLost.class,
        () -> client.onceWithLease(ns, "k", null, lease -> {
          runs.incrementAndGet();
          client.purge(ns, "k", "test: revoke the lease");
          return bytes("too late");
        }, OnceOptions.defaults().heartbeat(false)));
    check.equal("the work ran", 1, runs.get());
    check.ok("the cause is Complete's NOT_FOUND", lost != null && lost.getCause() instanceof IdempotencyException.KeyNotFound);
    check.equal("nothing stored", State.ABSENT, client.get(ns, "k").state());
  }

  private void onceHeartbeatKeepsTheLease(String ns) {
    // A 1 s lease, extended every 250 ms: still held after 1.6 s of work.
    OnceOptions options = OnceOptions.defaults().leaseTtl(Duration.ofSeconds(1)).heartbeatInterval(Duration.ofMillis(250));
    AtomicInteger observed = new AtomicInteger();
    OnceResult result = client.onceWithLease(ns, "k", null, lease -> {
      long end = System.nanoTime() + Duration.ofMillis(1600).toNanos();
      while (System.nanoTime() < end) {
        if (client.claim(ns, "k").outcome() == Outcome.IN_PROGRESS) {
          observed.incrementAndGet();
        } else {
          observed.set(-1000);
        }
        pause(200);
      }
      lease.checkLease();
      return bytes("long work");
    }, options);
    check.ok("every claim meanwhile was IN_PROGRESS", observed.get() >= 5);
    check.ok("completed", !result.replayed());
    check.equal("stored", bytes("long work"), client.get(ns, "k").response());
  }

  private void onceHeartbeatSeesTheLeaseLost(String ns) {
    OnceOptions options = OnceOptions.defaults().leaseTtl(Duration.ofSeconds(5)).heartbeatInterval(Duration.ofMillis(100));
    IdempotencyException.LeaseLost lost = check.throwsException("the heartbeat's ExtendLease found it gone",
        IdempotencyException.LeaseLost.class,
        () -> client.onceWithLease(ns, "k", null, lease -> {
          client.purge(ns, "k", "test: revoke the lease");
          long deadline = System.nanoTime() + Duration.ofSeconds(5).toNanos();
          while (!lease.isLost() && System.nanoTime() < deadline) {
            pause(20);
          }
          lease.checkLease();
          return bytes("never stored");
        }, options));
    check.ok("the cause is ExtendLease's NOT_FOUND", lost != null && lost.getCause() instanceof IdempotencyException.KeyNotFound);
    check.equal("nothing stored", State.ABSENT, client.get(ns, "k").state());
  }

  private static void pause(long millis) {
    try {
      Thread.sleep(millis);
    } catch (InterruptedException interrupted) {
      Thread.currentThread().interrupt();
      throw new IllegalStateException(interrupted);
    }
  }
}
