package idempotency.client;

import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.function.Function;

/**
 * once() meeting a holder (OUTCOME_IN_PROGRESS) waits for it: against the real
 * server each Claim asks to wait (ClaimRequest.wait) and gets the stored
 * result, or the lease when the holder releases or vanishes, in one Claim
 * ({@code waited} set). Through a {@link Relay} that clears the field, as a
 * server that predates it would, once() sees {@code waited} unset, falls back
 * to polling and still gets the right outcome.
 */
final class WaitTest {
  /** How many once() callers meet the holder at the same time. */
  private static final int WAITERS = 16;
  /** How long the holder's work takes once every waiter has sent its Claim. */
  private static final long WORK_MILLIS = 200;

  private final Cases cases;
  private final Check check;
  private final String serverTarget;
  private final String store;

  WaitTest(Cases cases, String serverTarget, String store) {
    this.cases = cases;
    this.check = cases.check;
    this.serverTarget = serverTarget;
    this.store = store;
  }

  void runAll() {
    cases.run(store + ": once() callers meeting a holder that completes all get its result, waiting on the server",
        ns -> callersMeetingAHolderThatCompletesAllGetItsResult(ns, null));
    cases.run(store + ": a holder that releases hands the key to one waiter, whose result the others get",
        ns -> aHolderThatReleasesHandsTheKeyToOneWaiter(ns, null));
    cases.run(store + ": once() waits for a holder whose lease runs out and takes the key over with its checkpoint",
        ns -> onceTakesOverAHolderWhoseLeaseRunsOut(ns, null));
    cases.run(store + ": once()'s wait runs out: InProgress", ns -> oncesWaitRunsOut(ns, null));
    cases.run(store + ": claim() with a wait gets the result, the lease, or IN_PROGRESS when it runs out",
        this::aPlainClaimCanWait);
    try (Relay relay = Relay.start(serverTarget)) {
      cases.run(store + " behind a relay that clears wait: once() callers poll and all get the holder's result",
          ns -> callersMeetingAHolderThatCompletesAllGetItsResult(ns, relay));
      cases.run(store + " behind a relay that clears wait: a holder that releases hands the key to one poller",
          ns -> aHolderThatReleasesHandsTheKeyToOneWaiter(ns, relay));
      cases.run(store + " behind a relay that clears wait: once() polls until a holder's lease runs out",
          ns -> onceTakesOverAHolderWhoseLeaseRunsOut(ns, relay));
      cases.run(store + " behind a relay that clears wait: once()'s wait runs out: InProgress",
          ns -> oncesWaitRunsOut(ns, relay));
      cases.run(store + " behind a relay that clears wait: claim() answers at once, waited unset",
          ns -> aPlainClaimBehindTheRelayAnswersAtOnce(ns, relay));
      cases.run(store + " behind a relay: once() with THROW does not ask to wait",
          ns -> onceWithThrowDoesNotAskToWait(ns, relay));
    }
  }

  private static byte[] bytes(String text) {
    return text.getBytes(StandardCharsets.UTF_8);
  }

  private static String text(byte[] bytes) {
    return bytes == null ? null : new String(bytes, StandardCharsets.UTF_8);
  }

  /** N once() calls on their own threads, each result or error kept in its slot. */
  private static final class Waiters {
    final Object[] outcomes = new Object[WAITERS];
    private final List<Thread> threads = new ArrayList<>();

    Waiters(IdempotencyClient client, String ns, String key, Function<Lease, byte[]> work, OnceOptions options) {
      for (int i = 0; i < WAITERS; i++) {
        int slot = i;
        Thread thread = new Thread(() -> {
          try {
            outcomes[slot] = client.onceWithLease(ns, key, null, work, options);
          } catch (Throwable error) {
            outcomes[slot] = error;
          }
        }, "waiter-" + i);
        threads.add(thread);
        thread.start();
      }
    }

    List<OnceResult> results() throws InterruptedException {
      List<OnceResult> results = new ArrayList<>();
      for (int i = 0; i < WAITERS; i++) {
        threads.get(i).join(TimeUnit.SECONDS.toMillis(60));
        if (!(outcomes[i] instanceof OnceResult)) {
          throw new AssertionError("waiter " + i + " ended with " + outcomes[i], (Throwable) (
              outcomes[i] instanceof Throwable ? outcomes[i] : null));
        }
        results.add((OnceResult) outcomes[i]);
      }
      return results;
    }
  }

