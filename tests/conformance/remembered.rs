//! Remembered keys: a completed key whose result's retention ended is kept
//! as a marker until its horizon (`remember_for` after its Complete), and a
//! late retry of it is re-executed with the next fencing token or refused,
//! as the Claim, its namespace or the server says. Purge makes it claimable
//! whatever the policy; the reaper makes markers, then forgets them at the
//! horizon.

use std::time::Duration;

use idempotency_service::domain::LateRetry;
use idempotency_service::grpc::proto::{
    GetResponse, LateRetry as WireLateRetry, PurgeRequest, State,
};
use tonic::Code;
use tonic_types::StatusExt;

use crate::support::*;

/// The server's default `remember_for`.
const A_WEEK: Duration = Duration::from_secs(7 * 24 * 3600);

/// Claims `key` offering `fingerprint`, completes it with a 1 s retention,
/// and waits until Get shows it remembered. The Claim and the marker.
async fn remembered(
    client: &mut Client,
    key: &str,
    fingerprint: &[u8],
) -> (ClaimResponse, GetResponse) {
    let mut request = claim_request(NS, key);
    request.fingerprint = fingerprint.to_vec();
    let claimed = claim_with(client, request).await;
    assert_eq!(outcome(&claimed), Outcome::Claimed);
    let mut done = complete_request(key, &claimed.lease_token, b"receipt");
    done.retention = secs(1);
    let expires_at = client.complete(done).await.unwrap().into_inner().expires_at;
    wait_past(expires_at).await;
    let reader = client.clone();
    let marker = eventually(Duration::from_secs(5), || {
        let mut reader = reader.clone();
        async move {
            let found = get(&mut reader, key).await;
            found.remembered_until.is_some().then_some(found)
        }
    })
    .await
    .expect("the key is remembered once its result expired");
    (claimed, marker)
}

fn late(key: &str, policy: WireLateRetry, fingerprint: &[u8]) -> ClaimRequest {
    let mut request = claim_request(NS, key);
    request.late_retry = policy as i32;
    request.fingerprint = fingerprint.to_vec();
    request
}

pub async fn a_late_retry_is_re_executed_with_the_next_fencing_token_by_default(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let (claimed, marker) = remembered(&mut client, "k", b"A").await;
    // Get shows the marker: absent to calls, with what is kept of the key.
    assert_eq!(state(&marker), State::Absent);
    assert_eq!(marker.fencing_token, claimed.fencing_token);
    assert_eq!(marker.fingerprint, b"A");
    assert!(marker.response.is_empty());
    let completed_at = at(&marker.completed_at);
    assert_eq!(
        at(&marker.expires_at),
        completed_at + Duration::from_secs(1)
    );
    assert_eq!(at(&marker.remembered_until), completed_at + A_WEEK);

    // The late retry claims the key anew (another payload is allowed, as
    // for a new key), with the next fencing token, and says when the key
    // completed before.
    let again = claim_with(&mut client, late("k", WireLateRetry::Unspecified, b"B")).await;
    assert_eq!(outcome(&again), Outcome::Claimed);
    assert_eq!(again.fencing_token, claimed.fencing_token + 1);
    assert_eq!(at(&again.completed_at), completed_at);
    assert!(!again.retried);
    let record = get(&mut client, "k").await;
    assert_eq!(state(&record), State::InProgress);
    assert_eq!(record.fingerprint, b"B");
    assert_eq!(record.remembered_until, None);
    client
        .complete(complete_request("k", &again.lease_token, b"second"))
        .await
        .unwrap();
    let replay = claim(&mut client, "k").await;
    assert_eq!(outcome(&replay), Outcome::Completed);
    assert_eq!(replay.response, b"second");
    assert_eq!(replay.completed_at, None);
}

pub async fn a_late_retry_is_refused_as_the_claim_or_the_server_says_across_replicas(
    backend: Backend,
) {
    let store = StoreFixture::new(backend).await;
    let a = TestServer::start(store.config()).await;
    let mut refusing = store.config();
    refusing.late_retry = LateRetry::Refuse;
    let b = TestServer::start(refusing).await;
    let mut a_client = a.client.clone();
    let mut b_client = b.client.clone();
    let (claimed, marker) = remembered(&mut a_client, "k", b"A").await;

    // Refused by the Claim, on the server that re-executes by default.
    let refused = claim_with(&mut a_client, late("k", WireLateRetry::Refuse, b"A")).await;
    assert_eq!(outcome(&refused), Outcome::Expired);
    assert_eq!(refused.completed_at, marker.completed_at);
    assert_eq!(refused.fencing_token, claimed.fencing_token);
    assert!(refused.lease_token.is_empty());
    assert!(refused.response.is_empty());
    // Refused with another payload: the mismatch says more.
    let other = claim_with(&mut a_client, late("k", WireLateRetry::Refuse, b"B")).await;
    assert_eq!(outcome(&other), Outcome::FingerprintMismatch);
    // Refused by the other replica's default; nothing changed.
    let by_default = claim_with(&mut b_client, late("k", WireLateRetry::Unspecified, b"")).await;
    assert_eq!(outcome(&by_default), Outcome::Expired);
    assert_eq!(get(&mut b_client, "k").await, marker);

    // A Claim that asks to re-execute does, on the refusing replica.
    let again = claim_with(&mut b_client, late("k", WireLateRetry::Reexecute, b"A")).await;
    assert_eq!(outcome(&again), Outcome::Claimed);
    assert_eq!(again.fencing_token, claimed.fencing_token + 1);
    assert_eq!(again.completed_at, marker.completed_at);
    // Another late retry meanwhile finds it in progress.
    let racing = claim_with(&mut a_client, late("k", WireLateRetry::Reexecute, b"A")).await;
    assert_eq!(outcome(&racing), Outcome::InProgress);
}

