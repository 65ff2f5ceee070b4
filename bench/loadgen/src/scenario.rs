//! The scenarios: what one operation of each does, the loop a caller runs
//! until the run's time or budget is spent, and the keys completed before a
//! run for the replay scenarios.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::ValueEnum;
use rand::Rng;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use serde::Serialize;
use tonic::{Code, Status};

use idempotency_proto::v1::{
    ClaimBatchRequest, ClaimRequest, ClaimResponse, CompleteRequest, Outcome, ReleaseRequest,
};

use crate::stats::Stats;
use crate::transport::Client;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    Claim,
    ClaimComplete,
    ClaimBatch,
    Duplicate,
    Contended,
    Mixed,
}

impl Scenario {
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Claim => "claim",
            Scenario::ClaimComplete => "claim-complete",
            Scenario::ClaimBatch => "claim-batch",
            Scenario::Duplicate => "duplicate",
            Scenario::Contended => "contended",
            Scenario::Mixed => "mixed",
        }
    }

    pub fn needs_completed_keys(self) -> bool {
        matches!(self, Scenario::Duplicate | Scenario::Mixed)
    }
}

/// The lease (and retention) used where a scenario wants a key back soon: the
/// smallest the service accepts.
const SHORT: Duration = Duration::from_secs(1);

/// How long after a short lease's expiry (by this machine's clock) a caller
/// takes the key over: the server decides by the database's clock, which is
/// this machine's too, so a small margin is enough.
const TAKEOVER_MARGIN: Duration = Duration::from_millis(250);

/// The most expired-lease keys one caller keeps waiting for takeover.
const ABANDONED_MAX: usize = 1024;

/// What every caller reads: the run's fixed inputs and its clock.
pub struct Shared {
    pub scenario: Scenario,
    pub batch_size: usize,
    pub namespace: String,
    pub response: Vec<u8>,
    /// Claims of completed keys, built once and cloned per call.
    pub duplicates: Vec<ClaimRequest>,
    pub contended: Vec<String>,
    pub measure_from: Instant,
    pub stop_at: Instant,
    pub budget: Option<u64>,
    /// Measured operations started so far, against `budget`.
    pub started: AtomicU64,
}

/// A failed RPC or an outcome the scenario rules out; already counted.
struct Failed;

/// One caller: its connection, its key counter and what it measured.
pub struct Caller {
    id: usize,
    client: Client,
    shared: Arc<Shared>,
    next_key: u64,
    rng: SmallRng,
    /// Keys claimed with a short lease and abandoned, with when to take them over.
    abandoned: VecDeque<(String, Instant)>,
    stats: Stats,
}

impl Caller {
    pub fn new(id: usize, client: Client, shared: Arc<Shared>) -> Self {
        Self {
            id,
            client,
            shared,
            next_key: 0,
            rng: SmallRng::seed_from_u64(rand::random()),
            abandoned: VecDeque::new(),
            stats: Stats::new(),
        }
    }

    pub async fn run(mut self) -> Stats {
        loop {
            let started = Instant::now();
            if started >= self.shared.stop_at {
                break;
            }
            let recording = started >= self.shared.measure_from;
            if recording
                && let Some(budget) = self.shared.budget
                && self.shared.started.fetch_add(1, Ordering::Relaxed) >= budget
            {
                break;
            }
            self.stats.recording = recording;
            let (kind, result) = self.operation().await;
            if recording {
                let finished = Instant::now();
                self.stats.last_finish = Some(finished);
                if result.is_ok() {
                    self.stats.ops += 1;
                    self.stats.latency(kind, finished - started);
                }
            }
        }
        self.stats
    }

    /// Runs one operation of the scenario; returns its kind for the latency
    /// table.
    async fn operation(&mut self) -> (&'static str, Result<(), Failed>) {
        match self.shared.scenario {
            Scenario::Claim => ("op:claim", self.fresh_claim().await),
            Scenario::ClaimComplete => ("op:claim-complete", self.fresh_cycle().await),
            Scenario::ClaimBatch => ("op:claim-batch", self.fresh_batch().await),
            Scenario::Duplicate => ("op:duplicate", self.duplicate().await),
            Scenario::Contended => ("op:contended", self.contended().await),
            Scenario::Mixed => match self.rng.random_range(0..100u32) {
                0..70 => ("op:mixed-fresh", self.fresh_cycle().await),
                70..90 => ("op:mixed-duplicate", self.duplicate().await),
                90..95 => ("op:mixed-release-reclaim", self.release_and_reclaim().await),
                _ => match self.abandoned.front() {
                    Some((_, due)) if *due <= Instant::now() => {
                        ("op:mixed-takeover", self.take_over_expired().await)
                    }
                    _ => ("op:mixed-abandon", self.abandon().await),
                },
            },
        }
    }

