//! The one place where the service's errors become gRPC statuses. Causes
//! (database errors, timeouts) are logged here and never sent to the caller,
//! so no SQL text or connection detail leaves the process.
//!
//! Every status carries the standard google.rpc error details (tonic-types
//! writes them into `grpc-status-details-bin`, where every stock gRPC
//! library finds them): ErrorInfo with the error's stable reason, RetryInfo
//! where a retry of the same call can succeed, and BadRequest naming the
//! field of an INVALID_ARGUMENT.

use std::collections::HashMap;
use std::time::SystemTime;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use super::proto;
use crate::error::Error;

/// ErrorInfo's `domain`: the service that decided the error.
pub const DOMAIN: &str = "idempotency-service";

pub fn to_status(error: Error) -> Status {
    let code = code_of(&error);
    match &error {
        Error::Unavailable(cause) => tracing::warn!(error = %cause, "store unavailable"),
        Error::Internal(cause) => tracing::error!(error = %cause, "internal error"),
        _ => {}
    }
    let mut metadata = HashMap::new();
    match &error {
        Error::InvalidArgument { field, .. } => {
            metadata.insert("field".to_owned(), field.to_string());
        }
        Error::KeyExpired {
            completed_at,
            remembered_until,
        } => {
            metadata.insert("completed_at".to_owned(), rfc3339(*completed_at));
            metadata.insert("remembered_until".to_owned(), rfc3339(*remembered_until));
        }
        _ => {}
    }
    let mut details = ErrorDetails::with_error_info(error.reason().as_str(), DOMAIN, metadata);
    if let Some(delay) = error.retry_delay() {
        details.set_retry_info(Some(delay));
    }
    if let Error::InvalidArgument { field, reason } = &error {
        details.add_bad_request_violation(field.to_string(), reason.to_string());
    }
    Status::with_error_details(code, error.to_string(), details)
}

/// The status of one item of a batch whose other items were answered (a
/// CompleteBatch's NOT_FOUND or FAILED_PRECONDITION, or an item the store
/// could not reach): its code, message, reason and retry delay, as its own
/// call's status would carry them. Causes are logged here, as for a call.
pub fn item_error(error: &Error) -> proto::ItemError {
    match error {
        Error::Unavailable(cause) => {
            tracing::warn!(error = %cause, "store unavailable for a batch item")
        }
        Error::Internal(cause) => tracing::error!(error = %cause, "internal error in a batch item"),
        _ => {}
    }
    proto::ItemError {
        code: code_of(error) as i32,
        message: error.to_string(),
        reason: error.reason().as_str().to_owned(),
        retry_after: error.retry_delay().and_then(|d| d.try_into().ok()),
    }
}

/// A time as RFC 3339 (UTC, microseconds), for ErrorInfo's metadata.
fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_micros(t).to_string()
}

/// The code an error becomes, for logs, without building the status.
pub fn code_of(error: &Error) -> Code {
    match error {
        Error::InvalidArgument { .. } => Code::InvalidArgument,
        Error::NotFound | Error::KeyExpired { .. } => Code::NotFound,
        Error::LeaseMismatch(..) => Code::FailedPrecondition,
        Error::Contended => Code::Aborted,
        Error::Unauthenticated(_) => Code::Unauthenticated,
        Error::PermissionDenied(_) => Code::PermissionDenied,
        Error::ResourceExhausted { .. } => Code::ResourceExhausted,
        Error::DeadlineExceeded => Code::DeadlineExceeded,
        Error::Unavailable(_) => Code::Unavailable,
        Error::Internal(_) => Code::Internal,
    }
}

/// A gRPC code as metrics and logs name it.
pub(crate) fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        InvalidArgument => "invalid_argument",
        NotFound => "not_found",
        FailedPrecondition => "failed_precondition",
        Aborted => "aborted",
        Unauthenticated => "unauthenticated",
        PermissionDenied => "permission_denied",
        ResourceExhausted => "resource_exhausted",
        DeadlineExceeded => "deadline_exceeded",
        Unavailable => "unavailable",
        Internal => "internal",
        _ => "error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Reason;
    use std::time::Duration;

    #[test]
    fn every_status_carries_its_reason_and_the_details_that_apply() {
        let status = to_status(Error::invalid("key", "must not be empty"));
        assert_eq!(status.code(), Code::InvalidArgument);
        let details = status.get_error_details();
        let info = details.error_info().unwrap();
        assert_eq!(info.reason, "INVALID_ARGUMENT");
        assert_eq!(info.domain, DOMAIN);
        assert_eq!(info.metadata["field"], "key");
        let violations = &details.bad_request().unwrap().field_violations;
        assert_eq!(violations.len(), 1);
        assert_eq!(violations[0].field, "key");
        assert_eq!(violations[0].description, "must not be empty");
        assert!(details.retry_info().is_none());

        let status = to_status(Error::Unavailable("down".into()));
        assert_eq!(status.code(), Code::Unavailable);
        assert_eq!(
            status.message(),
            "the store is unavailable; retry with backoff"
        );
        let details = status.get_error_details();
        assert_eq!(details.error_info().unwrap().reason, "STORE_UNAVAILABLE");
        assert_eq!(
            details.retry_info().unwrap().retry_delay,
            Some(crate::error::UNAVAILABLE_RETRY_DELAY)
        );

        let status = to_status(Error::ResourceExhausted {
            reason: Reason::RateLimited,
            message: "slow down",
            retry_after: Duration::from_millis(1500),
        });
        let details = status.get_error_details();
        assert_eq!(details.error_info().unwrap().reason, "RATE_LIMITED");
        assert_eq!(
            details.retry_info().unwrap().retry_delay,
            Some(Duration::from_millis(1500))
        );

        let status = to_status(Error::lease_lost());
        assert_eq!(status.code(), Code::FailedPrecondition);
        let details = status.get_error_details();
        assert_eq!(details.error_info().unwrap().reason, "LEASE_LOST");
        assert!(details.retry_info().is_none());
    }

    #[test]
    fn a_remembered_key_says_when_it_completed_and_until_when_it_is_remembered() {
        let completed_at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let status = to_status(Error::KeyExpired {
            completed_at,
            remembered_until: completed_at + Duration::from_secs(86_400),
        });
        assert_eq!(status.code(), Code::NotFound);
        let info = status.get_error_details().error_info().unwrap().clone();
        assert_eq!(info.reason, "KEY_EXPIRED");
        assert_eq!(info.metadata["completed_at"], "2023-11-14T22:13:20.000000Z");
        assert_eq!(
            info.metadata["remembered_until"],
            "2023-11-15T22:13:20.000000Z"
        );
    }
}
