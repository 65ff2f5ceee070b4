//! The PostgreSQL store's SQL: every statement it sends, and the settings of
//! its sessions. Nothing else in the service holds SQL.
//!
//! Each statement on the call path finds its row by primary key and is the
//! whole rule of one transition: its WHERE clause decides, with the
//! database's `now()` as the only clock. A rule two statements share is
//! written once, as a macro the statements `concat!`.

/// The columns of a new record, as every claim inserts them.
macro_rules! insert_record {
    () => {
        "INSERT INTO idempotency_records AS r
    (namespace, key, state, fencing_token, lease_token, fingerprint, response, retention_us,
     lease_expires_at, expires_at, created_at, updated_at)
"
    };
}

/// The takeover rule, written once: a conflicting row is taken over when it
/// is expired and not remembered (it starts afresh: fingerprint, creation
/// time and checkpoint replaced), or released or in progress under an
/// expired lease with no conflicting fingerprint (its checkpoint stays for
/// the new holder). Either way the fencing counter goes on. A remembered key
/// (a completed record past its expiry, before its horizon) is only ever
/// re-claimed by RECLAIM, and a marker (state 4) is live until its horizon,
/// so neither is taken here. `excluded` is the offered new record,
/// and its `created_at` is the statement's `now()`: the rule reads the clock
/// through it because Citus runs no `now()` in an `ON CONFLICT` clause
/// (it evaluates the inserted values on the coordinator instead). On plain
/// PostgreSQL the two are the same value.
macro_rules! takeover {
    () => {
        "ON CONFLICT (namespace, key) DO UPDATE SET
    state = 1,
    fencing_token = r.fencing_token + 1,
    lease_token = excluded.lease_token,
    fingerprint = CASE WHEN r.expires_at <= excluded.created_at THEN excluded.fingerprint
                       ELSE coalesce(r.fingerprint, excluded.fingerprint) END,
    response = NULL,
    retention_us = excluded.retention_us,
    lease_expires_at = excluded.lease_expires_at,
    expires_at = excluded.expires_at,
    created_at = CASE WHEN r.expires_at <= excluded.created_at THEN excluded.created_at
                      ELSE r.created_at END,
    updated_at = excluded.updated_at,
    checkpoint = CASE WHEN r.expires_at <= excluded.created_at THEN NULL ELSE r.checkpoint END,
    checkpoint_fencing = CASE WHEN r.expires_at <= excluded.created_at THEN NULL
                              ELSE r.checkpoint_fencing END,
    remember_until = NULL
WHERE (r.expires_at <= excluded.created_at
       AND NOT (r.state = 2 AND coalesce(r.remember_until > excluded.created_at, false)))
   OR ((r.state = 3 OR (r.state = 1 AND r.lease_expires_at <= excluded.created_at))
       AND (r.fingerprint IS NULL OR excluded.fingerprint IS NULL
            OR r.fingerprint = excluded.fingerprint))
"
    };
}

/// The record columns, in the order `record_from_row` reads them.
pub(super) const FETCH: &str = "
SELECT now() AS now, r.state, r.fencing_token, r.lease_token, r.fingerprint, r.response,
       r.retention_us, r.lease_expires_at, r.expires_at, r.created_at, r.updated_at,
       r.checkpoint, r.checkpoint_fencing, r.remember_until
FROM (SELECT 1) AS clock
LEFT JOIN idempotency_records AS r ON r.namespace = $1 AND r.key = $2";

/// FETCH for a Claim that waits on the key's holder, marking the row
/// `watched` when it is in progress under a live lease and not marked yet:
/// from the mark's commit on, the row's Complete or Release is announced on
/// the purges channel (the trigger of the migration `20261204000001_waiters`).
/// `marked` says this statement set the flag, `watched` that it was set
/// before. An in-progress, live, unwatched row that was not marked was changed
/// between the statement's snapshot and its row lock: the caller reads again.
pub(super) const WATCH: &str = "
WITH marked AS (
    UPDATE idempotency_records
    SET watched = true
    WHERE namespace = $1 AND key = $2 AND state = 1 AND NOT watched
      AND lease_expires_at > now() AND expires_at > now()
    RETURNING 1)
SELECT now() AS now, r.state, r.fencing_token, r.lease_token, r.fingerprint, r.response,
       r.retention_us, r.lease_expires_at, r.expires_at, r.created_at, r.updated_at,
       r.checkpoint, r.checkpoint_fencing, r.remember_until,
       coalesce(r.watched, false) AS watched,
       EXISTS (SELECT FROM marked) AS marked
