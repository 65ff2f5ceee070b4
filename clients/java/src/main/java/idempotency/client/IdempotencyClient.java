package idempotency.client;

import com.google.protobuf.ByteString;
import idempotency.client.health.HealthCheckRequest;
import idempotency.client.health.HealthCheckResponse;
import idempotency.client.health.HealthGrpc;
import idempotency.v1.Idempotency;
import idempotency.v1.IdempotencyServiceGrpc;
import io.grpc.Channel;
import io.grpc.ChannelCredentials;
import io.grpc.ClientInterceptor;
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
import java.security.SecureRandom;
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.Objects;
import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.TimeUnit;
import java.util.function.Function;
import java.util.function.Supplier;

/**
 * A blocking client of idempotency-service: the lease calls (claim, complete,
 * release, extendLease, get, purge) and {@code once()}, which wraps the
 * lifecycle: Claim; on CLAIMED run the work (extending the lease meanwhile,
 * with the checkpoint an earlier holder saved), then Complete with its result,
 * or Release when it throws; on COMPLETED return the stored result without
 * running the work (the replay); on IN_PROGRESS wait for the holder.
 *
 * <pre>{@code
 * try (IdempotencyClient client = new IdempotencyClient("10.0.0.1:50051,10.0.0.2:50051")) {
 *   String key = Keys.deriveKey("stripe", event.id());
 *   byte[] result = client.once("payments/stripe-webhooks", key, Keys.fingerprint(rawBody),
 *       () -> chargeCustomer(event));   // runs once per key; later calls replay its bytes
 * }
 * }</pre>
 *
 * <p>One address, several (a list, or one string with commas), or a gRPC
 * target ({@code dns:///idempotency.internal:50051}, balanced round-robin over
 * every address the name resolves to): one channel per address, each call
 * starting on the next in turn and each retry going to the next one. Every
 * call is retried on UNAVAILABLE, RESOURCE_EXHAUSTED and DEADLINE_EXCEEDED
 * with capped exponential backoff and full jitter within its deadline
 * ({@link RetryPolicy}); every RPC is safe to repeat, Claim because each
 * carries its own lease token.
 *
 * <p>Thread-safe; one client per process is enough. Errors are
 * {@link IdempotencyException} subclasses, one per status code.
 */
public final class IdempotencyClient implements AutoCloseable, LeaseCalls {
  /** The health service name that says the server's store is ready. */
  public static final String HEALTH_SERVICE = "idempotency.v1.IdempotencyService";

  /** Each call's deadline (all its attempts) unless the client or the call sets another. */
  public static final Duration DEFAULT_CALL_TIMEOUT = Duration.ofSeconds(10);

  private static final SecureRandom RANDOM = new SecureRandom();
  private static final char[] HEX = "0123456789abcdef".toCharArray();

  private final Endpoints endpoints;
  private final Duration callTimeout;
  private final RetryPolicy retry;
  private final Once once;
  private ScheduledExecutorService heartbeats;

  /**
   * Plaintext channels to {@code target}: "host:port", several separated by
   * commas, or a gRPC target such as {@code dns:///name:port}. Owned (closed by
   * {@link #close()}).
   */
  public IdempotencyClient(String target) {
    this(builder(target));
  }

  /** Plaintext channels to these addresses, one each. */
  public IdempotencyClient(List<String> targets) {
    this(builder(targets));
  }

  /**
   * A client on a channel you built (TLS, load balancing, interceptors...).
   * The channel is not closed by {@link #close()}.
   */
  public IdempotencyClient(Channel channel) {
    this(builder(List.of("<channel>")).channel(channel));
  }

  private IdempotencyClient(Builder builder) {
    this.endpoints = builder.buildEndpoints();
    this.callTimeout = builder.callTimeout;
    this.retry = builder.retry;
    this.once = new Once(this, this::scheduler);
  }

  /** Options: several addresses, a bearer token, TLS, a per-call timeout, retries, interceptors. */
  public static Builder builder(String target) {
    return new Builder(parseTargets(target));
  }

  /** {@link #builder(String)} with the addresses as a list. */
  public static Builder builder(List<String> targets) {
    return new Builder(parseTargets(targets));
  }

  /**
   * The addresses of a target string: split at commas, each trimmed (a gRPC
   * target such as {@code dns:///name:port} is one address).
   */
  static List<String> parseTargets(String target) {
    Objects.requireNonNull(target, "target");
    return parseTargets(Arrays.asList(target.split(",")));
  }

