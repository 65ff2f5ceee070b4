-- A duplicate, as a team would answer it: the same claiming upsert on one of
-- the completed keys '1'..:dupkeys (seeded before the point); its WHERE
-- rejects the update and it returns no row. (It does not read the stored
-- result back, which a replay needs: the yardstick is kept as light as the
-- issue gives it.)
\set k random(1, :dupkeys)
INSERT INTO idempotency_keys AS t
    (namespace, key, state, fingerprint, lease_token, lease_expires_at, expires_at)
VALUES (:ns, :k, 1, NULL, gen_random_uuid(), now() + interval '30 s', now() + interval '24 h')
ON CONFLICT (namespace, key) DO UPDATE SET
    state = 1, fingerprint = EXCLUDED.fingerprint, lease_token = EXCLUDED.lease_token,
    fencing = t.fencing + 1, lease_expires_at = EXCLUDED.lease_expires_at, response = NULL,
    updated_at = now(), expires_at = EXCLUDED.expires_at
WHERE t.expires_at <= now() OR (t.state = 1 AND t.lease_expires_at <= now())
RETURNING fencing, lease_token;
