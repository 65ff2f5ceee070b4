package idempotency.client;

import java.io.IOException;
import java.io.UncheckedIOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.StandardOpenOption;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;

/**
 * A three-step job that survives its worker being killed between steps and
 * does each step once, run as a child JVM by CheckpointTest (the Java twin of
 * the Python suite's resumable_job.py):
 *
 * <pre>
 * java idempotency.client.ResumableJob TARGET NAMESPACE JOB_ID LOG LEASE_SECONDS [STOP_AFTER]
 * </pre>
 *
 * Each step appends a line to LOG ("step job pid=N fencing=F", in place of a
 * charge or an email), then saves the steps done as the checkpoint. With
 * STOP_AFTER, right after that step's checkpoint is saved the job prints
 * "stopped after STEP" and blocks, for the test to kill it (SIGKILL). The next
 * worker, once the dead one's lease has run out, receives the checkpoint and
 * does the rest only. Prints the steps done ("reserve,charge,email") at the end.
 */
public final class ResumableJob {
  static final List<String> STEPS = List.of("reserve", "charge", "email");

  private ResumableJob() {}

  public static void main(String[] args) {
    String target = args[0];
    String namespace = args[1];
    String jobId = args[2];
    Path log = Path.of(args[3]);
    Duration lease = Duration.ofSeconds(Long.parseLong(args[4]));
    String stopAfter = args.length > 5 ? args[5] : null;
    try (IdempotencyClient client = new IdempotencyClient(target)) {
      OnceOptions options = OnceOptions.defaults().leaseTtl(lease).waitTimeout(Duration.ofSeconds(60));
      byte[] result = client.onceWithLease(namespace, jobId, null, run -> {
        // The checkpoint: what the last worker saved (null the first time).
        byte[] checkpoint = run.checkpoint();
        List<String> done = new ArrayList<>();
        if (checkpoint != null && checkpoint.length > 0) {
          done.addAll(Arrays.asList(new String(checkpoint, StandardCharsets.UTF_8).split(",")));
        }
        for (String step : STEPS) {
          if (done.contains(step)) {
            continue;
          }
          append(log, step + " " + jobId + " pid=" + ProcessHandle.current().pid() + " fencing=" + run.fencingToken());
          done.add(step);
          run.saveCheckpoint(String.join(",", done).getBytes(StandardCharsets.UTF_8));
          if (step.equals(stopAfter)) {
            System.out.println("stopped after " + step);
            System.out.flush();
            blockUntilKilled();
          }
        }
        return String.join(",", done).getBytes(StandardCharsets.UTF_8);
      }, options).value();
      System.out.println(new String(result, StandardCharsets.UTF_8));
    }
  }

  /** The step's effect: a line in the log, on disk before the checkpoint. */
  private static void append(Path log, String line) {
    try {
      Files.writeString(log, line + "\n", StandardCharsets.UTF_8, StandardOpenOption.CREATE, StandardOpenOption.APPEND,
          StandardOpenOption.SYNC);
    } catch (IOException error) {
      throw new UncheckedIOException(error);
    }
  }

  private static void blockUntilKilled() {
    while (true) {
      try {
        Thread.sleep(60_000);
      } catch (InterruptedException interrupted) {
        Thread.currentThread().interrupt();
        throw new IllegalStateException(interrupted);
      }
    }
  }
}
