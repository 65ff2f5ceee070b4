"""How one duplicate gets its answer, in the two ways bench/wait.sh compares.

- waiting: one Claim with ClaimRequest.wait (issue 23); the server answers
  when the holder's lease ends (here: its Complete). A server that predates
  the field ignores it, answers OUTCOME_IN_PROGRESS at once and leaves
  ClaimResponse.waited unset: the duplicate then polls, as the helpers do,
  and the run says so.
- polling: what the helpers do without waiting, reproduced exactly from
  clients/python/src/idempotency_client/_async/once.py (__aenter__'s loop)
  and _lifecycle.next_pause: Claim; on OUTCOME_IN_PROGRESS pause 100 ms,
  doubling each time, never past retry_after (at least 10 ms) nor past the
  deadline (wait_timeout, 30 s by default), and Claim again.

The stubs come from proto/ (bench/wait.sh generates them into its venv and
puts them on PYTHONPATH).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Optional

from google.protobuf import duration_pb2
from idempotency.v1 import idempotency_pb2 as pb

#: The helpers' first pause (_lifecycle.FIRST_WAIT_SECONDS) and default
#: wait_timeout (_lifecycle.Settings.wait_timeout).
FIRST_PAUSE_SECONDS = 0.1
WAIT_TIMEOUT_SECONDS = 30.0
#: How long a waiting Claim asks to wait; its gRPC deadline is a little
#: longer, so the server's answer (not the deadline) ends it.
WAIT_SECONDS = 30.0
DEADLINE_MARGIN_SECONDS = 5.0
#: The gRPC deadline of a Claim that does not wait.
CALL_TIMEOUT_SECONDS = 10.0

IN_PROGRESS = pb.OUTCOME_IN_PROGRESS
COMPLETED = pb.OUTCOME_COMPLETED
CLAIMED = pb.OUTCOME_CLAIMED


def outcome_name(outcome: int) -> str:
    return pb.Outcome.Name(outcome)


def seconds(duration: duration_pb2.Duration) -> float:
    return duration.seconds + duration.nanos / 1e9


def next_pause(attempt: int, retry_after: Optional[float], remaining: float) -> float:
    """_lifecycle.next_pause: 100 ms doubling, capped by retry_after (at
    least 10 ms) and by the time left before the deadline."""
    pause = FIRST_PAUSE_SECONDS * (2**attempt)
    if retry_after is not None:
        pause = min(pause, max(retry_after, 0.01))
    return max(0.0, min(pause, remaining))


@dataclass
class Answer:
    """What one duplicate saw, on this machine's monotonic clock (shared by
    the bench's processes: CLOCK_MONOTONIC)."""

    first_sent: float = 0.0
    answered: float = 0.0
    claims: int = 0
    outcome: str = ""
    response: bytes = b""
    #: The first Claim's `waited` in seconds; None when unset (a Claim that
    #: did not ask to wait, or a server that predates the field).
    waited: Optional[float] = None
    #: Whether the first Claim's answer came at once as OUTCOME_IN_PROGRESS
    #: (for a waiting duplicate: the server did not wait).
    first_in_progress: bool = False
    error: str = ""
    pauses: list = field(default_factory=list)

    def report(self, expected: bytes) -> dict:
        return {
            "first_sent": self.first_sent,
            "answered": self.answered,
            "claims": self.claims,
            "outcome": self.outcome,
            "response_ok": self.response == expected,
            "waited": self.waited,
            "first_in_progress": self.first_in_progress,
            "error": self.error,
            "pauses": self.pauses,
        }


async def _claim(stub, namespace: str, key: str, wait: Optional[float]):
    request = pb.ClaimRequest(namespace=namespace, key=key)
    timeout = CALL_TIMEOUT_SECONDS
    if wait is not None:
        request.wait.FromNanoseconds(int(wait * 1e9))
        timeout = wait + DEADLINE_MARGIN_SECONDS
    return await stub.Claim(request, timeout=timeout)


async def poll(stub, namespace: str, key: str, answer: Answer, start: float, first=None) -> None:
    """The helpers' poll loop, from an optional first answer already had."""
    deadline = start + WAIT_TIMEOUT_SECONDS
    attempt = 0
    response = first
    while True:
        if response is None:
            response = await _claim(stub, namespace, key, None)
            answer.claims += 1
        if response.outcome != IN_PROGRESS:
            answer.answered = time.monotonic()
            answer.outcome = outcome_name(response.outcome)
            answer.response = response.response
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            answer.answered = time.monotonic()
            answer.outcome = "still OUTCOME_IN_PROGRESS after the 30 s wait_timeout"
            return
        retry_after = seconds(response.retry_after) if response.HasField("retry_after") else None
        pause = next_pause(attempt, retry_after, remaining)
        answer.pauses.append(pause)
        await asyncio.sleep(pause)
        attempt += 1
        response = None


async def wait(stub, namespace: str, key: str, answer: Answer) -> None:
    """One Claim that waits; polls instead when the server ignored `wait`
    (waited unset), as the helpers do."""
    start = time.monotonic()
    deadline = start + WAIT_TIMEOUT_SECONDS
    refused = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            answer.answered = time.monotonic()
            answer.outcome = "still OUTCOME_IN_PROGRESS after the 30 s wait_timeout"
            return
        response = await _claim(stub, namespace, key, min(WAIT_SECONDS, left))
        answer.claims += 1
        if answer.claims == 1:
            answer.waited = seconds(response.waited) if response.HasField("waited") else None
            answer.first_in_progress = response.outcome == IN_PROGRESS
        if not response.HasField("waited"):
            # A server that predates `wait`: poll from this answer on.
            await poll(stub, namespace, key, answer, start, first=response)
            return
        if response.outcome != IN_PROGRESS:
            answer.answered = time.monotonic()
            answer.outcome = outcome_name(response.outcome)
            answer.response = response.response
            return
        # The wait ran out, or (waited zero) the server's waiter limit
        # answered at once: then pause as polling would before asking again.
        if seconds(response.waited) == 0:
            retry_after = seconds(response.retry_after) if response.HasField("retry_after") else None
            pause = next_pause(refused, retry_after, max(0.0, deadline - time.monotonic()))
            answer.pauses.append(pause)
            await asyncio.sleep(pause)
            refused += 1


async def duplicate(stub, mode: str, namespace: str, key: str) -> Answer:
    answer = Answer()
    answer.first_sent = time.monotonic()
    try:
        if mode == "wait":
            await wait(stub, namespace, key, answer)
        else:
            await poll(stub, namespace, key, answer, answer.first_sent)
    except Exception as error:  # reported, and the run fails on it
        answer.answered = time.monotonic()
        answer.error = f"{type(error).__name__}: {error}"
    return answer
