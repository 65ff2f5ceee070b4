// grpc-js client interceptors for the retry tests: they see every attempt of
// every call, record it, and can turn an answer into a failure.
import * as grpc from "@grpc/grpc-js";

export interface Attempt {
  /** The RPC's name: "Claim", "Complete", ... */
  method: string;
  /** When the attempt started (Date.now()). */
  at: number;
  /** The request as the client sent it (the loader's plain object). */
  request: any;
  /** The status the server answered with, before any rewriting by `fail`. */
  code?: grpc.status;
  /** The status the client saw. */
  seenCode?: grpc.status;
}

export interface Recorder {
  interceptor: grpc.Interceptor;
  attempts: Attempt[];
  /** The attempts of one RPC. */
  of(method: string): Attempt[];
}

/**
 * Record every attempt. `fail(attempt)` may return a status code: the call
 * still reaches the server (which does its work), but the answer is dropped
 * and the client sees that code instead, as when a connection breaks after
 * the server committed.
 */
export function recorder(fail?: (attempt: Attempt, index: number) => grpc.status | undefined): Recorder {
  const attempts: Attempt[] = [];
  const interceptor: grpc.Interceptor = (options, nextCall) => {
    const attempt: Attempt = { method: options.method_definition.path.split("/").pop()!, at: Date.now(), request: undefined };
    const index = attempts.filter((a) => a.method === attempt.method).length;
    attempts.push(attempt);
    let replaced: grpc.status | undefined;
    return new grpc.InterceptingCall(nextCall(options), {
      start(metadata, listener, next) {
        next(metadata, {
          onReceiveMessage(message, nextMessage) {
            if (replaced === undefined) nextMessage(message);
          },
          onReceiveStatus(status, nextStatus) {
            attempt.code = status.code;
            if (replaced !== undefined) {
              attempt.seenCode = replaced;
              // Straight to the caller's side: grpc-js holds a status back
              // while a message it was given is not passed on (nextMessage).
              listener.onReceiveStatus({ code: replaced, details: `the test dropped the answer (${grpc.status[status.code]})`, metadata: new grpc.Metadata() });
            } else {
              attempt.seenCode = status.code;
              nextStatus(status);
            }
          },
        });
      },
      sendMessage(message, next) {
        attempt.request = message;
        replaced = fail?.(attempt, index);
        next(message);
      },
    });
  };
  return { interceptor, attempts, of: (method) => attempts.filter((a) => a.method === method) };
}

/** Drop the answers of the first `count` attempts of `method`, failing them with UNAVAILABLE. */
export function dropAnswers(method: string, count = 1): Recorder {
  return recorder((attempt, index) => (attempt.method === method && index < count ? grpc.status.UNAVAILABLE : undefined));
}
