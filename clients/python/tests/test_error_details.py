"""What the typed errors say about a refusal (the google.rpc details of the
status: reason, domain, retry_delay, field, metadata), the retry that never
comes sooner than the server's RetryInfo, and late retries of a remembered
key (a key completed with a short retention, Claimed again after its result
expired): re-executed with the next fencing token, or refused as EXPIRED.

Against a real server: the session's (embedded store, no policy) and, for
the identities' refusals, one of this module's with a policy file."""

import hashlib
import secrets
import time
import uuid
from datetime import timedelta, timezone

import grpc
import pytest

from idempotency_client import (
    CompleteItem,
    IdempotencyClient,
    InvalidArgument,
    KeyExpired,
    KeyNotFound,
    LateRetry,
    LeaseNotCurrent,
    Outcome,
    PermissionDenied,
    ResourceExhausted,
    ResultExpired,
    RetryPolicy,
    State,
    Unauthenticated,
    Unavailable,
)
from idempotency_client.errors import DOMAIN
from idempotency_client.retry import Attempts
from idempotency_client.testing import ServerProcess
from interceptors import Counting, FailCalls
from poll import until, until_async

# --- a key's refusals ------------------------------------------------------------


def test_an_invalid_argument_names_its_field(client, namespace):
    with pytest.raises(InvalidArgument) as raised:
        client.claim(namespace, "")
    error = raised.value
    assert (error.code, error.reason, error.domain) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", DOMAIN)
    assert error.field == "key"
    assert error.metadata == {"field": "key"}
    assert error.details.field_violations == (("key", "must not be empty"),)
    assert error.retry_delay is None


def test_an_invalid_batch_item_names_the_item_s_field(client, namespace):
    with pytest.raises(InvalidArgument) as raised:
        client.claim_batch([{"namespace": namespace, "key": "a"}, {"namespace": namespace, "key": ""}])
    assert raised.value.field == "items[1].key"
    assert raised.value.reason == "INVALID_ARGUMENT"


def test_a_complete_of_a_key_without_a_record_is_not_found(client, namespace):
    with pytest.raises(KeyNotFound) as raised:
        client.complete(namespace, "never", "0" * 32, b"x")
    error = raised.value
    assert type(error) is KeyNotFound
    assert (error.reason, error.domain, error.retry_delay, error.field) == ("NOT_FOUND", DOMAIN, None, None)
    assert error.metadata == {}


def test_the_three_ways_a_lease_is_not_current_are_told_apart(client, other_client, namespace):
    # LEASE_LOST: the lease ran out and another claimant took the key.
    first = client.claim(namespace, "lost", lease_ttl=1)
    until(lambda: other_client.claim(namespace, "lost", lease_ttl=60).claimed, what="the lease to run out")
    with pytest.raises(LeaseNotCurrent) as raised:
        client.complete(namespace, "lost", first.lease_token, b"late")
    assert (raised.value.reason, raised.value.domain, raised.value.retry_delay) == ("LEASE_LOST", DOMAIN, None)

    # LEASE_RELEASED: this lease was given back.
    claim = client.claim(namespace, "released")
    client.release(namespace, "released", claim.lease_token)
    with pytest.raises(LeaseNotCurrent) as raised:
        client.complete(namespace, "released", claim.lease_token, b"late")
    assert (raised.value.reason, raised.value.retry_delay) == ("LEASE_RELEASED", None)

    # KEY_COMPLETED: a completed key cannot be released.
    claim = client.claim(namespace, "completed")
    client.complete(namespace, "completed", claim.lease_token, b"done")
    with pytest.raises(LeaseNotCurrent) as raised:
        client.release(namespace, "completed", claim.lease_token)
    assert (raised.value.reason, raised.value.retry_delay) == ("KEY_COMPLETED", None)


def test_a_batch_item_s_error_carries_its_reason(client, namespace):
    claim = client.claim(namespace, "released")
    client.release(namespace, "released", claim.lease_token)
    items = client.complete_batch(
        [
            CompleteItem(namespace, "never", "0" * 32),
            CompleteItem(namespace, "released", claim.lease_token),
        ]
    )
    assert [type(item.error) for item in items] == [KeyNotFound, LeaseNotCurrent]
    assert [item.error.reason for item in items] == ["NOT_FOUND", "LEASE_RELEASED"]
    assert [item.error.domain for item in items] == [DOMAIN, DOMAIN]


