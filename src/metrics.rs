//! Prometheus metrics: what an operator watches without reading logs.
//!
//! The recorder is installed once by the binary (`install`), serving
//! `/metrics` on its own port; the rest of the crate records through the
//! `metrics` facade, a no-op when nothing is installed (as in tests that run
//! several servers in one process). Label values stay bounded: never the key,
//! and the namespace only when the operator lists the namespaces to label.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, LazyLock, OnceLock, RwLock};
use std::time::Duration;

use metrics::{
    Counter, Histogram, Label, counter, describe_counter, describe_gauge, describe_histogram,
    gauge, histogram,
};
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder};
use tokio_util::sync::CancellationToken;

use crate::domain::{Namespace, RecordState};
use crate::error::Reason;
use crate::listen;
use crate::store::cache::CacheStats;
use crate::store::{Operations, Reaped, StoreStats};

/// Seconds; from half a millisecond (a replay on a warm pool) to the
/// database timeout.
const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// How often the pool gauges are refreshed.
const POOL_INTERVAL: Duration = Duration::from_secs(5);

/// Installs the Prometheus recorder and its HTTP listener on `addr`
/// (`IDEMPOTENCY_METRICS_ADDR`) and returns the address it serves on. A port
/// in use stops the start, named, unless `give_way` (the address is the
/// default, nobody chose it): then a free port on the same host serves, and
/// a warning says which (two replicas on one host both start).
/// Buckets of idempotency_wait_duration_seconds: over_cap is 0, and a wait
/// ends at IDEMPOTENCY_MAX_WAIT (30 s by default) or the call's deadline.
const WAIT_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
];

pub fn install(addr: SocketAddr, give_way: bool) -> anyhow::Result<SocketAddr> {
    // The exporter binds the port itself and reports only the OS error: bind
    // it first to say which setting to change.
    let addr = match std::net::TcpListener::bind(addr) {
        Ok(_) => addr,
        Err(e) if give_way && e.kind() == std::io::ErrorKind::AddrInUse => {
            let free = std::net::TcpListener::bind(SocketAddr::new(addr.ip(), 0))
                .and_then(|listener| listener.local_addr())
                .map_err(|e| listen::METRICS.error(addr, &e))?;
            tracing::warn!(
                default = %addr,
                %free,
                "IDEMPOTENCY_METRICS_ADDR is not set and its default is in use (another replica on \
                 this host?): metrics are served on another port; set IDEMPOTENCY_METRICS_ADDR to \
                 choose it, or \"\" to turn metrics off"
            );
            free
        }
        Err(e) => return Err(listen::METRICS.error(addr, &e)),
    };
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(
            Matcher::Full("idempotency_call_duration_seconds".into()),
            LATENCY_BUCKETS,
        )?
        .set_buckets_for_metric(
            Matcher::Full("idempotency_wait_duration_seconds".into()),
            WAIT_BUCKETS,
        )?
        .install()
        .map_err(|e| match e {
            BuildError::FailedToCreateHTTPListener(cause) => {
                listen::METRICS.error(addr, &std::io::Error::other(cause))
            }
            other => other.into(),
        })?;
    describe();
    tracing::info!(%addr, "serving Prometheus metrics at /metrics");
    Ok(addr)
}

