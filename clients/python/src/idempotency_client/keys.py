"""Stable event keys and payload fingerprints, byte-compatible across languages.

The canonical forms are specified in clients/KEYS.md; the Node client implements
the same ones, and clients/testdata/key_vectors.json pins both to the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any, Union

KeyField = Union[str, bytes, int]

#: Domain separation and version: a key derived under another scheme (or a
#: later version of this one) never collides with these.
KEY_PREFIX = b"idempotency-key/v1\n"

#: Integers outside this range have no exact JavaScript number, so two clients
#: could disagree on them: they are rejected by fingerprint() (use a string).
MAX_SAFE_INTEGER = 2**53 - 1


def derive_key(*fields: Any, **named: Any) -> str:
    """A stable key from the fields that make an event that event.

    Pass the fields positionally (their order matters) or by name, as keyword
    arguments or as one mapping (names are sorted, so their order does not):

        derive_key("stripe", event["id"])
        derive_key({"source": "stripe", "event_id": event["id"]})
        derive_key(source="stripe", event_id=event["id"])

    Each field is a str, bytes or int; the type is part of the encoding, so
    "1", b"1" and 1 give different keys. The result is 64 lowercase hex
    characters: the SHA-256 of key_encoding(), specified in clients/KEYS.md.
    Never include what changes between deliveries (timestamps, attempt numbers).
    """
    return hashlib.sha256(key_encoding(*fields, **named)).hexdigest()


def key_encoding(*fields: Any, **named: Any) -> bytes:
    """The canonical bytes that derive_key() hashes (clients/KEYS.md)."""
    if named:
        if fields:
            raise TypeError("derive_key: pass fields positionally or by name, not both")
        return _encode_mapping(named)
    if len(fields) == 1 and isinstance(fields[0], Mapping):
        return _encode_mapping(fields[0])
    if not fields:
        raise ValueError("derive_key: at least one field is needed")
    out = bytearray(KEY_PREFIX)
    out += b"L" + len(fields).to_bytes(8, "big")
    for field in fields:
        out += _encode_field(field)
    return bytes(out)


def _encode_mapping(mapping: Mapping[Any, Any]) -> bytes:
    if not mapping:
        raise ValueError("derive_key: at least one field is needed")
    entries = []
    for name, value in mapping.items():
        if not isinstance(name, str):
            raise TypeError(f"derive_key: field names must be str, got {type(name).__name__}")
        entries.append((name.encode("utf-8"), name, value))
    entries.sort(key=lambda entry: entry[0])  # by the names' UTF-8 bytes
    out = bytearray(KEY_PREFIX)
    out += b"M" + len(entries).to_bytes(8, "big")
    for _, name, value in entries:
        out += _encode_field(name)
        out += _encode_field(value)
    return bytes(out)


def _encode_field(value: Any) -> bytes:
    if isinstance(value, str):
        tag, body = b"s", value.encode("utf-8")  # raises on lone surrogates
    elif isinstance(value, (bytes, bytearray, memoryview)):
        tag, body = b"b", bytes(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        tag, body = b"i", str(value).encode("ascii")
    else:
        raise TypeError(
            f"derive_key: a field must be str, bytes or int, got {type(value).__name__}"
        )
    return tag + len(body).to_bytes(8, "big") + body


def fingerprint(payload: Any) -> bytes:
    """The SHA-256 (32 bytes) of a payload, for Claim's fingerprint.

    bytes-like payloads are hashed as they are (a webhook's raw body), str as
    its UTF-8 bytes; anything else (dict, list, int, bool, None) is hashed as
    canonical JSON (clients/KEYS.md): keys sorted, no whitespace, integers
    only. Floats with a fractional part are rejected because languages print
    them differently: send amounts as integer minor units or strings.
    """
    if isinstance(payload, (bytes, bytearray, memoryview)):
        data = bytes(payload)
    elif isinstance(payload, str):
        data = payload.encode("utf-8")
    else:
        data = canonical_json(payload)
    return hashlib.sha256(data).digest()


def canonical_json(value: Any) -> bytes:
    """The canonical JSON encoding of value (UTF-8), as fingerprint() hashes it."""
    return "".join(_canonical_json_parts(value)).encode("utf-8")


def _canonical_json_parts(value: Any):
    if value is None:
        yield "null"
    elif value is True:
        yield "true"
    elif value is False:
        yield "false"
    elif isinstance(value, int):
        yield _canonical_integer(value)
    elif isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ValueError(
                f"fingerprint: {value!r} is not an integer; encode it as a string or in minor units"
            )
        yield _canonical_integer(int(value))
    elif isinstance(value, str):
        value.encode("utf-8")  # lone surrogates have no UTF-8 form: reject them here
        yield json.dumps(value, ensure_ascii=False)
    elif isinstance(value, Mapping):
        names = list(value.keys())
        for name in names:
            if not isinstance(name, str):
                raise TypeError(f"fingerprint: object keys must be str, got {type(name).__name__}")
        # JavaScript's sort order: by UTF-16 code units.
        names.sort(key=lambda name: name.encode("utf-16-be", "surrogatepass"))
        yield "{"
        for index, name in enumerate(names):
            if index:
                yield ","
            yield from _canonical_json_parts(name)
            yield ":"
            yield from _canonical_json_parts(value[name])
        yield "}"
    elif isinstance(value, (list, tuple)):
        yield "["
        for index, item in enumerate(value):
            if index:
                yield ","
            yield from _canonical_json_parts(item)
        yield "]"
    else:
        raise TypeError(f"fingerprint: cannot encode {type(value).__name__} as canonical JSON")


def _canonical_integer(value: int) -> str:
    if abs(value) > MAX_SAFE_INTEGER:
        raise ValueError(f"fingerprint: {value} is beyond ±(2**53 - 1); encode it as a string")
    return str(value)
