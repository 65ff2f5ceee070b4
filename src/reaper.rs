//! The reaper: deletes expired records in bounded batches, on an interval.
//!
//! Expired records are already absent to every call (each call compares
//! `expires_at` with the store's clock); the reaper only gives their space back.
//! It is safe to run on every replica at once: the store's delete skips rows
//! another replica is deleting.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::store::Store;

/// At most this many batches per run, so one run cannot monopolise the store
/// after a long outage; the next run continues.
const MAX_BATCHES_PER_RUN: u32 = 100;

/// Deletes expired records until a batch comes back short (or the per-run cap).
/// Returns how many it deleted.
pub async fn reap_once<S: Store>(store: &S, batch_size: u32) -> Result<u64, crate::error::Error> {
    let mut deleted = 0;
    for _ in 0..MAX_BATCHES_PER_RUN {
        let batch = store.reap_expired(batch_size).await?;
        deleted += batch;
        if batch < u64::from(batch_size) {
            break;
        }
    }
    Ok(deleted)
}

/// Runs `reap_once` every `interval` until `stop`.
pub async fn run<S: Store>(store: S, interval: Duration, batch_size: u32, stop: CancellationToken) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
        let result = reap_once(&store, batch_size).await;
        crate::metrics::record_reaper_run(result.as_ref().map(|d| *d).map_err(|_| ()));
        match result {
            Ok(0) => {}
            Ok(deleted) => tracing::info!(deleted, "reaper deleted expired records"),
            Err(error) => tracing::warn!(%error, "reaper run failed; retrying next interval"),
        }
    }
}
