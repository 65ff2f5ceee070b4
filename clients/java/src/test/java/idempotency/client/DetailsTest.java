package idempotency.client;

import com.google.protobuf.Any;
import com.google.rpc.BadRequest;
import com.google.rpc.ErrorInfo;
import io.grpc.CallOptions;
import io.grpc.Channel;
import io.grpc.ClientCall;
import io.grpc.ClientInterceptor;
import io.grpc.ForwardingClientCall;
import io.grpc.ForwardingClientCallListener;
import io.grpc.Metadata;
import io.grpc.MethodDescriptor;
import io.grpc.Status;
import io.grpc.protobuf.StatusProto;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.security.MessageDigest;
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.concurrent.atomic.AtomicInteger;

/**
 * The google.rpc details of the service's statuses, as the exceptions'
 * {@code reason()}, {@code retryDelay()} and {@code field()} (decoded with
 * grpc-protobuf's StatusProto), and late retries of a remembered key: refused
 * (EXPIRED, ResultExpired) and re-executed (the fencing token continues), on
 * both stores; a server that refuses late retries by default; a rate limit's
 * retry delay, which the client's retries never undercut.
 */
final class DetailsTest {
  private final Cases cases;
  private final Check check;
  private final String target;
  private final String store;

  DetailsTest(Cases cases, String target, String store) {
    this.cases = cases;
    this.check = cases.check;
    this.target = target;
    this.store = store;
  }

  void runAll() {
    cases.run(store + ": every refusal carries its reason; INVALID_ARGUMENT its field", this::refusalsCarryTheirReason);
    cases.run(store + ": a late retry is refused or re-executed, and the fencing token continues",
        this::aLateRetryIsRefusedOrReexecuted);
  }

  /** The suites that need servers of their own: late retries refused by the server, and a rate limit. */
  static void runWithOwnServers(Cases cases, Path work) throws Exception {
    try (ServerProcess refusing = ServerProcess.start(work, "refusing", null,
        Map.of("IDEMPOTENCY_LATE_RETRY", "refuse"))) {
      cases.run("sqlite, IDEMPOTENCY_LATE_RETRY=refuse: a late retry is EXPIRED unless the Claim asks to re-execute",
          ns -> aServerThatRefusesLateRetries(cases.check, refusing.target(), ns));
    }
    String token = "idem_java_test_rate_0123456789abcdef";
    Path policy = work.resolve("rate-policy.toml");
    Files.writeString(policy, "[[identity]]\nname = \"java-rate\"\ntoken_hashes = [\"sha256:" + sha256(token)
        + "\"]\nnamespaces = [\"java-rate/*\"]\nrate_limit_per_second = 2\n");
    try (ServerProcess limited = ServerProcess.start(work, "rate-limited", null,
        Map.of("IDEMPOTENCY_POLICY_FILE", policy.toString()))) {
      cases.run("sqlite, a rate limit of 2/s: RATE_LIMITED carries its retry delay, and no retry comes sooner",
          ns -> aRateLimitedCallCarriesItsRetryDelay(cases.check, limited.target(), token));
    }
  }

  private static String sha256(String text) throws Exception {
    return Keys.hex(MessageDigest.getInstance("SHA-256").digest(text.getBytes(StandardCharsets.UTF_8)));
  }

  private static byte[] bytes(String text) {
    return text.getBytes(StandardCharsets.UTF_8);
  }

  /** Checks an exception's code, reason and domain, one attempt and no retry delay. */
  private void checkStatus(String what, IdempotencyException error, Status.Code code, String reason) {
    if (error == null) {
      return; // throwsException reported it
    }
    check.equal(what + ": code", code, error.code());
    check.equal(what + ": reason", reason, error.reason());
    check.equal(what + ": domain", IdempotencyException.DOMAIN, error.domain());
    check.equal(what + ": no retry delay", null, error.retryDelay());
    check.equal(what + ": one attempt", 1, error.attempts());
  }

