//! Claim (rules 1 to 4): a new key's lease and fencing token, a live lease
//! held by someone else, released and expired leases, the replay of a
//! completed key, and the fingerprint policy.

use std::time::{Duration, SystemTime};

use tonic::Code;

use crate::support::*;

// Rule 1: a claim on an absent key.
pub async fn a_claim_on_a_new_key_gets_a_lease_and_fencing_token_one(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let mut request = claim_request(NS, "evt_1");
    request.lease_ttl = secs(10);
    request.retention = secs(100);
    let before = SystemTime::now();
    let claimed = claim_with(&mut client, request).await;
    assert_eq!(outcome(&claimed), Outcome::Claimed);
    assert_eq!(claimed.fencing_token, 1);
    assert_eq!(claimed.lease_token.len(), 32);
    assert!(
        claimed
            .lease_token
            .bytes()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
    );
    assert!(claimed.response.is_empty());
    assert_eq!(claimed.retry_after, None);
    // lease_expires_at = now + lease_ttl; the record outlives its lease by the retention.
    let lease_left = at(&claimed.lease_expires_at)
        .duration_since(before)
        .unwrap();
    assert!(
        lease_left > Duration::from_secs(8) && lease_left <= Duration::from_secs(12),
        "{lease_left:?}"
    );
    assert_eq!(
        between(&claimed.lease_expires_at, &claimed.expires_at),
        Duration::from_secs(100)
    );
    let record = get(&mut client, "evt_1").await;
    assert_eq!(state(&record), State::InProgress);
    assert_eq!(record.fencing_token, 1);
    assert_eq!(record.lease_expires_at, claimed.lease_expires_at);
    assert_eq!(
        between(&record.updated_at, &record.lease_expires_at),
        Duration::from_secs(10)
    );
}

pub async fn lease_tokens_are_unique_per_claim(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let mut tokens = std::collections::HashSet::new();
    for i in 0..50 {
        let claimed = claim(&mut client, &format!("k{i}")).await;
        assert!(tokens.insert(claimed.lease_token));
    }
}

pub async fn the_default_lease_is_the_servers(backend: Backend) {
    let (_store, server) = TestServer::fresh_with(backend, |c| {
        c.default_lease_ttl = Duration::from_secs(7);
        c.default_retention = Duration::from_secs(77);
    })
    .await;
    let mut client = server.client.clone();
    let claimed = claim(&mut client, "k").await;
    let record = get(&mut client, "k").await;
    assert_eq!(
        between(&record.updated_at, &claimed.lease_expires_at),
        Duration::from_secs(7)
    );
    assert_eq!(
        between(&claimed.lease_expires_at, &claimed.expires_at),
        Duration::from_secs(77)
    );
}

// Rule 2: a live lease held by someone else.
pub async fn a_claim_during_a_live_lease_is_in_progress_without_a_token(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let mut request = claim_request(NS, "k");
    request.lease_ttl = secs(20);
    let first = claim_with(&mut client, request).await;
    let second = claim(&mut client, "k").await;
    assert_eq!(outcome(&second), Outcome::InProgress);
    assert_eq!(second.lease_token, "");
    assert_eq!(second.fencing_token, 0);
    assert!(second.response.is_empty());
    assert_eq!(second.lease_expires_at, first.lease_expires_at);
    let retry_after: Duration = second.retry_after.unwrap().try_into().unwrap();
    assert!(
        retry_after > Duration::from_secs(15) && retry_after <= Duration::from_secs(20),
        "{retry_after:?}"
    );
}

// Rule 1 (released and expired leases), rule 7.
pub async fn a_released_key_is_claimable_at_once_and_keeps_counting(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let first = claim(&mut client, "k").await;
    client
        .release(release_request("k", &first.lease_token))
        .await
        .unwrap();
    assert_eq!(state(&get(&mut client, "k").await), State::Released);
    let second = claim(&mut client, "k").await;
    assert_eq!(outcome(&second), Outcome::Claimed);
    assert_eq!(second.fencing_token, 2);
    assert_ne!(second.lease_token, first.lease_token);
}

pub async fn an_expired_lease_is_taken_over_with_the_next_fencing_token(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let first = claim_and_let_lease_expire(&mut client, "k").await;
    let second = claim(&mut client, "k").await;
    assert_eq!(outcome(&second), Outcome::Claimed);
    assert_eq!(second.fencing_token, first.fencing_token + 1);
    // The old holder lost the key: its Complete, Release and ExtendLease fail.
    assert_code(
        client
            .complete(complete_request("k", &first.lease_token, b"late"))
            .await,
        Code::FailedPrecondition,
    );
    assert_code(
        client
            .release(release_request("k", &first.lease_token))
            .await,
        Code::FailedPrecondition,
    );
    assert_code(
        client
            .extend_lease(extend_request("k", &first.lease_token, None))
            .await,
        Code::FailedPrecondition,
    );
    // The new holder completes normally.
    client
        .complete(complete_request("k", &second.lease_token, b"done"))
        .await
        .unwrap();
}

