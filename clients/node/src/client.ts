// IdempotencyClient: the RPCs over @grpc/grpc-js, with typed results and
// typed errors, and once() built on them.
import { join } from "node:path";
import { randomBytes } from "node:crypto";
import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";
import type { ProtoGrpcType } from "./generated/idempotency";
import type { IdempotencyServiceClient } from "./generated/idempotency/v1/IdempotencyService";
import type {
  BatchOptions,
  CallOptions,
  ClaimOptions,
  CompleteOptions,
  ExtendLeaseOptions,
  LeaseCalls,
  Logger,
  PurgeOptions,
  ReleaseOptions,
  RetryOptions,
} from "./calls";
import { fromServiceError } from "./errors";
import { detailsOf } from "./details";
import { runOnce, type OnceOptions, type OnceResult, type Lease } from "./once";
import { MIN_WAIT_MS, ServerWaits, WAIT_HEADROOM_MS, waitWithin } from "./waiting";
import {
  claimBatchResult,
  claimResult,
  completeItemResult,
  lateRetryValue,
  keyRecord,
  purgeResult,
  toDate,
  toDuration,
  type ClaimBatchResult,
  type ClaimItem,
  type ClaimResult,
  type CompleteItem,
  type CompleteItemResult,
  type CompleteResult,
  type ExtendLeaseResult,
  type KeyRecord,
  type PurgeResult,
} from "./types";

/** Each call's deadline unless the client or the call sets another: the budget of all its attempts. */
export const DEFAULT_TIMEOUT_MS = 10_000;

export type RetryPolicy = Required<Omit<RetryOptions, "perAttemptTimeoutMs">> & { perAttemptTimeoutMs: number | undefined };

export const DEFAULT_RETRY: Readonly<RetryPolicy> = Object.freeze({
  maxAttempts: 10,
  initialBackoffMs: 50,
  maxBackoffMs: 2000,
  multiplier: 2,
  perAttemptTimeoutMs: undefined,
});

/**
 * The codes a call is retried on. Every RPC is safe to repeat: Claim because
 * the client sends the same lease token on every attempt of one claim(), the
 * others as they are. Any other code (INVALID_ARGUMENT, FAILED_PRECONDITION,
 * NOT_FOUND, PERMISSION_DENIED, UNAUTHENTICATED, ...) is final.
 */
export const RETRYABLE_CODES: ReadonlySet<grpc.status> = new Set([
  grpc.status.UNAVAILABLE,
  grpc.status.RESOURCE_EXHAUSTED,
  grpc.status.DEADLINE_EXCEEDED,
]);

/**
 * The pause before the attempt after `attempt` (1 = after the first):
 * uniform in [0, min(maxBackoffMs, initialBackoffMs * multiplier^(attempt-1))].
 */
export function backoffMs(attempt: number, policy: RetryPolicy = DEFAULT_RETRY, random: () => number = Math.random): number {
  const cap = Math.min(policy.maxBackoffMs, policy.initialBackoffMs * policy.multiplier ** Math.max(0, attempt - 1));
  return random() * cap;
}