    /// A key no run has used: the caller's id and its counter, zero-padded so
    /// that a caller's keys are in index order, as pgbench's counters are
    /// (unpadded, "w5-1000" would sort between "w5-100" and "w5-101", and a
    /// batch would touch pages all over the index where pgbench's touches one).
    fn fresh_key(&mut self) -> String {
        self.next_key += 1;
        format!("w{:04}-{:012}", self.id, self.next_key)
    }

    fn claim_request(&self, key: String, lease_ttl: Option<Duration>) -> ClaimRequest {
        ClaimRequest {
            namespace: self.shared.namespace.clone(),
            key,
            fingerprint: Vec::new(),
            lease_ttl: lease_ttl.map(proto_duration),
            retention: None,
            ..Default::default()
        }
    }

    async fn fresh_claim(&mut self) -> Result<(), Failed> {
        let key = self.fresh_key();
        let request = self.claim_request(key, None);
        self.claim_expecting(request, Outcome::Claimed, "a fresh key")
            .await
            .map(drop)
    }

    async fn fresh_cycle(&mut self) -> Result<(), Failed> {
        let key = self.fresh_key();
        let request = self.claim_request(key.clone(), None);
        let claimed = self
            .claim_expecting(request, Outcome::Claimed, "a fresh key")
            .await?;
        self.complete(key, claimed.lease_token, None).await
    }

    async fn fresh_batch(&mut self) -> Result<(), Failed> {
        let items = (0..self.shared.batch_size)
            .map(|_| {
                let key = self.fresh_key();
                self.claim_request(key, None)
            })
            .collect();
        let started = Instant::now();
        let result = self
            .client
            .claim_batch(ClaimBatchRequest {
                items,
                ..Default::default()
            })
            .await;
        self.stats.latency("ClaimBatch", started.elapsed());
        let response = match result {
            Ok(response) => response.into_inner(),
            Err(status) => return Err(self.failed("ClaimBatch", &status)),
        };
        self.stats.outcome("ClaimBatch", "OK");
        let claimed = response
            .items
            .iter()
            .filter(|item| item.outcome == Outcome::Claimed as i32)
            .count();
        if claimed == self.shared.batch_size {
            return Ok(());
        }
        let expected = self.shared.batch_size;
        self.stats.error("UNEXPECTED_OUTCOME", || {
            format!("ClaimBatch of {expected} fresh keys claimed {claimed}")
        });
        Err(Failed)
    }

    async fn duplicate(&mut self) -> Result<(), Failed> {
        let index = self.rng.random_range(0..self.shared.duplicates.len());
        let request = self.shared.duplicates[index].clone();
        self.claim_expecting(request, Outcome::Completed, "a completed key")
            .await
            .map(drop)
    }

    async fn contended(&mut self) -> Result<(), Failed> {
        let index = self.rng.random_range(0..self.shared.contended.len());
        let key = self.shared.contended[index].clone();
        let request = self.claim_request(key.clone(), None);
        let response = self.claim(request).await?;
        if Outcome::try_from(response.outcome) != Ok(Outcome::Claimed) {
            // In progress elsewhere, or completed within the last second.
            return Ok(());
        }
        if self.rng.random_bool(0.5) {
            self.complete(key, response.lease_token, Some(SHORT)).await
        } else {
            self.release(key, response.lease_token).await
        }
    }

    async fn release_and_reclaim(&mut self) -> Result<(), Failed> {
        let key = self.fresh_key();
        let request = self.claim_request(key.clone(), None);
        let first = self
            .claim_expecting(request.clone(), Outcome::Claimed, "a fresh key")
            .await?;
        self.release(key.clone(), first.lease_token).await?;
        let second = self
            .claim_expecting(request, Outcome::Claimed, "a released key")
            .await?;
        self.expect_fencing(&second, 2)?;
        self.complete(key, second.lease_token, None).await
    }

    async fn abandon(&mut self) -> Result<(), Failed> {
        let key = self.fresh_key();
        let request = self.claim_request(key.clone(), Some(SHORT));
        self.claim_expecting(request, Outcome::Claimed, "a fresh key")
            .await?;
        if self.abandoned.len() < ABANDONED_MAX {
            let due = Instant::now() + SHORT + TAKEOVER_MARGIN;
            self.abandoned.push_back((key, due));
        }
        Ok(())
    }

    async fn take_over_expired(&mut self) -> Result<(), Failed> {
        let (key, _) = self.abandoned.pop_front().expect("checked by the caller");
        let request = self.claim_request(key.clone(), None);
        let claimed = self
            .claim_expecting(request, Outcome::Claimed, "a key whose lease expired")
            .await?;
        self.expect_fencing(&claimed, 2)?;
        self.complete(key, claimed.lease_token, None).await
    }

    fn expect_fencing(&mut self, response: &ClaimResponse, expected: u64) -> Result<(), Failed> {
        if response.fencing_token == expected {
            return Ok(());
        }
        let got = response.fencing_token;
        self.stats.error("UNEXPECTED_OUTCOME", || {
            format!("fencing token {got}, expected {expected}")
        });
        Err(Failed)
    }

