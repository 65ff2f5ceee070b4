//! grpc.health.v1 for "" and the service's own name: SERVING only while the
//! store answers. A third name, `liveness`, is SERVING for as long as the
//! process serves at all: a liveness probe must not restart every replica
//! because the database is down (a restart would not bring it back). A background task pings the store on an interval; shutdown
//! turns both names NOT_SERVING before the server stops accepting, so load
//! balancers stop routing to a draining replica.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::grpc::SERVICE_NAME;
use crate::store::{Operations, Store};

/// The health name that follows the process, not the store.
pub const LIVENESS: &str = "liveness";

/// Sets both store-following health names at once.
pub async fn set(reporter: &HealthReporter, status: ServingStatus) {
    reporter.set_service_status("", status).await;
    reporter.set_service_status(SERVICE_NAME, status).await;
}

/// Pings the store every `interval` until `stop`, reporting each change of
/// state once in the log.
pub async fn watch_store<S: Store + Operations>(
    store: S,
    reporter: HealthReporter,
    interval: Duration,
    stop: CancellationToken,
) {
    let mut serving = None;
    loop {
        let now_serving = match store.ping().await {
            Ok(()) => true,
            Err(error) => {
                if serving != Some(false) {
                    tracing::warn!(store = store.kind(), %error, cause = ?std::error::Error::source(&error), "store unreachable; health is NOT_SERVING");
                }
                false
            }
        };
        crate::metrics::record_store_up(now_serving);
        if serving != Some(now_serving) {
            if now_serving && serving.is_some() {
                tracing::info!(
                    store = store.kind(),
                    "store reachable again; health is SERVING"
                );
            }
            let status = if now_serving {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            set(&reporter, status).await;
            serving = Some(now_serving);
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
    }
}
