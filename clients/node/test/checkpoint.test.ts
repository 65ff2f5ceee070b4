// Checkpoints: saved with extendLease and release, received by the Claim that
// takes the key over, shown by get, discarded by Complete; once() hands them to
// the work; work killed after its second step is resumed by another process.
import { test } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { mkdtempSync, readFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import * as grpc from "@grpc/grpc-js";
import { IdempotencyClient, InvalidArgument, LeaseLost, type Lease } from "../src";
import { recorder } from "./interceptors";
import { withServer } from "./helpers";
import { threeStepJob } from "./fixtures/three-step-job";

const claimed = <T extends { outcome: string }>(claim: T) => {
  assert.equal(claim.outcome, "CLAIMED");
  return claim as Extract<T, { outcome: "CLAIMED" }>;
};

withServer("checkpoints", ["sqlite", "postgres"], (s) => {
  test("a checkpoint saved with extendLease goes to the Claim that takes the key over", async () => {
    const ns = s.namespace();
    const first = claimed(await s.client.claim(ns, "k", { leaseTtlMs: 1000 }));
    assert.equal(first.checkpoint, null);
    assert.equal(first.checkpointFencingToken, null);
    await s.client.extendLease(ns, "k", first.leaseToken, { leaseTtlMs: 1000, checkpoint: Buffer.from([1, 2, 3]) });
    const record = await s.client.get(ns, "k");
    assert.deepEqual(record.checkpoint, Buffer.from([1, 2, 3]));
    assert.equal(record.checkpointFencingToken, 1n);
    // Without a checkpoint, extendLease keeps the one saved.
    await s.client.extendLease(ns, "k", first.leaseToken, { leaseTtlMs: 1000 });
    assert.deepEqual((await s.client.get(ns, "k")).checkpoint, Buffer.from([1, 2, 3]));

    const deadline = Date.now() + 5000;
    let next = await s.other.claim(ns, "k");
    while (next.outcome === "IN_PROGRESS" && Date.now() < deadline) {
      await new Promise((r) => setTimeout(r, 50));
      next = await s.other.claim(ns, "k");
    }
    const takeover = claimed(next);
    assert.equal(takeover.fencingToken, 2n);
    assert.deepEqual(takeover.checkpoint, Buffer.from([1, 2, 3]));
    assert.equal(takeover.checkpointFencingToken, 1n);
    assert.equal(takeover.retried, false);
  });

  test("a checkpoint saved with release goes to the next Claim; Complete discards it", async () => {
    const ns = s.namespace();
    const first = claimed(await s.client.claim(ns, "k"));
    await s.client.release(ns, "k", first.leaseToken, { checkpoint: "step 1 done" });
    const released = await s.client.get(ns, "k");
    assert.equal(released.state, "RELEASED");
    assert.equal(released.checkpoint?.toString(), "step 1 done");
    const second = claimed(await s.other.claim(ns, "k"));
    assert.equal(second.checkpoint?.toString(), "step 1 done");
    assert.equal(second.checkpointFencingToken, 1n);
    await s.other.complete(ns, "k", second.leaseToken, "done");
    const done = await s.client.get(ns, "k");
    assert.equal(done.state, "COMPLETED");
    assert.equal(done.checkpoint, null);
    assert.equal(done.checkpointFencingToken, null);
  });

  test("an empty checkpoint is a checkpoint; a release without one keeps the one saved", async () => {
    const ns = s.namespace();
    const first = claimed(await s.client.claim(ns, "k"));
    await s.client.extendLease(ns, "k", first.leaseToken, { checkpoint: Buffer.alloc(0) });
    await s.client.release(ns, "k", first.leaseToken);
    const second = claimed(await s.client.claim(ns, "k"));
    assert.deepEqual(second.checkpoint, Buffer.alloc(0));
    assert.equal(second.checkpointFencingToken, 1n);
  });

  test("a checkpoint over the limit is INVALID_ARGUMENT naming checkpoint, not retried", async () => {
    const ns = s.namespace();
    const rec = recorder();
    const client = new IdempotencyClient(s.server.target, { interceptors: [rec.interceptor] });
    try {
      const claim = claimed(await client.claim(ns, "k"));
      await assert.rejects(client.extendLease(ns, "k", claim.leaseToken, { checkpoint: Buffer.alloc(64 * 1024 + 1) }), (error: unknown) => {
        assert.ok(error instanceof InvalidArgument);
        assert.match(error.message, /checkpoint/);
        return true;
      });
      assert.equal(rec.of("ExtendLease").length, 1);
      await client.extendLease(ns, "k", claim.leaseToken, { checkpoint: Buffer.alloc(64 * 1024) });
    } finally {
      client.close();
    }
  });

  test("once(): the work starts with no checkpoint, saves some, and a failed attempt's next one resumes from the last", async () => {
    const ns = s.namespace();
    const seen: Array<[string | null, bigint | null, bigint]> = [];
    await assert.rejects(s.client.once(ns, "k", async (lease) => {
      seen.push([lease.checkpoint?.toString() ?? null, lease.checkpointFencingToken, lease.fencingToken]);
      await lease.saveCheckpoint("a");
      assert.equal(lease.checkpoint?.toString(), "a", "the lease shows the checkpoint saved last");
      assert.equal(lease.checkpointFencingToken, 1n);
      await lease.saveCheckpoint("ab");
      throw new Error("step c failed");
    }), /step c failed/);
    const record = await s.client.get(ns, "k");
    assert.equal(record.state, "RELEASED");
    assert.equal(record.checkpoint?.toString(), "ab");

    const value = await s.client.once(ns, "k", async (lease) => {
      seen.push([lease.checkpoint?.toString() ?? null, lease.checkpointFencingToken, lease.fencingToken]);
      return `${lease.checkpoint}c`;
    });
    assert.equal(value, "abc");
    assert.deepEqual(seen, [[null, null, 1n], ["ab", 1n, 2n]]);
  });

  test("once(): a checkpoint whose ExtendLease failed goes with the Release", async () => {
    const ns = s.namespace();
    const rec = recorder((attempt) => (attempt.method === "ExtendLease" ? grpc.status.UNAVAILABLE : undefined));
    const client = new IdempotencyClient(s.server.target, { interceptors: [rec.interceptor], retry: false, logger: { warn: () => undefined } });
    try {
      await assert.rejects(client.once(ns, "k", async (lease) => {
        await lease.saveCheckpoint("step 1 done"); // the answer is lost: Unavailable
      }), /UNAVAILABLE/);
      assert.equal(rec.of("Release")[0].request.checkpoint.toString(), "step 1 done");
      assert.equal((await s.client.get(ns, "k")).checkpoint?.toString(), "step 1 done");
    } finally {
      client.close();
    }
  });

  test("once(): saveCheckpoint after the lease was lost rejects with LeaseLost and aborts the signal", async () => {
    const ns = s.namespace();
    let lease: Lease | undefined;
    await assert.rejects(s.client.once(ns, "k", async (l) => {
      lease = l;
      await s.other.release(ns, "k", l.leaseToken);
      assert.equal((await s.other.claim(ns, "k")).outcome, "CLAIMED");
      await l.saveCheckpoint("too late");
    }, { heartbeat: false }), LeaseLost);
    assert.equal(lease!.signal.aborted, true);
    const record = await s.client.get(ns, "k");
    assert.equal(record.fencingToken, 2n);
    assert.equal(record.checkpoint, null);
  });
});

withServer("resume", ["sqlite", "postgres"], (s) => {
  test("work killed after its second step is resumed from its checkpoint by another process: each step once", async () => {
    const ns = s.namespace();
    const log = join(mkdtempSync(join(tmpdir(), "idempotency-node-resume-")), "steps.log");
    const leaseMs = 1500;
    const worker = spawn(
      process.execPath,
      [join(__dirname, "fixtures", "three-step-worker.js"), s.server.target, ns, "job-1", log, "2", String(leaseMs)],
      { stdio: ["ignore", "inherit", "inherit"] },
    );
    const [code, signal] = await new Promise<[number | null, NodeJS.Signals | null]>((resolve) =>
      worker.once("exit", (c, sig) => resolve([c, sig])));
    assert.equal(signal, "SIGKILL", `the worker exited with ${code}`);
    assert.equal(readFileSync(log, "utf8"), "step 1 under fencing token 1\nstep 2 under fencing token 1\n");

    // The key is held by the dead worker's lease until it runs out; once() waits for it.
    const started = Date.now();
    const result = await s.client.onceWithDetails(ns, "job-1", (lease) => threeStepJob(lease, log), { leaseTtlMs: leaseMs });
    assert.ok(Date.now() - started < leaseMs + 3000, "resumed soon after the lease ran out");
    assert.deepEqual(result.value, { steps: 3 });
    const claim = claimed(result.claim);
    assert.equal(claim.fencingToken, 2n);
    assert.deepEqual(JSON.parse(claim.checkpoint!.toString()), { done: 2 });
    assert.equal(claim.checkpointFencingToken, 1n);
    assert.equal(
      readFileSync(log, "utf8"),
      "step 1 under fencing token 1\nstep 2 under fencing token 1\nstep 3 under fencing token 2\n",
    );
    // Done: a later delivery replays, and does no step.
    assert.deepEqual(await s.client.once(ns, "job-1", (lease) => threeStepJob(lease, log)), { steps: 3 });
    assert.equal(readFileSync(log, "utf8").split("\n").filter(Boolean).length, 3);
  });
});
