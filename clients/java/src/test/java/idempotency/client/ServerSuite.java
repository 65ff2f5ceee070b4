package idempotency.client;

import java.nio.file.Path;
import java.util.Arrays;
import java.util.List;

/**
 * The suites that start their own servers (the binary named by
 * IDEMPOTENCY_BIN), on the embedded store and on a fresh PostgreSQL database
 * each: retries and lost answers, checkpoints (with a child JVM killed
 * mid-job), several replicas (a rolling restart), waiting, and the google.rpc
 * error details with late retries of remembered keys.
 *
 * <pre>
 * java idempotency.client.ServerSuite WORK_DIR [retry] [checkpoint] [replica] [wait] [details]
 * </pre>
 *
 * With no suite named, runs them all. Prints every failed check; exits 1 when
 * there was one.
 */
public final class ServerSuite {
  private static final List<String> ALL = List.of("retry", "checkpoint", "replica", "wait", "details");

  private ServerSuite() {}

  public static void main(String[] args) throws Exception {
    Path work = Path.of(args[0]);
    List<String> chosen = args.length > 1 ? Arrays.asList(args).subList(1, args.length) : ALL;
    for (String suite : chosen) {
      if (!ALL.contains(suite)) {
        System.err.println("ServerSuite: unknown suite " + suite + " (known: " + ALL + ")");
        System.exit(2);
      }
    }
    Check check = new Check();
    Cases cases = new Cases(check);
    if (chosen.contains("retry")) {
      RetryTest.runUnitChecks(cases);
    }
    if (chosen.contains("retry") || chosen.contains("checkpoint") || chosen.contains("wait")
        || chosen.contains("details")) {
      String database = ServerProcess.createPostgresDatabase();
      try (ServerProcess sqlite = ServerProcess.start(work, "sqlite", null);
          ServerProcess postgres = ServerProcess.start(work, "postgres", database)) {
        for (ServerProcess server : List.of(sqlite, postgres)) {
          String store = server.name();
          if (chosen.contains("retry")) {
            new RetryTest(cases, server.target(), store).runAll();
          }
          if (chosen.contains("checkpoint")) {
            new CheckpointTest(cases, server.target(), store, work).runAll();
          }
          if (chosen.contains("wait")) {
            new WaitTest(cases, server.target(), store).runAll();
          }
          if (chosen.contains("details")) {
            new DetailsTest(cases, server.target(), store).runAll();
          }
        }
      } finally {
        ServerProcess.dropPostgresDatabase(database);
      }
    }
    if (chosen.contains("details")) {
      DetailsTest.runWithOwnServers(cases, work);
    }
    if (chosen.contains("replica")) {
      new ReplicaTest(cases, work).runAll();
    }
    System.out.println("java client, server suites " + chosen + ": " + check.passed + " checks passed, "
        + check.failed + " failed");
    System.exit(check.failed == 0 ? 0 : 1);
  }
}