pub async fn calls_on_a_remembered_key_answer_key_expired(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let (claimed, marker) = remembered(&mut client, "k", b"").await;
    let token = claimed.lease_token.clone();
    let errors = [
        client
            .complete(complete_request("k", &token, b"again"))
            .await
            .unwrap_err(),
        client
            .release(release_request("k", &token))
            .await
            .unwrap_err(),
        client
            .extend_lease(extend_request("k", &token, None))
            .await
            .unwrap_err(),
    ];
    for status in errors {
        assert_eq!(status.code(), Code::NotFound, "{status:?}");
        let details = status.get_error_details();
        let info = details.error_info().expect("ErrorInfo");
        assert_eq!(info.reason, "KEY_EXPIRED");
        assert_eq!(info.domain, "idempotency-service");
        assert_eq!(
            humantime::parse_rfc3339(&info.metadata["completed_at"]).unwrap(),
            at(&marker.completed_at)
        );
        assert_eq!(
            humantime::parse_rfc3339(&info.metadata["remembered_until"]).unwrap(),
            at(&marker.remembered_until)
        );
        assert!(details.retry_info().is_none());
    }
    assert_eq!(get(&mut client, "k").await, marker);
}

pub async fn purge_makes_a_remembered_key_claimable_whatever_its_policy(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let (claimed, marker) = remembered(&mut client, "k", b"A").await;
    let purged = client
        .purge(PurgeRequest {
            namespace: NS.into(),
            key: "k".into(),
            reason: "replay the event".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(purged.purged);
    assert_eq!(purged.previous_state, State::Absent as i32);
    // Released, without fingerprint, until the horizon.
    let record = get(&mut client, "k").await;
    assert_eq!(state(&record), State::Released);
    assert!(record.fingerprint.is_empty());
    assert_eq!(at(&record.expires_at), at(&marker.remembered_until));
    // Any Claim takes it, one that refuses late retries and carries another
    // payload included, and the fencing token goes on.
    let again = claim_with(&mut client, late("k", WireLateRetry::Refuse, b"B")).await;
    assert_eq!(outcome(&again), Outcome::Claimed);
    assert_eq!(again.fencing_token, claimed.fencing_token + 1);
    assert_eq!(again.completed_at, None);
}

pub async fn the_reaper_makes_markers_then_forgets_them_at_the_horizon(backend: Backend) {
    let remember_for = Duration::from_secs(6);
    let (store, server) = TestServer::fresh_with(backend, |c| {
        c.reaper_interval = Duration::from_millis(100);
        c.reaper_batch_size = 2;
        c.remember_for = remember_for;
    })
    .await;
    let mut client = server.client.clone();
    let mut last_expiry = None;
    let mut first_token = 0;
    for key in ["a", "b", "c"] {
        let claimed = claim(&mut client, key).await;
        first_token = claimed.fencing_token;
        let mut done = complete_request(key, &claimed.lease_token, b"receipt");
        done.retention = secs(1);
        last_expiry = client.complete(done).await.unwrap().into_inner().expires_at;
    }
    // A result kept longer than remember_for: nothing to remember past it.
    let keeper = claim(&mut client, "keeper").await;
    let mut kept = complete_request("keeper", &keeper.lease_token, b"kept");
    kept.retention = secs(3600);
    client.complete(kept).await.unwrap();
    assert_eq!(get(&mut client, "keeper").await.remembered_until, None);
    wait_past(last_expiry).await;

    // Step one: the results are dropped, the markers stay.
    let marked = eventually(Duration::from_secs(4), || async {
        let mut all = true;
        for key in ["a", "b", "c"] {
            all &= store.row_state(key).await == Some((4, false));
        }
        all.then_some(())
    })
    .await;
    assert!(marked.is_some(), "the reaper did not make three markers");
    assert_eq!(store.row_state("keeper").await, Some((2, true)));
    let marker = get(&mut client, "a").await;
    assert_eq!(state(&marker), State::Absent);
    assert_eq!(marker.fencing_token, first_token);
    assert_eq!(
        at(&marker.remembered_until),
        at(&marker.completed_at) + remember_for
    );
    let refused = claim_with(&mut client, late("b", WireLateRetry::Refuse, b"")).await;
    assert_eq!(outcome(&refused), Outcome::Expired);

    // Step two: past the horizon the markers are deleted, and the key is
    // new again.
    let forgotten = eventually(remember_for + Duration::from_secs(5), || async {
        (store.row_count().await == 1).then_some(())
    })
    .await;
    assert!(forgotten.is_some(), "the reaper did not delete the markers");
    let new = claim_with(&mut client, late("a", WireLateRetry::Refuse, b"")).await;
    assert_eq!(outcome(&new), Outcome::Claimed);
    assert_eq!(new.fencing_token, 1);
    assert_eq!(new.completed_at, None);
}