  private void refusalsCarryTheirReason(String ns) {
    try (IdempotencyClient client = new IdempotencyClient(target)) {
      // LEASE_LOST: the lease ran out and another Claim took the key; the first lease is stale.
      ClaimResult stale = client.claim(ns, "lost", ClaimOptions.defaults().leaseTtl(Duration.ofSeconds(1)));
      ClaimResult[] taken = new ClaimResult[1];
      Cases.until(() -> (taken[0] = client.claim(ns, "lost")).claimed(), Duration.ofSeconds(10),
          "the 1 s lease to run out");
      ClaimResult current = taken[0];
      check.equal("claimed again: fencing token 2", 2L, current.fencingToken());
      IdempotencyException.LeaseNotCurrent lost = check.throwsException("Complete with a stale token",
          IdempotencyException.LeaseNotCurrent.class,
          () -> client.complete(ns, "lost", stale.leaseToken(), bytes("x")));
      checkStatus("Complete with a stale token", lost, Status.Code.FAILED_PRECONDITION, "LEASE_LOST");
      check.ok("the message says LEASE_LOST",
          lost != null && lost.getMessage().startsWith("Complete: FAILED_PRECONDITION LEASE_LOST: "));
      check.equal("no field", null, lost == null ? null : lost.field());

      // LEASE_RELEASED and KEY_COMPLETED.
      ClaimResult released = client.claim(ns, "released");
      client.release(ns, "released", released.leaseToken());
      checkStatus("Complete after Release", check.throwsException("Complete after Release",
          IdempotencyException.LeaseNotCurrent.class,
          () -> client.complete(ns, "released", released.leaseToken(), bytes("x"))),
          Status.Code.FAILED_PRECONDITION, "LEASE_RELEASED");
      client.complete(ns, "lost", current.leaseToken(), bytes("x"));
      checkStatus("Release of a completed key", check.throwsException("Release of a completed key",
          IdempotencyException.LeaseNotCurrent.class, () -> client.release(ns, "lost", current.leaseToken())),
          Status.Code.FAILED_PRECONDITION, "KEY_COMPLETED");

      // NOT_FOUND: never claimed (a KeyNotFound, not a KeyExpired).
      IdempotencyException.KeyNotFound missing = check.throwsException("Complete of an unknown key",
          IdempotencyException.KeyNotFound.class,
          () -> client.complete(ns, "never", IdempotencyClient.newLeaseToken(), bytes("x")));
      checkStatus("Complete of an unknown key", missing, Status.Code.NOT_FOUND, "NOT_FOUND");
      check.ok("not a KeyExpired", !(missing instanceof IdempotencyException.KeyExpired));

      // INVALID_ARGUMENT names its field, in BadRequest and in ErrorInfo.
      IdempotencyException.InvalidArgument malformed = check.throwsException("a malformed lease token",
          IdempotencyException.InvalidArgument.class,
          () -> client.claim(ns, "k", ClaimOptions.defaults().leaseToken("not-hex")));
      checkStatus("a malformed lease token", malformed, Status.Code.INVALID_ARGUMENT, "INVALID_ARGUMENT");
      if (malformed != null) {
        check.equal("field", "lease_token", malformed.field());
        check.equal("ErrorInfo's field", "lease_token", malformed.metadata().get("field"));
        check.ok("a description", malformed.fieldDescription() != null);
      }
      IdempotencyException.InvalidArgument empty = check.throwsException("an empty namespace",
          IdempotencyException.InvalidArgument.class, () -> client.claim("", "k"));
      check.equal("an empty namespace: field", "namespace", empty == null ? null : empty.field());

      // The same details, decoded with nothing but grpc-protobuf and the google.rpc classes.
      com.google.rpc.Status details = empty == null ? null : StatusProto.fromThrowable(empty.getCause());
      ErrorInfo info = null;
      BadRequest bad = null;
      try {
        for (Any any : details == null ? List.<Any>of() : details.getDetailsList()) {
          if (any.is(ErrorInfo.class)) {
            info = any.unpack(ErrorInfo.class);
          } else if (any.is(BadRequest.class)) {
            bad = any.unpack(BadRequest.class);
          }
        }
      } catch (com.google.protobuf.InvalidProtocolBufferException malformedDetail) {
        throw new AssertionError(malformedDetail);
      }
      check.equal("StatusProto: ErrorInfo's reason", "INVALID_ARGUMENT", info == null ? null : info.getReason());
      check.equal("StatusProto: ErrorInfo's domain", "idempotency-service", info == null ? null : info.getDomain());
      check.equal("StatusProto: BadRequest's field", "namespace",
          bad == null || bad.getFieldViolationsCount() != 1 ? null : bad.getFieldViolations(0).getField());
    }
  }

  /** The first Claim and the Get of a key completed with a retention of 1 s, once it is remembered. */
  private record Remembered(ClaimResult claim, KeyRecord completed, KeyRecord marker) {}

