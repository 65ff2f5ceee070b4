"""An HTTP API that honours its clients' Idempotency-Key header, with
idempotency-service: the IETF draft's case (draft-ietf-httpapi-idempotency-
key-header), where the retrying side is a client that chose the key.

    API_KEYS=sk_test_a=acct_a IDEMPOTENCY_TARGET=127.0.0.1:50051 \
        uvicorn app:app --port 8000

POST /v1/charges creates a charge (`{"customer": "cus_1", "amount": 1200,
"currency": "eur"}`) and requires an `Idempotency-Key` header. Per request:

  1. Authenticate (`Authorization: Bearer <api key>`): 401 without. The
     principal names the namespace, `http-api/<principal>`: two clients that
     pick the same key never meet.
  2. The key, from the header: 400 when it is missing or malformed (a
     Structured Field string, `"…"`, or the same characters bare; 1 to 255
     printable ASCII characters). The service's key is
     derive_key("idempotency-key", value).
  3. The body: 400 when it is not a charge (nothing is claimed: a corrected
     request with the same key is a new request).
  4. The fingerprint: fingerprint(key_encoding(method, target, body)), the
     method, the request target as sent (path and query) and the body's bytes,
     length-prefixed so that no two requests encode alike (clients/KEYS.md).
  5. The request's marker in this API's own database, if one was stored for
     another request: 422, before any Claim (the marker outlives the service's
     record).
  6. Claim through AsyncIdempotencyClient.once(on_in_progress="raise"):
       CLAIMED               create the charge and the marker in one
                             transaction (or find the marker: its stored
                             response), Complete with the response. A late
                             retry (the stored answer expired; the service
                             remembers the key and re-executes it, with
                             completed_at) finds the marker: a replay.
       COMPLETED             the stored status, headers and body, with
                             `Idempotent-Replayed: true`.
       IN_PROGRESS           409 with Retry-After: the request is still being
                             processed.
       FINGERPRINT_MISMATCH  422: the key was used for another request.
     The handler's own answers (201, and 402 for a declined charge) are
     stored and replayed; a handler that raises is Released and answers 500,
     so the client's retry with the same key runs it again. The service
     unreachable: 503 with Retry-After.

Settings (environment):
  API_KEYS               comma-separated <api key>=<principal> (required)
  IDEMPOTENCY_TARGET     host:port of idempotency-service (default 127.0.0.1:50051)
  API_DB                 this API's SQLite file (default ./api.db)
  API_LEASE_SECONDS      the lease each request takes (default 30)
  API_RETENTION_SECONDS  how long the service replays a request (default 86400 = 24 h:
                         longer than any client retries; later retries are
                         answered from the marker, kept forever here)
  API_CHARGE_LIMIT       amounts above it are declined with 402 (default 100000)

Fault injection, for the tests; leave unset:
  API_TEST_SLOW_CUSTOMERS     comma-separated customers whose charge sleeps first
  API_TEST_SLOW_SECONDS       how long (default 1.5)
  API_TEST_FAIL_BEFORE_EFFECT comma-separated customers whose first charge fails before the effect
  API_TEST_FAIL_AFTER_EFFECT  comma-separated customers whose first charge fails after it committed
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import math
import os
import re
import sqlite3
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from idempotency_client import (
    AsyncIdempotencyClient,
    FingerprintMismatch,
    IdempotencyError,
    InProgress,
    LeaseLost,
    derive_key,
    fingerprint,
    key_encoding,
)

log = logging.getLogger("http-api")

KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
#: Where a client reads what the key is for: the 400's problem type (a
#: relative URI, resolved against the request's) links here, as the draft asks.
KEY_DOCS = "/docs/idempotency-key"
KEY_DOCS_TEXT = """POST /v1/charges requires an Idempotency-Key header: a value of your
choosing, unique per operation (a UUID), sent again unchanged with every retry
of that operation, as a Structured Field string ("...") or bare; 1 to 255
printable ASCII characters. A retry gets the first answer again, marked
Idempotent-Replayed: true. 409 (with Retry-After): the first request is still
being processed. 422: the key was used for another request. Keys are per API
key, and remembered for good.
"""
#: The stored response keeps these headers (and the status and body); not Date, Server, ...
REPLAYED_HEADERS = ("content-type", "location")
MAX_KEY_LENGTH = 255
MAX_AMOUNT = 2**53 - 1


def _csv(name: str) -> frozenset:
    return frozenset(item.strip() for item in os.environ.get(name, "").split(",") if item.strip())


def key_digest(api_key: str) -> bytes:
    """What the API keeps of an API key: its SHA-256. Compared in constant
    time by principal_for(); the same length whatever the key's."""
    return hashlib.sha256(api_key.encode("utf-8", "surrogateescape")).digest()


