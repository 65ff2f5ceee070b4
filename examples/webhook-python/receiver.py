"""A webhook receiver made exactly-once with idempotency-service.

    WEBHOOK_SECRET=whsec_test IDEMPOTENCY_TARGET=127.0.0.1:50051 \
        uvicorn receiver:app --port 8000

POST /webhooks takes a provider's signed event (a Stripe-like
`Webhook-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<raw body>">`
header) and applies its effect once, however often and however concurrently
the provider delivers it:

  1. Verify the signature over the raw body: 400 without a well-formed
     header, 401 when no v1 matches or t is outside the tolerance. Nothing
     is claimed, nothing changes; no header, however malformed, gets a 500.
  2. Parse the event (400 unless it has an id and a type, and everything the
     key and the effect use is readable).
  3. The event's marker in the receiver's own database, if its effect was
     applied for another body: 409 (the marker outlives the service's record).
  4. Claim derive_key(PROVIDER, event id) with fingerprint(raw body), through
     AsyncIdempotencyClient.once(on_in_progress="raise"):
       CLAIMED               apply the effect in the receiver's own SQLite
                             database, at most once per event id ever (the
                             marker), and Complete with the response: 200.
                             When the marker is there already (an earlier
                             delivery applied it and never completed, or a
                             late delivery after the stored response
                             expired: re-executed while the service remembers
                             the event, or claimed anew once it forgot it),
                             its stored response is completed instead.
       COMPLETED             the stored response, as it was (the replay): 200,
                             with `Idempotent-Replayed: true`.
       IN_PROGRESS           503 with Retry-After (the time left on the other
                             delivery's lease): the provider retries, and
                             by then gets the replay.
       FINGERPRINT_MISMATCH  409: the event id came with another body.
     A handler that raises is Released by once(), and answers 500, so the
     provider's retry runs the handler again.

The effect: for `payment.succeeded` and `invoice.paid`, a row in `payments`
(the event's marker: the body's fingerprint, the fencing token of the newest
lease that used it, and the response it produced), the customer's balance
credited, and a line in the append-only `effect_log`, all in one SQLite
transaction. Other event types are acknowledged and ignored
(200, stored like any other response).

Settings (environment):
  WEBHOOK_SECRET           the shared signing secret (required)
  IDEMPOTENCY_TARGET       host:port of idempotency-service (default 127.0.0.1:50051)
  RECEIVER_DB              the receiver's SQLite file (default ./receiver.db)
  WEBHOOK_PROVIDER         the provider's name in the key (default acmepay)
  WEBHOOK_NAMESPACE        the service namespace (default webhooks)
  WEBHOOK_TOLERANCE_SECONDS  how old (or how far ahead) t may be (default 300)
  WEBHOOK_LEASE_SECONDS    the lease each delivery takes (default 30)
  WEBHOOK_RETENTION_SECONDS  how long the service replays a completed event
                           (default 345600 = 4 days: longer than the provider's
                           automatic retries, e.g. Stripe's 3 days; check your
                           provider). Later deliveries are answered from the
                           marker, which this receiver keeps forever.

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
import re
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


#: t: 1 to 12 ASCII digits (a unix time until the year 33658). str.isdigit()
#: is not enough: it is true for "²" and "١", which int() refuses or reads.
_TIMESTAMP = re.compile(r"[0-9]{1,12}")
#: v1: the hex of an HMAC-SHA256, as the provider writes it.
_V1 = re.compile(r"[0-9a-f]{64}")


def verify_signature(header: Optional[str], body: bytes, secret: bytes, tolerance: float, now: float) -> None:
    """Raise BadSignature (400: no usable header; 401: not signed with our
    secret, or outside the tolerance) unless some v1 matches. Whatever the
    header holds (any characters, any length), the answer is one of these:
    never another exception, so never a 500."""
    if not header:
        raise BadSignature(400, f"missing {SIGNATURE_HEADER} header")
    timestamp: Optional[int] = None
    candidates: List[bytes] = []
    saw_v1 = False
    for part in header.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep:
            raise BadSignature(400, f"malformed {SIGNATURE_HEADER} header")
        if name == "t":
            if not _TIMESTAMP.fullmatch(value):
                raise BadSignature(400, f"malformed {SIGNATURE_HEADER} header: t is not a unix time")
            timestamp = int(value)
        elif name == "v1":
            saw_v1 = True
            # A v1 that is not 64 lowercase hex characters can match nothing;
            # it is skipped rather than compared (compare_digest refuses
            # non-ASCII text with TypeError).
            if _V1.fullmatch(value):
                candidates.append(value.encode("ascii"))
        # Other schemes (v0, future versions) are ignored, as Stripe's libraries do.
    if timestamp is None or not saw_v1:
        raise BadSignature(400, f"malformed {SIGNATURE_HEADER} header: needs t= and v1=")
    expected = sign(secret, body, timestamp).split("v1=", 1)[1].encode("ascii")
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
    -- the fingerprint (hex) of the body that applied the effect: the marker
    -- outlives the service's record, and still tells another body apart
    fingerprint   TEXT NOT NULL,
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


class OtherBody(Exception):
    """The event's marker was written for another body (another fingerprint)."""


