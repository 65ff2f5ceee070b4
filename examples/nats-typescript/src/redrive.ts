// List the messages parked in the dead-letter stream, and re-drive them.
//
//   node dist/src/redrive.js                      list, one JSON line each
//   node dist/src/redrive.js max_deliveries       re-drive those that ran out of deliveries
//   node dist/src/redrive.js all                  re-drive every parked message
//
//   NATS_URL            default nats://127.0.0.1:4222
//   STREAM              default ORDERS
//   DEAD_LETTER_STREAM  default <STREAM>_DEADLETTER
//
// Each re-driven copy carries a Nats-Msg-Id derived from the parked message
// (deadletter.ts, redriveMsgId): a re-drive that dies after publishing and is
// run again within the stream's duplicate_window (2 min) does not publish the
// message twice.
//
// Re-drive after the cause is fixed (the ledger is back). A term()ed message
// (an unreadable body, another body under a completed event id) is term()ed
// again when re-driven unchanged: read it, fix it at its source.
import { connect } from "nats";
import { parkedMessages, redrive } from "./deadletter";

async function main(): Promise<void> {
  const which = process.argv[2];
  if (which !== undefined && which !== "max_deliveries" && which !== "all") {
    throw new Error("usage: redrive.js [max_deliveries | all]");
  }
  const stream = process.env.STREAM || "ORDERS";
  const deadLetters = process.env.DEAD_LETTER_STREAM || `${stream}_DEADLETTER`;
  const nc = await connect({ servers: process.env.NATS_URL || "nats://127.0.0.1:4222" });
  try {
    const jsm = await nc.jetstreamManager();
    const js = nc.jetstream();
    for (const parked of await parkedMessages(jsm, deadLetters)) {
      if (parked.stream !== stream) continue;
      const { message, ...line } = parked;
      const shown = { ...line, subject: message?.subject, body: message?.data.toString("utf8") };
      if (which === "all" || which === parked.reason) {
        const seq = await redrive(js, jsm, deadLetters, parked, () => {
          // Test hook: die (kill -9) after the publish, before the advisory is removed.
          if (process.env.REDRIVE_TEST_KILL_AFTER_PUBLISH === "1") process.kill(process.pid, "SIGKILL");
        });
        console.log(JSON.stringify({ ...shown, redriven_as: seq }));
      } else {
        console.log(JSON.stringify(shown));
      }
    }
  } finally {
    await nc.close();
  }
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
