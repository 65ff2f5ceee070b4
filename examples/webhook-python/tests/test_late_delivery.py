"""A delivery that comes after the event's stored response expired (a 1 s
retention here).

Within remember_for (IDEMPOTENCY_REMEMBER_FOR, 7 days after the Complete by
default) the service remembers the event and re-executes the late delivery:
CLAIMED under the NEXT fencing token, above the marker's, with completed_at.
Past that horizon (IDEMPOTENCY_REMEMBER_FOR=0s here) the reaper deletes the
row and the key's fencing token restarts at 1, below the marker's.

What the receiver must do either way (README, "Late deliveries"): answer the
first such delivery with the stored response (200, `Idempotent-Replayed:
true`), apply nothing, and log the real cause; the same event id with another
body gets 409 and changes nothing, however late.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time

import httpx
import pytest

from conftest import PROVIDER, server_binary, sign
from idempotency_client import IdempotencyClient, State, derive_key
from idempotency_client.testing import ServerProcess

RETENTION_SECONDS = 1


@pytest.fixture
def reaping_server(tmp_path):
    """A server whose reaper runs every 200 ms, on its own embedded store,
    remembering completed events as by default (7 days past their Complete),
    and refusing late retries unless a Claim says otherwise
    (IDEMPOTENCY_LATE_RETRY=refuse): the receiver pins late_retry="reexecute",
    so a late delivery is re-executed whatever the server's or the
    namespace's policy (issue 33, defect 6)."""
    data_dir = tmp_path / "reaping-store"
    data_dir.mkdir()
    env = {"IDEMPOTENCY_REAPER_INTERVAL": "200ms", "IDEMPOTENCY_LATE_RETRY": "refuse"}
    with ServerProcess.start(server_binary(), data_dir=data_dir, env=env) as server:
        server.data_dir = data_dir
        yield server


@pytest.fixture
def forgetting_server(tmp_path):
    """The same, remembering nothing past a response's retention
    (IDEMPOTENCY_REMEMBER_FOR=0s): what any server does past a key's horizon."""
    data_dir = tmp_path / "reaping-store"
    data_dir.mkdir()
    env = {"IDEMPOTENCY_REAPER_INTERVAL": "200ms", "IDEMPOTENCY_REMEMBER_FOR": "0s"}
    with ServerProcess.start(server_binary(), data_dir=data_dir, env=env) as server:
        server.data_dir = data_dir
        yield server


def post(url, body: bytes):
    return httpx.post(f"{url}/webhooks", content=body, timeout=30,
                      headers={"Content-Type": "application/json", "Webhook-Signature": sign(body)})


def wait_until_reaped(server, namespace: str, key: str, timeout: float = 20.0) -> None:
    """Until the record's row is gone from the server's SQLite file (the
    reaper deleted it), not merely expired."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.closing(sqlite3.connect(f"file:{server.data_dir / 'idempotency.db'}?mode=ro", uri=True)) as db:
            rows = db.execute(
                "SELECT count(*) FROM idempotency_records WHERE namespace = ? AND key = ?", (namespace, key)
            ).fetchone()[0]
        if rows == 0:
            return
        assert time.monotonic() < deadline, "the reaper never deleted the expired record"
        time.sleep(0.1)


def wait_until_remembered(server, namespace: str, key: str, token: int, timeout: float = 20.0):
    """Until Get says the event is remembered (its stored response expired:
    ABSENT with remembered_until set) under the last lease's token; its Get."""
    deadline = time.monotonic() + timeout
    with IdempotencyClient(server.target) as client:
        while True:
            record = client.get(namespace, key)
            if record.state is State.ABSENT and record.remembered_until is not None:
                assert record.fencing_token == token, record
                return record
            assert time.monotonic() < deadline, f"the event was never remembered: {record}"
            time.sleep(0.05)


def receiver_state(receiver):
    with sqlite3.connect(receiver.database) as db:
        return {
            "effect_log": db.execute("SELECT event_id, fencing_token FROM effect_log ORDER BY seq").fetchall(),
            "balances": db.execute("SELECT customer, balance FROM balances ORDER BY customer").fetchall(),
            "payments": db.execute("SELECT event_id, amount, fencing_token FROM payments").fetchall(),
        }


def event(event_id: str, amount: int) -> bytes:
    return json.dumps(
        {"id": event_id, "object": "event", "type": "payment.succeeded", "created": 1764625000,
         "data": {"customer": "cus_L", "amount": amount, "currency": "eur"}},
        separators=(",", ":"),
    ).encode()


def first_completed_under_token_2(receiver, body: bytes) -> bytes:
    """The event's first attempt applies the effect and fails (its reply is
    lost: 500, Released); the provider's retry takes the marker over under
    fencing token 2 and completes. The answer the provider got."""
    failed = post(receiver.url, body)
    assert failed.status_code == 500, failed.text
    answer = post(receiver.url, body)
    assert answer.status_code == 200, answer.text
    assert "Idempotent-Replayed" not in answer.headers
    return answer.content


