"""IdempotencyClient: the RPCs over a synchronous gRPC channel, with typed
results and typed errors, and once() built on them.

Where the code is: _sync/client.py, generated from the asyncio client in
_async/client.py (see clients/python/gen_sync.py); the request builders both
use are in _requests.py. This module keeps the names importable from where
they always were.
"""

from ._requests import (
    call_metadata,
    channel_credentials,
    claim_batch_request,
    claim_request,
    complete_batch_request,
    complete_request,
    extend_lease_request,
    new_lease_token,
    purge_request,
    release_request,
)
from ._sync.client import DEFAULT_TIMEOUT, IdempotencyClient

__all__ = [
    "DEFAULT_TIMEOUT",
    "IdempotencyClient",
    "call_metadata",
    "channel_credentials",
    "claim_batch_request",
    "claim_request",
    "complete_batch_request",
    "complete_request",
    "extend_lease_request",
    "new_lease_token",
    "purge_request",
    "release_request",
]
