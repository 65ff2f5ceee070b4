"""How once() turns the work's result into Complete's response bytes and back.

A serializer is any object with `dumps(value) -> bytes` and
`loads(data: bytes) -> value`. JSON is the default because every client of the
service (Python, Node, Go, grpcurl) can read it: a result stored by one
language's once() replays in another's.
"""

from __future__ import annotations

import json
from typing import Any, Protocol


class Serializer(Protocol):
    def dumps(self, value: Any) -> bytes: ...

    def loads(self, data: bytes) -> Any: ...


class JsonSerializer:
    """Compact UTF-8 JSON; what the Node client's once() stores too."""

    def dumps(self, value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")

    def loads(self, data: bytes) -> Any:
        return json.loads(data.decode("utf-8"))


class BytesSerializer:
    """The result is already bytes (a rendered HTTP body, a protobuf message)."""

    def dumps(self, value: Any) -> bytes:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"BytesSerializer: the result must be bytes, got {type(value).__name__}")
        return bytes(value)

    def loads(self, data: bytes) -> Any:
        return data


JSON = JsonSerializer()
BYTES = BytesSerializer()
