-- The reaper's index moves from expires_at to reap_at, a stored copy of it,
-- so that no statement on the call path can plan through it.
--
-- Every statement on the call path finds its row by primary key and checks
-- `expires_at > now()` on it. While expires_at itself was indexed, PostgreSQL
-- could pick that index instead: on a table analysed while empty (a new
-- deployment, until autoanalyze runs), the generic plan of the Complete
-- inside idempotency_complete_many scanned the whole expires_at index, about
-- 2,100 buffers per call instead of a dozen. No call-path statement names
-- reap_at, so the primary key is their only index. The reaper, which does
-- want expiry order, scans reap_at.
--
-- A generated column: PostgreSQL keeps it equal to expires_at on every write,
-- whichever version of the service makes it. Adding it rewrites the table
-- once, under an exclusive lock.
ALTER TABLE idempotency_records
    ADD COLUMN reap_at timestamptz NOT NULL GENERATED ALWAYS AS (expires_at) STORED;

CREATE INDEX idempotency_records_reap_at ON idempotency_records (reap_at);
DROP INDEX idempotency_records_expires_at;
