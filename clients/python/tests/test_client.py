"""The five RPCs through IdempotencyClient: typed results for every outcome and
state, and a typed error for every status a caller can act on."""

import re
import secrets
from datetime import datetime, timedelta, timezone

import pytest

from idempotency_client import (
    IdempotencyClient,
    InvalidArgument,
    KeyNotFound,
    LeaseNotCurrent,
    Outcome,
    State,
    Unavailable,
)
from idempotency_client.testing import free_port


def now():
    return datetime.now(timezone.utc)


@pytest.mark.postgres
def test_a_claim_on_a_new_key_is_claimed_with_a_token_and_fencing_token_one(client, namespace):
    claim = client.claim(namespace, "k", lease_ttl=30, retention=timedelta(minutes=5))

    assert claim.outcome is Outcome.CLAIMED
    assert claim.claimed
    assert re.fullmatch(r"[0-9a-f]{32}", claim.lease_token)
    assert claim.fencing_token == 1
    assert now() < claim.lease_expires_at <= now() + timedelta(seconds=31)
    assert claim.expires_at > claim.lease_expires_at
    assert claim.response is None
    assert claim.retry_after is None


@pytest.mark.postgres
def test_a_claim_while_another_lease_is_live_is_in_progress_with_retry_after(client, other_client, namespace):
    first = client.claim(namespace, "k", lease_ttl=30)

    second = other_client.claim(namespace, "k", lease_ttl=30)

    assert second.outcome is Outcome.IN_PROGRESS
    assert second.lease_token is None
    assert second.fencing_token is None
    assert timedelta(0) < second.retry_after <= timedelta(seconds=30)
    assert second.lease_expires_at == first.lease_expires_at


@pytest.mark.postgres
def test_a_completed_key_replays_the_stored_response(client, other_client, namespace):
    claim = client.claim(namespace, "k")
    completed = client.complete(namespace, "k", claim.lease_token, b'{"ok":true}', retention=60)

    replay = other_client.claim(namespace, "k")

    assert replay.outcome is Outcome.COMPLETED
    assert replay.response == b'{"ok":true}'
    assert replay.expires_at == completed.expires_at
    assert now() < completed.expires_at <= now() + timedelta(seconds=61)
    assert replay.lease_token is None


def test_an_empty_response_replays_as_empty_bytes_not_none(client, namespace):
    claim = client.claim(namespace, "k")
    client.complete(namespace, "k", claim.lease_token)

    assert client.claim(namespace, "k").response == b""


def test_a_repeated_complete_returns_ok_and_keeps_the_first_response(client, namespace):
    claim = client.claim(namespace, "k")
    first = client.complete(namespace, "k", claim.lease_token, b"first")

    again = client.complete(namespace, "k", claim.lease_token, b"second")

    assert again.expires_at == first.expires_at
    assert client.get(namespace, "k").response == b"first"


@pytest.mark.postgres
def test_a_different_fingerprint_is_a_mismatch_and_changes_nothing(client, namespace):
    claim = client.claim(namespace, "k", fingerprint=b"\x01" * 32)
    client.complete(namespace, "k", claim.lease_token, b"done")

    mismatch = client.claim(namespace, "k", fingerprint=b"\x02" * 32)

    assert mismatch.outcome is Outcome.FINGERPRINT_MISMATCH
    assert mismatch.response is None and mismatch.lease_token is None
    record = client.get(namespace, "k")
    assert record.state is State.COMPLETED
    assert record.fingerprint == b"\x01" * 32
    assert client.claim(namespace, "k", fingerprint=b"\x01" * 32).outcome is Outcome.COMPLETED
    assert client.claim(namespace, "k").outcome is Outcome.COMPLETED  # empty: don't check


def test_release_makes_the_key_claimable_again_with_the_next_fencing_token(client, namespace):
    first = client.claim(namespace, "k")
    client.release(namespace, "k", first.lease_token)

    second = client.claim(namespace, "k")

    assert second.outcome is Outcome.CLAIMED
    assert second.fencing_token == 2
    assert second.lease_token != first.lease_token


