//! idempotency-bench: a load generator for the service, for measuring it
//! against PostgreSQL itself (bench/compare.sh runs both side by side).
//!
//! N callers share a few HTTP/2 connections and run one scenario for a bounded
//! time and/or number of operations, after an unrecorded warm-up:
//! - `claim`: Claim of a fresh key, left in progress (one Claim per op);
//! - `claim-complete`: Claim of a fresh key, then Complete (one cycle per op);
//! - `claim-batch`: one ClaimBatch of `--batch-size` fresh keys per op, every
//!   item CLAIMED (keys/s is ops/s times the batch size);
//! - `duplicate`: redeliveries of keys completed before the run; every Claim
//!   must answer OUTCOME_COMPLETED (the replay);
//! - `contended`: every caller on a few hot keys; whoever wins a Claim
//!   Completes it with a 1 s retention (so the key comes back) or Releases it;
//! - `mixed`: 70% fresh claim+complete, 20% duplicates, 5% claim, release and
//!   claim again, 5% claims with a 1 s lease left to expire (each caller later
//!   takes its expired keys over and completes them).
//!
//! It reports operations per second, latency percentiles per RPC and per
//! operation (HdrHistogram, microseconds), outcomes per RPC, and errors by gRPC
//! code (an outcome a scenario rules out counts as an error,
//! UNEXPECTED_OUTCOME), as a table and optionally as JSON. It exits 2 when any
//! error was counted, so scripts can fail on it. It only talks to loopback
//! addresses.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, VecDeque};
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, ValueEnum};
use hdrhistogram::Histogram;
use rand::Rng;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use serde::Serialize;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Code, Status};

use idempotency_service::grpc::proto::idempotency_service_client::IdempotencyServiceClient;
use idempotency_service::grpc::proto::{
    ClaimBatchRequest, ClaimRequest, ClaimResponse, CompleteRequest, GetRequest, Outcome,
    ReleaseRequest,
};

type Client = IdempotencyServiceClient<Transport>;

/// How the callers' requests reach a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
enum ClientKind {
    /// hyper's HTTP/2 client connection, driven directly: the leanest gRPC
    /// client, as pgbench is the leanest SQL one (the default).
    H2,
    /// tonic's `Channel`, which puts a tower `Buffer` task in front of each
    /// connection: one more task hand-over per call.
    Channel,
}

/// A connection as the generated client needs it: a service from HTTP
/// requests to HTTP responses.
#[derive(Clone)]
enum Transport {
    H2(hyper::client::conn::http2::SendRequest<tonic::body::Body>),
    Channel(Channel),
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower::Service<http::Request<tonic::body::Body>> for Transport {
    type Response = http::Response<tonic::body::Body>;
    type Error = BoxError;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, BoxError>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), BoxError>> {
        match self {
            Transport::H2(send) => send.poll_ready(cx).map_err(Into::into),
            Transport::Channel(channel) => {
                tower::Service::poll_ready(channel, cx).map_err(Into::into)
            }
        }
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        match self {
            Transport::H2(send) => {
                let response = send.send_request(request);
                Box::pin(async move { Ok(response.await?.map(tonic::body::Body::new)) })
            }
            Transport::Channel(channel) => {
                let response = tower::Service::call(channel, request);
                Box::pin(async move { Ok(response.await?) })
            }
        }
    }
}

/// Load generator for idempotency-service: runs one scenario against a
/// loopback server and reports throughput, latency percentiles, outcomes and
/// errors.
#[derive(Parser, Debug)]
#[command(name = "idempotency-bench", version)]
struct Args {
    /// The server's address. Only loopback addresses are accepted.
    #[arg(long, default_value = "http://127.0.0.1:50051")]
    target: String,

    /// What each operation does (see the binary's documentation).
    #[arg(long, value_enum, default_value_t = Scenario::ClaimComplete)]
    scenario: Scenario,

    /// Concurrent callers, each running one operation after another.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,

