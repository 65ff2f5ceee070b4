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
//!
//! Modules: `transport` (connections to the loopback target: hyper's HTTP/2
//! client or tonic's `Channel`), `scenario` (the scenarios, one caller's loop
//! and the set-up of completed keys), `stats` (what a caller records),
//! `report` (the results as a table and as JSON).
//!
//! It is its own crate in the workspace, so its dependencies (HdrHistogram,
//! hyper's client) stay out of the service's; it takes the generated client
//! from the workspace's proto crate (`idempotency_proto::v1`), not from the
//! service. The crate's second binary, `idempotency-floor` (src/floor), is
//! the minimal server the service is measured against; only it uses sqlx.

#![forbid(unsafe_code)]

mod report;
mod scenario;
mod stats;
mod transport;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;

use crate::report::{LatencySummary, Report, cpu_seconds, print_report};
use crate::scenario::{Caller, Scenario, Shared, complete_keys};
use crate::stats::Stats;
use crate::transport::{ClientKind, check_loopback, connect, wait_ready};

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
        let caller = Caller::new(id, clients[id % clients.len()].clone(), shared.clone());
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
