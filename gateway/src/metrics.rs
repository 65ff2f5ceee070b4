//! The gateway's metrics, in the service's naming (`idempotency_gateway_*`),
//! through the `metrics` facade; the admin port serves them in the
//! Prometheus format. Labels carry route names (from the config file) and
//! fixed words, never keys or identities.

use std::time::Duration;

/// How a guarded request ended, the `outcome` label of
/// `idempotency_gateway_requests_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Forwarded under a lease and its response stored.
    Stored,
    /// Answered with a stored response.
    Replayed,
    /// Forwarded under a lease, the response passed through and the key
    /// released: its status is not stored (5xx, or not in the route's list).
    ReleasedStatus,
    /// The same, because the response is larger than the route stores.
    ReleasedTooLarge,
    /// The upstream failed (unreachable, broke off, timed out): released.
    ReleasedUpstreamError,
    /// Forwarded under a lease, but Complete failed: the response was
    /// passed through and not stored.
    CompleteFailed,
    /// 409: still in progress after the wait.
    InProgress,
    /// 422: the key was used with another payload.
    Mismatch,
    /// 410: a late retry refused by the route's policy.
    LateRetryRefused,
    /// 400/401/413: refused before anything was claimed.
    Rejected,
    /// The service unavailable: 503.
    ServiceUnavailable,
    /// The service unavailable, forwarded without idempotency (fail-open).
    FailOpen,
    /// The service refused the call (a misconfiguration): 500.
    ServiceError,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stored => "stored",
            Self::Replayed => "replayed",
            Self::ReleasedStatus => "released_status",
            Self::ReleasedTooLarge => "released_too_large",
            Self::ReleasedUpstreamError => "released_upstream_error",
            Self::CompleteFailed => "complete_failed",
            Self::InProgress => "in_progress",
            Self::Mismatch => "mismatch",
            Self::LateRetryRefused => "late_retry_refused",
            Self::Rejected => "rejected",
            Self::ServiceUnavailable => "service_unavailable",
            Self::FailOpen => "fail_open",
            Self::ServiceError => "service_error",
        }
    }
}

pub fn request(route: &str, outcome: Outcome) {
    metrics::counter!(
        "idempotency_gateway_requests_total",
        "route" => route.to_owned(),
        "outcome" => outcome.as_str()
    )
    .increment(1);
}

/// A request on no guarded route, forwarded untouched.
pub fn passed_through() {
    metrics::counter!("idempotency_gateway_passthrough_total").increment(1);
}

/// A Claim that waited for another holder, and how long.
pub fn waited(route: &str, waited: Duration) {
    metrics::histogram!(
        "idempotency_gateway_wait_seconds",
        "route" => route.to_owned()
    )
    .record(waited.as_secs_f64());
}

/// A late retry (the key was completed before and its response expired)
/// that was run again.
pub fn late_retry_reexecuted(route: &str) {
    metrics::counter!(
        "idempotency_gateway_late_retries_reexecuted_total",
        "route" => route.to_owned()
    )
    .increment(1);
}

/// A failed call to the service (after its retries), by method and code.
pub fn service_error(method: &'static str, status: &tonic::Status) {
    metrics::counter!(
        "idempotency_gateway_service_errors_total",
        "method" => method,
        "code" => format!("{:?}", status.code())
    )
    .increment(1);
}

/// A connection to the TLS listener whose handshake failed or timed out
/// (a plain-HTTP client, an unknown certificate authority, a silent peer).
pub fn tls_handshake_failed() {
    metrics::counter!("idempotency_gateway_tls_handshake_failures_total").increment(1);
}
