//! The one place where the service's errors become gRPC statuses. Causes
//! (database errors, timeouts) are logged here and never sent to the caller,
//! so no SQL text or connection detail leaves the process.

use tonic::{Code, Status};

use crate::error::Error;

pub fn to_status(error: Error) -> Status {
    match error {
        Error::InvalidArgument { .. } => Status::invalid_argument(error.to_string()),
        Error::NotFound => Status::not_found(error.to_string()),
        Error::LeaseMismatch(reason) => Status::failed_precondition(reason),
        Error::Contended => Status::aborted(error.to_string()),
        Error::Unauthenticated(reason) => Status::unauthenticated(reason),
        Error::PermissionDenied(reason) => Status::permission_denied(reason),
        Error::ResourceExhausted(reason) => Status::resource_exhausted(reason),
        Error::DeadlineExceeded => Status::deadline_exceeded(error.to_string()),
        Error::Unavailable(ref cause) => {
            tracing::warn!(error = %cause, "store unavailable");
            Status::unavailable(error.to_string())
        }
        Error::Internal(ref cause) => {
            tracing::error!(error = %cause, "internal error");
            Status::internal(error.to_string())
        }
    }
}

/// The code an error becomes, for logs, without building the status.
pub fn code_of(error: &Error) -> Code {
    match error {
        Error::InvalidArgument { .. } => Code::InvalidArgument,
        Error::NotFound => Code::NotFound,
        Error::LeaseMismatch(_) => Code::FailedPrecondition,
        Error::Contended => Code::Aborted,
        Error::Unauthenticated(_) => Code::Unauthenticated,
        Error::PermissionDenied(_) => Code::PermissionDenied,
        Error::ResourceExhausted(_) => Code::ResourceExhausted,
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
