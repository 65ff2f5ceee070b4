"""Replay a recorded burst of deliveries (tests/fixtures/burst.jsonl) against
the receiver running under uvicorn, backed by the real idempotency-service,
and check every answer and the effect: once per event.

Each fixture line is one delivery: the raw body, how it is signed (`sign`:
true, false, {"secret": ...} or {"age_seconds": ...}; or a recorded
`signature` header), its concurrency `group`, an optional `delay_ms` within
the group, and the exact answer expected. Groups run in order; the lines of
one group are fired at once (asyncio.gather). Identical deliveries within a
group are interchangeable (which one wins the Claim is up to the race), so a
group's answers are compared as a multiset per body.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections import Counter, defaultdict
from typing import Any, Dict, List

import httpx

from conftest import HERE, PROVIDER, sign
from idempotency_client import IdempotencyClient, State, derive_key

FIXTURE = HERE / "fixtures" / "burst.jsonl"
LEASE_SECONDS = 10
RECEIVER_ENV = {
    "WEBHOOK_LEASE_SECONDS": str(LEASE_SECONDS),
    "WEBHOOK_TEST_SLOW_TYPES": "invoice.paid",
    "WEBHOOK_TEST_SLOW_SECONDS": "1.5",
    "WEBHOOK_TEST_FAIL_BEFORE_EFFECT": "evt_1005",
    "WEBHOOK_TEST_FAIL_AFTER_EFFECT": "evt_1006",
}


def load_fixture() -> List[Dict[str, Any]]:
    with open(FIXTURE, encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def headers_for(delivery: Dict[str, Any]) -> Dict[str, str]:
    headers = {"Content-Type": "application/json"}
    body = delivery["body"].encode()
    if "signature" in delivery:
        headers["Webhook-Signature"] = delivery["signature"]
        return headers
    how = delivery["sign"]
    if how is False:
        return headers
    if how is True:
        headers["Webhook-Signature"] = sign(body)
    elif "secret" in how:
        headers["Webhook-Signature"] = sign(body, secret=how["secret"])
    elif "age_seconds" in how:
        headers["Webhook-Signature"] = sign(body, timestamp=int(time.time()) - how["age_seconds"])
    else:
        raise ValueError(f"unknown sign: {how!r}")
    return headers


async def deliver(http: httpx.AsyncClient, url: str, delivery: Dict[str, Any]) -> httpx.Response:
    await asyncio.sleep(delivery.get("delay_ms", 0) / 1000)
    return await http.post(f"{url}/webhooks", content=delivery["body"].encode(), headers=headers_for(delivery))


def outcome(response: httpx.Response) -> str:
    """What is compared: status, replayed or not, and the JSON body, canonically."""
    return json.dumps(
        {
            "status": response.status_code,
            "replayed": response.headers.get("Idempotent-Replayed") == "true",
            "body": response.json(),
        },
        sort_keys=True,
    )


def expected(delivery: Dict[str, Any]) -> str:
    expect = delivery["expect"]
    return json.dumps(
        {"status": expect["status"], "replayed": expect.get("replayed", False), "body": expect["body"]},
        sort_keys=True,
    )


def groups_of(deliveries):
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for delivery in deliveries:
        groups.setdefault(delivery["group"], []).append(delivery)
    return groups


async def test_recorded_burst(receiver_factory, idempotency_server):
    receiver = receiver_factory(RECEIVER_ENV)
    deliveries = load_fixture()
    first_answer: Dict[str, bytes] = {}  # event id -> the body of its first 200 (not replayed)
    seen_statuses = Counter()

    async with httpx.AsyncClient(timeout=30) as http:
        for name, group in groups_of(deliveries).items():
            responses = await asyncio.gather(*(deliver(http, receiver.url, d) for d in group))
            got, want = defaultdict(Counter), defaultdict(Counter)
            for delivery, response in zip(group, responses):
                got[delivery["body"]][outcome(response)] += 1
                want[delivery["body"]][expected(delivery)] += 1
                seen_statuses[response.status_code] += 1
                if response.status_code == 503:
                    # The retryable answer says when: the time left on the
                    # first delivery's lease, in whole seconds.
                    retry_after = int(response.headers["Retry-After"])
                    assert 1 <= retry_after <= LEASE_SECONDS, (name, retry_after)
                else:
                    assert "Retry-After" not in response.headers, name
                if response.status_code == 200:
                    event_id = response.json()["event_id"]
                    if response.headers.get("Idempotent-Replayed") == "true":
                        # A replay is the stored response: byte for byte the first one.
                        assert response.content == first_answer[event_id], (name, event_id)
                    else:
                        assert event_id not in first_answer, f"{name}: {event_id} was applied twice"
                        first_answer[event_id] = response.content
            assert dict(got) == dict(want), f"group {name} ({group[0]['note']}): got {dict(got)}"

    # Every kind of answer the receiver gives was exercised.
    assert set(seen_statuses) == {200, 400, 401, 409, 500, 503}, seen_statuses
    assert seen_statuses[503] == 3

    # The effect, in the receiver's own database: once per event.
    with sqlite3.connect(receiver.database) as db:
        log = Counter(event for (event,) in db.execute("SELECT event_id FROM effect_log"))
        payments = dict(db.execute("SELECT event_id, fencing_token FROM payments"))
        balances = dict(db.execute("SELECT customer, balance FROM balances"))
    applied = ["evt_1001", "evt_1002", "evt_1003", "evt_1004", "evt_1005", "evt_1006"]
    assert log == Counter({event: 1 for event in applied}), log
    # evt_1006's row was taken over by the retry's lease (fencing token 2);
    # evt_1005's first attempt failed before writing anything.
    assert payments == {
        "evt_1001": 1, "evt_1002": 1, "evt_1003": 1, "evt_1004": 1, "evt_1005": 2, "evt_1006": 2,
    }, payments
    # 1200 + 3000 (not 9999: the other body was refused), 500 + 250, 700 + 900.
    assert balances == {"cus_A": 4200, "cus_B": 750, "cus_C": 1600}, balances

    # The service's side: every event completed under the documented key.
    with IdempotencyClient(idempotency_server.target) as client:
        for event_id, token in [*payments.items(), ("evt_1007", 1)]:
            record = client.get(receiver.namespace, derive_key(PROVIDER, event_id))
            assert record.state is State.COMPLETED, (event_id, record)
            assert record.fencing_token == token, (event_id, record)
            assert json.loads(record.response)["body"] == json.loads(first_answer[event_id]), event_id
