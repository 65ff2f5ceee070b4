//! The one error type of the service: what a caller can act on. Each variant's
//! doc names the gRPC code it becomes; the mapping itself lives in
//! `grpc::status`, the only place that knows tonic.

use std::borrow::Cow;

/// A boxed cause, kept for the logs and never shown to callers.
pub type Cause = Box<dyn std::error::Error + Send + Sync + 'static>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `INVALID_ARGUMENT`: a request field is missing, too long or malformed.
    /// The message names the field; nothing was changed.
    #[error("{field}: {reason}")]
    InvalidArgument {
        field: Cow<'static, str>,
        reason: Cow<'static, str>,
    },
    /// `NOT_FOUND`: no unexpired record for the key.
    #[error("no unexpired record for this namespace and key")]
    NotFound,
    /// `FAILED_PRECONDITION`: the lease token is not the key's current one, or
    /// the record is in a state that does not allow the call.
    #[error("{0}")]
    LeaseMismatch(&'static str),
    /// `UNAVAILABLE`: the store cannot be reached or is overloaded; retryable.
    #[error("the store is unavailable; retry with backoff")]
    Unavailable(#[source] Cause),
    /// `ABORTED`: the key kept changing under a Claim; retrying is safe.
    #[error("the key changed repeatedly during the call; retry")]
    Contended,
    /// `UNAUTHENTICATED`: no credentials, or credentials the policy does not
    /// know.
    #[error("{0}")]
    Unauthenticated(&'static str),
    /// `PERMISSION_DENIED`: the caller's identity is not granted the RPC or the
    /// namespace. Nothing was changed.
    #[error("{0}")]
    PermissionDenied(Cow<'static, str>),
    /// `RESOURCE_EXHAUSTED`: the caller's rate limit, or the server's limit of
    /// calls in flight, is reached; retry with backoff.
    #[error("{0}")]
    ResourceExhausted(&'static str),
    /// `DEADLINE_EXCEEDED`: the call's deadline (the caller's `grpc-timeout`
    /// or the server's call timeout) passed; no further work was done for it.
    #[error("the call's deadline passed")]
    DeadlineExceeded,
    /// `INTERNAL`: a bug or an unexpected store error. Logged with its cause,
    /// shown to the caller without it.
    #[error("internal error")]
    Internal(#[source] Cause),
}

impl Error {
    pub fn invalid(field: &'static str, reason: impl Into<Cow<'static, str>>) -> Self {
        Self::InvalidArgument {
            field: Cow::Borrowed(field),
            reason: reason.into(),
        }
    }

    /// The same error about item `index` of a batch: `items[3].key: …`.
    pub fn at_item(self, index: usize) -> Self {
        match self {
            Self::InvalidArgument { field, reason } => Self::InvalidArgument {
                field: Cow::Owned(format!("items[{index}].{field}")),
                reason,
            },
            Self::PermissionDenied(reason) => {
                Self::PermissionDenied(Cow::Owned(format!("items[{index}].{reason}")))
            }
            other => other,
        }
    }

    /// A copy for each call of a batch that failed as a whole (causes are
    /// carried as text: the original goes to one caller's log only).
    pub fn replicate(&self) -> Self {
        match self {
            Self::InvalidArgument { field, reason } => Self::InvalidArgument {
                field: field.clone(),
                reason: reason.clone(),
            },
            Self::NotFound => Self::NotFound,
            Self::LeaseMismatch(reason) => Self::LeaseMismatch(reason),
            Self::Contended => Self::Contended,
            Self::Unauthenticated(reason) => Self::Unauthenticated(reason),
            Self::PermissionDenied(reason) => Self::PermissionDenied(reason.clone()),
            Self::ResourceExhausted(reason) => Self::ResourceExhausted(reason),
            Self::DeadlineExceeded => Self::DeadlineExceeded,
            Self::Unavailable(cause) => Self::Unavailable(cause.to_string().into()),
            Self::Internal(cause) => Self::Internal(cause.to_string().into()),
        }
    }
}
