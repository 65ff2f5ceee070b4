"""once(): the run-once lifecycle through the synchronous client, against a real server."""

import json
import threading
import time

import pytest

from idempotency_client import (
    BYTES,
    FingerprintMismatch,
    InProgress,
    InvalidArgument,
    LeaseLost,
    LeaseNotCurrent,
    Outcome,
    State,
    derive_key,
    fingerprint,
)
from poll import until


class Work:
    """A piece of work that counts its runs."""

    def __init__(self, result=None, error=None):
        self.calls = 0
        self.result = result
        self.error = error

    def __call__(self, *args):
        self.calls += 1
        if self.error:
            raise self.error
        return self.result


@pytest.mark.postgres
def test_the_first_delivery_runs_the_work_and_completes_with_its_json_result(client, namespace):
    work = Work({"charge": "ch_1", "amount": 100})

    with client.once(namespace, "evt-1") as run:
        result = run(work)

    assert result == {"charge": "ch_1", "amount": 100}
    assert not run.replayed
    assert run.fencing_token == 1
    record = client.get(namespace, "evt-1")
    assert record.state is State.COMPLETED
    assert json.loads(record.response) == {"charge": "ch_1", "amount": 100}


@pytest.mark.postgres
def test_a_duplicate_delivery_replays_the_result_without_running_the_work(client, namespace):
    client.once(namespace, "evt-1").run(Work({"n": 1}))
    work = Work({"n": 2})

    with client.once(namespace, "evt-1") as run:
        result = run(work)

    assert result == {"n": 1}
    assert run.replayed
    assert run.claim.outcome is Outcome.COMPLETED
    assert work.calls == 0


@pytest.mark.postgres
def test_an_exception_in_the_work_releases_the_key_and_the_next_attempt_succeeds(client, namespace):
    failing = Work(error=RuntimeError("card declined"))

    with pytest.raises(RuntimeError, match="card declined"):
        client.once(namespace, "evt-1").run(failing)

    assert failing.calls == 1
    assert client.get(namespace, "evt-1").state is State.RELEASED
    succeeding = Work("ok")
    assert client.once(namespace, "evt-1").run(succeeding) == "ok"
    assert succeeding.calls == 1
    record = client.get(namespace, "evt-1")
    assert record.state is State.COMPLETED
    assert record.fencing_token == 2


def test_an_exception_in_the_with_block_releases_and_is_re_raised(client, namespace):
    with pytest.raises(KeyError):
        with client.once(namespace, "evt-1") as run:
            assert not run.replayed
            raise KeyError("boom")

    assert client.get(namespace, "evt-1").state is State.RELEASED


@pytest.mark.postgres
def test_a_fingerprint_mismatch_raises_without_running_the_work(client, namespace):
    client.once(namespace, "evt-1", fingerprint=fingerprint({"amount": 100})).run(Work(1))
    work = Work(2)

    with pytest.raises(FingerprintMismatch):
        client.once(namespace, "evt-1", fingerprint=fingerprint({"amount": 999})).run(work)

    assert work.calls == 0
    same = client.once(namespace, "evt-1", fingerprint=fingerprint({"amount": 100})).run(work)
    assert same == 1 and work.calls == 0


@pytest.mark.postgres
def test_in_progress_with_raise_raises_in_progress_with_retry_after(client, other_client, namespace):
    other_client.claim(namespace, "evt-1", lease_ttl=30)
    work = Work()

    with pytest.raises(InProgress) as raised:
        client.once(namespace, "evt-1", on_in_progress="raise").run(work)

    assert work.calls == 0
    assert 0 < raised.value.retry_after.total_seconds() <= 30
    assert raised.value.lease_expires_at is not None


def test_in_progress_with_wait_replays_once_the_other_claimant_completes(client, other_client, namespace):
    claim = other_client.claim(namespace, "evt-1", lease_ttl=30)
    completer = threading.Timer(
        0.3, lambda: other_client.complete(namespace, "evt-1", claim.lease_token, b'"theirs"')
    )
    completer.start()
    work = Work("mine")
    started = time.monotonic()

    result = client.once(namespace, "evt-1", wait_timeout=10).run(work)

    completer.join()
    assert result == "theirs"
    assert work.calls == 0
    assert time.monotonic() - started < 5  # polled, not slept until the lease expired


def test_in_progress_with_wait_claims_once_the_other_claimant_releases(client, other_client, namespace):
    claim = other_client.claim(namespace, "evt-1", lease_ttl=30)
    releaser = threading.Timer(0.3, lambda: other_client.release(namespace, "evt-1", claim.lease_token))
    releaser.start()
    work = Work("mine")

    result = client.once(namespace, "evt-1", wait_timeout=10).run(work)

    releaser.join()
    assert result == "mine"
    assert work.calls == 1


def test_in_progress_with_wait_takes_an_expired_lease_after_retry_after(client, other_client, namespace):
    other_client.claim(namespace, "evt-1", lease_ttl=1)  # a claimant that vanished
    work = Work("mine")

    result = client.once(namespace, "evt-1", wait_timeout=10).run(work)

    assert result == "mine"
    assert client.get(namespace, "evt-1").fencing_token == 2


