// What happens when a message cannot be processed, against the real thing
// (the service's binary, NATS JetStream, PostgreSQL), through the example's
// programs as the README runs them (setup.js, main.js, redrive.js):
//
//   1. The ledger is down for longer than the retry budget (max_deliver 3,
//      naks after 200 and 400 ms): the deliveries are nak'ed with growing
//      delays, then JetStream gives up and the message is parked in the
//      dead-letter stream, not lost; redrive.js puts it back once the ledger
//      is up, and it is applied once.
//   2. Bodies: floats and integers beyond 2^53 in fields the effect does not
//      use are processed (and a re-serialised copy is replayed); bodies that
//      cannot be read (bad JSON, a lone surrogate in the id, an amount beyond
//      2^53) and another body under a completed id are term()ed at once and
//      parked; the worker keeps running.
//   3. A late copy after the receipt expired, while the service remembers
//      the event (it re-executes the copy under the next fencing token: the
//      same body rewrites the row with the same values) and after it forgot
//      it (IDEMPOTENCY_REMEMBER_FOR=0s: the token restarts at 1, the same
//      body is answered with the row, unchanged); either way another amount
//      is term()ed before any Claim.
//   4. The defaults are docs/recipes.md's numbers.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { connect, type JetStreamClient, type JetStreamManager, type NatsConnection } from "nats";
import { Pool } from "pg";
import { IdempotencyClient } from "idempotency-client";
import { startServer, type RunningServer } from "idempotency-client/dist/src/testing";
import { applyEffect, ensureLedger, type Receipt } from "../src/ledger";
import { DEFAULT_ACK_WAIT_MS, DEFAULT_MAX_DELIVER, ensureStream } from "../src/jetstream";
import {
  checkSettings,
  DEFAULT_NAK_BACKOFF_MS,
  eventFingerprint,
  eventKey,
  nakDelayMs,
  retryBudgetMs,
  type OrderEvent,
  type Report,
} from "../src/consumer";
import { adminQuery, ConsumerProcess, NATS_URL, POSTGRES, program, waitFor } from "./support";

const NAMESPACE = "orders-ledger";
const RETENTION_MS = 10 * 60 * 1000;

let server: RunningServer;
let client: IdempotencyClient;
let nc: NatsConnection;
let jsm: JetStreamManager;
let js: JetStreamClient;
let pool: Pool;
let ledgerDb: string;
let serviceDb: string;
let suffix: string;
const streams: string[] = [];

before(async () => {
  suffix = randomBytes(6).toString("hex");
  // The service on PostgreSQL, its reaper every 200 ms, remembering
  // completed events as by default (7 days past their Complete), and
  // refusing late retries unless a Claim says otherwise: the consumer pins
  // lateRetry "reexecute", so a late copy is re-executed whatever the
  // server's or the namespace's policy (issue 33, defect 6).
  serviceDb = `nats_example_${suffix}_service`;
  await adminQuery(`CREATE DATABASE ${serviceDb}`);
  server = await startServer({
    databaseUrl: `${POSTGRES}/${serviceDb}`,
    env: { IDEMPOTENCY_REAPER_INTERVAL: "200ms", IDEMPOTENCY_LATE_RETRY: "refuse" },
  });
  client = new IdempotencyClient(server.target);
  ledgerDb = `nats_example_${suffix}`;
  await adminQuery(`CREATE DATABASE ${ledgerDb}`);
  pool = new Pool({ connectionString: `${POSTGRES}/${ledgerDb}`, max: 2 });
  pool.on("error", () => undefined); // an idle connection cut during the outage test
  await ensureLedger(pool);
  nc = await connect({ servers: NATS_URL, name: "nats-typescript-example-test-retries" });
  jsm = await nc.jetstreamManager();
  js = nc.jetstream();
});

