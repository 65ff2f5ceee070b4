//! ClaimBatch and CompleteBatch: every item answered as its own call, an
//! invalid item refused by index, and one winner per key across batches.

use std::time::Duration;

use tonic::Code;

use crate::support::*;

fn batch_item(key: &str, fingerprint: &[u8]) -> ClaimRequest {
    ClaimRequest {
        fingerprint: fingerprint.to_vec(),
        ..claim_request(NS, key)
    }
}

pub async fn claim_batch_answers_every_item_as_its_own_claim_in_order(backend: Backend) {
    use idempotency_service::grpc::proto::ClaimBatchRequest;
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let done = claim(&mut client, "done").await;
    client
        .complete(complete_request("done", &done.lease_token, b"stored"))
        .await
        .unwrap();
    claim_with(&mut client, batch_item("held", b"A")).await;
    let items = vec![
        batch_item("new-1", b""),
        batch_item("done", b""),
        batch_item("held", b"B"),
        batch_item("held", b"A"),
        batch_item("twice", b""),
        batch_item("twice", b""),
        batch_item("new-2", b"F"),
    ];
    let answers = client
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
        [
            Outcome::Claimed,
            Outcome::Completed,
            Outcome::FingerprintMismatch,
            Outcome::InProgress,
            Outcome::Claimed,
            Outcome::InProgress,
            Outcome::Claimed,
        ]
    );
    assert_eq!(answers[1].response, b"stored");
    assert_eq!(answers[0].fencing_token, 1);
    assert_ne!(answers[0].lease_token, answers[6].lease_token);
    assert_eq!(answers[5].lease_expires_at, answers[4].lease_expires_at);
    // The leases are real: each completes with its own token.
    client
        .complete(complete_request("new-1", &answers[0].lease_token, b"1"))
        .await
        .unwrap();
    assert_eq!(get(&mut client, "new-2").await.fingerprint, b"F");
}

pub async fn claim_batch_refuses_an_invalid_item_by_index_and_changes_nothing(backend: Backend) {
    use idempotency_service::grpc::proto::ClaimBatchRequest;
    let (store, server) = TestServer::fresh_with(backend, |c| c.max_batch_items = 3).await;
    let mut client = server.client.clone();
    let status = assert_code(
        client
            .claim_batch(ClaimBatchRequest {
                items: vec![batch_item("a", b""), batch_item("", b"")],
                ..Default::default()
            })
            .await,
        Code::InvalidArgument,
    );
    assert!(status.message().starts_with("items[1].key:"), "{status:?}");
    let mut long_lease = batch_item("b", b"");
    long_lease.lease_ttl = secs(7200);
    let status = assert_code(
        client
            .claim_batch(ClaimBatchRequest {
                items: vec![batch_item("a", b""), long_lease],
                ..Default::default()
            })
            .await,
        Code::InvalidArgument,
    );
    assert!(
        status.message().starts_with("items[1].lease_ttl:"),
        "{status:?}"
    );
    let status = assert_code(
        client
            .claim_batch(ClaimBatchRequest {
                items: vec![],
                ..Default::default()
            })
            .await,
        Code::InvalidArgument,
    );
    assert!(status.message().starts_with("items:"), "{status:?}");
    let four = (0..4).map(|i| batch_item(&format!("k{i}"), b"")).collect();
    let status = assert_code(
        client
            .claim_batch(ClaimBatchRequest {
                items: four,
                ..Default::default()
            })
            .await,
        Code::InvalidArgument,
    );
    assert!(
        status.message().starts_with("items: must be at most 3"),
        "{status:?}"
    );
    assert_eq!(store.row_count().await, 0);
}

