package idempotency.client;

import com.google.protobuf.ByteString;
import idempotency.client.health.HealthCheckRequest;
import idempotency.client.health.HealthCheckResponse;
import idempotency.client.health.HealthGrpc;
import idempotency.v1.Idempotency;
import idempotency.v1.IdempotencyServiceGrpc;
import io.grpc.Channel;
import io.grpc.ClientInterceptors;
import io.grpc.Grpc;
import io.grpc.InsecureChannelCredentials;
import io.grpc.ManagedChannel;
import io.grpc.Metadata;
import io.grpc.StatusRuntimeException;
import io.grpc.TlsChannelCredentials;
import io.grpc.stub.MetadataUtils;
import java.io.File;
import java.io.IOException;
import java.time.Duration;
import java.time.Instant;
import java.util.Objects;
import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.ScheduledFuture;
import java.util.concurrent.TimeUnit;
import java.util.function.Function;
import java.util.function.Supplier;
import java.util.logging.Level;
import java.util.logging.Logger;

/**
 * A blocking client of idempotency-service: the five lease calls (claim,
 * complete, release, extendLease, get, plus purge) and {@code once()}, which
 * wraps the lifecycle: Claim; on CLAIMED run the work (extending the lease
 * meanwhile), then Complete with its result, or Release when it throws; on
 * COMPLETED return the stored result without running the work (the replay).
 *
 * <pre>{@code
 * try (IdempotencyClient client = new IdempotencyClient("127.0.0.1:50051")) {
 *   String key = Keys.deriveKey("stripe", event.id());
 *   byte[] result = client.once("payments/stripe-webhooks", key, Keys.fingerprint(rawBody),
 *       () -> chargeCustomer(event));   // runs once per key; later calls replay its bytes
 * }
 * }</pre>
 *
 * Thread-safe; one client (one channel) per process is enough. Errors are
 * {@link IdempotencyException} subclasses, one per status code.
 */
public final class IdempotencyClient implements AutoCloseable {
  /** The health service name that says the server's store is ready. */
  public static final String HEALTH_SERVICE = "idempotency.v1.IdempotencyService";

  private static final Logger LOG = Logger.getLogger(IdempotencyClient.class.getName());
  private static final Duration FIRST_WAIT = Duration.ofMillis(100);
  private static final Duration MIN_WAIT = Duration.ofMillis(10);

  private final ManagedChannel ownedChannel;
  private final Channel channel;
  private final Duration callTimeout;
  private ScheduledExecutorService heartbeats;

  /** A plaintext channel to {@code target} ("host:port"), owned (closed by {@link #close()}). */
  public IdempotencyClient(String target) {
    this(builder(target));
  }

  /**
   * A client on a channel you built (TLS, load balancing, interceptors...).
   * The channel is not closed by {@link #close()}.
   */
  public IdempotencyClient(Channel channel) {
    this(Objects.requireNonNull(channel, "channel"), false, null, Duration.ofSeconds(10));
  }

  private IdempotencyClient(Builder builder) {
    this(builder.buildChannel(), builder.channel == null, builder.token, builder.callTimeout);
  }

  private IdempotencyClient(Channel channel, boolean owned, String token, Duration callTimeout) {
    this.ownedChannel = owned ? (ManagedChannel) channel : null;
    Channel base = channel;
    if (token != null) {
      Metadata headers = new Metadata();
      headers.put(Metadata.Key.of("authorization", Metadata.ASCII_STRING_MARSHALLER), "Bearer " + token);
      base = ClientInterceptors.intercept(base, MetadataUtils.newAttachHeadersInterceptor(headers));
    }
    this.channel = base;
    this.callTimeout = Objects.requireNonNull(callTimeout, "callTimeout");
  }

  /** Options: a bearer token, TLS, a per-call timeout. {@code IdempotencyClient.builder(t).token(...).build()}. */
  public static Builder builder(String target) {
    return new Builder(target);
  }

  /** Builds an {@link IdempotencyClient} on a channel it owns (the transport on the class path). */
  public static final class Builder {
    private final String target;
    private String token;
    private boolean tls;
    private File rootCertificates;
    private File clientCertificate;
    private File clientKey;
    private Duration callTimeout = Duration.ofSeconds(10);
    private Channel channel;

    private Builder(String target) {
      this.target = Objects.requireNonNull(target, "target");
    }

    /** Sends {@code authorization: Bearer <token>} with every call (the server's access policy). */
    public Builder token(String token) {
      if (token == null || token.isEmpty() || !token.chars().allMatch(c -> c > 0x20 && c < 0x7f)) {
        throw new IllegalArgumentException("token: printable ASCII without spaces");
      }
      this.token = token;
      return this;
    }

