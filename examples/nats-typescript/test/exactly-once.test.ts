// The example against the real thing: idempotency-service (the binary, on a
// free port), NATS JetStream on 127.0.0.1:4222 (a stream of its own, deleted
// at the end) and PostgreSQL (a ledger database of its own, dropped at the end).
//
//   1. Two consumer processes (dist/src/main.js) with ack_wait shorter than the
//      slow events' work and msg.working() off: JetStream redelivers the slow
//      events while the first attempt still runs, the copies find the key
//      IN_PROGRESS (the heartbeat keeps the lease) and are nak'ed; duplicates
//      published with other msg ids are replayed; a duplicate with the same
//      Nats-Msg-Id is dropped by JetStream itself; the same event id with
//      another body is term'ed. Every event's ledger row exactly once, every
//      replay identical to the row.
//   2. msg.working() on: no redelivery at all.
//   3. A worker whose lease runs out (1 s, no heartbeat) while it stalls;
//      another takes the key over (fencing token 2) and completes; the late
//      one's ledger write is rejected by the fencing guard and its Complete
//      refused (FAILED_PRECONDITION: LeaseNotCurrent); it never acks.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { connect, type JetStreamClient, type JetStreamManager, type NatsConnection } from "nats";
import { Pool } from "pg";
import { IdempotencyClient, type Lease } from "idempotency-client";
import { startServer, type RunningServer } from "idempotency-client/dist/src/testing";
import { ensureLedger, type Receipt } from "../src/ledger";
import { ensureConsumer, ensureStream } from "../src/jetstream";
import { adminQuery, ConsumerProcess, NATS_URL, POSTGRES, program, waitFor } from "./support";
import { checkSettings, eventFingerprint, eventKey, runWorker, type ConsumerSettings, type OrderEvent, type Report } from "../src/consumer";

const NAMESPACE = "orders-ledger";
const RETENTION_MS = 10 * 60 * 1000;

let server: RunningServer;
let client: IdempotencyClient;
let nc: NatsConnection;
let jsm: JetStreamManager;
let js: JetStreamClient;
let pool: Pool;
let ledgerDb: string;
let stream: string;

async function addConsumer(name: string, subject: string, ackWaitMs: number, maxDeliver: number): Promise<void> {
  await ensureConsumer(jsm, stream, { durable: name, filterSubject: `${stream}.${subject}`, ackWaitMs, maxDeliver });
}

/** Every message of the consumer acked or term'ed, none waiting. */
async function drained(consumer: string): Promise<boolean> {
  const info = await jsm.consumers.info(stream, consumer);
  return info.num_pending === 0 && info.num_ack_pending === 0;
}

async function publish(subject: string, event: OrderEvent, msgID?: string) {
  return js.publish(`${stream}.${subject}`, Buffer.from(JSON.stringify(event)), msgID ? { msgID } : undefined);
}

interface LedgerRow extends Receipt {
  event_key: string;
}

async function ledgerRows(): Promise<Map<string, LedgerRow>> {
  const result = await pool.query(
    "SELECT event_key, event_id, account, amount_cents::text, fencing::text, applied_by FROM ledger ORDER BY event_id",
  );
  const rows = new Map<string, LedgerRow>();
  for (const row of result.rows) {
    assert.ok(!rows.has(row.event_id), `two ledger rows for ${row.event_id}`);
    rows.set(row.event_id, { ...row, amount_cents: Number(row.amount_cents) });
  }
  return rows;
}

function receiptOf(row: LedgerRow): Receipt {
  const { event_key: _key, ...receipt } = row;
  return receipt;
}

/** What the service replays for the event now: a new Claim must find it COMPLETED with this receipt. */
async function replayed(event: OrderEvent): Promise<Receipt> {
  const claim = await client.claim(NAMESPACE, eventKey(event.event_id), { fingerprint: eventFingerprint(event) });
  assert.equal(claim.outcome, "COMPLETED", `${event.event_id}: a new Claim should replay`);
  return JSON.parse((claim as { response: Buffer }).response.toString("utf8"));
}

