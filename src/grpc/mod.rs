//! The gRPC adapter: parses each request into domain types at the edge
//! (INVALID_ARGUMENT naming the field), calls the lifecycle, and converts the
//! outcome back into the wire types.
//!
//! Each call runs in a span (the parent taken from incoming W3C trace context)
//! and ends with one log line and its metrics: method, namespace, the caller's
//! identity, outcome, fencing token, the caller's `x-request-id`, latency.
//! Never response bytes, fingerprints or tokens. Calls reach this adapter
//! through `guard` (credentials, RPC grant, limits, deadline); the adapter
//! checks each namespace against the caller's grant once the request parses.

pub mod codec;
#[cfg(test)]
mod fuzz;
pub mod guard;
pub mod proto;
pub mod status;

use std::time::{Duration, Instant, SystemTime};

use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use self::guard::{CallDeadline, Caller};
use crate::domain::{
    ClaimOutcome, Fingerprint, Key, LateRetry, LeaseToken, Namespace, Purged, RecordState,
};
use crate::error::Error;
use crate::lifecycle::{self, Inspection, Lifecycle};
use crate::metrics::{self, CallRecord, NamespaceLabels};
use crate::store::Store;

/// Longest `x-request-id` kept for the log; longer ones are cut.
const MAX_REQUEST_ID_CHARS: usize = 128;
/// Longest purge reason kept for the log.
const MAX_REASON_BYTES: usize = 256;

use proto::idempotency_service_server::IdempotencyService;

pub use self::proto::SERVICE_NAME;

pub struct IdempotencyApi<S> {
    lifecycle: Lifecycle<S>,
    labels: NamespaceLabels,
    /// The most items in one ClaimBatch or CompleteBatch.
    max_batch_items: usize,
}

impl<S: Store> IdempotencyApi<S> {
    /// The adapter. Installs the service's status for requests that are not
    /// valid protobuf in the generated server's codec (`codec::install`), so
    /// that any server built around the adapter answers them as the service
    /// answers every refusal.
    pub fn new(lifecycle: Lifecycle<S>, labels: NamespaceLabels, max_batch_items: usize) -> Self {
        codec::install();
        Self {
            lifecycle,
            labels,
            max_batch_items,
        }
    }

    fn check_batch_size(&self, items: usize) -> Result<(), Error> {
        if items == 0 {
            return Err(Error::invalid("items", "must not be empty"));
        }
        if items > self.max_batch_items {
            return Err(Error::invalid(
                "items",
                format!(
                    "must be at most {} items, got {items}",
                    self.max_batch_items
                ),
            ));
        }
        Ok(())
    }

    fn start<T>(&self, method: &'static str, request: &Request<T>) -> (CallLog, tracing::Span) {
        let span = tracing::debug_span!(
            "rpc",
            otel.name = method,
            otel.kind = "server",
            rpc.system = "grpc",
            rpc.service = SERVICE_NAME,
            rpc.method = method,
        );
        // The caller's trace context matters only when the span is recorded
        // (traces exported): otherwise reading it is work for nothing.
        if !span.is_disabled() {
            let parent = opentelemetry::global::get_text_map_propagator(|propagator| {
                propagator.extract(&MetadataExtractor(request.metadata()))
            });
            let _ = span.set_parent(parent);
        }
        let request_id = request
            .metadata()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .map(|id| id.chars().take(MAX_REQUEST_ID_CHARS).collect());
        let log = CallLog {
            method,
            started: Instant::now(),
            namespace: None,
            request_id,
            fencing_token: None,
            took_over: false,
            labels: self.labels.clone(),
            caller: request
                .extensions()
                .get::<Caller>()
                .cloned()
                .unwrap_or(Caller(None)),
        };
        (log, span)
    }
}

/// Reads W3C trace context (`traceparent`, `tracestate`) from gRPC metadata.
struct MetadataExtractor<'a>(&'a MetadataMap);

