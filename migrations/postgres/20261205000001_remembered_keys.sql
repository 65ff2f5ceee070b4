-- Remembered keys (issue 24): after a completed record's retention ends, its
-- key is remembered until a horizon, as a compact marker, so that a late
-- retry is answered by its late-retry policy (re-execute with the next
-- fencing token, or refuse) instead of looking new.
--
-- remember_until: on a completed record (state 2), the horizon its Complete
-- set (`remember_for` after it; NULL when the server remembers nothing).
-- The key is remembered while expires_at <= now() < remember_until: a
-- horizon not later than the result's expiry remembers nothing.
--
-- State 4, the marker: the reaper turns a remembered completed record into
-- one (REAP in src/store/postgres/sql.rs, idempotency_reap_remembering on
-- Citus). It drops the response and the checkpoint and swaps the two times:
-- expires_at becomes the horizon, where every row ends (and reap_at, its
-- copy, files the marker under it for the reaper's second step), and
-- remember_until keeps the result's original expiry. A marker is never live:
-- only the Claim that re-executes it (RECLAIM), Purge and the reaper change
-- it.
--
-- The table's changes come last (below): on Citus a function is created on
-- the workers too, which a transaction can no longer do once it ran a
-- parallel (multi-shard) command such as an ALTER TABLE. A nullable column
-- without a default changes only the catalog. The state check is replaced
-- without a scan (NOT VALID: every existing row is in 1..3 already). During
-- a rolling upgrade, replicas of the previous version set
-- no horizon, take over or reap an expired record as before (a key they
-- touch is not remembered), and answer INTERNAL for a marker they read
-- (state 4 is unknown to them), never a wrong replay.
-- COMPLETE_MANY with each item's horizon (remember_us: NULL remembers
-- nothing). The five-argument version stays for replicas of the previous
-- version during a rolling upgrade.
CREATE FUNCTION idempotency_complete_many(
    namespaces text[], keys text[], lease_tokens bytea[], responses bytea[],
    retentions_us int8[], remember_us int8[])
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
            remember_until = ((now() AT TIME ZONE 'UTC')
                + remember_us[i]::float8 * interval '1 microsecond') AT TIME ZONE 'UTC',
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

-- The Citus functions that read records answer remember_until too (their
-- columns change, so they are made again), and the ones that write follow
-- the rules of sql.rs: a remembered record is not taken over by a Claim
-- (only RECLAIM re-executes it), Purge makes it claimable by anyone, and the
-- reaper makes markers before it deletes. On plain PostgreSQL they exist but
-- are not called.
DROP FUNCTION idempotency_fetch_many(text[], text[]);
DROP FUNCTION idempotency_claim_or_fetch_many(text[], text[], bytea[], bytea[], int8[], int8[]);
DROP FUNCTION idempotency_fetch(text, text);
DROP FUNCTION idempotency_claim_or_fetch(text, text, bytea, bytea, int8, int8);

