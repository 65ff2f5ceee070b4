-- The dedup table a team would write by hand in its own PostgreSQL: the
-- yardstick of bench/compare.sh (issue 13). Nothing here is the service's;
-- the service's own table is in migrations/postgres.
DROP TABLE IF EXISTS idempotency_keys;
CREATE TABLE idempotency_keys (
    namespace        text        NOT NULL,
    key              text        NOT NULL,
    state            smallint    NOT NULL,
    fingerprint      bytea,
    lease_token      uuid,
    fencing          bigint      NOT NULL DEFAULT 1,
    lease_expires_at timestamptz,
    response         bytea,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    expires_at       timestamptz NOT NULL,
    PRIMARY KEY (namespace, key)
);
CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);
