//! Retention, expiry and the reaper (rule 9), and a claimant that dies
//! between Claim and its effect.

use std::time::Duration;

use tonic::Code;

use crate::support::*;

pub async fn an_abandoned_claim_expires_its_lease_plus_retention_after(backend: Backend) {
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

pub async fn a_completed_key_replays_until_retention_ends_then_is_claimable_afresh(
    backend: Backend,
) {
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

/// With nothing remembered past the result (IDEMPOTENCY_REMEMBER_FOR=0s;
/// remembered keys have cases of their own), an expired key is forgotten.
pub async fn the_reaper_deletes_expired_rows_and_fencing_restarts_at_one(backend: Backend) {
    let (store, server) = TestServer::fresh_with(backend, |c| {
        c.reaper_interval = Duration::from_millis(100);
        c.reaper_batch_size = 2;
        c.remember_for = Duration::ZERO;
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
pub async fn a_claimant_that_dies_leaves_the_key_claimable_after_its_lease(backend: Backend) {
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
