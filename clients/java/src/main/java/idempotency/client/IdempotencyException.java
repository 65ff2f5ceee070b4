package idempotency.client;

import com.google.protobuf.Any;
import com.google.protobuf.InvalidProtocolBufferException;
import com.google.rpc.BadRequest;
import com.google.rpc.ErrorInfo;
import com.google.rpc.RetryInfo;
import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import io.grpc.protobuf.StatusProto;
import java.time.Duration;
import java.time.Instant;
import java.time.format.DateTimeParseException;
import java.util.Map;

/**
 * Every error this client throws: one subclass per gRPC status the service
 * uses, plus {@code once()}'s own outcomes ({@link FingerprintMismatch},
 * {@link InProgress}, {@link LeaseLost}, {@link ResultExpired}). Unchecked,
 * like grpc-java's own {@link StatusRuntimeException}, which is the cause of
 * a failed call's error.
 *
 * <p>A failed call's error also carries the status's google.rpc details
 * (decoded with grpc-protobuf's {@link StatusProto#fromThrowable}):
 * {@link #reason()} (ErrorInfo's stable reason: {@code LEASE_LOST},
 * {@code KEY_EXPIRED}, ...), {@link #retryDelay()} (RetryInfo: how long to wait
 * before the same call can succeed) and {@link #field()} (BadRequest's field
 * violation, for INVALID_ARGUMENT). All null when the status carries none (a
 * server that predates them, or a status the channel made: a connection refused).
 */
public class IdempotencyException extends RuntimeException {
  private static final long serialVersionUID = 1L;

  /** ErrorInfo's domain on the service's statuses. */
  public static final String DOMAIN = "idempotency-service";

  private final Status.Code code;
  private int attempts;
  private transient Details details = Details.NONE;

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

  private Details details() {
    return details == null ? Details.NONE : details; // null after deserialization (transient)
  }

  /**
   * The stable reason of the status (google.rpc.ErrorInfo's {@code reason}):
   * {@code INVALID_ARGUMENT}, {@code NOT_FOUND}, {@code KEY_EXPIRED},
   * {@code LEASE_LOST}, {@code LEASE_RELEASED}, {@code KEY_COMPLETED},
   * {@code CONTENDED}, {@code STORE_UNAVAILABLE}, {@code UNAUTHENTICATED},
   * {@code PERMISSION_DENIED}, {@code RATE_LIMITED}, {@code OVERLOADED},
   * {@code DEADLINE_EXCEEDED}, {@code INTERNAL} (the proto's ErrorReason);
   * null when the status carries none, and for once()'s own outcomes.
   */
  public String reason() {
    return details().reason;
  }

  /** ErrorInfo's domain ({@link #DOMAIN}), or null. */
  public String domain() {
    return details().domain;
  }

  /**
   * ErrorInfo's metadata: {@code field} for INVALID_ARGUMENT,
   * {@code completed_at} and {@code remembered_until} (RFC 3339) for
   * KEY_EXPIRED; empty when none.
   */
  public Map<String, String> metadata() {
    return details().metadata;
  }

  /**
   * google.rpc.RetryInfo's delay: how long to wait before the same call can
   * succeed (UNAVAILABLE, RESOURCE_EXHAUSTED, ABORTED); null when the status
   * carries none. The client's retries never wait less.
   */
  public Duration retryDelay() {
    return details().retryDelay;
  }

  /**
   * INVALID_ARGUMENT: the request field at fault ({@code lease_token},
   * {@code items[2].key}), from BadRequest's field violation, else
   * ErrorInfo's {@code field}; null otherwise.
   */
  public String field() {
    return details().field;
  }

