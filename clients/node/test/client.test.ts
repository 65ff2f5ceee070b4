// The five RPCs through IdempotencyClient: typed results for every outcome and
// state, and a typed error for every status a caller can act on.
import { test } from "node:test";
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import {
  IdempotencyClient,
  InvalidArgument,
  KeyNotFound,
  LeaseNotCurrent,
  Unavailable,
  type ClaimResult,
} from "../src";
import { freePort } from "../src/testing";
import { withServer } from "./helpers";

function expectOutcome<O extends ClaimResult["outcome"]>(claim: ClaimResult, outcome: O): Extract<ClaimResult, { outcome: O }> {
  assert.equal(claim.outcome, outcome);
  return claim as Extract<ClaimResult, { outcome: O }>;
}

const token = () => randomBytes(16).toString("hex");

withServer("rpcs", ["sqlite", "postgres"], (s) => {
  test("a claim on a new key is claimed with a token and fencing token one", async () => {
    const ns = s.namespace();
    const before = Date.now();
    const claim = expectOutcome(await s.client.claim(ns, "k", { leaseTtlMs: 30_000 }), "CLAIMED");
    assert.match(claim.leaseToken, /^[0-9a-f]{32}$/);
    assert.equal(claim.fencingToken, 1n);
    assert.ok(claim.leaseExpiresAt.getTime() > before);
    assert.ok(claim.leaseExpiresAt.getTime() <= Date.now() + 31_000);
  });

  test("a claim while another lease is live is in progress with retryAfterMs", async () => {
    const ns = s.namespace();
    const first = expectOutcome(await s.client.claim(ns, "k", { leaseTtlMs: 30_000 }), "CLAIMED");
    const second = expectOutcome(await s.other.claim(ns, "k"), "IN_PROGRESS");
    assert.ok(second.retryAfterMs > 0 && second.retryAfterMs <= 30_000);
    assert.equal(second.leaseExpiresAt?.getTime(), first.leaseExpiresAt.getTime());
  });

  test("a completed key replays the stored response", async () => {
    const ns = s.namespace();
    const claim = expectOutcome(await s.client.claim(ns, "k"), "CLAIMED");
    const done = await s.client.complete(ns, "k", claim.leaseToken, '{"ok":true}', { retentionMs: 60_000 });
    const replay = expectOutcome(await s.other.claim(ns, "k"), "COMPLETED");
    assert.equal(replay.response.toString(), '{"ok":true}');
    assert.equal(replay.expiresAt?.getTime(), done.expiresAt.getTime());
  });

  test("a different fingerprint is a mismatch and changes nothing", async () => {
    const ns = s.namespace();
    const claim = expectOutcome(await s.client.claim(ns, "k", { fingerprint: Buffer.alloc(32, 1) }), "CLAIMED");
    await s.client.complete(ns, "k", claim.leaseToken, "done");
    expectOutcome(await s.client.claim(ns, "k", { fingerprint: Buffer.alloc(32, 2) }), "FINGERPRINT_MISMATCH");
    const record = await s.client.get(ns, "k");
    assert.equal(record.state, "COMPLETED");
    assert.deepEqual(record.fingerprint, Buffer.alloc(32, 1));
    expectOutcome(await s.client.claim(ns, "k"), "COMPLETED"); // empty: don't check
  });
});

