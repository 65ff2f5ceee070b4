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
  EXPIRED              (only with late_retry="refuse", the once()'s or the
                       namespace's) the key completed before and its result
                       expired: raise ResultExpired (completed_at,
                       fencing_token); the work does not run. With
                       "reexecute" (the server's default) such a late retry
                       is CLAIMED instead, and run.completed_before says
                       when the key completed before.
  IN_PROGRESS          another holder has the key. on_in_progress="wait"
                       (the default): the Claim itself waits on the server
                       (ClaimRequest.wait, up to wait_timeout, within each
                       call's timeout) and comes back with the holder's
                       stored result (the replay) or the lease (the holder
                       released, or its lease ran out: run the work); when
                       wait_timeout runs out, raise InProgress. Against a
                       server that predates waiting (ClaimResponse.waited
                       unset) it polls instead, and the client remembers
                       that. "poll": Claim again with backoff (100 ms
                       doubling, never past retry_after nor wait_timeout).
                       "raise": raise InProgress at once.

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

Where the code is: the helper is _sync/once.py (Once), generated from the
asyncio one in _async/once.py (AsyncOnce, exported by aio.py); the rules both
follow are in _lifecycle.py, and Run in _run.py. This module keeps the names
importable from where they always were.
"""

from ._lifecycle import (
    FIRST_WAIT_SECONDS,
    LEASE_GONE,
    MIN_WAIT_SECONDS,
    ON_IN_PROGRESS,
    SERVER_DEFAULT_LEASE_SECONDS,
    WAIT_HEADROOM_SECONDS,
    WAIT_RECHECK_SECONDS,
    FingerprintLike,
    KeyLike,
    ServerWaits,
    Settings,
    add_note,
    fingerprint_error,
    heartbeat_timeout,
    in_progress_error,
    log,
    next_pause,
    server_waited,
    unexpected_outcome,
    wait_within,
)
from ._run import Run, checkpoint_bytes, wants_run, with_run
from ._sync.once import Once

__all__ = [
    "FIRST_WAIT_SECONDS",
    "LEASE_GONE",
    "MIN_WAIT_SECONDS",
    "ON_IN_PROGRESS",
    "SERVER_DEFAULT_LEASE_SECONDS",
    "WAIT_HEADROOM_SECONDS",
    "WAIT_RECHECK_SECONDS",
    "FingerprintLike",
    "KeyLike",
    "Once",
    "Run",
    "ServerWaits",
    "Settings",
    "add_note",
    "checkpoint_bytes",
    "fingerprint_error",
    "heartbeat_timeout",
    "in_progress_error",
    "log",
    "next_pause",
    "server_waited",
    "unexpected_outcome",
    "wait_within",
    "wants_run",
    "with_run",
]
