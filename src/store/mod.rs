//! The store seam: the few atomic operations the lifecycle needs, and the two
//! implementations behind them, PostgreSQL (`postgres`, production, many
//! replicas on one table) and SQLite (`sqlite`, embedded, single instance).
//!
//! Every operation is one statement guarded by its own WHERE clause, so
//! concurrency is the database's job: two replicas racing for one key are
//! serialised by the row lock, never by Rust code. Each store keeps its SQL and
//! its migrations beside it; nothing above this module sees sqlx.
//!
//! Two traits: `Store`, the key's transitions the lifecycle is built from,
//! and `Operations`, what operators and the layers above see besides (counts,
//! connection pools, the cache's counters, the purge feed, health).
//!
//! Two decorators wrap a store without changing what it answers: `coalesce`
//! sends concurrent single calls as one set-based statement per kind, and
//! `cache` answers duplicate Claims of completed keys from memory, kept right
//! by the store's purge feed.

pub mod cache;
pub mod coalesce;
pub mod one_by_one;
pub mod postgres;
pub mod sqlite;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use tracing::Instrument;

use crate::domain::{
    Completion, Key, Lease, LeaseToken, Namespace, NewLease, Purged, RecordState, Snapshot,
};
use crate::error::Error;

/// The operations the lifecycle is built from. Each is atomic on its own;
/// none holds a transaction open across calls.
///
/// No method has a default body: a decorator (`cache`, `coalesce`) must say
/// what it does with each one, so that wrapping stores in any order keeps
/// every method's meaning (the compiler checks none is forgotten). Stores
/// without set-based statements answer the batch forms with `one_by_one`.
pub trait Store: Clone + Send + Sync + 'static {
    /// A short name for logs: "postgres" or "sqlite".
    fn kind(&self) -> &'static str;

    /// Reads a key's record (expired or not) with the store's clock.
    fn fetch(
        &self,
        namespace: &Namespace,
        key: &Key,
    ) -> impl Future<Output = Result<Snapshot, Error>> + Send;

    /// Reads a key's record for a Claim that waits on its holder, and, where
    /// the store can, arranges that the holder's Complete or Release from
    /// now on is announced on its purge feed (see [`Store::announces`]).
    fn watch(
        &self,
        namespace: &Namespace,
        key: &Key,
    ) -> impl Future<Output = Result<Snapshot, Error>> + Send;

    /// How a waiting Claim hears that a key it watches changed.
    fn announces(&self) -> Announces;

    /// Whether one batch can fail for some of its keys and not others: on
    /// Citus, a batch's keys live on several workers and one may be down.
    /// Where it can, a batch that asked for its items' own errors is tried
    /// again item by item after a failure; elsewhere every key is reached or
    /// none is, and the batch's failure is the answer.
    fn fails_in_parts(&self) -> bool;

    /// Takes the key if, at the instant of the statement, it is absent,
    /// expired, released, or in progress under an expired lease, and its
    /// fingerprint does not conflict. `None` when it was not claimable. A
    /// released or expired lease's checkpoint comes with the new lease; an
    /// expired record starts without one.
    fn try_claim(
        &self,
        lease: &NewLease,
    ) -> impl Future<Output = Result<Option<Lease>, Error>> + Send;

    /// Completes an unexpired in-progress record held by `token` (its lease may
    /// have run out, as long as nobody took it), discarding its checkpoint.
    /// The key is remembered until `remember_for` after now, when that is
    /// later than the result's expiry. Returns the new `expires_at`, or
    /// `None` when the record was not in that state.
    fn complete(
        &self,
        namespace: &Namespace,
        key: &Key,
        token: &LeaseToken,
        response: &[u8],
        retention: Option<Duration>,
        remember_for: Option<Duration>,
    ) -> impl Future<Output = Result<Option<SystemTime>, Error>> + Send;

    /// Claims a remembered key anew (a late retry, re-executed): if, at the
    /// instant of the statement, the key is completed, its result expired
    /// and its horizon not passed, it becomes in progress under `lease`, as
    /// a new key would, with the next fencing token. `None` otherwise.
    fn reclaim(
        &self,
        lease: &NewLease,
    ) -> impl Future<Output = Result<Option<Lease>, Error>> + Send;

    /// Releases an unexpired in-progress record held by `token`, saving
    /// `checkpoint` (under the lease's fencing token) when there is one.
    /// `false` when the record was not in that state.
    fn release(
        &self,
        namespace: &Namespace,
        key: &Key,
        token: &LeaseToken,
        checkpoint: Option<&[u8]>,
    ) -> impl Future<Output = Result<bool, Error>> + Send;

    /// Moves the lease of an unexpired in-progress record held by `token` to
    /// now + `lease_ttl`, saving `checkpoint` (under the lease's fencing
    /// token) when there is one. Returns the new lease expiry, or `None`.
    fn extend_lease(
        &self,
        namespace: &Namespace,
        key: &Key,
        token: &LeaseToken,
        lease_ttl: Duration,
        checkpoint: Option<&[u8]>,
    ) -> impl Future<Output = Result<Option<SystemTime>, Error>> + Send;

    /// A Claim's first step in one round trip where the store can: inserts
    /// the key with `lease` when it has no record, else reads the record
    /// (expired or not) without writing. A store without such a statement
    /// answers with `one_by_one::claim_or_fetch`.
    fn claim_or_fetch(
        &self,
        lease: &NewLease,
    ) -> impl Future<Output = Result<FirstClaim, Error>> + Send;

    /// `claim_or_fetch` for many leases, answered in order. A set-based
    /// override may answer `Raced` for a key named again after its first
    /// occurrence; the lifecycle reads such items again.
    fn claim_or_fetch_many(
        &self,
        leases: &[NewLease],
    ) -> impl Future<Output = Result<Vec<FirstClaim>, Error>> + Send;

    /// `fetch` for many keys, answered in order (`one_by_one` where the store
    /// has no set-based statement).
    fn fetch_many(
        &self,
        keys: &[(Namespace, Key)],
    ) -> impl Future<Output = Result<Vec<Snapshot>, Error>> + Send;

    /// `try_claim` for many leases, answered in order. A set-based statement
    /// may answer `None` for a key named
    /// again after its first occurrence (one statement cannot take a row
    /// twice); the lifecycle reads such items again.
    fn try_claim_many(
        &self,
        leases: &[NewLease],
    ) -> impl Future<Output = Result<Vec<Option<Lease>>, Error>> + Send;

    /// `complete` for many completions, answered in order. A set-based
    /// statement may answer `None` for
    /// a repeat of the same key and token, which the lifecycle reads again.
    fn complete_many(
        &self,
        completions: &[Completion],
    ) -> impl Future<Output = Result<Vec<Option<SystemTime>>, Error>> + Send;

    /// One bounded batch of the reaper's work, oldest first: of up to
    /// `batch` records past their expiry, the remembered ones become
    /// markers (their response and checkpoint dropped, kept until their
    /// horizon), and the others are deleted. Safe to run from several
    /// replicas at once.
    fn reap_expired(&self, batch: u32) -> impl Future<Output = Result<Reaped, Error>> + Send;

    /// Expires an unexpired record now, so the key is claimable at once; the
    /// row stays (and its fencing counter with it) until the reaper deletes
    /// it. A remembered key becomes released, without fingerprint, until its
    /// horizon: claimable by any Claim, its fencing counter going on.
    /// Returns what there was, or `None` when there was nothing.
    fn purge(
        &self,
        namespace: &Namespace,
        key: &Key,
    ) -> impl Future<Output = Result<Option<Purged>, Error>> + Send;

    /// Closes the connections, waiting for those in use.
    fn close(&self) -> impl Future<Output = ()> + Send;
}