async def test_the_async_client_s_errors_carry_the_same_details(aclient, namespace):
    with pytest.raises(InvalidArgument) as raised:
        await aclient.claim(namespace, "k", late_retry=None, lease_ttl=0.001)
    assert (raised.value.reason, raised.value.field) == ("INVALID_ARGUMENT", "lease_ttl")
    with pytest.raises(KeyNotFound) as raised:
        await aclient.release(namespace, "never", "0" * 32)
    assert raised.value.reason == "NOT_FOUND"


def test_an_error_that_never_reached_the_service_has_no_details(namespace):
    from idempotency_client.testing import free_port

    with IdempotencyClient(f"127.0.0.1:{free_port()}", retry=None, timeout=2) as client:
        with pytest.raises(Unavailable) as raised:
            client.get(namespace, "k")
    error = raised.value
    assert (error.reason, error.domain, error.retry_delay, error.field) == (None, None, None, None)
    assert error.metadata == {}


# --- the retry waits at least RetryInfo's delay ----------------------------------


def test_the_pause_before_a_retry_is_at_least_the_server_s_retry_delay():
    policy = RetryPolicy(max_attempts=10, initial_backoff=0.01, max_backoff=0.02)
    attempts = Attempts(policy, timeout=10.0)
    pauses = [attempts._pause_after(grpc.StatusCode.UNAVAILABLE, timedelta(milliseconds=250)) for _ in range(5)]
    assert all(pause >= 0.25 for pause in pauses), pauses
    # Without a RetryInfo the policy's backoff alone.
    assert all(attempts._pause_after(grpc.StatusCode.UNAVAILABLE) <= 0.02 for _ in range(3))


def test_a_retry_delay_beyond_the_deadline_ends_the_call_at_once():
    attempts = Attempts(RetryPolicy(), timeout=0.5)
    assert attempts._pause_after(grpc.StatusCode.RESOURCE_EXHAUSTED, timedelta(seconds=5)) is None
    # A delay that fits is waited.
    attempts = Attempts(RetryPolicy(), timeout=5)
    assert attempts._pause_after(grpc.StatusCode.RESOURCE_EXHAUSTED, timedelta(seconds=1)) >= 1.0


def test_a_failure_without_details_is_retried_on_the_policy_s_backoff_alone(client, namespace, server):
    failing = FailCalls("Get")
    with IdempotencyClient(server.target, interceptors=[failing], retry=RetryPolicy(max_attempts=3, initial_backoff=0.01)) as c:
        started = time.monotonic()
        with pytest.raises(Unavailable) as raised:
            c.get(namespace, "k")
    assert raised.value.attempts == 3 and raised.value.reason is None
    assert time.monotonic() - started < 1.0


# --- late retries of a remembered key ----------------------------------------------


def remembered(client, namespace, key, response=b"done"):
    """A key completed with the shortest retention (1 s), polled until its
    result expired and the server remembers it: (its first Claim, its Record)."""
    claim = client.claim(namespace, key, fingerprint=b"fp-1", retention=1)
    client.complete(namespace, key, claim.lease_token, response, retention=1)
    record = until(
        lambda: (lambda r: r if r.remembered else None)(client.get(namespace, key)),
        timeout=10,
        what="the result to expire and the key to be remembered",
    )
    return claim, record


def test_get_shows_a_remembered_key_and_its_marker(client, namespace):
    claim, record = remembered(client, namespace, "k")
    assert record.state is State.ABSENT and record.remembered
    assert record.fencing_token == claim.fencing_token == 1
    assert record.fingerprint == b"fp-1"
    assert record.response is None and record.lease_expires_at is None
    assert record.completed_at is not None and record.completed_at.tzinfo is timezone.utc
    assert record.expires_at is not None and record.completed_at <= record.expires_at
    # Remembered for the server's remember_for (7 days) after the Complete.
    assert record.remembered_until - record.completed_at == timedelta(days=7)