  /**
   * Until every waiter has met the holder: its Claim was answered IN_PROGRESS
   * (polling, behind the relay), or sent (a Claim that waits is not answered
   * until the holder is done; WORK_MILLIS after it was sent, it is waiting on
   * the server). How many Claims each waiter makes does not depend on it
   * (one, when the server waits); only how long they wait does.
   */
  private static void untilEveryWaiterMetTheHolder(Interceptors.Counting counting, Relay relay) {
    if (relay == null) {
      Cases.until(() -> counting.started("Claim") >= WAITERS, Duration.ofSeconds(30), "every waiter's Claim sent");
    } else {
      Cases.until(() -> counting.count("Claim", io.grpc.Status.Code.OK) >= WAITERS, Duration.ofSeconds(30),
          "every waiter's first Claim answered");
    }
  }

  private IdempotencyClient waitersClient(Relay relay, Interceptors.Counting counting) {
    return IdempotencyClient.builder(relay == null ? serverTarget : relay.target()).interceptors(counting).build();
  }

  private static int countWaited(List<OnceResult> results) {
    return (int) results.stream().filter(r -> r.claim().waited() != null).count();
  }

  private void callersMeetingAHolderThatCompletesAllGetItsResult(String ns, Relay relay) throws Exception {
    Interceptors.Counting counting = new Interceptors.Counting();
    AtomicInteger runs = new AtomicInteger();
    CountDownLatch holding = new CountDownLatch(1);
    int relayedBefore = relay == null ? 0 : relay.claims.get();
    int askedBefore = relay == null ? 0 : relay.claimsAskingToWait.get();
    try (IdempotencyClient holderClient = new IdempotencyClient(serverTarget);
        IdempotencyClient client = waitersClient(relay, counting)) {
      Object[] holderOutcome = new Object[1];
      Thread holder = new Thread(() -> {
        try {
          holderOutcome[0] = holderClient.once(ns, "k", null, () -> {
            runs.incrementAndGet();
            holding.countDown();
            // The work ends WORK_MILLIS after every waiter has met it.
            untilEveryWaiterMetTheHolder(counting, relay);
            ServerProcess.pause(WORK_MILLIS);
            return bytes("the holder's result");
          });
        } catch (Throwable error) {
          holderOutcome[0] = error;
        }
      }, "holder");
      holder.start();
      check.ok("the holder holds the key", holding.await(30, TimeUnit.SECONDS));
      Waiters waiters = new Waiters(client, ns, "k", lease -> {
        runs.incrementAndGet();
        return bytes("a waiter's result");
      }, OnceOptions.defaults().waitTimeout(Duration.ofSeconds(30)));
      List<OnceResult> results = waiters.results();
      holder.join(TimeUnit.SECONDS.toMillis(60));
      check.equal("the holder completed", "the holder's result",
          holderOutcome[0] instanceof byte[] ? text((byte[]) holderOutcome[0]) : String.valueOf(holderOutcome[0]));
      check.equal("the work ran once", 1, runs.get());
      check.ok("every waiter got the holder's result, replayed",
          results.stream().allMatch(r -> r.replayed() && text(r.value()).equals("the holder's result")));
      int claims = counting.count("Claim", null);
      if (relay == null) {
        check.equal("every waiter's Claim says it waited (waited set)", WAITERS, countWaited(results));
        check.equal("one Claim per waiter", WAITERS, claims);
        long waitedLong = results.stream()
            .filter(r -> r.claim().waited() != null && !r.claim().waited().isZero()).count();
        System.out.printf("     (%d Claims for %d waiters; %d waited on the server for the Complete)%n",
            claims, WAITERS, waitedLong);
      } else {
        check.equal("no answer says it waited (the relay cleared wait)", 0, countWaited(results));
        check.equal("each waiter asked to wait once, then polled", WAITERS,
            relay.claimsAskingToWait.get() - askedBefore);
        check.ok("polling: at least two Claims per waiter (" + claims + ")", claims >= 2 * WAITERS);
        check.equal("the relay saw every Claim", claims, relay.claims.get() - relayedBefore);
        System.out.printf("     (%d Claims for %d pollers)%n", claims, WAITERS);
      }
    }
  }

