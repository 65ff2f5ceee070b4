//! idempotency-service: a shared deduplication store over gRPC. A caller
//! Claims an event's key and gets a lease, Completes it with the result, and
//! every later delivery of the same event gets that result back (the replay).
//!
//! The map of the crate, from the wire inwards:
//! - [`server`]: wiring; opens the store, serves gRPC, health and reflection,
//!   runs the background tasks, drains on shutdown.
//! - [`tls`]: the port's connections, plain or TLS (mutual TLS with a client
//!   CA), with certificates re-read when they change ([`reload`]).
//! - [`grpc`]: the tonic adapter; parses requests into domain types at the
//!   edge, calls the lifecycle, converts outcomes back. `grpc::guard` admits
//!   each call (deadline, limits, credentials, RPC grant) before its body is
//!   read; `grpc::status` is the one place errors become gRPC codes.
//! - [`access`]: the access policy: identities, their token hashes and
//!   certificate names, namespaces, RPCs and rate limits.
//! - [`lifecycle`]: the rules of Claim, Complete, Release, ExtendLease and Get,
//!   built from the store's atomic operations. No tonic, no SQL.
//! - [`waiters`]: Claims that wait for another holder: the registry of this
//!   process's waiters and what wakes them (its own calls, the purge feed).
//! - [`domain`]: validated newtypes (namespace, key, fingerprint, lease token,
//!   limits) and outcome enums.
//! - [`error`]: the one error type, each variant naming its gRPC code.
//! - [`store`]: the seam to the database, with the PostgreSQL and SQLite
//!   implementations, each with its SQL and migrations. The only place with SQL.
//!   Its decorators coalesce concurrent calls into one statement and answer
//!   duplicate Claims from the replay cache.
//! - [`health`]: grpc.health.v1, SERVING only while the store answers.
//! - [`reaper`]: deletes expired records in bounded batches.
//! - [`metrics`]: Prometheus metrics, bounded labels.
//! - [`admin`]: the operator's command line (get, purge, stats).
//! - [`config`]: flags and environment variables.
//! - [`listen`]: binds the ports; a port that cannot be bound is reported
//!   with the setting to change.
//! - [`telemetry`]: logs (text or JSON) and optional OpenTelemetry traces.

#![forbid(unsafe_code)]

pub mod access;
pub mod admin;
pub mod config;
pub mod domain;
pub mod error;
pub mod grpc;
pub mod health;
pub mod lifecycle;
pub mod listen;
pub mod metrics;
pub mod reaper;
pub mod reload;
pub mod server;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod waiters;
