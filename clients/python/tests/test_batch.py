"""ClaimBatch, CompleteBatch and Purge through both clients: per-item results
in order, per-item errors as the single calls' classes, and whole-call errors
that name the item."""

import re
import secrets
from datetime import timedelta

import pytest

from idempotency_client import (
    ClaimItem,
    CompleteItem,
    IdempotencyError,
    InvalidArgument,
    KeyNotFound,
    LeaseNotCurrent,
    Outcome,
    State,
)


@pytest.mark.postgres
def test_claim_batch_answers_each_item_in_order_as_its_own_claim_would(client, namespace):
    done = client.claim(namespace, "done", fingerprint=b"\x01" * 32)
    stored = client.complete(namespace, "done", done.lease_token, b'{"ok":true}', retention=60)
    fp = client.claim(namespace, "fp", fingerprint=b"\x01" * 32)
    client.complete(namespace, "fp", fp.lease_token, b"x")

    results = client.claim_batch(
        [
            ClaimItem(namespace, "new", lease_ttl=30, retention=timedelta(minutes=5)),
            ClaimItem(namespace, "done", fingerprint=b"\x01" * 32),
            ClaimItem(namespace, "dup", lease_ttl=30),
            {"namespace": namespace, "key": "dup", "lease_ttl": 30},
            ClaimItem(namespace, "fp", fingerprint=b"\x02" * 32),
        ]
    )

    assert [r.outcome for r in results] == [
        Outcome.CLAIMED,
        Outcome.COMPLETED,
        Outcome.CLAIMED,
        Outcome.IN_PROGRESS,
        Outcome.FINGERPRINT_MISMATCH,
    ]
    new, replay, first, second, mismatch = results
    assert re.fullmatch(r"[0-9a-f]{32}", new.lease_token)
    assert new.fencing_token == 1
    assert new.response is None
    assert replay.response == b'{"ok":true}'
    assert replay.expires_at == stored.expires_at
    assert replay.lease_token is None
    assert first.fencing_token == 1 and first.lease_token != new.lease_token
    assert second.lease_token is None and second.fencing_token is None
    assert second.lease_expires_at == first.lease_expires_at
    assert timedelta(0) < second.retry_after <= timedelta(seconds=30)
    assert mismatch.lease_token is None and mismatch.response is None
    # The leases are real: the dup key's holder is the first item's.
    client.complete(namespace, "dup", first.lease_token, b"d")
    assert client.get(namespace, "dup").response == b"d"
    assert client.get(namespace, "fp").fingerprint == b"\x01" * 32


@pytest.mark.postgres
def test_complete_batch_answers_each_item_with_its_own_result_without_raising(client, namespace):
    ok = client.claim(namespace, "ok")
    client.claim(namespace, "taken")

    results = client.complete_batch(
        [
            CompleteItem(namespace, "ok", ok.lease_token, b"r", retention=60),
            CompleteItem(namespace, "taken", secrets.token_hex(16), b"x"),
            {"namespace": namespace, "key": "unknown", "lease_token": secrets.token_hex(16)},
        ]
    )

    assert [r.ok for r in results] == [True, False, False]
    assert results[0].error is None
    assert results[0].result().expires_at == results[0].expires_at
    assert client.claim(namespace, "ok").expires_at == results[0].expires_at
    assert client.get(namespace, "ok").response == b"r"

    assert type(results[1].error) is LeaseNotCurrent
    assert results[1].error.code.name == "FAILED_PRECONDITION"
    assert str(results[1].error).startswith("CompleteBatch: items[1]: FAILED_PRECONDITION: ")
    assert results[1].expires_at is None
    assert client.get(namespace, "taken").state is State.IN_PROGRESS

    assert type(results[2].error) is KeyNotFound
    assert results[2].error.code.name == "NOT_FOUND"
    assert str(results[2].error).startswith("CompleteBatch: items[2]: NOT_FOUND: ")
    with pytest.raises(KeyNotFound):
        results[2].result()


