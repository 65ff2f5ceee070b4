//! The PostgreSQL store: the production store, shared by any number of
//! replicas through one table.
//!
//! Every time comparison and every timestamp uses the database's `now()`, so
//! replicas whose clocks disagree still agree on who holds a lease. Each
//! transition is one statement whose WHERE clause is the rule; under READ
//! COMMITTED, `INSERT … ON CONFLICT DO UPDATE … WHERE` re-checks that clause on
//! the latest row version after taking the row lock, which is what makes
//! "exactly one winner" hold across replicas.
//!
//! The folder keeps one concern per file: `sql` (every statement),
//! `connections` (keeping connections between statements, and dropping dead
//! ones after a restart), `feed` (the purge feed and its heartbeats),
//! `sqlstate` (what the service knows of PostgreSQL's error codes), `rows`
//! (decoding rows, binding batches), `shards` (on Citus, which worker holds
//! a key, to send a batch once per worker), `nodes` (on Citus, a pool per
//! node, so that a key's statement goes straight to the node holding it, and
//! the coordinator for what must run there), and here the `Store` impl and
//! start-up.

mod connections;
mod feed;
mod nodes;
mod rows;
mod shards;
mod sql;
pub(crate) mod sqlstate;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions, PgRow, PgSslMode};
use sqlx::{ConnectOptions, Connection as _, Row};
use time::OffsetDateTime;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

use self::connections::{Connections, Route, Suspicion, Unreachable, held};
use self::rows::{
    LeaseArrays, PgQuery, by_key, distinct_in_key_order, first_claim_from_row, lease_from_row,
    purged_from, snapshot_from_row, stats_from_rows, system_time,
};
pub use self::shards::hashtext;
use self::sql::*;
use self::sqlstate::connection_lost;
use super::{
    Budget, FirstClaim, Operations, PoolStatus, PurgeEvent, Reaped, Store, StoreOptions,
    StoreStats, micros,
};
use crate::domain::{
    Completion, Fingerprint, Key, Lease, LeaseToken, Namespace, NewLease, Purged, RecordState,
    Snapshot,
};
use crate::error::Error;

/// How many times `watch` reads a row that changed under its mark before it
/// answers with the last read (the waiter then hears of the key at its
/// lease's expiry at the latest).
const WATCH_READS: usize = 3;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");

