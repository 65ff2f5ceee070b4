-- Citus (issue 21): the statements the PostgreSQL store sends when the
-- database is a Citus coordinator, and the step that distributes the table.
--
-- On Citus every call-path statement must reach one shard and read one clock,
-- the coordinator's. Citus routes a statement with a generic plan only when
-- it is a "fast path" one (one table, `key = $n`, no join, CTE or subquery),
-- and evaluates now() on the coordinator only where no column is beside it.
-- Claim's first step, the reads and the batches are therefore functions
-- here: each reads now() once, on the coordinator, and runs single-shard
-- statements with it as a parameter. Try-claim, Complete, Release and
-- ExtendLease stay single statements written so that Citus accepts them
-- (src/store/postgres/sql.rs). On plain PostgreSQL these functions exist
-- but the store does not call them (idempotency_complete_many aside, which
-- both engines call and whose arithmetic is rewritten below the same way:
-- same result, to the microsecond).
--
-- The store picks its statements by what it finds at each connection:
-- `citus` in pg_extension.

-- FETCH with the coordinator's clock: now() is read by PL/pgSQL (on the
-- coordinator) and passed into the row lookup as a parameter.
CREATE FUNCTION idempotency_fetch(p_namespace text, p_key text)
RETURNS TABLE (now timestamptz, state int2, fencing_token int8, lease_token bytea,
               fingerprint bytea, response bytea, retention_us int8,
               lease_expires_at timestamptz, expires_at timestamptz,
               created_at timestamptz, updated_at timestamptz,
               checkpoint bytea, checkpoint_fencing int8)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    t timestamptz := now();
BEGIN
    RETURN QUERY
    SELECT t, r.state, r.fencing_token, r.lease_token, r.fingerprint, r.response,
           r.retention_us, r.lease_expires_at, r.expires_at, r.created_at, r.updated_at,
           r.checkpoint, r.checkpoint_fencing
    FROM idempotency_records AS r
    WHERE r.namespace = p_namespace AND r.key = p_key;
    IF NOT FOUND THEN
        now := t;
        RETURN NEXT;
    END IF;
END
$$;

-- CLAIM_OR_FETCH as two single-shard statements, the clock read once here.
CREATE FUNCTION idempotency_claim_or_fetch(
    p_namespace text, p_key text, p_lease_token bytea, p_fingerprint bytea,
    p_lease_us int8, p_retention_us int8)
RETURNS TABLE (inserted bool, now timestamptz, state int2, fencing_token int8, lease_token bytea,
               fingerprint bytea, response bytea, retention_us int8,
               lease_expires_at timestamptz, expires_at timestamptz,
               created_at timestamptz, updated_at timestamptz,
               checkpoint bytea, checkpoint_fencing int8)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    t timestamptz := now();
BEGIN
    INSERT INTO idempotency_records AS r
        (namespace, key, state, fencing_token, lease_token, fingerprint, response, retention_us,
         lease_expires_at, expires_at, created_at, updated_at)
    VALUES (p_namespace, p_key, 1, 1, p_lease_token, p_fingerprint, NULL, p_retention_us,
            t + p_lease_us::float8 * interval '1 microsecond',
            t + (p_lease_us + p_retention_us)::float8 * interval '1 microsecond',
            t, t)
    ON CONFLICT (namespace, key) DO NOTHING
    RETURNING r.fencing_token, r.lease_expires_at, r.expires_at
    INTO fencing_token, lease_expires_at, expires_at;
    IF FOUND THEN
        inserted := true;
        now := t;
        RETURN NEXT;
        RETURN;
    END IF;
    RETURN QUERY
    SELECT false, t, r.state, r.fencing_token, r.lease_token, r.fingerprint, r.response,
           r.retention_us, r.lease_expires_at, r.expires_at, r.created_at, r.updated_at,
           r.checkpoint, r.checkpoint_fencing
    FROM idempotency_records AS r
    WHERE r.namespace = p_namespace AND r.key = p_key;
END
$$;