FROM (SELECT 1) AS clock
LEFT JOIN idempotency_records AS r ON r.namespace = $1 AND r.key = $2";

/// FETCH for many keys at once: one row per input, in input order.
///
/// One primary-key lookup per input, whatever the statistics say: as a plain
/// join, the plan PostgreSQL caches for this prepared statement while the
/// table is new (never analysed) is a hash join over a sequential scan, which
/// then reads the whole table for every batch as it grows (30 ms for 100 keys
/// at 200,000 rows, against 0.2 ms). `LIMIT 1` keeps the subquery from being
/// flattened into such a join.
pub(super) const FETCH_MANY: &str = "
SELECT now() AS now, r.state, r.fencing_token, r.lease_token, r.fingerprint, r.response,
       r.retention_us, r.lease_expires_at, r.expires_at, r.created_at, r.updated_at,
       r.checkpoint, r.checkpoint_fencing, r.remember_until
FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS i(namespace, key, ord)
LEFT JOIN LATERAL (
    SELECT * FROM idempotency_records AS x
    WHERE x.namespace = i.namespace COLLATE \"C\" AND x.key = i.key COLLATE \"C\"
    LIMIT 1) AS r ON true
ORDER BY i.ord";

/// A Claim's first step: inserts the key when it has no row, else reads the
/// row, in one round trip. `ON CONFLICT DO NOTHING` checks the key before it
/// writes anything, so a duplicate takes no row lock, no transaction id and
/// no WAL: it costs a read, as the replay should. Every part of the statement
/// sees one snapshot, so the SELECT never sees the row the INSERT just wrote;
/// a row committed after the snapshot was taken makes the INSERT do nothing
/// and stays unseen by the SELECT: no row comes back, and the caller reads
/// again. `NOT EXISTS` covers a row the reaper deleted meanwhile.
pub(super) const CLAIM_OR_FETCH: &str = concat!(
    "
WITH inserted AS (
    ",
    insert_record!(),
    "    VALUES ($1, $2, 1, 1, $3, $4, NULL, $6,
            now() + $5::float8 * interval '1 microsecond',
            now() + ($5 + $6)::float8 * interval '1 microsecond',
            now(), now())
    ON CONFLICT (namespace, key) DO NOTHING
    RETURNING fencing_token, lease_expires_at, expires_at)
SELECT true AS inserted, now() AS now, NULL::int2 AS state, i.fencing_token,
       NULL::bytea AS lease_token, NULL::bytea AS fingerprint, NULL::bytea AS response,
       NULL::int8 AS retention_us, i.lease_expires_at, i.expires_at,
       NULL::timestamptz AS created_at, NULL::timestamptz AS updated_at,
       NULL::bytea AS checkpoint, NULL::int8 AS checkpoint_fencing,
       NULL::timestamptz AS remember_until
FROM inserted AS i
UNION ALL
SELECT false, now(), r.state, r.fencing_token, r.lease_token, r.fingerprint, r.response,
       r.retention_us, r.lease_expires_at, r.expires_at, r.created_at, r.updated_at,
       r.checkpoint, r.checkpoint_fencing, r.remember_until
FROM idempotency_records AS r
WHERE r.namespace = $1 AND r.key = $2 AND NOT EXISTS (SELECT FROM inserted)"
);

/// CLAIM_OR_FETCH for many distinct keys in one statement: one row per key
/// that was inserted or found, tagged with its position in the input (a key
/// with neither raced, as above). Keys are inserted in key order, so
/// concurrent batches wait on each other's new keys in the same order and
/// cannot deadlock. Only the keys not inserted are looked up (the lookup's
/// `n.key IS NULL` is checked before its index scan), one by one as in
/// FETCH_MANY.
pub(super) const CLAIM_OR_FETCH_MANY: &str = concat!(
    "
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::bytea[], $5::int8[], $6::int8[])
         WITH ORDINALITY AS i(namespace, key, lease_token, fingerprint, lease_us, retention_us, ord)),
inserted AS (
    ",
    insert_record!(),
    "    SELECT i.namespace, i.key, 1, 1, i.lease_token, i.fingerprint, NULL, i.retention_us,
           now() + i.lease_us::float8 * interval '1 microsecond',
           now() + (i.lease_us + i.retention_us)::float8 * interval '1 microsecond',
           now(), now()
    FROM input AS i
    ORDER BY i.namespace COLLATE \"C\", i.key COLLATE \"C\"
    ON CONFLICT (namespace, key) DO NOTHING
    RETURNING namespace, key, fencing_token, lease_expires_at, expires_at)