// Rule 3: the replay.
pub async fn a_completed_key_replays_its_response(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let claimed = claim(&mut client, "k").await;
    let completed = client
        .complete(complete_request(
            "k",
            &claimed.lease_token,
            b"{\"charge\":\"ch_1\"}",
        ))
        .await
        .unwrap()
        .into_inner();
    for _ in 0..3 {
        let replay = claim(&mut client, "k").await;
        assert_eq!(outcome(&replay), Outcome::Completed);
        assert_eq!(replay.response, b"{\"charge\":\"ch_1\"}");
        assert_eq!(replay.expires_at, completed.expires_at);
        assert_eq!(replay.lease_token, "");
        assert_eq!(replay.retry_after, None);
    }
    let record = get(&mut client, "k").await;
    assert_eq!(state(&record), State::Completed);
    assert_eq!(record.response, b"{\"charge\":\"ch_1\"}");
    assert_eq!(record.fencing_token, 1);
    assert_eq!(record.lease_expires_at, None);
}

pub async fn an_empty_response_is_a_valid_result(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let claimed = claim(&mut client, "k").await;
    client
        .complete(complete_request("k", &claimed.lease_token, b""))
        .await
        .unwrap();
    let replay = claim(&mut client, "k").await;
    assert_eq!(outcome(&replay), Outcome::Completed);
    assert!(replay.response.is_empty());
}

// Rule 4: the fingerprint policy.
pub async fn a_different_fingerprint_is_rejected_in_every_state_and_changes_nothing(
    backend: Backend,
) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let with_fp = |key: &str, fp: &[u8]| {
        let mut r = claim_request(NS, key);
        r.fingerprint = fp.to_vec();
        r
    };
    // In progress.
    let held = claim_with(&mut client, with_fp("in-progress", b"A")).await;
    assert_eq!(outcome(&held), Outcome::Claimed);
    // Released.
    let released = claim_with(&mut client, with_fp("released", b"A")).await;
    client
        .release(release_request("released", &released.lease_token))
        .await
        .unwrap();
    // Completed.
    let done = claim_with(&mut client, with_fp("completed", b"A")).await;
    client
        .complete(complete_request("completed", &done.lease_token, b"r"))
        .await
        .unwrap();

    for key in ["in-progress", "released", "completed"] {
        let before = get(&mut client, key).await;
        let mismatch = claim_with(&mut client, with_fp(key, b"B")).await;
        assert_eq!(outcome(&mismatch), Outcome::FingerprintMismatch, "{key}");
        assert_eq!(mismatch.lease_token, "");
        assert!(mismatch.response.is_empty());
        assert_eq!(mismatch.fencing_token, 0);
        assert_eq!(get(&mut client, key).await, before, "{key} changed");
        assert_eq!(before.fingerprint, b"A");
    }
    // The same fingerprint, or none, is no mismatch.
    assert_eq!(
        outcome(&claim_with(&mut client, with_fp("completed", b"A")).await),
        Outcome::Completed
    );
    assert_eq!(
        outcome(&claim(&mut client, "completed").await),
        Outcome::Completed
    );
    assert_eq!(
        outcome(&claim(&mut client, "in-progress").await),
        Outcome::InProgress
    );
    assert_eq!(
        outcome(&claim_with(&mut client, with_fp("released", b"A")).await),
        Outcome::Claimed
    );
}

pub async fn a_record_keeps_the_first_fingerprint_of_a_winning_claim(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let with_fp = |fp: &[u8]| {
        let mut r = claim_request(NS, "k");
        r.fingerprint = fp.to_vec();
        r
    };
    // No fingerprint at first: nothing to compare against.
    let first = claim(&mut client, "k").await;
    client
        .release(release_request("k", &first.lease_token))
        .await
        .unwrap();
    assert_eq!(get(&mut client, "k").await.fingerprint, b"");
    // The next winning claim brings one: the record keeps it...
    let second = claim_with(&mut client, with_fp(b"A")).await;
    assert_eq!(outcome(&second), Outcome::Claimed);
    assert_eq!(get(&mut client, "k").await.fingerprint, b"A");
    client
        .release(release_request("k", &second.lease_token))
        .await
        .unwrap();
    // ...and a later one with another fingerprint is a mismatch, even released.
    assert_eq!(
        outcome(&claim_with(&mut client, with_fp(b"B")).await),
        Outcome::FingerprintMismatch
    );
    // A claim without one does not erase it.
    let third = claim(&mut client, "k").await;
    assert_eq!(outcome(&third), Outcome::Claimed);
    assert_eq!(get(&mut client, "k").await.fingerprint, b"A");
}
