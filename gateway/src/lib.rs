//! idempotency-gateway: a reverse proxy that makes an HTTP API honour the
//! `Idempotency-Key` header (draft-ietf-httpapi-idempotency-key-header-07),
//! with idempotency-service as its store, over gRPC.
//!
//! The map of the crate, from the edge inwards:
//!
//! - [`server`]: the listeners (the proxy's, HTTP/1.1 and h2c on one port;
//!   the admin port's health and metrics) and graceful shutdown.
//! - [`tls`]: TLS on the proxy's listener (rustls, ALPN `h2` and
//!   `http/1.1`), its certificate re-read when the files change.
//! - [`flow`]: what a guarded request goes through: the key, the Claim, the
//!   upstream call under a kept-alive lease, Complete or Release, the replay.
//! - [`background`]: the work that outlives a request's connection
//!   (its Complete or Release), counted so that a shutdown waits for it.
//! - [`proxy`]: the upstream client and the header rules of a reverse proxy
//!   (hop-by-hop headers, `X-Forwarded-*`); pass-through requests.
//! - [`request`]: what is read from a request: the `Idempotency-Key` (an
//!   RFC 8941 sf-string), the caller's namespace, the fingerprint.
//! - [`stored`]: the stored response's encoding (status, allowed headers,
//!   body) and the replay built from it.
//! - [`service`]: the gRPC client of idempotency-service, with the retry
//!   rules of `clients/service-config.json`.
//! - [`error`]: every answer the gateway gives itself, as an RFC 9457
//!   problem; service statuses are mapped to them here, in one place.
//! - [`config`]: the TOML file, read into typed and validated routes.
//! - [`metrics`]: the counters' names and labels.

#![forbid(unsafe_code)]

pub mod background;
pub mod config;
pub mod error;
pub mod flow;
pub mod metrics;
pub mod proxy;
pub mod request;
pub mod server;
pub mod service;
pub mod stored;
pub mod tls;

/// The body type of every request and response the gateway handles.
pub type Body = http_body_util::combinators::BoxBody<bytes::Bytes, BoxError>;

/// The error type inside [`Body`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
