//! Retry-safe Claims: the caller's own lease token gets the same lease back
//! while it is live.

use crate::support::*;

pub async fn a_claim_repeating_the_live_leases_token_gets_the_same_lease_back(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let token = own_token();
    let first = claim_with(&mut client, claim_with_token("k", &token)).await;
    assert_eq!(outcome(&first), Outcome::Claimed);
    assert_eq!(
        first.lease_token, token,
        "the lease carries the caller's token"
    );
    assert_eq!(first.fencing_token, 1);
    assert!(!first.retried);
    let before = get(&mut client, "k").await;

    // The answer was lost; the caller repeats the request.
    let retried = claim_with(&mut client, claim_with_token("k", &token)).await;
    assert_eq!(outcome(&retried), Outcome::Claimed);
    assert!(retried.retried);
    assert_eq!(retried.lease_token, first.lease_token);
    assert_eq!(retried.fencing_token, first.fencing_token);
    assert_eq!(retried.lease_expires_at, first.lease_expires_at);
    assert_eq!(retried.expires_at, first.expires_at);
    assert_eq!(
        get(&mut client, "k").await,
        before,
        "a retried Claim changes nothing: the lease is not extended"
    );

    // Everyone else is still told the key is in progress.
    assert_eq!(outcome(&claim(&mut client, "k").await), Outcome::InProgress);
    let other = claim_with(&mut client, claim_with_token("k", &own_token())).await;
    assert_eq!(outcome(&other), Outcome::InProgress);
    assert!(other.lease_token.is_empty());

    // The lease works as any other; once completed, the token replays.
    client
        .complete(complete_request("k", &token, b"done"))
        .await
        .unwrap();
    let replay = claim_with(&mut client, claim_with_token("k", &token)).await;
    assert_eq!(outcome(&replay), Outcome::Completed);
    assert_eq!(replay.response, b"done");
    assert!(!replay.retried);
}

pub async fn the_callers_token_after_its_lease_ran_out_or_was_released_is_a_new_claim(
    backend: Backend,
) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let token = own_token();
    let short = ClaimRequest {
        lease_ttl: secs(1),
        ..claim_with_token("k", &token)
    };
    let first = claim_with(&mut client, short.clone()).await;
    assert_eq!(outcome(&first), Outcome::Claimed);
    wait_past(first.lease_expires_at).await;
    // Run out: the same token claims again as anyone would, with the next
    // fencing token (nothing says the holder is still at work).
    let again = claim_with(&mut client, short).await;
    assert_eq!(outcome(&again), Outcome::Claimed);
    assert!(!again.retried);
    assert_eq!(again.fencing_token, 2);
    assert!(at(&again.lease_expires_at) > at(&first.lease_expires_at));
    // Released: likewise a new lease.
    client.release(release_request("k", &token)).await.unwrap();
    let after_release = claim_with(&mut client, claim_with_token("k", &token)).await;
    assert_eq!(outcome(&after_release), Outcome::Claimed);
    assert!(!after_release.retried);
    assert_eq!(after_release.fencing_token, 3);
}

pub async fn retries_racing_the_original_claim_all_get_its_lease(backend: Backend) {
    let store = StoreFixture::new(backend).await;
    let a = TestServer::start(store.config()).await;
    let b = TestServer::start(store.config()).await;
    for round in 0..3 {
        let key = format!("k{round}");
        let token = own_token();
        // 16 copies of one caller's Claim (the original and its retries, on
        // either replica) race 16 Claims of other callers.
        let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(32));
        let tasks: Vec<_> = (0..32)
            .map(|i| {
                let mut client = [&a, &b][i % 2].client.clone();
                let barrier = barrier.clone();
                let request = if i < 16 {
                    claim_with_token(&key, &token)
                } else {
                    claim_with_token(&key, &own_token())
                };
                tokio::spawn(async move {
                    barrier.wait().await;
                    (i < 16, claim_with(&mut client, request).await)
                })
            })
            .collect();
        let mut fencing_tokens = Vec::new();
        let mut others_claimed = 0;
        for task in tasks {
            let (mine, response) = task.await.unwrap();
            if outcome(&response) == Outcome::Claimed {
                if mine {
                    assert_eq!(response.lease_token, token);
                    fencing_tokens.push(response.fencing_token);
                } else {
                    others_claimed += 1;
                }
            } else {
                assert_eq!(outcome(&response), Outcome::InProgress, "{response:?}");
            }
        }
        // Either one of the caller's copies won (and every copy got that
        // lease) or another caller did (and no copy got anything).
        match others_claimed {
            0 => assert_eq!(fencing_tokens, vec![1; 16], "round {round}"),
            1 => assert!(
                fencing_tokens.is_empty(),
                "round {round}: {fencing_tokens:?}"
            ),
            n => panic!("round {round}: {n} other callers claimed"),
        }
    }
}

pub async fn a_claim_batch_item_with_its_own_token_is_retry_safe(backend: Backend) {
    use idempotency_service::grpc::proto::ClaimBatchRequest;
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let tokens = [own_token(), own_token()];
    let batch = ClaimBatchRequest {
        items: vec![
            claim_with_token("a", &tokens[0]),
            claim_with_token("b", &tokens[1]),
            claim_request(NS, "c"),
        ],
        ..Default::default()
    };
    let first = client
        .claim_batch(batch.clone())
        .await
        .unwrap()
        .into_inner()
        .items;
    assert!(first.iter().all(|i| outcome(i) == Outcome::Claimed));
    assert!(first.iter().all(|i| !i.retried));
    assert_eq!(first[0].lease_token, tokens[0]);
    assert_eq!(first[1].lease_token, tokens[1]);
    let again = client.claim_batch(batch).await.unwrap().into_inner().items;
    for i in 0..2 {
        assert_eq!(outcome(&again[i]), Outcome::Claimed);
        assert!(again[i].retried);
        assert_eq!(again[i].lease_token, first[i].lease_token);
        assert_eq!(again[i].fencing_token, first[i].fencing_token);
        assert_eq!(again[i].lease_expires_at, first[i].lease_expires_at);
    }
    // The item without a token of its own is not retry-safe.
    assert_eq!(outcome(&again[2]), Outcome::InProgress);
}
