//! The access policy: each identity confined to its namespaces and RPCs
//! (every RPC tried across the line, every record checked unchanged
//! afterwards), credentials required, Purge for operators only, rate limits,
//! and a changed policy picked up while a broken one is refused.

use std::path::Path;
use std::time::Duration;

use idempotency_service::access::{hash_token, new_token};
use idempotency_service::config::Config;
use idempotency_service::grpc::proto::{self, Outcome};
use tempfile::TempDir;
use tonic::transport::Channel;
use tonic::{Code, Request};

use crate::common::process::{self, ServerProcess};
use crate::common::{
    Backend, Client, StoreFixture, TestServer, claim_request, complete_request, eventually,
    extend_request, get_request, pki, release_request,
};
use crate::{Callers, as_caller};

/// A policy file in `dir`, and a configuration on `store` that uses it.
fn policy_config(store: &StoreFixture, dir: &Path, policy: &str) -> Config {
    let mut config = store.config();
    config.policy_file = Some(pki::write(dir, "policy.toml", policy));
    config.reload_interval = Duration::from_millis(100);
    config
}

async fn get_as(
    client: &mut Client,
    token: &str,
    namespace: &str,
    key: &str,
) -> proto::GetResponse {
    client
        .get(as_caller(token, get_request(namespace, key)))
        .await
        .unwrap()
        .into_inner()
}

