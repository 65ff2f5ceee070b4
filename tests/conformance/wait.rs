//! Claims that wait (ClaimRequest.wait): for the holder to Complete (the
//! stored response), Release, vanish (its lease runs out) or be purged (one
//! waiter claims, the others get its result), across two replicas on
//! PostgreSQL; the cap, cancelled waiters, the call's deadline, shutdown,
//! and bad input.
//!
//! Whether every waiter is waiting before the holder acts is asked of the
//! servers themselves: with IDEMPOTENCY_MAX_WAITERS set to the waiters per
//! replica, a probe Claim that asks to wait on another held key is answered
//! at once with `waited` zero exactly when the replica's waiters are all in.

use std::time::Duration;

use tonic::Code;

use crate::support::*;
use idempotency_service::grpc::proto::{ClaimBatchRequest, PurgeRequest};

/// The waiters of the 64-waiter cases.
const WAITERS: usize = 64;

fn wire(d: Duration) -> Option<prost_types::Duration> {
    Some(prost_types::Duration::try_from(d).unwrap())
}

fn waiting_request(key: &str, wait: Duration) -> ClaimRequest {
    ClaimRequest {
        wait: wire(wait),
        ..claim_with_token(key, &own_token())
    }
}

fn waited(response: &ClaimResponse) -> Option<Duration> {
    response
        .waited
        .map(|w| Duration::try_from(w).expect("a non-negative duration"))
}

/// One server per replica on one store (two on PostgreSQL, one on SQLite,
/// which serves one process), each letting `per_replica` Claims wait.
async fn replicas(store: &StoreFixture, per_replica: usize) -> Vec<TestServer> {
    let count = if store.backend == Backend::Sqlite {
        1
    } else {
        2
    };
    let mut servers = Vec::new();
    for _ in 0..count {
        let mut config = store.config();
        config.max_waiters = per_replica;
        servers.push(TestServer::start(config).await);
    }
    servers
}

/// A fresh store and its replicas, each with room for exactly its share of
/// the `WAITERS`.
async fn room_for_all_waiters(backend: Backend) -> (StoreFixture, Vec<TestServer>) {
    let store = StoreFixture::new(backend).await;
    let replicas_count = if backend == Backend::Sqlite { 1 } else { 2 };
    let servers = replicas(&store, WAITERS / replicas_count).await;
    (store, servers)
}

/// A Claim that waits, asked again when the replica had no room (a probe
/// took the place for a moment): what a caller gets once it waits.
async fn wait_for(mut client: Client, key: String, wait: Duration) -> ClaimResponse {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let response = claim_with(&mut client, waiting_request(&key, wait)).await;
        let refused =
            outcome(&response) == Outcome::InProgress && waited(&response) == Some(Duration::ZERO);
        if !refused || tokio::time::Instant::now() > deadline {
            return response;
        }
    }
}

/// Returns once every replica's waiters are all in (see the module's doc).
async fn until_full(servers: &[TestServer]) {
    for server in servers {
        let client = server.client.clone();
        let full = eventually(Duration::from_secs(20), || {
            let mut client = client.clone();
            async move {
                let probe = claim_with(
                    &mut client,
                    waiting_request("probe", Duration::from_millis(1)),
                )
                .await;
                (outcome(&probe) == Outcome::InProgress && waited(&probe) == Some(Duration::ZERO))
                    .then_some(())
            }
        })
        .await;
        assert!(full.is_some(), "the waiters never all waited");
    }
}

/// Starts `WAITERS` waiting Claims of `key`, spread over the replicas. A
/// waiter that wins the key completes it at once with `second`.
fn start_waiters(
    servers: &[TestServer],
    key: &str,
    wait: Duration,
) -> Vec<tokio::task::JoinHandle<ClaimResponse>> {
    (0..WAITERS)
        .map(|i| {
            let mut client = servers[i % servers.len()].client.clone();
            let key = key.to_owned();
            tokio::spawn(async move {
                let response = wait_for(client.clone(), key.clone(), wait).await;
                if outcome(&response) == Outcome::Claimed {
                    client
                        .complete(complete_request(&key, &response.lease_token, b"second"))
                        .await
                        .unwrap();
                }
                response
            })
        })
        .collect()
}

async fn answers(waiters: Vec<tokio::task::JoinHandle<ClaimResponse>>) -> Vec<ClaimResponse> {
    let mut all = Vec::new();
    for waiter in waiters {
        all.push(
            tokio::time::timeout(Duration::from_secs(60), waiter)
                .await
                .expect("a waiter never answered")
                .unwrap(),
        );
    }
    all
}

/// A held key for the probe, and the holder of the key under test.
async fn hold(
    servers: &[TestServer],
    key: &str,
    lease_ttl: Option<prost_types::Duration>,
) -> ClaimResponse {
    let mut client = servers[0].client.clone();
    assert_eq!(
        outcome(&claim(&mut client, "probe").await),
        Outcome::Claimed
    );
    let holder = claim_with(
        &mut client,
        ClaimRequest {
            lease_ttl,
            ..claim_with_token(key, &own_token())
        },
    )
    .await;
    assert_eq!(outcome(&holder), Outcome::Claimed);
    holder
}

