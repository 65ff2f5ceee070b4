// idempotency-service as the persistence layer of Powertools for AWS Lambda's
// idempotency utility (`@aws-lambda-powertools/idempotency`, an optional peer
// dependency), imported as `idempotency-client/powertools`:
//
//   import { makeIdempotent, IdempotencyConfig } from "@aws-lambda-powertools/idempotency";
//   import { IdempotencyServicePersistenceLayer } from "idempotency-client/powertools";
//
//   const persistenceStore = new IdempotencyServicePersistenceLayer({
//     target: "dns:///idempotency.internal:50051", namespace: "orders" });
//   export const handler = makeIdempotent(async (event, context) => { ... },
//     { persistenceStore, config: new IdempotencyConfig({ eventKeyJmesPath: "body.order_id" }) });
//
// How Powertools' calls map onto the service (BasePersistenceLayer of
// @aws-lambda-powertools/idempotency 2.x):
//
//   _putRecord     Claim: the record's idempotency key in `namespace`, its
//                  payload hash (payloadValidationJmesPath; base64, decoded
//                  to bytes) as the fingerprint, Powertools'
//                  expiresAfterSeconds as the retention, the invocation's
//                  remaining time as the lease. CLAIMED: the lease is kept
//                  (per async context, AsyncLocalStorage) for the calls
//                  below. Another holder: the Claim waits on the server
//                  (`waitMs`), so a duplicate gets the first one's result (or
//                  the key, when the first one fails) instead of
//                  IdempotencyAlreadyInProgressError. COMPLETED: Powertools
//                  replays the stored response. FINGERPRINT_MISMATCH:
//                  IdempotencyValidationError.
//   _getRecord     Get (Powertools calls it only when _putRecord's error
//                  carries no record, which this layer's always carries).
//   _updateRecord  Complete with the lease token: the response (JSON) is
//                  stored and replayed until the retention ends. A lease that
//                  was lost (it ran out and another caller took the key) is
//                  refused by the service, and Powertools throws
//                  IdempotencyPersistenceLayerError (cause: LeaseNotCurrent).
//   _deleteRecord  Release with the lease token: the key is claimable again
//                  at once (the function threw).
import { AsyncLocalStorage } from "node:async_hooks";
import { IdempotencyRecordStatus } from "@aws-lambda-powertools/idempotency";
import {
  IdempotencyItemAlreadyExistsError,
  IdempotencyItemNotFoundError,
  IdempotencyValidationError,
} from "@aws-lambda-powertools/idempotency";
import { BasePersistenceLayer, IdempotencyRecord } from "@aws-lambda-powertools/idempotency/persistence";
import { IdempotencyClient, type ClientOptions } from "./client";
import { KeyNotFound, LeaseLost, LeaseNotCurrent, ResultExpired } from "./errors";
import { State, type LateRetry } from "./types";

/**
 * How long a lease lasts when Powertools does not know the invocation's
 * remaining time (no Lambda context registered): Lambda's longest timeout.
 */
export const DEFAULT_LEASE_TTL_MS = 900_000;

/** The service's shortest lease and retention. */
const MIN_MS = 1000;

/** Time added to a waiting Claim's call deadline beyond its wait. */
const WAIT_CALL_HEADROOM_MS = 2000;

/** The lease an invocation holds while Powertools runs its function. */
export interface Lease {
  readonly namespace: string;
  readonly key: string;
  readonly leaseToken: string;
  /** Hand it to downstream writes so that they refuse an older holder. */
  readonly fencingToken: bigint;
  readonly leaseExpiresAt: Date | null;
}

interface Held extends Lease {
  settled: boolean;
}

export interface IdempotencyServicePersistenceLayerOptions {
  /** An IdempotencyClient; or pass `target` (and `clientOptions`) and the layer makes one. */
  client?: IdempotencyClient;
  target?: string | readonly string[];
  clientOptions?: ClientOptions;
  /** Where the keys go (default "powertools"); Powertools' key is `<prefix>#<hash of the event key>`. */
  namespace?: string;
  /**
   * How long a Claim that meets another holder waits on the server for its
   * result (default 10 000 ms); never past the invocation's remaining time
   * less `waitReserveMs` (the time kept to run the function should the key
   * come free). 0: no waiting, Powertools' own behaviour
   * (IdempotencyAlreadyInProgressError at once). The server shortens a wait
   * to its maximum (IDEMPOTENCY_MAX_WAIT, 30 s unless configured).
   */
  waitMs?: number;
  /** Default 1000 ms. */
  waitReserveMs?: number;
  /**
   * The lease when Powertools does not know the invocation's remaining time
   * (registerLambdaContext not called; default DEFAULT_LEASE_TTL_MS); with a
   * Lambda context the lease ends when the invocation does, as Powertools'
   * in-progress expiry.
   */
  leaseTtlMs?: number;
  /**
   * What a Claim of a key whose result expired but which the service still
   * remembers does: "reexecute" (the default) runs the function again, as
   * Powertools does once expiresAfterSeconds is over; "refuse" throws
   * ResultExpired (wrapped by Powertools in IdempotencyPersistenceLayerError);
   * null: the namespace's policy.
   */
  lateRetry?: LateRetry | null;
}