impl opentelemetry::propagation::Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// The per-call log line and metrics, filled in as the call goes.
struct CallLog {
    method: &'static str,
    started: Instant,
    namespace: Option<Namespace>,
    request_id: Option<String>,
    fencing_token: Option<u64>,
    took_over: bool,
    labels: NamespaceLabels,
    /// Who is calling, as the guard found; asked about each namespace.
    caller: Caller,
}

impl CallLog {
    /// Logs the call, records its metrics, and turns its result into the wire's.
    fn finish<T, R>(
        self,
        result: Result<T, Error>,
        outcome: impl FnOnce(&T) -> &'static str,
        respond: impl FnOnce(T) -> R,
    ) -> Result<Response<R>, Status> {
        let latency = self.started.elapsed();
        let (outcome, code) = match &result {
            Ok(value) => (outcome(value), "ok"),
            Err(error) => {
                let code = status::code_name(status::code_of(error));
                (code, code)
            }
        };
        let lease_lost = matches!(result, Err(Error::LeaseMismatch(..)));
        let reason = result.as_ref().err().map(Error::reason);
        tracing::info!(
            method = self.method,
            namespace = self.namespace.as_ref().map_or("", Namespace::as_str),
            identity = self.caller.name(),
            outcome,
            reason = reason.map(|r| r.as_str()),
            fencing_token = self.fencing_token,
            request_id = self.request_id.as_deref(),
            latency_us = latency.as_micros() as u64,
            "call"
        );
        metrics::record_call(
            &self.labels,
            CallRecord {
                method: self.method,
                code,
                namespace: self.namespace.as_ref(),
                latency,
                claim_outcome: (self.method == "Claim" && code == "ok").then_some(outcome),
                took_over: self.took_over,
                lease_lost,
                reason,
            },
        );
        result
            .map(|value| Response::new(respond(value)))
            .map_err(status::to_status)
    }
}

/// A wire duration as a std one; unset stays unset.
fn duration(
    field: &'static str,
    value: Option<prost_types::Duration>,
) -> Result<Option<Duration>, Error> {
    value
        .map(|d| {
            if !(-999_999_999..=999_999_999).contains(&d.nanos) {
                return Err(Error::invalid(field, "nanos out of range"));
            }
            Duration::try_from(d).map_err(|_| Error::invalid(field, "must not be negative"))
        })
        .transpose()
}

fn timestamp(t: SystemTime) -> Option<prost_types::Timestamp> {
    Some(prost_types::Timestamp::from(t))
}

fn wire_duration(d: Duration) -> Option<prost_types::Duration> {
    prost_types::Duration::try_from(d).ok()
}

/// Parses namespace and key, remembering the namespace for the log, and
/// checks that the caller may use the namespace.
fn namespaced_key(
    log: &mut CallLog,
    namespace: String,
    key: String,
) -> Result<(Namespace, Key), Error> {
    let namespace = Namespace::parse(namespace)?;
    log.namespace = Some(namespace.clone());
    let key = Key::parse(key)?;
    log.caller.check_namespace(&namespace)?;
    Ok((namespace, key))
}

/// Checks that the caller may use the namespace of every item of a batch.
fn check_items<'a>(
    caller: &Caller,
    namespaces: impl Iterator<Item = &'a Namespace>,
) -> Result<(), Error> {
    namespaces
        .enumerate()
        .try_for_each(|(i, namespace)| caller.check_namespace(namespace).map_err(|e| e.at_item(i)))
}

fn parse_claim(request: proto::ClaimRequest) -> Result<lifecycle::ClaimRequest, Error> {
    Ok(lifecycle::ClaimRequest {
        namespace: Namespace::parse(request.namespace)?,
        key: Key::parse(request.key)?,
        fingerprint: Fingerprint::parse(request.fingerprint)?,
        lease_ttl: duration("lease_ttl", request.lease_ttl)?,
        retention: duration("retention", request.retention)?,
        // Empty: the server makes the token (a Claim that is not retry-safe).
        lease_token: match request.lease_token.as_str() {
            "" => None,
            token => Some(LeaseToken::parse(token)?),
        },
        late_retry: late_retry(request.late_retry)?,
    })
}

