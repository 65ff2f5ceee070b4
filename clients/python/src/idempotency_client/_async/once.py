"""The run-once helper that client.once() returns: AsyncOnce for the asyncio
client, Once for the synchronous one. idempotency_client.once describes the
lifecycle; _lifecycle.py holds the rules both variants follow.

_async/once.py is the source; _sync/once.py is generated from it by
clients/python/gen_sync.py (unasync). This module does not import the
client: it needs only the four calls in AsyncLeaseCalls (and what the
client learned of the server's waiting), so the client imports it and not
the reverse.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Optional, Protocol

from .._concurrency import AsyncHeartbeat, async_sleep
from .._lifecycle import (
    LEASE_GONE,
    MIN_WAIT_SECONDS,
    ServerWaits,
    Settings,
    add_note,
    expired_error,
    fingerprint_error,
    heartbeat_timeout,
    in_progress_error,
    log,
    next_pause,
    server_waited,
    unexpected_outcome,
)
from .._run import AsyncRun
from ..errors import IdempotencyError, LeaseLost
from ..types import (
    ClaimResult,
    CompleteResult,
    DurationLike,
    ExtendLeaseResult,
    LateRetryLike,
    Outcome,
    seconds_of,
)


class AsyncLeaseCalls(Protocol):
    """The calls the helper makes, as the client has them."""

    timeout: Optional[float]
    wait_support: ServerWaits

    async def claim(
        self,
        namespace: str,
        key: str,
        *,
        fingerprint: bytes = b"",
        lease_ttl: Optional[DurationLike] = None,
        retention: Optional[DurationLike] = None,
        wait: Optional[DurationLike] = None,
        late_retry: LateRetryLike = None,
    ) -> ClaimResult: ...

    async def complete(
        self,
        namespace: str,
        key: str,
        lease_token: str,
        response: bytes = b"",
        *,
        retention: Optional[DurationLike] = None,
    ) -> CompleteResult: ...

    async def release(
        self, namespace: str, key: str, lease_token: str, *, checkpoint: Optional[bytes] = None
    ) -> None: ...

    async def extend_lease(
        self,
        namespace: str,
        key: str,
        lease_token: str,
        *,
        lease_ttl: Optional[DurationLike] = None,
        checkpoint: Optional[bytes] = None,
        timeout: Optional[float] = None,
    ) -> ExtendLeaseResult: ...


class AsyncOnce:
    """The run-once helper; see idempotency_client.once. Made by client.once()."""

    def __init__(self, client: AsyncLeaseCalls, settings: Settings):
        self._client = client
        self._settings = settings
        self._run: Optional[AsyncRun] = None
        self._heartbeat: Optional[AsyncHeartbeat] = None
        self._key: Optional[str] = None

    # -- decorator -------------------------------------------------------
    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        async def once_per_key(*args: Any, **kwargs: Any) -> Any:
            settings = self._settings.bound(args, kwargs)
            return await AsyncOnce(self._client, settings).run(fn, *args, **kwargs)

        return once_per_key

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) once per key: its result, or the replayed one."""
        async with self as run:
            return await run(fn, *args, **kwargs)

    # -- context manager -------------------------------------------------
    async def __aenter__(self) -> AsyncRun:
        if self._run is not None:
            raise RuntimeError(f"once(): a {type(self).__name__} is entered once; call client.once() again")
        settings = self._settings
        self._key = key = settings.fixed_key()
        deadline = time.monotonic() + (seconds_of(settings.wait_timeout) or 0.0)
        attempt = 0
        while True:
            claim = await self._client.claim(
                settings.namespace,
                key,
                fingerprint=settings.fingerprint,
                lease_ttl=settings.lease_ttl,
                retention=settings.retention,
                wait=self._wait(deadline),
                late_retry=settings.late_retry,
            )
            if claim.outcome is Outcome.CLAIMED:
                self._run = run = AsyncRun(claim, replayed=False)
                run._save = functools.partial(self._save_checkpoint, claim.lease_token)
                self._start_heartbeat(claim)
                return run
            if claim.outcome is Outcome.COMPLETED:
                self._run = AsyncRun(claim, True, settings.serializer.loads(claim.response))
                return self._run
            if claim.outcome is Outcome.FINGERPRINT_MISMATCH:
                raise fingerprint_error(settings)
            if claim.outcome is Outcome.EXPIRED:
                raise expired_error(claim, settings)
            if claim.outcome is not Outcome.IN_PROGRESS:
                raise unexpected_outcome(claim)
            if settings.on_in_progress == "raise":
                raise in_progress_error(claim, settings, waited=False)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise in_progress_error(claim, settings, waited=True)
            if server_waited(claim):
                continue  # its wait ended with the call's timeout: wait again
            # The server did not wait (it predates waiting, its waiter limit
            # was reached, or we chose to poll): pause, then Claim again.
            await async_sleep(next_pause(attempt, claim, remaining))
            attempt += 1

    def _wait(self, deadline: float) -> Optional[float]:
        """How long the next Claim asks the server to wait: what is left of
        wait_timeout (the client keeps it within the call's timeout); None
        when polling, or when the server is known to ignore it."""
        if self._settings.on_in_progress != "wait" or not self._client.wait_support.worth_asking():
            return None
        remaining = deadline - time.monotonic()
        return remaining if remaining >= MIN_WAIT_SECONDS else None

    def _start_heartbeat(self, claim: ClaimResult) -> None:
        interval = self._settings.heartbeat_seconds()
        if interval is None:
            return
        timeout = heartbeat_timeout(interval, self._client.timeout)
        beat = functools.partial(self._beat, claim.lease_token, timeout)
        self._heartbeat = AsyncHeartbeat(beat, interval)

    async def _beat(self, token: str, timeout: float) -> bool:
        """One beat of the heartbeat: extend the lease. False (no more beats)
        once the server says the lease is gone; the work learns it from the run."""
        settings = self._settings
        try:
            await self._client.extend_lease(
                settings.namespace, self._key, token, lease_ttl=settings.lease_ttl, timeout=timeout
            )
        except LEASE_GONE as error:
            self._run._lost = error
            return False
        except IdempotencyError as error:
            # A transient failure: the lease may well still be ours, and the
            # final Complete tells for sure.
            log.warning("idempotency heartbeat: ExtendLease failed: %s", error)
        return True

    async def _save_checkpoint(self, token: str, data: bytes) -> None:
        settings = self._settings
        await self._client.extend_lease(
            settings.namespace, self._key, token, lease_ttl=settings.lease_ttl, checkpoint=data
        )

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        run = self._run
        if run is None or run.replayed:
            return False
        if self._heartbeat is not None:
            await self._heartbeat.stop()
        settings = self._settings
        token = run.claim.lease_token
        if exc is not None:
            await self._release_after_failure(token, exc)
            return False
        if run._lost is not None:
            raise LeaseLost(
                f"{settings.namespace}/{self._key}: the lease was lost while the work ran;"
                " the result was not stored"
            ) from run._lost
        try:
            response = settings.serializer.dumps(run.result)
        except Exception as error:
            await self._release_after_failure(token, error)
            raise
        try:
            await self._client.complete(
                settings.namespace, self._key, token, response, retention=settings.retention
            )
        except LEASE_GONE as error:
            raise LeaseLost(
                f"{settings.namespace}/{self._key}: the lease was lost before Complete;"
                " the result was not stored"
            ) from error
        return False

    async def _release_after_failure(self, token: str, failure: BaseException) -> None:
        """Give the key back so the next delivery retries; never hide the failure."""
        if self._run._lost is not None:
            return  # not ours any more: nothing to release
        try:
            await self._client.release(
                self._settings.namespace, self._key, token, checkpoint=self._run._last_saved
            )
        except IdempotencyError as error:
            log.warning("idempotency once(): Release after a failed attempt failed: %s", error)
            add_note(failure, f"idempotency: Release after this failure also failed: {error}")
