package idempotency.client;

import idempotency.v1.Idempotency;
import io.grpc.Status;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.HashSet;
import java.util.List;
import java.util.Set;
import java.util.concurrent.atomic.AtomicInteger;

/**
 * Retries and the retry-safe Claim against a real server: a Claim whose answer
 * was lost (it reached the server, which gave the lease; the caller saw
 * UNAVAILABLE) is retried with the same lease token and gets the same lease
 * back ({@code retried}), instead of IN_PROGRESS against itself until the
 * lease runs out; the same for Complete, Release and ExtendLease; what is
 * retried and what is not, within the deadline; several addresses. The
 * counterpart of the Python suite's test_lost_answer.py and test_retry.py.
 */
final class RetryTest {
  private final Cases cases;
  private final Check check;
  private final String target;
  private final String store;

  RetryTest(Cases cases, String target, String store) {
    this.cases = cases;
    this.check = cases.check;
    this.target = target;
    this.store = store;
  }

  void runAll() {
    cases.run(store + ": a claim whose answer was lost is retried and gets the same lease",
        this::aClaimWhoseAnswerWasLostIsRetriedAndGetsTheSameLease);
    cases.run(store + ": once rides over a lost claim answer and runs the work once",
        this::onceRidesOverALostClaimAnswerAndRunsTheWorkOnce);
    cases.run(store + ": a lost answer of complete, release or extendLease is retried to OK",
        this::aLostAnswerOfCompleteReleaseOrExtendLeaseIsRetriedToOk);
    cases.run(store + ": the dropped answer reached the server",
        this::theDroppedAnswerReachedTheServer);
    cases.run(store + ": a claim repeating the holder's token gets the same lease and others are in progress",
        this::aClaimRepeatingTheHoldersTokenGetsTheSameLease);
    cases.run(store + ": every claim sends a new token, and a malformed one is refused",
        this::everyClaimSendsANewTokenAndAMalformedOneIsRefused);
    cases.run(store + ": a retryable failure is retried up to maxAttempts, the error says how many",
        this::aRetryableFailureIsRetriedUpToMaxAttempts);
    cases.run(store + ": a verdict on the request is never retried",
        this::aVerdictOnTheRequestIsNeverRetried);
    cases.run(store + ": retries stop at the call's deadline", this::retriesStopAtTheCallsDeadline);
    cases.run(store + ": calls go on when one of several addresses does not answer",
        this::callsGoOnWhenOneOfSeveralAddressesDoesNotAnswer);
    cases.run(store + ": a dns:/// target works", this::aDnsTargetWorks);
  }

  /** The policy's arithmetic and the parsing of targets: no server needed. */
  static void runUnitChecks(Cases cases) {
    Check check = cases.check;
    cases.run("the backoff is capped, exponential, with full jitter", namespace -> {
      RetryPolicy policy = RetryPolicy.defaults();
      check.equal("cap 1", Duration.ofMillis(50), policy.backoffCap(1));
      check.equal("cap 2", Duration.ofMillis(100), policy.backoffCap(2));
      check.equal("cap 6", Duration.ofMillis(1600), policy.backoffCap(6));
      check.equal("cap 7", Duration.ofSeconds(2), policy.backoffCap(7));
      check.equal("cap 1000 (no overflow)", Duration.ofSeconds(2), policy.backoffCap(1000));
      boolean within = true;
      Set<Long> seen = new HashSet<>();
      for (int i = 0; i < 1000; i++) {
        Duration pause = policy.backoff(3);
        within &= !pause.isNegative() && pause.compareTo(Duration.ofMillis(200)) <= 0;
        seen.add(pause.toNanos());
      }
      check.ok("every pause within [0, cap]", within);
      check.ok("pauses are jittered", seen.size() > 900);
      check.equal("defaults: 10 attempts", 10, policy.maxAttempts());
      check.equal("defaults: the retried codes", Set.of(Status.Code.UNAVAILABLE, Status.Code.RESOURCE_EXHAUSTED,
          Status.Code.DEADLINE_EXCEEDED), policy.retryableCodes());
      check.equal("none(): one attempt", 1, RetryPolicy.none().maxAttempts());
      check.throwsException("maxAttempts 0 refused", IllegalArgumentException.class,
          () -> RetryPolicy.defaults().maxAttempts(0));
      check.throwsException("perAttemptTimeout 0 refused", IllegalArgumentException.class,
          () -> RetryPolicy.defaults().perAttemptTimeout(Duration.ZERO));
      check.throwsException("multiplier < 1 refused", IllegalArgumentException.class,
          () -> RetryPolicy.defaults().multiplier(0.5));
    });
    cases.run("targets: a list, or a string with commas", namespace -> {
      check.equal("comma string", List.of("10.0.0.1:1", "10.0.0.2:2"),
          IdempotencyClient.parseTargets(" 10.0.0.1:1 , 10.0.0.2:2 ,"));
      check.equal("one dns target", List.of("dns:///idempotency.internal:50051"),
          IdempotencyClient.parseTargets("dns:///idempotency.internal:50051"));
      check.equal("list", List.of("a:1", "b:2"), IdempotencyClient.parseTargets(List.of("a:1", " b:2")));
      check.throwsException("no address", IllegalArgumentException.class, () -> IdempotencyClient.parseTargets(" , "));
      Set<String> tokens = new HashSet<>();
      for (int i = 0; i < 100; i++) {
        tokens.add(IdempotencyClient.newLeaseToken());
      }
      check.equal("100 distinct tokens", 100, tokens.size());
      check.ok("each 32 lowercase hex characters", tokens.stream().allMatch(t -> t.matches("[0-9a-f]{32}")));
    });
  }