fn describe() {
    describe_counter!(
        "idempotency_calls_total",
        "gRPC calls by method and status code."
    );
    describe_histogram!(
        "idempotency_call_duration_seconds",
        metrics::Unit::Seconds,
        "gRPC call latency by method."
    );
    describe_counter!(
        "idempotency_claims_total",
        "Claim outcomes: claimed, retried (a retried Claim got its own lease back), reexecuted (a remembered key claimed again: a late retry), in_progress, completed (a replay), fingerprint_mismatch, expired (a remembered key refused as late)."
    );
    describe_counter!(
        "idempotency_errors_total",
        "Calls that failed, by method and the stable reason of their ErrorInfo (LEASE_LOST, STORE_UNAVAILABLE, RATE_LIMITED, ...)."
    );
    describe_counter!(
        "idempotency_lease_takeovers_total",
        "Claims that won a key whose previous lease had expired (its claimant died or was too slow)."
    );
    describe_counter!(
        "idempotency_lease_lost_total",
        "Complete, Release or ExtendLease refused because the lease was no longer the caller's."
    );
    describe_counter!("idempotency_purges_total", "Keys purged by an operator.");
    describe_counter!(
        "idempotency_tls_handshake_failures_total",
        "Connections dropped because their TLS handshake failed or timed out (plaintext clients, untrusted or expired client certificates)."
    );
    describe_gauge!(
        "idempotency_db_pool_connections",
        "Open database connections."
    );
    describe_gauge!(
        "idempotency_db_pool_idle",
        "Open database connections not in use."
    );
    describe_gauge!(
        "idempotency_db_pool_max",
        "The most connections the pool opens."
    );
    describe_gauge!(
        "idempotency_db_pool_waiting",
        "Store operations waiting for a connection."
    );
    describe_counter!(
        "idempotency_reaper_runs_total",
        "Reaper runs by result (ok, error)."
    );
    describe_counter!(
        "idempotency_reaper_deleted_total",
        "Expired records the reaper deleted (markers past their horizon included)."
    );
    describe_counter!(
        "idempotency_reaper_remembered_total",
        "Expired completed records the reaper turned into markers of remembered keys (their response dropped)."
    );
    describe_gauge!(
        "idempotency_records",
        "Stored records by state; `expired` are rows waiting for the reaper."
    );
    describe_gauge!(
        "idempotency_reaper_lag_seconds",
        "How long the oldest expired row has waited for the reaper."
    );
    describe_gauge!(
        "idempotency_store_up",
        "1 while the store answers health pings, else 0."
    );
    describe_counter!(
        "idempotency_replay_cache_lookups_total",
        "Claims checked against the replay cache, by result: hit (answered from memory) or miss (asked the store; fresh keys too)."
    );
    describe_gauge!(
        "idempotency_replay_cache_bytes",
        "Bytes the replay cache holds, by its own count (responses, fingerprints, keys and a fixed overhead per entry)."
    );
    describe_gauge!(
        "idempotency_replay_cache_entries",
        "Completed records the replay cache holds."
    );
    describe_gauge!(
        "idempotency_replay_cache_fresh",
        "1 while the purge feed vouches for the replay cache (it answers), else 0."
    );
    describe_gauge!(
        "idempotency_waiters",
        "Claims waiting on this replica for another holder's lease to end (ClaimRequest.wait)."
    );
    describe_counter!(
        "idempotency_waits_total",
        "Waits ended, by outcome: completed (the stored result), claimed (this Claim took the key), fingerprint_mismatch, timed_out, shutdown, over_cap (IDEMPOTENCY_MAX_WAITERS reached: answered at once), error."
    );
    describe_histogram!(
        "idempotency_wait_duration_seconds",
        "How long Claims waited, by outcome."
    );
    describe_counter!(
        "idempotency_wait_reads_total",
        "Reads of a key by its waiters on this replica (one read serves them all), by cause: joined, woken (a Complete, Release or Purge announced), lease_expired (the holder's lease ran out), poll (the feed was not caught up), lost (another replica took the key first)."
    );
    describe_gauge!(
        "idempotency_wait_feed_fresh",
        "1 while the purge feed is caught up, so that waiters are woken by it; 0 while they poll instead."
    );
    describe_counter!(
        "idempotency_batch_splits_total",
        "Batches that asked for their items' own errors, failed UNAVAILABLE on a store whose keys live on several nodes (Citus), and were tried again item by item, by operation (claim, complete)."
    );
    describe_counter!(
        "idempotency_replay_cache_too_large_total",
        "Completed records not kept in the replay cache because they are larger than one shard's share of IDEMPOTENCY_REPLAY_CACHE_BYTES (the budget is split between shards: about budget / (4 x cores), rounded to a power of two)."
    );
}

/// Which namespaces get their own label value; the rest share "other". With no
/// list, metrics carry no namespace label at all.
#[derive(Debug, Clone, Default)]
pub struct NamespaceLabels(Option<Arc<HashSet<String>>>);

impl NamespaceLabels {
    /// Blank entries are ignored, so `IDEMPOTENCY_METRICS_NAMESPACES=""` means
    /// no namespace label.
    pub fn new(names: &[String]) -> Self {
        let listed: HashSet<String> = names
            .iter()
            .map(|n| n.trim())
            .filter(|n| !n.is_empty())
            .map(str::to_owned)
            .collect();
        Self((!listed.is_empty()).then(|| Arc::new(listed)))
    }

    /// The namespace label's value for a call, `None` without a list.
    fn value(&self, namespace: Option<&Namespace>) -> Option<String> {
        let listed = self.0.as_ref()?;
        Some(match namespace {
            Some(ns) if listed.contains(ns.as_str()) => ns.as_str().to_owned(),
            _ => "other".to_owned(),
        })
    }

    #[cfg(test)]
    fn push(&self, labels: &mut Vec<Label>, namespace: Option<&Namespace>) {
        if let Some(value) = self.value(namespace) {
            labels.push(Label::new("namespace", value));
        }
    }
}

