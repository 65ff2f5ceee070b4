// IdempotencyClient: the five RPCs over @grpc/grpc-js, with typed results and
// typed errors, and once() built on them.
import { join } from "node:path";
import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";
import type { ProtoGrpcType } from "./generated/idempotency";
import type { IdempotencyServiceClient } from "./generated/idempotency/v1/IdempotencyService";
import { fromServiceError } from "./errors";
import { runOnce, type OnceOptions, type OnceResult, type Lease } from "./once";
import {
  claimResult,
  keyRecord,
  toDate,
  toDuration,
  type ClaimResult,
  type CompleteResult,
  type ExtendLeaseResult,
  type KeyRecord,
} from "./types";

/** Each call's deadline unless the client or the call sets another. */
export const DEFAULT_TIMEOUT_MS = 10_000;

export interface Logger {
  warn(message: string): void;
}

export interface ClientOptions {
  /** TLS and the like; plaintext when omitted. */
  credentials?: grpc.ChannelCredentials;
  /** Each call's deadline, in milliseconds (default 10 s). */
  timeoutMs?: number;
  channelOptions?: grpc.ChannelOptions;
  /** Where once() reports what it cannot throw (a failed heartbeat, a failed Release). Default: console. */
  logger?: Logger;
}

export interface CallOptions {
  timeoutMs?: number;
}

export interface ClaimOptions extends CallOptions {
  /** The payload's fingerprint (e.g. fingerprint(body)); empty or omitted: don't check. */
  fingerprint?: Uint8Array;
  /** The lease's length if this Claim wins; the server's default when omitted. */
  leaseTtlMs?: number;
  /** How long a completed result is kept and replayed; the server's default when omitted. */
  retentionMs?: number;
}

export interface CompleteOptions extends CallOptions {
  retentionMs?: number;
}

export interface ExtendLeaseOptions extends CallOptions {
  leaseTtlMs?: number;
}

// The loader options must match the flags scripts/generate.mjs passes to
// proto-loader-gen-types, or the generated types lie about the values.
const LOADER_OPTIONS: protoLoader.Options = {
  keepCase: false,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
};

let service: ProtoGrpcType["idempotency"]["v1"]["IdempotencyService"] | undefined;

function serviceConstructor() {
  if (!service) {
    // dist/src/client.js -> <package>/proto, copied there by scripts/generate.mjs
    const protoRoot = join(__dirname, "..", "..", "proto");
    const definition = protoLoader.loadSync("idempotency/v1/idempotency.proto", {
      ...LOADER_OPTIONS,
      includeDirs: [protoRoot],
    });
    const loaded = grpc.loadPackageDefinition(definition) as unknown as ProtoGrpcType;
    service = loaded.idempotency.v1.IdempotencyService;
  }
  return service;
}

/**
 * A client of idempotency-service.
 *
 *     const client = new IdempotencyClient("127.0.0.1:50051");
 *
 * Failed calls reject with the classes in errors.ts, never with a bare grpc ServiceError.
 */
export class IdempotencyClient {
  private readonly stub: IdempotencyServiceClient;
  readonly timeoutMs: number;
  readonly logger: Logger;

  constructor(target: string, options: ClientOptions = {}) {
    const Service = serviceConstructor();
    this.stub = new Service(
      target,
      options.credentials ?? grpc.credentials.createInsecure(),
      options.channelOptions,
    );
    this.timeoutMs = options.timeoutMs ?? DEFAULT_TIMEOUT_MS;
    this.logger = options.logger ?? console;
  }

  close(): void {
    this.stub.close();
  }

  private call<Req, Res>(name: string, request: Req, options: CallOptions | undefined): Promise<Res> {
    const deadline = new Date(Date.now() + (options?.timeoutMs ?? this.timeoutMs));
    return new Promise((resolve, reject) => {
      const method = (this.stub as unknown as Record<string, Function>)[name];
      method.call(this.stub, request, { deadline }, (error: grpc.ServiceError | null, response: Res) => {
        if (error) reject(fromServiceError(error, name));
        else resolve(response);
      });
    });
  }

  /** Try to take the lease on a key. Losing a race is outcome IN_PROGRESS, not an error. */
  async claim(namespace: string, key: string, options: ClaimOptions = {}): Promise<ClaimResult> {
    const response = await this.call("Claim", {
      namespace,
      key,
      fingerprint: bytes(options.fingerprint ?? Buffer.alloc(0), "fingerprint"),
      leaseTtl: toDuration(options.leaseTtlMs, "leaseTtlMs"),
      retention: toDuration(options.retentionMs, "retentionMs"),
    }, options);
    return claimResult(response as never);
  }

  /** Store the work's result; later Claims replay it. Safe to retry with the same token. */
  async complete(
    namespace: string,
    key: string,
    leaseToken: string,
    response: Uint8Array | string = Buffer.alloc(0),
    options: CompleteOptions = {},
  ): Promise<CompleteResult> {
    const body = typeof response === "string" ? Buffer.from(response, "utf8") : bytes(response, "response");
    const reply = await this.call<unknown, { expiresAt: never }>("Complete", {
      namespace,
      key,
      leaseToken,
      response: body,
      retention: toDuration(options.retentionMs, "retentionMs"),
    }, options);
    return { expiresAt: toDate(reply.expiresAt)! };
  }

  /** Give a failed attempt back: the key is claimable again at once. */
  async release(namespace: string, key: string, leaseToken: string, options: CallOptions = {}): Promise<void> {
    await this.call("Release", { namespace, key, leaseToken }, options);
  }

  /** Keep a long piece of work's lease alive: it now ends leaseTtlMs from now. */
  async extendLease(
    namespace: string,
    key: string,
    leaseToken: string,
    options: ExtendLeaseOptions = {},
  ): Promise<ExtendLeaseResult> {
    const reply = await this.call<unknown, { leaseExpiresAt: never }>("ExtendLease", {
      namespace,
      key,
      leaseToken,
      leaseTtl: toDuration(options.leaseTtlMs, "leaseTtlMs"),
    }, options);
    return { leaseExpiresAt: toDate(reply.leaseExpiresAt)! };
  }

  /** Inspect a key's record without changing it. */
  async get(namespace: string, key: string, options: CallOptions = {}): Promise<KeyRecord> {
    return keyRecord(await this.call("Get", { namespace, key }, options));
  }

  /**
   * Run `work` once per key and return its result, or the stored result of the
   * run that did it (the replay); see once.ts for the lifecycle.
   *
   *     const receipt = await client.once("payments", deriveKey("stripe", event.id),
   *       () => charge(event), { fingerprint: fingerprint(rawBody) });
   */
  async once<T>(
    namespace: string,
    key: string,
    work: (lease: Lease) => T | Promise<T>,
    options: OnceOptions<T> = {},
  ): Promise<T> {
    return (await runOnce(this, namespace, key, work, options)).value;
  }

  /** As once(), and also tells whether the result was replayed, and the Claim behind it. */
  onceWithDetails<T>(
    namespace: string,
    key: string,
    work: (lease: Lease) => T | Promise<T>,
    options: OnceOptions<T> = {},
  ): Promise<OnceResult<T>> {
    return runOnce(this, namespace, key, work, options);
  }
}

function bytes(value: unknown, field: string): Buffer {
  if (value instanceof Uint8Array) return Buffer.from(value);
  throw new TypeError(`${field} must be bytes (a Buffer or Uint8Array), got ${typeof value}`);
}
