//! The PostgreSQL store: the production store, shared by any number of
//! replicas through one table.
//!
//! Every time comparison and every timestamp uses the database's `now()`, so
//! replicas whose clocks disagree still agree on who holds a lease. Each
//! transition is one statement whose WHERE clause is the rule; under READ
//! COMMITTED, `INSERT … ON CONFLICT DO UPDATE … WHERE` re-checks that clause on
//! the latest row version after taking the row lock, which is what makes
//! "exactly one winner" hold across replicas.

use std::cmp::Ordering;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgListener, PgPool, PgPoolOptions, PgRow};
use sqlx::{ConnectOptions, Connection as _, Postgres, Row};
use time::OffsetDateTime;
use tokio::sync::{Semaphore, SemaphorePermit, mpsc};
use tokio_util::sync::CancellationToken;

use super::{
    Budget, FirstClaim, PoolStatus, PurgeEvent, StateCount, Store, StoreOptions, StoreStats, micros,
};
use crate::domain::{
    Checkpoint, Completion, Fingerprint, Key, Lease, LeaseToken, Namespace, NewLease, Record,
    RecordState, Snapshot,
};
use crate::error::Error;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");

/// The record columns, in the order `record_from_row` reads them.
const FETCH: &str = "
SELECT now() AS now, r.state, r.fencing_token, r.lease_token, r.fingerprint, r.response,
       r.retention_us, r.lease_expires_at, r.expires_at, r.created_at, r.updated_at,
       r.checkpoint, r.checkpoint_fencing
FROM (SELECT 1) AS clock
LEFT JOIN idempotency_records AS r ON r.namespace = $1 AND r.key = $2";

/// FETCH for many keys at once: one row per input, in input order.
///
/// One primary-key lookup per input, whatever the statistics say: as a plain
/// join, the plan PostgreSQL caches for this prepared statement while the
/// table is new (never analysed) is a hash join over a sequential scan, which
/// then reads the whole table for every batch as it grows (30 ms for 100 keys
/// at 200,000 rows, against 0.2 ms). `LIMIT 1` keeps the subquery from being
/// flattened into such a join.
const FETCH_MANY: &str = "
SELECT now() AS now, r.state, r.fencing_token, r.lease_token, r.fingerprint, r.response,
       r.retention_us, r.lease_expires_at, r.expires_at, r.created_at, r.updated_at,
       r.checkpoint, r.checkpoint_fencing
FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS i(namespace, key, ord)
LEFT JOIN LATERAL (
    SELECT * FROM idempotency_records AS x
    WHERE x.namespace = i.namespace COLLATE \"C\" AND x.key = i.key COLLATE \"C\"
    LIMIT 1) AS r ON true
ORDER BY i.ord";

/// A Claim's first step: inserts the key when it has no row, else reads the
/// row, in one round trip. `ON CONFLICT DO NOTHING` checks the key before it
/// writes anything, so a duplicate takes no row lock, no transaction id and
/// no WAL: it costs a read, as the replay should. Every part of the statement
/// sees one snapshot, so the SELECT never sees the row the INSERT just wrote;
/// a row committed after the snapshot was taken makes the INSERT do nothing
/// and stays unseen by the SELECT: no row comes back, and the caller reads
/// again. `NOT EXISTS` covers a row the reaper deleted meanwhile.
const CLAIM_OR_FETCH: &str = "
WITH inserted AS (
    INSERT INTO idempotency_records AS r
        (namespace, key, state, fencing_token, lease_token, fingerprint, response, retention_us,
         lease_expires_at, expires_at, created_at, updated_at)
    VALUES ($1, $2, 1, 1, $3, $4, NULL, $6,
            now() + $5::float8 * interval '1 microsecond',
            now() + ($5 + $6)::float8 * interval '1 microsecond',
            now(), now())
    ON CONFLICT (namespace, key) DO NOTHING
    RETURNING fencing_token, lease_expires_at, expires_at)
SELECT true AS inserted, now() AS now, NULL::int2 AS state, i.fencing_token,
       NULL::bytea AS lease_token, NULL::bytea AS fingerprint, NULL::bytea AS response,
       NULL::int8 AS retention_us, i.lease_expires_at, i.expires_at,
       NULL::timestamptz AS created_at, NULL::timestamptz AS updated_at,
       NULL::bytea AS checkpoint, NULL::int8 AS checkpoint_fencing
FROM inserted AS i
UNION ALL
SELECT false, now(), r.state, r.fencing_token, r.lease_token, r.fingerprint, r.response,
       r.retention_us, r.lease_expires_at, r.expires_at, r.created_at, r.updated_at,
       r.checkpoint, r.checkpoint_fencing
FROM idempotency_records AS r
WHERE r.namespace = $1 AND r.key = $2 AND NOT EXISTS (SELECT FROM inserted)";

/// CLAIM_OR_FETCH for many distinct keys in one statement: one row per key
/// that was inserted or found, tagged with its position in the input (a key
/// with neither raced, as above). Keys are inserted in key order, so
/// concurrent batches wait on each other's new keys in the same order and
/// cannot deadlock. Only the keys not inserted are looked up (the lookup's
/// `n.key IS NULL` is checked before its index scan), one by one as in
/// FETCH_MANY.
const CLAIM_OR_FETCH_MANY: &str = "
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::bytea[], $5::int8[], $6::int8[])
         WITH ORDINALITY AS i(namespace, key, lease_token, fingerprint, lease_us, retention_us, ord)),
inserted AS (
    INSERT INTO idempotency_records AS r
        (namespace, key, state, fencing_token, lease_token, fingerprint, response, retention_us,
         lease_expires_at, expires_at, created_at, updated_at)
    SELECT i.namespace, i.key, 1, 1, i.lease_token, i.fingerprint, NULL, i.retention_us,
           now() + i.lease_us::float8 * interval '1 microsecond',
           now() + (i.lease_us + i.retention_us)::float8 * interval '1 microsecond',
           now(), now()
    FROM input AS i
    ORDER BY i.namespace COLLATE \"C\", i.key COLLATE \"C\"
    ON CONFLICT (namespace, key) DO NOTHING
    RETURNING namespace, key, fencing_token, lease_expires_at, expires_at)
SELECT i.ord, n.key IS NOT NULL AS inserted, now() AS now, r.state,
       coalesce(n.fencing_token, r.fencing_token) AS fencing_token, r.lease_token,
       r.fingerprint, r.response, r.retention_us,
       coalesce(n.lease_expires_at, r.lease_expires_at) AS lease_expires_at,
       coalesce(n.expires_at, r.expires_at) AS expires_at, r.created_at, r.updated_at,
       r.checkpoint, r.checkpoint_fencing
FROM input AS i
LEFT JOIN inserted AS n ON n.namespace = i.namespace COLLATE \"C\" AND n.key = i.key COLLATE \"C\"
LEFT JOIN LATERAL (
    SELECT * FROM idempotency_records AS x
    WHERE n.key IS NULL
      AND x.namespace = i.namespace COLLATE \"C\" AND x.key = i.key COLLATE \"C\"
    LIMIT 1) AS r ON true
