//! Exactly one winner (rule 5): concurrent Claims of one key, on one server
//! and on two servers sharing a store.

use crate::support::*;

pub async fn sixty_four_concurrent_claims_give_exactly_one_claimed(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let outcomes = concurrent_claims(std::slice::from_ref(&server.client), "hot-key", 64).await;
    assert_eq!(
        outcomes.iter().filter(|o| **o == Outcome::Claimed).count(),
        1,
        "{outcomes:?}"
    );
    assert_eq!(
        outcomes
            .iter()
            .filter(|o| **o == Outcome::InProgress)
            .count(),
        63
    );
}

async fn concurrent_claims(clients: &[Client], key: &str, n: usize) -> Vec<Outcome> {
    concurrent_claim_responses(clients, key, n)
        .await
        .iter()
        .map(outcome)
        .collect()
}

/// `n` Claims of one key, released together by a barrier, spread over `clients`.
async fn concurrent_claim_responses(clients: &[Client], key: &str, n: usize) -> Vec<ClaimResponse> {
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(n));
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let mut client = clients[i % clients.len()].clone();
            let barrier = barrier.clone();
            let key = key.to_owned();
            tokio::spawn(async move {
                barrier.wait().await;
                claim(&mut client, &key).await
            })
        })
        .collect();
    let mut responses = Vec::new();
    for task in tasks {
        responses.push(task.await.unwrap());
    }
    responses
}

pub async fn concurrent_claims_after_each_release_give_one_winner_per_lease(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    for round in 1..=4u64 {
        let responses = concurrent_claim_responses(std::slice::from_ref(&client), "k", 32).await;
        let winners: Vec<_> = responses
            .iter()
            .filter(|r| outcome(r) == Outcome::Claimed)
            .collect();
        assert_eq!(winners.len(), 1, "round {round}");
        assert_eq!(winners[0].fencing_token, round);
        client
            .release(release_request("k", &winners[0].lease_token))
            .await
            .unwrap();
    }
}

/// Both stores keep this rule: PostgreSQL through its row locks (the
/// production multi-replica setup), SQLite through its file lock.
pub async fn two_servers_on_one_store_agree_on_a_single_winner(backend: Backend) {
    let store = StoreFixture::new(backend).await;
    let a = TestServer::start(store.config()).await;
    let b = TestServer::start(store.config()).await;
    for round in 0..5 {
        let key = format!("k{round}");
        let outcomes = concurrent_claims(&[a.client.clone(), b.client.clone()], &key, 64).await;
        assert_eq!(
            outcomes.iter().filter(|o| **o == Outcome::Claimed).count(),
            1,
            "{outcomes:?}"
        );
    }
}