  private void aHolderThatReleasesHandsTheKeyToOneWaiter(String ns, Relay relay) throws Exception {
    Interceptors.Counting counting = new Interceptors.Counting();
    AtomicInteger runs = new AtomicInteger();
    List<String> received = Collections.synchronizedList(new ArrayList<>());
    try (IdempotencyClient holderClient = new IdempotencyClient(serverTarget);
        IdempotencyClient client = waitersClient(relay, counting)) {
      ClaimResult held = holderClient.claim(ns, "k", null, Duration.ofSeconds(30), null);
      check.ok("held", held.claimed());
      Waiters waiters = new Waiters(client, ns, "k", lease -> {
        runs.incrementAndGet();
        received.add(text(lease.checkpoint()) + "@" + lease.checkpointFencingToken() + " fencing=" + lease.fencingToken());
        return bytes("the taker's result");
      }, OnceOptions.defaults().waitTimeout(Duration.ofSeconds(30)));
      untilEveryWaiterMetTheHolder(counting, relay);
      ServerProcess.pause(WORK_MILLIS); // the holder's failed attempt takes this long
      holderClient.release(ns, "k", held.leaseToken(), bytes("half done"));
      List<OnceResult> results = waiters.results();
      check.equal("one waiter ran the work", 1, runs.get());
      check.equal("with the holder's checkpoint", List.of("half done@1 fencing=2"), List.copyOf(received));
      check.equal("one result not replayed", 1L, results.stream().filter(r -> !r.replayed()).count());
      check.ok("every waiter got the taker's result",
          results.stream().allMatch(r -> text(r.value()).equals("the taker's result")));
      int claims = counting.count("Claim", null);
      if (relay == null) {
        check.equal("every Claim says it waited", WAITERS, countWaited(results));
        check.equal("one Claim per waiter", WAITERS, claims);
      } else {
        check.equal("no answer says it waited", 0, countWaited(results));
        check.ok("polling: at least two Claims per waiter (" + claims + ")", claims >= 2 * WAITERS);
      }
      System.out.printf("     (%d Claims for %d callers)%n", claims, WAITERS);
    }
  }

  private void onceTakesOverAHolderWhoseLeaseRunsOut(String ns, Relay relay) {
    Interceptors.Counting counting = new Interceptors.Counting();
    try (IdempotencyClient holderClient = new IdempotencyClient(serverTarget);
        IdempotencyClient client = waitersClient(relay, counting)) {
      ClaimResult held = holderClient.claim(ns, "k", null, Duration.ofSeconds(1), null);
      holderClient.extendLease(ns, "k", held.leaseToken(), Duration.ofSeconds(1), bytes("step 1"));
      // The holder vanishes: no Complete, no Release; its lease runs out in 1 s.
      List<String> received = new ArrayList<>();
      OnceResult result = client.onceWithLease(ns, "k", null, lease -> {
        received.add(text(lease.checkpoint()) + "@" + lease.checkpointFencingToken());
        return bytes("taken over");
      }, OnceOptions.defaults().waitTimeout(Duration.ofSeconds(20)));
      check.ok("ran the work", !result.replayed());
      check.equal("fencing token 2", 2L, result.claim().fencingToken());
      check.equal("with the vanished holder's checkpoint", List.of("step 1@1"), received);
      int claims = counting.count("Claim", null);
      if (relay == null) {
        check.ok("waited on the server", result.claim().waited() != null && !result.claim().waited().isZero());
        check.equal("in one Claim", 1, claims);
      } else {
        check.equal("waited unset", null, result.claim().waited());
        check.ok("polled (" + claims + " Claims)", claims >= 2);
      }
    }
  }

  private void oncesWaitRunsOut(String ns, Relay relay) {
    Interceptors.Counting counting = new Interceptors.Counting();
    int askedBefore = relay == null ? 0 : relay.claimsAskingToWait.get();
    try (IdempotencyClient holderClient = new IdempotencyClient(serverTarget);
        IdempotencyClient client = waitersClient(relay, counting)) {
      ClaimResult held = holderClient.claim(ns, "k", null, Duration.ofSeconds(30), null);
      AtomicInteger runs = new AtomicInteger();
      IdempotencyException.InProgress error = check.throwsException("InProgress", IdempotencyException.InProgress.class,
          () -> client.once(ns, "k", null, () -> {
            runs.incrementAndGet();
            return bytes("x");
          }, OnceOptions.defaults().waitTimeout(Duration.ofMillis(500))));
      check.equal("the work did not run", 0, runs.get());
      check.ok("says it waited", error != null && error.getMessage().contains("waited PT0.5S"));
      check.equal("the holder's lease expiry", held.leaseExpiresAt(), error == null ? null : error.leaseExpiresAt());
      int claims = counting.count("Claim", null);
      if (relay == null) {
        check.ok("one or two Claims, waiting on the server (" + claims + ")", claims >= 1 && claims <= 2);
      } else {
        check.ok("polling: more than one Claim (" + claims + ")", claims >= 2);
        check.equal("only the first asked to wait", 1, relay.claimsAskingToWait.get() - askedBefore);
      }
      check.equal("the lease is untouched", State.IN_PROGRESS, holderClient.get(ns, "k").state());
    }
  }

