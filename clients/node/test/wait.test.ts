// Waiting for the holder (ClaimRequest.wait), against a real server: once()
// meets another holder and its one Claim waits on the server for the stored
// result or the lease, instead of polling; claim({ waitMs }) and waitedMs;
// and the fallback to polling against a server that ignores the field
// (startWaitClearingRelay stands in for one).
import { test } from "node:test";
import assert from "node:assert/strict";
import * as grpc from "@grpc/grpc-js";
import { IdempotencyClient, InvalidArgument, ServerWaits, WAIT_RECHECK_MS, type OnceResult } from "../src";
import { sleep, until, withServer, type Suite } from "./helpers";
import { recorder, type Recorder } from "./interceptors";
import { startWaitClearingRelay } from "./relay";

/** Concurrent duplicates of one key in each test. */
const WAITERS = 16;
/** How long the holder's work takes once every duplicate has sent its Claim. */
const HOLDER_WORK_MS = 200;

/** A piece of work that counts its runs. */
function work<T>(result: T) {
  const fn = async () => {
    fn.calls++;
    return result;
  };
  fn.calls = 0;
  return fn;
}

/**
 * A once() on `client` whose work starts, then waits until `go()`, works
 * HOLDER_WORK_MS and returns `result` (or throws when `fail`): the holder the
 * duplicates meet. Resolves once its work has started.
 */
async function holder(client: IdempotencyClient, ns: string, key: string, result: unknown, fail = false) {
  let go!: () => void;
  const released = new Promise<void>((resolve) => (go = resolve));
  let started!: () => void;
  const running = new Promise<void>((resolve) => (started = resolve));
  const outcome = client
    .once(ns, key, async () => {
      started();
      await released;
      await sleep(HOLDER_WORK_MS); // the work itself
      if (fail) throw new Error("the holder failed");
      return result;
    })
    .then(
      (value) => ({ value }),
      (error: unknown) => ({ error }),
    );
  const endedFirst = await Promise.race([running.then(() => undefined), outcome]);
  if (endedFirst !== undefined) throw new Error(`the holder's once() ended before its work started: ${"error" in endedFirst ? String(endedFirst.error) : "it returned"}`);
  return { go, outcome };
}

function duplicates<T>(client: IdempotencyClient, ns: string, key: string, w: () => Promise<T>, count = WAITERS) {
  return Array.from({ length: count }, () => client.onceWithDetails(ns, key, w));
}

function allSent(rec: Recorder, count = WAITERS) {
  return until(() => rec.of("Claim").length >= count, "every duplicate's Claim sent");
}

function waiting(s: Suite, rec: Recorder, options: ConstructorParameters<typeof IdempotencyClient>[1] = {}) {
  return new IdempotencyClient(s.server.target, { interceptors: [rec.interceptor], ...options });
}

