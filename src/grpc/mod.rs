//! The gRPC adapter: parses each request into domain types at the edge
//! (INVALID_ARGUMENT naming the field), calls the lifecycle, and converts the
//! outcome back into the wire types. It logs one line per call: method,
//! namespace, outcome and latency, never response bytes or fingerprints.

pub mod status;

use std::time::{Duration, Instant, SystemTime};

use tonic::{Request, Response, Status};

use crate::domain::{ClaimOutcome, Fingerprint, Key, LeaseToken, Namespace, Record, RecordState};
use crate::error::Error;
use crate::lifecycle::{self, Lifecycle};
use crate::store::Store;

/// The code generated from proto/idempotency/v1/idempotency.proto.
pub mod proto {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("idempotency.v1");

    /// The encoded descriptors, served by reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("idempotency_descriptor");
}

use proto::idempotency_service_server::IdempotencyService;

/// The fully qualified service name, as health and reflection know it.
pub const SERVICE_NAME: &str = "idempotency.v1.IdempotencyService";

pub struct IdempotencyApi<S> {
    lifecycle: Lifecycle<S>,
}

impl<S: Store> IdempotencyApi<S> {
    pub fn new(lifecycle: Lifecycle<S>) -> Self {
        Self { lifecycle }
    }
}

/// The per-call log line, filled in as the call goes.
struct CallLog {
    method: &'static str,
    started: Instant,
    namespace: Option<Namespace>,
}

impl CallLog {
    fn start(method: &'static str) -> Self {
        Self {
            method,
            started: Instant::now(),
            namespace: None,
        }
    }

    /// Logs the call and turns its result into the wire's.
    fn finish<T, R>(
        self,
        result: Result<T, Error>,
        outcome: impl FnOnce(&T) -> &'static str,
        respond: impl FnOnce(T) -> R,
    ) -> Result<Response<R>, Status> {
        let outcome = match &result {
            Ok(value) => outcome(value),
            Err(error) => code_name(status::code_of(error)),
        };
        tracing::info!(
            method = self.method,
            namespace = self.namespace.as_ref().map_or("", Namespace::as_str),
            outcome,
            latency_us = self.started.elapsed().as_micros() as u64,
            "call"
        );
        result
            .map(|value| Response::new(respond(value)))
            .map_err(status::to_status)
    }
}

fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        InvalidArgument => "invalid_argument",
        NotFound => "not_found",
        FailedPrecondition => "failed_precondition",
        Aborted => "aborted",
        Unavailable => "unavailable",
        Internal => "internal",
        _ => "error",
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

/// Parses namespace and key, remembering the namespace for the log.
fn identity(log: &mut CallLog, namespace: String, key: String) -> Result<(Namespace, Key), Error> {
    let namespace = Namespace::parse(namespace)?;
    log.namespace = Some(namespace.clone());
    Ok((namespace, Key::parse(key)?))
}

fn claim_response(outcome: ClaimOutcome) -> proto::ClaimResponse {
    use proto::{ClaimResponse, Outcome};
    match outcome {
        ClaimOutcome::Claimed(lease) => ClaimResponse {
            outcome: Outcome::Claimed as i32,
            lease_token: lease.lease_token.to_string(),
            fencing_token: lease.fencing_token,
            lease_expires_at: timestamp(lease.lease_expires_at),
            expires_at: timestamp(lease.expires_at),
            ..Default::default()
        },
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
    }
}

fn get_response(record: Option<Record>) -> proto::GetResponse {
    use proto::State;
    let Some(record) = record else {
        return proto::GetResponse {
            state: State::Absent as i32,
            ..Default::default()
        };
    };
    let state = match record.state {
        RecordState::InProgress => State::InProgress,
        RecordState::Completed => State::Completed,
        RecordState::Released => State::Released,
    };
    proto::GetResponse {
        state: state as i32,
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
    }
}

fn get_outcome(record: &Option<Record>) -> &'static str {
    match record.as_ref().map(|r| r.state) {
        None => "absent",
        Some(RecordState::InProgress) => "in_progress",
        Some(RecordState::Completed) => "completed",
        Some(RecordState::Released) => "released",
    }
}

#[tonic::async_trait]
impl<S: Store> IdempotencyService for IdempotencyApi<S> {
    async fn claim(
        &self,
        request: Request<proto::ClaimRequest>,
    ) -> Result<Response<proto::ClaimResponse>, Status> {
        let mut log = CallLog::start("Claim");
        let request = request.into_inner();
        let result = async {
            let (namespace, key) = identity(&mut log, request.namespace, request.key)?;
            let request = lifecycle::ClaimRequest {
                namespace,
                key,
                fingerprint: Fingerprint::parse(request.fingerprint)?,
                lease_ttl: duration("lease_ttl", request.lease_ttl)?,
                retention: duration("retention", request.retention)?,
            };
            self.lifecycle.claim(request).await
        }
        .await;
        log.finish(result, ClaimOutcome::name, claim_response)
    }

    async fn complete(
        &self,
        request: Request<proto::CompleteRequest>,
    ) -> Result<Response<proto::CompleteResponse>, Status> {
        let mut log = CallLog::start("Complete");
        let request = request.into_inner();
        let result = async {
            let (namespace, key) = identity(&mut log, request.namespace, request.key)?;
            let request = lifecycle::CompleteRequest {
                namespace,
                key,
                lease_token: LeaseToken::parse(&request.lease_token)?,
                response: request.response,
                retention: duration("retention", request.retention)?,
            };
            self.lifecycle.complete(request).await
        }
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
        let mut log = CallLog::start("Release");
        let request = request.into_inner();
        let result = async {
            let (namespace, key) = identity(&mut log, request.namespace, request.key)?;
            let token = LeaseToken::parse(&request.lease_token)?;
            self.lifecycle.release(namespace, key, token).await
        }
        .await;
        log.finish(result, |_| "ok", |()| proto::ReleaseResponse {})
    }

    async fn extend_lease(
        &self,
        request: Request<proto::ExtendLeaseRequest>,
    ) -> Result<Response<proto::ExtendLeaseResponse>, Status> {
        let mut log = CallLog::start("ExtendLease");
        let request = request.into_inner();
        let result = async {
            let (namespace, key) = identity(&mut log, request.namespace, request.key)?;
            let token = LeaseToken::parse(&request.lease_token)?;
            let lease_ttl = duration("lease_ttl", request.lease_ttl)?;
            self.lifecycle
                .extend_lease(namespace, key, token, lease_ttl)
                .await
        }
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
        let mut log = CallLog::start("Get");
        let request = request.into_inner();
        let result = async {
            let (namespace, key) = identity(&mut log, request.namespace, request.key)?;
            self.lifecycle.get(namespace, key).await
        }
        .await;
        log.finish(result, get_outcome, get_response)
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