/// A Claim's late-retry policy; unspecified: the namespace's.
fn late_retry(value: i32) -> Result<Option<LateRetry>, Error> {
    match proto::LateRetry::try_from(value) {
        Ok(proto::LateRetry::Unspecified) => Ok(None),
        Ok(proto::LateRetry::Reexecute) => Ok(Some(LateRetry::Reexecute)),
        Ok(proto::LateRetry::Refuse) => Ok(Some(LateRetry::Refuse)),
        Err(_) => Err(Error::invalid(
            "late_retry",
            format!("{value} is not a LateRetry value"),
        )),
    }
}

/// A ClaimBatch item: a Claim that does not wait (a batch answers at once).
fn parse_batch_claim(request: proto::ClaimRequest) -> Result<lifecycle::ClaimRequest, Error> {
    if request.wait.is_some_and(|w| w.seconds != 0 || w.nanos != 0) {
        return Err(Error::invalid(
            "wait",
            "a ClaimBatch item cannot wait; send a Claim of its own",
        ));
    }
    parse_claim(request)
}

/// How much earlier than the call's deadline a waiting Claim answers, so
/// that its answer reaches the caller in time: a tenth of the time left, at
/// least 10 ms and at most 250 ms.
fn answer_margin(left: Duration) -> Duration {
    (left / 10).clamp(Duration::from_millis(10), Duration::from_millis(250))
}

/// When a waiting Claim must answer by, early enough to reach the caller
/// before the call's deadline: fixed when the call arrives, so that a slow
/// first step shortens the wait instead of pushing it past the deadline.
fn answer_by(deadline: Option<tokio::time::Instant>) -> Option<tokio::time::Instant> {
    deadline.map(|deadline| {
        let now = tokio::time::Instant::now();
        let left = deadline.saturating_duration_since(now);
        now + left.saturating_sub(answer_margin(left))
    })
}

fn parse_complete(request: proto::CompleteRequest) -> Result<lifecycle::CompleteRequest, Error> {
    Ok(lifecycle::CompleteRequest {
        namespace: Namespace::parse(request.namespace)?,
        key: Key::parse(request.key)?,
        lease_token: LeaseToken::parse(&request.lease_token)?,
        response: request.response,
        retention: duration("retention", request.retention)?,
        remember_for: None,
    })
}

/// Parses every item of a batch; the first invalid one fails the call, named.
fn parse_items<T, U>(items: Vec<T>, parse: fn(T) -> Result<U, Error>) -> Result<Vec<U>, Error> {
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| parse(item).map_err(|e| e.at_item(i)))
        .collect()
}

/// The namespace a batch is logged under: the common one, or none when mixed.
fn batch_namespace<'a>(mut namespaces: impl Iterator<Item = &'a Namespace>) -> Option<Namespace> {
    let first = namespaces.next()?;
    namespaces.all(|n| n == first).then(|| first.clone())
}

fn complete_result(result: Result<SystemTime, Error>) -> proto::CompleteResult {
    match result {
        Ok(expires_at) => proto::CompleteResult {
            code: tonic::Code::Ok as i32,
            message: String::new(),
            expires_at: timestamp(expires_at),
            reason: String::new(),
            retry_after: None,
        },
        Err(error) => {
            let proto::ItemError {
                code,
                message,
                reason,
                retry_after,
            } = status::item_error(&error);
            proto::CompleteResult {
                code,
                message,
                expires_at: None,
                reason,
                retry_after,
            }
        }
    }
}

