//! What one request goes through.
//!
//! A request on no guarded route is forwarded untouched. On a guarded one:
//!
//! 1. the key (`Idempotency-Key`, an sf-string) and the caller's identity
//!    are read, the body is read (up to the route's limit) and fingerprinted;
//! 2. Claim, with a lease token of the gateway's own, waiting up to the
//!    route's `wait` for a request with the same key in flight;
//! 3. by the Claim's outcome: the stored response is replayed
//!    (`Idempotent-Replayed: true`), or 409, 422, 410 are answered, or,
//!    holding the lease, the request is forwarded with the key and the
//!    fencing token, the lease extended while the upstream works;
//! 4. the response is stored (Complete) when its status is one the route
//!    stores and it fits the route's limit; otherwise the key is Released
//!    and the response passed through.
//!
//! From the Claim on, the work runs in a task of its own: a client that
//! disconnects does not stop it, so its response is stored (or the key
//! released) all the same. A Claim abandoned by its client mid-call is
//! released with the gateway's lease token, in case it won. Those tasks,
//! and the Completes tried again while the service is down, are tracked
//! ([`Gateway::background`]), so that a shutdown waits for them too.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::background::Background;
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http::{HeaderValue, Request, Response, header};
use http_body_util::{BodyExt, BodyStream, Full, Limited, StreamBody};
use hyper::body::Incoming;
use idempotency_proto::v1::{
    ClaimRequest, ClaimResponse, CompleteRequest, ExtendLeaseRequest, LateRetry as ProtoLateRetry,
    Outcome as ClaimOutcome, ReleaseRequest,
};
use rand::RngCore;
use tokio::task::JoinHandle;
use tonic::Code;
use tracing::{info, warn};

use crate::config::{Config, LateRetry, MissingIdentity, Route};
use crate::error::{GatewayError, is_unavailable};
use crate::metrics::{self, Outcome};
use crate::proxy::{Upstream, boxed_incoming};
use crate::request::{fingerprint, identity_suffix, parse_key};
use crate::service::Service;
use crate::stored::StoredResponse;
use crate::{Body, BoxError};

/// What every request handler shares.
pub struct Gateway {
    pub config: Config,
    pub service: Service,
    pub upstream: Upstream,
    /// The work that outlives a client's connection: a claimed request's
    /// upstream call and its Complete or Release, a Complete tried again
    /// while the service is down, the Release of an abandoned Claim. A
    /// shutdown that only drained connections would cut them off and leave
    /// their keys in progress until the lease ran out (or store nothing of
    /// an effect that happened); the server waits for them.
    pub background: Background,
}

impl Gateway {
    pub fn new(config: Config) -> Result<Self, String> {
        Ok(Self {
            service: Service::new(&config.service, config.service_token.as_deref())?,
            upstream: Upstream::new(config.upstream.clone(), config.upstream_http2),
            background: Background::default(),
            config,
        })
    }

    /// Answers one request.
    pub async fn handle(
        self: Arc<Self>,
        request: Request<Incoming>,
        peer: SocketAddr,
    ) -> Response<Body> {
        let route = self
            .config
            .route_for(request.method(), request.uri().path())
            .cloned();
        let Some(route) = route else {
            metrics::passed_through();
            return self.pass_through(request, peer).await;
        };
        match self.clone().guarded(&route, request, peer).await {
            Ok(response) => response,
            Err(error) => {
                metrics::request(&route.name, outcome_of(&error));
                error.to_response(&self.config.problem_base)
            }
        }
    }

    async fn pass_through(&self, request: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
        let (parts, body) = request.into_parts();
        let request = self.upstream.request(parts, boxed_incoming(body), peer);
        match self.upstream.send(request).await {
            Ok(response) => response,
            Err(error) => {
                warn!(%error, "the upstream could not be reached");
                GatewayError::UpstreamUnreachable.to_response(&self.config.problem_base)
            }
        }
    }