CREATE FUNCTION idempotency_fetch(p_namespace text, p_key text)
RETURNS TABLE (now timestamptz, state int2, fencing_token int8, lease_token bytea,
               fingerprint bytea, response bytea, retention_us int8,
               lease_expires_at timestamptz, expires_at timestamptz,
               created_at timestamptz, updated_at timestamptz,
               checkpoint bytea, checkpoint_fencing int8, remember_until timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    t timestamptz := now();
BEGIN
    RETURN QUERY
    SELECT t, r.state, r.fencing_token, r.lease_token, r.fingerprint, r.response,
           r.retention_us, r.lease_expires_at, r.expires_at, r.created_at, r.updated_at,
           r.checkpoint, r.checkpoint_fencing, r.remember_until
    FROM idempotency_records AS r
    WHERE r.namespace = p_namespace AND r.key = p_key;
    IF NOT FOUND THEN
        now := t;
        RETURN NEXT;
    END IF;
END
$$;

CREATE FUNCTION idempotency_claim_or_fetch(
    p_namespace text, p_key text, p_lease_token bytea, p_fingerprint bytea,
    p_lease_us int8, p_retention_us int8)
RETURNS TABLE (inserted bool, now timestamptz, state int2, fencing_token int8, lease_token bytea,
               fingerprint bytea, response bytea, retention_us int8,
               lease_expires_at timestamptz, expires_at timestamptz,
               created_at timestamptz, updated_at timestamptz,
               checkpoint bytea, checkpoint_fencing int8, remember_until timestamptz)
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
           r.checkpoint, r.checkpoint_fencing, r.remember_until
    FROM idempotency_records AS r
    WHERE r.namespace = p_namespace AND r.key = p_key;
END
$$;

CREATE FUNCTION idempotency_claim_or_fetch_many(
    namespaces text[], keys text[], lease_tokens bytea[], fingerprints bytea[],
    leases_us int8[], retentions_us int8[])
RETURNS TABLE (ord int8, inserted bool, now timestamptz, state int2, fencing_token int8,
               lease_token bytea, fingerprint bytea, response bytea, retention_us int8,
               lease_expires_at timestamptz, expires_at timestamptz,
               created_at timestamptz, updated_at timestamptz,
               checkpoint bytea, checkpoint_fencing int8, remember_until timestamptz)
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

CREATE FUNCTION idempotency_fetch_many(namespaces text[], keys text[])
RETURNS TABLE (now timestamptz, state int2, fencing_token int8, lease_token bytea,
               fingerprint bytea, response bytea, retention_us int8,
               lease_expires_at timestamptz, expires_at timestamptz,
               created_at timestamptz, updated_at timestamptz,
               checkpoint bytea, checkpoint_fencing int8, remember_until timestamptz)
LANGUAGE plpgsql AS $fn$
BEGIN
    FOR i IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        RETURN QUERY SELECT * FROM idempotency_fetch(namespaces[i], keys[i]);
    END LOOP;
END
$fn$;

-- TRY_CLAIM_MANY with the takeover rule of sql.rs: an expired record is
-- taken over unless it is remembered.
CREATE OR REPLACE FUNCTION idempotency_try_claim_many(
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
                              ELSE r.checkpoint_fencing END,
    remember_until = NULL
WHERE (r.expires_at <= excluded.created_at
       AND NOT (r.state = 2 AND coalesce(r.remember_until > excluded.created_at, false)))
   OR ((r.state = 3 OR (r.state = 1 AND r.lease_expires_at <= excluded.created_at))
       AND (r.fingerprint IS NULL OR excluded.fingerprint IS NULL
            OR r.fingerprint = excluded.fingerprint))
        RETURNING r.namespace::text, r.key::text, r.fencing_token, r.lease_expires_at, r.expires_at,
                  r.checkpoint, r.checkpoint_fencing;
    END LOOP;
END
$fn$;

-- PURGE on Citus (the rule of feed.rs's PURGE, with the coordinator's clock
-- as a parameter): a live record expires now; a remembered one becomes a
-- released record without fingerprint, claimable by anyone and kept (with
-- its fencing counter) until its horizon. The answer is 4 for a remembered
-- key, else the record's state.
CREATE OR REPLACE FUNCTION idempotency_purge(p_namespace text, p_key text, p_channel text, p_name text)
RETURNS TABLE (state int2)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    t timestamptz := now();
BEGIN
    UPDATE idempotency_records AS r
    SET state = CASE WHEN r.expires_at > t AND r.state <> 4 THEN r.state ELSE 3 END,
        fingerprint = CASE WHEN r.expires_at > t AND r.state <> 4 THEN r.fingerprint END,
        response = CASE WHEN r.expires_at > t AND r.state <> 4 THEN r.response END,
        checkpoint = CASE WHEN r.expires_at > t AND r.state <> 4 THEN r.checkpoint END,
        checkpoint_fencing = CASE WHEN r.expires_at > t AND r.state <> 4
                                  THEN r.checkpoint_fencing END,
        expires_at = CASE WHEN r.state = 4 THEN r.expires_at
                          WHEN r.expires_at > t THEN t
                          ELSE r.remember_until END,
        remember_until = NULL, lease_expires_at = NULL, updated_at = t
    WHERE r.namespace = p_namespace AND r.key = p_key
      AND (r.expires_at > t OR (r.state = 2 AND r.remember_until > t))
    RETURNING CASE WHEN r.expires_at > t THEN 4::int2 ELSE r.state END INTO state;
    IF FOUND THEN
        PERFORM pg_notify(p_channel, length(p_namespace)::text || ':' || p_namespace || p_key);
        PERFORM pg_notify(p_channel,
                          p_name || length(p_namespace)::text || ':' || p_namespace || p_key);
        RETURN NEXT;
    END IF;
END
$$;

-- REAP on Citus, in the two steps of sql.rs's REAP: of the batch's keys
-- (oldest reap_at first, at most `batch`), the remembered records become
-- markers, then the rest, expired and not remembered, are deleted. Answers
-- how many of each.
CREATE FUNCTION idempotency_reap_remembering(batch int8)
RETURNS TABLE (remembered int8, deleted int8)
LANGUAGE plpgsql AS $$
DECLARE
    t timestamptz := now();
    ns text[];
    ks text[];
BEGIN
    EXECUTE 'SELECT array_agg(namespace), array_agg(key)
             FROM (SELECT namespace, key FROM idempotency_records
                   WHERE reap_at <= $1 ORDER BY reap_at LIMIT $2) AS b'
        INTO ns, ks USING t, batch;
    remembered := 0;
    deleted := 0;
    IF ks IS NOT NULL THEN
        EXECUTE 'UPDATE idempotency_records
                 SET state = 4, response = NULL, checkpoint = NULL, checkpoint_fencing = NULL,
                     expires_at = remember_until, remember_until = expires_at
                 WHERE key = ANY ($2) AND namespace = ANY ($3)
                   AND state = 2 AND expires_at <= $1 AND remember_until > $1'
            USING t, ks, ns;
        GET DIAGNOSTICS remembered = ROW_COUNT;
        EXECUTE 'DELETE FROM idempotency_records
                 WHERE key = ANY ($2) AND namespace = ANY ($3)
                   AND expires_at <= $1
                   AND NOT (state = 2 AND coalesce(remember_until > $1, false))'
            USING t, ks, ns;
        GET DIAGNOSTICS deleted = ROW_COUNT;
    END IF;
    RETURN NEXT;
END
$$;

-- The table: the horizon's column and the marker's state. The constraint
-- is added through EXECUTE: Citus sends an ADD CONSTRAINT to the workers as
-- the text of the statement it came in, and a migration's text holds many
-- statements, which a worker refuses ("cannot insert multiple commands into
-- a prepared statement").
ALTER TABLE idempotency_records ADD COLUMN remember_until timestamptz;
ALTER TABLE idempotency_records DROP CONSTRAINT idempotency_records_state_check;
DO $$
BEGIN
    EXECUTE 'ALTER TABLE idempotency_records ADD CONSTRAINT idempotency_records_state_check '
            'CHECK (state IN (1, 2, 3, 4)) NOT VALID';
END
$$;