/** Powertools' payload hash (base64; "" when validation is off) as the Claim's fingerprint, as bytes. */
function toFingerprint(payloadHash: string | undefined): Buffer {
  if (!payloadHash) return Buffer.alloc(0);
  const bytes = Buffer.from(payloadHash, "base64");
  return bytes.toString("base64") === payloadHash ? bytes : Buffer.from(payloadHash, "utf8");
}

function toPayloadHash(fingerprint: Buffer | null): string {
  return fingerprint && fingerprint.length > 0 ? fingerprint.toString("base64") : "";
}

/** Seconds, rounded up: a result is never taken for expired before the service says so. */
const seconds = (moment: Date | null) => (moment === null ? undefined : Math.ceil(moment.getTime() / 1000));

const millis = (moment: Date | null) => (moment === null ? undefined : moment.getTime());

const responseOf = (bytes: Buffer | null): unknown =>
  bytes === null || bytes.length === 0 ? undefined : JSON.parse(bytes.toString("utf8"));

/** Powertools' persistence layer on idempotency-service. */
export class IdempotencyServicePersistenceLayer extends BasePersistenceLayer {
  readonly client: IdempotencyClient;
  readonly namespace: string;
  readonly waitMs: number;
  readonly waitReserveMs: number;
  readonly leaseTtlMs: number;
  readonly lateRetry: LateRetry | undefined;
  /**
   * The leases of the invocations running in each async context, by key: one
   * layer serves every invocation of a process, and Powertools calls
   * _putRecord and then _updateRecord or _deleteRecord in one invocation's
   * async context. _putRecord enters a new map (a copy of the enclosing
   * one's, for nested idempotent functions) before its first await, so that
   * the rest of the invocation sees it.
   */
  readonly #leases = new AsyncLocalStorage<Map<string, Held>>();

  constructor(options: IdempotencyServicePersistenceLayerOptions) {
    super();
    const { client, target, clientOptions } = options;
    if (client !== undefined) {
      if (target !== undefined || clientOptions !== undefined) {
        throw new TypeError("pass either a client or a target with its clientOptions, not both");
      }
      this.client = client;
    } else if (target !== undefined) {
      this.client = new IdempotencyClient(target, clientOptions);
    } else {
      throw new TypeError("IdempotencyServicePersistenceLayer needs a client or a target");
    }
    this.namespace = options.namespace ?? "powertools";
    this.waitMs = options.waitMs ?? 10_000;
    this.waitReserveMs = options.waitReserveMs ?? 1000;
    this.leaseTtlMs = options.leaseTtlMs ?? DEFAULT_LEASE_TTL_MS;
    this.lateRetry = options.lateRetry === null ? undefined : (options.lateRetry ?? "reexecute");
  }

