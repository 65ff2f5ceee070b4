// Retries: the policy (backoff capped, the call's deadline respected, final
// codes not retried), retry-safe Claims (a lost answer, retried, gets the same
// lease at once), several addresses. Against a real server.
import { after, before, describe, test } from "node:test";
import assert from "node:assert/strict";
import { createHash, randomBytes } from "node:crypto";
import { mkdtempSync, writeFileSync } from "node:fs";
import { createServer, type Server, type Socket } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import * as grpc from "@grpc/grpc-js";
import {
  DEFAULT_RETRY,
  IdempotencyClient,
  InvalidArgument,
  KeyNotFound,
  LeaseNotCurrent,
  ResourceExhausted,
  Unavailable,
  backoffMs,
  newLeaseToken,
  parseTargets,
  type ClientOptions,
} from "../src";
import { freePort, startServer, type RunningServer } from "../src/testing";
import { dropAnswers, recorder } from "./interceptors";
import { withServer } from "./helpers";

const claimed = <T extends { outcome: string }>(claim: T) => {
  assert.equal(claim.outcome, "CLAIMED");
  return claim as Extract<T, { outcome: "CLAIMED" }>;
};

test("backoff: full jitter under a cap that grows by the multiplier up to maxBackoffMs", () => {
  const policy = { ...DEFAULT_RETRY, initialBackoffMs: 50, maxBackoffMs: 2000, multiplier: 2 };
  const caps = Array.from({ length: 12 }, (_, i) => backoffMs(i + 1, policy, () => 1));
  assert.deepEqual(caps, [50, 100, 200, 400, 800, 1600, 2000, 2000, 2000, 2000, 2000, 2000]);
  assert.equal(backoffMs(3, policy, () => 0), 0);
  assert.equal(backoffMs(3, policy, () => 0.5), 100);
  for (let attempt = 1; attempt < 200; attempt++) {
    const pause = backoffMs(attempt, policy);
    assert.ok(pause >= 0 && pause <= 2000, `pause ${pause} after attempt ${attempt}`);
  }
});

test("lease tokens: 32 lowercase hex characters, new every time", () => {
  const tokens = new Set(Array.from({ length: 100 }, () => newLeaseToken()));
  assert.equal(tokens.size, 100);
  for (const token of tokens) assert.match(token, /^[0-9a-f]{32}$/);
});

test("targets: an array, a comma-separated string, or one gRPC target", () => {
  assert.deepEqual(parseTargets("127.0.0.1:1"), ["127.0.0.1:1"]);
  assert.deepEqual(parseTargets("a:1, b:2,"), ["a:1", "b:2"]);
  assert.deepEqual(parseTargets(["a:1", " b:2 "]), ["a:1", "b:2"]);
  assert.deepEqual(parseTargets("dns:///idempotency.internal:50051"), ["dns:///idempotency.internal:50051"]);
  assert.deepEqual(parseTargets("ipv4:10.0.0.1:1,10.0.0.2:1"), ["ipv4:10.0.0.1:1,10.0.0.2:1"]);
  assert.throws(() => parseTargets(""), /at least one/);
  assert.throws(() => parseTargets([]), /at least one/);
  assert.throws(() => parseTargets([1 as unknown as string]), /target\[0\]/);
});

test("retry options are checked", () => {
  assert.throws(() => new IdempotencyClient("127.0.0.1:1", { retry: { maxAttempts: 0 } }), /maxAttempts/);
  assert.throws(() => new IdempotencyClient("127.0.0.1:1", { retry: { maxAttempts: 1.5 } }), /maxAttempts/);
  assert.throws(() => new IdempotencyClient("127.0.0.1:1", { retry: { multiplier: 0.5 } }), /multiplier/);
  assert.throws(() => new IdempotencyClient("127.0.0.1:1", { retry: { perAttemptTimeoutMs: 0 } }), /perAttemptTimeoutMs/);
  assert.throws(() => new IdempotencyClient("127.0.0.1:1", { retry: true as unknown as false }), /retry/);
  const client = new IdempotencyClient("127.0.0.1:1", { retry: { maxAttempts: 3 } });
  assert.deepEqual(client.retry, { ...DEFAULT_RETRY, maxAttempts: 3 });
  client.close();
  const off = new IdempotencyClient("127.0.0.1:1", { retry: false });
  assert.equal(off.retry.maxAttempts, 1);
  off.close();
});

