-- 64 fresh keys claimed by one statement, as a team would batch them: the
-- claiming upsert over unnest (keys per second = tps * 64). pgbench cannot
-- bind an array it builds, so the keys are made in the statement from a
-- per-client counter; every key is new.
\set n :n + 1
\set base (:client_id + 1) * 1000000000000 + :n * 64
INSERT INTO idempotency_keys AS t
    (namespace, key, state, fingerprint, lease_token, lease_expires_at, expires_at)
SELECT :ns, k.key, 1, NULL, gen_random_uuid(), now() + interval '30 s', now() + interval '24 h'
FROM unnest(ARRAY(SELECT (:base::bigint + g)::text FROM generate_series(0, 63) AS g)) AS k(key)
ON CONFLICT (namespace, key) DO UPDATE SET
    state = 1, fingerprint = EXCLUDED.fingerprint, lease_token = EXCLUDED.lease_token,
    fencing = t.fencing + 1, lease_expires_at = EXCLUDED.lease_expires_at, response = NULL,
    updated_at = now(), expires_at = EXCLUDED.expires_at
WHERE t.expires_at <= now() OR (t.state = 1 AND t.lease_expires_at <= now())
RETURNING key, fencing, lease_token;
