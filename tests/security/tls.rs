//! TLS: plaintext refused, mutual TLS admitting the policy's certificates
//! only (not unknown, expired or foreign ones), a token enough when client
//! certificates are optional, a rotated certificate served without a restart,
//! a plaintext health port, the binary configured from its environment, and a
//! TLS or policy file that does not load stopping the start.

use std::time::Duration;

use idempotency_service::config::Config;
use idempotency_service::grpc::proto::Outcome;
use tempfile::TempDir;
use tonic::transport::Channel;
use tonic::{Code, Request};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

use crate::common::pki::{self, Ca};
use crate::common::process::{self, ServerProcess};
use crate::common::{Backend, Client, StoreFixture, TestServer, claim_request, eventually};
use crate::{Callers, as_caller};

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
