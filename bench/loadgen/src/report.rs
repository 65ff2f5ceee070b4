//! The run's results: the report printed as a table and written as JSON, and
//! the load generator's own CPU time.

use std::collections::BTreeMap;

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::scenario::Scenario;

/// This process's CPU time (user + system) so far, from /proc (Linux only).
pub fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 here,
    // in clock ticks (100 per second on Linux).
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0)
}

#[derive(Serialize)]
pub struct Report {
    pub scenario: Scenario,
    pub target: String,
    pub namespace: String,
    pub concurrency: usize,
    pub connections: usize,
    pub warmup_s: f64,
    pub duration_s: Option<f64>,
    pub requests: Option<u64>,
    /// From the end of the warm-up to the last measured operation's end.
    pub elapsed_s: f64,
    /// Operations that finished without error (cycles for claim-complete).
    pub ops: u64,
    pub ops_per_s: f64,
    /// Keys claimed per second: ops/s, times the batch size for claim-batch.
    pub keys_per_s: f64,
    pub rpcs: u64,
    pub rpcs_per_s: f64,
    pub errors_total: u64,
    pub errors: BTreeMap<&'static str, u64>,
    pub error_samples: BTreeMap<&'static str, String>,
    pub outcomes: BTreeMap<&'static str, BTreeMap<&'static str, u64>>,
    pub latency_us: BTreeMap<&'static str, LatencySummary>,
    /// This load generator's own CPU time while measuring: it shares the
    /// machine with the server and the database.
    pub client_cpu_s: Option<f64>,
}

#[derive(Serialize)]
pub struct LatencySummary {
    pub count: u64,
    pub mean: f64,
    pub p50: u64,
    pub p90: u64,
    pub p99: u64,
    pub p999: u64,
    pub max: u64,
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

pub fn print_report(report: &Report) {
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
