//! The gRPC client of idempotency-service, with the retry rules every stock
//! client gets from `clients/service-config.json` (read from that file at
//! build time, so the gateway follows it): per method, a timeout for the
//! whole call, and up to `maxAttempts` attempts on the retryable codes, with
//! gRPC's jittered exponential backoff. A delay the status's RetryInfo asks
//! for is waited at least. Every call here is safe to repeat: the Claim
//! carries a lease token of the gateway's own (a retried Claim gets its own
//! lease back), and Complete, Release and ExtendLease are idempotent.

use std::future::Future;
use std::time::Duration;

use idempotency_proto::v1::idempotency_service_client::IdempotencyServiceClient;
use idempotency_proto::v1::{
    ClaimRequest, ClaimResponse, CompleteRequest, ExtendLeaseRequest, GetRequest, ReleaseRequest,
};
use rand::Rng;
use serde::Deserialize;
use tokio::time::Instant;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Status};

/// The service config the clients publish, compiled in.
const SERVICE_CONFIG: &str = include_str!("../../clients/service-config.json");

/// One method's rules.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    pub timeout: Duration,
    pub max_attempts: u32,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    pub multiplier: f64,
    pub retryable: Vec<Code>,
}

/// The rules of each method the gateway calls.
#[derive(Debug, Clone)]
pub struct RetryPolicies {
    pub claim: RetryPolicy,
    pub complete: RetryPolicy,
    pub release: RetryPolicy,
    pub extend_lease: RetryPolicy,
    pub get: RetryPolicy,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ServiceConfigFile {
    method_config: Vec<MethodConfig>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct MethodConfig {
    name: Vec<MethodName>,
    timeout: String,
    retry_policy: RetryPolicyFile,
}

#[derive(Deserialize)]
struct MethodName {
    method: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RetryPolicyFile {
    max_attempts: u32,
    initial_backoff: String,
    max_backoff: String,
    backoff_multiplier: f64,
    retryable_status_codes: Vec<String>,
}

fn seconds(text: &str) -> Result<Duration, String> {
    let number = text
        .strip_suffix('s')
        .ok_or_else(|| format!("{text:?}: a duration in seconds, as \"0.1s\""))?;
    let value: f64 = number.parse().map_err(|e| format!("{text:?}: {e}"))?;
    Ok(Duration::from_secs_f64(value))
}

fn code(name: &str) -> Result<Code, String> {
    Ok(match name {
        "UNAVAILABLE" => Code::Unavailable,
        "RESOURCE_EXHAUSTED" => Code::ResourceExhausted,
        "DEADLINE_EXCEEDED" => Code::DeadlineExceeded,
        "ABORTED" => Code::Aborted,
        "INTERNAL" => Code::Internal,
        other => {
            return Err(format!(
                "retryable code {other:?} is not one the gateway knows"
            ));
        }
    })
}

impl RetryPolicies {
    /// The policies of clients/service-config.json.
    pub fn published() -> Result<Self, String> {
        Self::parse(SERVICE_CONFIG)
    }

    fn parse(text: &str) -> Result<Self, String> {
        let file: ServiceConfigFile = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let find = |method: &str| -> Result<RetryPolicy, String> {
            let config = file
                .method_config
                .iter()
                .find(|c| c.name.iter().any(|n| n.method == method))
                .ok_or_else(|| format!("no methodConfig names {method}"))?;
            let retry = &config.retry_policy;
            Ok(RetryPolicy {
                timeout: seconds(&config.timeout)?,
                max_attempts: retry.max_attempts.clamp(1, 5),
                initial_backoff: seconds(&retry.initial_backoff)?,
                max_backoff: seconds(&retry.max_backoff)?,
                multiplier: retry.backoff_multiplier,
                retryable: retry
                    .retryable_status_codes
                    .iter()
                    .map(|c| code(c))
                    .collect::<Result<_, _>>()?,
            })
        };
        Ok(Self {
            claim: find("Claim")?,
            complete: find("Complete")?,
            release: find("Release")?,
            extend_lease: find("ExtendLease")?,
            get: find("Get")?,
        })
    }
}

/// The service, as the gateway calls it.
#[derive(Clone)]
pub struct Service {
    client: IdempotencyServiceClient<Channel>,
    policies: RetryPolicies,
    /// `Bearer <token>` for the service's access policy, when configured.
    authorization: Option<MetadataValue<Ascii>>,
}

impl Service {
    /// A client of the service at `uri`; connections are made on first use
    /// and again after a failure, so the gateway starts without the service.
    pub fn new(uri: &http::Uri, token: Option<&str>) -> Result<Self, String> {
        let authorization =
            match token {
                None => None,
                Some(token) => Some(MetadataValue::try_from(format!("Bearer {token}")).map_err(
                    |_| "service_token_file: the token is not printable ASCII".to_owned(),
                )?),
            };
        let endpoint = Endpoint::from_shared(uri.to_string())
            .map_err(|e| format!("service: {e}"))?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_while_idle(true);
        Ok(Self {
            client: IdempotencyServiceClient::new(endpoint.connect_lazy()),
            policies: RetryPolicies::published()?,
            authorization,
        })
    }

    /// Claim, waiting up to the request's `wait` for a holder: the call's
    /// timeout is stretched to cover the wait.
    pub async fn claim(&self, request: ClaimRequest) -> Result<ClaimResponse, Status> {
        let wait = request
            .wait
            .and_then(|w| Duration::try_from(w).ok())
            .unwrap_or_default();
        let mut policy = self.policies.claim.clone();
        policy.timeout = policy.timeout.max(wait + Duration::from_secs(5));
        call(&policy, self, request, |mut c, r| async move {
            c.claim(r).await
        })
        .await
    }

    pub async fn complete(&self, request: CompleteRequest) -> Result<(), Status> {
        call(
            &self.policies.complete,
            self,
            request,
            |mut c, r| async move { c.complete(r).await },
        )
        .await
        .map(drop)
    }

    pub async fn release(&self, request: ReleaseRequest) -> Result<(), Status> {
        call(
            &self.policies.release,
            self,
            request,
            |mut c, r| async move { c.release(r).await },
        )
        .await
        .map(drop)
    }

    pub async fn extend_lease(&self, request: ExtendLeaseRequest) -> Result<(), Status> {
        call(
            &self.policies.extend_lease,
            self,
            request,
            |mut c, r| async move { c.extend_lease(r).await },
        )
        .await
        .map(drop)
    }

    /// One Get without retries, within `timeout`: whether the service
    /// answers at all (readiness). Any answer from the service counts,
    /// a refusal included; only an unreachable service does not.
    pub async fn ping(&self, timeout: Duration) -> bool {
        let mut request = self.request(GetRequest {
            namespace: "idempotency-gateway".to_owned(),
            key: "readiness".to_owned(),
        });
        request.set_timeout(timeout);
        let answer = tokio::time::timeout(timeout, self.client.clone().get(request)).await;
        match answer {
            Ok(Ok(_)) => true,
            Ok(Err(status)) => !crate::error::is_unavailable(&status),
            Err(_) => false,
        }
    }

    pub fn policies(&self) -> &RetryPolicies {
        &self.policies
    }

    /// A request carrying the credentials, if any.
    fn request<T>(&self, message: T) -> Request<T> {
        let mut request = Request::new(message);
        if let Some(authorization) = &self.authorization {
            request
                .metadata_mut()
                .insert("authorization", authorization.clone());
        }
        request
    }
}

/// One call under `policy`: attempts until success, a code that is not
/// retryable, the last attempt, or the call's timeout.
async fn call<Req, Resp, F, Fut>(
    policy: &RetryPolicy,
    service: &Service,
    message: Req,
    send: F,
) -> Result<Resp, Status>
where
    Req: Clone,
    F: Fn(IdempotencyServiceClient<Channel>, Request<Req>) -> Fut,
    Fut: Future<Output = Result<tonic::Response<Resp>, Status>>,
{
    let deadline = Instant::now() + policy.timeout;
    let mut backoff = policy.initial_backoff;
    let mut attempt = 1;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Status::deadline_exceeded("the call's timeout passed"));
        }
        let mut request = service.request(message.clone());
        request.set_timeout(left);
        let status = match tokio::time::timeout(left, send(service.client.clone(), request)).await {
            Ok(Ok(response)) => return Ok(response.into_inner()),
            Ok(Err(status)) => status,
            Err(_) => return Err(Status::deadline_exceeded("the call's timeout passed")),
        };
        if attempt >= policy.max_attempts || !policy.retryable.contains(&status.code()) {
            return Err(status);
        }
        // gRPC's retry backoff: uniform in [0, backoff), the backoff growing
        // by the multiplier up to its maximum; RetryInfo's delay at least.
        let jittered = backoff.mul_f64(rand::rng().random::<f64>());
        let delay = jittered.max(crate::error::retry_delay(&status).unwrap_or_default());
        if Instant::now() + delay >= deadline {
            return Err(status);
        }
        tokio::time::sleep(delay).await;
        backoff = backoff.mul_f64(policy.multiplier).min(policy.max_backoff);
        attempt += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_published_config_is_read() {
        let policies = RetryPolicies::published().unwrap();
        assert_eq!(policies.claim.timeout, Duration::from_secs(30));
        assert_eq!(policies.complete.timeout, Duration::from_secs(10));
        for policy in [&policies.claim, &policies.complete, &policies.release] {
            assert_eq!(policy.max_attempts, 5);
            assert_eq!(policy.initial_backoff, Duration::from_millis(100));
            assert_eq!(policy.max_backoff, Duration::from_secs(2));
            assert_eq!(policy.retryable, vec![Code::Unavailable]);
        }
    }

    #[tokio::test]
    async fn retries_the_retryable_codes_only() {
        let service = Service::new(&http::Uri::from_static("http://127.0.0.1:1"), None).unwrap();
        let policy = RetryPolicy {
            timeout: Duration::from_secs(5),
            max_attempts: 3,
            initial_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(2),
            multiplier: 2.0,
            retryable: vec![Code::Unavailable],
        };
        let attempts = std::sync::atomic::AtomicU32::new(0);
        let result: Result<(), Status> = call(&policy, &service, (), |_, _| {
            attempts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async { Err(Status::unavailable("down")) }
        })
        .await;
        assert_eq!(result.unwrap_err().code(), Code::Unavailable);
        assert_eq!(attempts.load(std::sync::atomic::Ordering::SeqCst), 3);
        attempts.store(0, std::sync::atomic::Ordering::SeqCst);
        let result: Result<(), Status> = call(&policy, &service, (), |_, _| {
            attempts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async { Err(Status::failed_precondition("lost")) }
        })
        .await;
        assert_eq!(result.unwrap_err().code(), Code::FailedPrecondition);
        assert_eq!(attempts.load(std::sync::atomic::Ordering::SeqCst), 1);
    }
}