WHERE n.key IS NOT NULL OR r.key IS NOT NULL";

/// TRY_CLAIM for many distinct keys in one statement (the same rule, row by
/// row). Rows come in key order, so concurrent batches lock rows in the same
/// order and cannot deadlock each other.
const TRY_CLAIM_MANY: &str = "
INSERT INTO idempotency_records AS r
    (namespace, key, state, fencing_token, lease_token, fingerprint, response, retention_us,
     lease_expires_at, expires_at, created_at, updated_at)
SELECT i.namespace, i.key, 1, 1, i.lease_token, i.fingerprint, NULL, i.retention_us,
       now() + i.lease_us::float8 * interval '1 microsecond',
       now() + (i.lease_us + i.retention_us)::float8 * interval '1 microsecond',
       now(), now()
FROM unnest($1::text[], $2::text[], $3::bytea[], $4::bytea[], $5::int8[], $6::int8[])
     AS i(namespace, key, lease_token, fingerprint, lease_us, retention_us)
ORDER BY i.namespace COLLATE \"C\", i.key COLLATE \"C\"
ON CONFLICT (namespace, key) DO UPDATE SET
    state = 1,
    fencing_token = r.fencing_token + 1,
    lease_token = excluded.lease_token,
    fingerprint = CASE WHEN r.expires_at <= now() THEN excluded.fingerprint
                       ELSE coalesce(r.fingerprint, excluded.fingerprint) END,
    response = NULL,
    retention_us = excluded.retention_us,
    lease_expires_at = excluded.lease_expires_at,
    expires_at = excluded.expires_at,
    created_at = CASE WHEN r.expires_at <= now() THEN now() ELSE r.created_at END,
    updated_at = now(),
    checkpoint = CASE WHEN r.expires_at <= now() THEN NULL ELSE r.checkpoint END,
    checkpoint_fencing = CASE WHEN r.expires_at <= now() THEN NULL ELSE r.checkpoint_fencing END
WHERE r.expires_at <= now()
   OR ((r.state = 3 OR (r.state = 1 AND r.lease_expires_at <= now()))
       AND (r.fingerprint IS NULL OR excluded.fingerprint IS NULL
            OR r.fingerprint = excluded.fingerprint))
RETURNING namespace, key, fencing_token, lease_expires_at, expires_at, checkpoint,
          checkpoint_fencing";

/// Inserts a new key, or takes over an existing row that is expired, released,
/// or in progress under an expired lease, unless its fingerprint conflicts.
/// An expired row starts afresh (its fingerprint, creation time and
/// checkpoint are replaced) but keeps counting fencing tokens until the
/// reaper deletes it; a lease taken over keeps its checkpoint for the new
/// holder.
const TRY_CLAIM: &str = "
INSERT INTO idempotency_records AS r
    (namespace, key, state, fencing_token, lease_token, fingerprint, response, retention_us,
     lease_expires_at, expires_at, created_at, updated_at)
VALUES ($1, $2, 1, 1, $3, $4, NULL, $6,
        now() + $5::float8 * interval '1 microsecond',
        now() + ($5 + $6)::float8 * interval '1 microsecond',
        now(), now())
ON CONFLICT (namespace, key) DO UPDATE SET
    state = 1,
    fencing_token = r.fencing_token + 1,
    lease_token = excluded.lease_token,
    fingerprint = CASE WHEN r.expires_at <= now() THEN excluded.fingerprint
                       ELSE coalesce(r.fingerprint, excluded.fingerprint) END,
    response = NULL,
    retention_us = excluded.retention_us,
    lease_expires_at = excluded.lease_expires_at,
    expires_at = excluded.expires_at,
    created_at = CASE WHEN r.expires_at <= now() THEN now() ELSE r.created_at END,
    updated_at = now(),
    checkpoint = CASE WHEN r.expires_at <= now() THEN NULL ELSE r.checkpoint END,
    checkpoint_fencing = CASE WHEN r.expires_at <= now() THEN NULL ELSE r.checkpoint_fencing END
WHERE r.expires_at <= now()
   OR ((r.state = 3 OR (r.state = 1 AND r.lease_expires_at <= now()))
       AND (r.fingerprint IS NULL OR excluded.fingerprint IS NULL
            OR r.fingerprint = excluded.fingerprint))
RETURNING fencing_token, lease_expires_at, expires_at, checkpoint, checkpoint_fencing";

/// The lease holder's guard shared by Complete, Release and ExtendLease: the
/// record is unexpired, in progress, and the token is the current one. The
/// lease itself may have run out: until someone else claims the key, its
/// holder may still finish.
const COMPLETE: &str = "
UPDATE idempotency_records
SET state = 2, response = $4, lease_expires_at = NULL,
    expires_at = now() + coalesce($5, retention_us)::float8 * interval '1 microsecond',
    updated_at = now(), checkpoint = NULL, checkpoint_fencing = NULL
WHERE namespace = $1 AND key = $2 AND state = 1 AND lease_token = $3 AND expires_at > now()
RETURNING expires_at";

/// COMPLETE for many keys in one statement, item after item (the function
/// is in the migrations, with why it is one).
const COMPLETE_MANY: &str = "
SELECT item, new_expires_at FROM idempotency_complete_many($1, $2, $3, $4, $5)";

/// Released records stay for their retention, so a late duplicate with another
/// payload is still told about the mismatch, and the fencing counter goes on.
/// A checkpoint given ($4 not NULL) is saved under the lease's fencing token.
const RELEASE: &str = "
UPDATE idempotency_records
SET state = 3, lease_expires_at = NULL,
    expires_at = now() + retention_us::float8 * interval '1 microsecond',
    updated_at = now(),
    checkpoint = coalesce($4::bytea, checkpoint),
    checkpoint_fencing = CASE WHEN $4::bytea IS NULL THEN checkpoint_fencing
                              ELSE fencing_token END
WHERE namespace = $1 AND key = $2 AND state = 1 AND lease_token = $3 AND expires_at > now()";

/// Like RELEASE, a checkpoint given ($5 not NULL) is saved with the lease.
const EXTEND_LEASE: &str = "
UPDATE idempotency_records
SET lease_expires_at = now() + $4::float8 * interval '1 microsecond',
    expires_at = now() + ($4 + retention_us)::float8 * interval '1 microsecond',
    updated_at = now(),
    checkpoint = coalesce($5::bytea, checkpoint),
    checkpoint_fencing = CASE WHEN $5::bytea IS NULL THEN checkpoint_fencing
                              ELSE fencing_token END
WHERE namespace = $1 AND key = $2 AND state = 1 AND lease_token = $3 AND expires_at > now()
RETURNING lease_expires_at";

/// Deletes one bounded batch, oldest first, through the index on reap_at
/// (expires_at's stored copy: see its migration). SKIP LOCKED lets replicas
/// reap side by side without waiting on each other or on a Claim that is
/// taking a row over; the outer condition re-checks expiry on the locked row.
const REAP: &str = "
DELETE FROM idempotency_records
WHERE ctid = ANY (ARRAY(
        SELECT ctid FROM idempotency_records
        WHERE reap_at <= now()
        ORDER BY reap_at
        LIMIT $1
        FOR UPDATE SKIP LOCKED))
  AND expires_at <= now()";

