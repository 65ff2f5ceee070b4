// ClaimBatch, CompleteBatch and Purge: per-item results in order, per-item
// errors as the single calls' classes, and whole-call errors that name the item;
// itemErrors: the flag on the wire, and a failed item decoded as its own error.
import { after, before, describe, test } from "node:test";
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { join } from "node:path";
import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";
import {
  IdempotencyClient,
  IdempotencyError,
  InvalidArgument,
  KeyNotFound,
  LeaseNotCurrent,
  Unavailable,
  type ClaimBatchResult,
  type ClaimResult,
  type CompleteItemResult,
} from "../src";
import { recorder } from "./interceptors";
import { withServer } from "./helpers";

function expectOutcome<O extends ClaimResult["outcome"]>(claim: ClaimBatchResult | undefined, outcome: O): Extract<ClaimResult, { outcome: O }> {
  assert.equal(claim?.outcome, outcome);
  return claim as Extract<ClaimResult, { outcome: O }>;
}

function expectError(result: CompleteItemResult | undefined): IdempotencyError {
  assert.ok(result && !result.ok, `expected a failed item, got ${JSON.stringify(result)}`);
  return result.error;
}

const token = () => randomBytes(16).toString("hex");

// The service's methods with the serializers grpc-js uses (the package's proto,
// copied to <package>/proto by scripts/generate.mjs; this file runs from dist/test).
const SERVICE = protoLoader.loadSync("idempotency/v1/idempotency.proto", {
  keepCase: false,
  longs: String,
  enums: String,
  defaults: false,
  oneofs: true,
  includeDirs: [join(__dirname, "..", "..", "proto")],
})["idempotency.v1.IdempotencyService"] as grpc.ServiceDefinition;

