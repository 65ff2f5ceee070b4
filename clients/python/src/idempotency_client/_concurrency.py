"""Where the asyncio client and the synchronous one really differ, written
once for each: how a call pauses, and how once()'s heartbeat runs beside the
work (an asyncio task; a daemon thread).

_async/ names the asyncio side; gen_sync.py turns each name into its
synchronous twin in _sync/: async_sleep into sleep, AsyncHeartbeat into
Heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Awaitable, Callable


async def async_sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


def sleep(seconds: float) -> None:
    time.sleep(seconds)


class AsyncHeartbeat:
    """Awaits `beat()` every `interval` seconds in an asyncio task, until
    stopped or until a beat returns False (the lease is gone)."""

    def __init__(self, beat: Callable[[], Awaitable[bool]], interval: float):
        self._task = asyncio.ensure_future(self._run(beat, interval))

    @staticmethod
    async def _run(beat: Callable[[], Awaitable[bool]], interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            if not await beat():
                return

    async def stop(self) -> None:
        """Cancel the task, a beat in flight included, and wait for it to end."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class Heartbeat:
    """Calls `beat()` every `interval` seconds on a daemon thread, until
    stopped or until a beat returns False (the lease is gone)."""

    def __init__(self, beat: Callable[[], bool], interval: float):
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(beat, interval), name="idempotency-heartbeat", daemon=True
        )
        self._thread.start()

    def _run(self, beat: Callable[[], bool], interval: float) -> None:
        while not self._stopped.wait(interval):
            if not beat():
                return

    def stop(self) -> None:
        """Let a beat in flight finish (its ExtendLease is bounded by
        heartbeat_timeout()), then end the thread."""
        self._stopped.set()
        self._thread.join()
