//! The database goes away while the server runs: calls fail fast with
//! UNAVAILABLE (no SQL text), health turns NOT_SERVING, and when the database
//! returns the server recovers by itself, having lost nothing it acknowledged.
//! Runs on a PostgreSQL cluster of its own, which it crashes and restarts.

mod common;

use std::time::Duration;

use common::cluster::Cluster;
use common::{TestServer, claim_request, eventually, outcome};
use idempotency_service::grpc::proto::{CompleteRequest, Outcome};
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restart_gives_unavailable_then_recovers_without_losing_a_completed_record() {
    let cluster = Cluster::start();
    let mut config = idempotency_service::config::Config::defaults();
    config.database_url = Some(cluster.url());
    config.listen_addr = "127.0.0.1:0".parse().unwrap();
    config.health_check_interval = Duration::from_millis(200);
    config.db_timeout = Duration::from_secs(2);
    let server = TestServer::start(config).await;
    let mut client = server.client.clone();

    let claimed = client
        .claim(claim_request("ns", "before"))
        .await
        .unwrap()
        .into_inner();
    client
        .complete(CompleteRequest {
            namespace: "ns".into(),
            key: "before".into(),
            lease_token: claimed.lease_token,
            response: b"kept".to_vec(),
            retention: None,
        })
        .await
        .unwrap();

    // A crash of the database: no checkpoint, recovery from the WAL later.
    cluster.stop(true);
    server
        .wait_for_health(
            "idempotency.v1.IdempotencyService",
            ServingStatus::NotServing,
            Duration::from_secs(15),
        )
        .await;
    server
        .wait_for_health("", ServingStatus::NotServing, Duration::from_secs(5))
        .await;

    // A call fails with UNAVAILABLE well before the caller's own deadline, and
    // says nothing about SQL or connections.
    let mut request = tonic::Request::new(claim_request("ns", "during"));
    request.set_timeout(Duration::from_secs(20));
    let status = client
        .claim(request)
        .await
        .expect_err("the database is down");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    let message = status.message().to_lowercase();
    for leak in [
        "select",
        "insert",
        "idempotency_records",
        "127.0.0.1",
        "connection refused",
        "postgres",
    ] {
        assert!(!message.contains(leak), "status leaks {leak:?}: {message}");
    }

    cluster.restart();
    server
        .wait_for_health(
            "idempotency.v1.IdempotencyService",
            ServingStatus::Serving,
            Duration::from_secs(30),
        )
        .await;
    // Connections opened before the crash are dropped as they fail; within
    // seconds every call succeeds again.
    let replay = eventually(Duration::from_secs(20), || {
        let mut client = client.clone();
        async move { client.claim(claim_request("ns", "before")).await.ok() }
    })
    .await
    .expect("calls succeed again after the database returned")
    .into_inner();
    assert_eq!(outcome(&replay), Outcome::Completed);
    assert_eq!(replay.response, b"kept");
    let fresh = eventually(Duration::from_secs(20), || {
        let mut client = client.clone();
        async move { client.claim(claim_request("ns", "after")).await.ok() }
    })
    .await
    .unwrap()
    .into_inner();
    assert_eq!(outcome(&fresh), Outcome::Claimed);
    server.stop().await.unwrap();
}
