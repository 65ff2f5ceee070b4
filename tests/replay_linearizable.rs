//! The replay cache never answers with a result the key no longer has
//! (issue 22, README: the replay cache). Three replicas on one PostgreSQL
//! table, each with its own cache:
//! - once a Purge answers on any replica, no replica's Claim or ClaimBatch
//!   replays what it purged, over a thousand rounds;
//! - a purge from the command line under another search_path reaches them;
//! - an UPDATE, DELETE or TRUNCATE made in SQL, outside the service,
//!   reaches every cache within the freshness bound (in practice at once);
//! - and, for Claims that wait (issue 23), which hear the holder's Complete
//!   on the same feed: a replica whose listener is cut still answers its
//!   waiters, by reading the key again while the feed is not caught up.

mod common;

use std::time::{Duration, Instant};

use common::process::{output_within, store_command};
use common::*;
use idempotency_service::grpc::proto::{ClaimBatchRequest, ClaimResponse, Outcome, PurgeRequest};
use idempotency_service::store::cache::FRESHNESS;
use sqlx::Connection;

const NS: &str = "orders";

/// How long after its commit a change made outside the service may still
/// be replayed by a replica whose listener stalls: the freshness bound and
/// the feed's margin.
const OUT_OF_BAND_BOUND: Duration = FRESHNESS.saturating_add(Duration::from_millis(250));

/// Replicas sharing one fresh table, every one with the replay cache.
async fn replicas(n: usize) -> (StoreFixture, Vec<TestServer>) {
    let store = StoreFixture::new(Backend::Postgres).await;
    let mut servers = Vec::new();
    for _ in 0..n {
        servers.push(TestServer::start(store.config()).await);
    }
    (store, servers)
}

fn clients(servers: &[TestServer]) -> Vec<Client> {
    servers.iter().map(|s| s.client.clone()).collect()
}

async fn sql(store: &StoreFixture) -> sqlx::PgConnection {
    let url = store.database_url.clone().expect("a PostgreSQL store");
    sqlx::PgConnection::connect(&url).await.unwrap()
}

async fn purge(client: &Client, key: &str) -> bool {
    client
        .clone()
        .purge(PurgeRequest {
            namespace: NS.to_owned(),
            key: key.to_owned(),
            reason: "test".to_owned(),
        })
        .await
        .unwrap()
        .into_inner()
        .purged
}

