package idempotency.client;

import io.grpc.Status;
import java.nio.charset.StandardCharsets;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicBoolean;

/**
 * Several replicas: two servers on one fresh PostgreSQL database, the client
 * given both addresses. A replica stopped during a once(), one that stays
 * down, a Complete sent to a replica as it stops, and a rolling restart
 * (SIGTERM, the loop carried on by the other replica meanwhile, start again
 * on the same port, one replica after the other) under a running once()
 * loop: the caller's code sees no error, and every piece of work runs once. Also one address restarted under a loop (a load balancer,
 * or a single replica). The counterpart of the Python suite's test_replicas.py.
 */
final class ReplicaTest {
  private final Cases cases;
  private final Check check;
  private final Path work;
  private final List<ServerProcess> replicas = new ArrayList<>();

  ReplicaTest(Cases cases, Path work) {
    this.cases = cases;
    this.check = cases.check;
    this.work = work;
  }

  void runAll() {
    String database = ServerProcess.createPostgresDatabase();
    try {
      replicas.add(ServerProcess.start(work, "replica-a", database));
      replicas.add(ServerProcess.start(work, "replica-b", database));
      for (int victim = 0; victim < 2; victim++) {
        int stopped = victim;
        cases.run("replicas: replica " + victim + " stopped between the Claim and the Complete of one once()",
            ns -> aReplicaStoppedBetweenTwoCallsOfOneOnce(ns, stopped));
      }
      cases.run("replicas: a Complete sent to a replica that just stopped is retried on the other",
          this::aCompleteSentToAReplicaThatJustStoppedIsRetriedOnTheOther);
      cases.run("replicas: calls keep working while one replica is down", this::callsKeepWorkingWhileOneIsDown);
      cases.run("replicas: a rolling restart under a running once() loop raises nothing",
          this::aRollingRestartUnderARunningOnceLoopRaisesNothing);
    } finally {
      for (ServerProcess replica : replicas) {
        replica.stop();
      }
      ServerProcess.dropPostgresDatabase(database);
    }
    cases.run("one address: a restart under a running once() loop raises nothing",
        this::aRestartOfTheOnlyAddressUnderAOnceLoopRaisesNothing);
  }

  /** Both replicas up at the start of each test, whatever the last one did. */
  private List<String> targets() {
    List<String> targets = new ArrayList<>();
    for (ServerProcess replica : replicas) {
      if (!replica.running()) {
        replica.restart();
      }
      targets.add(replica.target());
    }
    return targets;
  }

  private static byte[] bytes(String text) {
    return text.getBytes(StandardCharsets.UTF_8);
  }

  private void aReplicaStoppedBetweenTwoCallsOfOneOnce(String ns, int victim) {
    Interceptors.Counting counting = new Interceptors.Counting();
    List<Integer> calls = Collections.synchronizedList(new ArrayList<>());
    try (IdempotencyClient client = IdempotencyClient.builder(targets()).interceptors(counting).build()) {
      byte[] result = client.once(ns, "order-1", null, () -> {
        replicas.get(victim).stop(); // the Claim has been answered; the Complete is next
        calls.add(1);
        return bytes("charged");
      });
      check.equal("the work's result", bytes("charged"), result);
      check.equal("completed", State.COMPLETED, client.get(ns, "order-1").state());
      check.equal("replayed", bytes("charged"), client.once(ns, "order-1", null, () -> {
        calls.add(2);
        return bytes("again");
      }));
      check.equal("the work ran once", List.of(1), calls);
      check.equal("one Claim answered OK twice (the work and the replay)", 2, counting.count("Claim", Status.Code.OK));
      check.equal("one Complete answered OK", 1, counting.count("Complete", Status.Code.OK));
    }
  }

  private void aCompleteSentToAReplicaThatJustStoppedIsRetriedOnTheOther(String ns) {
    // Calls start on each address in turn: the Claim on the first replica, the
    // Complete on the second, which stops as it is sent.
    List<String> targets = targets();
    Interceptors.BeforeFirst stopper = new Interceptors.BeforeFirst("Complete", replicas.get(1)::stop);
    try (IdempotencyClient client = IdempotencyClient.builder(targets).interceptors(stopper).build()) {
      client.waitUntilServing(Duration.ofSeconds(30)); // both connected: the turns decide
      check.equal("once", bytes("ok"), client.once(ns, "k", null, () -> bytes("ok")));
      check.equal("completed", State.COMPLETED, client.get(ns, "k").state());
    }
    List<String> attempts = new ArrayList<>(stopper.attempts());
    attempts.removeIf(attempt -> attempt.startsWith("Check ")); // waitUntilServing's health checks
    check.equal("Claim OK, Complete UNAVAILABLE on the stopped replica, Complete OK on the other",
        List.of("Claim OK", "Complete UNAVAILABLE", "Complete OK"), attempts.subList(0, Math.min(3, attempts.size())));
  }