  static List<String> parseTargets(List<String> targets) {
    Objects.requireNonNull(targets, "targets");
    List<String> addresses = new ArrayList<>();
    for (String target : targets) {
      String trimmed = Objects.requireNonNull(target, "target: an address is null").trim();
      if (!trimmed.isEmpty()) {
        addresses.add(trimmed);
      }
    }
    if (addresses.isEmpty()) {
      throw new IllegalArgumentException("target: no address given");
    }
    return List.copyOf(addresses);
  }

  /**
   * A new lease token for one Claim: 128 bits from {@link SecureRandom}, as 32
   * lowercase hex characters (what the server expects). Every Claim this
   * client makes sends one of its own, the same on each retry of it.
   */
  public static String newLeaseToken() {
    byte[] bytes = new byte[16];
    RANDOM.nextBytes(bytes);
    char[] text = new char[32];
    for (int i = 0; i < bytes.length; i++) {
      text[2 * i] = HEX[(bytes[i] >> 4) & 0xf];
      text[2 * i + 1] = HEX[bytes[i] & 0xf];
    }
    return new String(text);
  }

  /** Builds an {@link IdempotencyClient} on channels it owns (the transport on the class path). */
  public static final class Builder {
    private final List<String> targets;
    private String token;
    private boolean tls;
    private File rootCertificates;
    private File clientCertificate;
    private File clientKey;
    private Duration callTimeout = DEFAULT_CALL_TIMEOUT;
    private RetryPolicy retry = RetryPolicy.defaults();
    private final List<ClientInterceptor> interceptors = new ArrayList<>();
    private Channel channel;