    async fn guarded(
        self: Arc<Self>,
        route: &Route,
        request: Request<Incoming>,
        peer: SocketAddr,
    ) -> Result<Response<Body>, GatewayError> {
        let key = match parse_key(request.headers().get_all(&self.config.headers.key))? {
            Some(key) => key,
            None if route.key_required => return Err(GatewayError::KeyMissing),
            None => return Ok(self.pass_through(request, peer).await),
        };
        let mut namespace = route.namespace.clone();
        if let Some(identity) = &self.config.identity {
            match identity_suffix(identity, request.headers()) {
                Some(suffix) => namespace.push_str(&suffix),
                None if identity.missing == MissingIdentity::PassThrough => {
                    return Ok(self.pass_through(request, peer).await);
                }
                None => return Err(GatewayError::IdentityMissing),
            }
        }
        let (parts, body) = request.into_parts();
        let body = match Limited::new(body, route.max_request_bytes).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(error) if error.is::<http_body_util::LengthLimitError>() => {
                return Err(GatewayError::RequestTooLarge {
                    limit: route.max_request_bytes,
                });
            }
            Err(_) => return Err(GatewayError::RequestBody),
        };
        let target = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
        let lease = Lease {
            namespace,
            key,
            token: new_lease_token(),
            fencing_token: 0,
        };
        let claim = ClaimRequest {
            namespace: lease.namespace.clone(),
            key: lease.key.clone(),
            fingerprint: fingerprint(&route.fingerprint, parts.method.as_str(), target, &body),
            lease_ttl: Some(proto_duration(route.lease_ttl)),
            retention: route.retention.map(proto_duration),
            lease_token: lease.token.clone(),
            wait: (!route.wait.is_zero()).then(|| proto_duration(route.wait)),
            late_retry: match route.late_retry {
                LateRetry::Service => ProtoLateRetry::Unspecified,
                LateRetry::Reexecute => ProtoLateRetry::Reexecute,
                LateRetry::Refuse => ProtoLateRetry::Refuse,
            } as i32,
        };
        // Until the lease is handed to the task below, dropping this (the
        // client went away mid-Claim) releases whatever the Claim may have won.
        let mut guard = ReleaseOnDrop {
            service: self.service.clone(),
            background: self.background.clone(),
            lease: Some(lease.clone()),
        };
        let answer = match self.service.claim(claim).await {
            Ok(answer) => answer,
            Err(status) => {
                guard.lease = None;
                metrics::service_error("Claim", &status);
                if route.fail_open && is_unavailable(&status) {
                    warn!(route = %route.name, code = ?status.code(),
                        "the idempotency service is unavailable: forwarding without idempotency (fail_open)");
                    metrics::request(&route.name, Outcome::FailOpen);
                    let request = self.upstream.request(
                        parts,
                        Full::new(body).map_err(|n| match n {}).boxed(),
                        peer,
                    );
                    return Ok(self.send_or_problem(request).await);
                }
                warn!(route = %route.name, code = ?status.code(), message = status.message(),
                    "Claim failed");
                return Err(GatewayError::from_status(&status));
            }
        };
        if let Some(waited) = answer.waited.and_then(|w| Duration::try_from(w).ok())
            && !waited.is_zero()
        {
            metrics::waited(&route.name, waited);
        }
        let outcome = ClaimOutcome::try_from(answer.outcome).unwrap_or(ClaimOutcome::Unspecified);
        if outcome != ClaimOutcome::Claimed {
            guard.lease = None;
        }
        match outcome {
            ClaimOutcome::Claimed => {
                let lease = Lease {
                    fencing_token: answer.fencing_token,
                    ..guard.lease.take().expect("armed until here")
                };
                if answer.completed_at.is_some() {
                    info!(route = %route.name, fencing_token = lease.fencing_token,
                        "a late retry after the stored response expired: running it again");
                    metrics::late_retry_reexecuted(&route.name);
                }
                let gateway = self.clone();
                let route = route.clone();
                let (tx, rx) = tokio::sync::oneshot::channel();
                self.background.spawn(async move {
                    let response = gateway.run_claimed(&route, lease, parts, body, peer).await;
                    let _ = tx.send(response);
                });
                Ok(rx.await.unwrap_or_else(|_| {
                    GatewayError::UpstreamUnreachable.to_response(&self.config.problem_base)
                }))
            }
            ClaimOutcome::Completed => replay(route, &answer),
            ClaimOutcome::InProgress => Err(GatewayError::InProgress {
                retry_after: answer
                    .retry_after
                    .and_then(|d| Duration::try_from(d).ok())
                    .unwrap_or(Duration::from_secs(1)),
            }),
            ClaimOutcome::FingerprintMismatch => Err(GatewayError::FingerprintMismatch),
            ClaimOutcome::Expired => Err(GatewayError::LateRetryRefused {
                completed_at: answer.completed_at.map(|t| t.to_string()),
            }),
            ClaimOutcome::Unspecified => Err(GatewayError::ServiceRefused(
                "the Claim's outcome is unknown to this gateway".to_owned(),
            )),
        }
    }

    async fn send_or_problem(&self, request: Request<Body>) -> Response<Body> {
        match self.upstream.send(request).await {
            Ok(response) => response,
            Err(error) => {
                warn!(%error, "the upstream could not be reached");
                GatewayError::UpstreamUnreachable.to_response(&self.config.problem_base)
            }
        }
    }

    /// Holding the lease: forward, keep the lease alive, then store the
    /// response or release the key. Runs in a task of its own.
    async fn run_claimed(
        &self,
        route: &Route,
        lease: Lease,
        mut parts: http::request::Parts,
        body: Bytes,
        peer: SocketAddr,
    ) -> Response<Body> {
        let problem_base = &self.config.problem_base;
        let heartbeat = Heartbeat::start(self.service.clone(), lease.clone(), route.lease_ttl);
        let headers = &self.config.headers;
        if let Some(value) = parts.headers.get(&headers.key).cloned() {
            parts.headers.remove(&headers.key);
            parts.headers.insert(headers.forward_key.clone(), value);
        }
        parts.headers.insert(
            headers.fencing_token.clone(),
            HeaderValue::from(lease.fencing_token),
        );
        let request =
            self.upstream
                .request(parts, Full::new(body).map_err(|n| match n {}).boxed(), peer);
        let sent = tokio::time::timeout(route.upstream_timeout, self.upstream.send(request)).await;
        let response = match sent {
            Ok(Ok(response)) => response,
            Ok(Err(error)) => {
                warn!(route = %route.name, %error, "the upstream could not be reached: releasing the key");
                self.release_with(route, &lease, heartbeat, Outcome::ReleasedUpstreamError)
                    .await;
                return GatewayError::UpstreamUnreachable.to_response(problem_base);
            }
            Err(_) => {
                warn!(route = %route.name, "the upstream did not answer in time: releasing the key");
                self.release_with(route, &lease, heartbeat, Outcome::ReleasedUpstreamError)
                    .await;
                return GatewayError::UpstreamTimeout.to_response(problem_base);
            }
        };
        let status = response.status();
        if !route.stores(status) {
            self.release_with(route, &lease, heartbeat, Outcome::ReleasedStatus)
                .await;
            return response;
        }
        let limit = route.max_stored_bytes;
        let declared = response
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok());
        if declared.is_some_and(|length| length > limit) {
            self.too_large(route, &lease, heartbeat).await;
            return response;
        }
        let (head, body) = response.into_parts();
        let mut stream = BodyStream::new(body);
        let mut buffer = BytesMut::new();
        let mut trailers = None;
        let read = tokio::time::timeout(route.upstream_timeout, async {
            while let Some(frame) = stream.next().await {
                let frame = frame?;
                match frame.into_data() {
                    Ok(data) => {
                        buffer.extend_from_slice(&data);
                        if buffer.len() > limit {
                            return Ok::<bool, BoxError>(false);
                        }
                    }
                    Err(frame) => trailers = frame.into_trailers().ok(),
                }
            }
            Ok(true)
        })
        .await;
        match read {
            Ok(Ok(true)) => {}
            Ok(Ok(false)) => {
                // Over the limit: released, and what was read goes out
                // first, then the rest as it streams.
                self.too_large(route, &lease, heartbeat).await;
                let prefix = futures_util::stream::once(async move {
                    Ok::<_, BoxError>(hyper::body::Frame::data(buffer.freeze()))
                });
                let body = StreamBody::new(prefix.chain(stream));
                return Response::from_parts(head, BodyExt::boxed(body));
            }
            Ok(Err(error)) => {
                warn!(route = %route.name, %error, "the upstream broke off its response: releasing the key");
                self.release_with(route, &lease, heartbeat, Outcome::ReleasedUpstreamError)
                    .await;
                return GatewayError::UpstreamUnreachable.to_response(problem_base);
            }
            Err(_) => {
                warn!(route = %route.name, "the upstream's response body did not finish in time: releasing the key");
                self.release_with(route, &lease, heartbeat, Outcome::ReleasedUpstreamError)
                    .await;
                return GatewayError::UpstreamTimeout.to_response(problem_base);
            }
        }
        let body = buffer.freeze();
        let stored =
            StoredResponse::capture(status, &head.headers, &route.replay_headers, body.clone());
        let respond = move || {
            let mut response =
                Response::from_parts(head, Full::new(body).map_err(|n| match n {}).boxed());
            if trailers.is_some() {
                // Trailers are neither stored nor replayed; the first answer
                // goes without them too, so that every answer is the same.
                response.headers_mut().remove(header::TRAILER);
            }
            response
        };
        if stored.encoded_len() > limit {
            self.too_large(route, &lease, heartbeat).await;
            return respond();
        }
        let complete = CompleteRequest {
            namespace: lease.namespace.clone(),
            key: lease.key.clone(),
            lease_token: lease.token.clone(),
            response: stored.encode(),
            retention: route.retention.map(proto_duration),
        };
        let result = self.service.complete(complete.clone()).await;
        match result {
            Ok(()) => metrics::request(&route.name, Outcome::Stored),
            Err(status)
                if status.code() == Code::InvalidArgument || status.code() == Code::OutOfRange =>
            {
                // The service's own limit is below the route's.
                warn!(route = %route.name, message = status.message(),
                    "the service refused to store the response (larger than its limit?): releasing the key");
                self.release_with(route, &lease, heartbeat, Outcome::ReleasedTooLarge)
                    .await;
            }
            Err(status) if is_unavailable(&status) => {
                // The effect happened: the client gets its answer now, and
                // the response is stored once the service is back. The lease
                // is kept alive meanwhile, so a retry waits for it instead
                // of running the request again.
                metrics::service_error("Complete", &status);
                warn!(route = %route.name, code = ?status.code(),
                    "Complete failed: the service is unavailable; storing the response when it is back");
                self.background.spawn(complete_later(
                    self.service.clone(),
                    route.name.clone(),
                    complete,
                    heartbeat,
                ));
            }
            Err(status) => {
                // A lost lease (another holder took the key over after this
                // one ran out): its answer stands, this one is not stored.
                drop(heartbeat);
                metrics::service_error("Complete", &status);
                warn!(route = %route.name, code = ?status.code(), message = status.message(),
                    "Complete refused: the response was not stored");
                metrics::request(&route.name, Outcome::CompleteFailed);
            }
        }
        respond()
    }

    async fn too_large(&self, route: &Route, lease: &Lease, heartbeat: Heartbeat) {
        warn!(route = %route.name, limit = route.max_stored_bytes,
            "the response is larger than the route stores: releasing the key and passing it through");
        self.release_with(route, lease, heartbeat, Outcome::ReleasedTooLarge)
            .await;
    }

    /// Stops the heartbeat, releases the key, counts the outcome.
    async fn release_with(
        &self,
        route: &Route,
        lease: &Lease,
        heartbeat: Heartbeat,
        outcome: Outcome,
    ) {
        drop(heartbeat);
        self.release(lease).await;
        metrics::request(&route.name, outcome);
    }

    async fn release(&self, lease: &Lease) {
        if let Err(status) = self.service.release(lease.release_request()).await {
            metrics::service_error("Release", &status);
            warn!(code = ?status.code(), message = status.message(),
                "Release failed: the key stays in progress until its lease runs out");
        }
    }
}

