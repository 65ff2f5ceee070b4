//! The binary as operators run it: no arguments, the `migrate` subcommand,
//! SIGTERM, and a kill -9 right after Complete returned (nothing lost), on
//! both stores.

mod common;

use common::process::{ServerProcess, command, free_port, store_command};
use common::{Backend, StoreFixture, claim, claim_request, complete, outcome};
use idempotency_service::grpc::proto::Outcome;

async fn a_completed_record_survives_a_kill_9_right_after_complete(backend: Backend) {
    let store = StoreFixture::new(backend).await;
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(store_command(&store, dir.path())).await;
    let mut client = server.client();
    let mut tokens = Vec::new();
    for i in 0..20 {
        let claimed = claim(&mut client, "ns", &format!("evt-{i}")).await;
        complete(
            &mut client,
            "ns",
            &format!("evt-{i}"),
            &claimed.lease_token,
            format!("result-{i}").as_bytes(),
        )
        .await;
        tokens.push(claimed.lease_token);
    }
    // No shutdown code runs: whatever Complete acknowledged must be on disk.
    server.kill_hard();

    let server = ServerProcess::start(store_command(&store, dir.path())).await;
    let mut client = server.client();
    for i in 0..20 {
        let replay = claim(&mut client, "ns", &format!("evt-{i}")).await;
        assert_eq!(outcome(&replay), Outcome::Completed, "evt-{i} was lost");
        assert_eq!(replay.response, format!("result-{i}").into_bytes());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_keeps_a_completed_record_through_a_kill_9() {
    a_completed_record_survives_a_kill_9_right_after_complete(Backend::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_keeps_a_completed_record_through_a_kill_9() {
    a_completed_record_survives_a_kill_9_right_after_complete(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_arguments_it_serves_the_embedded_store_in_data() {
    let dir = tempfile::tempdir().unwrap();
    let mut bare = command(dir.path());
    // Everything at its default but the ports, which parallel tests share.
    bare.env(
        "IDEMPOTENCY_METRICS_ADDR",
        format!("127.0.0.1:{}", free_port()),
    );
    let server = ServerProcess::start(bare).await;
    let mut client = server.client();
    let claimed = claim(&mut client, "ns", "k").await;
    assert_eq!(outcome(&claimed), Outcome::Claimed);
    assert!(dir.path().join("data/idempotency.db").is_file());
    let status = server.terminate().await;
    assert!(status.success(), "exit status {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_and_exits_zero_on_postgres() {
    let store = StoreFixture::new(Backend::Postgres).await;
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(store_command(&store, dir.path())).await;
    let port = server.port;
    let status = server.terminate().await;
    assert_eq!(status.code(), Some(0));
    // Stopped accepting: nothing listens on the port any more.
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_applies_the_schema_and_exits_so_servers_can_skip_it() {
    for backend in [Backend::Postgres, Backend::Sqlite] {
        let store = StoreFixture::new(backend).await;
        let dir = tempfile::tempdir().unwrap();
        let status = store_command(&store, dir.path())
            .arg("migrate")
            .status()
            .unwrap();
        assert!(status.success(), "{backend:?}: migrate exited {status:?}");
        // Twice is fine: migrations are applied once.
        let status = store_command(&store, dir.path())
            .arg("migrate")
            .status()
            .unwrap();
        assert!(status.success());
        assert_eq!(store.row_count().await, 0);
        let mut serve = store_command(&store, dir.path());
        serve.env("IDEMPOTENCY_RUN_MIGRATIONS", "false");
        let server = ServerProcess::start(serve).await;
        let claimed = server
            .client()
            .claim(claim_request("ns", "k"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(outcome(&claimed), Outcome::Claimed, "{backend:?}");
    }
}

#[test]
fn an_unsupported_database_url_is_refused_at_start_without_echoing_it() {
    let dir = tempfile::tempdir().unwrap();
    let output = command(dir.path())
        .env("DATABASE_URL", "mysql://user:hunter2@db/x")
        .env("IDEMPOTENCY_LISTEN_ADDR", "127.0.0.1:0")
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .output()
        .unwrap();
    assert!(!output.status.success());
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(text.contains("DATABASE_URL"), "{text}");
    assert!(!text.contains("hunter2"), "the password leaked: {text}");
}
