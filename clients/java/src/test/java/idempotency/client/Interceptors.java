package idempotency.client;

import io.grpc.CallOptions;
import io.grpc.Channel;
import io.grpc.ClientCall;
import io.grpc.ClientInterceptor;
import io.grpc.ForwardingClientCall;
import io.grpc.ForwardingClientCallListener;
import io.grpc.Metadata;
import io.grpc.MethodDescriptor;
import io.grpc.Status;
import java.util.ArrayList;
import java.util.List;

/**
 * Client interceptors for the tests: they count attempts, and lose an answer
 * on purpose (the call reached the server, which did the work; the caller sees
 * UNAVAILABLE instead of the answer), as a dropped connection or a replica
 * that dies after committing would. The counterparts of the Python suite's
 * tests/interceptors.py.
 */
final class Interceptors {
  static final String DROPPED = "the answer was dropped on purpose by the test";

  private Interceptors() {}

  /** What an interceptor saw: each attempt's method and status code, and the calls started. */
  abstract static class Recorder implements ClientInterceptor {
    private final List<String> attempts = new ArrayList<>();
    private final List<String> started = new ArrayList<>();

    synchronized void record(String method, Status.Code code) {
      attempts.add(method + " " + code);
    }

    synchronized void recordStart(String method) {
      started.add(method);
    }

    /** Attempts of {@code method} (null: any) that ended with {@code code} (null: any). */
    synchronized int count(String method, Status.Code code) {
      int count = 0;
      for (String attempt : attempts) {
        String[] parts = attempt.split(" ");
        if ((method == null || parts[0].equals(method)) && (code == null || parts[1].equals(code.name()))) {
          count++;
        }
      }
      return count;
    }

    /** Calls of {@code method} sent so far, answered or not. */
    synchronized int started(String method) {
      return (int) started.stream().filter(method::equals).count();
    }

    /** Every attempt as "Method CODE", in order. */
    synchronized List<String> attempts() {
      return List.copyOf(attempts);
    }
  }

  /** A call passed on as it is, its start and outcome recorded. */
  static final class Forward<Q, R> extends ForwardingClientCall.SimpleForwardingClientCall<Q, R> {
    private final Recorder recorder;
    private final String name;

    Forward(Recorder recorder, String name, ClientCall<Q, R> call) {
      super(call);
      this.recorder = recorder;
      this.name = name;
    }

    @Override
    public void start(Listener<R> listener, Metadata headers) {
      recorder.recordStart(name);
      super.start(new ForwardingClientCallListener.SimpleForwardingClientCallListener<>(listener) {
        @Override
        public void onClose(Status status, Metadata trailers) {
          recorder.record(name, status.getCode());
          super.onClose(status, trailers);
        }
      }, headers);
    }
  }

  /** Counts every attempt with its outcome. */
  static final class Counting extends Recorder {
    @Override
    public <Q, R> ClientCall<Q, R> interceptCall(MethodDescriptor<Q, R> method, CallOptions options, Channel next) {
      return new Forward<>(this, method.getBareMethodName(), next.newCall(method, options));
    }
  }

  /**
   * Lets the first {@code times} calls of {@code method} reach the server and
   * answer OK, keeps their answers in {@link #dropped()}, and closes them with
   * UNAVAILABLE to the caller instead. Every attempt is counted.
   */
  static final class DropAnswers extends Recorder {
    private final String method;
    private final int times;
    private final List<Object> dropped = new ArrayList<>();

    DropAnswers(String method, int times) {
      this.method = method;
      this.times = times;
    }

    synchronized List<Object> dropped() {
      return List.copyOf(dropped);
    }

    private synchronized boolean keep(String name, Object answer) {
      if (name.equals(method) && dropped.size() < times) {
        dropped.add(answer);
        return true;
      }
      return false;
    }

    @Override
    public <Q, R> ClientCall<Q, R> interceptCall(MethodDescriptor<Q, R> descriptor, CallOptions options, Channel next) {
      String name = descriptor.getBareMethodName();
      return new ForwardingClientCall.SimpleForwardingClientCall<>(next.newCall(descriptor, options)) {
        @Override
        public void start(Listener<R> listener, Metadata headers) {
          recordStart(name);
          super.start(new ForwardingClientCallListener.SimpleForwardingClientCallListener<>(listener) {
            private boolean droppedThis;

            @Override
            public void onMessage(R message) {
              if (keep(name, message)) {
                droppedThis = true; // the caller never sees it
              } else {
                super.onMessage(message);
              }
            }

            @Override
            public void onClose(Status status, Metadata trailers) {
              if (droppedThis && status.isOk()) {
                record(name, Status.Code.UNAVAILABLE);
                super.onClose(Status.UNAVAILABLE.withDescription(DROPPED), new Metadata());
                return;
              }
              record(name, status.getCode());
              super.onClose(status, trailers);
            }
          }, headers);
        }
      };
    }
  }

  /** Fails every call of {@code method} with {@code code} without sending it. */
  static final class FailCalls extends Recorder {
    private final String method;
    private final Status.Code code;

    FailCalls(String method, Status.Code code) {
      this.method = method;
      this.code = code;
    }

    @Override
    public <Q, R> ClientCall<Q, R> interceptCall(MethodDescriptor<Q, R> descriptor, CallOptions options, Channel next) {
      String name = descriptor.getBareMethodName();
      if (!name.equals(method)) {
        return new Forward<>(this, name, next.newCall(descriptor, options));
      }
      return new ClientCall<>() {
        private Listener<R> listener;

        @Override
        public void start(Listener<R> listener, Metadata headers) {
          recordStart(name);
          this.listener = listener;
        }

        @Override
        public void request(int count) {}

        @Override
        public void cancel(String message, Throwable cause) {}

        @Override
        public void sendMessage(Q message) {}

        @Override
        public void halfClose() {
          record(name, code);
          listener.onClose(Status.fromCode(code).withDescription("failed on purpose by the test"), new Metadata());
        }
      };
    }
  }

  /**
   * Runs {@code action} once, right before the first call of {@code method} is
   * sent (after the client chose the channel for it); counts every attempt.
   */
  static final class BeforeFirst extends Recorder {
    private final String method;
    private final Runnable action;
    private boolean done;

    BeforeFirst(String method, Runnable action) {
      this.method = method;
      this.action = action;
    }

    private synchronized boolean first(String name) {
      if (name.equals(method) && !done) {
        done = true;
        return true;
      }
      return false;
    }

    @Override
    public <Q, R> ClientCall<Q, R> interceptCall(MethodDescriptor<Q, R> descriptor, CallOptions options, Channel next) {
      String name = descriptor.getBareMethodName();
      if (first(name)) {
        action.run();
      }
      return new Forward<>(this, name, next.newCall(descriptor, options));
    }
  }
}