/// How long a Complete refused for unavailability is tried again in the
/// background (the service down, or unreachable, that long).
const COMPLETE_LATER_FOR: Duration = Duration::from_secs(300);

/// Tries a Complete again until it lands, is refused, or
/// [`COMPLETE_LATER_FOR`] has passed, the lease kept alive all along.
async fn complete_later(
    service: Service,
    route: String,
    complete: CompleteRequest,
    heartbeat: Heartbeat,
) {
    let give_up = tokio::time::Instant::now() + COMPLETE_LATER_FOR;
    let mut delay = Duration::from_millis(100);
    loop {
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(1));
        match service.complete(complete.clone()).await {
            Ok(()) => {
                info!(route = %route, "the response was stored once the service was back");
                metrics::request(&route, Outcome::Stored);
                break;
            }
            Err(status) if is_unavailable(&status) && tokio::time::Instant::now() < give_up => {}
            Err(status) => {
                metrics::service_error("Complete", &status);
                warn!(route = %route, code = ?status.code(), message = status.message(),
                    "the response could not be stored: a retry after the lease runs out runs the request again");
                metrics::request(&route, Outcome::CompleteFailed);
                break;
            }
        }
    }
    drop(heartbeat);
}

fn replay(route: &Route, answer: &ClaimResponse) -> Result<Response<Body>, GatewayError> {
    let stored = StoredResponse::decode(&answer.response).ok_or_else(|| {
        warn!(route = %route.name, "a stored response this gateway cannot read (written by another client?)");
        GatewayError::StoredResponseInvalid
    })?;
    metrics::request(&route.name, Outcome::Replayed);
    Ok(stored.replay())
}