    /** TLS with the system's roots. */
    public Builder tls() {
      this.tls = true;
      return this;
    }

    /** TLS with this CA (PEM file) instead of the system's roots. */
    public Builder rootCertificates(File pem) {
      this.tls = true;
      this.rootCertificates = pem;
      return this;
    }

    /** Mutual TLS: this client certificate and its key (PEM files). */
    public Builder clientCertificate(File certificatePem, File keyPem) {
      this.tls = true;
      this.clientCertificate = Objects.requireNonNull(certificatePem, "certificatePem");
      this.clientKey = Objects.requireNonNull(keyPem, "keyPem");
      return this;
    }

    /** The deadline of each call (default 10 s); an expired one is {@link IdempotencyException.Unavailable}. */
    public Builder callTimeout(Duration callTimeout) {
      this.callTimeout = Objects.requireNonNull(callTimeout, "callTimeout");
      return this;
    }

    /** Use this channel (not closed by the client) instead of building one; TLS options are then refused. */
    public Builder channel(Channel channel) {
      this.channel = Objects.requireNonNull(channel, "channel");
      return this;
    }

    public IdempotencyClient build() {
      return new IdempotencyClient(this);
    }

    private Channel buildChannel() {
      if (channel != null) {
        if (tls) {
          throw new IllegalArgumentException("TLS options and channel() together: configure TLS on your channel");
        }
        return channel;
      }
      // Whichever transport is on the class path (grpc-netty, grpc-netty-shaded, grpc-okhttp).
      if (!tls) {
        return Grpc.newChannelBuilder(target, InsecureChannelCredentials.create()).build();
      }
      try {
        TlsChannelCredentials.Builder credentials = TlsChannelCredentials.newBuilder();
        if (rootCertificates != null) {
          credentials.trustManager(rootCertificates);
        }
        if (clientCertificate != null) {
          credentials.keyManager(clientCertificate, clientKey);
        }
        return Grpc.newChannelBuilder(target, credentials.build()).build();
      } catch (IOException error) {
        throw new IllegalArgumentException("TLS: " + error.getMessage(), error);
      }
    }
  }

  private IdempotencyServiceGrpc.IdempotencyServiceBlockingStub stub() {
    return IdempotencyServiceGrpc.newBlockingStub(channel).withDeadlineAfter(callTimeout.toMillis(), TimeUnit.MILLISECONDS);
  }

  /**
   * Polls the health check until it says SERVING for {@link #HEALTH_SERVICE},
   * every 50 ms; throws {@link IdempotencyException.Unavailable} after {@code timeout}.
   */
  public void waitUntilServing(Duration timeout) {
    long deadline = System.nanoTime() + timeout.toNanos();
    String last = "no answer yet";
    while (System.nanoTime() < deadline) {
      try {
        HealthCheckResponse reply = HealthGrpc.newBlockingStub(channel)
            .withDeadlineAfter(1, TimeUnit.SECONDS)
            .check(HealthCheckRequest.newBuilder().setService(HEALTH_SERVICE).build());
        if (reply.getStatus() == HealthCheckResponse.ServingStatus.SERVING) {
          return;
        }
        last = reply.getStatus().name();
      } catch (StatusRuntimeException error) {
        last = error.getStatus().getCode() + ": " + error.getStatus().getDescription();
      }
      sleep(Duration.ofMillis(50));
    }
    throw new IdempotencyException.Unavailable(
        "not SERVING after " + timeout + " (" + last + ")", io.grpc.Status.Code.UNAVAILABLE, null);
  }

  // -- the calls ------------------------------------------------------------

  /** Claim with the server's lease and retention and no fingerprint check. */
  public ClaimResult claim(String namespace, String key) {
    return claim(namespace, key, null, null, null);
  }

  /** Claim with a payload fingerprint (null or empty: no check). */
  public ClaimResult claim(String namespace, String key, byte[] fingerprint) {
    return claim(namespace, key, fingerprint, null, null);
  }