  /**
   * The lease of the innermost idempotent function running in this async
   * context (undefined outside one): its `fencingToken` guards the
   * function's writes against a holder whose lease ran out.
   */
  heldLease(): Lease | undefined {
    const leases = [...(this.#leases.getStore()?.values() ?? [])].filter((lease) => !lease.settled);
    const lease = leases.at(-1);
    if (lease === undefined) return undefined;
    const { namespace, key, leaseToken, fencingToken, leaseExpiresAt } = lease;
    return { namespace, key, leaseToken, fencingToken, leaseExpiresAt };
  }

  #take(key: string): Held | undefined {
    const leases = this.#leases.getStore();
    const lease = leases?.get(key);
    leases?.delete(key);
    if (lease === undefined || lease.settled) return undefined;
    lease.settled = true;
    return lease;
  }

  protected override async _putRecord(record: IdempotencyRecord): Promise<void> {
    // Synchronously, before the first await: the invocation's continuations see this map.
    const leases = new Map(this.#leases.getStore() ?? []);
    this.#leases.enterWith(leases);

    const key = record.idempotencyKey;
    const remaining = record.inProgressExpiryTimestamp === undefined ? undefined : record.inProgressExpiryTimestamp - Date.now();
    const leaseTtlMs = remaining === undefined ? this.leaseTtlMs : remaining;
    const waitMs = Math.max(0, remaining === undefined ? this.waitMs : Math.min(this.waitMs, remaining - this.waitReserveMs));
    const retentionMs = Math.max(this.expiresAfterSeconds * 1000, MIN_MS);
    const claim = await this.client.claim(this.namespace, key, {
      fingerprint: toFingerprint(record.payloadHash),
      leaseTtlMs: Math.max(leaseTtlMs, MIN_MS),
      retentionMs,
      waitMs: waitMs || undefined,
      lateRetry: this.lateRetry,
      timeoutMs: waitMs ? waitMs + WAIT_CALL_HEADROOM_MS + this.client.timeoutMs : undefined,
    });
    switch (claim.outcome) {
      case "CLAIMED":
        leases.set(key, {
          namespace: this.namespace,
          key,
          leaseToken: claim.leaseToken,
          fencingToken: claim.fencingToken,
          leaseExpiresAt: claim.leaseExpiresAt,
          settled: false,
        });
        return;
      case "COMPLETED":
        throw new IdempotencyItemAlreadyExistsError(
          `Failed to put record for already existing idempotency key: ${key}`,
          new IdempotencyRecord({
            idempotencyKey: key,
            status: IdempotencyRecordStatus.COMPLETED,
            expiryTimestamp: seconds(claim.expiresAt),
            responseData: responseOf(claim.response) as never,
            // The service compared the fingerprints: the same payload.
            payloadHash: record.payloadHash,
          }),
        );
      case "IN_PROGRESS":
        throw new IdempotencyItemAlreadyExistsError(
          `Failed to put record for already existing idempotency key: ${key}`,
          new IdempotencyRecord({
            idempotencyKey: key,
            status: IdempotencyRecordStatus.INPROGRESS,
            expiryTimestamp: seconds(claim.expiresAt),
            inProgressExpiryTimestamp: millis(claim.leaseExpiresAt),
            payloadHash: record.payloadHash,
          }),
        );
      case "FINGERPRINT_MISMATCH": {
        // Powertools validates the payload of the record it is handed, and
        // throws IdempotencyValidationError itself (unwrapped) when it
        // differs: hand it the stored record, with the stored fingerprint.
        const stored = await this.client.get(this.namespace, key);
        const storedHash = toPayloadHash(stored.fingerprint);
        if (this.isPayloadValidationEnabled() && storedHash !== record.payloadHash) {
          throw new IdempotencyItemAlreadyExistsError(
            `Failed to put record for already existing idempotency key: ${key}`,
            new IdempotencyRecord({
              idempotencyKey: key,
              status: stored.state === State.COMPLETED ? IdempotencyRecordStatus.COMPLETED : IdempotencyRecordStatus.INPROGRESS,
              expiryTimestamp: seconds(stored.expiresAt),
              payloadHash: storedHash,
            }),
          );
        }
        throw new IdempotencyValidationError("Payload does not match stored record for this event key");
      }
      case "EXPIRED":
        throw new ResultExpired(
          `${this.namespace}/${key} completed at ${claim.completedAt.toISOString()}; its result expired and late retries are refused`,
          claim.completedAt,
          claim.fencingToken,
        );
    }
  }

  protected override async _getRecord(idempotencyKey: string): Promise<IdempotencyRecord> {
    const record = await this.client.get(this.namespace, idempotencyKey);
    if (record.state === State.COMPLETED) {
      return new IdempotencyRecord({
        idempotencyKey,
        status: IdempotencyRecordStatus.COMPLETED,
        expiryTimestamp: seconds(record.expiresAt),
        responseData: responseOf(record.response) as never,
        payloadHash: toPayloadHash(record.fingerprint),
      });
    }
    if (record.state === State.IN_PROGRESS) {
      return new IdempotencyRecord({
        idempotencyKey,
        status: IdempotencyRecordStatus.INPROGRESS,
        expiryTimestamp: seconds(record.expiresAt),
        inProgressExpiryTimestamp: millis(record.leaseExpiresAt),
        payloadHash: toPayloadHash(record.fingerprint),
      });
    }
    // ABSENT (remembered or not) and RELEASED: nothing to replay or wait for.
    throw new IdempotencyItemNotFoundError(`Item with idempotency key ${idempotencyKey} not found`);
  }

  protected override async _updateRecord(record: IdempotencyRecord): Promise<void> {
    const lease = this.#take(record.idempotencyKey);
    if (lease === undefined) {
      throw new LeaseLost(
        `${this.namespace}/${record.idempotencyKey}: this invocation holds no lease on the key, so the result was not stored`,
      );
    }
    const response = record.responseData === undefined ? "" : JSON.stringify(record.responseData);
    await this.client.complete(lease.namespace, lease.key, lease.leaseToken, response, {
      retentionMs: Math.max(this.expiresAfterSeconds * 1000, MIN_MS),
    });
  }

  protected override async _deleteRecord(record: IdempotencyRecord): Promise<void> {
    const lease = this.#take(record.idempotencyKey);
    if (lease === undefined) return; // nothing held, nothing to give back
    try {
      await this.client.release(lease.namespace, lease.key, lease.leaseToken);
    } catch (error) {
      // The lease ran out and the key expired or went to another caller: it
      // is not this invocation's to give back. Powertools then throws the
      // function's own error, as it should.
      if (!(error instanceof KeyNotFound || error instanceof LeaseNotCurrent)) throw error;
    }
  }
}
