//! ClaimBatch and CompleteBatch: every item answered as its own call, an
//! invalid item refused by index, and one winner per key across batches.

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
        .claim_batch(ClaimBatchRequest { items })
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
            .claim_batch(ClaimBatchRequest { items: vec![] })
            .await,
        Code::InvalidArgument,
    );
    assert!(status.message().starts_with("items:"), "{status:?}");
    let four = (0..4).map(|i| batch_item(&format!("k{i}"), b"")).collect();
    let status = assert_code(
        client.claim_batch(ClaimBatchRequest { items: four }).await,
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
        .complete_batch(CompleteBatchRequest { items })
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
                    .claim_batch(ClaimBatchRequest { items })
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
