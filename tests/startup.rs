//! Starting the real binary when something is wrong: each failure stops the
//! start with a non-zero exit code and exactly one line on stderr that names
//! the setting to change and its address or path (a port in use, a database
//! that cannot be reached or refuses, a data directory that cannot be
//! created, TLS and policy files that do not load), never the database
//! password. And two replicas on one host against one PostgreSQL with only
//! their gRPC addresses changed: the second refuses the default metrics port
//! with that one line (README: configuration, `IDEMPOTENCY_METRICS_ADDR`).
//!
//! Ports are taken by binding 127.0.0.1:0 here; no test uses a fixed port but
//! the two-replica test, whose point is the default metrics port.

mod common;

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::process::{ServerProcess, command, free_port, output_within};
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
/// The first takes it and serves; the second stops with the one line that
/// says what to do. If another process on this machine already holds the
/// default port, the first refuses with the same line, and so does the
/// second: the assertion is the same either way. Then the way out: a
/// replica with metrics off starts beside the first, on the same table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_replica_on_one_host_refuses_the_default_metrics_port_in_one_line() {
    let store = StoreFixture::new(Backend::Postgres).await;
    let dir = tempfile::tempdir().unwrap();
    let default = Config::defaults().metrics_addr;
    let in_use = format!(
        "error: IDEMPOTENCY_METRICS_ADDR={default} is in use; set another address, or \"\" to turn metrics off"
    );
    let replica = || {
        let mut command = command(dir.path());
        command.env("DATABASE_URL", store.database_url.as_ref().unwrap());
        // The default metrics setting, as a user starting two replicas has it.
        command.env_remove("IDEMPOTENCY_METRICS_ADDR");
        command
    };
    let one_line = |(status, stderr): (std::process::ExitStatus, String)| {
        assert!(!status.success(), "{status:?}");
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines, [in_use.as_str()], "stderr: {stderr}");
    };

    let first = ServerProcess::start_or_exit(replica()).await;
    let second = ServerProcess::start_or_exit(replica()).await;
    let second = match second {
        Ok(_) => panic!("the second replica started on the metrics port of the first"),
        Err(exit) => exit,
    };
    one_line(second);
    let first = match first {
        Ok(first) => {
            // The first serves its metrics on the default port.
            let port = default.rsplit(':').next().unwrap().to_owned();
            let body = tokio::task::spawn_blocking(move || http_get(&port, "/metrics"))
                .await
                .unwrap();
            assert!(body.contains("idempotency_store_up 1"), "{body}");
            first
        }
        Err(exit) => {
            eprintln!("another process holds {default}: both replicas refused it");
            one_line(exit);
            let mut off = replica();
            off.env("IDEMPOTENCY_METRICS_ADDR", "");
            ServerProcess::start(off).await
        }
    };

    // The way out the line names: metrics off (or another address).
    let mut off = replica();
    off.env("IDEMPOTENCY_METRICS_ADDR", "");
    let other = ServerProcess::start(off).await;
    let claimed = first
        .client()
        .claim(claim_request("ns", "evt"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(outcome(&claimed), Outcome::Claimed);
    let duplicate = other
        .client()
        .claim(claim_request("ns", "evt"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(outcome(&duplicate), Outcome::InProgress);
}

/// The body of a plain HTTP/1.0 GET on the loopback.
fn http_get(port: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(format!("127.0.0.1:{port}")).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}
