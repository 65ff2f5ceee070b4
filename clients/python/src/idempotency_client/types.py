"""Typed results of the RPCs, the items of the batch calls, and their
conversion from the wire.

Fields that the server sets only for some outcomes are None for the others, so
`result.response is None` means "no replay", never "an empty replay".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import List, Optional, Union

from google.protobuf import duration_pb2

from ._proto import idempotency_pb2 as pb
from .errors import IdempotencyError, from_item_status

#: A duration as the client accepts it: a timedelta or a number of seconds.
DurationLike = Union[timedelta, int, float]


class Outcome(enum.IntEnum):
    """What a Claim found (proto enum idempotency.v1.Outcome)."""

    UNSPECIFIED = pb.OUTCOME_UNSPECIFIED
    #: You hold the lease: do the work, then Complete or Release.
    CLAIMED = pb.OUTCOME_CLAIMED
    #: Another claimant holds a live lease: try again after retry_after.
    IN_PROGRESS = pb.OUTCOME_IN_PROGRESS
    #: The work was done already: response is the stored result (the replay).
    COMPLETED = pb.OUTCOME_COMPLETED
    #: The key was seen with another payload fingerprint; nothing changed.
    FINGERPRINT_MISMATCH = pb.OUTCOME_FINGERPRINT_MISMATCH
    #: Only for a Claim whose late-retry policy is refuse: the key was
    #: completed (completed_at), its result expired, and the server still
    #: remembers it. The effect happened; the result is gone. Nothing changed.
    EXPIRED = pb.OUTCOME_EXPIRED


class LateRetry(enum.IntEnum):
    """What a Claim of a remembered key does (proto enum idempotency.v1.LateRetry).

    A key is remembered once its completed result's retention is over, until
    its horizon (the server's IDEMPOTENCY_REMEMBER_FOR after its Complete,
    7 days unless configured, or the namespace's `remember_for`)."""

    #: The namespace's policy (the policy file's `late_retry`), else the
    #: server's (IDEMPOTENCY_LATE_RETRY: reexecute unless configured).
    UNSPECIFIED = pb.LATE_RETRY_UNSPECIFIED
    #: Claim the key anew with the next fencing token: Outcome.CLAIMED with
    #: completed_at set (ClaimResult.reexecuted).
    REEXECUTE = pb.LATE_RETRY_REEXECUTE
    #: Answer Outcome.EXPIRED, changing nothing.
    REFUSE = pb.LATE_RETRY_REFUSE


#: `late_retry=` accepts a LateRetry, "reexecute" or "refuse", or None (the
#: namespace's or the server's policy).
LateRetryLike = Union[LateRetry, str, None]


def late_retry_value(value: LateRetryLike) -> LateRetry:
    """The LateRetry of a `late_retry=` argument (None is UNSPECIFIED)."""
    if value is None:
        return LateRetry.UNSPECIFIED
    if isinstance(value, LateRetry):
        return value
    if isinstance(value, str):
        try:
            return {"reexecute": LateRetry.REEXECUTE, "refuse": LateRetry.REFUSE}[value.lower()]
        except KeyError:
            pass
    raise ValueError(f'late_retry must be "reexecute", "refuse", a LateRetry or None, got {value!r}')


class State(enum.IntEnum):
    """The state of a key's record as Get reports it (proto enum idempotency.v1.State)."""

    UNSPECIFIED = pb.STATE_UNSPECIFIED
    ABSENT = pb.STATE_ABSENT
    IN_PROGRESS = pb.STATE_IN_PROGRESS
    COMPLETED = pb.STATE_COMPLETED
    RELEASED = pb.STATE_RELEASED


@dataclass(frozen=True)
class ClaimResult:
    outcome: Outcome
    #: CLAIMED: the lease's secret (32 lowercase hex characters).
    lease_token: Optional[str]
    #: CLAIMED: one more than the key's previous Claim; hand it to downstream
    #: writes so they can reject an older lease holder. EXPIRED: the last
    #: lease's (the one that completed the key).
    fencing_token: Optional[int]
    #: CLAIMED: when your lease runs out; IN_PROGRESS: when the other one's does.
    lease_expires_at: Optional[datetime]
    #: COMPLETED: the stored response (the replay), possibly b"".
    response: Optional[bytes]
    #: COMPLETED: when the stored result expires; CLAIMED/IN_PROGRESS: when the
    #: record expires if nobody completes it.
    expires_at: Optional[datetime]
    #: IN_PROGRESS: the time left on the other claimant's lease.
    retry_after: Optional[timedelta]
    #: CLAIMED: the last checkpoint an earlier holder of the key saved (with
    #: extend_lease() or release()), to resume from; None when there is none.
    checkpoint: Optional[bytes] = None
    #: The fencing token of the lease that saved `checkpoint`; None with it.
    checkpoint_fencing_token: Optional[int] = None
    #: CLAIMED: True when this answer repeats the lease an earlier Claim with
    #: the same lease token won (a retried Claim whose first answer was lost).
    retried: bool = False
    #: A Claim that asked to wait (claim(wait=...)): how long the server made
    #: it wait for another holder (timedelta(0): nothing to wait for, or the
    #: server's waiter limit was reached). None when the Claim did not ask, or
    #: when the server predates waiting and ignored the request.
    waited: Optional[timedelta] = None
    #: When the key was completed before: set on EXPIRED, and on CLAIMED when
    #: this Claim took over a remembered key (a late retry, re-executed: the
    #: effect ran once already and its result is gone; `reexecuted` is True).
    completed_at: Optional[datetime] = None
    #: Only in claim_batch(item_errors=True): why this item's Claim failed while
    #: the others were answered (Unavailable: the node holding its key is
    #: down). Its outcome is then UNSPECIFIED and only lease_token is set
    #: besides: the token the item was sent with, to retry it safely
    #: (ClaimItem(..., lease_token=result.lease_token)).
    error: Optional[IdempotencyError] = None

    @property
    def claimed(self) -> bool:
        return self.outcome is Outcome.CLAIMED

    @property
    def ok(self) -> bool:
        """False only for an item of claim_batch(item_errors=True) that failed."""
        return self.error is None

    @property
    def reexecuted(self) -> bool:
        """CLAIMED over a remembered key: a late retry of a key that completed
        before (at completed_at), whose result expired. The work runs again;
        the fencing token continues from the earlier leases'."""
        return self.outcome is Outcome.CLAIMED and self.completed_at is not None


@dataclass(frozen=True)
class CompleteResult:
    #: Until then every Claim of the key replays the stored response.
    expires_at: datetime


@dataclass(frozen=True)
class ExtendLeaseResult:
    lease_expires_at: datetime


@dataclass(frozen=True)
class ClaimItem:
    """One Claim of a claim_batch(): the arguments claim() takes."""

    namespace: str
    key: str
    fingerprint: bytes = b""
    lease_ttl: Optional[DurationLike] = None
    retention: Optional[DurationLike] = None
    #: The item's own lease token; None: a new random one (what you want).
    lease_token: Optional[str] = None
    #: What to do when the key is remembered (see LateRetry); None: the
    #: namespace's or the server's policy.
    late_retry: LateRetryLike = None


@dataclass(frozen=True)
class CompleteItem:
    """One Complete of a complete_batch(): the arguments complete() takes."""

    namespace: str
    key: str
    lease_token: str
    response: bytes = b""
    retention: Optional[DurationLike] = None


@dataclass(frozen=True)
class CompleteItemResult:
    """One item's answer in complete_batch(): what its own complete() would have
    returned (expires_at) or raised (error: KeyNotFound, LeaseNotCurrent, ...).
    Exactly one of the two is set."""

    expires_at: Optional[datetime]
    error: Optional[IdempotencyError]

    @property
    def ok(self) -> bool:
        return self.error is None

    def result(self) -> CompleteResult:
        """The item's CompleteResult, or raise its error as complete() would have."""
        if self.error is not None:
            raise self.error
        return CompleteResult(expires_at=self.expires_at)


@dataclass(frozen=True)
class PurgeResult:
    #: True when an unexpired record was purged; False when there was none.
    purged: bool
    #: The state the purged record had; State.ABSENT when there was none.
    previous_state: State


@dataclass(frozen=True)
class Record:
    """A key's record as Get reports it; ABSENT leaves every other field None,
    unless the key is remembered (`remembered`: remembered_until is set):
    then fencing_token, fingerprint, expires_at (when its result expired),
    created_at and completed_at describe it."""

    state: State
    fencing_token: Optional[int]
    fingerprint: Optional[bytes]
    #: COMPLETED only.
    response: Optional[bytes]
    #: IN_PROGRESS only; may be in the past (the next Claim takes the lease).
    lease_expires_at: Optional[datetime]
    expires_at: Optional[datetime]
    created_at: Optional[datetime]
    updated_at: Optional[datetime]
    #: IN_PROGRESS and RELEASED: the last checkpoint saved; None when none.
    checkpoint: Optional[bytes] = None
    #: The fencing token of the lease that saved `checkpoint`; None with it.
    checkpoint_fencing_token: Optional[int] = None
    #: COMPLETED, and a remembered key: when it was completed.
    completed_at: Optional[datetime] = None
    #: COMPLETED: until when the key will be remembered once its result
    #: expires (None when the server remembers nothing past the retention);
    #: ABSENT: set only for a remembered key.
    remembered_until: Optional[datetime] = None

    @property
    def remembered(self) -> bool:
        """ABSENT, but remembered: completed, its result expired; a Claim
        before remembered_until follows its late-retry policy."""
        return self.state is State.ABSENT and self.remembered_until is not None


def to_duration(value: Optional[DurationLike], field: str) -> Optional[duration_pb2.Duration]:
    if value is None:
        return None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"{field}: expected a timedelta or seconds, got {type(value).__name__}")
    duration = duration_pb2.Duration()
    duration.FromTimedelta(timedelta(seconds=seconds))
    return duration


