// IdempotencyClient: the RPCs over @grpc/grpc-js, with typed results and
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
  completeItemResult,
  keyRecord,
  purgeResult,
  toDate,
  toDuration,
  type ClaimItem,
  type ClaimResult,
  type CompleteItem,
  type CompleteItemResult,
  type CompleteResult,
  type ExtendLeaseResult,
  type KeyRecord,
  type PurgeResult,
} from "./types";

/** Each call's deadline unless the client or the call sets another. */
export const DEFAULT_TIMEOUT_MS = 10_000;

export interface Logger {
  warn(message: string): void;
}

/** TLS settings: PEM as Buffers. Omitted roots: the system's (Node's) roots. */
export interface TlsOptions {
  /** The CA certificates that verify the server, instead of the system's roots. */
  rootCerts?: Buffer;
  /** A client certificate (chain) for mutual TLS; needs clientKey. */
  clientCert?: Buffer;
  /** The client certificate's private key; needs clientCert. */
  clientKey?: Buffer;
}

export interface ClientOptions {
  /**
   * A bearer token, sent as `authorization: Bearer <token>` with every call
   * (once()'s and the batch calls' included). Over a plaintext channel it
   * travels in clear: use TLS beyond loopback or a trusted network.
   */
  token?: string;
  /** TLS: `true` verifies the server against the system's roots; an object sets roots and a client certificate. */
  tls?: boolean | TlsOptions;
  /** Any other channel credentials (instead of `tls`); plaintext when neither is given. */
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

export interface PurgeOptions extends CallOptions {
  /** Why, for the server's log (an incident or ticket reference); at most 256 bytes. */
  reason?: string;
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
 *     const client = new IdempotencyClient("idempotency.internal:50051",
 *       { token, tls: { rootCerts: readFileSync("ca.pem") } });
 *
 * Failed calls reject with the classes in errors.ts, never with a bare grpc ServiceError.
 */
export class IdempotencyClient {
  private readonly stub: IdempotencyServiceClient;
  private readonly authorization: string | undefined;
  readonly timeoutMs: number;
  readonly logger: Logger;

  constructor(target: string, options: ClientOptions = {}) {
    this.authorization = bearer(options.token);
    const credentials = channelCredentials(options);
    const Service = serviceConstructor();
    this.stub = new Service(target, credentials, options.channelOptions);
    this.timeoutMs = options.timeoutMs ?? DEFAULT_TIMEOUT_MS;
    this.logger = options.logger ?? console;
  }

  close(): void {
    this.stub.close();
  }

  private call<Req, Res>(name: string, request: Req, options: CallOptions | undefined): Promise<Res> {
    const deadline = new Date(Date.now() + (options?.timeoutMs ?? this.timeoutMs));
    const metadata = new grpc.Metadata();
    if (this.authorization !== undefined) metadata.set("authorization", this.authorization);
    return new Promise((resolve, reject) => {
      const method = (this.stub as unknown as Record<string, Function>)[name];
      method.call(this.stub, request, metadata, { deadline }, (error: grpc.ServiceError | null, response: Res) => {
        if (error) reject(fromServiceError(error, name));
        else resolve(response);
      });
    });
  }

