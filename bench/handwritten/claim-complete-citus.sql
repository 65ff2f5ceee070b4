-- The claim+complete cycle of claim-complete.sql, as a team would write it
-- for Citus (bench/citus.sh's yardstick, issue 31): idempotency_keys
-- distributed by key (SELECT create_distributed_table('idempotency_keys',
-- 'key')), run through the coordinator. Citus refuses now() in an ON
-- CONFLICT's SET and WHERE ("functions used in the DO UPDATE SET clause of
-- INSERTs on distributed tables must be marked IMMUTABLE"), so the claiming
-- upsert takes its instant from the row it proposes instead: updated_at and
-- created_at default to now() in VALUES, which Citus evaluates on the
-- coordinator, and the SET and WHERE read them as EXCLUDED.updated_at and
-- EXCLUDED.created_at. Same statements, same effect, same round trips
-- otherwise. The guarded UPDATE is claim-complete.sql's, unchanged: Citus
-- 12.1 accepts its now() in SET (no column beside it), tried with psql and
-- pgbench -M prepared; nothing was adapted. pgbench variables: ns
-- (namespace), n (counter), resp (the result).
\set n :n + 1
\set k (:client_id + 1) * 1000000000000 + :n
INSERT INTO idempotency_keys AS t
    (namespace, key, state, fingerprint, lease_token, lease_expires_at, expires_at)
VALUES (:ns, :k, 1, NULL, gen_random_uuid(), now() + interval '30 s', now() + interval '24 h')
ON CONFLICT (namespace, key) DO UPDATE SET
    state = 1, fingerprint = EXCLUDED.fingerprint, lease_token = EXCLUDED.lease_token,
    fencing = t.fencing + 1, lease_expires_at = EXCLUDED.lease_expires_at, response = NULL,
    updated_at = EXCLUDED.updated_at, expires_at = EXCLUDED.expires_at
WHERE t.expires_at <= EXCLUDED.created_at
   OR (t.state = 1 AND t.lease_expires_at <= EXCLUDED.created_at)
RETURNING fencing, lease_token \gset
UPDATE idempotency_keys
SET state = 2, response = :resp, lease_expires_at = NULL, updated_at = now(),
    expires_at = now() + interval '24 h'
WHERE namespace = :ns AND key = :k AND lease_token = :lease_token AND state = 1;
