"""idempotency-service as the persistence layer of Powertools for AWS Lambda's
idempotency utility (`pip install "idempotency-client[powertools]"`).

    from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent
    from idempotency_client.powertools import IdempotencyServicePersistenceLayer

    persistence = IdempotencyServicePersistenceLayer(target="dns:///idempotency.internal:50051",
                                                     namespace="orders")
    config = IdempotencyConfig(event_key_jmespath="body.order_id",
                               payload_validation_jmespath="body.amount")

    @idempotent(persistence_store=persistence, config=config)
    def handler(event, context): ...

How Powertools' calls map onto the service (BasePersistenceLayer of
aws-lambda-powertools 3.x):

  _put_record     Claim: the record's idempotency key in `namespace`, its
                  payload hash (payload_validation_jmespath) as the
                  fingerprint, Powertools' expires_after_seconds as the
                  retention, the invocation's remaining time as the lease.
                  CLAIMED: the lease token is kept (per thread) for the
                  calls below. Another holder: the Claim waits on the server
                  (`wait`), so a duplicate gets the first one's result (or
                  the key, when the first one fails) instead of
                  IdempotencyAlreadyInProgressError. COMPLETED: Powertools
                  replays the stored response. FINGERPRINT_MISMATCH:
                  IdempotencyValidationError.
  _get_record     Get (Powertools calls it only when _put_record gave no
                  record, which this layer always gives).
  _update_record  Complete with the lease token: the response is stored and
                  replayed until the retention ends. A lease that was lost
                  (it ran out and another caller took the key) is refused by
                  the service, and Powertools raises
                  IdempotencyPersistenceLayerError.
  _delete_record  Release with the lease token: the key is claimable again
                  at once (the handler raised).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Dict, Optional

try:
    from aws_lambda_powertools.utilities.idempotency.exceptions import (
        IdempotencyItemAlreadyExistsError,
        IdempotencyItemNotFoundError,
        IdempotencyValidationError,
    )
    from aws_lambda_powertools.utilities.idempotency.persistence.base import BasePersistenceLayer
    from aws_lambda_powertools.utilities.idempotency.persistence.datarecord import (
        STATUS_CONSTANTS,
        DataRecord,
    )
except ImportError as error:  # pragma: no cover - the extra is not installed
    raise ImportError(
        'idempotency_client.powertools needs aws-lambda-powertools: pip install "idempotency-client[powertools]"'
    ) from error

from .client import IdempotencyClient
from .errors import KeyNotFound, LeaseLost, LeaseNotCurrent, ResultExpired
from .types import LateRetryLike, Outcome, State

#: How long a lease lasts when Powertools does not know the invocation's
#: remaining time (no Lambda context registered): Lambda's longest timeout.
DEFAULT_LEASE_TTL = 900.0

#: The service's shortest lease and retention.
MIN_SECONDS = 1.0

#: Time added to a waiting Claim's call deadline beyond its wait.
WAIT_CALL_HEADROOM = 2.0


@dataclass(frozen=True)
class Lease:
    """The lease a thread holds while Powertools runs its function."""

    namespace: str
    key: str
    lease_token: str
    #: Hand it to downstream writes so that they refuse an older holder.
    fencing_token: int
    lease_expires_at: Optional[datetime]


def _millis(moment: Optional[datetime]) -> Optional[int]:
    return None if moment is None else int(moment.timestamp() * 1000)


def _seconds(moment: Optional[datetime]) -> Optional[int]:
    return None if moment is None else int(moment.timestamp())


def _fingerprint(payload_hash: str) -> bytes:
    """Powertools' payload hash (a hexdigest; "" when validation is off) as
    the Claim's fingerprint: its bytes, so Get gives back the same hash."""
    if not payload_hash:
        return b""
    try:
        return bytes.fromhex(payload_hash)
    except ValueError:
        return payload_hash.encode()


