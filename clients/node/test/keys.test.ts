// deriveKey() and fingerprint() match the shared vectors byte for byte (clients/KEYS.md).
import { test, describe } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { canonicalJson, deriveKey, fingerprint, keyEncoding, type KeyField } from "../src";

// dist/test/keys.test.js -> clients/testdata
const vectors = JSON.parse(readFileSync(join(__dirname, "..", "..", "..", "testdata", "key_vectors.json"), "utf8"));

type Typed = { s?: string; b?: string; i?: string };

function typed(value: Typed): KeyField {
  if (value.s !== undefined) return value.s;
  if (value.b !== undefined) return Buffer.from(value.b, "hex");
  const n = BigInt(value.i!);
  // Safe integers as plain numbers, the rest as bigint: both are integers to deriveKey.
  return n <= BigInt(Number.MAX_SAFE_INTEGER) && n >= -BigInt(Number.MAX_SAFE_INTEGER) ? Number(n) : n;
}

function fingerprintInput(c: { bytes?: string; text?: string; json_text?: string; json?: unknown }): unknown {
  if (c.bytes !== undefined) return Buffer.from(c.bytes, "hex");
  if (c.text !== undefined) return c.text;
  if (c.json_text !== undefined) return JSON.parse(c.json_text);
  return c.json;
}

describe("deriveKey matches the shared vector", () => {
  for (const c of vectors.derive_key) {
    test(c.name, () => {
      if (c.fields) {
        const fields = (c.fields as Typed[]).map(typed);
        assert.equal(keyEncoding(...fields).toString("hex"), c.encoding_hex);
        assert.equal(deriveKey(...fields), c.key);
      } else {
        const mapping = Object.fromEntries(Object.entries(c.mapping as Record<string, Typed>).map(([k, v]) => [k, typed(v)]));
        assert.equal(keyEncoding(mapping).toString("hex"), c.encoding_hex);
        assert.equal(deriveKey(mapping), c.key);
        assert.equal(deriveKey(new Map(Object.entries(mapping))), c.key);
      }
    });
  }
});

describe("fingerprint matches the shared vector", () => {
  for (const c of vectors.fingerprint) {
    test(c.name, () => {
      const payload = fingerprintInput(c);
      if (c.canonical !== undefined) assert.equal(canonicalJson(payload).toString("utf8"), c.canonical);
      assert.equal(fingerprint(payload).toString("hex"), c.fingerprint);
    });
  }
});

describe("deriveKey rejects fields that have no canonical form", () => {
  for (const c of vectors.invalid_derive_key) {
    test(c.name, () => {
      assert.throws(() => deriveKey(...(c.fields as KeyField[])), /deriveKey/);
    });
  }
});

describe("fingerprint rejects numbers that languages print differently", () => {
  for (const c of vectors.invalid_fingerprint_json) {
    test(c.name, () => {
      assert.throws(() => fingerprint(c.json), RangeError);
    });
  }
});

test("a safe-integer number and the same bigint give the same key", () => {
  assert.equal(deriveKey(42), deriveKey(42n));
});

test("a number that is not a safe integer is rejected, as a bigint it is not", () => {
  assert.throws(() => deriveKey(2 ** 64), TypeError);
  assert.match(deriveKey(2n ** 64n), /^[0-9a-f]{64}$/);
});

test("a lone surrogate has no canonical form", () => {
  assert.throws(() => deriveKey("\ud800"), TypeError);
  assert.throws(() => fingerprint({ x: "\udc00" }), TypeError);
});

test("members whose value is undefined are left out, as JSON.stringify does", () => {
  assert.equal(canonicalJson({ a: 1, b: undefined }).toString(), '{"a":1}');
});