  private IdempotencyClient client(Interceptors.Recorder interceptor) {
    return IdempotencyClient.builder(target).interceptors(interceptor).build();
  }

  private static byte[] bytes(String text) {
    return text.getBytes(StandardCharsets.UTF_8);
  }

  private void aClaimWhoseAnswerWasLostIsRetriedAndGetsTheSameLease(String ns) {
    Interceptors.DropAnswers drop = new Interceptors.DropAnswers("Claim", 1);
    try (IdempotencyClient client = client(drop)) {
      ClaimResult claim = client.claim(ns, "k", null, Duration.ofSeconds(30), null);
      check.equal("two Claim attempts", 2, drop.count("Claim", null));
      check.equal("the first answer was dropped", 1, drop.dropped().size());
      Idempotency.ClaimResponse dropped = (Idempotency.ClaimResponse) drop.dropped().get(0);
      check.equal("claimed", Outcome.CLAIMED, claim.outcome());
      check.ok("retried", claim.retried());
      check.ok("the dropped answer was not a retry", !dropped.getRetried());
      check.equal("the same lease token", dropped.getLeaseToken(), claim.leaseToken());
      check.equal("the same fencing token", dropped.getFencingToken(), claim.fencingToken());
      check.equal("fencing token 1", 1L, claim.fencingToken());
      check.equal("the same lease expiry", IdempotencyClient.toInstant(dropped.getLeaseExpiresAt()), claim.leaseExpiresAt());
      client.complete(ns, "k", claim.leaseToken(), bytes("done"));
      check.equal("completed", State.COMPLETED, client.get(ns, "k").state());
    }
  }

  private void onceRidesOverALostClaimAnswerAndRunsTheWorkOnce(String ns) {
    Interceptors.DropAnswers drop = new Interceptors.DropAnswers("Claim", 1);
    AtomicInteger runs = new AtomicInteger();
    try (IdempotencyClient client = client(drop)) {
      OnceResult result = client.onceWithDetails(ns, "k", null, () -> {
        runs.incrementAndGet();
        return bytes("ok");
      }, OnceOptions.defaults());
      check.equal("the work ran once", 1, runs.get());
      check.equal("its result", bytes("ok"), result.value());
      check.ok("the Claim was a retry", result.claim().retried());
      check.equal("fencing token 1", 1L, result.claim().fencingToken());
      check.equal("replayed afterwards", bytes("ok"), client.once(ns, "k", null, () -> {
        runs.incrementAndGet();
        return bytes("again");
      }));
      check.equal("and not run again", 1, runs.get());
    }
  }

  private void aLostAnswerOfCompleteReleaseOrExtendLeaseIsRetriedToOk(String ns) {
    for (String method : List.of("Complete", "Release", "ExtendLease")) {
      Interceptors.DropAnswers drop = new Interceptors.DropAnswers(method, 1);
      try (IdempotencyClient client = client(drop)) {
        String key = "k-" + method;
        ClaimResult claim = client.claim(ns, key);
        if (method.equals("Complete")) {
          client.complete(ns, key, claim.leaseToken(), bytes("r"));
          check.equal("Complete: stored", bytes("r"), client.get(ns, key).response());
        } else if (method.equals("Release")) {
          client.release(ns, key, claim.leaseToken());
          check.equal("Release: released", State.RELEASED, client.get(ns, key).state());
        } else {
          client.extendLease(ns, key, claim.leaseToken(), Duration.ofSeconds(60));
          check.ok("ExtendLease: extended", client.get(ns, key).leaseExpiresAt().isAfter(claim.leaseExpiresAt()));
        }
        check.equal(method + ": two attempts", 2, drop.count(method, null));
        check.equal(method + ": one answer dropped", 1, drop.dropped().size());
      }
    }
  }

