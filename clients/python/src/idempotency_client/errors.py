"""The errors a caller can act on, one class per gRPC status the service uses,
plus the run-once helper's own outcomes (InProgress, FingerprintMismatch,
LeaseLost, ResultExpired).

Every error from a failed call carries what the server said about it in the
standard google.rpc error details (the `grpc-status-details-bin` trailer,
decoded with grpcio-status): `reason`, the stable ErrorInfo reason
("LEASE_LOST", "KEY_EXPIRED", "STORE_UNAVAILABLE", ...), `domain`,
`metadata`, `retry_delay` (RetryInfo: how long to wait before the same call
can succeed) and `field` (the field an INVALID_ARGUMENT names). They are None
(and metadata empty) when the status carried no details: a call that never
reached the service (the client's own deadline, a connection refused), a
proxy's answer, or a server that predates them.
"""

from __future__ import annotations

from dataclasses import dataclass, field as dataclass_field
from datetime import datetime, timedelta, timezone
from typing import Any, Mapping, Optional, Tuple

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

#: ErrorInfo's domain on every status the service sends.
DOMAIN = "idempotency-service"

#: The trailer that carries a serialized google.rpc.Status.
DETAILS_KEY = "grpc-status-details-bin"


@dataclass(frozen=True)
class ErrorDetails:
    """The google.rpc details of a failed call's status, decoded."""

    #: ErrorInfo.reason: an ErrorReason name without its prefix ("LEASE_LOST").
    reason: Optional[str] = None
    #: ErrorInfo.domain: "idempotency-service" for the service's own statuses.
    domain: Optional[str] = None
    #: ErrorInfo.metadata: `field` (INVALID_ARGUMENT), `completed_at` and
    #: `remembered_until` (KEY_EXPIRED, RFC 3339).
    metadata: Mapping[str, str] = dataclass_field(default_factory=dict)
    #: RetryInfo.retry_delay: how long to wait before the same call can succeed.
    retry_delay: Optional[timedelta] = None
    #: BadRequest's field violations, as (field, description) pairs.
    field_violations: Tuple[Tuple[str, str], ...] = ()

    @property
    def field(self) -> Optional[str]:
        """The field an INVALID_ARGUMENT names (its FieldViolation, else ErrorInfo's metadata)."""
        if self.field_violations:
            return self.field_violations[0][0]
        return self.metadata.get("field")


NO_DETAILS = ErrorDetails()


def _rich_status(error: Any) -> Optional[status_pb2.Status]:
    """The google.rpc.Status of a failed call: grpcio-status's from_call(),
    which also checks that it agrees with the call's code and message."""
    if not callable(getattr(error, "trailing_metadata", None)):
        return None
    try:
        return rpc_status.from_call(error)
    except ValueError:
        # The details disagree with the status line (a proxy rewrote the
        # message, say): the details are still the server's own.
        for key, value in error.trailing_metadata() or ():
            if key == DETAILS_KEY:
                return status_pb2.Status.FromString(value)
        return None


def details_of(error: Any) -> ErrorDetails:
    """The details of a failed call (grpc.RpcError, grpc.aio.AioRpcError);
    NO_DETAILS when its status carried none."""
    try:
        status = _rich_status(error)
    except Exception:  # a trailer that does not parse: as if there were none
        return NO_DETAILS
    if status is None:
        return NO_DETAILS
    reason = domain = retry_delay = None
    metadata: Mapping[str, str] = {}
    violations: Tuple[Tuple[str, str], ...] = ()
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, domain, metadata = info.reason, info.domain, dict(info.metadata)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            retry_delay = retry.retry_delay.ToTimedelta()
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations = tuple((v.field, v.description) for v in bad.field_violations)
    return ErrorDetails(reason, domain, metadata, retry_delay, violations)


def _rfc3339(value: Optional[str]) -> Optional[datetime]:
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


class IdempotencyError(Exception):
    """Base class of every error raised by this package."""

    #: The gRPC status code behind the error, when a call failed.
    code: Optional[grpc.StatusCode] = None
    #: How many attempts the call made (its retries included) before this
    #: error; 1 when it was not retried, 0 when no call was made.
    attempts: int = 0
    #: The google.rpc details of the status (see the module's docstring).
    details: ErrorDetails = NO_DETAILS

    def __init__(
        self,
        message: str,
        *,
        code: Optional[grpc.StatusCode] = None,
        attempts: int = 0,
        details: Optional[ErrorDetails] = None,
    ):
        super().__init__(message)
        if code is not None:
            self.code = code
        self.attempts = attempts
        if details is not None:
            self.details = details

    @property
    def reason(self) -> Optional[str]:
        """ErrorInfo's reason: "LEASE_LOST", "KEY_EXPIRED", "RATE_LIMITED", ...
        (the ErrorReason names of the proto without their prefix); None when
        the status carried no details."""
        return self.details.reason

    @property
    def domain(self) -> Optional[str]:
        """ErrorInfo's domain ("idempotency-service"); None without details."""
        return self.details.domain

    @property
    def metadata(self) -> Mapping[str, str]:
        """ErrorInfo's metadata (empty when there is none)."""
        return self.details.metadata

    @property
    def retry_delay(self) -> Optional[timedelta]:
        """RetryInfo's delay: how long to wait before the same call can
        succeed (UNAVAILABLE, RESOURCE_EXHAUSTED, ABORTED); None when the
        server gave none (retrying the same call cannot help)."""
        return self.details.retry_delay

    @property
    def field(self) -> Optional[str]:
        """INVALID_ARGUMENT: the field the server refused ("key",
        "items[3].lease_ttl"); None otherwise."""
        return self.details.field


