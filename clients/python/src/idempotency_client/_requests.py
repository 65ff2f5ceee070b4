"""What both clients send: the request messages, built from a call's
arguments and checked on the way (a TypeError names the argument, and the
item of a batch), and the channel's credentials and call metadata from the
client's arguments.

The asyncio client (_async/client.py) and the synchronous one generated from
it (_sync/client.py) import these; idempotency_client.client re-exports them
under the names they always had.
"""

from __future__ import annotations

import secrets
from typing import Any, Iterable, Mapping, Optional, Tuple, Union

import grpc

from . import types
from ._proto import idempotency_pb2 as pb
from .types import ClaimItem, CompleteItem


def new_lease_token() -> str:
    """A fresh lease token for one logical Claim: 128 bits from the OS's CSPRNG,
    as 32 lowercase hex characters (what the server expects)."""
    return secrets.token_hex(16)


def _fingerprint_bytes(fingerprint: Any) -> bytes:
    if isinstance(fingerprint, (bytes, bytearray, memoryview)):
        return bytes(fingerprint)
    raise TypeError(
        "fingerprint must be bytes (e.g. idempotency_client.fingerprint(payload)),"
        f" got {type(fingerprint).__name__}"
    )


def _checkpoint_bytes(checkpoint: Any) -> Optional[bytes]:
    if checkpoint is None:
        return None
    if isinstance(checkpoint, (bytes, bytearray, memoryview)):
        return bytes(checkpoint)
    raise TypeError(f"checkpoint must be bytes, got {type(checkpoint).__name__}")


def claim_request(
    namespace, key, fingerprint, lease_ttl, retention, lease_token=None, wait=None, late_retry=None
) -> pb.ClaimRequest:
    """A Claim with its own lease token (a new one unless given), so that the
    same request, sent again after a lost answer, gets the same lease back;
    `wait` (seconds, or None) is how long it may wait for another holder;
    `late_retry` what to do when the key is remembered (None: unset, the
    namespace's or the server's policy)."""
    if lease_token is None:
        lease_token = new_lease_token()
    elif not isinstance(lease_token, str):
        raise TypeError(f"lease_token must be a str, got {type(lease_token).__name__}")
    return pb.ClaimRequest(
        namespace=namespace,
        key=key,
        fingerprint=_fingerprint_bytes(fingerprint),
        lease_ttl=types.to_duration(lease_ttl, "lease_ttl"),
        retention=types.to_duration(retention, "retention"),
        lease_token=lease_token,
        wait=types.to_duration(wait, "wait"),
        late_retry=types.late_retry_value(late_retry),
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


def extend_lease_request(namespace, key, lease_token, lease_ttl, checkpoint=None) -> pb.ExtendLeaseRequest:
    request = pb.ExtendLeaseRequest(
        namespace=namespace,
        key=key,
        lease_token=lease_token,
        lease_ttl=types.to_duration(lease_ttl, "lease_ttl"),
    )
    checkpoint = _checkpoint_bytes(checkpoint)
    if checkpoint is not None:
        request.checkpoint = checkpoint
    return request


def release_request(namespace, key, lease_token, checkpoint=None) -> pb.ReleaseRequest:
    request = pb.ReleaseRequest(namespace=namespace, key=key, lease_token=lease_token)
    checkpoint = _checkpoint_bytes(checkpoint)
    if checkpoint is not None:
        request.checkpoint = checkpoint
    return request


def _item(item: Any, cls: type, index: int):
    if isinstance(item, cls):
        return item
    if isinstance(item, Mapping):
        try:
            return cls(**item)
        except TypeError as error:
            raise TypeError(f"items[{index}]: {error}") from None
    raise TypeError(f"items[{index}]: expected a {cls.__name__} or a mapping, got {type(item).__name__}")


def claim_batch_request(
    items: Iterable[Union[ClaimItem, Mapping[str, Any]]], item_errors: bool = False
) -> pb.ClaimBatchRequest:
    request = pb.ClaimBatchRequest(item_errors=bool(item_errors))
    for index, item in enumerate(items):
        item = _item(item, ClaimItem, index)
        try:
            request.items.append(
                claim_request(
                    item.namespace,
                    item.key,
                    item.fingerprint,
                    item.lease_ttl,
                    item.retention,
                    item.lease_token,
                    late_retry=item.late_retry,
                )
            )
        except TypeError as error:
            raise TypeError(f"items[{index}].{error}") from None
        except ValueError as error:
            raise ValueError(f"items[{index}].{error}") from None
    return request


def complete_batch_request(
    items: Iterable[Union[CompleteItem, Mapping[str, Any]]], item_errors: bool = False
) -> pb.CompleteBatchRequest:
    request = pb.CompleteBatchRequest(item_errors=bool(item_errors))
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
