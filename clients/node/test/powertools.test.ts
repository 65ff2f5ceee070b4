// idempotency-client/powertools against the real @aws-lambda-powertools/idempotency
// package (the pinned devDependency) and a real server: Powertools'
// documented behaviours (completed, in progress, expired, payload mismatch,
// a handler that throws), a concurrent duplicate that waits for the result,
// a lost lease refused, and a Lambda-style handler run twice concurrently
// with one effect.
import { test } from "node:test";
import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import {
  IdempotencyAlreadyInProgressError,
  IdempotencyConfig,
  IdempotencyPersistenceLayerError,
  IdempotencyValidationError,
  makeIdempotent,
} from "@aws-lambda-powertools/idempotency";
import { IdempotencyClient, LeaseNotCurrent, ResultExpired, State } from "../src";
import { IdempotencyServicePersistenceLayer, type IdempotencyServicePersistenceLayerOptions } from "../src/powertools";
import { sleep, until, withServer, type Suite } from "./helpers";
import { recorder } from "./interceptors";

/** What the Lambda runtime hands a handler, as far as Powertools reads it. */
interface Context {
  functionName: string;
  memoryLimitInMB: string;
  invokedFunctionArn: string;
  awsRequestId: string;
  getRemainingTimeInMillis(): number;
}

function lambdaContext(timeoutMs = 30_000): Context {
  const deadline = Date.now() + timeoutMs;
  return {
    functionName: "orders",
    memoryLimitInMB: "128",
    invokedFunctionArn: "arn:aws:lambda:eu-west-1:123456789012:function:orders",
    awsRequestId: "req",
    getRemainingTimeInMillis: () => deadline - Date.now(),
  };
}

/** A layer that lets the tests compute Powertools' key of a payload. */
class Layer extends IdempotencyServicePersistenceLayer {
  keyOf(data: Record<string, string | number>): string {
    return this.getHashedIdempotencyKey(data);
  }
}

function layer(s: Suite, ns: string, options: Partial<IdempotencyServicePersistenceLayerOptions> = {}) {
  return new Layer({ client: s.client, namespace: ns, waitMs: 0, ...options });
}

/** A gate the test opens: `wait()` resolves once `open()` was called. */
function gate() {
  let open!: () => void;
  const opened = new Promise<void>((resolve) => (open = resolve));
  return { open, wait: () => opened };
}

/** An outcome without an unhandled rejection while the test does other things. */
const settle = <T>(promise: Promise<T>) =>
  promise.then(
    (value) => ({ value }),
    (error: unknown) => ({ error }),
  );

// Powertools warns when it cannot tell the remaining time (no Lambda context):
// the layer then uses its leaseTtlMs. Keep the test output readable.
const warn = console.warn;
console.warn = (...args: unknown[]) => {
  if (String(args[0]).startsWith("Could not determine remaining time left")) return;
  warn(...args);
};