fn outcome_of(error: &GatewayError) -> Outcome {
    match error {
        GatewayError::InProgress { .. } => Outcome::InProgress,
        GatewayError::FingerprintMismatch => Outcome::Mismatch,
        GatewayError::LateRetryRefused { .. } => Outcome::LateRetryRefused,
        GatewayError::ServiceUnavailable { .. } => Outcome::ServiceUnavailable,
        GatewayError::ServiceRefused(_) | GatewayError::StoredResponseInvalid => {
            Outcome::ServiceError
        }
        GatewayError::UpstreamUnreachable | GatewayError::UpstreamTimeout => {
            Outcome::ReleasedUpstreamError
        }
        GatewayError::KeyMissing
        | GatewayError::KeyInvalid(_)
        | GatewayError::IdentityMissing
        | GatewayError::RequestTooLarge { .. }
        | GatewayError::RequestBody => Outcome::Rejected,
    }
}

/// A lease the gateway holds (or may hold, before the Claim answers).
#[derive(Debug, Clone)]
struct Lease {
    namespace: String,
    key: String,
    token: String,
    fencing_token: u64,
}

impl Lease {
    fn release_request(&self) -> ReleaseRequest {
        ReleaseRequest {
            namespace: self.namespace.clone(),
            key: self.key.clone(),
            lease_token: self.token.clone(),
            checkpoint: None,
        }
    }
}