after(async () => {
  const errors: unknown[] = [];
  const attempt = async (step: () => Promise<unknown> | unknown) => {
    try {
      await step();
    } catch (error) {
      errors.push(error);
    }
  };
  for (const name of streams) {
    await attempt(() => jsm.streams.delete(name));
    await attempt(() => jsm.streams.delete(`${name}_DEADLETTER`));
  }
  if (nc) await attempt(() => nc.close());
  if (pool) await attempt(() => pool.end());
  if (ledgerDb) await attempt(() => adminQuery(`DROP DATABASE IF EXISTS ${ledgerDb} WITH (FORCE)`));
  if (client) client.close();
  if (server) await attempt(() => server.stop());
  if (serviceDb) await attempt(() => adminQuery(`DROP DATABASE IF EXISTS ${serviceDb} WITH (FORCE)`));
  if (errors.length > 0) throw errors[0];
});

/** A stream of this test's own, made the README's way: setup.js (stream, consumer, dead-letter stream). */
async function setUp(tag: string, consumer: string, env: Record<string, string>): Promise<string> {
  const stream = `IDEMPOTENCY_EXAMPLE_${suffix.toUpperCase()}_${tag}`;
  streams.push(stream);
  await ensureStream(jsm, { name: stream, subjects: [`${stream}.>`] });
  const out = await program("setup", [], { STREAM: stream, CONSUMER: consumer, FILTER_SUBJECT: `${stream}.${consumer}`, ...env });
  assert.match(out, new RegExp(`consumer ${consumer}: .* dead letters ${stream}_DEADLETTER`));
  return stream;
}

function consumerEnv(stream: string, consumer: string): Record<string, string> {
  return {
    STREAM: stream,
    CONSUMER: consumer,
    IDEMPOTENCY_TARGET: server.target,
    LEDGER_DATABASE_URL: `${POSTGRES}/${ledgerDb}`,
    NAMESPACE,
    CONCURRENCY: "1",
    LEASE_MS: "5000",
    RETENTION_MS: String(RETENTION_MS),
    NAK_BACKOFF_MS: "200,400",
  };
}

async function drained(stream: string, consumer: string): Promise<boolean> {
  const info = await jsm.consumers.info(stream, consumer);
  return info.num_pending === 0 && info.num_ack_pending === 0;
}

async function ledgerRow(eventId: string): Promise<Receipt | undefined> {
  const result = await pool.query(
    "SELECT event_id, account, amount_cents::text, fencing::text, applied_by FROM ledger WHERE event_id = $1",
    [eventId],
  );
  assert.ok(result.rowCount! <= 1);
  return result.rows[0] && { ...result.rows[0], amount_cents: Number(result.rows[0].amount_cents) };
}

async function replayed(event: OrderEvent, service: IdempotencyClient = client): Promise<Receipt> {
  const claim = await service.claim(NAMESPACE, eventKey(event.event_id), { fingerprint: eventFingerprint(event) });
  assert.equal(claim.outcome, "COMPLETED", `${event.event_id}: a new Claim should replay`);
  return JSON.parse((claim as { response: Buffer }).response.toString("utf8"));
}

/** redrive.js's lines: the parked messages of `stream` (and, with an argument, what it re-drove). */
async function redrive(stream: string, which?: string): Promise<Record<string, unknown>[]> {
  const out = await program("redrive", which ? [which] : [], { STREAM: stream });
  return out.split("\n").filter((line) => line.trim() !== "").map((line) => JSON.parse(line));
}

