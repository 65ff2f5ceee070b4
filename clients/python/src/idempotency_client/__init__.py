"""Python client of idempotency-service.

Modules users import from:
  client       IdempotencyClient: Claim, Complete, Release, ExtendLease, Get, Purge,
               ClaimBatch, CompleteBatch, and once()
  aio          AsyncIdempotencyClient: the same over grpc.aio
  once         the run-once lifecycle (Claim, work, Complete or Release, replay,
               heartbeat, checkpoints for resumable work): Once and Run
  retry        RetryPolicy: what is retried, the backoff, the overall deadline
  channels     several addresses or a dns:/// name, round-robin, retries on the next one
  keys         derive_key() and fingerprint(): canonical forms in clients/KEYS.md
  types        Outcome, State and the typed results of the RPCs
  errors       one exception class per status a caller can act on, with the
               status's google.rpc details (reason, retry_delay, field)
  serializers  how once() stores results (JSON by default)
  testing      start a real server for tests
  powertools   a persistence layer for Powertools for AWS Lambda's idempotency
               utility (the `powertools` extra; not imported here)

Where client, aio and once keep their code:
  _async/      the asyncio client and once() helper: the source
  _sync/       the synchronous ones, generated from _async/ by gen_sync.py (unasync)
  _requests    the request builders, credentials and metadata both clients use
  _lifecycle   the rules of once() both helpers follow (settings, errors, pacing)
  _run         Run and AsyncRun, what the work of once() holds
  _concurrency where asyncio and threads differ: a pause, the heartbeat
  _proto       stubs generated from proto/ by gen_proto.py (not committed)
"""

from .aio import AsyncIdempotencyClient, AsyncOnce, AsyncRun
from .client import IdempotencyClient, new_lease_token
from .errors import (
    ErrorDetails,
    FingerprintMismatch,
    IdempotencyError,
    InProgress,
    InvalidArgument,
    KeyExpired,
    KeyNotFound,
    LeaseLost,
    LeaseNotCurrent,
    PermissionDenied,
    ResourceExhausted,
    ResultExpired,
    Unauthenticated,
    Unavailable,
)
from .keys import canonical_json, derive_key, fingerprint, key_encoding
from .once import Once, Run
from .retry import DEFAULT_RETRY, RETRYABLE_CODES, RetryPolicy
from .serializers import BYTES, JSON, BytesSerializer, JsonSerializer, Serializer
from .types import (
    ClaimItem,
    ClaimResult,
    CompleteItem,
    CompleteItemResult,
    CompleteResult,
    ExtendLeaseResult,
    LateRetry,
    Outcome,
    PurgeResult,
    Record,
    State,
)

__all__ = [
    "AsyncIdempotencyClient",
    "AsyncOnce",
    "AsyncRun",
    "BYTES",
    "DEFAULT_RETRY",
    "BytesSerializer",
    "ClaimItem",
    "ClaimResult",
    "CompleteItem",
    "CompleteItemResult",
    "CompleteResult",
    "ErrorDetails",
    "ExtendLeaseResult",
    "FingerprintMismatch",
    "IdempotencyClient",
    "IdempotencyError",
    "InProgress",
    "InvalidArgument",
    "JSON",
    "JsonSerializer",
    "KeyExpired",
    "KeyNotFound",
    "LateRetry",
    "LeaseLost",
    "LeaseNotCurrent",
    "Once",
    "Outcome",
    "PermissionDenied",
    "PurgeResult",
    "RETRYABLE_CODES",
    "Record",
    "ResourceExhausted",
    "ResultExpired",
    "RetryPolicy",
    "Run",
    "Serializer",
    "State",
    "Unauthenticated",
    "Unavailable",
    "canonical_json",
    "derive_key",
    "fingerprint",
    "key_encoding",
    "new_lease_token",
]