def _payload_hash(fingerprint: Optional[bytes]) -> str:
    return fingerprint.hex() if fingerprint else ""


class IdempotencyServicePersistenceLayer(BasePersistenceLayer):
    """Powertools' persistence layer on idempotency-service.

    `client`: an IdempotencyClient (or pass `target` and the client's keyword
    arguments, and this layer makes one). `namespace`: where the keys go;
    Powertools' key is `<function name>#<hash of the event key>`.

    `wait` (seconds): how long a Claim that meets another holder waits on the
    server for its result; never past the invocation's remaining time less
    `wait_reserve` (the time kept to run the function should the key come
    free). 0: no waiting, Powertools' own behaviour
    (IdempotencyAlreadyInProgressError at once). The server shortens a wait
    to its maximum (IDEMPOTENCY_MAX_WAIT, 30 s unless configured).

    `lease_ttl` (seconds): the lease when Powertools does not know the
    invocation's remaining time (register_lambda_context not called); with a
    Lambda context the lease ends when the invocation does, as Powertools'
    in-progress expiry.

    `late_retry`: what a Claim of a key whose result expired but which the
    service still remembers does. "reexecute" (the default) runs the
    function again, as Powertools does once expires_after_seconds is over;
    "refuse" raises ResultExpired (wrapped by Powertools in
    IdempotencyPersistenceLayerError); None: the namespace's policy.
    """

    def __init__(
        self,
        client: Optional[IdempotencyClient] = None,
        *,
        target: Any = None,
        namespace: str = "powertools",
        wait: float = 10.0,
        wait_reserve: float = 1.0,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        late_retry: LateRetryLike = "reexecute",
        **client_options: Any,
    ):
        super().__init__()
        if client is None:
            if target is None:
                raise TypeError("IdempotencyServicePersistenceLayer needs a client or a target")
            client = IdempotencyClient(target, **client_options)
        elif target is not None or client_options:
            raise TypeError("pass either a client or a target with its options, not both")
        self.client = client
        self.namespace = namespace
        self.wait = float(wait)
        self.wait_reserve = float(wait_reserve)
        self.lease_ttl = float(lease_ttl)
        self.late_retry = late_retry
        # The leases of the invocations running on each thread, by key: one
        # layer serves every invocation of a process, and Powertools calls
        # _put_record and then _update_record or _delete_record on one thread.
        self._local = threading.local()

    # -- the lease carried across one invocation's calls ---------------------

    def _leases(self) -> Dict[str, Lease]:
        leases = getattr(self._local, "leases", None)
        if leases is None:
            leases = self._local.leases = {}
        return leases

    def held_lease(self) -> Optional[Lease]:
        """The lease of the innermost idempotent function running on this
        thread (None outside one): its `fencing_token` guards the function's
        writes against a holder whose lease ran out."""
        leases = self._leases()
        return next(reversed(leases.values())) if leases else None

    # -- Powertools' four operations ---------------------------------------

    def _put_record(self, data_record: DataRecord) -> None:
        now = time.time()
        remaining = None
        if data_record.in_progress_expiry_timestamp is not None:
            remaining = data_record.in_progress_expiry_timestamp / 1000.0 - now
        lease_ttl = self.lease_ttl if remaining is None else remaining
        wait = self.wait if remaining is None else min(self.wait, remaining - self.wait_reserve)
        wait = max(wait, 0.0)
        claim = self.client.claim(
            self.namespace,
            data_record.idempotency_key,
            fingerprint=_fingerprint(data_record.payload_hash),
            lease_ttl=max(lease_ttl, MIN_SECONDS),
            retention=max(self.expires_after_seconds, MIN_SECONDS),
            wait=wait or None,
            late_retry=self.late_retry,
            timeout=(wait + WAIT_CALL_HEADROOM + (self.client.timeout or 0)) if wait else None,
        )
        if claim.outcome is Outcome.CLAIMED:
            self._leases()[data_record.idempotency_key] = Lease(
                self.namespace,
                data_record.idempotency_key,
                claim.lease_token,
                claim.fencing_token,
                claim.lease_expires_at,
            )
            return
        if claim.outcome is Outcome.COMPLETED:
            old = DataRecord(
                idempotency_key=data_record.idempotency_key,
                status=STATUS_CONSTANTS["COMPLETED"],
                expiry_timestamp=_seconds(claim.expires_at),
                response_data=claim.response.decode("utf-8"),
                # The service compared the fingerprints: the same payload.
                payload_hash=data_record.payload_hash,
            )
            self._save_to_cache(data_record=old)
            raise IdempotencyItemAlreadyExistsError(old_data_record=old)
        if claim.outcome is Outcome.IN_PROGRESS:
            old = DataRecord(
                idempotency_key=data_record.idempotency_key,
                status=STATUS_CONSTANTS["INPROGRESS"],
                expiry_timestamp=_seconds(claim.expires_at),
                in_progress_expiry_timestamp=_millis(claim.lease_expires_at),
                payload_hash=data_record.payload_hash,
            )
            raise IdempotencyItemAlreadyExistsError(old_data_record=old)
        if claim.outcome is Outcome.FINGERPRINT_MISMATCH:
            raise IdempotencyValidationError("Payload does not match stored record for this event key")
        if claim.outcome is Outcome.EXPIRED:
            raise ResultExpired(
                f"{self.namespace}/{data_record.idempotency_key} completed at {claim.completed_at}; "
                "its result expired and late retries are refused",
                completed_at=claim.completed_at,
                fencing_token=claim.fencing_token,
            )
        raise RuntimeError(f"unexpected Claim outcome {claim.outcome!r}")

    def _get_record(self, idempotency_key) -> DataRecord:
        record = self.client.get(self.namespace, idempotency_key)
        if record.state is State.COMPLETED:
            return DataRecord(
                idempotency_key=idempotency_key,
                status=STATUS_CONSTANTS["COMPLETED"],
                expiry_timestamp=_seconds(record.expires_at),
                response_data=(record.response or b"").decode("utf-8"),
                payload_hash=_payload_hash(record.fingerprint),
            )
        if record.state is State.IN_PROGRESS:
            return DataRecord(
                idempotency_key=idempotency_key,
                status=STATUS_CONSTANTS["INPROGRESS"],
                expiry_timestamp=_seconds(record.expires_at),
                in_progress_expiry_timestamp=_millis(record.lease_expires_at),
                payload_hash=_payload_hash(record.fingerprint),
            )
        # ABSENT (remembered or not) and RELEASED: nothing to replay or wait for.
        raise IdempotencyItemNotFoundError

    def _take_lease(self, idempotency_key: str) -> Optional[Lease]:
        return self._leases().pop(idempotency_key, None)

    def _update_record(self, data_record: DataRecord) -> None:
        lease = self._take_lease(data_record.idempotency_key)
        if lease is None:
            raise LeaseLost(
                f"{self.namespace}/{data_record.idempotency_key}: this thread holds no lease on the key, "
                "so the result was not stored"
            )
        self.client.complete(
            lease.namespace,
            lease.key,
            lease.lease_token,
            data_record.response_data.encode("utf-8"),
            retention=max(self.expires_after_seconds, MIN_SECONDS),
        )

    def _delete_record(self, data_record: DataRecord) -> None:
        lease = self._take_lease(data_record.idempotency_key)
        if lease is None:
            return  # nothing held, nothing to give back
        try:
            self.client.release(lease.namespace, lease.key, lease.lease_token)
        except (KeyNotFound, LeaseNotCurrent):
            # The lease ran out and the key expired or went to another
            # caller: it is not this invocation's to give back. Powertools
            # then raises the function's own exception, as it should.
            pass


__all__ = ["DEFAULT_LEASE_TTL", "IdempotencyServicePersistenceLayer", "Lease"]
