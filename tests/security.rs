//! Who may call and on what, over the wire: the access policy confines each
//! identity to its namespaces and RPCs (every RPC tried across the line, and
//! every record checked unchanged afterwards), credentials are required, TLS
//! refuses plaintext, mutual TLS refuses unknown, expired and foreign client
//! certificates, certificates and the policy reload when their files change,
//! and secrets stay out of logs and `--help`.

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use common::pki::{self, Ca};
use common::process::{self, ServerProcess};
use common::{
    Backend, Client, StoreFixture, TestServer, claim_request, complete_request, eventually,
    extend_request, get_request, release_request,
};
use idempotency_service::access::{hash_token, new_token};
use idempotency_service::config::Config;
use idempotency_service::grpc::proto::{self, Outcome};
use tempfile::TempDir;
use tonic::transport::Channel;
use tonic::{Code, Request};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

/// Three callers: `team-a` confined to its namespaces, `team-b` likewise, and
/// an operator with everything, Purge included.
struct Callers {
    a: String,
    b: String,
    operator: String,
}

impl Callers {
    fn new() -> Self {
        Self {
            a: new_token(),
            b: new_token(),
            operator: new_token(),
        }
    }

    fn policy(&self) -> String {
        format!(
            r#"
            [[identity]]
            name = "team-a"
            token_hashes = ["{}"]
            namespaces = ["team-a", "team-a/*"]

            [[identity]]
            name = "team-b"
            token_hashes = ["{}"]
            client_cert_cn = "team-b.internal"
            namespaces = ["team-b"]

            [[identity]]
            name = "operator"
            token_hashes = ["{}"]
            namespaces = ["*"]
            rpcs = ["*"]
            "#,
            hash_token(&self.a),
            hash_token(&self.b),
            hash_token(&self.operator),
        )
    }
}

/// `message` with `authorization: Bearer <token>`.
fn as_caller<T>(token: &str, message: T) -> Request<T> {
    let mut request = Request::new(message);
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    request
}

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

/// A TLS server (mutual TLS when `client_ca` is given) on the embedded store.
struct TlsSetup {
    dir: TempDir,
    ca: Ca,
    store: StoreFixture,
    server: TestServer,
}

async fn tls_server(
    client_ca: Option<&Ca>,
    client_auth: idempotency_service::tls::ClientAuth,
    policy: Option<String>,
) -> TlsSetup {
    let dir = TempDir::new().unwrap();
    let ca = Ca::new("server CA");
    let pair = ca.server();
    let store = StoreFixture::new(Backend::Sqlite).await;
    let mut config = store.config();
    config.tls_cert_file = Some(pki::write(dir.path(), "tls.crt", &pair.cert));
    config.tls_key_file = Some(pki::write(dir.path(), "tls.key", &pair.key));
    config.tls_client_ca_file = client_ca.map(|ca| pki::write(dir.path(), "ca.crt", &ca.pem()));
    config.tls_client_auth = client_auth;
    config.reload_interval = Duration::from_millis(100);
    if let Some(policy) = policy {
        config.policy_file = Some(pki::write(dir.path(), "policy.toml", &policy));
    }
    // The test client presents the one client certificate the CA issues
    // first (CN team-b.internal) when mutual TLS is on; health needs none.
    let ca_pem = ca.pem();
    let client_pair = client_ca.map(|ca| ca.client("team-b.internal"));
    let server = TestServer::start_with_channel(config, |addr| {
        pki::channel(addr, &ca_pem, client_pair.as_ref())
    })
    .await;
    TlsSetup {
        dir,
        ca,
        store,
        server,
    }
}

async fn claim_over(
    channel: Channel,
    token: Option<&str>,
    key: &str,
) -> Result<Outcome, tonic::Status> {
    let mut client = Client::new(channel);
    let request = match token {
        Some(token) => as_caller(token, claim_request("team-b", key)),
        None => Request::new(claim_request("team-b", key)),
    };
    client
        .claim(request)
        .await
        .map(|r| r.into_inner().outcome())
}

