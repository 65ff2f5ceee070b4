//! Release (rule 7): idempotent until someone claims again; refused on a
//! completed key or with another token.

use tonic::Code;

use crate::support::*;

pub async fn release_is_idempotent_until_someone_claims_again(backend: Backend) {
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

pub async fn release_of_a_completed_key_or_with_another_token_fails_precondition(backend: Backend) {
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
