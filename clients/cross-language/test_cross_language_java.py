"""Python and Java share one store: a result completed from one language is
replayed to the other, with the same derived key and the same fingerprint.

The Java side (java_side/JavaSide.java, on clients/java) is built once per
module with clients/java/build.sh, which installs Debian's JDK, protoc,
grpc-java and protobuf-java when missing. Run with the Python client's venv:

    bash clients/python/setup-venv.sh
    clients/python/.venv/bin/python -m pytest clients/cross-language/test_cross_language_java.py
"""

import json
import pathlib
import subprocess

import pytest

from idempotency_client import (
    ClaimItem,
    CompleteItem,
    FingerprintMismatch,
    Outcome,
    derive_key,
    fingerprint,
)

REPO = pathlib.Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "clients" / "java" / "build.sh"


@pytest.fixture(scope="module")
def java_classpath(tmp_path_factory):
    out = tmp_path_factory.mktemp("java-build")
    done = subprocess.run(["bash", str(BUILD_SCRIPT), str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"clients/java/build.sh failed:\n{done.stdout}\n{done.stderr}"
    return (out / "classpath").read_text().strip()





@pytest.fixture
def java_once(java_classpath, server):
    def run(namespace, fields, payload, result, on_in_progress="wait"):
        request = {
            "target": server.target,
            "namespace": namespace,
            "fields": fields,
            "payload": payload,
            "result": result,
            "onInProgress": on_in_progress,
        }
        done = subprocess.run(
            ["java", "-cp", java_classpath, "JavaSide", json.dumps(request)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    return run


ORDER = {"order_id": "o-1", "lines": [{"sku": "A", "qty": 2}], "total_cents": 1998, "note": "caf\u00e9 <&>"}


def test_a_result_completed_from_python_is_replayed_to_java(client, namespace, java_once):
    key = derive_key("shop", "order-paid", "o-1")
    stored = client.once(namespace, key, fingerprint=fingerprint(ORDER)).run(
        lambda: {"charged_by": "python", "charge": "ch_py", "amount": 1998}
    )

    java = java_once(namespace, ["shop", "order-paid", "o-1"], ORDER, {"charged_by": "java"})

    assert java["key"] == key
    assert java["fingerprint"] == fingerprint(ORDER).hex()
    assert java == {**java, "ran": False, "replayed": True, "value": stored}


def test_a_result_completed_from_java_is_replayed_to_python(client, namespace, java_once):
    java = java_once(namespace, ["shop", "order-paid", "o-2"], ORDER, {"charged_by": "java", "n": [1, None, True]})
    assert java["ran"] is True and java["replayed"] is False
    assert java["key"] == derive_key("shop", "order-paid", "o-2")

    ran = []
    with client.once(
        namespace, derive_key("shop", "order-paid", "o-2"), fingerprint=fingerprint(ORDER)
    ) as run:
        result = run(lambda: ran.append(1) or {"charged_by": "python"})

    assert run.replayed
    assert result == {"charged_by": "java", "n": [1, None, True]}
    assert ran == []


def test_integer_and_named_fields_derive_the_same_key(client, namespace, java_once):
    java = java_once(namespace, ["shop", 12345, -7], "text payload", "java")
    assert java["key"] == derive_key("shop", 12345, -7)
    assert java["fingerprint"] == fingerprint("text payload").hex()


def test_another_payload_for_the_same_event_is_a_mismatch_in_both_directions(client, namespace, java_once):
    client.once(namespace, derive_key("shop", "o-3"), fingerprint=fingerprint(ORDER)).run(lambda: "py")
    altered = {**ORDER, "total_cents": 1}

    java = java_once(namespace, ["shop", "o-3"], altered, "java")
    assert java["error"] == "FingerprintMismatch" and java["ran"] is False

    java_once(namespace, ["shop", "o-4"], ORDER, "java")
    with pytest.raises(FingerprintMismatch):
        client.once(namespace, derive_key("shop", "o-4"), fingerprint=fingerprint(altered)).run(lambda: "py")


def test_a_lease_held_from_python_is_in_progress_to_java(client, namespace, java_once):
    key = derive_key("shop", "o-5")
    claim = client.claim(namespace, key, fingerprint=fingerprint(ORDER), lease_ttl=30)
    assert claim.claimed

    java = java_once(namespace, ["shop", "o-5"], ORDER, "java", on_in_progress="throw")

    assert java["error"] == "InProgress" and java["ran"] is False
    client.complete(namespace, key, claim.lease_token, json.dumps("py").encode())
    assert java_once(namespace, ["shop", "o-5"], ORDER, "java")["value"] == "py"


def test_a_batch_completed_from_python_is_replayed_to_java_and_the_reverse(client, namespace, java_once):
    java = java_once(namespace, ["shop", "o-6"], ORDER, {"charged_by": "java"})
    assert java["ran"] is True
    keys = [derive_key("shop", order) for order in ("o-6", "o-7")]

    claims = client.claim_batch([ClaimItem(namespace, key, fingerprint=fingerprint(ORDER)) for key in keys])

    assert [c.outcome for c in claims] == [Outcome.COMPLETED, Outcome.CLAIMED]
    assert json.loads(claims[0].response) == {"charged_by": "java"}
    done = client.complete_batch(
        [CompleteItem(namespace, keys[1], claims[1].lease_token, json.dumps({"charged_by": "python"}).encode())]
    )
    assert [d.ok for d in done] == [True]
    java = java_once(namespace, ["shop", "o-7"], ORDER, "java")
    assert java == {**java, "ran": False, "replayed": True, "value": {"charged_by": "python"}}
