"""What the work of once() holds: Run, and AsyncRun for the asyncio client.

`with client.once(...) as run:` (or `async with`) gives a Run: the Claim
behind it, the replayed result or the one to Complete with, the checkpoint
to resume from and save_checkpoint() to save a new one. AsyncRun is a Run
whose save_checkpoint() and __call__() are awaited, and whose work may be a
coroutine function. Both live here, written by hand, because they differ in
those two methods only; _async/once.py names AsyncRun and its generated twin
_sync/once.py names Run.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

from ._lifecycle import LEASE_GONE
from .errors import LeaseLost
from .types import ClaimResult


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
    def completed_before(self):
        """A late retry that runs the work again (the key completed before,
        its result expired, the server remembered it and re-executes): when
        it completed (a datetime). None otherwise, and for a replay."""
        return self.claim.completed_at if self.claim.reexecuted else None

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
