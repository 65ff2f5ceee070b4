-- A claim+complete cycle, as a team would write it: the claiming upsert (it
-- inserts a fresh key, or takes over an expired record or an expired lease),
-- then the guarded UPDATE that stores the result. Fresh keys, one counter per
-- client (clear of the seeded keys 1..100). pgbench variables: ns
-- (namespace), n (counter), resp (the result).
\set n :n + 1
\set k (:client_id + 1) * 1000000000000 + :n
INSERT INTO idempotency_keys AS t
    (namespace, key, state, fingerprint, lease_token, lease_expires_at, expires_at)
VALUES (:ns, :k, 1, NULL, gen_random_uuid(), now() + interval '30 s', now() + interval '24 h')
ON CONFLICT (namespace, key) DO UPDATE SET
    state = 1, fingerprint = EXCLUDED.fingerprint, lease_token = EXCLUDED.lease_token,
    fencing = t.fencing + 1, lease_expires_at = EXCLUDED.lease_expires_at, response = NULL,
    updated_at = now(), expires_at = EXCLUDED.expires_at
WHERE t.expires_at <= now() OR (t.state = 1 AND t.lease_expires_at <= now())
RETURNING fencing, lease_token \gset
UPDATE idempotency_keys
SET state = 2, response = :resp, lease_expires_at = NULL, updated_at = now(),
    expires_at = now() + interval '24 h'
WHERE namespace = :ns AND key = :k AND lease_token = :lease_token AND state = 1;
