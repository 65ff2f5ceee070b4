//! The contract, written once and run against both stores over gRPC: every
//! numbered rule of the service, concurrency, expiry, the reaper and bad input.
//! Each case is an `async fn(Backend)`; the macro at the bottom makes one test
//! per store (`postgres::…`, with concurrent calls coalesced as in production,
//! `postgres_uncoalesced::…`, one statement per call, and `sqlite::…`).

mod common;

use std::time::{Duration, SystemTime};

use common::*;
use idempotency_service::grpc::proto::{
    ClaimResponse, CompleteRequest, ExtendLeaseRequest, GetRequest, Outcome, ReleaseRequest,
};
use tonic::Code;

const NS: &str = "payments/webhooks";

type Client =
    idempotency_service::grpc::proto::idempotency_service_client::IdempotencyServiceClient<
        tonic::transport::Channel,
    >;

async fn claim(client: &mut Client, key: &str) -> ClaimResponse {
    client
        .claim(claim_request(NS, key))
        .await
        .unwrap()
        .into_inner()
}

async fn claim_with(
    client: &mut Client,
    request: idempotency_service::grpc::proto::ClaimRequest,
) -> ClaimResponse {
    client.claim(request).await.unwrap().into_inner()
}

fn complete_request(key: &str, token: &str, response: &[u8]) -> CompleteRequest {
    CompleteRequest {
        namespace: NS.to_owned(),
        key: key.to_owned(),
        lease_token: token.to_owned(),
        response: response.to_vec(),
        retention: None,
    }
}

fn release_request(key: &str, token: &str) -> ReleaseRequest {
    ReleaseRequest {
        namespace: NS.to_owned(),
        key: key.to_owned(),
        lease_token: token.to_owned(),
        ..Default::default()
    }
}

fn extend_request(
    key: &str,
    token: &str,
    ttl: Option<prost_types::Duration>,
) -> ExtendLeaseRequest {
    ExtendLeaseRequest {
        namespace: NS.to_owned(),
        key: key.to_owned(),
        lease_token: token.to_owned(),
        lease_ttl: ttl,
        ..Default::default()
    }
}

async fn get(client: &mut Client, key: &str) -> idempotency_service::grpc::proto::GetResponse {
    client
        .get(GetRequest {
            namespace: NS.to_owned(),
            key: key.to_owned(),
        })
        .await
        .unwrap()
        .into_inner()
}

/// Claims `key` with a 1 s lease and waits until that lease has run out, by
/// polling Get until the store's clock is past the lease.
async fn claim_and_let_lease_expire(client: &mut Client, key: &str) -> ClaimResponse {
    let mut request = claim_request(NS, key);
    request.lease_ttl = secs(1);
    let claimed = claim_with(client, request).await;
    assert_eq!(outcome(&claimed), Outcome::Claimed);
    wait_past(claimed.lease_expires_at).await;
    claimed
}

/// Waits until the local clock is past `t` plus a margin for clock reading.
async fn wait_past(t: Option<prost_types::Timestamp>) {
    let deadline = at(&t) + Duration::from_millis(50);
    let passed = eventually(Duration::from_secs(10), || async {
        (SystemTime::now() > deadline).then_some(())
    })
    .await;
    assert!(passed.is_some());
}

fn assert_code<T: std::fmt::Debug>(result: Result<T, tonic::Status>, code: Code) -> tonic::Status {
    let status = result.expect_err("expected an error status");
    assert_eq!(status.code(), code, "unexpected status: {status:?}");
    status
}

