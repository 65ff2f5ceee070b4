"""A webhook receiver made exactly-once with idempotency-service.

    WEBHOOK_SECRET=whsec_test IDEMPOTENCY_TARGET=127.0.0.1:50051 \
        uvicorn receiver:app --port 8000

POST /webhooks takes a provider's signed event (a Stripe-like
`Webhook-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<raw body>">`
header) and applies its effect once, however often and however concurrently
the provider delivers it:

  1. Verify the signature over the raw body: 400 without a well-formed
     header, 401 when no v1 matches or t is outside the tolerance. Nothing
     is claimed, nothing changes.
  2. Parse the event (400 unless it has an id and a type).
  3. Claim derive_key(PROVIDER, event id) with fingerprint(raw body), through
     AsyncIdempotencyClient.once(on_in_progress="raise"):
       CLAIMED               apply the effect in the receiver's own SQLite
                             database, guarded by the fencing token, and
                             Complete with the response: 200.
       COMPLETED             the stored response, as it was (the replay): 200,
                             with `Idempotent-Replayed: true`.
       IN_PROGRESS           503 with Retry-After (the time left on the other
                             delivery's lease): the provider retries, and
                             by then gets the replay.
       FINGERPRINT_MISMATCH  409: the event id came with another body.
     A handler that raises is Released by once(), and answers 500, so the
     provider's retry runs the handler again.

The effect: for `payment.succeeded` and `invoice.paid`, a row in `payments`
(the event's marker, its fencing token and the response it produced), the
customer's balance credited, and a line in the append-only `effect_log`, all
in one SQLite transaction. Other event types are acknowledged and ignored
(200, stored like any other response).

Settings (environment):
  WEBHOOK_SECRET           the shared signing secret (required)
  IDEMPOTENCY_TARGET       host:port of idempotency-service (default 127.0.0.1:50051)
  RECEIVER_DB              the receiver's SQLite file (default ./receiver.db)
  WEBHOOK_PROVIDER         the provider's name in the key (default acmepay)
  WEBHOOK_NAMESPACE        the service namespace (default webhooks)
  WEBHOOK_TOLERANCE_SECONDS  how old (or how far ahead) t may be (default 300)
  WEBHOOK_LEASE_SECONDS    the lease each delivery takes (default 30)
  WEBHOOK_RETENTION_SECONDS  how long a completed event is remembered
                           (default 345600 = 4 days: longer than the provider's
                           retry window, e.g. Stripe's 3 days; check your provider)

Fault injection, for the tests and for trying things out; leave unset:
  WEBHOOK_TEST_SLOW_TYPES        comma-separated event types whose handler sleeps first
  WEBHOOK_TEST_SLOW_SECONDS      how long (default 1.5)
  WEBHOOK_TEST_FAIL_BEFORE_EFFECT  comma-separated event ids whose first attempt
                                 fails before the effect (a downstream outage)
  WEBHOOK_TEST_FAIL_AFTER_EFFECT   comma-separated event ids whose first attempt
                                 fails after the effect committed (the reply lost)
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
import sqlite3
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from idempotency_client import (
    AsyncIdempotencyClient,
    FingerprintMismatch,
    IdempotencyError,
    InProgress,
    LeaseLost,
    derive_key,
    fingerprint,
)

log = logging.getLogger("webhook-receiver")

SIGNATURE_HEADER = "Webhook-Signature"
REPLAYED_HEADER = "Idempotent-Replayed"

#: Event types whose effect this receiver applies; others are acknowledged.
APPLIED_TYPES = ("payment.succeeded", "invoice.paid")


def _csv(name: str) -> frozenset:
    return frozenset(item.strip() for item in os.environ.get(name, "").split(",") if item.strip())


@dataclass(frozen=True)
class Config:
    secret: bytes
    target: str
    database: str
    provider: str
    namespace: str
    tolerance: float
    lease: float
    retention: float
    slow_types: frozenset
    slow_seconds: float
    fail_before_effect: frozenset
    fail_after_effect: frozenset

    @classmethod
    def from_env(cls) -> "Config":
        secret = os.environ.get("WEBHOOK_SECRET")
        if not secret:
            raise RuntimeError("WEBHOOK_SECRET is not set: the receiver cannot verify signatures")
        return cls(
            secret=secret.encode(),
            target=os.environ.get("IDEMPOTENCY_TARGET", "127.0.0.1:50051"),
            database=os.environ.get("RECEIVER_DB", "receiver.db"),
            provider=os.environ.get("WEBHOOK_PROVIDER", "acmepay"),
            namespace=os.environ.get("WEBHOOK_NAMESPACE", "webhooks"),
            tolerance=float(os.environ.get("WEBHOOK_TOLERANCE_SECONDS", "300")),
            lease=float(os.environ.get("WEBHOOK_LEASE_SECONDS", "30")),
            retention=float(os.environ.get("WEBHOOK_RETENTION_SECONDS", str(4 * 24 * 3600))),
            slow_types=_csv("WEBHOOK_TEST_SLOW_TYPES"),
            slow_seconds=float(os.environ.get("WEBHOOK_TEST_SLOW_SECONDS", "1.5")),
            fail_before_effect=_csv("WEBHOOK_TEST_FAIL_BEFORE_EFFECT"),
            fail_after_effect=_csv("WEBHOOK_TEST_FAIL_AFTER_EFFECT"),
        )


# --- signature -------------------------------------------------------------


class BadSignature(Exception):
    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


def sign(secret: bytes, body: bytes, timestamp: int) -> str:
    """The header value a provider sends: t=<timestamp>,v1=<hex HMAC-SHA256 of "t.body">."""
    mac = hmac.new(secret, str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify_signature(header: Optional[str], body: bytes, secret: bytes, tolerance: float, now: float) -> None:
    """Raise BadSignature (400: no usable header; 401: not signed with our
    secret, or outside the tolerance) unless some v1 matches."""
    if not header:
        raise BadSignature(400, f"missing {SIGNATURE_HEADER} header")
    timestamp: Optional[int] = None
    candidates: List[str] = []
    for part in header.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep:
            raise BadSignature(400, f"malformed {SIGNATURE_HEADER} header")
        if name == "t":
            if not value.isdigit():
                raise BadSignature(400, f"malformed {SIGNATURE_HEADER} header: t is not a unix time")
            timestamp = int(value)
        elif name == "v1":
            candidates.append(value)
        # Other schemes (v0, future versions) are ignored, as Stripe's libraries do.
    if timestamp is None or not candidates:
        raise BadSignature(400, f"malformed {SIGNATURE_HEADER} header: needs t= and v1=")
    expected = sign(secret, body, timestamp).split("v1=", 1)[1]
    # Several v1 values are allowed (a provider rolling its secret sends both).
    if not any(hmac.compare_digest(expected, candidate) for candidate in candidates):
        raise BadSignature(401, "signature does not match")
    if abs(now - timestamp) > tolerance:
        # Checked after the MAC so that an attacker learns nothing from it; a
        # captured delivery replayed later than the tolerance is refused.
        raise BadSignature(401, "timestamp outside the tolerance")


# --- the effect, in the receiver's own database ------------------------------

SCHEMA = """
CREATE TABLE IF NOT EXISTS payments (
    event_id      TEXT PRIMARY KEY,
    customer      TEXT NOT NULL,
    amount        INTEGER NOT NULL,
    fencing_token INTEGER NOT NULL,
    response      TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS balances (
    customer TEXT PRIMARY KEY,
    balance  INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS effect_log (
    seq           INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id      TEXT NOT NULL,
    fencing_token INTEGER NOT NULL,
    applied_at    REAL NOT NULL
);
"""


class StaleLease(Exception):
    """A newer lease holder (a larger fencing token) got to the effect first."""


def open_db(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=10, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA busy_timeout=10000")
    return conn


def init_db(path: str) -> None:
    with contextlib.closing(open_db(path)) as conn:
        conn.executescript(SCHEMA)


def apply_payment(path: str, event_id: str, customer: str, amount: int, token: int, response: Dict[str, Any]) -> Dict[str, Any]:
    """Apply the effect once, in one transaction, guarded by the fencing token.
    Returns the response to store: the one this call made, or, when an
    earlier lease holder already applied the effect (its Complete never
    landed), the one that holder made."""
    with contextlib.closing(open_db(path)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        try:
            inserted = conn.execute(
                "INSERT INTO payments (event_id, customer, amount, fencing_token, response)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (event_id) DO NOTHING",
                (event_id, customer, amount, token, json.dumps(response)),
            ).rowcount
            if inserted:
                conn.execute(
                    "INSERT INTO balances (customer, balance) VALUES (?, ?)"
                    " ON CONFLICT (customer) DO UPDATE SET balance = balance + excluded.balance",
                    (customer, amount),
                )
                conn.execute(
                    "INSERT INTO effect_log (event_id, fencing_token, applied_at) VALUES (?, ?, ?)",
                    (event_id, token, time.time()),
                )
                conn.execute("COMMIT")
                return response
            # The effect is there already: an earlier holder applied it and
            # then failed (or crashed) before Complete. Take the row over, if
            # our lease is the newer one, and answer with its response.
            taken = conn.execute(
                "UPDATE payments SET fencing_token = ? WHERE event_id = ? AND fencing_token < ?",
                (token, event_id, token),
            ).rowcount
            if not taken:
                conn.execute("ROLLBACK")
                raise StaleLease(f"{event_id}: a lease newer than fencing token {token} applied it")
            stored = conn.execute("SELECT response FROM payments WHERE event_id = ?", (event_id,)).fetchone()[0]
            conn.execute("COMMIT")
            return json.loads(stored)
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise


# --- the app ---------------------------------------------------------------


class SimulatedFailure(RuntimeError):
    pass


def error(status: int, code: str, detail: str, event_id: Optional[str] = None, headers=None) -> JSONResponse:
    body: Dict[str, Any] = {"error": code, "detail": detail}
    if event_id is not None:
        body["event_id"] = event_id
    return JSONResponse(status_code=status, content=body, headers=headers)


def retry_after_seconds(retry_after) -> str:
    seconds = retry_after.total_seconds() if retry_after is not None else 1.0
    return str(max(1, math.ceil(seconds)))


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

    app = FastAPI(title="webhook receiver (idempotency-service example)", lifespan=lifespan)

    async def handle(cfg: Config, event: Dict[str, Any], token: int) -> Dict[str, Any]:
        """The work for one event; its return value is the stored response."""
        event_id, event_type = event["id"], event["type"]
        if event_type in cfg.slow_types:
            await asyncio.sleep(cfg.slow_seconds)
        if event_id in cfg.fail_before_effect and event_id not in state["failed_once"]:
            state["failed_once"].add(event_id)
            raise SimulatedFailure(f"{event_id}: simulated failure before the effect")
        if event_type not in APPLIED_TYPES:
            return {"status": 200, "body": {"result": "ignored", "event_id": event_id, "type": event_type}}
        data = event["data"]
        response = {
            "status": 200,
            "body": {
                "result": "applied",
                "event_id": event_id,
                "type": event_type,
                "customer": data["customer"],
                "amount": data["amount"],
                "fencing_token": token,
            },
        }
        stored = await asyncio.to_thread(
            apply_payment, cfg.database, event_id, data["customer"], data["amount"], token, response
        )
        if event_id in cfg.fail_after_effect and (event_id, "after") not in state["failed_once"]:
            state["failed_once"].add((event_id, "after"))
            raise SimulatedFailure(f"{event_id}: simulated failure after the effect committed")
        return stored

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    @app.post("/webhooks")
    async def webhook(request: Request):
        cfg: Config = state["config"]
        client: AsyncIdempotencyClient = state["client"]
        raw = await request.body()

        try:
            verify_signature(request.headers.get(SIGNATURE_HEADER), raw, cfg.secret, cfg.tolerance, time.time())
        except BadSignature as bad:
            return error(bad.status, "bad_signature", bad.reason)
        try:
            event = json.loads(raw)
        except ValueError:
            return error(400, "bad_payload", "the body is not JSON")
        problem = payload_problem(event)
        if problem:
            return error(400, "bad_payload", problem)
        event_id = event["id"]

        key = derive_key(cfg.provider, event_id)
        try:
            async with client.once(
                cfg.namespace,
                key,
                fingerprint=fingerprint(raw),
                lease_ttl=cfg.lease,
                retention=cfg.retention,
                on_in_progress="raise",
            ) as run:
                if run.replayed:
                    stored, replayed = run.result, True
                else:
                    stored, replayed = await handle(cfg, event, run.fencing_token), False
                    run.set_result(stored)
        except InProgress as busy:
            return error(
                503,
                "in_progress",
                "another delivery of this event is being processed; retry later",
                event_id,
                headers={"Retry-After": retry_after_seconds(busy.retry_after)},
            )
        except FingerprintMismatch:
            return error(409, "fingerprint_mismatch", "this event id was delivered with another body", event_id)
        except (LeaseLost, StaleLease) as lost:
            # Our lease ran out while the handler ran, and another delivery
            # took over; nothing was stored by us. The provider's retry gets
            # the other delivery's response.
            log.warning("webhook %s: %s", event_id, lost)
            return error(503, "lease_lost", "the lease ran out while processing; retry", event_id, headers={"Retry-After": "1"})
        except IdempotencyError as failure:
            # The service could not be reached (on Claim or on Complete), or
            # refused the call. If Complete failed after the effect, the lease
            # stays until it runs out; the retry after that takes the effect's
            # row over (fencing token) instead of applying it again.
            log.warning("webhook %s: idempotency-service: %s", event_id, failure)
            return error(503, "unavailable", "deduplication is unavailable; retry", event_id, headers={"Retry-After": "5"})
        except Exception as failure:  # the handler failed: once() Released the key
            log.warning("webhook %s: handler failed: %s", event_id, failure)
            return error(500, "handler_failed", "processing failed; the event will be processed on retry", event_id)

        headers = {REPLAYED_HEADER: "true"} if replayed else None
        return JSONResponse(status_code=stored["status"], content=stored["body"], headers=headers)

    return app


def payload_problem(event: Any) -> Optional[str]:
    """Why the event cannot be handled (checked before any Claim), or None."""
    if not isinstance(event, dict):
        return "the body is not a JSON object"
    if not isinstance(event.get("id"), str) or not event["id"]:
        return "id: must be a non-empty string"
    if not isinstance(event.get("type"), str) or not event["type"]:
        return "type: must be a non-empty string"
    if event["type"] in APPLIED_TYPES:
        data = event.get("data")
        if not isinstance(data, dict):
            return "data: must be an object"
        if not isinstance(data.get("customer"), str) or not data["customer"]:
            return "data.customer: must be a non-empty string"
        if not isinstance(data.get("amount"), int) or isinstance(data["amount"], bool):
            return "data.amount: must be an integer (minor units)"
    return None


app = create_app()
