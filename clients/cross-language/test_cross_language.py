"""Python and Node share one store: a result completed from one language is
replayed to the other, with the same derived key and the same fingerprint.

Run by clients/cross-language-test.sh, which builds both clients first.
"""

import json
import pathlib
import subprocess

import pytest

from idempotency_client import (
    ClaimItem,
    CompleteItem,
    FingerprintMismatch,
    InProgress,
    Outcome,
    derive_key,
    fingerprint,
)

NODE_SIDE = pathlib.Path(__file__).with_name("node_side.js")





def node_once(server, namespace, fields, payload, result, on_in_progress="wait"):
    request = {
        "target": server.target,
        "namespace": namespace,
        "fields": fields,
        "payload": payload,
        "result": result,
        "onInProgress": on_in_progress,
    }
    done = subprocess.run(
        ["node", str(NODE_SIDE), json.dumps(request)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


ORDER = {"order_id": "o-1", "lines": [{"sku": "A", "qty": 2}], "total_cents": 1998}


def test_a_result_completed_from_python_is_replayed_to_node(server, client, namespace):
    key = derive_key("shop", "order-paid", "o-1")
    stored = client.once(namespace, key, fingerprint=fingerprint(ORDER)).run(
        lambda: {"charged_by": "python", "charge": "ch_py"}
    )

    node = node_once(server, namespace, ["shop", "order-paid", "o-1"], ORDER, {"charged_by": "node"})

    assert node["key"] == key
    assert node["fingerprint"] == fingerprint(ORDER).hex()
    assert node == {**node, "ran": False, "replayed": True, "value": stored}


def test_a_result_completed_from_node_is_replayed_to_python(server, client, namespace):
    node = node_once(server, namespace, ["shop", "order-paid", "o-2"], ORDER, {"charged_by": "node"})
    assert node["ran"] is True and node["replayed"] is False

    ran = []
    with client.once(
        namespace, derive_key("shop", "order-paid", "o-2"), fingerprint=fingerprint(ORDER)
    ) as run:
        result = run(lambda: ran.append(1) or {"charged_by": "python"})

    assert run.replayed
    assert result == {"charged_by": "node"}
    assert ran == []


def test_another_payload_for_the_same_event_is_a_mismatch_in_both_directions(server, client, namespace):
    client.once(namespace, derive_key("shop", "o-3"), fingerprint=fingerprint(ORDER)).run(lambda: "py")
    altered = {**ORDER, "total_cents": 1}

    node = node_once(server, namespace, ["shop", "o-3"], altered, "node")
    assert node["error"] == "FingerprintMismatch" and node["ran"] is False

    node_once(server, namespace, ["shop", "o-4"], ORDER, "node")
    with pytest.raises(FingerprintMismatch):
        client.once(namespace, derive_key("shop", "o-4"), fingerprint=fingerprint(altered)).run(lambda: "py")


def test_a_lease_held_from_python_is_in_progress_to_node(server, client, namespace):
    key = derive_key("shop", "o-5")
    claim = client.claim(namespace, key, fingerprint=fingerprint(ORDER), lease_ttl=30)
    assert claim.claimed

    node = node_once(server, namespace, ["shop", "o-5"], ORDER, "node", on_in_progress="throw")

    assert node["error"] == "InProgress" and node["ran"] is False
    client.complete(namespace, key, claim.lease_token, json.dumps("py").encode())
    assert node_once(server, namespace, ["shop", "o-5"], ORDER, "node")["value"] == "py"


def test_a_batch_completed_from_python_is_replayed_to_node_and_the_reverse(server, client, namespace):
    node = node_once(server, namespace, ["shop", "o-6"], ORDER, {"charged_by": "node"})
    assert node["ran"] is True
    keys = [derive_key("shop", order) for order in ("o-6", "o-7", "o-8")]

    claims = client.claim_batch([ClaimItem(namespace, key, fingerprint=fingerprint(ORDER)) for key in keys])

    assert [c.outcome for c in claims] == [Outcome.COMPLETED, Outcome.CLAIMED, Outcome.CLAIMED]
    assert json.loads(claims[0].response) == {"charged_by": "node"}
    done = client.complete_batch(
        [
            CompleteItem(namespace, key, claim.lease_token, json.dumps({"charged_by": "python", "key": i}).encode())
            for i, (key, claim) in enumerate(zip(keys, claims))
            if claim.claimed
        ]
    )
    assert [d.ok for d in done] == [True, True]
    for i, order in ((1, "o-7"), (2, "o-8")):
        node = node_once(server, namespace, ["shop", order], ORDER, "node")
        assert node == {**node, "ran": False, "replayed": True, "value": {"charged_by": "python", "key": i}}