withServer("powertools", ["sqlite"], (s) => {
  test("a completed result is replayed", async () => {
    const ns = s.namespace();
    const store = layer(s, ns);
    const runs: [string, bigint][] = [];
    const place = makeIdempotent(
      async (order: { orderId: string; amount: number }) => {
        const lease = store.heldLease()!;
        runs.push([order.orderId, lease.fencingToken]);
        return { order: order.orderId, fencingToken: Number(lease.fencingToken) };
      },
      { persistenceStore: store, config: new IdempotencyConfig({ eventKeyJmesPath: "orderId" }) },
    );
    const first = await place({ orderId: "o-1", amount: 10 });
    const again = await place({ orderId: "o-1", amount: 10 });
    assert.deepEqual(first, { order: "o-1", fencingToken: 1 });
    assert.deepEqual(again, first);
    assert.deepEqual(runs, [["o-1", 1n]]);
    assert.equal(store.heldLease(), undefined);
    const record = await s.client.get(ns, store.keyOf({ orderId: "o-1", amount: 10 }));
    assert.equal(record.state, State.COMPLETED);
    assert.equal(record.response!.toString(), '{"order":"o-1","fencingToken":1}');
    assert.deepEqual(record.fingerprint, Buffer.alloc(0)); // no payloadValidationJmesPath
  });

  test("an in-progress duplicate without waiting throws IdempotencyAlreadyInProgressError", async () => {
    const ns = s.namespace();
    const store = layer(s, ns);
    const runs: string[] = [];
    const entered = gate();
    const finish = gate();
    const handler = makeIdempotent(
      async (event: { id: string }, _context: Context) => {
        runs.push(event.id);
        entered.open();
        await finish.wait();
        return { done: event.id };
      },
      { persistenceStore: store, config: new IdempotencyConfig({ eventKeyJmesPath: "id" }) },
    );
    const holder = settle(handler({ id: "e-1" }, lambdaContext()));
    await entered.wait();
    await assert.rejects(handler({ id: "e-1" }, lambdaContext()), IdempotencyAlreadyInProgressError);
    finish.open();
    assert.deepEqual(await holder, { value: { done: "e-1" } });
    assert.deepEqual(await handler({ id: "e-1" }, lambdaContext()), { done: "e-1" });
    assert.deepEqual(runs, ["e-1"]);
  });

  test("a handler that throws releases the key, and the retry runs again", async () => {
    const ns = s.namespace();
    const store = layer(s, ns);
    const runs: [string, bigint][] = [];
    const handler = makeIdempotent(
      async (event: { id: string }, _context: Context) => {
        runs.push([event.id, store.heldLease()!.fencingToken]);
        if (runs.length === 1) throw new Error("downstream refused");
        return { run: runs.length };
      },
      { persistenceStore: store, config: new IdempotencyConfig({ eventKeyJmesPath: "id" }) },
    );
    await assert.rejects(handler({ id: "e-4" }, lambdaContext()), { message: "downstream refused" });
    assert.equal((await s.client.get(ns, store.keyOf({ id: "e-4" }))).state, State.RELEASED);
    assert.equal(store.heldLease(), undefined);
    assert.deepEqual(await handler({ id: "e-4" }, lambdaContext()), { run: 2 });
    assert.deepEqual(await handler({ id: "e-4" }, lambdaContext()), { run: 2 });
    assert.deepEqual(runs, [
      ["e-4", 1n],
      ["e-4", 2n],
    ]);
  });

  test("a payload mismatch is an IdempotencyValidationError", async () => {
    const ns = s.namespace();
    const store = layer(s, ns);
    const runs: number[] = [];
    const place = makeIdempotent(
      async (order: { orderId: string; amount: number }) => {
        runs.push(order.amount);
        return { charged: order.amount };
      },
      {
        persistenceStore: store,
        config: new IdempotencyConfig({ eventKeyJmesPath: "orderId", payloadValidationJmesPath: "amount" }),
      },
    );
    assert.deepEqual(await place({ orderId: "o-5", amount: 10 }), { charged: 10 });
    assert.deepEqual(await place({ orderId: "o-5", amount: 10 }), { charged: 10 });
    await assert.rejects(place({ orderId: "o-5", amount: 11 }), IdempotencyValidationError);
    assert.deepEqual(runs, [10]);
    // The fingerprint is Powertools' payload hash (md5 of the amount's JSON, base64), as bytes.
    const record = await s.client.get(ns, store.keyOf({ orderId: "o-5" }));
    assert.deepEqual(record.fingerprint, createHash("md5").update("10").digest());
  });

  test("an expired result runs again, with the next fencing token", async () => {
    const ns = s.namespace();
    const store = layer(s, ns);
    const runs: bigint[] = [];
    const handler = makeIdempotent(
      async (_event: { id: string }, _context: Context) => {
        const fencingToken = store.heldLease()!.fencingToken;
        runs.push(fencingToken);
        return { run: runs.length, fencingToken: Number(fencingToken) };
      },
      { persistenceStore: store, config: new IdempotencyConfig({ eventKeyJmesPath: "id", expiresAfterSeconds: 1 }) },
    );
    assert.deepEqual(await handler({ id: "e-6" }, lambdaContext()), { run: 1, fencingToken: 1 });
    assert.deepEqual(await handler({ id: "e-6" }, lambdaContext()), { run: 1, fencingToken: 1 });
    const key = store.keyOf({ id: "e-6" });
    await until(async () => (await s.client.get(ns, key)).state === State.ABSENT, "the result to expire", 5000);
    assert.deepEqual(await handler({ id: "e-6" }, lambdaContext()), { run: 2, fencingToken: 2 });
    assert.deepEqual(runs, [1n, 2n]);
  });

  test("an expired result is refused when late retries are", async () => {
    const ns = s.namespace();
    const store = layer(s, ns, { lateRetry: "refuse" });
    let runs = 0;
    const handler = makeIdempotent(async (_event: { id: string }, _context: Context) => ({ run: ++runs }), {
      persistenceStore: store,
      config: new IdempotencyConfig({ eventKeyJmesPath: "id", expiresAfterSeconds: 1 }),
    });
    assert.deepEqual(await handler({ id: "e-7" }, lambdaContext()), { run: 1 });
    const key = store.keyOf({ id: "e-7" });
    await until(async () => (await s.client.get(ns, key)).state === State.ABSENT, "the result to expire", 5000);
    const error = await handler({ id: "e-7" }, lambdaContext()).then(
      () => assert.fail("a refused late retry ran"),
      (e: unknown) => e,
    );
    assert.ok(error instanceof IdempotencyPersistenceLayerError);
    assert.ok(error.cause instanceof ResultExpired);
    assert.equal(error.cause.fencingToken, 1n);
    assert.equal(runs, 1);
  });

  test("a lost lease is fenced: its result is refused", async () => {
    const ns = s.namespace();
    const store = layer(s, ns);
    const runs: bigint[] = [];
    const entered = gate();
    const finish = gate();
    const handler = makeIdempotent(
      async (_event: { id: string }, _context: Context) => {
        const fencingToken = store.heldLease()!.fencingToken;
        runs.push(fencingToken);
        if (fencingToken === 1n) {
          entered.open();
          await finish.wait();
        }
        return { fencingToken: Number(fencingToken) };
      },
      { persistenceStore: store, config: new IdempotencyConfig({ eventKeyJmesPath: "id" }) },
    );
    // The first invocation's lease ends with its remaining time: 1 s.
    const slow = settle(handler({ id: "e-8" }, lambdaContext(1000)));
    await entered.wait();
    const key = store.keyOf({ id: "e-8" });
    const leaseEnd = (await s.client.get(ns, key)).leaseExpiresAt!.getTime();
    await sleep(Math.max(0, leaseEnd - Date.now()) + 100);
    assert.deepEqual(await handler({ id: "e-8" }, lambdaContext()), { fencingToken: 2 });
    finish.open();
    const outcome = await slow;
    assert.ok("error" in outcome && outcome.error instanceof IdempotencyPersistenceLayerError);
    assert.ok(outcome.error.cause instanceof LeaseNotCurrent);
    assert.deepEqual(runs, [1n, 2n]);
    assert.equal((await s.client.get(ns, key)).response!.toString(), '{"fencingToken":2}');
  });

  test("a waiting duplicate takes the key when the holder throws", async () => {
    const ns = s.namespace();
    const store = layer(s, ns, { waitMs: 10_000 });
    const runs: bigint[] = [];
    const entered = gate();
    const finish = gate();
    const handler = makeIdempotent(
      async (_event: { id: string }, _context: Context) => {
        runs.push(store.heldLease()!.fencingToken);
        if (runs.length === 1) {
          entered.open();
          await finish.wait();
          throw new Error("first attempt fails");
        }
        return { run: runs.length };
      },
      { persistenceStore: store, config: new IdempotencyConfig({ eventKeyJmesPath: "id" }) },
    );
    const holder = settle(handler({ id: "e-3" }, lambdaContext()));
    await entered.wait();
    const duplicate = settle(handler({ id: "e-3" }, lambdaContext()));
    await sleep(300);
    finish.open();
    const held = await holder;
    assert.ok("error" in held && (held.error as Error).message === "first attempt fails");
    assert.deepEqual(await duplicate, { value: { run: 2 } });
    assert.deepEqual(runs, [1n, 2n]);
  });
});