SELECT i.ord, n.key IS NOT NULL AS inserted, now() AS now, r.state,
       coalesce(n.fencing_token, r.fencing_token) AS fencing_token, r.lease_token,
       r.fingerprint, r.response, r.retention_us,
       coalesce(n.lease_expires_at, r.lease_expires_at) AS lease_expires_at,
       coalesce(n.expires_at, r.expires_at) AS expires_at, r.created_at, r.updated_at,
       r.checkpoint, r.checkpoint_fencing, r.remember_until
FROM input AS i
LEFT JOIN inserted AS n ON n.namespace = i.namespace COLLATE \"C\" AND n.key = i.key COLLATE \"C\"
LEFT JOIN LATERAL (
    SELECT * FROM idempotency_records AS x
    WHERE n.key IS NULL
      AND x.namespace = i.namespace COLLATE \"C\" AND x.key = i.key COLLATE \"C\"
    LIMIT 1) AS r ON true
WHERE n.key IS NOT NULL OR r.key IS NOT NULL"
);

/// TRY_CLAIM for many distinct keys in one statement (the same rule, row by
/// row). Rows come in key order, so concurrent batches lock rows in the same
/// order and cannot deadlock each other.
pub(super) const TRY_CLAIM_MANY: &str = concat!(
    "
",
    insert_record!(),
    "SELECT i.namespace, i.key, 1, 1, i.lease_token, i.fingerprint, NULL, i.retention_us,
       now() + i.lease_us::float8 * interval '1 microsecond',
       now() + (i.lease_us + i.retention_us)::float8 * interval '1 microsecond',
       now(), now()
FROM unnest($1::text[], $2::text[], $3::bytea[], $4::bytea[], $5::int8[], $6::int8[])
     AS i(namespace, key, lease_token, fingerprint, lease_us, retention_us)
ORDER BY i.namespace COLLATE \"C\", i.key COLLATE \"C\"
",
    takeover!(),
    "RETURNING namespace, key, fencing_token, lease_expires_at, expires_at, checkpoint,
          checkpoint_fencing"
);

/// Inserts a new key, or takes over an existing row that is expired, released,
/// or in progress under an expired lease, unless its fingerprint conflicts.
/// An expired row starts afresh (its fingerprint, creation time and
/// checkpoint are replaced) but keeps counting fencing tokens until the
/// reaper deletes it; a lease taken over keeps its checkpoint for the new
/// holder.
pub(super) const TRY_CLAIM: &str = concat!(
    "
",
    insert_record!(),
    "VALUES ($1, $2, 1, 1, $3, $4, NULL, $6,
        now() + $5::float8 * interval '1 microsecond',
        now() + ($5 + $6)::float8 * interval '1 microsecond',
        now(), now())
",
    takeover!(),
    "RETURNING fencing_token, lease_expires_at, expires_at, checkpoint, checkpoint_fencing"
);

/// Clock arithmetic with a column beside `now()`, in the three statements
/// below, is written `(now() AT TIME ZONE 'UTC' + x) AT TIME ZONE 'UTC'`:
/// Citus refuses a STABLE function next to a column in an UPDATE, and
/// `timestamptz + interval` is STABLE, while both conversions and
/// `timestamp + interval` are IMMUTABLE; `now()` alone is evaluated on the
/// coordinator. The intervals have no day or month part, so the result is
/// `now() + x` to the microsecond, in every time zone.
///
/// The lease holder's guard shared by Complete, Release and ExtendLease: the
/// record is unexpired, in progress, and the token is the current one. The
/// lease itself may have run out: until someone else claims the key, its
/// holder may still finish.
///
/// Complete sets the key's horizon, $6 (remember_for) after now (NULL: none).
/// A horizon not later than the result's expiry remembers nothing: the key
/// is remembered only while expires_at <= now() < remember_until. (No CASE
/// comparing $6 with the retention here: Citus cannot plan a parameter
/// beside a column in one.)
pub(super) const COMPLETE: &str = "
UPDATE idempotency_records
SET state = 2, response = $4, lease_expires_at = NULL,
    expires_at = ((now() AT TIME ZONE 'UTC') + coalesce($5, retention_us)::float8 * interval '1 microsecond')
                 AT TIME ZONE 'UTC',
    remember_until = ((now() AT TIME ZONE 'UTC') + $6::float8 * interval '1 microsecond') AT TIME ZONE 'UTC',
    updated_at = now(), checkpoint = NULL, checkpoint_fencing = NULL
