"""Run a piece of work once per key: the lifecycle every caller would otherwise rewrite.

    with client.once("payments", key, fingerprint=fingerprint(body)) as run:
        receipt = run(charge, body)      # runs charge() only if this Claim won

Claim, then by outcome:
  CLAIMED              run the work while a heartbeat extends the lease; on
                       success Complete with the serialised result, on an
                       exception Release (so the next delivery retries) and
                       re-raise; if the lease was lost meanwhile, never
                       Complete and raise LeaseLost.
  COMPLETED            replay: the stored result, deserialised; the work does not run.
  FINGERPRINT_MISMATCH raise FingerprintMismatch.
  IN_PROGRESS          on_in_progress="wait": Claim again with backoff until
                       wait_timeout (then raise InProgress); "raise": raise InProgress.

Resumable work: when an earlier holder of the key died or failed after saving
a checkpoint, the Claim that takes the key over receives it. `run.checkpoint`
is that checkpoint (bytes, or None), `run.checkpoint_fencing_token` the
fencing token it was saved under, and `run.save_checkpoint(data)` saves a new
one under the lease (ExtendLease, which also extends the lease). A work
function called through run(fn, ...), Once.run() or the decorator receives
the Run when it declares a keyword-only parameter named `run`:

    def job(order, *, run):
        done = json.loads(run.checkpoint) if run.checkpoint is not None else []
        if "charge" not in done:
            charge(order); done.append("charge")
            run.save_checkpoint(json.dumps(done).encode())
        ...

A Release after a failure carries the last checkpoint the work asked to
save, so progress whose save failed is not lost with the lease.

This module holds the synchronous helper and the rules both variants share;
aio.py has the asyncio one.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from .errors import (
    FingerprintMismatch,
    IdempotencyError,
    InProgress,
    KeyNotFound,
    LeaseLost,
    LeaseNotCurrent,
)
from .serializers import JSON, Serializer
from .types import ClaimResult, DurationLike, Outcome, seconds_of

if TYPE_CHECKING:
    from .client import IdempotencyClient

log = logging.getLogger("idempotency_client")

#: Errors from ExtendLease or Complete meaning "this lease is no longer ours".
LEASE_GONE = (LeaseNotCurrent, KeyNotFound)

#: The server's default lease when the caller sets none; only used to pace the heartbeat.
SERVER_DEFAULT_LEASE_SECONDS = 30.0

#: First pause while waiting on another claimant; doubles on each attempt.
FIRST_WAIT_SECONDS = 0.1

KeyLike = Union[str, Callable[..., str]]
FingerprintLike = Union[bytes, Callable[..., bytes]]


@dataclass(frozen=True)
class Settings:
    """Everything once() was asked, shared by the sync and async helpers."""

    namespace: str
    key: KeyLike
    fingerprint: FingerprintLike = b""
    lease_ttl: Optional[DurationLike] = None
    retention: Optional[DurationLike] = None
    on_in_progress: str = "wait"
    wait_timeout: DurationLike = 30.0
    serializer: Serializer = JSON
    #: False disables it; None paces it at a third of the lease.
    heartbeat: bool = True
    heartbeat_interval: Optional[DurationLike] = None

    def __post_init__(self):
        if self.on_in_progress not in ("wait", "raise"):
            raise ValueError('on_in_progress must be "wait" or "raise"')

    def bound(self, args: tuple, kwargs: dict) -> "Settings":
        """The settings for one call of a decorated function: key and fingerprint
        may be functions of its arguments."""
        key = self.key(*args, **kwargs) if callable(self.key) else self.key
        fp = self.fingerprint(*args, **kwargs) if callable(self.fingerprint) else self.fingerprint
        return dataclasses.replace(self, key=key, fingerprint=fp)

    def fixed_key(self) -> str:
        if callable(self.key) or callable(self.fingerprint):
            raise TypeError(
                "once(): a key or fingerprint computed from arguments needs the decorator form"
            )
        return self.key

    def heartbeat_seconds(self) -> Optional[float]:
        if not self.heartbeat:
            return None
        if self.heartbeat_interval is not None:
            return seconds_of(self.heartbeat_interval)
        lease = seconds_of(self.lease_ttl) or SERVER_DEFAULT_LEASE_SECONDS
        return lease / 3


def in_progress_error(claim: ClaimResult, settings: Settings, waited: bool) -> InProgress:
    how = f"still in progress after waiting {seconds_of(settings.wait_timeout)} s" if waited else "in progress"
    return InProgress(
        f"{settings.namespace}/{settings.key}: {how} (another claimant holds the lease;"
        f" retry after {claim.retry_after})",
        retry_after=claim.retry_after,
        lease_expires_at=claim.lease_expires_at,
    )


def fingerprint_error(settings: Settings) -> FingerprintMismatch:
    return FingerprintMismatch(
        f"{settings.namespace}/{settings.key}: the key was seen with another payload fingerprint"
    )


def unexpected_outcome(claim: ClaimResult) -> IdempotencyError:
    return IdempotencyError(f"Claim: unexpected outcome {claim.outcome!r}")


def next_pause(attempt: int, claim: ClaimResult, remaining: float) -> float:
    """How long to wait before claiming again: exponential from 100 ms, so an
    early Complete is seen soon, but never past the other lease's expiry
    (retry_after, when it can be taken) nor past the caller's wait_timeout."""
    pause = FIRST_WAIT_SECONDS * (2**attempt)
    if claim.retry_after is not None:
        pause = min(pause, max(claim.retry_after.total_seconds(), 0.01))
    return max(0.0, min(pause, remaining))


