package idempotency.client;

import io.grpc.Channel;
import io.grpc.ConnectivityState;
import io.grpc.ManagedChannel;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;

/**
 * The channels of a client, one per address, and the choice of one per
 * attempt: a call starts on the next address in turn, and each retry goes to
 * the next one. A channel that is connected is preferred to one that is
 * connecting, which is preferred to one that is failing, so a replica that is
 * down gets no call while another is up.
 */
final class Endpoints {
  /**
   * How often a failing channel is told to reconnect now. grpc-java's own
   * reconnect backoff grows to 2 minutes, which would keep a replica that came
   * back out of use long after it is up; the other clients cap it at 1 s.
   */
  private static final long RECONNECT_NUDGE_NANOS = TimeUnit.SECONDS.toNanos(1);

  /** One address: the channel calls go through (interceptors, token) and the one the client owns. */
  static final class Endpoint {
    final String target;
    final Channel channel;
    /** The channel under {@link #channel} whose state is followed; null for a caller's own channel. */
    final ManagedChannel managed;
    private volatile long lastNudge;

    Endpoint(String target, Channel channel, ManagedChannel managed) {
      this.target = target;
      this.channel = channel;
      this.managed = managed;
      this.lastNudge = System.nanoTime();
    }

    /** The channel's state, asking an idle one to connect; a failing one is nudged at most once a second. */
    ConnectivityState state() {
      if (managed == null) {
        return null;
      }
      ConnectivityState state = managed.getState(true);
      if (state == ConnectivityState.TRANSIENT_FAILURE) {
        long now = System.nanoTime();
        if (now - lastNudge >= RECONNECT_NUDGE_NANOS) {
          lastNudge = now;
          managed.resetConnectBackoff();
        }
      }
      return state;
    }
  }

  private final List<Endpoint> endpoints;
  private final AtomicInteger turn = new AtomicInteger();

  Endpoints(List<Endpoint> endpoints) {
    if (endpoints.isEmpty()) {
      throw new IllegalArgumentException("target: no address given");
    }
    this.endpoints = List.copyOf(endpoints);
    if (this.endpoints.size() > 1) {
      // Connect every address now, so that the first calls already know which are up.
      for (Endpoint endpoint : this.endpoints) {
        endpoint.state();
      }
    }
  }

  List<String> targets() {
    List<String> targets = new ArrayList<>();
    for (Endpoint endpoint : endpoints) {
      targets.add(endpoint.target);
    }
    return targets;
  }

  List<Endpoint> all() {
    return endpoints;
  }

  /** Where a call starts: the next address in turn. */
  int first() {
    return turn.getAndIncrement() & Integer.MAX_VALUE;
  }

  /**
   * The channel for attempt {@code attempt} (0 for the first) of a call that
   * started at {@code first}: in turn from there, the first that is connected,
   * else the first that is not failing (connecting, idle), else the one in turn.
   */
  Endpoint pick(int first, int attempt) {
    int count = endpoints.size();
    if (count == 1) {
      Endpoint only = endpoints.get(0);
      only.state(); // keeps a failing channel reconnecting
      return only;
    }
    int start = Math.floorMod(first + attempt, count);
    Endpoint notFailing = null;
    for (int offset = 0; offset < count; offset++) {
      Endpoint endpoint = endpoints.get((start + offset) % count);
      ConnectivityState state = endpoint.state();
      if (state == ConnectivityState.READY) {
        return endpoint;
      }
      if (notFailing == null && state != ConnectivityState.TRANSIENT_FAILURE && state != ConnectivityState.SHUTDOWN) {
        notFailing = endpoint;
      }
    }
    return notFailing != null ? notFailing : endpoints.get(start);
  }

  /** Shuts the owned channels down, waiting up to 5 s in all for calls in flight. */
  void close() {
    for (Endpoint endpoint : endpoints) {
      if (endpoint.managed != null) {
        endpoint.managed.shutdown();
      }
    }
    long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(5);
    for (Endpoint endpoint : endpoints) {
      if (endpoint.managed == null) {
        continue;
      }
      try {
        long left = Math.max(deadline - System.nanoTime(), 0);
        if (!endpoint.managed.awaitTermination(left, TimeUnit.NANOSECONDS)) {
          endpoint.managed.shutdownNow();
        }
      } catch (InterruptedException interrupted) {
        endpoint.managed.shutdownNow();
        Thread.currentThread().interrupt();
      }
    }
  }
}