  /** Completes {@code key} with a retention of 1 s (the least) and waits until Get says it is remembered. */
  private static Remembered remember(Check check, IdempotencyClient client, String ns, String key, byte[] fingerprint) {
    ClaimResult claim = client.claim(ns, key,
        ClaimOptions.defaults().fingerprint(fingerprint).retention(Duration.ofSeconds(1)));
    check.ok(key + ": first Claim: CLAIMED, fencing token 1, not re-executed",
        claim.claimed() && claim.fencingToken() == 1 && claim.completedAt() == null && !claim.reexecuted());
    Instant before = Instant.now();
    client.complete(ns, key, claim.leaseToken(), bytes("\"first\""));
    Instant after = Instant.now();
    KeyRecord completed = client.get(ns, key);
    check.equal(key + ": completed", State.COMPLETED, completed.state());
    check.ok(key + ": completedAt is the Complete's time", completed.completedAt() != null
        && !completed.completedAt().isBefore(before.minusSeconds(1)) && !completed.completedAt().isAfter(after.plusSeconds(1)));
    // The server remembers keys for 7 days unless configured.
    check.equal(key + ": remembered for 7 days", Duration.ofDays(7),
        completed.rememberedUntil() == null ? null : Duration.between(completed.completedAt(), completed.rememberedUntil()));
    KeyRecord[] marker = new KeyRecord[1];
    Cases.until(() -> (marker[0] = client.get(ns, key)).remembered(), Duration.ofSeconds(15),
        key + " to be remembered");
    KeyRecord m = marker[0];
    check.equal(key + ": remembered: ABSENT", State.ABSENT, m.state());
    check.equal(key + ": remembered: fencing token", 1L, m.fencingToken());
    check.equal(key + ": remembered: fingerprint", fingerprint == null ? new byte[0] : fingerprint, m.fingerprint());
    check.equal(key + ": remembered: completedAt", completed.completedAt(), m.completedAt());
    check.equal(key + ": remembered: rememberedUntil", completed.rememberedUntil(), m.rememberedUntil());
    check.equal(key + ": remembered: expiresAt (when the result expired)", completed.expiresAt(), m.expiresAt());
    check.equal(key + ": remembered: no response", new byte[0], m.response());
    return new Remembered(claim, completed, m);
  }

