"""Bearer tokens, TLS and mutual TLS against a real server with an access
policy: two servers for the module (plaintext, and TLS with optional client
certificates), certificates made with the openssl CLI at set-up
(clients/testdata/make-test-certs.sh), tokens and policy made here."""

import hashlib
import pathlib
import secrets
import subprocess
import time
import uuid

import grpc
import pytest

from idempotency_client import (
    AsyncIdempotencyClient,
    ClaimItem,
    CompleteItem,
    IdempotencyClient,
    IdempotencyError,
    Outcome,
    PermissionDenied,
    ResourceExhausted,
    State,
    Unauthenticated,
    Unavailable,
)
from idempotency_client.testing import ServerProcess
from interceptors import Counting
from poll import until, until_async

MAKE_CERTS = pathlib.Path(__file__).resolve().parents[2] / "testdata" / "make-test-certs.sh"

ORDERS_TOKEN = f"idem_{secrets.token_hex(32)}"
LIMITED_TOKEN = f"idem_{secrets.token_hex(32)}"
UNKNOWN_TOKEN = f"idem_{secrets.token_hex(32)}"


def token_hash(token: str) -> str:
    return "sha256:" + hashlib.sha256(token.encode("utf-8")).hexdigest()


POLICY = f"""
[[identity]]
name = "orders"
token_hashes = ["{token_hash(ORDERS_TOKEN)}"]
namespaces = ["orders", "orders/*"]

[[identity]]
name = "orders-by-certificate"
client_cert_cn = "orders-client"
namespaces = ["billing/*"]

[[identity]]
name = "limited"
token_hashes = ["{token_hash(LIMITED_TOKEN)}"]
namespaces = ["limited/*"]
rate_limit_per_second = 1
rate_limit_burst = 1
"""


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("certs")
    subprocess.run(["bash", str(MAKE_CERTS), str(directory)], check=True, capture_output=True, timeout=30)
    return {path.name: path.read_bytes() for path in directory.iterdir()} | {"dir": directory}


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy") / "policy.toml"
    path.write_text(POLICY)
    return path


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory, policy_file):
    env = {"IDEMPOTENCY_POLICY_FILE": str(policy_file)}
    with ServerProcess.start(data_dir=tmp_path_factory.mktemp("plain-policy"), env=env) as server:
        yield server


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, policy_file, certs):
    directory = certs["dir"]
    env = {
        "IDEMPOTENCY_POLICY_FILE": str(policy_file),
        "IDEMPOTENCY_TLS_CERT_FILE": str(directory / "server.pem"),
        "IDEMPOTENCY_TLS_KEY_FILE": str(directory / "server.key"),
        "IDEMPOTENCY_TLS_CLIENT_CA_FILE": str(directory / "ca.pem"),
        "IDEMPOTENCY_TLS_CLIENT_AUTH": "optional",
    }
    # ServerProcess waits on a plaintext health listener it adds on another port.
    with ServerProcess.start(data_dir=tmp_path_factory.mktemp("tls-policy"), env=env) as server:
        yield server


def unique(prefix: str) -> str:
    return f"{prefix}/py-{uuid.uuid4().hex[:12]}"


# --- bearer tokens over plaintext -------------------------------------------


def test_a_token_over_plaintext_claims_completes_and_replays(plain_server):
    ns = unique("orders")
    with IdempotencyClient(plain_server.target, token=ORDERS_TOKEN) as client:
        claim = client.claim(ns, "k")
        assert claim.outcome is Outcome.CLAIMED
        client.complete(ns, "k", claim.lease_token, b'{"ok":true}')
        replay = client.claim(ns, "k")
        assert replay.outcome is Outcome.COMPLETED and replay.response == b'{"ok":true}'
        # The exact namespace of the grant, as well as "orders/*".
        assert client.claim("orders", uuid.uuid4().hex).outcome is Outcome.CLAIMED