-- PURGE on Citus: the row's UPDATE goes to its shard (now() alone, which
-- Citus evaluates on the coordinator), and the notifications are sent here,
-- on the coordinator, where the replicas listen, delivered when the
-- transaction commits. The same notifications as the PURGE statement of
-- src/store/postgres/feed.rs, which plain PostgreSQL runs: the key, and the
-- key with the purge's name ($4) for the replicas to acknowledge, on the
-- channel the store derived from the table's schema ($3).
CREATE FUNCTION idempotency_purge(p_namespace text, p_key text, p_channel text, p_name text)
RETURNS TABLE (state int2)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    UPDATE idempotency_records AS r
    SET expires_at = now(), lease_expires_at = NULL, updated_at = now()
    WHERE r.namespace = p_namespace AND r.key = p_key AND r.expires_at > now()
    RETURNING r.state INTO state;
    IF FOUND THEN
        PERFORM pg_notify(p_channel, length(p_namespace)::text || ':' || p_namespace || p_key);
        PERFORM pg_notify(p_channel,
                          p_name || length(p_namespace)::text || ':' || p_namespace || p_key);
        RETURN NEXT;
    END IF;
END
$$;

-- COMPLETE_MANY without relying on Citus letting coalesce() hide a column
-- reference: the clock arithmetic is timestamp (IMMUTABLE) arithmetic. The
-- item's namespace and key are read into "C"-collated variables: Citus
-- prunes `key = k` to one shard, where `key = keys[i] COLLATE "C"` sent each
-- item's UPDATE to all 32 shards under a generic plan (bench/citus.sh found
-- it: 0.09x of plain PostgreSQL at 8 callers). Same rows on plain PostgreSQL.
CREATE OR REPLACE FUNCTION idempotency_complete_many(
    namespaces text[], keys text[], lease_tokens bytea[], responses bytea[],
    retentions_us int8[])
RETURNS TABLE (item int, new_expires_at timestamptz)
LANGUAGE plpgsql
AS $$
DECLARE
    n text COLLATE "C";
    k text COLLATE "C";
BEGIN
    FOR i IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        n := namespaces[i];
        k := keys[i];
        UPDATE idempotency_records AS r
        SET state = 2, response = responses[i], lease_expires_at = NULL,
            expires_at = ((now() AT TIME ZONE 'UTC')
                + coalesce(retentions_us[i], r.retention_us)::float8 * interval '1 microsecond')
                AT TIME ZONE 'UTC',
            updated_at = now(), checkpoint = NULL, checkpoint_fencing = NULL
        WHERE r.namespace = n AND r.key = k
          AND r.state = 1 AND r.lease_token = lease_tokens[i] AND r.expires_at > now()
        RETURNING i, r.expires_at INTO item, new_expires_at;
        IF FOUND THEN
            RETURN NEXT;
        END IF;
    END LOOP;
END
$$;
-- TRY_CLAIM_MANY as one single-shard INSERT per key, in the order given
-- (the store sorts by key). The clock is read once, here on the coordinator.
CREATE FUNCTION idempotency_try_claim_many(
    namespaces text[], keys text[], lease_tokens bytea[], fingerprints bytea[],
    leases_us int8[], retentions_us int8[])
RETURNS TABLE (namespace text, key text, fencing_token int8, lease_expires_at timestamptz,
               expires_at timestamptz, checkpoint bytea, checkpoint_fencing int8)
LANGUAGE plpgsql AS $fn$
#variable_conflict use_column
DECLARE
    t timestamptz := now();
BEGIN
    FOR i IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        RETURN QUERY
        INSERT INTO idempotency_records AS r
            (namespace, key, state, fencing_token, lease_token, fingerprint, response, retention_us,
             lease_expires_at, expires_at, created_at, updated_at)
        VALUES (namespaces[i], keys[i], 1, 1, lease_tokens[i], fingerprints[i], NULL, retentions_us[i],
                t + leases_us[i]::float8 * interval '1 microsecond',
                t + (leases_us[i] + retentions_us[i])::float8 * interval '1 microsecond',
                t, t)
        ON CONFLICT (namespace, key) DO UPDATE SET
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
                              ELSE r.checkpoint_fencing END
WHERE r.expires_at <= excluded.created_at
   OR ((r.state = 3 OR (r.state = 1 AND r.lease_expires_at <= excluded.created_at))
       AND (r.fingerprint IS NULL OR excluded.fingerprint IS NULL
            OR r.fingerprint = excluded.fingerprint))
        RETURNING r.namespace::text, r.key::text, r.fencing_token, r.lease_expires_at, r.expires_at,
                  r.checkpoint, r.checkpoint_fencing;
    END LOOP;
END
$fn$;

