// ClaimBatch, CompleteBatch and Purge: per-item results in order, per-item
// errors as the single calls' classes, and whole-call errors that name the item.
import { test } from "node:test";
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import {
  IdempotencyClient,
  IdempotencyError,
  InvalidArgument,
  KeyNotFound,
  LeaseNotCurrent,
  type ClaimResult,
  type CompleteItemResult,
} from "../src";
import { withServer } from "./helpers";

function expectOutcome<O extends ClaimResult["outcome"]>(claim: ClaimResult, outcome: O): Extract<ClaimResult, { outcome: O }> {
  assert.equal(claim.outcome, outcome);
  return claim as Extract<ClaimResult, { outcome: O }>;
}

function expectError(result: CompleteItemResult | undefined): IdempotencyError {
  assert.ok(result && !result.ok, `expected a failed item, got ${JSON.stringify(result)}`);
  return result.error;
}

const token = () => randomBytes(16).toString("hex");

withServer("batch", ["sqlite", "postgres"], (s) => {
  test("claimBatch answers each item in order as its own claim would", async () => {
    const ns = s.namespace();
    const done = expectOutcome(await s.client.claim(ns, "done", { fingerprint: Buffer.alloc(32, 1) }), "CLAIMED");
    const stored = await s.client.complete(ns, "done", done.leaseToken, '{"ok":true}', { retentionMs: 60_000 });
    const fp = expectOutcome(await s.client.claim(ns, "fp", { fingerprint: Buffer.alloc(32, 1) }), "CLAIMED");
    await s.client.complete(ns, "fp", fp.leaseToken, "x");

    const results = await s.client.claimBatch([
      { namespace: ns, key: "new", leaseTtlMs: 30_000, retentionMs: 300_000 },
      { namespace: ns, key: "done", fingerprint: Buffer.alloc(32, 1) },
      { namespace: ns, key: "dup", leaseTtlMs: 30_000 },
      { namespace: ns, key: "dup", leaseTtlMs: 30_000 },
      { namespace: ns, key: "fp", fingerprint: Buffer.alloc(32, 2) },
    ]);

    assert.deepEqual(
      results.map((r) => r.outcome),
      ["CLAIMED", "COMPLETED", "CLAIMED", "IN_PROGRESS", "FINGERPRINT_MISMATCH"],
    );
    const created = expectOutcome(results[0], "CLAIMED");
    assert.match(created.leaseToken, /^[0-9a-f]{32}$/);
    assert.equal(created.fencingToken, 1n);
    const replay = expectOutcome(results[1], "COMPLETED");
    assert.equal(replay.response.toString(), '{"ok":true}');
    assert.equal(replay.expiresAt?.getTime(), stored.expiresAt.getTime());
    const first = expectOutcome(results[2], "CLAIMED");
    const second = expectOutcome(results[3], "IN_PROGRESS");
    assert.equal(first.fencingToken, 1n);
    assert.equal(second.leaseExpiresAt?.getTime(), first.leaseExpiresAt.getTime());
    assert.ok(second.retryAfterMs > 0 && second.retryAfterMs <= 30_000);
    // The leases are real: the dup key's holder is the first item's.
    await s.client.complete(ns, "dup", first.leaseToken, "d");
    assert.equal((await s.client.get(ns, "dup")).response?.toString(), "d");
    assert.deepEqual((await s.client.get(ns, "fp")).fingerprint, Buffer.alloc(32, 1));
  });

  test("completeBatch answers each item with its own result without rejecting", async () => {
    const ns = s.namespace();
    const ok = expectOutcome(await s.client.claim(ns, "ok"), "CLAIMED");
    await s.client.claim(ns, "taken");

    const results = await s.client.completeBatch([
      { namespace: ns, key: "ok", leaseToken: ok.leaseToken, response: "r", retentionMs: 60_000 },
      { namespace: ns, key: "taken", leaseToken: token(), response: Buffer.from("x") },
      { namespace: ns, key: "unknown", leaseToken: token() },
    ]);

    assert.deepEqual(results.map((r) => r.ok), [true, false, false]);
    const [done] = results;
    assert.ok(done?.ok);
    assert.equal(expectOutcome(await s.client.claim(ns, "ok"), "COMPLETED").expiresAt?.getTime(), done.expiresAt.getTime());
    assert.equal((await s.client.get(ns, "ok")).response?.toString(), "r");

    const wrongToken = expectError(results[1]);
    assert.equal(wrongToken.constructor, LeaseNotCurrent);
    assert.equal(wrongToken.code, 9); // FAILED_PRECONDITION
    assert.match(wrongToken.message, /^CompleteBatch: items\[1\]: FAILED_PRECONDITION: /);
    assert.equal((await s.client.get(ns, "taken")).state, "IN_PROGRESS");

    const unknown = expectError(results[2]);
    assert.equal(unknown.constructor, KeyNotFound);
    assert.equal(unknown.code, 5); // NOT_FOUND
    assert.match(unknown.message, /^CompleteBatch: items\[2\]: NOT_FOUND: /);
  });

  test("purge makes a completed key claimable again", async () => {
    const ns = s.namespace();
    const claim = expectOutcome(await s.client.claim(ns, "k"), "CLAIMED");
    await s.client.complete(ns, "k", claim.leaseToken, "old");

    assert.deepEqual(await s.client.purge(ns, "k", { reason: "INC-42: reprocess" }), {
      purged: true,
      previousState: "COMPLETED",
    });

    assert.equal((await s.client.get(ns, "k")).state, "ABSENT");
    const again = expectOutcome(await s.client.claim(ns, "k"), "CLAIMED");
    assert.notEqual(again.leaseToken, claim.leaseToken);
    await s.client.complete(ns, "k", again.leaseToken, "new");
    assert.equal(expectOutcome(await s.client.claim(ns, "k"), "COMPLETED").response.toString(), "new");
  });
});