def test_the_token_goes_with_batch_calls_and_with_once_and_its_heartbeat(plain_server):
    ns = unique("orders")
    with IdempotencyClient(plain_server.target, token=ORDERS_TOKEN) as client:
        claims = client.claim_batch([ClaimItem(ns, "a"), ClaimItem(ns, "b")])
        assert [c.outcome for c in claims] == [Outcome.CLAIMED, Outcome.CLAIMED]
        done = client.complete_batch([CompleteItem(ns, k, c.lease_token, b"1") for k, c in zip("ab", claims)])
        assert [d.ok for d in done] == [True, True]

        with client.once(ns, "once", lease_ttl=5, heartbeat_interval=0.05) as run:
            # The heartbeat's ExtendLease moves the lease on only if it was let in.
            until(
                lambda: client.get(ns, "once").lease_expires_at > run.claim.lease_expires_at,
                timeout=5,
                what="the heartbeat to extend the lease",
            )
            run(lambda: {"charged": 1})
        with client.once(ns, "once") as run:
            assert run(lambda: {"charged": 2}) == {"charged": 1} and run.replayed


def test_no_token_is_unauthenticated(plain_server):
    with IdempotencyClient(plain_server.target) as client:
        with pytest.raises(Unauthenticated) as raised:
            client.claim(unique("orders"), "k")
    assert raised.value.code is grpc.StatusCode.UNAUTHENTICATED
    assert "UNAUTHENTICATED" in str(raised.value)


def test_an_unknown_token_is_unauthenticated(plain_server):
    with IdempotencyClient(plain_server.target, token=UNKNOWN_TOKEN) as client:
        with pytest.raises(Unauthenticated):
            client.claim(unique("orders"), "k")


@pytest.mark.parametrize("namespace", ["payments/x", "ordersx", "billing/x"])
def test_a_namespace_outside_the_grant_is_permission_denied(plain_server, namespace):
    with IdempotencyClient(plain_server.target, token=ORDERS_TOKEN) as client:
        with pytest.raises(PermissionDenied) as raised:
            client.claim(namespace, uuid.uuid4().hex)
    assert raised.value.code is grpc.StatusCode.PERMISSION_DENIED


def test_a_batch_with_one_item_outside_the_grant_is_denied_and_changes_nothing(plain_server):
    ns = unique("orders")
    with IdempotencyClient(plain_server.target, token=ORDERS_TOKEN) as client:
        with pytest.raises(PermissionDenied):
            client.claim_batch([ClaimItem(ns, "k"), ClaimItem("payments/x", "k")])
        assert client.get(ns, "k").state is State.ABSENT


def test_purge_is_not_granted_unless_the_policy_lists_it(plain_server):
    ns = unique("orders")
    with IdempotencyClient(plain_server.target, token=ORDERS_TOKEN) as client:
        client.claim(ns, "k")
        with pytest.raises(PermissionDenied):
            client.purge(ns, "k", reason="test")


def test_over_the_rate_limit_is_resource_exhausted(plain_server):
    ns = unique("limited")
    with IdempotencyClient(plain_server.target, token=LIMITED_TOKEN, retry=None) as client:
        with pytest.raises(ResourceExhausted) as raised:
            for attempt in range(20):  # 1 per second, burst 1: the second or so is refused
                client.get(ns, f"k{attempt}")
    assert raised.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert raised.value.attempts == 1