def principal_for(api_keys: Tuple[Tuple[bytes, str], ...], presented: str) -> Optional[str]:
    """The principal whose API key was presented, or None. In constant time:
    the presented key's digest is compared with every configured digest by
    hmac.compare_digest, with no early exit, so the time taken does not tell
    how much of a key was right, nor which key matched (a dict lookup, or
    ==, stops at the first differing byte)."""
    digest = key_digest(presented)
    found: Optional[str] = None
    for candidate, principal in api_keys:
        if hmac.compare_digest(digest, candidate):
            found = principal
    return found


@dataclass(frozen=True)
class Config:
    #: (SHA-256 of an API key, its principal): never the keys themselves.
    api_keys: Tuple[Tuple[bytes, str], ...]
    target: str
    database: str
    lease: float
    retention: float
    charge_limit: int
    slow_customers: frozenset
    slow_seconds: float
    fail_before_effect: frozenset
    fail_after_effect: frozenset

    @classmethod
    def from_env(cls) -> "Config":
        keys: Dict[bytes, str] = {}
        for entry in os.environ.get("API_KEYS", "").split(","):
            api_key, sep, principal = entry.strip().partition("=")
            if sep and api_key and principal:
                keys[key_digest(api_key)] = principal
        if not keys:
            raise RuntimeError("API_KEYS is not set (<api key>=<principal>, comma-separated)")
        return cls(
            api_keys=tuple(keys.items()),
            target=os.environ.get("IDEMPOTENCY_TARGET", "127.0.0.1:50051"),
            database=os.environ.get("API_DB", "api.db"),
            lease=float(os.environ.get("API_LEASE_SECONDS", "30")),
            retention=float(os.environ.get("API_RETENTION_SECONDS", str(24 * 3600))),
            charge_limit=int(os.environ.get("API_CHARGE_LIMIT", "100000")),
            slow_customers=_csv("API_TEST_SLOW_CUSTOMERS"),
            slow_seconds=float(os.environ.get("API_TEST_SLOW_SECONDS", "1.5")),
            fail_before_effect=_csv("API_TEST_FAIL_BEFORE_EFFECT"),
            fail_after_effect=_csv("API_TEST_FAIL_AFTER_EFFECT"),
        )


# --- the request: principal, key, fingerprint ---------------------------------


class BadKey(Exception):
    pass


_SF_STRING = re.compile(r'"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"')
_BARE_KEY = re.compile(r"[\x21-\x7e]+")


def parse_idempotency_key(header: Optional[str]) -> str:
    """The key's value: a Structured Field string (RFC 8941, as the draft
    says: `"8e03978e-…"`), or, as many clients send it, the same characters
    without quotes. 1 to 255 printable ASCII characters."""
    if header is None:
        raise BadKey(f"this request requires an {KEY_HEADER} header")
    header = header.strip(" \t")
    if header in ("", '""'):
        raise BadKey(f"{KEY_HEADER}: must not be empty")
    quoted = _SF_STRING.fullmatch(header)
    if quoted:
        value = re.sub(r'\\(["\\])', r"\1", quoted.group(1))
    elif header.startswith('"'):
        raise BadKey(f"{KEY_HEADER}: a malformed quoted string")
    elif _BARE_KEY.fullmatch(header):
        value = header
    else:
        raise BadKey(f"{KEY_HEADER}: printable ASCII characters only")
    if not 1 <= len(value) <= MAX_KEY_LENGTH:
        raise BadKey(f"{KEY_HEADER}: 1 to {MAX_KEY_LENGTH} characters")
    return value