withServer("batch", ["sqlite"], (s) => {
  test("a repeated complete in a batch is ok with the first expiry", async () => {
    const ns = s.namespace();
    const claim = expectOutcome(await s.client.claim(ns, "k"), "CLAIMED");
    const first = await s.client.complete(ns, "k", claim.leaseToken, "first");
    const [again] = await s.client.completeBatch([{ namespace: ns, key: "k", leaseToken: claim.leaseToken, response: "second" }]);
    assert.ok(again?.ok);
    assert.equal(again.expiresAt.getTime(), first.expiresAt.getTime());
    assert.equal((await s.client.get(ns, "k")).response?.toString(), "first");
  });

  const invalid: [string, (c: IdempotencyClient, ns: string) => Promise<unknown>, string][] = [
    ["claim empty key", (c, ns) => c.claimBatch([{ namespace: ns, key: "a" }, { namespace: ns, key: "b" }, { namespace: ns, key: "" }]), "items[2].key:"],
    ["claim short lease", (c, ns) => c.claimBatch([{ namespace: ns, key: "a" }, { namespace: ns, key: "b", leaseTtlMs: 500 }]), "items[1].lease_ttl:"],
    ["claim empty namespace", (c) => c.claimBatch([{ namespace: "", key: "a" }]), "items[0].namespace:"],
    ["claim none", (c) => c.claimBatch([]), "items:"],
    ["claim 501", (c, ns) => c.claimBatch(Array.from({ length: 501 }, (_, i) => ({ namespace: ns, key: `k${i}` }))), "items:"],
    ["complete malformed token", (c, ns) => c.completeBatch([{ namespace: ns, key: "a", leaseToken: token() }, { namespace: ns, key: "b", leaseToken: "not-a-token" }]), "items[1].lease_token:"],
    ["complete none", (c) => c.completeBatch([]), "items:"],
  ];
  for (const [name, call, prefix] of invalid) {
    test(`an invalid batch (${name}) rejects the whole call with InvalidArgument starting ${prefix}`, async () => {
      const ns = s.namespace();
      await assert.rejects(call(s.client, ns), (error: unknown) => {
        assert.ok(error instanceof InvalidArgument, String(error));
        assert.ok(error.message.split(": INVALID_ARGUMENT: ")[1]?.startsWith(prefix), error.message);
        return true;
      });
      for (const key of ["a", "b", "k0"]) assert.equal((await s.client.get(ns, key)).state, "ABSENT"); // nothing changed
    });
  }

  test("a batch item of the wrong type is rejected before the call, naming the item", async () => {
    const ns = s.namespace();
    await assert.rejects(
      s.client.claimBatch([{ namespace: ns, key: "a" }, { namespace: ns, key: "b", fingerprint: "abc" as never }]),
      (error: unknown) => error instanceof TypeError && /^items\[1\]\.fingerprint/.test(error.message),
    );
    assert.equal((await s.client.get(ns, "a")).state, "ABSENT");
  });

  test("purge of an absent key reports nothing purged", async () => {
    assert.deepEqual(await s.client.purge(s.namespace(), "never"), { purged: false, previousState: "ABSENT" });
  });

  test("purge revokes a live lease: its holder's complete rejects with KeyNotFound", async () => {
    const ns = s.namespace();
    const claim = expectOutcome(await s.client.claim(ns, "k", { leaseTtlMs: 60_000 }), "CLAIMED");
    assert.deepEqual(await s.other.purge(ns, "k", { reason: "stuck worker" }), { purged: true, previousState: "IN_PROGRESS" });
    await assert.rejects(s.client.complete(ns, "k", claim.leaseToken, "late"), KeyNotFound);
    expectOutcome(await s.client.claim(ns, "k"), "CLAIMED");
  });

  test("purge with a long reason rejects with InvalidArgument naming it", async () => {
    await assert.rejects(s.client.purge(s.namespace(), "k", { reason: "r".repeat(257) }), (error: unknown) => {
      assert.ok(error instanceof InvalidArgument);
      assert.match(error.message, /reason/);
      return true;
    });
  });
});
