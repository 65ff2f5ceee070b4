"""derive_key() and fingerprint() match the shared vectors byte for byte (clients/KEYS.md)."""

import json
import pathlib

import pytest

from idempotency_client import canonical_json, derive_key, fingerprint, key_encoding

VECTORS = json.loads(
    (pathlib.Path(__file__).resolve().parents[2] / "testdata" / "key_vectors.json").read_text()
)


def typed(value):
    (tag, text), = value.items()
    return {"s": lambda v: v, "b": bytes.fromhex, "i": int}[tag](text)


def fingerprint_input(case):
    if "bytes" in case:
        return bytes.fromhex(case["bytes"])
    if "text" in case:
        return case["text"]
    if "json_text" in case:
        return json.loads(case["json_text"])
    return case["json"]


@pytest.mark.parametrize("case", VECTORS["derive_key"], ids=lambda c: c["name"])
def test_derive_key_matches_the_shared_vector(case):
    if "fields" in case:
        fields = [typed(f) for f in case["fields"]]
        assert key_encoding(*fields).hex() == case["encoding_hex"]
        assert derive_key(*fields) == case["key"]
    else:
        mapping = {name: typed(v) for name, v in case["mapping"].items()}
        assert key_encoding(mapping).hex() == case["encoding_hex"]
        assert derive_key(mapping) == case["key"]
        assert derive_key(**mapping) == case["key"]


@pytest.mark.parametrize("case", VECTORS["fingerprint"], ids=lambda c: c["name"])
def test_fingerprint_matches_the_shared_vector(case):
    payload = fingerprint_input(case)
    if "canonical" in case:
        assert canonical_json(payload).decode("utf-8") == case["canonical"]
    assert fingerprint(payload).hex() == case["fingerprint"]


@pytest.mark.parametrize("case", VECTORS["invalid_derive_key"], ids=lambda c: c["name"])
def test_derive_key_rejects_fields_that_have_no_canonical_form(case):
    with pytest.raises((TypeError, ValueError)):
        derive_key(*case["fields"])


@pytest.mark.parametrize("case", VECTORS["invalid_fingerprint_json"], ids=lambda c: c["name"])
def test_fingerprint_rejects_numbers_that_languages_print_differently(case):
    with pytest.raises(ValueError):
        fingerprint(case["json"])


def test_the_same_event_gives_the_same_key_and_another_event_another():
    assert derive_key("stripe", "evt_1") == derive_key("stripe", "evt_1")
    assert derive_key("stripe", "evt_1") != derive_key("stripe", "evt_2")
    assert len(derive_key("x")) == 64


def test_positional_and_named_fields_give_different_keys():
    assert derive_key("stripe", "evt_1") != derive_key(source="stripe", event_id="evt_1")


def test_a_lone_surrogate_has_no_canonical_form():
    with pytest.raises(UnicodeEncodeError):
        derive_key("\ud800")
    with pytest.raises(UnicodeEncodeError):
        fingerprint({"x": "\ud800"})
