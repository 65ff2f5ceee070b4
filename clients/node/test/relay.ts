// A gRPC relay that makes a server look as if it predated ClaimRequest.wait:
// it forwards every call to the real server unchanged (bytes in, bytes out,
// with the caller's metadata and deadline), except that it clears the `wait`
// field of each Claim, so the field never takes effect and the server, not
// asked to wait, leaves ClaimResponse.waited unset: exactly what a server
// built before the field does. CI has no old server binary; this relay stands
// in for one in the tests of the helpers' fallback to polling.
import { join } from "node:path";
import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";

const SERVICE = "idempotency.v1.IdempotencyService";
const identity = (value: Buffer) => value;

export interface WaitClearingRelay {
  /** Where to point the client. */
  target: string;
  /** Claims relayed. */
  claims: number;
  /** Claims that carried a wait (cleared on the way). */
  claimsAskingToWait: number;
  close(): Promise<void>;
}

export async function startWaitClearingRelay(upstream: string): Promise<WaitClearingRelay> {
  // dist/test/relay.js -> <package>/proto, where scripts/generate.mjs copies it.
  const definition = protoLoader.loadSync("idempotency/v1/idempotency.proto", {
    keepCase: false,
    longs: String,
    enums: String,
    defaults: false,
    oneofs: true,
    includeDirs: [join(__dirname, "..", "..", "proto")],
  });
  const service = definition[SERVICE] as grpc.ServiceDefinition;
  const claim = service.Claim;
  const client = new grpc.Client(upstream, grpc.credentials.createInsecure());
  const server = new grpc.Server();
  const relay: WaitClearingRelay = {
    target: "",
    claims: 0,
    claimsAskingToWait: 0,
    close: () =>
      new Promise((resolve) => {
        client.close();
        server.tryShutdown(() => resolve());
      }),
  };

  const raw: Record<string, grpc.MethodDefinition<Buffer, Buffer>> = {};
  const handlers: grpc.UntypedServiceImplementation = {};
  for (const [name, method] of Object.entries(service)) {
    raw[name] = {
      ...method,
      requestSerialize: identity,
      requestDeserialize: identity,
      responseSerialize: identity,
      responseDeserialize: identity,
    };
    handlers[name] = (call: grpc.ServerUnaryCall<Buffer, Buffer>, callback: grpc.sendUnaryData<Buffer>) => {
      let request = call.request;
      if (name === "Claim") {
        const message = claim.requestDeserialize(request) as Record<string, unknown>;
        relay.claims++;
        if (message.wait) relay.claimsAskingToWait++;
        delete message.wait;
        request = claim.requestSerialize(message);
      }
      client.makeUnaryRequest(
        method.path,
        identity,
        identity,
        request,
        call.metadata.clone(),
        { deadline: call.getDeadline() },
        (error, response) => (error ? callback(error) : callback(null, response)),
      );
    };
  }
  server.addService(raw as grpc.ServiceDefinition, handlers);
  const port = await new Promise<number>((resolve, reject) =>
    server.bindAsync("127.0.0.1:0", grpc.ServerCredentials.createInsecure(), (error, bound) =>
      error ? reject(error) : resolve(bound),
    ),
  );
  relay.target = `127.0.0.1:${port}`;
  return relay;
}
