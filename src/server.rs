//! Wiring: opens the store the configuration names, builds the gRPC server
//! (the service, health, reflection), starts the health watch and the reaper,
//! and runs until the shutdown future resolves; then drains.
//!
//! The shutdown signal is a parameter, so tests drive it without signals.

use std::future::Future;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;

use crate::config::Config;
use crate::grpc::proto::idempotency_service_server::IdempotencyServiceServer;
use crate::grpc::{IdempotencyApi, proto};
use crate::health;
use crate::lifecycle::Lifecycle;
use crate::metrics::{self, NamespaceLabels};
use crate::reaper;
use crate::store::coalesce::Coalesced;
use crate::store::{AnyStore, Store};

/// Room above the largest response for the rest of a Complete request, so that
/// an oversized response reaches validation and gets INVALID_ARGUMENT naming
/// the field instead of a transport error.
const REQUEST_OVERHEAD_BYTES: usize = 64 * 1024;

/// The largest request any call may send, unless a single response may be
/// larger: room for a CompleteBatch of many small responses, while a request
/// is still refused before it is decoded when it is larger than any valid one.
const BATCH_REQUEST_BYTES: usize = 16 * 1024 * 1024;

/// Opens the configured store (migrating it unless told not to) and serves on
/// `listener` until `shutdown` resolves.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    config.validate()?;
    match AnyStore::open(&config.store_options(), config.run_migrations).await? {
        AnyStore::Postgres(store) if config.coalesce => {
            tracing::info!(
                store = "postgres",
                coalesce = true,
                "using the PostgreSQL store"
            );
            let store = Coalesced::new(store, config.coalesce_options());
            serve(store, &config, listener, shutdown).await
        }
        AnyStore::Postgres(store) => {
            tracing::info!(
                store = "postgres",
                coalesce = false,
                "using the PostgreSQL store"
            );
            serve(store, &config, listener, shutdown).await
        }
        AnyStore::Sqlite(store) => {
            tracing::info!(
                store = "sqlite",
                file = %store.path().display(),
                "using the embedded SQLite store: single instance only; use PostgreSQL (DATABASE_URL=postgres://…) to run several replicas"
            );
            serve(store, &config, listener, shutdown).await
        }
    }
}

/// Serves one store. Health starts NOT_SERVING and turns SERVING once the
/// store answers a ping.
pub async fn serve<S: Store>(
    store: S,
    config: &Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
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
    let api = IdempotencyServiceServer::new(IdempotencyApi::new(
        Lifecycle::new(store.clone(), config.limits()),
        NamespaceLabels::new(&config.metrics_namespaces),
        config.max_batch_items,
    ))
    .max_decoding_message_size(
        (config.max_response_bytes + REQUEST_OVERHEAD_BYTES).max(BATCH_REQUEST_BYTES),
    );

    let addr = listener.local_addr()?;
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let drain = CancellationToken::new();
    let server = tonic::transport::Server::builder()
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
    let _ = reaper_task.await;
    let _ = metrics_task.await;
    store.close().await;
    tracing::info!("stopped");
    result
}
