-- Remembered keys (issue 24), as on PostgreSQL (see its migration
-- 20261205000001_remembered_keys.sql): remember_until is a completed
-- record's horizon (NULL: nothing remembered past the retention), and state
-- 4 is the reaper's marker (no response or checkpoint; expires_at is the
-- horizon, remember_until the result's original expiry). Times are
-- microseconds since the Unix epoch, as in every column here.
--
-- SQLite cannot change a CHECK constraint in place, so the table is made
-- again with the new state allowed and the rows copied, in the migration's
-- transaction (the embedded store is small, and nothing else uses the file
-- while the service migrates it).
CREATE TABLE idempotency_records_new (
    namespace          TEXT    NOT NULL,
    key                TEXT    NOT NULL,
    -- 1 = in progress, 2 = completed, 3 = released, 4 = remembered (a marker).
    state              INTEGER NOT NULL CHECK (state IN (1, 2, 3, 4)),
    fencing_token      INTEGER NOT NULL CHECK (fencing_token > 0),
    lease_token        BLOB    NOT NULL,
    fingerprint        BLOB,
    response           BLOB,
    retention_us       INTEGER NOT NULL CHECK (retention_us > 0),
    lease_expires_at   INTEGER,
    expires_at         INTEGER NOT NULL,
    created_at         INTEGER NOT NULL,
    updated_at         INTEGER NOT NULL,
    checkpoint         BLOB,
    checkpoint_fencing INTEGER,
    remember_until     INTEGER,
    PRIMARY KEY (namespace, key)
);

INSERT INTO idempotency_records_new
    (namespace, key, state, fencing_token, lease_token, fingerprint, response, retention_us,
     lease_expires_at, expires_at, created_at, updated_at, checkpoint, checkpoint_fencing)
SELECT namespace, key, state, fencing_token, lease_token, fingerprint, response, retention_us,
       lease_expires_at, expires_at, created_at, updated_at, checkpoint, checkpoint_fencing
FROM idempotency_records;

DROP TABLE idempotency_records;
ALTER TABLE idempotency_records_new RENAME TO idempotency_records;
CREATE INDEX idempotency_records_expires_at ON idempotency_records (expires_at);