withServer("rpcs", ["sqlite"], (s) => {
  test("a repeated complete returns ok and keeps the first response", async () => {
    const ns = s.namespace();
    const claim = expectOutcome(await s.client.claim(ns, "k"), "CLAIMED");
    const first = await s.client.complete(ns, "k", claim.leaseToken, "first");
    const again = await s.client.complete(ns, "k", claim.leaseToken, "second");
    assert.equal(again.expiresAt.getTime(), first.expiresAt.getTime());
    assert.equal((await s.client.get(ns, "k")).response?.toString(), "first");
  });

  test("release makes the key claimable again with the next fencing token", async () => {
    const ns = s.namespace();
    const first = expectOutcome(await s.client.claim(ns, "k"), "CLAIMED");
    await s.client.release(ns, "k", first.leaseToken);
    const second = expectOutcome(await s.client.claim(ns, "k"), "CLAIMED");
    assert.equal(second.fencingToken, 2n);
  });

  test("extendLease moves the lease expiry forward", async () => {
    const ns = s.namespace();
    const claim = expectOutcome(await s.client.claim(ns, "k", { leaseTtlMs: 2000 }), "CLAIMED");
    const extended = await s.client.extendLease(ns, "k", claim.leaseToken, { leaseTtlMs: 60_000 });
    assert.ok(extended.leaseExpiresAt > claim.leaseExpiresAt);
  });

  test("get reports each state of a record", async () => {
    const ns = s.namespace();
    const absent = await s.client.get(ns, "k");
    assert.equal(absent.state, "ABSENT");
    assert.equal(absent.fencingToken, null);
    const claim = expectOutcome(await s.client.claim(ns, "k", { fingerprint: Buffer.from("fp") }), "CLAIMED");
    const inProgress = await s.client.get(ns, "k");
    assert.equal(inProgress.state, "IN_PROGRESS");
    assert.equal(inProgress.fencingToken, 1n);
    assert.equal(inProgress.fingerprint?.toString(), "fp");
    assert.equal(inProgress.leaseExpiresAt?.getTime(), claim.leaseExpiresAt.getTime());
    assert.equal(inProgress.response, null);
    await s.client.release(ns, "k", claim.leaseToken);
    assert.equal((await s.client.get(ns, "k")).state, "RELEASED");
    const again = expectOutcome(await s.client.claim(ns, "k"), "CLAIMED");
    await s.client.complete(ns, "k", again.leaseToken, Buffer.from("r"));
    const completed = await s.client.get(ns, "k");
    assert.equal(completed.state, "COMPLETED");
    assert.equal(completed.response?.toString(), "r");
  });

  test("complete on an unknown key rejects with KeyNotFound", async () => {
    await assert.rejects(s.client.complete(s.namespace(), "never", token(), "x"), KeyNotFound);
  });

  test("complete with a token that is not current rejects with LeaseNotCurrent", async () => {
    const ns = s.namespace();
    await s.client.claim(ns, "k");
    await assert.rejects(s.client.complete(ns, "k", token(), "x"), (error: unknown) => {
      assert.ok(error instanceof LeaseNotCurrent);
      assert.equal(error.code, 9); // FAILED_PRECONDITION
      return true;
    });
  });

  const invalid: [string, (c: IdempotencyClient, ns: string) => Promise<unknown>, string][] = [
    ["empty namespace", (c) => c.claim("", "k"), "namespace"],
    ["long namespace", (c) => c.claim("n".repeat(129), "k"), "namespace"],
    ["empty key", (c, ns) => c.claim(ns, ""), "key"],
    ["long key", (c, ns) => c.claim(ns, "k".repeat(513)), "key"],
    ["long fingerprint", (c, ns) => c.claim(ns, "k", { fingerprint: Buffer.alloc(65) }), "fingerprint"],
    ["short lease", (c, ns) => c.claim(ns, "k", { leaseTtlMs: 500 }), "lease_ttl"],
    ["malformed token", (c, ns) => c.complete(ns, "k", "not-a-token"), "lease_token"],
  ];
  for (const [name, call, field] of invalid) {
    test(`invalid argument (${name}) rejects with InvalidArgument naming ${field}`, async () => {
      await assert.rejects(call(s.client, s.namespace()), (error: unknown) => {
        assert.ok(error instanceof InvalidArgument, String(error));
        assert.match(error.message, new RegExp(field));
        return true;
      });
    });
  }
});

test("an unreachable server rejects with Unavailable", async () => {
  const client = new IdempotencyClient(`127.0.0.1:${await freePort()}`, { timeoutMs: 2000 });
  try {
    await assert.rejects(client.get("ns", "k"), Unavailable);
  } finally {
    client.close();
  }
});
