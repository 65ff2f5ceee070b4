-- Claims that wait (issue 23): a Claim may wait for the holder of a live
-- lease to Complete or Release, on any replica. A waiting replica marks the
-- key's row `watched` (one write per key, however many wait on it), and from
-- then on the row's Complete or Release (state leaving 1, in progress) is
-- announced on the purges channel, in the feed's format
-- (src/store/postgres/feed.rs: `<n>:<namespace><key>`, n counting
-- characters), which every replica's listener hears.
--
-- Cost: the WHEN clause reads two columns of the row being updated; rows
-- nobody waited on (nearly all) never run the function, so their Complete
-- sends no NOTIFY (a NOTIFY serialises committing transactions on a
-- database-wide lock: it must stay off the common path). The flag stays set
-- for the row's life: a later holder's Complete is announced too, which costs
-- one notification nobody may need.
--
-- Adding a column with a constant default rewrites nothing (PostgreSQL 11+).
-- On Citus the column is added to every shard, and the trigger is not made:
-- triggers run on the workers, whose NOTIFY never reaches the coordinator's
-- listeners; waiting replicas there read the key again at a bounded interval
-- instead (docs/scaling.md).
CREATE FUNCTION idempotency_records_settled() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idempotency_purges_' || left(md5(TG_TABLE_SCHEMA), 16),
                      length(NEW.namespace)::text || ':' || NEW.namespace || NEW.key);
    RETURN NULL;
END
$$;

-- After the function: on Citus, a function is created on the workers too,
-- which a transaction can no longer do once it ran a parallel (multi-shard)
-- command such as this ALTER TABLE.
ALTER TABLE idempotency_records ADD COLUMN watched boolean NOT NULL DEFAULT false;

DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_extension WHERE extname = 'citus') THEN
        RETURN;
    END IF;
    CREATE TRIGGER idempotency_records_settled
        AFTER UPDATE ON idempotency_records
        FOR EACH ROW
        WHEN (OLD.watched AND OLD.state = 1 AND NEW.state <> 1)
        EXECUTE FUNCTION idempotency_records_settled();
END
$$;