WHERE namespace = $1 AND key = $2 AND state = 1 AND lease_token = $3 AND expires_at > now()
RETURNING expires_at";

/// COMPLETE for many keys in one statement, item after item (the function
/// is in the migrations, with why it is one).
pub(super) const COMPLETE_MANY: &str = "
SELECT item, new_expires_at FROM idempotency_complete_many($1, $2, $3, $4, $5, $6)";

/// A remembered key claimed anew (a late retry, re-executed): a completed
/// record past its expiry and before its horizon (remember_until), or a
/// marker (state 4) before its horizon (expires_at), becomes in progress
/// as a new key would ($1 to $6 as in TRY_CLAIM), with the next fencing
/// token. Written so that Citus runs it as it is: now() is beside no column.
pub(super) const RECLAIM: &str = "
UPDATE idempotency_records
SET state = 1, fencing_token = fencing_token + 1, lease_token = $3, fingerprint = $4,
    response = NULL, retention_us = $6,
    lease_expires_at = now() + $5::float8 * interval '1 microsecond',
    expires_at = now() + ($5 + $6)::float8 * interval '1 microsecond',
    created_at = now(), updated_at = now(), checkpoint = NULL, checkpoint_fencing = NULL,
    remember_until = NULL
WHERE namespace = $1 AND key = $2
  AND ((state = 2 AND expires_at <= now() AND remember_until > now())
       OR (state = 4 AND expires_at > now()))
RETURNING fencing_token, lease_expires_at, expires_at, checkpoint, checkpoint_fencing";

/// Released records stay for their retention, so a late duplicate with another
/// payload is still told about the mismatch, and the fencing counter goes on.
/// A checkpoint given ($4 not NULL) is saved under the lease's fencing token.
pub(super) const RELEASE: &str = "
UPDATE idempotency_records
SET state = 3, lease_expires_at = NULL,
    expires_at = ((now() AT TIME ZONE 'UTC') + retention_us::float8 * interval '1 microsecond') AT TIME ZONE 'UTC',
    updated_at = now(),
    checkpoint = coalesce($4::bytea, checkpoint),
    checkpoint_fencing = CASE WHEN $4::bytea IS NULL THEN checkpoint_fencing
                              ELSE fencing_token END
WHERE namespace = $1 AND key = $2 AND state = 1 AND lease_token = $3 AND expires_at > now()";

/// Like RELEASE, a checkpoint given ($5 not NULL) is saved with the lease.
pub(super) const EXTEND_LEASE: &str = "
UPDATE idempotency_records
SET lease_expires_at = now() + $4::float8 * interval '1 microsecond',
    expires_at = ((now() AT TIME ZONE 'UTC') + ($4 + retention_us)::float8 * interval '1 microsecond')
                 AT TIME ZONE 'UTC',
    updated_at = now(),
    checkpoint = coalesce($5::bytea, checkpoint),
    checkpoint_fencing = CASE WHEN $5::bytea IS NULL THEN checkpoint_fencing
                              ELSE fencing_token END
WHERE namespace = $1 AND key = $2 AND state = 1 AND lease_token = $3 AND expires_at > now()
RETURNING lease_expires_at";

/// One bounded batch of the reaper, oldest first, through the index on
/// reap_at (expires_at's stored copy: see its migration), in two steps: the
/// batch's remembered records become markers (state 4: response and
/// checkpoint dropped, expires_at moved to the horizon, which files them
/// under it in reap_at, and remember_until keeping the original expiry),
/// and the rest are deleted. SKIP LOCKED lets replicas reap side by side
/// without waiting on each other or on a Claim that is taking a row over;
/// each step re-checks its condition on the locked row.
pub(super) const REAP: &str = "
WITH batch AS (
    SELECT ctid, (state = 2 AND coalesce(remember_until > now(), false)) AS remember
    FROM idempotency_records
    WHERE reap_at <= now()
    ORDER BY reap_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED),
remembered AS (
    UPDATE idempotency_records
    SET state = 4, response = NULL, checkpoint = NULL, checkpoint_fencing = NULL,
        expires_at = remember_until, remember_until = expires_at
    WHERE ctid = ANY (ARRAY(SELECT ctid FROM batch WHERE remember))
      AND state = 2 AND expires_at <= now() AND remember_until > now()
    RETURNING 1),