withServer("waiting for the holder", ["sqlite", "postgres"], (s) => {
  test("duplicates wait for a holder that completes and all replay its result, one Claim each", async () => {
    const ns = s.namespace();
    const rec = recorder();
    const client = waiting(s, rec);
    try {
      const h = await holder(s.other, ns, "k", { receipt: "r-1" });
      const w = work({ receipt: "duplicate" });
      const all = duplicates(client, ns, "k", w);
      await allSent(rec);
      h.go();
      const results: OnceResult<unknown>[] = await Promise.all(all);
      assert.deepEqual(await h.outcome, { value: { receipt: "r-1" } });
      assert.equal(w.calls, 0);
      assert.deepEqual(results.map((r) => r.value), Array(WAITERS).fill({ receipt: "r-1" }));
      assert.ok(results.every((r) => r.replayed));
      // Each asked to wait, the server said how long it waited, and one Claim each was enough.
      assert.ok(results.every((r) => r.claim.waitedMs !== null));
      assert.ok(rec.of("Claim").every((a) => a.request.wait));
      assert.equal(rec.of("Claim").length, WAITERS);
      assert.equal(client.serverWaits, true);
    } finally {
      client.close();
    }
  });

  test("when the holder fails and releases, one duplicate takes the key and runs the work", async () => {
    const ns = s.namespace();
    const rec = recorder();
    const client = waiting(s, rec);
    try {
      const h = await holder(s.other, ns, "k", null, true);
      const w = work("done by a duplicate");
      const all = duplicates(client, ns, "k", w);
      await allSent(rec);
      h.go();
      const results = await Promise.all(all);
      assert.match(String(((await h.outcome) as { error: Error }).error), /the holder failed/);
      assert.equal(w.calls, 1);
      assert.deepEqual(results.map((r) => r.value), Array(WAITERS).fill("done by a duplicate"));
      assert.equal(results.filter((r) => !r.replayed).length, 1);
      assert.ok(results.every((r) => r.claim.waitedMs !== null));
      assert.equal(rec.of("Claim").length, WAITERS);
      const record = await client.get(ns, "k");
      assert.equal(record.state, "COMPLETED");
      assert.equal(record.fencingToken, 2n);
    } finally {
      client.close();
    }
  });

  test("when the holder vanishes, exactly one duplicate runs the work once its lease runs out", async () => {
    const ns = s.namespace();
    const rec = recorder();
    const client = waiting(s, rec);
    try {
      const vanished = await s.other.claim(ns, "k", { leaseTtlMs: 1000 }); // never completed nor released
      assert.equal(vanished.outcome, "CLAIMED");
      const w = work("taken over");
      const results = await Promise.all(duplicates(client, ns, "k", w));
      assert.equal(w.calls, 1);
      assert.deepEqual(results.map((r) => r.value), Array(WAITERS).fill("taken over"));
      assert.equal(results.filter((r) => !r.replayed).length, 1);
      assert.ok(results.every((r) => r.claim.waitedMs !== null));
      assert.equal(rec.of("Claim").length, WAITERS);
    } finally {
      client.close();
    }
  });

  test("a Claim that asks to wait says how long it waited", async () => {
    const ns = s.namespace();
    assert.equal((await s.client.claim(ns, "plain")).waitedMs, null); // did not ask
    const fresh = await s.client.claim(ns, "fresh", { waitMs: 5000 });
    assert.equal(fresh.outcome, "CLAIMED");
    assert.equal(fresh.waitedMs, 0); // nothing to wait for
    await s.other.claim(ns, "held", { leaseTtlMs: 30_000 });
    const held = await s.client.claim(ns, "held", { waitMs: 300 });
    assert.equal(held.outcome, "IN_PROGRESS");
    assert.ok(held.waitedMs! > 0);
    assert.ok(held.outcome === "IN_PROGRESS" && held.retryAfterMs > 0 && held.leaseExpiresAt !== null);
  });

  test("a waiting Claim gets the result the holder completes meanwhile", async () => {
    const ns = s.namespace();
    const held = await s.other.claim(ns, "k", { leaseTtlMs: 30_000 });
    assert.equal(held.outcome, "CLAIMED");
    const rec = recorder();
    const client = waiting(s, rec);
    try {
      const answer = client.claim(ns, "k", { waitMs: 20_000 });
      await until(() => rec.of("Claim").length === 1, "the waiting Claim sent");
      await s.other.complete(ns, "k", held.outcome === "CLAIMED" ? held.leaseToken : "", "stored");
      const claim = await answer;
      assert.equal(claim.outcome, "COMPLETED");
      assert.equal(claim.outcome === "COMPLETED" && claim.response.toString(), "stored");
      assert.notEqual(claim.waitedMs, null);
      assert.equal(rec.of("Claim").length, 1);
    } finally {
      client.close();
    }
  });

  test("a per-attempt timeout shorter than the wait does not cut the waiting Claim", async () => {
    const ns = s.namespace();
    await s.other.claim(ns, "k", { leaseTtlMs: 30_000 });
    const rec = recorder();
    const client = waiting(s, rec, { retry: { perAttemptTimeoutMs: 100 }, timeoutMs: 5000 });
    try {
      const claim = await client.claim(ns, "k", { waitMs: 500 });
      assert.equal(claim.outcome, "IN_PROGRESS");
      assert.ok(claim.waitedMs! > 0);
      assert.deepEqual(rec.of("Claim").map((a) => a.code), [grpc.status.OK]);
    } finally {
      client.close();
    }
  });

  test("a negative wait is refused naming the field", async () => {
    await assert.rejects(s.client.claim(s.namespace(), "k", { waitMs: -1000 }), (error: unknown) => {
      assert.ok(error instanceof InvalidArgument);
      assert.match(error.message, /wait/);
      return true;
    });
  });

  test("onInProgress poll never asks the server to wait", async () => {
    const ns = s.namespace();
    const held = await s.other.claim(ns, "k", { leaseTtlMs: 30_000 });
    const rec = recorder();
    const client = waiting(s, rec);
    try {
      const result = client.once(ns, "k", work("mine"), { onInProgress: "poll" });
      await until(() => rec.of("Claim").filter((a) => a.code !== undefined).length >= 2, "two Claims: polling");
      await s.other.complete(ns, "k", held.outcome === "CLAIMED" ? held.leaseToken : "", JSON.stringify("theirs"));
      assert.equal(await result, "theirs");
      assert.ok(rec.of("Claim").every((a) => !a.request.wait));
      assert.equal(client.serverWaits, null); // never asked
    } finally {
      client.close();
    }
  });

  test("against a server that ignores wait, once() polls and the client remembers", async () => {
    const ns = s.namespace();
    const held = await s.other.claim(ns, "k", { leaseTtlMs: 30_000 });
    const relay = await startWaitClearingRelay(s.server.target);
    const rec = recorder();
    const client = new IdempotencyClient(relay.target, { interceptors: [rec.interceptor] });
    try {
      const w = work("mine");
      const result = client.onceWithDetails(ns, "k", w);
      // It polls: Claim after Claim, each answered IN_PROGRESS at once.
      await until(() => rec.of("Claim").filter((a) => a.code !== undefined).length >= 3, "three Claims: polling");
      await s.other.complete(ns, "k", held.outcome === "CLAIMED" ? held.leaseToken : "", JSON.stringify("theirs"));
      const r = await result;
      assert.equal(r.value, "theirs");
      assert.equal(r.replayed, true);
      assert.equal(w.calls, 0);
      assert.equal(r.claim.waitedMs, null);
      assert.ok(rec.of("Claim").length >= 4); // three IN_PROGRESS, then the replay
      assert.equal(client.serverWaits, false);
      // Only the first Claim asked; the polls did not, nor does the next once() of this client.
      assert.equal(relay.claimsAskingToWait, 1);
      assert.equal(await client.once(ns, "another", work(7)), 7);
      assert.equal(relay.claimsAskingToWait, 1);
      assert.equal(relay.claims, rec.of("Claim").length);
    } finally {
      client.close();
      await relay.close();
    }
  });

  test("a plain Claim through a server that ignores wait has no waitedMs", async () => {
    const ns = s.namespace();
    await s.other.claim(ns, "k", { leaseTtlMs: 30_000 });
    const relay = await startWaitClearingRelay(s.server.target);
    const client = new IdempotencyClient(relay.target);
    try {
      const claim = await client.claim(ns, "k", { waitMs: 5000 });
      assert.equal(claim.outcome, "IN_PROGRESS");
      assert.equal(claim.waitedMs, null);
      assert.equal(client.serverWaits, false);
    } finally {
      client.close();
      await relay.close();
    }
  });
});

test("a client that saw wait ignored asks again after the recheck interval", () => {
  const waits = new ServerWaits();
  assert.equal(waits.supported, null);
  assert.equal(waits.worthAsking(), true);
  waits.saw(null); // a server that predates waiting
  assert.equal(waits.supported, false);
  assert.equal(waits.worthAsking(), false);
  (waits as unknown as { ignoredAt: number }).ignoredAt -= WAIT_RECHECK_MS - 1000;
  assert.equal(waits.worthAsking(), false);
  (waits as unknown as { ignoredAt: number }).ignoredAt -= 1000;
  assert.equal(waits.worthAsking(), true);
  waits.saw(0); // this one answers with `waited`
  assert.equal(waits.supported, true);
  assert.equal(waits.worthAsking(), true);
});