async fn claim_twice_in_a_batch(client: &Client, key: &str) -> Vec<ClaimResponse> {
    client
        .clone()
        .claim_batch(ClaimBatchRequest {
            items: vec![claim_request(NS, key), claim_request(NS, key)],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .items
}

/// Completes `key` with `response` through `first`, and has every replica
/// read it (a completed record read by a Claim enters the cache).
async fn completed_and_read_everywhere(clients: &[Client], key: &str, response: &[u8]) {
    let mut first = clients[0].clone();
    let claimed = claim(&mut first, NS, key).await;
    assert_eq!(outcome(&claimed), Outcome::Claimed);
    complete(&mut first, NS, key, &claimed.lease_token, response).await;
    for client in clients {
        let replay = claim(&mut client.clone(), NS, key).await;
        assert_eq!(outcome(&replay), Outcome::Completed);
        assert_eq!(replay.response, response);
    }
}

/// Asserts that every replica answers `key` from memory: the stored result
/// is rewritten with triggers off (so no notification), and each replica
/// still replays `response`; then the stored result is put back with
/// triggers on (what a replica read meanwhile is forgotten). On Citus the
/// trigger runs on the node holding the key: the setting that turns it off
/// goes there with the statement (`citus.propagate_set_commands`, a
/// placeholder that plain PostgreSQL keeps and ignores).
async fn held_in_memory_everywhere(
    store: &StoreFixture,
    servers: &[TestServer],
    key: &str,
    response: &[u8],
) {
    let mut restore = sql(store).await;
    let mut sql = sql(store).await;
    sqlx::query("SET citus.propagate_set_commands = 'local'")
        .execute(&mut sql)
        .await
        .unwrap();
    let rewrite = "UPDATE idempotency_records SET response = $1 WHERE namespace = $2 AND key = $3";
    for (i, server) in servers.iter().enumerate() {
        let deadline = Instant::now() + FRESHNESS;
        loop {
            let mut unannounced = sql.begin().await.unwrap();
            sqlx::query("SET LOCAL session_replication_role = replica")
                .execute(&mut *unannounced)
                .await
                .unwrap();
            sqlx::query(rewrite)
                .bind(&b"rewritten"[..])
                .bind(NS)
                .bind(key)
                .execute(&mut *unannounced)
                .await
                .unwrap();
            unannounced.commit().await.unwrap();
            let replay = claim(&mut server.client.clone(), NS, key).await;
            sqlx::query(rewrite)
                .bind(response)
                .bind(NS)
                .bind(key)
                .execute(&mut restore)
                .await
                .unwrap();
            if replay.response == response {
                break;
            }
            claim(&mut server.client.clone(), NS, key).await;
            assert!(
                Instant::now() < deadline,
                "replica {i} never answered from memory"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Claims `key` on every replica until none replays `stale`, within
/// `within`; returns how long that took, and every answer after the last
/// stale one (each replica's first answer that was not stale, in order).
async fn until_no_replica_replays(
    servers: &[TestServer],
    key: &str,
    stale: &[u8],
    within: Duration,
) -> (Duration, Vec<ClaimResponse>) {
    let start = Instant::now();
    let mut answers = Vec::new();
    for (i, server) in servers.iter().enumerate() {
        let answer = eventually(within.saturating_sub(start.elapsed()), || {
            let mut client = server.client.clone();
            async move {
                let answer = claim(&mut client, NS, key).await;
                let replayed = outcome(&answer) == Outcome::Completed && answer.response == stale;
                (!replayed).then_some(answer)
            }
        })
        .await
        .unwrap_or_else(|| panic!("replica {i} still replays the old result after {within:?}"));
        answers.push(answer);
    }
    (start.elapsed(), answers)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_purge_answers_no_replica_replays_what_it_purged() {
    const WORKERS: usize = 4;
    const ROUNDS: usize = 250;
    let (_store, servers) = replicas(3).await;
    // A replica waits the whole bound for its first purges, until its
    // listener has heard a full window of heartbeats; wait for that here so
    // the latencies below are the usual ones.
    for (i, server) in servers.iter().enumerate() {
        let warm = format!("warm-{i}");
        let fast = eventually(Duration::from_secs(10), || {
            let server = &server.client;
            let warm = warm.clone();
            async move {
                let mut client = server.clone();
                let claimed = claim(&mut client, NS, &warm).await;
                if outcome(&claimed) == Outcome::Claimed {
                    complete(&mut client, NS, &warm, &claimed.lease_token, b"w").await;
                }
                let start = Instant::now();
                purge(server, &warm).await;
                (start.elapsed() < Duration::from_secs(1)).then_some(())
            }
        })
        .await;
        assert!(
            fast.is_some(),
            "replica {i}'s purges never stopped waiting the bound"
        );
    }
    let started = Instant::now();
    let mut runs = tokio::task::JoinSet::new();
    for worker in 0..WORKERS {
        let clients = clients(&servers);
        runs.spawn(async move {
            let mut latencies = Vec::with_capacity(ROUNDS);
            let mut replays = 0usize;
            for round in 0..ROUNDS {
                let key = format!("w{worker}-r{round}");
                let response = format!("result of {key}").into_bytes();
                completed_and_read_everywhere(&clients, &key, &response).await;
                // The purger, the claimer and the batcher change every round.
                let purger = &clients[(worker + round) % 3];
                let claimer = &clients[(worker + round + 1) % 3];
                let batcher = &clients[(worker + round + 2) % 3];
                let start = Instant::now();
                assert!(purge(purger, &key).await);
                latencies.push(start.elapsed());
                let (single, batch) = tokio::join!(
                    async { claim(&mut claimer.clone(), NS, &key).await },
                    claim_twice_in_a_batch(batcher, &key)
                );
                let answers: Vec<&ClaimResponse> = std::iter::once(&single).chain(&batch).collect();
                replays += answers
                    .iter()
                    .filter(|a| outcome(a) == Outcome::Completed)
                    .count();
                // The key is claimable again: one of the three claims wins
                // it, the other two are told it is in progress (the batch's
                // items answered one after the other).
                let mut outcomes: Vec<Outcome> = answers.iter().map(|a| outcome(a)).collect();
                outcomes.sort();
                let mut expected = vec![Outcome::Claimed, Outcome::InProgress, Outcome::InProgress];
                expected.sort();
                assert_eq!(outcomes, expected, "round {round} of worker {worker}");
            }
            (latencies, replays)
        });
    }
    let results: Vec<(Vec<Duration>, usize)> = runs.join_all().await;
    let elapsed = started.elapsed();
    let replays: usize = results.iter().map(|(_, r)| r).sum();
    let mut latencies: Vec<Duration> = results.into_iter().flat_map(|(l, _)| l).collect();
    latencies.sort();
    eprintln!(
        "{} rounds in {elapsed:?}: {replays} replays of a purged result; purge latency p50 {:?}, p99 {:?}, max {:?}",
        latencies.len(),
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        latencies.last().unwrap()
    );
    assert_eq!(replays, 0);
    assert_eq!(latencies.len(), WORKERS * ROUNDS);
    assert!(
        elapsed < Duration::from_secs(240),
        "the rounds took {elapsed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_from_the_command_line_under_another_search_path_reaches_every_replica() {
    let (store, servers) = replicas(2).await;
    completed_and_read_everywhere(&clients(&servers), "evt_cli", b"charged").await;
    held_in_memory_everywhere(&store, &servers, "evt_cli", b"charged").await;
    // The operator's session puts another schema first: its
    // current_schema() is not the table's.
    let other = format!("ops_{:08x}", rand_u64() as u32);
    let mut sql = sql(&store).await;
    sqlx::query(&format!("CREATE SCHEMA {other}"))
        .execute(&mut sql)
        .await
        .unwrap();
    let url = store.database_url.clone().unwrap();
    let elsewhere = url.replace("search_path%3D", &format!("search_path%3D{other}%2C"));
    assert_ne!(url, elsewhere);
    let dir = tempfile::tempdir().unwrap();
    let mut command = store_command(&store, dir.path());
    command
        .env("DATABASE_URL", &elsewhere)
        .args(["purge", NS, "evt_cli", "--reason", "INC-22"]);
    let output = output_within(command, Duration::from_secs(30));
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(String::from_utf8_lossy(&output.stdout).starts_with("purged"));
    // The command has answered: no replica replays the purged result.
    let first = claim(&mut servers[1].client.clone(), NS, "evt_cli").await;
    assert_eq!(outcome(&first), Outcome::Claimed);
    assert_eq!(first.fencing_token, 2);
    let second = claim(&mut servers[0].client.clone(), NS, "evt_cli").await;
    assert_eq!(outcome(&second), Outcome::InProgress);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_or_delete_in_sql_reaches_every_replica() {
    let (store, servers) = replicas(3).await;
    completed_and_read_everywhere(&clients(&servers), "evt_deleted", b"old-d").await;
    completed_and_read_everywhere(&clients(&servers), "evt_updated", b"old-u").await;
    held_in_memory_everywhere(&store, &servers, "evt_deleted", b"old-d").await;
    held_in_memory_everywhere(&store, &servers, "evt_updated", b"old-u").await;
    let mut sql = sql(&store).await;
    let deleted = sqlx::query("DELETE FROM idempotency_records WHERE key = 'evt_deleted'")
        .execute(&mut sql)
        .await
        .unwrap();
    assert_eq!(deleted.rows_affected(), 1);
    let updated = sqlx::query(
        "UPDATE idempotency_records SET response = 'new-u'::bytea WHERE key = 'evt_updated'",
    )
    .execute(&mut sql)
    .await
    .unwrap();
    assert_eq!(updated.rows_affected(), 1);

    let (took, answers) =
        until_no_replica_replays(&servers, "evt_deleted", b"old-d", OUT_OF_BAND_BOUND).await;
    eprintln!("a DELETE in SQL reached every replica within {took:?}");
    let outcomes: Vec<Outcome> = answers.iter().map(outcome).collect();
    assert_eq!(
        outcomes,
        [Outcome::Claimed, Outcome::InProgress, Outcome::InProgress]
    );
    let (took, answers) =
        until_no_replica_replays(&servers, "evt_updated", b"old-u", OUT_OF_BAND_BOUND).await;
    eprintln!("an UPDATE in SQL reached every replica within {took:?}");
    for answer in answers {
        assert_eq!(outcome(&answer), Outcome::Completed);
        assert_eq!(answer.response, b"new-u");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncate_in_sql_reaches_every_replica() {
    let (store, servers) = replicas(3).await;
    completed_and_read_everywhere(&clients(&servers), "evt_t", b"before").await;
    held_in_memory_everywhere(&store, &servers, "evt_t", b"before").await;
    sqlx::query("TRUNCATE idempotency_records")
        .execute(&mut sql(&store).await)
        .await
        .unwrap();
    let (took, answers) =
        until_no_replica_replays(&servers, "evt_t", b"before", OUT_OF_BAND_BOUND).await;
    eprintln!("a TRUNCATE reached every replica within {took:?}");
    let outcomes: Vec<Outcome> = answers.iter().map(outcome).collect();
    assert_eq!(
        outcomes,
        [Outcome::Claimed, Outcome::InProgress, Outcome::InProgress]
    );
}

/// A TCP relay to PostgreSQL that can black-hole the connections that have
/// sent `LISTEN`: they stay open and say nothing, as a half-open socket
/// does.
struct Relay {
    addr: std::net::SocketAddr,
    /// Bumped to black-hole every listening connection open now.
    cut: tokio::sync::watch::Sender<u64>,
}

impl Relay {
    async fn start(upstream: std::net::SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (cut, _) = tokio::sync::watch::channel(0u64);
        let cuts = cut.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
                    continue;
                };
                tokio::spawn(Self::relay(client, server, cuts.subscribe()));
            }
        });
        Self { addr, cut }
    }

    async fn relay(
        client: tokio::net::TcpStream,
        server: tokio::net::TcpStream,
        mut cut: tokio::sync::watch::Receiver<u64>,
    ) {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let seen = *cut.borrow_and_update();
        let listening = Arc::new(AtomicBool::new(false));
        // Once set, each direction keeps its sockets open and forwards
        // nothing more: silence, not a closed connection.
        let silenced = Arc::new(AtomicBool::new(false));
        let (mut client_read, mut client_write) = client.into_split();
        let (mut server_read, mut server_write) = server.into_split();
        let (heard, quiet) = (listening.clone(), silenced.clone());
        let upstream = async move {
            let mut buffer = vec![0u8; 16 * 1024];
            loop {
                let n = client_read.read(&mut buffer).await.unwrap_or(0);
                if quiet.load(Ordering::SeqCst) {
                    std::future::pending::<()>().await;
                }
                if n == 0 {
                    return;
                }
                if buffer[..n].windows(7).any(|w| w == b"LISTEN ") {
                    heard.store(true, Ordering::SeqCst);
                }
                if server_write.write_all(&buffer[..n]).await.is_err() {
                    return;
                }
            }
        };
        let quiet = silenced.clone();
        let downstream = async move {
            let mut buffer = vec![0u8; 16 * 1024];
            loop {
                let n = server_read.read(&mut buffer).await.unwrap_or(0);
                if quiet.load(Ordering::SeqCst) {
                    std::future::pending::<()>().await;
                }
                if n == 0 || client_write.write_all(&buffer[..n]).await.is_err() {
                    return;
                }
            }
        };
        let black_hole = async move {
            while cut.changed().await.is_ok() {
                if *cut.borrow() != seen && listening.load(Ordering::SeqCst) {
                    silenced.store(true, Ordering::SeqCst);
                    return;
                }
            }
        };
        tokio::join!(upstream, downstream, black_hole);
    }

    /// Silences every connection that listens now; new ones pass.
    fn silence_listeners(&self) {
        self.cut.send_modify(|n| *n += 1);
    }
}

/// A's server, and b's behind a relay that can silence its listener.
async fn a_and_relayed_b(store: &StoreFixture, b_max_waiters: usize) -> (Relay, [TestServer; 2]) {
    let url = store.database_url.clone().unwrap();
    // The server the URL names (host:port between '@' and the database).
    let authority = url
        .split('@')
        .nth(1)
        .and_then(|rest| rest.split('/').next());
    let upstream: std::net::SocketAddr = authority
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("a numeric host:port in {url}"));
    let relay = Relay::start(upstream).await;
    let a = TestServer::start(store.config()).await;
    let mut relayed = store.config();
    relayed.max_waiters = b_max_waiters;
    // Plaintext, so that the relay can see which connection listens.
    relayed.database_url = Some(format!(
        "{}&sslmode=disable",
        url.replace(&upstream.to_string(), &relay.addr.to_string())
    ));
    let b = TestServer::start(relayed).await;
    (relay, [a, b])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_whose_listener_is_cut_still_get_the_holders_result() {
    let store = StoreFixture::new(Backend::Postgres).await;
    // b lets exactly its 8 waiters wait: a probe Claim that asks to wait on
    // another held key is turned away (waited zero) once they are all in.
    let (relay, servers) = a_and_relayed_b(&store, 8).await;
    let holder = claim(&mut servers[0].client.clone(), NS, "evt_wait").await;
    assert_eq!(outcome(&holder), Outcome::Claimed);
    let probe = claim(&mut servers[0].client.clone(), NS, "evt_probe").await;
    assert_eq!(outcome(&probe), Outcome::Claimed);
    relay.silence_listeners();
    let waiting_request = |key: &str, millis: u64| {
        let mut request = claim_request(NS, key);
        request.wait =
            Some(prost_types::Duration::try_from(Duration::from_millis(millis)).unwrap());
        request
    };
    let turned_away =
        |answer: &ClaimResponse| answer.waited == Some(prost_types::Duration::default());
    let waiting: Vec<_> = (0..8)
        .map(|_| {
            let mut client = servers[1].client.clone();
            let request = waiting_request("evt_wait", 20_000);
            tokio::spawn(async move {
                // Asked again if the probe took its place for a moment.
                loop {
                    let answer = client.claim(request.clone()).await.unwrap().into_inner();
                    if !turned_away(&answer) {
                        return answer;
                    }
                }
            })
        })
        .collect();
    let all_in = eventually(Duration::from_secs(20), || {
        let mut client = servers[1].client.clone();
        let request = waiting_request("evt_probe", 1);
        async move {
            let answer = client.claim(request).await.unwrap().into_inner();
            turned_away(&answer).then_some(())
        }
    })
    .await;
    assert!(all_in.is_some(), "b's waiters never all waited");
    let completed_at = Instant::now();
    complete(
        &mut servers[0].client.clone(),
        NS,
        "evt_wait",
        &holder.lease_token,
        b"done",
    )
    .await;
    for waiter in waiting {
        let answer = waiter.await.unwrap();
        assert_eq!(outcome(&answer), Outcome::Completed, "{answer:?}");
        assert_eq!(answer.response, b"done");
    }
    // Not the wait's 20 s: the feed's freshness (3 s) and a poll (0.5 s),
    // or the watchdog's new listener.
    let late = completed_at.elapsed();
    eprintln!("b's waiters answered {late:?} after the Complete, its listener cut");
    assert!(late < Duration::from_secs(10), "{late:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_cut_silently_stops_the_cache_and_is_replaced() {
    let store = StoreFixture::new(Backend::Postgres).await;
    let (relay, servers) = a_and_relayed_b(&store, store.config().max_waiters).await;
    completed_and_read_everywhere(&clients(&servers), "evt_cut", b"kept").await;
    held_in_memory_everywhere(&store, &servers, "evt_cut", b"kept").await;

    relay.silence_listeners();
    // b cannot hear this purge, nor acknowledge it: a waits the bound.
    let start = Instant::now();
    assert!(purge(&servers[0].client, "evt_cut").await);
    let waited = start.elapsed();
    eprintln!("the purge took {waited:?} (b could not hear it nor acknowledge)");
    assert!(waited < OUT_OF_BAND_BOUND + Duration::from_secs(1));
    // b's heartbeats no longer come back: it asks the database.
    let next = claim(&mut servers[1].client.clone(), NS, "evt_cut").await;
    assert_eq!(outcome(&next), Outcome::Claimed);
    assert_eq!(next.fencing_token, 2);

    // The watchdog replaces b's silent listener; its cache answers again.
    let mut client = servers[0].client.clone();
    complete(&mut client, NS, "evt_cut", &next.lease_token, b"again").await;
    let cut_at = start;
    let deadline = cut_at + Duration::from_secs(15);
    loop {
        let mut sql = sql(&store).await;
        sqlx::query("SET session_replication_role = replica")
            .execute(&mut sql)
            .await
            .unwrap();
        claim(&mut servers[1].client.clone(), NS, "evt_cut").await;
        sqlx::query(
            "UPDATE idempotency_records SET response = 'probe'::bytea WHERE key = 'evt_cut'",
        )
        .execute(&mut sql)
        .await
        .unwrap();
        let replay = claim(&mut servers[1].client.clone(), NS, "evt_cut").await;
        sqlx::query("SET session_replication_role = origin")
            .execute(&mut sql)
            .await
            .unwrap();
        sqlx::query(
            "UPDATE idempotency_records SET response = 'again'::bytea WHERE key = 'evt_cut'",
        )
        .execute(&mut sql)
        .await
        .unwrap();
        if replay.response == b"again" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "b's cache never answered again after its listener was cut"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "b's cache answered again {:?} after its listener was silenced",
        cut_at.elapsed()
    );
}

/// A Claim that waits on one replica hears the holder's Complete on another
/// through the feed, not by reading the key again every 500 ms: on plain
/// PostgreSQL (issue 23), and on Citus (issue 31), where the trigger that
/// announces it runs on the node holding the key, which every replica's
/// feed listens on. Two processes with their metrics: the waiting one reads
/// the key when its waiter joins and once more when woken, never to poll,
/// although the holder works for longer than two polls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_by_another_replicas_complete_without_polling() {
    use common::process::{ServerProcess, free_port, scrape};
    let store = StoreFixture::new(Backend::Postgres).await;
    let dir = tempfile::tempdir().unwrap();
    let ports = [free_port(), free_port()];
    let mut servers = Vec::new();
    for port in ports {
        let mut command = store_command(&store, dir.path());
        command.env("IDEMPOTENCY_METRICS_ADDR", format!("127.0.0.1:{port}"));
        servers.push(ServerProcess::start(command).await);
    }
    let metric = |port: u16, name: &'static str| async move {
        scrape(port).await.get(name).copied().unwrap_or(0.0)
    };
    for port in ports {
        let fresh = eventually(Duration::from_secs(20), || async move {
            (metric(port, "idempotency_wait_feed_fresh").await == 1.0).then_some(())
        })
        .await;
        assert!(fresh.is_some(), "the feed of :{port} never caught up");
    }
    let holder = claim(&mut servers[0].client(), NS, "evt_woken").await;
    assert_eq!(outcome(&holder), Outcome::Claimed);
    let mut waiting_client = servers[1].client();
    let waiter = tokio::spawn(async move {
        let mut request = claim_request(NS, "evt_woken");
        request.wait = Some(prost_types::Duration::try_from(Duration::from_secs(20)).unwrap());
        waiting_client.claim(request).await.unwrap().into_inner()
    });
    let joined = eventually(Duration::from_secs(10), || async {
        (metric(ports[1], "idempotency_waiters").await == 1.0).then_some(())
    })
    .await;
    assert!(joined.is_some(), "the waiter never waited");
    // The holder's work: longer than two of the 500 ms polls a replica that
    // cannot hear the Complete would make.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    complete(
        &mut servers[0].client(),
        NS,
        "evt_woken",
        &holder.lease_token,
        b"done",
    )
    .await;
    let answer = tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("the waiter never answered")
        .unwrap();
    assert_eq!(outcome(&answer), Outcome::Completed, "{answer:?}");
    assert_eq!(answer.response, b"done");
    let reads = scrape(ports[1]).await;
    let read = |cause: &str| {
        reads
            .get(&format!(
                "idempotency_wait_reads_total{{cause=\"{cause}\"}}"
            ))
            .copied()
            .unwrap_or(0.0)
    };
    assert_eq!(read("poll"), 0.0, "{reads:?}");
    assert_eq!(read("joined"), 1.0, "{reads:?}");
    assert_eq!(read("woken"), 1.0, "{reads:?}");
}
