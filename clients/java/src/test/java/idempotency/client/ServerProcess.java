package idempotency.client;

import idempotency.client.health.HealthCheckRequest;
import idempotency.client.health.HealthCheckResponse;
import idempotency.client.health.HealthGrpc;
import io.grpc.Grpc;
import io.grpc.InsecureChannelCredentials;
import io.grpc.ManagedChannel;
import io.grpc.StatusRuntimeException;
import java.io.IOException;
import java.io.UncheckedIOException;
import java.net.InetAddress;
import java.net.ServerSocket;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.HashMap;
import java.util.Map;
import java.util.UUID;
import java.util.concurrent.TimeUnit;

/**
 * A real idempotency-service for the tests: the binary named by
 * IDEMPOTENCY_BIN on a free loopback port, on the embedded store in its own
 * data directory or on a PostgreSQL database, ready once its health check says
 * SERVING. {@link #stop()} is SIGTERM (a graceful drain), {@link #kill()}
 * SIGKILL, {@link #restart()} starts it again on the same port, as a rolling
 * restart does. The counterpart of the Python suite's testing.ServerProcess.
 */
final class ServerProcess implements AutoCloseable {
  private static final String DEFAULT_POSTGRES = "postgres://postgres@127.0.0.1:5432";

  /** Every server process started, so that none outlives the test JVM (a failure, Ctrl-C, a timeout's SIGTERM). */
  private static final java.util.Set<Process> STARTED = java.util.concurrent.ConcurrentHashMap.newKeySet();

  static {
    Runtime.getRuntime().addShutdownHook(new Thread(() -> STARTED.forEach(Process::destroyForcibly)));
  }

  private final String name;
  private final Path binary;
  private final Path log;
  private final Map<String, String> env;
  private final int port;
  private Process process;

  private ServerProcess(String name, Path binary, Path log, Map<String, String> env, int port) {
    this.name = name;
    this.binary = binary;
    this.log = log;
    this.env = env;
    this.port = port;
  }

  /** The binary from $IDEMPOTENCY_BIN (run-tests.sh sets it). */
  static Path binary() {
    String configured = System.getenv("IDEMPOTENCY_BIN");
    if (configured == null || configured.isEmpty()) {
      throw new IllegalStateException("IDEMPOTENCY_BIN is not set");
    }
    return Path.of(configured).toAbsolutePath();
  }

  /**
   * Starts a server named {@code name} with its data directory and log under
   * {@code work}; on PostgreSQL when {@code databaseUrl} is not null.
   */
  static ServerProcess start(Path work, String name, String databaseUrl) {
    return start(work, name, databaseUrl, Map.of());
  }

  /** {@link #start(Path, String, String)} with more settings ({@code IDEMPOTENCY_...} variables). */
  static ServerProcess start(Path work, String name, String databaseUrl, Map<String, String> settings) {
    Path dataDir = work.resolve(name);
    try {
      Files.createDirectories(dataDir);
    } catch (IOException error) {
      throw new UncheckedIOException(error);
    }
    for (int attempt = 0; ; attempt++) {
      int port = freePort();
      Map<String, String> env = new HashMap<>(System.getenv());
      env.remove("DATABASE_URL");
      env.put("IDEMPOTENCY_LISTEN_ADDR", "127.0.0.1:" + port);
      env.put("IDEMPOTENCY_DATA_DIR", dataDir.toString());
      env.put("IDEMPOTENCY_METRICS_ADDR", ""); // the default port would be one for every server here
      if (databaseUrl != null) {
        env.put("DATABASE_URL", databaseUrl);
      }
      env.putAll(settings);
      ServerProcess server = new ServerProcess(name, binary(), work.resolve(name + ".log"), env, port);
      try {
        server.launch(60);
        return server;
      } catch (PortTaken taken) {
        // Another test run on this machine took the port between our check and the bind.
        if (attempt >= 5) {
          throw new IllegalStateException(name + ": no free port after 6 tries");
        }
      }
    }
  }

  String target() {
    return "127.0.0.1:" + port;
  }

  String name() {
    return name;
  }

  boolean running() {
    return process != null && process.isAlive();
  }

  /** SIGTERM, then SIGKILL if it has not exited within 10 s. */
  void stop() {
    if (process == null || !process.isAlive()) {
      return;
    }
    process.destroy();
    try {
      if (!process.waitFor(10, TimeUnit.SECONDS)) {
        process.destroyForcibly().waitFor();
      }
    } catch (InterruptedException interrupted) {
      Thread.currentThread().interrupt();
      throw new IllegalStateException(interrupted);
    }
  }

  /** SIGKILL: the server dies without draining its calls. */
  void kill() {
    if (process != null && process.isAlive()) {
      try {
        process.destroyForcibly().waitFor();
      } catch (InterruptedException interrupted) {
        Thread.currentThread().interrupt();
        throw new IllegalStateException(interrupted);
      }
    }
  }

  /**
   * Stops the server (SIGTERM) if it runs and starts the same binary with the
   * same settings on the same port; back once it is SERVING. A port still
   * held for a moment by the old process is tried again for up to 60 s.
   */
  void restart() {
    stop();
    long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(60);
    while (true) {
      try {
        launch(Math.max(1, (deadline - System.nanoTime()) / 1_000_000_000L));
        return;
      } catch (PortTaken taken) {
        if (System.nanoTime() >= deadline) {
          throw new IllegalStateException(name + ": restart failed, port " + port + " still in use\n" + logTail());
        }
        pause(100);
      }
    }
  }

