// Two replicas on one PostgreSQL database, and a client given both addresses:
// a replica stopped in the middle of a once(), and a rolling restart (SIGTERM,
// restart on the same port, one replica after the other) under a running
// once() loop, produce no error in the caller's code. Duplicates waiting on
// one replica for a holder on the other learn of its Complete or Release
// through the database's feed.
import { after, before, describe, test } from "node:test";
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import * as grpc from "@grpc/grpc-js";
import { IdempotencyClient } from "../src";
import { startReplicas } from "../src/testing";
import { until } from "./helpers";
import { recorder, type Recorder } from "./interceptors";

describe("replicas [postgres]", () => {
  let replicas: Awaited<ReturnType<typeof startReplicas>> | undefined;
  const clients: IdempotencyClient[] = [];
  const warnings: string[] = [];
  const connect = (rec: Recorder) => {
    const client = new IdempotencyClient(replicas!.servers.map((server) => server.target), {
      logger: { warn: (message) => warnings.push(message) },
      interceptors: [rec.interceptor],
    });
    clients.push(client);
    return client;
  };
  const namespace = () => `node-replicas-${randomBytes(4).toString("hex")}`;

  before(async () => {
    replicas = await startReplicas(2);
  });
  after(async () => {
    clients.forEach((client) => client.close());
    await replicas?.stop();
  });

  test("a replica stopped between two calls of one once(): once() completes without error", async () => {
    const rec = recorder();
    const client = connect(rec);
    const ns = namespace();
    const [first] = replicas!.servers;
    let runs = 0;
    let stoppedAt = 0;
    const value = await client.once(ns, "k", async (lease) => {
      runs++;
      await lease.saveCheckpoint("step 1"); // one replica or the other
      assert.equal(await first.stop(), 0, "the replica stopped cleanly");
      stoppedAt = rec.attempts.length;
      // The calls left (two more ExtendLease, the Complete) go round both
      // addresses: one of them is down.
      await lease.saveCheckpoint("step 2");
      await lease.saveCheckpoint("step 3");
      return "done";
    });
    assert.equal(value, "done");
    assert.equal(runs, 1);
    const record = await client.get(ns, "k");
    assert.equal(record.state, "COMPLETED");
    assert.equal(record.fencingToken, 1n);
    // The calls after the stop (two ExtendLease, the Complete, the Get) all
    // answered: the client skips an address whose connection failed, or
    // retries an attempt sent there on the other.
    const after = rec.attempts.slice(stoppedAt);
    assert.deepEqual(after.filter((a) => a.seenCode === grpc.status.OK).map((a) => a.method), ["ExtendLease", "ExtendLease", "Complete", "Get"]);
    assert.ok(after.every((a) => a.seenCode === grpc.status.OK || a.seenCode === grpc.status.UNAVAILABLE));
    replicas!.servers[0] = await first.restart();
  });

  test("a rolling restart of both replicas under a running once() loop: no error, each key's work once", async () => {
    const rec = recorder();
    const client = connect(rec);
    const ns = namespace();
    const runs = new Map<string, number>();
    const errors: unknown[] = [];
    let stop = false;
    let completed = 0;
    let next = 0;

    // Three callers in a loop, each once() a new key: claims, a checkpoint, completes.
    const loop = async () => {
      while (!stop) {
        const key = `k${next++}`;
        try {
          const value = await client.once(ns, key, async (lease) => {
            runs.set(key, (runs.get(key) ?? 0) + 1);
            await new Promise((r) => setTimeout(r, 20));
            await lease.saveCheckpoint("half way");
            await new Promise((r) => setTimeout(r, 20));
            return key;
          }, { leaseTtlMs: 5000 });
          assert.equal(value, key);
          completed++;
        } catch (error) {
          errors.push(error);
        }
      }
    };
    const loops = Promise.all([loop(), loop(), loop()]);

    const progress = async (more: number) => {
      const target = completed + more;
      await until(() => completed >= target || errors.length > 0, `${more} more keys done`, 30_000);
    };
    try {
      await progress(5);
      // As an orchestrator would: the next replica as soon as the last one
      // restarted is SERVING (before the client has reconnected to it).
      for (let i = 0; i < replicas!.servers.length; i++) {
        const server = replicas!.servers[i];
        replicas!.servers[i] = await server.restart(); // SIGTERM, wait for the exit, start on the same port, wait for SERVING
      }
      await progress(5);
    } finally {
      stop = true;
      await loops;
    }

    assert.deepEqual(errors.map(String), []);
    assert.ok(completed >= 15, `${completed} keys done`);
    assert.equal(runs.size, completed);
    for (const [key, count] of runs) assert.equal(count, 1, `${key}'s work ran ${count} times`);
    for (let i = 0; i < next; i++) assert.equal((await client.get(ns, `k${i}`)).state, "COMPLETED");
    // Attempts that reached a stopping replica (if any: the client also skips
    // an address whose connection failed) failed UNAVAILABLE, and were retried.
    const failed = rec.attempts.filter((a) => a.seenCode !== grpc.status.OK);
    assert.ok(failed.every((a) => a.seenCode === grpc.status.UNAVAILABLE), `only UNAVAILABLE: ${failed.map((a) => a.seenCode)}`);
  });

  for (const ending of ["complete", "release"] as const) {
    test(`duplicates waiting on one replica learn that the holder on the other ${ending}s`, async () => {
      const [holderReplica, waitingReplica] = replicas!.servers;
      const holderClient = new IdempotencyClient(holderReplica.target);
      const rec = recorder();
      const client = new IdempotencyClient(waitingReplica.target, { interceptors: [rec.interceptor] });
      clients.push(holderClient, client);
      const ns = namespace();
      const duplicates = 16;
      let runs = 0;
      const held = await holderClient.claim(ns, "k", { leaseTtlMs: 30_000 });
      assert.equal(held.outcome, "CLAIMED");
      const all = Array.from({ length: duplicates }, () =>
        client.onceWithDetails(ns, "k", async () => {
          runs++;
          return "done by a duplicate";
        }),
      );
      await until(() => rec.of("Claim").length >= duplicates, "every duplicate's Claim sent");
      await new Promise((r) => setTimeout(r, 200)); // the holder's work
      const token = held.outcome === "CLAIMED" ? held.leaseToken : "";
      if (ending === "complete") await holderClient.complete(ns, "k", token, JSON.stringify("done by the holder"));
      else await holderClient.release(ns, "k", token);
      const results = await Promise.all(all);
      const expected = ending === "complete" ? "done by the holder" : "done by a duplicate";
      assert.deepEqual(results.map((r) => r.value), Array(duplicates).fill(expected));
      assert.equal(runs, ending === "complete" ? 0 : 1);
      assert.equal(results.filter((r) => !r.replayed).length, runs);
      assert.ok(results.every((r) => r.claim.waitedMs !== null));
      assert.equal(rec.of("Claim").length, duplicates); // one each: they waited, nobody polled
      assert.equal(client.serverWaits, true);
    });
  }
});