    async fn claim(&mut self, request: ClaimRequest) -> Result<ClaimResponse, Failed> {
        let started = Instant::now();
        let result = self.client.claim(request).await;
        self.stats.latency("Claim", started.elapsed());
        match result {
            Ok(response) => {
                let response = response.into_inner();
                self.stats.outcome("Claim", outcome_name(response.outcome));
                Ok(response)
            }
            Err(status) => Err(self.failed("Claim", &status)),
        }
    }

    async fn claim_expecting(
        &mut self,
        request: ClaimRequest,
        expected: Outcome,
        what: &'static str,
    ) -> Result<ClaimResponse, Failed> {
        let response = self.claim(request).await?;
        if response.outcome == expected as i32 {
            return Ok(response);
        }
        let got = outcome_name(response.outcome);
        self.stats.error("UNEXPECTED_OUTCOME", || {
            format!(
                "Claim of {what} answered {got}, expected {}",
                expected.as_str_name()
            )
        });
        Err(Failed)
    }

    async fn complete(
        &mut self,
        key: String,
        lease_token: String,
        retention: Option<Duration>,
    ) -> Result<(), Failed> {
        let request = CompleteRequest {
            namespace: self.shared.namespace.clone(),
            key,
            lease_token,
            response: self.shared.response.clone(),
            retention: retention.map(proto_duration),
        };
        let started = Instant::now();
        let result = self.client.complete(request).await;
        self.stats.latency("Complete", started.elapsed());
        match result {
            Ok(_) => {
                self.stats.outcome("Complete", "OK");
                Ok(())
            }
            Err(status) => Err(self.failed("Complete", &status)),
        }
    }

    async fn release(&mut self, key: String, lease_token: String) -> Result<(), Failed> {
        let request = ReleaseRequest {
            namespace: self.shared.namespace.clone(),
            key,
            lease_token,
            ..Default::default()
        };
        let started = Instant::now();
        let result = self.client.release(request).await;
        self.stats.latency("Release", started.elapsed());
        match result {
            Ok(_) => {
                self.stats.outcome("Release", "OK");
                Ok(())
            }
            Err(status) => Err(self.failed("Release", &status)),
        }
    }

    fn failed(&mut self, rpc: &'static str, status: &Status) -> Failed {
        let code = code_name(status.code());
        self.stats.outcome(rpc, code);
        self.stats
            .error(code, || format!("{rpc}: {}", status.message()));
        Failed
    }
}

fn proto_duration(duration: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: duration.as_secs() as i64,
        nanos: duration.subsec_nanos() as i32,
    }
}

fn outcome_name(outcome: i32) -> &'static str {
    Outcome::try_from(outcome).map_or("OUTCOME_UNKNOWN", |o| o.as_str_name())
}

fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// Completes `count` keys before the run, for the replay scenarios.
pub async fn complete_keys(
    clients: &[Client],
    namespace: &str,
    count: usize,
    response: &[u8],
) -> anyhow::Result<Vec<ClaimRequest>> {
    const IN_FLIGHT: usize = 32;
    let requests: Vec<ClaimRequest> = (0..count)
        .map(|i| ClaimRequest {
            namespace: namespace.to_owned(),
            key: format!("dup-{i}"),
            fingerprint: Vec::new(),
            lease_ttl: None,
            retention: None,
            ..Default::default()
        })
        .collect();
    let mut tasks = tokio::task::JoinSet::new();
    for lane in 0..IN_FLIGHT.min(count) {
        let mut client = clients[lane % clients.len()].clone();
        let mine: Vec<ClaimRequest> = requests
            .iter()
            .skip(lane)
            .step_by(IN_FLIGHT)
            .cloned()
            .collect();
        let response = response.to_vec();
        tasks.spawn(async move {
            for request in mine {
                let claimed = client.claim(request.clone()).await?.into_inner();
                match Outcome::try_from(claimed.outcome) {
                    Ok(Outcome::Claimed) => {
                        client
                            .complete(CompleteRequest {
                                namespace: request.namespace,
                                key: request.key,
                                lease_token: claimed.lease_token,
                                response: response.clone(),
                                retention: None,
                            })
                            .await?;
                    }
                    Ok(Outcome::Completed) => {}
                    _ => {
                        return Err(anyhow::anyhow!(
                            "setup: Claim of {} answered {}",
                            request.key,
                            outcome_name(claimed.outcome)
                        ));
                    }
                }
            }
            anyhow::Ok(())
        });
    }
    let setup = tokio::time::timeout(Duration::from_secs(120), async {
        while let Some(done) = tasks.join_next().await {
            done??;
        }
        anyhow::Ok(())
    });
    setup
        .await
        .context("setup: completing the duplicate keys took over 120 s")??;
    Ok(requests)
}
