"""Every error path of the service, with its google.rpc details decoded by
two languages' stock gRPC libraries: grpcio with grpcio-status
(grpc_status.rpc_status.from_call, google.rpc.error_details_pb2) in Python,
and @grpc/grpc-js with the google.rpc protos (protobufjs) in Node
(node_errors.js). Each case is also made through both helpers (retries off),
whose typed errors must say the same.

Every case asserts the code, ErrorInfo's reason and domain, and RetryInfo's
presence (and delay) or absence, exactly; INVALID_ARGUMENT its FieldViolation,
KEY_EXPIRED its metadata. The servers are real:
  - the embedded store with a policy file (identities, a rate limit): the
    key's refusals, UNAUTHENTICATED, PERMISSION_DENIED, RATE_LIMITED;
  - two on one PostgreSQL database behind a TCP relay (tcp_relay.py): cut,
    the store is unreachable (STORE_UNAVAILABLE); stalled, a call outlasts
    the server's call timeout (DEADLINE_EXCEEDED, IDEMPOTENCY_CALL_TIMEOUT=1s)
    and, where IDEMPOTENCY_MAX_CONCURRENT_CALLS=2, two Claims stuck on the
    store hold every slot (OVERLOADED).
Not covered: ABORTED/CONTENDED (a key that keeps changing under a Claim
cannot be provoked on cue) and INTERNAL (a bug).

Run by clients/cross-language-test.sh, which builds both clients first.
"""

import hashlib
import json
import pathlib
import secrets
import subprocess
import time
import urllib.parse
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import grpc
import pytest
from google.protobuf import json_format
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from idempotency_client import (
    IdempotencyClient,
    IdempotencyError,
    InvalidArgument,
    ResourceExhausted,
    new_lease_token,
)
from idempotency_client._proto import idempotency_pb2 as pb
from idempotency_client.testing import (
    ServerProcess,
    create_postgres_database,
    drop_postgres_database,
)
from tcp_relay import TcpRelay

NODE_ERRORS = pathlib.Path(__file__).with_name("node_errors.js")
SERVICE = "/idempotency.v1.IdempotencyService/"
DOMAIN = "idempotency-service"

REQUESTS = {
    "Claim": (pb.ClaimRequest, pb.ClaimResponse),
    "Complete": (pb.CompleteRequest, pb.CompleteResponse),
    "Release": (pb.ReleaseRequest, pb.ReleaseResponse),
    "ExtendLease": (pb.ExtendLeaseRequest, pb.ExtendLeaseResponse),
    "Get": (pb.GetRequest, pb.GetResponse),
}

# --- the two sides ---------------------------------------------------------------


def decode(error: grpc.RpcError) -> dict:
    """A failed call's status and its google.rpc details, decoded by
    grpcio-status, in the shape node_errors.js reports too."""
    out = {
        "code": error.code().name,
        "message": error.details(),
        "reason": None,
        "domain": None,
        "metadata": {},
        "retryDelayMs": None,
        "fieldViolations": None,
        "detailsCode": None,
        "detailTypes": [],
    }
    status = rpc_status.from_call(error)  # raises if it disagrees with the status line
    if status is None:
        return out
    out["detailsCode"] = next(code.name for code in grpc.StatusCode if code.value[0] == status.code)
    for detail in status.details:
        name = detail.type_url.rsplit("/", 1)[-1]
        out["detailTypes"].append(name)
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            out.update(reason=info.reason, domain=info.domain, metadata=dict(info.metadata))
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            out["retryDelayMs"] = retry.retry_delay.ToTimedelta().total_seconds() * 1000
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            out["fieldViolations"] = [[v.field, v.description] for v in bad.field_violations]
    return out


def raw_call(case: dict) -> grpc.RpcError:
    """The case's call with grpcio alone (its own channel); the error it failed with."""
    request_type, response_type = REQUESTS[case["method"]]
    request = json_format.ParseDict(case["request"], request_type())
    metadata = (("authorization", f"Bearer {case['token']}"),) if case.get("token") else None
    with grpc.insecure_channel(case["target"]) as channel:
        call = channel.unary_unary(
            SERVICE + case["method"],
            request_serializer=request_type.SerializeToString,
            response_deserializer=response_type.FromString,
        )
        for _ in range(case.get("repeat", 1)):
            try:
                call(request, timeout=case.get("timeoutMs", 10_000) / 1000, metadata=metadata)
            except grpc.RpcError as error:
                return error
    raise AssertionError(f"{case['method']} succeeded")