fn claim_response(outcome: ClaimOutcome) -> proto::ClaimResponse {
    use proto::{ClaimResponse, Outcome};
    match outcome {
        ClaimOutcome::Claimed {
            lease,
            retried,
            completed_before,
            ..
        } => {
            let (checkpoint, checkpoint_fencing_token) = lease
                .checkpoint
                .map_or((Vec::new(), 0), |c| (c.data, c.fencing_token));
            ClaimResponse {
                outcome: Outcome::Claimed as i32,
                lease_token: lease.lease_token.to_string(),
                fencing_token: lease.fencing_token,
                lease_expires_at: timestamp(lease.lease_expires_at),
                expires_at: timestamp(lease.expires_at),
                checkpoint,
                checkpoint_fencing_token,
                retried,
                completed_at: completed_before.and_then(timestamp),
                ..Default::default()
            }
        }
        ClaimOutcome::InProgress {
            lease_expires_at,
            retry_after,
            expires_at,
        } => ClaimResponse {
            outcome: Outcome::InProgress as i32,
            lease_expires_at: timestamp(lease_expires_at),
            retry_after: wire_duration(retry_after),
            expires_at: timestamp(expires_at),
            ..Default::default()
        },
        ClaimOutcome::Completed {
            response,
            expires_at,
        } => ClaimResponse {
            outcome: Outcome::Completed as i32,
            response,
            expires_at: timestamp(expires_at),
            ..Default::default()
        },
        ClaimOutcome::FingerprintMismatch => ClaimResponse {
            outcome: Outcome::FingerprintMismatch as i32,
            ..Default::default()
        },
        ClaimOutcome::Expired {
            completed_at,
            fencing_token,
        } => ClaimResponse {
            outcome: Outcome::Expired as i32,
            completed_at: timestamp(completed_at),
            fencing_token,
            ..Default::default()
        },
    }
}

fn get_response(found: Inspection) -> proto::GetResponse {
    use proto::State;
    let record = match found {
        Inspection::Live(record) => record,
        Inspection::Absent => {
            return proto::GetResponse {
                state: State::Absent as i32,
                ..Default::default()
            };
        }
        Inspection::Remembered(marker) => {
            return proto::GetResponse {
                state: State::Absent as i32,
                fencing_token: marker.fencing_token,
                fingerprint: marker
                    .fingerprint
                    .map(Fingerprint::into_bytes)
                    .unwrap_or_default(),
                expires_at: timestamp(marker.expired_at),
                created_at: timestamp(marker.created_at),
                updated_at: timestamp(marker.completed_at),
                completed_at: timestamp(marker.completed_at),
                remembered_until: timestamp(marker.remembered_until),
                ..Default::default()
            };
        }
    };
    let completed = record.state == RecordState::Completed;
    let (checkpoint, checkpoint_fencing_token) = record
        .open_checkpoint()
        .map_or((Vec::new(), 0), |c| (c.data.clone(), c.fencing_token));
    proto::GetResponse {
        state: wire_state(record.state) as i32,
        fencing_token: record.fencing_token,
        fingerprint: record
            .fingerprint
            .map(Fingerprint::into_bytes)
            .unwrap_or_default(),
        response: record.response.unwrap_or_default(),
        lease_expires_at: record.lease_expires_at.and_then(timestamp),
        expires_at: timestamp(record.expires_at),
        created_at: timestamp(record.created_at),
        updated_at: timestamp(record.updated_at),
        checkpoint,
        checkpoint_fencing_token,
        completed_at: completed.then_some(record.updated_at).and_then(timestamp),
        remembered_until: record
            .remember_until
            .filter(|until| completed && *until > record.expires_at)
            .and_then(timestamp),
    }
}

fn get_outcome(found: &Inspection) -> &'static str {
    match found {
        Inspection::Live(record) => state_name(record.state),
        Inspection::Remembered(_) => "remembered",
        Inspection::Absent => "absent",
    }
}

#[tonic::async_trait]
impl<S: Store> IdempotencyService for IdempotencyApi<S> {
    async fn claim(
        &self,
        request: Request<proto::ClaimRequest>,
    ) -> Result<Response<proto::ClaimResponse>, Status> {
        let (mut log, span) = self.start("Claim", &request);
        let deadline = request.extensions().get::<CallDeadline>().map(|d| d.0);
        let request = request.into_inner();
        let asked_to_wait = request.wait.is_some_and(|w| w.seconds > 0 || w.nanos > 0);
        let result = async {
            let wait = duration("wait", request.wait)?;
            let request = parse_claim(request)?;
            log.namespace = Some(request.namespace.clone());
            log.caller.check_namespace(&request.namespace)?;
            let wait = self.lifecycle.limits().wait(wait)?;
            let answer_by = answer_by(deadline);
            self.lifecycle.claim_waiting(request, wait, answer_by).await
        }
        .instrument(span)
        .await;
        if let Ok(lifecycle::Waited {
            outcome: ClaimOutcome::Claimed {
                lease, took_over, ..
            },
            ..
        }) = &result
        {
            log.fencing_token = Some(lease.fencing_token);
            log.took_over = *took_over;
        }
        log.finish(
            result,
            |w| w.outcome.name(),
            |w| proto::ClaimResponse {
                waited: if asked_to_wait {
                    wire_duration(w.waited)
                } else {
                    None
                },
                ..claim_response(w.outcome)
            },
        )
    }