  private void callsKeepWorkingWhileOneIsDown(String ns) {
    List<String> targets = targets();
    replicas.get(1).stop();
    Interceptors.Counting counting = new Interceptors.Counting();
    try (IdempotencyClient client = IdempotencyClient.builder(targets).interceptors(counting).build()) {
      for (int i = 0; i < 20; i++) {
        String value = "v" + i;
        check.equal("once " + i, bytes(value), client.once(ns, "k" + i, null, () -> bytes(value)));
      }
    }
    check.equal("a Claim and a Complete each answered", 40, counting.count(null, Status.Code.OK));
    int failed = counting.count(null, Status.Code.UNAVAILABLE);
    check.ok("the stopped replica is passed over once known to fail (" + failed + " UNAVAILABLE)", failed <= 10);
  }

  /** A once() loop on its own thread: each key's work counted, every error kept. */
  private static final class OnceLoop implements Runnable {
    final Map<String, Integer> runs = new ConcurrentHashMap<>();
    final List<String> completed = Collections.synchronizedList(new ArrayList<>());
    final List<Throwable> errors = Collections.synchronizedList(new ArrayList<>());
    final AtomicBoolean stop = new AtomicBoolean();
    private final IdempotencyClient client;
    private final String namespace;
    private final OnceOptions options;

    OnceLoop(IdempotencyClient client, String namespace, OnceOptions options) {
      this.client = client;
      this.namespace = namespace;
      this.options = options;
    }

    @Override
    public void run() {
      for (int index = 0; !stop.get(); index++) {
        String key = "evt-" + index;
        try {
          byte[] value = client.once(namespace, key, null, () -> {
            runs.merge(key, 1, Integer::sum);
            return bytes(key);
          }, options);
          if (!new String(value, StandardCharsets.UTF_8).equals(key)) {
            throw new AssertionError(key + ": got " + new String(value, StandardCharsets.UTF_8));
          }
          completed.add(key);
        } catch (Throwable error) { // anything at all reaching the caller's code
          errors.add(error);
        }
      }
    }

    int done() {
      return completed.size();
    }
  }

  private void aRollingRestartUnderARunningOnceLoopRaisesNothing(String ns) throws Exception {
    try (IdempotencyClient client = new IdempotencyClient(targets())) {
      OnceLoop loop = new OnceLoop(client, ns, OnceOptions.defaults().leaseTtl(Duration.ofSeconds(10)));
      Thread worker = new Thread(loop, "once-loop");
      worker.start();
      try {
        Cases.until(() -> loop.done() >= 10, Duration.ofSeconds(20), "the loop to run");
        for (ServerProcess replica : replicas) {
          int before = loop.done();
          replica.stop(); // SIGTERM: it drains its calls and exits
          // The other replica carries the loop, the one restarted before included.
          Cases.until(() -> loop.done() >= before + 10, Duration.ofSeconds(20),
              "progress while " + replica.name() + " is down");
          replica.restart(); // again on the same port
          int after = loop.done();
          Cases.until(() -> loop.done() >= after + 10, Duration.ofSeconds(20), "progress after a restart");
        }
      } finally {
        loop.stop.set(true);
        worker.join(TimeUnit.SECONDS.toMillis(30));
      }
      check.ok("the loop ended", !worker.isAlive());
      check.equal("no error reached the caller", List.of(), List.copyOf(loop.errors));
      check.ok("each piece of work ran once (" + loop.runs.size() + " keys)",
          !loop.runs.isEmpty() && loop.runs.values().stream().allMatch(count -> count == 1));
      check.equal("every key the loop finished was run", loop.done(), loop.runs.size());
      List<String> done = List.copyOf(loop.completed);
      for (int i = 0; i < done.size(); i += Math.max(1, done.size() / 10)) {
        check.equal(done.get(i) + " completed", State.COMPLETED, client.get(ns, done.get(i)).state());
      }
      System.out.println("     (" + done.size() + " once() calls across the rolling restart)");
    }
  }

  private void aRestartOfTheOnlyAddressUnderAOnceLoopRaisesNothing(String ns) throws Exception {
    try (ServerProcess server = ServerProcess.start(work, "single", null);
        IdempotencyClient client = new IdempotencyClient(server.target())) {
      OnceLoop loop = new OnceLoop(client, ns, OnceOptions.defaults());
      Thread worker = new Thread(loop, "once-loop");
      worker.start();
      try {
        Cases.until(() -> loop.done() >= 10, Duration.ofSeconds(20), "the loop to run");
        server.restart();
        int after = loop.done();
        Cases.until(() -> loop.done() >= after + 10, Duration.ofSeconds(20), "progress after the restart");
      } finally {
        loop.stop.set(true);
        worker.join(TimeUnit.SECONDS.toMillis(30));
      }
      check.equal("no error reached the caller", List.of(), List.copyOf(loop.errors));
      check.ok("each piece of work ran once", loop.runs.values().stream().allMatch(count -> count == 1));
    }
  }
}
