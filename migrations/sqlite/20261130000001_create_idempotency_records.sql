-- One row per (namespace, key): the whole lifecycle of an event's key. The same
-- shape as the PostgreSQL table, in SQLite's types.
--
-- namespace and key are two columns compared byte for byte (SQLite's default
-- BINARY collation), never joined into one string.
--
-- Times are INTEGER microseconds since the Unix epoch, from the server
-- process's clock: the embedded store has one process, so one clock.
CREATE TABLE idempotency_records (
    namespace        TEXT    NOT NULL,
    key              TEXT    NOT NULL,
    -- 1 = in progress, 2 = completed, 3 = released.
    state            INTEGER NOT NULL CHECK (state IN (1, 2, 3)),
    -- One more on every successful claim; restarts at 1 only when the row is
    -- deleted after expiring.
    fencing_token    INTEGER NOT NULL CHECK (fencing_token > 0),
    -- The 128-bit secret of the latest claim, kept after Complete and Release
    -- so that a retried call with the same token is recognised.
    lease_token      BLOB    NOT NULL,
    -- NULL when no claim that won the key carried one ("don't check").
    fingerprint      BLOB,
    response         BLOB,
    retention_us     INTEGER NOT NULL CHECK (retention_us > 0),
    lease_expires_at INTEGER,
    expires_at       INTEGER NOT NULL,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    PRIMARY KEY (namespace, key)
);

CREATE INDEX idempotency_records_expires_at ON idempotency_records (expires_at);
