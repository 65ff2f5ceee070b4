"""IdempotencyClient: the RPCs over a synchronous gRPC channel, with typed
results and typed errors, and once() built on them.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import grpc

from . import types
from ._proto import idempotency_pb2 as pb
from ._proto import idempotency_pb2_grpc as pb_grpc
from .errors import from_rpc_error
from .once import FingerprintLike, KeyLike, Once, Settings
from .serializers import JSON, Serializer
from .types import (
    ClaimItem,
    ClaimResult,
    CompleteItem,
    CompleteItemResult,
    CompleteResult,
    DurationLike,
    ExtendLeaseResult,
    PurgeResult,
    Record,
)

#: Per-call deadline unless the client or the call sets another, in seconds.
DEFAULT_TIMEOUT = 10.0

ChannelOptions = Optional[Sequence[Tuple[str, Any]]]


def _fingerprint_bytes(fingerprint: Any) -> bytes:
    if isinstance(fingerprint, (bytes, bytearray, memoryview)):
        return bytes(fingerprint)
    raise TypeError(
        "fingerprint must be bytes (e.g. idempotency_client.fingerprint(payload)),"
        f" got {type(fingerprint).__name__}"
    )


def claim_request(namespace, key, fingerprint, lease_ttl, retention) -> pb.ClaimRequest:
    return pb.ClaimRequest(
        namespace=namespace,
        key=key,
        fingerprint=_fingerprint_bytes(fingerprint),
        lease_ttl=types.to_duration(lease_ttl, "lease_ttl"),
        retention=types.to_duration(retention, "retention"),
    )


def complete_request(namespace, key, lease_token, response, retention) -> pb.CompleteRequest:
    if not isinstance(response, (bytes, bytearray, memoryview)):
        raise TypeError(f"response must be bytes, got {type(response).__name__}")
    return pb.CompleteRequest(
        namespace=namespace,
        key=key,
        lease_token=lease_token,
        response=bytes(response),
        retention=types.to_duration(retention, "retention"),
    )


def extend_lease_request(namespace, key, lease_token, lease_ttl) -> pb.ExtendLeaseRequest:
    return pb.ExtendLeaseRequest(
        namespace=namespace,
        key=key,
        lease_token=lease_token,
        lease_ttl=types.to_duration(lease_ttl, "lease_ttl"),
    )


def _item(item: Any, cls: type, index: int):
    if isinstance(item, cls):
        return item
    if isinstance(item, Mapping):
        try:
            return cls(**item)
        except TypeError as error:
            raise TypeError(f"items[{index}]: {error}") from None
    raise TypeError(f"items[{index}]: expected a {cls.__name__} or a mapping, got {type(item).__name__}")


def claim_batch_request(items: Iterable[Union[ClaimItem, Mapping[str, Any]]]) -> pb.ClaimBatchRequest:
    request = pb.ClaimBatchRequest()
    for index, item in enumerate(items):
        item = _item(item, ClaimItem, index)
        try:
            request.items.append(
                claim_request(item.namespace, item.key, item.fingerprint, item.lease_ttl, item.retention)
            )
        except TypeError as error:
            raise TypeError(f"items[{index}].{error}") from None
    return request


def complete_batch_request(
    items: Iterable[Union[CompleteItem, Mapping[str, Any]]],
) -> pb.CompleteBatchRequest:
    request = pb.CompleteBatchRequest()
    for index, item in enumerate(items):
        item = _item(item, CompleteItem, index)
        try:
            request.items.append(
                complete_request(item.namespace, item.key, item.lease_token, item.response, item.retention)
            )
        except TypeError as error:
            raise TypeError(f"items[{index}].{error}") from None
    return request


def purge_request(namespace, key, reason) -> pb.PurgeRequest:
    if not isinstance(reason, str):
        raise TypeError(f"reason must be a str, got {type(reason).__name__}")
    return pb.PurgeRequest(namespace=namespace, key=key, reason=reason)


def channel_credentials(
    credentials: Optional[grpc.ChannelCredentials],
    tls: bool,
    root_certificates: Optional[bytes],
    client_certificate: Optional[bytes],
    client_key: Optional[bytes],
    channel: Any,
) -> Optional[grpc.ChannelCredentials]:
    """The channel's credentials from a client's TLS options: None for plaintext."""
    pems = {
        "root_certificates": root_certificates,
        "client_certificate": client_certificate,
        "client_key": client_key,
    }
    for name, value in pems.items():
        if value is not None and not isinstance(value, bytes):
            raise TypeError(f"{name} must be PEM bytes, got {type(value).__name__}")
    wants_tls = bool(tls) or any(value is not None for value in pems.values())
    if wants_tls and (credentials is not None or channel is not None):
        raise TypeError(
            "pass either credentials= or channel=, or the TLS options"
            " (tls, root_certificates, client_certificate, client_key), not both"
        )
    if (client_certificate is None) != (client_key is None):
        raise TypeError("client_certificate and client_key go together (mutual TLS needs both)")
    if not wants_tls:
        return credentials
    return grpc.ssl_channel_credentials(
        root_certificates=root_certificates,
        private_key=client_key,
        certificate_chain=client_certificate,
    )


def call_metadata(token: Optional[str]) -> Optional[Tuple[Tuple[str, str], ...]]:
    """The metadata sent with every call: the bearer token, if any."""
    if token is None:
        return None
    if not isinstance(token, str):
        raise TypeError(f"token must be a str, got {type(token).__name__}")
    if not token or not all("!" <= ch <= "~" for ch in token):
        raise ValueError("token must be non-empty printable ASCII without spaces")
    return (("authorization", f"Bearer {token}"),)


class IdempotencyClient:
    """A client of idempotency-service.

        client = IdempotencyClient("127.0.0.1:50051")
        client = IdempotencyClient("idempotency.internal:50051", token=token,
                                   root_certificates=open("ca.pem", "rb").read())

    `token` is sent as `authorization: Bearer <token>` with every call
    (once()'s and the batch calls' included). Over a plaintext channel it
    travels in clear: use TLS beyond loopback or a trusted network.

    TLS: `tls=True` verifies the server against the system's roots;
    `root_certificates` (PEM bytes) against those instead; `client_certificate`
    and `client_key` (PEM bytes, both) present a client certificate (mutual
    TLS). Any of the three implies TLS. For anything else pass `credentials`
    (grpc.ChannelCredentials), or an existing `channel` instead of a target;
    the token is still sent with those. Without any, the channel is plaintext.

    `timeout` is each call's deadline in seconds. Errors are raised as the
    classes in idempotency_client.errors, never as bare grpc.RpcError.
    """

    def __init__(
        self,
        target: Optional[str] = None,
        *,
        token: Optional[str] = None,
        tls: bool = False,
        root_certificates: Optional[bytes] = None,
        client_certificate: Optional[bytes] = None,
        client_key: Optional[bytes] = None,
        credentials: Optional[grpc.ChannelCredentials] = None,
        timeout: float = DEFAULT_TIMEOUT,
        options: ChannelOptions = None,
        channel: Optional[grpc.Channel] = None,
    ):
        metadata = call_metadata(token)
        credentials = channel_credentials(
            credentials, tls, root_certificates, client_certificate, client_key, channel
        )
        if channel is None:
            if target is None:
                raise TypeError("IdempotencyClient needs a target or a channel")
            if credentials is None:
                channel = grpc.insecure_channel(target, options=options)
            else:
                channel = grpc.secure_channel(target, credentials, options=options)
        self._channel = channel
        self._stub = pb_grpc.IdempotencyServiceStub(channel)
        self._metadata = metadata
        self.timeout = timeout

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "IdempotencyClient":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _call(self, name: str, method, request, timeout: Optional[float]):
        try:
            return method(
                request,
                timeout=self.timeout if timeout is None else timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as error:
            raise from_rpc_error(error, name) from error

    def claim(
        self,
        namespace: str,
        key: str,
        *,
        fingerprint: bytes = b"",
        lease_ttl: Optional[DurationLike] = None,
        retention: Optional[DurationLike] = None,
        timeout: Optional[float] = None,
    ) -> ClaimResult:
        """Try to take the lease on a key. Losing a race is Outcome.IN_PROGRESS, not an error."""
        request = claim_request(namespace, key, fingerprint, lease_ttl, retention)
        return types.claim_result(self._call("Claim", self._stub.Claim, request, timeout))

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
        return types.complete_result(self._call("Complete", self._stub.Complete, request, timeout))

    def release(
        self, namespace: str, key: str, lease_token: str, *, timeout: Optional[float] = None
    ) -> None:
        """Give a failed attempt back: the key is claimable again at once."""
        request = pb.ReleaseRequest(namespace=namespace, key=key, lease_token=lease_token)
        self._call("Release", self._stub.Release, request, timeout)

    def extend_lease(
        self,
        namespace: str,
        key: str,
        lease_token: str,
        *,
        lease_ttl: Optional[DurationLike] = None,
        timeout: Optional[float] = None,
    ) -> ExtendLeaseResult:
        """Keep a long piece of work's lease alive: it now ends lease_ttl from now."""
        request = extend_lease_request(namespace, key, lease_token, lease_ttl)
        return types.extend_lease_result(
            self._call("ExtendLease", self._stub.ExtendLease, request, timeout)
        )

    def get(self, namespace: str, key: str, *, timeout: Optional[float] = None) -> Record:
        """Inspect a key's record without changing it."""
        request = pb.GetRequest(namespace=namespace, key=key)
        return types.record(self._call("Get", self._stub.Get, request, timeout))

    def claim_batch(
        self,
        items: Iterable[Union[ClaimItem, Mapping[str, Any]]],
        *,
        timeout: Optional[float] = None,
    ) -> List[ClaimResult]:
        """Claim many keys in one call (ClaimItem, or mappings of claim()'s
        arguments): one ClaimResult per item, in order, each what its own
        claim() would have returned. The same key twice is one lease: the first
        item is CLAIMED, the second IN_PROGRESS. An invalid item fails the whole
        call with InvalidArgument naming it ("items[3].key: ..."), as does an
        empty list or one longer than the server's limit (500 unless configured).
        """
        request = claim_batch_request(items)
        reply = self._call("ClaimBatch", self._stub.ClaimBatch, request, timeout)
        return [types.claim_result(item) for item in reply.items]

    def complete_batch(
        self,
        items: Iterable[Union[CompleteItem, Mapping[str, Any]]],
        *,
        timeout: Optional[float] = None,
    ) -> List[CompleteItemResult]:
        """Complete many keys in one call (CompleteItem, or mappings of
        complete()'s arguments): one CompleteItemResult per item, in order,
        with expires_at or the error its own complete() would have raised
        (KeyNotFound, LeaseNotCurrent). A failed item does not raise; an
        invalid item fails the whole call with InvalidArgument naming it."""
        request = complete_batch_request(items)
        reply = self._call("CompleteBatch", self._stub.CompleteBatch, request, timeout)
        return types.complete_item_results(reply)

    def purge(
        self, namespace: str, key: str, *, reason: str = "", timeout: Optional[float] = None
    ) -> PurgeResult:
        """An operator's action: make a key claimable again at once (its record
        expires now; a live lease is revoked, so its holder's Complete raises
        KeyNotFound). `reason` (at most 256 bytes) goes to the server's log."""
        request = purge_request(namespace, key, reason)
        return types.purge_result(self._call("Purge", self._stub.Purge, request, timeout))

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
    ) -> Once:
        """Run work once per key: a context manager, or a decorator.

            with client.once("payments", key, fingerprint=fp) as run:
                receipt = run(charge, order)

            @client.once("payments", key=lambda order: derive_key(order["id"]))
            def charge(order): ...

        See idempotency_client.once for the lifecycle. `lease_ttl` and
        `retention` default to the server's; the heartbeat extends the lease
        every heartbeat_interval (default lease_ttl / 3) while the work runs.
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
            ),
        )