#[derive(Clone)]
pub struct PostgresStore {
    /// The connections to the node DATABASE_URL names (the entry).
    connections: Arc<Connections>,
    /// On Citus, each node's connections, for the statements sent where
    /// their key lives (nodes.rs).
    nodes: Arc<nodes::Nodes>,
    /// Whether, on Citus, a key's statement goes straight to the node
    /// holding its shard (`StoreOptions::citus_direct`).
    direct: bool,
    /// Where migrations go, and the purge feed listens first (the
    /// coordinator).
    home: Arc<nodes::Home>,
    /// How a pool is opened, for the other nodes'.
    setup: Setup,
    /// Plain PostgreSQL or Citus, as the connections found.
    engine: Arc<EngineCell>,
    max_connections: u32,
    budget: Budget,
    /// Stops the purge feed's tasks when the store closes.
    feed_stop: CancellationToken,
    /// The purge feed, started by the first purge or subscription.
    feed: feed::Slot,
    /// On Citus, which worker holds each shard (read when first needed).
    shards: Arc<shards::Shards>,
    /// Citus's statements on plain PostgreSQL (`StoreOptions::citus_statements`).
    citus_statements: bool,
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
        let engine = Arc::new(EngineCell::default());
        let setup = Setup {
            pool_size: options.pool_size,
            timeout: options.timeout,
            engine: engine.clone(),
            forced: options.citus_statements,
        };
        Self {
            connections: Arc::new(setup.open(connect_options)),
            nodes: Arc::default(),
            direct: options.citus_direct && !options.citus_statements,
            home: Arc::default(),
            setup,
            engine,
            max_connections: options.pool_size + 1,
            budget: Budget::new("postgresql", options.timeout),
            feed_stop: CancellationToken::new(),
            feed: feed::Slot::default(),
            shards: Arc::default(),
            citus_statements: options.citus_statements,
        }
    }

    /// The connections for a statement on `key`: on Citus, when calls go
    /// direct, those of the node holding the key's shard as the shard map
    /// has it; otherwise, and whenever the map cannot say, the entry's.
    fn on_key(&self, key: &str) -> Route<'_> {
        let entry = Route::Entry(&self.connections);
        if !self.direct || self.engine.get() != Some(Engine::Citus) {
            return entry;
        }
        let Some(map) = self.shards.current(self.pool()) else {
            return entry;
        };
        // A pool of its own for every node, the entry's included: the
        // entry may be an address that reaches any worker (a load balancer).
        match map.group_of(key).and_then(|group| map.node(group)) {
            Some(node) => Route::Node(self.nodes.get(node, |node| {
                let mut connections =
                    self.setup
                        .open(nodes::at_node(self.pool(), &node.host, node.port));
                connections.unreachable = Unreachable::of(&connections.pool);
                connections
            })),
            None => entry,
        }
    }

    /// A batch's items (`order`, positions in key order) in the groups its
    /// statement goes in: one on plain PostgreSQL; on Citus one per worker,
    /// as the shard map places their keys (shards.rs).
    fn groups<'a>(
        &self,
        sql: &Statements,
        order: &[usize],
        key_of: impl Fn(usize) -> &'a str,
    ) -> Vec<Vec<usize>> {
        if !sql.routed {
            return vec![order.to_vec()];
        }
        if self.citus_statements {
            // Plain PostgreSQL has no shard map: two made-up workers, so that
            // the tests' batches go in several groups, as on Citus.
            return shards::group_by_worker(Some(&shards::ShardMap::halves()), order, key_of);
        }
        let map = self.shards.current(self.pool());
        shards::group_by_worker(map.as_deref(), order, key_of)
    }

    /// A set-based claim (`statement` of the engine's statements, binding
    /// `LeaseArrays`) for distinct keys, in key order, sent once per group:
    /// the order, the groups (positions in `leases`) and each group's rows.
    async fn lease_batch(
        &self,
        operation: &'static str,
        statement: fn(&Statements) -> &'static str,
        leases: &[NewLease],
    ) -> Result<(Vec<usize>, Vec<Vec<usize>>, Vec<Vec<PgRow>>), Error> {
        let order = distinct_in_key_order(leases, |a, b| {
            by_key((&a.namespace, &a.key), (&b.namespace, &b.key))
        });
        let sql = self.engine().await?.statements();
        let groups = self.groups(sql, &order, |i| leases[i].key.as_str());
        let statement = statement(sql);
        let answers = each_group(&groups, |group| async move {
            let arrays = LeaseArrays::new(leases, group);
            let route = leases[group[0]].key.as_str();
            self.budget
                .run(
                    operation,
                    held!(on self.on_key(route), |conn| arrays
                        .bind(Self::batch(sql, statement, route))
                        .fetch_all(conn)),
                )
                .await
        })
        .await?;
        Ok((order, groups, answers))
    }

    /// A batch statement for one group: on Citus it takes the group's
    /// routing key first (any of its keys: Citus sends the call to the
    /// worker holding that key's shard).
    fn batch<'q>(sql: &Statements, statement: &'static str, route: &'q str) -> PgQuery<'q> {
        let query = sqlx::query(statement);
        if sql.routed { query.bind(route) } else { query }
    }

    /// The statements for the engine found. Read once a connection is held:
    /// its `after_connect` has told the engine by then.
    fn sql(&self) -> &'static Statements {
        self.engine.get().unwrap_or(Engine::Postgres).statements()
    }

    /// The engine, connecting first when no connection has told it yet (for
    /// the statements that run on the pool, and the server's start).
    pub async fn engine(&self) -> Result<Engine, Error> {
        if let Some(engine) = self.engine.get() {
            return Ok(engine);
        }
        self.budget
            .run("connect", async { self.pool().acquire().await.map(drop) })
            .await?;
        Ok(self.engine.get().unwrap_or(Engine::Postgres))
    }

    /// sqlx's pool, for the statements off the call path (the reaper,
    /// stats, health) and the connections `Connections` takes.
    fn pool(&self) -> &PgPool {
        &self.connections.pool
    }

    /// The store's purge feed, made (not started) if it has none yet: on
    /// the home node (`home`).
    fn feed(&self) -> &Arc<feed::Feed> {
        feed::feed(
            &self.feed,
            self.pool(),
            &self.home,
            &self.budget,
            &self.feed_stop,
        )
    }

    /// Applies the pending migrations; on Citus, one of them distributes the
    /// table (docs/scaling.md), and the line after says over how many shards.
    pub async fn migrate(&self) -> anyhow::Result<()> {
        let failed = |server: String, e: &dyn std::fmt::Display| {
            anyhow::anyhow!("DATABASE_URL: migrating the database at {server} failed: {e}")
        };
        // On a Citus worker, through the coordinator: DDL runs there.
        let home = self
            .home
            .options(self.pool())
            .await
            .map_err(|e| failed(self.server(), &e))?;
        match home {
            None => MIGRATOR
                .run(self.pool())
                .await
                .map_err(|e| failed(self.server(), &e))?,
            Some(options) => {
                let coordinator = format!("{}:{}", options.get_host(), options.get_port());
                let pool = PgPoolOptions::new()
                    .max_connections(1)
                    .acquire_timeout(self.budget.timeout)
                    .connect_lazy_with(options);
                let migrated = MIGRATOR.run(&pool).await;
                pool.close().await;
                migrated.map_err(|e| failed(format!("the coordinator {coordinator}"), &e))?;
            }
        }
        if self.engine().await? == Engine::Citus && !self.citus_statements {
            let shards: i64 = sqlx::query_scalar(CITUS_SHARDS)
                .fetch_one(self.pool())
                .await?;
            tracing::info!(
                shards,
                "idempotency_records is distributed by key over {shards} shards"
            );
        }
        Ok(())
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
                sqlx::Error::Database(e) => e.code().is_some_and(|code| sqlstate::starting(&code)),
                _ => false,
            };
            let retry_at = tokio::time::Instant::now() + Duration::from_millis(200);
            if !starting || retry_at >= deadline {
                anyhow::bail!(
                    "DATABASE_URL: {}",
                    unreachable(&server, options.get_ssl_mode(), &error)
                );
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
fn unreachable(server: &str, ssl_mode: PgSslMode, error: &sqlx::Error) -> String {
    match error {
        sqlx::Error::Io(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            format!("cannot connect to PostgreSQL at {server}: connection refused")
        }
        // sqlx hands rustls's refusal of the server's certificate back as
        // an I/O error.
        sqlx::Error::Io(e) if e.get_ref().is_some_and(|inner| inner.is::<rustls::Error>()) => {
            tls_failed(server, ssl_mode, e)
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
        sqlx::Error::Tls(e) => tls_failed(server, ssl_mode, e),
        other => format!("cannot connect to PostgreSQL at {server}: {other}"),
    }
}

/// A TLS handshake that failed, in one line: the sslmode in force and what
/// to choose instead. Under `prefer` (the default) the certificate is not
/// verified, as with libpq, but it must still be one rustls can read (X.509
/// v3): Citus's `CREATE EXTENSION` turns TLS on with a self-signed v1
/// certificate, which is the usual cause. The service does not fall back to
/// plaintext after a failed handshake (libpq's `prefer` does): a server that
/// offers TLS gets TLS or a clear refusal, never a silent downgrade.
fn tls_failed(server: &str, ssl_mode: PgSslMode, error: &dyn std::fmt::Display) -> String {
    let mode = match ssl_mode {
        PgSslMode::Disable => "disable",
        PgSslMode::Allow => "allow",
        PgSslMode::Prefer => "prefer",
        PgSslMode::Require => "require",
        PgSslMode::VerifyCa => "verify-ca",
        PgSslMode::VerifyFull => "verify-full",
    };
    format!(
        "TLS with PostgreSQL at {server} failed under sslmode={mode}: {error}; the server's \
         certificate cannot be used (under prefer and require it is not verified, but it must \
         be an X.509 v3 certificate: Citus's CREATE EXTENSION installs a self-signed v1 one). \
         Choose one: add sslmode=disable to DATABASE_URL (plaintext, on a network you trust), \
         or sslmode=verify-full with sslrootcert=<the CA's file> and a proper server \
         certificate, or give the server a proper v3 certificate (docs/operations.md, \"TLS to \
         PostgreSQL\")"
    )
}

/// How the store opens a node's pool: the entry's, and on Citus each other
/// node's the same way.
#[derive(Clone)]
struct Setup {
    pool_size: u32,
    timeout: Duration,
    /// Told by every new connection which engine it is on.
    engine: Arc<EngineCell>,
    /// Citus's statements on plain PostgreSQL (`StoreOptions::citus_statements`).
    forced: bool,
}

impl Setup {
    /// A pool for `connect_options`, not connected yet.
    fn open(&self, connect_options: PgConnectOptions) -> Connections {
        // One connection more than the calls may hold, so that background
        // statements (health, the reaper, counts, heartbeats) always find
        // one: the calls keep theirs between statements (`Connections`).
        let suspicion = Arc::new(Suspicion::new());
        let checks = suspicion.clone();
        let found = self.engine.clone();
        let forced = self.forced;
        let pool = PgPoolOptions::new()
            .max_connections(self.pool_size + 1)
            .min_connections(0)
            .acquire_timeout(self.timeout)
            // sqlx pings every connection it hands out unless told not to: a
            // second round trip per call. Broken connections are still found,
            // by the ping sqlx makes when a failed statement's connection is
            // returned (see `Connections`), and by the one below for a
            // connection opened before the last connection-level error.
            // Which engine this is, asked of every new connection (one round
            // trip per connection, not per statement), before its first
            // statement chooses its text by it. Any Citus node will do: every
            // node of a Citus 11+ cluster routes a statement to its shard.
            .after_connect(move |connection, _| {
                let found = found.clone();
                Box::pin(async move {
                    let citus: Option<String> = sqlx::query_scalar(CITUS_VERSION)
                        .fetch_optional(&mut *connection)
                        .await?;
                    if citus.is_some() || forced {
                        sqlx::query(CITUS_SESSION).execute(&mut *connection).await?;
                    }
                    found.set(match citus.as_deref() {
                        None if forced => Some(FORCED),
                        version => version,
                    });
                    Ok(())
                })
            })
            .test_before_acquire(false)
            .before_acquire(move |connection, meta| {
                let suspect = Instant::now()
                    .checked_sub(meta.age)
                    .is_some_and(|opened| checks.covers(opened));
                Box::pin(async move { Ok(!suspect || connection.ping().await.is_ok()) })
            })
            .connect_lazy_with(connect_options);
        Connections {
            pool,
            permits: Semaphore::new(self.pool_size as usize),
            kept: std::sync::Mutex::default(),
            suspicion,
            unreachable: None,
        }
    }
}

/// The database behind `DATABASE_URL`: the statements differ (sql.rs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Postgres,
    /// A Citus coordinator (the extension installed in the database).
    Citus,
}

impl Engine {
    fn statements(self) -> &'static Statements {
        match self {
            Self::Postgres => &ON_POSTGRES,
            Self::Citus => &ON_CITUS,
        }
    }
}