#[tokio::test]
async fn a_caller_confined_to_its_namespaces_can_neither_read_nor_claim_nor_release_anothers_keys()
{
    let dir = TempDir::new().unwrap();
    let callers = Callers::new();
    let store = StoreFixture::new(Backend::Sqlite).await;
    let server = TestServer::start(policy_config(&store, dir.path(), &callers.policy())).await;
    let mut client = server.client.clone();
    let (a, b) = (callers.a.as_str(), callers.b.as_str());

    // team-b's records: one in progress, one completed.
    let held = client
        .claim(as_caller(b, claim_request("team-b", "held")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(held.outcome(), Outcome::Claimed);
    let done = client
        .claim(as_caller(b, claim_request("team-b", "done")))
        .await
        .unwrap()
        .into_inner();
    client
        .complete(as_caller(
            b,
            complete_request(
                "team-b",
                "done",
                &done.lease_token,
                b"team-b's secret result",
            ),
        ))
        .await
        .unwrap();
    let before = (
        get_as(&mut client, b, "team-b", "held").await,
        get_as(&mut client, b, "team-b", "done").await,
    );

    // team-a may use its own namespaces.
    for namespace in ["team-a", "team-a/eu"] {
        let own = client
            .claim(as_caller(a, claim_request(namespace, "k")))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(own.outcome(), Outcome::Claimed, "{namespace}");
    }

    // Every RPC, aimed at team-b's namespace: PERMISSION_DENIED.
    let denied = |result: Result<(), tonic::Status>, what: &str| {
        let status = result.err().unwrap_or_else(|| panic!("{what} was allowed"));
        assert_eq!(status.code(), Code::PermissionDenied, "{what}: {status:?}");
        status.message().to_owned()
    };
    let message = denied(
        client
            .claim(as_caller(a, claim_request("team-b", "held")))
            .await
            .map(|_| ()),
        "Claim of a held key",
    );
    assert_eq!(
        message,
        "namespace: \"team-b\" is not granted to identity \"team-a\""
    );
    denied(
        client
            .claim(as_caller(a, claim_request("team-b", "fresh")))
            .await
            .map(|_| ()),
        "Claim of a fresh key",
    );
    denied(
        client
            .get(as_caller(a, get_request("team-b", "done")))
            .await
            .map(|_| ()),
        "Get",
    );
    denied(
        client
            .complete(as_caller(
                a,
                complete_request("team-b", "held", &held.lease_token, b"forged"),
            ))
            .await
            .map(|_| ()),
        "Complete",
    );
    denied(
        client
            .release(as_caller(
                a,
                release_request("team-b", "held", &held.lease_token),
            ))
            .await
            .map(|_| ()),
        "Release",
    );
    denied(
        client
            .extend_lease(as_caller(
                a,
                extend_request("team-b", "held", &held.lease_token, None),
            ))
            .await
            .map(|_| ()),
        "ExtendLease",
    );
    let message = denied(
        client
            .claim_batch(as_caller(
                a,
                proto::ClaimBatchRequest {
                    items: vec![
                        claim_request("team-a", "batch"),
                        claim_request("team-b", "batch"),
                    ],
                    ..Default::default()
                },
            ))
            .await
            .map(|_| ()),
        "ClaimBatch",
    );
    assert_eq!(
        message,
        "items[1].namespace: \"team-b\" is not granted to identity \"team-a\""
    );
    denied(
        client
            .complete_batch(as_caller(
                a,
                proto::CompleteBatchRequest {
                    items: vec![complete_request(
                        "team-b",
                        "held",
                        &held.lease_token,
                        b"forged",
                    )],
                    ..Default::default()
                },
            ))
            .await
            .map(|_| ()),
        "CompleteBatch",
    );
    let message = denied(
        client
            .purge(as_caller(
                a,
                proto::PurgeRequest {
                    namespace: "team-b".into(),
                    key: "done".into(),
                    reason: String::new(),
                },
            ))
            .await
            .map(|_| ()),
        "Purge",
    );
    assert_eq!(message, "Purge is not granted to identity \"team-a\"");

    // Nothing changed: team-b's records are as they were, and neither the
    // fresh key nor the batch's own-namespace item was written.
    let after = (
        get_as(&mut client, b, "team-b", "held").await,
        get_as(&mut client, b, "team-b", "done").await,
    );
    assert_eq!(after, before);
    assert_eq!(after.1.response, b"team-b's secret result");
    let operator = callers.operator.as_str();
    for (namespace, key) in [("team-b", "fresh"), ("team-a", "batch")] {
        let record = get_as(&mut client, operator, namespace, key).await;
        assert_eq!(record.state(), proto::State::Absent, "{namespace}/{key}");
    }
    // team-b's lease still works for team-b.
    client
        .release(as_caller(
            b,
            release_request("team-b", "held", &held.lease_token),
        ))
        .await
        .unwrap();
    assert_eq!(store.row_count().await, 4);
}

#[tokio::test]
async fn calls_without_known_credentials_are_unauthenticated_and_change_nothing() {
    let dir = TempDir::new().unwrap();
    let callers = Callers::new();
    let store = StoreFixture::new(Backend::Sqlite).await;
    let server = TestServer::start(policy_config(&store, dir.path(), &callers.policy())).await;
    let mut client = server.client.clone();

    let mut cases: Vec<(&str, Request<proto::ClaimRequest>)> = vec![
        ("no credentials", Request::new(claim_request("team-a", "k"))),
        (
            "an unknown token",
            as_caller(&new_token(), claim_request("team-a", "k")),
        ),
        (
            "an empty token",
            as_caller("", claim_request("team-a", "k")),
        ),
    ];
    let mut basic = Request::new(claim_request("team-a", "k"));
    basic
        .metadata_mut()
        .insert("authorization", "Basic dGVhbS1hOnB3".parse().unwrap());
    cases.push(("a Basic header", basic));
    for (what, request) in cases {
        let status = client.claim(request).await.unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated, "{what}: {status:?}");
    }
    // A valid token of another identity's hash (the hash is not the token).
    let status = client
        .claim(as_caller(
            &hash_token(&callers.a),
            claim_request("team-a", "k"),
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    assert_eq!(store.row_count().await, 0);

    // Health and reflection need no credentials.
    assert_eq!(
        server.health_status("").await,
        Some(tonic_health::pb::health_check_response::ServingStatus::Serving)
    );
    let mut reflection =
        tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient::new(
            Channel::from_shared(format!("http://{}", server.addr))
                .unwrap()
                .connect_lazy(),
        );
    use tokio_stream::StreamExt;
    let mut stream = reflection
        .server_reflection_info(tokio_stream::once(
            tonic_reflection::pb::v1::ServerReflectionRequest {
                host: String::new(),
                message_request: Some(
                    tonic_reflection::pb::v1::server_reflection_request::MessageRequest::ListServices(
                        String::new(),
                    ),
                ),
            },
        ))
        .await
        .unwrap()
        .into_inner();
    let listed = format!("{:?}", stream.next().await.unwrap().unwrap());
    assert!(
        listed.contains("idempotency.v1.IdempotencyService"),
        "{listed}"
    );
}

#[tokio::test]
async fn an_operator_may_purge_where_others_may_not() {
    let dir = TempDir::new().unwrap();
    let callers = Callers::new();
    let store = StoreFixture::new(Backend::Sqlite).await;
    let server = TestServer::start(policy_config(&store, dir.path(), &callers.policy())).await;
    let mut client = server.client.clone();
    client
        .claim(as_caller(&callers.a, claim_request("team-a", "k")))
        .await
        .unwrap();
    let purge = || proto::PurgeRequest {
        namespace: "team-a".into(),
        key: "k".into(),
        reason: "INC-1".into(),
    };
    let status = client
        .purge(as_caller(&callers.a, purge()))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    let purged = client
        .purge(as_caller(&callers.operator, purge()))
        .await
        .unwrap()
        .into_inner();
    assert!(purged.purged);
}

#[tokio::test]
async fn an_identity_over_its_rate_limit_gets_resource_exhausted() {
    let dir = TempDir::new().unwrap();
    let token = new_token();
    let policy = format!(
        r#"
        [[identity]]
        name = "slow"
        token_hashes = ["{}"]
        namespaces = ["*"]
        rate_limit_per_second = 1
        rate_limit_burst = 3
        "#,
        hash_token(&token)
    );
    let store = StoreFixture::new(Backend::Sqlite).await;
    let server = TestServer::start(policy_config(&store, dir.path(), &policy)).await;
    let mut client = server.client.clone();
    let mut codes = Vec::new();
    for i in 0..5 {
        let result = client
            .claim(as_caller(&token, claim_request("n", &format!("k{i}"))))
            .await;
        codes.push(result.map_or_else(|s| s.code(), |_| Code::Ok));
    }
    // The burst of 3 passes (a 4th token may refill within the loop's time).
    assert_eq!(&codes[..3], &[Code::Ok; 3]);
    assert_eq!(codes[4], Code::ResourceExhausted, "{codes:?}");
    let refused = codes
        .iter()
        .filter(|c| **c == Code::ResourceExhausted)
        .count() as i64;
    assert_eq!(store.row_count().await, 5 - refused);
}

#[tokio::test]
async fn a_changed_policy_is_picked_up_and_a_broken_one_keeps_the_last_good_one() {
    // The binary, so that its log shows when it has read the broken file.
    let dir = TempDir::new().unwrap();
    let callers = Callers::new();
    let log = dir.path().join("server.log");
    let mut command = process::command(dir.path());
    command
        .env(
            "IDEMPOTENCY_POLICY_FILE",
            pki::write(dir.path(), "policy.toml", &callers.policy()),
        )
        .env("IDEMPOTENCY_RELOAD_INTERVAL", "100ms")
        .stdout(std::fs::File::create(&log).unwrap());
    let server = ServerProcess::start(command).await;
    let mut client = server.client();
    let newcomer = new_token();

    let status = client
        .claim(as_caller(&newcomer, claim_request("team-c", "k")))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);

    let grown = format!(
        "{}\n[[identity]]\nname = \"team-c\"\ntoken_hashes = [\"{}\"]\nnamespaces = [\"team-c\"]\n",
        callers.policy(),
        hash_token(&newcomer)
    );
    pki::write(dir.path(), "policy.toml", &grown);
    let admitted = eventually(Duration::from_secs(10), || {
        let mut client = client.clone();
        let newcomer = newcomer.clone();
        async move {
            client
                .claim(as_caller(&newcomer, claim_request("team-c", "k")))
                .await
                .ok()
        }
    })
    .await;
    assert!(admitted.is_some(), "the new identity was never admitted");

    // A broken file is refused; the last good policy stays in force.
    pki::write(dir.path(), "policy.toml", "[[identity]]\nname = 3\n");
    let refused = eventually(Duration::from_secs(10), || async {
        let text = std::fs::read_to_string(&log).ok()?;
        text.contains("the files changed but do not load")
            .then_some(())
    })
    .await;
    assert!(refused.is_some(), "the server never read the broken policy");
    let outcome = client
        .claim(as_caller(&newcomer, claim_request("team-c", "k2")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(outcome.outcome(), Outcome::Claimed);
}
