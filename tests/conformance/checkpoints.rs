//! Checkpoints: resumable work saved under a lease and handed to the next
//! holder.

use std::time::Duration;

use idempotency_service::grpc::proto::ExtendLeaseRequest;
use tonic::Code;

use crate::support::*;

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

pub async fn a_checkpoint_saved_under_a_lease_goes_to_the_next_holder(backend: Backend) {
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

pub async fn an_expired_or_purged_record_starts_without_a_checkpoint(backend: Backend) {
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