def test_in_progress_with_wait_raises_in_progress_when_the_wait_times_out(client, other_client, namespace):
    other_client.claim(namespace, "evt-1", lease_ttl=30)
    work = Work()
    started = time.monotonic()

    with pytest.raises(InProgress, match="still in progress"):
        client.once(namespace, "evt-1", wait_timeout=0.5).run(work)

    assert work.calls == 0
    assert 0.5 <= time.monotonic() - started < 5


@pytest.mark.postgres
def test_a_lease_lost_to_another_claimant_raises_lease_lost_and_stores_nothing(client, other_client, namespace):
    with pytest.raises(LeaseLost) as raised:
        with client.once(namespace, "evt-1", lease_ttl=1, heartbeat=False) as run:
            # The work outlives its lease and another claimant takes the key over.
            taken = until(
                lambda: other_client.claim(namespace, "evt-1", lease_ttl=30).claimed,
                what="another claimant to take the expired lease",
            )
            run.set_result("too late")

    assert taken
    assert isinstance(raised.value.__cause__, LeaseNotCurrent)
    record = client.get(namespace, "evt-1")
    assert record.state is State.IN_PROGRESS
    assert record.fencing_token == 2


def test_the_heartbeat_keeps_the_lease_through_work_longer_than_the_lease(client, other_client, namespace):
    def long_work():
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # one and a half leases of 2 s
            assert other_client.claim(namespace, "evt-1").outcome is Outcome.IN_PROGRESS
            time.sleep(0.2)
        return "done"

    result = client.once(namespace, "evt-1", lease_ttl=2).run(long_work)

    assert result == "done"
    record = client.get(namespace, "evt-1")
    assert record.state is State.COMPLETED
    assert record.fencing_token == 1


def test_the_heartbeat_notices_a_lost_lease_and_the_result_is_not_stored(client, other_client, namespace):
    with pytest.raises(LeaseLost):
        with client.once(namespace, "evt-1", lease_ttl=2, heartbeat_interval=0.1) as run:
            # Someone releases our lease behind our back and another claimant wins.
            other_client.release(namespace, "evt-1", run.claim.lease_token)
            assert other_client.claim(namespace, "evt-1").claimed
            until(lambda: run.lease_lost, what="the heartbeat to notice")
            with pytest.raises(LeaseLost):
                run.check_lease()
            run.set_result("must not be stored")

    record = client.get(namespace, "evt-1")
    assert record.state is State.IN_PROGRESS
    assert record.fencing_token == 2


def test_the_decorator_runs_once_per_key_derived_from_the_arguments(client, namespace):
    calls = []

    @client.once(
        namespace,
        key=lambda event: derive_key(event["source"], event["id"]),
        fingerprint=lambda event: fingerprint(event),
    )
    def handle(event):
        calls.append(event["id"])
        return {"handled": event["id"]}

    first = handle({"source": "shop", "id": "o-1"})
    again = handle({"source": "shop", "id": "o-1"})
    other = handle({"source": "shop", "id": "o-2"})

    assert first == again == {"handled": "o-1"}
    assert other == {"handled": "o-2"}
    assert calls == ["o-1", "o-2"]
    assert handle.__name__ == "handle"
    with pytest.raises(FingerprintMismatch):  # same event id, another payload
        handle({"source": "shop", "id": "o-1", "amount": 5})
    assert calls == ["o-1", "o-2"]


def test_a_decorated_function_with_a_fixed_key_runs_once(client, namespace):
    calls = []

    @client.once(namespace, "migration-2024-01")
    def backfill():
        calls.append(1)
        return len(calls)

    assert backfill() == 1
    assert backfill() == 1
    assert calls == [1]


def test_work_that_is_not_one_call_uses_replayed_and_set_result(client, namespace):
    for _ in range(2):
        with client.once(namespace, "evt-1") as run:
            if not run.replayed:
                run.set_result({"steps": 2})
        assert run.result == {"steps": 2}
    assert run.replayed


def test_a_bytes_serializer_stores_the_result_as_it_is(client, namespace):
    assert client.once(namespace, "evt-1", serializer=BYTES).run(lambda: b"\x00raw") == b"\x00raw"

    assert client.get(namespace, "evt-1").response == b"\x00raw"
    assert client.once(namespace, "evt-1", serializer=BYTES).run(Work()) == b"\x00raw"


def test_a_result_that_cannot_be_serialised_releases_the_key(client, namespace):
    with pytest.raises(TypeError):
        client.once(namespace, "evt-1").run(lambda: object())

    assert client.get(namespace, "evt-1").state is State.RELEASED


def test_an_invalid_key_surfaces_as_invalid_argument_naming_the_field(client, namespace):
    work = Work()

    with pytest.raises(InvalidArgument, match="key"):
        client.once(namespace, "k" * 513).run(work)

    assert work.calls == 0


def test_a_computed_key_needs_the_decorator_form(client, namespace):
    with pytest.raises(TypeError, match="decorator"):
        with client.once(namespace, key=lambda: "k"):
            pass