/// After one waiter claimed and completed with `second`: exactly one claimed
/// with the next fencing token, and every other got its result.
fn one_claimed_the_rest_replayed(all: &[ClaimResponse], fencing: u64) {
    let claimed: Vec<&ClaimResponse> = all
        .iter()
        .filter(|r| outcome(r) == Outcome::Claimed)
        .collect();
    assert_eq!(claimed.len(), 1, "exactly one waiter takes the key");
    assert_eq!(claimed[0].fencing_token, fencing);
    for response in all.iter().filter(|r| outcome(r) != Outcome::Claimed) {
        assert_eq!(outcome(response), Outcome::Completed, "{response:?}");
        assert_eq!(response.response, b"second");
    }
    assert!(all.iter().all(|r| waited(r).is_some()));
}

pub async fn waiters_get_the_stored_response_when_the_holder_completes(backend: Backend) {
    let (_store, servers) = room_for_all_waiters(backend).await;
    let holder = hold(&servers, "k", None).await;
    let waiters = start_waiters(&servers, "k", Duration::from_secs(20));
    until_full(&servers).await;
    // The work takes 200 ms.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut client = servers[0].client.clone();
    client
        .complete(complete_request("k", &holder.lease_token, b"first"))
        .await
        .unwrap();
    let all = answers(waiters).await;
    assert_eq!(all.len(), WAITERS);
    for response in &all {
        assert_eq!(outcome(response), Outcome::Completed, "{response:?}");
        assert_eq!(response.response, b"first");
        assert!(waited(response).unwrap() > Duration::ZERO);
    }
}

pub async fn when_the_holder_releases_one_waiter_claims_and_the_rest_get_its_result(
    backend: Backend,
) {
    let (_store, servers) = room_for_all_waiters(backend).await;
    let holder = hold(&servers, "k", None).await;
    let waiters = start_waiters(&servers, "k", Duration::from_secs(20));
    until_full(&servers).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut client = servers[1 % servers.len()].client.clone();
    client
        .release(release_request("k", &holder.lease_token))
        .await
        .unwrap();
    one_claimed_the_rest_replayed(&answers(waiters).await, 2);
}

pub async fn when_the_holder_vanishes_one_waiter_takes_over_at_its_lease_expiry(backend: Backend) {
    let (_store, servers) = room_for_all_waiters(backend).await;
    // A holder with a one-second lease that never comes back.
    hold(&servers, "k", secs(1)).await;
    let waiters = start_waiters(&servers, "k", Duration::from_secs(20));
    let all = answers(waiters).await;
    one_claimed_the_rest_replayed(&all, 2);
}