/// Releases its lease when dropped while still holding one.
struct ReleaseOnDrop {
    service: Service,
    background: Background,
    lease: Option<Lease>,
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            let service = self.service.clone();
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let background = self.background.clone();
                runtime.spawn(background.track(async move {
                    // A Claim that did not win answers this with an error:
                    // the token is ours alone, so nothing else is released.
                    let _ = service.release(lease.release_request()).await;
                }));
            }
        }
    }
}

/// Extends the lease every third of its TTL until dropped.
struct Heartbeat(JoinHandle<()>);

impl Heartbeat {
    fn start(service: Service, lease: Lease, ttl: Duration) -> Self {
        Self(tokio::spawn(async move {
            let period = ttl / 3;
            loop {
                tokio::time::sleep(period).await;
                let request = ExtendLeaseRequest {
                    namespace: lease.namespace.clone(),
                    key: lease.key.clone(),
                    lease_token: lease.token.clone(),
                    lease_ttl: Some(proto_duration(ttl)),
                    checkpoint: None,
                };
                if let Err(status) = service.extend_lease(request).await {
                    metrics::service_error("ExtendLease", &status);
                    if !is_unavailable(&status) {
                        warn!(code = ?status.code(), message = status.message(),
                            "the lease was lost while the upstream worked: its response will not be stored");
                        return;
                    }
                }
            }
        }))
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// 128 random bits in lowercase hex: the lease token the gateway chooses,
/// which makes its Claim safe to retry.
fn new_lease_token() -> String {
    let mut bytes = [0u8; 16];
    rand::rng().fill_bytes(&mut bytes);
    hex::encode(bytes)
}

fn proto_duration(duration: Duration) -> prost_types::Duration {
    prost_types::Duration::try_from(duration).expect("configured durations are in range")
}