withServer("retry", ["sqlite", "postgres"], (s) => {
  const clients: IdempotencyClient[] = [];
  const connect = (options: ClientOptions) => {
    const client = new IdempotencyClient(s.server.target, options);
    clients.push(client);
    return client;
  };
  after(() => clients.forEach((c) => c.close()));

  test("a Claim whose answer is lost is retried and gets the same lease at once", async () => {
    const ns = s.namespace();
    const drop = dropAnswers("Claim");
    const client = connect({ interceptors: [drop.interceptor] });
    const started = Date.now();
    const claim = claimed(await client.claim(ns, "k", { leaseTtlMs: 30_000 }));
    const elapsed = Date.now() - started;

    const attempts = drop.of("Claim");
    assert.equal(attempts.length, 2);
    assert.equal(attempts[0].code, grpc.status.OK, "the first attempt reached the server and won");
    assert.equal(attempts[0].seenCode, grpc.status.UNAVAILABLE);
    assert.equal(attempts[0].request.leaseToken, attempts[1].request.leaseToken, "the same token on the retry");
    assert.equal(claim.leaseToken, attempts[0].request.leaseToken);
    assert.equal(claim.retried, true);
    assert.equal(claim.fencingToken, 1n);
    assert.ok(elapsed < 2000, `no wait on the lease (${elapsed} ms)`);

    // The lease is the first attempt's: nobody else gets it, and it completes.
    assert.equal((await s.other.claim(ns, "k")).outcome, "IN_PROGRESS");
    await client.complete(ns, "k", claim.leaseToken, "done");
    const record = await s.other.get(ns, "k");
    assert.equal(record.state, "COMPLETED");
    assert.equal(record.fencingToken, 1n);
  });

  test("a retried Claim whose first attempt never arrived wins the lease, not retried", async () => {
    const ns = s.namespace();
    const rec = recorder();
    const client = connect({ interceptors: [rec.interceptor] });
    const claim = claimed(await client.claim(ns, "k"));
    assert.equal(claim.retried, false);
    assert.equal(claim.leaseToken, rec.of("Claim")[0].request.leaseToken);
  });

  test("a ClaimBatch whose answer is lost is retried: each item its own lease, the same on the retry", async () => {
    const ns = s.namespace();
    const drop = dropAnswers("ClaimBatch");
    const client = connect({ interceptors: [drop.interceptor] });
    const claims = (await client.claimBatch([{ namespace: ns, key: "a" }, { namespace: ns, key: "b" }])).map(claimed);
    const [first, second] = drop.of("ClaimBatch").map((a) => a.request.items.map((item: { leaseToken: string }) => item.leaseToken));
    assert.deepEqual(first, second);
    assert.notEqual(first[0], first[1]);
    assert.deepEqual(claims.map((c) => c.leaseToken), first);
    assert.deepEqual(claims.map((c) => c.retried), [true, true]);
    assert.deepEqual(claims.map((c) => c.fencingToken), [1n, 1n]);
  });

  test("a caller-chosen lease token is the lease's; a repeated Claim with it gets the same lease", async () => {
    const ns = s.namespace();
    const token = newLeaseToken();
    const first = claimed(await s.client.claim(ns, "k", { leaseToken: token }));
    assert.equal(first.leaseToken, token);
    assert.equal(first.retried, false);
    const again = claimed(await s.client.claim(ns, "k", { leaseToken: token }));
    assert.deepEqual(again, { ...first, retried: true });
    assert.equal((await s.client.claim(ns, "k")).outcome, "IN_PROGRESS", "another token");
  });

  test("a malformed lease token is INVALID_ARGUMENT naming lease_token, not retried", async () => {
    const rec = recorder();
    const client = connect({ interceptors: [rec.interceptor] });
    await assert.rejects(client.claim(s.namespace(), "k", { leaseToken: "not-hex" }), (error: unknown) => {
      assert.ok(error instanceof InvalidArgument);
      assert.match(error.message, /lease_token/);
      assert.equal(error.attempts, 1);
      return true;
    });
    assert.equal(rec.of("Claim").length, 1);
  });

  test("a Complete whose answer is lost is retried and succeeds", async () => {
    const ns = s.namespace();
    const drop = dropAnswers("Complete");
    const client = connect({ interceptors: [drop.interceptor] });
    const claim = claimed(await client.claim(ns, "k"));
    await client.complete(ns, "k", claim.leaseToken, "result");
    assert.equal(drop.of("Complete").length, 2);
    assert.equal(drop.of("Complete")[0].code, grpc.status.OK);
    const replay = await s.other.claim(ns, "k");
    assert.equal(replay.outcome === "COMPLETED" && replay.response.toString(), "result");
  });

  test("a Release whose answer is lost is retried and succeeds", async () => {
    const ns = s.namespace();
    const drop = dropAnswers("Release");
    const client = connect({ interceptors: [drop.interceptor] });
    const claim = claimed(await client.claim(ns, "k"));
    await client.release(ns, "k", claim.leaseToken);
    assert.equal(drop.of("Release").length, 2);
    assert.equal((await s.other.get(ns, "k")).state, "RELEASED");
  });

  test("once() survives a lost Claim answer: the work runs once under the first attempt's lease", async () => {
    const ns = s.namespace();
    const drop = dropAnswers("Claim");
    const client = connect({ interceptors: [drop.interceptor] });
    let runs = 0;
    const result = await client.onceWithDetails(ns, "k", async (lease) => {
      runs++;
      return lease.fencingToken.toString();
    });
    assert.equal(result.value, "1");
    assert.equal(runs, 1);
    assert.equal(result.claim.outcome === "CLAIMED" && result.claim.retried, true);
    assert.equal(drop.of("Claim").length, 2);
  });

  test("final codes are not retried: INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND", async () => {
    const ns = s.namespace();
    const rec = recorder();
    const client = connect({ interceptors: [rec.interceptor] });
    await assert.rejects(client.claim(ns, "k".repeat(513)), InvalidArgument);
    const claim = claimed(await client.claim(ns, "k"));
    await assert.rejects(client.complete(ns, "k", newLeaseToken(), "x"), LeaseNotCurrent);
    await assert.rejects(client.release(ns, "absent", claim.leaseToken), KeyNotFound);
    assert.deepEqual(
      rec.attempts.map((a) => [a.method, grpc.status[a.seenCode!]]),
      [["Claim", "INVALID_ARGUMENT"], ["Claim", "OK"], ["Complete", "FAILED_PRECONDITION"], ["Release", "NOT_FOUND"]],
    );
  });

  test("UNAVAILABLE is retried up to maxAttempts, with pauses under the cap", async () => {
    const ns = s.namespace();
    const drop = recorder(() => grpc.status.UNAVAILABLE);
    const client = connect({ interceptors: [drop.interceptor], retry: { maxAttempts: 4, initialBackoffMs: 100, maxBackoffMs: 150, multiplier: 10 } });
    await assert.rejects(client.get(ns, "k"), (error: unknown) => {
      assert.ok(error instanceof Unavailable);
      assert.equal(error.attempts, 4);
      assert.match(error.message, /after 4 attempts/);
      return true;
    });
    assert.equal(drop.of("Get").length, 4);
    const gaps = drop.attempts.slice(1).map((a, i) => a.at - drop.attempts[i].at);
    for (const gap of gaps) assert.ok(gap <= 150 + 200, `a pause of ${gap} ms over the cap of 150 ms`);
  });

  test("retries stop at the call's deadline", async () => {
    const drop = recorder(() => grpc.status.UNAVAILABLE);
    const client = connect({ interceptors: [drop.interceptor], retry: { maxAttempts: 1000, initialBackoffMs: 50, maxBackoffMs: 100 } });
    const started = Date.now();
    await assert.rejects(client.get(s.namespace(), "k", { timeoutMs: 700 }), Unavailable);
    const elapsed = Date.now() - started;
    assert.ok(elapsed < 700 + 300, `gave up after ${elapsed} ms, not at the 700 ms deadline`);
    assert.ok(drop.attempts.length > 2 && drop.attempts.length < 1000, `${drop.attempts.length} attempts`);
  });

  test("retry: false tries once", async () => {
    const drop = recorder(() => grpc.status.UNAVAILABLE);
    const client = connect({ interceptors: [drop.interceptor], retry: false });
    await assert.rejects(client.get(s.namespace(), "k"), Unavailable);
    assert.equal(drop.attempts.length, 1);
    // ... and a call may turn retries back on for itself, or off.
    await assert.rejects(client.get(s.namespace(), "k", { retry: { maxAttempts: 3, initialBackoffMs: 1 } }), Unavailable);
    assert.equal(drop.attempts.length, 4);
  });
});