deleted AS (
    DELETE FROM idempotency_records
    WHERE ctid = ANY (ARRAY(SELECT ctid FROM batch WHERE NOT remember))
      AND expires_at <= now()
      AND NOT (state = 2 AND coalesce(remember_until > now(), false))
    RETURNING 1)
SELECT (SELECT count(*) FROM remembered) AS remembered,
       (SELECT count(*) FROM deleted) AS deleted";

/// The planner's defaults, for the statements of `stats` only.
pub(super) const STATS_SETTINGS: &str = "
SELECT set_config('enable_seqscan', 'on', true), set_config('plan_cache_mode', 'auto', true)";

pub(super) const STATS_LIVE: &str = "
SELECT namespace, state, count(*) AS count
FROM idempotency_records WHERE expires_at > now()
GROUP BY namespace, state ORDER BY namespace, state";

pub(super) const STATS_SUMMARY: &str = "
SELECT now() AS now,
       count(*) FILTER (WHERE expires_at <= now()) AS expired,
       min(created_at) FILTER (WHERE expires_at > now()) AS oldest_created_at,
       min(expires_at) AS earliest_expiry
FROM idempotency_records";

/// The planner's estimate of the table's rows (free: no scan).
pub(super) const TABLE_ROWS: &str = "
SELECT reltuples FROM pg_class WHERE oid = 'idempotency_records'::regclass";

/// Up to this many rows, the records gauge counts them all.
pub(super) const EXACT_GAUGE_ROWS: f64 = 1_000_000.0;

/// About how many rows the gauge's sample reads on a larger table.
pub(super) const SAMPLE_ROWS: f64 = 200_000.0;

/// The gauge counts expired rows up to this many (a reaper this far behind
/// needs no finer figure).
pub(super) const EXPIRED_COUNT_CAP: i64 = 1_000_000;

/// STATS_LIVE from a sample of $1 percent of the table's pages, scaled up.
pub(super) const STATS_LIVE_SAMPLED: &str = "
SELECT namespace, state, round(count(*) * 100.0 / $1::float8)::int8 AS count
FROM idempotency_records TABLESAMPLE SYSTEM ($1::float8)
WHERE expires_at > now()
GROUP BY namespace, state ORDER BY namespace, state";

/// STATS_SUMMARY through reap_at's index: expired rows counted up to $1,
/// the oldest creation time left out.
pub(super) const STATS_SUMMARY_INDEXED: &str = "
SELECT now() AS now,
       (SELECT count(*) FROM (SELECT FROM idempotency_records WHERE reap_at <= now() LIMIT $1) AS e)
           AS expired,
       NULL::timestamptz AS oldest_created_at,
       (SELECT min(reap_at) FROM idempotency_records) AS earliest_expiry";

/// Settings of every session the store opens, so that a statement's plan is
/// the same from the first call on a new table to the billionth on a large
/// one.
///
/// Every statement on the call path finds its rows by primary key. Left to
/// itself, PostgreSQL caches for a prepared statement a generic plan made
/// with the statistics of the moment: on a table just created or analysed at
/// a few hundred rows that plan is a sequential scan, and it keeps scanning
/// while the table grows, until autovacuum's next analyse replans it (seen:
/// the Complete reading 85 buffers per call instead of 12, 42 million tuples
/// scanned in 15 s). And for statements over arrays it may replan on every
/// call, when it guesses a plan for the actual array is cheaper than the
/// generic one. So: sequential scans are ruled out (they remain possible
/// where nothing else is, as in `stats`, which turns them back on), the
/// plan is made once per session and kept, and JIT compilation, which a
/// ruled-out scan's cost could trigger, is off: it never pays on statements
/// of microseconds.
pub(super) const SESSION_SETTINGS: [(&str, &str); 3] = [
    ("enable_seqscan", "off"),
    ("plan_cache_mode", "force_generic_plan"),
    ("jit", "off"),
];