/// The name of the channel purges are announced on, as an SQL expression:
/// one per schema, so that deployments (or tests) sharing a database but not
/// a table do not hear each other. Channel names are at most 63 bytes, hence
/// the digest.
macro_rules! purges_channel {
    () => {
        "'idempotency_purges_' || left(md5(current_schema()), 16)"
    };
}

/// Expires a record now: it is absent to every call from this statement on.
/// The notification goes out with the purge's commit, and only then, to
/// every replica listening on the purges channel (their replay caches drop
/// the key). Its payload is the namespace's length in bytes, a colon, the
/// namespace and the key.
const PURGE: &str = concat!(
    "
WITH purged AS (
    UPDATE idempotency_records
    SET expires_at = now(), lease_expires_at = NULL, updated_at = now()
    WHERE namespace = $1 AND key = $2 AND expires_at > now()
    RETURNING state)
SELECT p.state
FROM purged AS p
CROSS JOIN LATERAL (
    SELECT pg_notify(",
    purges_channel!(),
    ", octet_length($1)::text || ':' || $1 || $2)) AS told"
);

/// The purges channel's name, for LISTEN.
const PURGES_CHANNEL: &str = concat!("SELECT ", purges_channel!());

/// A heartbeat on the purges channel: the payload `hb:<replica>:<sent>`
/// comes back to the replica that sent it after every notification
/// committed before it.
const HEARTBEAT: &str = concat!("SELECT pg_notify(", purges_channel!(), ", $1)");

/// How often a replica sends itself a heartbeat on the purges channel.
const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);

/// The planner's defaults, for the statements of `stats` only.
const STATS_SETTINGS: &str = "
SELECT set_config('enable_seqscan', 'on', true), set_config('plan_cache_mode', 'auto', true)";

const STATS_LIVE: &str = "
SELECT namespace, state, count(*) AS count
FROM idempotency_records WHERE expires_at > now()
GROUP BY namespace, state ORDER BY namespace, state";

const STATS_SUMMARY: &str = "
SELECT now() AS now,
       count(*) FILTER (WHERE expires_at <= now()) AS expired,
       min(created_at) FILTER (WHERE expires_at > now()) AS oldest_created_at,
       min(expires_at) AS earliest_expiry
FROM idempotency_records";

/// The planner's estimate of the table's rows (free: no scan).
const TABLE_ROWS: &str = "
SELECT reltuples FROM pg_class WHERE oid = 'idempotency_records'::regclass";

/// Up to this many rows, the records gauge counts them all.
const EXACT_GAUGE_ROWS: f64 = 1_000_000.0;

/// About how many rows the gauge's sample reads on a larger table.
const SAMPLE_ROWS: f64 = 200_000.0;

/// The gauge counts expired rows up to this many (a reaper this far behind
/// needs no finer figure).
const EXPIRED_COUNT_CAP: i64 = 1_000_000;

/// STATS_LIVE from a sample of $1 percent of the table's pages, scaled up.
const STATS_LIVE_SAMPLED: &str = "
SELECT namespace, state, round(count(*) * 100.0 / $1::float8)::int8 AS count
FROM idempotency_records TABLESAMPLE SYSTEM ($1::float8)
WHERE expires_at > now()
GROUP BY namespace, state ORDER BY namespace, state";

/// STATS_SUMMARY through reap_at's index: expired rows counted up to $1,
/// the oldest creation time left out.
const STATS_SUMMARY_INDEXED: &str = "
SELECT now() AS now,
       (SELECT count(*) FROM (SELECT FROM idempotency_records WHERE reap_at <= now() LIMIT $1) AS e)
           AS expired,
       NULL::timestamptz AS oldest_created_at,
       (SELECT min(reap_at) FROM idempotency_records) AS earliest_expiry";

/// Settings of every session the store opens, so that a statement's plan is
/// the same from the first call on a new table to the billionth on a large
/// one.
///
/// Every statement on the call path finds its rows by primary key. Left to
/// itself, PostgreSQL caches for a prepared statement a generic plan made
/// with the statistics of the moment: on a table just created or analysed at
/// a few hundred rows that plan is a sequential scan, and it keeps scanning
/// while the table grows, until autovacuum's next analyse replans it (seen:
/// the Complete reading 85 buffers per call instead of 12, 42 million tuples
/// scanned in 15 s). And for statements over arrays it may replan on every
/// call, when it guesses a plan for the actual array is cheaper than the
/// generic one. So: sequential scans are ruled out (they remain possible
/// where nothing else is, as in `stats`, which turns them back on), the
/// plan is made once per session and kept, and JIT compilation, which a
/// ruled-out scan's cost could trigger, is off: it never pays on statements
/// of microseconds.
const SESSION_SETTINGS: [(&str, &str); 3] = [
    ("enable_seqscan", "off"),
    ("plan_cache_mode", "force_generic_plan"),
    ("jit", "off"),
];

#[derive(Clone)]
pub struct PostgresStore {
    connections: Arc<Connections>,
    max_connections: u32,
    budget: Budget,
    /// Stops the purge feed's tasks when the store closes.
    feed_stop: CancellationToken,
}

/// How long a connection may go from statement to statement outside the
/// pool before it is handed back, so the pool's lifetime and idle rules still
/// reach it.
const HOLD_FOR: Duration = Duration::from_secs(60);

/// The connections of the statements on the call path. sqlx 0.8 tests every
/// connection handed back to its pool with a round trip to the database
/// before anyone may have it again: one extra round trip per statement. A
/// connection whose statement ran to its end is in a known clean state, so
/// it is kept here instead and the next statement takes it at once. A
/// statement that failed, or was cancelled with its call, drops its
/// connection into the pool, which tests it as before.
///
/// When the database restarts, every connection opened before is dead, and
/// nothing says so until a statement is sent on it. So a connection-level
/// error anywhere (a statement's, or the health check's) makes every
/// connection older than it suspect (`Suspicion`): each is pinged before its
/// next statement, and dropped when the ping fails, so the calls after a
/// restart run on live connections.
struct Connections {
    pool: PgPool,
    /// One permit per connection the pool may open: statements wait here in
    /// arrival order, whether their connection then comes from `kept` or
    /// from the pool.
    permits: Semaphore,
    /// Each kept connection, when it left the pool, and when it was last
    /// known to be alive (a statement or a ping ran on it).
    kept: std::sync::Mutex<Vec<(PoolConnection<Postgres>, Instant, Instant)>>,
    suspicion: Arc<Suspicion>,
}

/// The last moment a connection-level error was seen: a connection last
/// known alive before it may be dead.
struct Suspicion {
    base: Instant,
    /// Nanoseconds from `base` to the last error, plus one; 0: none yet.
    since: std::sync::atomic::AtomicU64,
}

impl Suspicion {
    fn new() -> Self {
        Self {
            base: Instant::now(),
            since: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// From now on, connections last known alive before now are suspect.
    fn raise(&self) {
        let now = self.base.elapsed().as_nanos() as u64 + 1;
        self.since
            .fetch_max(now, std::sync::atomic::Ordering::AcqRel);
    }

    /// Whether a connection last known alive at `alive` must be checked.
    fn covers(&self, alive: Instant) -> bool {
        match self.since.load(std::sync::atomic::Ordering::Acquire) {
            0 => false,
            since => alive <= self.base + Duration::from_nanos(since - 1),
        }
    }
}

/// Errors that say the connection (not the statement) failed: it was closed
/// or broken, or the server is shutting down, crashed or starting. Other
/// connections may be in the same state.
fn connection_lost(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(e) => e.code().is_some_and(|code| {
            matches!(code.as_ref(), "57P01" | "57P02" | "57P03") || code.starts_with("08")
        }),
        _ => false,
    }
}

impl Connections {
    async fn take(&self) -> Result<Held<'_>, sqlx::Error> {
        let permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| sqlx::Error::PoolClosed)?;
        loop {
            let kept = self.kept.lock().unwrap_or_else(|e| e.into_inner()).pop();
            let Some((mut connection, since, alive)) = kept else {
                // The pool checks its own (see `before_acquire`).
                let connection = self.pool.acquire().await?;
                let now = Instant::now();
                return Ok(Held {
                    connection: Some((connection, now)),
                    owner: self,
                    _permit: permit,
                });
            };
            if self.suspicion.covers(alive) && connection.ping().await.is_err() {
                // Dead: closed when dropped; try the next one.
                continue;
            }
            return Ok(Held {
                connection: Some((connection, since)),
                owner: self,
                _permit: permit,
            });
        }
    }

    fn kept(&self) -> usize {
        self.kept.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Hands every kept connection back to the pool (to close it).
    fn release_all(&self) {
        self.permits.close();
        self.kept.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// A connection taken for one statement. Dropped without `keep`, it goes
/// back to the pool, which tests it.
struct Held<'a> {
    connection: Option<(PoolConnection<Postgres>, Instant)>,
    owner: &'a Connections,
    _permit: SemaphorePermit<'a>,
}

impl Held<'_> {
    /// The statement ran to its end: keep the connection for the next one.
    fn keep(mut self) {
        if let Some((connection, since)) = self.connection.take()
            && since.elapsed() < HOLD_FOR
            && !self.owner.permits.is_closed()
        {
            self.owner
                .kept
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((connection, since, Instant::now()));
        }
    }
}

impl std::ops::Deref for Held<'_> {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        &self.connection.as_ref().expect("held until dropped").0
    }
}

