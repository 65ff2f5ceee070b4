"""The asyncio variant: AsyncIdempotencyClient over grpc.aio, and its once().

Same results, errors and lifecycle as the synchronous client (see once.py);
the work may be a coroutine function or a plain function, and the heartbeat is
an asyncio task.

    async with AsyncIdempotencyClient("127.0.0.1:50051") as client:
        async with client.once("payments", key) as run:
            receipt = await run(charge, order)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import time
from typing import Any, Callable, Iterable, List, Mapping, Optional, Sequence, Union

import grpc
import grpc.aio

from . import types
from ._proto import idempotency_pb2 as pb
from .channels import ChannelOptions, Target, aio_channel_endpoints, aio_endpoints, parse_targets
from .client import (
    DEFAULT_TIMEOUT,
    call_metadata,
    channel_credentials,
    claim_batch_request,
    claim_request,
    complete_batch_request,
    complete_request,
    extend_lease_request,
    purge_request,
    release_request,
)
from .errors import IdempotencyError, LeaseLost, from_rpc_error
from .once import (
    LEASE_GONE,
    FingerprintLike,
    KeyLike,
    Run,
    Settings,
    add_note,
    fingerprint_error,
    heartbeat_timeout,
    in_progress_error,
    log,
    next_pause,
    unexpected_outcome,
    with_run,
)
from .retry import DEFAULT_RETRY, Attempts, RetryLike, retry_policy
from .serializers import JSON, Serializer
from .types import (
    ClaimItem,
    ClaimResult,
    CompleteItem,
    CompleteItemResult,
    CompleteResult,
    DurationLike,
    ExtendLeaseResult,
    Outcome,
    PurgeResult,
    Record,
    seconds_of,
)


class AsyncIdempotencyClient:
    """The asyncio client; the same arguments as IdempotencyClient (target or
    targets, token, TLS options, credentials, timeout, retry), with grpc.aio
    channels; `interceptors` are grpc.aio client interceptors."""

    def __init__(
        self,
        target: Optional[Target] = None,
        *,
        token: Optional[str] = None,
        tls: bool = False,
        root_certificates: Optional[bytes] = None,
        client_certificate: Optional[bytes] = None,
        client_key: Optional[bytes] = None,
        credentials: Optional[grpc.ChannelCredentials] = None,
        timeout: Optional[float] = DEFAULT_TIMEOUT,
        options: ChannelOptions = None,
        channel: Optional[grpc.aio.Channel] = None,
        retry: RetryLike = DEFAULT_RETRY,
        interceptors: Optional[Sequence[Any]] = None,
    ):
        metadata = call_metadata(token)
        credentials = channel_credentials(
            credentials, tls, root_certificates, client_certificate, client_key, channel
        )
        self.retry = retry_policy(retry)
        interceptors = list(interceptors or ())
        if channel is not None:
            if interceptors:
                raise TypeError("interceptors go with a target; add them to your own channel yourself")
            self._endpoints = aio_channel_endpoints(channel)
        else:
            if target is None:
                raise TypeError("AsyncIdempotencyClient needs a target or a channel")
            self._endpoints = aio_endpoints(parse_targets(target), credentials, options, interceptors)
        self._metadata = metadata
        self.timeout = timeout

    @property
    def targets(self) -> List[str]:
        """The addresses this client calls, one channel each."""
        return self._endpoints.targets

    async def close(self) -> None:
        for channel in self._endpoints.channels:
            await channel.close()

    async def __aenter__(self) -> "AsyncIdempotencyClient":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def _call(self, name: str, request, timeout: Optional[float]):
        """As IdempotencyClient._call(): the RPC with its retries, within the deadline."""
        attempts = Attempts(self.retry, self.timeout if timeout is None else timeout)
        first = self._endpoints.first()
        while True:
            endpoint = self._endpoints.pick(first, attempts.made)
            try:
                return await getattr(endpoint.stub, name)(
                    request, timeout=attempts.timeout(), metadata=self._metadata
                )
            except grpc.RpcError as error:  # grpc.aio.AioRpcError is one
                pause = attempts.pause_after(error, name, endpoint.target)
                if pause is None:
                    raise from_rpc_error(error, name, attempts.made) from error
            await asyncio.sleep(pause)

    async def claim(
        self,
        namespace: str,
        key: str,
        *,
        fingerprint: bytes = b"",
        lease_ttl: Optional[DurationLike] = None,
        retention: Optional[DurationLike] = None,
        lease_token: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> ClaimResult:
        """As IdempotencyClient.claim(): retry-safe with its own lease token."""
        request = claim_request(namespace, key, fingerprint, lease_ttl, retention, lease_token)
        return types.claim_result(await self._call("Claim", request, timeout))

    async def complete(
        self,
        namespace: str,
        key: str,
        lease_token: str,
        response: bytes = b"",
        *,
        retention: Optional[DurationLike] = None,
        timeout: Optional[float] = None,
    ) -> CompleteResult:
        request = complete_request(namespace, key, lease_token, response, retention)
        return types.complete_result(await self._call("Complete", request, timeout))

    async def release(
        self,
        namespace: str,
        key: str,
        lease_token: str,
        *,
        checkpoint: Optional[bytes] = None,
        timeout: Optional[float] = None,
    ) -> None:
        """As IdempotencyClient.release(), with an optional checkpoint."""
        request = release_request(namespace, key, lease_token, checkpoint)
        await self._call("Release", request, timeout)

    async def extend_lease(
        self,
        namespace: str,
        key: str,
        lease_token: str,
        *,
        lease_ttl: Optional[DurationLike] = None,
        checkpoint: Optional[bytes] = None,
        timeout: Optional[float] = None,
    ) -> ExtendLeaseResult:
        """As IdempotencyClient.extend_lease(), with an optional checkpoint."""
        request = extend_lease_request(namespace, key, lease_token, lease_ttl, checkpoint)
        return types.extend_lease_result(await self._call("ExtendLease", request, timeout))

    async def get(self, namespace: str, key: str, *, timeout: Optional[float] = None) -> Record:
        request = pb.GetRequest(namespace=namespace, key=key)
        return types.record(await self._call("Get", request, timeout))

    async def claim_batch(
        self,
        items: Iterable[Union[ClaimItem, Mapping[str, Any]]],
        *,
        timeout: Optional[float] = None,
    ) -> List[ClaimResult]:
        """As IdempotencyClient.claim_batch(): one ClaimResult per item, in order."""
        request = claim_batch_request(items)
        reply = await self._call("ClaimBatch", request, timeout)
        return [types.claim_result(item) for item in reply.items]

    async def complete_batch(
        self,
        items: Iterable[Union[CompleteItem, Mapping[str, Any]]],
        *,
        timeout: Optional[float] = None,
    ) -> List[CompleteItemResult]:
        """As IdempotencyClient.complete_batch(): per-item results; a failed item does not raise."""
        request = complete_batch_request(items)
        reply = await self._call("CompleteBatch", request, timeout)
        return types.complete_item_results(reply)

    async def purge(
        self, namespace: str, key: str, *, reason: str = "", timeout: Optional[float] = None
    ) -> PurgeResult:
        """As IdempotencyClient.purge(): make a key claimable again at once."""
        request = purge_request(namespace, key, reason)
        return types.purge_result(await self._call("Purge", request, timeout))

    def once(
        self,
        namespace: str,
        key: KeyLike,
        *,
        fingerprint: FingerprintLike = b"",
        lease_ttl: Optional[DurationLike] = None,
        retention: Optional[DurationLike] = None,
        on_in_progress: str = "wait",
        wait_timeout: DurationLike = 30.0,
        serializer: Serializer = JSON,
        heartbeat: bool = True,
        heartbeat_interval: Optional[DurationLike] = None,
    ) -> "AsyncOnce":
        """As IdempotencyClient.once(), with `async with` and for coroutine functions."""
        return AsyncOnce(
            self,
            Settings(
                namespace=namespace,
                key=key,
                fingerprint=fingerprint,
                lease_ttl=lease_ttl,
                retention=retention,
                on_in_progress=on_in_progress,
                wait_timeout=wait_timeout,
                serializer=serializer,
                heartbeat=heartbeat,
                heartbeat_interval=heartbeat_interval,
            ),
        )


class AsyncRun(Run):
    """Run for `async with`: `await run(fn, *args)`; fn may be a coroutine
    function, and receives the run when it declares a keyword-only `run`.
    `await run.save_checkpoint(data)` saves a checkpoint."""

    async def save_checkpoint(self, data: bytes) -> None:  # type: ignore[override]
        """As Run.save_checkpoint(), awaited."""
        data = self._before_save(data)
        try:
            await self._save(data)
        except LEASE_GONE as error:
            raise self._save_failed(error) from error
        self._saved(data)

    async def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.replayed:
            return self.result
        if self._has_result:
            raise RuntimeError("once(): this run already has a result")
        result = fn(*args, **with_run(self, fn, kwargs))
        if inspect.isawaitable(result):
            result = await result
        self.set_result(result)
        return self.result


class AsyncOnce:
    """The asyncio run-once helper; see once.py for the lifecycle."""

    def __init__(self, client: AsyncIdempotencyClient, settings: Settings):
        self._client = client
        self._settings = settings
        self._run: Optional[AsyncRun] = None
        self._heartbeat: Optional[asyncio.Task] = None
        self._key: Optional[str] = None

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        async def once_per_key(*args: Any, **kwargs: Any) -> Any:
            settings = self._settings.bound(args, kwargs)
            return await AsyncOnce(self._client, settings).run(fn, *args, **kwargs)

        return once_per_key

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        async with self as run:
            return await run(fn, *args, **kwargs)

    async def __aenter__(self) -> AsyncRun:
        if self._run is not None:
            raise RuntimeError("once(): an AsyncOnce is entered once; call client.once() again")
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
            if claim.outcome is not Outcome.IN_PROGRESS:
                raise unexpected_outcome(claim)
            if settings.on_in_progress == "raise":
                raise in_progress_error(claim, settings, waited=False)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise in_progress_error(claim, settings, waited=True)
            await asyncio.sleep(next_pause(attempt, claim, remaining))
            attempt += 1

    def _start_heartbeat(self, claim: ClaimResult) -> None:
        interval = self._settings.heartbeat_seconds()
        if interval is None:
            return
        self._heartbeat = asyncio.ensure_future(self._beat(claim, interval))

    async def _save_checkpoint(self, token: str, data: bytes) -> None:
        settings = self._settings
        await self._client.extend_lease(
            settings.namespace, self._key, token, lease_ttl=settings.lease_ttl, checkpoint=data
        )

    async def _beat(self, claim: ClaimResult, interval: float) -> None:
        settings = self._settings
        timeout = heartbeat_timeout(interval, self._client.timeout)
        while True:
            await asyncio.sleep(interval)
            try:
                await self._client.extend_lease(
                    settings.namespace,
                    self._key,
                    claim.lease_token,
                    lease_ttl=settings.lease_ttl,
                    timeout=timeout,
                )
            except LEASE_GONE as error:
                self._run._lost = error
                return
            except IdempotencyError as error:
                log.warning("idempotency heartbeat: ExtendLease failed: %s", error)

    async def _stop_heartbeat(self) -> None:
        if self._heartbeat is None:
            return
        self._heartbeat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._heartbeat

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        run = self._run
        if run is None or run.replayed:
            return False
        await self._stop_heartbeat()
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
        if self._run._lost is not None:
            return
        try:
            await self._client.release(
                self._settings.namespace, self._key, token, checkpoint=self._run._last_saved
            )
        except IdempotencyError as error:
            log.warning("idempotency once(): Release after a failed attempt failed: %s", error)
            add_note(failure, f"idempotency: Release after this failure also failed: {error}")
