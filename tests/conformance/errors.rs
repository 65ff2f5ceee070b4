//! Every refusal carries the standard google.rpc error details, decoded
//! here with tonic-types as any stock gRPC library would: ErrorInfo with a
//! stable reason and the domain, BadRequest naming the field of an
//! INVALID_ARGUMENT, and no RetryInfo where a retry of the same call cannot
//! succeed. CompleteBatch items carry the same reasons.

use idempotency_service::grpc::proto::CompleteBatchRequest;
use tonic::{Code, Status};
use tonic_types::StatusExt;

use crate::support::*;

/// The status's code and ErrorInfo reason, after checking the domain and
/// that nothing suggests retrying the same call.
fn reason_of(status: &Status) -> (Code, String) {
    let details = status.get_error_details();
    let info = details
        .error_info()
        .unwrap_or_else(|| panic!("no ErrorInfo on {status:?}"));
    assert_eq!(info.domain, "idempotency-service");
    assert!(details.retry_info().is_none(), "{status:?}");
    (status.code(), info.reason.clone())
}

pub async fn every_refusal_names_its_reason_in_error_info(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();

    // INVALID_ARGUMENT: the field, in ErrorInfo and in a FieldViolation.
    let mut bad = claim_request(NS, "k");
    bad.lease_ttl = secs(0);
    let status = client.claim(bad).await.unwrap_err();
    assert_eq!(
        reason_of(&status),
        (Code::InvalidArgument, "INVALID_ARGUMENT".into())
    );
    let details = status.get_error_details();
    assert_eq!(details.error_info().unwrap().metadata["field"], "lease_ttl");
    let violations = &details.bad_request().expect("BadRequest").field_violations;
    assert_eq!(violations.len(), 1);
    assert_eq!(violations[0].field, "lease_ttl");
    assert_eq!(violations[0].description, "must be at least 1s");

    // NOT_FOUND: no record.
    let token = own_token();
    let status = client
        .complete(complete_request("nothing", &token, b"r"))
        .await
        .unwrap_err();
    assert_eq!(reason_of(&status), (Code::NotFound, "NOT_FOUND".into()));

    // LEASE_LOST: a token that is not the key's current lease.
    let held = claim(&mut client, "held").await;
    let status = client
        .complete(complete_request("held", &own_token(), b"r"))
        .await
        .unwrap_err();
    assert_eq!(
        reason_of(&status),
        (Code::FailedPrecondition, "LEASE_LOST".into())
    );

    // LEASE_RELEASED: this lease was given back.
    client
        .release(release_request("held", &held.lease_token))
        .await
        .unwrap();
    let status = client
        .complete(complete_request("held", &held.lease_token, b"r"))
        .await
        .unwrap_err();
    assert_eq!(
        reason_of(&status),
        (Code::FailedPrecondition, "LEASE_RELEASED".into())
    );

    // KEY_COMPLETED: completed under another lease; a completed key cannot
    // be released or extended.
    let done = claim(&mut client, "done").await;
    client
        .complete(complete_request("done", &done.lease_token, b"r"))
        .await
        .unwrap();
    for status in [
        client
            .complete(complete_request("done", &own_token(), b"r"))
            .await
            .unwrap_err(),
        client
            .release(release_request("done", &done.lease_token))
            .await
            .unwrap_err(),
        client
            .extend_lease(extend_request("done", &done.lease_token, None))
            .await
            .unwrap_err(),
    ] {
        assert_eq!(
            reason_of(&status),
            (Code::FailedPrecondition, "KEY_COMPLETED".into())
        );
    }

    // CompleteBatch: each item's reason beside its code.
    let batch = client
        .complete_batch(CompleteBatchRequest {
            items: vec![
                complete_request("nothing", &own_token(), b"r"),
                complete_request("done", &own_token(), b"r"),
            ],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let reasons: Vec<(i32, &str)> = batch
        .items
        .iter()
        .map(|item| (item.code, item.reason.as_str()))
        .collect();
    assert_eq!(
        reasons,
        [
            (Code::NotFound as i32, "NOT_FOUND"),
            (Code::FailedPrecondition as i32, "KEY_COMPLETED"),
        ]
    );
}
