//! The database goes away while the server runs: calls fail fast with
//! UNAVAILABLE (no SQL text), health turns NOT_SERVING, and when the database
//! returns the server recovers by itself, having lost nothing it acknowledged.
//! Runs on a PostgreSQL cluster of its own, which it crashes and restarts.

mod common;

use std::time::Duration;

use common::cluster::Cluster;
use common::{TestServer, claim, claim_request, complete, complete_request, eventually, outcome};
use idempotency_service::grpc::proto::Outcome;
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

    let claimed = claim(&mut client, "ns", "before").await;
    complete(&mut client, "ns", "before", &claimed.lease_token, b"kept").await;

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

/// A server on its own cluster with `pool_size` connections, health checked
/// every `health_every`.
async fn server_on(cluster: &Cluster, health_every: Duration) -> TestServer {
    let mut config = idempotency_service::config::Config::defaults();
    config.database_url = Some(cluster.url());
    config.listen_addr = "127.0.0.1:0".parse().unwrap();
    config.health_check_interval = health_every;
    config.db_timeout = Duration::from_secs(2);
    config.db_pool_size = 8;
    TestServer::start(config).await
}

/// `n` Claims of distinct keys at once, then their Completes at once: every
/// one must succeed (no retry here: a failed call fails the test).
async fn every_call_succeeds(server: &TestServer, prefix: &str, n: usize) {
    let claims: Vec<_> = (0..n)
        .map(|i| {
            let mut client = server.client.clone();
            let key = format!("{prefix}-{i}");
            tokio::spawn(async move {
                let claimed = client
                    .claim(claim_request("ns", &key))
                    .await
                    .unwrap_or_else(|s| panic!("Claim {key}: {s:?}"))
                    .into_inner();
                assert_eq!(outcome(&claimed), Outcome::Claimed, "{key}");
                client
                    .complete(complete_request(
                        "ns",
                        &key,
                        &claimed.lease_token,
                        key.as_bytes(),
                    ))
                    .await
                    .unwrap_or_else(|s| panic!("Complete {key}: {s:?}"));
            })
        })
        .collect();
    for claim in claims {
        claim.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_health_is_serving_again_after_a_database_crash_no_call_fails() {
    let cluster = Cluster::start();
    let server = server_on(&cluster, Duration::from_millis(200)).await;
    // Every connection of the pool opened and kept.
    every_call_succeeds(&server, "warm", 32).await;

    cluster.stop(true);
    server
        .wait_for_health("", ServingStatus::NotServing, Duration::from_secs(15))
        .await;
    cluster.restart();
    server
        .wait_for_health("", ServingStatus::Serving, Duration::from_secs(30))
        .await;
    // The connections kept from before the crash are dead: none may cost a
    // call its answer.
    every_call_succeeds(&server, "after", 64).await;
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restart_that_health_never_saw_costs_no_call() {
    let cluster = Cluster::start();
    // Health checks once, at the start: the restart below goes unseen.
    let server = server_on(&cluster, Duration::from_secs(3600)).await;
    every_call_succeeds(&server, "warm", 32).await;

    cluster.stop(false);
    cluster.restart();
    // The first statement on a dead connection is sent again on a live one;
    // the others' connections are checked before use.
    every_call_succeeds(&server, "after", 64).await;
    server.stop().await.unwrap();
}
