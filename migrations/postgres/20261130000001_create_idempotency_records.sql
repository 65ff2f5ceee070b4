-- One row per (namespace, key): the whole lifecycle of an event's key.
--
-- namespace and key are two columns, never joined into one string, so no
-- separator can make two identities collide. COLLATE "C" compares them byte for
-- byte (no locale rules), which is also the cheapest comparison for the index.
--
-- Times are timestamptz written from now(): the database's clock decides every
-- lease, so replicas whose clocks disagree still agree on who holds a key.
CREATE TABLE idempotency_records (
    namespace        text COLLATE "C" NOT NULL,
    key              text COLLATE "C" NOT NULL,
    -- 1 = in progress, 2 = completed, 3 = released.
    state            smallint    NOT NULL CHECK (state IN (1, 2, 3)),
    -- One more on every successful claim; restarts at 1 only when the row is
    -- deleted after expiring.
    fencing_token    bigint      NOT NULL CHECK (fencing_token > 0),
    -- The 128-bit secret of the latest claim. Kept after Complete and Release
    -- so that a retried Complete or Release with the same token is recognised.
    lease_token      bytea       NOT NULL,
    -- NULL when no claim that won the key carried one ("don't check").
    fingerprint      bytea,
    -- Set by Complete; what every later Claim replays.
    response         bytea,
    -- The claim's retention, in microseconds: used when Complete names none, and
    -- to keep an abandoned in-progress record past its lease.
    retention_us     bigint      NOT NULL CHECK (retention_us > 0),
    -- Set while in progress (it may lie in the past: an expired lease is
    -- claimable, and completable by its holder until someone claims it).
    lease_expires_at timestamptz,
    -- After this the record is absent for every RPC, and the reaper deletes it.
    expires_at       timestamptz NOT NULL,
    created_at       timestamptz NOT NULL,
    updated_at       timestamptz NOT NULL,
    PRIMARY KEY (namespace, key)
);

-- The reaper's scan: oldest expiries first, in bounded batches.
CREATE INDEX idempotency_records_expires_at ON idempotency_records (expires_at);