def request_fingerprint(method: str, target: bytes, body: bytes) -> bytes:
    """What makes two requests the same request: the method, the target as
    sent (path and query, percent-encoded as they came) and the body's bytes.
    The length-prefixed, typed encoding of derive_key (clients/KEYS.md),
    hashed by fingerprint() as bytes."""
    return fingerprint(key_encoding("http-request/v1", method, target, body))


def request_target(request: Request) -> bytes:
    target = request.scope.get("raw_path") or request.url.path.encode()
    query = request.scope.get("query_string") or b""
    return target + (b"?" + query if query else b"")


# --- the effect, in the API's own database -------------------------------------

SCHEMA = """
CREATE TABLE IF NOT EXISTS charges (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    principal  TEXT NOT NULL,
    customer   TEXT NOT NULL,
    amount     INTEGER NOT NULL,
    currency   TEXT NOT NULL,
    status     TEXT NOT NULL
);
-- One row per (principal, key) whose request was carried out: its
-- fingerprint and the response it produced, written with the effect. It makes
-- the effect happen at most once per key, and answers a retry after the
-- service's record is gone.
CREATE TABLE IF NOT EXISTS idempotent_requests (
    namespace     TEXT NOT NULL,
    key           TEXT NOT NULL,
    fingerprint   TEXT NOT NULL,
    fencing_token INTEGER NOT NULL,
    response      TEXT NOT NULL,
    PRIMARY KEY (namespace, key)
);
"""


class OtherRequest(Exception):
    """The key's marker was written for another request."""