def test_over_the_rate_limit_the_client_retries_until_the_bucket_refills(plain_server):
    ns = unique("limited")
    counting = Counting()
    with IdempotencyClient(plain_server.target, token=LIMITED_TOKEN, interceptors=[counting]) as client:
        started = time.monotonic()
        for attempt in range(3):  # 1 per second, burst 1: each waits for the bucket
            assert client.get(ns, f"k{attempt}").state is State.ABSENT
        elapsed = time.monotonic() - started
    assert counting.count("Get", grpc.StatusCode.OK) == 3
    assert counting.count("Get", grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1
    assert elapsed < 8


async def test_the_async_client_sends_the_token(plain_server):
    ns = unique("orders")
    async with AsyncIdempotencyClient(plain_server.target, token=ORDERS_TOKEN) as client:
        claim = await client.claim(ns, "k")
        await client.complete(ns, "k", claim.lease_token, b"r")
        assert (await client.claim(ns, "k")).response == b"r"
        claims = await client.claim_batch([{"namespace": ns, "key": "b"}])
        assert (await client.complete_batch([CompleteItem(ns, "b", claims[0].lease_token)]))[0].ok
        async with client.once(ns, "once", lease_ttl=5, heartbeat_interval=0.05) as run:

            async def extended():
                return (await client.get(ns, "once")).lease_expires_at > run.claim.lease_expires_at

            await until_async(extended, timeout=5, what="the heartbeat to extend the lease")
            await run(lambda: 7)
        async with client.once(ns, "once") as run:
            assert await run(lambda: 8) == 7 and run.replayed
        with pytest.raises(PermissionDenied):
            await client.claim("payments/x", "k")
    async with AsyncIdempotencyClient(plain_server.target) as anonymous:
        with pytest.raises(Unauthenticated):
            await anonymous.claim(ns, "k")


# --- TLS and mutual TLS ------------------------------------------------------


def test_tls_with_the_ca_as_root_and_a_token_works(tls_server, certs):
    ns = unique("orders")
    with IdempotencyClient(tls_server.target, token=ORDERS_TOKEN, root_certificates=certs["ca.pem"]) as client:
        claim = client.claim(ns, "k")
        client.complete(ns, "k", claim.lease_token, b"tls")
        assert client.claim(ns, "k").response == b"tls"
        with pytest.raises(PermissionDenied):
            client.claim(unique("billing"), "k")


def test_tls_without_credentials_is_unauthenticated(tls_server, certs):
    with IdempotencyClient(tls_server.target, root_certificates=certs["ca.pem"]) as client:
        with pytest.raises(Unauthenticated):
            client.claim(unique("orders"), "k")


def test_mutual_tls_works_as_the_certificate_identity(tls_server, certs):
    ns = unique("billing")
    with IdempotencyClient(
        tls_server.target,
        root_certificates=certs["ca.pem"],
        client_certificate=certs["client.pem"],
        client_key=certs["client.key"],
    ) as client:
        claim = client.claim(ns, "k")
        assert claim.outcome is Outcome.CLAIMED
        client.complete(ns, "k", claim.lease_token, b"mtls")
        assert client.claim(ns, "k").response == b"mtls"
        # The certificate's grant (billing/*), not the token identity's (orders/*).
        with pytest.raises(PermissionDenied):
            client.claim(unique("orders"), "k")


def test_tls_to_a_dns_name_of_the_certificate_works(tls_server, certs):
    target = tls_server.target.replace("127.0.0.1", "localhost")
    with IdempotencyClient(
        target,
        root_certificates=certs["ca.pem"],
        client_certificate=certs["client.pem"],
        client_key=certs["client.key"],
    ) as client:
        assert client.claim(unique("billing"), "k").outcome is Outcome.CLAIMED


def test_tls_and_a_token_over_several_addresses_and_a_dns_target(tls_server, certs):
    from idempotency_client.testing import free_port

    port = tls_server.target.rsplit(":", 1)[1]
    dead = f"127.0.0.1:{free_port()}"
    for target in ([dead, tls_server.target, f"localhost:{port}"], f"dns:///localhost:{port}"):
        ns = unique("orders")
        with IdempotencyClient(target, token=ORDERS_TOKEN, root_certificates=certs["ca.pem"]) as client:
            for index in range(4):
                claim = client.claim(ns, f"k{index}")
                assert claim.outcome is Outcome.CLAIMED
                client.complete(ns, f"k{index}", claim.lease_token, b"tls")
            with pytest.raises(PermissionDenied):
                client.claim(unique("billing"), "k")


async def test_the_async_client_over_tls_with_several_addresses(tls_server, certs):
    port = tls_server.target.rsplit(":", 1)[1]
    ns = unique("billing")
    async with AsyncIdempotencyClient(
        [tls_server.target, f"localhost:{port}"],
        root_certificates=certs["ca.pem"],
        client_certificate=certs["client.pem"],
        client_key=certs["client.key"],
    ) as client:
        for index in range(4):
            claim = await client.claim(ns, f"k{index}")
            await client.complete(ns, f"k{index}", claim.lease_token, b"mtls")


def test_with_a_good_certificate_a_wrong_token_still_decides(tls_server, certs):
    with IdempotencyClient(
        tls_server.target,
        token=UNKNOWN_TOKEN,
        root_certificates=certs["ca.pem"],
        client_certificate=certs["client.pem"],
        client_key=certs["client.key"],
    ) as client:
        with pytest.raises(Unauthenticated):
            client.claim(unique("billing"), "k")


async def test_the_async_client_over_mutual_tls(tls_server, certs):
    ns = unique("billing")
    async with AsyncIdempotencyClient(
        tls_server.target,
        root_certificates=certs["ca.pem"],
        client_certificate=certs["client.pem"],
        client_key=certs["client.key"],
    ) as client:
        claim = await client.claim(ns, "k")
        await client.complete(ns, "k", claim.lease_token, b"a")
        assert (await client.claim(ns, "k")).response == b"a"


def test_tls_without_the_ca_as_root_fails(tls_server):
    # tls=True: the system's roots, which do not include the test CA.
    # retry=None: a failed handshake is retried like any UNAVAILABLE; one attempt says it.
    with IdempotencyClient(tls_server.target, token=ORDERS_TOKEN, tls=True, timeout=5, retry=None) as client:
        with pytest.raises(Unavailable, match="(?i)certificate"):
            client.claim(unique("orders"), "k")


def test_a_plaintext_client_cannot_reach_the_tls_port(tls_server):
    with IdempotencyClient(tls_server.target, token=ORDERS_TOKEN, timeout=5, retry=None) as client:
        with pytest.raises(Unavailable):
            client.claim(unique("orders"), "k")


def test_a_client_certificate_from_another_ca_is_refused(tls_server, certs):
    with IdempotencyClient(
        tls_server.target,
        token=ORDERS_TOKEN,
        root_certificates=certs["ca.pem"],
        client_certificate=certs["rogue-client.pem"],
        client_key=certs["rogue-client.key"],
        timeout=5,
        retry=None,
    ) as client:
        with pytest.raises(IdempotencyError) as raised:
            client.claim(unique("orders"), "k")
    assert raised.value.code is grpc.StatusCode.UNAVAILABLE


# --- options -----------------------------------------------------------------


@pytest.mark.parametrize("cls", [IdempotencyClient, AsyncIdempotencyClient])
def test_the_tls_and_token_options_are_checked(cls, certs):
    with pytest.raises(TypeError, match="client_key"):
        cls("127.0.0.1:1", client_certificate=certs["client.pem"])
    with pytest.raises(TypeError, match="PEM bytes"):
        cls("127.0.0.1:1", root_certificates=certs["ca.pem"].decode())
    with pytest.raises(TypeError, match="not both"):
        cls("127.0.0.1:1", tls=True, credentials=grpc.ssl_channel_credentials())
    with pytest.raises(ValueError, match="token"):
        cls("127.0.0.1:1", token="Bearer abc")
    with pytest.raises(ValueError, match="token"):
        cls("127.0.0.1:1", token="")
    with pytest.raises(TypeError, match="token"):
        cls("127.0.0.1:1", token=b"abc")
