"""The asyncio variant: AsyncIdempotencyClient over grpc.aio, and its once().

Same results, errors and lifecycle as the synchronous client (see once.py);
the work may be a coroutine function or a plain function, and the heartbeat is
an asyncio task.

    async with AsyncIdempotencyClient("127.0.0.1:50051") as client:
        async with client.once("payments", key) as run:
            receipt = await run(charge, order)

Where the code is: _async/client.py and _async/once.py, the source from which
the synchronous client (_sync/) is generated; AsyncRun is in _run.py.
"""

from ._async.client import AsyncIdempotencyClient
from ._async.once import AsyncOnce
from ._run import AsyncRun

__all__ = ["AsyncIdempotencyClient", "AsyncOnce", "AsyncRun"]