  @Override
  public void close() {
    stop();
  }

  String logTail() {
    try {
      String text = Files.readString(log, StandardCharsets.UTF_8);
      return text.substring(Math.max(0, text.length() - 4000));
    } catch (IOException error) {
      return "(no log: " + error.getMessage() + ")";
    }
  }

  private static final class PortTaken extends Exception {
    private static final long serialVersionUID = 1L;
  }

  private void launch(long readySeconds) throws PortTaken {
    long logStart;
    try {
      Files.writeString(log, "--- start ---\n", StandardCharsets.UTF_8,
          java.nio.file.StandardOpenOption.CREATE, java.nio.file.StandardOpenOption.APPEND);
      logStart = Files.size(log);
      ProcessBuilder builder = new ProcessBuilder(binary.toString());
      builder.environment().clear();
      builder.environment().putAll(env);
      builder.redirectErrorStream(true);
      builder.redirectOutput(ProcessBuilder.Redirect.appendTo(log.toFile()));
      process = builder.start();
      STARTED.add(process);
    } catch (IOException error) {
      throw new UncheckedIOException(error);
    }
    long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(readySeconds);
    ManagedChannel channel = Grpc.newChannelBuilder(target(), InsecureChannelCredentials.create()).build();
    try {
      String last = "no answer yet";
      while (System.nanoTime() < deadline) {
        if (!process.isAlive()) {
          if (logSince(logStart).contains("IDEMPOTENCY_LISTEN_ADDR=127.0.0.1:" + port + " is in use")) {
            throw new PortTaken();
          }
          throw new IllegalStateException(name + ": the server exited with status " + process.exitValue()
              + "\n--- server log ---\n" + logTail());
        }
        try {
          HealthCheckResponse reply = HealthGrpc.newBlockingStub(channel).withDeadlineAfter(1, TimeUnit.SECONDS)
              .check(HealthCheckRequest.newBuilder().setService(IdempotencyClient.HEALTH_SERVICE).build());
          if (reply.getStatus() == HealthCheckResponse.ServingStatus.SERVING) {
            return;
          }
          last = reply.getStatus().name();
        } catch (StatusRuntimeException error) {
          last = error.getStatus().getCode() + ": " + error.getStatus().getDescription();
        }
        pause(50);
      }
      stop();
      throw new IllegalStateException(name + ": not SERVING after " + readySeconds + " s (" + last + ")\n" + logTail());
    } finally {
      channel.shutdownNow();
    }
  }

  private String logSince(long start) {
    try {
      byte[] all = Files.readAllBytes(log);
      int from = (int) Math.min(start, all.length);
      return new String(all, from, all.length - from, StandardCharsets.UTF_8);
    } catch (IOException error) {
      return "";
    }
  }

  static int freePort() {
    try (ServerSocket socket = new ServerSocket(0, 1, InetAddress.getLoopbackAddress())) {
      return socket.getLocalPort();
    } catch (IOException error) {
      throw new UncheckedIOException(error);
    }
  }

  // -- PostgreSQL -------------------------------------------------------------

  /** A fresh database on the machine's PostgreSQL ($IDEMPOTENCY_TEST_POSTGRES, else the local one); its URL. */
  static String createPostgresDatabase() {
    String base = postgresBase();
    String name = "idempotency_java_" + UUID.randomUUID().toString().replace("-", "").substring(0, 16);
    psql(base, "CREATE DATABASE " + name);
    return base + "/" + name;
  }

  static void dropPostgresDatabase(String url) {
    int slash = url.lastIndexOf('/');
    psql(url.substring(0, slash), "DROP DATABASE IF EXISTS " + url.substring(slash + 1) + " WITH (FORCE)");
  }

  private static String postgresBase() {
    String configured = System.getenv("IDEMPOTENCY_TEST_POSTGRES");
    String base = configured == null || configured.isEmpty() ? DEFAULT_POSTGRES : configured;
    return base.endsWith("/") ? base.substring(0, base.length() - 1) : base;
  }

  private static void psql(String base, String sql) {
    try {
      Process psql = new ProcessBuilder("psql", base + "/postgres", "-v", "ON_ERROR_STOP=1", "-q", "-c", sql)
          .redirectErrorStream(true).start();
      String output = new String(psql.getInputStream().readAllBytes(), StandardCharsets.UTF_8);
      if (!psql.waitFor(30, TimeUnit.SECONDS) || psql.exitValue() != 0) {
        throw new IllegalStateException("psql " + sql + " failed: " + output);
      }
    } catch (IOException error) {
      throw new UncheckedIOException(error);
    } catch (InterruptedException interrupted) {
      Thread.currentThread().interrupt();
      throw new IllegalStateException(interrupted);
    }
  }

  static void pause(long millis) {
    try {
      Thread.sleep(millis);
    } catch (InterruptedException interrupted) {
      Thread.currentThread().interrupt();
      throw new IllegalStateException(interrupted);
    }
  }
}