def test_complete_release_and_extend_of_a_remembered_key_say_key_expired(client, namespace):
    claim, record = remembered(client, namespace, "k")
    calls = [
        lambda: client.complete(namespace, "k", claim.lease_token, b"again"),
        lambda: client.release(namespace, "k", claim.lease_token),
        lambda: client.extend_lease(namespace, "k", claim.lease_token),
    ]
    for call in calls:
        with pytest.raises(KeyExpired) as raised:
            call()
        error = raised.value
        assert isinstance(error, KeyNotFound)
        assert (error.code, error.reason, error.domain, error.retry_delay) == (
            grpc.StatusCode.NOT_FOUND,
            "KEY_EXPIRED",
            DOMAIN,
            None,
        )
        assert set(error.metadata) == {"completed_at", "remembered_until"}
        # RFC 3339 with microseconds: the marker's own times, to the microsecond.
        assert error.completed_at == record.completed_at
        assert error.remembered_until == record.remembered_until


def test_a_late_retry_refused_is_expired_and_changes_nothing(client, namespace):
    claim, record = remembered(client, namespace, "k")

    late = client.claim(namespace, "k", fingerprint=b"fp-1", late_retry="refuse")

    assert late.outcome is Outcome.EXPIRED
    assert late.completed_at == record.completed_at
    assert late.fencing_token == claim.fencing_token == 1
    assert (late.lease_token, late.response, late.reexecuted) == (None, None, False)
    assert client.get(namespace, "k") == record
    # Another payload for the same key is still a mismatch, not EXPIRED.
    other = client.claim(namespace, "k", fingerprint=b"fp-2", late_retry=LateRetry.REFUSE)
    assert other.outcome is Outcome.FINGERPRINT_MISMATCH


def test_a_late_retry_re_executed_claims_with_the_next_fencing_token(client, namespace):
    claim, record = remembered(client, namespace, "k")

    late = client.claim(namespace, "k", fingerprint=b"fp-1")  # the server's policy: reexecute

    assert late.outcome is Outcome.CLAIMED and late.reexecuted
    assert late.completed_at == record.completed_at
    assert late.fencing_token == claim.fencing_token + 1 == 2
    client.complete(namespace, "k", late.lease_token, b"again")
    assert client.claim(namespace, "k").response == b"again"


def test_once_refusing_a_late_retry_raises_result_expired_without_running(client, namespace):
    _, record = remembered(client, namespace, "k", b'{"charged": 1}')
    ran = []

    with pytest.raises(ResultExpired) as raised:
        client.once(namespace, "k", late_retry="refuse").run(lambda: ran.append(1))

    assert ran == []
    assert raised.value.completed_at == record.completed_at
    assert raised.value.fencing_token == 1


def test_once_re_executing_a_late_retry_runs_the_work_and_says_when_it_completed(client, namespace):
    _, record = remembered(client, namespace, "k", b'{"charged": 1}')

    with client.once(namespace, "k", late_retry="reexecute") as run:
        result = run(lambda: {"charged": 2})

    assert result == {"charged": 2} and not run.replayed
    assert run.completed_before == record.completed_at
    assert run.fencing_token == 2
    # A fresh key's run has no earlier completion.
    with client.once(namespace, "fresh") as run:
        run(lambda: 1)
    assert run.completed_before is None


async def test_the_async_once_refuses_and_re_executes_late_retries(aclient, namespace):
    claim = await aclient.claim(namespace, "k", retention=1)
    await aclient.complete(namespace, "k", claim.lease_token, b"1", retention=1)

    async def is_remembered():
        return (await aclient.get(namespace, "k")).remembered

    await until_async(is_remembered, timeout=10, what="the key to be remembered")
    with pytest.raises(ResultExpired):
        async with aclient.once(namespace, "k", late_retry="refuse") as run:
            await run(lambda: 2)
    async with aclient.once(namespace, "k") as run:
        assert await run(lambda: 2) == 2
    assert run.completed_before is not None and run.fencing_token == 2


