package idempotency.client;

import java.util.Arrays;
import java.util.Objects;

/** A tiny assertion recorder: every check is printed; main() exits 1 when one failed. */
final class Check {
  int passed;
  int failed;

  interface Body {
    void run() throws Exception;
  }

  void ok(String name, boolean condition) {
    if (condition) {
      passed++;
    } else {
      failed++;
      System.out.println("FAIL " + name);
    }
  }

  void equal(String name, Object expected, Object actual) {
    boolean same = expected instanceof byte[] && actual instanceof byte[]
        ? Arrays.equals((byte[]) expected, (byte[]) actual)
        : Objects.equals(expected, actual);
    if (same) {
      passed++;
    } else {
      failed++;
      System.out.println("FAIL " + name + ": expected " + show(expected) + ", got " + show(actual));
    }
  }

  /** Runs body; passes when it throws an instance of type, and returns that exception (else null). */
  <T extends Throwable> T throwsException(String name, Class<T> type, Body body) {
    try {
      body.run();
    } catch (Throwable thrown) {
      if (type.isInstance(thrown)) {
        passed++;
        return type.cast(thrown);
      }
      failed++;
      System.out.println("FAIL " + name + ": expected " + type.getSimpleName() + ", got " + thrown);
      return null;
    }
    failed++;
    System.out.println("FAIL " + name + ": expected " + type.getSimpleName() + ", nothing was thrown");
    return null;
  }

  private static String show(Object value) {
    return value instanceof byte[] ? "bytes " + Keys.hex((byte[]) value) : String.valueOf(value);
  }
}