  /** Try to take the lease on a key. Losing a race is outcome IN_PROGRESS, not an error. */
  async claim(namespace: string, key: string, options: ClaimOptions = {}): Promise<ClaimResult> {
    const response = await this.call("Claim", claimRequest({ ...options, namespace, key }), options);
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
    const request = completeRequest({ namespace, key, leaseToken, response, retentionMs: options.retentionMs });
    const reply = await this.call<unknown, { expiresAt: never }>("Complete", request, options);
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
   * Claim many keys in one call: one ClaimResult per item, in order, each what
   * its own claim() would have resolved to. The same key twice is one lease:
   * the first item is CLAIMED, the second IN_PROGRESS. An invalid item rejects
   * the whole call with InvalidArgument naming it ("items[3].key: ..."), as
   * does an empty list or one longer than the server's limit (500 unless configured).
   */
  async claimBatch(items: readonly ClaimItem[], options: CallOptions = {}): Promise<ClaimResult[]> {
    const request = { items: items.map((item, index) => atItem(index, () => claimRequest(item))) };
    const reply = await this.call<unknown, { items: never[] }>("ClaimBatch", request, options);
    return reply.items.map((item) => claimResult(item));
  }

  /**
   * Complete many keys in one call: one result per item, in order, either
   * `{ ok: true, expiresAt }` or `{ ok: false, error }` with the error its own
   * complete() would have rejected with (KeyNotFound, LeaseNotCurrent). A failed
   * item does not reject the call; an invalid item rejects it with InvalidArgument naming it.
   */
  async completeBatch(items: readonly CompleteItem[], options: CallOptions = {}): Promise<CompleteItemResult[]> {
    const request = { items: items.map((item, index) => atItem(index, () => completeRequest(item))) };
    const reply = await this.call<unknown, { items: never[] }>("CompleteBatch", request, options);
    return reply.items.map((item, index) => completeItemResult(item, index));
  }

  /**
   * An operator's action: make a key claimable again at once (its record
   * expires now; a live lease is revoked, so its holder's complete() rejects
   * with KeyNotFound). `reason` goes to the server's log.
   */
  async purge(namespace: string, key: string, options: PurgeOptions = {}): Promise<PurgeResult> {
    const reason = options.reason ?? "";
    if (typeof reason !== "string") throw new TypeError(`reason must be a string, got ${typeof reason}`);
    return purgeResult(await this.call("Purge", { namespace, key, reason }, options));
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

/** The `authorization` metadata value for a token, checked. */
function bearer(token: unknown): string | undefined {
  if (token === undefined) return undefined;
  if (typeof token !== "string") throw new TypeError(`token must be a string, got ${typeof token}`);
  if (!/^[\x21-\x7e]+$/.test(token)) throw new TypeError("token must be non-empty printable ASCII without spaces");
  return `Bearer ${token}`;
}

/** The channel's credentials from `tls` or `credentials`; plaintext when neither is set. */
function channelCredentials(options: ClientOptions): grpc.ChannelCredentials {
  const tls = options.tls;
  if (tls === undefined || tls === false) return options.credentials ?? grpc.credentials.createInsecure();
  if (options.credentials) throw new TypeError("pass either credentials or tls, not both");
  if (tls === true) return grpc.credentials.createSsl();
  if (typeof tls !== "object" || tls === null) throw new TypeError("tls must be a boolean or { rootCerts, clientCert, clientKey }");
  const pem = (value: unknown, field: string): Buffer | null => {
    if (value === undefined || value === null) return null;
    if (!Buffer.isBuffer(value)) throw new TypeError(`tls.${field} must be a Buffer of PEM, got ${typeof value}`);
    return value;
  };
  const rootCerts = pem(tls.rootCerts, "rootCerts");
  const clientCert = pem(tls.clientCert, "clientCert");
  const clientKey = pem(tls.clientKey, "clientKey");
  if ((clientCert === null) !== (clientKey === null)) {
    throw new TypeError("tls.clientCert and tls.clientKey go together (mutual TLS needs both)");
  }
  return grpc.credentials.createSsl(rootCerts, clientKey, clientCert);
}

function claimRequest(item: ClaimItem) {
  return {
    namespace: item.namespace,
    key: item.key,
    fingerprint: bytes(item.fingerprint ?? Buffer.alloc(0), "fingerprint"),
    leaseTtl: toDuration(item.leaseTtlMs, "leaseTtlMs"),
    retention: toDuration(item.retentionMs, "retentionMs"),
  };
}

function completeRequest(item: CompleteItem) {
  const response = item.response ?? Buffer.alloc(0);
  return {
    namespace: item.namespace,
    key: item.key,
    leaseToken: item.leaseToken,
    response: typeof response === "string" ? Buffer.from(response, "utf8") : bytes(response, "response"),
    retention: toDuration(item.retentionMs, "retentionMs"),
  };
}

/** Build one item of a batch request; a TypeError names the item ("items[2].fingerprint ..."). */
function atItem<T>(index: number, build: () => T): T {
  try {
    return build();
  } catch (error) {
    if (error instanceof TypeError) throw new TypeError(`items[${index}].${error.message}`);
    throw error;
  }
}

function bytes(value: unknown, field: string): Buffer {
  if (value instanceof Uint8Array) return Buffer.from(value);
  throw new TypeError(`${field} must be bytes (a Buffer or Uint8Array), got ${typeof value}`);
}
