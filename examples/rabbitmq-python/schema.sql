-- The consumer's own database: the effect of one order message.
-- (The idempotency service keeps its records elsewhere; nothing here refers to it.)
--
-- Every row carries the fencing token of the lease under which it was written,
-- and the order row the SHA-256 of the message body that wrote it. A write from
-- a newer lease rewrites the same values (a takeover; a late retry the service
-- re-executes under the next token while it remembers the key). A write from
-- an older or equal lease (a consumer that stalled past its lease while another
-- took the message over; a copy that came after the service forgot the key,
-- whose new record starts again at token 1) writes nothing; a write of another
-- body under the same order id never overwrites it, whatever its token: see
-- apply_order() in consumer.py.

CREATE TABLE IF NOT EXISTS orders (
    order_id      text        PRIMARY KEY,
    customer      text        NOT NULL,
    amount_cents  bigint      NOT NULL,
    message_id    text        NOT NULL,
    body_sha256   bytea       NOT NULL,    -- fingerprint(body): what the Claim carried
    fencing       bigint      NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now()
);

-- One ledger entry per order: the order's debit.
CREATE TABLE IF NOT EXISTS ledger (
    entry_id      bigserial   PRIMARY KEY,
    order_id      text        NOT NULL UNIQUE REFERENCES orders (order_id),
    amount_cents  bigint      NOT NULL,
    fencing       bigint      NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now()
);

-- An audit of every committed application of the effect (which lease wrote
-- it, from which process). Not needed for correctness; it shows the two cases
-- where the effect legitimately runs twice: the consumer died after the
-- effect's commit and before Complete, or a late copy came after the result
-- expired while the service still remembered the key; either way the next
-- lease (next fencing token) ran it again, and the guarded upserts above left
-- one order and one entry.
CREATE TABLE IF NOT EXISTS effect_runs (
    run_id        bigserial   PRIMARY KEY,
    order_id      text        NOT NULL,
    fencing       bigint      NOT NULL,
    pid           integer     NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    UNIQUE (order_id, fencing)
);