    private Builder(List<String> targets) {
      this.targets = targets;
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

    /**
     * The overall deadline of each call, its retries included (default 10 s);
     * a call whose deadline passes is {@link IdempotencyException.Unavailable}.
     * A Claim that waits ({@link ClaimOptions#waitFor}) gets its wait on top.
     */
    public Builder callTimeout(Duration callTimeout) {
      this.callTimeout = Objects.requireNonNull(callTimeout, "callTimeout");
      return this;
    }

    /** How calls are retried (default {@link RetryPolicy#defaults()}); {@link RetryPolicy#none()} turns retries off. */
    public Builder retry(RetryPolicy retry) {
      this.retry = Objects.requireNonNull(retry, "retry (RetryPolicy.none() for no retries)");
      return this;
    }

    /** Interceptors on every channel, run on every attempt of every call (tracing, tests). */
    public Builder interceptors(ClientInterceptor... interceptors) {
      this.interceptors.addAll(Arrays.asList(interceptors));
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

    private Endpoints buildEndpoints() {
      List<Endpoints.Endpoint> endpoints = new ArrayList<>();
      if (channel != null) {
        if (tls) {
          throw new IllegalArgumentException("TLS options and channel() together: configure TLS on your channel");
        }
        endpoints.add(new Endpoints.Endpoint("<channel>", decorate(channel), null));
        return new Endpoints(endpoints);
      }
      ChannelCredentials credentials = credentials();
      for (String target : targets) {
        // Whichever transport is on the class path (grpc-netty, grpc-netty-shaded, grpc-okhttp).
        // Round-robin over the addresses a name resolves to (a dns:/// name with several records).
        ManagedChannel managed = Grpc.newChannelBuilder(target, credentials)
            .defaultLoadBalancingPolicy("round_robin")
            .build();
        endpoints.add(new Endpoints.Endpoint(target, decorate(managed), managed));
      }
      return new Endpoints(endpoints);
    }

    private Channel decorate(Channel base) {
      Channel channel = base;
      if (token != null) {
        Metadata headers = new Metadata();
        headers.put(Metadata.Key.of("authorization", Metadata.ASCII_STRING_MARSHALLER), "Bearer " + token);
        channel = ClientInterceptors.intercept(channel, MetadataUtils.newAttachHeadersInterceptor(headers));
      }
      return ClientInterceptors.intercept(channel, interceptors);
    }

    private ChannelCredentials credentials() {
      if (!tls) {
        return InsecureChannelCredentials.create();
      }
      try {
        TlsChannelCredentials.Builder credentials = TlsChannelCredentials.newBuilder();
        if (rootCertificates != null) {
          credentials.trustManager(rootCertificates);
        }
        if (clientCertificate != null) {
          credentials.keyManager(clientCertificate, clientKey);
        }
        return credentials.build();
      } catch (IOException error) {
        throw new IllegalArgumentException("TLS: " + error.getMessage(), error);
      }
    }
  }

  /** The addresses this client calls, one channel each. */
  public List<String> targets() {
    return endpoints.targets();
  }

  @Override
  public Duration callTimeout() {
    return callTimeout;
  }

  public RetryPolicy retryPolicy() {
    return retry;
  }

  /**
   * Polls the health check of every address until each says SERVING for
   * {@link #HEALTH_SERVICE}, every 50 ms; throws
   * {@link IdempotencyException.Unavailable} after {@code timeout}.
   */
  public void waitUntilServing(Duration timeout) {
    long deadline = System.nanoTime() + timeout.toNanos();
    for (Endpoints.Endpoint endpoint : endpoints.all()) {
      String last = "no answer yet";
      while (true) {
        try {
          HealthCheckResponse reply = HealthGrpc.newBlockingStub(endpoint.channel)
              .withDeadlineAfter(1, TimeUnit.SECONDS)
              .check(HealthCheckRequest.newBuilder().setService(HEALTH_SERVICE).build());
          if (reply.getStatus() == HealthCheckResponse.ServingStatus.SERVING) {
            break;
          }
          last = reply.getStatus().name();
        } catch (StatusRuntimeException error) {
          last = error.getStatus().getCode() + ": " + error.getStatus().getDescription();
        }
        if (System.nanoTime() >= deadline) {
          throw new IdempotencyException.Unavailable(
              endpoint.target + " not SERVING after " + timeout + " (" + last + ")", io.grpc.Status.Code.UNAVAILABLE,
              null);
        }
        Once.sleep(Duration.ofMillis(50));
      }
    }
  }

  /** One RPC of the service on a blocking stub. */
  @FunctionalInterface
  private interface Rpc<Q, R> {
    R call(IdempotencyServiceGrpc.IdempotencyServiceBlockingStub stub, Q request);
  }

  /**
   * One RPC with its retries: each attempt on the next channel in turn,
   * within the overall deadline; the last failure thrown as its typed error.
   *
   * @param timeout the overall deadline; null: the client's callTimeout
   * @param extraPerAttempt added to the policy's per-attempt timeout (a waiting Claim's wait)
   */
  private <Q, R> R call(String name, Q request, Rpc<Q, R> rpc, Duration timeout, Duration extraPerAttempt) {
    Attempts attempts = new Attempts(retry, timeout == null ? callTimeout : timeout, extraPerAttempt);
    int first = endpoints.first();
    while (true) {
      Endpoints.Endpoint endpoint = endpoints.pick(first, attempts.made());
      IdempotencyServiceGrpc.IdempotencyServiceBlockingStub stub = IdempotencyServiceGrpc.newBlockingStub(endpoint.channel)
          .withDeadlineAfter(attempts.attemptTimeoutNanos(), TimeUnit.NANOSECONDS);
      try {
        return rpc.call(stub, request);
      } catch (StatusRuntimeException error) {
        Duration pause = attempts.pauseAfter(error, name, endpoint.target);
        if (pause == null) {
          throw IdempotencyException.fromStatus(name, error, attempts.made());
        }
        Once.sleep(pause);
      }
    }
  }

  private <Q, R> R call(String name, Q request, Rpc<Q, R> rpc, Duration timeout) {
    return call(name, request, rpc, timeout, Duration.ZERO);
  }

  // -- the calls ------------------------------------------------------------

  /** Claim with the server's lease and retention and no fingerprint check. */
  public ClaimResult claim(String namespace, String key) {
    return claim(namespace, key, ClaimOptions.defaults());
  }

  /** Claim with a payload fingerprint (null or empty: no check). */
  public ClaimResult claim(String namespace, String key, byte[] fingerprint) {
    return claim(namespace, key, ClaimOptions.defaults().fingerprint(fingerprint));
  }

  /**
   * Claim with a fingerprint, a lease length and a retention (each null: none,
   * or the server's default).
   */
  public ClaimResult claim(String namespace, String key, byte[] fingerprint, Duration leaseTtl, Duration retention) {
    return claim(namespace, key, ClaimOptions.defaults().fingerprint(fingerprint).leaseTtl(leaseTtl).retention(retention));
  }

  /**
   * Tries to take the lease on a key. Losing a race is {@link Outcome#IN_PROGRESS}, never an error
   * (unless {@link ClaimOptions#waitFor} asks to wait for the holder first).
   *
   * <p>Retry-safe: the Claim carries its own lease token ({@link ClaimOptions#leaseToken}, or a new
   * one), the same on every retry, so a retry after a lost answer gets the same lease back
   * ({@link ClaimResult#retried()}).
   */
  @Override
  public ClaimResult claim(String namespace, String key, ClaimOptions options) {
    Objects.requireNonNull(options, "options");
    Idempotency.ClaimRequest.Builder request = Idempotency.ClaimRequest.newBuilder()
        .setNamespace(namespace)
        .setKey(key)
        .setLeaseToken(options.leaseToken() != null ? options.leaseToken() : newLeaseToken());
    byte[] fingerprint = options.fingerprint();
    if (fingerprint != null) {
      request.setFingerprint(ByteString.copyFrom(fingerprint));
    }
    if (options.leaseTtl() != null) {
      request.setLeaseTtl(toProto(options.leaseTtl()));
    }
    if (options.retention() != null) {
      request.setRetention(toProto(options.retention()));
    }
    Duration wait = options.waits() ? options.waitFor() : Duration.ZERO;
    if (options.waitFor() != null) {
      request.setWait(toProto(options.waitFor()));
    }
    if (options.lateRetry() != null) {
      request.setLateRetry(options.lateRetry().toProto());
    }
    // A waiting Claim has its wait on top of the deadline, so that the server
    // waits the whole of it and still answers before the deadline.
    Duration timeout = (options.timeout() != null ? options.timeout() : callTimeout).plus(wait);
    Idempotency.ClaimResponse reply = call("Claim", request.build(),
        IdempotencyServiceGrpc.IdempotencyServiceBlockingStub::claim, timeout, wait);
    boolean checkpointed = reply.getCheckpointFencingToken() != 0;
    return new ClaimResult(
        Outcome.of(reply.getOutcome()),
        reply.getLeaseToken(),
        reply.getFencingToken(),
        reply.hasLeaseExpiresAt() ? toInstant(reply.getLeaseExpiresAt()) : null,
        reply.getResponse().toByteArray(),
        reply.hasExpiresAt() ? toInstant(reply.getExpiresAt()) : null,
        reply.hasRetryAfter() ? toDuration(reply.getRetryAfter()) : null,
        checkpointed ? reply.getCheckpoint().toByteArray() : null,
        reply.getCheckpointFencingToken(),
        reply.getRetried(),
        reply.hasWaited() ? toDuration(reply.getWaited()) : null,
        reply.hasCompletedAt() ? toInstant(reply.getCompletedAt()) : null);
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
  @Override
  public Instant complete(String namespace, String key, String leaseToken, byte[] response, Duration retention) {
    Idempotency.CompleteRequest.Builder request = Idempotency.CompleteRequest.newBuilder()
        .setNamespace(namespace)
        .setKey(key)
        .setLeaseToken(leaseToken)
        .setResponse(response == null ? ByteString.EMPTY : ByteString.copyFrom(response));
    if (retention != null) {
      request.setRetention(toProto(retention));
    }
    Idempotency.CompleteResponse reply = call("Complete", request.build(),
        IdempotencyServiceGrpc.IdempotencyServiceBlockingStub::complete, null);
    return reply.hasExpiresAt() ? toInstant(reply.getExpiresAt()) : null;
  }

  /** Gives a failed attempt back: the key is claimable again at once (the checkpoint saved before is kept). */
  public void release(String namespace, String key, String leaseToken) {
    release(namespace, key, leaseToken, null);
  }

  /**
   * Gives a failed attempt back: the key is claimable again at once.
   *
   * @param checkpoint saved for the next holder (how far this attempt got); null keeps the one saved before
   */
  @Override
  public void release(String namespace, String key, String leaseToken, byte[] checkpoint) {
    Idempotency.ReleaseRequest.Builder request = Idempotency.ReleaseRequest.newBuilder()
        .setNamespace(namespace).setKey(key).setLeaseToken(leaseToken);
    if (checkpoint != null) {
      request.setCheckpoint(ByteString.copyFrom(checkpoint));
    }
    call("Release", request.build(), IdempotencyServiceGrpc.IdempotencyServiceBlockingStub::release, null);
  }

  /**
   * Keeps a lease alive: it now runs out {@code leaseTtl} from now (null: the server's default).
   *
   * @return when the extended lease runs out
   */
  public Instant extendLease(String namespace, String key, String leaseToken, Duration leaseTtl) {
    return extendLease(namespace, key, leaseToken, leaseTtl, null, null);
  }

  /**
   * Keeps a lease alive and saves a checkpoint under it: how far the work got
   * (at most the server's limit, 64 KiB unless configured), replacing the one
   * saved before. Whoever takes the key over after this lease receives it.
   *
   * @param checkpoint null keeps the one saved before
   */
  public Instant extendLease(String namespace, String key, String leaseToken, Duration leaseTtl, byte[] checkpoint) {
    return extendLease(namespace, key, leaseToken, leaseTtl, checkpoint, null);
  }

  /**
   * {@link #extendLease(String, String, String, Duration, byte[])} with its own
   * overall deadline (null: the client's callTimeout).
   */
  @Override
  public Instant extendLease(String namespace, String key, String leaseToken, Duration leaseTtl, byte[] checkpoint,
      Duration timeout) {
    Idempotency.ExtendLeaseRequest.Builder request = Idempotency.ExtendLeaseRequest.newBuilder()
        .setNamespace(namespace).setKey(key).setLeaseToken(leaseToken);
    if (leaseTtl != null) {
      request.setLeaseTtl(toProto(leaseTtl));
    }
    if (checkpoint != null) {
      request.setCheckpoint(ByteString.copyFrom(checkpoint));
    }
    Idempotency.ExtendLeaseResponse reply = call("ExtendLease", request.build(),
        IdempotencyServiceGrpc.IdempotencyServiceBlockingStub::extendLease, timeout);
    return reply.hasLeaseExpiresAt() ? toInstant(reply.getLeaseExpiresAt()) : null;
  }

  /** Inspects a key without changing it. */
  public KeyRecord get(String namespace, String key) {
    Idempotency.GetResponse reply = call("Get",
        Idempotency.GetRequest.newBuilder().setNamespace(namespace).setKey(key).build(),
        IdempotencyServiceGrpc.IdempotencyServiceBlockingStub::get, null);
    boolean checkpointed = reply.getCheckpointFencingToken() != 0;
    return new KeyRecord(
        State.of(reply.getState()),
        reply.getFencingToken(),
        reply.getFingerprint().toByteArray(),
        reply.getResponse().toByteArray(),
        reply.hasLeaseExpiresAt() ? toInstant(reply.getLeaseExpiresAt()) : null,
        reply.hasExpiresAt() ? toInstant(reply.getExpiresAt()) : null,
        reply.hasCreatedAt() ? toInstant(reply.getCreatedAt()) : null,
        reply.hasUpdatedAt() ? toInstant(reply.getUpdatedAt()) : null,
        checkpointed ? reply.getCheckpoint().toByteArray() : null,
        reply.getCheckpointFencingToken(),
        reply.hasCompletedAt() ? toInstant(reply.getCompletedAt()) : null,
        reply.hasRememberedUntil() ? toInstant(reply.getRememberedUntil()) : null);
  }

  /**
   * An operator's action: the key's record expires now, so the next Claim wins
   * it (a live lease is revoked). Logged by the server with {@code reason}.
   *
   * @return true when there was an unexpired record to purge (a retry after a
   *     lost answer says false: the record is gone already)
   */
  public boolean purge(String namespace, String key, String reason) {
    return call("Purge",
        Idempotency.PurgeRequest.newBuilder().setNamespace(namespace).setKey(key)
            .setReason(reason == null ? "" : reason).build(),
        IdempotencyServiceGrpc.IdempotencyServiceBlockingStub::purge, null).getPurged();
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
   * and the exception is rethrown as it is. When another caller holds the
   * key, waits for it (by default; see {@link OnceOptions.OnInProgress}).
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
   * token for downstream writes, {@link Lease#checkLease()} for long work, and
   * the checkpoint to resume from ({@link Lease#checkpoint()},
   * {@link Lease#saveCheckpoint(byte[])}). A null result is stored as empty bytes.
   */
  public OnceResult onceWithLease(String namespace, String key, byte[] fingerprint, Function<Lease, byte[]> work,
      OnceOptions options) {
    Objects.requireNonNull(work, "work");
    Objects.requireNonNull(options, "options");
    return once.run(namespace, key, fingerprint, work, options);
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

  /** Stops the heartbeat thread and shuts down the channels the client built. */
  @Override
  public void close() {
    synchronized (this) {
      if (heartbeats != null) {
        heartbeats.shutdownNow();
      }
    }
    endpoints.close();
  }

  // -- helpers --------------------------------------------------------------

  static com.google.protobuf.Duration toProto(Duration duration) {
    long seconds = duration.getSeconds();
    int nanos = duration.getNano();
    if (seconds < 0 && nanos > 0) {
      // java.time keeps nanos positive; protobuf wants them of the seconds' sign.
      seconds += 1;
      nanos -= 1_000_000_000;
    }
    return com.google.protobuf.Duration.newBuilder().setSeconds(seconds).setNanos(nanos).build();
  }

  static Duration toDuration(com.google.protobuf.Duration duration) {
    return Duration.ofSeconds(duration.getSeconds(), duration.getNanos());
  }

  static Instant toInstant(com.google.protobuf.Timestamp timestamp) {
    return Instant.ofEpochSecond(timestamp.getSeconds(), timestamp.getNanos());
  }
}