/// What operators and the layers above see of a store besides its
/// transitions: counts, connections, the cache's counters, the change feed
/// and health (shared/STYLE.md: a trait says one thing).
pub trait Operations: Clone + Send + Sync + 'static {
    /// Counts records by namespace and state, and how far behind the reaper is.
    /// A full scan: for operators, not for calls.
    fn stats(&self) -> impl Future<Output = Result<StoreStats, Error>> + Send;

    /// `stats` for the records gauge, which every replica refreshes every
    /// minute: exact where a full count is cheap, estimated where it is not
    /// (`stats` itself where counting is cheap).
    fn stats_estimate(&self) -> impl Future<Output = Result<StoreStats, Error>> + Send;

    /// The connection pool's state right now, for metrics.
    fn pool_status(&self) -> PoolStatus;

    /// Starts telling, in commit order, which records any process purged,
    /// with heartbeats that vouch nothing was missed: what a cache of
    /// completed records needs to stay right. `None` for a store that
    /// cannot.
    fn purge_feed(&self) -> Option<tokio::sync::mpsc::Receiver<PurgeEvent>>;

    /// The replay cache's counters, when the store has one.
    fn cache_stats(&self) -> Option<cache::CacheStats>;

    /// Answers when the store is usable (for health).
    fn ping(&self) -> impl Future<Output = Result<(), Error>> + Send;
}

