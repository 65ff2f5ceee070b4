//! Complete (rule 6): retried, late, with a token that is not current, on an
//! unknown or expired key, and whose retention wins.

use std::time::Duration;

use tonic::Code;

use crate::support::*;

pub async fn a_retried_complete_returns_ok_and_keeps_the_first_response(backend: Backend) {
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

pub async fn complete_after_the_lease_ran_out_succeeds_while_nobody_claimed(backend: Backend) {
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

pub async fn complete_with_a_token_that_is_not_current_fails_precondition(backend: Backend) {
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

pub async fn complete_on_an_unknown_or_expired_key_is_not_found(backend: Backend) {
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

pub async fn the_completes_retention_wins_over_the_claims_which_wins_over_the_default(
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
