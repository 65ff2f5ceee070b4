"""The errors a caller can act on, one class per gRPC status the service uses,
plus the run-once helper's own outcomes (InProgress, FingerprintMismatch, LeaseLost).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Optional

import grpc


class IdempotencyError(Exception):
    """Base class of every error raised by this package."""

    #: The gRPC status code behind the error, when a call failed.
    code: Optional[grpc.StatusCode] = None
    #: How many attempts the call made (its retries included) before this
    #: error; 1 when it was not retried, 0 when no call was made.
    attempts: int = 0

    def __init__(self, message: str, *, code: Optional[grpc.StatusCode] = None, attempts: int = 0):
        super().__init__(message)
        if code is not None:
            self.code = code
        self.attempts = attempts


class InvalidArgument(IdempotencyError, ValueError):
    """INVALID_ARGUMENT: a field is missing, too long or malformed; the message
    names the field. Nothing was changed; retrying the same call cannot help."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class KeyNotFound(IdempotencyError):
    """NOT_FOUND: Complete, Release or ExtendLease on a key that does not exist
    or whose record expired."""

    code = grpc.StatusCode.NOT_FOUND


class LeaseNotCurrent(IdempotencyError):
    """FAILED_PRECONDITION: the lease token is not the key's current one (the
    lease was lost to another claimant, was released, or the key is completed)."""

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
    """RESOURCE_EXHAUSTED: over the caller's rate limit, or the server has too
    many calls in flight. Nothing was done. The client has retried already
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


def from_item_status(number: int, message: str, method: str, index: int) -> IdempotencyError:
    """The typed error for one item of a batch that answers each item with its
    own status (CompleteBatch): the class the single call would have raised."""
    code = _STATUS_BY_NUMBER.get(number)
    name = code.name if code is not None else f"status {number}"
    cls = _BY_CODE.get(code, IdempotencyError)
    return cls(f"{method}: items[{index}]: {name}: {message or name}", code=code)


def from_rpc_error(error: grpc.RpcError, method: str, attempts: int = 1) -> IdempotencyError:
    """The typed error for a failed call (grpc.RpcError and grpc.aio.AioRpcError),
    after `attempts` attempts (said in the message when more than one)."""
    code = error.code()
    details = error.details() or code.name
    cls = _BY_CODE.get(code, IdempotencyError)
    after = f" (after {attempts} attempts)" if attempts > 1 else ""
    return cls(f"{method}: {code.name}: {details}{after}", code=code, attempts=attempts)
