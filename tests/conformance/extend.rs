//! ExtendLease (rule 8): the new expiry, an expired lease revived, and the
//! current token required.

use std::time::Duration;

use tonic::Code;

use crate::support::*;

pub async fn extend_lease_moves_the_expiry_to_now_plus_the_ttl(backend: Backend) {
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

pub async fn extend_lease_revives_an_expired_lease_nobody_took(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let claimed = claim_and_let_lease_expire(&mut client, "k").await;
    client
        .extend_lease(extend_request("k", &claimed.lease_token, secs(30)))
        .await
        .unwrap();
    assert_eq!(outcome(&claim(&mut client, "k").await), Outcome::InProgress);
}

pub async fn extend_lease_needs_the_current_token_on_an_in_progress_key(backend: Backend) {
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