  /** The field violation's description, or null. */
  public String fieldDescription() {
    return details().fieldDescription;
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

  /**
   * NOT_FOUND with reason KEY_EXPIRED: Complete, Release or ExtendLease on a
   * remembered key, one completed whose result has expired (the server keeps
   * a marker of it until {@link #rememberedUntil()}). The effect happened;
   * there is nothing to complete, release or extend.
   */
  public static class KeyExpired extends KeyNotFound {
    private static final long serialVersionUID = 1L;

    public KeyExpired(String message, Throwable cause) {
      super(message, cause);
    }

    /** When the key was completed (ErrorInfo's {@code completed_at}), or null. */
    public Instant completedAt() {
      return instant(metadata().get("completed_at"));
    }

    /** Until when the key is remembered (ErrorInfo's {@code remembered_until}), or null. */
    public Instant rememberedUntil() {
      return instant(metadata().get("remembered_until"));
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
   * once(): a late retry refused ({@link LateRetry#REFUSE}, the call's or its
   * namespace's or the server's policy): the key was completed at
   * {@link #completedAt()}, its stored result has expired, and the server
   * still remembers it (OUTCOME_EXPIRED). The effect happened; the result is
   * gone; the work did not run.
   */
  public static class ResultExpired extends IdempotencyException {
    private static final long serialVersionUID = 1L;
    private final transient Instant completedAt;
    private final long fencingToken;

    public ResultExpired(String message, Instant completedAt, long fencingToken) {
      super(message, null, null);
      this.completedAt = completedAt;
      this.fencingToken = fencingToken;
    }

    /** When the key was completed. */
    public Instant completedAt() {
      return completedAt;
    }

    /** The fencing token of the last lease (the one that completed); a later holder gets a higher one. */
    public long fencingToken() {
      return fencingToken;
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
    Details details = Details.of(error);
    IdempotencyException exception = forStatus(rpc, error, details,
        attempts > 1 ? " (after " + attempts + " attempts)" : "");
    exception.attempts = attempts;
    exception.details = details;
    return exception;
  }

  private static IdempotencyException forStatus(String rpc, StatusRuntimeException error, Details details,
      String after) {
    Status status = error.getStatus();
    String message = rpc + ": " + status.getCode() + (details.reason == null ? "" : " " + details.reason)
        + (status.getDescription() == null ? "" : ": " + status.getDescription()) + after;
    switch (status.getCode()) {
      case INVALID_ARGUMENT:
        return new InvalidArgument(message, error);
      case NOT_FOUND:
        if ("KEY_EXPIRED".equals(details.reason)) {
          return new KeyExpired(message, error);
        }
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

  static Instant instant(String rfc3339) {
    if (rfc3339 == null || rfc3339.isEmpty()) {
      return null;
    }
    try {
      return java.time.OffsetDateTime.parse(rfc3339).toInstant();
    } catch (DateTimeParseException malformed) {
      return null;
    }
  }

  /** What a status's google.rpc details say. */
  static final class Details {
    static final Details NONE = new Details(null, null, Map.of(), null, null, null);

    final String reason;
    final String domain;
    final Map<String, String> metadata;
    final Duration retryDelay;
    final String field;
    final String fieldDescription;

    private Details(String reason, String domain, Map<String, String> metadata, Duration retryDelay, String field,
        String fieldDescription) {
      this.reason = reason;
      this.domain = domain;
      this.metadata = metadata;
      this.retryDelay = retryDelay;
      this.field = field;
      this.fieldDescription = fieldDescription;
    }

    /** The details of a failed call's status (its {@code grpc-status-details-bin} trailer); NONE when it has none. */
    static Details of(Throwable error) {
      com.google.rpc.Status status = StatusProto.fromThrowable(error);
      if (status == null) {
        return NONE;
      }
      ErrorInfo info = null;
      RetryInfo retry = null;
      BadRequest bad = null;
      for (Any detail : status.getDetailsList()) {
        try {
          if (info == null && detail.is(ErrorInfo.class)) {
            info = detail.unpack(ErrorInfo.class);
          } else if (retry == null && detail.is(RetryInfo.class)) {
            retry = detail.unpack(RetryInfo.class);
          } else if (bad == null && detail.is(BadRequest.class)) {
            bad = detail.unpack(BadRequest.class);
          }
        } catch (InvalidProtocolBufferException malformed) {
          // A detail that does not parse is skipped; the others still count.
        }
      }
      String reason = info == null || info.getReason().isEmpty() ? null : info.getReason();
      String domain = info == null || info.getDomain().isEmpty() ? null : info.getDomain();
      Map<String, String> metadata = info == null ? Map.of() : Map.copyOf(info.getMetadataMap());
      Duration retryDelay = null;
      if (retry != null && retry.hasRetryDelay()) {
        retryDelay = IdempotencyClient.toDuration(retry.getRetryDelay());
        if (retryDelay.isNegative()) {
          retryDelay = Duration.ZERO;
        }
      }
      String field = null;
      String fieldDescription = null;
      if (bad != null && bad.getFieldViolationsCount() > 0) {
        field = bad.getFieldViolations(0).getField();
        fieldDescription = bad.getFieldViolations(0).getDescription();
      }
      if ((field == null || field.isEmpty()) && "INVALID_ARGUMENT".equals(reason)) {
        field = metadata.get("field");
      }
      return new Details(reason, domain, metadata, retryDelay, field == null || field.isEmpty() ? null : field,
          fieldDescription == null || fieldDescription.isEmpty() ? null : fieldDescription);
    }
  }
}
