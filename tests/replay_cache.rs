//! The replay cache across replicas: two servers on one PostgreSQL table,
//! each with its own cache of completed records. What one replica purges,
//! or what changes while a replica cannot hear of purges, must not be
//! replayed from the other's memory beyond the documented bound (README:
//! the replay cache). The rules of a single server, cache on, are the
//! conformance suite's (PostgreSQL runs it with the cache at its default).

mod common;

use std::time::Duration;

use common::*;
use idempotency_service::grpc::proto::{ClaimResponse, Outcome, PurgeRequest};
use idempotency_service::store::cache::FRESHNESS;
use sqlx::Connection;

const NS: &str = "webhooks";

/// Two replicas on one fresh table, both with the replay cache, and a key
/// completed through the first and replayed by the second.
async fn two_replicas_with_a_replayed_key(key: &str) -> (StoreFixture, TestServer, TestServer) {
    let store = StoreFixture::new(Backend::Postgres).await;
    let a = TestServer::start(store.config()).await;
    let b = TestServer::start(store.config()).await;
    let (mut ca, mut cb) = (a.client.clone(), b.client.clone());
    let claimed = claim(&mut ca, NS, key).await;
    complete(&mut ca, NS, key, &claimed.lease_token, b"first").await;
    let replay = claim(&mut cb, NS, key).await;
    assert_eq!(outcome(&replay), Outcome::Completed);
    assert_eq!(replay.response, b"first");
    (store, a, b)
}

/// Waits until `client`'s server answers `key` from memory, which shows
/// when the stored result is rewritten behind the service's back (no
/// notification) and the replay still carries the old one. Returns the SQL
/// connection it rewrote the result with; the stored result is then not
/// what the cache holds.
async fn until_replayed_from_memory(
    store: &StoreFixture,
    client: &Client,
    key: &str,
) -> sqlx::PgConnection {
    let url = store.database_url.clone().expect("a PostgreSQL store");
    let mut sql = sqlx::PgConnection::connect(&url).await.unwrap();
    // Triggers off: they would announce the rewrite (the migrations'
    // change notifications).
    sqlx::query("SET session_replication_role = replica")
        .execute(&mut sql)
        .await
        .unwrap();
    for round in 0.. {
        assert!(round < 200, "the replica never answered from memory");
        let before = claim(&mut client.clone(), NS, key).await.response;
        let probe = format!("probe-{round}");
        sqlx::query(
            "UPDATE idempotency_records SET response = convert_to($1, 'UTF8') WHERE key = $2",
        )
        .bind(&probe)
        .bind(key)
        .execute(&mut sql)
        .await
        .unwrap();
        let after = claim(&mut client.clone(), NS, key).await.response;
        if after == before && after != probe.as_bytes() {
            return sql;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    unreachable!()
}

/// Claims `key` on `client` until it is no longer replayed, within `within`.
async fn first_claim_after_replays(
    client: &Client,
    key: &str,
    within: Duration,
) -> Option<ClaimResponse> {
    eventually(within, || {
        let mut client = client.clone();
        async move {
            let response = claim(&mut client, NS, key).await;
            (outcome(&response) != Outcome::Completed).then_some(response)
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_on_one_replica_reaches_the_replay_cache_of_the_other() {
    let (store, a, b) = two_replicas_with_a_replayed_key("evt_1").await;
    let _sql = until_replayed_from_memory(&store, &b.client, "evt_1").await;
    let purged = a
        .client
        .clone()
        .purge(PurgeRequest {
            namespace: NS.to_owned(),
            key: "evt_1".to_owned(),
            reason: "test".to_owned(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(purged.purged);
    let next = first_claim_after_replays(&b.client, "evt_1", FRESHNESS)
        .await
        .expect("b replayed a purged key for longer than the documented bound");
    assert_eq!(outcome(&next), Outcome::Claimed);
    assert_eq!(next.fencing_token, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_loses_its_purge_listener_forgets_what_it_held() {
    let (store, _a, b) = two_replicas_with_a_replayed_key("evt_2").await;
    // b now replays a result the table no longer holds, and nothing told it.
    let mut sql = until_replayed_from_memory(&store, &b.client, "evt_2").await;
    let stored: Vec<u8> =
        sqlx::query_scalar("SELECT response FROM idempotency_records WHERE key = 'evt_2'")
            .fetch_one(&mut sql)
            .await
            .unwrap();
    // Cut the connections that listen on this schema's channel (both
    // replicas'): whatever was purged meanwhile, b cannot know.
    let channel: String =
        sqlx::query_scalar("SELECT 'idempotency_purges_' || left(md5(current_schema()), 16)")
            .fetch_one(&mut sql)
            .await
            .unwrap();
    let cut: i64 = sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
         WHERE query = format('LISTEN \"%s\"', $1::text)",
    )
    .bind(&channel)
    .fetch_one(&mut sql)
    .await
    .unwrap();
    assert!(cut >= 1, "no connection listened on {channel}");
    let fresh = eventually(FRESHNESS, || {
        let mut client = b.client.clone();
        let stored = stored.clone();
        async move {
            let replay = claim(&mut client, NS, "evt_2").await;
            (replay.response == stored).then_some(replay)
        }
    })
    .await
    .expect("b kept replaying from memory after its purge listener was cut");
    assert_eq!(outcome(&fresh), Outcome::Completed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_duplicates_is_answered_item_by_item_from_the_cache_and_the_store() {
    use idempotency_service::grpc::proto::ClaimBatchRequest;
    let (_store, _a, b) = two_replicas_with_a_replayed_key("evt_3").await;
    let mut cb = b.client.clone();
    let items = ["evt_3", "fresh", "evt_3"]
        .iter()
        .map(|k| claim_request(NS, k))
        .collect();
    let answers = cb
        .claim_batch(ClaimBatchRequest {
            items,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .items;
    let outcomes: Vec<Outcome> = answers.iter().map(outcome).collect();
    assert_eq!(
        outcomes,
        [Outcome::Completed, Outcome::Claimed, Outcome::Completed]
    );
    assert_eq!(answers[0].response, b"first");
    assert_eq!(answers[2].response, b"first");
}
