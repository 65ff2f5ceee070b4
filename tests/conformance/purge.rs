//! Purge: an operator makes a key claimable again.

use tonic::Code;

use crate::support::*;

pub async fn purge_makes_a_key_claimable_again_and_revokes_a_live_lease(backend: Backend) {
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
