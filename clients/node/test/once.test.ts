// once(): the run-once lifecycle, against a real server.
import { test } from "node:test";
import assert from "node:assert/strict";
import {
  BYTES_SERIALIZER,
  FingerprintMismatch,
  InProgress,
  InvalidArgument,
  LeaseLost,
  LeaseNotCurrent,
  deriveKey,
  fingerprint,
} from "../src";
import { sleep, until, withServer } from "./helpers";

/** A piece of work that counts its runs. */
function work<T>(result: T, error?: Error) {
  const fn = async () => {
    fn.calls++;
    if (error) throw error;
    return result;
  };
  fn.calls = 0;
  return fn;
}

withServer("once", ["sqlite", "postgres"], (s) => {
  test("the first delivery runs the work and completes with its JSON result", async () => {
    const ns = s.namespace();
    const charge = work({ charge: "ch_1", amount: 100 });
    const result = await s.client.onceWithDetails(ns, "evt-1", charge);
    assert.deepEqual(result.value, { charge: "ch_1", amount: 100 });
    assert.equal(result.replayed, false);
    const record = await s.client.get(ns, "evt-1");
    assert.equal(record.state, "COMPLETED");
    assert.deepEqual(JSON.parse(record.response!.toString()), { charge: "ch_1", amount: 100 });
  });

  test("a duplicate delivery replays the result without running the work", async () => {
    const ns = s.namespace();
    await s.client.once(ns, "evt-1", work({ n: 1 }));
    const second = work({ n: 2 });
    const result = await s.client.onceWithDetails(ns, "evt-1", second);
    assert.deepEqual(result.value, { n: 1 });
    assert.equal(result.replayed, true);
    assert.equal(second.calls, 0);
  });

  test("an exception in the work releases the key and the next attempt succeeds", async () => {
    const ns = s.namespace();
    const failing = work(null, new Error("card declined"));
    await assert.rejects(s.client.once(ns, "evt-1", failing), /card declined/);
    assert.equal(failing.calls, 1);
    assert.equal((await s.client.get(ns, "evt-1")).state, "RELEASED");
    const succeeding = work("ok");
    assert.equal(await s.client.once(ns, "evt-1", succeeding), "ok");
    assert.equal(succeeding.calls, 1);
    assert.equal((await s.client.get(ns, "evt-1")).fencingToken, 2n);
  });

  test("a fingerprint mismatch rejects without running the work", async () => {
    const ns = s.namespace();
    await s.client.once(ns, "evt-1", work(1), { fingerprint: fingerprint({ amount: 100 }) });
    const second = work(2);
    await assert.rejects(s.client.once(ns, "evt-1", second, { fingerprint: fingerprint({ amount: 999 }) }), FingerprintMismatch);
    assert.equal(second.calls, 0);
    assert.equal(await s.client.once(ns, "evt-1", second, { fingerprint: fingerprint({ amount: 100 }) }), 1);
  });

  test("a lease lost to another claimant rejects with LeaseLost and stores nothing", async () => {
    const ns = s.namespace();
    const attempt = s.client.once(ns, "evt-1", async () => {
      // The work outlives its 1 s lease and another claimant takes the key over.
      await until(async () => (await s.other.claim(ns, "evt-1", { leaseTtlMs: 30_000 })).outcome === "CLAIMED",
        "another claimant to take the expired lease");
      return "too late";
    }, { leaseTtlMs: 1000, heartbeat: false });
    await assert.rejects(attempt, (error: unknown) => {
      assert.ok(error instanceof LeaseLost);
      assert.ok(error.cause instanceof LeaseNotCurrent);
      return true;
    });
    const record = await s.client.get(ns, "evt-1");
    assert.equal(record.state, "IN_PROGRESS");
    assert.equal(record.fencingToken, 2n);
  });

  test("in progress with throw rejects with InProgress and retryAfterMs", async () => {
    const ns = s.namespace();
    await s.other.claim(ns, "evt-1", { leaseTtlMs: 30_000 });
    const w = work("mine");
    await assert.rejects(s.client.once(ns, "evt-1", w, { onInProgress: "throw" }), (error: unknown) => {
      assert.ok(error instanceof InProgress);
      assert.ok(error.retryAfterMs > 0 && error.retryAfterMs <= 30_000);
      return true;
    });
    assert.equal(w.calls, 0);
  });
});