/** The item_errors field of a batch request as it goes on the wire: the client's request object, encoded and decoded again. */
function itemErrorsOnTheWire(method: "ClaimBatch" | "CompleteBatch", request: unknown): boolean {
  const definition = SERVICE[method];
  const decoded = definition.requestDeserialize(definition.requestSerialize(request)) as { itemErrors?: boolean };
  return decoded.itemErrors === true;
}

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

  test("itemErrors, on a store that reaches every key or none, changes no answer and sets no error", async () => {
    // On one PostgreSQL and on SQLite a batch fails as a whole or not at all,
    // so the flag must change nothing here; what it changes on Citus is
    // decoded in "a batch item that failed (item_errors)" below.
    const rec = recorder();
    const client = new IdempotencyClient(s.server.target, { interceptors: [rec.interceptor] });
    try {
      const batch = (ns: string) => [
        { namespace: ns, key: "ie-a", leaseTtlMs: 30_000 },
        { namespace: ns, key: "ie-a", leaseTtlMs: 30_000 },
        { namespace: ns, key: "ie-b", leaseTtlMs: 30_000 },
      ];
      const withFlag = await client.claimBatch(batch(s.namespace()), { itemErrors: true });
      const without = await client.claimBatch(batch(s.namespace()));
      assert.deepEqual(withFlag.map((r) => r.outcome), ["CLAIMED", "IN_PROGRESS", "CLAIMED"]);
      assert.deepEqual(withFlag.map((r) => r.outcome), without.map((r) => r.outcome));
      assert.deepEqual(withFlag.map((r) => r.ok), [true, true, true]);
      assert.ok(withFlag.every((r) => !("error" in r)), "no item carries an error");
      const first = expectOutcome(withFlag[0], "CLAIMED");
      const second = expectOutcome(withFlag[1], "IN_PROGRESS");
      assert.deepEqual([first.fencingToken, first.retried], [1n, false]);
      assert.equal(second.leaseExpiresAt?.getTime(), first.leaseExpiresAt.getTime());
      // The requests said so on the wire: item_errors true, then false (unset).
      assert.deepEqual(rec.of("ClaimBatch").map((a) => itemErrorsOnTheWire("ClaimBatch", a.request)), [true, false]);

      const ns = s.namespace();
      const [claim] = await client.claimBatch([{ namespace: ns, key: "k" }], { itemErrors: true });
      const held = expectOutcome(claim, "CLAIMED");
      const done = await client.completeBatch(
        [
          { namespace: ns, key: "k", leaseToken: held.leaseToken, response: "r" },
          { namespace: ns, key: "none", leaseToken: token() },
        ],
        { itemErrors: true },
      );
      assert.deepEqual(done.map((r) => r.ok), [true, false]);
      const unknown = expectError(done[1]);
      assert.equal(unknown.constructor, KeyNotFound);
      assert.deepEqual([unknown.code, unknown.reason, unknown.retryDelayMs], [5, "NOT_FOUND", undefined]);
      assert.equal((await s.client.get(ns, "k")).response?.toString(), "r");
      assert.deepEqual(rec.of("CompleteBatch").map((a) => itemErrorsOnTheWire("CompleteBatch", a.request)), [true]);
    } finally {
      client.close();
    }
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

// A ClaimBatch item answered with an ItemError, and CompleteBatch items with
// codes 14 and 10 and retry_after. The real server sends them only on Citus
// with a worker down (a key it cannot reach while it reaches the others: see
// tests/conformance/batch.rs and the citus_worker_crash fault scenario), never
// on SQLite or one PostgreSQL, which these tests run on; so a stand-in server
// answers over gRPC with what such a server sends, and the client decodes it
// from the wire as it would the real one's.
describe("a batch item that failed (item_errors)", () => {
  let server: grpc.Server;
  let client: IdempotencyClient;
  const seen: Record<string, { itemErrors?: boolean; items: { leaseToken: string }[] }[]> = { ClaimBatch: [], CompleteBatch: [] };
  const leaseExpiresAt = { seconds: String(Math.floor(Date.now() / 1000) + 30), nanos: 0 };

  before(async () => {
    server = new grpc.Server();
    server.addService(SERVICE, {
      ClaimBatch: (call: grpc.ServerUnaryCall<any, unknown>, callback: grpc.sendUnaryData<unknown>) => {
        seen.ClaimBatch.push(call.request);
        callback(null, {
          items: [
            { outcome: "OUTCOME_CLAIMED", leaseToken: call.request.items[0].leaseToken, fencingToken: "1", leaseExpiresAt },
            {
              outcome: "OUTCOME_UNSPECIFIED",
              error: {
                code: 14,
                message: "the store is unavailable: connection to worker 2 refused",
                reason: "STORE_UNAVAILABLE",
                retryAfter: { seconds: "1", nanos: 250_000_000 },
              },
            },
            { error: { code: 10, message: "the key kept changing", reason: "CONTENDED", retryAfter: { seconds: "0", nanos: 50_000_000 } } },
          ],
        });
      },
      CompleteBatch: (call: grpc.ServerUnaryCall<any, unknown>, callback: grpc.sendUnaryData<unknown>) => {
        seen.CompleteBatch.push(call.request);
        callback(null, {
          items: [
            { code: 0, expiresAt: leaseExpiresAt },
            { code: 14, message: "the store is unavailable", reason: "STORE_UNAVAILABLE", retryAfter: { seconds: "0", nanos: 500_000_000 } },
            { code: 9, message: "the lease was lost", reason: "LEASE_LOST" },
          ],
        });
      },
    });
    const port = await new Promise<number>((resolve, reject) =>
      server.bindAsync("127.0.0.1:0", grpc.ServerCredentials.createInsecure(), (error, bound) => (error ? reject(error) : resolve(bound))),
    );
    client = new IdempotencyClient(`127.0.0.1:${port}`, { retry: false });
  });

  after(async () => {
    client.close();
    await new Promise<void>((resolve) => server.tryShutdown(() => resolve()));
  });

  const claims = [
    { namespace: "ns", key: "a" },
    { namespace: "ns", key: "b" },
    { namespace: "ns", key: "c", leaseToken: token() },
  ];

  test("a ClaimBatch item with an ItemError is ok false, outcome UNSPECIFIED, with the typed error, its reason and retry delay", async () => {
    const results: ClaimBatchResult[] = await client.claimBatch(claims, { itemErrors: true });
    const request = seen.ClaimBatch.at(-1)!;
    assert.equal(request.itemErrors, true);

    const [claimed, unreachable, contended] = results;
    assert.ok(claimed?.ok && claimed.outcome === "CLAIMED");
    assert.equal(claimed.leaseToken, request.items[0]!.leaseToken);

    assert.ok(unreachable && !unreachable.ok);
    assert.equal(unreachable.outcome, "UNSPECIFIED");
    assert.ok(unreachable.error instanceof Unavailable, String(unreachable.error));
    assert.deepEqual(
      [unreachable.error.code, unreachable.error.reason, unreachable.error.domain, unreachable.error.retryDelayMs],
      [grpc.status.UNAVAILABLE, "STORE_UNAVAILABLE", "idempotency-service", 1250],
    );
    assert.equal(unreachable.error.message, "ClaimBatch: items[1]: UNAVAILABLE: the store is unavailable: connection to worker 2 refused");
    // The lease token the item was sent with (made by the client), to retry it with.
    assert.equal(unreachable.leaseToken, request.items[1]!.leaseToken);
    assert.match(unreachable.leaseToken, /^[0-9a-f]{32}$/);

    // ABORTED: the class claim() would have thrown, the base one, with code 10.
    assert.ok(contended && !contended.ok);
    assert.equal(contended.error.constructor, IdempotencyError);
    assert.deepEqual([contended.error.code, contended.error.reason, contended.error.retryDelayMs], [grpc.status.ABORTED, "CONTENDED", 50]);
    assert.equal(contended.leaseToken, claims[2]!.leaseToken);
  });

  test("without itemErrors the request leaves the field unset, and an item error (sent only when asked) rejects the call", async () => {
    await assert.rejects(client.claimBatch(claims), (error: unknown) => {
      assert.ok(error instanceof Unavailable, String(error));
      assert.match(error.message, /^ClaimBatch: items\[1\]: UNAVAILABLE: /);
      return true;
    });
    assert.equal(seen.ClaimBatch.at(-1)!.itemErrors, undefined);
  });

  test("a CompleteBatch item with code 14 and retry_after is Unavailable with retryDelayMs", async () => {
    const results = await client.completeBatch(
      [
        { namespace: "ns", key: "a", leaseToken: token() },
        { namespace: "ns", key: "b", leaseToken: token() },
        { namespace: "ns", key: "c", leaseToken: token() },
      ],
      { itemErrors: true },
    );
    assert.equal(seen.CompleteBatch.at(-1)!.itemErrors, true);
    assert.deepEqual(results.map((r) => r.ok), [true, false, false]);
    const unavailable = expectError(results[1]);
    assert.equal(unavailable.constructor, Unavailable);
    assert.deepEqual([unavailable.code, unavailable.reason, unavailable.retryDelayMs], [14, "STORE_UNAVAILABLE", 500]);
    assert.match(unavailable.message, /^CompleteBatch: items\[1\]: UNAVAILABLE: /);
    const lost = expectError(results[2]);
    assert.equal(lost.constructor, LeaseNotCurrent);
    assert.deepEqual([lost.reason, lost.retryDelayMs], ["LEASE_LOST", undefined]);
  });

  test("itemErrors must be a boolean", async () => {
    await assert.rejects(client.claimBatch(claims, { itemErrors: "yes" as never }), /itemErrors must be a boolean/);
  });
});