  private void aLateRetryIsRefusedOrReexecuted(String ns) {
    try (IdempotencyClient client = new IdempotencyClient(target)) {
      byte[] fp = Keys.fingerprint(Map.of("order", "o-1"));
      Remembered first = remember(check, client, ns, "k", fp);
      Instant completedAt = first.marker().completedAt();

      // Refused: EXPIRED with when it completed and the last fencing token.
      ClaimResult refused = client.claim(ns, "k", ClaimOptions.defaults().fingerprint(fp).lateRetry(LateRetry.REFUSE));
      check.equal("refused: EXPIRED", Outcome.EXPIRED, refused.outcome());
      check.equal("refused: the last fencing token", 1L, refused.fencingToken());
      check.equal("refused: completedAt", completedAt, refused.completedAt());
      check.ok("refused: no lease, no response, not re-executed",
          refused.leaseToken().isEmpty() && refused.response().length == 0 && !refused.claimed() && !refused.reexecuted());
      // Another payload is a mismatch, not EXPIRED.
      check.equal("a late retry with another payload", Outcome.FINGERPRINT_MISMATCH,
          client.claim(ns, "k", ClaimOptions.defaults().fingerprint(bytes("other")).lateRetry(LateRetry.REFUSE)).outcome());

      // once(), refused: ResultExpired; the work does not run.
      AtomicInteger runs = new AtomicInteger();
      Long[] fencing = new Long[1];
      Instant[] previously = new Instant[1];
      java.util.function.Function<Lease, byte[]> work = lease -> {
        runs.incrementAndGet();
        fencing[0] = lease.fencingToken();
        previously[0] = lease.previouslyCompletedAt();
        return bytes("\"again\"");
      };
      IdempotencyException.ResultExpired expired = check.throwsException("once(), refused",
          IdempotencyException.ResultExpired.class,
          () -> client.onceWithLease(ns, "k", fp, work, OnceOptions.defaults().lateRetry(LateRetry.REFUSE)));
      if (expired != null) {
        check.equal("ResultExpired: completedAt", completedAt, expired.completedAt());
        check.equal("ResultExpired: fencing token", 1L, expired.fencingToken());
        check.equal("ResultExpired: no code", null, expired.code());
      }
      check.equal("once(), refused: the work did not run", 0, runs.get());

      // Remembered: Complete, Release and ExtendLease are KeyExpired, with its times.
      String staleToken = first.claim().leaseToken();
      IdempotencyException.KeyExpired keyExpired = check.throwsException("Complete of a remembered key",
          IdempotencyException.KeyExpired.class, () -> client.complete(ns, "k", staleToken, bytes("late")));
      checkStatus("Complete of a remembered key", keyExpired, Status.Code.NOT_FOUND, "KEY_EXPIRED");
      if (keyExpired != null) {
        check.ok("KeyExpired is a KeyNotFound", keyExpired instanceof IdempotencyException.KeyNotFound);
        check.ok("KeyExpired: completedAt " + keyExpired.completedAt() + " vs " + completedAt,
            sameSecondOrExact(completedAt, keyExpired.completedAt()));
        check.ok("KeyExpired: rememberedUntil " + keyExpired.rememberedUntil() + " vs " + first.marker().rememberedUntil(),
            sameSecondOrExact(first.marker().rememberedUntil(), keyExpired.rememberedUntil()));
      }
      checkStatus("Release of a remembered key", check.throwsException("Release of a remembered key",
          IdempotencyException.KeyExpired.class, () -> client.release(ns, "k", staleToken)),
          Status.Code.NOT_FOUND, "KEY_EXPIRED");
      checkStatus("ExtendLease of a remembered key", check.throwsException("ExtendLease of a remembered key",
          IdempotencyException.KeyExpired.class, () -> client.extendLease(ns, "k", staleToken, null)),
          Status.Code.NOT_FOUND, "KEY_EXPIRED");

      // once(), re-executed: the work runs with the next fencing token.
      OnceResult again = client.onceWithLease(ns, "k", fp, work, OnceOptions.defaults().lateRetry(LateRetry.REEXECUTE));
      check.equal("re-executed: the work's result", "\"again\"", new String(again.value(), StandardCharsets.UTF_8));
      check.ok("re-executed: not a replay; reexecuted()", !again.replayed() && again.claim().reexecuted());
      check.equal("re-executed: fencing token 2", 2L, fencing[0]);
      check.equal("re-executed: previouslyCompletedAt", completedAt, previously[0]);
      check.equal("re-executed: the Claim's completedAt", completedAt, again.claim().completedAt());
      check.equal("re-executed: the work ran once", 1, runs.get());
      ClaimResult replay = client.claim(ns, "k", ClaimOptions.defaults().fingerprint(fp).lateRetry(LateRetry.REFUSE));
      check.ok("then the new result is replayed", replay.outcome() == Outcome.COMPLETED
          && "\"again\"".equals(new String(replay.response(), StandardCharsets.UTF_8)));

      // The server's default policy (re-execute), with claim().
      Remembered other = remember(check, client, ns, "default", null);
      ClaimResult byDefault = client.claim(ns, "default");
      check.ok("the server's default: re-executed", byDefault.claimed() && byDefault.reexecuted());
      check.equal("the server's default: fencing token 2", 2L, byDefault.fencingToken());
      check.equal("the server's default: completedAt", other.marker().completedAt(), byDefault.completedAt());

      // Purge makes a remembered key claimable whatever the policy; the fencing token continues.
      remember(check, client, ns, "purged", null);
      check.ok("Purge of a remembered key: purged", client.purge(ns, "purged", "java test"));
      ClaimResult taken = client.claim(ns, "purged", ClaimOptions.defaults().lateRetry(LateRetry.REFUSE));
      check.ok("a refusing Claim after Purge: CLAIMED", taken.claimed());
      check.equal("a refusing Claim after Purge: fencing token 2", 2L, taken.fencingToken());
    }
  }

  /** The metadata's RFC 3339 times may be rounded to the second. */
  private static boolean sameSecondOrExact(Instant expected, Instant actual) {
    return actual != null && (actual.equals(expected) || actual.equals(expected.truncatedTo(java.time.temporal.ChronoUnit.SECONDS)));
  }