/// What `EngineCell` is told for plain PostgreSQL running Citus's
/// statements (the tests' `IDEMPOTENCY_CITUS_STATEMENTS`).
const FORCED: &str =
    "none: Citus's statements on plain PostgreSQL (IDEMPOTENCY_CITUS_STATEMENTS, for the tests)";

/// The engine the connections found; logged the first time it is known.
#[derive(Default)]
struct EngineCell(std::sync::atomic::AtomicU8);

impl EngineCell {
    fn get(&self) -> Option<Engine> {
        match self.0.load(std::sync::atomic::Ordering::Acquire) {
            1 => Some(Engine::Postgres),
            2 => Some(Engine::Citus),
            _ => None,
        }
    }

    fn set(&self, citus_version: Option<&str>) {
        let code = if citus_version.is_some() { 2 } else { 1 };
        let before = self.0.swap(code, std::sync::atomic::Ordering::AcqRel);
        if before == code {
            return;
        }
        match citus_version {
            Some(version) => tracing::info!(
                citus = version,
                "the database is a Citus cluster: every call's statement goes to the one \
                 shard of its key"
            ),
            None => tracing::info!("the database is plain PostgreSQL"),
        }
    }
}

impl PostgresStore {
    /// Runs a statement that claims a key with `lease` (TRY_CLAIM, RECLAIM:
    /// both take $1 to $6 as a new record's columns) and reads the lease it
    /// returns, if it applied.
    async fn claiming(
        &self,
        operation: &'static str,
        statement: &'static str,
        lease: &NewLease,
    ) -> Result<Option<Lease>, Error> {
        let row = self
            .budget
            .run(
                operation,
                held!(on self.on_key(lease.key.as_str()), |conn| sqlx::query(statement)
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
                held!(on self.on_key(key.as_str()), |conn| sqlx::query(self.sql().fetch)
                    .bind(namespace.as_str())
                    .bind(key.as_str())
                    .fetch_one(conn)),
            )
            .await?;
        snapshot_from_row(&row)
    }

    /// WATCH, on the node holding the key (read again, up to
    /// [`WATCH_READS`] times, when the mark met a row changed under it).
    async fn watch(&self, namespace: &Namespace, key: &Key) -> Result<Snapshot, Error> {
        let mut reads = 0;
        loop {
            reads += 1;
            let row = self
                .budget
                .run(
                    "watch",
                    held!(on self.on_key(key.as_str()), |conn| sqlx::query(self.sql().watch)
                        .bind(namespace.as_str())
                        .bind(key.as_str())
                        .fetch_one(conn)),
                )
                .await?;
            let snapshot = snapshot_from_row(&row)?;
            let get = |column| {
                row.try_get::<bool, _>(column)
                    .map_err(|e| Error::Internal(Box::new(e)))
            };
            let heard = get("watched")? || get("marked")?;
            let open = snapshot.record.as_ref().is_some_and(|r| {
                r.state == RecordState::InProgress
                    && !r.is_expired(snapshot.now)
                    && r.lease_expires_at.is_some_and(|at| at > snapshot.now)
            });
            if heard || !open || reads >= WATCH_READS {
                return Ok(snapshot);
            }
        }
    }

    fn announces(&self) -> super::Announces {
        super::Announces::Feed
    }

    fn fails_in_parts(&self) -> bool {
        // Citus, whose batches go in one group per worker (`groups`); also
        // Citus's statements on plain PostgreSQL (the tests' made-up
        // workers), so that the engines take the same path.
        self.engine.get() == Some(Engine::Citus)
    }

    async fn try_claim(&self, lease: &NewLease) -> Result<Option<Lease>, Error> {
        self.claiming("try_claim", TRY_CLAIM, lease).await
    }

    async fn claim_or_fetch(&self, lease: &NewLease) -> Result<FirstClaim, Error> {
        let row = self
            .budget
            .run(
                "claim_or_fetch",
                held!(on self.on_key(lease.key.as_str()), |conn| sqlx::query(self.sql().claim_or_fetch)
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
        let (_, groups, answers) = self
            .lease_batch("claim_or_fetch_many", |sql| sql.claim_or_fetch_many, leases)
            .await?;
        let mut results = vec![FirstClaim::Raced; leases.len()];
        for (group, rows) in groups.iter().zip(&answers) {
            for row in rows {
                let ord: i64 = row
                    .try_get("ord")
                    .map_err(|e| Error::Internal(Box::new(e)))?;
                let i = item_at(group, ord)?;
                results[i] = first_claim_from_row(row, &leases[i])?;
            }
        }
        Ok(results)
    }

    async fn fetch_many(&self, keys: &[(Namespace, Key)]) -> Result<Vec<Snapshot>, Error> {
        // One item: the scalar statement. Array statements cost PostgreSQL
        // several times as much for a single row (measured: docs/benchmarks.md).
        if let [(namespace, key)] = keys {
            return Ok(vec![self.fetch(namespace, key).await?]);
        }
        let order: Vec<usize> = (0..keys.len()).collect();
        let sql = self.engine().await?.statements();
        let groups = self.groups(sql, &order, |i| keys[i].1.as_str());
        let statement = sql.fetch_many;
        let answers = each_group(&groups, |group| async move {
            let namespaces: Vec<&str> = group.iter().map(|&i| keys[i].0.as_str()).collect();
            let names: Vec<&str> = group.iter().map(|&i| keys[i].1.as_str()).collect();
            self.budget
                .run(
                    "fetch_many",
                    held!(on self.on_key(names[0]), |conn| Self::batch(sql, statement, names[0])
                        .bind(&namespaces)
                        .bind(&names)
                        .fetch_all(conn)),
                )
                .await
        })
        .await?;
        // One row per input, in the group's order.
        let mut results: Vec<Option<Snapshot>> = vec![None; keys.len()];
        for (group, rows) in groups.iter().zip(&answers) {
            if rows.len() != group.len() {
                return Err(Error::Internal("a batch read lost track of an item".into()));
            }
            for (&i, row) in group.iter().zip(rows) {
                results[i] = Some(snapshot_from_row(row)?);
            }
        }
        results
            .into_iter()
            .map(|snapshot| {
                snapshot.ok_or_else(|| Error::Internal("a batch read missed an item".into()))
            })
            .collect()
    }

    async fn try_claim_many(&self, leases: &[NewLease]) -> Result<Vec<Option<Lease>>, Error> {
        if let [lease] = leases {
            return Ok(vec![self.try_claim(lease).await?]);
        }
        // One lease per key: a statement cannot take the same row twice.
        let (order, _, answers) = self
            .lease_batch("try_claim_many", |sql| sql.try_claim_many, leases)
            .await?;
        let get = |e: sqlx::Error| Error::Internal(Box::new(e));
        let mut won = HashMap::with_capacity(order.len());
        for row in answers.iter().flatten() {
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
                    c.remember_for,
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
        let sql = self.engine().await?.statements();
        let groups = self.groups(sql, &order, |i| completions[i].key.as_str());
        let statement = sql.complete_many;
        let answers = each_group(&groups, |group| async move {
            let picked = || group.iter().map(|&i| &completions[i]);
            let namespaces: Vec<&str> = picked().map(|c| c.namespace.as_str()).collect();
            let names: Vec<&str> = picked().map(|c| c.key.as_str()).collect();
            let tokens: Vec<&[u8]> = picked()
                .map(|c| c.lease_token.as_bytes().as_slice())
                .collect();
            let responses: Vec<&[u8]> = picked().map(|c| c.response.as_slice()).collect();
            let retentions: Vec<Option<i64>> = picked().map(|c| c.retention.map(micros)).collect();
            let remember: Vec<Option<i64>> = picked().map(|c| c.remember_for.map(micros)).collect();
            self.budget
                .run(
                    "complete_many",
                    held!(on self.on_key(names[0]), |conn| Self::batch(sql, statement, names[0])
                        .bind(&namespaces)
                        .bind(&names)
                        .bind(&tokens)
                        .bind(&responses)
                        .bind(&retentions)
                        .bind(&remember)
                        .fetch_all(conn)),
                )
                .await
        })
        .await?;
        let mut results = vec![None; completions.len()];
        for (group, rows) in groups.iter().zip(&answers) {
            for row in rows {
                let get = |e: sqlx::Error| Error::Internal(Box::new(e));
                let item: i32 = row.try_get("item").map_err(get)?;
                let expires_at: OffsetDateTime = row.try_get("new_expires_at").map_err(get)?;
                results[item_at(group, i64::from(item))?] = Some(system_time(expires_at));
            }
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
        remember_for: Option<Duration>,
    ) -> Result<Option<SystemTime>, Error> {
        let expires_at: Option<OffsetDateTime> = self
            .budget
            .run(
                "complete",
                held!(on self.on_key(key.as_str()), |conn| sqlx::query_scalar(COMPLETE)
                    .bind(namespace.as_str())
                    .bind(key.as_str())
                    .bind(token.as_bytes().as_slice())
                    .bind(response)
                    .bind(retention.map(micros))
                    .bind(remember_for.map(micros))
                    .fetch_optional(conn)),
            )
            .await?;
        Ok(expires_at.map(system_time))
    }

    async fn reclaim(&self, lease: &NewLease) -> Result<Option<Lease>, Error> {
        self.claiming("reclaim", RECLAIM, lease).await
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
                held!(on self.on_key(key.as_str()), |conn| sqlx::query(RELEASE)
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
                held!(on self.on_key(key.as_str()), |conn| sqlx::query_scalar(EXTEND_LEASE)
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

    async fn reap_expired(&self, batch: u32) -> Result<Reaped, Error> {
        let statement = self.engine().await?.statements().reap;
        let (remembered, deleted): (i64, i64) = self
            .budget
            .run(
                "reap",
                sqlx::query_as(statement)
                    .bind(i64::from(batch))
                    .fetch_one(self.pool()),
            )
            .await?;
        Ok(Reaped {
            remembered: remembered.max(0) as u64,
            deleted: deleted.max(0) as u64,
        })
    }

    /// Returns once no replica's replay cache can answer with what was
    /// purged (`feed`: each acknowledged it, or the bound has passed).
    async fn purge(&self, namespace: &Namespace, key: &Key) -> Result<Option<Purged>, Error> {
        // On the node holding the key (on Citus; every replica's feed
        // listens there too), whose clock decides its Claims.
        let feed = self.feed();
        let purge = feed.purge(self.pool()).await?;
        let state: Option<i16> = self
            .budget
            .run(
                "purge",
                held!(once on self.on_key(key.as_str()), |conn| sqlx::query_scalar(self.sql().purge)
                    .bind(namespace.as_str())
                    .bind(key.as_str())
                    .bind(&purge.channel)
                    .bind(&purge.name)
                    .fetch_optional(conn)),
            )
            .await?;
        let purged = state.map(purged_from).transpose()?;
        if purged == Some(Purged::Live(RecordState::Completed)) {
            purge.settle(Instant::now()).await;
        }
        Ok(purged)
    }

    async fn close(&self) {
        self.feed_stop.cancel();
        self.connections.release_all();
        self.pool().close().await;
        for node in self.nodes.all() {
            node.release_all();
            node.pool.close().await;
        }
    }
}

impl Operations for PostgresStore {
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

    /// Every pool's together: the entry's and, on Citus, each node's.
    fn pool_status(&self) -> PoolStatus {
        let mut pools = vec![self.connections.clone()];
        pools.extend(self.nodes.all());
        PoolStatus {
            size: pools.iter().map(|c| c.pool.size()).sum(),
            idle: pools
                .iter()
                .map(|c| c.pool.num_idle() as u32 + c.kept() as u32)
                .sum(),
            max: self.max_connections * pools.len() as u32,
            in_flight: self.budget.in_flight(),
        }
    }

    /// The store's one feed (`feed`: a LISTEN connection and a connection
    /// for heartbeats, both outside the pool), told to one more cache.
    fn purge_feed(&self) -> Option<mpsc::Receiver<PurgeEvent>> {
        Some(self.feed().subscribe())
    }

    /// No cache here: `cache::Cached` wraps this store.
    fn cache_stats(&self) -> Option<super::cache::CacheStats> {
        None
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
}

/// Runs a batch's statement once per group (`run`), the groups side by
/// side, each on its own connection and in its own transaction: on Citus no
/// statement spans two workers. Any group's failure fails the batch.
async fn each_group<'g, R, F, Fut>(groups: &'g [Vec<usize>], run: F) -> Result<Vec<R>, Error>
where
    F: Fn(&'g [usize]) -> Fut,
    Fut: std::future::Future<Output = Result<R, Error>>,
{
    match groups {
        [one] => Ok(vec![run(one).await?]),
        _ => futures_util::future::join_all(groups.iter().map(|group| run(group)))
            .await
            .into_iter()
            .collect(),
    }
}

/// The input a batch row names by its 1-based position in `group`.
fn item_at(group: &[usize], position: i64) -> Result<usize, Error> {
    usize::try_from(position - 1)
        .ok()
        .and_then(|at| group.get(at).copied())
        .ok_or_else(|| Error::Internal("a batch row names no input".into()))
}
