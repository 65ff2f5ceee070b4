"""Retries: which failures are retried, how long to wait between attempts,
and how the attempts share the caller's deadline.

Every RPC of both clients goes through one loop (IdempotencyClient._call and
its asyncio twin): an attempt that fails with one of `retryable_codes` is tried
again, on the next address when the client has several, after a pause drawn
with full jitter from a capped exponential,

    pause(n) = uniform(0, min(max_backoff, initial_backoff * multiplier ** (n - 1)))

for the n-th retry, as long as attempts are left (`max_attempts` counts the
first one) and the call's overall deadline (its `timeout`) leaves time for
another attempt. When the failed attempt's status carries a RetryInfo (the
server's `retry_delay`: 250 ms for STORE_UNAVAILABLE, until the next call is
allowed for RATE_LIMITED, 50 ms for OVERLOADED), the pause is at least that
long; when the deadline leaves no room for it, the call fails at once with
that error instead of retrying too soon. Each attempt gets the time left, or `per_attempt_timeout`
when that is shorter, so an attempt that hangs (DEADLINE_EXCEEDED) leaves time
for the next. A Claim that asks the server to wait for another holder is the
exception: its attempts get at least the wait (and a little more for the
answer to come back), since a server that waits is not a server that hangs;
the call's overall deadline still bounds them.

Every RPC is safe to repeat: Claim because the client sends its own lease
token (a new one per logical Claim, the same on each retry of it) and the
server answers a repeated token with the same lease (`ClaimResult.retried`);
Complete, Release and ExtendLease because repeating one that succeeded answers
OK; Get and CompleteBatch change nothing more the second time; Purge answers
`purged=False` the second time (the record is already gone).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import FrozenSet, Optional, Union

import grpc

from .errors import NO_DETAILS, ErrorDetails, details_of

#: What is retried by default: the server or its store is unreachable or
#: restarting (UNAVAILABLE), over a rate limit or the server's limit of calls
#: in flight (RESOURCE_EXHAUSTED), an attempt's deadline passed
#: (DEADLINE_EXCEEDED). Never a verdict on the request: INVALID_ARGUMENT,
#: NOT_FOUND, FAILED_PRECONDITION, UNAUTHENTICATED, PERMISSION_DENIED, ...
RETRYABLE_CODES: FrozenSet[grpc.StatusCode] = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)

log = logging.getLogger("idempotency_client")

#: An attempt is not started with less time than this left before the deadline.
MIN_ATTEMPT_SECONDS = 0.05


@dataclass(frozen=True)
class RetryPolicy:
    """How a client retries a failed call (`IdempotencyClient(retry=...)`).

    max_attempts         attempts in all, the first included (1: no retry)
    initial_backoff      cap of the first pause, in seconds
    max_backoff          cap of every pause, in seconds
    multiplier           how much the cap grows per retry
    per_attempt_timeout  seconds one attempt may take; None: the time left of
                         the call's timeout (the overall deadline)
    retryable_codes      the gRPC status codes worth another attempt

    The defaults (the TypeScript client's too) ride out a replica's restart:
    9 retries, pauses of about 4.6 s in all on average (9.2 s at most), cut
    short by the call's timeout (10 s unless set).
    """

    max_attempts: int = 10
    initial_backoff: float = 0.05
    max_backoff: float = 2.0
    multiplier: float = 2.0
    per_attempt_timeout: Optional[float] = None
    retryable_codes: FrozenSet[grpc.StatusCode] = field(default=RETRYABLE_CODES)

    def __post_init__(self):
        if not isinstance(self.max_attempts, int) or isinstance(self.max_attempts, bool) or self.max_attempts < 1:
            raise ValueError("RetryPolicy: max_attempts must be an int >= 1")
        for name in ("initial_backoff", "max_backoff"):
            if getattr(self, name) < 0:
                raise ValueError(f"RetryPolicy: {name} must be >= 0")
        if self.multiplier < 1:
            raise ValueError("RetryPolicy: multiplier must be >= 1")
        if self.per_attempt_timeout is not None and self.per_attempt_timeout <= 0:
            raise ValueError("RetryPolicy: per_attempt_timeout must be > 0 (or None)")
        object.__setattr__(self, "retryable_codes", frozenset(self.retryable_codes))

    def backoff_cap(self, retry: int) -> float:
        """The longest pause before the `retry`-th retry (1 for the first)."""
        exponent = max(retry - 1, 0)
        try:
            cap = self.initial_backoff * (self.multiplier**exponent)
        except OverflowError:
            cap = self.max_backoff
        return min(self.max_backoff, cap)

    def backoff(self, retry: int, rng: Optional[random.Random] = None) -> float:
        """The pause before the `retry`-th retry: full jitter, uniform in [0, cap]."""
        return (rng or random).uniform(0.0, self.backoff_cap(retry))

    def retryable(self, code: Optional[grpc.StatusCode]) -> bool:
        return code in self.retryable_codes


#: What clients use unless told otherwise.
DEFAULT_RETRY = RetryPolicy()

#: `retry=` accepts a policy, or None / False for no retry.
RetryLike = Union[RetryPolicy, None, bool]


def retry_policy(value: RetryLike) -> Optional[RetryPolicy]:
    if value is None or value is False:
        return None
    if value is True:
        return DEFAULT_RETRY
    if isinstance(value, RetryPolicy):
        return value
    raise TypeError(f"retry must be a RetryPolicy, or None to disable retries, got {type(value).__name__}")


class Attempts:
    """The bookkeeping of one call's attempts: how long the next may take and
    whether a failure is worth another. Shared by the sync and asyncio loops."""

    def __init__(
        self, policy: Optional[RetryPolicy], timeout: Optional[float], at_least: Optional[float] = None
    ):
        self.policy = policy
        self.deadline = None if timeout is None else time.monotonic() + timeout
        #: No attempt is cut by the per-attempt timeout before this many
        #: seconds (a Claim that asked the server to wait that long).
        self.at_least = at_least
        #: Attempts made so far.
        self.made = 0
        #: The google.rpc details of the last failed attempt.
        self.last_details: ErrorDetails = NO_DETAILS

    def timeout(self) -> Optional[float]:
        """The deadline of the next attempt, in seconds from now."""
        remaining = None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)
        per_attempt = self.policy.per_attempt_timeout if self.policy else None
        if per_attempt is None:
            return remaining
        if self.at_least is not None:
            per_attempt = max(per_attempt, self.at_least)
        return per_attempt if remaining is None else min(per_attempt, remaining)

    def pause_after(self, error: grpc.RpcError, method: str, target: str) -> Optional[float]:
        """After a failed attempt: the pause before the next one, or None when
        the failure is final (not retryable, no attempt left, or no time left).
        A retry is logged at DEBUG on the "idempotency_client" logger.
        The pause is never shorter than the status's RetryInfo delay."""
        self.last_details = details = details_of(error)
        pause = self._pause_after(error.code(), details.retry_delay)
        if pause is not None and log.isEnabledFor(logging.DEBUG):
            log.debug(
                "idempotency: %s attempt %d on %s failed (%s: %s); retrying in %.3f s",
                method,
                self.made,
                target,
                error.code().name,
                error.details(),
                pause,
            )
        return pause

    def _pause_after(self, code: Optional[grpc.StatusCode], retry_delay=None) -> Optional[float]:
        self.made += 1
        policy = self.policy
        if policy is None or not policy.retryable(code) or self.made >= policy.max_attempts:
            return None
        pause = policy.backoff(self.made)
        # The server's RetryInfo: no sooner than it says the call can succeed.
        at_least = retry_delay.total_seconds() if retry_delay is not None else 0.0
        pause = max(pause, at_least)
        if self.deadline is not None:
            # A pause that would leave too little time is cut short, so the
            # last attempt still happens before the deadline; but not below
            # the server's delay: then the call fails now.
            room = self.deadline - time.monotonic() - MIN_ATTEMPT_SECONDS
            if room <= 0 or at_least > room:
                return None
            pause = min(pause, room)
        return pause
