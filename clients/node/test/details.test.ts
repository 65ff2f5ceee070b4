// What the typed errors say about a refusal (the google.rpc details of the
// status: reason, domain, retryDelayMs, field, metadata), the retry that never
// comes sooner than the server's RetryInfo, and late retries of a remembered
// key (completed with a short retention, Claimed again after its result
// expired): re-executed with the next fencing token, or refused as EXPIRED.
import { after, before, describe, test } from "node:test";
import assert from "node:assert/strict";
import { createHash, randomBytes } from "node:crypto";
import { mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import * as grpc from "@grpc/grpc-js";
import {
  DOMAIN,
  IdempotencyClient,
  IdempotencyError,
  InvalidArgument,
  KeyExpired,
  KeyNotFound,
  LeaseNotCurrent,
  PermissionDenied,
  ResourceExhausted,
  ResultExpired,
  Unauthenticated,
  Unavailable,
  type KeyRecord,
} from "../src";
import { freePort, startServer, type RunningServer } from "../src/testing";
import { recorder } from "./interceptors";
import { until, withServer } from "./helpers";

/** The error `promise` rejects with, checked to be of `Class`. */
async function rejection<E extends IdempotencyError>(promise: Promise<unknown>, Class: abstract new (...args: never[]) => E): Promise<E> {
  try {
    await promise;
  } catch (error) {
    assert.ok(error instanceof Class, `expected ${Class.name}, got ${String(error)}`);
    return error;
  }
  assert.fail(`expected ${Class.name}, but the call succeeded`);
}

withServer("error details", ["sqlite"], (s) => {
  test("an invalid argument names its field", async () => {
    const error = await rejection(s.client.claim(s.namespace(), ""), InvalidArgument);
    assert.deepEqual(
      [error.code, error.reason, error.domain, error.field, error.retryDelayMs],
      [grpc.status.INVALID_ARGUMENT, "INVALID_ARGUMENT", DOMAIN, "key", undefined],
    );
    assert.deepEqual(error.metadata, { field: "key" });
    assert.deepEqual(error.details.fieldViolations, [{ field: "key", description: "must not be empty" }]);
  });

  test("an invalid batch item names the item's field", async () => {
    const ns = s.namespace();
    const error = await rejection(s.client.claimBatch([{ namespace: ns, key: "a" }, { namespace: ns, key: "" }]), InvalidArgument);
    assert.equal(error.field, "items[1].key");
  });

  test("a complete of a key without a record is NOT_FOUND", async () => {
    const error = await rejection(s.client.complete(s.namespace(), "never", "0".repeat(32), "x"), KeyNotFound);
    assert.equal(error.constructor, KeyNotFound);
    assert.deepEqual([error.reason, error.domain, error.retryDelayMs, error.field], ["NOT_FOUND", DOMAIN, undefined, undefined]);
    assert.deepEqual(error.metadata, {});
  });

  test("the three ways a lease is not current are told apart", async () => {
    const ns = s.namespace();
    const first = await s.client.claim(ns, "lost", { leaseTtlMs: 1000 });
    assert.equal(first.outcome, "CLAIMED");
    await until(async () => (await s.other.claim(ns, "lost", { leaseTtlMs: 60_000 })).outcome === "CLAIMED", "the lease to run out");
    if (first.outcome !== "CLAIMED") return;
    const lost = await rejection(s.client.complete(ns, "lost", first.leaseToken, "late"), LeaseNotCurrent);
    assert.deepEqual([lost.reason, lost.domain, lost.retryDelayMs], ["LEASE_LOST", DOMAIN, undefined]);

    const released = await s.client.claim(ns, "released");
    if (released.outcome !== "CLAIMED") assert.fail("not claimed");
    await s.client.release(ns, "released", released.leaseToken);
    const error = await rejection(s.client.complete(ns, "released", released.leaseToken, "late"), LeaseNotCurrent);
    assert.equal(error.reason, "LEASE_RELEASED");

    const done = await s.client.claim(ns, "completed");
    if (done.outcome !== "CLAIMED") assert.fail("not claimed");
    await s.client.complete(ns, "completed", done.leaseToken, "done");
    const completed = await rejection(s.client.release(ns, "completed", done.leaseToken), LeaseNotCurrent);
    assert.equal(completed.reason, "KEY_COMPLETED");
  });

  test("a batch item's error carries its reason", async () => {
    const ns = s.namespace();
    const claim = await s.client.claim(ns, "released");
    if (claim.outcome !== "CLAIMED") assert.fail("not claimed");
    await s.client.release(ns, "released", claim.leaseToken);
    const items = await s.client.completeBatch([
      { namespace: ns, key: "never", leaseToken: "0".repeat(32) },
      { namespace: ns, key: "released", leaseToken: claim.leaseToken },
    ]);
    const errors = items.map((item) => (item.ok ? undefined : item.error));
    assert.ok(errors[0] instanceof KeyNotFound && errors[1] instanceof LeaseNotCurrent);
    assert.deepEqual(errors.map((e) => e?.reason), ["NOT_FOUND", "LEASE_RELEASED"]);
    assert.deepEqual(errors.map((e) => e?.domain), [DOMAIN, DOMAIN]);
  });

  test("an error that never reached the service has no details", async () => {
    const client = new IdempotencyClient(`127.0.0.1:${await freePort()}`, { retry: false, timeoutMs: 2000 });
    try {
      const error = await rejection(client.get("ns", "k"), Unavailable);
      assert.deepEqual([error.reason, error.domain, error.retryDelayMs, error.field], [undefined, undefined, undefined, undefined]);
      assert.deepEqual(error.metadata, {});
    } finally {
      client.close();
    }
  });

  /** A key completed with the shortest retention (1 s), polled until the server remembers it. */
  async function remembered(ns: string, key: string, response = "done"): Promise<KeyRecord> {
    const claim = await s.client.claim(ns, key, { fingerprint: Buffer.from("fp-1"), retentionMs: 1000 });
    if (claim.outcome !== "CLAIMED") assert.fail(`not claimed: ${claim.outcome}`);
    await s.client.complete(ns, key, claim.leaseToken, response, { retentionMs: 1000 });
    return rememberedRecord(ns, key);
  }

  /** Get polled until the key is remembered: ABSENT, with rememberedUntil set. */
  async function rememberedRecord(ns: string, key: string): Promise<KeyRecord> {
    const record = await until(async () => {
      const r = await s.client.get(ns, key);
      return r.state === "ABSENT" && r.rememberedUntil !== null ? r : undefined;
    }, "the result to expire and the key to be remembered");
    return record!;
  }

  test("get shows a remembered key and its marker", async () => {
    const record = await remembered(s.namespace(), "k");
    assert.equal(record.state, "ABSENT");
    assert.equal(record.fencingToken, 1n);
    assert.deepEqual(record.fingerprint, Buffer.from("fp-1"));
    assert.equal(record.response, null);
    assert.ok(record.completedAt !== null && record.expiresAt !== null && record.completedAt <= record.expiresAt);
    assert.equal(record.rememberedUntil!.getTime() - record.completedAt.getTime(), 7 * 86_400_000);
  });

  test("complete, release and extendLease of a remembered key say KEY_EXPIRED", async () => {
    const ns = s.namespace();
    const claim = await s.client.claim(ns, "k", { retentionMs: 1000 });
    if (claim.outcome !== "CLAIMED") assert.fail("not claimed");
    await s.client.complete(ns, "k", claim.leaseToken, "done", { retentionMs: 1000 });
    const record = await rememberedRecord(ns, "k");
    for (const call of [
      () => s.client.complete(ns, "k", claim.leaseToken, "again"),
      () => s.client.release(ns, "k", claim.leaseToken),
      () => s.client.extendLease(ns, "k", claim.leaseToken),
    ]) {
      const error = await rejection(call(), KeyExpired);
      assert.ok(error instanceof KeyNotFound);
      assert.deepEqual([error.code, error.reason, error.domain, error.retryDelayMs], [grpc.status.NOT_FOUND, "KEY_EXPIRED", DOMAIN, undefined]);
      assert.deepEqual(Object.keys(error.metadata).sort(), ["completed_at", "remembered_until"]);
      // Milliseconds in a Date: the marker's own times, to the millisecond.
      assert.equal(error.completedAt!.getTime(), record.completedAt!.getTime());
      assert.equal(error.rememberedUntil!.getTime(), record.rememberedUntil!.getTime());
    }
  });

  test("a late retry refused is EXPIRED and changes nothing", async () => {
    const ns = s.namespace();
    const record = await remembered(ns, "k");
    const late = await s.client.claim(ns, "k", { fingerprint: Buffer.from("fp-1"), lateRetry: "refuse" });
    assert.equal(late.outcome, "EXPIRED");
    if (late.outcome !== "EXPIRED") return;
    assert.equal(late.completedAt.getTime(), record.completedAt!.getTime());
    assert.equal(late.fencingToken, 1n);
    assert.deepEqual(await s.client.get(ns, "k"), record);
    const other = await s.client.claim(ns, "k", { fingerprint: Buffer.from("fp-2"), lateRetry: "refuse" });
    assert.equal(other.outcome, "FINGERPRINT_MISMATCH");
  });

  test("a late retry re-executed claims with the next fencing token", async () => {
    const ns = s.namespace();
    const record = await remembered(ns, "k");
    const late = await s.client.claim(ns, "k", { fingerprint: Buffer.from("fp-1") }); // the server's policy: reexecute
    if (late.outcome !== "CLAIMED") assert.fail(`not claimed: ${late.outcome}`);
    assert.equal(late.completedAt!.getTime(), record.completedAt!.getTime());
    assert.equal(late.fencingToken, 2n);
    await s.client.complete(ns, "k", late.leaseToken, "again");
    const replay = await s.client.claim(ns, "k");
    assert.ok(replay.outcome === "COMPLETED" && replay.response.toString() === "again");
    // A fresh key's Claim has no earlier completion.
    const fresh = await s.client.claim(ns, "fresh");
    assert.ok(fresh.outcome === "CLAIMED" && fresh.completedAt === null);
  });

  test("once() refusing a late retry throws ResultExpired without running the work", async () => {
    const ns = s.namespace();
    const record = await remembered(ns, "k", '{"charged":1}');
    let ran = 0;
    const error = await rejection(s.client.once(ns, "k", async () => ran++, { lateRetry: "refuse" }), ResultExpired);
    assert.equal(ran, 0);
    assert.equal(error.completedAt!.getTime(), record.completedAt!.getTime());
    assert.equal(error.fencingToken, 1n);
  });

  test("once() re-executing a late retry runs the work and says when the key completed", async () => {
    const ns = s.namespace();
    const record = await remembered(ns, "k", '{"charged":1}');
    let seen: { completedBefore: Date | null; fencingToken: bigint } | undefined;
    const result = await s.client.onceWithDetails(ns, "k", async (lease) => {
      seen = { completedBefore: lease.completedBefore, fencingToken: lease.fencingToken };
      return { charged: 2 };
    }, { lateRetry: "reexecute" });
    assert.deepEqual(result.value, { charged: 2 });
    assert.equal(result.replayed, false);
    assert.equal(seen!.completedBefore!.getTime(), record.completedAt!.getTime());
    assert.equal(seen!.fencingToken, 2n);
    await s.client.once(ns, "fresh", async (lease) => assert.equal(lease.completedBefore, null));
  });

  test("a lateRetry out of range is refused before any call", async () => {
    await assert.rejects(s.client.claim(s.namespace(), "k", { lateRetry: "sometimes" as never }), TypeError);
    await assert.rejects(s.client.once(s.namespace(), "k", async () => 1, { lateRetry: "sometimes" as never }), TypeError);
  });
});

const newToken = () => `idem_${randomBytes(32).toString("hex")}`;
const tokenHash = (token: string) => `sha256:${createHash("sha256").update(token, "utf8").digest("hex")}`;
const ORDERS_TOKEN = newToken();
const LIMITED_TOKEN = newToken();
const unique = (prefix: string) => `${prefix}/node-${randomBytes(6).toString("hex")}`;

describe("error details of the identities' refusals", () => {
  let server: RunningServer | undefined;
  const clients: IdempotencyClient[] = [];
  const connect = (options: ConstructorParameters<typeof IdempotencyClient>[1]) => {
    const client = new IdempotencyClient(server!.target, options);
    clients.push(client);
    return client;
  };

  before(async () => {
    const dir = mkdtempSync(join(tmpdir(), "idempotency-node-details-"));
    writeFileSync(
      join(dir, "policy.toml"),
      `
[[identity]]
name = "orders"
token_hashes = ["${tokenHash(ORDERS_TOKEN)}"]
namespaces = ["orders/*"]

[[identity]]
name = "limited"
token_hashes = ["${tokenHash(LIMITED_TOKEN)}"]
namespaces = ["limited/*"]
rate_limit_per_second = 1
rate_limit_burst = 1
`,
    );
    server = await startServer({ dataDir: dir, env: { IDEMPOTENCY_POLICY_FILE: join(dir, "policy.toml") } });
  });
  after(async () => {
    for (const client of clients) client.close();
    await server?.stop();
  });

  test("unknown credentials and a namespace not granted say why", async () => {
    const unknown = await rejection(connect({ token: newToken() }).get(unique("orders"), "k"), Unauthenticated);
    assert.deepEqual([unknown.reason, unknown.domain, unknown.retryDelayMs], ["UNAUTHENTICATED", DOMAIN, undefined]);
    const denied = await rejection(connect({ token: ORDERS_TOKEN }).get(unique("billing"), "k"), PermissionDenied);
    assert.deepEqual([denied.reason, denied.domain, denied.retryDelayMs], ["PERMISSION_DENIED", DOMAIN, undefined]);
  });

  test("the rate limit says when the next call is allowed", async () => {
    const client = connect({ token: LIMITED_TOKEN, retry: false });
    const ns = unique("limited");
    let refusal: ResourceExhausted | undefined;
    for (let i = 0; i < 5 && !refusal; i++) {
      try {
        await client.get(ns, `k${i}`);
      } catch (error) {
        assert.ok(error instanceof ResourceExhausted, String(error));
        refusal = error;
      }
    }
    assert.ok(refusal, "no call was refused");
    assert.deepEqual([refusal.reason, refusal.domain], ["RATE_LIMITED", DOMAIN]);
    assert.ok(refusal.retryDelayMs! > 0 && refusal.retryDelayMs! <= 1000, `retryDelayMs ${refusal.retryDelayMs}`);
  });

  test("the client retries a rate limit no sooner than the server allows", async () => {
    const ns = unique("limited");
    const probe = connect({ token: LIMITED_TOKEN, retry: false });
    // Empty the bucket: a call refused says it is.
    await until(async () => {
      try {
        await probe.get(ns, "probe");
        return false;
      } catch (error) {
        return error instanceof ResourceExhausted;
      }
    }, "an empty bucket", 5000);
    const recording = recorder();
    const client = connect({ token: LIMITED_TOKEN, interceptors: [recording.interceptor] });
    const started = Date.now();
    for (let i = 0; i < 2; i++) assert.equal((await client.get(ns, `k${i}`)).state, "ABSENT");
    const elapsed = Date.now() - started;
    // One refusal per call: its retry waited for RetryInfo's delay, where the
    // policy's own backoff (50 ms, then 100 ms) would have been refused again.
    assert.equal(recording.of("Get").filter((a) => a.code === grpc.status.RESOURCE_EXHAUSTED).length, 2);
    assert.equal(recording.of("Get").filter((a) => a.code === grpc.status.OK).length, 2);
    assert.ok(elapsed >= 1000 && elapsed < 4000, `elapsed ${elapsed} ms`);
  });
});