def add_note(error: BaseException, note: str) -> None:
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(note)


def wants_run(fn: Callable[..., Any]) -> bool:
    """True when fn declares a keyword-only parameter named `run`: it is
    handed the Run (for run.checkpoint and run.save_checkpoint())."""
    try:
        parameter = inspect.signature(fn).parameters.get("run")
    except (TypeError, ValueError):  # builtins and other callables without one
        return False
    return parameter is not None and parameter.kind is inspect.Parameter.KEYWORD_ONLY


def with_run(run: "Run", fn: Callable[..., Any], kwargs: dict) -> dict:
    if "run" not in kwargs and wants_run(fn):
        return {**kwargs, "run": run}
    return kwargs


def checkpoint_bytes(data: Any) -> bytes:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"save_checkpoint(): the checkpoint must be bytes, got {type(data).__name__}")


def heartbeat_timeout(interval: float, client_timeout: Optional[float]) -> float:
    """A heartbeat's ExtendLease (retries included) ends before the next beat
    is due, so stopping the heartbeat never waits long."""
    bound = max(interval, 1.0)
    return bound if client_timeout is None else min(bound, client_timeout)


class Run:
    """What the body of `with client.once(...) as run:` works with.

    `run(fn, *args)` calls fn only when this attempt holds the lease and returns
    its result, or returns the replayed result without calling fn. Work that
    is not one call can check `run.replayed` and use `run.set_result(value)`.
    """

    def __init__(self, claim: ClaimResult, replayed: bool, result: Any = None):
        #: The Claim that won the lease, or the one that found the stored result.
        self.claim = claim
        #: True when the work was done before: `result` is the stored result.
        self.replayed = replayed
        self.result = result
        self._has_result = replayed
        self._lost: Optional[BaseException] = None
        self._checkpoint = claim.checkpoint
        self._checkpoint_fencing_token = claim.checkpoint_fencing_token
        #: The last checkpoint the work asked to save (sent again with a Release).
        self._last_saved: Optional[bytes] = None
        #: How a checkpoint is saved under this lease (set by Once).
        self._save: Optional[Callable[[bytes], Any]] = None

    @property
    def fencing_token(self) -> Optional[int]:
        return self.claim.fencing_token

    @property
    def checkpoint(self) -> Optional[bytes]:
        """The last checkpoint: the one an earlier holder of the key saved
        (received with the Claim), or the last this run saved; None when
        there is none (start from the beginning)."""
        return self._checkpoint

    @property
    def checkpoint_fencing_token(self) -> Optional[int]:
        """The fencing token of the lease `checkpoint` was saved under (lower
        than fencing_token when an earlier holder saved it); None with it."""
        return self._checkpoint_fencing_token

    def _before_save(self, data: Any) -> bytes:
        if self.replayed:
            raise RuntimeError("once(): this key was replayed; there is no lease to save a checkpoint under")
        if self._lost is not None:
            raise LeaseLost("the lease was lost while the work ran; the checkpoint was not saved") from self._lost
        data = checkpoint_bytes(data)
        self._last_saved = data
        return data

    def _saved(self, data: bytes) -> None:
        self._checkpoint = data
        self._checkpoint_fencing_token = self.fencing_token

    def _save_failed(self, error: BaseException) -> LeaseLost:
        self._lost = error
        return LeaseLost("the lease was lost while the work ran; the checkpoint was not saved")

    def save_checkpoint(self, data: bytes) -> None:
        """Save how far the work got (bytes, at most the server's limit: 64
        KiB unless configured) under the lease, replacing the last one, and
        extend the lease. If this worker dies, whoever claims the key next
        receives it as run.checkpoint. Raises LeaseLost when the lease is no
        longer ours (stop: someone else may be doing the work)."""
        data = self._before_save(data)
        try:
            self._save(data)
        except LEASE_GONE as error:
            raise self._save_failed(error) from error
        self._saved(data)

    @property
    def lease_lost(self) -> bool:
        """True once the heartbeat found the lease gone: stop the work early."""
        return self._lost is not None

    def check_lease(self) -> None:
        """Raise LeaseLost if the heartbeat found the lease gone (for long work
        to call between steps)."""
        if self._lost is not None:
            raise LeaseLost("the lease was lost while the work ran") from self._lost

    def set_result(self, value: Any) -> None:
        """The result to Complete with (serialised by the once()'s serializer)."""
        if self.replayed:
            raise RuntimeError("once(): this key was replayed; there is nothing to complete")
        self.result = value
        self._has_result = True

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs), plus run=self when fn declares a keyword-only
        `run`; or the replayed result without calling fn."""
        if self.replayed:
            return self.result
        if self._has_result:
            raise RuntimeError("once(): this run already has a result")
        self.set_result(fn(*args, **with_run(self, fn, kwargs)))
        return self.result


class _Heartbeat:
    """Extends the lease every `interval` seconds on a daemon thread until
    stopped, or until the server says the lease is gone."""

    def __init__(self, extend: Callable[[], Any], interval: float, on_lost: Callable[[BaseException], None]):
        self._extend = extend
        self._interval = interval
        self._on_lost = on_lost
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="idempotency-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                self._extend()
            except LEASE_GONE as error:
                self._on_lost(error)
                return
            except IdempotencyError as error:
                # A transient failure: the lease may well still be ours, and the
                # final Complete tells for sure.
                log.warning("idempotency heartbeat: ExtendLease failed: %s", error)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


class Once:
    """The synchronous run-once helper; see the module doc. Made by IdempotencyClient.once()."""

    def __init__(self, client: "IdempotencyClient", settings: Settings):
        self._client = client
        self._settings = settings
        self._run: Optional[Run] = None
        self._heartbeat: Optional[_Heartbeat] = None
        self._key: Optional[str] = None

    # -- decorator -------------------------------------------------------
    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def once_per_key(*args: Any, **kwargs: Any) -> Any:
            settings = self._settings.bound(args, kwargs)
            return Once(self._client, settings).run(fn, *args, **kwargs)

        return once_per_key

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) once per key: its result, or the replayed one."""
        with self as run:
            return run(fn, *args, **kwargs)

    # -- context manager -------------------------------------------------
    def __enter__(self) -> Run:
        if self._run is not None:
            raise RuntimeError("once(): a Once is entered once; call client.once() again")
        settings = self._settings
        self._key = key = settings.fixed_key()
        deadline = time.monotonic() + (seconds_of(settings.wait_timeout) or 0.0)
        attempt = 0
        while True:
            claim = self._client.claim(
                settings.namespace,
                key,
                fingerprint=settings.fingerprint,
                lease_ttl=settings.lease_ttl,
                retention=settings.retention,
            )
            if claim.outcome is Outcome.CLAIMED:
                self._run = run = Run(claim, replayed=False)
                run._save = functools.partial(self._save_checkpoint, claim.lease_token)
                self._start_heartbeat(claim)
                return run
            if claim.outcome is Outcome.COMPLETED:
                self._run = Run(claim, True, settings.serializer.loads(claim.response))
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
            time.sleep(next_pause(attempt, claim, remaining))
            attempt += 1

    def _start_heartbeat(self, claim: ClaimResult) -> None:
        interval = self._settings.heartbeat_seconds()
        if interval is None:
            return
        run = self._run
        settings = self._settings

        timeout = heartbeat_timeout(interval, self._client.timeout)

        def extend() -> None:
            self._client.extend_lease(
                settings.namespace, self._key, claim.lease_token, lease_ttl=settings.lease_ttl, timeout=timeout
            )

        def on_lost(error: BaseException) -> None:
            run._lost = error

        self._heartbeat = _Heartbeat(extend, interval, on_lost)

    def _save_checkpoint(self, token: str, data: bytes) -> None:
        settings = self._settings
        self._client.extend_lease(
            settings.namespace, self._key, token, lease_ttl=settings.lease_ttl, checkpoint=data
        )

    def __exit__(self, exc_type, exc, tb) -> bool:
        run = self._run
        if run is None or run.replayed:
            return False
        if self._heartbeat is not None:
            self._heartbeat.stop()
        settings = self._settings
        token = run.claim.lease_token
        if exc is not None:
            self._release_after_failure(token, exc)
            return False
        if run._lost is not None:
            raise LeaseLost(
                f"{settings.namespace}/{self._key}: the lease was lost while the work ran;"
                " the result was not stored"
            ) from run._lost
        try:
            response = settings.serializer.dumps(run.result)
        except Exception as error:
            self._release_after_failure(token, error)
            raise
        try:
            self._client.complete(
                settings.namespace, self._key, token, response, retention=settings.retention
            )
        except LEASE_GONE as error:
            raise LeaseLost(
                f"{settings.namespace}/{self._key}: the lease was lost before Complete;"
                " the result was not stored"
            ) from error
        return False

    def _release_after_failure(self, token: str, failure: BaseException) -> None:
        """Give the key back so the next delivery retries; never hide the failure."""
        if self._run._lost is not None:
            return  # not ours any more: nothing to release
        try:
            self._client.release(
                self._settings.namespace, self._key, token, checkpoint=self._run._last_saved
            )
        except IdempotencyError as error:
            log.warning("idempotency once(): Release after a failed attempt failed: %s", error)
            add_note(failure, f"idempotency: Release after this failure also failed: {error}")
