//! The embedded SQLite store: the zero-setup default, for one instance (a
//! sidecar, local development, a small deployment). PostgreSQL is the store for
//! several replicas.
//!
//! Settings, chosen for "a Complete that returned OK survives a crash":
//! - `journal_mode=WAL`: readers never block the writer, and a commit is one
//!   append to the log;
//! - `synchronous=FULL`: the log is fsynced at every commit, so a committed
//!   record survives a kill -9 of the process and a power loss of the machine;
//! - `busy_timeout`: the configured store timeout, after which a locked file
//!   is UNAVAILABLE rather than a hang.
//!
//! All writes go through one connection, so they queue in the pool instead of
//! spinning on SQLite's file lock; reads use a pool of their own. The clock is
//! the process's: times are microseconds since the Unix epoch, taken after the
//! writer connection is acquired so that waiting in line does not age them.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use sqlx::{ConnectOptions, Connection as _, Row};

use super::cache::CacheStats;
use super::{
    Budget, FirstClaim, Operations, PoolStatus, PurgeEvent, Reaped, StateCount, Store,
    StoreOptions, StoreStats, micros, one_by_one,
};
use crate::domain::{
    Checkpoint, Completion, Fingerprint, Key, Lease, LeaseToken, Namespace, NewLease, Purged,
    Record, RecordState, Snapshot,
};
use crate::error::Error;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/sqlite");

const FETCH: &str = "
SELECT state, fencing_token, lease_token, fingerprint, response, retention_us,
       lease_expires_at, expires_at, created_at, updated_at, checkpoint, checkpoint_fencing,
       remember_until
FROM idempotency_records WHERE namespace = ?1 AND key = ?2";

/// The same rule as PostgreSQL's TRY_CLAIM (see there); `?7` is now.
const TRY_CLAIM: &str = "
INSERT INTO idempotency_records AS r
    (namespace, key, state, fencing_token, lease_token, fingerprint, response, retention_us,
     lease_expires_at, expires_at, created_at, updated_at)
VALUES (?1, ?2, 1, 1, ?3, ?4, NULL, ?6, ?7 + ?5, ?7 + ?5 + ?6, ?7, ?7)
ON CONFLICT (namespace, key) DO UPDATE SET
    state = 1,
    fencing_token = r.fencing_token + 1,
    lease_token = excluded.lease_token,
    fingerprint = CASE WHEN r.expires_at <= ?7 THEN excluded.fingerprint
                       ELSE coalesce(r.fingerprint, excluded.fingerprint) END,
    response = NULL,
    retention_us = excluded.retention_us,
    lease_expires_at = excluded.lease_expires_at,
    expires_at = excluded.expires_at,
    created_at = CASE WHEN r.expires_at <= ?7 THEN ?7 ELSE r.created_at END,
    updated_at = ?7,
    checkpoint = CASE WHEN r.expires_at <= ?7 THEN NULL ELSE r.checkpoint END,
    checkpoint_fencing = CASE WHEN r.expires_at <= ?7 THEN NULL ELSE r.checkpoint_fencing END,
    remember_until = NULL
WHERE (r.expires_at <= ?7 AND NOT (r.state = 2 AND coalesce(r.remember_until > ?7, 0)))
   OR ((r.state = 3 OR (r.state = 1 AND r.lease_expires_at <= ?7))
       AND (r.fingerprint IS NULL OR excluded.fingerprint IS NULL
            OR r.fingerprint = excluded.fingerprint))
RETURNING fencing_token, lease_expires_at, expires_at, checkpoint, checkpoint_fencing";

/// As PostgreSQL's COMPLETE: the horizon is ?7 (remember_for) after now.
const COMPLETE: &str = "
UPDATE idempotency_records
SET state = 2, response = ?4, lease_expires_at = NULL,
    expires_at = ?6 + coalesce(?5, retention_us),
    remember_until = ?6 + ?7,
    updated_at = ?6, checkpoint = NULL, checkpoint_fencing = NULL
WHERE namespace = ?1 AND key = ?2 AND state = 1 AND lease_token = ?3 AND expires_at > ?6
RETURNING expires_at";

