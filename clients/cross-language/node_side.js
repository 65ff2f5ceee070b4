// The Node half of the cross-language test: derive the key and fingerprint
// from the fields and payload it is given, run once() with a work that returns
// `result`, and print what happened as one JSON line.
//
//   node node_side.js '{"target": "...", "namespace": "...", "fields": [...],
//                       "payload": {...}, "result": {...}, "onInProgress": "throw"}'
"use strict";
const { IdempotencyClient, deriveKey, fingerprint } = require("../node/dist/src");

async function main() {
  const request = JSON.parse(process.argv[2]);
  const client = new IdempotencyClient(request.target);
  const key = deriveKey(...request.fields);
  const fp = fingerprint(request.payload);
  let ran = false;
  try {
    const outcome = await client.onceWithDetails(
      request.namespace,
      key,
      async () => {
        ran = true;
        return request.result;
      },
      { fingerprint: fp, onInProgress: request.onInProgress ?? "wait", waitTimeoutMs: 5000 },
    );
    return { key, fingerprint: fp.toString("hex"), ran, replayed: outcome.replayed, value: outcome.value };
  } catch (error) {
    return { key, fingerprint: fp.toString("hex"), ran, error: error.name, message: error.message };
  } finally {
    client.close();
  }
}

main().then(
  (report) => process.stdout.write(JSON.stringify(report) + "\n"),
  (error) => {
    console.error(error);
    process.exit(2);
  },
);
