package idempotency.client;

import java.time.Duration;
import java.util.UUID;
import java.util.function.BooleanSupplier;

/** Runs named test cases against a {@link Check}, each with its own namespace, and waits for conditions. */
final class Cases {
  interface Case {
    void run(String namespace) throws Exception;
  }

  final Check check;

  Cases(Check check) {
    this.check = check;
  }

  /** Runs one case; an exception it throws is a failure. Prints "ok" or "FAIL" with its time. */
  void run(String name, Case body) {
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
    System.out.flush();
  }

  /** Waits until {@code condition} holds, polling every 20 ms; throws AssertionError after {@code timeout}. */
  static void until(BooleanSupplier condition, Duration timeout, String what) {
    long deadline = System.nanoTime() + timeout.toNanos();
    while (!condition.getAsBoolean()) {
      if (System.nanoTime() > deadline) {
        throw new AssertionError("timed out after " + timeout + " waiting for " + what);
      }
      ServerProcess.pause(20);
    }
  }
}