    async fn complete(
        &self,
        request: Request<proto::CompleteRequest>,
    ) -> Result<Response<proto::CompleteResponse>, Status> {
        let (mut log, span) = self.start("Complete", &request);
        let request = request.into_inner();
        let result = async {
            let request = parse_complete(request)?;
            log.namespace = Some(request.namespace.clone());
            log.caller.check_namespace(&request.namespace)?;
            self.lifecycle.complete(request).await
        }
        .instrument(span)
        .await;
        log.finish(
            result,
            |_| "ok",
            |expires_at| proto::CompleteResponse {
                expires_at: timestamp(expires_at),
            },
        )
    }

    async fn release(
        &self,
        request: Request<proto::ReleaseRequest>,
    ) -> Result<Response<proto::ReleaseResponse>, Status> {
        let (mut log, span) = self.start("Release", &request);
        let request = request.into_inner();
        let result = async {
            let (namespace, key) = namespaced_key(&mut log, request.namespace, request.key)?;
            let token = LeaseToken::parse(&request.lease_token)?;
            self.lifecycle
                .release(namespace, key, token, request.checkpoint)
                .await
        }
        .instrument(span)
        .await;
        log.finish(result, |_| "ok", |()| proto::ReleaseResponse {})
    }

    async fn extend_lease(
        &self,
        request: Request<proto::ExtendLeaseRequest>,
    ) -> Result<Response<proto::ExtendLeaseResponse>, Status> {
        let (mut log, span) = self.start("ExtendLease", &request);
        let request = request.into_inner();
        let result = async {
            let (namespace, key) = namespaced_key(&mut log, request.namespace, request.key)?;
            let token = LeaseToken::parse(&request.lease_token)?;
            let lease_ttl = duration("lease_ttl", request.lease_ttl)?;
            self.lifecycle
                .extend_lease(namespace, key, token, lease_ttl, request.checkpoint)
                .await
        }
        .instrument(span)
        .await;
        log.finish(
            result,
            |_| "ok",
            |lease_expires_at| proto::ExtendLeaseResponse {
                lease_expires_at: timestamp(lease_expires_at),
            },
        )
    }

    async fn get(
        &self,
        request: Request<proto::GetRequest>,
    ) -> Result<Response<proto::GetResponse>, Status> {
        let (mut log, span) = self.start("Get", &request);
        let request = request.into_inner();
        let result = async {
            let (namespace, key) = namespaced_key(&mut log, request.namespace, request.key)?;
            self.lifecycle.get(namespace, key).await
        }
        .instrument(span)
        .await;
        log.finish(result, get_outcome, get_response)
    }

    async fn claim_batch(
        &self,
        request: Request<proto::ClaimBatchRequest>,
    ) -> Result<Response<proto::ClaimBatchResponse>, Status> {
        let (mut log, span) = self.start("ClaimBatch", &request);
        let proto::ClaimBatchRequest { items, item_errors } = request.into_inner();
        let result = async {
            self.check_batch_size(items.len())?;
            let requests = parse_items(items, parse_batch_claim)?;
            log.namespace = batch_namespace(requests.iter().map(|r| &r.namespace));
            check_items(&log.caller, requests.iter().map(|r| &r.namespace))?;
            if item_errors {
                self.lifecycle.claim_each(requests).await
            } else {
                let outcomes = self.lifecycle.claim_many(requests).await?;
                Ok(outcomes.into_iter().map(Ok).collect())
            }
        }
        .instrument(span)
        .await;
        log.finish(
            result,
            |o| batch_claim_outcome(o),
            |outcomes| proto::ClaimBatchResponse {
                items: outcomes
                    .into_iter()
                    .map(|outcome| match outcome {
                        Ok(outcome) => claim_response(outcome),
                        Err(error) => proto::ClaimResponse {
                            error: Some(status::item_error(&error)),
                            ..Default::default()
                        },
                    })
                    .collect(),
            },
        )
    }

