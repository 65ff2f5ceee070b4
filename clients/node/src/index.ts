// TypeScript client of idempotency-service.
//
//   client.ts   IdempotencyClient: claim, complete, release, extendLease, get, purge,
//               claimBatch, completeBatch, and once(); retries with backoff,
//               several addresses
//   calls.ts    the options of each call, and LeaseCalls: what once() uses of a client
//   once.ts     the run-once lifecycle (Claim, work, Complete or Release, replay, heartbeat)
//   waiting.ts  Claims that wait for another holder on the server, and the
//               fallback to polling against a server that predates waiting
//   keys.ts     deriveKey() and fingerprint(): canonical forms in clients/KEYS.md
//   types.ts    Outcome, State and the typed results of the RPCs
//   errors.ts   one error class per status a caller can act on, with the
//               status's google.rpc details (reason, retryDelayMs, field)
//   details.ts  decoding those details (grpc-status-details-bin) with protobufjs
//   testing.ts  start a real server for tests
//   generated/  types generated from proto/ by scripts/generate.mjs (not committed)
export {
  IdempotencyClient,
  DEFAULT_TIMEOUT_MS,
  DEFAULT_RETRY,
  RETRYABLE_CODES,
  backoffMs,
  newLeaseToken,
  parseTargets,
} from "./client";
export type { ClientOptions, RetryPolicy, TlsOptions } from "./client";
export type {
  RetryOptions,
  ReleaseOptions,
  CallOptions,
  BatchOptions,
  ClaimOptions,
  CompleteOptions,
  ExtendLeaseOptions,
  PurgeOptions,
  Logger,
} from "./calls";
export { JSON_SERIALIZER, BYTES_SERIALIZER } from "./once";
export { ServerWaits, WAIT_HEADROOM_MS, WAIT_RECHECK_MS } from "./waiting";
export type { Lease, OnceOptions, OnceResult, Serializer } from "./once";
export { deriveKey, keyEncoding, fingerprint, canonicalJson } from "./keys";
export type { KeyField } from "./keys";
export { Outcome, State, LateRetry } from "./types";
export { DOMAIN, NO_DETAILS, detailsOf } from "./details";
export type { ErrorDetails } from "./details";
export type {
  ClaimResult,
  Claimed,
  InProgressClaim,
  CompletedClaim,
  FingerprintMismatchClaim,
  ExpiredClaim,
  FailedClaim,
  ClaimBatchResult,
  ClaimWaited,
  CompleteResult,
  ExtendLeaseResult,
  KeyRecord,
  ClaimItem,
  CompleteItem,
  CompleteItemResult,
  PurgeResult,
} from "./types";
export {
  IdempotencyError,
  InvalidArgument,
  KeyNotFound,
  KeyExpired,
  LeaseNotCurrent,
  Unavailable,
  Unauthenticated,
  PermissionDenied,
  ResourceExhausted,
  FingerprintMismatch,
  InProgress,
  LeaseLost,
  ResultExpired,
} from "./errors";
export type { ErrorOptions } from "./errors";