/// The call failed in the transport (a refused handshake, a closed
/// connection), not with a status the service sent: with TLS 1.3 the client
/// learns of a refused certificate at its first request (UNKNOWN) or before
/// (UNAVAILABLE).
fn assert_refused_by_transport(result: Result<Outcome, tonic::Status>, what: &str) {
    let status = result.expect_err(what);
    assert!(
        matches!(status.code(), Code::Unavailable | Code::Unknown),
        "{what}: {status:?}"
    );
    assert!(
        std::error::Error::source(&status).is_some(),
        "{what}: a status from the server, not a transport failure: {status:?}"
    );
}

fn plaintext(addr: std::net::SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy()
}

#[tokio::test]
async fn with_tls_on_plaintext_is_refused_and_tls_works() {
    let setup = tls_server(None, idempotency_service::tls::ClientAuth::Required, None).await;
    let addr = setup.server.addr;

    assert_refused_by_transport(
        claim_over(plaintext(addr), None, "plain").await,
        "plaintext",
    );
    let mut health = HealthClient::new(plaintext(addr));
    assert!(health.check(HealthCheckRequest::default()).await.is_err());

    // A client that does not trust the server's CA refuses the server.
    let stranger = Ca::new("another CA");
    assert_refused_by_transport(
        claim_over(pki::channel(addr, &stranger.pem(), None), None, "x").await,
        "untrusted server",
    );

    let outcome = claim_over(pki::channel(addr, &setup.ca.pem(), None), None, "tls")
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Claimed);
    assert_eq!(setup.store.row_count().await, 1);
}

#[tokio::test]
async fn mutual_tls_admits_the_policys_certificates_only() {
    let callers = Callers::new();
    let client_ca = Ca::new("client CA");
    let setup = tls_server(
        Some(&client_ca),
        idempotency_service::tls::ClientAuth::Required,
        Some(callers.policy()),
    )
    .await;
    let addr = setup.server.addr;
    let server_ca = setup.ca.pem();

    // The certificate's CN is team-b's identity: team-b's namespace works.
    let good = client_ca.client("team-b.internal");
    let outcome = claim_over(pki::channel(addr, &server_ca, Some(&good)), None, "cert")
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Claimed);

    // Refused at the handshake: no certificate, an expired one, one from
    // another CA (even with the right CN).
    let expired = client_ca.expired_client("team-b.internal");
    let foreign = Ca::new("rogue CA").client("team-b.internal");
    for (what, pair) in [
        ("none", None),
        ("expired", Some(&expired)),
        ("foreign", Some(&foreign)),
    ] {
        assert_refused_by_transport(
            claim_over(pki::channel(addr, &server_ca, pair), None, what).await,
            what,
        );
    }
    // A valid certificate whose CN the policy does not name: UNAUTHENTICATED.
    let unknown = client_ca.client("nobody.internal");
    let status = claim_over(
        pki::channel(addr, &server_ca, Some(&unknown)),
        None,
        "unknown",
    )
    .await
    .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    assert_eq!(setup.store.row_count().await, 1);
}

#[tokio::test]
async fn with_optional_client_certificates_a_token_is_enough() {
    let callers = Callers::new();
    let client_ca = Ca::new("client CA");
    let setup = tls_server(
        Some(&client_ca),
        idempotency_service::tls::ClientAuth::Optional,
        Some(callers.policy()),
    )
    .await;
    let addr = setup.server.addr;
    let server_ca = setup.ca.pem();
    let outcome = claim_over(
        pki::channel(addr, &server_ca, None),
        Some(&callers.b),
        "token",
    )
    .await
    .unwrap();
    assert_eq!(outcome, Outcome::Claimed);
    let status = claim_over(pki::channel(addr, &server_ca, None), None, "neither")
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    // A presented certificate must still verify.
    let expired = client_ca.expired_client("team-b.internal");
    assert_refused_by_transport(
        claim_over(
            pki::channel(addr, &server_ca, Some(&expired)),
            Some(&callers.b),
            "expired",
        )
        .await,
        "expired",
    );
}