/// What one batch of the reaper did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reaped {
    /// Expired completed records turned into markers.
    pub remembered: u64,
    /// Records deleted (expired and not remembered, or markers past their
    /// horizon).
    pub deleted: u64,
}

impl Reaped {
    /// Rows the batch changed.
    pub fn total(&self) -> u64 {
        self.remembered + self.deleted
    }
}

/// What a Claim's first step found.
#[derive(Debug, Clone)]
pub enum FirstClaim {
    /// The key had no record: it is now claimed with the offered lease.
    Inserted(Lease),
    /// The key has a record (expired or not), read with the store's clock;
    /// nothing was written.
    Found(Snapshot),
    /// A record appeared between the step's read and its write (or the key
    /// was named twice in one batch): read it again.
    Raced,
}

/// How a waiting Claim of this process hears that the key it watches changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Announces {
    /// On the purge feed: every replica's Complete and Release of a watched
    /// key, and every purge (PostgreSQL, and Citus, whose every node the
    /// feed listens on). While the feed is not known
    /// to be caught up, waiters read again at a bounded interval.
    Feed,
    /// Only this process writes the records (SQLite): what this process does
    /// is all there is to hear.
    InProcess,
}

/// What a store's purge feed tells.
#[derive(Debug, Clone)]
pub enum PurgeEvent {
    /// The record was purged (by this process or another).
    Purged(Namespace, Key),
    /// Every purge committed before this instant (this machine's monotonic
    /// clock) has been told.
    CaughtUp(std::time::Instant),
    /// Purges may have been missed (the feed's connection was lost), or
    /// everything changed (the table was truncated).
    Lost,
    /// To be notified once every event before it has been applied: the
    /// feed then acknowledges a purge to the replica that waits for it.
    Applied(std::sync::Arc<tokio::sync::Notify>),
}

/// Unexpired records of one namespace in one state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateCount {
    pub namespace: String,
    pub state: RecordState,
    pub count: u64,
}

/// What `stats` reports, read with the store's clock.
#[derive(Debug, Clone)]
pub struct StoreStats {
    pub now: SystemTime,
    pub live: Vec<StateCount>,
    /// Markers of remembered keys, by namespace (records the reaper has
    /// made markers of; a remembered record it has not reached yet counts
    /// as expired).
    pub remembered: Vec<(String, u64)>,
    /// Expired rows the reaper has not deleted yet.
    pub expired: u64,
    /// The creation time of the oldest unexpired record.
    pub oldest_created_at: Option<SystemTime>,
    /// The earliest expiry of any row; when it lies in the past, the reaper is
    /// that far behind.
    pub earliest_expiry: Option<SystemTime>,
}

impl StoreStats {
    /// How long the oldest expired row has waited for the reaper.
    pub fn reaper_lag(&self) -> Duration {
        self.earliest_expiry
            .and_then(|t| self.now.duration_since(t).ok())
            .unwrap_or_default()
    }

    /// Markers of remembered keys, in every namespace.
    pub fn remembered_total(&self) -> u64 {
        self.remembered.iter().map(|(_, count)| count).sum()
    }

    /// Unexpired records in `state`, over every namespace.
    pub fn count(&self, state: RecordState) -> u64 {
        self.live
            .iter()
            .filter(|c| c.state == state)
            .map(|c| c.count)
            .sum()
    }
}