  /**
   * Tries to take the lease on a key. Losing a race is {@link Outcome#IN_PROGRESS}, never an error.
   *
   * @param fingerprint the payload's fingerprint (at most 64 bytes; null or empty: no check)
   * @param leaseTtl the lease length; null: the server's default
   * @param retention how long the completed result is kept; null: the server's default
   */
  public ClaimResult claim(String namespace, String key, byte[] fingerprint, Duration leaseTtl, Duration retention) {
    Idempotency.ClaimRequest.Builder request = Idempotency.ClaimRequest.newBuilder()
        .setNamespace(namespace)
        .setKey(key);
    if (fingerprint != null) {
      request.setFingerprint(ByteString.copyFrom(fingerprint));
    }
    if (leaseTtl != null) {
      request.setLeaseTtl(toProto(leaseTtl));
    }
    if (retention != null) {
      request.setRetention(toProto(retention));
    }
    Idempotency.ClaimResponse reply;
    try {
      reply = stub().claim(request.build());
    } catch (StatusRuntimeException error) {
      throw IdempotencyException.fromStatus("Claim", error);
    }
    return new ClaimResult(
        Outcome.of(reply.getOutcome()),
        reply.getLeaseToken(),
        reply.getFencingToken(),
        reply.hasLeaseExpiresAt() ? toInstant(reply.getLeaseExpiresAt()) : null,
        reply.getResponse().toByteArray(),
        reply.hasExpiresAt() ? toInstant(reply.getExpiresAt()) : null,
        reply.hasRetryAfter() ? toDuration(reply.getRetryAfter()) : null);
  }

  /** Complete with the Claim's retention. */
  public Instant complete(String namespace, String key, String leaseToken, byte[] response) {
    return complete(namespace, key, leaseToken, response, null);
  }

  /**
   * Stores the result of the work done under a lease; later Claims replay it.
   * A retried Complete that already succeeded returns the same answer.
   *
   * @return when the stored result expires
   */
  public Instant complete(String namespace, String key, String leaseToken, byte[] response, Duration retention) {
    Idempotency.CompleteRequest.Builder request = Idempotency.CompleteRequest.newBuilder()
        .setNamespace(namespace)
        .setKey(key)
        .setLeaseToken(leaseToken)
        .setResponse(response == null ? ByteString.EMPTY : ByteString.copyFrom(response));
    if (retention != null) {
      request.setRetention(toProto(retention));
    }
    try {
      Idempotency.CompleteResponse reply = stub().complete(request.build());
      return reply.hasExpiresAt() ? toInstant(reply.getExpiresAt()) : null;
    } catch (StatusRuntimeException error) {
      throw IdempotencyException.fromStatus("Complete", error);
    }
  }

  /** Gives a failed attempt back: the key is claimable again at once. */
  public void release(String namespace, String key, String leaseToken) {
    try {
      stub().release(Idempotency.ReleaseRequest.newBuilder()
          .setNamespace(namespace).setKey(key).setLeaseToken(leaseToken).build());
    } catch (StatusRuntimeException error) {
      throw IdempotencyException.fromStatus("Release", error);
    }
  }

  /**
   * Keeps a lease alive: it now runs out {@code leaseTtl} from now (null: the server's default).
   *
   * @return when the extended lease runs out
   */
  public Instant extendLease(String namespace, String key, String leaseToken, Duration leaseTtl) {
    Idempotency.ExtendLeaseRequest.Builder request = Idempotency.ExtendLeaseRequest.newBuilder()
        .setNamespace(namespace).setKey(key).setLeaseToken(leaseToken);
    if (leaseTtl != null) {
      request.setLeaseTtl(toProto(leaseTtl));
    }
    try {
      Idempotency.ExtendLeaseResponse reply = stub().extendLease(request.build());
      return reply.hasLeaseExpiresAt() ? toInstant(reply.getLeaseExpiresAt()) : null;
    } catch (StatusRuntimeException error) {
      throw IdempotencyException.fromStatus("ExtendLease", error);
    }
  }

  /** Inspects a key without changing it. */
  public KeyRecord get(String namespace, String key) {
    Idempotency.GetResponse reply;
    try {
      reply = stub().get(Idempotency.GetRequest.newBuilder().setNamespace(namespace).setKey(key).build());
    } catch (StatusRuntimeException error) {
      throw IdempotencyException.fromStatus("Get", error);
    }
    return new KeyRecord(
        State.of(reply.getState()),
        reply.getFencingToken(),
        reply.getFingerprint().toByteArray(),
        reply.getResponse().toByteArray(),
        reply.hasLeaseExpiresAt() ? toInstant(reply.getLeaseExpiresAt()) : null,
        reply.hasExpiresAt() ? toInstant(reply.getExpiresAt()) : null,
        reply.hasCreatedAt() ? toInstant(reply.getCreatedAt()) : null,
        reply.hasUpdatedAt() ? toInstant(reply.getUpdatedAt()) : null);
  }