impl std::ops::DerefMut for Held<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.connection.as_mut().expect("held until dropped").0
    }
}

/// Runs one statement on a held connection: `held!(store, |conn| query...
/// .fetch_one(conn))`, inside `Budget::run`.
///
/// A statement whose connection turned out to be dead is sent once more, on
/// a connection checked first: the database restarted since the connection
/// was last used, and the caller must not pay for it. Sending it again is
/// safe whether or not the first one took effect, because every statement on
/// the call path is answered through the lifecycle, which reads what a
/// repeat finds: a Claim finds its own lease token (a retried Claim), a
/// Complete or Release finds its own token on the completed or released
/// record, a read reads. `held!(once store, …)` sends it once (Purge, whose
/// answer says whether it found a record).
macro_rules! held {
    (once $store:expr, |$conn:ident| $statement:expr) => {
        async {
            let mut held = $store.connections.take().await?;
            let $conn = &mut *held;
            match $statement.await {
                Ok(result) => {
                    held.keep();
                    Ok::<_, sqlx::Error>(result)
                }
                Err(error) => {
                    if connection_lost(&error) {
                        $store.connections.suspicion.raise();
                    }
                    Err(error)
                }
            }
        }
    };
    ($store:expr, |$conn:ident| $statement:expr) => {
        async {
            let mut again = true;
            loop {
                let mut held = $store.connections.take().await?;
                let $conn = &mut *held;
                match $statement.await {
                    Ok(result) => {
                        held.keep();
                        break Ok::<_, sqlx::Error>(result);
                    }
                    Err(error) if connection_lost(&error) => {
                        $store.connections.suspicion.raise();
                        if !std::mem::take(&mut again) {
                            break Err(error);
                        }
                    }
                    Err(error) => break Err(error),
                }
            }
        }
    };
}

impl PostgresStore {
    /// Builds the pool without connecting: the service starts, reports
    /// NOT_SERVING, and connects once the database answers.
    pub async fn connect(url: &str, options: &StoreOptions) -> anyhow::Result<Self> {
        let connect_options: PgConnectOptions = url
            .parse::<PgConnectOptions>()
            .map_err(|_| anyhow::anyhow!("DATABASE_URL is not a valid PostgreSQL URL"))?
            .application_name("idempotency-service")
            .disable_statement_logging()
            .options(SESSION_SETTINGS);
        Ok(Self::with_options(connect_options, options))
    }

    /// The pool for already-built connection options (tests use this to give
    /// each test its own schema).
    pub fn with_options(connect_options: PgConnectOptions, options: &StoreOptions) -> Self {
        // One connection more than the calls may hold, so that background
        // statements (health, the reaper, counts, heartbeats) always find
        // one: the calls keep theirs between statements (`Connections`).
        let suspicion = Arc::new(Suspicion::new());
        let checks = suspicion.clone();
        let pool = PgPoolOptions::new()
            .max_connections(options.pool_size + 1)
            .min_connections(0)
            .acquire_timeout(options.timeout)
            // sqlx pings every connection it hands out unless told not to: a
            // second round trip per call. Broken connections are still found,
            // by the ping sqlx makes when a failed statement's connection is
            // returned (see `Connections`), and by the one below for a
            // connection opened before the last connection-level error.
            .test_before_acquire(false)
            .before_acquire(move |connection, meta| {
                let suspect = Instant::now()
                    .checked_sub(meta.age)
                    .is_some_and(|opened| checks.covers(opened));
                Box::pin(async move { Ok(!suspect || connection.ping().await.is_ok()) })
            })
            .connect_lazy_with(connect_options);
        Self {
            connections: Arc::new(Connections {
                pool,
                permits: Semaphore::new(options.pool_size as usize),
                kept: std::sync::Mutex::default(),
                suspicion,
            }),
            max_connections: options.pool_size + 1,
            budget: Budget::new("postgresql", options.timeout),
            feed_stop: CancellationToken::new(),
        }
    }

    /// sqlx's pool, for the statements off the call path (migrations, the
    /// reaper, stats, health) and the connections `Connections` takes.
    fn pool(&self) -> &PgPool {
        &self.connections.pool
    }

    pub async fn migrate(&self) -> anyhow::Result<()> {
        MIGRATOR.run(self.pool()).await.map_err(|e| {
            anyhow::anyhow!(
                "DATABASE_URL: migrating the database at {} failed: {e}",
                self.server()
            )
        })
    }

