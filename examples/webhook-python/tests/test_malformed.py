"""Whatever arrives, the receiver answers 400 or 401 and changes nothing; a
malformed signature header or body never gets a 500. Over HTTP, against the
receiver under uvicorn (headers as raw bytes: Starlette reads them as
Latin-1, so byte 0xB2 arrives as '²')."""

from __future__ import annotations

import json
import sqlite3
import time

import httpx
import pytest

from conftest import sign, start_receiver

NOW = int(time.time())


def effect_log(receiver):
    with sqlite3.connect(receiver.database) as db:
        return db.execute("SELECT event_id FROM effect_log").fetchall()


@pytest.fixture(scope="module")
def receiver(tmp_path_factory, idempotency_server):
    """One receiver for the module: every case here must leave it unchanged."""
    receiver = start_receiver(tmp_path_factory.mktemp("malformed"), idempotency_server.target, {})
    yield receiver
    receiver.stop()


BODY = b'{"id":"evt_6001","type":"payment.succeeded","data":{"customer":"cus_M","amount":10}}'
MAC = sign(BODY).split("v1=")[1]

MALFORMED_HEADERS = [
    (b"t=\xb2,v1=00", 400),
    (b"t=1764620000\xb9,v1=00", 400),
    (b"t=" + b"9" * 5000 + b",v1=00", 400),
    (b"t=\xff\xfe,v1=00", 400),
    (b"t=1e9,v1=00", 400),
    (b",,,", 400),
    (b"v1=" + MAC.encode(), 400),
    (f"t={NOW},v1=".encode() + b"\xe9" * 64, 401),
    (f"t={NOW},v1={MAC[:-2]}".encode() + b"\xc3\xa9", 401),
    (f"t={NOW},v1={MAC.upper()}".encode(), 401),
    (f"t={NOW},v1=".encode(), 401),
]


@pytest.mark.parametrize("header, status", MALFORMED_HEADERS)
def test_a_malformed_signature_header_gets_400_or_401(receiver, header, status):
    response = httpx.post(f"{receiver.url}/webhooks", content=BODY, timeout=30,
                          headers={"Content-Type": "application/json", "Webhook-Signature": header})
    assert response.status_code == status, response.text
    assert response.json()["error"] == "bad_signature"
    assert effect_log(receiver) == []


MALFORMED_BODIES = [
    (b"[" * 100_000, "the body is not JSON"),  # deeper than the parser goes
    (b"\xff\xfe{}", "the body is not JSON"),
    (b'{"id":"\\ud800","type":"payment.succeeded","data":{"customer":"cus_M","amount":1}}', "id: must be valid Unicode"),
    (b'{"id":"evt_6002","type":"payment.succeeded","data":{"customer":"\\udfff","amount":1}}',
     "data.customer: must be valid Unicode"),
    (b'{"id":"evt_6003","type":"payment.succeeded","data":{"customer":"cus_M","amount":' + b"9" * 30 + b"}}",
     "data.amount: must be an integer (minor units) within +-(2^53 - 1)"),
    (b'{"id":"evt_6004","type":"payment.succeeded","data":{"customer":"cus_M","amount":NaN}}',
     "data.amount: must be an integer (minor units) within +-(2^53 - 1)"),
    (b'{"id":"evt_6005","type":"payment.succeeded","data":{"customer":"cus_M","amount":1.5}}',
     "data.amount: must be an integer (minor units) within +-(2^53 - 1)"),
]


@pytest.mark.parametrize("body, detail", MALFORMED_BODIES, ids=range(len(MALFORMED_BODIES)))
def test_a_signed_body_the_receiver_cannot_read_gets_400(receiver, body, detail):
    response = httpx.post(f"{receiver.url}/webhooks", content=body, timeout=30,
                          headers={"Content-Type": "application/json", "Webhook-Signature": sign(body)})
    assert response.status_code == 400, response.text
    assert response.json() == {"error": "bad_payload", "detail": detail}
    assert effect_log(receiver) == []


def test_after_all_that_a_good_delivery_is_applied(receiver):
    for header, _ in MALFORMED_HEADERS:
        httpx.post(f"{receiver.url}/webhooks", content=BODY, timeout=30, headers={"Webhook-Signature": header})
    response = httpx.post(f"{receiver.url}/webhooks", content=BODY, timeout=30,
                          headers={"Content-Type": "application/json", "Webhook-Signature": sign(BODY)})
    assert response.status_code == 200, response.text
    assert json.loads(response.content)["fencing_token"] == 1
    assert effect_log(receiver) == [("evt_6001",)]