  /**
   * An operator's action: the key's record expires now, so the next Claim wins
   * it (a live lease is revoked). Logged by the server with {@code reason}.
   *
   * @return true when there was an unexpired record to purge
   */
  public boolean purge(String namespace, String key, String reason) {
    try {
      return stub().purge(Idempotency.PurgeRequest.newBuilder()
          .setNamespace(namespace).setKey(key).setReason(reason == null ? "" : reason).build()).getPurged();
    } catch (StatusRuntimeException error) {
      throw IdempotencyException.fromStatus("Purge", error);
    }
  }

  // -- once -----------------------------------------------------------------

  /** {@link #once(String, String, byte[], Supplier, OnceOptions)} with the default options. */
  public byte[] once(String namespace, String key, byte[] fingerprint, Supplier<byte[]> work) {
    return once(namespace, key, fingerprint, work, OnceOptions.defaults());
  }

  /**
   * Runs {@code work} once per key and returns its result, or the stored
   * result of an earlier run (the replay; the work does not run then).
   * When the work throws, the key is released (the next delivery retries)
   * and the exception is rethrown as it is.
   *
   * @throws IdempotencyException.FingerprintMismatch the key was seen with another payload
   * @throws IdempotencyException.InProgress another claimant holds the lease (after the wait, with WAIT)
   * @throws IdempotencyException.LeaseLost the lease was lost; the result was not stored
   */
  public byte[] once(String namespace, String key, byte[] fingerprint, Supplier<byte[]> work, OnceOptions options) {
    return onceWithDetails(namespace, key, fingerprint, work, options).value();
  }

  /** Like once(), and says whether the value was replayed, with the deciding Claim. */
  public OnceResult onceWithDetails(String namespace, String key, byte[] fingerprint, Supplier<byte[]> work,
      OnceOptions options) {
    Objects.requireNonNull(work, "work");
    return onceWithLease(namespace, key, fingerprint, lease -> work.get(), options);
  }

  /**
   * Like onceWithDetails(), with the work given the {@link Lease}: its fencing
   * token for downstream writes, and {@link Lease#checkLease()} for long work.
   * A null result is stored as empty bytes.
   */
  public OnceResult onceWithLease(String namespace, String key, byte[] fingerprint, Function<Lease, byte[]> work,
      OnceOptions options) {
    Objects.requireNonNull(work, "work");
    Objects.requireNonNull(options, "options");
    long deadline = System.nanoTime() + options.waitTimeout().toNanos();
    for (int attempt = 0; ; attempt++) {
      ClaimResult claim = claim(namespace, key, fingerprint, options.leaseTtl(), options.retention());
      switch (claim.outcome()) {
        case CLAIMED:
          return runClaimed(namespace, key, claim, work, options);
        case COMPLETED:
          return new OnceResult(claim.response(), true, claim);
        case FINGERPRINT_MISMATCH:
          throw new IdempotencyException.FingerprintMismatch(
              namespace + "/" + key + ": the key was seen with another payload fingerprint");
        case IN_PROGRESS:
          break;
        default:
          throw new IdempotencyException("Claim: unexpected outcome " + claim.outcome(), null, null);
      }
      long remaining = deadline - System.nanoTime();
      if (options.onInProgress() == OnceOptions.OnInProgress.THROW || remaining <= 0) {
        boolean waited = options.onInProgress() == OnceOptions.OnInProgress.WAIT;
        throw new IdempotencyException.InProgress(
            namespace + "/" + key + ": another claimant holds the lease"
                + (waited ? " (waited " + options.waitTimeout() + ")" : "")
                + " (retry after " + claim.retryAfter() + ")",
            claim.retryAfter(), claim.leaseExpiresAt());
      }
      // 100 ms doubling, never past the other lease's expiry nor the wait timeout.
      long pause = FIRST_WAIT.toNanos() << Math.min(attempt, 20);
      if (claim.retryAfter() != null) {
        pause = Math.min(pause, Math.max(claim.retryAfter().toNanos(), MIN_WAIT.toNanos()));
      }
      sleep(Duration.ofNanos(Math.min(pause, remaining)));
    }
  }

  private OnceResult runClaimed(String namespace, String key, ClaimResult claim, Function<Lease, byte[]> work,
      OnceOptions options) {
    Lease lease = new Lease(namespace, key, claim);
    Heartbeat heartbeat = startHeartbeat(lease, options);
    byte[] value;
    try {
      value = work.apply(lease);
    } catch (RuntimeException | Error failure) {
      stop(heartbeat);
      releaseAfterFailure(lease, failure);
      throw failure;
    }
    stop(heartbeat);
    if (lease.isLost()) {
      throw new IdempotencyException.LeaseLost(
          namespace + "/" + key + ": the lease was lost while the work ran; the result was not stored",
          lease.lostCause());
    }
    byte[] response = value == null ? new byte[0] : value;
    try {
      complete(namespace, key, claim.leaseToken(), response, options.retention());
    } catch (IdempotencyException.KeyNotFound | IdempotencyException.LeaseNotCurrent error) {
      throw new IdempotencyException.LeaseLost(
          namespace + "/" + key + ": the lease was lost before Complete; the result was not stored", error);
    }
    return new OnceResult(response, false, claim);
  }