test("a ledger outage longer than the retry budget ends parked in the dead-letter stream, and is applied once after a re-drive", async () => {
  const stream = await setUp("OUTAGE", "outage", { ACK_WAIT_MS: "5000", MAX_DELIVER: "3" });
  const deadLetters = `${stream}_DEADLETTER`;
  const consumer = new ConsumerProcess("o1", consumerEnv(stream, "outage"));
  let ledgerDown = false;
  try {
    await consumer.waitReady();
    // The ledger goes away: no new connections, and the open ones (the
    // consumer's, idle in its pool since start-up, and this test's) cut.
    await adminQuery(`ALTER DATABASE ${ledgerDb} ALLOW_CONNECTIONS false`);
    ledgerDown = true;
    await adminQuery(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '${ledgerDb}'`);

    const event: OrderEvent = { event_id: "outage-1", account: "acct-o", amount_cents: 4242 };
    const published = await js.publish(`${stream}.outage`, Buffer.from(JSON.stringify(event)));
    await waitFor(
      "the message parked in the dead-letter stream",
      async () => (await jsm.streams.info(deadLetters)).state.messages === 1,
      30_000,
      () => `${JSON.stringify(consumer.reports)}\n${consumer.log()}`,
    );
    assert.equal(consumer.exitCode(), null, `the consumer survived the outage\n${consumer.log()}`);

    // Three deliveries, each failed and nak'ed after its backoff step.
    const attempts = consumer.reports.filter((r) => r.event_id === "outage-1");
    assert.deepEqual(
      attempts.map((r) => [r.outcome, r.stream_seq, r.delivery, r.nak_delay_ms]),
      [
        ["failed", published.seq, 1, 200],
        ["failed", published.seq, 2, 400],
        ["failed", published.seq, 3, 400],
      ],
      consumer.log(),
    );
    for (const r of attempts) assert.match(r.error!, /not currently accepting connections/);
    // JetStream delivers it no more; nothing was claimed (each attempt failed
    // at its first ledger read, before the Claim) and nothing written.
    assert.ok(await drained(stream, "outage"));
    assert.equal((await client.get(NAMESPACE, eventKey("outage-1"))).state, "ABSENT");

    // Parked, not lost: the advisory names the message, which the stream still holds.
    const [parked, ...more] = await redrive(stream);
    assert.deepEqual(more, []);
    assert.deepEqual(
      { reason: parked.reason, consumer: parked.consumer, stream_seq: parked.stream_seq, deliveries: parked.deliveries, subject: parked.subject, body: parked.body },
      { reason: "max_deliveries", consumer: "outage", stream_seq: published.seq, deliveries: 3, subject: `${stream}.outage`, body: JSON.stringify(event) },
    );

    // The ledger is back; the operator re-drives; the event is applied once.
    await adminQuery(`ALTER DATABASE ${ledgerDb} ALLOW_CONNECTIONS true`);
    ledgerDown = false;
    assert.equal(await ledgerRow("outage-1"), undefined, "nothing was written during the outage");
    // Issue 33, defect 14: a re-drive killed (kill -9) after its publish,
    // before it removed the advisory, and run again: the second publish
    // carries the same Nats-Msg-Id, JetStream drops it as a duplicate, and
    // the stream holds one re-driven copy (it held two: the re-drive
    // published without an id).
    await assert.rejects(
      program("redrive", ["max_deliveries"], { STREAM: stream, REDRIVE_TEST_KILL_AFTER_PUBLISH: "1" }),
      (error: NodeJS.ErrnoException & { signal?: string }) => error.signal === "SIGKILL",
    );
    const [redriven] = await redrive(stream, "max_deliveries");
    const newSeq = redriven.redriven_as as number;
    assert.equal(newSeq, published.seq + 1, "the second re-drive's copy is the first one's");
    assert.equal((await jsm.streams.info(stream)).state.last_seq, published.seq + 1, "one re-driven copy in the stream");
    const copy = await jsm.streams.getMessage(stream, { seq: newSeq });
    assert.equal(copy.header.get("Nats-Msg-Id"), `${stream}/${published.seq}/redrive/1`);
    await waitFor(
      "the re-driven message completed",
      async () => consumer.reports.some((r) => r.stream_seq === newSeq && r.outcome === "completed") && (await drained(stream, "outage")),
      20_000,
      () => `${JSON.stringify(consumer.reports)}\n${consumer.log()}`,
    );
    const row = await ledgerRow("outage-1");
    assert.deepEqual(row, { event_id: "outage-1", account: "acct-o", amount_cents: 4242, fencing: "1", applied_by: "o1" });
    assert.deepEqual(await replayed(event), row);
    assert.equal((await jsm.streams.info(deadLetters)).state.messages, 0, "the re-drive removed the advisory");
    assert.equal(await consumer.stop(), 0, consumer.log());
  } finally {
    if (ledgerDown) await adminQuery(`ALTER DATABASE ${ledgerDb} ALLOW_CONNECTIONS true`);
    consumer.kill();
  }
});

test("bodies: floats and big integers are processed, unreadable bodies and another body are term()ed and parked", async () => {
  const stream = await setUp("BODIES", "bodies", { MAX_DELIVER: "3" });
  const consumer = new ConsumerProcess("b1", consumerEnv(stream, "bodies"));
  const bodies: [string, string][] = [
    // fields the effect does not use: a float, integers beyond 2^53, a nested float
    ["completed", '{"event_id":"body-1","account":"acct-b","amount_cents":1250,"rate":0.075,"ref":12345678901234567890,"meta":{"x":1.5e300,"big":-9007199254740993}}'],
    // the same event, re-serialised: other order, other spacing, a field less
    ["replayed", '{ "ref": 12345678901234567890, "amount_cents": 1250, "account": "acct-b", "event_id": "body-1" }'],
    // the same id, another amount
    ["mismatch", '{"event_id":"body-1","account":"acct-b","amount_cents":1251}'],
    ["invalid", '{"event_id":"\\ud800","account":"acct-b","amount_cents":1}'],
    ["invalid", '{"event_id":"body-5","account":"acct-b","amount_cents":9007199254740993}'],
    ["invalid", "not json"],
    ["completed", '{"event_id":"body-7","account":"acct-b","amount_cents":700}'],
  ];
  try {
    await consumer.waitReady();
    const seqs: number[] = [];
    for (const [, body] of bodies) seqs.push((await js.publish(`${stream}.bodies`, Buffer.from(body))).seq);
    await waitFor(
      "every body handled and the consumer drained",
      async () => consumer.reports.length >= bodies.length && (await drained(stream, "bodies")),
      30_000,
      () => `${JSON.stringify(consumer.reports)}\n${consumer.log()}`,
    );
    assert.equal(consumer.exitCode(), null, `the consumer keeps running\n${consumer.log()}`);
    const reports: Report[] = consumer.reports;
    // One delivery each, in order (one loop): nothing was nak'ed.
    assert.deepEqual(
      reports.map((r) => [r.stream_seq, r.delivery, r.outcome]),
      bodies.map(([outcome], i) => [seqs[i], 1, outcome]),
      JSON.stringify(reports, null, 1),
    );
    assert.match(reports[3].error!, /string|surrogate|Unicode/i);
    assert.match(reports[4].error!, /amount_cents/);

    const row1 = await ledgerRow("body-1");
    assert.deepEqual(row1, { event_id: "body-1", account: "acct-b", amount_cents: 1250, fencing: "1", applied_by: "b1" });
    assert.deepEqual(reports[1].receipt, row1, "the re-serialised copy replayed the row");
    assert.deepEqual(await replayed({ event_id: "body-1", account: "acct-b", amount_cents: 1250 }), row1);
    assert.equal((await ledgerRow("body-7"))?.amount_cents, 700);
    assert.equal(await ledgerRow("body-5"), undefined);

    // The four term()ed messages are parked, each after its one delivery.
    const parked = await redrive(stream);
    assert.deepEqual(
      parked.map((p) => [p.reason, p.stream_seq, p.deliveries, p.body]),
      [2, 3, 4, 5].map((i) => ["terminated", seqs[i], 1, bodies[i][1]]),
    );
    assert.equal(await consumer.stop(), 0, consumer.log());
  } finally {
    consumer.kill();
  }
});

test("a late copy within remember_for: another amount is term()ed, the same body re-executed under the next token rewrites the row", async () => {
  const stream = await setUp("LATE", "late", { MAX_DELIVER: "3" });
  const consumer = new ConsumerProcess("l1", { ...consumerEnv(stream, "late"), RETENTION_MS: "1000" });
  const original: OrderEvent = { event_id: "late-1", account: "acct-l", amount_cents: 500 };
  const key = eventKey("late-1");
  const report = (seq: number) => consumer.reports.find((r) => r.stream_seq === seq);
  const handled = async (seq: number) => {
    await waitFor(`seq ${seq} handled`, async () => report(seq) !== undefined && (await drained(stream, "late")), 20_000, () =>
      `${JSON.stringify(consumer.reports)}\n${consumer.log()}`,
    );
    return report(seq)!;
  };
  const remembered = async (token: bigint) => {
    const got = await client.get(NAMESPACE, key);
    return got.state === "ABSENT" && got.rememberedUntil !== null && got.fencingToken === token ? got : undefined;
  };
  try {
    await consumer.waitReady();
    const first = await handled((await js.publish(`${stream}.late`, Buffer.from(JSON.stringify(original)))).seq);
    assert.deepEqual([first.outcome, first.late_retry], ["completed", undefined]);
    const row = await ledgerRow("late-1");
    assert.deepEqual(row, { event_id: "late-1", account: "acct-l", amount_cents: 500, fencing: "1", applied_by: "l1" });

    // The retention (1 s) passes: the receipt is gone, the service remembers the event.
    await waitFor("late-1 to be remembered", async () => (await remembered(1n)) !== undefined, 20_000);
    const marker = (await remembered(1n))!;

    // Another amount under the same id: refused from the row, before any
    // Claim (the service would re-execute it); parked, the row unchanged.
    const other = { ...original, amount_cents: 900 };
    const refused = await handled((await js.publish(`${stream}.late`, Buffer.from(JSON.stringify(other)))).seq);
    assert.deepEqual([refused.outcome, refused.delivery, refused.fencing], ["mismatch", 1, undefined], JSON.stringify(refused));
    assert.ok(await remembered(1n), "nothing was claimed");
    assert.deepEqual(await ledgerRow("late-1"), row);

    // The same body: a late retry, re-executed under token 2 (completedAt
    // set); the guard rewrites the row with the same values, the row is the
    // receipt, and the report says late_retry.
    const again = await handled((await js.publish(`${stream}.late`, Buffer.from(JSON.stringify(original)))).seq);
    assert.equal(again.outcome, "completed");
    assert.deepEqual([again.fencing, again.effect, again.late_retry], ["2", { applied: true, row_fencing: "2" }, marker.completedAt!.toISOString()]);
    const rewritten = { ...row!, fencing: "2" };
    assert.deepEqual(again.receipt, rewritten);
    assert.deepEqual(await ledgerRow("late-1"), rewritten);
    assert.deepEqual(await replayed(original), rewritten);
    const record = await client.get(NAMESPACE, key);
    assert.deepEqual([record.state, record.fencingToken], ["COMPLETED", 2n]);
    assert.deepEqual((await redrive(stream)).map((p) => [p.reason, p.body]), [["terminated", JSON.stringify(other)]]);
    assert.equal(await consumer.stop(), 0, consumer.log());
  } finally {
    consumer.kill();
  }
});

test("a late copy after the service forgot the event: another amount is term()ed, the same body answered with the row, the row unchanged", async () => {
  // A server of its own that remembers nothing past the retention
  // (IDEMPOTENCY_REMEMBER_FOR=0s: what any server does past an event's
  // horizon), on PostgreSQL, its reaper every 200 ms.
  const forgetDb = `nats_example_${suffix}_forget`;
  await adminQuery(`CREATE DATABASE ${forgetDb}`);
  const forgetting = await startServer({
    databaseUrl: `${POSTGRES}/${forgetDb}`,
    env: { IDEMPOTENCY_REAPER_INTERVAL: "200ms", IDEMPOTENCY_REMEMBER_FOR: "0s" },
  });
  const forgetPool = new Pool({ connectionString: `${POSTGRES}/${forgetDb}`, max: 1 });
  const service = new IdempotencyClient(forgetting.target);
  const stream = await setUp("FORGOT", "forgot", { MAX_DELIVER: "3" });
  const consumer = new ConsumerProcess("f1", {
    ...consumerEnv(stream, "forgot"),
    IDEMPOTENCY_TARGET: forgetting.target,
    RETENTION_MS: "1000",
  });
  const original: OrderEvent = { event_id: "forgot-1", account: "acct-f", amount_cents: 500 };
  const key = eventKey("forgot-1");
  const report = (seq: number) => consumer.reports.find((r) => r.stream_seq === seq);
  const handled = async (seq: number) => {
    await waitFor(`seq ${seq} handled`, async () => report(seq) !== undefined && (await drained(stream, "forgot")), 20_000, () =>
      `${JSON.stringify(consumer.reports)}\n${consumer.log()}`,
    );
    return report(seq)!;
  };
  try {
    await consumer.waitReady();
    const first = await handled((await js.publish(`${stream}.forgot`, Buffer.from(JSON.stringify(original)))).seq);
    assert.equal(first.outcome, "completed");
    const row = await ledgerRow("forgot-1");
    assert.deepEqual(row, { event_id: "forgot-1", account: "acct-f", amount_cents: 500, fencing: "1", applied_by: "f1" });

    // The retention (1 s) passes and the reaper deletes the record.
    await waitFor(
      "the reaper to delete forgot-1's record",
      async () => (await forgetPool.query("SELECT 1 FROM idempotency_records WHERE namespace = $1 AND key = $2", [NAMESPACE, key])).rowCount === 0,
      20_000,
    );

    // Another amount under the same id: refused from the row, before any
    // Claim (the service no longer knows the event); parked, the row unchanged.
    const other = { ...original, amount_cents: 900 };
    const refused = await handled((await js.publish(`${stream}.forgot`, Buffer.from(JSON.stringify(other)))).seq);
    assert.deepEqual([refused.outcome, refused.delivery, refused.fencing], ["mismatch", 1, undefined], JSON.stringify(refused));
    assert.equal((await service.get(NAMESPACE, key)).state, "ABSENT", "nothing was claimed");
    assert.deepEqual(await ledgerRow("forgot-1"), row);

    // The same body: claimed anew (fencing token 1), the guard rejects the
    // write (the row's token is not lower), the row is the receipt.
    const again = await handled((await js.publish(`${stream}.forgot`, Buffer.from(JSON.stringify(original)))).seq);
    assert.equal(again.outcome, "completed");
    assert.deepEqual([again.fencing, again.effect, again.late_retry], ["1", { applied: false, row_fencing: "1" }, undefined]);
    assert.deepEqual(again.receipt, row);
    assert.deepEqual(await replayed(original, service), row);

    // And the guard alone, as in a race past that check: a newer token with
    // another amount does not rewrite the row.
    const raced = await applyEffect(pool, { eventKey: key, eventId: "forgot-1", account: "acct-f", amountCents: 900, fencing: 2n, worker: "racer" });
    assert.deepEqual(raced, { applied: false, receipt: row });
    assert.deepEqual(await ledgerRow("forgot-1"), row);
    assert.deepEqual((await redrive(stream)).map((p) => [p.reason, p.body]), [["terminated", JSON.stringify(other)]]);
    assert.equal(await consumer.stop(), 0, consumer.log());
  } finally {
    consumer.kill();
    service.close();
    await forgetting.stop();
    await forgetPool.end();
    await adminQuery(`DROP DATABASE IF EXISTS ${forgetDb} WITH (FORCE)`);
  }
});

test("the defaults are docs/recipes.md's numbers, and agree with each other", () => {
  assert.equal(DEFAULT_ACK_WAIT_MS, 30_000);
  assert.equal(DEFAULT_MAX_DELIVER, 20);
  assert.deepEqual(DEFAULT_NAK_BACKOFF_MS, [1_000, 5_000, 30_000, 120_000, 300_000]);
  assert.deepEqual([1, 2, 5, 6, 20].map((n) => nakDelayMs(n)), [1_000, 5_000, 300_000, 300_000, 300_000]);
  // The retry budget: about 83 minutes of failures before a message is parked.
  assert.equal(retryBudgetMs(DEFAULT_MAX_DELIVER), 4_956_000);
  // main.js's defaults (lease 30 s, retention 3 days) pass the checks against them.
  const jetstream = { ackWaitMs: DEFAULT_ACK_WAIT_MS, maxDeliver: DEFAULT_MAX_DELIVER, duplicateWindowMs: 120_000, maxAgeMs: 0 };
  assert.deepEqual(checkSettings(jetstream, { leaseTtlMs: 30_000, retentionMs: 3 * 24 * 3600_000 }), []);
  assert.match(checkSettings({ ...jetstream, maxDeliver: -1 }, { leaseTtlMs: 30_000, retentionMs: 3 * 24 * 3600_000 }).join("\n"), /never parked/);
  assert.match(checkSettings(jetstream, { leaseTtlMs: 60_000, retentionMs: 3 * 24 * 3600_000 }).join("\n"), /longer than ack_wait/);
});