def test_extend_lease_moves_the_lease_expiry_forward(client, namespace):
    claim = client.claim(namespace, "k", lease_ttl=2)

    extended = client.extend_lease(namespace, "k", claim.lease_token, lease_ttl=60)

    assert extended.lease_expires_at > claim.lease_expires_at
    assert extended.lease_expires_at > now() + timedelta(seconds=50)


def test_get_reports_each_state_of_a_record(client, namespace):
    assert client.get(namespace, "k").state is State.ABSENT
    assert client.get(namespace, "k").fencing_token is None

    claim = client.claim(namespace, "k", fingerprint=b"fp")
    in_progress = client.get(namespace, "k")
    assert in_progress.state is State.IN_PROGRESS
    assert in_progress.fencing_token == 1
    assert in_progress.fingerprint == b"fp"
    assert in_progress.lease_expires_at == claim.lease_expires_at
    assert in_progress.response is None
    assert in_progress.created_at <= in_progress.updated_at

    client.release(namespace, "k", claim.lease_token)
    assert client.get(namespace, "k").state is State.RELEASED

    claim = client.claim(namespace, "k")
    client.complete(namespace, "k", claim.lease_token, b"r")
    completed = client.get(namespace, "k")
    assert completed.state is State.COMPLETED
    assert completed.response == b"r"
    assert completed.fencing_token == 2


def test_complete_on_an_unknown_key_raises_key_not_found(client, namespace):
    with pytest.raises(KeyNotFound) as raised:
        client.complete(namespace, "never-claimed", secrets.token_hex(16), b"x")
    assert raised.value.code.name == "NOT_FOUND"


def test_complete_with_a_token_that_is_not_current_raises_lease_not_current(client, namespace):
    client.claim(namespace, "k")

    with pytest.raises(LeaseNotCurrent):
        client.complete(namespace, "k", secrets.token_hex(16), b"x")


def test_release_after_complete_raises_lease_not_current(client, namespace):
    claim = client.claim(namespace, "k")
    client.complete(namespace, "k", claim.lease_token, b"x")

    with pytest.raises(LeaseNotCurrent):
        client.release(namespace, "k", claim.lease_token)


def test_extend_lease_on_an_unknown_key_raises_key_not_found(client, namespace):
    with pytest.raises(KeyNotFound):
        client.extend_lease(namespace, "nope", secrets.token_hex(16))


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda c, ns: c.claim("", "k"), "namespace"),
        (lambda c, ns: c.claim("n" * 129, "k"), "namespace"),
        (lambda c, ns: c.claim(ns, ""), "key"),
        (lambda c, ns: c.claim(ns, "k" * 513), "key"),
        (lambda c, ns: c.claim(ns, "a\0b"), "key"),
        (lambda c, ns: c.claim(ns, "k", fingerprint=b"f" * 65), "fingerprint"),
        (lambda c, ns: c.claim(ns, "k", lease_ttl=0.5), "lease_ttl"),
        (lambda c, ns: c.claim(ns, "k", retention=timedelta(days=31)), "retention"),
        (lambda c, ns: c.complete(ns, "k", "not-a-token", b""), "lease_token"),
        (lambda c, ns: c.release(ns, "k", ""), "lease_token"),
    ],
    ids=[
        "empty namespace", "long namespace", "empty key", "long key", "NUL in key",
        "long fingerprint", "short lease", "long retention", "malformed token", "empty token",
    ],
)
def test_invalid_arguments_raise_invalid_argument_naming_the_field(client, namespace, call, field):
    with pytest.raises(InvalidArgument) as raised:
        call(client, namespace)
    assert field in str(raised.value)
    assert isinstance(raised.value, ValueError)


def test_an_unreachable_server_raises_unavailable():
    with IdempotencyClient(f"127.0.0.1:{free_port()}", timeout=2) as client:
        with pytest.raises(Unavailable):
            client.claim("ns", "k")


def test_a_fingerprint_must_be_bytes(client, namespace):
    with pytest.raises(TypeError, match="fingerprint"):
        client.claim(namespace, "k", fingerprint="abc")
