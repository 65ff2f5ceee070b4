//! What the server offers beside the contract: reflection for gRPC tools,
//! health names for probes, and health following the embedded store's file.

mod common;

use std::time::Duration;

use common::{Backend, TestServer};
use tokio_stream::StreamExt;
use tonic_health::pb::health_check_response::ServingStatus;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_lists_the_service_over_v1_and_v1alpha() {
    use tonic_reflection::pb::{v1, v1alpha};
    let (_store, server) = TestServer::fresh(Backend::Sqlite).await;
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();

    let request = v1alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            v1alpha::server_reflection_request::MessageRequest::ListServices(String::new()),
        ),
    };
    let mut client =
        v1alpha::server_reflection_client::ServerReflectionClient::new(channel.clone());
    let mut responses = client
        .server_reflection_info(tokio_stream::once(request))
        .await
        .unwrap()
        .into_inner();
    let response = responses.next().await.unwrap().unwrap();
    let Some(v1alpha::server_reflection_response::MessageResponse::ListServicesResponse(list)) =
        response.message_response
    else {
        panic!("expected a service list");
    };
    let names: Vec<_> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.contains(&"idempotency.v1.IdempotencyService".to_owned()),
        "{names:?}"
    );
    assert!(
        names.contains(&"grpc.health.v1.Health".to_owned()),
        "{names:?}"
    );

    let request = v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            v1::server_reflection_request::MessageRequest::FileContainingSymbol(
                "idempotency.v1.IdempotencyService".into(),
            ),
        ),
    };
    let mut client = v1::server_reflection_client::ServerReflectionClient::new(channel);
    let mut responses = client
        .server_reflection_info(tokio_stream::once(request))
        .await
        .unwrap()
        .into_inner();
    let response = responses.next().await.unwrap().unwrap();
    let Some(v1::server_reflection_response::MessageResponse::FileDescriptorResponse(files)) =
        response.message_response
    else {
        panic!("expected file descriptors");
    };
    assert!(!files.file_descriptor_proto.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_follows_the_embedded_file_while_liveness_follows_the_process() {
    let (store, server) = TestServer::fresh(Backend::Sqlite).await;
    assert_eq!(
        server.health_status("liveness").await,
        Some(ServingStatus::Serving)
    );
    // The data directory disappears under the running server.
    std::fs::remove_dir_all(&store.data_dir).unwrap();
    server
        .wait_for_health(
            "idempotency.v1.IdempotencyService",
            ServingStatus::NotServing,
            Duration::from_secs(10),
        )
        .await;
    assert_eq!(
        server.health_status("").await,
        Some(ServingStatus::NotServing)
    );
    assert_eq!(
        server.health_status("liveness").await,
        Some(ServingStatus::Serving)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_returns_ok() {
    let (_store, server) = TestServer::fresh(Backend::Postgres).await;
    server.stop().await.unwrap();
}
