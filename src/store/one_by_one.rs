//! The batch and combined operations of `Store`, made of its single ones: what
//! a store without set-based statements (SQLite, one writer) answers with.
//! Each is a plain function its `Store` impl calls by name, so no decorator
//! inherits one by accident.

use std::time::SystemTime;

use super::{FirstClaim, Store};
use crate::domain::{Completion, Key, Lease, Namespace, NewLease, Snapshot};
use crate::error::Error;

/// Reads the key, then tries the guarded claim when the read found nothing.
pub async fn claim_or_fetch<S: Store>(store: &S, lease: &NewLease) -> Result<FirstClaim, Error> {
    let snapshot = store.fetch(&lease.namespace, &lease.key).await?;
    if snapshot.record.is_some() {
        return Ok(FirstClaim::Found(snapshot));
    }
    Ok(match store.try_claim(lease).await? {
        Some(lease) => FirstClaim::Inserted(lease),
        None => FirstClaim::Raced,
    })
}

/// `claim_or_fetch` for each lease in turn.
pub async fn claim_or_fetch_many<S: Store>(
    store: &S,
    leases: &[NewLease],
) -> Result<Vec<FirstClaim>, Error> {
    let mut results = Vec::with_capacity(leases.len());
    for lease in leases {
        results.push(store.claim_or_fetch(lease).await?);
    }
    Ok(results)
}

/// `fetch` for each key in turn.
pub async fn fetch_many<S: Store>(
    store: &S,
    keys: &[(Namespace, Key)],
) -> Result<Vec<Snapshot>, Error> {
    let mut snapshots = Vec::with_capacity(keys.len());
    for (namespace, key) in keys {
        snapshots.push(store.fetch(namespace, key).await?);
    }
    Ok(snapshots)
}

/// `try_claim` for each lease in turn.
pub async fn try_claim_many<S: Store>(
    store: &S,
    leases: &[NewLease],
) -> Result<Vec<Option<Lease>>, Error> {
    let mut results = Vec::with_capacity(leases.len());
    for lease in leases {
        results.push(store.try_claim(lease).await?);
    }
    Ok(results)
}

/// `complete` for each completion in turn.
pub async fn complete_many<S: Store>(
    store: &S,
    completions: &[Completion],
) -> Result<Vec<Option<SystemTime>>, Error> {
    let mut results = Vec::with_capacity(completions.len());
    for c in completions {
        results.push(
            store
                .complete(
                    &c.namespace,
                    &c.key,
                    &c.lease_token,
                    &c.response,
                    c.retention,
                    c.remember_for,
                )
                .await?,
        );
    }
    Ok(results)
}