describe("several addresses", () => {
  let server: RunningServer | undefined;
  let hang: Server | undefined;
  const sockets: Socket[] = [];
  let hangTarget = "";
  const clients: IdempotencyClient[] = [];
  const connect = (target: string | string[], options: ClientOptions = {}) => {
    const client = new IdempotencyClient(target, options);
    clients.push(client);
    return client;
  };

  before(async () => {
    server = await startServer();
    // A replica that accepts connections and never answers.
    hang = createServer((socket) => sockets.push(socket));
    await new Promise<void>((resolve) => hang!.listen(0, "127.0.0.1", resolve));
    const address = hang.address();
    hangTarget = `127.0.0.1:${typeof address === "object" && address ? address.port : 0}`;
  });
  after(async () => {
    clients.forEach((c) => c.close());
    sockets.forEach((s) => s.destroy());
    await new Promise((resolve) => hang?.close(resolve));
    await server?.stop();
  });

  test("calls succeed while one of two addresses refuses connections", async () => {
    const dead = `127.0.0.1:${await freePort()}`;
    const client = connect([dead, server!.target]);
    const ns = `node-replicas-${randomBytes(4).toString("hex")}`;
    for (let i = 0; i < 20; i++) {
      const claim = claimed(await client.claim(ns, `k${i}`));
      await client.complete(ns, `k${i}`, claim.leaseToken, "ok");
    }
  });

  test("a comma-separated string works as an array", async () => {
    const dead = `127.0.0.1:${await freePort()}`;
    const client = connect(`${server!.target},${dead}`);
    assert.deepEqual(client.targets, [server!.target, dead]);
    for (let i = 0; i < 5; i++) assert.equal((await client.get("node-x", `k${i}`)).state, "ABSENT");
  });

  test("a dns:/// name resolves and balances (localhost: 127.0.0.1, and ::1 where nobody listens)", async () => {
    const port = server!.target.split(":").pop();
    const client = connect(`dns:///localhost:${port}`);
    for (let i = 0; i < 10; i++) assert.equal((await client.get("node-x", `k${i}`)).state, "ABSENT");
  });

  test("a per-attempt timeout leaves time for another attempt on another address", async () => {
    const client = connect([hangTarget, server!.target], { retry: { perAttemptTimeoutMs: 300 }, timeoutMs: 5000 });
    const started = Date.now();
    assert.equal((await client.get("node-x", "k")).state, "ABSENT");
    assert.ok(Date.now() - started >= 250, "the first attempt went to the hanging address and timed out");
  });

  test("an address whose connections hang gets no call while another is connected", async () => {
    const client = connect([hangTarget, server!.target], { retry: { perAttemptTimeoutMs: 300 }, timeoutMs: 5000 });
    await client.get("node-x", "warm-up"); // connects to the live address (maybe after one attempt on the other)
    const started = Date.now();
    for (let i = 0; i < 20; i++) assert.equal((await client.get("node-x", `k${i}`)).state, "ABSENT");
    assert.ok(Date.now() - started < 250, `20 calls took ${Date.now() - started} ms: none waited on the hanging address`);
  });

  test("without a per-attempt timeout a hanging attempt uses up the deadline: DEADLINE_EXCEEDED once", async () => {
    const client = connect(hangTarget, { timeoutMs: 600 });
    const started = Date.now();
    await assert.rejects(client.get("node-x", "k"), (error: unknown) => {
      assert.ok(error instanceof Unavailable);
      assert.equal(error.code, grpc.status.DEADLINE_EXCEEDED);
      assert.equal(error.attempts, 1);
      return true;
    });
    assert.ok(Date.now() - started < 600 + 300);
  });
});