/// A connection pool's occupancy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStatus {
    /// Connections open.
    pub size: u32,
    /// Open connections not in use.
    pub idle: u32,
    /// The most connections the pool opens.
    pub max: u32,
    /// Store operations started and not finished: beyond the connections in
    /// use, they are waiting for one.
    pub in_flight: u32,
}

impl PoolStatus {
    /// Operations waiting for a connection.
    pub fn waiting(&self) -> u32 {
        let busy = self.size.saturating_sub(self.idle);
        self.in_flight.saturating_sub(busy)
    }
}

/// How to reach the store, from the configuration.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// `postgres://…` or `sqlite://…`; `None` means the embedded SQLite file in
    /// `data_dir`.
    pub database_url: Option<String>,
    pub data_dir: PathBuf,
    /// Most connections the pool opens (PostgreSQL; SQLite's readers).
    pub pool_size: u32,
    /// How long one store operation may take, connecting included, before the
    /// call fails with UNAVAILABLE instead of hanging until the caller's deadline.
    pub timeout: Duration,
    /// On plain PostgreSQL, the statements the store sends on Citus (for the
    /// tests: `Config::citus_statements`).
    pub citus_statements: bool,
    /// On Citus, each key's statement goes to the node holding its shard
    /// (`Config::citus_direct`).
    pub citus_direct: bool,
}

/// The store the configuration picked.
pub enum AnyStore {
    Postgres(postgres::PostgresStore),
    Sqlite(sqlite::SqliteStore),
}

/// Which store a configuration names, before connecting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    Postgres(String),
    Sqlite(PathBuf),
}

impl StoreOptions {
    /// Picks the store by the URL's scheme; no URL means the embedded file.
    pub fn location(&self) -> Result<Location, Error> {
        match self.database_url.as_deref() {
            None | Some("") => Ok(Location::Sqlite(self.data_dir.join("idempotency.db"))),
            Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
                Ok(Location::Postgres(url.to_owned()))
            }
            Some(url) if url.starts_with("sqlite:") => {
                let path = url
                    .trim_start_matches("sqlite:")
                    .trim_start_matches("//")
                    .split('?')
                    .next()
                    .unwrap_or_default();
                if path.is_empty() {
                    return Err(Error::invalid("DATABASE_URL", "sqlite URL names no file"));
                }
                Ok(Location::Sqlite(PathBuf::from(path)))
            }
            Some(_) => Err(Error::invalid(
                "DATABASE_URL",
                "must start with postgres://, postgresql:// or sqlite://",
            )),
        }
    }
}

/// What opening a store does before it returns. Its errors are one line that
/// names the setting to change (`DATABASE_URL`, `IDEMPOTENCY_DATA_DIR`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Open {
    /// Connect now, then apply the pending migrations: the server's start
    /// (unless told not to migrate) and `migrate`.
    Migrate,
    /// Connect now: the operator's commands.
    Connect,
    /// PostgreSQL connects when first used, so that a server whose database
    /// is down starts NOT_SERVING and recovers by itself: the server with its
    /// migrations off (a job runs them). SQLite opens its file at once.
    Lazy,
}

impl AnyStore {
    /// Opens the store the options name (creating the SQLite file and its
    /// folder when missing), connecting and migrating as `open` says.
    pub async fn open(options: &StoreOptions, open: Open) -> anyhow::Result<Self> {
        match options.location()? {
            Location::Postgres(url) => {
                let store = postgres::PostgresStore::connect(&url, options).await?;
                if open != Open::Lazy {
                    store.reach().await?;
                }
                if open == Open::Migrate {
                    store.migrate().await?;
                }
                Ok(Self::Postgres(store))
            }
            Location::Sqlite(path) => {
                let setting = match options.database_url.as_deref() {
                    None | Some("") => {
                        format!("IDEMPOTENCY_DATA_DIR={}", options.data_dir.display())
                    }
                    Some(_) => "DATABASE_URL".to_owned(),
                };
                let store = sqlite::SqliteStore::open(&path, options, &setting).await?;
                if open == Open::Migrate {
                    store
                        .migrate()
                        .await
                        .map_err(|e| anyhow::anyhow!("{setting}: {e:#}"))?;
                }
                Ok(Self::Sqlite(store))
            }
        }
    }