class InvalidArgument(IdempotencyError, ValueError):
    """INVALID_ARGUMENT: a field is missing, too long or malformed; the message
    names the field. Nothing was changed; retrying the same call cannot help."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class KeyNotFound(IdempotencyError):
    """NOT_FOUND: Complete, Release or ExtendLease on a key that does not exist
    or whose record expired (reason NOT_FOUND), or that is remembered
    (KeyExpired, reason KEY_EXPIRED)."""

    code = grpc.StatusCode.NOT_FOUND


class KeyExpired(KeyNotFound):
    """NOT_FOUND with reason KEY_EXPIRED: the key was completed, its result
    expired, and the server still remembers it (until `remembered_until`).
    The effect happened; there is nothing to complete, release or extend."""

    @property
    def completed_at(self) -> Optional[datetime]:
        """When the key was completed (ErrorInfo's `completed_at`)."""
        return _rfc3339(self.metadata.get("completed_at"))

    @property
    def remembered_until(self) -> Optional[datetime]:
        """Until when the server remembers the key (`remembered_until`)."""
        return _rfc3339(self.metadata.get("remembered_until"))


class LeaseNotCurrent(IdempotencyError):
    """FAILED_PRECONDITION: the lease token is not the key's current one;
    `reason` says which: LEASE_LOST (another claimant took the key),
    LEASE_RELEASED (this lease was released), KEY_COMPLETED (the key is
    completed, under another lease or as a Release or ExtendLease found it)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(IdempotencyError):
    """UNAVAILABLE (or DEADLINE_EXCEEDED): the service or its store cannot be
    reached. The client has retried already (see RetryPolicy): raised when
    the attempts or the call's deadline ran out."""

    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(IdempotencyError):
    """UNAUTHENTICATED: no credentials, a token the server's policy does not
    know, or a client certificate whose CN is not in it. Retrying cannot help
    until the token (or certificate) is fixed."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(IdempotencyError):
    """PERMISSION_DENIED: the caller is known, but the policy does not grant it
    this RPC or this namespace (for a batch: any item's). Nothing was changed."""

    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(IdempotencyError):
    """RESOURCE_EXHAUSTED: over the caller's rate limit (reason RATE_LIMITED),
    or the server has too many calls in flight (OVERLOADED). Nothing was
    done. The client has retried already, never sooner than `retry_delay`
    (see RetryPolicy): raised when the attempts or the deadline ran out."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FingerprintMismatch(IdempotencyError):
    """once(): the key was already seen with another payload fingerprint, i.e. the
    same event identity arrived with a different payload. Nothing was changed."""


class InProgress(IdempotencyError):
    """once(): another claimant holds the key's lease (and, when waiting, still
    held it when wait_timeout ran out)."""

    def __init__(
        self,
        message: str,
        *,
        retry_after: Optional[timedelta],
        lease_expires_at: Optional[datetime],
    ):
        super().__init__(message)
        self.retry_after = retry_after
        self.lease_expires_at = lease_expires_at


class ResultExpired(IdempotencyError):
    """once() with late_retry="refuse": the key was completed before
    (`completed_at`), its stored result has expired, and the server still
    remembers it (OUTCOME_EXPIRED). The effect happened; the result is gone,
    so there is nothing to replay. `fencing_token` is the last lease's. The
    work did not run."""

    def __init__(self, message: str, *, completed_at: Optional[datetime], fencing_token: Optional[int]):
        super().__init__(message)
        self.completed_at = completed_at
        self.fencing_token = fencing_token


class LeaseLost(IdempotencyError):
    """once(): the lease was lost while the work ran (the heartbeat's ExtendLease
    or the final Complete answered FAILED_PRECONDITION or NOT_FOUND), so the
    result was NOT stored: someone else may be doing the work. The work's
    effect happened; whether to compensate is the caller's decision. The
    underlying error is the exception's __cause__."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: KeyNotFound,
    grpc.StatusCode.FAILED_PRECONDITION: LeaseNotCurrent,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
}


_STATUS_BY_NUMBER = {status.value[0]: status for status in grpc.StatusCode}


def _class_of(code: Optional[grpc.StatusCode], reason: Optional[str]) -> type:
    if code is grpc.StatusCode.NOT_FOUND and reason == "KEY_EXPIRED":
        return KeyExpired
    return _BY_CODE.get(code, IdempotencyError)


def from_item_status(
    number: int,
    message: str,
    method: str,
    index: int,
    reason: str = "",
    retry_delay: Optional[timedelta] = None,
) -> IdempotencyError:
    """The typed error for one item of a batch that answers each item with its
    own status (CompleteBatch, and either batch with item_errors): the class
    the single call would have raised, with the item's reason and retry delay
    (ItemError, CompleteResult; no other details)."""
    code = _STATUS_BY_NUMBER.get(number)
    name = code.name if code is not None else f"status {number}"
    details = (
        ErrorDetails(reason=reason or None, domain=DOMAIN, retry_delay=retry_delay)
        if reason or retry_delay is not None
        else None
    )
    cls = _class_of(code, reason or None)
    return cls(f"{method}: items[{index}]: {name}: {message or name}", code=code, details=details)


def from_rpc_error(
    error: grpc.RpcError, method: str, attempts: int = 1, details: Optional[ErrorDetails] = None
) -> IdempotencyError:
    """The typed error for a failed call (grpc.RpcError and grpc.aio.AioRpcError),
    after `attempts` attempts (said in the message when more than one), with
    its status's google.rpc details (`details`, when already decoded)."""
    code = error.code()
    message = error.details() or code.name
    if details is None:
        details = details_of(error)
    cls = _class_of(code, details.reason)
    after = f" (after {attempts} attempts)" if attempts > 1 else ""
    return cls(f"{method}: {code.name}: {message}{after}", code=code, attempts=attempts, details=details)