def test_a_late_retry_policy_out_of_range_is_refused_before_any_call(client, namespace):
    with pytest.raises(ValueError, match="late_retry"):
        client.claim(namespace, "k", late_retry="sometimes")
    with pytest.raises(ValueError, match="late_retry"):
        client.once(namespace, "k", late_retry="sometimes")


# --- the identities' refusals (a server with a policy file) -----------------------

ORDERS_TOKEN = f"idem_{secrets.token_hex(32)}"
LIMITED_TOKEN = f"idem_{secrets.token_hex(32)}"


def token_hash(token: str) -> str:
    return "sha256:" + hashlib.sha256(token.encode("utf-8")).hexdigest()


POLICY = f"""
[[identity]]
name = "orders"
token_hashes = ["{token_hash(ORDERS_TOKEN)}"]
namespaces = ["orders/*"]

[[identity]]
name = "limited"
token_hashes = ["{token_hash(LIMITED_TOKEN)}"]
namespaces = ["limited/*"]
rate_limit_per_second = 1
rate_limit_burst = 1
"""


@pytest.fixture(scope="module")
def policy_server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("details-policy")
    (directory / "policy.toml").write_text(POLICY)
    env = {"IDEMPOTENCY_POLICY_FILE": str(directory / "policy.toml")}
    with ServerProcess.start(data_dir=directory, env=env) as server:
        yield server


def unique(prefix: str) -> str:
    return f"{prefix}/py-{uuid.uuid4().hex[:12]}"


def test_unknown_credentials_and_a_namespace_not_granted_say_why(policy_server):
    with IdempotencyClient(policy_server.target, token=f"idem_{secrets.token_hex(32)}") as client:
        with pytest.raises(Unauthenticated) as raised:
            client.get(unique("orders"), "k")
    assert (raised.value.reason, raised.value.domain, raised.value.retry_delay) == ("UNAUTHENTICATED", DOMAIN, None)
    with IdempotencyClient(policy_server.target, token=ORDERS_TOKEN) as client:
        with pytest.raises(PermissionDenied) as raised:
            client.get(unique("billing"), "k")
    assert (raised.value.reason, raised.value.domain, raised.value.retry_delay) == ("PERMISSION_DENIED", DOMAIN, None)


def test_the_rate_limit_says_when_the_next_call_is_allowed(policy_server):
    ns = unique("limited")
    with IdempotencyClient(policy_server.target, token=LIMITED_TOKEN, retry=None) as client:
        with pytest.raises(ResourceExhausted) as raised:
            for index in range(5):  # 1 per second, burst 1: the second or so is refused
                client.get(ns, f"k{index}")
    error = raised.value
    assert (error.reason, error.domain) == ("RATE_LIMITED", DOMAIN)
    assert timedelta(0) < error.retry_delay <= timedelta(seconds=1)


def test_the_client_retries_a_rate_limit_no_sooner_than_the_server_allows(policy_server):
    ns = unique("limited")
    counting = Counting()
    with IdempotencyClient(policy_server.target, token=LIMITED_TOKEN, interceptors=[counting]) as client:
        until(lambda: _refused_once(client, ns), timeout=5, what="an empty bucket")
        before = counting.count("Get", grpc.StatusCode.RESOURCE_EXHAUSTED)
        started = time.monotonic()
        for index in range(2):  # the bucket is empty: each waits for the next token
            assert client.get(ns, f"k{index}").state is State.ABSENT
        elapsed = time.monotonic() - started
    # One refusal per call: its retry waited for RetryInfo's delay, and the
    # policy's own backoff (50 ms, then 100 ms) would have been refused again.
    assert counting.count("Get", grpc.StatusCode.RESOURCE_EXHAUSTED) - before == 2
    assert 1.0 <= elapsed < 4.0


def _refused_once(client, ns):
    """One Get with retries off on the limited identity: True once refused
    (the bucket is empty then)."""
    with IdempotencyClient(client.targets[0], token=LIMITED_TOKEN, retry=None) as probe:
        try:
            probe.get(ns, "probe")
        except ResourceExhausted:
            return True
    return False
