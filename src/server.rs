//! Wiring: binds the health-only port (before anything slow, so that a port
//! in use stops the start at once), opens the store the configuration names
//! (connecting and migrating first unless migrations are off), builds the
//! gRPC server (the service behind its guard, health, reflection; TLS when
//! configured), starts the health watch, the reaper and the file reloaders,
//! and runs until the shutdown future resolves; then drains.
//!
//! The shutdown signal is a parameter, so tests drive it without signals.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;

use crate::access::Policy;
use crate::config::Config;
use crate::grpc::guard::{Access, GuardLayer};
use crate::grpc::proto::idempotency_service_server::IdempotencyServiceServer;
use crate::grpc::{IdempotencyApi, proto};
use crate::health;
use crate::lifecycle::Lifecycle;
use crate::listen;
use crate::metrics::{self, NamespaceLabels};
use crate::reaper;
use crate::reload::Reloading;
use crate::store::cache::Cached;
use crate::store::coalesce::{CoalesceOptions, Coalesced};
use crate::store::postgres::Engine;
use crate::store::{AnyStore, Open, Operations, Store};
use crate::tls::{self, TlsConfig};

/// Room above the largest response for the rest of a Complete request, so that
/// an oversized response reaches validation and gets INVALID_ARGUMENT naming
/// the field instead of a transport error.
const REQUEST_OVERHEAD_BYTES: usize = 64 * 1024;

/// The largest request any call may send, unless a single response may be
/// larger: room for a CompleteBatch of many small responses, while a request
/// is still refused before it is decoded when it is larger than any valid one.
const BATCH_REQUEST_BYTES: usize = 16 * 1024 * 1024;

/// The most header bytes (metadata) one call may send.
const MAX_HEADER_LIST_BYTES: u32 = 16 * 1024;

/// HTTP/2 pings find connections whose peer vanished.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(60);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// The setting that names the access policy file, for its errors.
const POLICY_FILE: &str = "IDEMPOTENCY_POLICY_FILE";

/// The policy and TLS files, loaded; checked before the store opens so that a
/// bad file stops the start at once.
struct Security {
    access: Access,
    tls: Option<Arc<TlsConfig>>,
}

impl Security {
    fn open(config: &Config) -> anyhow::Result<Self> {
        let access = match &config.policy_file {
            None => {
                tracing::warn!(
                    "NO ACCESS POLICY: every caller may use every namespace and every RPC, Purge included; set IDEMPOTENCY_POLICY_FILE to confine callers"
                );
                Access::Open
            }
            Some(path) => {
                let named = format!("{POLICY_FILE}={}", path.display());
                let files = vec![(POLICY_FILE, path.clone())];
                let policy = Reloading::open("access policy", files, move |contents| {
                    std::str::from_utf8(&contents[0])
                        .map_err(anyhow::Error::from)
                        .and_then(Policy::parse)
                        .with_context(|| named.clone())
                })?;
                tracing::info!(
                    file = %path.display(),
                    identities = policy.current().identities(),
                    "access policy loaded"
                );
                Access::Policy(policy)
            }
        };
        let tls = match config.tls_files()? {
            Some(files) => {
                let tls = files.open()?;
                tracing::info!(
                    mutual = files.client_ca.is_some(),
                    client_auth = ?files.client_auth,
                    "TLS on: the gRPC port refuses plaintext"
                );
                Some(tls)
            }
            None => {
                tracing::info!("TLS off: the gRPC port speaks plaintext");
                None
            }
        };
        Ok(Self { access, tls })
    }

    /// Re-reads the files every interval until cancelled.
    fn watch(&self, interval: Duration, cancel: &CancellationToken) {
        if let Access::Policy(policy) = &self.access {
            tokio::spawn(policy.clone().watch(interval, cancel.clone()));
        }
        if let Some(tls) = &self.tls {
            tokio::spawn(tls.clone().watch(interval, cancel.clone()));
        }
    }
}

/// The ports a server answers on, bound before the store opens so that a
/// port in use stops the start at once.
struct Listeners {
    grpc: TcpListener,
    /// The plaintext health-only port, when configured.
    health: Option<TcpListener>,
}

/// Opens the configured store (migrating it unless told not to) and serves on
/// `listener` until `shutdown` resolves.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    config.validate()?;
    let listeners = Listeners {
        grpc: listener,
        health: match config.health_listen_addr()? {
            Some(addr) => Some(listen::HEALTH.bind(addr)?),
            None => None,
        },
    };
    let security = Security::open(&config)?;
    let open = if config.run_migrations {
        Open::Migrate
    } else {
        Open::Lazy
    };
    match AnyStore::open(&config.store_options()?, open).await? {
        AnyStore::Postgres(store) => {
            tracing::info!(
                store = "postgres",
                coalesce = config.coalesce,
                replay_cache_bytes = config.replay_cache_bytes,
                "using the PostgreSQL store"
            );
            // On Citus too: a coalesced batch goes as one delegated call per
            // worker (store/postgres/shards.rs).
            if config.coalesce {
                // A batch that failed on Citus is sent again call by call,
                // so that a worker that is down fails only its own keys. The
                // engine is asked now (a database still down at start, with
                // migrations off, is taken as plain PostgreSQL).
                let citus = matches!(
                    tokio::time::timeout(config.db_timeout, store.engine()).await,
                    Ok(Ok(Engine::Citus))
                );
                let options = CoalesceOptions {
                    split_failed: citus,
                    ..config.coalesce_options()
                };
                let store = Coalesced::new(store, options);
                serve_cached(store, &config, security, listeners, shutdown).await
            } else {
                serve_cached(store, &config, security, listeners, shutdown).await
            }
        }
        AnyStore::Sqlite(store) => {
            tracing::info!(
                store = "sqlite",
                file = %store.path().display(),
                "using the embedded SQLite store: single instance only; use PostgreSQL (DATABASE_URL=postgres://…) to run several replicas"
            );
            serve(store, &config, security, listeners, shutdown).await
        }
    }
}

