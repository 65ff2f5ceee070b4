// Bearer tokens, TLS and mutual TLS against a real server with an access
// policy: two servers (plaintext, and TLS with optional client certificates),
// certificates made with the openssl CLI at set-up
// (clients/testdata/make-test-certs.sh), tokens and policy made here.
import { after, before, describe, test } from "node:test";
import assert from "node:assert/strict";
import { createHash, randomBytes } from "node:crypto";
import { execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import * as grpc from "@grpc/grpc-js";
import {
  IdempotencyClient,
  IdempotencyError,
  PermissionDenied,
  ResourceExhausted,
  Unauthenticated,
  Unavailable,
  type ClientOptions,
} from "../src";
import { freePort, startServer, type RunningServer } from "../src/testing";
import { until } from "./helpers";

// dist/test/security.test.js -> clients/testdata
const MAKE_CERTS = resolve(__dirname, "..", "..", "..", "testdata", "make-test-certs.sh");

const newToken = () => `idem_${randomBytes(32).toString("hex")}`;
const tokenHash = (token: string) => `sha256:${createHash("sha256").update(token, "utf8").digest("hex")}`;
const ORDERS_TOKEN = newToken();
const LIMITED_TOKEN = newToken();
const UNKNOWN_TOKEN = newToken();

const POLICY = `
[[identity]]
name = "orders"
token_hashes = ["${tokenHash(ORDERS_TOKEN)}"]
namespaces = ["orders", "orders/*"]

[[identity]]
name = "orders-by-certificate"
client_cert_cn = "orders-client"
namespaces = ["billing/*"]

[[identity]]
name = "limited"
token_hashes = ["${tokenHash(LIMITED_TOKEN)}"]
namespaces = ["limited/*"]
rate_limit_per_second = 1
rate_limit_burst = 1
`;

const unique = (prefix: string) => `${prefix}/node-${randomBytes(6).toString("hex")}`;

const code = (expected: grpc.status) => (error: unknown) => {
  assert.ok(error instanceof IdempotencyError, `expected an IdempotencyError, got ${error}`);
  assert.equal(error.code, expected, `expected ${grpc.status[expected]}, got ${String(error)}`);
  return true;
};

describe("authentication and TLS", () => {
  const dir = mkdtempSync(join(tmpdir(), "idempotency-node-security-"));
  const certDir = join(dir, "certs");
  const pem = (name: string) => readFileSync(join(certDir, name));
  const clients: IdempotencyClient[] = [];
  let plain: RunningServer | undefined;
  let secure: RunningServer | undefined;

  const connect = (server: RunningServer | undefined, options: ClientOptions = {}, host = "127.0.0.1") => {
    const client = new IdempotencyClient(server!.target.replace("127.0.0.1", host), options);
    clients.push(client);
    return client;
  };

  before(async () => {
    execFileSync("bash", [MAKE_CERTS, certDir], { stdio: "pipe", timeout: 30_000 });
    const policy = join(dir, "policy.toml");
    writeFileSync(policy, POLICY);
    [plain, secure] = await Promise.all([
      startServer({ dataDir: mkdtempSync(join(dir, "plain-")), env: { IDEMPOTENCY_POLICY_FILE: policy } }),
      // startServer waits on a plaintext health listener it adds on another port.
      startServer({
        dataDir: mkdtempSync(join(dir, "tls-")),
        env: {
          IDEMPOTENCY_POLICY_FILE: policy,
          IDEMPOTENCY_TLS_CERT_FILE: join(certDir, "server.pem"),
          IDEMPOTENCY_TLS_KEY_FILE: join(certDir, "server.key"),
          IDEMPOTENCY_TLS_CLIENT_CA_FILE: join(certDir, "ca.pem"),
          IDEMPOTENCY_TLS_CLIENT_AUTH: "optional",
        },
      }),
    ]);
  });

  after(async () => {
    for (const client of clients) client.close();
    await Promise.all([plain?.stop(), secure?.stop()]);
  });

  // --- bearer tokens over plaintext ------------------------------------------

  test("a token over plaintext claims, completes and replays", async () => {
    const client = connect(plain, { token: ORDERS_TOKEN });
    const ns = unique("orders");
    const claim = await client.claim(ns, "k");
    assert.equal(claim.outcome, "CLAIMED");
    if (claim.outcome !== "CLAIMED") return;
    await client.complete(ns, "k", claim.leaseToken, '{"ok":true}');
    const replay = await client.claim(ns, "k");
    assert.equal(replay.outcome, "COMPLETED");
    if (replay.outcome === "COMPLETED") assert.equal(replay.response.toString(), '{"ok":true}');
    // The exact namespace of the grant, as well as "orders/*".
    assert.equal((await client.claim("orders", randomBytes(8).toString("hex"))).outcome, "CLAIMED");
  });

  test("the token goes with batch calls and with once() and its heartbeat", async () => {
    const client = connect(plain, { token: ORDERS_TOKEN });
    const ns = unique("orders");
    const claims = await client.claimBatch([{ namespace: ns, key: "a" }, { namespace: ns, key: "b" }]);
    assert.deepEqual(claims.map((c) => c.outcome), ["CLAIMED", "CLAIMED"]);
    const done = await client.completeBatch(
      claims.map((c, i) => ({ namespace: ns, key: "ab"[i], leaseToken: c.outcome === "CLAIMED" ? c.leaseToken : "", response: "1" })),
    );
    assert.deepEqual(done.map((d) => d.ok), [true, true]);

    const first = await client.onceWithDetails(ns, "once", async (lease) => {
      // The heartbeat's ExtendLease moves the lease on only if it was let in.
      await until(
        async () => ((await client.get(ns, "once")).leaseExpiresAt?.getTime() ?? 0) > lease.leaseExpiresAt.getTime(),
        "the heartbeat to extend the lease",
        5000,
      );
      return { charged: 1 };
    }, { leaseTtlMs: 5000, heartbeatIntervalMs: 50 });
    assert.equal(first.replayed, false);
    const again = await client.onceWithDetails(ns, "once", () => ({ charged: 2 }));
    assert.deepEqual(again, { ...again, value: { charged: 1 }, replayed: true });
  });

  test("no token is UNAUTHENTICATED", async () => {
    const client = connect(plain);
    await assert.rejects(client.claim(unique("orders"), "k"), Unauthenticated);
    await assert.rejects(client.claim(unique("orders"), "k"), code(grpc.status.UNAUTHENTICATED));
  });

  test("an unknown token is UNAUTHENTICATED", async () => {
    const client = connect(plain, { token: UNKNOWN_TOKEN });
    await assert.rejects(client.claim(unique("orders"), "k"), Unauthenticated);
  });

  test("a namespace outside the grant is PERMISSION_DENIED", async () => {
    const client = connect(plain, { token: ORDERS_TOKEN });
    for (const ns of ["payments/x", "ordersx", "billing/x"]) {
      await assert.rejects(client.claim(ns, "k"), code(grpc.status.PERMISSION_DENIED));
    }
    await assert.rejects(client.claim("payments/x", "k"), PermissionDenied);
  });

  test("a batch with one item outside the grant is denied and changes nothing", async () => {
    const client = connect(plain, { token: ORDERS_TOKEN });
    const ns = unique("orders");
    await assert.rejects(client.claimBatch([{ namespace: ns, key: "k" }, { namespace: "payments/x", key: "k" }]), PermissionDenied);
    assert.equal((await client.get(ns, "k")).state, "ABSENT");
  });

  test("purge is not granted unless the policy lists it", async () => {
    const client = connect(plain, { token: ORDERS_TOKEN });
    const ns = unique("orders");
    await client.claim(ns, "k");
    await assert.rejects(client.purge(ns, "k", { reason: "test" }), PermissionDenied);
  });

  test("over the rate limit is RESOURCE_EXHAUSTED", async () => {
    // Retries off: with them the client would wait for the next token.
    const client = connect(plain, { token: LIMITED_TOKEN, retry: false });
    const ns = unique("limited");
    await assert.rejects(async () => {
      for (let i = 0; i < 20; i++) await client.get(ns, `k${i}`); // 1 per second, burst 1
    }, (error: unknown) => error instanceof ResourceExhausted && error.code === grpc.status.RESOURCE_EXHAUSTED);
  });

  // --- TLS and mutual TLS ----------------------------------------------------

  test("TLS with the CA as root and a token works", async () => {
    const client = connect(secure, { token: ORDERS_TOKEN, tls: { rootCerts: pem("ca.pem") } });
    const ns = unique("orders");
    const claim = await client.claim(ns, "k");
    assert.equal(claim.outcome, "CLAIMED");
    if (claim.outcome !== "CLAIMED") return;
    await client.complete(ns, "k", claim.leaseToken, "tls");
    const replay = await client.claim(ns, "k");
    assert.equal(replay.outcome === "COMPLETED" && replay.response.toString(), "tls");
    await assert.rejects(client.claim(unique("billing"), "k"), PermissionDenied);
  });

  test("TLS and a token with several addresses, one of them down", async () => {
    const dead = `127.0.0.1:${await freePort()}`;
    const targets = [dead, secure!.target, secure!.target.replace("127.0.0.1", "localhost")];
    const client = new IdempotencyClient(targets, { token: ORDERS_TOKEN, tls: { rootCerts: pem("ca.pem") } });
    clients.push(client);
    const ns = unique("orders");
    for (let i = 0; i < 6; i++) {
      const claim = await client.claim(ns, `k${i}`);
      assert.equal(claim.outcome, "CLAIMED");
      if (claim.outcome === "CLAIMED") await client.complete(ns, `k${i}`, claim.leaseToken, "tls");
    }
    await assert.rejects(client.claim(unique("billing"), "k"), PermissionDenied);
  });

  test("TLS without credentials is UNAUTHENTICATED", async () => {
    const client = connect(secure, { tls: { rootCerts: pem("ca.pem") } });
    await assert.rejects(client.claim(unique("orders"), "k"), Unauthenticated);
  });

  test("mutual TLS works as the certificate's identity", async () => {
    const client = connect(secure, { tls: { rootCerts: pem("ca.pem"), clientCert: pem("client.pem"), clientKey: pem("client.key") } });
    const ns = unique("billing");
    const claim = await client.claim(ns, "k");
    assert.equal(claim.outcome, "CLAIMED");
    if (claim.outcome !== "CLAIMED") return;
    await client.complete(ns, "k", claim.leaseToken, "mtls");
    const replay = await client.claim(ns, "k");
    assert.equal(replay.outcome === "COMPLETED" && replay.response.toString(), "mtls");
    // The certificate's grant (billing/*), not the token identity's (orders/*).
    await assert.rejects(client.claim(unique("orders"), "k"), PermissionDenied);
  });

  test("TLS to a DNS name of the certificate works", async () => {
    const tls = { rootCerts: pem("ca.pem"), clientCert: pem("client.pem"), clientKey: pem("client.key") };
    const client = connect(secure, { tls }, "localhost");
    assert.equal((await client.claim(unique("billing"), "k")).outcome, "CLAIMED");
  });

  test("with a good certificate a wrong token still decides", async () => {
    const client = connect(secure, {
      token: UNKNOWN_TOKEN,
      tls: { rootCerts: pem("ca.pem"), clientCert: pem("client.pem"), clientKey: pem("client.key") },
    });
    await assert.rejects(client.claim(unique("billing"), "k"), Unauthenticated);
  });

  test("TLS without the CA as root fails", async () => {
    // tls: true: the system's roots, which do not include the test CA.
    const client = connect(secure, { token: ORDERS_TOKEN, tls: true, timeoutMs: 5000, retry: { maxAttempts: 2 } });
    await assert.rejects(client.claim(unique("orders"), "k"), (error: unknown) => error instanceof Unavailable && /certificate/i.test(error.message));
  });

  test("a plaintext client cannot reach the TLS port", async () => {
    const client = connect(secure, { token: ORDERS_TOKEN, timeoutMs: 5000, retry: { maxAttempts: 2 } });
    await assert.rejects(client.claim(unique("orders"), "k"), Unavailable);
  });

  test("a client certificate from another CA is refused", async () => {
    const client = connect(secure, {
      token: ORDERS_TOKEN,
      timeoutMs: 5000,
      retry: { maxAttempts: 2 },
      tls: { rootCerts: pem("ca.pem"), clientCert: pem("rogue-client.pem"), clientKey: pem("rogue-client.key") },
    });
    await assert.rejects(client.claim(unique("orders"), "k"), (error: unknown) => error instanceof Unavailable && /unknown ca/i.test(error.message));
  });
});

test("the tls and token options are checked", () => {
  const cert = Buffer.from("-----BEGIN CERTIFICATE-----\n");
  assert.throws(() => new IdempotencyClient("127.0.0.1:1", { tls: { clientCert: cert } }), /clientKey/);
  assert.throws(() => new IdempotencyClient("127.0.0.1:1", { tls: { rootCerts: "pem" as unknown as Buffer } }), /Buffer/);
  assert.throws(
    () => new IdempotencyClient("127.0.0.1:1", { tls: true, credentials: grpc.credentials.createSsl() }),
    /not both/,
  );
  assert.throws(() => new IdempotencyClient("127.0.0.1:1", { token: "Bearer abc" }), /token/);
  assert.throws(() => new IdempotencyClient("127.0.0.1:1", { token: "" }), /token/);
  assert.throws(() => new IdempotencyClient("127.0.0.1:1", { token: 42 as unknown as string }), /token/);
});
