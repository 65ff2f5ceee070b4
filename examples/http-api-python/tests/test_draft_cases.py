"""The Idempotency-Key draft's cases (draft-ietf-httpapi-idempotency-key-header),
against the API under uvicorn and the real idempotency-service:

- a request with a key is carried out once; a retry gets the stored status,
  headers and body again, marked `Idempotent-Replayed: true`;
- a missing key where required: 400, with a link to the documentation;
- a key reused for another request (body, path or query): 422;
- a retry while the first request is still processed: 409 with Retry-After;
- keys belong to a client: another client's same key is another request.

And what the draft leaves to the server, as this example decides it: the key
as a Structured Field string or bare, a failure released for a retry, a
failure after the effect completed once by the retry, a stored 4xx replayed,
the service unreachable, and a late retry after the stored answer expired:
while the service remembers the key (re-executed under the next fencing
token) and after it forgot it (token 1 again).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
import uuid

import httpx
import pytest

from conftest import LEASE_SECONDS, server_binary
from idempotency_client import IdempotencyClient, State, derive_key
from idempotency_client.testing import ServerProcess, free_port


def charge(customer: str, amount: int = 1200) -> bytes:
    return json.dumps({"customer": customer, "amount": amount, "currency": "eur"}, separators=(",", ":")).encode()


def post(api, body: bytes, key=None, *, client: str = "sk_test_a", path: str = "/v1/charges", timeout: float = 30):
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {client}"}
    if key is not None:
        headers["Idempotency-Key"] = key
    return httpx.post(f"{api.url}{path}", content=body, headers=headers, timeout=timeout)


def new_key() -> str:
    return str(uuid.uuid4())


def charges_of(api, customer: str):
    with contextlib.closing(sqlite3.connect(api.database)) as db:
        return db.execute("SELECT id, principal, amount FROM charges WHERE customer = ? ORDER BY id", (customer,)).fetchall()


def record(target: str, principal: str, key: str):
    with IdempotencyClient(target) as client:
        return client.get(f"http-api/{principal}", derive_key("idempotency-key", key))


def same_answer(first: httpx.Response, again: httpx.Response) -> None:
    """The replay: the same status, the stored headers and the same body bytes."""
    assert again.status_code == first.status_code
    assert again.content == first.content
    for name in ("content-type", "location"):
        assert again.headers.get(name) == first.headers.get(name), name


def test_the_first_request_is_carried_out_and_a_retry_gets_the_same_answer_marked_replayed(api):
    key = new_key()
    first = post(api, charge("cus_one"), key)
    assert first.status_code == 201, first.text
    assert first.headers["content-type"] == "application/json"
    assert "Idempotent-Replayed" not in first.headers
    created = first.json()
    assert created == {"id": created["id"], "customer": "cus_one", "amount": 1200, "currency": "eur", "status": "succeeded"}
    assert first.headers["location"] == f"/v1/charges/{created['id']}"

    again = post(api, charge("cus_one"), key)
    same_answer(first, again)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert len(charges_of(api, "cus_one")) == 1
    fetched = httpx.get(f"{api.url}{first.headers['location']}", headers={"Authorization": "Bearer sk_test_a"})
    assert fetched.json() == created


def test_a_missing_key_is_a_400_that_links_to_the_documentation(api):
    response = post(api, charge("cus_nokey"))
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem == {"type": "/docs/idempotency-key", "title": "Idempotency-Key is missing or malformed",
                       "status": 400, "detail": "this request requires an Idempotency-Key header"}
    docs = httpx.get(f"{api.url}{problem['type']}")
    assert docs.status_code == 200 and "Idempotency-Key" in docs.text
    assert charges_of(api, "cus_nokey") == []


@pytest.mark.parametrize(
    "key",
    [b"", b'""', b'"unterminated', b'"bad \\x escape"', b"two words", b"caf\xe9", b"k" * 256, b'"' + b"k" * 256 + b'"'],
    ids=["empty", "empty-string", "unterminated", "bad-escape", "space", "latin1", "256-bare", "256-quoted"],
)
def test_a_malformed_key_is_a_400_and_changes_nothing(api, key):
    customer = f"cus_badkey_{uuid.uuid4().hex[:8]}"
    response = post(api, charge(customer), key)
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "/docs/idempotency-key"
    assert charges_of(api, customer) == []


def test_a_key_reused_for_another_request_is_a_422_and_changes_nothing(api, idempotency_server):
    key = new_key()
    first = post(api, charge("cus_reuse", 1200), key)
    assert first.status_code == 201
    # Another body, the same body on another target (a query added), the same
    # body with other bytes (spacing): each is another request.
    for other in (
        post(api, charge("cus_reuse", 9900), key),
        post(api, charge("cus_reuse", 1200), key, path="/v1/charges?expand=customer"),
        post(api, charge("cus_reuse", 1200).replace(b",", b", "), key),
    ):
        assert other.status_code == 422, other.text
        assert other.headers["content-type"] == "application/problem+json"
        assert other.json()["title"] == "Idempotency-Key reused"
    assert [amount for _, _, amount in charges_of(api, "cus_reuse")] == [1200]
    # The first request still replays.
    same_answer(first, post(api, charge("cus_reuse", 1200), key))
    assert record(idempotency_server.target, "acct_a", key).state is State.COMPLETED


def test_a_retry_while_the_first_request_is_processed_is_a_409_with_retry_after(api, idempotency_server):
    key = new_key()
    answers = {}
    first = threading.Thread(target=lambda: answers.update(first=post(api, charge("cus_slow"), key)))
    first.start()
    deadline = time.monotonic() + 10
    while record(idempotency_server.target, "acct_a", key).state is not State.IN_PROGRESS:
        assert time.monotonic() < deadline, "the first request never claimed its key"
        time.sleep(0.02)
    concurrent = post(api, charge("cus_slow"), key)
    assert concurrent.status_code == 409, concurrent.text
    assert concurrent.headers["content-type"] == "application/problem+json"
    assert concurrent.json()["title"] == "request in progress"
    assert 1 <= int(concurrent.headers["Retry-After"]) <= LEASE_SECONDS
    first.join(30)
    assert answers["first"].status_code == 201
    later = post(api, charge("cus_slow"), key)
    same_answer(answers["first"], later)
    assert later.headers["Idempotent-Replayed"] == "true"
    assert len(charges_of(api, "cus_slow")) == 1


def test_keys_belong_to_a_client_so_another_clients_same_key_is_another_request(api):
    key = new_key()
    a = post(api, charge("cus_shared"), key, client="sk_test_a")
    b = post(api, charge("cus_shared"), key, client="sk_test_b")
    assert (a.status_code, b.status_code) == (201, 201)
    assert "Idempotent-Replayed" not in b.headers
    assert a.json()["id"] != b.json()["id"]
    assert [principal for _, principal, _ in charges_of(api, "cus_shared")] == ["acct_a", "acct_b"]
    same_answer(a, post(api, charge("cus_shared"), key, client="sk_test_a"))
    # Without a known API key there is no client, and no namespace: 401.
    assert post(api, charge("cus_shared"), key, client="sk_unknown").status_code == 401


def test_a_quoted_key_and_the_same_characters_bare_are_one_key(api):
    key = new_key()
    first = post(api, charge("cus_quoted"), f'"{key}"')
    assert first.status_code == 201
    again = post(api, charge("cus_quoted"), key)
    same_answer(first, again)
    assert again.headers["Idempotent-Replayed"] == "true"
    escaped = post(api, charge("cus_quoted2"), '"a\\"b"')  # the key a"b
    assert escaped.status_code == 201
    assert post(api, charge("cus_quoted2"), 'a"b').headers["Idempotent-Replayed"] == "true"


def test_a_failed_request_is_released_and_its_retry_with_the_same_key_carries_it_out(api, idempotency_server):
    key = new_key()
    failed = post(api, charge("cus_fail_before"), key)
    assert failed.status_code == 500
    assert failed.json()["detail"] == "the request failed; retry it with the same Idempotency-Key"
    assert record(idempotency_server.target, "acct_a", key).state is State.RELEASED
    assert charges_of(api, "cus_fail_before") == []
    retry = post(api, charge("cus_fail_before"), key)
    assert retry.status_code == 201
    assert "Idempotent-Replayed" not in retry.headers
    assert len(charges_of(api, "cus_fail_before")) == 1


def test_a_request_that_failed_after_its_effect_is_completed_once_by_its_retry(api, idempotency_server):
    key = new_key()
    failed = post(api, charge("cus_fail_after"), key)
    assert failed.status_code == 500
    [(charge_id, _, _)] = charges_of(api, "cus_fail_after")  # the effect committed
    retry = post(api, charge("cus_fail_after"), key)
    assert retry.status_code == 201
    # The first completed answer: the charge the failed attempt made, not a second one.
    assert retry.json()["id"] == f"ch_{charge_id}"
    assert "Idempotent-Replayed" not in retry.headers
    assert len(charges_of(api, "cus_fail_after")) == 1
    got = record(idempotency_server.target, "acct_a", key)
    assert got.state is State.COMPLETED and got.fencing_token == 2
    same_answer(retry, post(api, charge("cus_fail_after"), key))


def test_a_declined_charge_is_stored_and_replayed_as_the_same_402(api):
    key = new_key()
    declined = post(api, charge("cus_big", 150_000), key)
    assert declined.status_code == 402
    assert declined.headers["content-type"] == "application/problem+json"
    assert declined.json()["title"] == "card declined"
    again = post(api, charge("cus_big", 150_000), key)
    same_answer(declined, again)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert charges_of(api, "cus_big") == []


def test_a_body_that_is_not_a_charge_is_a_400_and_claims_nothing(api, idempotency_server):
    key = new_key()
    for body in (b"not json", b"[" * 100_000, b'{"customer":"cus_x","amount":1.5,"currency":"eur"}',
                 b'{"customer":"cus_x","amount":' + b"9" * 30 + b',"currency":"eur"}', b'{"customer":"\\ud800","amount":1,"currency":"eur"}'):
        response = post(api, body, key)
        assert response.status_code == 400, (body[:40], response.text)
    assert record(idempotency_server.target, "acct_a", key).state is State.ABSENT
    # The corrected request with the same key is carried out.
    assert post(api, charge("cus_x"), key).status_code == 201


def test_without_the_service_the_api_answers_503_and_changes_nothing(api_factory):
    api = api_factory(f"127.0.0.1:{free_port()}")  # nothing listens there
    response = post(api, charge("cus_down"), new_key())
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "5"
    assert charges_of(api, "cus_down") == []


def remembered(target: str, principal: str, key: str, token: int):
    """The key's Get once the service remembers it (its stored answer
    expired: ABSENT with remembered_until set), else None."""
    got = record(target, principal, key)
    if got.state is State.ABSENT and got.remembered_until is not None:
        assert got.fencing_token == token, got
        return got
    return None


def wait_remembered(target: str, principal: str, key: str, token: int, timeout: float = 20):
    deadline = time.monotonic() + timeout
    while True:
        got = remembered(target, principal, key, token)
        if got is not None:
            return got
        assert time.monotonic() < deadline, "the service never remembered the key"
        time.sleep(0.05)


def test_a_late_retry_within_remember_for_is_re_executed_and_gets_the_stored_answer(api_factory, idempotency_server):
    """The stored answer expired (a 1 s retention) and the service remembers
    the key (7 days by default): a retry is re-executed under the next
    fencing token, with completed_at; the marker answers it as a replay, on
    the first try. Another request under the key is 422, from the marker."""
    api = api_factory(idempotency_server.target, {"API_RETENTION_SECONDS": "1"})
    key = new_key()
    first = post(api, charge("cus_late_r"), key)
    assert first.status_code == 201
    marker = wait_remembered(idempotency_server.target, "acct_a", key, 1)
    late = post(api, charge("cus_late_r"), key)
    same_answer(first, late)
    assert late.headers["Idempotent-Replayed"] == "true"
    assert len(charges_of(api, "cus_late_r")) == 1
    got = record(idempotency_server.target, "acct_a", key)
    assert got.state is State.COMPLETED and got.fencing_token == 2
    assert (f"http-api/acct_a {key}: a late retry after the stored answer expired (completed at"
            f" {marker.completed_at.isoformat()}), re-executed under fencing token 2; answered from the marker") in api.log()
    wait_remembered(idempotency_server.target, "acct_a", key, 2)
    assert post(api, charge("cus_late_r", 5), key).status_code == 422
    assert len(charges_of(api, "cus_late_r")) == 1
    assert remembered(idempotency_server.target, "acct_a", key, 2)  # refused before any Claim


def test_a_retry_after_the_service_forgot_the_key_gets_the_stored_answer(tmp_path, api_factory):
    """The record expired (a 1 s retention) on a server that remembers nothing
    past it (IDEMPOTENCY_REMEMBER_FOR=0s, as any server past a key's horizon),
    and the reaper deleted it: the fencing token restarts at 1 and the marker
    answers, on the first try; another request under the key is 422."""
    data_dir = tmp_path / "reaping-store"
    data_dir.mkdir()
    env = {"IDEMPOTENCY_REAPER_INTERVAL": "200ms", "IDEMPOTENCY_REMEMBER_FOR": "0s"}
    with ServerProcess.start(server_binary(), data_dir=data_dir, env=env) as server:
        api = api_factory(server.target, {"API_RETENTION_SECONDS": "1"})
        key = new_key()
        first = post(api, charge("cus_late"), key)
        assert first.status_code == 201
        deadline = time.monotonic() + 20
        while True:
            with contextlib.closing(sqlite3.connect(f"file:{data_dir / 'idempotency.db'}?mode=ro", uri=True)) as db:
                if db.execute("SELECT count(*) FROM idempotency_records").fetchone()[0] == 0:
                    break
            assert time.monotonic() < deadline, "the reaper never deleted the expired record"
            time.sleep(0.1)
        late = post(api, charge("cus_late"), key)
        same_answer(first, late)
        assert late.headers["Idempotent-Replayed"] == "true"
        assert len(charges_of(api, "cus_late")) == 1
        got = record(server.target, "acct_a", key)
        assert got.state is State.COMPLETED and got.fencing_token == 1
        assert post(api, charge("cus_late", 5), key).status_code == 422
        assert len(charges_of(api, "cus_late")) == 1
