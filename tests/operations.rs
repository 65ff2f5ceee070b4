//! What operators see: Prometheus metrics moving under a scripted load, the
//! per-call log line, and the command line's get, purge and stats against a
//! real database.

mod common;

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::Duration;

use common::process::{ServerProcess, free_port, scrape, store_command};
use common::{Backend, StoreFixture, claim, claim_request, complete, eventually, outcome, secs};
use idempotency_service::grpc::proto::{CompleteRequest, Outcome};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_counter_moves_under_a_scripted_load() {
    let store = StoreFixture::new(Backend::Postgres).await;
    let dir = tempfile::tempdir().unwrap();
    let metrics_port = free_port();
    let mut serve = store_command(&store, dir.path());
    serve
        .env(
            "IDEMPOTENCY_METRICS_ADDR",
            format!("127.0.0.1:{metrics_port}"),
        )
        .env("IDEMPOTENCY_METRICS_NAMESPACES", "payments")
        .env("IDEMPOTENCY_RECORDS_GAUGE_INTERVAL", "1s")
        .env("IDEMPOTENCY_REAPER_INTERVAL", "200ms");
    let server = ServerProcess::start(serve).await;
    let mut client = server.client();

    // claimed, in_progress, completed (replay), fingerprint_mismatch, a
    // retried Claim, a lost lease, a takeover, an invalid argument, and a
    // completed record the reaper turns into a marker (a remembered key).
    let mut first = claim_request("payments", "a");
    first.fingerprint = b"A".to_vec();
    let a = client.claim(first).await.unwrap().into_inner();
    assert_eq!(
        outcome(&claim(&mut client, "payments", "a").await),
        Outcome::InProgress
    );
    let complete = |key: &str, token: &str, retention| CompleteRequest {
        namespace: "payments".into(),
        key: key.into(),
        lease_token: token.into(),
        response: b"r".to_vec(),
        retention,
    };
    client
        .complete(complete("a", &a.lease_token, None))
        .await
        .unwrap();
    assert_eq!(
        outcome(&claim(&mut client, "payments", "a").await),
        Outcome::Completed
    );
    let mut other = claim_request("payments", "a");
    other.fingerprint = b"B".to_vec();
    assert_eq!(
        outcome(&client.claim(other).await.unwrap().into_inner()),
        Outcome::FingerprintMismatch
    );
    let mut mine = claim_request("payments", "r");
    mine.lease_token = format!("{:032x}", 7u128);
    assert!(
        !client
            .claim(mine.clone())
            .await
            .unwrap()
            .into_inner()
            .retried
    );
    assert!(client.claim(mine).await.unwrap().into_inner().retried);
    let mut short = claim_request("orders", "b");
    short.lease_ttl = secs(1);
    let dying = client.claim(short).await.unwrap().into_inner();
    let taken = eventually(Duration::from_secs(10), || {
        let mut client = client.clone();
        async move {
            let c = client
                .claim(claim_request("orders", "b"))
                .await
                .ok()?
                .into_inner();
            (outcome(&c) == Outcome::Claimed).then_some(c)
        }
    })
    .await
    .unwrap();
    let lost = client
        .complete(CompleteRequest {
            namespace: "orders".into(),
            ..complete("b", &dying.lease_token, None)
        })
        .await
        .unwrap_err();
    assert_eq!(lost.code(), tonic::Code::FailedPrecondition);
    client
        .complete(CompleteRequest {
            namespace: "orders".into(),
            ..complete("b", &taken.lease_token, secs(1))
        })
        .await
        .unwrap();
    assert_eq!(
        client
            .claim(claim_request("", "x"))
            .await
            .unwrap_err()
            .code(),
        tonic::Code::InvalidArgument
    );

    let metrics = eventually(Duration::from_secs(15), || async {
        let m = scrape(metrics_port).await;
        let reaped = m
            .get("idempotency_reaper_remembered_total")
            .copied()
            .unwrap_or(0.0)
            >= 1.0;
        let counted = m.get("idempotency_records{state=\"completed\"}") == Some(&1.0)
            && m.get("idempotency_records{state=\"remembered\"}") == Some(&1.0);
        (reaped && counted).then_some(m)
    })
    .await
    .expect("the reaper made a marker of the expired record and the gauge counted both");
    let value = |name: &str| {
        metrics
            .get(name)
            .copied()
            .unwrap_or_else(|| panic!("{name} missing"))
    };
    assert_eq!(
        value("idempotency_claims_total{namespace=\"payments\",outcome=\"claimed\"}"),
        2.0
    );
    assert_eq!(
        value("idempotency_claims_total{namespace=\"payments\",outcome=\"retried\"}"),
        1.0
    );
    assert_eq!(
        value("idempotency_claims_total{namespace=\"payments\",outcome=\"in_progress\"}"),
        1.0
    );
    assert_eq!(
        value("idempotency_claims_total{namespace=\"payments\",outcome=\"completed\"}"),
        1.0
    );
    assert_eq!(
        value("idempotency_claims_total{namespace=\"payments\",outcome=\"fingerprint_mismatch\"}"),
        1.0
    );
    assert!(value("idempotency_claims_total{namespace=\"other\",outcome=\"claimed\"}") >= 2.0);
    assert_eq!(
        value("idempotency_lease_takeovers_total{namespace=\"other\"}"),
        1.0
    );
    assert_eq!(
        value("idempotency_lease_lost_total{namespace=\"other\",method=\"Complete\"}"),
        1.0
    );
    assert_eq!(
        value(
            "idempotency_calls_total{namespace=\"other\",method=\"Claim\",code=\"invalid_argument\"}"
        ),
        1.0
    );
    assert_eq!(
        value("idempotency_calls_total{namespace=\"payments\",method=\"Complete\",code=\"ok\"}"),
        1.0
    );
    assert!(value("idempotency_call_duration_seconds_count{method=\"Claim\"}") >= 7.0);
    assert!(value("idempotency_reaper_runs_total{result=\"ok\"}") >= 1.0);
    assert_eq!(
        value("idempotency_errors_total{method=\"Claim\",reason=\"INVALID_ARGUMENT\"}"),
        1.0
    );
    assert_eq!(
        value("idempotency_errors_total{method=\"Complete\",reason=\"LEASE_LOST\"}"),
        1.0
    );
    assert_eq!(value("idempotency_store_up"), 1.0);
    assert!(value("idempotency_db_pool_max") >= 1.0);
    assert!(metrics.contains_key("idempotency_db_pool_waiting"));
    assert!(metrics.contains_key("idempotency_db_pool_idle"));
    assert!(metrics.contains_key("idempotency_reaper_lag_seconds"));
    // Never a key in a label.
    assert!(
        metrics.keys().all(|name| !name.contains("key=")),
        "{metrics:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_call_logs_one_json_line_with_request_id_and_fencing_token_but_no_payload() {
    let store = StoreFixture::new(Backend::Sqlite).await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut serve = store_command(&store, dir.path());
    serve
        .env("IDEMPOTENCY_LISTEN_ADDR", format!("127.0.0.1:{port}"))
        .env("IDEMPOTENCY_LOG_FORMAT", "json")
        .stdout(Stdio::piped());
    let mut child = serve.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let channel = tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect_lazy();
    let mut client =
        idempotency_service::grpc::proto::idempotency_service_client::IdempotencyServiceClient::new(
            channel,
        );
    let claimed = eventually(Duration::from_secs(20), || {
        let mut client = client.clone();
        async move {
            let mut request = tonic::Request::new(claim_request("payments", "evt-1"));
            request
                .metadata_mut()
                .insert("x-request-id", "req-7f3a".parse().unwrap());
            client.claim(request).await.ok()
        }
    })
    .await
    .unwrap()
    .into_inner();
    complete(
        &mut client,
        "payments",
        "evt-1",
        &claimed.lease_token,
        b"SECRET-RESPONSE-BYTES",
    )
    .await;
    let mut lines = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < deadline
        && lines
            .iter()
            .filter(|l: &&String| l.contains("\"message\":\"call\""))
            .count()
            < 2
    {
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(100)) {
            lines.push(line);
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let calls: Vec<serde_json::Value> = lines
        .iter()
        .filter(|l| l.contains("\"message\":\"call\""))
        .map(|l| serde_json::from_str(l).expect("each log line is JSON"))
        .collect();
    let claim = calls
        .iter()
        .find(|c| c["method"] == "Claim" && c["request_id"] == "req-7f3a")
        .expect("the Claim's line");
    assert_eq!(claim["namespace"], "payments");
    assert_eq!(claim["outcome"], "claimed");
    assert_eq!(claim["fencing_token"], 1);
    assert!(claim["latency_us"].is_u64());
    let all = lines.join("\n");
    assert!(
        !all.contains("SECRET-RESPONSE-BYTES"),
        "response bytes in the log"
    );
    assert!(
        !all.contains(&claimed.lease_token),
        "lease token in the log"
    );
}

async fn the_command_line_gets_purges_and_counts(backend: Backend) {
    let store = StoreFixture::new(backend).await;
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(store_command(&store, dir.path())).await;
    let mut client = server.client();
    for key in ["a", "b"] {
        let claimed = claim(&mut client, "shop", key).await;
        complete(
            &mut client,
            "shop",
            key,
            &claimed.lease_token,
            b"{\"ok\":true}",
        )
        .await;
    }
    client.claim(claim_request("mail", "c")).await.unwrap();

    let run = |args: &[&str]| {
        let output = store_command(&store, dir.path())
            .args(args)
            .stdout(Stdio::piped())
            .output()
            .unwrap();
        assert!(output.status.success(), "{args:?}: {output:?}");
        String::from_utf8(output.stdout).unwrap()
    };
    let got = run(&["get", "shop", "a"]);
    assert!(got.contains("state: completed\n"), "{got}");
    assert!(got.contains("fencing_token: 1\n"), "{got}");
    assert!(got.contains("response: {\"ok\":true}\n"), "{got}");
    let stats = run(&["stats"]);
    assert!(
        stats.contains(
            "records: in_progress 1 completed 2 released 0 expired (awaiting the reaper) 0"
        ),
        "{stats}"
    );
    assert!(stats.contains("reaper lag: 0s"), "{stats}");
    assert!(
        stats
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["shop", "completed", "2"]),
        "{stats}"
    );
    assert!(
        stats
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["mail", "in_progress", "1"]),
        "{stats}"
    );
    // Replays of "a", so that the running server may hold it in memory.
    for _ in 0..3 {
        let replay = claim(&mut client, "shop", "a").await;
        assert_eq!(outcome(&replay), Outcome::Completed);
    }
    let purged = run(&["purge", "shop", "a", "--reason", "INC-1"]);
    assert_eq!(
        purged,
        "purged (was completed): the key is claimable again\n"
    );
    assert_eq!(run(&["get", "shop", "a"]), "state: absent\n");
    assert_eq!(
        run(&["purge", "shop", "a"]),
        "nothing to purge: no unexpired record\n"
    );
    let stats = run(&["stats"]);
    assert!(
        stats.contains("completed 1 released 0 expired (awaiting the reaper) 1"),
        "{stats}"
    );
    // The running server sees the purge: at once on SQLite, within the
    // replay cache's bound on PostgreSQL (in practice when the purge's
    // notification arrives, milliseconds later).
    let again = eventually(idempotency_service::store::cache::FRESHNESS, || {
        let mut client = client.clone();
        async move {
            let answer = claim(&mut client, "shop", "a").await;
            (outcome(&answer) != Outcome::Completed).then_some(answer)
        }
    })
    .await
    .expect("the running server replayed a purged key past the bound");
    assert_eq!(outcome(&again), Outcome::Claimed);
    assert_eq!(again.fencing_token, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_line_works_on_postgres() {
    the_command_line_gets_purges_and_counts(Backend::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_line_works_on_sqlite() {
    the_command_line_gets_purges_and_counts(Backend::Sqlite).await;
}

/// Every replica refreshes the records gauge every minute, so on a large
/// table it must not count every row: above a million rows it estimates the
/// live records from a sample of pages, and counts the expired ones through
/// the reaper's index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_large_table_the_records_gauge_is_estimated_from_a_sample() {
    use sqlx::Connection;
    const COMPLETED: i64 = 1_200_000;
    const EXPIRED: i64 = 3_000;
    let store = StoreFixture::new(Backend::Postgres).await;
    let dir = tempfile::tempdir().unwrap();
    // The schema first (the server's migrations), then the rows, straight
    // into the table: live completed ones, and expired ones the reaper has
    // not deleted (the server below never runs it).
    let migrate = store_command(&store, dir.path())
        .arg("migrate")
        .output()
        .unwrap();
    assert!(migrate.status.success(), "{migrate:?}");
    let url = store.database_url.clone().unwrap();
    let mut sql = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::query(
        "INSERT INTO idempotency_records (namespace, key, state, fencing_token, lease_token,
             response, retention_us, expires_at, created_at, updated_at)
         SELECT 'big', g::text, 2, 1, '\\x00112233445566778899aabbccddeeff', 'r', 86400000000,
                now() + CASE WHEN g <= $2 THEN interval '-1 hour' ELSE interval '1 day' END,
                now(), now()
         FROM generate_series(1, $1 + $2) AS g",
    )
    .bind(COMPLETED)
    .bind(EXPIRED)
    .execute(&mut sql)
    .await
    .unwrap();
    sqlx::query("ANALYZE idempotency_records")
        .execute(&mut sql)
        .await
        .unwrap();

    let metrics_port = free_port();
    let mut serve = store_command(&store, dir.path());
    serve
        .env(
            "IDEMPOTENCY_METRICS_ADDR",
            format!("127.0.0.1:{metrics_port}"),
        )
        .env("IDEMPOTENCY_RECORDS_GAUGE_INTERVAL", "1s")
        .env("IDEMPOTENCY_REAPER_INTERVAL", "1h");
    let _server = ServerProcess::start(serve).await;
    let metrics = eventually(Duration::from_secs(30), || async {
        let m = scrape(metrics_port).await;
        m.contains_key("idempotency_records{state=\"completed\"}")
            .then_some(m)
    })
    .await
    .expect("the records gauge was never published");
    let completed = metrics["idempotency_records{state=\"completed\"}"];
    let error = (completed - COMPLETED as f64).abs() / COMPLETED as f64;
    assert!(
        error < 0.1,
        "{completed} completed records estimated for {COMPLETED}"
    );
    assert_eq!(
        metrics["idempotency_records{state=\"expired\"}"], EXPIRED as f64,
        "expired rows are counted exactly, through the reaper's index"
    );
    let lag = metrics["idempotency_reaper_lag_seconds"];
    assert!(
        (3_590.0..3_700.0).contains(&lag),
        "the oldest expired row waited about an hour: {lag}"
    );
}