    /// Applies the pending migrations; safe when several replicas start at once
    /// (PostgreSQL takes an advisory lock; SQLite has one writer).
    pub async fn migrate(&self) -> anyhow::Result<()> {
        match self {
            Self::Postgres(store) => store.migrate().await,
            Self::Sqlite(store) => store.migrate().await,
        }
    }
}

/// What every operation of one store shares: its deadline, and a count of the
/// operations under way (for the pool metrics).
#[derive(Debug, Clone)]
pub(crate) struct Budget {
    timeout: Duration,
    system: &'static str,
    in_flight: Arc<AtomicUsize>,
}

/// Decrements the in-flight count however the operation ends (done, failed,
/// timed out or cancelled with its call).
struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Budget {
    pub(crate) fn new(system: &'static str, timeout: Duration) -> Self {
        Self {
            timeout,
            system,
            in_flight: Arc::default(),
        }
    }

    /// How long one operation may take.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    pub(crate) fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed) as u32
    }

    /// Runs one store operation under the deadline, in a span of its own, and
    /// turns sqlx's errors into the service's. A timeout is UNAVAILABLE: a slow
    /// or vanished database must not hold the caller until its own deadline.
    pub(crate) async fn run<T>(
        &self,
        operation: &'static str,
        statement: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, Error> {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        let _in_flight = InFlight(&self.in_flight);
        let span = tracing::debug_span!(
            "db",
            otel.name = operation,
            otel.kind = "client",
            db.system = self.system,
            db.operation = operation,
        );
        match tokio::time::timeout(self.timeout, statement)
            .instrument(span)
            .await
        {
            Ok(result) => result.map_err(classify),
            Err(elapsed) => Err(Error::Unavailable(Box::new(elapsed))),
        }
    }
}

/// Sorts a database error into "retry later" (the database is down, starting,
/// overloaded or locked) and "a bug" (anything else): the one place that
/// decides it, from the two stores' own knowledge of their codes.
fn classify(error: sqlx::Error) -> Error {
    use sqlx::Error as E;
    let transient = match &error {
        E::PoolTimedOut | E::PoolClosed | E::Io(_) | E::Tls(_) | E::WorkerCrashed => true,
        E::Protocol(_) => true,
        E::Database(db) => {
            let code = db.code().unwrap_or_default();
            if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
                code.parse().is_ok_and(transient_sqlite_code)
            } else {
                postgres::sqlstate::transient(&code, db.message())
            }
        }
        _ => false,
    };
    if transient {
        Error::Unavailable(Box::new(error))
    } else {
        Error::Internal(Box::new(error))
    }
}

/// SQLite result codes (primary code in the low byte) that say "try again":
/// BUSY, LOCKED, NOMEM, READONLY, IOERR, FULL, CANTOPEN.
fn transient_sqlite_code(code: u32) -> bool {
    matches!(code & 0xff, 5 | 6 | 7 | 8 | 10 | 13 | 14)
}

/// Microseconds in a duration, as the stores keep them.
pub(crate) fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(url: Option<&str>) -> StoreOptions {
        StoreOptions {
            database_url: url.map(str::to_owned),
            data_dir: PathBuf::from("./data"),
            pool_size: 4,
            timeout: Duration::from_secs(1),
            citus_statements: false,
            citus_direct: true,
        }
    }

    #[test]
    fn the_url_scheme_picks_the_store() {
        assert_eq!(
            options(None).location().unwrap(),
            Location::Sqlite(PathBuf::from("./data/idempotency.db"))
        );
        assert_eq!(
            options(Some("sqlite:///var/lib/x.db?mode=rwc"))
                .location()
                .unwrap(),
            Location::Sqlite(PathBuf::from("/var/lib/x.db"))
        );
        assert_eq!(
            options(Some("sqlite://rel/x.db")).location().unwrap(),
            Location::Sqlite(PathBuf::from("rel/x.db"))
        );
        assert!(matches!(
            options(Some("postgres://u@h/db")).location().unwrap(),
            Location::Postgres(_)
        ));
        assert!(options(Some("mysql://h/db")).location().is_err());
    }

    #[test]
    fn busy_and_io_errors_of_sqlite_are_transient() {
        assert!(transient_sqlite_code(5));
        assert!(transient_sqlite_code(517));
        assert!(!transient_sqlite_code(19));
    }
}
