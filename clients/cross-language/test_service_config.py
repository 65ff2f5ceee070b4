"""The published gRPC service config (clients/service-config.json) and
grpcio's built-in retry honouring it: a Claim with the caller's own lease
token meets STORE_UNAVAILABLE (the server's PostgreSQL is behind a TCP relay
that the test cuts) and, with retries on, succeeds by itself once the relay
is restored; with retries off, the same Claim fails UNAVAILABLE. The server
counts the attempts: idempotency_errors_total{method="Claim",
reason="STORE_UNAVAILABLE"} on its metrics endpoint, and its call log lines.

Run by clients/cross-language-test.sh.
"""

import json
import pathlib
import re
import time
import urllib.parse
import urllib.request
import uuid

import grpc
import pytest
from grpc_status import rpc_status

from idempotency_client import new_lease_token
from idempotency_client._proto import idempotency_pb2 as pb
from idempotency_client.testing import (
    ServerProcess,
    create_postgres_database,
    drop_postgres_database,
    free_port,
)
from tcp_relay import TcpRelay

CONFIG = pathlib.Path(__file__).resolve().parents[1] / "service-config.json"
SERVICE = "idempotency.v1.IdempotencyService"
RETRY_SAFE = {"Claim", "Get", "Complete", "Release", "ExtendLease", "ClaimBatch", "CompleteBatch"}


def test_the_service_config_retries_unavailable_on_every_rpc_but_purge():
    config = json.loads(CONFIG.read_text())
    methods = {}
    for entry in config["methodConfig"]:
        for name in entry["name"]:
            assert name["service"] == SERVICE
            assert name["method"] not in methods, name
            methods[name["method"]] = entry
    assert set(methods) == RETRY_SAFE  # not Purge
    for method, entry in methods.items():
        assert entry["retryPolicy"] == {
            "maxAttempts": 5,
            "initialBackoff": "0.1s",
            "maxBackoff": "2s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        }, method
    # Claim may wait on the server up to its call timeout (30 s by default).
    assert methods["Claim"]["timeout"] == "30s"
    assert {methods[m]["timeout"] for m in RETRY_SAFE - {"Claim"}} == {"10s"}


@pytest.fixture(scope="module")
def relayed(tmp_path_factory):
    """A server on a fresh PostgreSQL database through a relay, metrics on."""
    url = create_postgres_database()
    try:
        parts = urllib.parse.urlsplit(url)
        with TcpRelay(parts.hostname, parts.port or 5432) as relay:
            user = f"{parts.username}@" if parts.username else ""
            relayed_url = urllib.parse.urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{relay.port}"))
            metrics = f"127.0.0.1:{free_port()}"
            with ServerProcess.start(
                data_dir=tmp_path_factory.mktemp("service-config"),
                database_url=relayed_url,
                env={"IDEMPOTENCY_METRICS_ADDR": metrics},
            ) as server:
                yield relay, server, f"http://{metrics}/metrics"
    finally:
        drop_postgres_database(url)


def store_unavailable_claims(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    match = re.search(
        r'^idempotency_errors_total\{method="Claim",reason="STORE_UNAVAILABLE"\} (\S+)$', text, re.M
    )
    return float(match.group(1)) if match else 0.0


def logged_claims(server: ServerProcess, namespace: str) -> dict:
    """The outcomes of the Claim calls the server logged in `namespace`."""
    outcomes = {}
    for line in server.log_path.read_text(errors="replace").splitlines():
        if 'method="Claim"' in line and f'namespace="{namespace}"' in line:
            outcome = re.search(r'outcome="([a-z_]+)"', line).group(1)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


def claim_stub(target: str, retries: bool):
    channel = grpc.insecure_channel(
        target,
        options=[
            ("grpc.service_config", CONFIG.read_text()),
            ("grpc.enable_retries", 1 if retries else 0),
        ],
    )
    stub = channel.unary_unary(
        f"/{SERVICE}/Claim",
        request_serializer=pb.ClaimRequest.SerializeToString,
        response_deserializer=pb.ClaimResponse.FromString,
    )
    return channel, stub


def until(condition, what, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def test_grpcio_retries_a_claim_that_met_an_unreachable_store_by_the_service_config(relayed):
    relay, server, metrics = relayed
    ns, token = f"svc-{uuid.uuid4().hex[:12]}", new_lease_token()
    channel, claim = claim_stub(server.target, retries=True)
    before = store_unavailable_claims(metrics)
    started = time.monotonic()
    relay.cut()
    try:
        future = claim.future(pb.ClaimRequest(namespace=ns, key="k", lease_token=token), timeout=10)
        # The first attempt failed on the server: the store comes back, and
        # grpcio's next attempt (after 0-100 ms, then 0-200 ms, ...) gets through.
        until(lambda: store_unavailable_claims(metrics) > before, "the first attempt to fail")
    finally:
        relay.restore()
    answer = future.result(timeout=10)
    elapsed = time.monotonic() - started
    channel.close()

    assert answer.outcome == pb.OUTCOME_CLAIMED
    assert (answer.lease_token, answer.fencing_token, answer.retried) == (token, 1, False)
    failed = store_unavailable_claims(metrics) - before
    assert 1 <= failed <= 4  # at most maxAttempts - 1 before the one that succeeded
    assert logged_claims(server, ns) == {"unavailable": failed, "claimed": 1}
    assert elapsed < 5


def test_without_retries_the_same_claim_fails_unavailable_after_one_attempt(relayed):
    relay, server, metrics = relayed
    ns = f"svc-{uuid.uuid4().hex[:12]}"
    channel, claim = claim_stub(server.target, retries=False)
    before = store_unavailable_claims(metrics)
    relay.cut()
    try:
        with pytest.raises(grpc.RpcError) as raised:
            claim(pb.ClaimRequest(namespace=ns, key="k", lease_token=new_lease_token()), timeout=10)
    finally:
        relay.restore()
        channel.close()

    assert raised.value.code() is grpc.StatusCode.UNAVAILABLE
    assert rpc_status.from_call(raised.value) is not None
    assert store_unavailable_claims(metrics) - before == 1
    assert logged_claims(server, ns) == {"unavailable": 1}