function settings(worker: string, overrides: Partial<ConsumerSettings> = {}): ConsumerSettings {
  return {
    namespace: NAMESPACE,
    worker,
    leaseTtlMs: 3_000,
    retentionMs: RETENTION_MS,
    ackWaitMs: 1_500,
    nakBackoffMs: [300, 1_000],
    ...overrides,
  };
}

before(async () => {
  server = await startServer();
  client = new IdempotencyClient(server.target);
  const suffix = randomBytes(6).toString("hex");
  ledgerDb = `nats_example_${suffix}`;
  await adminQuery(`CREATE DATABASE ${ledgerDb}`);
  pool = new Pool({ connectionString: `${POSTGRES}/${ledgerDb}`, max: 4 });
  await ensureLedger(pool);
  nc = await connect({ servers: NATS_URL, name: "nats-typescript-example-test" });
  jsm = await nc.jetstreamManager();
  js = nc.jetstream();
  stream = `IDEMPOTENCY_EXAMPLE_${suffix.toUpperCase()}`;
  await ensureStream(jsm, { name: stream, subjects: [`${stream}.>`], duplicateWindowMs: 120_000 });
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
  if (jsm) await attempt(() => jsm.streams.delete(stream));
  if (jsm) await attempt(() => jsm.streams.delete(`${stream}_DEADLETTER`)); // made by setup.js
  if (nc) await attempt(() => nc.close());
  if (pool) await attempt(() => pool.end());
  if (ledgerDb) await attempt(() => adminQuery(`DROP DATABASE IF EXISTS ${ledgerDb} WITH (FORCE)`));
  if (client) client.close();
  if (server) await attempt(() => server.stop());
  if (errors.length > 0) throw errors[0];
});

test("checkSettings: retention against the duplicate window and the redelivery span", () => {
  const jsSettings = { ackWaitMs: 30_000, maxDeliver: 10, duplicateWindowMs: 120_000, maxAgeMs: 0 };
  assert.deepEqual(checkSettings(jsSettings, { leaseTtlMs: 30_000, retentionMs: 24 * 3600_000 }), []);
  assert.match(checkSettings(jsSettings, { leaseTtlMs: 30_000, retentionMs: 60_000 }).join("\n"), /duplicate_window/);
  assert.match(
    checkSettings({ ...jsSettings, backoffMs: [1_000, 60_000, 600_000] }, { leaseTtlMs: 30_000, retentionMs: 3600_000 }).join("\n"),
    /redelivery span .* 6817000 ms/, // 4861 s of ack waits and backoff, 1956 s of naks
  );
  assert.match(
    checkSettings({ ...jsSettings, maxDeliver: -1, maxAgeMs: 7 * 24 * 3600_000 }, { leaseTtlMs: 30_000, retentionMs: 24 * 3600_000 }).join("\n"),
    /max_age/,
  );
});

/** One line per delivery, for the test's output: "w1 seq 21 delivery 2: in-progress (nak 1000 ms)". */
function describe(r: Report): string {
  const extra = r.outcome === "in-progress" ? ` (nak ${r.nak_delay_ms} ms)` : r.fencing ? ` (fencing ${r.fencing}${r.cause ? `, ${r.cause}` : ""})` : "";
  return `${r.worker} seq ${r.stream_seq} delivery ${r.delivery}: ${r.outcome}${extra}`;
}