-- CLAIM_OR_FETCH_MANY: idempotency_claim_or_fetch for each key, in the order
-- given (the clock is the transaction's, the same for every item).
CREATE FUNCTION idempotency_claim_or_fetch_many(
    namespaces text[], keys text[], lease_tokens bytea[], fingerprints bytea[],
    leases_us int8[], retentions_us int8[])
RETURNS TABLE (ord int8, inserted bool, now timestamptz, state int2, fencing_token int8,
               lease_token bytea, fingerprint bytea, response bytea, retention_us int8,
               lease_expires_at timestamptz, expires_at timestamptz,
               created_at timestamptz, updated_at timestamptz,
               checkpoint bytea, checkpoint_fencing int8)
LANGUAGE plpgsql AS $fn$
BEGIN
    FOR i IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        RETURN QUERY
        SELECT i::int8, f.*
        FROM idempotency_claim_or_fetch(namespaces[i], keys[i], lease_tokens[i], fingerprints[i],
                                        leases_us[i], retentions_us[i]) AS f;
    END LOOP;
END
$fn$;

-- FETCH_MANY: idempotency_fetch for each key, in input order.
CREATE FUNCTION idempotency_fetch_many(namespaces text[], keys text[])
RETURNS TABLE (now timestamptz, state int2, fencing_token int8, lease_token bytea,
               fingerprint bytea, response bytea, retention_us int8,
               lease_expires_at timestamptz, expires_at timestamptz,
               created_at timestamptz, updated_at timestamptz,
               checkpoint bytea, checkpoint_fencing int8)
LANGUAGE plpgsql AS $fn$
BEGIN
    FOR i IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        RETURN QUERY SELECT * FROM idempotency_fetch(namespaces[i], keys[i]);
    END LOOP;
END
$fn$;
-- REAP on Citus: the batch's keys are found across all shards through each
-- shard's reap_at index (oldest first, at most `batch` in all), then deleted
-- with one statement pruned to the shards that hold them. The clock is read
-- once, here on the coordinator; the DELETE re-checks expiry on every row.
-- Dynamic SQL: a multi-shard statement cannot use a generic plan.
CREATE FUNCTION idempotency_reap(batch int8)
RETURNS int8
LANGUAGE plpgsql AS $$
DECLARE
    t timestamptz := now();
    ns text[];
    ks text[];
    deleted int8;
BEGIN
    EXECUTE 'SELECT array_agg(namespace), array_agg(key)
             FROM (SELECT namespace, key FROM idempotency_records
                   WHERE reap_at <= $1 ORDER BY reap_at LIMIT $2) AS b'
        INTO ns, ks USING t, batch;
    IF ks IS NULL THEN
        RETURN 0;
    END IF;
    -- namespace = ANY AND key = ANY may also match another pair from the
    -- same arrays; such a row is expired too (the guard), so reaping it is
    -- still right.
    EXECUTE 'DELETE FROM idempotency_records
             WHERE key = ANY ($2) AND namespace = ANY ($3)
               AND expires_at <= $1'
        USING t, ks, ns;
    GET DIAGNOSTICS deleted = ROW_COUNT;
    RETURN deleted;
END
$$;

-- Distribution: on a database with the citus extension, the table is
-- distributed by `key` (both primary-key columns would do; `key` spreads a
-- namespace's keys over every shard), with the cluster's citus.shard_count
-- shards (32 by default). Triggers run on the workers under Citus, and their
-- NOTIFY would never reach the replicas listening on the coordinator, so the
-- change-notification triggers are dropped there (docs/scaling.md says what
-- an out-of-band change on Citus does). On a populated table,
-- create_distributed_table copies the rows into the shards and blocks writes
-- to the table meanwhile (reads go on); see docs/scaling.md before running
-- this on a large table. Nothing happens on plain PostgreSQL.
DO $$
DECLARE
    distributed int8 := 0;
BEGIN
    IF NOT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus') THEN
        RETURN;
    END IF;
    EXECUTE 'SELECT count(*) FROM pg_dist_partition
             WHERE logicalrelid = ''idempotency_records''::regclass'
        INTO distributed;
    IF distributed = 0 THEN
        DROP TRIGGER IF EXISTS idempotency_records_changed ON idempotency_records;
        DROP TRIGGER IF EXISTS idempotency_records_truncated ON idempotency_records;
        PERFORM create_distributed_table('idempotency_records', 'key');
    END IF;
END
$$;
