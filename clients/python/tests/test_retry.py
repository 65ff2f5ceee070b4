"""Retries: the policy's backoff, the overall deadline, what is and is not
retried, per-attempt timeouts, and the ways to give several addresses.

Against the real server where there is one; "nobody listening" is a free
port with no server, and a "black hole" a socket that accepts connections and
never answers (an attempt on it hangs until its deadline)."""

import logging
import random
import socket
import time

import grpc
import pytest

from idempotency_client import (
    DEFAULT_RETRY,
    AsyncIdempotencyClient,
    IdempotencyClient,
    InvalidArgument,
    KeyNotFound,
    LeaseNotCurrent,
    Outcome,
    RetryPolicy,
    State,
    Unavailable,
)
from idempotency_client.channels import parse_targets
from idempotency_client.testing import free_port
from interceptors import AsyncCounting, Counting

FAST = RetryPolicy(max_attempts=1000, initial_backoff=0.01, max_backoff=0.05)


@pytest.fixture
def nobody():
    """An address where nothing listens: every attempt is UNAVAILABLE at once."""
    return f"127.0.0.1:{free_port()}"


@pytest.fixture
def black_hole():
    """An address that accepts TCP connections and never speaks: an attempt
    there waits for its deadline (DEADLINE_EXCEEDED)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield "127.0.0.1:%d" % sock.getsockname()[1]


# --- the policy ----------------------------------------------------------------


def test_the_backoff_grows_by_the_multiplier_up_to_the_cap_with_full_jitter():
    policy = RetryPolicy(initial_backoff=0.05, max_backoff=2.0, multiplier=2.0)
    assert [policy.backoff_cap(n) for n in range(1, 9)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert policy.backoff_cap(10_000) == 2.0  # no overflow
    rng = random.Random(7)
    for retry in range(1, 12):
        pauses = [policy.backoff(retry, rng) for _ in range(200)]
        assert all(0.0 <= pause <= policy.backoff_cap(retry) for pause in pauses)
        # Full jitter: spread over the whole range, not bunched at the cap.
        assert min(pauses) < policy.backoff_cap(retry) * 0.1
        assert max(pauses) > policy.backoff_cap(retry) * 0.9


def test_the_default_policy_is_the_documented_one():
    assert DEFAULT_RETRY == RetryPolicy(
        max_attempts=10, initial_backoff=0.05, max_backoff=2.0, multiplier=2.0, per_attempt_timeout=None
    )
    assert DEFAULT_RETRY.retryable_codes == {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }


@pytest.mark.parametrize(
    "arguments",
    [
        {"max_attempts": 0},
        {"max_attempts": 1.5},
        {"initial_backoff": -1},
        {"max_backoff": -0.1},
        {"multiplier": 0.5},
        {"per_attempt_timeout": 0},
    ],
)
def test_a_policy_out_of_range_is_refused(arguments):
    with pytest.raises(ValueError, match="RetryPolicy"):
        RetryPolicy(**arguments)


@pytest.mark.parametrize("cls", [IdempotencyClient, AsyncIdempotencyClient])
def test_retry_is_on_by_default_and_none_turns_it_off(cls):
    assert cls("127.0.0.1:1").retry == DEFAULT_RETRY
    assert cls("127.0.0.1:1", retry=None).retry is None
    assert cls("127.0.0.1:1", retry=False).retry is None
    with pytest.raises(TypeError, match="retry"):
        cls("127.0.0.1:1", retry=3)


# --- against a server that is not there ------------------------------------------


def test_an_unreachable_server_is_retried_until_the_overall_deadline_and_no_longer(nobody):
    counting = Counting()
    with IdempotencyClient(nobody, retry=FAST, timeout=1.0, interceptors=[counting]) as client:
        started = time.monotonic()
        with pytest.raises(Unavailable) as raised:
            client.get("ns", "k")
        elapsed = time.monotonic() - started
    assert 0.8 <= elapsed <= 1.5, elapsed
    assert raised.value.attempts == counting.count("Get") > 5
    assert f"after {raised.value.attempts} attempts" in str(raised.value)
    assert raised.value.code is grpc.StatusCode.UNAVAILABLE


def test_a_call_s_own_timeout_is_its_overall_deadline(nobody):
    with IdempotencyClient(nobody, retry=FAST, timeout=30) as client:
        started = time.monotonic()
        with pytest.raises(Unavailable):
            client.claim("ns", "k", timeout=0.5)
        assert time.monotonic() - started <= 1.0


def test_max_attempts_bounds_the_attempts_and_each_retry_is_logged(nobody, caplog):
    counting = Counting()
    policy = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.01)
    with IdempotencyClient(nobody, retry=policy, interceptors=[counting]) as client:
        with caplog.at_level(logging.DEBUG, logger="idempotency_client"):
            with pytest.raises(Unavailable) as raised:
                client.claim("ns", "k")
    assert counting.count("Claim") == 3 == raised.value.attempts
    retries = [record.getMessage() for record in caplog.records if "retrying" in record.getMessage()]
    assert len(retries) == 2
    assert retries[0].startswith(f"idempotency: Claim attempt 1 on {nobody} failed (UNAVAILABLE: ")


def test_without_retries_one_attempt_is_made(nobody):
    counting = Counting()
    with IdempotencyClient(nobody, retry=None, interceptors=[counting]) as client:
        with pytest.raises(Unavailable) as raised:
            client.complete("ns", "k", "0" * 32, b"")
    assert counting.count() == 1 == raised.value.attempts
    assert "attempts" not in str(raised.value)


async def test_the_async_client_retries_until_the_deadline(nobody):
    counting = AsyncCounting()
    async with AsyncIdempotencyClient(nobody, retry=FAST, timeout=1.0, interceptors=[counting]) as client:
        started = time.monotonic()
        with pytest.raises(Unavailable) as raised:
            await client.get("ns", "k")
        elapsed = time.monotonic() - started
    assert 0.8 <= elapsed <= 1.5, elapsed
    assert raised.value.attempts == counting.count("Get") > 5


# --- against the real server ---------------------------------------------------------


def test_what_the_server_refuses_is_not_retried(server, namespace):
    counting = Counting()
    with IdempotencyClient(server.target, retry=FAST, interceptors=[counting]) as client:
        with pytest.raises(InvalidArgument):
            client.claim("", "k")  # INVALID_ARGUMENT
        with pytest.raises(KeyNotFound):
            client.complete(namespace, "absent", "0" * 32, b"")  # NOT_FOUND
        claim = client.claim(namespace, "k")
        with pytest.raises(LeaseNotCurrent):
            client.release(namespace, "k", "f" * 32)  # FAILED_PRECONDITION
        client.complete(namespace, "k", claim.lease_token, b"r")
        with pytest.raises(LeaseNotCurrent):
            client.extend_lease(namespace, "k", claim.lease_token)  # FAILED_PRECONDITION
    assert counting.attempts == [
        ("Claim", grpc.StatusCode.INVALID_ARGUMENT),
        ("Complete", grpc.StatusCode.NOT_FOUND),
        ("Claim", grpc.StatusCode.OK),
        ("Release", grpc.StatusCode.FAILED_PRECONDITION),
        ("Complete", grpc.StatusCode.OK),
        ("ExtendLease", grpc.StatusCode.FAILED_PRECONDITION),
    ]


async def test_what_the_server_refuses_is_not_retried_by_the_async_client(server, namespace):
    counting = AsyncCounting()
    async with AsyncIdempotencyClient(server.target, retry=FAST, interceptors=[counting]) as client:
        with pytest.raises(InvalidArgument):
            await client.get("", "k")
        with pytest.raises(KeyNotFound):
            await client.release(namespace, "absent", "0" * 32)
    assert counting.attempts == [
        ("Get", grpc.StatusCode.INVALID_ARGUMENT),
        ("Release", grpc.StatusCode.NOT_FOUND),
    ]


def test_a_retry_after_unavailable_lands_on_the_other_address(server, namespace, nobody):
    counting = Counting()
    with IdempotencyClient([nobody, server.target], retry=FAST, interceptors=[counting]) as client:
        for index in range(6):
            claim = client.claim(namespace, f"k{index}")
            assert claim.outcome is Outcome.CLAIMED
            client.complete(namespace, f"k{index}", claim.lease_token, b"")
    # Every call succeeded; the dead address cost at most a failed attempt
    # per call (none once its channel is known to be failing).
    assert counting.count(code=grpc.StatusCode.OK) == 12
    assert counting.count(code=grpc.StatusCode.UNAVAILABLE) <= 12


def test_a_hanging_attempt_times_out_and_leaves_time_for_another(black_hole):
    counting = Counting()
    policy = RetryPolicy(per_attempt_timeout=0.2, initial_backoff=0.01, max_backoff=0.01)
    with IdempotencyClient(black_hole, retry=policy, timeout=1.0, interceptors=[counting]) as client:
        started = time.monotonic()
        with pytest.raises(Unavailable) as raised:
            client.get("ns", "k")
        elapsed = time.monotonic() - started
    assert raised.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert counting.count("Get", grpc.StatusCode.DEADLINE_EXCEEDED) == raised.value.attempts >= 4
    assert 0.8 <= elapsed <= 1.5, elapsed


def test_a_replica_that_hangs_gets_no_call_once_another_is_connected(server, namespace, black_hole):
    counting = Counting()
    policy = RetryPolicy(per_attempt_timeout=0.5)
    with IdempotencyClient([black_hole, server.target], retry=policy, timeout=5, interceptors=[counting]) as client:
        started = time.monotonic()
        for index in range(10):
            assert client.get(namespace, f"k{index}").state is State.ABSENT
        elapsed = time.monotonic() - started
    # At most the first call, before the server's channel was connected,
    # tried the black hole (and timed out after 0.5 s).
    assert counting.count("Get", grpc.StatusCode.OK) == 10
    assert counting.count("Get", grpc.StatusCode.DEADLINE_EXCEEDED) <= 1
    assert elapsed < 2.0, elapsed


def test_without_a_per_attempt_timeout_a_hanging_attempt_takes_the_whole_deadline(black_hole):
    counting = Counting()
    with IdempotencyClient(black_hole, timeout=0.5, interceptors=[counting]) as client:
        started = time.monotonic()
        with pytest.raises(Unavailable) as raised:
            client.get("ns", "k")
        assert 0.4 <= time.monotonic() - started <= 1.0
    assert raised.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert counting.count() == 1


# --- several addresses -------------------------------------------------------------------


def test_targets_are_one_address_a_list_a_comma_separated_string_or_a_grpc_uri():
    assert parse_targets("127.0.0.1:1") == ["127.0.0.1:1"]
    assert parse_targets("a:1, b:2,") == ["a:1", "b:2"]
    assert parse_targets(["a:1", " b:2 "]) == ["a:1", "b:2"]
    assert parse_targets("dns:///idempotency.internal:50051") == ["dns:///idempotency.internal:50051"]
    assert parse_targets("ipv4:10.0.0.1:1,10.0.0.2:2") == ["ipv4:10.0.0.1:1,10.0.0.2:2"]
    assert parse_targets("ipv6:[::1]:1,[::1]:2") == ["ipv6:[::1]:1,[::1]:2"]
    with pytest.raises(ValueError):
        parse_targets(" , ")
    with pytest.raises(TypeError):
        parse_targets(["a:1", 2])
    with pytest.raises(TypeError):
        parse_targets(b"a:1")


@pytest.mark.parametrize(
    "shape",
    ["dns", "ipv4 list", "comma string", "list"],
)
def test_every_form_of_target_reaches_the_server(server, namespace, nobody, shape):
    port = server.target.rsplit(":", 1)[1]
    target = {
        "dns": f"dns:///localhost:{port}",
        "ipv4 list": f"ipv4:{nobody},127.0.0.1:{port}",
        "comma string": f"{nobody},{server.target}",
        "list": [nobody, server.target],
    }[shape]
    with IdempotencyClient(target) as client:
        for index in range(3):
            claim = client.claim(namespace, f"k{index}")
            assert claim.outcome is Outcome.CLAIMED
            client.complete(namespace, f"k{index}", claim.lease_token, b"ok")
            assert client.get(namespace, f"k{index}").state is State.COMPLETED


async def test_the_async_client_takes_several_addresses(server, namespace, nobody):
    async with AsyncIdempotencyClient([nobody, server.target]) as client:
        assert len(client.targets) == 2
        for index in range(4):
            claim = await client.claim(namespace, f"k{index}")
            await client.complete(namespace, f"k{index}", claim.lease_token, b"ok")
            assert (await client.get(namespace, f"k{index}")).state is State.COMPLETED