  private void aPlainClaimCanWait(String ns) throws Exception {
    Interceptors.Counting counting = new Interceptors.Counting();
    try (IdempotencyClient client = IdempotencyClient.builder(serverTarget).interceptors(counting).build()) {
      ClaimResult free = client.claim(ns, "free", ClaimOptions.defaults().waitFor(Duration.ofSeconds(5)));
      check.equal("a free key: claimed at once", Outcome.CLAIMED, free.outcome());
      check.equal("waited zero", Duration.ZERO, free.waited());
      check.equal("no wait asked: waited unset", null, client.claim(ns, "other").waited());

      ClaimResult held = client.claim(ns, "k", null, Duration.ofSeconds(30), null);
      int before = counting.started("Claim");
      ClaimResult[] waited = new ClaimResult[1];
      Thread waiter = new Thread(() -> waited[0] = client.claim(ns, "k",
          ClaimOptions.defaults().waitFor(Duration.ofSeconds(20))), "waiting-claim");
      waiter.start();
      Cases.until(() -> counting.started("Claim") > before, Duration.ofSeconds(10), "the waiting Claim to be sent");
      ServerProcess.pause(WORK_MILLIS);
      client.complete(ns, "k", held.leaseToken(), bytes("done"));
      waiter.join(TimeUnit.SECONDS.toMillis(30));
      check.equal("the waiting Claim: completed", Outcome.COMPLETED, waited[0] == null ? null : waited[0].outcome());
      check.equal("with the stored response", "done", waited[0] == null ? null : text(waited[0].response()));
      check.ok("waited set", waited[0] != null && waited[0].waited() != null);

      ClaimResult other = client.claim(ns, "short", null, Duration.ofSeconds(30), null);
      ClaimResult timedOut = client.claim(ns, "short", ClaimOptions.defaults().waitFor(Duration.ofMillis(300)));
      check.equal("a short wait runs out: in progress", Outcome.IN_PROGRESS, timedOut.outcome());
      check.ok("waited set and above zero", timedOut.waited() != null && !timedOut.waited().isZero());
      check.equal("the holder's lease expiry", other.leaseExpiresAt(), timedOut.leaseExpiresAt());
      check.ok("retry_after given", timedOut.retryAfter() != null);

      IdempotencyException.InvalidArgument invalid = check.throwsException("a negative wait",
          IdempotencyException.InvalidArgument.class,
          () -> client.claim(ns, "k2", ClaimOptions.defaults().waitFor(Duration.ofMillis(-1))));
      check.ok("names wait", invalid != null && invalid.getMessage().contains("wait"));
    }
  }

  private void aPlainClaimBehindTheRelayAnswersAtOnce(String ns, Relay relay) {
    try (IdempotencyClient client = new IdempotencyClient(relay.target())) {
      client.claim(ns, "k", null, Duration.ofSeconds(30), null);
      ClaimResult answer = client.claim(ns, "k", ClaimOptions.defaults().waitFor(Duration.ofSeconds(20)));
      check.equal("in progress", Outcome.IN_PROGRESS, answer.outcome());
      check.equal("waited unset: the server did not wait", null, answer.waited());
    }
  }

  private void onceWithThrowDoesNotAskToWait(String ns, Relay relay) {
    try (IdempotencyClient client = new IdempotencyClient(relay.target())) {
      client.claim(ns, "k", null, Duration.ofSeconds(30), null);
      int askedBefore = relay.claimsAskingToWait.get();
      int claimsBefore = relay.claims.get();
      check.throwsException("InProgress at once", IdempotencyException.InProgress.class,
          () -> client.once(ns, "k", null, () -> bytes("x"), OnceOptions.defaults().throwOnInProgress()));
      check.equal("one Claim", 1, relay.claims.get() - claimsBefore);
      check.equal("which did not ask to wait", 0, relay.claimsAskingToWait.get() - askedBefore);
    }
  }
}
