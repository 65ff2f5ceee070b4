package idempotency.client;

import io.grpc.Status;
import java.io.BufferedReader;
import java.io.IOException;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;

/**
 * Checkpoints against a real server: progress saved under a lease, handed to
 * whoever takes the key over, shown by Get, discarded by Complete; and once()
 * resuming from them, including a worker JVM killed after step 2 of 3 whose
 * successor does step 3 only. The counterpart of the Python suite's
 * test_checkpoints.py.
 */
final class CheckpointTest {
  private final Cases cases;
  private final Check check;
  private final String target;
  private final String store;
  private final Path work;

  CheckpointTest(Cases cases, String target, String store, Path work) {
    this.cases = cases;
    this.check = cases.check;
    this.target = target;
    this.store = store;
    this.work = work;
  }

  void runAll() {
    try (IdempotencyClient client = new IdempotencyClient(target)) {
      cases.run(store + ": a checkpoint saved with extendLease goes to the next holder after a release",
          ns -> aCheckpointGoesToTheNextHolderAfterARelease(client, ns));
      cases.run(store + ": a lease that runs out hands its checkpoint to the next claim",
          ns -> aLeaseThatRunsOutHandsItsCheckpointToTheNextClaim(client, ns));
      cases.run(store + ": a checkpoint over the limit is refused",
          ns -> aCheckpointOverTheLimitIsRefused(client, ns));
      cases.run(store + ": once resumes a failed attempt from its checkpoint",
          ns -> onceResumesAFailedAttemptFromItsCheckpoint(client, ns));
      cases.run(store + ": a release after a failure carries the checkpoint whose save failed",
          ns -> aReleaseCarriesTheCheckpointWhoseSaveFailed(client, ns));
      cases.run(store + ": saving a checkpoint on a lost lease throws LeaseLost",
          ns -> savingACheckpointOnALostLeaseThrowsLeaseLost(client, ns));
      cases.run(store + ": a worker JVM killed after its second step is resumed from its checkpoint by another",
          ns -> aWorkerKilledAfterItsSecondStepIsResumedByAnother(client, ns));
    }
  }

  private static byte[] bytes(String text) {
    return text.getBytes(StandardCharsets.UTF_8);
  }

  private static String text(byte[] bytes) {
    return bytes == null ? null : new String(bytes, StandardCharsets.UTF_8);
  }

  private void aCheckpointGoesToTheNextHolderAfterARelease(IdempotencyClient client, String ns) {
    ClaimResult first = client.claim(ns, "k");
    check.equal("first: no checkpoint", null, first.checkpoint());
    check.equal("first: no checkpoint fencing token", 0L, first.checkpointFencingToken());
    client.extendLease(ns, "k", first.leaseToken(), null, bytes("step 1"));
    KeyRecord record = client.get(ns, "k");
    check.equal("get: in progress", State.IN_PROGRESS, record.state());
    check.equal("get: the checkpoint", "step 1", text(record.checkpoint()));
    check.equal("get: saved under fencing token 1", 1L, record.checkpointFencingToken());
    client.extendLease(ns, "k", first.leaseToken(), null);
    check.equal("an extendLease without one keeps it", "step 1", text(client.get(ns, "k").checkpoint()));
    client.release(ns, "k", first.leaseToken(), bytes("step 2"));
    record = client.get(ns, "k");
    check.equal("released", State.RELEASED, record.state());
    check.equal("release saved its checkpoint", "step 2", text(record.checkpoint()));

    ClaimResult second = client.claim(ns, "k");
    check.equal("second: fencing token 2", 2L, second.fencingToken());
    check.equal("second: the checkpoint", "step 2", text(second.checkpoint()));
    check.equal("second: saved under fencing token 1", 1L, second.checkpointFencingToken());
    client.complete(ns, "k", second.leaseToken(), bytes("done"));
    record = client.get(ns, "k");
    check.equal("completed", State.COMPLETED, record.state());
    check.equal("complete discards the checkpoint", null, record.checkpoint());
    check.equal("and its fencing token", 0L, record.checkpointFencingToken());
  }

  private void aLeaseThatRunsOutHandsItsCheckpointToTheNextClaim(IdempotencyClient client, String ns) {
    ClaimResult first = client.claim(ns, "k", null, Duration.ofSeconds(1), null);
    client.extendLease(ns, "k", first.leaseToken(), Duration.ofSeconds(1), new byte[0]); // an empty one
    ClaimResult[] taken = new ClaimResult[1];
    Cases.until(() -> (taken[0] = client.claim(ns, "k")).claimed(), Duration.ofSeconds(10), "the lease to run out");
    check.equal("taken over: fencing token 2", 2L, taken[0].fencingToken());
    check.equal("an empty checkpoint is one", 0, taken[0].checkpoint() == null ? -1 : taken[0].checkpoint().length);
    check.equal("saved under fencing token 1", 1L, taken[0].checkpointFencingToken());
  }

