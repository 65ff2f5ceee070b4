//! Starting the real binary when something is wrong: each failure stops the
//! start with a non-zero exit code and exactly one line on stderr that names
//! the setting to change and its address or path (a port in use, a database
//! that cannot be reached or refuses, a data directory that cannot be
//! created, TLS and policy files that do not load), never the database
//! password. And two replicas on one host against one PostgreSQL with only
//! their gRPC addresses changed: both start, the second's metrics moved off
//! the default port it finds taken (README: configuration,
//! `IDEMPOTENCY_METRICS_ADDR`).
//!
//! Ports are taken by binding 127.0.0.1:0 here; no test uses a fixed port but
//! the two-replica test, whose point is the default metrics port.

mod common;

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::process::{ServerProcess, command, free_port, output_within, scrape};
use common::{Backend, StoreFixture, claim_request, outcome, pki, postgres_admin_url};
use idempotency_service::config::Config;
use idempotency_service::grpc::proto::Outcome;

const PASSWORD: &str = "hunter2-Zq7";

/// A port held by this test for as long as the listener lives.
fn taken() -> (TcpListener, SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    (listener, addr)
}

/// The binary in `dir` on a free gRPC port, metrics off, SQLite in `dir`.
fn server(dir: &Path) -> Command {
    let mut command = command(dir);
    command.env(
        "IDEMPOTENCY_LISTEN_ADDR",
        format!("127.0.0.1:{}", free_port()),
    );
    command
}

/// Runs a start that must fail: a non-zero exit and exactly one non-empty
/// line on stderr, which is returned. Stdout (the log) must not hold the
/// password either.
fn refused(command: Command) -> String {
    let output = output_within(command, Duration::from_secs(30));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "the start did not fail: {:?}\nstderr: {stderr}",
        output.status
    );
    assert!(
        !stdout.contains(PASSWORD) && !stderr.contains(PASSWORD),
        "the password leaked:\n{stdout}\n{stderr}"
    );
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "stderr is not one line:\n{stderr}");
    lines[0].to_owned()
}

#[test]
fn the_grpc_port_in_use_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (_held, addr) = taken();
    let mut command = command(dir.path());
    command.env("IDEMPOTENCY_LISTEN_ADDR", addr.to_string());
    assert_eq!(
        refused(command),
        format!("error: IDEMPOTENCY_LISTEN_ADDR={addr} is in use; set another address")
    );
}

#[test]
fn the_metrics_port_in_use_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (_held, addr) = taken();
    let mut command = server(dir.path());
    command.env("IDEMPOTENCY_METRICS_ADDR", addr.to_string());
    assert_eq!(
        refused(command),
        format!(
            "error: IDEMPOTENCY_METRICS_ADDR={addr} is in use; set another address, or \"\" to turn metrics off"
        )
    );
}

#[test]
fn the_health_port_in_use_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (_held, addr) = taken();
    let mut command = server(dir.path());
    command.env("IDEMPOTENCY_HEALTH_LISTEN_ADDR", addr.to_string());
    assert_eq!(
        refused(command),
        format!(
            "error: IDEMPOTENCY_HEALTH_LISTEN_ADDR={addr} is in use; set another address, or \"\" to turn the health-only listener off"
        )
    );
}

#[test]
fn an_unreachable_database_is_named_with_host_and_port_without_the_password() {
    let dir = tempfile::tempdir().unwrap();
    // Bound and released: nothing listens there.
    let closed = free_port();
    let mut command = server(dir.path());
    command.env(
        "DATABASE_URL",
        format!("postgres://app:{PASSWORD}@127.0.0.1:{closed}/db"),
    );
    // A refused connection is retried until the timeout (the database may be
    // starting): keep it short.
    command.env("IDEMPOTENCY_DB_TIMEOUT", "1s");
    assert_eq!(
        refused(command),
        format!(
            "error: DATABASE_URL: cannot connect to PostgreSQL at 127.0.0.1:{closed}: connection refused"
        )
    );
}

#[test]
fn a_database_that_refuses_the_role_is_named_without_the_password() {
    let dir = tempfile::tempdir().unwrap();
    let admin: sqlx::postgres::PgConnectOptions = postgres_admin_url().parse().unwrap();
    let server_addr = format!("{}:{}", admin.get_host(), admin.get_port());
    let mut command = server(dir.path());
    command.env(
        "DATABASE_URL",
        format!("postgres://no_such_role_x7:{PASSWORD}@{server_addr}/postgres"),
    );
    let line = refused(command);
    // With trust authentication PostgreSQL says the role does not exist; with
    // passwords, that authentication failed. Both name the user.
    let prefix =
        format!("error: DATABASE_URL: PostgreSQL at {server_addr} refused the connection: ");
    assert!(line.starts_with(&prefix), "{line}");
    assert!(line.contains("no_such_role_x7"), "{line}");
}

#[test]
fn a_data_directory_that_cannot_be_created_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let file = pki::write(dir.path(), "a-file", "not a folder");
    let data = file.join("data");
    let mut command = server(dir.path());
    command.env("IDEMPOTENCY_DATA_DIR", &data);
    let data = data.display();
    assert_eq!(
        refused(command),
        format!(
            "error: IDEMPOTENCY_DATA_DIR={data}: cannot create the folder {data}: Not a directory (os error 20)"
        )
    );
}

