"""Python and Go share one store: a result completed from one language is
replayed to the other, with the same derived key and the same fingerprint.

The Go side (go_side/main.go) is built by the module's fixture with
clients/go/build.sh (Debian's Go packages, GOPATH mode). Run by
clients/cross-language-test.sh, which builds the Python client first.
"""

import json
import pathlib
import subprocess

import pytest

from idempotency_client import (
    FingerprintMismatch,
    derive_key,
    fingerprint,
)

HERE = pathlib.Path(__file__).resolve().parent
BUILD = HERE.parent / "go" / "build.sh"


@pytest.fixture(scope="module")
def go_side(tmp_path_factory):
    out = tmp_path_factory.mktemp("go-side")
    done = subprocess.run(
        ["bash", str(BUILD), str(out), "clients/cross-language/go_side"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"clients/go/build.sh failed:\n{done.stdout}\n{done.stderr}"
    return out / "go_side"





def go_once(go_side, server, namespace, fields, payload, result, on_in_progress="wait"):
    request = {
        "target": server.target,
        "namespace": namespace,
        "fields": fields,
        "payload": payload,
        "result": result,
        "onInProgress": on_in_progress,
    }
    done = subprocess.run([str(go_side), json.dumps(request)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


ORDER = {"order_id": "o-1", "lines": [{"sku": "A", "qty": 2}], "total_cents": 1998, "note": "café ☕ <&>"}


def test_a_result_completed_from_python_is_replayed_to_go(go_side, server, client, namespace):
    key = derive_key("shop", "order-paid", "o-1")
    stored = client.once(namespace, key, fingerprint=fingerprint(ORDER)).run(
        lambda: {"charged_by": "python", "charge": "ch_py", "amount": 1998}
    )

    go = go_once(go_side, server, namespace, ["shop", "order-paid", "o-1"], ORDER, {"charged_by": "go"})

    assert go["key"] == key
    assert go["fingerprint"] == fingerprint(ORDER).hex()
    assert go == {**go, "ran": False, "replayed": True, "value": stored}


def test_a_result_completed_from_go_is_replayed_to_python(go_side, server, client, namespace):
    go = go_once(go_side, server, namespace, ["shop", "order-paid", "o-2"], ORDER, {"charged_by": "go", "n": 7})
    assert go["ran"] is True and go["replayed"] is False
    assert go["key"] == derive_key("shop", "order-paid", "o-2")
    assert go["fingerprint"] == fingerprint(ORDER).hex()

    ran = []
    with client.once(namespace, derive_key("shop", "order-paid", "o-2"), fingerprint=fingerprint(ORDER)) as run:
        result = run(lambda: ran.append(1) or {"charged_by": "python"})

    assert run.replayed
    assert result == {"charged_by": "go", "n": 7}
    assert ran == []


def test_integer_key_fields_derive_the_same_key(go_side, server, client, namespace):
    fields = ["shop", 42, -7, 18446744073709551616]
    go = go_once(go_side, server, namespace, fields, "raw text payload", [1, "two"])

    assert go["key"] == derive_key(*fields)
    assert go["fingerprint"] == fingerprint("raw text payload").hex()
    assert client.once(namespace, derive_key(*fields), fingerprint=fingerprint("raw text payload")).run(
        lambda: "py"
    ) == [1, "two"]


def test_another_payload_for_the_same_event_is_a_mismatch_in_both_directions(go_side, server, client, namespace):
    client.once(namespace, derive_key("shop", "o-3"), fingerprint=fingerprint(ORDER)).run(lambda: "py")
    altered = {**ORDER, "total_cents": 1}

    go = go_once(go_side, server, namespace, ["shop", "o-3"], altered, "go")
    assert go["error"] == "FingerprintMismatch" and go["ran"] is False

    go_once(go_side, server, namespace, ["shop", "o-4"], ORDER, "go")
    with pytest.raises(FingerprintMismatch):
        client.once(namespace, derive_key("shop", "o-4"), fingerprint=fingerprint(altered)).run(lambda: "py")


def test_a_lease_held_from_python_is_in_progress_to_go(go_side, server, client, namespace):
    key = derive_key("shop", "o-5")
    claim = client.claim(namespace, key, fingerprint=fingerprint(ORDER), lease_ttl=30)
    assert claim.claimed

    go = go_once(go_side, server, namespace, ["shop", "o-5"], ORDER, "go", on_in_progress="throw")

    assert go["error"] == "InProgress" and go["ran"] is False
    client.complete(namespace, key, claim.lease_token, json.dumps("py").encode())
    assert go_once(go_side, server, namespace, ["shop", "o-5"], ORDER, "go")["value"] == "py"
