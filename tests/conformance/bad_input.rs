//! Bad input (rule 10): INVALID_ARGUMENT naming the field, and nothing
//! changed.

use idempotency_service::grpc::proto::{GetRequest, ReleaseRequest};
use tonic::Code;

use crate::support::*;

pub async fn bad_input_is_invalid_argument_naming_the_field_and_changes_nothing(backend: Backend) {
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