#[tokio::test]
async fn a_rotated_certificate_is_served_without_a_restart() {
    let setup = tls_server(None, idempotency_service::tls::ClientAuth::Required, None).await;
    let addr = setup.server.addr;
    let next_ca = Ca::new("next CA");
    let next = next_ca.server();
    // As cert-manager and the kubelet do: new files swapped in.
    pki::write(setup.dir.path(), "tls.key", &next.key);
    pki::write(setup.dir.path(), "tls.crt", &next.cert);

    let rotated = eventually(Duration::from_secs(10), || async {
        claim_over(pki::channel(addr, &next_ca.pem(), None), None, "rotated")
            .await
            .ok()
    })
    .await;
    assert_eq!(rotated, Some(Outcome::Claimed));
    // New connections no longer get the old certificate.
    assert_refused_by_transport(
        claim_over(pki::channel(addr, &setup.ca.pem(), None), None, "old").await,
        "the old CA",
    );
}

#[tokio::test]
async fn a_plaintext_health_port_serves_probes_while_the_main_port_needs_tls() {
    let dir = TempDir::new().unwrap();
    let ca = Ca::new("server CA");
    let pair = ca.server();
    let store = StoreFixture::new(Backend::Sqlite).await;
    let health_port = process::free_port();
    let mut config = store.config();
    config.tls_cert_file = Some(pki::write(dir.path(), "tls.crt", &pair.cert));
    config.tls_key_file = Some(pki::write(dir.path(), "tls.key", &pair.key));
    config.health_listen_addr = format!("127.0.0.1:{health_port}");
    let ca_pem = ca.pem();
    let _server =
        TestServer::start_with_channel(config, |addr| pki::channel(addr, &ca_pem, None)).await;
    let probe = plaintext(format!("127.0.0.1:{health_port}").parse().unwrap());
    let mut health = HealthClient::new(probe.clone());
    for service in ["", "liveness", "idempotency.v1.IdempotencyService"] {
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status();
        assert_eq!(
            status,
            tonic_health::pb::health_check_response::ServingStatus::Serving,
            "{service:?}"
        );
    }
    // Only health: the service itself is not on the probe port.
    let status = claim_over(probe, None, "k").await.unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented);
}

#[tokio::test]
async fn a_bad_tls_or_policy_file_stops_the_start_naming_it() {
    let dir = TempDir::new().unwrap();
    let store = StoreFixture::new(Backend::Sqlite).await;
    type Tweak<'a> = Box<dyn Fn(&mut Config) + 'a>;
    let cases: Vec<(Tweak, &str)> = vec![
        (
            Box::new(|c: &mut Config| {
                c.tls_cert_file = Some(pki::write(dir.path(), "bad.crt", "not a certificate"));
                c.tls_key_file = Some(pki::write(dir.path(), "bad.key", "not a key"));
            }),
            "IDEMPOTENCY_TLS_CERT_FILE=",
        ),
        (
            Box::new(|c: &mut Config| {
                c.policy_file = Some(pki::write(
                    dir.path(),
                    "bad.toml",
                    "[[identity]]\nname = \"x\"\nnamespaces = [\"a\"]\n",
                ));
            }),
            "needs token_hashes or client_cert_cn",
        ),
        (
            Box::new(|c: &mut Config| c.policy_file = Some(dir.path().join("missing.toml"))),
            "missing.toml",
        ),
    ];
    for (tweak, expected) in cases {
        let mut config = store.config();
        tweak(&mut config);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let error = idempotency_service::server::run(config, listener, std::future::pending())
            .await
            .unwrap_err();
        let error = format!("{error:#}");
        assert!(error.contains(expected), "{error}");
    }
}

