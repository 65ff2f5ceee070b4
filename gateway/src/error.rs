//! Every answer the gateway gives itself (rather than the upstream's, or a
//! replay of it), as an RFC 9457 problem (`application/problem+json`) with a
//! `type` URI per case; and the one mapping from the service's gRPC statuses
//! to those answers.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use tonic::Code;
use tonic_types::StatusExt;

use crate::Body;

/// What went wrong, from the client's point of view.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("this route requires an Idempotency-Key header")]
    KeyMissing,
    #[error("the Idempotency-Key header is invalid: {0}")]
    KeyInvalid(String),
    #[error("the request does not carry the header that identifies its caller")]
    IdentityMissing,
    #[error("the request body is larger than {limit} bytes, the most this route fingerprints")]
    RequestTooLarge { limit: usize },
    #[error("the request body could not be read")]
    RequestBody,
    #[error("a request with this key is still being processed")]
    InProgress { retry_after: Duration },
    #[error("this key was used for another request")]
    FingerprintMismatch,
    #[error("this key's request was carried out and its stored response has expired")]
    LateRetryRefused { completed_at: Option<String> },
    #[error("the idempotency service is unavailable")]
    ServiceUnavailable { retry_after: Option<Duration> },
    #[error("the idempotency service refused the call: {0}")]
    ServiceRefused(String),
    #[error("the stored response for this key cannot be read")]
    StoredResponseInvalid,
    #[error("the upstream could not be reached or broke off its response")]
    UpstreamUnreachable,
    #[error("the upstream did not answer in time")]
    UpstreamTimeout,
}

impl GatewayError {
    /// The one mapping from a failed service call to the client's answer.
    pub fn from_status(status: &tonic::Status) -> Self {
        if is_unavailable(status) {
            Self::ServiceUnavailable {
                retry_after: retry_delay(status),
            }
        } else {
            Self::ServiceRefused(format!("{:?}: {}", status.code(), status.message()))
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Self::KeyMissing | Self::KeyInvalid(_) | Self::RequestBody => StatusCode::BAD_REQUEST,
            Self::IdentityMissing => StatusCode::UNAUTHORIZED,
            Self::RequestTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::InProgress { .. } => StatusCode::CONFLICT,
            Self::FingerprintMismatch => StatusCode::UNPROCESSABLE_ENTITY,
            Self::LateRetryRefused { .. } => StatusCode::GONE,
            Self::ServiceUnavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::ServiceRefused(_) | Self::StoredResponseInvalid => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            Self::UpstreamUnreachable => StatusCode::BAD_GATEWAY,
            Self::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// The last part of the problem's `type` URI, stable across versions.
    pub fn slug(&self) -> &'static str {
        match self {
            Self::KeyMissing => "idempotency-key-missing",
            Self::KeyInvalid(_) => "idempotency-key-invalid",
            Self::IdentityMissing => "identity-missing",
            Self::RequestTooLarge { .. } => "request-too-large",
            Self::RequestBody => "request-body-unreadable",
            Self::InProgress { .. } => "request-in-progress",
            Self::FingerprintMismatch => "idempotency-key-reused",
            Self::LateRetryRefused { .. } => "idempotency-key-expired",
            Self::ServiceUnavailable { .. } => "idempotency-service-unavailable",
            Self::ServiceRefused(_) => "idempotency-service-error",
            Self::StoredResponseInvalid => "stored-response-invalid",
            Self::UpstreamUnreachable => "upstream-unreachable",
            Self::UpstreamTimeout => "upstream-timeout",
        }
    }

    fn title(&self) -> &'static str {
        match self {
            Self::KeyMissing => "Idempotency-Key missing",
            Self::KeyInvalid(_) => "Idempotency-Key invalid",
            Self::IdentityMissing => "Caller not identified",
            Self::RequestTooLarge { .. } => "Request body too large",
            Self::RequestBody => "Request body unreadable",
            Self::InProgress { .. } => "Request in progress",
            Self::FingerprintMismatch => "Idempotency-Key reused",
            Self::LateRetryRefused { .. } => "Idempotency-Key expired",
            Self::ServiceUnavailable { .. } => "Idempotency service unavailable",
            Self::ServiceRefused(_) => "Idempotency service error",
            Self::StoredResponseInvalid => "Stored response invalid",
            Self::UpstreamUnreachable => "Upstream unreachable",
            Self::UpstreamTimeout => "Upstream timeout",
        }
    }

    /// When a retry of the same request may succeed.
    fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::InProgress { retry_after } => Some(*retry_after),
            Self::ServiceUnavailable { retry_after } => {
                Some(retry_after.unwrap_or(Duration::from_secs(1)))
            }
            _ => None,
        }
    }

    /// The problem document, as the response to the client.
    pub fn to_response(&self, problem_base: &str) -> Response<Body> {
        let mut problem = serde_json::json!({
            "type": format!("{problem_base}{}", self.slug()),
            "title": self.title(),
            "status": self.status().as_u16(),
            "detail": self.to_string(),
        });
        if let Self::LateRetryRefused {
            completed_at: Some(at),
        } = self
        {
            problem["completed_at"] = serde_json::Value::String(at.clone());
        }
        let mut response = Response::new(
            Full::new(Bytes::from(problem.to_string()))
                .map_err(|never| match never {})
                .boxed(),
        );
        *response.status_mut() = self.status();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(delay) = self.retry_after() {
            // Whole seconds, rounded up, at least 1: "0" would invite a storm.
            let seconds = delay.as_millis().div_ceil(1000).max(1);
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds as u64));
        }
        response
    }
}

/// Whether the service could not be reached or could not answer now
/// (retrying later can succeed): a fail-open route forwards on these.
pub fn is_unavailable(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable | Code::DeadlineExceeded | Code::ResourceExhausted | Code::Aborted
    )
}

/// The status's google.rpc.RetryInfo delay, when it carries one.
pub fn retry_delay(status: &tonic::Status) -> Option<Duration> {
    let info = status.get_details_retry_info()?;
    info.retry_delay
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn problems_are_problem_json_with_a_type_per_case() {
        let base = "urn:example:";
        let response = GatewayError::InProgress {
            retry_after: Duration::from_millis(1200),
        }
        .to_response(base);
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(response.headers()[header::RETRY_AFTER], "2");
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["type"], "urn:example:request-in-progress");
        assert_eq!(json["status"], 409);
    }

    #[test]
    fn unavailable_statuses_carry_their_retry_delay() {
        let status = tonic::Status::with_error_details(
            Code::Unavailable,
            "store down",
            tonic_types::ErrorDetails::with_retry_info(Some(Duration::from_millis(250))),
        );
        match GatewayError::from_status(&status) {
            GatewayError::ServiceUnavailable { retry_after } => {
                assert_eq!(retry_after, Some(Duration::from_millis(250)))
            }
            other => panic!("{other:?}"),
        }
        let refused = tonic::Status::permission_denied("namespace");
        assert_eq!(
            GatewayError::from_status(&refused).status(),
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }
}
