//! The reaper: in bounded batches, on an interval, turns expired completed
//! records that are remembered into markers (their response dropped) and
//! deletes the other expired records and the markers past their horizon.
//!
//! Expired records are already absent to every call (each call compares
//! `expires_at` with the store's clock), and a remembered record is a marker
//! to every call whether or not the reaper has reached it; the reaper only
//! gives their space back.
//! It is safe to run on every replica at once: the store's delete skips rows
//! another replica is deleting.
//!
//! It must keep pace with the expiry rate whatever it is (5,000 completions a
//! second expire 5,000 rows a second a retention later), without taking the
//! database from the calls: a run deletes batch after batch until one comes
//! back short, resting after each batch as long as the batch took (so it
//! holds a connection at most half the time), and a run that is still
//! behind when the next interval comes goes on at once instead of sleeping.

use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::store::{Reaped, Store};

/// The longest rest between two batches, whatever the last one took.
const MAX_REST: Duration = Duration::from_secs(1);

/// What one run did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub reaped: Reaped,
    /// False when the run stopped at its time budget with full batches still
    /// coming: the next run should start at once.
    pub caught_up: bool,
}

/// Deletes expired records until a batch comes back short, or `budget` has
/// passed, or `stop`.
pub async fn reap_once<S: Store>(
    store: &S,
    batch_size: u32,
    budget: Duration,
    stop: &CancellationToken,
) -> Result<Run, crate::error::Error> {
    let until = Instant::now() + budget;
    let mut reaped = Reaped::default();
    loop {
        let started = Instant::now();
        let batch = store.reap_expired(batch_size).await?;
        reaped.remembered += batch.remembered;
        reaped.deleted += batch.deleted;
        if batch.total() < u64::from(batch_size) {
            return Ok(Run {
                reaped,
                caught_up: true,
            });
        }
        let rest = started.elapsed().min(MAX_REST);
        if Instant::now() + rest >= until || stop.is_cancelled() {
            return Ok(Run {
                reaped,
                caught_up: false,
            });
        }
        tokio::select! {
            () = stop.cancelled() => return Ok(Run { reaped, caught_up: false }),
            () = tokio::time::sleep(rest) => {}
        }
    }
}

/// Runs `reap_once` every `interval` (at once again while it is behind) until
/// `stop`.
pub async fn run<S: Store>(store: S, interval: Duration, batch_size: u32, stop: CancellationToken) {
    let mut behind = false;
    loop {
        if !behind {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(interval) => {}
            }
        }
        if stop.is_cancelled() {
            return;
        }
        let result = reap_once(&store, batch_size, interval, &stop).await;
        crate::metrics::record_reaper_run(result.as_ref().map(|r| r.reaped).map_err(|_| ()));
        behind = false;
        match result {
            Ok(run) => {
                behind = !run.caught_up;
                if run.reaped.total() > 0 {
                    tracing::info!(
                        deleted = run.reaped.deleted,
                        remembered = run.reaped.remembered,
                        caught_up = run.caught_up,
                        "reaper deleted expired records and kept markers of remembered keys"
                    );
                }
            }
            Err(error) => tracing::warn!(%error, "reaper run failed; retrying next interval"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{Key, LeaseToken, Namespace, NewLease};
    use crate::store::StoreOptions;
    use crate::store::sqlite::SqliteStore;

    /// A store holding `n` records that expired a moment ago.
    async fn expired_records(n: usize) -> (tempfile::TempDir, SqliteStore) {
        let dir = tempfile::tempdir().unwrap();
        let options = StoreOptions {
            database_url: None,
            data_dir: dir.path().to_owned(),
            pool_size: 2,
            timeout: Duration::from_secs(5),
            citus_statements: false,
            citus_direct: true,
        };
        let store = SqliteStore::open(&dir.path().join("reaper.db"), &options, "test")
            .await
            .unwrap();
        store.migrate().await.unwrap();
        for i in 0..n {
            let lease = NewLease {
                namespace: Namespace::parse("ns".into()).unwrap(),
                key: Key::parse(format!("k{i}")).unwrap(),
                fingerprint: None,
                lease_token: LeaseToken::generate(),
                lease_ttl: Duration::from_millis(1),
                retention: Duration::from_millis(1),
                late_retry: crate::domain::LateRetry::Reexecute,
            };
            assert!(store.try_claim(&lease).await.unwrap().is_some());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        (dir, store)
    }

    #[tokio::test]
    async fn a_run_deletes_batch_after_batch_until_one_comes_back_short() {
        let (_dir, store) = expired_records(25).await;
        let stop = CancellationToken::new();
        let run = reap_once(&store, 10, Duration::from_secs(60), &stop)
            .await
            .unwrap();
        assert_eq!(
            run,
            Run {
                reaped: Reaped {
                    remembered: 0,
                    deleted: 25
                },
                caught_up: true
            }
        );
    }

    #[tokio::test]
    async fn a_run_out_of_time_says_it_is_behind() {
        let (_dir, store) = expired_records(25).await;
        let stop = CancellationToken::new();
        let run = reap_once(&store, 10, Duration::ZERO, &stop).await.unwrap();
        assert_eq!(
            run,
            Run {
                reaped: Reaped {
                    remembered: 0,
                    deleted: 10
                },
                caught_up: false
            }
        );
        let rest = reap_once(&store, 10, Duration::from_secs(60), &stop)
            .await
            .unwrap();
        assert_eq!(rest.reaped.deleted, 15);
        assert!(rest.caught_up);
    }
}