    /// Connects once, outside the pool, so that a start whose database cannot
    /// be reached or refuses to let it in stops with one line naming
    /// DATABASE_URL, the host and the port, and never the password. A refused
    /// connection, or a database still starting, is tried again until the
    /// timeout: the database may be starting beside the service.
    pub async fn reach(&self) -> anyhow::Result<()> {
        let options = self.pool().connect_options();
        let timeout = self.budget.timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        let server = self.server();
        loop {
            let error = match tokio::time::timeout_at(
                deadline,
                PgConnection::connect_with(&options),
            )
            .await
            {
                Ok(Ok(connection)) => {
                    let _ = connection.close().await;
                    return Ok(());
                }
                Ok(Err(error)) => error,
                Err(_) => anyhow::bail!(
                    "DATABASE_URL: PostgreSQL at {server} did not answer within {} (IDEMPOTENCY_DB_TIMEOUT)",
                    humantime::format_duration(timeout)
                ),
            };
            let starting = match &error {
                sqlx::Error::Io(e) => e.kind() == std::io::ErrorKind::ConnectionRefused,
                sqlx::Error::Database(e) => e.code().as_deref() == Some("57P03"),
                _ => false,
            };
            let retry_at = tokio::time::Instant::now() + Duration::from_millis(200);
            if !starting || retry_at >= deadline {
                anyhow::bail!("DATABASE_URL: {}", unreachable(&server, &error));
            }
            tokio::time::sleep_until(retry_at).await;
        }
    }

    /// Where the database is, for errors: `host:port`, or the socket folder.
    fn server(&self) -> String {
        let options = self.pool().connect_options();
        let port = options.get_port();
        match options.get_socket() {
            Some(socket) => format!("{} (port {port})", socket.display()),
            None if options.get_host().contains(':') => format!("[{}]:{port}", options.get_host()),
            None => format!("{}:{port}", options.get_host()),
        }
    }
}

/// Why a connection to `server` failed, in words that carry no credentials:
/// sqlx's errors and PostgreSQL's messages never hold the password.
fn unreachable(server: &str, error: &sqlx::Error) -> String {
    match error {
        sqlx::Error::Io(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            format!("cannot connect to PostgreSQL at {server}: connection refused")
        }
        sqlx::Error::Io(e) => format!("cannot connect to PostgreSQL at {server}: {e}"),
        sqlx::Error::Database(e) if e.message().contains("unsupported startup parameter") => {
            format!(
                "the server at {server} refused the connection: {} (a connection pooler such as \
                 PgBouncer: set ignore_startup_parameters = extra_float_digits, options and \
                 pool_mode = session for the service's database; see docs/operations.md, \
                 \"Behind PgBouncer\")",
                e.message()
            )
        }
        sqlx::Error::Database(e) => {
            format!(
                "PostgreSQL at {server} refused the connection: {}",
                e.message()
            )
        }
        sqlx::Error::Tls(e) => format!("TLS with PostgreSQL at {server} failed: {e}"),
        other => format!("cannot connect to PostgreSQL at {server}: {other}"),
    }
}

fn system_time(t: OffsetDateTime) -> SystemTime {
    SystemTime::from(t)
}

fn state_from(code: i16) -> Result<RecordState, Error> {
    match code {
        1 => Ok(RecordState::InProgress),
        2 => Ok(RecordState::Completed),
        3 => Ok(RecordState::Released),
        other => Err(Error::Internal(
            format!("unknown record state {other} in the database").into(),
        )),
    }
}

fn token_from(bytes: Vec<u8>) -> Result<LeaseToken, Error> {
    <[u8; 16]>::try_from(bytes)
        .map(LeaseToken::from_bytes)
        .map_err(|_| Error::Internal("a stored lease token is not 16 bytes".into()))
}

/// The positions of the first occurrence of each item, in the order `cmp`
/// sorts them (items it finds equal are one): the order rows are locked in
/// when `cmp` starts with (namespace, key) in byte order.
fn distinct_in_key_order<T>(items: &[T], cmp: impl Fn(&T, &T) -> Ordering) -> Vec<usize> {
    let mut order: Vec<usize> = (0..items.len()).collect();
    // Stable: of equal items, the first occurrence stays first and is kept.
    order.sort_by(|&a, &b| cmp(&items[a], &items[b]));
    order.dedup_by(|later, kept| cmp(&items[*later], &items[*kept]).is_eq());
    order
}

/// (namespace, key) in byte order.
fn by_key(a: (&Namespace, &Key), b: (&Namespace, &Key)) -> Ordering {
    (a.0.as_str().as_bytes(), a.1.as_str().as_bytes())
        .cmp(&(b.0.as_str().as_bytes(), b.1.as_str().as_bytes()))
}

/// The arrays a set-based claim binds as $1 to $6 (namespace, key, lease
/// token, fingerprint, lease and retention in microseconds), in `order`.
struct LeaseArrays<'a> {
    namespaces: Vec<&'a str>,
    names: Vec<&'a str>,
    tokens: Vec<&'a [u8]>,
    fingerprints: Vec<Option<&'a [u8]>>,
    lease_us: Vec<i64>,
    retention_us: Vec<i64>,
}

impl<'a> LeaseArrays<'a> {
    fn new(leases: &'a [NewLease], order: &[usize]) -> Self {
        let picked = || order.iter().map(|&i| &leases[i]);
        Self {
            namespaces: picked().map(|l| l.namespace.as_str()).collect(),
            names: picked().map(|l| l.key.as_str()).collect(),
            tokens: picked()
                .map(|l| l.lease_token.as_bytes().as_slice())
                .collect(),
            fingerprints: picked()
                .map(|l| l.fingerprint.as_ref().map(Fingerprint::as_bytes))
                .collect(),
            lease_us: picked().map(|l| micros(l.lease_ttl)).collect(),
            retention_us: picked().map(|l| micros(l.retention)).collect(),
        }
    }

    fn bind<'q>(&'q self, query: PgQuery<'q>) -> PgQuery<'q> {
        query
            .bind(&self.namespaces)
            .bind(&self.names)
            .bind(&self.tokens)
            .bind(&self.fingerprints)
            .bind(&self.lease_us)
            .bind(&self.retention_us)
    }
}

type PgQuery<'q> = sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>;