    async fn complete_batch(
        &self,
        request: Request<proto::CompleteBatchRequest>,
    ) -> Result<Response<proto::CompleteBatchResponse>, Status> {
        let (mut log, span) = self.start("CompleteBatch", &request);
        let proto::CompleteBatchRequest { items, item_errors } = request.into_inner();
        let result = async {
            self.check_batch_size(items.len())?;
            let requests = parse_items(items, parse_complete)?;
            log.namespace = batch_namespace(requests.iter().map(|r| &r.namespace));
            check_items(&log.caller, requests.iter().map(|r| &r.namespace))?;
            if item_errors {
                self.lifecycle.complete_each(requests).await
            } else {
                self.lifecycle.complete_many(requests).await
            }
        }
        .instrument(span)
        .await;
        log.finish(
            result,
            |_| "ok",
            |results| proto::CompleteBatchResponse {
                items: results.into_iter().map(complete_result).collect(),
            },
        )
    }

    async fn purge(
        &self,
        request: Request<proto::PurgeRequest>,
    ) -> Result<Response<proto::PurgeResponse>, Status> {
        let (mut log, span) = self.start("Purge", &request);
        let request = request.into_inner();
        let result = async {
            let (namespace, key) = namespaced_key(&mut log, request.namespace, request.key)?;
            if request.reason.len() > MAX_REASON_BYTES {
                return Err(Error::invalid(
                    "reason",
                    format!("must be at most {MAX_REASON_BYTES} bytes"),
                ));
            }
            let previous = self.lifecycle.purge(namespace.clone(), key.clone()).await?;
            // An operator's action: the one log line that names a key.
            tracing::warn!(
                namespace = namespace.as_str(),
                key = key.as_str(),
                previous_state = match previous {
                    Some(Purged::Live(state)) => state_name(state),
                    Some(Purged::Remembered) => "remembered",
                    None => "absent",
                },
                reason = request.reason,
                "key purged"
            );
            metrics::record_purge();
            Ok(previous)
        }
        .instrument(span)
        .await;
        log.finish(
            result,
            |previous| {
                if previous.is_some() {
                    "purged"
                } else {
                    "absent"
                }
            },
            |previous| proto::PurgeResponse {
                purged: previous.is_some(),
                previous_state: match previous {
                    Some(Purged::Live(state)) => wire_state(state),
                    Some(Purged::Remembered) | None => proto::State::Absent,
                } as i32,
            },
        )
    }
}

fn batch_claim_outcome(outcomes: &[Result<ClaimOutcome, Error>]) -> &'static str {
    if outcomes.iter().any(Result::is_err) {
        "items_failed"
    } else if outcomes
        .iter()
        .any(|o| matches!(o, Ok(ClaimOutcome::Claimed { .. })))
    {
        "claimed"
    } else {
        "none_claimed"
    }
}

fn state_name(state: RecordState) -> &'static str {
    match state {
        RecordState::InProgress => "in_progress",
        RecordState::Completed => "completed",
        RecordState::Released => "released",
    }
}

fn wire_state(state: RecordState) -> proto::State {
    match state {
        RecordState::InProgress => proto::State::InProgress,
        RecordState::Completed => proto::State::Completed,
        RecordState::Released => proto::State::Released,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_negative_duration_names_its_field() {
        let error = duration(
            "lease_ttl",
            Some(prost_types::Duration {
                seconds: -1,
                nanos: 0,
            }),
        )
        .unwrap_err();
        assert_eq!(error.to_string(), "lease_ttl: must not be negative");
    }

    #[test]
    fn an_unset_duration_stays_unset() {
        assert_eq!(duration("retention", None).unwrap(), None);
    }
}
