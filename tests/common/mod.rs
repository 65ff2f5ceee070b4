//! Test helpers: a real server on 127.0.0.1:0 over a real store (a fresh
//! PostgreSQL schema or a fresh SQLite file per test), a typed client with
//! the requests and calls every suite makes, and polling with a deadline.

#![allow(dead_code)]

pub mod cluster;
pub mod pki;
pub mod process;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use idempotency_service::config::Config;
use idempotency_service::grpc::proto::idempotency_service_client::IdempotencyServiceClient;
use idempotency_service::grpc::proto::{
    self, ClaimRequest, CompleteRequest, ExtendLeaseRequest, GetRequest, Outcome, ReleaseRequest,
};
use sqlx::Connection;
use tempfile::TempDir;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

pub use idempotency_service::grpc::proto::State;

/// The PostgreSQL server the tests use; a database of their own is created in it.
pub fn postgres_admin_url() -> String {
    std::env::var("TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

const TEST_DATABASE: &str = "idempotency_test";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// PostgreSQL, with concurrent calls coalesced (the default).
    Postgres,
    /// PostgreSQL, one statement per call.
    PostgresUncoalesced,
    /// Plain PostgreSQL running the statements and functions the store sends
    /// on Citus (IDEMPOTENCY_CITUS_STATEMENTS), coalesced: the two engines'
    /// rules must agree, and this needs no Citus.
    PostgresCitusSql,
    Sqlite,
}

/// A fresh, empty store that one or more servers can share.
pub struct StoreFixture {
    pub backend: Backend,
    pub database_url: Option<String>,
    /// On Citus with TEST_CITUS_SPREAD=1: the URLs of the nodes the
    /// servers of this store connect to, one after the other, a worker
    /// first (`config`); empty otherwise (every server on `database_url`).
    pub spread: Vec<String>,
    next_node: std::sync::atomic::AtomicUsize,
    pub data_dir: PathBuf,
    _temp: TempDir,
}

impl StoreFixture {
    pub async fn new(backend: Backend) -> Self {
        let temp = tempfile::tempdir().expect("temp dir");
        let database_url = match backend {
            Backend::Sqlite => None,
            Backend::Postgres | Backend::PostgresUncoalesced | Backend::PostgresCitusSql => {
                Some(fresh_postgres_schema().await)
            }
        };
        let spread = match &database_url {
            Some(url) if backend != Backend::PostgresCitusSql => citus_spread(url).await,
            _ => Vec::new(),
        };
        Self {
            backend,
            database_url,
            spread,
            next_node: std::sync::atomic::AtomicUsize::new(0),
            data_dir: temp.path().join("data"),
            _temp: temp,
        }
    }

    /// Rows in the table, expired or not, read straight from the database.
    pub async fn row_count(&self) -> i64 {
        let sql = "SELECT count(*) FROM idempotency_records";
        match &self.database_url {
            Some(url) => {
                let mut conn = sqlx::PgConnection::connect(url).await.expect("connect");
                sqlx::query_scalar(sql)
                    .fetch_one(&mut conn)
                    .await
                    .expect("count")
            }
            None => {
                let url = format!(
                    "sqlite://{}",
                    self.data_dir.join("idempotency.db").display()
                );
                let mut conn = sqlx::SqliteConnection::connect(&url).await.expect("open");
                sqlx::query_scalar(sql)
                    .fetch_one(&mut conn)
                    .await
                    .expect("count")
            }
        }
    }

    /// A key's row as stored, read straight from the database: its state
    /// code (4: a marker) and whether it holds a response.
    pub async fn row_state(&self, key: &str) -> Option<(i64, bool)> {
        match &self.database_url {
            Some(url) => {
                let mut conn = sqlx::PgConnection::connect(url).await.expect("connect");
                sqlx::query_as(
                    "SELECT state::int8, response IS NOT NULL FROM idempotency_records WHERE key = $1",
                )
                .bind(key)
                .fetch_optional(&mut conn)
                .await
                .expect("row")
            }
            None => {
                let url = format!(
                    "sqlite://{}",
                    self.data_dir.join("idempotency.db").display()
                );
                let mut conn = sqlx::SqliteConnection::connect(&url).await.expect("open");
                sqlx::query_as(
                    "SELECT state, response IS NOT NULL FROM idempotency_records WHERE key = ?1",
                )
                .bind(key)
                .fetch_optional(&mut conn)
                .await
                .expect("row")
            }
        }
    }

    /// The URL the next server of this store is given: `database_url`, or
    /// with TEST_CITUS_SPREAD=1 the next node of `spread`.
    pub fn next_database_url(&self) -> Option<String> {
        if self.spread.is_empty() {
            return self.database_url.clone();
        }
        let next = self
            .next_node
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Some(self.spread[next % self.spread.len()].clone())
    }

    /// A configuration pointing at this store, on an ephemeral loopback port.
    pub fn config(&self) -> Config {
        let mut config = Config::defaults();
        config.database_url = self.next_database_url();
        config.data_dir = self.data_dir.clone();
        config.listen_addr = "127.0.0.1:0".parse().unwrap();
        config.health_check_interval = Duration::from_millis(200);
        config.db_timeout = Duration::from_secs(5);
        config.db_pool_size = 8;
        config.metrics_addr = String::new();
        config.coalesce = self.backend != Backend::PostgresUncoalesced;
        config.citus_statements = self.backend == Backend::PostgresCitusSql;
        config
    }
}

/// With TEST_CITUS_SPREAD=1 and a Citus cluster behind `url` (its
/// coordinator), the URL of each node the servers take turns on: a worker
/// first, then the coordinator, then the other workers, so that a test's
/// single server is on a worker and two servers are on two kinds of node.
async fn citus_spread(url: &str) -> Vec<String> {
    if std::env::var("TEST_CITUS_SPREAD").map_or(true, |v| v.is_empty() || v == "0") {
        return Vec::new();
    }
    let mut conn = sqlx::PgConnection::connect(url).await.expect("connect");
    let nodes: Vec<(String, i32, i32)> = sqlx::query_as(
        "SELECT nodename, nodeport, groupid FROM pg_dist_node
         WHERE isactive AND noderole = 'primary' ORDER BY groupid",
    )
    .fetch_all(&mut conn)
    .await
    .expect("TEST_CITUS_SPREAD=1 needs a Citus coordinator, registered in pg_dist_node");
    let mut urls: Vec<String> = nodes
        .iter()
        .map(|(host, port, _)| replace_host(url, host, *port))
        .collect();
    assert!(
        nodes.first().is_some_and(|(_, _, group)| *group == 0) && urls.len() >= 2,
        "TEST_CITUS_SPREAD=1: pg_dist_node must hold the coordinator (citus_set_coordinator_host) and a worker"
    );
    urls.swap(0, 1);
    urls
}

/// The same URL at another host and port.
fn replace_host(url: &str, host: &str, port: i32) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let (authority, tail) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let user = authority.rsplit_once('@').map(|(user, _)| user);
    match user {
        Some(user) => format!("{scheme}://{user}@{host}:{port}{tail}"),
        None => format!("{scheme}://{host}:{port}{tail}"),
    }
}