def test_a_repeated_complete_in_a_batch_is_ok_with_the_first_expiry(client, namespace):
    claim = client.claim(namespace, "k")
    first = client.complete(namespace, "k", claim.lease_token, b"first")

    (again,) = client.complete_batch([CompleteItem(namespace, "k", claim.lease_token, b"second")])

    assert again.ok and again.expires_at == first.expires_at
    assert client.get(namespace, "k").response == b"first"


@pytest.mark.parametrize(
    "call, prefix",
    [
        (lambda c, ns: c.claim_batch([ClaimItem(ns, "a"), ClaimItem(ns, "b"), ClaimItem(ns, "")]), "items[2].key:"),
        (lambda c, ns: c.claim_batch([ClaimItem(ns, "a"), ClaimItem(ns, "b", lease_ttl=0.5)]), "items[1].lease_ttl:"),
        (lambda c, ns: c.claim_batch([ClaimItem("", "a")]), "items[0].namespace:"),
        (lambda c, ns: c.claim_batch([]), "items:"),
        (lambda c, ns: c.claim_batch([ClaimItem(ns, f"k{i}") for i in range(501)]), "items:"),
        (
            lambda c, ns: c.complete_batch(
                [CompleteItem(ns, "a", secrets.token_hex(16)), CompleteItem(ns, "b", "not-a-token")]
            ),
            "items[1].lease_token:",
        ),
        (lambda c, ns: c.complete_batch([]), "items:"),
    ],
    ids=[
        "claim empty key", "claim short lease", "claim empty namespace", "claim none", "claim 501",
        "complete malformed token", "complete none",
    ],
)
def test_an_invalid_batch_fails_the_whole_call_naming_the_item(client, namespace, call, prefix):
    with pytest.raises(InvalidArgument) as raised:
        call(client, namespace)

    assert str(raised.value).split(": INVALID_ARGUMENT: ", 1)[1].startswith(prefix)
    for key in ("a", "b", "k0"):
        assert client.get(namespace, key).state is State.ABSENT  # nothing was changed


def test_a_batch_item_of_the_wrong_type_is_rejected_before_the_call(client, namespace):
    with pytest.raises(TypeError, match=r"items\[1\]\.fingerprint"):
        client.claim_batch([ClaimItem(namespace, "a"), ClaimItem(namespace, "b", fingerprint="abc")])
    with pytest.raises(TypeError, match=r"items\[0\]"):
        client.complete_batch([("ns", "k", "token")])
    assert client.get(namespace, "a").state is State.ABSENT


@pytest.mark.postgres
def test_purge_makes_a_completed_key_claimable_again(client, namespace):
    claim = client.claim(namespace, "k")
    client.complete(namespace, "k", claim.lease_token, b"old")

    purged = client.purge(namespace, "k", reason="INC-42: reprocess")

    assert purged.purged is True
    assert purged.previous_state is State.COMPLETED
    assert client.get(namespace, "k").state is State.ABSENT
    again = client.claim(namespace, "k")
    assert again.outcome is Outcome.CLAIMED
    assert again.lease_token != claim.lease_token
    client.complete(namespace, "k", again.lease_token, b"new")
    assert client.claim(namespace, "k").response == b"new"


def test_purge_of_an_absent_key_reports_nothing_purged(client, namespace):
    purged = client.purge(namespace, "never")

    assert purged.purged is False
    assert purged.previous_state is State.ABSENT


def test_purge_revokes_a_live_lease(client, namespace):
    claim = client.claim(namespace, "k", lease_ttl=60)

    purged = client.purge(namespace, "k", reason="stuck worker")

    assert purged.purged is True and purged.previous_state is State.IN_PROGRESS
    with pytest.raises(KeyNotFound):
        client.complete(namespace, "k", claim.lease_token, b"late")
    assert client.claim(namespace, "k").outcome is Outcome.CLAIMED


def test_purge_with_a_long_reason_raises_invalid_argument_naming_it(client, namespace):
    with pytest.raises(InvalidArgument, match="reason"):
        client.purge(namespace, "k", reason="r" * 257)