  private void theDroppedAnswerReachedTheServer(String ns) {
    Interceptors.DropAnswers drop = new Interceptors.DropAnswers("Claim", 1);
    try (IdempotencyClient dropping = IdempotencyClient.builder(target).interceptors(drop).retry(RetryPolicy.none()).build();
        IdempotencyClient client = new IdempotencyClient(target)) {
      IdempotencyException.Unavailable error = check.throwsException("UNAVAILABLE without retries",
          IdempotencyException.Unavailable.class, () -> dropping.claim(ns, "k"));
      check.equal("one attempt", 1, error == null ? -1 : error.attempts());
      KeyRecord record = client.get(ns, "k");
      check.equal("the Claim took the lease", State.IN_PROGRESS, record.state());
      check.equal("fencing token 1", 1L, record.fencingToken());
    }
  }

  private void aClaimRepeatingTheHoldersTokenGetsTheSameLease(String ns) {
    try (IdempotencyClient client = new IdempotencyClient(target)) {
      String token = IdempotencyClient.newLeaseToken();
      ClaimResult first = client.claim(ns, "k", ClaimOptions.defaults().leaseToken(token));
      check.equal("claimed", Outcome.CLAIMED, first.outcome());
      check.equal("with the caller's token", token, first.leaseToken());
      check.ok("not a retry", !first.retried());
      ClaimResult again = client.claim(ns, "k", ClaimOptions.defaults().leaseToken(token));
      check.ok("again: a retry", again.retried());
      check.equal("again: the same token", token, again.leaseToken());
      check.equal("again: the same fencing token", first.fencingToken(), again.fencingToken());
      check.equal("again: the same lease expiry", first.leaseExpiresAt(), again.leaseExpiresAt());
      check.equal("again: the same record expiry", first.expiresAt(), again.expiresAt());
      ClaimResult other = client.claim(ns, "k");
      check.equal("another token: in progress", Outcome.IN_PROGRESS, other.outcome());
      check.equal("another token: no token", "", other.leaseToken());
    }
  }

  private void everyClaimSendsANewTokenAndAMalformedOneIsRefused(String ns) {
    try (IdempotencyClient client = new IdempotencyClient(target)) {
      ClaimResult a = client.claim(ns, "a");
      ClaimResult b = client.claim(ns, "b");
      check.ok("tokens differ", !a.leaseToken().equals(b.leaseToken()));
      check.ok("a token is 32 lowercase hex", a.leaseToken().matches("[0-9a-f]{32}"));
      IdempotencyException.InvalidArgument invalid = check.throwsException("a malformed token",
          IdempotencyException.InvalidArgument.class,
          () -> client.claim(ns, "k", ClaimOptions.defaults().leaseToken("not-hex")));
      check.ok("names lease_token", invalid != null && invalid.getMessage().contains("lease_token"));
      check.equal("not retried", 1, invalid == null ? -1 : invalid.attempts());
    }
  }

  private void aRetryableFailureIsRetriedUpToMaxAttempts(String ns) {
    Interceptors.FailCalls failing = new Interceptors.FailCalls("Get", Status.Code.UNAVAILABLE);
    RetryPolicy policy = RetryPolicy.defaults().maxAttempts(3).initialBackoff(Duration.ofMillis(1));
    try (IdempotencyClient client = IdempotencyClient.builder(target).interceptors(failing).retry(policy).build()) {
      IdempotencyException.Unavailable error = check.throwsException("Unavailable after the attempts",
          IdempotencyException.Unavailable.class, () -> client.get(ns, "k"));
      check.equal("three attempts", 3, failing.count("Get", Status.Code.UNAVAILABLE));
      check.equal("attempts() says so", 3, error == null ? -1 : error.attempts());
      check.ok("and the message", error != null && error.getMessage().contains("(after 3 attempts)"));
      check.equal("other calls go through", Outcome.CLAIMED, client.claim(ns, "k").outcome());
    }
    Interceptors.FailCalls exhausted = new Interceptors.FailCalls("Get", Status.Code.RESOURCE_EXHAUSTED);
    try (IdempotencyClient client = IdempotencyClient.builder(target).interceptors(exhausted).retry(policy).build()) {
      check.throwsException("ResourceExhausted after the attempts", IdempotencyException.ResourceExhausted.class,
          () -> client.get(ns, "k"));
      check.equal("RESOURCE_EXHAUSTED: three attempts", 3, exhausted.count("Get", null));
    }
    Interceptors.FailCalls off = new Interceptors.FailCalls("Get", Status.Code.UNAVAILABLE);
    try (IdempotencyClient client = IdempotencyClient.builder(target).interceptors(off).retry(RetryPolicy.none()).build()) {
      check.throwsException("retries off", IdempotencyException.Unavailable.class, () -> client.get(ns, "k"));
      check.equal("retries off: one attempt", 1, off.count("Get", null));
    }
  }