    /// How long to measure, after the warm-up (e.g. `20s`). Without it and
    /// without --requests: 10s.
    #[arg(long, value_parser = humantime::parse_duration)]
    duration: Option<Duration>,

    /// Stop after this many measured operations (with --duration, whichever
    /// comes first).
    #[arg(long)]
    requests: Option<u64>,

    /// Unrecorded run before measuring: connections, the server's pool and
    /// PostgreSQL's plan caches fill up here.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "1s")]
    warmup: Duration,

    /// HTTP/2 connections the callers are spread over (capped at
    /// --concurrency).
    #[arg(long, default_value_t = 4)]
    connections: usize,

    /// The client stack each connection is driven by.
    #[arg(long, value_enum, default_value_t = ClientKind::H2)]
    client: ClientKind,

    /// Namespace of every key. Default: a random one per run, so that runs
    /// never see each other's keys.
    #[arg(long)]
    namespace: Option<String>,

    /// Keys completed before a `duplicate` or `mixed` run, redelivered during it.
    #[arg(long, default_value_t = 1000)]
    duplicate_keys: usize,

    /// Fresh keys per ClaimBatch in the `claim-batch` scenario.
    #[arg(long, default_value_t = 100)]
    batch_size: usize,

    /// Hot keys of the `contended` scenario.
    #[arg(long, default_value_t = 8)]
    contended_keys: usize,

    /// Size of the response each Complete stores (and each replay returns).
    #[arg(long, default_value_t = 64)]
    response_bytes: usize,

    /// With --requests alone, the longest the run may take anyway.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10m")]
    max_time: Duration,

    /// How long to wait for the server to answer before starting.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "15s")]
    wait_ready: Duration,

    /// Write the results here as JSON.
    #[arg(long)]
    json: Option<PathBuf>,