test("redelivered while the first attempt works: IN_PROGRESS, then one effect per event and identical replays", async (t) => {
  const ACK_WAIT_MS = 2_000;
  const SLOW_MS = 5_000; // 2.5 x ack_wait: JetStream redelivers twice meanwhile
  // The consumer as the README creates it: with setup.js.
  const setup = await program("setup", [], {
    STREAM: stream,
    SUBJECTS: `${stream}.>`,
    CONSUMER: "orders",
    FILTER_SUBJECT: `${stream}.orders`,
    ACK_WAIT_MS: String(ACK_WAIT_MS),
    MAX_DELIVER: "30",
  });
  assert.match(setup, /consumer orders: ack_wait 2000 ms, max_deliver 30/);

  const events: OrderEvent[] = [];
  for (let i = 1; i <= 22; i++) {
    const id = `evt-${String(i).padStart(2, "0")}`;
    events.push({ event_id: id, account: `acct-${i % 3}`, amount_cents: 100 * i, work_ms: i > 20 ? SLOW_MS : 20 });
  }
  const byId = new Map(events.map((e) => [e.event_id, e]));
  const slow = events.filter((e) => e.work_ms === SLOW_MS).map((e) => e.event_id);

  const env = {
    STREAM: stream,
    CONSUMER: "orders",
    IDEMPOTENCY_TARGET: server.target,
    LEDGER_DATABASE_URL: `${POSTGRES}/${ledgerDb}`,
    NAMESPACE,
    CONCURRENCY: "3",
    LEASE_MS: "3000",
    RETENTION_MS: String(RETENTION_MS),
    TOUCH_MESSAGE: "0", // let ack_wait run out while the slow events are worked on
    NAK_BACKOFF_MS: "300,1000", // an in-progress copy comes back within 1 s
  };
  const consumers = [new ConsumerProcess("w1", env), new ConsumerProcess("w2", env)];
  const logs = () => consumers.map((c) => c.log()).join("\n");
  try {
    await Promise.all(consumers.map((c) => c.waitReady()));

    // Each event once, then duplicates: two events again (new stream messages:
    // JetStream cannot know, the service replays), one slow event again while it
    // runs, and one with the same Nats-Msg-Id (JetStream's duplicate window drops it).
    let stored = 0;
    for (const event of events) {
      const ack = await publish("orders", event, event.event_id === "evt-05" ? "msg-evt-05" : undefined);
      assert.equal(ack.duplicate, false);
      stored++;
    }
    for (const id of ["evt-03", "evt-07", slow[0]]) {
      await publish("orders", byId.get(id)!);
      stored++;
    }
    const again = await publish("orders", byId.get("evt-05")!, "msg-evt-05");
    assert.equal(again.duplicate, true, "the same Nats-Msg-Id within the duplicate window is not stored twice");
    assert.equal((await jsm.streams.info(stream)).state.messages, stored);

    const all = () => consumers.flatMap((c) => c.reports);
    await waitFor(
      "every event completed and the consumer drained",
      async () => events.every((e) => all().some((r) => r.event_id === e.event_id && r.outcome === "completed")) && (await drained("orders")),
      60_000,
      logs,
    );

    // The same event id with another body: term'ed, the first body's effect stands.
    // Published as the README does it, with publish.js.
    const published = JSON.parse(await program("publish", [`${stream}.orders`, "evt-09", "acct-0", "999999", "20"]));
    assert.deepEqual(published, { stream, seq: stored + 1, duplicate: false });
    await waitFor("the changed evt-09 term'ed", async () => all().some((r) => r.outcome === "mismatch") && (await drained("orders")), 20_000, logs);

    for (const c of consumers) assert.equal(await c.stop(), 0, `${c.worker} exits 0 on SIGTERM\n${c.log()}`);
    const reports = all();
    const unexpected = reports.filter((r) => !["completed", "replayed", "in-progress", "mismatch"].includes(r.outcome));
    assert.deepEqual(unexpected, [], "no failed or lost attempts");

    const rows = await ledgerRows();
    assert.deepEqual([...rows.keys()], events.map((e) => e.event_id), "one ledger row per event, no other");
    for (const event of events) {
      const row = rows.get(event.event_id)!;
      const mine = reports.filter((r) => r.event_id === event.event_id);
      const completed = mine.filter((r) => r.outcome === "completed");
      assert.equal(completed.length, 1, `${event.event_id}: completed once`);
      assert.equal(mine.filter((r) => r.effect?.applied).length, 1, `${event.event_id}: the effect was written once`);
      assert.deepEqual(
        { key: row.event_key, account: row.account, amount: row.amount_cents, fencing: row.fencing },
        { key: eventKey(event.event_id), account: event.account, amount: event.amount_cents, fencing: "1" },
        `${event.event_id}: the row holds the event, written under the first lease (no takeover)`,
      );
      for (const r of mine.filter((r) => r.receipt)) {
        assert.deepEqual(r.receipt, receiptOf(row), `${event.event_id}: delivery ${r.delivery} of seq ${r.stream_seq}`);
      }
      assert.deepEqual(await replayed(event), receiptOf(row));
    }
    // Each duplicate stream message was answered by a replay.
    for (const id of ["evt-03", "evt-07", slow[0]]) {
      assert.ok(reports.some((r) => r.event_id === id && r.outcome === "replayed"), `${id}: the duplicate was replayed`);
    }
    // The slow events: JetStream redelivered them while the first attempt still
    // ran; the redelivery found the key IN_PROGRESS (the heartbeat kept the
    // lease, so the row's fencing token is still 1) and was nak'ed.
    for (const id of slow) {
      const order = reports.filter((r) => r.event_id === id).sort((a, b) => a.ended_at - b.ended_at);
      t.diagnostic(`${id}: ${order.map(describe).join("; ")}`);
      const first = reports.find((r) => r.event_id === id && r.outcome === "completed")!;
      const overlapping = reports.filter(
        (r) => r.event_id === id && r.outcome === "in-progress" && r.stream_seq === first.stream_seq && r.delivery > 1,
      );
      assert.ok(overlapping.length >= 1, `${id}: a redelivery of the same message found it IN_PROGRESS`);
      for (const r of overlapping) {
        assert.ok(r.started_at >= first.started_at && r.ended_at <= first.ended_at, `${id}: while the first attempt ran`);
        assert.ok(r.nak_delay_ms! >= 100 && r.nak_delay_ms! <= 1_000, `${id}: nak'ed with a delay`);
      }
    }
    const mismatch = reports.filter((r) => r.outcome === "mismatch");
    assert.equal(mismatch.length, 1);
    assert.equal(mismatch[0].event_id, "evt-09");
    assert.equal(rows.get("evt-09")!.amount_cents, 900);
  } finally {
    for (const c of consumers) c.kill();
  }
});