pub async fn a_purge_while_claims_wait_lets_one_claim_and_the_rest_get_its_result(
    backend: Backend,
) {
    let (_store, servers) = room_for_all_waiters(backend).await;
    let holder = hold(&servers, "k", None).await;
    let waiters = start_waiters(&servers, "k", Duration::from_secs(20));
    until_full(&servers).await;
    let mut client = servers[0].client.clone();
    let purged = client
        .purge(PurgeRequest {
            namespace: NS.to_owned(),
            key: "k".to_owned(),
            reason: "test".to_owned(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(purged.purged);
    one_claimed_the_rest_replayed(&answers(waiters).await, 2);
    // The purged holder's lease is gone: the key was completed under the
    // waiter's.
    assert_code(
        client
            .complete(complete_request("k", &holder.lease_token, b"late"))
            .await,
        Code::FailedPrecondition,
    );
}

pub async fn cancelled_waiters_leave_their_place_and_the_cap_answers_at_once(backend: Backend) {
    let store = StoreFixture::new(backend).await;
    let mut config = store.config();
    config.max_waiters = 4;
    let server = TestServer::start(config).await;
    let servers = std::slice::from_ref(&server);
    hold(servers, "k", None).await;
    // Four waiters whose callers go away: the calls are dropped.
    let gone: Vec<_> = (0..4)
        .map(|_| {
            tokio::spawn(wait_for(
                server.client.clone(),
                "k".into(),
                Duration::from_secs(20),
            ))
        })
        .collect();
    until_full(servers).await;
    for waiter in &gone {
        waiter.abort();
    }
    // Their places are free again: a probe waits (its 1 ms) instead of
    // being turned away.
    let mut client = server.client.clone();
    let freed = eventually(Duration::from_secs(10), || {
        let mut client = client.clone();
        async move {
            let probe = claim_with(
                &mut client,
                waiting_request("probe", Duration::from_millis(1)),
            )
            .await;
            (waited(&probe) > Some(Duration::ZERO)).then_some(())
        }
    })
    .await;
    assert!(freed.is_some(), "cancelled waiters kept their places");
    // Four waiters again fill the replica; a fifth is answered at once.
    let staying: Vec<_> = (0..4)
        .map(|_| {
            tokio::spawn(wait_for(
                server.client.clone(),
                "k".into(),
                Duration::from_secs(20),
            ))
        })
        .collect();
    until_full(servers).await;
    let started = tokio::time::Instant::now();
    let fifth = claim_with(&mut client, waiting_request("k", Duration::from_secs(20))).await;
    assert_eq!(outcome(&fifth), Outcome::InProgress);
    assert_eq!(waited(&fifth), Some(Duration::ZERO));
    assert!(fifth.retry_after.is_some());
    assert!(started.elapsed() < Duration::from_secs(10));
    for waiter in staying {
        waiter.abort();
    }
}

pub async fn a_wait_ends_before_the_calls_deadline_with_in_progress(backend: Backend) {
    let (_store, server) = TestServer::fresh(backend).await;
    let servers = std::slice::from_ref(&server);
    hold(servers, "k", None).await;
    let mut client = server.client.clone();
    let mut request = tonic::Request::new(waiting_request("k", Duration::from_secs(20)));
    request.set_timeout(Duration::from_millis(800));
    let response = client
        .claim(request)
        .await
        .expect("answered before the deadline")
        .into_inner();
    assert_eq!(outcome(&response), Outcome::InProgress);
    let waited = waited(&response).unwrap();
    assert!(
        waited > Duration::from_millis(300) && waited < Duration::from_millis(800),
        "{waited:?}"
    );
    let retry_after = Duration::try_from(response.retry_after.unwrap()).unwrap();
    assert!(
        retry_after > Duration::from_secs(25) && retry_after <= Duration::from_secs(30),
        "{retry_after:?}"
    );
}

pub async fn shutdown_answers_waiters_in_progress_at_once(backend: Backend) {
    let store = StoreFixture::new(backend).await;
    let mut config = store.config();
    config.max_waiters = 8;
    let server = TestServer::start(config).await;
    hold(std::slice::from_ref(&server), "k", None).await;
    let waiters: Vec<_> = (0..8)
        .map(|_| {
            tokio::spawn(wait_for(
                server.client.clone(),
                "k".into(),
                Duration::from_secs(25),
            ))
        })
        .collect();
    until_full(std::slice::from_ref(&server)).await;
    let started = tokio::time::Instant::now();
    server.stop().await.unwrap();
    for waiter in waiters {
        let response = waiter.await.unwrap();
        assert_eq!(outcome(&response), Outcome::InProgress);
        assert!(waited(&response).unwrap() > Duration::ZERO);
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

pub async fn without_wait_or_retried_a_claim_answers_at_once_and_bad_waits_are_refused(
    backend: Backend,
) {
    let (store, server) = TestServer::fresh(backend).await;
    let mut client = server.client.clone();
    let token = own_token();
    let holder = claim_with(&mut client, claim_with_token("k", &token)).await;
    assert_eq!(outcome(&holder), Outcome::Claimed);
    // No wait: in progress, as always, and no `waited`.
    let plain = claim(&mut client, "k").await;
    assert_eq!(outcome(&plain), Outcome::InProgress);
    assert_eq!(plain.waited, None);
    // A retried Claim (the live lease's token) is answered at once.
    let retried = claim_with(
        &mut client,
        ClaimRequest {
            wait: secs(20),
            ..claim_with_token("k", &token)
        },
    )
    .await;
    assert_eq!(outcome(&retried), Outcome::Claimed);
    assert!(retried.retried);
    assert_eq!(waited(&retried), Some(Duration::ZERO));
    // A new key with a wait is claimed at once.
    let fresh = claim_with(
        &mut client,
        waiting_request("fresh", Duration::from_secs(20)),
    )
    .await;
    assert_eq!(outcome(&fresh), Outcome::Claimed);
    assert_eq!(waited(&fresh), Some(Duration::ZERO));
    // Bad waits name the field and change nothing.
    let before = store.row_count().await;
    for (wait, why) in [
        (
            prost_types::Duration {
                seconds: -1,
                nanos: 0,
            },
            "negative",
        ),
        (
            prost_types::Duration {
                seconds: 3601,
                nanos: 0,
            },
            "1 hour",
        ),
    ] {
        let status = assert_code(
            client
                .claim(ClaimRequest {
                    wait: Some(wait),
                    ..claim_with_token("bad", &own_token())
                })
                .await,
            Code::InvalidArgument,
        );
        assert!(status.message().starts_with("wait:"), "{status:?}");
        assert!(status.message().contains(why), "{status:?}");
    }
    let status = assert_code(
        client
            .claim_batch(ClaimBatchRequest {
                items: vec![
                    claim_with_token("b1", &own_token()),
                    waiting_request("b2", Duration::from_secs(1)),
                ],
                ..Default::default()
            })
            .await,
        Code::InvalidArgument,
    );
    assert!(status.message().starts_with("items[1].wait:"), "{status:?}");
    assert_eq!(store.row_count().await, before);
    assert_eq!(state(&get(&mut client, "bad").await), State::Absent);
    assert_eq!(state(&get(&mut client, "b1").await), State::Absent);
}
