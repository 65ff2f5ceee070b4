//! The gate in front of the service's RPCs: a tower layer that runs on each
//! call's headers, before its body is read or decoded.
//!
//! In order: the call's deadline (the caller's `grpc-timeout`, at most the
//! server's call timeout), the server's limit of calls in flight, who is
//! calling (bearer token or client certificate, through [`access::Policy`]),
//! whether that identity may use the RPC, and its rate limit. A call that
//! passes carries a [`Caller`] in its extensions, and the adapter checks each
//! namespace against it once the request is parsed. A call that fails gets its
//! status here, and nothing else runs for it.
//!
//! Health and reflection pass untouched: probes need no credentials, and
//! neither service says anything about keys.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::HeaderMap;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tonic::body::Body;
use tower::{Layer, Service};

use crate::access::{self, Credentials, Identity, Policy};
use crate::error::{Error, Reason};
use crate::grpc::proto::SERVICE_NAME;
use crate::grpc::status::{self, code_name};
use crate::metrics::{self, CallRecord, NamespaceLabels};
use crate::reload::Reloading;
use crate::tls::PeerInfo;

/// How long a caller refused for too many calls in flight should wait: a
/// typical call's time, after which slots are free again.
const OVERLOADED_RETRY_DELAY: Duration = Duration::from_millis(50);

/// When the call must have answered (the caller's `grpc-timeout`, at most
/// the server's call timeout), put into each admitted call's extensions: a
/// Claim that waits answers before it.
#[derive(Debug, Clone, Copy)]
pub struct CallDeadline(pub Instant);

/// Who is calling, put into each admitted call's extensions.
#[derive(Debug, Clone)]
pub struct Caller(pub Option<Arc<Identity>>);

impl Caller {
    /// PERMISSION_DENIED unless the caller may use `namespace`. A service that
    /// runs without a policy lets everyone use everything.
    pub fn check_namespace(&self, namespace: &crate::domain::Namespace) -> Result<(), Error> {
        match &self.0 {
            Some(identity) => identity.check_namespace(namespace),
            None => Ok(()),
        }
    }

    pub fn name(&self) -> Option<&str> {
        self.0.as_deref().map(Identity::name)
    }
}

/// Who may call: everyone, or whom the policy file names.
#[derive(Clone)]
pub enum Access {
    Open,
    Policy(Arc<Reloading<Policy>>),
}

/// The guard's settings.
#[derive(Clone)]
pub struct GuardLayer {
    state: Arc<State>,
}

struct State {
    access: Access,
    in_flight: Arc<Semaphore>,
    call_timeout: Duration,
    labels: NamespaceLabels,
}

impl GuardLayer {
    pub fn new(
        access: Access,
        max_concurrent_calls: usize,
        call_timeout: Duration,
        labels: NamespaceLabels,
    ) -> Self {
        Self {
            state: Arc::new(State {
                access,
                in_flight: Arc::new(Semaphore::new(max_concurrent_calls)),
                call_timeout,
                labels,
            }),
        }
    }
}

impl<S> Layer<S> for GuardLayer {
    type Service = Guard<S>;