test("msg.working() with each heartbeat: JetStream does not redeliver work longer than ack_wait", async () => {
  const ACK_WAIT_MS = 1_500;
  await addConsumer("touch", "touch", ACK_WAIT_MS, 10);
  const event: OrderEvent = { event_id: "touch-1", account: "acct-t", amount_cents: 4200, work_ms: 3 * ACK_WAIT_MS };
  const reports: Report[] = [];
  const consumer = await js.consumers.get(stream, "touch");
  const worker = runWorker(consumer, { client, pool, settings: settings("toucher", { ackWaitMs: ACK_WAIT_MS }) }, {
    concurrency: 2, // a second loop would pull a redelivery, if there were one
    onReport: (r) => reports.push(r),
  });
  try {
    await publish("touch", event);
    await waitFor("touch-1 completed and drained", async () => reports.length > 0 && (await drained("touch")), 20_000);
  } finally {
    await worker.stop();
  }
  assert.deepEqual(reports.map((r) => [r.outcome, r.delivery, r.fencing]), [["completed", 1, "1"]]);
  assert.ok(reports[0].ended_at - reports[0].started_at >= 3 * ACK_WAIT_MS);
  assert.equal((await jsm.consumers.info(stream, "touch")).num_redelivered, 0);
  const row = (await ledgerRows()).get("touch-1")!;
  assert.deepEqual(await replayed(event), receiptOf(row));
});

