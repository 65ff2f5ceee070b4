"""The rules of once() that the asyncio helper and the synchronous one share:
its settings, the errors it raises for each outcome, how it waits for another
holder (on the server, or by polling when the server cannot) and how it paces
its heartbeat.

idempotency_client.once describes the lifecycle; _async/once.py (and
_sync/once.py, generated from it) carries it out with these rules.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional, Union

from .errors import (
    FingerprintMismatch,
    IdempotencyError,
    InProgress,
    KeyNotFound,
    LeaseNotCurrent,
    ResultExpired,
)
from .serializers import JSON, Serializer
from .types import ClaimResult, DurationLike, LateRetryLike, late_retry_value, seconds_of

log = logging.getLogger("idempotency_client")

#: Errors from ExtendLease or Complete meaning "this lease is no longer ours".
LEASE_GONE = (LeaseNotCurrent, KeyNotFound)

#: The server's default lease when the caller sets none; only used to pace the heartbeat.
SERVER_DEFAULT_LEASE_SECONDS = 30.0

#: First pause while polling another claimant; doubles on each attempt.
FIRST_WAIT_SECONDS = 0.1

#: What on_in_progress accepts: wait on the server (polling where it cannot),
#: always poll, or raise InProgress at once.
ON_IN_PROGRESS = ("wait", "poll", "raise")

#: The longest part of a call's timeout a waiting Claim keeps for its answer
#: to come back: the wait it sends ends this long (or a tenth of the timeout,
#: when that is shorter) before the call's deadline.
WAIT_HEADROOM_SECONDS = 0.5

#: Waits shorter than this are not asked for (a Duration of a few nanoseconds
#: would be zero, which is "do not wait").
MIN_WAIT_SECONDS = 0.01

#: After a server ignored `wait`, once() polls without asking for this long,
#: then asks again (a server upgraded under a long-lived client is noticed).
WAIT_RECHECK_SECONDS = 300.0

KeyLike = Union[str, Callable[..., str]]
FingerprintLike = Union[bytes, Callable[..., bytes]]


@dataclass(frozen=True)
class Settings:
    """Everything once() was asked, shared by the sync and async helpers."""

    namespace: str
    key: KeyLike
    fingerprint: FingerprintLike = b""
    lease_ttl: Optional[DurationLike] = None
    retention: Optional[DurationLike] = None
    on_in_progress: str = "wait"
    wait_timeout: DurationLike = 30.0
    serializer: Serializer = JSON
    #: False disables it; None paces it at a third of the lease.
    heartbeat: bool = True
    heartbeat_interval: Optional[DurationLike] = None
    #: What a Claim of a remembered key does; None: the namespace's or the server's policy.
    late_retry: LateRetryLike = None

    def __post_init__(self):
        if self.on_in_progress not in ON_IN_PROGRESS:
            raise ValueError('on_in_progress must be "wait", "poll" or "raise"')
        late_retry_value(self.late_retry)  # ValueError now, not at the first Claim

    def bound(self, args: tuple, kwargs: dict) -> "Settings":
        """The settings for one call of a decorated function: key and fingerprint
        may be functions of its arguments."""
        key = self.key(*args, **kwargs) if callable(self.key) else self.key
        fp = self.fingerprint(*args, **kwargs) if callable(self.fingerprint) else self.fingerprint
        return dataclasses.replace(self, key=key, fingerprint=fp)

    def fixed_key(self) -> str:
        if callable(self.key) or callable(self.fingerprint):
            raise TypeError(
                "once(): a key or fingerprint computed from arguments needs the decorator form"
            )
        return self.key

    def heartbeat_seconds(self) -> Optional[float]:
        if not self.heartbeat:
            return None
        if self.heartbeat_interval is not None:
            return seconds_of(self.heartbeat_interval)
        lease = seconds_of(self.lease_ttl) or SERVER_DEFAULT_LEASE_SECONDS
        return lease / 3


def in_progress_error(claim: ClaimResult, settings: Settings, waited: bool) -> InProgress:
    how = f"still in progress after waiting {seconds_of(settings.wait_timeout)} s" if waited else "in progress"
    return InProgress(
        f"{settings.namespace}/{settings.key}: {how} (another claimant holds the lease;"
        f" retry after {claim.retry_after})",
        retry_after=claim.retry_after,
        lease_expires_at=claim.lease_expires_at,
    )


def fingerprint_error(settings: Settings) -> FingerprintMismatch:
    return FingerprintMismatch(
        f"{settings.namespace}/{settings.key}: the key was seen with another payload fingerprint"
    )


def expired_error(claim: ClaimResult, settings: Settings) -> ResultExpired:
    return ResultExpired(
        f"{settings.namespace}/{settings.key}: completed at {claim.completed_at} and its result has"
        " expired (a late retry, refused): the effect happened, there is nothing to replay",
        completed_at=claim.completed_at,
        fencing_token=claim.fencing_token,
    )


def unexpected_outcome(claim: ClaimResult) -> IdempotencyError:
    return IdempotencyError(f"Claim: unexpected outcome {claim.outcome!r}")


class ServerWaits:
    """What a client has learned about its servers and ClaimRequest.wait.

    A server that predates `wait` ignores it and never sets
    ClaimResponse.waited; a client that asked and finds `waited` unset knows
    that server will not wait. The client remembers it, so once() polls
    without asking again for WAIT_RECHECK_SECONDS; an answer with `waited`
    set (a server that waits) makes it ask again at once.
    """

    def __init__(self) -> None:
        #: True: a server waited (or answered with `waited`); False: one
        #: ignored the field; None: no Claim has asked yet.
        self.supported: Optional[bool] = None
        self._ignored_at: Optional[float] = None

    def worth_asking(self) -> bool:
        """Whether once() should ask the server to wait, or go straight to polling."""
        return self._ignored_at is None or time.monotonic() - self._ignored_at >= WAIT_RECHECK_SECONDS

    def saw(self, waited: Optional[timedelta]) -> None:
        """The answer to a Claim that asked to wait: `waited` as it came back."""
        if waited is not None:
            self.supported = True
            self._ignored_at = None
            return
        if self.supported is not False:
            log.info(
                "idempotency: the server ignored ClaimRequest.wait (it predates waiting);"
                " once() polls instead for the next %.0f s",
                WAIT_RECHECK_SECONDS,
            )
        self.supported = False
        self._ignored_at = time.monotonic()


def wait_within(wait: float, timeout: Optional[float]) -> float:
    """The wait a Claim sends: `wait`, ending before the call's `timeout` by
    WAIT_HEADROOM_SECONDS (or a tenth of the timeout, when shorter), so that
    the server's answer arrives before the deadline."""
    if timeout is None:
        return wait
    return min(wait, timeout - min(WAIT_HEADROOM_SECONDS, timeout / 10))