def helper_call(case: dict) -> dict:
    """The case's call through the Python client (retries off): its typed error."""
    r = case["request"]
    with IdempotencyClient(
        case["target"], token=case.get("token"), retry=None, timeout=case.get("timeoutMs", 10_000) / 1000
    ) as client:
        calls = {
            "Claim": lambda: client.claim(r["namespace"], r["key"], lease_token=r.get("leaseToken")),
            "Complete": lambda: client.complete(r["namespace"], r["key"], r["leaseToken"], b""),
            "Release": lambda: client.release(r["namespace"], r["key"], r["leaseToken"]),
            "ExtendLease": lambda: client.extend_lease(r["namespace"], r["key"], r["leaseToken"]),
            "Get": lambda: client.get(r["namespace"], r["key"]),
        }
        for _ in range(case.get("repeat", 1)):
            try:
                calls[case["method"]]()
            except IdempotencyError as error:
                return {
                    "name": type(error).__name__,
                    "code": error.code.name,
                    "reason": error.reason,
                    "domain": error.domain,
                    "metadata": dict(error.metadata),
                    "retryDelayMs": None if error.retry_delay is None else error.retry_delay.total_seconds() * 1000,
                    "field": error.field,
                }
    raise AssertionError(f"{case['method']} succeeded through the client")


def python_side(case: dict) -> dict:
    return {"status": decode(raw_call(case)), "helper": helper_call(case)}


