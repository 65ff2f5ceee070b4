//! What every case of the conformance suite shares: the namespace its keys
//! live in, the helpers of `common` with that namespace filled in (`claim`,
//! `get`, `complete_request`, … take a key alone here), and the macro that
//! runs each case once per store.

use std::time::{Duration, SystemTime};

pub use crate::common::*;
pub use idempotency_service::grpc::proto::{ClaimRequest, ClaimResponse, Outcome};
use idempotency_service::grpc::proto::{
    CompleteRequest, ExtendLeaseRequest, GetResponse, ReleaseRequest,
};

/// One test per case and store, named `postgres::case` (concurrent calls
/// coalesced, as in production), `postgres_uncoalesced::case` (one statement
/// per call) and `sqlite::case`.
macro_rules! conformance {
    ($($module:ident :: $case:ident),* $(,)?) => {
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    crate::$module::$case(crate::common::Backend::Postgres).await
                }
            )*
        }
        mod postgres_uncoalesced {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    crate::$module::$case(crate::common::Backend::PostgresUncoalesced).await
                }
            )*
        }
        mod postgres_citus_sql {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    crate::$module::$case(crate::common::Backend::PostgresCitusSql).await
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    crate::$module::$case(crate::common::Backend::Sqlite).await
                }
            )*
        }
    };
}
pub(crate) use conformance;

pub const NS: &str = "payments/webhooks";

pub async fn claim(client: &mut Client, key: &str) -> ClaimResponse {
    crate::common::claim(client, NS, key).await
}

pub async fn claim_with(client: &mut Client, request: ClaimRequest) -> ClaimResponse {
    client.claim(request).await.unwrap().into_inner()
}

pub fn complete_request(key: &str, token: &str, response: &[u8]) -> CompleteRequest {
    crate::common::complete_request(NS, key, token, response)
}

pub fn release_request(key: &str, token: &str) -> ReleaseRequest {
    crate::common::release_request(NS, key, token)
}

pub fn extend_request(
    key: &str,
    token: &str,
    ttl: Option<prost_types::Duration>,
) -> ExtendLeaseRequest {
    crate::common::extend_request(NS, key, token, ttl)
}

pub async fn get(client: &mut Client, key: &str) -> GetResponse {
    crate::common::get(client, NS, key).await
}

/// Claims `key` with a 1 s lease and waits until that lease has run out, by
/// polling Get until the store's clock is past the lease.
pub async fn claim_and_let_lease_expire(client: &mut Client, key: &str) -> ClaimResponse {
    let mut request = claim_request(NS, key);
    request.lease_ttl = secs(1);
    let claimed = claim_with(client, request).await;
    assert_eq!(outcome(&claimed), Outcome::Claimed);
    wait_past(claimed.lease_expires_at).await;
    claimed
}

/// Waits until the local clock is past `t` plus a margin for clock reading.
pub async fn wait_past(t: Option<prost_types::Timestamp>) {
    let deadline = at(&t) + Duration::from_millis(50);
    let passed = eventually(Duration::from_secs(10), || async {
        (SystemTime::now() > deadline).then_some(())
    })
    .await;
    assert!(passed.is_some());
}

/// A fresh caller-chosen lease token, as a client makes one per attempt.
pub fn own_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// A Claim of `key` under the caller's own lease token (retry-safe).
pub fn claim_with_token(key: &str, token: &str) -> ClaimRequest {
    ClaimRequest {
        lease_token: token.to_owned(),
        ..claim_request(NS, key)
    }
}
