"""Checkpoints: progress saved under a lease, handed to whoever takes the key
over, shown by Get, discarded by Complete; and once() resuming from them, in
every form, sync and asyncio, including a worker process killed between two
steps and resumed by another.

Needs a server with checkpoints (ExtendLeaseRequest.checkpoint)."""

import json
import pathlib
import subprocess
import sys
import time

import grpc
import pytest

from idempotency_client import (
    AsyncIdempotencyClient,
    IdempotencyClient,
    InvalidArgument,
    LeaseLost,
    Outcome,
    RetryPolicy,
    State,
    Unavailable,
)
from interceptors import FailCalls
from poll import until

JOB = pathlib.Path(__file__).resolve().parent / "resumable_job.py"


# --- the RPCs ---------------------------------------------------------------------


@pytest.mark.postgres
def test_a_checkpoint_saved_with_extend_lease_goes_to_the_next_holder_after_a_release(client, namespace):
    first = client.claim(namespace, "k")
    assert first.checkpoint is None and first.checkpoint_fencing_token is None and not first.retried
    client.extend_lease(namespace, "k", first.lease_token, checkpoint=b"step 1")
    record = client.get(namespace, "k")
    assert (record.state, record.checkpoint, record.checkpoint_fencing_token) == (State.IN_PROGRESS, b"step 1", 1)
    client.extend_lease(namespace, "k", first.lease_token)  # unset keeps it
    assert client.get(namespace, "k").checkpoint == b"step 1"
    client.release(namespace, "k", first.lease_token, checkpoint=b"step 2")
    record = client.get(namespace, "k")
    assert (record.state, record.checkpoint, record.checkpoint_fencing_token) == (State.RELEASED, b"step 2", 1)

    second = client.claim(namespace, "k")
    assert (second.fencing_token, second.checkpoint, second.checkpoint_fencing_token) == (2, b"step 2", 1)
    client.complete(namespace, "k", second.lease_token, b"done")
    record = client.get(namespace, "k")
    assert record.state is State.COMPLETED
    assert record.checkpoint is None and record.checkpoint_fencing_token is None


@pytest.mark.postgres
def test_a_lease_that_runs_out_hands_its_checkpoint_to_the_next_claim(client, namespace):
    first = client.claim(namespace, "k", lease_ttl=1)
    client.extend_lease(namespace, "k", first.lease_token, lease_ttl=1, checkpoint=b"")  # an empty one
    taken = until(
        lambda: (claim := client.claim(namespace, "k")).claimed and claim,
        timeout=5,
        what="the lease to run out",
    )
    assert (taken.fencing_token, taken.checkpoint, taken.checkpoint_fencing_token) == (2, b"", 1)


def test_a_checkpoint_over_the_limit_is_refused_and_a_non_bytes_one_is_a_type_error(client, namespace):
    claim = client.claim(namespace, "k")
    with pytest.raises(InvalidArgument, match="checkpoint"):
        client.extend_lease(namespace, "k", claim.lease_token, checkpoint=b"x" * (64 * 1024 + 1))
    with pytest.raises(TypeError, match="checkpoint"):
        client.release(namespace, "k", claim.lease_token, checkpoint="text")
    client.extend_lease(namespace, "k", claim.lease_token, checkpoint=b"x" * (64 * 1024))


# --- once() -------------------------------------------------------------------------


class Job:
    """Three steps, a checkpoint after each; fails after `fail_after` once."""

    def __init__(self, fail_after=None):
        self.log = []
        self.fail_after = fail_after
        self.seen = []

    def __call__(self, order, *, run):
        self.seen.append((run.checkpoint, run.checkpoint_fencing_token))
        done = json.loads(run.checkpoint) if run.checkpoint is not None else []
        for step in ("reserve", "charge", "email"):
            if step in done:
                continue
            self.log.append(step)
            done.append(step)
            run.save_checkpoint(json.dumps(done).encode())
            assert json.loads(run.checkpoint) == done and run.checkpoint_fencing_token == run.fencing_token
            if step == self.fail_after:
                self.fail_after = None
                raise RuntimeError(f"{order}: failed after {step}")
        return done


@pytest.mark.postgres
def test_once_resumes_a_failed_attempt_from_its_checkpoint(client, namespace):
    job = Job(fail_after="charge")
    with pytest.raises(RuntimeError, match="failed after charge"):
        client.once(namespace, "order-1").run(job, "order-1")
    record = client.get(namespace, "order-1")
    assert record.state is State.RELEASED and json.loads(record.checkpoint) == ["reserve", "charge"]

    assert client.once(namespace, "order-1").run(job, "order-1") == ["reserve", "charge", "email"]
    assert job.log == ["reserve", "charge", "email"]
    assert job.seen == [(None, None), (b'["reserve", "charge"]', 1)]
    assert client.get(namespace, "order-1").checkpoint is None  # Complete discards it


def test_the_context_manager_the_decorator_and_run_all_hand_over_the_checkpoint(client, namespace):
    # Context manager: run.checkpoint and run.save_checkpoint() on the run itself.
    with pytest.raises(RuntimeError):
        with client.once(namespace, "cm") as run:
            assert run.checkpoint is None
            run.save_checkpoint(b"half")
            raise RuntimeError("crash")
    with client.once(namespace, "cm") as run:
        assert (run.checkpoint, run.checkpoint_fencing_token, run.fencing_token) == (b"half", 1, 2)
        run.set_result("whole")

    # Decorator: the wrapped function asks for `run` (keyword-only); the
    # caller does not pass it, and the key function never sees it.
    job = Job(fail_after="reserve")

    @client.once(namespace, key=lambda order: f"dec-{order}")
    def process(order, *, run):
        return job(order, run=run)

    with pytest.raises(RuntimeError):
        process("o1")
    assert process("o1") == ["reserve", "charge", "email"]
    assert job.log == ["reserve", "charge", "email"]

    # run(fn) in the context manager, and Once.run().
    seen = []

    def work(*, run):
        seen.append(run.checkpoint)
        return "ok"

    with client.once(namespace, "cm2") as run:
        run.save_checkpoint(b"mine")
        assert run(work) == "ok"
    assert seen == [b"mine"]
    assert client.once(namespace, "plain").run(work) == "ok"


