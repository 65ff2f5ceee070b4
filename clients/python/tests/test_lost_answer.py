"""A Claim whose answer is lost: the Claim reached the server, which gave the
lease, and the caller saw UNAVAILABLE instead of the answer. The client's
retry sends the same lease token and gets the same lease back at once
(`retried`), instead of OUTCOME_IN_PROGRESS against itself until the lease
runs out. The same for every other RPC a retry repeats.

Needs a server with retry-safe Claims (ClaimRequest.lease_token)."""

import time
from datetime import timezone

import grpc
import pytest

from idempotency_client import (
    AsyncIdempotencyClient,
    ClaimItem,
    IdempotencyClient,
    InvalidArgument,
    Outcome,
    State,
    new_lease_token,
)
from interceptors import AsyncDropAnswers, DropAnswers

#: A retry of a lost answer must not wait for anything (the lease is 30 s).
NO_WAIT = 2.0


def assert_same_lease(retried, dropped):
    assert retried.outcome is Outcome.CLAIMED
    assert retried.retried is True
    assert retried.lease_token == dropped.lease_token
    assert retried.fencing_token == dropped.fencing_token
    assert retried.lease_expires_at == dropped.lease_expires_at.ToDatetime(tzinfo=timezone.utc)
    assert not dropped.retried


@pytest.mark.postgres
def test_a_claim_whose_answer_was_lost_is_retried_and_gets_the_same_lease(server, namespace):
    drop = DropAnswers("Claim")
    with IdempotencyClient(server.target, interceptors=[drop]) as client:
        started = time.monotonic()
        claim = client.claim(namespace, "k", lease_ttl=30)
        assert time.monotonic() - started < NO_WAIT
        assert drop.count("Claim") == 2
        assert_same_lease(claim, drop.dropped[0])
        assert claim.fencing_token == 1
        client.complete(namespace, "k", claim.lease_token, b"done")
        assert client.get(namespace, "k").state is State.COMPLETED


@pytest.mark.postgres
def test_once_rides_over_a_lost_claim_answer_and_runs_the_work_once(server, namespace):
    drop = DropAnswers("Claim")
    calls = []
    with IdempotencyClient(server.target, interceptors=[drop]) as client:
        started = time.monotonic()
        with client.once(namespace, "k") as run:
            result = run(lambda: calls.append(1) or "ok")
        assert time.monotonic() - started < NO_WAIT
        assert result == "ok" and calls == [1]
        assert run.claim.retried and run.fencing_token == 1
        assert client.once(namespace, "k").run(lambda: calls.append(2)) == "ok"
    assert calls == [1]


@pytest.mark.postgres
def test_a_claim_batch_whose_answer_was_lost_gets_every_lease_back(server, namespace):
    drop = DropAnswers("ClaimBatch")
    with IdempotencyClient(server.target, interceptors=[drop]) as client:
        client.complete(namespace, "done", client.claim(namespace, "done").lease_token, b"r")
        results = client.claim_batch(
            [ClaimItem(namespace, "a"), ClaimItem(namespace, "b"), ClaimItem(namespace, "done")]
        )
        first = drop.dropped[0].items
        assert_same_lease(results[0], first[0])
        assert_same_lease(results[1], first[1])
        assert results[0].lease_token != results[1].lease_token
        assert results[2].outcome is Outcome.COMPLETED and results[2].response == b"r"


@pytest.mark.postgres
@pytest.mark.parametrize("method", ["Complete", "Release", "ExtendLease"])
def test_a_lost_answer_of_complete_release_or_extend_lease_is_retried_to_ok(server, namespace, method):
    drop = DropAnswers(method)
    with IdempotencyClient(server.target, interceptors=[drop]) as client:
        claim = client.claim(namespace, "k")
        if method == "Complete":
            client.complete(namespace, "k", claim.lease_token, b"r")
            assert client.get(namespace, "k").response == b"r"
        elif method == "Release":
            client.release(namespace, "k", claim.lease_token)
            assert client.get(namespace, "k").state is State.RELEASED
        else:
            client.extend_lease(namespace, "k", claim.lease_token, lease_ttl=60)
        assert drop.count(method) == 2 and len(drop.dropped) == 1


async def test_the_async_client_retries_a_lost_claim_answer(server, namespace):
    drop = AsyncDropAnswers("Claim")
    async with AsyncIdempotencyClient(server.target, interceptors=[drop]) as client:
        started = time.monotonic()
        claim = await client.claim(namespace, "k")
        assert time.monotonic() - started < NO_WAIT
        assert_same_lease(claim, drop.dropped[0])
        async with client.once(namespace, "other") as run:
            await run(lambda: "x")
        assert run.claim.retried is False  # only the first Claim's answer was dropped
        await client.complete(namespace, "k", claim.lease_token, b"")


async def test_async_once_rides_over_a_lost_claim_answer(server, namespace):
    drop = AsyncDropAnswers("Claim")
    calls = []

    async def work():
        calls.append(1)
        return {"n": 1}

    async with AsyncIdempotencyClient(server.target, interceptors=[drop]) as client:
        started = time.monotonic()
        async with client.once(namespace, "k") as run:
            assert await run(work) == {"n": 1}
        assert time.monotonic() - started < NO_WAIT
        assert run.claim.retried and calls == [1]


# --- the lease token the caller chooses ---------------------------------------------


@pytest.mark.postgres
def test_a_claim_repeating_the_holder_s_token_gets_the_same_lease_and_others_wait(client, namespace):
    token = new_lease_token()
    first = client.claim(namespace, "k", lease_token=token)
    assert first.outcome is Outcome.CLAIMED and first.lease_token == token and not first.retried
    again = client.claim(namespace, "k", lease_token=token)
    assert again.retried and again.lease_token == token
    assert (again.fencing_token, again.lease_expires_at, again.expires_at) == (
        first.fencing_token,
        first.lease_expires_at,
        first.expires_at,
    )
    other = client.claim(namespace, "k")
    assert other.outcome is Outcome.IN_PROGRESS and other.lease_token is None


def test_a_new_token_per_claim_and_a_malformed_one_refused(client, namespace):
    tokens = {new_lease_token() for _ in range(100)}
    assert len(tokens) == 100 and all(len(token) == 32 and token == token.lower() for token in tokens)
    assert client.claim(namespace, "a").lease_token != client.claim(namespace, "b").lease_token
    with pytest.raises(InvalidArgument, match="lease_token"):
        client.claim(namespace, "k", lease_token="not-hex")
    with pytest.raises(TypeError, match="lease_token"):
        client.claim(namespace, "k", lease_token=b"0" * 32)


def test_the_dropped_answer_reached_the_server(client, namespace, server):
    """The interceptor's premise: the first Claim did take the lease."""
    drop = DropAnswers("Claim")
    with IdempotencyClient(server.target, interceptors=[drop], retry=None) as dropping:
        with pytest.raises(Exception) as raised:
            dropping.claim(namespace, "k")
    assert raised.value.code is grpc.StatusCode.UNAVAILABLE
    record = client.get(namespace, "k")
    assert record.state is State.IN_PROGRESS and record.fencing_token == 1