  private void aCheckpointOverTheLimitIsRefused(IdempotencyClient client, String ns) {
    ClaimResult claim = client.claim(ns, "k");
    IdempotencyException.InvalidArgument error = check.throwsException("65537 bytes",
        IdempotencyException.InvalidArgument.class,
        () -> client.extendLease(ns, "k", claim.leaseToken(), null, new byte[64 * 1024 + 1]));
    check.ok("names the checkpoint", error != null && error.getMessage().contains("checkpoint"));
    client.extendLease(ns, "k", claim.leaseToken(), null, new byte[64 * 1024]);
    check.equal("65536 bytes are saved", 64 * 1024, client.get(ns, "k").checkpoint().length);
  }

  /** Three steps, a checkpoint after each; fails after {@code failAfter} once. */
  private static final class Job {
    final List<String> log = new ArrayList<>();
    final List<String> seen = new ArrayList<>();
    String failAfter;

    Job(String failAfter) {
      this.failAfter = failAfter;
    }

    byte[] run(Lease lease) {
      seen.add(text(lease.checkpoint()) + "@" + lease.checkpointFencingToken());
      List<String> done = new ArrayList<>();
      if (lease.checkpoint() != null) {
        done.addAll(Arrays.asList(text(lease.checkpoint()).split(",")));
      }
      for (String step : List.of("reserve", "charge", "email")) {
        if (done.contains(step)) {
          continue;
        }
        log.add(step);
        done.add(step);
        lease.saveCheckpoint(bytes(String.join(",", done)));
        if (!String.join(",", done).equals(text(lease.checkpoint()))
            || lease.checkpointFencingToken() != lease.fencingToken()) {
          throw new AssertionError("the saved checkpoint is not the lease's checkpoint");
        }
        if (step.equals(failAfter)) {
          failAfter = null;
          throw new IllegalStateException("failed after " + step);
        }
      }
      return bytes(String.join(",", done));
    }
  }

  private void onceResumesAFailedAttemptFromItsCheckpoint(IdempotencyClient client, String ns) {
    Job job = new Job("charge");
    IllegalStateException failed = check.throwsException("the first attempt fails", IllegalStateException.class,
        () -> client.onceWithLease(ns, "order-1", null, job::run, OnceOptions.defaults()));
    check.ok("its own exception", failed != null && failed.getMessage().equals("failed after charge"));
    KeyRecord record = client.get(ns, "order-1");
    check.equal("released", State.RELEASED, record.state());
    check.equal("with the checkpoint", "reserve,charge", text(record.checkpoint()));

    OnceResult result = client.onceWithLease(ns, "order-1", null, job::run, OnceOptions.defaults());
    check.equal("the second attempt finishes", "reserve,charge,email", text(result.value()));
    check.equal("each step once", List.of("reserve", "charge", "email"), job.log);
    check.equal("what each attempt received", List.of("null@0", "reserve,charge@1"), job.seen);
    check.equal("complete discards the checkpoint", null, client.get(ns, "order-1").checkpoint());
  }

  private void aReleaseCarriesTheCheckpointWhoseSaveFailed(IdempotencyClient client, String ns) {
    Interceptors.FailCalls failing = new Interceptors.FailCalls("ExtendLease", Status.Code.UNAVAILABLE);
    RetryPolicy policy = RetryPolicy.defaults().maxAttempts(2).initialBackoff(Duration.ofMillis(10));
    try (IdempotencyClient flaky = IdempotencyClient.builder(target).interceptors(failing).retry(policy).build()) {
      check.throwsException("the save's Unavailable reaches the work, which lets it through",
          IdempotencyException.Unavailable.class,
          () -> flaky.onceWithLease(ns, "k", null, lease -> {
            lease.saveCheckpoint(bytes("step 1 done"));
            return bytes("never");
          }, OnceOptions.defaults().heartbeat(false)));
    }
    check.equal("the save was tried twice", 2, failing.count("ExtendLease", Status.Code.UNAVAILABLE));
    KeyRecord record = client.get(ns, "k");
    check.equal("released", State.RELEASED, record.state());
    check.equal("with the checkpoint the failed save asked for", "step 1 done", text(record.checkpoint()));
  }