  private void aVerdictOnTheRequestIsNeverRetried(String ns) {
    Interceptors.FailCalls failing = new Interceptors.FailCalls("Get", Status.Code.INVALID_ARGUMENT);
    Interceptors.Counting counting = new Interceptors.Counting();
    try (IdempotencyClient client = IdempotencyClient.builder(target).interceptors(failing, counting).build()) {
      check.throwsException("INVALID_ARGUMENT", IdempotencyException.InvalidArgument.class, () -> client.get(ns, "k"));
      check.equal("INVALID_ARGUMENT: one attempt", 1, failing.count("Get", null));
      ClaimResult claim = client.claim(ns, "k");
      client.release(ns, "k", claim.leaseToken());
      client.claim(ns, "k");
      IdempotencyException.LeaseNotCurrent stale = check.throwsException("FAILED_PRECONDITION",
          IdempotencyException.LeaseNotCurrent.class, () -> client.complete(ns, "k", claim.leaseToken(), bytes("x")));
      check.equal("FAILED_PRECONDITION: one attempt", 1, stale == null ? -1 : stale.attempts());
      check.equal("FAILED_PRECONDITION: one Complete sent", 1, counting.count("Complete", null));
      check.throwsException("NOT_FOUND", IdempotencyException.KeyNotFound.class,
          () -> client.release(ns, "absent", IdempotencyClient.newLeaseToken()));
      check.equal("NOT_FOUND: one Release sent", 1, counting.count("Release", Status.Code.NOT_FOUND));
    }
  }

  private void retriesStopAtTheCallsDeadline(String ns) {
    Interceptors.FailCalls failing = new Interceptors.FailCalls("Get", Status.Code.UNAVAILABLE);
    RetryPolicy policy = RetryPolicy.defaults().maxAttempts(100_000).initialBackoff(Duration.ofMillis(5))
        .maxBackoff(Duration.ofMillis(20));
    try (IdempotencyClient client = IdempotencyClient.builder(target).interceptors(failing).retry(policy)
        .callTimeout(Duration.ofMillis(500)).build()) {
      IdempotencyException.Unavailable error = check.throwsException("Unavailable at the deadline",
          IdempotencyException.Unavailable.class, () -> client.get(ns, "k"));
      int attempts = error == null ? -1 : error.attempts();
      check.ok("several attempts, far fewer than maxAttempts (" + attempts + ")", attempts > 1 && attempts < 100_000);
      check.equal("every attempt counted", attempts, failing.count("Get", null));
    }
  }

  private void callsGoOnWhenOneOfSeveralAddressesDoesNotAnswer(String ns) {
    String dead = "127.0.0.1:" + ServerProcess.freePort(); // nothing listens there
    Interceptors.Counting counting = new Interceptors.Counting();
    try (IdempotencyClient client = IdempotencyClient.builder(dead + "," + target).interceptors(counting).build()) {
      check.equal("two addresses", List.of(dead, target), client.targets());
      for (int i = 0; i < 20; i++) {
        String value = "v" + i;
        check.equal("once " + i, bytes(value), client.once(ns, "k" + i, null, () -> bytes(value)));
      }
      check.equal("a Claim and a Complete each answered", 40, counting.count(null, Status.Code.OK));
      int failed = counting.count(null, Status.Code.UNAVAILABLE);
      check.ok("the dead address is passed over once known to fail (" + failed + " UNAVAILABLE)", failed <= 10);
    }
  }

  private void aDnsTargetWorks(String ns) {
    String port = target.substring(target.lastIndexOf(':') + 1);
    try (IdempotencyClient client = new IdempotencyClient("dns:///localhost:" + port)) {
      ClaimResult claim = client.claim(ns, "k");
      check.equal("claimed through dns:///localhost", Outcome.CLAIMED, claim.outcome());
      client.complete(ns, "k", claim.leaseToken(), bytes("r"));
      check.equal("replayed", Outcome.COMPLETED, client.claim(ns, "k").outcome());
    }
  }
}