    fn layer(&self, inner: S) -> Guard<S> {
        Guard {
            inner,
            state: self.state.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Guard<S> {
    inner: S,
    state: Arc<State>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B> Service<http::Request<B>> for Guard<S>
where
    S: Service<http::Request<B>, Response = http::Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let Some(method) = rpc_of(request.uri().path()) else {
            return Box::pin(self.inner.call(request));
        };
        let started = Instant::now();
        let timeout = grpc_timeout(request.headers())
            .map_or(self.state.call_timeout, |t| t.min(self.state.call_timeout));
        let deadline = started + timeout;
        request.extensions_mut().insert(CallDeadline(deadline));
        let permit = match self.state.admit(method, &mut request) {
            Ok(permit) => permit,
            Err((error, identity)) => {
                return Box::pin(std::future::ready(Ok(self.state.refuse(
                    method,
                    identity.as_deref(),
                    started,
                    error,
                ))));
            }
        };
        // The service that was polled ready is the one to call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let state = self.state.clone();
        Box::pin(async move {
            let _permit = permit;
            let caller = request.extensions().get::<Caller>().cloned();
            let identity = caller.as_ref().and_then(Caller::name);
            // A call whose deadline passed does no work at all. (The timer
            // below has millisecond ticks, so it cannot be trusted to fire
            // before the call is first polled.)
            if Instant::now() >= deadline {
                return Ok(state.refuse(method, identity, started, Error::DeadlineExceeded));
            }
            tokio::select! {
                biased;
                () = tokio::time::sleep_until(deadline) => {
                    Ok(state.refuse(method, identity, started, Error::DeadlineExceeded))
                }
                response = inner.call(request) => response,
            }
        })
    }
}

impl State {
    /// Checks the call's credentials and limits; on success the call holds a
    /// slot of the in-flight limit and carries its [`Caller`].
    fn admit<B>(
        &self,
        method: &'static str,
        request: &mut http::Request<B>,
    ) -> Result<OwnedSemaphorePermit, (Error, Option<String>)> {
        let permit = self.in_flight.clone().try_acquire_owned().map_err(|_| {
            (
                Error::ResourceExhausted {
                    reason: Reason::Overloaded,
                    message: "the server has too many calls in flight; retry with backoff",
                    retry_after: OVERLOADED_RETRY_DELAY,
                },
                None,
            )
        })?;
        let caller = match &self.access {
            Access::Open => Caller(None),
            Access::Policy(policy) => {
                let token = bearer_token(request.headers());
                let cn = request
                    .extensions()
                    .get::<PeerInfo>()
                    .and_then(|p| p.client_cert_cn.clone());
                let identity = policy
                    .current()
                    .authenticate(Credentials {
                        token,
                        client_cert_cn: cn.as_deref(),
                    })
                    .map_err(|e| (e, None))?;
                let name = || Some(identity.name().to_owned());
                identity.check_rpc(method).map_err(|e| (e, name()))?;
                identity.check_rate().map_err(|e| (e, name()))?;
                Caller(Some(identity))
            }
        };
        request.extensions_mut().insert(caller);
        Ok(permit)
    }

    /// Answers a call the guard stopped, with its log line and metrics.
    fn refuse(
        &self,
        method: &'static str,
        identity: Option<&str>,
        started: Instant,
        error: Error,
    ) -> http::Response<Body> {
        let code = code_name(status::code_of(&error));
        tracing::info!(
            method,
            identity,
            outcome = code,
            reason = error.reason().as_str(),
            message = %error,
            "call refused"
        );
        metrics::record_call(
            &self.labels,
            CallRecord {
                method,
                code,
                namespace: None,
                latency: started.elapsed(),
                claim_outcome: None,
                took_over: false,
                lease_lost: false,
                reason: Some(error.reason()),
            },
        );
        status::to_status(error).into_http()
    }
}

/// The RPC a path names, when it is one of the service's.
fn rpc_of(path: &str) -> Option<&'static str> {
    let method = path
        .strip_prefix('/')?
        .strip_prefix(SERVICE_NAME)?
        .strip_prefix('/')?;
    access::RPCS.iter().copied().find(|rpc| *rpc == method)
}

/// The token of an `authorization: Bearer …` header; `Some("")` for any other
/// `authorization` header, so that it is refused rather than ignored.
fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(http::header::AUTHORIZATION)?;
    let value = value.to_str().unwrap_or("");
    Some(match value.split_once(' ') {
        Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => token.trim(),
        _ => "",
    })
}

/// The caller's `grpc-timeout`: up to 8 digits and a unit.
fn grpc_timeout(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(name: &'static str, value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(name, value.parse().unwrap());
        headers
    }

    #[test]
    fn grpc_timeouts_are_read_in_every_unit() {
        let cases = [
            ("2H", Some(Duration::from_secs(7200))),
            ("3M", Some(Duration::from_secs(180))),
            ("4S", Some(Duration::from_secs(4))),
            ("250m", Some(Duration::from_millis(250))),
            ("7u", Some(Duration::from_micros(7))),
            ("1n", Some(Duration::from_nanos(1))),
            ("123456789S", None),
            ("m", None),
            ("10x", None),
            ("-1S", None),
        ];
        for (value, expected) in cases {
            assert_eq!(
                grpc_timeout(&headers("grpc-timeout", value)),
                expected,
                "{value}"
            );
        }
        assert_eq!(grpc_timeout(&HeaderMap::new()), None);
    }

    #[test]
    fn only_bearer_tokens_are_tokens() {
        assert_eq!(
            bearer_token(&headers("authorization", "Bearer abc")),
            Some("abc")
        );
        assert_eq!(
            bearer_token(&headers("authorization", "bearer abc")),
            Some("abc")
        );
        assert_eq!(
            bearer_token(&headers("authorization", "Basic abc")),
            Some("")
        );
        assert_eq!(bearer_token(&headers("authorization", "abc")), Some(""));
        assert_eq!(bearer_token(&HeaderMap::new()), None);
    }

    #[test]
    fn only_the_services_own_paths_are_guarded() {
        assert_eq!(
            rpc_of("/idempotency.v1.IdempotencyService/Claim"),
            Some("Claim")
        );
        assert_eq!(
            rpc_of("/idempotency.v1.IdempotencyService/Purge"),
            Some("Purge")
        );
        assert_eq!(rpc_of("/idempotency.v1.IdempotencyService/Nope"), None);
        assert_eq!(rpc_of("/grpc.health.v1.Health/Check"), None);
    }
}