  private void savingACheckpointOnALostLeaseThrowsLeaseLost(IdempotencyClient client, String ns) {
    check.throwsException("purged under the work", IdempotencyException.LeaseLost.class,
        () -> client.onceWithLease(ns, "k", null, lease -> {
          client.purge(ns, "k", "test: revoke the lease");
          lease.saveCheckpoint(bytes("too late"));
          return bytes("never");
        }, OnceOptions.defaults().heartbeat(false)));
    check.equal("nothing stored", State.ABSENT, client.get(ns, "k").state());
  }

  private void aWorkerKilledAfterItsSecondStepIsResumedByAnother(IdempotencyClient client, String ns)
      throws Exception {
    Path log = Files.createTempFile(work, "steps-", ".log");
    Process killed = startWorker(ns, "job-1", log, "charge");
    try {
      String line = readLine(killed, Duration.ofSeconds(60));
      check.equal("the worker got to step 2", "stopped after charge", line);
    } finally {
      killed.destroyForcibly(); // SIGKILL, after step 2's checkpoint
      killed.waitFor(30, TimeUnit.SECONDS);
    }
    check.equal("killed by SIGKILL", 137, killed.exitValue());
    check.equal("two steps done", List.of("reserve", "charge"), firstWords(log));

    KeyRecord record = client.get(ns, "job-1");
    check.equal("the dead worker's lease, until it runs out", State.IN_PROGRESS, record.state());
    check.equal("its checkpoint", "reserve,charge", text(record.checkpoint()));

    Process resumed = startWorker(ns, "job-1", log, null);
    String result = readLine(resumed, Duration.ofSeconds(60));
    check.ok("the successor exits 0", resumed.waitFor(30, TimeUnit.SECONDS) && resumed.exitValue() == 0);
    check.equal("the successor's result", "reserve,charge,email", result);

    List<String[]> steps = new ArrayList<>();
    for (String stepLine : Files.readAllLines(log)) {
      steps.add(stepLine.split(" "));
    }
    check.equal("each step once", List.of("reserve", "charge", "email"), firstWords(log));
    if (steps.size() == 3) {
      check.equal("steps 1 and 2 by the killed worker", steps.get(0)[2], steps.get(1)[2]);
      check.ok("step 3 by another", !steps.get(2)[2].equals(steps.get(0)[2]));
      check.equal("fencing tokens", List.of("fencing=1", "fencing=1", "fencing=2"),
          List.of(steps.get(0)[3], steps.get(1)[3], steps.get(2)[3]));
    }
    record = client.get(ns, "job-1");
    check.equal("completed", State.COMPLETED, record.state());
    check.equal("the stored result", "reserve,charge,email", text(record.response()));
    check.equal("no checkpoint left", null, record.checkpoint());

    Process again = startWorker(ns, "job-1", log, null);
    String replayed = readLine(again, Duration.ofSeconds(60));
    check.ok("a later delivery exits 0", again.waitFor(30, TimeUnit.SECONDS) && again.exitValue() == 0);
    check.equal("and replays the result", "reserve,charge,email", replayed);
    check.equal("without doing a step", 3, Files.readAllLines(log).size());
  }

  private Process startWorker(String ns, String jobId, Path log, String stopAfter) throws IOException {
    List<String> command = new ArrayList<>(List.of(
        ProcessHandle.current().info().command().orElse("java"),
        "-cp", System.getProperty("java.class.path"),
        ResumableJob.class.getName(), target, ns, jobId, log.toString(), "1"));
    if (stopAfter != null) {
      command.add(stopAfter);
    }
    return new ProcessBuilder(command).redirectError(ProcessBuilder.Redirect.INHERIT).start();
  }

  /** The child's next line of output, or AssertionError after {@code timeout}. */
  private static String readLine(Process process, Duration timeout) throws Exception {
    BufferedReader reader = new BufferedReader(new InputStreamReader(process.getInputStream(), StandardCharsets.UTF_8));
    CompletableFuture<String> line = CompletableFuture.supplyAsync(() -> {
      try {
        return reader.readLine();
      } catch (IOException error) {
        return "(read failed: " + error + ")";
      }
    });
    try {
      return line.get(timeout.toMillis(), TimeUnit.MILLISECONDS);
    } catch (java.util.concurrent.TimeoutException timedOut) {
      process.destroyForcibly();
      throw new AssertionError("no output from the worker within " + timeout);
    }
  }

  private static List<String> firstWords(Path log) throws IOException {
    List<String> words = new ArrayList<>();
    for (String line : Files.readAllLines(log)) {
      words.add(line.split(" ")[0]);
    }
    return words;
  }
}
