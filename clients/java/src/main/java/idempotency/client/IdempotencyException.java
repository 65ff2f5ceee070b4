package idempotency.client;

import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import java.time.Duration;
import java.time.Instant;

/**
 * Every error this client throws: one subclass per gRPC status the service
 * uses, plus {@code once()}'s own outcomes ({@link FingerprintMismatch},
 * {@link InProgress}, {@link LeaseLost}). Unchecked, like grpc-java's own
 * {@link StatusRuntimeException}, which is the cause of a failed call's error.
 */
public class IdempotencyException extends RuntimeException {
  private static final long serialVersionUID = 1L;
  private final Status.Code code;
  private int attempts;

  public IdempotencyException(String message, Status.Code code, Throwable cause) {
    super(message, cause);
    this.code = code;
  }

  /** The gRPC status code behind the error, or null for once()'s own outcomes. */
  public Status.Code code() {
    return code;
  }

  /**
   * How many attempts the failed call made, its retries included (the error is
   * the last attempt's); 0 for errors that are not a call's.
   */
  public int attempts() {
    return attempts;
  }

  /** INVALID_ARGUMENT: a field is missing, too long or malformed; the message names it. Nothing changed. */
  public static class InvalidArgument extends IdempotencyException {
    private static final long serialVersionUID = 1L;

    public InvalidArgument(String message, Throwable cause) {
      super(message, Status.Code.INVALID_ARGUMENT, cause);
    }
  }

  /** NOT_FOUND: Complete, Release or ExtendLease on a key that does not exist or whose record expired. */
  public static class KeyNotFound extends IdempotencyException {
    private static final long serialVersionUID = 1L;

    public KeyNotFound(String message, Throwable cause) {
      super(message, Status.Code.NOT_FOUND, cause);
    }
  }

  /** FAILED_PRECONDITION: the lease token is not the key's current one (lost, released, or completed). */
  public static class LeaseNotCurrent extends IdempotencyException {
    private static final long serialVersionUID = 1L;

    public LeaseNotCurrent(String message, Throwable cause) {
      super(message, Status.Code.FAILED_PRECONDITION, cause);
    }
  }

  /**
   * UNAVAILABLE or DEADLINE_EXCEEDED: the service or its store cannot be
   * reached, after the client's retries (see {@link RetryPolicy}) ran out.
   */
  public static class Unavailable extends IdempotencyException {
    private static final long serialVersionUID = 1L;

    public Unavailable(String message, Status.Code code, Throwable cause) {
      super(message, code, cause);
    }
  }

  /** UNAUTHENTICATED: no credentials, or a token (certificate) the server's policy does not know. */
  public static class Unauthenticated extends IdempotencyException {
    private static final long serialVersionUID = 1L;

    public Unauthenticated(String message, Throwable cause) {
      super(message, Status.Code.UNAUTHENTICATED, cause);
    }
  }

  /** PERMISSION_DENIED: the policy does not grant this RPC or namespace. Nothing changed. */
  public static class PermissionDenied extends IdempotencyException {
    private static final long serialVersionUID = 1L;

    public PermissionDenied(String message, Throwable cause) {
      super(message, Status.Code.PERMISSION_DENIED, cause);
    }
  }

  /** RESOURCE_EXHAUSTED: over the rate limit, or too many calls in flight, after the client's retries ran out. */
  public static class ResourceExhausted extends IdempotencyException {
    private static final long serialVersionUID = 1L;

    public ResourceExhausted(String message, Throwable cause) {
      super(message, Status.Code.RESOURCE_EXHAUSTED, cause);
    }
  }

  /** once(): the key was seen with another payload fingerprint. Nothing changed; the work did not run. */
  public static class FingerprintMismatch extends IdempotencyException {
    private static final long serialVersionUID = 1L;

    public FingerprintMismatch(String message) {
      super(message, null, null);
    }
  }

  /** once(): another claimant holds a live lease (and the wait, if any, ran out). The work did not run. */
  public static class InProgress extends IdempotencyException {
    private static final long serialVersionUID = 1L;
    private final transient Duration retryAfter;
    private final transient Instant leaseExpiresAt;

    public InProgress(String message, Duration retryAfter, Instant leaseExpiresAt) {
      super(message, null, null);
      this.retryAfter = retryAfter;
      this.leaseExpiresAt = leaseExpiresAt;
    }

    /** The time that was left on the other claimant's lease, or null. */
    public Duration retryAfter() {
      return retryAfter;
    }

    /** When the other claimant's lease runs out, or null. */
    public Instant leaseExpiresAt() {
      return leaseExpiresAt;
    }
  }

  /**
   * once(): the lease was lost (to a heartbeat's or Complete's NOT_FOUND or
   * FAILED_PRECONDITION) and the result was NOT stored; someone else may be
   * doing the work. The cause is the call's error.
   */
  public static class LeaseLost extends IdempotencyException {
    private static final long serialVersionUID = 1L;

    public LeaseLost(String message, Throwable cause) {
      super(message, null, cause);
    }
  }

  /**
   * The exception for a call that failed after {@code attempts} attempts: the
   * subclass for the last attempt's status code (the message says how many
   * attempts when more than one).
   */
  static IdempotencyException fromStatus(String rpc, StatusRuntimeException error, int attempts) {
    IdempotencyException exception = forStatus(rpc, error, attempts > 1 ? " (after " + attempts + " attempts)" : "");
    exception.attempts = attempts;
    return exception;
  }

  private static IdempotencyException forStatus(String rpc, StatusRuntimeException error, String after) {
    Status status = error.getStatus();
    String message = rpc + ": " + status.getCode() + (status.getDescription() == null ? "" : ": " + status.getDescription())
        + after;
    switch (status.getCode()) {
      case INVALID_ARGUMENT:
        return new InvalidArgument(message, error);
      case NOT_FOUND:
        return new KeyNotFound(message, error);
      case FAILED_PRECONDITION:
        return new LeaseNotCurrent(message, error);
      case UNAVAILABLE:
      case DEADLINE_EXCEEDED:
        return new Unavailable(message, status.getCode(), error);
      case UNAUTHENTICATED:
        return new Unauthenticated(message, error);
      case PERMISSION_DENIED:
        return new PermissionDenied(message, error);
      case RESOURCE_EXHAUSTED:
        return new ResourceExhausted(message, error);
      default:
        return new IdempotencyException(message, status.getCode(), error);
    }
  }
}