test("a late attempt whose lease ran out: its write is fenced out and its Complete refused", async (t) => {
  const ACK_WAIT_MS = 1_500;
  await addConsumer("late", "late", ACK_WAIT_MS, 10);
  const consumer = await js.consumers.get(stream, "late");
  const event: OrderEvent = { event_id: "late-1", account: "acct-l", amount_cents: 777, work_ms: 0 };
  const key = eventKey(event.event_id);
  const reports: Report[] = [];
  let claimedByA: Lease | undefined;

  // A: a 1 s lease and no heartbeat, and work that stalls (a long GC pause, a
  // hung downstream call) until the key has been completed by someone else.
  const stalled = async () => {
    await waitFor("B to complete late-1", async () => (await client.get(NAMESPACE, key)).state === "COMPLETED", 30_000);
  };
  const workerA = runWorker(
    consumer,
    {
      client,
      pool,
      settings: settings("A", { leaseTtlMs: 1_000, heartbeat: false, touchMessage: false, ackWaitMs: ACK_WAIT_MS }),
      work: stalled,
      onClaimed: (_event, lease) => (claimedByA ??= lease),
    },
    { onReport: (r) => reports.push(r) },
  );
  let workerB: ReturnType<typeof runWorker> | undefined;
  try {
    await publish("late", event);
    await waitFor("A to claim late-1", () => claimedByA !== undefined, 10_000);
    // B: the ordinary settings. It gets the redelivery once ack_wait (1.5 s) ran
    // out, after A's lease (1 s) did: it takes the key over, fencing token 2.
    workerB = runWorker(consumer, { client, pool, settings: settings("B", { ackWaitMs: ACK_WAIT_MS }) }, {
      onReport: (r) => reports.push(r),
    });
    await waitFor("A's late attempt to end", () => reports.some((r) => r.worker === "A" && r.outcome !== "replayed"), 30_000, () =>
      JSON.stringify(reports, null, 1),
    );
    await waitFor("the late consumer drained", () => drained("late"), 20_000);
  } finally {
    await Promise.all([workerA.stop(), workerB?.stop()]);
  }

  for (const r of [...reports].sort((a, b) => a.ended_at - b.ended_at)) t.diagnostic(describe(r));
  assert.equal(claimedByA!.fencingToken, 1n);
  const late = reports.find((r) => r.worker === "A" && r.outcome !== "replayed")!;
  assert.equal(late.outcome, "lease-lost", JSON.stringify(late));
  assert.equal(late.fencing, "1");
  assert.deepEqual(late.effect, { applied: false, row_fencing: "2" }, "A's write was rejected by the fencing guard");
  assert.equal(late.cause, "LeaseNotCurrent", "A's Complete was refused with FAILED_PRECONDITION");
  assert.equal(late.receipt, undefined, "A acked nothing");

  const taken = reports.filter((r) => r.worker === "B" && r.outcome === "completed");
  assert.equal(taken.length, 1, JSON.stringify(reports));
  assert.equal(taken[0].fencing, "2");
  assert.deepEqual(taken[0].effect, { applied: true, row_fencing: "2" });
  assert.ok(reports.every((r) => r.outcome !== "completed" || r.worker === "B"), "only B completed");

  const row = (await ledgerRows()).get("late-1")!;
  assert.deepEqual(
    { fencing: row.fencing, applied_by: row.applied_by, amount: row.amount_cents },
    { fencing: "2", applied_by: "B", amount: 777 },
  );
  assert.deepEqual(taken[0].receipt, receiptOf(row));
  assert.deepEqual(await replayed(event), receiptOf(row));
  // And the service itself: A's lease token is no longer the key's.
  await assert.rejects(client.complete(NAMESPACE, key, claimedByA!.leaseToken, "{}"), { name: "LeaseNotCurrent" });
});