/// A schema of its own in the shared test database, so tests run in parallel.
async fn fresh_postgres_schema() -> String {
    let admin = postgres_admin_url();
    let mut conn = sqlx::PgConnection::connect(&admin)
        .await
        .expect("PostgreSQL must run on 127.0.0.1:5432 (see README)");
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(TEST_DATABASE)
            .fetch_one(&mut conn)
            .await
            .unwrap();
    if !exists {
        // Several test processes may race to create it: losing is fine.
        let _ = sqlx::query(&format!("CREATE DATABASE {TEST_DATABASE}"))
            .execute(&mut conn)
            .await;
    }
    let base = replace_database(&admin, TEST_DATABASE);
    let schema = format!("t_{:016x}", rand_u64());
    let mut conn = sqlx::PgConnection::connect(&base)
        .await
        .expect("connect test db");
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(&mut conn)
        .await
        .unwrap();
    let separator = if base.contains('?') { '&' } else { '?' };
    format!("{base}{separator}options=-c%20search_path%3D{schema}")
}

/// The same server URL with another database name.
pub fn replace_database(url: &str, database: &str) -> String {
    let (head, query) = url
        .split_once('?')
        .map_or((url, None), |(h, q)| (h, Some(q)));
    let cut = head.rfind('/').expect("URL with a database");
    let mut out = format!("{}/{database}", &head[..cut]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

pub fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(SystemTime::now())
}

/// A server running in this process, with clients connected to it.
pub struct TestServer {
    pub addr: SocketAddr,
    pub client: Client,
    pub health: HealthClient<Channel>,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<anyhow::Result<()>>>,
}

impl TestServer {
    /// Starts a server on `config` and waits (with a deadline) until it
    /// reports SERVING.
    pub async fn start(config: Config) -> Self {
        Self::start_with_channel(config, |addr| {
            Channel::from_shared(format!("http://{addr}"))
                .unwrap()
                .connect_lazy()
        })
        .await
    }

    /// The same, with the clients' channel made by `channel` (TLS, say).
    pub async fn start_with_channel(
        config: Config,
        channel: impl FnOnce(SocketAddr) -> Channel,
    ) -> Self {
        let listener = tokio::net::TcpListener::bind(config.listen_addr)
            .await
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(idempotency_service::server::run(config, listener, async {
            let _ = rx.await;
        }));
        let channel = channel(addr);
        let server = Self {
            addr,
            client: IdempotencyServiceClient::new(channel.clone())
                .max_decoding_message_size(64 * 1024 * 1024)
                .max_encoding_message_size(64 * 1024 * 1024),
            health: HealthClient::new(channel),
            shutdown: Some(tx),
            task: Some(task),
        };
        server
            .wait_for_health("", ServingStatus::Serving, Duration::from_secs(20))
            .await;
        server
    }

    /// Starts a server on a fresh store of `backend`, returning both.
    pub async fn fresh(backend: Backend) -> (StoreFixture, Self) {
        Self::fresh_with(backend, |_| {}).await
    }

    pub async fn fresh_with(
        backend: Backend,
        tweak: impl FnOnce(&mut Config),
    ) -> (StoreFixture, Self) {
        let store = StoreFixture::new(backend).await;
        let mut config = store.config();
        tweak(&mut config);
        let server = Self::start(config).await;
        (store, server)
    }

    pub async fn health_status(&self, service: &str) -> Option<ServingStatus> {
        let mut health = self.health.clone();
        health
            .check(HealthCheckRequest {
                service: service.to_owned(),
            })
            .await
            .ok()
            .and_then(|r| ServingStatus::try_from(r.into_inner().status).ok())
    }

    pub async fn wait_for_health(&self, service: &str, status: ServingStatus, within: Duration) {
        let found = eventually(within, || async {
            (self.health_status(service).await == Some(status)).then_some(())
        })
        .await;
        assert!(
            found.is_some(),
            "health of {service:?} never became {status:?}"
        );
    }

    /// Triggers a graceful shutdown and waits for the server to return.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.task.take().unwrap().await.unwrap()
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// Polls `probe` every 50 ms until it yields a value or `within` has passed.
pub async fn eventually<T, F, Fut>(within: Duration, mut probe: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(value) = probe().await {
            return Some(value);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub fn secs(n: i64) -> Option<prost_types::Duration> {
    Some(prost_types::Duration {
        seconds: n,
        nanos: 0,
    })
}

/// The service's typed client, as `TestServer` and `ServerProcess` hand it out.
pub type Client = IdempotencyServiceClient<Channel>;

pub fn claim_request(namespace: &str, key: &str) -> ClaimRequest {
    ClaimRequest {
        namespace: namespace.to_owned(),
        key: key.to_owned(),
        ..Default::default()
    }
}

pub fn complete_request(
    namespace: &str,
    key: &str,
    lease_token: &str,
    response: &[u8],
) -> CompleteRequest {
    CompleteRequest {
        namespace: namespace.to_owned(),
        key: key.to_owned(),
        lease_token: lease_token.to_owned(),
        response: response.to_vec(),
        retention: None,
    }
}

pub fn release_request(namespace: &str, key: &str, lease_token: &str) -> ReleaseRequest {
    ReleaseRequest {
        namespace: namespace.to_owned(),
        key: key.to_owned(),
        lease_token: lease_token.to_owned(),
        ..Default::default()
    }
}

pub fn extend_request(
    namespace: &str,
    key: &str,
    lease_token: &str,
    lease_ttl: Option<prost_types::Duration>,
) -> ExtendLeaseRequest {
    ExtendLeaseRequest {
        namespace: namespace.to_owned(),
        key: key.to_owned(),
        lease_token: lease_token.to_owned(),
        lease_ttl,
        ..Default::default()
    }
}

pub fn get_request(namespace: &str, key: &str) -> GetRequest {
    GetRequest {
        namespace: namespace.to_owned(),
        key: key.to_owned(),
    }
}

/// Claims `key` with the server's defaults; the call must succeed.
pub async fn claim(client: &mut Client, namespace: &str, key: &str) -> proto::ClaimResponse {
    client
        .claim(claim_request(namespace, key))
        .await
        .unwrap()
        .into_inner()
}

/// Completes `key` under `lease_token`; the call must succeed.
pub async fn complete(
    client: &mut Client,
    namespace: &str,
    key: &str,
    lease_token: &str,
    response: &[u8],
) -> proto::CompleteResponse {
    client
        .complete(complete_request(namespace, key, lease_token, response))
        .await
        .unwrap()
        .into_inner()
}

/// Gets `key`'s record; the call must succeed.
pub async fn get(client: &mut Client, namespace: &str, key: &str) -> proto::GetResponse {
    client
        .get(get_request(namespace, key))
        .await
        .unwrap()
        .into_inner()
}

/// The call failed with `code`; returns its status for the message.
pub fn assert_code<T: std::fmt::Debug>(
    result: Result<T, tonic::Status>,
    code: tonic::Code,
) -> tonic::Status {
    let status = result.expect_err("expected an error status");
    assert_eq!(status.code(), code, "unexpected status: {status:?}");
    status
}

pub fn outcome(response: &proto::ClaimResponse) -> Outcome {
    Outcome::try_from(response.outcome).expect("a known outcome")
}

pub fn state(response: &proto::GetResponse) -> State {
    State::try_from(response.state).expect("a known state")
}

/// A timestamp as a SystemTime.
pub fn at(t: &Option<prost_types::Timestamp>) -> SystemTime {
    SystemTime::try_from(t.expect("timestamp set")).expect("valid timestamp")
}

/// The difference between two wire timestamps.
pub fn between(
    from: &Option<prost_types::Timestamp>,
    to: &Option<prost_types::Timestamp>,
) -> Duration {
    at(to).duration_since(at(from)).expect("to is after from")
}
