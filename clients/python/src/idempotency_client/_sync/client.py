# Generated from ../_async/client.py by clients/python/gen_sync.py (unasync): do not edit.
# Change the asyncio source and run the script again.
"""The client's RPCs with typed results and typed errors, and once() built on
them: AsyncIdempotencyClient over grpc.aio channels, and IdempotencyClient
over synchronous ones.

_async/client.py is the source; _sync/client.py is generated from it by
clients/python/gen_sync.py (unasync), and run-tests.sh fails when the two
drift apart. What they share that is not a call (the request builders,
credentials, metadata) is in _requests.py.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Mapping, Optional, Sequence, Union

import grpc

from .. import types
from .._concurrency import sleep
from .._lifecycle import (
    MIN_WAIT_SECONDS,
    WAIT_HEADROOM_SECONDS,
    FingerprintLike,
    KeyLike,
    ServerWaits,
    Settings,
    wait_within,
)
from .._proto import idempotency_pb2 as pb
from .._requests import (
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
from ..channels import (
    Channel,
    ChannelOptions,
    Target,
    sync_channel_endpoints,
    sync_endpoints,
    close_sync,
    parse_targets,
)
from ..errors import from_rpc_error
from ..retry import DEFAULT_RETRY, Attempts, RetryLike, retry_policy
from ..serializers import JSON, Serializer
from ..types import (
    ClaimItem,
    ClaimResult,
    CompleteItem,
    CompleteItemResult,
    CompleteResult,
    DurationLike,
    ExtendLeaseResult,
    LateRetryLike,
    PurgeResult,
    Record,
    seconds_of,
)
from .once import Once

#: A call's overall deadline (all its attempts) unless the client or the call
#: sets another, in seconds.
DEFAULT_TIMEOUT = 10.0


class IdempotencyClient:
    """A client of idempotency-service: IdempotencyClient, and its asyncio
    twin AsyncIdempotencyClient (the same arguments over grpc.aio channels,
    every call awaited, `async with` for the client and its once()).

        client = IdempotencyClient("127.0.0.1:50051")
        client = IdempotencyClient(["10.0.0.1:50051", "10.0.0.2:50051"])
        client = IdempotencyClient("dns:///idempotency.internal:50051", token=token,
                                   root_certificates=open("ca.pem", "rb").read())

    `target` is one address, several (a list, or a string with commas), or a
    gRPC target URI (`dns:///name:port` balances over every address the name
    resolves to; `ipv4:a:1,b:2` too). With several addresses, calls go to
    each in turn and a retry goes to the next one (see channels.py).

    `token` is sent as `authorization: Bearer <token>` with every call
    (once()'s and the batch calls' included). Over a plaintext channel it
    travels in clear: use TLS beyond loopback or a trusted network.

    TLS: `tls=True` verifies the server against the system's roots;
    `root_certificates` (PEM bytes) against those instead; `client_certificate`
    and `client_key` (PEM bytes, both) present a client certificate (mutual
    TLS). Any of the three implies TLS. For anything else pass `credentials`
    (grpc.ChannelCredentials), or an existing `channel` instead of a target
    (a grpc.aio one for the asyncio client); the token is still sent with
    those. Without any, the channel is plaintext.

    `timeout` is each call's overall deadline in seconds, its retries
    included. `retry` is the RetryPolicy (on by default: UNAVAILABLE,
    RESOURCE_EXHAUSTED and DEADLINE_EXCEEDED are retried with capped
    exponential backoff and full jitter; see retry.py); None turns retries off.
    `interceptors` wrap every channel (grpc.UnaryUnaryClientInterceptor, or
    grpc.aio client interceptors for the asyncio client, which takes them
    with a target only). Errors are raised as the classes in
    idempotency_client.errors, never as bare grpc.RpcError; after retries,
    the last attempt's error, with `attempts` set.
    """

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
        channel: Optional[Channel] = None,
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
            self._endpoints = sync_channel_endpoints(channel, interceptors)
        else:
            if target is None:
                raise TypeError(f"{type(self).__name__} needs a target or a channel")
            self._endpoints = sync_endpoints(parse_targets(target), credentials, options, interceptors)
        self._metadata = metadata
        self.timeout = timeout
        #: What Claims that asked to wait have shown of the servers (once()
        #: polls instead while they ignore `wait`).
        self.wait_support = ServerWaits()

    @property
    def targets(self) -> List[str]:
        """The addresses this client calls, one channel each."""
        return self._endpoints.targets

    @property
    def server_waits(self) -> Optional[bool]:
        """Whether the server waited when a Claim asked it to: True once an
        answer carried `waited`, False after one ignored `wait` (a server
        that predates it; once() then polls), None before any Claim asked."""
        return self.wait_support.supported

    def close(self) -> None:
        close_sync(self._endpoints)

    def __enter__(self) -> "IdempotencyClient":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _call(self, name: str, request, timeout: Optional[float], at_least: Optional[float] = None):
        """One RPC with its retries: each attempt on the next channel in turn,
        within the overall deadline; the last failure raised as its typed error.
        `at_least`: no attempt is cut by the per-attempt timeout sooner."""
        attempts = Attempts(self.retry, self.timeout if timeout is None else timeout, at_least)
        first = self._endpoints.first()
        while True:
            endpoint = self._endpoints.pick(first, attempts.made)
            try:
                return getattr(endpoint.stub, name)(
                    request, timeout=attempts.timeout(), metadata=self._metadata
                )
            except grpc.RpcError as error:  # grpc.aio.AioRpcError is one too
                pause = attempts.pause_after(error, name, endpoint.target)
                if pause is None:
                    raise from_rpc_error(error, name, attempts.made, attempts.last_details) from error
            sleep(pause)

    def claim(
        self,
        namespace: str,
        key: str,
        *,
        fingerprint: bytes = b"",
        lease_ttl: Optional[DurationLike] = None,
        retention: Optional[DurationLike] = None,
        lease_token: Optional[str] = None,
        wait: Optional[DurationLike] = None,
        late_retry: LateRetryLike = None,
        timeout: Optional[float] = None,
    ) -> ClaimResult:
        """Try to take the lease on a key. Losing a race is Outcome.IN_PROGRESS, not an error.

        The Claim carries its own lease token (`lease_token`, or a new random
        one), the same on every retry: a retry after a lost answer gets the
        same lease back (`retried` is then True). Pass your own only to retry
        a logical Claim yourself; never reuse one across Claims.

        `wait` (a timedelta or seconds): when another holder has a live
        lease, wait for it on the server instead of answering IN_PROGRESS at
        once: COMPLETED with its result when it completes, CLAIMED when it
        releases or its lease runs out and this Claim takes the key,
        IN_PROGRESS when the wait runs out. The wait ends before the call's
        timeout (with time left for the answer), and the retry policy's
        per_attempt_timeout does not cut it short. `waited` on the result
        says how long the server waited; it is None when the server predates
        waiting (it ignored the request and answered at once).

        `late_retry` ("reexecute", "refuse", a LateRetry; None: the
        namespace's or the server's policy) says what to do when the key is
        remembered (completed, its result expired): "reexecute" claims it
        anew, CLAIMED with `completed_at` set (`reexecuted` is True) and the
        next fencing token; "refuse" answers Outcome.EXPIRED with
        `completed_at` and the last lease's `fencing_token`."""
        call_timeout = self.timeout if timeout is None else timeout
        wait_seconds = seconds_of(wait)
        at_least = None
        if wait_seconds is not None and wait_seconds > 0:
            wait_seconds = max(wait_within(wait_seconds, call_timeout), MIN_WAIT_SECONDS)
            at_least = wait_seconds + WAIT_HEADROOM_SECONDS
        elif wait_seconds == 0:
            wait_seconds = None  # zero is no waiting: the field stays unset
        request = claim_request(
            namespace, key, fingerprint, lease_ttl, retention, lease_token, wait_seconds, late_retry
        )
        result = types.claim_result(self._call("Claim", request, call_timeout, at_least))
        if at_least is not None:
            self.wait_support.saw(result.waited)
        return result

    def complete(
        self,
        namespace: str,
        key: str,
        lease_token: str,
        response: bytes = b"",
        *,
        retention: Optional[DurationLike] = None,
        timeout: Optional[float] = None,
    ) -> CompleteResult:
        """Store the work's result; later Claims replay it. Safe to retry."""
        request = complete_request(namespace, key, lease_token, response, retention)
        return types.complete_result(self._call("Complete", request, timeout))

    def release(
        self,
        namespace: str,
        key: str,
        lease_token: str,
        *,
        checkpoint: Optional[bytes] = None,
        timeout: Optional[float] = None,
    ) -> None:
        """Give a failed attempt back: the key is claimable again at once.
        `checkpoint` (bytes) is saved for the next holder; None keeps the last
        one saved."""
        request = release_request(namespace, key, lease_token, checkpoint)
        self._call("Release", request, timeout)

    def extend_lease(
        self,
        namespace: str,
        key: str,
        lease_token: str,
        *,
        lease_ttl: Optional[DurationLike] = None,
        checkpoint: Optional[bytes] = None,
        timeout: Optional[float] = None,
    ) -> ExtendLeaseResult:
        """Keep a long piece of work's lease alive: it now ends lease_ttl from
        now. `checkpoint` (bytes: how far the work got) replaces the one saved
        before; whoever takes the key over after this lease receives it."""
        request = extend_lease_request(namespace, key, lease_token, lease_ttl, checkpoint)
        return types.extend_lease_result(self._call("ExtendLease", request, timeout))

    def get(self, namespace: str, key: str, *, timeout: Optional[float] = None) -> Record:
        """Inspect a key's record without changing it."""
        request = pb.GetRequest(namespace=namespace, key=key)
        return types.record(self._call("Get", request, timeout))

    def claim_batch(
        self,
        items: Iterable[Union[ClaimItem, Mapping[str, Any]]],
        *,
        item_errors: bool = False,
        timeout: Optional[float] = None,
    ) -> List[ClaimResult]:
        """Claim many keys in one call (ClaimItem, or mappings of claim()'s
        arguments): one ClaimResult per item, in order, each what its own
        claim() would have returned. The same key twice is one lease: the first
        item is CLAIMED, the second IN_PROGRESS. An invalid item fails the whole
        call with InvalidArgument naming it ("items[3].key: ..."), as does an
        empty list or one longer than the server's limit (500 unless configured).
        Each item carries its own lease token, so the batch is safe to retry.

        item_errors=True: an item whose key cannot be reached while others can
        (on Citus, the worker holding it is down) comes back with only its
        `error` set (Unavailable; `ok` is False), and the others are answered;
        the call raises only when every item failed, or for the call's own
        reasons. A failed item's lease_token is the one it was sent with:
        retry it with ClaimItem(..., lease_token=result.lease_token), which is
        safe whether or not its Claim took effect. Without item_errors, such
        a failure fails the whole call.
        """
        request = claim_batch_request(items, item_errors)
        reply = self._call("ClaimBatch", request, timeout)
        return types.claim_batch_results(reply, request)

    def complete_batch(
        self,
        items: Iterable[Union[CompleteItem, Mapping[str, Any]]],
        *,
        item_errors: bool = False,
        timeout: Optional[float] = None,
    ) -> List[CompleteItemResult]:
        """Complete many keys in one call (CompleteItem, or mappings of
        complete()'s arguments): one CompleteItemResult per item, in order,
        with expires_at or the error its own complete() would have raised
        (KeyNotFound, LeaseNotCurrent). A failed item does not raise; an
        invalid item fails the whole call with InvalidArgument naming it.
        item_errors=True: an item whose key cannot be reached while others can
        (on Citus, a worker down) is answered with Unavailable and the others
        are completed; retrying that item is safe."""
        request = complete_batch_request(items, item_errors)
        reply = self._call("CompleteBatch", request, timeout)
        return types.complete_item_results(reply)

    def purge(
        self, namespace: str, key: str, *, reason: str = "", timeout: Optional[float] = None
    ) -> PurgeResult:
        """An operator's action: make a key claimable again at once (its record
        expires now; a live lease is revoked, so its holder's Complete raises
        KeyNotFound). `reason` (at most 256 bytes) goes to the server's log."""
        request = purge_request(namespace, key, reason)
        return types.purge_result(self._call("Purge", request, timeout))

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
        late_retry: LateRetryLike = None,
    ) -> "Once":
        """Run work once per key: a context manager, or a decorator.

            with client.once("payments", key, fingerprint=fp) as run:
                receipt = run(charge, order)

            @client.once("payments", key=lambda order: derive_key(order["id"]))
            def charge(order): ...

        With the asyncio client: `async with client.once(...) as run:` and
        `await run(fn, ...)`, where fn may be a coroutine function; the
        decorator makes a coroutine function.

        See idempotency_client.once for the lifecycle. `lease_ttl` and
        `retention` default to the server's; the heartbeat extends the lease
        every heartbeat_interval (default lease_ttl / 3) while the work runs.
        When another holder has the key, `on_in_progress="wait"` (the
        default) waits for it on the server, up to `wait_timeout` in all,
        one Claim per call's timeout, and gets its stored result or the
        lease; against a server that predates waiting it polls instead.
        "poll" always polls (Claim again with backoff); "raise" raises
        InProgress at once.
        Resumable work: `run.checkpoint` is what an earlier holder saved (or
        None), `run.save_checkpoint(data)` saves progress; a work function
        with a keyword-only parameter `run` receives the Run.
        A late retry (the key completed before, its result expired, the
        server still remembers it) follows `late_retry`: "reexecute" runs the
        work again, and `run.completed_before` says when the key completed
        before; "refuse" raises ResultExpired (with completed_at and
        fencing_token) without running it. None: the namespace's or the
        server's policy (reexecute unless configured).
        """
        return Once(
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
                late_retry=late_retry,
            ),
        )
