//! What one caller records: latency histograms per RPC and per operation,
//! outcomes per RPC, errors by code. Each caller keeps its own and they are
//! merged once at the end, so a call takes no lock.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

/// What one caller records; merged once at the end, so no locks per call.
pub struct Stats {
    pub latency: BTreeMap<&'static str, Histogram<u64>>,
    pub outcomes: BTreeMap<&'static str, BTreeMap<&'static str, u64>>,
    pub errors: BTreeMap<&'static str, u64>,
    /// The first message seen per error code, to tell what went wrong.
    pub error_samples: BTreeMap<&'static str, String>,
    pub ops: u64,
    pub rpcs: u64,
    pub last_finish: Option<Instant>,
    /// False during the warm-up: nothing is recorded.
    pub recording: bool,
}

impl Stats {
    pub fn new() -> Self {
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

    pub fn latency(&mut self, kind: &'static str, elapsed: Duration) {
        if self.recording {
            self.latency
                .entry(kind)
                .or_insert_with(new_histogram)
                .saturating_record(elapsed.as_micros() as u64);
        }
    }

    pub fn outcome(&mut self, rpc: &'static str, outcome: &'static str) {
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

    pub fn error(&mut self, code: &'static str, message: impl FnOnce() -> String) {
        if self.recording {
            *self.errors.entry(code).or_default() += 1;
            self.error_samples.entry(code).or_insert_with(message);
        }
    }

    pub fn merge(&mut self, other: Stats) {
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