pub async fn complete_batch_answers_every_item_with_its_own_status(backend: Backend) {
    use idempotency_service::grpc::proto::{ClaimBatchRequest, CompleteBatchRequest};
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let leases = client
        .claim_batch(ClaimBatchRequest {
            items: vec![
                batch_item("a", b""),
                batch_item("b", b""),
                batch_item("c", b""),
            ],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .items;
    client
        .release(release_request("c", &leases[2].lease_token))
        .await
        .unwrap();
    let items = vec![
        complete_request("a", &leases[0].lease_token, b"ra"),
        complete_request("a", &leases[0].lease_token, b"again"),
        complete_request("b", &leases[0].lease_token, b"wrong token"),
        complete_request("c", &leases[2].lease_token, b"released"),
        complete_request("nobody", &leases[1].lease_token, b"x"),
        complete_request("b", &leases[1].lease_token, b"rb"),
    ];
    let results = client
        .complete_batch(CompleteBatchRequest {
            items,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .items;
    let codes: Vec<i32> = results.iter().map(|r| r.code).collect();
    assert_eq!(
        codes,
        [
            0,
            0,
            Code::FailedPrecondition as i32,
            Code::FailedPrecondition as i32,
            Code::NotFound as i32,
            0
        ]
    );
    assert_eq!(results[0].expires_at, results[1].expires_at);
    assert!(results[2].expires_at.is_none());
    assert!(!results[2].message.is_empty());
    assert_eq!(claim(&mut client, "a").await.response, b"ra");
    assert_eq!(claim(&mut client, "b").await.response, b"rb");
    let mut bad = complete_request("a", "not-a-token", b"");
    bad.retention = None;
    let status = assert_code(
        client
            .complete_batch(CompleteBatchRequest {
                items: vec![complete_request("a", &leases[0].lease_token, b""), bad],
                ..Default::default()
            })
            .await,
        Code::InvalidArgument,
    );
    assert!(
        status.message().starts_with("items[1].lease_token:"),
        "{status:?}"
    );
}

pub async fn concurrent_claim_batches_on_overlapping_keys_give_one_winner_per_key(
    backend: Backend,
) {
    use idempotency_service::grpc::proto::ClaimBatchRequest;
    let (_store, server) = TestServer::fresh(backend).await;
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(8));
    let tasks: Vec<_> = (0..8)
        .map(|t| {
            let mut client = server.client.clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                // Each batch names the 20 keys in its own order.
                let mut keys: Vec<usize> = (0..20).collect();
                keys.rotate_left((t * 3) % 20);
                if t % 2 == 1 {
                    keys.reverse();
                }
                let items = keys
                    .iter()
                    .map(|k| batch_item(&format!("k{k}"), b""))
                    .collect();
                barrier.wait().await;
                let answers = client
                    .claim_batch(ClaimBatchRequest {
                        items,
                        ..Default::default()
                    })
                    .await
                    .unwrap()
                    .into_inner()
                    .items;
                keys.into_iter()
                    .zip(answers.iter().map(outcome))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut winners = std::collections::HashMap::new();
    for task in tasks {
        for (key, outcome) in task.await.unwrap() {
            if outcome == Outcome::Claimed {
                *winners.entry(key).or_insert(0) += 1;
            } else {
                assert_eq!(outcome, Outcome::InProgress);
            }
        }
    }
    assert_eq!(winners.len(), 20);
    assert!(winners.values().all(|&n| n == 1), "{winners:?}");
}

/// With `item_errors`, a key the store cannot reach fails alone where a
/// batch's keys live on several nodes (Citus, and Citus's statements with
/// their two made-up workers), and the others are answered; where every key
/// is reached or none is (one PostgreSQL, SQLite) the field changes nothing
/// and such a failure is the whole call's, as before. Here the key that
/// cannot be reached is one whose row another session holds locked past the
/// store's statement budget.
pub async fn with_item_errors_a_key_that_cannot_be_reached_fails_alone(backend: Backend) {
    use idempotency_service::grpc::proto::{ClaimBatchRequest, CompleteBatchRequest};
    use sqlx::Connection;
    let store = StoreFixture::new(backend).await;
    let mut config = store.config();
    config.db_timeout = Duration::from_millis(1500);
    let server = TestServer::start(config).await;
    let mut client = server.client.clone();
    let claims = |keys: &[&str]| ClaimBatchRequest {
        items: keys.iter().map(|k| batch_item(k, b"")).collect(),
        item_errors: true,
    };

    // Every key reached: the same answers as without the field, no error.
    let answers = client
        .claim_batch(claims(&["ok-1", "ok-2"]))
        .await
        .unwrap()
        .into_inner()
        .items;
    assert_eq!(
        answers.iter().map(outcome).collect::<Vec<_>>(),
        [Outcome::Claimed; 2]
    );
    assert!(answers.iter().all(|a| a.error.is_none()), "{answers:?}");
    let completes = CompleteBatchRequest {
        items: vec![
            complete_request("ok-1", &answers[0].lease_token, b"1"),
            complete_request("ok-2", &answers[1].lease_token, b"2"),
            complete_request("ok-1", &own_token(), b"x"),
        ],
        item_errors: true,
    };
    let results = client
        .complete_batch(completes)
        .await
        .unwrap()
        .into_inner()
        .items;
    let codes: Vec<i32> = results.iter().map(|r| r.code).collect();
    assert_eq!(codes, [0, 0, Code::FailedPrecondition as i32]);
    assert!(
        results.iter().all(|r| r.retry_after.is_none()),
        "{results:?}"
    );

    let Some(url) = store.database_url.clone() else {
        return; // SQLite: one writer, every key reached or none.
    };
    // `stuck`, released, so that a Claim must write its row; `held`, whose
    // lease is live, so that its Complete must write its row.
    let stuck = claim(&mut client, "stuck").await;
    client
        .release(release_request("stuck", &stuck.lease_token))
        .await
        .unwrap();
    let held = claim(&mut client, "held").await;
    let mut locker = sqlx::PgConnection::connect(&url).await.expect("connect");
    let on_citus: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')")
            .fetch_one(&mut locker)
            .await
            .expect("extensions");
    let in_parts = on_citus || backend == Backend::PostgresCitusSql;
    let mut locked = locker.begin().await.expect("begin");
    for key in ["stuck", "held"] {
        // One key per statement: Citus locks rows only in a statement routed
        // to one shard.
        let row: Option<String> = sqlx::query_scalar(
            "SELECT key FROM idempotency_records WHERE namespace = $1 AND key = $2 FOR UPDATE",
        )
        .bind(NS)
        .bind(key)
        .fetch_optional(&mut *locked)
        .await
        .expect("lock");
        assert_eq!(row.as_deref(), Some(key));
    }

    let keys = ["free-1", "stuck", "free-2", "free-3", "free-4"];
    let claimed = client.claim_batch(claims(&keys)).await;
    let completed = client
        .complete_batch(CompleteBatchRequest {
            items: vec![complete_request("held", &held.lease_token, b"h")],
            item_errors: true,
        })
        .await;
    if in_parts {
        let answers = claimed
            .expect("the reachable keys are answered")
            .into_inner()
            .items;
        for (key, answer) in keys.iter().zip(&answers) {
            if *key == "stuck" {
                assert_eq!(outcome(answer), Outcome::Unspecified, "{answer:?}");
                let error = answer.error.as_ref().expect("the stuck key's own error");
                assert_eq!(error.code, Code::Unavailable as i32, "{error:?}");
                assert_eq!(error.reason, "STORE_UNAVAILABLE");
                assert!(error.retry_after.is_some(), "{error:?}");
                assert!(answer.lease_token.is_empty());
            } else {
                assert_eq!(outcome(answer), Outcome::Claimed, "{key}: {answer:?}");
                assert!(answer.error.is_none(), "{key}: {answer:?}");
                assert_eq!(answer.fencing_token, 1, "{key}");
            }
        }
        // The leases answered are the keys' live leases: each completes.
        let items = keys
            .iter()
            .zip(&answers)
            .filter(|(key, _)| **key != "stuck")
            .map(|(key, answer)| complete_request(key, &answer.lease_token, b"done"))
            .collect::<Vec<_>>();
        let n = items.len();
        let results = client
            .complete_batch(CompleteBatchRequest {
                items,
                item_errors: true,
            })
            .await
            .unwrap()
            .into_inner()
            .items;
        assert_eq!(
            results.iter().map(|r| r.code).collect::<Vec<_>>(),
            vec![0; n]
        );
        // A batch whose every item fails is the call's own UNAVAILABLE.
        assert_code(completed, Code::Unavailable);
    } else {
        assert_code(claimed, Code::Unavailable);
        assert_code(completed, Code::Unavailable);
    }
    locked.rollback().await.expect("unlock");
    // Once the row is free again, its Complete is answered (the timed-out
    // statement may have applied it already: a retried Complete is OK).
    let results = client
        .complete_batch(CompleteBatchRequest {
            items: vec![complete_request("held", &held.lease_token, b"h")],
            item_errors: true,
        })
        .await
        .unwrap()
        .into_inner()
        .items;
    assert_eq!(results[0].code, 0, "{results:?}");
}