#[tokio::test]
async fn no_database_password_reaches_logs_help_or_errors() {
    let dir = TempDir::new().unwrap();
    let secret = "s3cr3t-Pa55word";
    let url = format!(
        "postgres://app:{secret}@127.0.0.1:{}/db",
        process::free_port()
    );
    let url_file = pki::write(dir.path(), "database-url", &format!("{url}\n"));

    let run = |configure: &dyn Fn(&mut std::process::Command)| {
        let mut command = process::command(dir.path());
        command.stdout(Stdio::piped()).stderr(Stdio::piped());
        command.env("IDEMPOTENCY_DB_TIMEOUT", "1s");
        configure(&mut command);
        let output = command.output().unwrap();
        (
            output.status,
            String::from_utf8_lossy(&output.stdout).into_owned()
                + &String::from_utf8_lossy(&output.stderr),
        )
    };
    type Configure<'a> = &'a dyn Fn(&mut std::process::Command);
    let cases: [(&str, Configure); 4] = [
        ("serve with DATABASE_URL", &|c| {
            c.env("DATABASE_URL", &url);
        }),
        ("serve with DATABASE_URL_FILE", &|c| {
            c.env("DATABASE_URL_FILE", &url_file);
        }),
        ("migrate", &|c| {
            c.env("DATABASE_URL", &url).arg("migrate");
        }),
        ("--help", &|c| {
            c.env("DATABASE_URL", &url).arg("--help");
        }),
    ];
    for (what, configure) in cases {
        let (status, output) = run(configure);
        assert!(
            !output.contains(secret),
            "{what} printed the password:\n{output}"
        );
        if what == "--help" {
            assert!(status.success());
            assert!(output.contains("DATABASE_URL_FILE"), "{output}");
        } else {
            assert!(
                !status.success(),
                "{what} should fail: nothing listens there"
            );
            assert!(!output.is_empty(), "{what} should say why it failed");
        }
    }
}

#[tokio::test]
async fn the_token_command_prints_a_token_and_the_hash_the_policy_holds() {
    let dir = TempDir::new().unwrap();
    let output = process::command(dir.path())
        .arg("token")
        .stdout(Stdio::piped())
        .output()
        .unwrap();
    assert!(output.status.success());
    let text = String::from_utf8(output.stdout).unwrap();
    let mut lines = text.lines();
    let token = lines
        .next()
        .unwrap()
        .strip_prefix("token:  ")
        .unwrap()
        .to_owned();
    let policy_line = lines.next().unwrap();
    assert_eq!(
        policy_line,
        format!("policy: token_hashes = [\"{}\"]", hash_token(&token))
    );
    assert!(token.starts_with("idem_") && token.len() == 69, "{token}");

    let mut child = process::command(dir.path())
        .args(["token", "--hash"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(format!("{token}\n").as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert_eq!(
        String::from_utf8(output.stdout).unwrap(),
        format!("{}\n", hash_token(&token))
    );
}

#[tokio::test]
async fn the_binary_serves_tls_with_a_policy_from_its_environment() {
    let dir = TempDir::new().unwrap();
    let ca = Ca::new("server CA");
    let pair = ca.server();
    let callers = Callers::new();
    let health_port = process::free_port();
    let mut command = process::command(dir.path());
    command
        .env(
            "IDEMPOTENCY_TLS_CERT_FILE",
            pki::write(dir.path(), "tls.crt", &pair.cert),
        )
        .env(
            "IDEMPOTENCY_TLS_KEY_FILE",
            pki::write(dir.path(), "tls.key", &pair.key),
        )
        .env(
            "IDEMPOTENCY_POLICY_FILE",
            pki::write(dir.path(), "policy.toml", &callers.policy()),
        )
        .env(
            "IDEMPOTENCY_HEALTH_LISTEN_ADDR",
            format!("127.0.0.1:{health_port}"),
        );
    let server = ServerProcess::start_probing(command, health_port).await;
    let addr = format!("127.0.0.1:{}", server.port).parse().unwrap();
    let outcome = claim_over(pki::channel(addr, &ca.pem(), None), Some(&callers.b), "k")
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Claimed);
    let status = claim_over(pki::channel(addr, &ca.pem(), None), None, "k")
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    assert!(server.terminate().await.success());
}