/// PostgreSQL's RECLAIM; ?7 is now.
const RECLAIM: &str = "
UPDATE idempotency_records
SET state = 1, fencing_token = fencing_token + 1, lease_token = ?3, fingerprint = ?4,
    response = NULL, retention_us = ?6, lease_expires_at = ?7 + ?5,
    expires_at = ?7 + ?5 + ?6, created_at = ?7, updated_at = ?7,
    checkpoint = NULL, checkpoint_fencing = NULL, remember_until = NULL
WHERE namespace = ?1 AND key = ?2
  AND ((state = 2 AND expires_at <= ?7 AND remember_until > ?7)
       OR (state = 4 AND expires_at > ?7))
RETURNING fencing_token, lease_expires_at, expires_at, checkpoint, checkpoint_fencing";

/// A checkpoint given (?5 not NULL) is saved under the lease's fencing token.
const RELEASE: &str = "
UPDATE idempotency_records
SET state = 3, lease_expires_at = NULL, expires_at = ?4 + retention_us, updated_at = ?4,
    checkpoint = coalesce(?5, checkpoint),
    checkpoint_fencing = CASE WHEN ?5 IS NULL THEN checkpoint_fencing ELSE fencing_token END
WHERE namespace = ?1 AND key = ?2 AND state = 1 AND lease_token = ?3 AND expires_at > ?4";

/// As in RELEASE, a checkpoint given (?6 not NULL) is saved with the lease.
const EXTEND_LEASE: &str = "
UPDATE idempotency_records
SET lease_expires_at = ?5 + ?4, expires_at = ?5 + ?4 + retention_us, updated_at = ?5,
    checkpoint = coalesce(?6, checkpoint),
    checkpoint_fencing = CASE WHEN ?6 IS NULL THEN checkpoint_fencing ELSE fencing_token END
WHERE namespace = ?1 AND key = ?2 AND state = 1 AND lease_token = ?3 AND expires_at > ?5
RETURNING lease_expires_at";

/// The reaper's two steps as PostgreSQL's REAP, over the same batch (the
/// oldest ?2 expired rows; ?1 is now), run in one transaction: the
/// remembered records become markers, then the rest are deleted.
const REAP_REMEMBER: &str = "
UPDATE idempotency_records
SET state = 4, response = NULL, checkpoint = NULL, checkpoint_fencing = NULL,
    expires_at = remember_until, remember_until = expires_at
WHERE rowid IN (SELECT rowid FROM idempotency_records
                WHERE expires_at <= ?1 ORDER BY expires_at LIMIT ?2)
  AND state = 2 AND remember_until > ?1";

const REAP: &str = "
DELETE FROM idempotency_records
WHERE rowid IN (SELECT rowid FROM idempotency_records
                WHERE expires_at <= ?1 ORDER BY expires_at LIMIT ?2)
  AND NOT (state = 2 AND coalesce(remember_until > ?1, 0))";

/// As PostgreSQL's PURGE: a live record expires now; a remembered key
/// becomes released without fingerprint until its horizon; 4 for the
/// latter.
const PURGE: &str = "
UPDATE idempotency_records
SET state = CASE WHEN expires_at > ?3 AND state <> 4 THEN state ELSE 3 END,
    fingerprint = CASE WHEN expires_at > ?3 AND state <> 4 THEN fingerprint END,
    response = CASE WHEN expires_at > ?3 AND state <> 4 THEN response END,
    checkpoint = CASE WHEN expires_at > ?3 AND state <> 4 THEN checkpoint END,
    checkpoint_fencing = CASE WHEN expires_at > ?3 AND state <> 4 THEN checkpoint_fencing END,
    expires_at = CASE WHEN state = 4 THEN expires_at
                      WHEN expires_at > ?3 THEN ?3
                      ELSE remember_until END,
    remember_until = NULL, lease_expires_at = NULL, updated_at = ?3
WHERE namespace = ?1 AND key = ?2
  AND (expires_at > ?3 OR (state = 2 AND remember_until > ?3))
RETURNING CASE WHEN expires_at > ?3 THEN 4 ELSE state END";

