-- 64 fresh keys claimed by one statement: TRY_CLAIM over unnest(...), the
-- issue's yardstick for a batch claim (rate in keys per second = tps * 64).
-- Written by hand from TRY_CLAIM (the store has no batch statement yet): the
-- same columns, conflict target, takeover rule and RETURNING, with the keys
-- from an array. pgbench cannot bind an array it builds, so the array of keys
-- is made in the statement from a per-client counter; every key is new.
\set n :n + 1
\set base :client_id * 1000000000000 + :n * 64
INSERT INTO idempotency_records AS r
    (namespace, key, state, fencing_token, lease_token, fingerprint, response, retention_us,
     lease_expires_at, expires_at, created_at, updated_at)
SELECT :ns::text, k.key, 1, 1, :token::bytea, NULL::bytea, NULL::bytea, :ret_us::bigint,
       now() + :ttl_us::bigint::float8 * interval '1 microsecond',
       now() + (:ttl_us::bigint + :ret_us::bigint)::float8 * interval '1 microsecond',
       now(), now()
FROM unnest(ARRAY(SELECT (:base::bigint + g)::text FROM generate_series(0, 63) AS g)) AS k(key)
ON CONFLICT (namespace, key) DO UPDATE SET
    state = 1,
    fencing_token = r.fencing_token + 1,
    lease_token = excluded.lease_token,
    fingerprint = CASE WHEN r.expires_at <= now() THEN excluded.fingerprint
                       ELSE coalesce(r.fingerprint, excluded.fingerprint) END,
    response = NULL,
    retention_us = excluded.retention_us,
    lease_expires_at = excluded.lease_expires_at,
    expires_at = excluded.expires_at,
    created_at = CASE WHEN r.expires_at <= now() THEN now() ELSE r.created_at END,
    updated_at = now()
WHERE r.expires_at <= now()
   OR ((r.state = 3 OR (r.state = 1 AND r.lease_expires_at <= now()))
       AND (r.fingerprint IS NULL OR excluded.fingerprint IS NULL
            OR r.fingerprint = excluded.fingerprint))
RETURNING key, fencing_token, lease_expires_at, expires_at;
