// The standard google.rpc error details every non-OK status of the service
// carries: a serialized google.rpc.Status in the `grpc-status-details-bin`
// trailer (grpc-js hands it over base64-decoded, as a Buffer, in the
// ServiceError's metadata), decoded with protobufjs from google/rpc/status.proto
// and error_details.proto (copied beside the package by scripts/generate.mjs).
import { join } from "node:path";
import * as protobuf from "protobufjs";
import type { Metadata } from "@grpc/grpc-js";
import type { Status__Output } from "./generated/google/rpc/Status";
import type { ErrorInfo__Output } from "./generated/google/rpc/ErrorInfo";
import type { RetryInfo__Output } from "./generated/google/rpc/RetryInfo";
import type { BadRequest__Output } from "./generated/google/rpc/BadRequest";

/** ErrorInfo's domain on every status the service sends. */
export const DOMAIN = "idempotency-service";

/** The trailer that carries a serialized google.rpc.Status. */
export const DETAILS_KEY = "grpc-status-details-bin";

/** The google.rpc details of a failed call's status, decoded. */
export interface ErrorDetails {
  /** ErrorInfo.reason: an ErrorReason name without its prefix ("LEASE_LOST"). */
  readonly reason: string | undefined;
  /** ErrorInfo.domain: "idempotency-service" for the service's own statuses. */
  readonly domain: string | undefined;
  /** ErrorInfo.metadata: `field` (INVALID_ARGUMENT), `completed_at` and `remembered_until` (KEY_EXPIRED, RFC 3339). */
  readonly metadata: Readonly<Record<string, string>>;
  /** RetryInfo.retry_delay in milliseconds: how long to wait before the same call can succeed. */
  readonly retryDelayMs: number | undefined;
  /** BadRequest's field violations. */
  readonly fieldViolations: readonly { field: string; description: string }[];
}

export const NO_DETAILS: ErrorDetails = Object.freeze({
  reason: undefined,
  domain: undefined,
  metadata: Object.freeze({}),
  retryDelayMs: undefined,
  fieldViolations: Object.freeze([]),
});

const TO_OBJECT: protobuf.IConversionOptions = { longs: String, enums: String, defaults: true, oneofs: true };

interface RpcTypes {
  Status: protobuf.Type;
  ErrorInfo: protobuf.Type;
  RetryInfo: protobuf.Type;
  BadRequest: protobuf.Type;
}

let types: RpcTypes | undefined;

function rpcTypes(): RpcTypes {
  if (!types) {
    // dist/src/details.js -> <package>/proto, copied there by scripts/generate.mjs
    const protoRoot = join(__dirname, "..", "..", "proto");
    const root = protobuf.loadSync([
      join(protoRoot, "google", "rpc", "status.proto"),
      join(protoRoot, "google", "rpc", "error_details.proto"),
    ]);
    types = {
      Status: root.lookupType("google.rpc.Status"),
      ErrorInfo: root.lookupType("google.rpc.ErrorInfo"),
      RetryInfo: root.lookupType("google.rpc.RetryInfo"),
      BadRequest: root.lookupType("google.rpc.BadRequest"),
    };
  }
  return types;
}

function decode<T>(type: protobuf.Type, data: Uint8Array): T {
  return type.toObject(type.decode(data), TO_OBJECT) as T;
}

/** The google.rpc.Status in a status's metadata (the trailers), or undefined when there is none. */
export function richStatus(metadata: Metadata | undefined): Status__Output | undefined {
  const value = metadata?.get(DETAILS_KEY)[0];
  if (value === undefined || typeof value === "string") return undefined;
  return decode<Status__Output>(rpcTypes().Status, value);
}

/**
 * The details of a failed call, from its ServiceError's metadata; NO_DETAILS
 * when the status carried none (the client's own deadline, a refused
 * connection, a proxy's answer, a server that predates them) or they do not parse.
 */
export function detailsOf(metadata: Metadata | undefined): ErrorDetails {
  let status: Status__Output | undefined;
  try {
    status = richStatus(metadata);
  } catch {
    return NO_DETAILS;
  }
  if (status === undefined) return NO_DETAILS;
  const { ErrorInfo, RetryInfo, BadRequest } = rpcTypes();
  let reason: string | undefined;
  let domain: string | undefined;
  let info: Record<string, string> = {};
  let retryDelayMs: number | undefined;
  let fieldViolations: { field: string; description: string }[] = [];
  for (const detail of status.details) {
    const type = detail.type_url.slice(detail.type_url.lastIndexOf("/") + 1);
    try {
      if (type === "google.rpc.ErrorInfo") {
        const message = decode<ErrorInfo__Output>(ErrorInfo, detail.value);
        reason = message.reason;
        domain = message.domain;
        info = { ...message.metadata };
      } else if (type === "google.rpc.RetryInfo") {
        const delay = decode<RetryInfo__Output>(RetryInfo, detail.value).retryDelay;
        retryDelayMs = delay ? Number(delay.seconds) * 1000 + delay.nanos / 1e6 : 0;
      } else if (type === "google.rpc.BadRequest") {
        fieldViolations = decode<BadRequest__Output>(BadRequest, detail.value).fieldViolations.map((v) => ({
          field: v.field,
          description: v.description,
        }));
      }
    } catch {
      // A detail that does not parse is skipped; the others still count.
    }
  }
  return Object.freeze({
    reason,
    domain,
    metadata: Object.freeze(info),
    retryDelayMs,
    fieldViolations: Object.freeze(fieldViolations),
  });
}