  private void releaseAfterFailure(Lease lease, Throwable failure) {
    if (lease.isLost()) {
      return; // not ours any more: nothing to release
    }
    try {
      release(lease.namespace(), lease.key(), lease.leaseToken());
    } catch (IdempotencyException error) {
      LOG.log(Level.WARNING, "idempotency once(): Release after a failed attempt failed: " + error.getMessage());
      failure.addSuppressed(error);
    }
  }

  /** Extends the lease every interval until stopped, or until the server says the lease is gone. */
  private final class Heartbeat implements Runnable {
    private final Lease lease;
    private final Duration leaseTtl;
    private boolean stopped;
    private ScheduledFuture<?> future;

    Heartbeat(Lease lease, Duration leaseTtl) {
      this.lease = lease;
      this.leaseTtl = leaseTtl;
    }

    @Override
    public synchronized void run() {
      if (stopped) {
        return;
      }
      try {
        extendLease(lease.namespace(), lease.key(), lease.leaseToken(), leaseTtl);
      } catch (IdempotencyException.KeyNotFound | IdempotencyException.LeaseNotCurrent error) {
        lease.markLost(error);
        stopped = true;
        future.cancel(false);
      } catch (IdempotencyException error) {
        // Transient: the lease may well still be ours, and Complete tells for sure.
        LOG.log(Level.WARNING, "idempotency heartbeat: ExtendLease failed: " + error.getMessage());
      }
    }

    // Waits for a beat in flight (synchronized), so no ExtendLease follows.
    synchronized void stop() {
      stopped = true;
      future.cancel(false);
    }
  }

  private Heartbeat startHeartbeat(Lease lease, OnceOptions options) {
    Duration interval = options.effectiveHeartbeatInterval();
    if (interval == null) {
      return null;
    }
    Heartbeat heartbeat = new Heartbeat(lease, options.leaseTtl());
    synchronized (heartbeat) {
      heartbeat.future = scheduler().scheduleWithFixedDelay(
          heartbeat, interval.toNanos(), interval.toNanos(), TimeUnit.NANOSECONDS);
    }
    return heartbeat;
  }

  private static void stop(Heartbeat heartbeat) {
    if (heartbeat != null) {
      heartbeat.stop();
    }
  }

  private synchronized ScheduledExecutorService scheduler() {
    if (heartbeats == null) {
      heartbeats = Executors.newSingleThreadScheduledExecutor(runnable -> {
        Thread thread = new Thread(runnable, "idempotency-heartbeat");
        thread.setDaemon(true);
        return thread;
      });
    }
    return heartbeats;
  }

  /** Stops the heartbeat thread and, when the client built it, shuts the channel down. */
  @Override
  public void close() {
    synchronized (this) {
      if (heartbeats != null) {
        heartbeats.shutdownNow();
      }
    }
    if (ownedChannel != null) {
      ownedChannel.shutdown();
      try {
        if (!ownedChannel.awaitTermination(5, TimeUnit.SECONDS)) {
          ownedChannel.shutdownNow();
        }
      } catch (InterruptedException interrupted) {
        ownedChannel.shutdownNow();
        Thread.currentThread().interrupt();
      }
    }
  }

  // -- helpers --------------------------------------------------------------

  private static void sleep(Duration pause) {
    try {
      Thread.sleep(pause.toMillis(), (int) (pause.toNanos() % 1_000_000));
    } catch (InterruptedException interrupted) {
      Thread.currentThread().interrupt();
      throw new IdempotencyException("interrupted", io.grpc.Status.Code.CANCELLED, interrupted);
    }
  }

  static com.google.protobuf.Duration toProto(Duration duration) {
    return com.google.protobuf.Duration.newBuilder()
        .setSeconds(duration.getSeconds()).setNanos(duration.getNano()).build();
  }

  static Duration toDuration(com.google.protobuf.Duration duration) {
    return Duration.ofSeconds(duration.getSeconds(), duration.getNanos());
  }

  static Instant toInstant(com.google.protobuf.Timestamp timestamp) {
    return Instant.ofEpochSecond(timestamp.getSeconds(), timestamp.getNanos());
  }
}
