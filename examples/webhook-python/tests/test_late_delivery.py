"""A delivery that comes after the service forgot the event: its record
expired (a 1 s retention here) and the server's reaper deleted the row, so the
key's fencing token restarts at 1, below the token on the receiver's marker.

What the receiver must do (README, "Late deliveries"): answer the first such
delivery with the stored response (200, `Idempotent-Replayed: true`), apply
nothing, and log the real cause; the same event id with another body gets 409
and changes nothing, however late.
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
    """A server whose reaper runs every 200 ms, on its own embedded store."""
    data_dir = tmp_path / "reaping-store"
    data_dir.mkdir()
    with ServerProcess.start(server_binary(), data_dir=data_dir, env={"IDEMPOTENCY_REAPER_INTERVAL": "200ms"}) as server:
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


def test_a_late_delivery_after_the_record_was_reaped_gets_the_stored_answer_first_time(reaping_server, receiver_factory):
    receiver = receiver_factory(
        {"WEBHOOK_RETENTION_SECONDS": str(RETENTION_SECONDS), "WEBHOOK_TEST_FAIL_AFTER_EFFECT": "evt_5001"},
        target=reaping_server.target,
    )
    body = event("evt_5001", 7300)
    key = derive_key(PROVIDER, "evt_5001")
    first = first_completed_under_token_2(receiver, body)
    assert json.loads(first) == {"result": "applied", "event_id": "evt_5001", "type": "payment.succeeded",
                                 "customer": "cus_L", "amount": 7300, "fencing_token": 1}
    before = receiver_state(receiver)
    assert before["payments"] == [("evt_5001", 7300, 2)]

    wait_until_reaped(reaping_server, receiver.namespace, key)

    # The provider redelivers, long after (a manual redelivery): one try.
    late = post(receiver.url, body)
    assert late.status_code == 200, late.text
    assert late.headers["Idempotent-Replayed"] == "true"
    assert late.content == first
    # Nothing applied again; the marker keeps its token.
    assert receiver_state(receiver) == before
    # The service remembers the event again: completed under the restarted
    # token, replaying the same response.
    with IdempotencyClient(reaping_server.target) as client:
        record = client.get(receiver.namespace, key)
        assert record.state is State.COMPLETED and record.fencing_token == 1
        assert json.loads(record.response)["body"] == json.loads(first)
    # The log names the cause: the record was reaped; no lease was lost.
    log = receiver.log()
    assert ("webhook evt_5001: a late delivery after the service forgot the event (its record expired and was"
            " reaped: fencing token 1 now, 2 on the marker); answered with the stored response, nothing applied."
            " The retention (1 s) is shorter than this provider's redelivery window.") in log, log
    assert "lease" not in log.lower(), log


def test_a_late_delivery_with_another_body_is_refused_and_applies_nothing(reaping_server, receiver_factory):
    receiver = receiver_factory({"WEBHOOK_RETENTION_SECONDS": str(RETENTION_SECONDS)}, target=reaping_server.target)
    body = event("evt_5002", 1100)
    key = derive_key(PROVIDER, "evt_5002")
    first = post(receiver.url, body)
    assert first.status_code == 200, first.text
    before = receiver_state(receiver)
    assert before["balances"] == [("cus_L", 1100)]

    wait_until_reaped(reaping_server, receiver.namespace, key)

    # The same event id with another amount, after the service forgot it:
    # refused from the receiver's own marker, as the service would while it
    # remembered; nothing claimed, nothing applied.
    other = post(receiver.url, event("evt_5002", 999_999))
    assert other.status_code == 409, other.text
    assert other.json() == {"error": "fingerprint_mismatch", "detail": "this event id was delivered with another body",
                            "event_id": "evt_5002"}
    assert receiver_state(receiver) == before
    with IdempotencyClient(reaping_server.target) as client:
        assert client.get(receiver.namespace, key).state is State.ABSENT
    assert "webhook evt_5002: another body than the one whose effect was applied: refused (409)" in receiver.log()

    # The original body still gets its stored answer, first time.
    again = post(receiver.url, body)
    assert again.status_code == 200, again.text
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert receiver_state(receiver) == before