def server_waited(claim: ClaimResult) -> bool:
    """Whether the server did the waiting for this IN_PROGRESS answer (so the
    next Claim may go at once). False when it did not wait: it predates
    waiting (`waited` unset) or its waiter limit was reached (zero). A wait
    shorter than the first poll pause counts as none (a server answering its
    waiters as it shuts down, say): once() then pauses as when polling, so it
    never spins on a server that keeps answering at once."""
    return claim.waited is not None and claim.waited >= timedelta(seconds=FIRST_WAIT_SECONDS)


def next_pause(attempt: int, claim: ClaimResult, remaining: float) -> float:
    """How long to wait before claiming again: exponential from 100 ms, so an
    early Complete is seen soon, but never past the other lease's expiry
    (retry_after, when it can be taken) nor past the caller's wait_timeout."""
    pause = FIRST_WAIT_SECONDS * (2**attempt)
    if claim.retry_after is not None:
        pause = min(pause, max(claim.retry_after.total_seconds(), 0.01))
    return max(0.0, min(pause, remaining))


def add_note(error: BaseException, note: str) -> None:
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(note)


def heartbeat_timeout(interval: float, client_timeout: Optional[float]) -> float:
    """A heartbeat's ExtendLease (retries included) ends before the next beat
    is due, so stopping the heartbeat never waits long."""
    bound = max(interval, 1.0)
    return bound if client_timeout is None else min(bound, client_timeout)