withServer("powertools concurrency", ["sqlite", "postgres"], (s) => {
  test("a concurrent duplicate waits for the first one's result", async () => {
    const ns = s.namespace();
    const rec = recorder();
    const client = new IdempotencyClient(s.server.target, { interceptors: [rec.interceptor] });
    try {
      const store = new Layer({ client, namespace: ns, waitMs: 10_000 });
      const runs: string[] = [];
      const entered = gate();
      const finish = gate();
      const handler = makeIdempotent(
        async (event: { id: string }, _context: Context) => {
          runs.push(event.id);
          entered.open();
          await finish.wait();
          return { done: event.id };
        },
        { persistenceStore: store, config: new IdempotencyConfig({ eventKeyJmesPath: "id" }) },
      );
      const holder = settle(handler({ id: "e-2" }, lambdaContext()));
      await entered.wait();
      let duplicateDone = false;
      const duplicate = settle(handler({ id: "e-2" }, lambdaContext())).finally(() => (duplicateDone = true));
      await until(() => rec.of("Claim").length === 2, "the duplicate's Claim");
      await sleep(300); // the Claim reaches the server and waits there
      assert.equal(duplicateDone, false);
      finish.open();
      assert.deepEqual(await holder, { value: { done: "e-2" } });
      assert.deepEqual(await duplicate, { value: { done: "e-2" } });
      assert.deepEqual(runs, ["e-2"]);
      const waiting = rec.of("Claim")[1].request;
      assert.ok(waiting.wait, "the duplicate's Claim asked to wait");
      // Two Claims and one Complete: the duplicate neither polled nor ran.
      assert.deepEqual(
        rec.attempts.map((a) => a.method),
        ["Claim", "Claim", "Complete"],
      );
    } finally {
      client.close();
    }
  });

  test("a Lambda-style handler delivered twice at once has one effect", async () => {
    // Two deliveries of one event at once, each on its own client and layer
    // as two Lambda instances would be: one runs, the other waits and replays.
    const ns = s.namespace();
    const ledger = new Map<string, { fencingToken: bigint; amount: number }>();
    const effects: [string, bigint][] = [];
    type PaymentEvent = { detail: { paymentId: string; amount: number } };
    const instance = () => {
      const client = new IdempotencyClient(s.server.target);
      const store = new IdempotencyServicePersistenceLayer({ client, namespace: ns, waitMs: 10_000 });
      const handler = makeIdempotent(
        async (event: PaymentEvent, _context: Context) => {
          const fencingToken = store.heldLease()!.fencingToken;
          await sleep(300); // the charge takes a while
          // The downstream write refuses an older fencing token.
          const { paymentId, amount } = event.detail;
          if ((ledger.get(paymentId)?.fencingToken ?? 0n) < fencingToken) ledger.set(paymentId, { fencingToken, amount });
          effects.push([paymentId, fencingToken]);
          return { statusCode: 200, charged: amount, fencingToken: Number(fencingToken) };
        },
        {
          persistenceStore: store,
          config: new IdempotencyConfig({ eventKeyJmesPath: "detail.paymentId", payloadValidationJmesPath: "detail" }),
        },
      );
      return (event: PaymentEvent) => handler(event, lambdaContext(15_000)).finally(() => client.close());
    };
    const event = { detail: { paymentId: "pay-9", amount: 1299 } };
    const [a, b] = [instance(), instance()];
    const results = await Promise.all([a(event), b(event)]);
    assert.deepEqual(results, [
      { statusCode: 200, charged: 1299, fencingToken: 1 },
      { statusCode: 200, charged: 1299, fencingToken: 1 },
    ]);
    assert.deepEqual(effects, [["pay-9", 1n]]);
    assert.deepEqual([...ledger], [["pay-9", { fencingToken: 1n, amount: 1299 }]]);
  });
});

