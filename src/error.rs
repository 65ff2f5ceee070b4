//! The one error type of the service: what a caller can act on. Each variant's
//! doc names the gRPC code it becomes; the mapping itself lives in
//! `grpc::status`, the only place that knows tonic. Every error also has a
//! stable [`Reason`] (sent in google.rpc.ErrorInfo, counted in the metrics,
//! written in the call's log line) and, where a retry of the same call can
//! succeed, how long to wait first.

use std::borrow::Cow;
use std::time::{Duration, SystemTime};

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
    /// `NOT_FOUND` (reason KEY_EXPIRED): the key completed, its result
    /// expired, and the key is remembered until `remembered_until`.
    #[error("the key completed and its result expired; it is remembered, with no result")]
    KeyExpired {
        completed_at: SystemTime,
        remembered_until: SystemTime,
    },
    /// `FAILED_PRECONDITION`: the lease token is not the key's current one, or
    /// the record is in a state that does not allow the call. The reason is
    /// LEASE_LOST, LEASE_RELEASED or KEY_COMPLETED.
    #[error("{1}")]
    LeaseMismatch(Reason, &'static str),
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
    /// `RESOURCE_EXHAUSTED`: the caller's rate limit (RATE_LIMITED), or the
    /// server's limit of calls in flight (OVERLOADED), is reached; retry
    /// after `retry_after`.
    #[error("{message}")]
    ResourceExhausted {
        reason: Reason,
        message: &'static str,
        retry_after: Duration,
    },
    /// `DEADLINE_EXCEEDED`: the call's deadline (the caller's `grpc-timeout`
    /// or the server's call timeout) passed; no further work was done for it.
    #[error("the call's deadline passed")]
    DeadlineExceeded,
    /// `INTERNAL`: a bug or an unexpected store error. Logged with its cause,
    /// shown to the caller without it.
    #[error("internal error")]
    Internal(#[source] Cause),
}

/// The stable reasons of the proto's ErrorReason, as sent (without the
/// enum's prefix). Added, never renamed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    InvalidArgument,
    NotFound,
    KeyExpired,
    LeaseLost,
    LeaseReleased,
    KeyCompleted,
    Contended,
    StoreUnavailable,
    Unauthenticated,
    PermissionDenied,
    RateLimited,
    Overloaded,
    DeadlineExceeded,
    Internal,
}

impl Reason {
    /// Every reason, in the proto's order.
    pub const ALL: [Reason; 14] = [
        Reason::InvalidArgument,
        Reason::NotFound,
        Reason::KeyExpired,
        Reason::LeaseLost,
        Reason::LeaseReleased,
        Reason::KeyCompleted,
        Reason::Contended,
        Reason::StoreUnavailable,
        Reason::Unauthenticated,
        Reason::PermissionDenied,
        Reason::RateLimited,
        Reason::Overloaded,
        Reason::DeadlineExceeded,
        Reason::Internal,
    ];

    /// The name callers match on (ErrorInfo's `reason`).
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::InvalidArgument => "INVALID_ARGUMENT",
            Reason::NotFound => "NOT_FOUND",
            Reason::KeyExpired => "KEY_EXPIRED",
            Reason::LeaseLost => "LEASE_LOST",
            Reason::LeaseReleased => "LEASE_RELEASED",
            Reason::KeyCompleted => "KEY_COMPLETED",
            Reason::Contended => "CONTENDED",
            Reason::StoreUnavailable => "STORE_UNAVAILABLE",
            Reason::Unauthenticated => "UNAUTHENTICATED",
            Reason::PermissionDenied => "PERMISSION_DENIED",
            Reason::RateLimited => "RATE_LIMITED",
            Reason::Overloaded => "OVERLOADED",
            Reason::DeadlineExceeded => "DEADLINE_EXCEEDED",
            Reason::Internal => "INTERNAL",
        }
    }
}

/// How long a caller should wait before retrying after the store was
/// unavailable: about the time a replica needs to notice a lost connection
/// and open another, or a database to finish a fast failover's first step.
pub const UNAVAILABLE_RETRY_DELAY: Duration = Duration::from_millis(250);

/// How long before retrying a Claim that met a key changing under it: the
/// race is over by then, and a retry at once would likely meet it again.
pub const CONTENDED_RETRY_DELAY: Duration = Duration::from_millis(10);

impl Error {
    /// The stable reason callers, metrics and logs see.
    pub fn reason(&self) -> Reason {
        match self {
            Self::InvalidArgument { .. } => Reason::InvalidArgument,
            Self::NotFound => Reason::NotFound,
            Self::KeyExpired { .. } => Reason::KeyExpired,
            Self::LeaseMismatch(reason, _) => *reason,
            Self::Unavailable(_) => Reason::StoreUnavailable,
            Self::Contended => Reason::Contended,
            Self::Unauthenticated(_) => Reason::Unauthenticated,
            Self::PermissionDenied(_) => Reason::PermissionDenied,
            Self::ResourceExhausted { reason, .. } => *reason,
            Self::DeadlineExceeded => Reason::DeadlineExceeded,
            Self::Internal(_) => Reason::Internal,
        }
    }

    /// How long to wait before the same call can succeed, where it can.
    pub fn retry_delay(&self) -> Option<Duration> {
        match self {
            Self::Unavailable(_) => Some(UNAVAILABLE_RETRY_DELAY),
            Self::Contended => Some(CONTENDED_RETRY_DELAY),
            Self::ResourceExhausted { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }

    /// A lease token that is not the key's current lease (LEASE_LOST).
    pub fn lease_lost() -> Self {
        Self::LeaseMismatch(
            Reason::LeaseLost,
            "lease_token is not the key's current lease",
        )
    }

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
            Self::KeyExpired {
                completed_at,
                remembered_until,
            } => Self::KeyExpired {
                completed_at: *completed_at,
                remembered_until: *remembered_until,
            },
            Self::LeaseMismatch(reason, message) => Self::LeaseMismatch(*reason, message),
            Self::Contended => Self::Contended,
            Self::Unauthenticated(reason) => Self::Unauthenticated(reason),
            Self::PermissionDenied(reason) => Self::PermissionDenied(reason.clone()),
            Self::ResourceExhausted {
                reason,
                message,
                retry_after,
            } => Self::ResourceExhausted {
                reason: *reason,
                message,
                retry_after: *retry_after,
            },
            Self::DeadlineExceeded => Self::DeadlineExceeded,
            Self::Unavailable(cause) => Self::Unavailable(cause.to_string().into()),
            Self::Internal(cause) => Self::Internal(cause.to_string().into()),
        }
    }
}