#[test]
fn a_data_directory_where_the_database_cannot_be_created_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    // Root may write anywhere, so take the file's name with a folder instead
    // of taking the folder's permissions.
    std::fs::create_dir_all(data.join("idempotency.db")).unwrap();
    let mut command = server(dir.path());
    command.env("IDEMPOTENCY_DATA_DIR", &data);
    let file = data.join("idempotency.db");
    assert_eq!(
        refused(command),
        format!(
            "error: IDEMPOTENCY_DATA_DIR={}: cannot open or create the SQLite file {} (its folder must be writable): unable to open database file",
            data.display(),
            file.display()
        )
    );
}

#[test]
fn a_missing_tls_certificate_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let cert = dir.path().join("missing.crt");
    let mut command = server(dir.path());
    command.env("IDEMPOTENCY_TLS_CERT_FILE", &cert);
    command.env("IDEMPOTENCY_TLS_KEY_FILE", dir.path().join("missing.key"));
    assert_eq!(
        refused(command),
        format!(
            "error: IDEMPOTENCY_TLS_CERT_FILE={}: cannot read: No such file or directory (os error 2)",
            cert.display()
        )
    );
}

#[test]
fn tls_files_that_do_not_load_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let pair = pki::Ca::new("test CA").server();
    let good_cert = pki::write(dir.path(), "good.crt", &pair.cert);
    let bad_cert = pki::write(dir.path(), "bad.crt", "not a certificate");
    let bad_key = pki::write(dir.path(), "bad.key", "not a key");

    let mut command = server(dir.path());
    command.env("IDEMPOTENCY_TLS_CERT_FILE", &bad_cert);
    command.env("IDEMPOTENCY_TLS_KEY_FILE", &bad_key);
    assert_eq!(
        refused(command),
        format!(
            "error: IDEMPOTENCY_TLS_CERT_FILE={} holds no PEM certificate",
            bad_cert.display()
        )
    );

    let mut command = server(dir.path());
    command.env("IDEMPOTENCY_TLS_CERT_FILE", &good_cert);
    command.env("IDEMPOTENCY_TLS_KEY_FILE", &bad_key);
    let line = refused(command);
    let prefix = format!(
        "error: IDEMPOTENCY_TLS_KEY_FILE={} holds no PEM private key",
        bad_key.display()
    );
    assert!(line.starts_with(&prefix), "{line}");
}

#[test]
fn a_missing_policy_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("missing.toml");
    let mut command = server(dir.path());
    command.env("IDEMPOTENCY_POLICY_FILE", &policy);
    assert_eq!(
        refused(command),
        format!(
            "error: IDEMPOTENCY_POLICY_FILE={}: cannot read: No such file or directory (os error 2)",
            policy.display()
        )
    );
}

#[test]
fn a_policy_file_that_does_not_load_is_named() {
    let dir = tempfile::tempdir().unwrap();
    // Not TOML: toml's own message spans several lines, quoting the input.
    let broken = pki::write(dir.path(), "broken.toml", "[[identity]]\nname = = \"x\"\n");
    let mut command = server(dir.path());
    command.env("IDEMPOTENCY_POLICY_FILE", &broken);
    let line = refused(command);
    let prefix = format!(
        "error: IDEMPOTENCY_POLICY_FILE={}: line 2, column ",
        broken.display()
    );
    assert!(line.starts_with(&prefix), "{line}");

    // TOML, but not a policy.
    let wrong = pki::write(
        dir.path(),
        "wrong.toml",
        "[[identity]]\nname = \"x\"\nnamespaces = [\"a\"]\n",
    );
    let mut command = server(dir.path());
    command.env("IDEMPOTENCY_POLICY_FILE", &wrong);
    assert_eq!(
        refused(command),
        format!(
            "error: IDEMPOTENCY_POLICY_FILE={}: identity \"x\": needs token_hashes or client_cert_cn",
            wrong.display()
        )
    );
}