// Rule 1: a claim on an absent key.
async fn a_claim_on_a_new_key_gets_a_lease_and_fencing_token_one(backend: Backend) {
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

async fn lease_tokens_are_unique_per_claim(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let mut tokens = std::collections::HashSet::new();
    for i in 0..50 {
        let claimed = claim(&mut client, &format!("k{i}")).await;
        assert!(tokens.insert(claimed.lease_token));
    }
}

async fn the_default_lease_is_the_servers(backend: Backend) {
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
async fn a_claim_during_a_live_lease_is_in_progress_without_a_token(backend: Backend) {
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
async fn a_released_key_is_claimable_at_once_and_keeps_counting(backend: Backend) {
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

async fn an_expired_lease_is_taken_over_with_the_next_fencing_token(backend: Backend) {
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
async fn a_completed_key_replays_its_response(backend: Backend) {
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

async fn an_empty_response_is_a_valid_result(backend: Backend) {
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
async fn a_different_fingerprint_is_rejected_in_every_state_and_changes_nothing(backend: Backend) {
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

async fn a_record_keeps_the_first_fingerprint_of_a_winning_claim(backend: Backend) {
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

// Rule 5: exactly one winner.
async fn sixty_four_concurrent_claims_give_exactly_one_claimed(backend: Backend) {
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

async fn concurrent_claims_after_each_release_give_one_winner_per_lease(backend: Backend) {
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

// Rule 6: Complete.
async fn a_retried_complete_returns_ok_and_keeps_the_first_response(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let claimed = claim(&mut client, "k").await;
    let first = client
        .complete(complete_request("k", &claimed.lease_token, b"first"))
        .await
        .unwrap()
        .into_inner();
    let again = client
        .complete(complete_request("k", &claimed.lease_token, b"second"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.expires_at, first.expires_at);
    assert_eq!(get(&mut client, "k").await.response, b"first");
}

async fn complete_after_the_lease_ran_out_succeeds_while_nobody_claimed(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let claimed = claim_and_let_lease_expire(&mut client, "k").await;
    client
        .complete(complete_request(
            "k",
            &claimed.lease_token,
            b"late but fine",
        ))
        .await
        .unwrap();
    let replay = claim(&mut client, "k").await;
    assert_eq!(outcome(&replay), Outcome::Completed);
    assert_eq!(replay.response, b"late but fine");
}

async fn complete_with_a_token_that_is_not_current_fails_precondition(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let a = claim(&mut client, "a").await;
    let b = claim(&mut client, "b").await;
    // Another key's token.
    assert_code(
        client
            .complete(complete_request("a", &b.lease_token, b"x"))
            .await,
        Code::FailedPrecondition,
    );
    // A released token.
    client
        .release(release_request("a", &a.lease_token))
        .await
        .unwrap();
    assert_code(
        client
            .complete(complete_request("a", &a.lease_token, b"x"))
            .await,
        Code::FailedPrecondition,
    );
    // A token whose key was re-claimed after expiry.
    let old = claim_and_let_lease_expire(&mut client, "c").await;
    let new = claim(&mut client, "c").await;
    assert_eq!(outcome(&new), Outcome::Claimed);
    assert_code(
        client
            .complete(complete_request("c", &old.lease_token, b"x"))
            .await,
        Code::FailedPrecondition,
    );
    // A completed key, completed by someone else.
    client
        .complete(complete_request("c", &new.lease_token, b"new"))
        .await
        .unwrap();
    assert_code(
        client
            .complete(complete_request("c", &old.lease_token, b"x"))
            .await,
        Code::FailedPrecondition,
    );
    assert_eq!(get(&mut client, "c").await.response, b"new");
    // A well-formed token nobody was given.
    assert_code(
        client
            .complete(complete_request("b", &"0".repeat(32), b"x"))
            .await,
        Code::FailedPrecondition,
    );
}

async fn complete_on_an_unknown_or_expired_key_is_not_found(backend: Backend) {
    let (_store, server) =
        TestServer::fresh_with(backend, |c| c.reaper_interval = Duration::from_secs(3600)).await;
    let mut client = server.client.clone();
    assert_code(
        client
            .complete(complete_request("nobody", &"a".repeat(32), b"x"))
            .await,
        Code::NotFound,
    );
    let mut request = claim_request(NS, "short");
    request.lease_ttl = secs(1);
    request.retention = secs(1);
    let claimed = claim_with(&mut client, request).await;
    wait_past(claimed.expires_at).await;
    assert_code(
        client
            .complete(complete_request("short", &claimed.lease_token, b"x"))
            .await,
        Code::NotFound,
    );
}

async fn the_completes_retention_wins_over_the_claims_which_wins_over_the_default(
    backend: Backend,
) {
    let (_store, server) =
        TestServer::fresh_with(backend, |c| c.default_retention = Duration::from_secs(500)).await;
    let mut client = server.client.clone();
    // Complete's own.
    let mut request = claim_request(NS, "a");
    request.retention = secs(200);
    let a = claim_with(&mut client, request).await;
    let mut complete = complete_request("a", &a.lease_token, b"");
    complete.retention = secs(300);
    client.complete(complete).await.unwrap();
    let record = get(&mut client, "a").await;
    assert_eq!(
        between(&record.updated_at, &record.expires_at),
        Duration::from_secs(300)
    );
    // The Claim's.
    let mut request = claim_request(NS, "b");
    request.retention = secs(200);
    let b = claim_with(&mut client, request).await;
    client
        .complete(complete_request("b", &b.lease_token, b""))
        .await
        .unwrap();
    let record = get(&mut client, "b").await;
    assert_eq!(
        between(&record.updated_at, &record.expires_at),
        Duration::from_secs(200)
    );
    // The server's.
    let c = claim(&mut client, "c").await;
    client
        .complete(complete_request("c", &c.lease_token, b""))
        .await
        .unwrap();
    let record = get(&mut client, "c").await;
    assert_eq!(
        between(&record.updated_at, &record.expires_at),
        Duration::from_secs(500)
    );
}

// Rule 7: Release.
async fn release_is_idempotent_until_someone_claims_again(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let first = claim(&mut client, "k").await;
    client
        .release(release_request("k", &first.lease_token))
        .await
        .unwrap();
    client
        .release(release_request("k", &first.lease_token))
        .await
        .unwrap();
    let second = claim(&mut client, "k").await;
    assert_eq!(outcome(&second), Outcome::Claimed);
    assert_code(
        client
            .release(release_request("k", &first.lease_token))
            .await,
        Code::FailedPrecondition,
    );
    assert_eq!(state(&get(&mut client, "k").await), State::InProgress);
}

async fn release_of_a_completed_key_or_with_another_token_fails_precondition(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let a = claim(&mut client, "a").await;
    let b = claim(&mut client, "b").await;
    assert_code(
        client.release(release_request("a", &b.lease_token)).await,
        Code::FailedPrecondition,
    );
    client
        .complete(complete_request("a", &a.lease_token, b"done"))
        .await
        .unwrap();
    assert_code(
        client.release(release_request("a", &a.lease_token)).await,
        Code::FailedPrecondition,
    );
    assert_eq!(state(&get(&mut client, "a").await), State::Completed);
    assert_code(
        client
            .release(release_request("nobody", &a.lease_token))
            .await,
        Code::NotFound,
    );
}

// Rule 8: ExtendLease.
async fn extend_lease_moves_the_expiry_to_now_plus_the_ttl(backend: Backend) {
    let (_store, server) =
        TestServer::fresh_with(backend, |c| c.default_lease_ttl = Duration::from_secs(9)).await;
    let mut client = server.client.clone();
    let mut request = claim_request(NS, "k");
    request.lease_ttl = secs(2);
    request.retention = secs(60);
    let claimed = claim_with(&mut client, request).await;
    let extended = client
        .extend_lease(extend_request("k", &claimed.lease_token, secs(120)))
        .await
        .unwrap()
        .into_inner();
    let record = get(&mut client, "k").await;
    assert_eq!(record.lease_expires_at, extended.lease_expires_at);
    assert_eq!(
        between(&record.updated_at, &extended.lease_expires_at),
        Duration::from_secs(120)
    );
    // The record still outlives its lease by the retention.
    assert_eq!(
        between(&record.lease_expires_at, &record.expires_at),
        Duration::from_secs(60)
    );
    // Without a ttl: the server's default.
    let extended = client
        .extend_lease(extend_request("k", &claimed.lease_token, None))
        .await
        .unwrap()
        .into_inner();
    let record = get(&mut client, "k").await;
    assert_eq!(
        between(&record.updated_at, &extended.lease_expires_at),
        Duration::from_secs(9)
    );
    // The lease is live again: another claim is in progress.
    assert_eq!(outcome(&claim(&mut client, "k").await), Outcome::InProgress);
}

async fn extend_lease_revives_an_expired_lease_nobody_took(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let claimed = claim_and_let_lease_expire(&mut client, "k").await;
    client
        .extend_lease(extend_request("k", &claimed.lease_token, secs(30)))
        .await
        .unwrap();
    assert_eq!(outcome(&claim(&mut client, "k").await), Outcome::InProgress);
}

async fn extend_lease_needs_the_current_token_on_an_in_progress_key(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let a = claim(&mut client, "a").await;
    let b = claim(&mut client, "b").await;
    assert_code(
        client
            .extend_lease(extend_request("a", &b.lease_token, None))
            .await,
        Code::FailedPrecondition,
    );
    client
        .complete(complete_request("a", &a.lease_token, b""))
        .await
        .unwrap();
    assert_code(
        client
            .extend_lease(extend_request("a", &a.lease_token, None))
            .await,
        Code::FailedPrecondition,
    );
    client
        .release(release_request("b", &b.lease_token))
        .await
        .unwrap();
    assert_code(
        client
            .extend_lease(extend_request("b", &b.lease_token, None))
            .await,
        Code::FailedPrecondition,
    );
    assert_code(
        client
            .extend_lease(extend_request("nobody", &b.lease_token, None))
            .await,
        Code::NotFound,
    );
}

// Rule 9: retention, expiry and the reaper.
async fn an_abandoned_claim_expires_its_lease_plus_retention_after(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let mut request = claim_request(NS, "k");
    request.lease_ttl = secs(5);
    request.retention = secs(3600);
    let claimed = claim_with(&mut client, request).await;
    assert_eq!(
        between(&claimed.lease_expires_at, &claimed.expires_at),
        Duration::from_secs(3600)
    );
    let record = get(&mut client, "k").await;
    assert_eq!(record.expires_at, claimed.expires_at);
}

async fn a_completed_key_replays_until_retention_ends_then_is_claimable_afresh(backend: Backend) {
    let (store, server) =
        TestServer::fresh_with(backend, |c| c.reaper_interval = Duration::from_secs(3600)).await;
    let mut client = server.client.clone();
    let mut request = claim_request(NS, "k");
    request.fingerprint = b"A".to_vec();
    let claimed = claim_with(&mut client, request).await;
    let mut complete = complete_request("k", &claimed.lease_token, b"result");
    complete.retention = secs(1);
    let completed = client.complete(complete).await.unwrap().into_inner();
    assert_eq!(outcome(&claim(&mut client, "k").await), Outcome::Completed);
    wait_past(completed.expires_at).await;
    // Expired: absent at once for every call, although the row is still there.
    assert_eq!(state(&get(&mut client, "k").await), State::Absent);
    assert_eq!(store.row_count().await, 1);
    assert_code(
        client
            .complete(complete_request("k", &claimed.lease_token, b"x"))
            .await,
        Code::NotFound,
    );
    assert_code(
        client
            .release(release_request("k", &claimed.lease_token))
            .await,
        Code::NotFound,
    );
    // A new claim starts afresh, with another fingerprint allowed; the fencing
    // counter goes on while the row exists.
    let mut request = claim_request(NS, "k");
    request.fingerprint = b"B".to_vec();
    let again = claim_with(&mut client, request).await;
    assert_eq!(outcome(&again), Outcome::Claimed);
    assert_eq!(again.fencing_token, 2);
    let record = get(&mut client, "k").await;
    assert_eq!(record.fingerprint, b"B");
    assert!(record.response.is_empty());
    assert_eq!(record.created_at, record.updated_at);
}

async fn the_reaper_deletes_expired_rows_and_fencing_restarts_at_one(backend: Backend) {
    let (store, server) = TestServer::fresh_with(backend, |c| {
        c.reaper_interval = Duration::from_millis(100);
        c.reaper_batch_size = 2;
    })
    .await;
    let mut client = server.client.clone();
    let mut last_expiry = None;
    for key in ["a", "b", "c", "d", "e"] {
        let claimed = claim(&mut client, key).await;
        let mut complete = complete_request(key, &claimed.lease_token, b"r");
        complete.retention = secs(1);
        last_expiry = client
            .complete(complete)
            .await
            .unwrap()
            .into_inner()
            .expires_at;
    }
    let keeper = claim(&mut client, "keeper").await;
    client
        .complete(complete_request("keeper", &keeper.lease_token, b"kept"))
        .await
        .unwrap();
    wait_past(last_expiry).await;
    let reaped = eventually(Duration::from_secs(10), || async {
        (store.row_count().await == 1).then_some(())
    })
    .await;
    assert!(
        reaped.is_some(),
        "the reaper did not delete the five expired rows"
    );
    assert_eq!(
        outcome(&claim(&mut client, "keeper").await),
        Outcome::Completed
    );
    let again = claim(&mut client, "a").await;
    assert_eq!(outcome(&again), Outcome::Claimed);
    assert_eq!(again.fencing_token, 1);
}

// A claimant that fails between Claim and its effect.
async fn a_claimant_that_dies_leaves_the_key_claimable_after_its_lease(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let mut request = claim_request(NS, "k");
    request.lease_ttl = secs(1);
    let dead = claim_with(&mut client, request).await;
    assert_eq!(outcome(&claim(&mut client, "k").await), Outcome::InProgress);
    let taken = eventually(Duration::from_secs(10), || {
        let mut client = client.clone();
        async move {
            let c = claim(&mut client, "k").await;
            (outcome(&c) == Outcome::Claimed).then_some(c)
        }
    })
    .await
    .expect("the key became claimable once the lease expired");
    assert_eq!(taken.fencing_token, dead.fencing_token + 1);
    client
        .complete(complete_request("k", &taken.lease_token, b"ok"))
        .await
        .unwrap();
    assert_eq!(claim(&mut client, "k").await.response, b"ok");
}

// Get.
async fn get_reports_absent_for_an_unknown_key(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let record = get(&mut client, "nobody").await;
    assert_eq!(state(&record), State::Absent);
    assert_eq!(record.fencing_token, 0);
    assert_eq!(record.expires_at, None);
    assert_eq!(record.created_at, None);
}

async fn namespaces_and_keys_are_compared_byte_for_byte(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    // Case, trailing space, Unicode normal forms, and separators that would
    // collide if namespace and key were joined into one string.
    let pairs = [
        ("ns", "Key"),
        ("ns", "key"),
        ("ns", "key "),
        ("ns", "caf\u{e9}"),
        ("ns", "cafe\u{301}"),
        ("ns/a", "b"),
        ("ns", "a/b"),
        ("NS", "key"),
    ];
    for (namespace, key) in pairs {
        let c = client
            .claim(claim_request(namespace, key))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(outcome(&c), Outcome::Claimed, "{namespace:?}/{key:?}");
        assert_eq!(c.fencing_token, 1);
    }
}

// Rule 10: bad input.
async fn bad_input_is_invalid_argument_naming_the_field_and_changes_nothing(backend: Backend) {
    let (store, server) = TestServer::fresh_with(backend, |c| {
        c.max_response_bytes = 1000;
        c.max_checkpoint_bytes = 100;
    })
    .await;
    let mut client = server.client.clone();
    let held = claim(&mut client, "held").await;
    let before = get(&mut client, "held").await;
    let token = held.lease_token.clone();

    let claim_cases: Vec<(&str, idempotency_service::grpc::proto::ClaimRequest)> = vec![
        ("namespace", claim_request("", "k")),
        ("key", claim_request(NS, "")),
        ("namespace", claim_request(&"n".repeat(129), "k")),
        ("key", claim_request(NS, &"k".repeat(513))),
        ("namespace", claim_request("a\0b", "k")),
        ("key", claim_request(NS, "a\0b")),
        ("fingerprint", {
            let mut r = claim_request(NS, "held");
            r.fingerprint = vec![1; 65];
            r
        }),
        ("lease_ttl", {
            let mut r = claim_request(NS, "held");
            r.lease_ttl = Some(prost_types::Duration {
                seconds: 0,
                nanos: 999_999_999,
            });
            r
        }),
        ("lease_ttl", {
            let mut r = claim_request(NS, "held");
            r.lease_ttl = secs(-5);
            r
        }),
        ("lease_ttl", {
            let mut r = claim_request(NS, "held");
            r.lease_ttl = secs(3601);
            r
        }),
        ("retention", {
            let mut r = claim_request(NS, "held");
            r.retention = secs(0);
            r
        }),
        ("retention", {
            let mut r = claim_request(NS, "held");
            r.retention = secs(30 * 86_400 + 1);
            r
        }),
        ("lease_token", {
            let mut r = claim_request(NS, "held");
            r.lease_token = "xyz".into();
            r
        }),
        ("lease_token", {
            let mut r = claim_request(NS, "held");
            r.lease_token = token.to_uppercase();
            r
        }),
    ];
    for (field, request) in claim_cases {
        let status = assert_code(client.claim(request).await, Code::InvalidArgument);
        assert!(
            status.message().starts_with(&format!("{field}:")),
            "{field}: {status:?}"
        );
    }
    // The bounds themselves are allowed.
    assert_eq!(
        outcome(
            &claim_with(
                &mut client,
                ClaimRequest {
                    lease_ttl: secs(3600),
                    retention: secs(30 * 86_400),
                    ..claim_request(NS, &"k".repeat(512))
                }
            )
            .await
        ),
        Outcome::Claimed
    );
    assert_eq!(
        outcome(
            &claim_with(
                &mut client,
                ClaimRequest {
                    lease_ttl: secs(1),
                    retention: secs(1),
                    fingerprint: vec![7; 64],
                    ..claim_request(&"n".repeat(128), "k")
                }
            )
            .await
        ),
        Outcome::Claimed
    );

    let status = assert_code(
        client
            .complete(complete_request("held", &token, &[0; 1001]))
            .await,
        Code::InvalidArgument,
    );
    assert!(status.message().starts_with("response:"), "{status:?}");
    for bad_token in ["", "xyz", &token.to_uppercase(), &format!("{token}0")] {
        let status = assert_code(
            client
                .complete(complete_request("held", bad_token, b""))
                .await,
            Code::InvalidArgument,
        );
        assert!(status.message().starts_with("lease_token:"), "{status:?}");
        let status = assert_code(
            client.release(release_request("held", bad_token)).await,
            Code::InvalidArgument,
        );
        assert!(status.message().starts_with("lease_token:"), "{status:?}");
        let status = assert_code(
            client
                .extend_lease(extend_request("held", bad_token, None))
                .await,
            Code::InvalidArgument,
        );
        assert!(status.message().starts_with("lease_token:"), "{status:?}");
    }
    let mut complete = complete_request("held", &token, b"");
    complete.retention = secs(-1);
    let status = assert_code(client.complete(complete).await, Code::InvalidArgument);
    assert!(status.message().starts_with("retention:"), "{status:?}");
    let status = assert_code(
        client
            .extend_lease(extend_request("held", &token, secs(7200)))
            .await,
        Code::InvalidArgument,
    );
    assert!(status.message().starts_with("lease_ttl:"), "{status:?}");
    let status = assert_code(
        client
            .get(GetRequest {
                namespace: String::new(),
                key: "held".into(),
            })
            .await,
        Code::InvalidArgument,
    );
    assert!(status.message().starts_with("namespace:"), "{status:?}");
    let status = assert_code(
        client
            .release(ReleaseRequest {
                namespace: NS.into(),
                key: String::new(),
                lease_token: token.clone(),
                ..Default::default()
            })
            .await,
        Code::InvalidArgument,
    );
    assert!(status.message().starts_with("key:"), "{status:?}");
    let mut extend = extend_request("held", &token, None);
    extend.checkpoint = Some(vec![0; 101]);
    let status = assert_code(client.extend_lease(extend).await, Code::InvalidArgument);
    assert!(status.message().starts_with("checkpoint:"), "{status:?}");
    let mut release = release_request("held", &token);
    release.checkpoint = Some(vec![0; 101]);
    let status = assert_code(client.release(release).await, Code::InvalidArgument);
    assert!(status.message().starts_with("checkpoint:"), "{status:?}");

    // Nothing changed: the held key is as it was, and only the two valid
    // claims above added rows.
    assert_eq!(get(&mut client, "held").await, before);
    assert_eq!(store.row_count().await, 3);
}

use idempotency_service::grpc::proto::ClaimRequest;

// Health and reflection.
async fn health_is_serving_for_both_names(backend: Backend) {
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

/// Both stores keep this rule: PostgreSQL through its row locks (the
/// production multi-replica setup), SQLite through its file lock.
async fn two_servers_on_one_store_agree_on_a_single_winner(backend: Backend) {
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

macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::Backend::Postgres).await
                }
            )*
        }
        mod postgres_uncoalesced {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::Backend::PostgresUncoalesced).await
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::Backend::Sqlite).await
                }
            )*
        }
    };
}

conformance!(
    a_claim_on_a_new_key_gets_a_lease_and_fencing_token_one,
    lease_tokens_are_unique_per_claim,
    the_default_lease_is_the_servers,
    a_claim_during_a_live_lease_is_in_progress_without_a_token,
    a_released_key_is_claimable_at_once_and_keeps_counting,
    an_expired_lease_is_taken_over_with_the_next_fencing_token,
    a_completed_key_replays_its_response,
    an_empty_response_is_a_valid_result,
    a_different_fingerprint_is_rejected_in_every_state_and_changes_nothing,
    a_record_keeps_the_first_fingerprint_of_a_winning_claim,
    sixty_four_concurrent_claims_give_exactly_one_claimed,
    concurrent_claims_after_each_release_give_one_winner_per_lease,
    a_retried_complete_returns_ok_and_keeps_the_first_response,
    complete_after_the_lease_ran_out_succeeds_while_nobody_claimed,
    complete_with_a_token_that_is_not_current_fails_precondition,
    complete_on_an_unknown_or_expired_key_is_not_found,
    the_completes_retention_wins_over_the_claims_which_wins_over_the_default,
    release_is_idempotent_until_someone_claims_again,
    release_of_a_completed_key_or_with_another_token_fails_precondition,
    extend_lease_moves_the_expiry_to_now_plus_the_ttl,
    extend_lease_revives_an_expired_lease_nobody_took,
    extend_lease_needs_the_current_token_on_an_in_progress_key,
    an_abandoned_claim_expires_its_lease_plus_retention_after,
    a_completed_key_replays_until_retention_ends_then_is_claimable_afresh,
    the_reaper_deletes_expired_rows_and_fencing_restarts_at_one,
    a_claimant_that_dies_leaves_the_key_claimable_after_its_lease,
    get_reports_absent_for_an_unknown_key,
    namespaces_and_keys_are_compared_byte_for_byte,
    bad_input_is_invalid_argument_naming_the_field_and_changes_nothing,
    health_is_serving_for_both_names,
    two_servers_on_one_store_agree_on_a_single_winner,
    a_claim_repeating_the_live_leases_token_gets_the_same_lease_back,
    the_callers_token_after_its_lease_ran_out_or_was_released_is_a_new_claim,
    retries_racing_the_original_claim_all_get_its_lease,
    a_claim_batch_item_with_its_own_token_is_retry_safe,
    a_checkpoint_saved_under_a_lease_goes_to_the_next_holder,
    an_expired_or_purged_record_starts_without_a_checkpoint,
    purge_makes_a_key_claimable_again_and_revokes_a_live_lease,
    claim_batch_answers_every_item_as_its_own_claim_in_order,
    claim_batch_refuses_an_invalid_item_by_index_and_changes_nothing,
    complete_batch_answers_every_item_with_its_own_status,
    concurrent_claim_batches_on_overlapping_keys_give_one_winner_per_key,
);

// Purge: an operator makes a key claimable again.
async fn purge_makes_a_key_claimable_again_and_revokes_a_live_lease(backend: Backend) {
    use idempotency_service::grpc::proto::PurgeRequest;
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let purge = |key: &str| PurgeRequest {
        namespace: NS.to_owned(),
        key: key.to_owned(),
        reason: "INC-42".to_owned(),
    };
    // A completed key is processed again after a purge.
    let first = claim(&mut client, "done").await;
    client
        .complete(complete_request("done", &first.lease_token, b"old"))
        .await
        .unwrap();
    let purged = client.purge(purge("done")).await.unwrap().into_inner();
    assert!(purged.purged);
    assert_eq!(purged.previous_state, State::Completed as i32);
    assert_eq!(state(&get(&mut client, "done").await), State::Absent);
    let again = claim(&mut client, "done").await;
    assert_eq!(outcome(&again), Outcome::Claimed);
    assert_eq!(again.fencing_token, 2, "the fencing counter goes on");
    // A live lease is revoked: its holder can no longer complete.
    let held = claim(&mut client, "held").await;
    client.purge(purge("held")).await.unwrap();
    assert_code(
        client
            .complete(complete_request("held", &held.lease_token, b"x"))
            .await,
        Code::NotFound,
    );
    assert_eq!(outcome(&claim(&mut client, "held").await), Outcome::Claimed);
    // Nothing to purge.
    let nothing = client.purge(purge("nobody")).await.unwrap().into_inner();
    assert!(!nothing.purged);
    assert_eq!(nothing.previous_state, State::Absent as i32);
    let status = assert_code(
        client
            .purge(PurgeRequest {
                reason: "x".repeat(257),
                ..purge("done")
            })
            .await,
        Code::InvalidArgument,
    );
    assert!(status.message().starts_with("reason:"), "{status:?}");
}

// ClaimBatch and CompleteBatch.
fn batch_item(key: &str, fingerprint: &[u8]) -> ClaimRequest {
    ClaimRequest {
        fingerprint: fingerprint.to_vec(),
        ..claim_request(NS, key)
    }
}

async fn claim_batch_answers_every_item_as_its_own_claim_in_order(backend: Backend) {
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

async fn claim_batch_refuses_an_invalid_item_by_index_and_changes_nothing(backend: Backend) {
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

async fn complete_batch_answers_every_item_with_its_own_status(backend: Backend) {
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

async fn concurrent_claim_batches_on_overlapping_keys_give_one_winner_per_key(backend: Backend) {
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

// Retry-safe Claims: the caller's own lease token.

/// A fresh caller-chosen lease token, as a client makes one per attempt.
fn own_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}

fn claim_with_token(key: &str, token: &str) -> ClaimRequest {
    ClaimRequest {
        lease_token: token.to_owned(),
        ..claim_request(NS, key)
    }
}

async fn a_claim_repeating_the_live_leases_token_gets_the_same_lease_back(backend: Backend) {
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

async fn the_callers_token_after_its_lease_ran_out_or_was_released_is_a_new_claim(
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

async fn retries_racing_the_original_claim_all_get_its_lease(backend: Backend) {
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

async fn a_claim_batch_item_with_its_own_token_is_retry_safe(backend: Backend) {
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

// Checkpoints: resumable work.

fn extend_saving(
    key: &str,
    token: &str,
    ttl: Option<prost_types::Duration>,
    data: &[u8],
) -> ExtendLeaseRequest {
    ExtendLeaseRequest {
        checkpoint: Some(data.to_vec()),
        ..extend_request(key, token, ttl)
    }
}

async fn a_checkpoint_saved_under_a_lease_goes_to_the_next_holder(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let a = claim(&mut client, "job").await;
    assert_eq!(
        (a.checkpoint.as_slice(), a.checkpoint_fencing_token),
        (&b""[..], 0)
    );

    client
        .extend_lease(extend_saving("job", &a.lease_token, None, b"step 1"))
        .await
        .unwrap();
    let seen = get(&mut client, "job").await;
    assert_eq!(state(&seen), State::InProgress);
    assert_eq!(
        (seen.checkpoint.as_slice(), seen.checkpoint_fencing_token),
        (&b"step 1"[..], 1)
    );
    // An ExtendLease without one keeps it.
    client
        .extend_lease(extend_request("job", &a.lease_token, None))
        .await
        .unwrap();
    assert_eq!(get(&mut client, "job").await.checkpoint, b"step 1");
    // The last one saved, with a short lease that then runs out.
    let extended = client
        .extend_lease(extend_saving("job", &a.lease_token, secs(1), b"step 2"))
        .await
        .unwrap()
        .into_inner();
    wait_past(extended.lease_expires_at).await;

    // B takes over and resumes from A's checkpoint.
    let b = claim(&mut client, "job").await;
    assert_eq!(outcome(&b), Outcome::Claimed);
    assert_eq!(b.fencing_token, 2);
    assert_eq!(
        (b.checkpoint.as_slice(), b.checkpoint_fencing_token),
        (&b"step 2"[..], 1)
    );
    // A, too late, can no longer save one.
    assert_code(
        client
            .extend_lease(extend_saving("job", &a.lease_token, None, b"stale"))
            .await,
        Code::FailedPrecondition,
    );
    assert_eq!(get(&mut client, "job").await.checkpoint, b"step 2");

    // B saves its own with the Release; C receives it.
    let mut release = release_request("job", &b.lease_token);
    release.checkpoint = Some(b"step 3".to_vec());
    client.release(release).await.unwrap();
    let released = get(&mut client, "job").await;
    assert_eq!(state(&released), State::Released);
    assert_eq!(
        (
            released.checkpoint.as_slice(),
            released.checkpoint_fencing_token
        ),
        (&b"step 3"[..], 2)
    );
    let c_token = own_token();
    let c = claim_with(&mut client, claim_with_token("job", &c_token)).await;
    assert_eq!(c.fencing_token, 3);
    assert_eq!(
        (c.checkpoint.as_slice(), c.checkpoint_fencing_token),
        (&b"step 3"[..], 2)
    );
    // A retried Claim gets the checkpoint too.
    let c_again = claim_with(&mut client, claim_with_token("job", &c_token)).await;
    assert!(c_again.retried);
    assert_eq!(
        (
            c_again.checkpoint.as_slice(),
            c_again.checkpoint_fencing_token
        ),
        (&b"step 3"[..], 2)
    );

    // A Release without one keeps it; an empty one is a checkpoint too.
    client
        .release(release_request("job", &c.lease_token))
        .await
        .unwrap();
    let d = claim(&mut client, "job").await;
    assert_eq!(
        (d.checkpoint.as_slice(), d.checkpoint_fencing_token),
        (&b"step 3"[..], 2)
    );
    client
        .extend_lease(extend_saving("job", &d.lease_token, None, b""))
        .await
        .unwrap();
    let emptied = get(&mut client, "job").await;
    assert_eq!(
        (
            emptied.checkpoint.as_slice(),
            emptied.checkpoint_fencing_token
        ),
        (&b""[..], 4)
    );

    // Complete discards it.
    client
        .extend_lease(extend_saving("job", &d.lease_token, None, b"step 4"))
        .await
        .unwrap();
    client
        .complete(complete_request("job", &d.lease_token, b"done"))
        .await
        .unwrap();
    let done = get(&mut client, "job").await;
    assert_eq!(state(&done), State::Completed);
    assert_eq!(
        (done.checkpoint.as_slice(), done.checkpoint_fencing_token),
        (&b""[..], 0)
    );
}

async fn an_expired_or_purged_record_starts_without_a_checkpoint(backend: Backend) {
    use idempotency_service::grpc::proto::PurgeRequest;
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    // Expired: lease and retention both run out.
    let short = ClaimRequest {
        lease_ttl: secs(1),
        retention: secs(1),
        ..claim_request(NS, "old")
    };
    let first = claim_with(&mut client, short).await;
    let extended = client
        .extend_lease(extend_saving("old", &first.lease_token, secs(1), b"half"))
        .await
        .unwrap()
        .into_inner();
    let lease_end = at(&extended.lease_expires_at);
    let record_end = Some(prost_types::Timestamp::from(
        lease_end + Duration::from_secs(1),
    ));
    wait_past(record_end).await;
    assert_eq!(state(&get(&mut client, "old").await), State::Absent);
    let fresh = claim(&mut client, "old").await;
    assert_eq!(outcome(&fresh), Outcome::Claimed);
    assert_eq!(
        (fresh.checkpoint.as_slice(), fresh.checkpoint_fencing_token),
        (&b""[..], 0)
    );

    // Purged: the operator asked for the event to be processed afresh.
    let held = claim(&mut client, "purged").await;
    client
        .extend_lease(extend_saving("purged", &held.lease_token, None, b"half"))
        .await
        .unwrap();
    client
        .purge(PurgeRequest {
            namespace: NS.into(),
            key: "purged".into(),
            reason: "test".into(),
        })
        .await
        .unwrap();
    let again = claim(&mut client, "purged").await;
    assert_eq!(outcome(&again), Outcome::Claimed);
    assert_eq!(
        (again.checkpoint.as_slice(), again.checkpoint_fencing_token),
        (&b""[..], 0)
    );
}