    /// Exit 0 even when errors were counted.
    #[arg(long)]
    allow_errors: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Scenario {
    Claim,
    ClaimComplete,
    ClaimBatch,
    Duplicate,
    Contended,
    Mixed,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::Claim => "claim",
            Scenario::ClaimComplete => "claim-complete",
            Scenario::ClaimBatch => "claim-batch",
            Scenario::Duplicate => "duplicate",
            Scenario::Contended => "contended",
            Scenario::Mixed => "mixed",
        }
    }

    fn needs_completed_keys(self) -> bool {
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
struct Shared {
    scenario: Scenario,
    batch_size: usize,
    namespace: String,
    response: Vec<u8>,
    /// Claims of completed keys, built once and cloned per call.
    duplicates: Vec<ClaimRequest>,
    contended: Vec<String>,
    measure_from: Instant,
    stop_at: Instant,
    budget: Option<u64>,
    /// Measured operations started so far, against `budget`.
    started: AtomicU64,
}

/// What one caller records; merged once at the end, so no locks per call.
struct Stats {
    latency: BTreeMap<&'static str, Histogram<u64>>,
    outcomes: BTreeMap<&'static str, BTreeMap<&'static str, u64>>,
    errors: BTreeMap<&'static str, u64>,
    /// The first message seen per error code, to tell what went wrong.
    error_samples: BTreeMap<&'static str, String>,
    ops: u64,
    rpcs: u64,
    last_finish: Option<Instant>,
    /// False during the warm-up: nothing is recorded.
    recording: bool,
}

impl Stats {
    fn new() -> Self {
        Self {
            latency: BTreeMap::new(),
            outcomes: BTreeMap::new(),
            errors: BTreeMap::new(),
            error_samples: BTreeMap::new(),
            ops: 0,
            rpcs: 0,
            last_finish: None,
            recording: false,
        }
    }

    fn latency(&mut self, kind: &'static str, elapsed: Duration) {
        if self.recording {
            self.latency
                .entry(kind)
                .or_insert_with(new_histogram)
                .saturating_record(elapsed.as_micros() as u64);
        }
    }

    fn outcome(&mut self, rpc: &'static str, outcome: &'static str) {
        if self.recording {
            self.rpcs += 1;
            *self
                .outcomes
                .entry(rpc)
                .or_default()
                .entry(outcome)
                .or_default() += 1;
        }
    }

    fn error(&mut self, code: &'static str, message: impl FnOnce() -> String) {
        if self.recording {
            *self.errors.entry(code).or_default() += 1;
            self.error_samples.entry(code).or_insert_with(message);
        }
    }

    fn merge(&mut self, other: Stats) {
        for (kind, histogram) in other.latency {
            match self.latency.get_mut(kind) {
                Some(mine) => mine.add(&histogram).expect("same bounds"),
                None => {
                    self.latency.insert(kind, histogram);
                }
            }
        }
        for (rpc, outcomes) in other.outcomes {
            let mine = self.outcomes.entry(rpc).or_default();
            for (outcome, n) in outcomes {
                *mine.entry(outcome).or_default() += n;
            }
        }
        for (code, n) in other.errors {
            *self.errors.entry(code).or_default() += n;
        }
        for (code, message) in other.error_samples {
            self.error_samples.entry(code).or_insert(message);
        }
        self.ops += other.ops;
        self.rpcs += other.rpcs;
        self.last_finish = self.last_finish.max(other.last_finish);
    }
}

fn new_histogram() -> Histogram<u64> {
    // 1 µs to 60 s at three significant digits.
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid bounds")
}

/// A failed RPC or an outcome the scenario rules out; already counted.
struct Failed;

/// One caller: its connection, its key counter and what it measured.
struct Caller {
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
    async fn run(mut self) -> Stats {
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
        let result = self.client.claim_batch(ClaimBatchRequest { items }).await;
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

/// Refuses any target that is not on this machine's loopback interface.
fn check_loopback(target: &str) -> anyhow::Result<()> {
    let uri: Uri = target.parse().context("--target is not a URI")?;
    let host = uri.host().context("--target has no host")?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let loopback = host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if !loopback {
        bail!(
            "--target {target}: only loopback addresses (127.0.0.0/8, ::1, localhost) are allowed"
        );
    }
    Ok(())
}

/// This process's CPU time (user + system) so far, from /proc (Linux only).
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 here,
    // in clock ticks (100 per second on Linux).
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0)
}

async fn connect(
    target: &str,
    connections: usize,
    kind: ClientKind,
) -> anyhow::Result<Vec<Client>> {
    let endpoint = Endpoint::from_shared(target.to_owned())
        .context("--target")?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(5));
    let origin: Uri = target.parse().context("--target")?;
    let mut clients = Vec::with_capacity(connections);
    for _ in 0..connections {
        let transport = match kind {
            ClientKind::Channel => Transport::Channel(
                endpoint
                    .connect()
                    .await
                    .with_context(|| format!("connecting to {target}"))?,
            ),
            ClientKind::H2 => {
                let authority = origin.authority().context("--target has no host")?.as_str();
                let stream = tokio::time::timeout(
                    Duration::from_secs(5),
                    tokio::net::TcpStream::connect(authority),
                )
                .await
                .with_context(|| format!("connecting to {target}: timed out"))?
                .with_context(|| format!("connecting to {target}"))?;
                stream.set_nodelay(true)?;
                let (send, connection) = hyper::client::conn::http2::handshake(
                    hyper_util::rt::TokioExecutor::new(),
                    hyper_util::rt::TokioIo::new(stream),
                )
                .await
                .with_context(|| format!("HTTP/2 handshake with {target}"))?;
                tokio::spawn(connection);
                Transport::H2(send)
            }
        };
        clients.push(IdempotencyServiceClient::with_origin(
            transport,
            origin.clone(),
        ));
    }
    Ok(clients)
}