withServer("once", ["sqlite"], (s) => {
  test("in progress with wait replays once the other claimant completes", async () => {
    const ns = s.namespace();
    const claim = await s.other.claim(ns, "evt-1", { leaseTtlMs: 30_000 });
    assert.equal(claim.outcome, "CLAIMED");
    const completer = sleep(300).then(() =>
      s.other.complete(ns, "evt-1", (claim as { leaseToken: string }).leaseToken, JSON.stringify("theirs")));
    const w = work("mine");
    const started = Date.now();
    assert.equal(await s.client.once(ns, "evt-1", w, { waitTimeoutMs: 10_000 }), "theirs");
    await completer;
    assert.equal(w.calls, 0);
    assert.ok(Date.now() - started < 5000, "polled, not slept until the lease expired");
  });

  test("in progress with wait claims once the other claimant releases", async () => {
    const ns = s.namespace();
    const claim = await s.other.claim(ns, "evt-1", { leaseTtlMs: 30_000 });
    const releaser = sleep(300).then(() => s.other.release(ns, "evt-1", (claim as { leaseToken: string }).leaseToken));
    const w = work("mine");
    assert.equal(await s.client.once(ns, "evt-1", w, { waitTimeoutMs: 10_000 }), "mine");
    await releaser;
    assert.equal(w.calls, 1);
  });

  test("in progress with wait rejects with InProgress when the wait times out", async () => {
    const ns = s.namespace();
    await s.other.claim(ns, "evt-1", { leaseTtlMs: 30_000 });
    const started = Date.now();
    await assert.rejects(s.client.once(ns, "evt-1", work("mine"), { waitTimeoutMs: 500 }), /still in progress/);
    assert.ok(Date.now() - started >= 500);
  });

  test("the heartbeat keeps the lease through work longer than the lease", async () => {
    const ns = s.namespace();
    const result = await s.client.once(ns, "evt-1", async (lease) => {
      for (let i = 0; i < 15; i++) { // 3 s: one and a half leases of 2 s
        assert.equal((await s.other.claim(ns, "evt-1")).outcome, "IN_PROGRESS");
        await sleep(200);
      }
      assert.equal(lease.signal.aborted, false);
      return "done";
    }, { leaseTtlMs: 2000 });
    assert.equal(result, "done");
    assert.equal((await s.client.get(ns, "evt-1")).fencingToken, 1n);
  });

  test("the heartbeat notices a lost lease, aborts the signal, and the result is not stored", async () => {
    const ns = s.namespace();
    const attempt = s.client.once(ns, "evt-1", async (lease) => {
      // Someone releases our lease behind our back and another claimant wins.
      await s.other.release(ns, "evt-1", lease.leaseToken);
      assert.equal((await s.other.claim(ns, "evt-1")).outcome, "CLAIMED");
      await until(() => lease.signal.aborted, "the heartbeat to notice");
      assert.ok(lease.signal.reason instanceof LeaseLost);
      return "must not be stored";
    }, { leaseTtlMs: 2000, heartbeatIntervalMs: 100 });
    await assert.rejects(attempt, LeaseLost);
    const record = await s.client.get(ns, "evt-1");
    assert.equal(record.state, "IN_PROGRESS");
    assert.equal(record.fencingToken, 2n);
  });

  test("the work receives its lease's fencing token", async () => {
    const ns = s.namespace();
    const seen: bigint[] = [];
    await assert.rejects(s.client.once(ns, "evt-1", async (lease) => { seen.push(lease.fencingToken); throw new Error("x"); }));
    await s.client.once(ns, "evt-1", async (lease) => { seen.push(lease.fencingToken); });
    assert.deepEqual(seen, [1n, 2n]);
  });

  test("a key derived from the event's fields deduplicates its deliveries", async () => {
    const ns = s.namespace();
    const handled: string[] = [];
    const handle = (event: { source: string; id: string }) =>
      s.client.once(ns, deriveKey(event.source, event.id), async () => {
        handled.push(event.id);
        return { handled: event.id };
      }, { fingerprint: fingerprint(event) });
    assert.deepEqual(await handle({ source: "shop", id: "o-1" }), { handled: "o-1" });
    assert.deepEqual(await handle({ source: "shop", id: "o-1" }), { handled: "o-1" });
    assert.deepEqual(await handle({ source: "shop", id: "o-2" }), { handled: "o-2" });
    assert.deepEqual(handled, ["o-1", "o-2"]);
  });

  test("a bytes serializer stores the result as it is", async () => {
    const ns = s.namespace();
    const raw = Buffer.from([0, 1, 2]);
    assert.deepEqual(await s.client.once(ns, "evt-1", async () => raw, { serializer: BYTES_SERIALIZER }), raw);
    assert.deepEqual((await s.client.get(ns, "evt-1")).response, raw);
    assert.deepEqual(await s.client.once(ns, "evt-1", work(Buffer.from("x")), { serializer: BYTES_SERIALIZER }), raw);
  });

  test("undefined results are stored as JSON null", async () => {
    const ns = s.namespace();
    assert.equal(await s.client.once(ns, "evt-1", async () => undefined), undefined);
    assert.equal(await s.client.once(ns, "evt-1", work("again")), null);
  });

  test("an invalid key surfaces as InvalidArgument naming the field", async () => {
    const w = work("x");
    await assert.rejects(s.client.once(s.namespace(), "k".repeat(513), w), (error: unknown) => {
      assert.ok(error instanceof InvalidArgument);
      assert.match(error.message, /key/);
      return true;
    });
    assert.equal(w.calls, 0);
  });
});