describe("RESOURCE_EXHAUSTED", () => {
  const token = `idem_${randomBytes(32).toString("hex")}`;
  let server: RunningServer | undefined;
  before(async () => {
    const dir = mkdtempSync(join(tmpdir(), "idempotency-node-retry-"));
    const policy = join(dir, "policy.toml");
    writeFileSync(policy, `
[[identity]]
name = "limited"
token_hashes = ["sha256:${createHash("sha256").update(token, "utf8").digest("hex")}"]
namespaces = ["limited/*"]
rate_limit_per_second = 2
rate_limit_burst = 1
`);
    server = await startServer({ dataDir: dir, env: { IDEMPOTENCY_POLICY_FILE: policy } });
  });
  after(async () => {
    await server?.stop();
  });

  test("over the rate limit, calls are retried until a token is free", async () => {
    const rec = recorder();
    const client = new IdempotencyClient(server!.target, { token, interceptors: [rec.interceptor] });
    try {
      for (let i = 0; i < 3; i++) assert.equal((await client.get("limited/x", `k${i}`)).state, "ABSENT");
      const codes = rec.attempts.map((a) => a.code);
      assert.ok(codes.includes(grpc.status.RESOURCE_EXHAUSTED), `some attempt was limited: ${codes}`);
      assert.equal(codes.filter((c) => c === grpc.status.OK).length, 3);
    } finally {
      client.close();
    }
    const once = new IdempotencyClient(server!.target, { token, retry: false });
    try {
      await assert.rejects(async () => {
        for (let i = 0; i < 5; i++) await once.get("limited/x", `k${i}`);
      }, ResourceExhausted);
    } finally {
      once.close();
    }
  });
});
