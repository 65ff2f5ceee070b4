// Stable event keys and payload fingerprints, byte-compatible with the Python
// client: the canonical forms are specified in clients/KEYS.md, and
// clients/testdata/key_vectors.json pins both clients to the same bytes.
import { createHash } from "node:crypto";

/** A field of an event's identity. The type is part of the key: "1", 1 and bytes "1" differ. */
export type KeyField = string | Uint8Array | number | bigint;

/** Domain separation and version of the key scheme. */
const KEY_PREFIX = Buffer.from("idempotency-key/v1\n", "ascii");

const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;

/**
 * A stable key from the fields that make an event that event: 64 lowercase hex
 * characters, the SHA-256 of keyEncoding() (clients/KEYS.md).
 *
 *     deriveKey("stripe", event.id)                        // positional: order matters
 *     deriveKey({ source: "stripe", event_id: event.id })  // named: order does not
 *
 * Fields are strings, bytes (Uint8Array/Buffer), safe-integer numbers or bigints.
 * Never include what changes between deliveries (timestamps, attempt numbers).
 */
export function deriveKey(...fields: KeyField[]): string;
export function deriveKey(fields: Readonly<Record<string, KeyField>> | ReadonlyMap<string, KeyField>): string;
export function deriveKey(...fields: unknown[]): string {
  return createHash("sha256").update(keyEncoding(...(fields as KeyField[]))).digest("hex");
}

/** The canonical bytes that deriveKey() hashes. */
export function keyEncoding(...fields: KeyField[]): Buffer;
export function keyEncoding(fields: Readonly<Record<string, KeyField>> | ReadonlyMap<string, KeyField>): Buffer;
export function keyEncoding(...fields: unknown[]): Buffer {
  if (fields.length === 1 && isMapping(fields[0])) {
    return encodeMapping(fields[0]);
  }
  if (fields.length === 0) {
    throw new RangeError("deriveKey: at least one field is needed");
  }
  return Buffer.concat([KEY_PREFIX, Buffer.from("L"), u64(fields.length), ...fields.map(encodeField)]);
}

function isMapping(value: unknown): value is Record<string, unknown> | ReadonlyMap<string, unknown> {
  return value instanceof Map || isPlainObject(value);
}

function isPlainObject(value: unknown): value is Record<string, unknown> {
  if (value === null || typeof value !== "object") return false;
  const proto = Object.getPrototypeOf(value);
  return proto === Object.prototype || proto === null;
}

function encodeMapping(mapping: Record<string, unknown> | ReadonlyMap<string, unknown>): Buffer {
  const pairs: [string, unknown][] =
    mapping instanceof Map ? [...mapping.entries()] : Object.entries(mapping as Record<string, unknown>);
  if (pairs.length === 0) {
    throw new RangeError("deriveKey: at least one field is needed");
  }
  const entries = pairs.map(([name, value]) => {
    if (typeof name !== "string") throw new TypeError("deriveKey: field names must be strings");
    return { sortKey: utf8(name, "deriveKey"), name, value };
  });
  entries.sort((a, b) => Buffer.compare(a.sortKey, b.sortKey)); // by the names' UTF-8 bytes
  const parts = [KEY_PREFIX, Buffer.from("M"), u64(entries.length)];
  for (const { name, value } of entries) {
    parts.push(encodeField(name), encodeField(value));
  }
  return Buffer.concat(parts);
}

function encodeField(value: unknown): Buffer {
  let tag: string;
  let body: Buffer;
  if (typeof value === "string") {
    tag = "s";
    body = utf8(value, "deriveKey");
  } else if (value instanceof Uint8Array) {
    tag = "b";
    body = Buffer.from(value);
  } else if (typeof value === "bigint" || (typeof value === "number" && Number.isSafeInteger(value))) {
    tag = "i";
    body = Buffer.from(BigInt(value).toString(10), "ascii");
  } else {
    const what = typeof value === "number" ? `the number ${value} (not a safe integer)` : describe(value);
    throw new TypeError(`deriveKey: a field must be a string, bytes or an integer, got ${what}`);
  }
  return Buffer.concat([Buffer.from(tag), u64(body.length), body]);
}

function u64(n: number): Buffer {
  const out = Buffer.alloc(8);
  out.writeBigUInt64BE(BigInt(n));
  return out;
}

function utf8(text: string, who: string): Buffer {
  if (LONE_SURROGATE.test(text)) {
    throw new TypeError(`${who}: a string with a lone surrogate has no UTF-8 form`);
  }
  return Buffer.from(text, "utf8");
}

function describe(value: unknown): string {
  if (value === null) return "null";
  if (Array.isArray(value)) return "an array";
  return typeof value;
}

/**
 * The SHA-256 (32 bytes) of a payload, for Claim's fingerprint: bytes as they
 * are (a webhook's raw body), a string as its UTF-8 bytes, anything else as
 * canonical JSON (clients/KEYS.md).
 */
export function fingerprint(payload: unknown): Buffer {
  let data: Buffer;
  if (payload instanceof Uint8Array) {
    data = Buffer.from(payload);
  } else if (typeof payload === "string") {
    data = utf8(payload, "fingerprint");
  } else {
    data = canonicalJson(payload);
  }
  return createHash("sha256").update(data).digest();
}

const MAX_SAFE = BigInt(Number.MAX_SAFE_INTEGER);

/**
 * The canonical JSON of a value (UTF-8), as fingerprint() hashes it: RFC 8785
 * restricted to integers. Members whose value is undefined are left out, as
 * JSON.stringify leaves them out.
 */
export function canonicalJson(value: unknown): Buffer {
  return Buffer.from(canonical(value), "utf8");
}

function canonical(value: unknown): string {
  if (value === null) return "null";
  switch (typeof value) {
    case "boolean":
      return value ? "true" : "false";
    case "number":
      if (!Number.isSafeInteger(value)) {
        throw new RangeError(
          `fingerprint: ${value} is not an integer within ±(2^53 - 1); encode it as a string or in minor units`,
        );
      }
      return String(value); // -0 is written 0
    case "bigint":
      if (value > MAX_SAFE || value < -MAX_SAFE) {
        throw new RangeError(`fingerprint: ${value} is beyond ±(2^53 - 1); encode it as a string`);
      }
      return value.toString(10);
    case "string":
      utf8(value, "fingerprint");
      return JSON.stringify(value);
  }
  if (Array.isArray(value)) {
    return `[${value.map((item) => {
      if (item === undefined) throw new TypeError("fingerprint: undefined in an array has no JSON form");
      return canonical(item);
    }).join(",")}]`;
  }
  if (isPlainObject(value)) {
    const names = Object.keys(value).filter((name) => value[name] !== undefined);
    names.sort(); // by UTF-16 code units, as RFC 8785 orders members
    return `{${names.map((name) => `${canonical(name)}:${canonical(value[name])}`).join(",")}}`;
  }
  throw new TypeError(`fingerprint: cannot encode ${describe(value)} as canonical JSON`);
}