fn lease_from_row(row: &PgRow, lease_token: LeaseToken) -> Result<Lease, Error> {
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
fn checkpoint_from_row(row: &PgRow) -> Result<Option<Checkpoint>, Error> {
    let get = |e: sqlx::Error| Error::Internal(Box::new(e));
    Ok(Checkpoint::from_stored(
        row.try_get("checkpoint").map_err(get)?,
        row.try_get("checkpoint_fencing").map_err(get)?,
    ))
}

/// StoreStats from the rows of STATS_LIVE (or its sample) and STATS_SUMMARY
/// (or its indexed form).
fn stats_from_rows(rows: &[PgRow], summary: &PgRow) -> Result<StoreStats, Error> {
    let get = |e: sqlx::Error| Error::Internal(Box::new(e));
    let live = rows
        .iter()
        .map(|row| {
            Ok(StateCount {
                namespace: row.try_get("namespace").map_err(get)?,
                state: state_from(row.try_get("state").map_err(get)?)?,
                count: row.try_get::<i64, _>("count").map_err(get)? as u64,
            })
        })
        .collect::<Result<_, Error>>()?;
    Ok(StoreStats {
        now: system_time(summary.try_get("now").map_err(get)?),
        live,
        expired: summary.try_get::<i64, _>("expired").map_err(get)? as u64,
        oldest_created_at: summary
            .try_get::<Option<OffsetDateTime>, _>("oldest_created_at")
            .map_err(get)?
            .map(system_time),
        earliest_expiry: summary
            .try_get::<Option<OffsetDateTime>, _>("earliest_expiry")
            .map_err(get)?
            .map(system_time),
    })
}

/// One row of CLAIM_OR_FETCH(_MANY): the new lease, or the record found.
fn first_claim_from_row(row: &PgRow, lease: &NewLease) -> Result<FirstClaim, Error> {
    let inserted: bool = row
        .try_get("inserted")
        .map_err(|e| Error::Internal(Box::new(e)))?;
    if inserted {
        Ok(FirstClaim::Inserted(lease_from_row(
            row,
            lease.lease_token,
        )?))
    } else {
        Ok(FirstClaim::Found(snapshot_from_row(row)?))
    }
}

fn snapshot_from_row(row: &PgRow) -> Result<Snapshot, Error> {
    let get = |e: sqlx::Error| Error::Internal(Box::new(e));
    let now = system_time(row.try_get("now").map_err(get)?);
    let Some(state) = row.try_get::<Option<i16>, _>("state").map_err(get)? else {
        return Ok(Snapshot { now, record: None });
    };
    let record = Record {
        state: state_from(state)?,
        fencing_token: row.try_get::<i64, _>("fencing_token").map_err(get)? as u64,
        lease_token: Some(token_from(row.try_get("lease_token").map_err(get)?)?),
        fingerprint: row
            .try_get::<Option<Vec<u8>>, _>("fingerprint")
            .map_err(get)?
            .and_then(Fingerprint::from_stored),
        response: row.try_get("response").map_err(get)?,
        retention: Duration::from_micros(row.try_get::<i64, _>("retention_us").map_err(get)? as u64),
        lease_expires_at: row
            .try_get::<Option<OffsetDateTime>, _>("lease_expires_at")
            .map_err(get)?
            .map(system_time),
        expires_at: system_time(row.try_get("expires_at").map_err(get)?),
        created_at: system_time(row.try_get("created_at").map_err(get)?),
        updated_at: system_time(row.try_get("updated_at").map_err(get)?),
        checkpoint: checkpoint_from_row(row)?,
    };
    Ok(Snapshot {
        now,
        record: Some(record),
    })
}

impl Store for PostgresStore {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    async fn fetch(&self, namespace: &Namespace, key: &Key) -> Result<Snapshot, Error> {
        let row = self
            .budget
            .run(
                "fetch",
                held!(self, |conn| sqlx::query(FETCH)
                    .bind(namespace.as_str())
                    .bind(key.as_str())
                    .fetch_one(conn)),
            )
            .await?;
        snapshot_from_row(&row)
    }

    async fn try_claim(&self, lease: &NewLease) -> Result<Option<Lease>, Error> {
        let row = self
            .budget
            .run(
                "try_claim",
                held!(self, |conn| sqlx::query(TRY_CLAIM)
                    .bind(lease.namespace.as_str())
                    .bind(lease.key.as_str())
                    .bind(lease.lease_token.as_bytes().as_slice())
                    .bind(lease.fingerprint.as_ref().map(Fingerprint::as_bytes))
                    .bind(micros(lease.lease_ttl))
                    .bind(micros(lease.retention))
                    .fetch_optional(conn)),
            )
            .await?;
        row.map(|row| lease_from_row(&row, lease.lease_token))
            .transpose()
    }

    async fn claim_or_fetch(&self, lease: &NewLease) -> Result<FirstClaim, Error> {
        let row = self
            .budget
            .run(
                "claim_or_fetch",
                held!(self, |conn| sqlx::query(CLAIM_OR_FETCH)
                    .bind(lease.namespace.as_str())
                    .bind(lease.key.as_str())
                    .bind(lease.lease_token.as_bytes().as_slice())
                    .bind(lease.fingerprint.as_ref().map(Fingerprint::as_bytes))
                    .bind(micros(lease.lease_ttl))
                    .bind(micros(lease.retention))
                    .fetch_optional(conn)),
            )
            .await?;
        match row {
            Some(row) => first_claim_from_row(&row, lease),
            None => Ok(FirstClaim::Raced),
        }
    }

    async fn claim_or_fetch_many(&self, leases: &[NewLease]) -> Result<Vec<FirstClaim>, Error> {
        if let [lease] = leases {
            return Ok(vec![self.claim_or_fetch(lease).await?]);
        }
        // A key named again is left `Raced`: the lifecycle reads it again.
        let order = distinct_in_key_order(leases, |a, b| {
            by_key((&a.namespace, &a.key), (&b.namespace, &b.key))
        });
        let arrays = LeaseArrays::new(leases, &order);
        let rows = self
            .budget
            .run(
                "claim_or_fetch_many",
                held!(self, |conn| arrays
                    .bind(sqlx::query(CLAIM_OR_FETCH_MANY))
                    .fetch_all(conn)),
            )
            .await?;
        let mut results = vec![FirstClaim::Raced; leases.len()];
        for row in &rows {
            let ord: i64 = row
                .try_get("ord")
                .map_err(|e| Error::Internal(Box::new(e)))?;
            let i = usize::try_from(ord - 1)
                .ok()
                .and_then(|position| order.get(position).copied())
                .ok_or_else(|| Error::Internal("a batch row names no input".into()))?;
            results[i] = first_claim_from_row(row, &leases[i])?;
        }
        Ok(results)
    }

    async fn fetch_many(&self, keys: &[(Namespace, Key)]) -> Result<Vec<Snapshot>, Error> {
        // One item: the scalar statement. Array statements cost PostgreSQL
        // several times as much for a single row (measured: docs/benchmarks.md).
        if let [(namespace, key)] = keys {
            return Ok(vec![self.fetch(namespace, key).await?]);
        }
        let namespaces: Vec<&str> = keys.iter().map(|(n, _)| n.as_str()).collect();
        let names: Vec<&str> = keys.iter().map(|(_, k)| k.as_str()).collect();
        let rows = self
            .budget
            .run(
                "fetch_many",
                held!(self, |conn| sqlx::query(FETCH_MANY)
                    .bind(&namespaces)
                    .bind(&names)
                    .fetch_all(conn)),
            )
            .await?;
        rows.iter().map(snapshot_from_row).collect()
    }

    async fn try_claim_many(&self, leases: &[NewLease]) -> Result<Vec<Option<Lease>>, Error> {
        if let [lease] = leases {
            return Ok(vec![self.try_claim(lease).await?]);
        }
        // One lease per key: a statement cannot take the same row twice.
        let order = distinct_in_key_order(leases, |a, b| {
            by_key((&a.namespace, &a.key), (&b.namespace, &b.key))
        });
        let arrays = LeaseArrays::new(leases, &order);
        let rows = self
            .budget
            .run(
                "try_claim_many",
                held!(self, |conn| arrays
                    .bind(sqlx::query(TRY_CLAIM_MANY))
                    .fetch_all(conn)),
            )
            .await?;
        let get = |e: sqlx::Error| Error::Internal(Box::new(e));
        let mut won = HashMap::with_capacity(rows.len());
        for row in &rows {
            let namespace: String = row.try_get("namespace").map_err(get)?;
            let key: String = row.try_get("key").map_err(get)?;
            won.insert((namespace, key), row);
        }
        let mut results = vec![None; leases.len()];
        for &i in &order {
            let lease = &leases[i];
            let won_row = won.get(&(
                lease.namespace.as_str().to_owned(),
                lease.key.as_str().to_owned(),
            ));
            if let Some(row) = won_row {
                results[i] = Some(lease_from_row(row, lease.lease_token)?);
            }
        }
        Ok(results)
    }

    async fn complete_many(
        &self,
        completions: &[Completion],
    ) -> Result<Vec<Option<SystemTime>>, Error> {
        // One item: the scalar statement, which costs PostgreSQL a third of
        // the function's call for one row.
        if let [c] = completions {
            return Ok(vec![
                self.complete(
                    &c.namespace,
                    &c.key,
                    &c.lease_token,
                    &c.response,
                    c.retention,
                )
                .await?,
            ]);
        }
        // In key order, so concurrent batches lock rows in the same order. A
        // repeat of the same key and token is answered by the lifecycle.
        let order = distinct_in_key_order(completions, |a, b| {
            by_key((&a.namespace, &a.key), (&b.namespace, &b.key))
                .then_with(|| a.lease_token.as_bytes().cmp(b.lease_token.as_bytes()))
        });
        let namespaces: Vec<&str> = order
            .iter()
            .map(|&i| completions[i].namespace.as_str())
            .collect();
        let names: Vec<&str> = order.iter().map(|&i| completions[i].key.as_str()).collect();
        let tokens: Vec<&[u8]> = order
            .iter()
            .map(|&i| completions[i].lease_token.as_bytes().as_slice())
            .collect();
        let responses: Vec<&[u8]> = order
            .iter()
            .map(|&i| completions[i].response.as_slice())
            .collect();
        let retentions: Vec<Option<i64>> = order
            .iter()
            .map(|&i| completions[i].retention.map(micros))
            .collect();
        let rows: Vec<(i32, OffsetDateTime)> = self
            .budget
            .run(
                "complete_many",
                held!(self, |conn| sqlx::query_as(COMPLETE_MANY)
                    .bind(&namespaces)
                    .bind(&names)
                    .bind(&tokens)
                    .bind(&responses)
                    .bind(&retentions)
                    .fetch_all(conn)),
            )
            .await?;
        let mut results = vec![None; completions.len()];
        for (item, expires_at) in rows {
            let i = usize::try_from(item - 1)
                .ok()
                .and_then(|position| order.get(position).copied())
                .ok_or_else(|| Error::Internal("a batch row names no input".into()))?;
            results[i] = Some(system_time(expires_at));
        }
        Ok(results)
    }

    async fn complete(
        &self,
        namespace: &Namespace,
        key: &Key,
        token: &LeaseToken,
        response: &[u8],
        retention: Option<Duration>,
    ) -> Result<Option<SystemTime>, Error> {
        let expires_at: Option<OffsetDateTime> = self
            .budget
            .run(
                "complete",
                held!(self, |conn| sqlx::query_scalar(COMPLETE)
                    .bind(namespace.as_str())
                    .bind(key.as_str())
                    .bind(token.as_bytes().as_slice())
                    .bind(response)
                    .bind(retention.map(micros))
                    .fetch_optional(conn)),
            )
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
            .run(
                "release",
                held!(self, |conn| sqlx::query(RELEASE)
                    .bind(namespace.as_str())
                    .bind(key.as_str())
                    .bind(token.as_bytes().as_slice())
                    .bind(checkpoint)
                    .execute(conn)),
            )
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
        let lease_expires_at: Option<OffsetDateTime> = self
            .budget
            .run(
                "extend_lease",
                held!(self, |conn| sqlx::query_scalar(EXTEND_LEASE)
                    .bind(namespace.as_str())
                    .bind(key.as_str())
                    .bind(token.as_bytes().as_slice())
                    .bind(micros(lease_ttl))
                    .bind(checkpoint)
                    .fetch_optional(conn)),
            )
            .await?;
        Ok(lease_expires_at.map(system_time))
    }

    async fn reap_expired(&self, batch: u32) -> Result<u64, Error> {
        let done = self
            .budget
            .run(
                "reap",
                sqlx::query(REAP)
                    .bind(i64::from(batch))
                    .execute(self.pool()),
            )
            .await?;
        Ok(done.rows_affected())
    }

    async fn purge(&self, namespace: &Namespace, key: &Key) -> Result<Option<RecordState>, Error> {
        let state: Option<i16> = self
            .budget
            .run(
                "purge",
                held!(once self, |conn| sqlx::query_scalar(PURGE)
                    .bind(namespace.as_str())
                    .bind(key.as_str())
                    .fetch_optional(conn)),
            )
            .await?;
        state.map(state_from).transpose()
    }

    async fn stats(&self) -> Result<StoreStats, Error> {
        // Full counts: a sequential scan is the right plan here, so this
        // transaction turns the session's settings back to the defaults.
        let (rows, summary) = self
            .budget
            .run("stats", async {
                let mut tx = self.pool().begin().await?;
                sqlx::query(STATS_SETTINGS).execute(&mut *tx).await?;
                let rows = sqlx::query(STATS_LIVE).fetch_all(&mut *tx).await?;
                let summary = sqlx::query(STATS_SUMMARY).fetch_one(&mut *tx).await?;
                tx.commit().await?;
                Ok((rows, summary))
            })
            .await?;
        stats_from_rows(&rows, &summary)
    }

    /// Counts every row while the table is small; above
    /// EXACT_GAUGE_ROWS rows, estimates the live records from a sample of
    /// about SAMPLE_ROWS (whole pages, TABLESAMPLE SYSTEM), counts the
    /// expired rows through reap_at's index up to EXPIRED_COUNT_CAP, and
    /// finds the oldest expiry there too. Every replica refreshes its gauge
    /// every minute: a full count of 50 million rows took longer than the
    /// store's timeout, and went on in PostgreSQL after the timeout gave up.
    async fn stats_estimate(&self) -> Result<StoreStats, Error> {
        let rows: Option<f32> = self
            .budget
            .run(
                "stats",
                sqlx::query_scalar(TABLE_ROWS).fetch_optional(self.pool()),
            )
            .await?;
        let rows = f64::from(rows.unwrap_or(0.0));
        if rows < EXACT_GAUGE_ROWS {
            return self.stats().await;
        }
        let percent = (100.0 * SAMPLE_ROWS / rows).clamp(0.001, 100.0);
        let (live, summary) = self
            .budget
            .run("stats", async {
                let mut tx = self.pool().begin().await?;
                sqlx::query(STATS_SETTINGS).execute(&mut *tx).await?;
                let live = sqlx::query(STATS_LIVE_SAMPLED)
                    .bind(percent)
                    .fetch_all(&mut *tx)
                    .await?;
                let summary = sqlx::query(STATS_SUMMARY_INDEXED)
                    .bind(EXPIRED_COUNT_CAP)
                    .fetch_one(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok((live, summary))
            })
            .await?;
        stats_from_rows(&live, &summary)
    }

    fn pool_status(&self) -> PoolStatus {
        PoolStatus {
            size: self.pool().size(),
            idle: self.pool().num_idle() as u32 + self.connections.kept() as u32,
            max: self.max_connections,
            in_flight: self.budget.in_flight(),
        }
    }

    /// Health's check. A connection-level failure here makes every
    /// connection opened before it suspect, so that the calls after the
    /// database comes back check theirs first.
    async fn ping(&self) -> Result<(), Error> {
        let suspicion = &self.connections.suspicion;
        self.budget
            .run("ping", async {
                let result = sqlx::query("SELECT 1").execute(self.pool()).await;
                if let Err(error) = &result
                    && (connection_lost(error) || matches!(error, sqlx::Error::PoolTimedOut))
                {
                    suspicion.raise();
                }
                result
            })
            .await
            .map(|_| ())
    }

    /// Listens on the purges channel on a connection of its own (outside the pool),
    /// and sends a heartbeat through it every second from the pool.
    fn purge_feed(&self) -> Option<mpsc::Receiver<PurgeEvent>> {
        let (events, feed) = mpsc::channel(1024);
        let replica: u64 = rand::random();
        let base = Instant::now();
        // A pool of one of its own: sqlx's listener keeps the connection it
        // takes, which would otherwise be the calls' pool's spare, the one
        // health and the reaper rely on.
        let own = PgPoolOptions::new()
            .max_connections(1)
            .min_connections(0)
            .acquire_timeout(self.budget.timeout)
            .connect_lazy_with(self.pool().connect_options().as_ref().clone());
        tokio::spawn(listen_for_purges(
            own,
            events,
            replica,
            base,
            self.feed_stop.clone(),
        ));
        tokio::spawn(send_heartbeats(
            self.pool().clone(),
            self.budget.clone(),
            replica,
            base,
            self.feed_stop.clone(),
        ));
        Some(feed)
    }

    async fn close(&self) {
        self.feed_stop.cancel();
        self.connections.release_all();
        self.pool().close().await;
    }
}

/// The feed's listening side: forwards purges and this replica's own
/// heartbeats, and says `Lost` whenever its connection fails (then connects
/// again, with a growing pause).
async fn listen_for_purges(
    pool: PgPool,
    events: mpsc::Sender<PurgeEvent>,
    replica: u64,
    base: Instant,
    stop: CancellationToken,
) {
    let mut pause = Duration::from_millis(100);
    loop {
        let connect = async {
            let mut listener = PgListener::connect_with(&pool).await?;
            listener.ignore_pool_close_event(true);
            let channel: String = sqlx::query_scalar(PURGES_CHANNEL)
                .fetch_one(&mut listener)
                .await?;
            listener.listen(&channel).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        let listener = tokio::select! {
            () = stop.cancelled() => return,
            listener = connect => listener,
        };
        match listener {
            Ok(mut listener) => {
                pause = Duration::from_millis(100);
                loop {
                    let received = tokio::select! {
                        () = stop.cancelled() => return,
                        received = listener.try_recv() => received,
                    };
                    let event = match received {
                        Ok(Some(notification)) => {
                            match feed_event(notification.payload(), replica, base) {
                                Some(event) => event,
                                None => continue,
                            }
                        }
                        Ok(None) | Err(_) => break,
                    };
                    if events.send(event).await.is_err() {
                        return;
                    }
                }
                tracing::warn!("lost the connection that listens for purges; reconnecting");
            }
            Err(error) => {
                tracing::debug!(%error, "cannot listen for purges yet");
            }
        }
        if events.send(PurgeEvent::Lost).await.is_err() {
            return;
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}

/// Reads one notification of the purges channel: a purge (from any replica), this
/// replica's heartbeat, or another replica's heartbeat (`None`, as is
/// anything unreadable, which no version of this service sends).
fn feed_event(payload: &str, replica: u64, base: Instant) -> Option<PurgeEvent> {
    if let Some(heartbeat) = payload.strip_prefix("hb:") {
        let (from, sent) = heartbeat.split_once(':')?;
        if u64::from_str_radix(from, 16).ok()? != replica {
            return None;
        }
        let sent = Duration::from_micros(sent.parse().ok()?);
        return Some(PurgeEvent::CaughtUp(base + sent));
    }
    let (length, rest) = payload.split_once(':')?;
    let length: usize = length.parse().ok()?;
    if !rest.is_char_boundary(length) {
        return None;
    }
    let (namespace, key) = rest.split_at(length);
    let namespace = Namespace::parse(namespace.to_owned()).ok()?;
    let key = Key::parse(key.to_owned()).ok()?;
    Some(PurgeEvent::Purged(namespace, key))
}

/// The feed's heartbeats: one NOTIFY every second, carrying when it was
/// sent, through the pool's reserve connection.
async fn send_heartbeats(
    pool: PgPool,
    budget: Budget,
    replica: u64,
    base: Instant,
    stop: CancellationToken,
) {
    let mut every = tokio::time::interval(HEARTBEAT_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = every.tick() => {}
        }
        let sent = base.elapsed().as_micros();
        let payload = format!("hb:{replica:x}:{sent}");
        let notify = sqlx::query(HEARTBEAT).bind(payload).execute(&pool);
        // A failed heartbeat only lets the cache's freshness lapse.
        let _ = budget.run("heartbeat", notify).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_purge_notification_names_its_key_whatever_the_key_holds() {
        let base = Instant::now();
        let event = feed_event("5:shöpa:b:c", 7, base);
        let Some(PurgeEvent::Purged(namespace, key)) = event else {
            panic!("expected a purge, got {event:?}");
        };
        assert_eq!((namespace.as_str(), key.as_str()), ("shöp", "a:b:c"));
        assert!(feed_event("9:short", 7, base).is_none());
        assert!(feed_event("1:\u{e9}x", 7, base).is_none());
    }

    #[test]
    fn only_this_replicas_heartbeats_vouch_for_its_cache() {
        let base = Instant::now();
        match feed_event("hb:7:1500000", 7, base) {
            Some(PurgeEvent::CaughtUp(sent)) => {
                assert_eq!(sent, base + Duration::from_millis(1500))
            }
            other => panic!("expected a heartbeat, got {other:?}"),
        }
        assert!(feed_event("hb:8:1500000", 7, base).is_none());
    }

    #[test]
    fn distinct_items_come_in_key_order_keeping_each_first_occurrence() {
        let items = [
            ("n", "b", 1),
            ("n", "a", 2),
            ("m", "z", 3),
            ("n", "b", 4),
            ("n", "a", 5),
        ];
        let order = distinct_in_key_order(&items, |x, y| (x.0, x.1).cmp(&(y.0, y.1)));
        assert_eq!(order, [2, 1, 0]);
        let by_all = distinct_in_key_order(&items, |x, y| (x.0, x.1, x.2).cmp(&(y.0, y.1, y.2)));
        assert_eq!(by_all, [2, 1, 4, 0, 3]);
    }
}