def test_a_late_delivery_within_remember_for_is_re_executed_and_gets_the_stored_answer(
        reaping_server, receiver_factory):
    receiver = receiver_factory(
        {"WEBHOOK_RETENTION_SECONDS": str(RETENTION_SECONDS), "WEBHOOK_TEST_FAIL_AFTER_EFFECT": "evt_5003"},
        target=reaping_server.target,
    )
    body = event("evt_5003", 4100)
    key = derive_key(PROVIDER, "evt_5003")
    first = first_completed_under_token_2(receiver, body)
    before = receiver_state(receiver)
    assert before["payments"] == [("evt_5003", 4100, 2)]

    marker = wait_until_remembered(reaping_server, receiver.namespace, key, 2)

    # The provider redelivers after the stored response expired: the service
    # re-executes it under token 3, the receiver answers from its marker.
    late = post(receiver.url, body)
    assert late.status_code == 200, late.text
    assert late.headers["Idempotent-Replayed"] == "true"
    assert late.content == first
    # Nothing applied again; the marker records the newest lease.
    assert receiver_state(receiver) == {**before, "payments": [("evt_5003", 4100, 3)]}
    with IdempotencyClient(reaping_server.target) as client:
        record = client.get(receiver.namespace, key)
        assert record.state is State.COMPLETED and record.fencing_token == 3
        assert json.loads(record.response)["body"] == json.loads(first)
    log = receiver.log()
    assert (f"webhook evt_5003: a late delivery after the stored response expired (completed at"
            f" {marker.completed_at.isoformat()}; the service remembers the event and re-executed it: fencing token 3"
            " now, 2 on the marker); answered with the stored response, nothing applied. The retention (1 s) is"
            " shorter than this provider's redelivery window.") in log, log
    # Only the retry that took the first lease over was a takeover, not the late delivery.
    assert log.count("webhook evt_5003: an earlier delivery (fencing token 1) applied the effect and never completed") == 1, log
    assert "lease" not in log.lower(), log


def test_a_late_delivery_within_remember_for_with_another_body_is_refused(reaping_server, receiver_factory):
    receiver = receiver_factory({"WEBHOOK_RETENTION_SECONDS": str(RETENTION_SECONDS)}, target=reaping_server.target)
    body = event("evt_5004", 1200)
    key = derive_key(PROVIDER, "evt_5004")
    first = post(receiver.url, body)
    assert first.status_code == 200, first.text
    before = receiver_state(receiver)
    wait_until_remembered(reaping_server, receiver.namespace, key, 1)

    # Refused from the marker before any Claim: the service, which would
    # re-execute it without comparing fingerprints, is not asked.
    other = post(receiver.url, event("evt_5004", 999_999))
    assert other.status_code == 409, other.text
    assert other.json()["error"] == "fingerprint_mismatch"
    assert receiver_state(receiver) == before
    wait_until_remembered(reaping_server, receiver.namespace, key, 1)

    again = post(receiver.url, body)
    assert again.status_code == 200, again.text
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert receiver_state(receiver) == {**before, "payments": [("evt_5004", 1200, 2)]}


def test_a_late_delivery_after_the_service_forgot_the_event_gets_the_stored_answer_first_time(
        forgetting_server, receiver_factory):
    receiver = receiver_factory(
        {"WEBHOOK_RETENTION_SECONDS": str(RETENTION_SECONDS), "WEBHOOK_TEST_FAIL_AFTER_EFFECT": "evt_5001"},
        target=forgetting_server.target,
    )
    body = event("evt_5001", 7300)
    key = derive_key(PROVIDER, "evt_5001")
    first = first_completed_under_token_2(receiver, body)
    assert json.loads(first) == {"result": "applied", "event_id": "evt_5001", "type": "payment.succeeded",
                                 "customer": "cus_L", "amount": 7300, "fencing_token": 1}
    before = receiver_state(receiver)
    assert before["payments"] == [("evt_5001", 7300, 2)]

    wait_until_reaped(forgetting_server, receiver.namespace, key)

    # The provider redelivers, long after (a manual redelivery): one try.
    late = post(receiver.url, body)
    assert late.status_code == 200, late.text
    assert late.headers["Idempotent-Replayed"] == "true"
    assert late.content == first
    # Nothing applied again; the marker keeps its token.
    assert receiver_state(receiver) == before
    # The service remembers the event again: completed under the restarted
    # token, replaying the same response.
    with IdempotencyClient(forgetting_server.target) as client:
        record = client.get(receiver.namespace, key)
        assert record.state is State.COMPLETED and record.fencing_token == 1
        assert json.loads(record.response)["body"] == json.loads(first)
    # The log names the cause: the record was reaped; no lease was lost.
    log = receiver.log()
    assert ("webhook evt_5001: a late delivery after the service forgot the event (its record expired and was"
            " reaped: fencing token 1 now, 2 on the marker); answered with the stored response, nothing applied."
            " The retention (1 s) is shorter than this provider's redelivery window.") in log, log
    assert "lease" not in log.lower(), log


def test_a_late_delivery_after_the_service_forgot_the_event_with_another_body_is_refused(forgetting_server, receiver_factory):
    receiver = receiver_factory({"WEBHOOK_RETENTION_SECONDS": str(RETENTION_SECONDS)}, target=forgetting_server.target)
    body = event("evt_5002", 1100)
    key = derive_key(PROVIDER, "evt_5002")
    first = post(receiver.url, body)
    assert first.status_code == 200, first.text
    before = receiver_state(receiver)
    assert before["balances"] == [("cus_L", 1100)]

    wait_until_reaped(forgetting_server, receiver.namespace, key)

    # The same event id with another amount, after the service forgot it:
    # refused from the receiver's own marker; nothing claimed, nothing applied.
    other = post(receiver.url, event("evt_5002", 999_999))
    assert other.status_code == 409, other.text
    assert other.json() == {"error": "fingerprint_mismatch", "detail": "this event id was delivered with another body",
                            "event_id": "evt_5002"}
    assert receiver_state(receiver) == before
    with IdempotencyClient(forgetting_server.target) as client:
        assert client.get(receiver.namespace, key).state is State.ABSENT
    assert "webhook evt_5002: another body than the one whose effect was applied: refused (409)" in receiver.log()

    # The original body still gets its stored answer, first time.
    again = post(receiver.url, body)
    assert again.status_code == 200, again.text
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert receiver_state(receiver) == before