def seconds_of(value: Optional[DurationLike]) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, timedelta):
        return value.total_seconds()
    return float(value)


def _time(message, field: str) -> Optional[datetime]:
    if not message.HasField(field):
        return None
    return getattr(message, field).ToDatetime(tzinfo=timezone.utc)


def claim_batch_results(
    message: pb.ClaimBatchResponse, request: Optional[pb.ClaimBatchRequest] = None
) -> List[ClaimResult]:
    """A ClaimBatch's answers: each item's ClaimResult, or for an item that
    failed (item_errors) a ClaimResult with its error and the lease token the
    item was sent with (from `request`), to retry it with."""
    return [
        claim_result(item)
        if not item.HasField("error")
        else _failed_claim(item.error, index, request.items[index].lease_token if request else None)
        for index, item in enumerate(message.items)
    ]


def _failed_claim(error: pb.ItemError, index: int, lease_token: Optional[str]) -> ClaimResult:
    return ClaimResult(
        outcome=Outcome.UNSPECIFIED,
        lease_token=lease_token or None,
        fencing_token=None,
        lease_expires_at=None,
        response=None,
        expires_at=None,
        retry_after=None,
        error=from_item_status(
            error.code, error.message, "ClaimBatch", index, error.reason, _retry_after(error)
        ),
    )