def test_work_that_does_not_ask_for_run_is_called_as_before(client, namespace):
    def positional(run=None, *args):
        return run

    def keyword(a, run="given"):
        return run

    assert client.once(namespace, "a").run(positional) is None
    assert client.once(namespace, "b").run(keyword, 1) == "given"
    assert client.once(namespace, "c").run(keyword, 1, run="mine") == "mine"


def test_a_release_after_a_failure_carries_the_checkpoint_whose_save_failed(server, namespace):
    failing = FailCalls("ExtendLease")
    policy = RetryPolicy(max_attempts=2, initial_backoff=0.01)
    with IdempotencyClient(server.target, interceptors=[failing], retry=policy) as client:
        with pytest.raises(Unavailable):
            with client.once(namespace, "k", heartbeat=False) as run:
                run.save_checkpoint(b"step 1 done")
    assert failing.count("ExtendLease", grpc.StatusCode.UNAVAILABLE) == 2
    with IdempotencyClient(server.target) as client:
        record = client.get(namespace, "k")
        assert (record.state, record.checkpoint) == (State.RELEASED, b"step 1 done")


def test_saving_a_checkpoint_on_a_lost_lease_raises_lease_lost(client, namespace):
    with pytest.raises(LeaseLost):
        with client.once(namespace, "k", heartbeat=False) as run:
            client.purge(namespace, "k", reason="test")
            run.save_checkpoint(b"too late")
    assert client.get(namespace, "k").state is State.ABSENT
    with client.once(namespace, "replayed") as run:
        run.set_result(1)
    with client.once(namespace, "replayed") as run:
        with pytest.raises(RuntimeError, match="replayed"):
            run.save_checkpoint(b"x")


async def test_async_once_hands_over_the_checkpoint_in_every_form(server, namespace):
    async with AsyncIdempotencyClient(server.target) as client:
        with pytest.raises(RuntimeError):
            async with client.once(namespace, "k") as run:
                await run.save_checkpoint(b'["reserve"]')
                raise RuntimeError("crash")

        seen = []

        async def job(order, *, run):
            seen.append((run.checkpoint, run.checkpoint_fencing_token))
            await run.save_checkpoint(b'["reserve","charge"]')
            return order

        assert await client.once(namespace, "k").run(job, "o") == "o"
        assert seen == [(b'["reserve"]', 1)]

        @client.once(namespace, key=lambda order: order)
        async def decorated(order, *, run):
            seen.append(run.checkpoint)
            return order

        assert await decorated("d") == "d"
        assert seen[-1] is None
        async with client.once(namespace, "k") as run:
            assert run.replayed and await run(job, "x") == "o"


# --- a worker killed between two steps ----------------------------------------------------


def run_worker(server, namespace, job_id, log, *extra, timeout=60):
    return subprocess.run(
        [sys.executable, str(JOB), server.target, namespace, job_id, str(log), "--lease-ttl", "1", *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.postgres
def test_a_worker_killed_after_its_second_step_is_resumed_from_its_checkpoint_by_another(
    server, namespace, tmp_path
):
    log = tmp_path / "steps.log"
    killed = run_worker(server, namespace, "job-1", log, "--die-after", "charge")
    assert killed.returncode == -9, killed.stderr  # SIGKILL, after step 2
    lines = log.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["reserve", "charge"]

    with IdempotencyClient(server.target) as client:
        record = client.get(namespace, "job-1")
        assert record.state is State.IN_PROGRESS  # the dead worker's lease, until it runs out
        assert json.loads(record.checkpoint) == ["reserve", "charge"]

    started = time.monotonic()
    resumed = run_worker(server, namespace, "job-1", log)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout) == ["reserve", "charge", "email"]
    assert time.monotonic() - started < 15

    steps = [line.split() for line in log.read_text().splitlines()]
    assert [step[0] for step in steps] == ["reserve", "charge", "email"]  # each step once
    first_pid, second_pid = steps[0][2], steps[2][2]
    assert steps[1][2] == first_pid != second_pid
    assert [step[3] for step in steps] == ["fencing=1", "fencing=1", "fencing=2"]

    with IdempotencyClient(server.target) as client:
        record = client.get(namespace, "job-1")
        assert record.state is State.COMPLETED and json.loads(record.response) == ["reserve", "charge", "email"]
        assert record.checkpoint is None
        # A later delivery replays the result and does no step.
        again = run_worker(server, namespace, "job-1", log)
        assert again.returncode == 0 and json.loads(again.stdout) == ["reserve", "charge", "email"]
    assert len(log.read_text().splitlines()) == 3


def test_claim_results_expose_checkpoint_fields_even_when_empty(client, namespace):
    claim = client.claim(namespace, "k")
    assert claim.outcome is Outcome.CLAIMED
    assert (claim.checkpoint, claim.checkpoint_fencing_token, claim.retried) == (None, None, False)
    in_progress = client.claim(namespace, "k")
    assert (in_progress.checkpoint, in_progress.checkpoint_fencing_token, in_progress.retried) == (None, None, False)