/** A new lease token for one logical Claim: 128 bits from the CSPRNG, as 32 lowercase hex characters. */
export function newLeaseToken(): string {
  return randomBytes(16).toString("hex");
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
  /** Each call's deadline, in milliseconds (default 10 s): the budget of all its attempts. */
  timeoutMs?: number;
  /** How calls are retried (see RetryOptions; on by default); `false`: every call is tried once. */
  retry?: RetryOptions | false;
  /**
   * grpc-js channel options, over the client's defaults: round_robin balancing
   * (`grpc.service_config`) and reconnect backoff of 100 ms to 1 s
   * (`grpc.initial_reconnect_backoff_ms`, `grpc.max_reconnect_backoff_ms`), so
   * that a replica that comes back is used again soon.
   */
  channelOptions?: grpc.ChannelOptions;
  /** grpc-js client interceptors, run on every attempt of every call (tracing, tests). */
  interceptors?: grpc.Interceptor[];
  /** Where once() reports what it cannot throw (a failed heartbeat, a failed Release). Default: console. */
  logger?: Logger;
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

const DEFAULT_CHANNEL_OPTIONS: grpc.ChannelOptions = {
  // A dns:/// name that resolves to several replicas: spread calls over all of them.
  "grpc.service_config": JSON.stringify({ loadBalancingConfig: [{ round_robin: {} }] }),
  // gRPC's defaults (1 s, doubling to 120 s) would keep a restarted replica
  // out of use for long after it is back; retries want it soon.
  "grpc.initial_reconnect_backoff_ms": 100,
  "grpc.max_reconnect_backoff_ms": 1000,
};

/**
 * The addresses a client connects to: an array, or a comma-separated string
 * ("10.0.0.1:50051,10.0.0.2:50051"), each "host:port" or a gRPC target
 * ("dns:///idempotency.internal:50051", which resolves to every replica). A
 * string with grpc-js's own multi-address schemes (ipv4:, ipv6:, unix:) is
 * one target as it is.
 */
export function parseTargets(target: string | readonly string[]): string[] {
  let targets: string[];
  if (Array.isArray(target)) {
    targets = target.map((t, i) => {
      if (typeof t !== "string") throw new TypeError(`target[${i}] must be a string, got ${typeof t}`);
      return t.trim();
    });
  } else if (typeof target === "string") {
    targets = /^(ipv4|ipv6|unix|unix-abstract):/i.test(target.trim()) ? [target.trim()] : target.split(",").map((t) => t.trim());
  } else {
    throw new TypeError(`target must be a string or an array of strings, got ${typeof target}`);
  }
  targets = targets.filter((t) => t.length > 0);
  if (targets.length === 0) throw new TypeError("target: at least one address is needed");
  return targets;
}

/** The client's retry policy merged with a call's; `false` anywhere: one attempt. */
function retryPolicy(base: RetryPolicy, override: RetryOptions | false | undefined): RetryPolicy {
  if (override === false) return { ...base, maxAttempts: 1 };
  if (override === undefined) return base;
  if (typeof override !== "object" || override === null) throw new TypeError("retry must be false or { maxAttempts, initialBackoffMs, maxBackoffMs, multiplier, perAttemptTimeoutMs }");
  const policy: RetryPolicy = { ...base };
  const positive = (field: keyof RetryOptions, min: number) => {
    const value = override[field];
    if (value === undefined) return;
    if (typeof value !== "number" || !Number.isFinite(value) || value < min) {
      throw new TypeError(`retry.${field} must be a number >= ${min}, got ${value}`);
    }
    (policy as unknown as Record<string, number>)[field] = value;
  };
  positive("maxAttempts", 1);
  if (!Number.isInteger(policy.maxAttempts)) throw new TypeError(`retry.maxAttempts must be an integer, got ${policy.maxAttempts}`);
  positive("initialBackoffMs", 0);
  positive("maxBackoffMs", 0);
  positive("multiplier", 1);
  positive("perAttemptTimeoutMs", 1);
  return policy;
}

/** No attempt is started with less time than this left before the call's deadline. */
export const MIN_ATTEMPT_MS = 50;

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

/**
 * A client of idempotency-service.
 *
 *     const client = new IdempotencyClient("127.0.0.1:50051");
 *     const client = new IdempotencyClient(["10.0.0.1:50051", "10.0.0.2:50051"]);
 *     const client = new IdempotencyClient("dns:///idempotency.internal:50051",
 *       { token, tls: { rootCerts: readFileSync("ca.pem") } });
 *
 * Every call is retried on UNAVAILABLE, RESOURCE_EXHAUSTED and
 * DEADLINE_EXCEEDED with capped exponential backoff and full jitter, within
 * its timeout (see RetryOptions), each attempt on the next address. Failed
 * calls reject with the classes in errors.ts, never with a bare grpc ServiceError.
 */
export class IdempotencyClient implements LeaseCalls {
  private readonly stubs: IdempotencyServiceClient[];
  private next = 0;
  private readonly authorization: string | undefined;
  /** The addresses, one channel each; calls go round them. */
  readonly targets: readonly string[];
  readonly timeoutMs: number;
  readonly retry: Readonly<RetryPolicy>;
  readonly logger: Logger;
  /** What Claims that asked to wait have shown of the servers (once() polls while they ignore `wait`). */
  readonly waitSupport = new ServerWaits();

  constructor(target: string | readonly string[], options: ClientOptions = {}) {
    this.targets = Object.freeze(parseTargets(target));
    this.authorization = bearer(options.token);
    this.retry = Object.freeze(retryPolicy(DEFAULT_RETRY, options.retry));
    const credentials = channelCredentials(options);
    const Service = serviceConstructor();
    const channelOptions: grpc.ClientOptions = { ...DEFAULT_CHANNEL_OPTIONS, ...options.channelOptions };
    if (options.interceptors) channelOptions.interceptors = options.interceptors;
    this.stubs = this.targets.map((t) => new Service(t, credentials, channelOptions));
    this.timeoutMs = options.timeoutMs ?? DEFAULT_TIMEOUT_MS;
    this.logger = options.logger ?? console;
  }

  close(): void {
    for (const stub of this.stubs) stub.close();
  }

  /**
   * Whether the server waited when a Claim asked it to: true once an answer
   * carried `waited`, false after one ignored `wait` (a server that predates
   * it; once() then polls), null before any Claim asked.
   */
  get serverWaits(): boolean | null {
    return this.waitSupport.supported;
  }

  /**
   * The next address in turn whose channel is connected; else the next whose
   * channel is not failing (idle or connecting); else simply the next. So a
   * replica that is down, or whose connections hang, gets no call while
   * another is connected. Looking wakes an idle channel up, so that a replica
   * that came back is connected and used again.
   */
  private pickStub(): IdempotencyServiceClient {
    const count = this.stubs.length;
    if (count === 1) return this.stubs[0];
    let notFailing: number | undefined;
    for (let i = 0; i < count; i++) {
      const index = (this.next + i) % count;
      const state = this.stubs[index].getChannel().getConnectivityState(true);
      if (state === grpc.connectivityState.READY) {
        this.next = index + 1;
        return this.stubs[index];
      }
      if (notFailing === undefined && state !== grpc.connectivityState.TRANSIENT_FAILURE) notFailing = index;
    }
    const index = notFailing ?? this.next % count;
    this.next = index + 1;
    return this.stubs[index];
  }

  private attempt<Res>(name: string, request: unknown, deadline: number): Promise<Res> {
    const metadata = new grpc.Metadata();
    if (this.authorization !== undefined) metadata.set("authorization", this.authorization);
    const stub = this.pickStub();
    return new Promise((resolve, reject) => {
      const method = (stub as unknown as Record<string, Function>)[name];
      method.call(stub, request, metadata, { deadline: new Date(deadline) }, (error: grpc.ServiceError | null, response: Res) => {
        if (error) reject(error);
        else resolve(response);
      });
    });
  }

  /**
   * One RPC: attempts until one answers, a code is final, maxAttempts is
   * reached or the timeout would pass. `atLeastMs`: no attempt is cut by the
   * per-attempt timeout sooner (a Claim that asked the server to wait).
   */
  private async call<Req, Res>(name: string, request: Req, options: CallOptions | undefined, atLeastMs = 0): Promise<Res> {
    const policy = retryPolicy(this.retry, options?.retry);
    const deadline = Date.now() + (options?.timeoutMs ?? this.timeoutMs);
    for (let attempt = 1; ; attempt++) {
      const attemptDeadline =
        policy.perAttemptTimeoutMs === undefined
          ? deadline
          : Math.min(deadline, Date.now() + Math.max(policy.perAttemptTimeoutMs, atLeastMs));
      try {
        return await this.attempt<Res>(name, request, attemptDeadline);
      } catch (error) {
        const failure = error as grpc.ServiceError;
        const details = detailsOf(failure.metadata);
        if (!RETRYABLE_CODES.has(failure.code) || attempt >= policy.maxAttempts) throw fromServiceError(failure, name, attempt, details);
        // The server's RetryInfo is the least pause: a retry sooner cannot succeed.
        const pause = Math.max(backoffMs(attempt, policy), details.retryDelayMs ?? 0);
        if (Date.now() + pause + MIN_ATTEMPT_MS > deadline) throw fromServiceError(failure, name, attempt, details);
        await sleep(pause);
      }
    }
  }

  /**
   * Try to take the lease on a key. Losing a race is outcome IN_PROGRESS, not
   * an error. Retry-safe: every attempt sends the same lease token (a new one
   * per call, or options.leaseToken), so an attempt whose answer was lost is
   * answered by the next with the same lease (`retried: true`).
   *
   * With options.waitMs, a Claim that meets another holder waits for it on
   * the server (see ClaimOptions.waitMs); `waitedMs` on the result says how
   * long, or is null when the server predates waiting.
   *
   * A late retry (the key completed before, its result expired, the server
   * still remembers it) follows options.lateRetry (else the namespace's or the
   * server's policy): "reexecute" is CLAIMED with `completedAt` set and the
   * next fencing token; "refuse" is outcome EXPIRED with `completedAt` and the
   * last lease's `fencingToken`.
   */
  async claim(namespace: string, key: string, options: ClaimOptions = {}): Promise<ClaimResult> {
    const timeoutMs = options.timeoutMs ?? this.timeoutMs;
    let waitMs = options.waitMs;
    if (waitMs !== undefined && (typeof waitMs !== "number" || !Number.isFinite(waitMs))) {
      throw new TypeError(`waitMs: expected milliseconds, got ${waitMs}`);
    }
    let atLeastMs: number | undefined;
    if (waitMs !== undefined && waitMs > 0) {
      waitMs = Math.max(waitWithin(waitMs, timeoutMs), MIN_WAIT_MS);
      atLeastMs = waitMs + WAIT_HEADROOM_MS;
    } else if (waitMs === 0) {
      waitMs = undefined; // zero is no waiting: the field stays unset
    }
    const request = { ...claimRequest({ ...options, namespace, key }), wait: toDuration(waitMs, "waitMs") };
    const response = await this.call("Claim", request, { ...options, timeoutMs }, atLeastMs);
    const result = claimResult(response as never);
    if (atLeastMs !== undefined) this.waitSupport.saw(result.waitedMs);
    return result;
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

  /**
   * Give a failed attempt back: the key is claimable again at once. With
   * options.checkpoint, saves how far the attempt got for the next holder.
   * Safe to retry (a repeated Release of the same lease is OK).
   */
  async release(namespace: string, key: string, leaseToken: string, options: ReleaseOptions = {}): Promise<void> {
    const request: Record<string, unknown> = { namespace, key, leaseToken };
    if (options.checkpoint !== undefined) request.checkpoint = checkpointBytes(options.checkpoint);
    await this.call("Release", request, options);
  }

  /**
   * Keep a long piece of work's lease alive: it now ends leaseTtlMs from now.
   * With options.checkpoint, also saves how far the work got (replacing the
   * checkpoint saved before): whoever takes the key over receives it.
   */
  async extendLease(
    namespace: string,
    key: string,
    leaseToken: string,
    options: ExtendLeaseOptions = {},
  ): Promise<ExtendLeaseResult> {
    const request: Record<string, unknown> = {
      namespace,
      key,
      leaseToken,
      leaseTtl: toDuration(options.leaseTtlMs, "leaseTtlMs"),
    };
    if (options.checkpoint !== undefined) request.checkpoint = checkpointBytes(options.checkpoint);
    const reply = await this.call<unknown, { leaseExpiresAt: never }>("ExtendLease", request, options);
    return { leaseExpiresAt: toDate(reply.leaseExpiresAt)! };
  }

  /** Inspect a key's record without changing it. */
  async get(namespace: string, key: string, options: CallOptions = {}): Promise<KeyRecord> {
    return keyRecord(await this.call("Get", { namespace, key }, options));
  }

  /**
   * Claim many keys in one call: one ClaimResult per item, in order, each what
   * its own claim() would have resolved to (each item with its own lease token,
   * the same on every attempt, so the call is retry-safe). The same key twice is one lease:
   * the first item is CLAIMED, the second IN_PROGRESS. An invalid item rejects
   * the whole call with InvalidArgument naming it ("items[3].key: ..."), as
   * does an empty list or one longer than the server's limit (500 unless configured).
   *
   * With `{ itemErrors: true }`, an item whose key cannot be reached while the
   * others can (on Citus, the worker holding it is down) comes back as a
   * FailedClaim (`ok: false`, outcome UNSPECIFIED, `error` an Unavailable with
   * its retryDelayMs, and the `leaseToken` to retry it with), and the others
   * are answered; the call rejects only when every item failed, or for its own
   * reasons. Without it, such a failure rejects the whole call.
   */
  claimBatch(items: readonly ClaimItem[], options?: BatchOptions & { itemErrors?: false }): Promise<ClaimResult[]>;
  claimBatch(items: readonly ClaimItem[], options: BatchOptions): Promise<ClaimBatchResult[]>;
  async claimBatch(items: readonly ClaimItem[], options: BatchOptions = {}): Promise<ClaimBatchResult[]> {
    const itemErrors = itemErrorsOption(options);
    // Unset unless asked: without the option the request is the one sent before the field existed.
    const request = { items: items.map((item, index) => atItem(index, () => claimRequest(item))), ...(itemErrors && { itemErrors }) };
    const reply = await this.call<unknown, { items: never[] }>("ClaimBatch", request, options);
    return reply.items.map((item, index) => {
      const result = claimBatchResult(item, index, request.items[index]?.leaseToken ?? "");
      // Only a server asked for item errors sends them; should another do so,
      // the item's error is the call's, as a failure without the field is.
      if (!result.ok && !itemErrors) throw result.error;
      return result;
    });
  }

  /**
   * Complete many keys in one call: one result per item, in order, either
   * `{ ok: true, expiresAt }` or `{ ok: false, error }` with the error its own
   * complete() would have rejected with (KeyNotFound, LeaseNotCurrent). A failed
   * item does not reject the call; an invalid item rejects it with InvalidArgument naming it.
   *
   * With `{ itemErrors: true }`, an item whose key cannot be reached while the
   * others can (on Citus, a worker down) is answered with Unavailable (code
   * 14, or IdempotencyError with code 10 ABORTED) and its retryDelayMs, and the
   * others are completed; retrying that item is safe. Without it, such a
   * failure rejects the whole call.
   */
  async completeBatch(items: readonly CompleteItem[], options: BatchOptions = {}): Promise<CompleteItemResult[]> {
    const itemErrors = itemErrorsOption(options);
    const request = { items: items.map((item, index) => atItem(index, () => completeRequest(item))), ...(itemErrors && { itemErrors }) };
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
  const leaseToken = item.leaseToken ?? newLeaseToken();
  if (typeof leaseToken !== "string") throw new TypeError(`leaseToken must be a string, got ${typeof leaseToken}`);
  return {
    namespace: item.namespace,
    key: item.key,
    fingerprint: bytes(item.fingerprint ?? Buffer.alloc(0), "fingerprint"),
    leaseTtl: toDuration(item.leaseTtlMs, "leaseTtlMs"),
    retention: toDuration(item.retentionMs, "retentionMs"),
    leaseToken,
    lateRetry: lateRetryValue(item.lateRetry),
  };
}

function checkpointBytes(value: unknown): Buffer {
  return typeof value === "string" ? Buffer.from(value, "utf8") : bytes(value, "checkpoint");
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

/** A batch's itemErrors option: a boolean, false when omitted. */
function itemErrorsOption(options: BatchOptions): boolean {
  const value = options.itemErrors ?? false;
  if (typeof value !== "boolean") throw new TypeError(`itemErrors must be a boolean, got ${typeof value}`);
  return value;
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