withServer("powertools readme", ["sqlite"], (s) => {
  test("the README's Powertools snippet runs as written", async () => {
    // The snippet of README.md's "Powertools for AWS Lambda", transpiled as
    // written (its address and namespace pointed at the test's server).
    const ts: typeof import("typescript") = require("typescript");
    const readme = readFileSync(join(__dirname, "..", "..", "README.md"), "utf8");
    const section = readme.split("## Powertools for AWS Lambda\n")[1].split("\n## ")[0];
    const blocks = [...section.matchAll(/^```ts\n(.*?)^```\n/gms)].map((m) => m[1]);
    assert.equal(blocks.length, 1);
    let code = blocks[0];
    assert.equal(code.split('"dns:///idempotency.internal:50051"').length, 2);
    assert.equal(code.split('"payments"').length, 2);
    const ns = s.namespace();
    code = code.replace('"dns:///idempotency.internal:50051"', JSON.stringify(s.server.target));
    code = code.replace('"payments"', JSON.stringify(ns));
    const js = ts.transpileModule(code, { compilerOptions: { module: ts.ModuleKind.CommonJS, target: ts.ScriptTarget.ES2022 } }).outputText;
    const charges: [string, bigint][] = [];
    const charge = async (detail: { paymentId: string }, fencingToken: bigint) => void charges.push([detail.paymentId, fencingToken]);
    const moduleRequire = (id: string) => require(id === "idempotency-client/powertools" ? "../src/powertools" : id);
    const exports: {
      handler?: (event: unknown, context: Context) => Promise<unknown>;
      persistenceStore?: IdempotencyServicePersistenceLayer;
    } = {};
    // The snippet's layer makes its own client: hand it out to close it.
    new Function("require", "exports", "charge", `${js}\nexports.persistenceStore = persistenceStore;`)(moduleRequire, exports, charge);
    const event = { detail: { paymentId: "pay-1", amount: 500 } };
    try {
      assert.deepEqual(await exports.handler!(event, lambdaContext()), { statusCode: 200 });
      assert.deepEqual(await exports.handler!(event, lambdaContext()), { statusCode: 200 });
      assert.deepEqual(charges, [["pay-1", 1n]]);
    } finally {
      exports.persistenceStore?.client.close();
    }
  });
});