/// Two replicas on one host, one PostgreSQL, only the gRPC address changed:
/// the metrics setting stays at its default, which one process can hold.
/// Both start: the first takes the default port (unless another process on
/// this machine holds it already), the second finds it taken, serves its
/// metrics on a free port and logs which. Both serve one table. An address
/// set explicitly is strict (`the_metrics_port_in_use_is_named`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_one_host_both_start_with_the_default_metrics_setting() {
    let store = StoreFixture::new(Backend::Postgres).await;
    let dir = tempfile::tempdir().unwrap();
    let default: SocketAddr = Config::defaults().metrics_addr.parse().unwrap();
    let replica = |log: &str| {
        let mut command = command(dir.path());
        command.env("DATABASE_URL", store.database_url.as_ref().unwrap());
        // The default metrics setting, as a user starting two replicas has it.
        command.env_remove("IDEMPOTENCY_METRICS_ADDR");
        command.env("IDEMPOTENCY_LOG_FORMAT", "json");
        command.stdout(std::fs::File::create(dir.path().join(log)).unwrap());
        command
    };
    // Whether another process on this machine already holds the default.
    let held_before = TcpListener::bind(("127.0.0.1", default.port())).is_err();

    let first = ServerProcess::start(replica("first.log")).await;
    let second = ServerProcess::start(replica("second.log")).await;

    let port_of = |log: &str| -> u16 {
        let text = std::fs::read_to_string(dir.path().join(log)).unwrap();
        let line = text
            .lines()
            .find(|l| l.contains("IDEMPOTENCY_METRICS_ADDR is not set and its default is in use"));
        match line {
            None => default.port(),
            // JSON: "free":"0.0.0.0:41234"
            Some(line) => {
                let (_, after) = line.split_once("\"free\":\"").expect(line);
                let (addr, _) = after.split_once('"').expect(line);
                addr.parse::<SocketAddr>().expect(line).port()
            }
        }
    };
    let first_port = port_of("first.log");
    let second_port = port_of("second.log");
    if held_before {
        eprintln!("another process holds {default}: both replicas gave way");
        assert_ne!(first_port, default.port());
    } else {
        assert_eq!(first_port, default.port());
    }
    assert_ne!(
        second_port,
        default.port(),
        "the second replica did not give way"
    );
    assert_ne!(second_port, first_port);
    for port in [first_port, second_port] {
        let metrics = scrape(port).await;
        assert_eq!(
            metrics.get("idempotency_store_up"),
            Some(&1.0),
            "port {port}: {metrics:?}"
        );
    }

    // One table behind both.
    let claimed = first
        .client()
        .claim(claim_request("ns", "evt"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(outcome(&claimed), Outcome::Claimed);
    let duplicate = second
        .client()
        .claim(claim_request("ns", "evt"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(outcome(&duplicate), Outcome::InProgress);
}

/// A stand-in for a PostgreSQL server that offers TLS with a self-signed
/// X.509 version 1 certificate, as Citus's `CREATE EXTENSION` sets up: it
/// answers the client's SSLRequest with `S`, then shakes hands with that
/// certificate (served as it is: rustls checks no certificate it serves).
fn v1_certificate_server(dir: &Path) -> SocketAddr {
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

    let openssl = |args: &[&str]| {
        let status = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl (the clients' TLS tests need it too)");
        assert!(status.status.success(), "openssl {args:?} failed");
    };
    openssl(&[
        "req",
        "-new",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-keyout",
        "key.pem",
        "-out",
        "req.csr",
        "-subj",
        "/CN=localhost",
    ]);
    // `x509 -req` with no extensions makes a version 1 certificate.
    openssl(&[
        "x509", "-req", "-in", "req.csr", "-signkey", "key.pem", "-days", "1", "-outform", "DER",
        "-out", "cert.der",
    ]);
    openssl(&[
        "pkcs8", "-topk8", "-nocrypt", "-in", "key.pem", "-outform", "DER", "-out", "key.der",
    ]);
    let cert = CertificateDer::from(std::fs::read(dir.join("cert.der")).unwrap());
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(
        std::fs::read(dir.join("key.der")).unwrap(),
    ));
    let signing = rustls::crypto::ring::sign::any_supported_type(&key).unwrap();
    let certified = Arc::new(rustls::sign::CertifiedKey::new(vec![cert], signing));

    #[derive(Debug)]
    struct Always(Arc<rustls::sign::CertifiedKey>);
    impl rustls::server::ResolvesServerCert for Always {
        fn resolve(
            &self,
            _: rustls::server::ClientHello<'_>,
        ) -> Option<Arc<rustls::sign::CertifiedKey>> {
            Some(self.0.clone())
        }
    }
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_cert_resolver(Arc::new(Always(certified)));
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));

    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            loop {
                let Ok((mut socket, _)) = listener.accept().await else {
                    return;
                };
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let mut request = [0u8; 8];
                    if socket.read_exact(&mut request).await.is_err() {
                        return;
                    }
                    let _ = socket.write_all(b"S").await;
                    let _ = acceptor.accept(socket).await;
                });
            }
        });
    });
    addr
}

#[test]
fn a_server_certificate_that_cannot_be_read_names_the_sslmode_and_the_choices() {
    let dir = tempfile::tempdir().unwrap();
    let addr = v1_certificate_server(dir.path());
    let mut command = server(dir.path());
    command.env(
        "DATABASE_URL",
        format!("postgres://app:{PASSWORD}@{addr}/db"),
    );
    command.env("IDEMPOTENCY_DB_TIMEOUT", "5s");
    let line = refused(command);
    let head =
        format!("error: DATABASE_URL: TLS with PostgreSQL at {addr} failed under sslmode=prefer: ");
    assert!(line.starts_with(&head), "{line}");
    assert!(line.contains("UnsupportedCertVersion"), "{line}");
    for choice in [
        "add sslmode=disable to DATABASE_URL",
        "sslmode=verify-full with sslrootcert=",
        "give the server a proper v3 certificate",
    ] {
        assert!(line.contains(choice), "{choice:?} missing from: {line}");
    }
}