/// What one finished call contributes.
pub struct CallRecord<'a> {
    pub method: &'static str,
    pub code: &'static str,
    pub namespace: Option<&'a Namespace>,
    pub latency: Duration,
    pub claim_outcome: Option<&'static str>,
    pub took_over: bool,
    pub lease_lost: bool,
    /// The error's stable reason, for a call that failed.
    pub reason: Option<Reason>,
}

/// The label set of one kind of finished call.
#[derive(Clone, PartialEq, Eq, Hash)]
struct CallKind {
    method: &'static str,
    code: &'static str,
    claim_outcome: Option<&'static str>,
    /// The namespace label's value, when the operator listed namespaces.
    namespace: Option<String>,
}

/// The metric handles of one kind of call. Takeovers and lost leases are
/// registered when first counted, so that no series shows until it happens.
struct CallHandles {
    calls: Counter,
    duration: Histogram,
    claims: Option<Counter>,
    takeovers: OnceLock<Counter>,
    lease_lost: OnceLock<Counter>,
    /// The namespace label, when there is one.
    common: Vec<Label>,
    method: &'static str,
}

impl CallHandles {
    fn register(kind: &CallKind) -> Self {
        let common: Vec<Label> = kind
            .namespace
            .iter()
            .map(|value| Label::new("namespace", value.clone()))
            .collect();
        let with = |extra: &[(&'static str, &'static str)]| labelled(&common, extra);
        Self {
            calls: counter!(
                "idempotency_calls_total",
                with(&[("method", kind.method), ("code", kind.code)])
            ),
            duration: histogram!("idempotency_call_duration_seconds", "method" => kind.method),
            claims: kind
                .claim_outcome
                .map(|outcome| counter!("idempotency_claims_total", with(&[("outcome", outcome)]))),
            takeovers: OnceLock::new(),
            lease_lost: OnceLock::new(),
            method: kind.method,
            common,
        }
    }

    fn takeovers(&self) -> &Counter {
        self.takeovers.get_or_init(|| {
            counter!(
                "idempotency_lease_takeovers_total",
                labelled(&self.common, &[])
            )
        })
    }

    fn lease_lost(&self) -> &Counter {
        self.lease_lost.get_or_init(|| {
            counter!(
                "idempotency_lease_lost_total",
                labelled(&self.common, &[("method", self.method)])
            )
        })
    }
}

fn labelled(common: &[Label], extra: &[(&'static str, &'static str)]) -> Vec<Label> {
    let mut all = common.to_vec();
    all.extend(extra.iter().map(|(k, v)| Label::new(*k, *v)));
    all
}

/// Handles by kind of call, registered once each: registering (hashing a
/// name and its labels, a lookup in the exporter's registry, a few
/// allocations) cost more than the rest of a call's metrics. The kinds are
/// bounded: methods times codes times outcomes times the listed namespaces.
static CALL_HANDLES: LazyLock<RwLock<HashMap<CallKind, Arc<CallHandles>>>> =
    LazyLock::new(RwLock::default);

fn call_handles(kind: CallKind) -> Arc<CallHandles> {
    if let Some(handles) = CALL_HANDLES
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&kind)
    {
        return handles.clone();
    }
    let mut all = CALL_HANDLES.write().unwrap_or_else(|e| e.into_inner());
    all.entry(kind)
        .or_insert_with_key(|kind| Arc::new(CallHandles::register(kind)))
        .clone()
}

pub fn record_call(labels: &NamespaceLabels, call: CallRecord<'_>) {
    let handles = call_handles(CallKind {
        method: call.method,
        code: call.code,
        claim_outcome: call.claim_outcome,
        namespace: labels.value(call.namespace),
    });
    handles.calls.increment(1);
    handles.duration.record(call.latency.as_secs_f64());
    if let Some(claims) = &handles.claims {
        claims.increment(1);
    }
    if call.took_over {
        handles.takeovers().increment(1);
    }
    if call.lease_lost {
        handles.lease_lost().increment(1);
    }
    if let Some(reason) = call.reason {
        counter!("idempotency_errors_total", "method" => call.method, "reason" => reason.as_str())
            .increment(1);
    }
}

pub fn record_tls_handshake_failure() {
    counter!("idempotency_tls_handshake_failures_total").increment(1);
}

/// A batch tried again item by item after it failed on one node (Citus).
pub fn batch_split(operation: &'static str) {
    counter!("idempotency_batch_splits_total", "operation" => operation).increment(1);
}

pub fn record_purge() {
    counter!("idempotency_purges_total").increment(1);
}

pub fn record_reaper_run(result: Result<Reaped, ()>) {
    match result {
        Ok(reaped) => {
            counter!("idempotency_reaper_runs_total", "result" => "ok").increment(1);
            counter!("idempotency_reaper_deleted_total").increment(reaped.deleted);
            counter!("idempotency_reaper_remembered_total").increment(reaped.remembered);
        }
        Err(()) => counter!("idempotency_reaper_runs_total", "result" => "error").increment(1),
    }
}