  private static void aServerThatRefusesLateRetries(Check check, String target, String ns) {
    try (IdempotencyClient client = new IdempotencyClient(target)) {
      Remembered key = remember(check, client, ns, "k", null);
      ClaimResult refused = client.claim(ns, "k");
      check.equal("the server refuses: EXPIRED", Outcome.EXPIRED, refused.outcome());
      check.equal("the server refuses: fencing token 1", 1L, refused.fencingToken());
      check.equal("the server refuses: completedAt", key.marker().completedAt(), refused.completedAt());
      IdempotencyException.ResultExpired expired = check.throwsException("once() on a refusing server",
          IdempotencyException.ResultExpired.class, () -> client.once(ns, "k", null, () -> bytes("x")));
      check.equal("once() on a refusing server: completedAt", key.marker().completedAt(),
          expired == null ? null : expired.completedAt());
      // The caller's policy wins over the server's.
      ClaimResult again = client.claim(ns, "k", ClaimOptions.defaults().lateRetry(LateRetry.REEXECUTE));
      check.ok("re-execute asked of a refusing server", again.reexecuted() && again.fencingToken() == 2);
    }
  }

  /** Records every attempt: when it started and ended, its code and its RetryInfo delay. */
  private static final class Timeline implements ClientInterceptor {
    record Attempt(long startNanos, long endNanos, Status.Code code, Duration retryDelay) {}

    private final List<Attempt> attempts = new ArrayList<>();

    synchronized List<Attempt> attempts() {
      return List.copyOf(attempts);
    }

    @Override
    public <Q, R> ClientCall<Q, R> interceptCall(MethodDescriptor<Q, R> method, CallOptions options, Channel next) {
      return new ForwardingClientCall.SimpleForwardingClientCall<>(next.newCall(method, options)) {
        @Override
        public void start(Listener<R> listener, Metadata headers) {
          long start = System.nanoTime();
          super.start(new ForwardingClientCallListener.SimpleForwardingClientCallListener<>(listener) {
            @Override
            public void onClose(Status status, Metadata trailers) {
              long end = System.nanoTime();
              Duration delay = IdempotencyException.Details.of(status.asRuntimeException(trailers)).retryDelay;
              synchronized (Timeline.this) {
                attempts.add(new Attempt(start, end, status.getCode(), delay));
              }
              super.onClose(status, trailers);
            }
          }, headers);
        }
      };
    }
  }

  private static void aRateLimitedCallCarriesItsRetryDelay(Check check, String target, String token) {
    // Without retries: the calls past the limit are RATE_LIMITED, with the time
    // until the limiter allows the next call (at most 1/2 s at 2 a second).
    try (IdempotencyClient client = IdempotencyClient.builder(target).token(token).retry(RetryPolicy.none()).build()) {
      IdempotencyException.ResourceExhausted limited = null;
      for (int i = 0; i < 10 && limited == null; i++) {
        try {
          client.get("java-rate/a", "k");
        } catch (IdempotencyException.ResourceExhausted error) {
          limited = error;
        }
      }
      check.ok("10 Gets in a row at 2 a second: one is rate limited", limited != null);
      if (limited != null) {
        check.equal("rate limited: reason", "RATE_LIMITED", limited.reason());
        check.ok("rate limited: a retry delay in (0, 0.5 s]: " + limited.retryDelay(), limited.retryDelay() != null
            && !limited.retryDelay().isZero() && limited.retryDelay().compareTo(Duration.ofMillis(500)) <= 0);
      }
    }
    // With retries: every call succeeds, and no retry comes sooner than the server said.
    Timeline timeline = new Timeline();
    try (IdempotencyClient client = IdempotencyClient.builder(target).token(token).interceptors(timeline).build()) {
      for (int i = 0; i < 5; i++) {
        client.get("java-rate/a", "k");
      }
    }
    List<Timeline.Attempt> attempts = timeline.attempts();
    int retried = 0;
    for (int i = 0; i + 1 < attempts.size(); i++) {
      Timeline.Attempt failed = attempts.get(i);
      if (failed.code() != Status.Code.RESOURCE_EXHAUSTED) {
        continue;
      }
      retried++;
      long pause = attempts.get(i + 1).startNanos() - failed.endNanos();
      check.ok("a retry " + pause / 1_000_000 + " ms after RATE_LIMITED, delay " + failed.retryDelay(),
          failed.retryDelay() != null && pause >= failed.retryDelay().toNanos());
    }
    check.ok("5 Gets in a row at 2 a second were retried", retried > 0);
    check.equal("the last attempt succeeded", Status.Code.OK, attempts.get(attempts.size() - 1).code());
  }
}