@dataclass(frozen=True)
class Applied:
    """What apply_payment did: the response to store, and whether this lease
    applied the effect or found it applied (the marker) and took its response."""

    response: Dict[str, Any]
    #: None: this lease applied the effect. Otherwise the marker's fencing
    #: token as it was found: lower than ours, an earlier lease applied it and
    #: either never completed or completed long ago (a late retry: the Claim
    #: says when, completed_at); equal or higher, either the service forgot
    #: the key (past its horizon the record is deleted and its fencing token
    #: restarts at 1) or a newer lease holder wrote it, and only Complete can
    #: tell which.
    marker_token: Optional[int] = None


def open_db(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=10, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA busy_timeout=10000")
    return conn


def init_db(path: str) -> None:
    with contextlib.closing(open_db(path)) as conn:
        conn.executescript(SCHEMA)


def marker_fingerprint(path: str, event_id: str) -> Optional[str]:
    """The fingerprint of the body that applied the event's effect, or None
    when the effect was never applied here."""
    with contextlib.closing(open_db(path)) as conn:
        row = conn.execute("SELECT fingerprint FROM payments WHERE event_id = ?", (event_id,)).fetchone()
    return row[0] if row else None


def apply_payment(
    path: str, event_id: str, customer: str, amount: int, fp: str, token: int, response: Dict[str, Any]
) -> Applied:
    """Apply the effect at most once per event id, ever, in one transaction,
    and return the response to store: the one this call made, or, when the
    effect is there already, the one stored with it (never a second effect,
    never another amount). The fencing token is recorded, not used to refuse:
    a marker with a higher token than ours is either a newer holder's (our
    Complete will then be refused) or from before the service forgot the key
    (our Complete succeeds); Complete decides, as in the NATS example."""
    with contextlib.closing(open_db(path)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        try:
            inserted = conn.execute(
                "INSERT INTO payments (event_id, customer, amount, fingerprint, fencing_token, response)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (event_id) DO NOTHING",
                (event_id, customer, amount, fp, token, json.dumps(response)),
            ).rowcount
            if inserted:
                # Only the transaction that inserted the marker credits the balance.
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
                return Applied(response)
            # The effect is there already. Answer with its stored response.
            stored_fp, stored_token, stored = conn.execute(
                "SELECT fingerprint, fencing_token, response FROM payments WHERE event_id = ?", (event_id,)
            ).fetchone()
            if stored_fp != fp:
                conn.execute("ROLLBACK")
                raise OtherBody(f"{event_id}: the effect was applied for another body")
            # Record the newest lease that answered from the marker.
            conn.execute(
                "UPDATE payments SET fencing_token = ? WHERE event_id = ? AND fencing_token < ?",
                (token, event_id, token),
            )
            conn.execute("COMMIT")
            return Applied(json.loads(stored), marker_token=stored_token)
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

    async def handle(cfg: Config, event: Dict[str, Any], fp: str, token: int) -> Applied:
        """The work for one event; its response is the stored response."""
        event_id, event_type = event["id"], event["type"]
        if event_type in cfg.slow_types:
            await asyncio.sleep(cfg.slow_seconds)
        if event_id in cfg.fail_before_effect and event_id not in state["failed_once"]:
            state["failed_once"].add(event_id)
            raise SimulatedFailure(f"{event_id}: simulated failure before the effect")
        if event_type not in APPLIED_TYPES:
            return Applied({"status": 200, "body": {"result": "ignored", "event_id": event_id, "type": event_type}})
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
        applied = await asyncio.to_thread(
            apply_payment, cfg.database, event_id, data["customer"], data["amount"], fp, token, response
        )
        if event_id in cfg.fail_after_effect and (event_id, "after") not in state["failed_once"]:
            state["failed_once"].add((event_id, "after"))
            raise SimulatedFailure(f"{event_id}: simulated failure after the effect committed")
        return applied

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
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested beyond the parser's depth
            return error(400, "bad_payload", "the body is not JSON")
        problem = payload_problem(event)
        if problem:
            return error(400, "bad_payload", problem)
        event_id = event["id"]
        fp = fingerprint(raw)

        # The receiver's own marker outlives the service's record: an event
        # whose effect was applied for another body is refused here, before
        # any Claim, however late it comes (once the stored response expired
        # the service re-executes a late delivery without comparing
        # fingerprints, and past the key's horizon it has forgotten it).
        if event["type"] in APPLIED_TYPES:
            marked = await asyncio.to_thread(marker_fingerprint, cfg.database, event_id)
            if marked is not None and marked != fp.hex():
                log.warning("webhook %s: another body than the one whose effect was applied: refused (409)", event_id)
                return error(409, "fingerprint_mismatch", "this event id was delivered with another body", event_id)

        key = derive_key(cfg.provider, event_id)
        applied: Optional[Applied] = None
        try:
            async with client.once(
                cfg.namespace,
                key,
                fingerprint=fp,
                lease_ttl=cfg.lease,
                retention=cfg.retention,
                on_in_progress="raise",
                # Pinned, not left to the namespace or the server: the marker
                # guards the effect, so a late delivery re-executed under the
                # next token applies nothing and answers with the stored
                # response. Refused (EXPIRED), once() would raise
                # ResultExpired and the provider would get a 503, retry by
                # retry, until it gave up.
                late_retry="reexecute",
            ) as run:
                if run.replayed:
                    stored = run.result
                else:
                    applied = await handle(cfg, event, fp.hex(), run.fencing_token)
                    stored = applied.response
                    run.set_result(stored)
        except InProgress as busy:
            return error(
                503,
                "in_progress",
                "another delivery of this event is being processed; retry later",
                event_id,
                headers={"Retry-After": retry_after_seconds(busy.retry_after)},
            )
        except (FingerprintMismatch, OtherBody):
            return error(409, "fingerprint_mismatch", "this event id was delivered with another body", event_id)
        except LeaseLost as lost:
            # Our lease ran out while the handler ran and another delivery
            # took the key over (the heartbeat found it gone, or Complete was
            # refused); nothing was stored by us, the effect is applied at
            # most once whatever happened. The retry gets the other
            # delivery's response.
            log.warning("webhook %s: lease lost to a newer delivery, nothing stored by this one: %s", event_id, lost)
            return error(503, "lease_lost", "the lease ran out while processing; retry", event_id, headers={"Retry-After": "1"})
        except IdempotencyError as failure:
            # The service could not be reached (on Claim or on Complete), or
            # refused the call. If Complete failed after the effect, the lease
            # stays until it runs out; the retry after that finds the effect's
            # marker and answers with its response instead of applying it again.
            log.warning("webhook %s: idempotency-service: %s", event_id, failure)
            return error(503, "unavailable", "deduplication is unavailable; retry", event_id, headers={"Retry-After": "5"})
        except Exception as failure:  # the handler failed: once() Released the key
            log.warning("webhook %s: handler failed: %s", event_id, failure)
            return error(500, "handler_failed", "processing failed; the event will be processed on retry", event_id)

        # Idempotent-Replayed marks an answer an earlier delivery completed:
        # the service's replay, or, once the stored response expired, the
        # marker's. A takeover (an earlier delivery applied the effect and
        # never completed) is the event's first completed answer, and is not
        # marked.
        replayed = applied is None
        # A late retry: the event completed before (completed_at) and its
        # stored response expired; the service remembers the event and
        # re-executed it under the next fencing token (above the marker's).
        late = None if run.replayed else run.claim.completed_at
        if applied is not None and applied.marker_token is not None:
            # Complete accepted our lease, so ours is the key's current one.
            if late is not None:
                replayed = True
                log.warning(
                    "webhook %s: a late delivery after the stored response expired (completed at %s; the service"
                    " remembers the event and re-executed it: fencing token %d now, %d on the marker); answered"
                    " with the stored response, nothing applied. The retention (%d s) is shorter than this"
                    " provider's redelivery window.",
                    event_id, late.isoformat(), run.fencing_token, applied.marker_token, cfg.retention,
                )
            elif applied.marker_token >= run.fencing_token:
                # Within one record, and while the service remembers a key,
                # every lease has a larger token than the ones before; so the
                # record the marker was written under is gone: past its
                # horizon the service deleted it, and the token restarted.
                replayed = True
                log.warning(
                    "webhook %s: a late delivery after the service forgot the event (its record expired and was"
                    " reaped: fencing token %d now, %d on the marker); answered with the stored response,"
                    " nothing applied. The retention (%d s) is shorter than this provider's redelivery window.",
                    event_id, run.fencing_token, applied.marker_token, cfg.retention,
                )
            else:
                log.warning(
                    "webhook %s: an earlier delivery (fencing token %d) applied the effect and never completed;"
                    " completed with its stored response (fencing token %d), nothing applied again",
                    event_id, applied.marker_token, run.fencing_token,
                )
        elif late is not None:
            # No marker (an event type this receiver ignores): handled again.
            log.warning("webhook %s: a late delivery after the stored response expired (completed at %s):"
                        " handled again under fencing token %d", event_id, late.isoformat(), run.fencing_token)
        headers = {REPLAYED_HEADER: "true"} if replayed else None
        return JSONResponse(status_code=stored["status"], content=stored["body"], headers=headers)

    return app


#: The largest amount accepted: what every JSON parser reads exactly (2^53 - 1).
MAX_AMOUNT = 2**53 - 1


def _text_problem(value: Any, name: str) -> Optional[str]:
    if not isinstance(value, str) or not value:
        return f"{name}: must be a non-empty string"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate, from a \ud800 escape
        return f"{name}: must be valid Unicode"
    return None


def payload_problem(event: Any) -> Optional[str]:
    """Why the event cannot be handled (checked before any Claim), or None.
    Everything the key, the fingerprint and the effect will use is checked
    here, so that a delivery the receiver cannot read gets 400, never a 500."""
    if not isinstance(event, dict):
        return "the body is not a JSON object"
    problem = _text_problem(event.get("id"), "id") or _text_problem(event.get("type"), "type")
    if problem:
        return problem
    if event["type"] in APPLIED_TYPES:
        data = event.get("data")
        if not isinstance(data, dict):
            return "data: must be an object"
        problem = _text_problem(data.get("customer"), "data.customer")
        if problem:
            return problem
        amount = data.get("amount")
        if not isinstance(amount, int) or isinstance(amount, bool) or abs(amount) > MAX_AMOUNT:
            return "data.amount: must be an integer (minor units) within +-(2^53 - 1)"
    return None


app = create_app()