const STATS_LIVE: &str = "
SELECT namespace, state, count(*) AS count
FROM idempotency_records WHERE expires_at > ?1
GROUP BY namespace, state ORDER BY namespace, state";

const STATS_SUMMARY: &str = "
SELECT count(*) FILTER (WHERE expires_at <= ?1) AS expired,
       min(created_at) FILTER (WHERE expires_at > ?1) AS oldest_created_at,
       min(expires_at) AS earliest_expiry
FROM idempotency_records";

#[derive(Clone)]
pub struct SqliteStore {
    /// One connection: SQLite has one writer at a time anyway.
    writer: SqlitePool,
    readers: SqlitePool,
    max_readers: u32,
    path: PathBuf,
    budget: Budget,
}

impl SqliteStore {
    /// Opens (creating when missing) the database file and its folder.
    /// `setting` names where the path came from, for errors: the data
    /// directory (`IDEMPOTENCY_DATA_DIR=./data`) or `DATABASE_URL`.
    pub async fn open(path: &Path, options: &StoreOptions, setting: &str) -> anyhow::Result<Self> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| {
                anyhow::anyhow!(
                    "{setting}: cannot create the folder {}: {e}",
                    parent.display()
                )
            })?;
        }
        let connect_options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(options.timeout)
            .disable_statement_logging();
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .acquire_timeout(options.timeout)
            .connect_with(connect_options.clone())
            .await
            .map_err(|e| {
                let cause = match &e {
                    sqlx::Error::Database(e) => e.message().to_owned(),
                    other => other.to_string(),
                };
                anyhow::anyhow!(
                    "{setting}: cannot open or create the SQLite file {} (its folder must be writable): {cause}",
                    path.display()
                )
            })?;
        let readers = SqlitePoolOptions::new()
            .max_connections(options.pool_size.max(1))
            .acquire_timeout(options.timeout)
            .connect_lazy_with(connect_options);
        Ok(Self {
            writer,
            readers,
            max_readers: options.pool_size.max(1),
            path: path.to_owned(),
            budget: Budget::new("sqlite", options.timeout),
        })
    }

    pub async fn migrate(&self) -> anyhow::Result<()> {
        MIGRATOR.run(&self.writer).await.map_err(|e| {
            anyhow::anyhow!(
                "migrating the SQLite file {} failed: {e}",
                self.path.display()
            )
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The row of a write statement, read to its end. A write returns its row
/// with `fetch_all`, never `fetch_optional`: sqlx stops stepping a SQLite
/// statement at the first row for the latter, and an autocommit statement
/// commits at its last step, so a commit that fails (a full disk: SQLITE_FULL
/// as the WAL grows) would go unseen and the caller be told of a write that
/// was never stored.
fn first<T>(rows: Vec<T>) -> Option<T> {
    rows.into_iter().next()
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(micros)
        .unwrap_or_default()
}

fn system_time(us: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_micros(us.max(0) as u64)
}

/// The state column's code of a marker (a remembered key whose result the
/// reaper dropped).
const MARKER: i64 = 4;

fn state_from(code: i64) -> Result<RecordState, Error> {
    match code {
        1 => Ok(RecordState::InProgress),
        2 | MARKER => Ok(RecordState::Completed),
        3 => Ok(RecordState::Released),
        other => Err(Error::Internal(
            format!("unknown record state {other} in the database").into(),
        )),
    }
}

fn record_from_row(row: &SqliteRow) -> Result<Record, Error> {
    let get = |e: sqlx::Error| Error::Internal(Box::new(e));
    let token: Vec<u8> = row.try_get("lease_token").map_err(get)?;
    let token = <[u8; 16]>::try_from(token)
        .map(LeaseToken::from_bytes)
        .map_err(|_| Error::Internal("a stored lease token is not 16 bytes".into()))?;
    let state: i64 = row.try_get("state").map_err(get)?;
    let expires_at = system_time(row.try_get("expires_at").map_err(get)?);
    let remember_until = row
        .try_get::<Option<i64>, _>("remember_until")
        .map_err(get)?
        .map(system_time);
    // A marker keeps the horizon in expires_at and the result's expiry in
    // remember_until (as on PostgreSQL).
    let (expires_at, remember_until) = match (state, remember_until) {
        (MARKER, Some(expired_at)) => (expired_at, Some(expires_at)),
        (MARKER, None) => {
            return Err(Error::Internal(
                "a marker in the database has no expiry".into(),
            ));
        }
        _ => (expires_at, remember_until),
    };
    Ok(Record {
        state: state_from(state)?,
        fencing_token: row.try_get::<i64, _>("fencing_token").map_err(get)? as u64,
        lease_token: Some(token),
        fingerprint: row
            .try_get::<Option<Vec<u8>>, _>("fingerprint")
            .map_err(get)?
            .and_then(Fingerprint::from_stored),
        response: row.try_get("response").map_err(get)?,
        retention: Duration::from_micros(row.try_get::<i64, _>("retention_us").map_err(get)? as u64),
        lease_expires_at: row
            .try_get::<Option<i64>, _>("lease_expires_at")
            .map_err(get)?
            .map(system_time),
        expires_at,
        created_at: system_time(row.try_get("created_at").map_err(get)?),
        updated_at: system_time(row.try_get("updated_at").map_err(get)?),
        checkpoint: checkpoint_from_row(row)?,
        remember_until,
    })
}

/// The lease a claiming statement returns (its fencing token, times and
/// checkpoint).
fn lease_from_row(row: &SqliteRow, lease_token: LeaseToken) -> Result<Lease, Error> {
    let get = |e: sqlx::Error| Error::Internal(Box::new(e));
    Ok(Lease {
        lease_token,
        fencing_token: row.try_get::<i64, _>("fencing_token").map_err(get)? as u64,
        lease_expires_at: system_time(row.try_get("lease_expires_at").map_err(get)?),
        expires_at: system_time(row.try_get("expires_at").map_err(get)?),
        checkpoint: checkpoint_from_row(row)?,
    })
}

/// The checkpoint columns of a row (NULL for a key that has none).
fn checkpoint_from_row(row: &SqliteRow) -> Result<Option<Checkpoint>, Error> {
    let get = |e: sqlx::Error| Error::Internal(Box::new(e));
    Ok(Checkpoint::from_stored(
        row.try_get("checkpoint").map_err(get)?,
        row.try_get("checkpoint_fencing").map_err(get)?,
    ))
}

impl SqliteStore {
    /// Runs a statement that claims a key with `lease` (TRY_CLAIM, RECLAIM:
    /// ?1 to ?6 as a new record's columns, ?7 now) and reads the lease it
    /// returns, if it applied.
    async fn claiming(
        &self,
        operation: &'static str,
        statement: &'static str,
        lease: &NewLease,
    ) -> Result<Option<Lease>, Error> {
        let row = self
            .budget
            .run(operation, async {
                let mut conn = self.writer.acquire().await?;
                sqlx::query(statement)
                    .bind(lease.namespace.as_str())
                    .bind(lease.key.as_str())
                    .bind(lease.lease_token.as_bytes().as_slice())
                    .bind(lease.fingerprint.as_ref().map(Fingerprint::as_bytes))
                    .bind(micros(lease.lease_ttl))
                    .bind(micros(lease.retention))
                    .bind(now_us())
                    .fetch_all(&mut *conn)
                    .await
                    .map(first)
            })
            .await?;
        row.map(|row| lease_from_row(&row, lease.lease_token))
            .transpose()
    }
}

impl Store for SqliteStore {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    async fn fetch(&self, namespace: &Namespace, key: &Key) -> Result<Snapshot, Error> {
        let (now, row) = self
            .budget
            .run("fetch", async {
                let mut conn = self.readers.acquire().await?;
                let now = now_us();
                let row = sqlx::query(FETCH)
                    .bind(namespace.as_str())
                    .bind(key.as_str())
                    .fetch_optional(&mut *conn)
                    .await?;
                Ok((now, row))
            })
            .await?;
        Ok(Snapshot {
            now: system_time(now),
            record: row.as_ref().map(record_from_row).transpose()?,
        })
    }

    async fn try_claim(&self, lease: &NewLease) -> Result<Option<Lease>, Error> {
        self.claiming("try_claim", TRY_CLAIM, lease).await
    }

    async fn reclaim(&self, lease: &NewLease) -> Result<Option<Lease>, Error> {
        self.claiming("reclaim", RECLAIM, lease).await
    }

    async fn complete(
        &self,
        namespace: &Namespace,
        key: &Key,
        token: &LeaseToken,
        response: &[u8],
        retention: Option<Duration>,
        remember_for: Option<Duration>,
    ) -> Result<Option<SystemTime>, Error> {
        let expires_at: Option<i64> = self
            .budget
            .run("complete", async {
                let mut conn = self.writer.acquire().await?;
                sqlx::query_scalar(COMPLETE)
                    .bind(namespace.as_str())
                    .bind(key.as_str())
                    .bind(token.as_bytes().as_slice())
                    .bind(response)
                    .bind(retention.map(micros))
                    .bind(now_us())
                    .bind(remember_for.map(micros))
                    .fetch_all(&mut *conn)
                    .await
                    .map(first)
            })
            .await?;
        Ok(expires_at.map(system_time))
    }

    async fn release(
        &self,
        namespace: &Namespace,
        key: &Key,
        token: &LeaseToken,
        checkpoint: Option<&[u8]>,
    ) -> Result<bool, Error> {
        let done = self
            .budget
            .run("release", async {
                let mut conn = self.writer.acquire().await?;
                sqlx::query(RELEASE)
                    .bind(namespace.as_str())
                    .bind(key.as_str())
                    .bind(token.as_bytes().as_slice())
                    .bind(now_us())
                    .bind(checkpoint)
                    .execute(&mut *conn)
                    .await
            })
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn extend_lease(
        &self,
        namespace: &Namespace,
        key: &Key,
        token: &LeaseToken,
        lease_ttl: Duration,
        checkpoint: Option<&[u8]>,
    ) -> Result<Option<SystemTime>, Error> {
        let lease_expires_at: Option<i64> = self
            .budget
            .run("extend_lease", async {
                let mut conn = self.writer.acquire().await?;
                sqlx::query_scalar(EXTEND_LEASE)
                    .bind(namespace.as_str())
                    .bind(key.as_str())
                    .bind(token.as_bytes().as_slice())
                    .bind(micros(lease_ttl))
                    .bind(now_us())
                    .bind(checkpoint)
                    .fetch_all(&mut *conn)
                    .await
                    .map(first)
            })
            .await?;
        Ok(lease_expires_at.map(system_time))
    }

    async fn reap_expired(&self, batch: u32) -> Result<Reaped, Error> {
        self.budget
            .run("reap", async {
                let mut conn = self.writer.acquire().await?;
                let mut transaction = conn.begin().await?;
                let now = now_us();
                let remembered = sqlx::query(REAP_REMEMBER)
                    .bind(now)
                    .bind(i64::from(batch))
                    .execute(&mut *transaction)
                    .await?
                    .rows_affected();
                let left = i64::from(batch) - remembered as i64;
                let deleted = sqlx::query(REAP)
                    .bind(now)
                    .bind(left)
                    .execute(&mut *transaction)
                    .await?
                    .rows_affected();
                transaction.commit().await?;
                Ok(Reaped {
                    remembered,
                    deleted,
                })
            })
            .await
    }

    async fn purge(&self, namespace: &Namespace, key: &Key) -> Result<Option<Purged>, Error> {
        let state: Option<i64> = self
            .budget
            .run("purge", async {
                let mut conn = self.writer.acquire().await?;
                sqlx::query_scalar(PURGE)
                    .bind(namespace.as_str())
                    .bind(key.as_str())
                    .bind(now_us())
                    .fetch_all(&mut *conn)
                    .await
                    .map(first)
            })
            .await?;
        state
            .map(|code| match code {
                MARKER => Ok(Purged::Remembered),
                code => state_from(code).map(Purged::Live),
            })
            .transpose()
    }

    async fn claim_or_fetch(&self, lease: &NewLease) -> Result<FirstClaim, Error> {
        one_by_one::claim_or_fetch(self, lease).await
    }

    async fn claim_or_fetch_many(&self, leases: &[NewLease]) -> Result<Vec<FirstClaim>, Error> {
        one_by_one::claim_or_fetch_many(self, leases).await
    }

    async fn fetch_many(&self, keys: &[(Namespace, Key)]) -> Result<Vec<Snapshot>, Error> {
        one_by_one::fetch_many(self, keys).await
    }

    async fn try_claim_many(&self, leases: &[NewLease]) -> Result<Vec<Option<Lease>>, Error> {
        one_by_one::try_claim_many(self, leases).await
    }

    async fn complete_many(
        &self,
        completions: &[Completion],
    ) -> Result<Vec<Option<SystemTime>>, Error> {
        one_by_one::complete_many(self, completions).await
    }

    /// A plain read: this process makes every change, and tells its waiters
    /// itself.
    async fn watch(&self, namespace: &Namespace, key: &Key) -> Result<Snapshot, Error> {
        self.fetch(namespace, key).await
    }

    fn announces(&self) -> super::Announces {
        super::Announces::InProcess
    }

    fn fails_in_parts(&self) -> bool {
        false
    }

    async fn close(&self) {
        self.readers.close().await;
        self.writer.close().await;
    }
}

impl Operations for SqliteStore {
    async fn stats(&self) -> Result<StoreStats, Error> {
        let get = |e: sqlx::Error| Error::Internal(Box::new(e));
        let (now, rows, summary) = self
            .budget
            .run("stats", async {
                let mut conn = self.readers.acquire().await?;
                let now = now_us();
                let rows = sqlx::query(STATS_LIVE)
                    .bind(now)
                    .fetch_all(&mut *conn)
                    .await?;
                let summary = sqlx::query(STATS_SUMMARY)
                    .bind(now)
                    .fetch_one(&mut *conn)
                    .await?;
                Ok((now, rows, summary))
            })
            .await?;
        let mut live = Vec::new();
        let mut remembered = Vec::new();
        for row in &rows {
            let namespace: String = row.try_get("namespace").map_err(get)?;
            let code: i64 = row.try_get("state").map_err(get)?;
            let count = row.try_get::<i64, _>("count").map_err(get)? as u64;
            if code == MARKER {
                remembered.push((namespace, count));
            } else {
                live.push(StateCount {
                    namespace,
                    state: state_from(code)?,
                    count,
                });
            }
        }
        Ok(StoreStats {
            now: system_time(now),
            live,
            remembered,
            expired: summary.try_get::<i64, _>("expired").map_err(get)? as u64,
            oldest_created_at: summary
                .try_get::<Option<i64>, _>("oldest_created_at")
                .map_err(get)?
                .map(system_time),
            earliest_expiry: summary
                .try_get::<Option<i64>, _>("earliest_expiry")
                .map_err(get)?
                .map(system_time),
        })
    }

    /// A full count is cheap on a table one process writes.
    async fn stats_estimate(&self) -> Result<StoreStats, Error> {
        self.stats().await
    }

    fn pool_status(&self) -> PoolStatus {
        // The writer's single connection and the readers, as one pool.
        PoolStatus {
            size: self.writer.size() + self.readers.size(),
            idle: (self.writer.num_idle() + self.readers.num_idle()) as u32,
            max: self.max_readers + 1,
            in_flight: self.budget.in_flight(),
        }
    }

    /// One process writes the file: nothing changes behind a cache's back,
    /// and no cache sits in front of this store.
    fn purge_feed(&self) -> Option<tokio::sync::mpsc::Receiver<PurgeEvent>> {
        None
    }

    fn cache_stats(&self) -> Option<CacheStats> {
        None
    }

    /// Usable means: the file is still where it was opened, and readable.
    async fn ping(&self) -> Result<(), Error> {
        if !self.path.exists() {
            return Err(Error::Unavailable(
                format!("the database file {} is gone", self.path.display()).into(),
            ));
        }
        self.budget
            .run(
                "ping",
                sqlx::query("SELECT 1 FROM idempotency_records LIMIT 1")
                    .fetch_optional(&self.readers),
            )
            .await
            .map(|_| ())
    }
}
