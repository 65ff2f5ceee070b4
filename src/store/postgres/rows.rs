//! Between Rust and the rows: decoding the statements' rows into the
//! domain's types, and binding a batch's leases as arrays in lock order.

use std::cmp::Ordering;
use std::time::{Duration, SystemTime};

use sqlx::Postgres;
use sqlx::Row;
use sqlx::postgres::{PgArguments, PgRow};
use time::OffsetDateTime;

use crate::domain::{
    Checkpoint, Fingerprint, Key, Lease, LeaseToken, Namespace, NewLease, Purged, Record,
    RecordState, Snapshot,
};
use crate::error::Error;
use crate::store::{FirstClaim, StateCount, StoreStats, micros};

pub(super) fn system_time(t: OffsetDateTime) -> SystemTime {
    SystemTime::from(t)
}

/// The state column's code of a marker: a remembered key, whose result the
/// reaper dropped (see the migration `20261205000001_remembered_keys`).
pub(super) const MARKER: i16 = 4;

pub(super) fn state_from(code: i16) -> Result<RecordState, Error> {
    match code {
        1 => Ok(RecordState::InProgress),
        2 | MARKER => Ok(RecordState::Completed),
        3 => Ok(RecordState::Released),
        other => Err(Error::Internal(
            format!("unknown record state {other} in the database").into(),
        )),
    }
}

/// What Purge answers: the state of the live record it expired, or
/// [`MARKER`] for a remembered key it made claimable.
pub(super) fn purged_from(code: i16) -> Result<Purged, Error> {
    match code {
        MARKER => Ok(Purged::Remembered),
        code => state_from(code).map(Purged::Live),
    }
}

pub(super) fn token_from(bytes: Vec<u8>) -> Result<LeaseToken, Error> {
    <[u8; 16]>::try_from(bytes)
        .map(LeaseToken::from_bytes)
        .map_err(|_| Error::Internal("a stored lease token is not 16 bytes".into()))
}

/// The positions of the first occurrence of each item, in the order `cmp`
/// sorts them (items it finds equal are one): the order rows are locked in
/// when `cmp` starts with (namespace, key) in byte order.
pub(super) fn distinct_in_key_order<T>(
    items: &[T],
    cmp: impl Fn(&T, &T) -> Ordering,
) -> Vec<usize> {
    let mut order: Vec<usize> = (0..items.len()).collect();
    // Stable: of equal items, the first occurrence stays first and is kept.
    order.sort_by(|&a, &b| cmp(&items[a], &items[b]));
    order.dedup_by(|later, kept| cmp(&items[*later], &items[*kept]).is_eq());
    order
}

/// (namespace, key) in byte order.
pub(super) fn by_key(a: (&Namespace, &Key), b: (&Namespace, &Key)) -> Ordering {
    (a.0.as_str().as_bytes(), a.1.as_str().as_bytes())
        .cmp(&(b.0.as_str().as_bytes(), b.1.as_str().as_bytes()))
}

/// The arrays a set-based claim binds as $1 to $6 (namespace, key, lease
/// token, fingerprint, lease and retention in microseconds), in `order`.
pub(super) struct LeaseArrays<'a> {
    namespaces: Vec<&'a str>,
    names: Vec<&'a str>,
    tokens: Vec<&'a [u8]>,
    fingerprints: Vec<Option<&'a [u8]>>,
    lease_us: Vec<i64>,
    retention_us: Vec<i64>,
}

impl<'a> LeaseArrays<'a> {
    pub(super) fn new(leases: &'a [NewLease], order: &[usize]) -> Self {
        let picked = || order.iter().map(|&i| &leases[i]);
        Self {
            namespaces: picked().map(|l| l.namespace.as_str()).collect(),
            names: picked().map(|l| l.key.as_str()).collect(),
            tokens: picked()
                .map(|l| l.lease_token.as_bytes().as_slice())
                .collect(),
            fingerprints: picked()
                .map(|l| l.fingerprint.as_ref().map(Fingerprint::as_bytes))
                .collect(),
            lease_us: picked().map(|l| micros(l.lease_ttl)).collect(),
            retention_us: picked().map(|l| micros(l.retention)).collect(),
        }
    }

    pub(super) fn bind<'q>(&'q self, query: PgQuery<'q>) -> PgQuery<'q> {
        query
            .bind(&self.namespaces)
            .bind(&self.names)
            .bind(&self.tokens)
            .bind(&self.fingerprints)
            .bind(&self.lease_us)
            .bind(&self.retention_us)
    }
}

pub(super) type PgQuery<'q> = sqlx::query::Query<'q, Postgres, PgArguments>;

pub(super) fn lease_from_row(row: &PgRow, lease_token: LeaseToken) -> Result<Lease, Error> {
    let get = |e: sqlx::Error| Error::Internal(Box::new(e));
    Ok(Lease {
        lease_token,
        fencing_token: row.try_get::<i64, _>("fencing_token").map_err(get)? as u64,
        lease_expires_at: system_time(row.try_get("lease_expires_at").map_err(get)?),
        expires_at: system_time(row.try_get("expires_at").map_err(get)?),
        checkpoint: checkpoint_from_row(row)?,
    })
}