/// How many Claims wait on this replica now.
pub fn record_waiters(waiting: usize) {
    gauge!("idempotency_waiters").set(waiting as f64);
}

/// A Claim's wait ended: how, and after how long.
pub fn record_wait(outcome: &'static str, waited: std::time::Duration) {
    counter!("idempotency_waits_total", "outcome" => outcome).increment(1);
    histogram!("idempotency_wait_duration_seconds", "outcome" => outcome)
        .record(waited.as_secs_f64());
}

/// Waiters read a key (one read shared by this replica's waiters on it):
/// why ("joined", "woken", "lease_expired", "poll", "lost").
pub fn record_wait_read(cause: &'static str) {
    counter!("idempotency_wait_reads_total", "cause" => cause).increment(1);
}

/// Whether the purge feed is caught up for waiters (else they poll).
pub fn record_wait_feed(fresh: bool) {
    gauge!("idempotency_wait_feed_fresh").set(if fresh { 1.0 } else { 0.0 });
}

pub fn record_store_up(up: bool) {
    gauge!("idempotency_store_up").set(if up { 1.0 } else { 0.0 });
}

fn state_label(state: RecordState) -> &'static str {
    match state {
        RecordState::InProgress => "in_progress",
        RecordState::Completed => "completed",
        RecordState::Released => "released",
    }
}

fn record_stats(stats: &StoreStats) {
    for state in [
        RecordState::InProgress,
        RecordState::Completed,
        RecordState::Released,
    ] {
        gauge!("idempotency_records", "state" => state_label(state)).set(stats.count(state) as f64);
    }
    gauge!("idempotency_records", "state" => "expired").set(stats.expired as f64);
    gauge!("idempotency_records", "state" => "remembered").set(stats.remembered_total() as f64);
    gauge!("idempotency_reaper_lag_seconds").set(stats.reaper_lag().as_secs_f64());
}

/// The replay cache counts its hits itself (an atomic add per Claim); they
/// are published here with the pool gauges.
fn record_cache(cache: &CacheStats) {
    counter!("idempotency_replay_cache_lookups_total", "result" => "hit").absolute(cache.hits);
    counter!("idempotency_replay_cache_lookups_total", "result" => "miss").absolute(cache.misses);
    gauge!("idempotency_replay_cache_bytes").set(cache.bytes as f64);
    gauge!("idempotency_replay_cache_entries").set(cache.entries as f64);
    gauge!("idempotency_replay_cache_fresh").set(if cache.fresh { 1.0 } else { 0.0 });
    counter!("idempotency_replay_cache_too_large_total").absolute(cache.too_large);
}

/// Refreshes the pool gauges every few seconds and, when `records_every` is
/// set, the records-by-state gauge (a full count: keep it slow on big tables).
pub async fn watch_store<S: Operations>(
    store: S,
    records_every: Option<Duration>,
    stop: CancellationToken,
) {
    let mut last_count: Option<tokio::time::Instant> = None;
    loop {
        let pool = store.pool_status();
        gauge!("idempotency_db_pool_connections").set(f64::from(pool.size));
        gauge!("idempotency_db_pool_idle").set(f64::from(pool.idle));
        gauge!("idempotency_db_pool_max").set(f64::from(pool.max));
        gauge!("idempotency_db_pool_waiting").set(f64::from(pool.waiting()));
        if let Some(cache) = store.cache_stats() {
            record_cache(&cache);
        }
        if let Some(every) = records_every
            && last_count.is_none_or(|t| t.elapsed() >= every)
        {
            last_count = Some(tokio::time::Instant::now());
            let counted = tokio::select! {
                () = stop.cancelled() => return,
                counted = store.stats_estimate() => counted,
            };
            match counted {
                Ok(stats) => record_stats(&stats),
                Err(error) => tracing::debug!(%error, "counting records failed"),
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(POOL_INTERVAL.min(records_every.unwrap_or(POOL_INTERVAL))) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_namespace_list_means_no_namespace_label() {
        let mut labels = Vec::new();
        NamespaceLabels::new(&[String::new()]).push(&mut labels, None);
        assert!(labels.is_empty());
        let listed = NamespaceLabels::new(&["payments".to_owned()]);
        let payments = Namespace::parse("payments".to_owned()).unwrap();
        let orders = Namespace::parse("orders".to_owned()).unwrap();
        listed.push(&mut labels, Some(&payments));
        listed.push(&mut labels, Some(&orders));
        let values: Vec<_> = labels.iter().map(|l| l.value().to_owned()).collect();
        assert_eq!(values, ["payments", "other"]);
    }
}
