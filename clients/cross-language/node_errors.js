// The Node half of the error-details conformance test: make each call it is
// given with the stock libraries, @grpc/grpc-js (the service loaded with
// @grpc/proto-loader from the client's proto/) and protobufjs for the
// google.rpc messages of the `grpc-status-details-bin` trailer, and again
// through the TypeScript client (retries off) to see its typed error; print
// what came back as one JSON line.
//
//   node node_errors.js '[{"target": "...", "token": "...", "method": "Complete",
//                          "request": {"namespace": "...", "key": "...", "leaseToken": "..."},
//                          "timeoutMs": 10000, "repeat": 1}, ...]'
//
// For each case: {"status": {code, message, reason, domain, metadata,
// retryDelayMs, fieldViolations}, "helper": {name, code, reason, domain,
// metadata, retryDelayMs, field}}. `repeat` makes the call up to that many
// times until one fails (a rate limit whose bucket is not empty yet).
"use strict";
const path = require("node:path");
const { createRequire } = require("node:module");
// The packages the Node client installed (clients/node/node_modules).
const fromClient = createRequire(path.join(__dirname, "..", "node", "package.json"));
const grpc = fromClient("@grpc/grpc-js");
const protoLoader = fromClient("@grpc/proto-loader");
const protobuf = fromClient("protobufjs");
const { IdempotencyClient } = require("../node/dist/src");

const PROTO_ROOT = path.join(__dirname, "..", "node", "proto");

const definition = protoLoader.loadSync("idempotency/v1/idempotency.proto", {
  keepCase: false,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
  includeDirs: [PROTO_ROOT],
});
const Service = grpc.loadPackageDefinition(definition).idempotency.v1.IdempotencyService;

const rpc = protobuf.loadSync([
  path.join(PROTO_ROOT, "google", "rpc", "status.proto"),
  path.join(PROTO_ROOT, "google", "rpc", "error_details.proto"),
]);
const Status = rpc.lookupType("google.rpc.Status");
const DETAIL_TYPES = {
  "google.rpc.ErrorInfo": rpc.lookupType("google.rpc.ErrorInfo"),
  "google.rpc.RetryInfo": rpc.lookupType("google.rpc.RetryInfo"),
  "google.rpc.BadRequest": rpc.lookupType("google.rpc.BadRequest"),
};
const OBJECT = { longs: String, enums: String, defaults: true };

/** The google.rpc.Status of a ServiceError, decoded, in the shape the Python side reports too. */
function decodeStatus(error) {
  const out = {
    code: grpc.status[error.code],
    message: error.details,
    reason: null,
    domain: null,
    metadata: {},
    retryDelayMs: null,
    fieldViolations: null,
    detailsCode: null,
    detailTypes: [],
  };
  const raw = error.metadata.get("grpc-status-details-bin");
  if (raw.length === 0) return out;
  const status = Status.toObject(Status.decode(raw[0]), OBJECT);
  out.detailsCode = grpc.status[status.code];
  for (const any of status.details) {
    const name = any.type_url.slice(any.type_url.lastIndexOf("/") + 1);
    out.detailTypes.push(name);
    const type = DETAIL_TYPES[name];
    if (!type) continue;
    const detail = type.toObject(type.decode(any.value), OBJECT);
    if (name === "google.rpc.ErrorInfo") {
      out.reason = detail.reason;
      out.domain = detail.domain;
      out.metadata = detail.metadata;
    } else if (name === "google.rpc.RetryInfo") {
      out.retryDelayMs = Number(detail.retryDelay.seconds) * 1000 + detail.retryDelay.nanos / 1e6;
    } else {
      out.fieldViolations = detail.fieldViolations.map((v) => [v.field, v.description]);
    }
  }
  return out;
}

function rawCall(stub, c) {
  const metadata = new grpc.Metadata();
  if (c.token) metadata.set("authorization", `Bearer ${c.token}`);
  return new Promise((resolve) => {
    stub[c.method](c.request, metadata, { deadline: new Date(Date.now() + (c.timeoutMs ?? 10_000)) }, (error) =>
      resolve(error ?? null),
    );
  });
}

/** The same call through the TypeScript client, retries off. */
function helperCall(client, c) {
  const r = c.request;
  switch (c.method) {
    case "Claim":
      return client.claim(r.namespace, r.key, { leaseToken: r.leaseToken });
    case "Complete":
      return client.complete(r.namespace, r.key, r.leaseToken, Buffer.alloc(0));
    case "Release":
      return client.release(r.namespace, r.key, r.leaseToken);
    case "ExtendLease":
      return client.extendLease(r.namespace, r.key, r.leaseToken);
    case "Get":
      return client.get(r.namespace, r.key);
    default:
      throw new Error(`node_errors: no helper call for ${c.method}`);
  }
}

async function one(c) {
  const stub = new Service(c.target, grpc.credentials.createInsecure());
  const client = new IdempotencyClient(c.target, { token: c.token, retry: false, timeoutMs: c.timeoutMs ?? 10_000 });
  try {
    let error = null;
    for (let i = 0; i < (c.repeat ?? 1) && !error; i++) error = await rawCall(stub, c);
    if (!error) return { error: `${c.method} succeeded` };
    let helper = null;
    for (let i = 0; i < (c.repeat ?? 1) && !helper; i++) {
      try {
        await helperCall(client, c);
      } catch (e) {
        helper = {
          name: e.name,
          code: grpc.status[e.code],
          reason: e.reason ?? null,
          domain: e.domain ?? null,
          metadata: e.metadata,
          retryDelayMs: e.retryDelayMs ?? null,
          field: e.field ?? null,
        };
      }
    }
    return { status: decodeStatus(error), helper: helper ?? { error: `${c.method} succeeded` } };
  } finally {
    stub.close();
    client.close();
  }
}

async function main() {
  const cases = JSON.parse(process.argv[2]);
  const results = [];
  for (const c of cases) results.push(await one(c));
  return results;
}

main().then(
  (results) => process.stdout.write(JSON.stringify(results) + "\n"),
  (error) => {
    console.error(error);
    process.exit(2);
  },
);
