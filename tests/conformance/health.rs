//! Health: SERVING under both names.

use crate::support::*;

pub async fn health_is_serving_for_both_names(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    use tonic_health::pb::health_check_response::ServingStatus;
    assert_eq!(server.health_status("").await, Some(ServingStatus::Serving));
    assert_eq!(
        server
            .health_status("idempotency.v1.IdempotencyService")
            .await,
        Some(ServingStatus::Serving)
    );
}
