"""Regenerate key_vectors.json from the Python implementation.

The vectors pin derive_key() and fingerprint() of every client to the same
bytes: clients/python/tests/test_keys.py and clients/node/test/keys.test.ts
both check them. Regenerate only on purpose (a new case, never a changed
encoding: a changed encoding changes every key already stored), and check the
`encoding_hex` of a new case by hand against clients/KEYS.md.

    clients/python/.venv/bin/python clients/testdata/make_key_vectors.py
"""

import json
import pathlib

from idempotency_client.keys import canonical_json, fingerprint, key_encoding, derive_key

# Typed field values, as the vectors write them: {"s": text}, {"b": hex}, {"i": decimal}.
def s(text): return {"s": text}
def b(hex_): return {"b": hex_}
def i(number): return {"i": str(number)}


def decode(typed):
    (tag, value), = typed.items()
    return {"s": lambda v: v, "b": bytes.fromhex, "i": int}[tag](value)


KEY_CASES = [
    ("source and event id", [s("stripe"), s("evt_1MqLX2")]),
    ("one string", [s("evt_1")]),
    ("split differently: a|bc", [s("a"), s("bc")]),
    ("split differently: ab|c", [s("ab"), s("c")]),
    ("string one", [s("1")]),
    ("integer one", [i(1)]),
    ("bytes one", [b("31")]),
    ("integers: zero, negative, beyond 64 bits", [i(0), i(-7), i(2**64)]),
    ("empty string and empty bytes", [s(""), b("")]),
    ("bytes with zero and high bytes", [b("00ff10")]),
    ("non-ASCII text", [s("café"), s("日本"), s("😀")]),
    ("a NUL in a string is just a byte", [s("a\u0000b")]),
]

MAPPING_CASES = [
    ("named fields", {"source": s("stripe"), "event_id": s("evt_1MqLX2")}),
    ("named fields, other order", {"event_id": s("evt_1MqLX2"), "source": s("stripe")}),
    ("names sorted by UTF-8 bytes, not UTF-16", {"😀": s("x"), "ｚ": s("y"), "é": i(1), "z": i(2)}),
    ("one named integer", {"order": i(12345)}),
]

FINGERPRINT_CASES = [
    ("empty bytes", {"bytes": ""}),
    ("raw bytes", {"bytes": "7b2261223a317d"}),
    ("text is its UTF-8 bytes", {"text": "café"}),
    ("text that looks like JSON is still text", {"text": "{\"a\":1}"}),
    ("object keys sorted, no whitespace", {"json": {"b": 1, "a": [1, 2, 3]}}),
    ("scalars", {"json": [None, True, False, 0, -1, 9007199254740991, -9007199254740991]}),
    ("empty containers", {"json": {"o": {}, "l": []}}),
    ("string escapes", {"json": ["quote\" backslash\\ nl\n tab\t cr\r bs\b ff\f c1\u0001 del\u007f ls\u2028 é 😀 /"]}),
    ("keys sorted by UTF-16 code units (RFC 8785)", {"json": {"ｚ": 2, "😀": 1, "a": 3, "é": 4}}),
    ("an integral number written 1.0 is 1", {"json_text": "{\"amount\":1.0}"}),
    ("nested", {"json": {"order": {"id": "ord_1", "lines": [{"sku": "A", "qty": 2}]}, "currency": "EUR"}}),
]

INVALID_KEY_FIELDS = [
    ("a fractional number", [1.5]),
    ("a boolean", [True]),
    ("null", [None]),
    ("a list", [["a"]]),
    ("no fields", []),
]

INVALID_FINGERPRINT_JSON = [
    ("a fractional number", {"x": 1.5}),
    ("an integer beyond 2^53 - 1", {"x": 9007199254740992}),
]


def fingerprint_input(case):
    if "bytes" in case:
        return bytes.fromhex(case["bytes"])
    if "text" in case:
        return case["text"]
    if "json_text" in case:
        return json.loads(case["json_text"])
    return case["json"]


def main():
    vectors = {
        "spec": "clients/KEYS.md",
        "derive_key": [],
        "fingerprint": [],
        "invalid_derive_key": [{"name": n, "fields": f} for n, f in INVALID_KEY_FIELDS],
        "invalid_fingerprint_json": [{"name": n, "json": j} for n, j in INVALID_FINGERPRINT_JSON],
    }
    for name, fields in KEY_CASES:
        values = [decode(f) for f in fields]
        vectors["derive_key"].append(
            {"name": name, "fields": fields,
             "encoding_hex": key_encoding(*values).hex(), "key": derive_key(*values)})
    for name, mapping in MAPPING_CASES:
        values = {k: decode(v) for k, v in mapping.items()}
        vectors["derive_key"].append(
            {"name": name, "mapping": mapping,
             "encoding_hex": key_encoding(values).hex(), "key": derive_key(values)})
    for name, case in FINGERPRINT_CASES:
        payload = fingerprint_input(case)
        entry = {"name": name, **case}
        if not isinstance(payload, (bytes, str)):
            entry["canonical"] = canonical_json(payload).decode("utf-8")
        entry["fingerprint"] = fingerprint(payload).hex()
        vectors["fingerprint"].append(entry)
    out = pathlib.Path(__file__).with_name("key_vectors.json")
    out.write_text(json.dumps(vectors, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