def node_side(cases: list) -> list:
    done = subprocess.run(
        ["node", str(NODE_ERRORS), json.dumps(cases)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# --- what each case must say ---------------------------------------------------------

#: The helpers' class for each reason, the same name in Python and TypeScript.
HELPER_CLASS = {
    "INVALID_ARGUMENT": "InvalidArgument",
    "NOT_FOUND": "KeyNotFound",
    "KEY_EXPIRED": "KeyExpired",
    "LEASE_LOST": "LeaseNotCurrent",
    "LEASE_RELEASED": "LeaseNotCurrent",
    "KEY_COMPLETED": "LeaseNotCurrent",
    "UNAUTHENTICATED": "Unauthenticated",
    "PERMISSION_DENIED": "PermissionDenied",
    "RATE_LIMITED": "ResourceExhausted",
    "OVERLOADED": "ResourceExhausted",
    "STORE_UNAVAILABLE": "Unavailable",
    "DEADLINE_EXCEEDED": "Unavailable",
}


def check(side: str, seen: dict, code: str, reason: str, retry_delay_ms, metadata=None, field=None, violation=None):
    """One side's report of one case against what the service must say.
    retry_delay_ms: None (no RetryInfo), a number (exactly), or a (low, high] range."""
    where = f"{side} {reason}"
    status, helper = seen["status"], seen["helper"]
    assert (status["code"], status["detailsCode"]) == (code, code), (where, status)
    assert (status["reason"], status["domain"]) == (reason, DOMAIN), (where, status)
    expected_types = ["google.rpc.ErrorInfo"]
    if retry_delay_ms is not None:
        expected_types.append("google.rpc.RetryInfo")
    if violation is not None:
        expected_types.append("google.rpc.BadRequest")
    assert sorted(status["detailTypes"]) == sorted(expected_types), (where, status)
    assert status["metadata"] == (metadata or {}), (where, status)
    assert status["fieldViolations"] == ([list(violation)] if violation else None), (where, status)
    assert (helper["name"], helper["code"], helper["reason"], helper["domain"]) == (
        HELPER_CLASS[reason],
        code,
        reason,
        DOMAIN,
    ), (where, helper)
    assert helper["metadata"] == (metadata or {}), (where, helper)
    assert helper["field"] == field, (where, helper)
    for delay in (status["retryDelayMs"], helper["retryDelayMs"]):
        if isinstance(retry_delay_ms, tuple):
            low, high = retry_delay_ms
            assert delay is not None and low < delay <= high, (where, delay)
        else:
            assert delay == retry_delay_ms, (where, delay)


def check_both(python: dict, node: dict, *args, **kwargs):
    check("python", python, *args, **kwargs)
    check("node", node, *args, **kwargs)
    # And the two stock libraries decoded the very same status.
    for key in ("code", "message", "reason", "domain", "fieldViolations", "detailTypes"):
        assert python["status"][key] == node["status"][key], key


# --- the key's refusals and the identities' (embedded store, a policy file) -----------

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
    directory = tmp_path_factory.mktemp("details-conformance")
    (directory / "policy.toml").write_text(POLICY)
    with ServerProcess.start(data_dir=directory, env={"IDEMPOTENCY_POLICY_FILE": str(directory / "policy.toml")}) as server:
        yield server


def until(condition, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def rfc3339(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def test_every_refusal_of_a_key_and_of_an_identity_decodes_alike_in_python_and_node(policy_server):
    ns = f"orders/x-{uuid.uuid4().hex[:12]}"
    target = policy_server.target
    with IdempotencyClient(target, token=ORDERS_TOKEN) as client:
        # LEASE_LOST: a 1 s lease ran out and another claimant took the key.
        lost = client.claim(ns, "lost", lease_ttl=1)
        # KEY_EXPIRED: completed with a 1 s retention; remembered once it expired.
        remembered = client.claim(ns, "remembered", retention=1)
        client.complete(ns, "remembered", remembered.lease_token, b"done", retention=1)
        # LEASE_RELEASED: this lease was given back.
        released = client.claim(ns, "released")
        client.release(ns, "released", released.lease_token)
        # KEY_COMPLETED: a completed key cannot be released.
        completed = client.claim(ns, "completed")
        client.complete(ns, "completed", completed.lease_token, b"done")
        until(lambda: client.claim(ns, "lost", lease_ttl=60).claimed, "the 1 s lease to run out")
        record = until(
            lambda: (lambda r: r if r.remembered else None)(client.get(ns, "remembered")),
            "the key to be remembered",
        )

    def case(method, request, token=ORDERS_TOKEN, **extra):
        return {"target": target, "token": token, "method": method, "request": request, **extra}

    cases = {
        "INVALID_ARGUMENT": case("Claim", {"namespace": ns, "key": ""}),
        "NOT_FOUND": case("Complete", {"namespace": ns, "key": "never", "leaseToken": "0" * 32}),
        "KEY_EXPIRED": case("Complete", {"namespace": ns, "key": "remembered", "leaseToken": remembered.lease_token}),
        "LEASE_LOST": case("Complete", {"namespace": ns, "key": "lost", "leaseToken": lost.lease_token}),
        "LEASE_RELEASED": case("Complete", {"namespace": ns, "key": "released", "leaseToken": released.lease_token}),
        "KEY_COMPLETED": case("Release", {"namespace": ns, "key": "completed", "leaseToken": completed.lease_token}),
        "UNAUTHENTICATED": case("Get", {"namespace": ns, "key": "k"}, token=f"idem_{secrets.token_hex(32)}"),
        "PERMISSION_DENIED": case("Get", {"namespace": "billing/x", "key": "k"}),
        # 1 call per second, burst 1: the second call or so is refused.
        "RATE_LIMITED": case("Get", {"namespace": "limited/x", "key": "k"}, token=LIMITED_TOKEN, repeat=5),
    }
    python = {reason: python_side(c) for reason, c in cases.items()}
    node = dict(zip(cases, node_side(list(cases.values()))))

    for side in (python, node):
        assert side["INVALID_ARGUMENT"]["status"]["message"] == "key: must not be empty"
    check_both(
        python["INVALID_ARGUMENT"],
        node["INVALID_ARGUMENT"],
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
        None,
        metadata={"field": "key"},
        field="key",
        violation=("key", "must not be empty"),
    )
    check_both(python["NOT_FOUND"], node["NOT_FOUND"], "NOT_FOUND", "NOT_FOUND", None)
    times = python["KEY_EXPIRED"]["status"]["metadata"]
    check_both(python["KEY_EXPIRED"], node["KEY_EXPIRED"], "NOT_FOUND", "KEY_EXPIRED", None, metadata=times)
    assert set(times) == {"completed_at", "remembered_until"}
    assert rfc3339(times["completed_at"]) == record.completed_at
    assert rfc3339(times["remembered_until"]) == record.remembered_until
    for reason in ("LEASE_LOST", "LEASE_RELEASED", "KEY_COMPLETED"):
        check_both(python[reason], node[reason], "FAILED_PRECONDITION", reason, None)
    check_both(python["UNAUTHENTICATED"], node["UNAUTHENTICATED"], "UNAUTHENTICATED", "UNAUTHENTICATED", None)
    check_both(python["PERMISSION_DENIED"], node["PERMISSION_DENIED"], "PERMISSION_DENIED", "PERMISSION_DENIED", None)
    # Until the limiter allows the next call: more than nothing, at most a second.
    check("python", python["RATE_LIMITED"], "RESOURCE_EXHAUSTED", "RATE_LIMITED", (0, 1000))
    check("node", node["RATE_LIMITED"], "RESOURCE_EXHAUSTED", "RATE_LIMITED", (0, 1000))


# --- the store's failures, the deadline and the limit of calls in flight -------------


@pytest.fixture(scope="module")
def relayed(tmp_path_factory):
    """Two servers on one fresh PostgreSQL database, both through one relay:
    `short` with a 1 s call timeout, `narrow` with room for 2 calls in flight
    (and a 30 s database timeout, so that stuck calls keep their slots)."""
    url = create_postgres_database()
    try:
        parts = urllib.parse.urlsplit(url)
        with TcpRelay(parts.hostname, parts.port or 5432) as relay:
            user = f"{parts.username}@" if parts.username else ""
            relayed_url = urllib.parse.urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{relay.port}"))
            with ServerProcess.start(
                data_dir=tmp_path_factory.mktemp("short"),
                database_url=relayed_url,
                env={"IDEMPOTENCY_CALL_TIMEOUT": "1s", "IDEMPOTENCY_DB_TIMEOUT": "5s"},
            ) as short, ServerProcess.start(
                data_dir=tmp_path_factory.mktemp("narrow"),
                database_url=relayed_url,
                env={"IDEMPOTENCY_MAX_CONCURRENT_CALLS": "2", "IDEMPOTENCY_DB_TIMEOUT": "30s"},
            ) as narrow:
                yield relay, short, narrow
    finally:
        drop_postgres_database(url)


def claim_case(server, ns):
    return {
        "target": server.target,
        "method": "Claim",
        "request": {"namespace": ns, "key": f"k-{uuid.uuid4().hex[:8]}", "leaseToken": new_lease_token()},
    }


def test_a_cut_store_is_store_unavailable_with_retry_info_in_python_and_node(relayed):
    relay, short, _ = relayed
    ns = f"x-{uuid.uuid4().hex[:12]}"
    relay.cut()
    try:
        python = python_side(claim_case(short, ns))
        (node,) = node_side([claim_case(short, ns)])
    finally:
        relay.restore()
    check_both(python, node, "UNAVAILABLE", "STORE_UNAVAILABLE", 250.0)
    with IdempotencyClient(short.target) as client:  # and back once the relay is
        assert client.claim(ns, "after").claimed


def test_a_stalled_store_is_deadline_exceeded_and_a_full_server_overloaded_in_python_and_node(relayed):
    relay, short, narrow = relayed
    ns = f"x-{uuid.uuid4().hex[:12]}"
    stuck_channel = grpc.insecure_channel(narrow.target)
    claim = stuck_channel.unary_unary(
        SERVICE + "Claim",
        request_serializer=pb.ClaimRequest.SerializeToString,
        response_deserializer=pb.ClaimResponse.FromString,
    )
    probe = IdempotencyClient(narrow.target, retry=None)
    relay.stall()
    try:
        # Two Claims stuck on the store hold both of `narrow`'s call slots.
        stuck = [
            claim.future(pb.ClaimRequest(namespace=ns, key=f"stuck-{i}", lease_token=new_lease_token()), timeout=60)
            for i in range(2)
        ]

        def full():
            # A Get of no key: answered INVALID_ARGUMENT before any read while
            # a slot is free (so the probe never sticks in one itself).
            try:
                probe.get(ns, "")
            except ResourceExhausted as error:
                return error.reason == "OVERLOADED"
            except InvalidArgument:
                return False
            raise AssertionError("a Get of no key succeeded")

        until(full, "both call slots to be taken")
        overloaded = {"target": narrow.target, "method": "Get", "request": {"namespace": ns, "key": "k"}}
        with ThreadPoolExecutor(2) as pool:
            python_deadline = pool.submit(python_side, claim_case(short, ns))
            python_overloaded = python_side(overloaded)
            node_deadline, node_overloaded = node_side([claim_case(short, ns), overloaded])
            python_deadline = python_deadline.result()
    finally:
        relay.restore()
        probe.close()
    for future in stuck:  # the relay reset their connections: they end now, either way
        future.exception(timeout=30)
    stuck_channel.close()

    check_both(python_deadline, node_deadline, "DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED", None)
    assert python_deadline["status"]["message"] == "the call's deadline passed"
    check_both(python_overloaded, node_overloaded, "RESOURCE_EXHAUSTED", "OVERLOADED", 50.0)
