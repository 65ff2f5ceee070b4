//! The gateway end to end: a real upstream that counts its effects, the
//! real gateway and idempotency-service binaries, and a real HTTP client.
//! Each test asserts exact outcomes: statuses, bodies, headers, and how
//! many times the upstream's effect ran.

mod common;

use std::time::Duration;

use common::{Answer, Rig, Store, eventually};

fn problem_type(answer: &Answer) -> String {
    assert_eq!(
        answer.content_type.as_deref(),
        Some("application/problem+json")
    );
    answer.json()["type"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn a_missing_key_is_400_and_runs_nothing() {
    let rig = Rig::start(Store::Sqlite).await;
    let answer = Answer::of(rig.post("/charges", None, "tenant-a").send().await.unwrap()).await;
    assert_eq!(answer.status, 400);
    assert_eq!(
        problem_type(&answer),
        "tag:idempotency-gateway,2026:problem/idempotency-key-missing"
    );
    assert_eq!(rig.upstream.effects("/charges"), 0);
}

#[tokio::test]
async fn a_key_that_is_not_one_sf_string_of_at_most_255_characters_is_400() {
    let rig = Rig::start(Store::Sqlite).await;
    let too_long = format!("\"{}\"", "k".repeat(256));
    for value in [
        "abc",
        "\"\"",
        "42",
        "\"unterminated",
        too_long.as_str(),
        "\"a\", \"b\"",
    ] {
        let response = rig
            .post("/charges", None, "tenant-a")
            .header("idempotency-key", value)
            .send()
            .await
            .unwrap();
        let answer = Answer::of(response).await;
        assert_eq!(answer.status, 400, "{value}");
        assert!(
            problem_type(&answer).ends_with("/idempotency-key-invalid"),
            "{value}"
        );
    }
    let longest = format!("\"{}\"", "k".repeat(255));
    let response = rig
        .post("/charges", None, "tenant-a")
        .header("idempotency-key", longest);
    assert_eq!(response.send().await.unwrap().status(), 201);
    assert_eq!(rig.upstream.effects("/charges"), 1);
}

async fn first_request_then_replay(store: Store) {
    let rig = Rig::start(store).await;
    let first = Answer::of(
        rig.post("/charges", Some("k-1"), "tenant-a")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(first.status, 201);
    assert_eq!(first.replayed, None);
    assert_eq!(first.location.as_deref(), Some("/charges/1"));
    assert_eq!(first.set_cookie.as_deref(), Some("session=1"));
    assert_eq!(first.json()["effect"], 1);
    // The upstream got the key field as sent, and the lease's fencing token.
    assert_eq!(
        rig.upstream.requests(),
        vec![(
            "/charges".to_owned(),
            Some("\"k-1\"".to_owned()),
            Some("1".to_owned())
        )]
    );
    let second = Answer::of(
        rig.post("/charges", Some("k-1"), "tenant-a")
            .send()
            .await
            .unwrap(),
    )
    .await;
    // The same status, allowed headers and body; no Set-Cookie; the marker.
    assert_eq!(second, first.as_replayed());
    assert_eq!(rig.upstream.effects("/charges"), 1);
    let third = Answer::of(
        rig.post("/charges", Some("k-1"), "tenant-a")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(third, second);
    let metrics = rig.gateway.metrics().await;
    assert!(
        metrics
            .contains(r#"idempotency_gateway_requests_total{route="charges",outcome="stored"} 1"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            r#"idempotency_gateway_requests_total{route="charges",outcome="replayed"} 2"#
        ),
        "{metrics}"
    );
}

#[tokio::test]
async fn the_first_request_runs_and_its_retry_is_replayed_sqlite() {
    first_request_then_replay(Store::Sqlite).await;
}

#[tokio::test]
async fn the_first_request_runs_and_its_retry_is_replayed_postgres() {
    first_request_then_replay(Store::Postgres).await;
}

#[tokio::test]
async fn the_same_key_with_another_payload_is_422() {
    let rig = Rig::start(Store::Sqlite).await;
    assert_eq!(
        rig.post("/charges", Some("k"), "tenant-a")
            .send()
            .await
            .unwrap()
            .status(),
        201
    );
    let other = rig
        .post("/charges", Some("k"), "tenant-a")
        .body(r#"{"amount":999}"#);
    let answer = Answer::of(other.send().await.unwrap()).await;
    assert_eq!(answer.status, 422);
    assert!(problem_type(&answer).ends_with("/idempotency-key-reused"));
    // Another query string is another request too.
    let response = rig
        .client
        .post(format!("{}/charges?x=1", rig.gateway.url))
        .header("x-api-key", "tenant-a")
        .header("idempotency-key", "\"k\"")
        .body(r#"{"amount":100}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 422);
    assert_eq!(rig.upstream.effects("/charges"), 1);
}

#[tokio::test]
async fn a_concurrent_duplicate_waits_and_gets_the_same_answer() {
    let rig = Rig::start(Store::Sqlite).await;
    let first = rig
        .post("/charges", Some("k"), "tenant-a")
        .header("x-delay-ms", "600")
        .send();
    let first = tokio::spawn(first);
    rig.until_upstream_started(1).await;
    let second = Answer::of(
        rig.post("/charges", Some("k"), "tenant-a")
            .header("x-delay-ms", "600")
            .send()
            .await
            .unwrap(),
    )
    .await;
    let first = Answer::of(first.await.unwrap().unwrap()).await;
    assert_eq!(first.status, 201);
    assert_eq!(second, first.as_replayed());
    assert_eq!(rig.upstream.effects("/charges"), 1);
}

async fn thirty_two_duplicates(store: Store) {
    let rig = Rig::start(store).await;
    let requests = (0..32).map(|_| {
        let request = rig
            .post("/charges", Some("storm"), "tenant-a")
            .header("x-delay-ms", "300");
        tokio::spawn(async move { Answer::of(request.send().await.unwrap()).await })
    });
    let mut answers = Vec::new();
    for request in requests.collect::<Vec<_>>() {
        answers.push(request.await.unwrap());
    }
    assert_eq!(rig.upstream.effects("/charges"), 1);
    let first: Vec<&Answer> = answers.iter().filter(|a| a.replayed.is_none()).collect();
    assert_eq!(first.len(), 1, "{answers:#?}");
    let expected = first[0].as_replayed();
    for answer in &answers {
        assert_eq!(answer.status, 201);
        if answer.replayed.is_some() {
            assert_eq!(answer, &expected);
        }
    }
}

#[tokio::test]
async fn thirty_two_concurrent_duplicates_make_one_effect_and_one_answer_sqlite() {
    thirty_two_duplicates(Store::Sqlite).await;
}

#[tokio::test]
async fn thirty_two_concurrent_duplicates_make_one_effect_and_one_answer_postgres() {
    thirty_two_duplicates(Store::Postgres).await;
}

#[tokio::test]
async fn a_duplicate_still_in_flight_after_the_wait_is_409_with_retry_after() {
    let rig = Rig::start(Store::Sqlite).await;
    let first = tokio::spawn(
        rig.post("/impatient", Some("k"), "tenant-a")
            .header("x-delay-ms", "1500")
            .send(),
    );
    rig.until_upstream_started(1).await;
    let second = Answer::of(
        rig.post("/impatient", Some("k"), "tenant-a")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(second.status, 409);
    assert!(problem_type(&second).ends_with("/request-in-progress"));
    let retry_after: u64 = second.retry_after.as_deref().unwrap().parse().unwrap();
    assert!((1..=30).contains(&retry_after), "{retry_after}");
    assert_eq!(first.await.unwrap().unwrap().status(), 201);
    let third = Answer::of(
        rig.post("/impatient", Some("k"), "tenant-a")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(third.replayed.as_deref(), Some("true"));
    assert_eq!(rig.upstream.effects("/impatient"), 1);
}

#[tokio::test]
async fn a_5xx_releases_the_key_and_the_retry_runs_again() {
    let rig = Rig::start(Store::Sqlite).await;
    rig.upstream
        .state
        .fail_next
        .store(1, std::sync::atomic::Ordering::SeqCst);
    let first = Answer::of(
        rig.post("/flaky", Some("k"), "tenant-a")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(first.status, 500);
    assert_eq!(first.replayed, None);
    let second = Answer::of(
        rig.post("/flaky", Some("k"), "tenant-a")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(second.status, 201);
    assert_eq!(second.replayed, None);
    // The second run holds the next lease: fencing token 2.
    assert_eq!(second.json()["fencing_token"], 2);
    let third = Answer::of(
        rig.post("/flaky", Some("k"), "tenant-a")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(third, second.as_replayed());
    assert_eq!(rig.upstream.effects("/flaky"), 2);
}

#[tokio::test]
async fn the_same_key_from_two_api_keys_is_two_requests() {
    let rig = Rig::start(Store::Sqlite).await;
    let a = Answer::of(
        rig.post("/charges", Some("shared"), "tenant-a")
            .send()
            .await
            .unwrap(),
    )
    .await;
    let b = Answer::of(
        rig.post("/charges", Some("shared"), "tenant-b")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((a.status, b.status), (201, 201));
    assert_eq!((a.replayed.as_deref(), b.replayed.as_deref()), (None, None));
    assert_eq!(
        (a.json()["effect"].clone(), b.json()["effect"].clone()),
        (1.into(), 2.into())
    );
    assert_eq!(rig.upstream.effects("/charges"), 2);
    // Each tenant replays its own answer.
    let a2 = Answer::of(
        rig.post("/charges", Some("shared"), "tenant-a")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(a2, a.as_replayed());
    // Without the identity header: 401, nothing run.
    let anonymous = rig
        .client
        .post(format!("{}/charges", rig.gateway.url))
        .header("idempotency-key", "\"shared\"")
        .send()
        .await
        .unwrap();
    let anonymous = Answer::of(anonymous).await;
    assert_eq!(anonymous.status, 401);
    assert!(problem_type(&anonymous).ends_with("/identity-missing"));
    assert_eq!(rig.upstream.effects("/charges"), 2);
}

#[tokio::test]
async fn a_response_over_the_limit_is_passed_through_not_stored_and_counted() {
    let rig = Rig::start(Store::Sqlite).await;
    let big = || {
        rig.post("/big", Some("k"), "tenant-a")
            .header("x-size", "100000")
            .send()
    };
    let first = Answer::of(big().await.unwrap()).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.body.len(), 100_000);
    let second = Answer::of(big().await.unwrap()).await;
    assert_eq!(
        (second.status, second.body.len(), second.replayed),
        (200, 100_000, None)
    );
    assert_eq!(rig.upstream.effects("/big"), 2);
    // Just under the limit is stored.
    let small = || {
        rig.post("/big", Some("small"), "tenant-a")
            .header("x-size", "2000")
            .send()
    };
    assert_eq!(Answer::of(small().await.unwrap()).await.replayed, None);
    assert_eq!(
        Answer::of(small().await.unwrap()).await.replayed.as_deref(),
        Some("true")
    );
    assert_eq!(rig.upstream.effects("/big"), 3);
    let metrics = rig.gateway.metrics().await;
    assert!(
        metrics.contains(
            r#"idempotency_gateway_requests_total{route="big",outcome="released_too_large"} 2"#
        ),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_client_that_disconnects_mid_request_leaves_the_response_stored() {
    let rig = Rig::start(Store::Sqlite).await;
    let impatient = rig
        .post("/charges", Some("k"), "tenant-a")
        .header("x-delay-ms", "1000")
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(impatient.unwrap_err().is_timeout());
    // The upstream call goes on without the client; the lease outlives its
    // 3 s TTL only through ExtendLease, so wait past it.
    eventually("the upstream's effect", Duration::from_secs(5), || {
        rig.upstream.effects("/charges") == 1
    })
    .await;
    let retry = Answer::of(
        rig.post("/charges", Some("k"), "tenant-a")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(retry.status, 201);
    assert_eq!(retry.replayed.as_deref(), Some("true"));
    assert_eq!(retry.json()["effect"], 1);
    assert_eq!(rig.upstream.effects("/charges"), 1);
}

#[tokio::test]
async fn the_lease_is_extended_while_a_slow_upstream_works() {
    let rig = Rig::start(Store::Sqlite).await;
    // 4 s of work under a 3 s lease: without ExtendLease a retry at 3.5 s
    // would take the key over and run the effect again.
    let first = tokio::spawn(
        rig.post("/charges", Some("slow"), "tenant-a")
            .header("x-delay-ms", "4000")
            .send(),
    );
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let retry = Answer::of(
        rig.post("/charges", Some("slow"), "tenant-a")
            .send()
            .await
            .unwrap(),
    )
    .await;
    let first = Answer::of(first.await.unwrap().unwrap()).await;
    assert_eq!(first.status, 201);
    assert_eq!(retry, first.as_replayed());
    assert_eq!(rig.upstream.effects("/charges"), 1);
}

#[tokio::test]
async fn http2_clients_get_the_same_behaviour() {
    let rig = Rig::start(Store::Sqlite).await;
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let send = || {
        h2.post(format!("{}/charges", rig.gateway.url))
            .header("x-api-key", "tenant-a")
            .header("idempotency-key", "\"h2\"")
            .body("{}")
            .send()
    };
    let first = send().await.unwrap();
    assert_eq!(first.version(), reqwest::Version::HTTP_2);
    let first = Answer::of(first).await;
    let second = send().await.unwrap();
    assert_eq!(second.version(), reqwest::Version::HTTP_2);
    assert_eq!(Answer::of(second).await, first.as_replayed());
    // And an HTTP/1.1 client with the same key replays the same answer.
    let h1 = rig
        .client
        .post(format!("{}/charges", rig.gateway.url))
        .header("x-api-key", "tenant-a")
        .header("idempotency-key", "\"h2\"")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(h1.version(), reqwest::Version::HTTP_11);
    assert_eq!(Answer::of(h1).await, first.as_replayed());
    assert_eq!(rig.upstream.effects("/charges"), 1);
}

#[tokio::test]
async fn other_routes_and_keyless_optional_routes_pass_through() {
    let rig = Rig::start(Store::Sqlite).await;
    let hello = rig
        .client
        .get(format!("{}/hello", rig.gateway.url))
        .send()
        .await
        .unwrap();
    assert_eq!(hello.status(), 200);
    assert_eq!(hello.headers()["x-saw-forwarded-for"], "127.0.0.1");
    assert_eq!(hello.text().await.unwrap(), "hello");
    for _ in 0..2 {
        let answer = Answer::of(
            rig.post("/optional", None, "tenant-a")
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!((answer.status, answer.replayed), (201, None));
        let unguarded = Answer::of(
            rig.post("/unguarded", Some("k"), "tenant-a")
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!((unguarded.status, unguarded.replayed), (201, None));
    }
    assert_eq!(rig.upstream.effects("/optional"), 2);
    assert_eq!(rig.upstream.effects("/unguarded"), 2);
    // The upstream saw no fencing token on pass-through requests.
    assert!(
        rig.upstream
            .requests()
            .iter()
            .all(|(_, _, fencing)| fencing.is_none())
    );
}

#[tokio::test]
async fn late_retries_follow_the_route_policy() {
    let extra = r#"
[[route]]
method = "POST"
path = "/refuse"
namespace = "refuse"
retention = "1s"
late_retry = "refuse"

[[route]]
method = "POST"
path = "/reexecute"
namespace = "reexecute"
retention = "1s"
late_retry = "reexecute"
"#;
    let rig = Rig::with_routes(Store::Sqlite, extra).await;
    for path in ["/refuse", "/reexecute"] {
        assert_eq!(
            rig.post(path, Some("late"), "tenant-a")
                .send()
                .await
                .unwrap()
                .status(),
            201
        );
    }
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let refused = Answer::of(
        rig.post("/refuse", Some("late"), "tenant-a")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(refused.status, 410);
    assert!(problem_type(&refused).ends_with("/idempotency-key-expired"));
    assert!(
        refused.json()["completed_at"]
            .as_str()
            .is_some_and(|t| t.starts_with("20")),
        "{}",
        refused.body
    );
    assert_eq!(rig.upstream.effects("/refuse"), 1);
    let again = Answer::of(
        rig.post("/reexecute", Some("late"), "tenant-a")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((again.status, again.replayed.clone()), (201, None));
    assert_eq!(again.json()["fencing_token"], 2);
    assert_eq!(rig.upstream.effects("/reexecute"), 2);
}

#[tokio::test]
async fn an_unreachable_service_is_503_with_retry_after_or_fail_open() {
    let upstream = common::TestUpstream::start().await;
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let extra = r#"
[[route]]
method = "POST"
path = "/open"
namespace = "open"
fail_open = true
"#;
    let gateway = common::GatewayProcess::start(&common::config(
        upstream.addr,
        &format!("http://127.0.0.1:{port}"),
        extra,
    ));
    let client = reqwest::Client::new();
    let post = |path: &str| {
        client
            .post(format!("{}{path}", gateway.url))
            .header("x-api-key", "tenant-a")
            .header("idempotency-key", "\"k\"")
            .send()
    };
    let started = std::time::Instant::now();
    let closed = Answer::of(post("/charges").await.unwrap()).await;
    assert_eq!(closed.status, 503);
    assert!(problem_type(&closed).ends_with("/idempotency-service-unavailable"));
    assert_eq!(closed.retry_after.as_deref(), Some("1"));
    // Five attempts with the published backoff: well under the Claim's 30 s.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(upstream.effects("/charges"), 0);
    let open = Answer::of(post("/open").await.unwrap()).await;
    assert_eq!((open.status, open.replayed), (201, None));
    assert_eq!(upstream.effects("/open"), 1);
    let metrics = gateway.metrics().await;
    assert!(
        metrics
            .contains(r#"idempotency_gateway_requests_total{route="open",outcome="fail_open"} 1"#),
        "{metrics}"
    );
}

#[tokio::test]
async fn the_service_killed_mid_request_runs_nothing_twice_and_answers_503_meanwhile() {
    let extra = r#"
[[route]]
method = "POST"
path = "/durable"
namespace = "durable"
lease_ttl = "10s"
"#;
    let mut rig = Rig::with_routes(Store::Sqlite, extra).await;
    let first = tokio::spawn(
        rig.post("/durable", Some("k"), "tenant-a")
            .header("x-delay-ms", "800")
            .send(),
    );
    rig.until_upstream_started(1).await;
    rig.service.kill();
    // The effect happened: its client gets the upstream's answer, though
    // Complete could not be stored yet (its retries take about 1.5 s).
    let first = Answer::of(first.await.unwrap().unwrap()).await;
    assert_eq!((first.status, first.replayed.clone()), (201, None));
    // While the service is down, a guarded request is a clear 503.
    let down = Answer::of(
        rig.post("/durable", Some("other"), "tenant-a")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(down.status, 503);
    assert!(problem_type(&down).ends_with("/idempotency-service-unavailable"));
    rig.service.restart().await;
    // The response is stored once the service is back: the retry replays it.
    let retry = Answer::of(
        rig.post("/durable", Some("k"), "tenant-a")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(retry, first.as_replayed());
    assert_eq!(rig.upstream.effects("/durable"), 1);
}

#[tokio::test]
async fn an_http2_upstream_works() {
    let upstream = common::TestUpstream::start().await;
    let service = common::ServiceProcess::start(Store::Sqlite).await;
    let config = common::config(upstream.addr, &service.url(), "").replace(
        "shutdown_timeout = \"2s\"",
        "shutdown_timeout = \"2s\"\nupstream_http2 = true",
    );
    let gateway = common::GatewayProcess::start(&config);
    let client = reqwest::Client::new();
    let hello = client
        .get(format!("{}/hello", gateway.url))
        .send()
        .await
        .unwrap();
    assert_eq!(hello.headers()["x-saw-version"], "HTTP/2.0");
    let post = || {
        client
            .post(format!("{}/charges", gateway.url))
            .header("x-api-key", "tenant-a")
            .header("idempotency-key", "\"k\"")
            .send()
    };
    let first = Answer::of(post().await.unwrap()).await;
    assert_eq!(first.status, 201);
    assert_eq!(Answer::of(post().await.unwrap()).await, first.as_replayed());
    assert_eq!(upstream.effects("/charges"), 1);
}

const HUNDRED_MB: usize = 100 * 1024 * 1024;

#[tokio::test]
async fn a_100_mb_body_streams_through_at_constant_memory() {
    let rig = Rig::start(Store::Sqlite).await;
    let before = rig.gateway.peak_memory();
    // Upstream to client, on a guarded route: over the stored limit after
    // the first 64 KiB, released, and the rest streamed.
    let response = rig
        .post("/stream", Some("large"), "tenant-a")
        .header("x-size", HUNDRED_MB.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut stream = response.bytes_stream();
    let mut received = 0;
    while let Some(chunk) = futures_util::StreamExt::next(&mut stream).await {
        received += chunk.unwrap().len();
    }
    assert_eq!(received, HUNDRED_MB);
    // Client to upstream, passed through: the body is made as it is sent.
    let chunk = bytes::Bytes::from(vec![b'z'; 64 * 1024]);
    let chunks = (0..HUNDRED_MB / chunk.len()).map(move |_| Ok::<_, std::io::Error>(chunk.clone()));
    let upload = rig
        .client
        .post(format!("{}/sink", rig.gateway.url))
        .body(reqwest::Body::wrap_stream(futures_util::stream::iter(
            chunks,
        )))
        .send()
        .await
        .unwrap();
    let upload = Answer::of(upload).await;
    assert_eq!(upload.status, 200);
    assert_eq!(upload.json()["received"], HUNDRED_MB);
    let grown = rig.gateway.peak_memory().saturating_sub(before);
    assert!(
        grown < 32 * 1024 * 1024,
        "the gateway's peak memory grew by {grown} bytes"
    );
    assert_eq!(rig.upstream.effects("/stream"), 1);
}

#[tokio::test]
async fn a_request_body_over_the_route_limit_is_413_and_runs_nothing() {
    let rig = Rig::start(Store::Sqlite).await;
    let large = rig
        .post("/big", Some("k"), "tenant-a")
        .body(vec![b'a'; 65537]);
    let answer = Answer::of(large.send().await.unwrap()).await;
    assert_eq!(answer.status, 413);
    assert!(problem_type(&answer).ends_with("/request-too-large"));
    assert_eq!(rig.upstream.effects("/big"), 0);
    // Nothing was claimed: the same key with a body within the limit runs.
    let fits = rig
        .post("/big", Some("k"), "tenant-a")
        .body(vec![b'a'; 65536]);
    assert_eq!(fits.send().await.unwrap().status(), 200);
    assert_eq!(rig.upstream.effects("/big"), 1);
}

#[tokio::test]
async fn sigterm_lets_the_request_in_flight_finish() {
    let mut rig = Rig::start(Store::Sqlite).await;
    let in_flight = tokio::spawn(
        rig.post("/charges", Some("k"), "tenant-a")
            .header("x-delay-ms", "700")
            .send(),
    );
    rig.until_upstream_started(1).await;
    rig.gateway.terminate();
    let answer = Answer::of(in_flight.await.unwrap().unwrap()).await;
    assert_eq!(
        (answer.status, answer.json()["effect"].clone()),
        (201, 1.into())
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Some(status) = rig.gateway.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still running 5 s after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn a_service_with_an_access_policy_takes_the_gateway_token() {
    use sha2::Digest;
    let token = "idem_gateway-test-token";
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.toml");
    std::fs::write(
        &policy,
        format!(
            "[[identity]]\nname = \"gateway\"\ntoken_hashes = [\"sha256:{}\"]\nnamespaces = [\"charges/*\"]\n",
            hex::encode(sha2::Sha256::digest(token))
        ),
    )
    .unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    let upstream = common::TestUpstream::start().await;
    let service = common::ServiceProcess::start_with(
        Store::Sqlite,
        &[(
            "IDEMPOTENCY_POLICY_FILE",
            policy.to_str().unwrap().to_owned(),
        )],
    )
    .await;
    let client = reqwest::Client::new();
    let post = |gateway: &common::GatewayProcess, path: &str| {
        client
            .post(format!("{}{path}", gateway.url))
            .header("x-api-key", "tenant-a")
            .header("idempotency-key", "\"k\"")
            .send()
    };
    let config = common::config(upstream.addr, &service.url(), "");
    let with_token = common::GatewayProcess::start(&config.replace(
        "shutdown_timeout = \"2s\"",
        &format!(
            "shutdown_timeout = \"2s\"\nservice_token_file = {:?}",
            token_file.to_str().unwrap()
        ),
    ));
    let first = Answer::of(post(&with_token, "/charges").await.unwrap()).await;
    assert_eq!(first.status, 201);
    let replay = Answer::of(post(&with_token, "/charges").await.unwrap()).await;
    assert_eq!(replay, first.as_replayed());
    // A namespace the policy does not grant: the service refuses, nothing runs.
    let refused = Answer::of(post(&with_token, "/flaky").await.unwrap()).await;
    assert_eq!(refused.status, 500);
    assert!(problem_type(&refused).ends_with("/idempotency-service-error"));
    // Without the token: refused the same way.
    let without = common::GatewayProcess::start(&config);
    let anonymous = Answer::of(post(&without, "/charges").await.unwrap()).await;
    assert_eq!(anonymous.status, 500);
    assert!(problem_type(&anonymous).ends_with("/idempotency-service-error"));
    assert_eq!(
        (upstream.effects("/charges"), upstream.effects("/flaky")),
        (1, 0)
    );
}

#[tokio::test]
async fn a_duplicate_whose_client_leaves_while_it_waits_changes_nothing() {
    let rig = Rig::start(Store::Sqlite).await;
    let first = tokio::spawn(
        rig.post("/charges", Some("k"), "tenant-a")
            .header("x-delay-ms", "1200")
            .send(),
    );
    rig.until_upstream_started(1).await;
    // The duplicate's Claim waits for the first; its client gives up. The
    // gateway releases with the duplicate's own lease token, which holds
    // nothing: the first request's lease is untouched.
    let impatient = rig
        .post("/charges", Some("k"), "tenant-a")
        .timeout(Duration::from_millis(200))
        .send()
        .await;
    assert!(impatient.unwrap_err().is_timeout());
    let first = Answer::of(first.await.unwrap().unwrap()).await;
    assert_eq!((first.status, first.replayed.clone()), (201, None));
    let retry = Answer::of(
        rig.post("/charges", Some("k"), "tenant-a")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(retry, first.as_replayed());
    assert_eq!(rig.upstream.effects("/charges"), 1);
}

#[tokio::test]
async fn over_tls_a_post_runs_once_and_is_replayed_on_http1_and_http2() {
    let pki = common::TestPki::new();
    let rig = Rig::with_routes(Store::Sqlite, &pki.config()).await;
    assert!(
        rig.gateway.url.starts_with("https://"),
        "{}",
        rig.gateway.url
    );
    let h2 = common::TlsClient::new(&pki.ca, &[b"h2", b"http/1.1"]);
    let h1 = common::TlsClient::new(&pki.ca, &[b"http/1.1"]);
    let url = &rig.gateway.url;

    let (version, first) = h2.post(url, "/charges", "tls", "tenant-a").await.unwrap();
    assert_eq!(version, http::Version::HTTP_2);
    assert_eq!((first.status, first.replayed.clone()), (201, None));
    assert_eq!(first.json()["effect"], 1);
    let (version, again) = h2.post(url, "/charges", "tls", "tenant-a").await.unwrap();
    assert_eq!(version, http::Version::HTTP_2);
    assert_eq!(again, first.as_replayed());
    let (version, again) = h1.post(url, "/charges", "tls", "tenant-a").await.unwrap();
    assert_eq!(version, http::Version::HTTP_11);
    assert_eq!(again, first.as_replayed());

    // And a key first seen over HTTP/1.1.
    let (version, first) = h1.post(url, "/charges", "tls-1", "tenant-a").await.unwrap();
    assert_eq!(version, http::Version::HTTP_11);
    assert_eq!((first.status, first.replayed.clone()), (201, None));
    assert_eq!(first.json()["effect"], 2);
    let (_, again) = h1.post(url, "/charges", "tls-1", "tenant-a").await.unwrap();
    assert_eq!(again, first.as_replayed());
    assert_eq!(rig.upstream.effects("/charges"), 2);
}

#[tokio::test]
async fn plain_http_to_the_tls_port_fails_and_runs_nothing() {
    let pki = common::TestPki::new();
    let rig = Rig::with_routes(Store::Sqlite, &pki.config()).await;
    let plain = rig.gateway.url.replace("https://", "http://");
    let sent = rig
        .client
        .post(format!("{plain}/charges"))
        .header("x-api-key", "tenant-a")
        .header("idempotency-key", "\"plain\"")
        .body(r#"{"amount":100}"#)
        .send()
        .await;
    assert!(sent.is_err(), "{sent:?}");
    // A client that trusts another CA is refused too.
    let stranger = common::TlsClient::new(&common::TestPki::new().ca, &[b"h2"]);
    assert!(stranger.connect(&rig.gateway.url).await.is_err());
    assert_eq!(rig.upstream.effects("/charges"), 0);
    // The server counts a failed handshake once it has read the client's
    // alert, which may be after the client gave up: poll with a deadline.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let metrics = rig.gateway.metrics().await;
        if metrics.contains("idempotency_gateway_tls_handshake_failures_total 2") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{metrics}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_rotated_certificate_is_served_without_a_restart() {
    let pki = common::TestPki::new();
    let rig = Rig::with_routes(Store::Sqlite, &pki.config()).await;
    let old = common::TlsClient::new(&pki.ca, &[b"h2"]);
    assert!(old.connect(&rig.gateway.url).await.is_ok());
    let new = common::TlsClient::new(&pki.rotate(), &[b"h2"]);
    // The files are re-read every 100 ms: poll with a deadline.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while new.connect(&rig.gateway.url).await.is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "the new certificate is not served within 5 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(old.connect(&rig.gateway.url).await.is_err());
    let (_, answer) = new
        .post(&rig.gateway.url, "/charges", "rotated", "tenant-a")
        .await
        .unwrap();
    assert_eq!(
        (answer.status, answer.json()["effect"].clone()),
        (201, 1.into())
    );
}

/// Waits for the gateway's process to end (within `within`): its status.
async fn exited(rig: &mut Rig, within: Duration) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + within;
    loop {
        if let Some(status) = rig.gateway.child.try_wait().unwrap() {
            return status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still running {within:?} after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn sigterm_waits_for_the_work_of_a_client_that_left_and_its_retry_is_replayed() {
    let mut rig = Rig::start(Store::Sqlite).await;
    let left = rig
        .post("/charges", Some("left"), "tenant-a")
        .header("x-delay-ms", "1000")
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(left.unwrap_err().is_timeout());
    rig.until_upstream_started(1).await;
    // No connection is left to drain: only the background work holds the
    // process, until the upstream answers and the response is stored.
    rig.gateway.terminate();
    let status = exited(&mut rig, Duration::from_secs(5)).await;
    assert!(status.success(), "{status:?}");
    assert_eq!(rig.upstream.effects("/charges"), 1);
    // The next gateway, on the same service, replays the stored response.
    rig.gateway =
        common::GatewayProcess::start(&common::config(rig.upstream.addr, &rig.service.url(), ""));
    let retry = Answer::of(
        rig.post("/charges", Some("left"), "tenant-a")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (
            retry.status,
            retry.replayed.as_deref(),
            retry.json()["effect"].clone()
        ),
        (201, Some("true"), 1.into())
    );
    assert_eq!(rig.upstream.effects("/charges"), 1);
}

#[tokio::test]
async fn sigterm_stops_waiting_for_background_work_at_the_shutdown_timeout() {
    let mut rig = Rig::start(Store::Sqlite).await;
    let left = rig
        .post("/charges", Some("slow"), "tenant-a")
        .header("x-delay-ms", "10000")
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(left.unwrap_err().is_timeout());
    rig.until_upstream_started(1).await;
    let terminated = std::time::Instant::now();
    rig.gateway.terminate();
    // The rig's shutdown_timeout is 2 s; the upstream takes 10.
    let status = exited(&mut rig, Duration::from_secs(6)).await;
    assert!(status.success(), "{status:?}");
    assert!(
        terminated.elapsed() >= Duration::from_secs(2),
        "{:?}",
        terminated.elapsed()
    );
    assert_eq!(rig.upstream.effects("/charges"), 0);
}