/// Serves a store behind the replay cache, unless its budget is zero.
async fn serve_cached<S: Store + Operations>(
    store: S,
    config: &Config,
    security: Security,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    if config.replay_cache_bytes > 0
        && let Some(cached) = Cached::new(store.clone(), config.replay_cache_bytes)
    {
        return serve(cached, config, security, listeners, shutdown).await;
    }
    serve(store, config, security, listeners, shutdown).await
}

/// Serves one store. Health starts NOT_SERVING and turns SERVING once the
/// store answers a ping.
async fn serve<S: Store + Operations>(
    store: S,
    config: &Config,
    security: Security,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let Listeners {
        grpc: listener,
        health: health_listener,
    } = listeners;
    let (reporter, health_service) = tonic_health::server::health_reporter();
    health::set(&reporter, ServingStatus::NotServing).await;
    reporter
        .set_service_status(health::LIVENESS, ServingStatus::Serving)
        .await;
    let background = CancellationToken::new();
    let health_task = tokio::spawn(health::watch_store(
        store.clone(),
        reporter.clone(),
        config.health_check_interval,
        background.clone(),
    ));
    let metrics_task = tokio::spawn(metrics::watch_store(
        store.clone(),
        (!config.records_gauge_interval.is_zero()).then_some(config.records_gauge_interval),
        background.clone(),
    ));
    let reaper_task = tokio::spawn(reaper::run(
        store.clone(),
        config.reaper_interval,
        config.reaper_batch_size,
        background.clone(),
    ));

    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    security.watch(config.reload_interval, &background);
    let labels = NamespaceLabels::new(&config.metrics_namespaces);
    let mut lifecycle = Lifecycle::new(store.clone(), config.limits());
    if let Access::Policy(policy) = &security.access {
        lifecycle = lifecycle.with_namespaces(policy.clone());
    }
    let guard = GuardLayer::new(
        security.access,
        config.max_concurrent_calls,
        config.call_timeout,
        labels.clone(),
    );
    let waiters = lifecycle.waiters().clone();
    // Waiting Claims hear other replicas' Completes, Releases and Purges on
    // the store's feed (PostgreSQL); a store without one announces only what
    // this process does, which the lifecycle tells its waiters itself.
    let waiters_task = store
        .purge_feed()
        .map(|feed| tokio::spawn(waiters.clone().follow(feed)));
    let api = IdempotencyServiceServer::new(IdempotencyApi::new(
        lifecycle,
        labels,
        config.max_batch_items,
    ))
    .max_decoding_message_size(
        (config.max_response_bytes.max(config.max_checkpoint_bytes) + REQUEST_OVERHEAD_BYTES)
            .max(BATCH_REQUEST_BYTES),
    );

    let addr = listener.local_addr()?;
    let drain = CancellationToken::new();
    let health_only = match health_listener {
        None => None,
        Some(listener) => {
            let addr = listener.local_addr()?;
            tracing::info!(%addr, "serving plaintext grpc.health.v1 for probes");
            let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
            Some(tokio::spawn(
                tonic::transport::Server::builder()
                    .max_concurrent_streams(config.max_streams_per_connection)
                    .http2_max_header_list_size(MAX_HEADER_LIST_BYTES)
                    .timeout(config.call_timeout)
                    .add_service(health_service.clone())
                    .serve_with_incoming_shutdown(incoming, drain.clone().cancelled_owned()),
            ))
        }
    };
    let incoming = tls::incoming(listener, security.tls, drain.clone());
    let server = tonic::transport::Server::builder()
        .max_concurrent_streams(config.max_streams_per_connection)
        .http2_max_header_list_size(MAX_HEADER_LIST_BYTES)
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .layer(guard)
        .add_service(health_service)
        // grpcurl 1.8 and Python's reflection client speak only v1alpha.
        .add_service(reflection().build_v1()?)
        .add_service(reflection().build_v1alpha()?)
        .add_service(api)
        .serve_with_incoming_shutdown(incoming, drain.clone().cancelled_owned());
    tracing::info!(%addr, "listening");
    tokio::pin!(server);

    let result = tokio::select! {
        result = &mut server => result.map_err(anyhow::Error::from),
        () = shutdown => {
            tracing::info!("shutting down: health NOT_SERVING, draining calls in flight");
            background.cancel();
            let _ = health_task.await;
            health::set(&reporter, ServingStatus::NotServing).await;
            reporter
                .set_service_status(health::LIVENESS, ServingStatus::NotServing)
                .await;
            // Waiting Claims answer OUTCOME_IN_PROGRESS now, so the drain
            // does not wait for their waits to run out.
            waiters.shut_down();
            drain.cancel();
            match tokio::time::timeout(config.shutdown_timeout, &mut server).await {
                Ok(result) => result.map_err(anyhow::Error::from),
                Err(_) => {
                    tracing::warn!(timeout = ?config.shutdown_timeout, "calls still in flight after the shutdown timeout; stopping anyway");
                    Ok(())
                }
            }
        }
    };
    background.cancel();
    waiters.shut_down();
    drain.cancel();
    if let Some(task) = waiters_task {
        task.abort();
    }
    if let Some(task) = health_only {
        let _ = task.await;
    }
    let _ = reaper_task.await;
    let _ = metrics_task.await;
    store.close().await;
    tracing::info!("stopped");
    result
}
