package idempotency.client;

import idempotency.v1.Idempotency;
import idempotency.v1.IdempotencyServiceGrpc;
import io.grpc.CallOptions;
import io.grpc.Grpc;
import io.grpc.InsecureChannelCredentials;
import io.grpc.ManagedChannel;
import io.grpc.MethodDescriptor;
import io.grpc.Server;
import io.grpc.ServerServiceDefinition;
import io.grpc.netty.NettyServerBuilder;
import io.grpc.stub.ClientCalls;
import io.grpc.stub.ServerCalls;
import java.io.IOException;
import java.io.UncheckedIOException;
import java.net.InetAddress;
import java.net.InetSocketAddress;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;

/**
 * A gRPC relay on a free loopback port in front of a real server: it forwards
 * every call of the service unchanged (the caller's deadline goes with it),
 * except that it clears ClaimRequest.wait. That is exactly what a server that
 * predates the field does (it never takes effect, and ClaimResponse.waited is
 * never set), so a client behind it must fall back to polling.
 */
final class Relay implements AutoCloseable {
  private final ManagedChannel upstream;
  private final Server server;
  /** Claims relayed, and how many of them had asked to wait. */
  final AtomicInteger claims = new AtomicInteger();
  final AtomicInteger claimsAskingToWait = new AtomicInteger();

  private Relay(String upstreamTarget) {
    this.upstream = Grpc.newChannelBuilder(upstreamTarget, InsecureChannelCredentials.create()).build();
    ServerServiceDefinition.Builder service = ServerServiceDefinition.builder(IdempotencyServiceGrpc.getServiceDescriptor());
    for (MethodDescriptor<?, ?> method : IdempotencyServiceGrpc.getServiceDescriptor().getMethods()) {
      forward(service, method);
    }
    try {
      this.server = NettyServerBuilder.forAddress(new InetSocketAddress(InetAddress.getLoopbackAddress(), 0))
          .addService(service.build())
          .build()
          .start();
    } catch (IOException error) {
      upstream.shutdownNow();
      throw new UncheckedIOException(error);
    }
  }

  static Relay start(String upstreamTarget) {
    return new Relay(upstreamTarget);
  }

  String target() {
    return "127.0.0.1:" + server.getPort();
  }

  private <Q, R> void forward(ServerServiceDefinition.Builder service, MethodDescriptor<Q, R> method) {
    // Runs in the incoming call's context: its deadline and cancellation reach the upstream call.
    service.addMethod(method, ServerCalls.asyncUnaryCall((request, responses) ->
        ClientCalls.asyncUnaryCall(upstream.newCall(method, CallOptions.DEFAULT), rewrite(request), responses)));
  }

  @SuppressWarnings("unchecked")
  private <Q> Q rewrite(Q request) {
    if (request instanceof Idempotency.ClaimRequest) {
      Idempotency.ClaimRequest claim = (Idempotency.ClaimRequest) request;
      claims.incrementAndGet();
      if (claim.hasWait()) {
        claimsAskingToWait.incrementAndGet();
      }
      return (Q) claim.toBuilder().clearWait().build();
    }
    return request;
  }

  @Override
  public void close() {
    server.shutdownNow();
    upstream.shutdownNow();
    try {
      server.awaitTermination(5, TimeUnit.SECONDS);
      upstream.awaitTermination(5, TimeUnit.SECONDS);
    } catch (InterruptedException interrupted) {
      Thread.currentThread().interrupt();
    }
  }
}