def _retry_after(message) -> Optional[timedelta]:
    return message.retry_after.ToTimedelta() if message.HasField("retry_after") else None


def claim_result(message: pb.ClaimResponse) -> ClaimResult:
    outcome = Outcome(message.outcome)
    claimed = outcome is Outcome.CLAIMED
    return ClaimResult(
        outcome=outcome,
        lease_token=message.lease_token if claimed else None,
        fencing_token=message.fencing_token if claimed or outcome is Outcome.EXPIRED else None,
        lease_expires_at=_time(message, "lease_expires_at"),
        response=bytes(message.response) if outcome is Outcome.COMPLETED else None,
        expires_at=_time(message, "expires_at"),
        retry_after=(
            message.retry_after.ToTimedelta() if message.HasField("retry_after") else None
        ),
        checkpoint=_checkpoint(message) if claimed else None,
        checkpoint_fencing_token=(message.checkpoint_fencing_token or None) if claimed else None,
        retried=bool(message.retried) if claimed else False,
        waited=message.waited.ToTimedelta() if message.HasField("waited") else None,
        completed_at=_time(message, "completed_at"),
    )


def _checkpoint(message) -> Optional[bytes]:
    """The checkpoint of a ClaimResponse or GetResponse: None when there is
    none (checkpoint_fencing_token 0), else the bytes (possibly b"")."""
    if not message.checkpoint_fencing_token:
        return None
    return bytes(message.checkpoint)


def complete_result(message: pb.CompleteResponse) -> CompleteResult:
    return CompleteResult(expires_at=message.expires_at.ToDatetime(tzinfo=timezone.utc))


def complete_item_results(message: pb.CompleteBatchResponse) -> List[CompleteItemResult]:
    return [
        CompleteItemResult(expires_at=_time(item, "expires_at"), error=None)
        if item.code == 0
        else CompleteItemResult(
            expires_at=None,
            error=from_item_status(
                item.code, item.message, "CompleteBatch", index, item.reason, _retry_after(item)
            ),
        )
        for index, item in enumerate(message.items)
    ]


def purge_result(message: pb.PurgeResponse) -> PurgeResult:
    return PurgeResult(purged=message.purged, previous_state=State(message.previous_state))


def extend_lease_result(message: pb.ExtendLeaseResponse) -> ExtendLeaseResult:
    return ExtendLeaseResult(
        lease_expires_at=message.lease_expires_at.ToDatetime(tzinfo=timezone.utc)
    )


def record(message: pb.GetResponse) -> Record:
    state = State(message.state)
    if state is State.ABSENT:
        if not message.HasField("remembered_until"):
            return Record(state, None, None, None, None, None, None, None)
        return Record(
            state=state,
            fencing_token=message.fencing_token,
            fingerprint=bytes(message.fingerprint),
            response=None,
            lease_expires_at=None,
            expires_at=_time(message, "expires_at"),
            created_at=_time(message, "created_at"),
            updated_at=_time(message, "updated_at"),
            completed_at=_time(message, "completed_at"),
            remembered_until=_time(message, "remembered_until"),
        )
    return Record(
        state=state,
        fencing_token=message.fencing_token,
        fingerprint=bytes(message.fingerprint),
        response=bytes(message.response) if state is State.COMPLETED else None,
        lease_expires_at=_time(message, "lease_expires_at"),
        expires_at=_time(message, "expires_at"),
        created_at=_time(message, "created_at"),
        updated_at=_time(message, "updated_at"),
        checkpoint=_checkpoint(message),
        checkpoint_fencing_token=message.checkpoint_fencing_token or None,
        completed_at=_time(message, "completed_at"),
        remembered_until=_time(message, "remembered_until"),
    )