def open_db(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=10, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA busy_timeout=10000")
    return conn


def init_db(path: str) -> None:
    with contextlib.closing(open_db(path)) as conn:
        conn.executescript(SCHEMA)


def marker_fingerprint(path: str, namespace: str, key: str) -> Optional[str]:
    with contextlib.closing(open_db(path)) as conn:
        row = conn.execute(
            "SELECT fingerprint FROM idempotent_requests WHERE namespace = ? AND key = ?", (namespace, key)
        ).fetchone()
    return row[0] if row else None


def create_charge(
    path: str, namespace: str, key: str, fp: str, token: int, principal: str, charge: Dict[str, Any], limit: int
) -> Tuple[Dict[str, Any], Optional[int]]:
    """Carry the request out once per key, in one transaction: the charge
    (or the decline) and the marker with the response. Returns the response
    to store and, when the marker was there already, its fencing token (its
    response is returned: nothing is done again)."""
    with contextlib.closing(open_db(path)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        try:
            found = conn.execute(
                "SELECT fingerprint, fencing_token, response FROM idempotent_requests WHERE namespace = ? AND key = ?",
                (namespace, key),
            ).fetchone()
            if found:
                stored_fp, stored_token, stored = found
                if stored_fp != fp:
                    raise OtherRequest(f"{key}: the key was used for another request")
                conn.execute(
                    "UPDATE idempotent_requests SET fencing_token = ? WHERE namespace = ? AND key = ? AND fencing_token < ?",
                    (token, namespace, key, token),
                )
                conn.execute("COMMIT")
                return json.loads(stored), stored_token
            if charge["amount"] > limit:
                body = {"type": "about:blank", "title": "card declined", "status": 402,
                        "detail": f"amount {charge['amount']} is above the limit {limit}"}
                response = {"status": 402, "headers": {"content-type": "application/problem+json"},
                            "body": json.dumps(body, separators=(",", ":"))}
            else:
                charge_id = conn.execute(
                    "INSERT INTO charges (principal, customer, amount, currency, status) VALUES (?, ?, ?, ?, 'succeeded')",
                    (principal, charge["customer"], charge["amount"], charge["currency"]),
                ).lastrowid
                body = {"id": f"ch_{charge_id}", "customer": charge["customer"], "amount": charge["amount"],
                        "currency": charge["currency"], "status": "succeeded"}
                response = {"status": 201,
                            "headers": {"content-type": "application/json", "location": f"/v1/charges/ch_{charge_id}"},
                            "body": json.dumps(body, separators=(",", ":"))}
            conn.execute(
                "INSERT INTO idempotent_requests (namespace, key, fingerprint, fencing_token, response) VALUES (?, ?, ?, ?, ?)",
                (namespace, key, fp, token, json.dumps(response)),
            )
            conn.execute("COMMIT")
            return response, None
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise


def read_charge(path: str, principal: str, charge_id: int) -> Optional[Dict[str, Any]]:
    with contextlib.closing(open_db(path)) as conn:
        row = conn.execute(
            "SELECT id, customer, amount, currency, status FROM charges WHERE id = ? AND principal = ?",
            (charge_id, principal),
        ).fetchone()
    if row is None:
        return None
    return {"id": f"ch_{row[0]}", "customer": row[1], "amount": row[2], "currency": row[3], "status": row[4]}


# --- the app -------------------------------------------------------------------


class SimulatedFailure(RuntimeError):
    pass


def problem(status: int, title: str, detail: str, headers: Optional[Dict[str, str]] = None,
            type_: str = "about:blank") -> JSONResponse:
    """An RFC 9457 problem, as the draft suggests for its errors."""
    return JSONResponse(status_code=status, content={"type": type_, "title": title, "status": status, "detail": detail},
                        media_type="application/problem+json", headers=headers)


def stored_response(stored: Dict[str, Any], replayed: bool) -> Response:
    headers = dict(stored["headers"])
    if replayed:
        headers[REPLAYED_HEADER] = "true"
    media_type = headers.pop("content-type", None)
    return Response(content=stored["body"].encode(), status_code=stored["status"], headers=headers, media_type=media_type)


def charge_problem(charge: Any) -> Optional[str]:
    if not isinstance(charge, dict):
        return "the body is not a JSON object"
    for name in ("customer", "currency"):
        value = charge.get(name)
        if not isinstance(value, str) or not value or not value.isascii():
            return f"{name}: a non-empty ASCII string is required"
    amount = charge.get("amount")
    if not isinstance(amount, int) or isinstance(amount, bool) or not 1 <= amount <= MAX_AMOUNT:
        return "amount: an integer from 1 to 2^53 - 1 (minor units) is required"
    return None


def create_app(config: Optional[Config] = None) -> FastAPI:
    state: Dict[str, Any] = {"failed_once": set()}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        cfg = config or Config.from_env()
        init_db(cfg.database)
        state["config"] = cfg
        async with AsyncIdempotencyClient(cfg.target, timeout=5.0) as client:
            state["client"] = client
            yield

    app = FastAPI(title="HTTP API with Idempotency-Key (idempotency-service example)", lifespan=lifespan)

    def principal_of(request: Request) -> Optional[str]:
        scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        return principal_for(state["config"].api_keys, token.strip())

    async def charge_once(cfg: Config, namespace: str, key: str, fp: str, token: int, principal: str,
                          charge: Dict[str, Any]) -> Tuple[Dict[str, Any], Optional[int]]:
        customer = charge["customer"]
        if customer in cfg.slow_customers:
            await asyncio.sleep(cfg.slow_seconds)
        if customer in cfg.fail_before_effect and (customer, "before") not in state["failed_once"]:
            state["failed_once"].add((customer, "before"))
            raise SimulatedFailure(f"{customer}: simulated failure before the effect")
        result = await asyncio.to_thread(create_charge, cfg.database, namespace, key, fp, token, principal, charge,
                                         cfg.charge_limit)
        if customer in cfg.fail_after_effect and (customer, "after") not in state["failed_once"]:
            state["failed_once"].add((customer, "after"))
            raise SimulatedFailure(f"{customer}: simulated failure after the effect committed")
        return result

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    @app.get(KEY_DOCS)
    async def key_docs():
        return Response(content=KEY_DOCS_TEXT, media_type="text/plain")

    @app.get("/v1/charges/{charge_id}")
    async def get_charge(charge_id: str, request: Request):
        principal = principal_of(request)
        if principal is None:
            return problem(401, "unauthenticated", "send Authorization: Bearer <api key>")
        found = None
        if re.fullmatch(r"ch_[0-9]{1,18}", charge_id):
            found = await asyncio.to_thread(read_charge, state["config"].database, principal, int(charge_id[3:]))
        if found is None:
            return problem(404, "not found", f"no charge {charge_id}")
        return found

    @app.post("/v1/charges")
    async def post_charge(request: Request):
        cfg: Config = state["config"]
        client: AsyncIdempotencyClient = state["client"]
        principal = principal_of(request)
        if principal is None:
            return problem(401, "unauthenticated", "send Authorization: Bearer <api key>")
        try:
            key_value = parse_idempotency_key(request.headers.get(KEY_HEADER))
        except BadKey as bad:
            return problem(400, "Idempotency-Key is missing or malformed", str(bad), type_=KEY_DOCS)
        raw = await request.body()
        try:
            charge = json.loads(raw)
        except (ValueError, RecursionError):
            return problem(400, "bad request", "the body is not JSON")
        bad_charge = charge_problem(charge)
        if bad_charge:
            return problem(400, "bad request", bad_charge)

        namespace = f"http-api/{principal}"
        key = derive_key("idempotency-key", key_value)
        fp = request_fingerprint(request.method, request_target(request), raw)
        mismatch = problem(422, "Idempotency-Key reused",
                           "this key was used for another request (another method, path, query or body)")

        marked = await asyncio.to_thread(marker_fingerprint, cfg.database, namespace, key)
        if marked is not None and marked != fp.hex():
            return mismatch

        marker_token: Optional[int] = None
        try:
            # late_retry pinned, not left to the namespace or the server: the
            # marker guards the charge, so a late retry re-executed under the
            # next token charges nothing and answers with the stored response.
            # Refused (EXPIRED), once() would raise ResultExpired: a 503 for
            # every retry of that key.
            async with client.once(namespace, key, fingerprint=fp, lease_ttl=cfg.lease, retention=cfg.retention,
                                   on_in_progress="raise", late_retry="reexecute") as run:
                if run.replayed:
                    stored = run.result
                else:
                    stored, marker_token = await charge_once(cfg, namespace, key, fp.hex(), run.fencing_token,
                                                             principal, charge)
                    run.set_result(stored)
        except InProgress as busy:
            seconds = busy.retry_after.total_seconds() if busy.retry_after is not None else 1.0
            return problem(409, "request in progress", "a request with this key is being processed; retry later",
                           headers={"Retry-After": str(max(1, math.ceil(seconds)))})
        except (FingerprintMismatch, OtherRequest):
            return mismatch
        except LeaseLost as lost:
            # Our lease ran out and a retry of the same request took it over:
            # that one is being processed.
            log.warning("%s %s: lease lost to a retry of the same request: %s", namespace, key_value, lost)
            return problem(409, "request in progress", "a retry of this request is being processed; retry later",
                           headers={"Retry-After": "1"})
        except IdempotencyError as failure:
            log.warning("%s %s: idempotency-service: %s", namespace, key_value, failure)
            return problem(503, "unavailable", "retry later with the same Idempotency-Key", headers={"Retry-After": "5"})
        except Exception as failure:  # the handler failed: once() Released the key
            log.warning("%s %s: handler failed: %s", namespace, key_value, failure)
            return problem(500, "internal error", "the request failed; retry it with the same Idempotency-Key")

        # Replayed: the service's stored answer, or, once it expired, the
        # marker's: for a late retry the service re-executed (completed_at
        # set: the request completed before; the token goes on counting, above
        # the marker's), or once the service forgot the key (past its horizon
        # the record is deleted and the fencing token restarts, at or below
        # the marker's). A marker under an older token otherwise is the first
        # completion of a request that failed after its effect: not a replay.
        late = None if run.replayed else run.claim.completed_at
        if late is not None:
            log.warning("%s %s: a late retry after the stored answer expired (completed at %s), re-executed under"
                        " fencing token %d; %s", namespace, key_value, late.isoformat(), run.fencing_token,
                        "answered from the marker" if marker_token is not None else "no marker: carried out again")
        replayed = run.replayed or (
            marker_token is not None and (late is not None or marker_token >= run.fencing_token))
        return stored_response(stored, replayed)

    return app


app = create_app()