/// The checkpoint columns of a row (NULL for a key that has none).
pub(super) fn checkpoint_from_row(row: &PgRow) -> Result<Option<Checkpoint>, Error> {
    let get = |e: sqlx::Error| Error::Internal(Box::new(e));
    Ok(Checkpoint::from_stored(
        row.try_get("checkpoint").map_err(get)?,
        row.try_get("checkpoint_fencing").map_err(get)?,
    ))
}

/// StoreStats from the rows of STATS_LIVE (or its sample) and STATS_SUMMARY
/// (or its indexed form).
pub(super) fn stats_from_rows(rows: &[PgRow], summary: &PgRow) -> Result<StoreStats, Error> {
    let get = |e: sqlx::Error| Error::Internal(Box::new(e));
    let mut live = Vec::new();
    let mut remembered = Vec::new();
    for row in rows {
        let namespace: String = row.try_get("namespace").map_err(get)?;
        let code: i16 = row.try_get("state").map_err(get)?;
        let count = row.try_get::<i64, _>("count").map_err(get)? as u64;
        if code == MARKER {
            remembered.push((namespace, count));
        } else {
            live.push(StateCount {
                namespace,
                state: state_from(code)?,
                count,
            });
        }
    }
    Ok(StoreStats {
        now: system_time(summary.try_get("now").map_err(get)?),
        live,
        remembered,
        expired: summary.try_get::<i64, _>("expired").map_err(get)? as u64,
        oldest_created_at: summary
            .try_get::<Option<OffsetDateTime>, _>("oldest_created_at")
            .map_err(get)?
            .map(system_time),
        earliest_expiry: summary
            .try_get::<Option<OffsetDateTime>, _>("earliest_expiry")
            .map_err(get)?
            .map(system_time),
    })
}

/// One row of CLAIM_OR_FETCH(_MANY): the new lease, or the record found.
pub(super) fn first_claim_from_row(row: &PgRow, lease: &NewLease) -> Result<FirstClaim, Error> {
    let inserted: bool = row
        .try_get("inserted")
        .map_err(|e| Error::Internal(Box::new(e)))?;
    if inserted {
        Ok(FirstClaim::Inserted(lease_from_row(
            row,
            lease.lease_token,
        )?))
    } else {
        Ok(FirstClaim::Found(snapshot_from_row(row)?))
    }
}

pub(super) fn snapshot_from_row(row: &PgRow) -> Result<Snapshot, Error> {
    let get = |e: sqlx::Error| Error::Internal(Box::new(e));
    let now = system_time(row.try_get("now").map_err(get)?);
    let Some(state) = row.try_get::<Option<i16>, _>("state").map_err(get)? else {
        return Ok(Snapshot { now, record: None });
    };
    let expires_at = system_time(row.try_get("expires_at").map_err(get)?);
    let remember_until = row
        .try_get::<Option<OffsetDateTime>, _>("remember_until")
        .map_err(get)?
        .map(system_time);
    // A marker keeps the horizon in expires_at (where the reaper files it)
    // and the result's expiry in remember_until: the record it stands for is
    // completed, expired at the latter, remembered until the former.
    let (expires_at, remember_until) = match (state, remember_until) {
        (MARKER, Some(expired_at)) => (expired_at, Some(expires_at)),
        (MARKER, None) => {
            return Err(Error::Internal(
                "a marker in the database has no expiry".into(),
            ));
        }
        _ => (expires_at, remember_until),
    };
    let record = Record {
        state: state_from(state)?,
        fencing_token: row.try_get::<i64, _>("fencing_token").map_err(get)? as u64,
        lease_token: Some(token_from(row.try_get("lease_token").map_err(get)?)?),
        fingerprint: row
            .try_get::<Option<Vec<u8>>, _>("fingerprint")
            .map_err(get)?
            .and_then(Fingerprint::from_stored),
        response: row.try_get("response").map_err(get)?,
        retention: Duration::from_micros(row.try_get::<i64, _>("retention_us").map_err(get)? as u64),
        lease_expires_at: row
            .try_get::<Option<OffsetDateTime>, _>("lease_expires_at")
            .map_err(get)?
            .map(system_time),
        expires_at,
        created_at: system_time(row.try_get("created_at").map_err(get)?),
        updated_at: system_time(row.try_get("updated_at").map_err(get)?),
        checkpoint: checkpoint_from_row(row)?,
        remember_until,
    };
    Ok(Snapshot {
        now,
        record: Some(record),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(super) fn distinct_items_come_in_key_order_keeping_each_first_occurrence() {
        let items = [
            ("n", "b", 1),
            ("n", "a", 2),
            ("m", "z", 3),
            ("n", "b", 4),
            ("n", "a", 5),
        ];
        let order = distinct_in_key_order(&items, |x, y| (x.0, x.1).cmp(&(y.0, y.1)));
        assert_eq!(order, [2, 1, 0]);
        let by_all = distinct_in_key_order(&items, |x, y| (x.0, x.1, x.2).cmp(&(y.0, y.1, y.2)));
        assert_eq!(by_all, [2, 1, 4, 0, 3]);
    }
}