/// Waits until the server answers a Get (its store is reachable), bounded.
async fn wait_ready(client: &mut Client, namespace: &str, within: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    loop {
        let request = GetRequest {
            namespace: namespace.to_owned(),
            key: "ready".to_owned(),
        };
        match client.get(request).await {
            Ok(_) => return Ok(()),
            Err(status) if Instant::now() >= deadline => {
                bail!("the server did not answer within {within:?}: {status}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Completes `count` keys before the run, for the replay scenarios.
async fn complete_keys(
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

#[derive(Serialize)]
struct Report {
    scenario: Scenario,
    target: String,
    namespace: String,
    concurrency: usize,
    connections: usize,
    warmup_s: f64,
    duration_s: Option<f64>,
    requests: Option<u64>,
    /// From the end of the warm-up to the last measured operation's end.
    elapsed_s: f64,
    /// Operations that finished without error (cycles for claim-complete).
    ops: u64,
    ops_per_s: f64,
    /// Keys claimed per second: ops/s, times the batch size for claim-batch.
    keys_per_s: f64,
    rpcs: u64,
    rpcs_per_s: f64,
    errors_total: u64,
    errors: BTreeMap<&'static str, u64>,
    error_samples: BTreeMap<&'static str, String>,
    outcomes: BTreeMap<&'static str, BTreeMap<&'static str, u64>>,
    latency_us: BTreeMap<&'static str, LatencySummary>,
    /// This load generator's own CPU time while measuring: it shares the
    /// machine with the server and the database.
    client_cpu_s: Option<f64>,
}

#[derive(Serialize)]
struct LatencySummary {
    count: u64,
    mean: f64,
    p50: u64,
    p90: u64,
    p99: u64,
    p999: u64,
    max: u64,
}

impl From<&Histogram<u64>> for LatencySummary {
    fn from(h: &Histogram<u64>) -> Self {
        Self {
            count: h.len(),
            mean: (h.mean() * 10.0).round() / 10.0,
            p50: h.value_at_quantile(0.50),
            p90: h.value_at_quantile(0.90),
            p99: h.value_at_quantile(0.99),
            p999: h.value_at_quantile(0.999),
            max: h.max(),
        }
    }
}

fn print_report(report: &Report) {
    println!(
        "scenario {}  concurrency {}  connections {}  namespace {}",
        report.scenario.name(),
        report.concurrency,
        report.connections,
        report.namespace
    );
    println!(
        "measured {:.2} s: {} ops ({:.1} ops/s, {:.1} keys/s), {} RPCs ({:.1} RPC/s), {} errors{}",
        report.elapsed_s,
        report.ops,
        report.ops_per_s,
        report.keys_per_s,
        report.rpcs,
        report.rpcs_per_s,
        report.errors_total,
        report
            .client_cpu_s
            .map(|cpu| format!(", client CPU {cpu:.2} s"))
            .unwrap_or_default()
    );
    println!(
        "{:<26} {:>9} {:>8} {:>8} {:>8} {:>8} {:>9}",
        "latency (µs)", "count", "p50", "p90", "p99", "p99.9", "max"
    );
    for (kind, s) in &report.latency_us {
        println!(
            "{:<26} {:>9} {:>8} {:>8} {:>8} {:>8} {:>9}",
            kind, s.count, s.p50, s.p90, s.p99, s.p999, s.max
        );
    }
    for (rpc, outcomes) in &report.outcomes {
        let list: Vec<String> = outcomes.iter().map(|(o, n)| format!("{o} {n}")).collect();
        println!("outcomes {rpc}: {}", list.join(", "));
    }
    if report.errors.is_empty() {
        println!("errors: none");
    }
    for (code, n) in &report.errors {
        let sample = report.error_samples.get(code).map_or("", String::as_str);
        println!("errors {code}: {n} (first: {sample})");
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<ExitCode> {
    let args = Args::parse();
    check_loopback(&args.target)?;
    if args.concurrency == 0 || args.connections == 0 {
        bail!("--concurrency and --connections must be at least 1");
    }
    if args.scenario == Scenario::ClaimBatch && args.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    if args.scenario == Scenario::Contended && args.contended_keys == 0 {
        bail!("--contended-keys must be at least 1");
    }
    if args.scenario.needs_completed_keys() && args.duplicate_keys == 0 {
        bail!("--duplicate-keys must be at least 1");
    }
    let measure_for = match (args.duration, args.requests) {
        (Some(duration), _) => duration,
        (None, Some(_)) => args.max_time,
        (None, None) => Duration::from_secs(10),
    };
    let namespace = args
        .namespace
        .clone()
        .unwrap_or_else(|| format!("bench-{:016x}", rand::random::<u64>()));
    let connections = args.connections.min(args.concurrency);
    let clients = connect(&args.target, connections, args.client).await?;
    wait_ready(&mut clients[0].clone(), &namespace, args.wait_ready).await?;

    let response = vec![b'r'; args.response_bytes];
    let duplicates = if args.scenario.needs_completed_keys() {
        complete_keys(&clients, &namespace, args.duplicate_keys, &response).await?
    } else {
        Vec::new()
    };
    let start = Instant::now();
    let measure_from = start + args.warmup;
    let shared = Arc::new(Shared {
        scenario: args.scenario,
        batch_size: args.batch_size,
        namespace: namespace.clone(),
        response,
        duplicates,
        contended: (0..args.contended_keys)
            .map(|i| format!("hot-{i}"))
            .collect(),
        measure_from,
        stop_at: measure_from + measure_for,
        budget: args.requests,
        started: AtomicU64::new(0),
    });
    let mut callers = tokio::task::JoinSet::new();
    for id in 0..args.concurrency {
        let caller = Caller {
            id,
            client: clients[id % clients.len()].clone(),
            shared: shared.clone(),
            next_key: 0,
            rng: SmallRng::seed_from_u64(rand::random()),
            abandoned: VecDeque::new(),
            stats: Stats::new(),
        };
        callers.spawn(caller.run());
    }
    tokio::time::sleep_until(measure_from.into()).await;
    let cpu_at_start = cpu_seconds();
    // Scripts that measure the server alongside (bench/compare.sh) start
    // counting at this line.
    eprintln!("measuring: setup and warm-up done");

    let mut total = Stats::new();
    while let Some(stats) = callers.join_next().await {
        total.merge(stats.context("a caller panicked")?);
    }
    let cpu_at_end = cpu_seconds();
    let elapsed = total
        .last_finish
        .map_or(measure_for, |end| {
            end.saturating_duration_since(measure_from)
        })
        .as_secs_f64()
        .max(1e-9);
    let errors_total = total.errors.values().sum();
    let report = Report {
        scenario: args.scenario,
        target: args.target.clone(),
        namespace,
        concurrency: args.concurrency,
        connections,
        warmup_s: args.warmup.as_secs_f64(),
        duration_s: args.duration.map(|d| d.as_secs_f64()),
        requests: args.requests,
        elapsed_s: elapsed,
        ops: total.ops,
        ops_per_s: total.ops as f64 / elapsed,
        keys_per_s: total.ops as f64 / elapsed
            * match args.scenario {
                Scenario::ClaimBatch => args.batch_size as f64,
                _ => 1.0,
            },
        rpcs: total.rpcs,
        rpcs_per_s: total.rpcs as f64 / elapsed,
        errors_total,
        errors: total.errors,
        error_samples: total.error_samples,
        outcomes: total.outcomes,
        latency_us: total
            .latency
            .iter()
            .map(|(kind, h)| (*kind, LatencySummary::from(h)))
            .collect(),
        client_cpu_s: cpu_at_start.zip(cpu_at_end).map(|(a, b)| b - a),
    };
    print_report(&report);
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    if report.errors_total > 0 && !args.allow_errors {
        eprintln!("idempotency-bench: {} errors", report.errors_total);
        return Ok(ExitCode::from(2));
    }
    Ok(ExitCode::SUCCESS)
}
