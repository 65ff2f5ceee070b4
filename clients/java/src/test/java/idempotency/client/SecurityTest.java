package idempotency.client;

import java.io.File;
import java.nio.charset.StandardCharsets;
import java.nio.file.Path;
import java.time.Duration;
import java.util.UUID;
import java.util.concurrent.atomic.AtomicBoolean;

/**
 * Bearer tokens, TLS and mutual TLS against a server with an access policy
 * (run-tests.sh starts it: TLS with optional client certificates, the policy
 * below, a plaintext health listener). Certificates from
 * clients/testdata/make-test-certs.sh.
 *
 * <pre>
 * identity "orders":                token ORDERS_TOKEN,   namespaces "orders/*"
 * identity "orders-by-certificate": client cert CN "orders-client", namespaces "billing/*"
 * </pre>
 */
final class SecurityTest {
  private SecurityTest() {}

  static void run(Check check, String target, String healthTarget, Path certs, String ordersToken) {
    try (IdempotencyClient health = new IdempotencyClient(healthTarget)) {
      health.waitUntilServing(Duration.ofSeconds(60));
    }
    File ca = certs.resolve("ca.pem").toFile();
    String orders = "orders/java-" + UUID.randomUUID().toString().substring(0, 12);
    String billing = "billing/java-" + UUID.randomUUID().toString().substring(0, 12);
    byte[] done = "{\"ok\":true}".getBytes(StandardCharsets.UTF_8);

    try (IdempotencyClient client = IdempotencyClient.builder(target).rootCertificates(ca).token(ordersToken).build()) {
      ClaimResult claim = client.claim(orders, "k");
      check.equal("tls + token: claimed", Outcome.CLAIMED, claim.outcome());
      client.complete(orders, "k", claim.leaseToken(), done);
      check.equal("tls + token: replay", Outcome.COMPLETED, client.claim(orders, "k").outcome());
      // once(): Claim, the heartbeat's ExtendLease and Complete all carry the token.
      AtomicBoolean extended = new AtomicBoolean();
      OnceResult once = client.onceWithLease(orders, "once", null, lease -> {
        long deadline = System.nanoTime() + Duration.ofSeconds(5).toNanos();
        while (!extended.get() && System.nanoTime() < deadline) {
          extended.set(client.get(orders, "once").leaseExpiresAt().isAfter(lease.claim().leaseExpiresAt()));
          if (!extended.get()) {
            sleep(20);
          }
        }
        lease.checkLease();
        return done;
      }, OnceOptions.defaults().leaseTtl(Duration.ofSeconds(5)).heartbeatInterval(Duration.ofMillis(50)));
      check.ok("tls + token: once() completed", !once.replayed());
      check.ok("tls + token: the heartbeat extended the lease", extended.get());
      check.equal("tls + token: once() stored", done, client.get(orders, "once").response());
      check.throwsException("tls + token: a namespace not granted", IdempotencyException.PermissionDenied.class,
          () -> client.claim(billing, "k"));
    }

    try (IdempotencyClient client = IdempotencyClient.builder(target).rootCertificates(ca).build()) {
      check.throwsException("tls, no credentials: unauthenticated", IdempotencyException.Unauthenticated.class,
          () -> client.claim(orders, "k2"));
    }

    try (IdempotencyClient client = IdempotencyClient.builder(target).rootCertificates(ca)
        .token("idem_" + UUID.randomUUID().toString().replace("-", "")).build()) {
      check.throwsException("tls, unknown token: unauthenticated", IdempotencyException.Unauthenticated.class,
          () -> client.claim(orders, "k2"));
    }

    try (IdempotencyClient client = IdempotencyClient.builder(target).rootCertificates(ca)
        .clientCertificate(certs.resolve("client.pem").toFile(), certs.resolve("client.key").toFile()).build()) {
      check.equal("mutual tls: claimed by certificate", Outcome.CLAIMED, client.claim(billing, "k").outcome());
      check.throwsException("mutual tls: a namespace not granted", IdempotencyException.PermissionDenied.class,
          () -> client.claim(orders, "k3"));
    }

    try (IdempotencyClient client = IdempotencyClient.builder(target)
        .rootCertificates(certs.resolve("rogue-ca.pem").toFile()).token(ordersToken).build()) {
      check.throwsException("a server the client cannot verify: unavailable", IdempotencyException.Unavailable.class,
          () -> client.claim(orders, "k4"));
    }

    try (IdempotencyClient client = IdempotencyClient.builder(target).token(ordersToken).build()) {
      // grpc-java reads the TLS server's answer as a broken HTTP/2 stream: INTERNAL, not UNAVAILABLE.
      IdempotencyException error = check.throwsException("plaintext to a TLS port: refused",
          IdempotencyException.class, () -> client.claim(orders, "k5"));
      check.equal("plaintext to a TLS port: INTERNAL", io.grpc.Status.Code.INTERNAL, error == null ? null : error.code());
    }
  }

  private static void sleep(long millis) {
    try {
      Thread.sleep(millis);
    } catch (InterruptedException interrupted) {
      Thread.currentThread().interrupt();
      throw new IllegalStateException(interrupted);
    }
  }
}
