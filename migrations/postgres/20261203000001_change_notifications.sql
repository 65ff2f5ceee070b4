-- Every change to a completed record reaches the replicas' replay caches,
-- whoever makes it: an operator's UPDATE or DELETE in psql, a restore into
-- the live table, a TRUNCATE. The service's own Purge announces itself in its
-- statement (and still does: on Citus, triggers run on the workers, whose
-- NOTIFY never reaches listeners on the coordinator); these triggers announce
-- the rest on the same channel, in the same format (src/store/postgres/feed.rs):
-- `<n>:<namespace><key>`, n counting characters, and `*` for "forget
-- everything". An identical notification from Purge and from its trigger in
-- one transaction is delivered once.
--
-- The channel is the schema's that holds the table (TG_TABLE_SCHEMA), as the
-- service derives it, whatever the session's search_path.
--
-- Cost: the WHEN clause is checked on every updated or deleted row, and the
-- function runs only when it holds. The service's own statements never
-- satisfy it on the call path: Complete, Release and ExtendLease update rows
-- in progress (state 1), a Claim takes over a completed row only once it has
-- expired, and the reaper deletes expired rows. Only Purge of a completed
-- record fires it.
CREATE FUNCTION idempotency_records_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idempotency_purges_' || left(md5(TG_TABLE_SCHEMA), 16),
                      length(OLD.namespace)::text || ':' || OLD.namespace || OLD.key);
    RETURN NULL;
END
$$;

CREATE TRIGGER idempotency_records_changed
    AFTER UPDATE OR DELETE ON idempotency_records
    FOR EACH ROW
    WHEN (OLD.state = 2 AND OLD.expires_at > now())
    EXECUTE FUNCTION idempotency_records_changed();

CREATE FUNCTION idempotency_records_truncated() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idempotency_purges_' || left(md5(TG_TABLE_SCHEMA), 16), '*');
    RETURN NULL;
END
$$;

CREATE TRIGGER idempotency_records_truncated
    AFTER TRUNCATE ON idempotency_records
    FOR EACH STATEMENT
    EXECUTE FUNCTION idempotency_records_truncated();