@pytest.mark.postgres
async def test_the_async_client_batches_and_purges(aclient, namespace):
    done = await aclient.claim(namespace, "done")
    await aclient.complete(namespace, "done", done.lease_token, b"stored")

    claims = await aclient.claim_batch(
        [ClaimItem(namespace, "new"), ClaimItem(namespace, "done"), ClaimItem(namespace, "new")]
    )
    assert [c.outcome for c in claims] == [Outcome.CLAIMED, Outcome.COMPLETED, Outcome.IN_PROGRESS]
    assert claims[1].response == b"stored"

    completes = await aclient.complete_batch(
        [
            CompleteItem(namespace, "new", claims[0].lease_token, b"n"),
            CompleteItem(namespace, "done", secrets.token_hex(16)),
            CompleteItem(namespace, "unknown", secrets.token_hex(16)),
        ]
    )
    assert completes[0].ok and completes[0].expires_at is not None
    assert type(completes[1].error) is LeaseNotCurrent
    assert type(completes[2].error) is KeyNotFound
    assert all(isinstance(c.error, IdempotencyError) for c in completes[1:])

    with pytest.raises(InvalidArgument, match=re.escape("INVALID_ARGUMENT: items[1].key:")):
        await aclient.claim_batch([ClaimItem(namespace, "x"), ClaimItem(namespace, "")])

    purged = await aclient.purge(namespace, "done", reason="test")
    assert purged.purged and purged.previous_state is State.COMPLETED
    assert (await aclient.claim(namespace, "done")).outcome is Outcome.CLAIMED


@pytest.mark.postgres
def test_item_errors_on_a_store_that_reaches_every_key_changes_no_answer(client, namespace):
    results = client.claim_batch(
        [ClaimItem(namespace, "ie-a", lease_ttl=30), ClaimItem(namespace, "ie-a", lease_ttl=30)],
        item_errors=True,
    )
    assert [r.outcome for r in results] == [Outcome.CLAIMED, Outcome.IN_PROGRESS]
    assert all(r.ok and r.error is None for r in results)
    done = client.complete_batch(
        [
            CompleteItem(namespace, "ie-a", results[0].lease_token, b"a"),
            CompleteItem(namespace, "ie-none", secrets.token_hex(16), b"x"),
        ],
        item_errors=True,
    )
    assert done[0].ok and done[0].expires_at is not None
    assert isinstance(done[1].error, KeyNotFound)


def test_a_failed_claim_batch_item_decodes_to_its_own_typed_error():
    """What the server sends for an item it could not reach (ItemError, on
    Citus with a worker down: tests/conformance and the citus_worker_crash
    fault scenario make it for real) becomes that item's ClaimResult."""
    from idempotency_client import Unavailable
    from idempotency_client._proto import idempotency_pb2 as pb
    from idempotency_client.types import claim_batch_results

    reply = pb.ClaimBatchResponse(
        items=[
            pb.ClaimResponse(outcome=pb.OUTCOME_CLAIMED, lease_token="ab" * 16, fencing_token=1),
            pb.ClaimResponse(
                error=pb.ItemError(code=14, message="the store is unavailable", reason="STORE_UNAVAILABLE")
            ),
        ]
    )
    reply.items[1].error.retry_after.FromTimedelta(timedelta(milliseconds=250))
    request = pb.ClaimBatchRequest(
        items=[pb.ClaimRequest(key="a", lease_token="ab" * 16), pb.ClaimRequest(key="b", lease_token="cd" * 16)]
    )
    claimed, failed = claim_batch_results(reply, request)
    assert claimed.ok and claimed.outcome is Outcome.CLAIMED and claimed.lease_token == "ab" * 16
    # The failed item keeps the token it was sent with, to be retried with.
    assert not failed.ok and failed.outcome is Outcome.UNSPECIFIED and failed.lease_token == "cd" * 16
    assert failed.fencing_token is None and failed.response is None
    assert isinstance(failed.error, Unavailable)
    assert failed.error.details.reason == "STORE_UNAVAILABLE"
    assert failed.error.details.retry_delay == timedelta(milliseconds=250)
    assert "items[1]" in str(failed.error)