/// The statements whose text depends on the engine: plain PostgreSQL runs
/// the set-based statements above; Citus runs the functions of the
/// migrations `20261203000002_citus.sql` and
/// `20261207000001_citus_routed_batches.sql`, which take the same parameters
/// and answer the same columns. On Citus the single reads are functions
/// distributed by their key, and each batch statement is sent once per
/// worker (shards.rs), with a routing key before the arrays ($1): Citus
/// delegates the whole call to the worker holding that key's shard.
pub(super) struct Statements {
    pub fetch: &'static str,
    pub fetch_many: &'static str,
    /// WATCH: FETCH that marks a live, in-progress row `watched`, with
    /// `watched` (marked before) and `marked` (by this statement).
    pub watch: &'static str,
    pub claim_or_fetch: &'static str,
    pub claim_or_fetch_many: &'static str,
    pub try_claim_many: &'static str,
    pub complete_many: &'static str,
    /// Whether the batch statements take a routing key first, and batches
    /// go once per worker.
    pub routed: bool,
    /// Purge with its notifications ($1 namespace, $2 key, $3 channel, $4
    /// the purge's name: feed.rs).
    pub purge: &'static str,
    /// One row: how many records became markers, and how many were
    /// deleted.
    pub reap: &'static str,
}

/// On plain PostgreSQL.
pub(super) const ON_POSTGRES: Statements = Statements {
    fetch: FETCH,
    fetch_many: FETCH_MANY,
    watch: WATCH,
    claim_or_fetch: CLAIM_OR_FETCH,
    claim_or_fetch_many: CLAIM_OR_FETCH_MANY,
    try_claim_many: TRY_CLAIM_MANY,
    complete_many: COMPLETE_MANY,
    routed: false,
    purge: super::feed::PURGE,
    reap: REAP,
};

/// On Citus.
pub(super) const ON_CITUS: Statements = Statements {
    fetch: "SELECT * FROM idempotency_fetch($1, $2)",
    fetch_many: "SELECT * FROM idempotency_routed_fetch($1, $2, $3)",
    watch: "SELECT * FROM idempotency_watch($1, $2)",
    claim_or_fetch: "SELECT * FROM idempotency_claim_or_fetch($1, $2, $3, $4, $5, $6)",
    claim_or_fetch_many: "
SELECT * FROM idempotency_routed_claim_or_fetch($1, $2, $3, $4, $5, $6, $7)",
    try_claim_many: "SELECT * FROM idempotency_routed_try_claim($1, $2, $3, $4, $5, $6, $7)",
    complete_many: "
SELECT item, new_expires_at FROM idempotency_routed_complete($1, $2, $3, $4, $5, $6, $7)",
    routed: true,
    purge: "SELECT * FROM idempotency_purge($1, $2, $3, $4)",
    reap: "SELECT remembered, deleted FROM idempotency_reap_remembering($1)",
};

/// Run on every new Citus connection: the plan cache's default instead of
/// SESSION_SETTINGS' generic plans. Citus delegates a distributed function's
/// call only when it can read the routing argument's value while planning,
/// which a generic plan never lets it (the call then runs on the node it was
/// sent to, every key's statement routed from there); its single-shard
/// statements are planned by its fast path either way.
pub(super) const CITUS_SESSION: &str = "SELECT set_config('plan_cache_mode', 'auto', false)";

/// Each shard of the table's hash range and the node group holding it (the
/// lowest, should a shard have several placements), for shards.rs.
pub(super) const CITUS_SHARD_MAP: &str = "
SELECT s.shardminvalue, s.shardmaxvalue, min(p.groupid)::int4
FROM pg_dist_shard AS s JOIN pg_dist_placement AS p USING (shardid)
WHERE s.logicalrelid = 'idempotency_records'::regclass AND p.shardstate = 1
GROUP BY s.shardminvalue, s.shardmaxvalue";

/// The nodes that take the service's statements: each node group's primary.
pub(super) const CITUS_NODES: &str = "
SELECT groupid, nodename, nodeport FROM pg_dist_node
WHERE isactive AND noderole = 'primary'";

/// The coordinator's address, as the cluster's metadata has it (group 0,
/// registered with `citus_set_coordinator_host`).
pub(super) const CITUS_COORDINATOR: &str = "
SELECT nodename, nodeport FROM pg_dist_node
WHERE groupid = 0 AND noderole = 'primary'
LIMIT 1";

/// Run on every new connection: the Citus extension's version, or no row on
/// plain PostgreSQL.
pub(super) const CITUS_VERSION: &str =
    "SELECT extversion FROM pg_extension WHERE extname = 'citus'";

/// Whether this Citus node is the coordinator (asked only where the
/// extension is installed).
pub(super) const CITUS_IS_COORDINATOR: &str = "SELECT citus_is_coordinator()";

/// Whether the table is distributed, and over how many shards (Citus only:
/// the catalogue does not exist elsewhere).
pub(super) const CITUS_SHARDS: &str = "
SELECT count(*) FROM pg_dist_shard WHERE logicalrelid = 'idempotency_records'::regclass";
