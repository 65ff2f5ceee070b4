-- Every change heard on every node (issue 31). On Citus a row's triggers run
-- on the node holding its shard, and their NOTIFY reaches only that node's
-- listeners; the service's purge feed now listens on every node group's
-- primary of pg_dist_node, besides the coordinator (src/store/postgres/
-- feed.rs). So the triggers that plain PostgreSQL has since the migrations
-- 20261203000001_change_notifications and 20261204000001_waiters are made on
-- Citus too: an operator's UPDATE, DELETE or TRUNCATE in SQL reaches every
-- replica's replay cache, and a watched key's Complete or Release wakes its
-- waiters on every replica, instead of their reading again every 500 ms.
--
-- Citus refuses triggers on a distributed table unless
-- citus.enable_unsafe_triggers is on (a user-settable setting). Ours only
-- call pg_notify with the row's own columns: they read and write no other
-- table, which is what makes a trigger unsafe on Citus. Citus makes each
-- trigger on every shard. A TRUNCATE is announced by the coordinator's
-- trigger (and by the shards' where Citus fires them), on the coordinator,
-- which every replica listens on.
--
-- idempotency_watch is WATCH (src/store/postgres/sql.rs) as a function: a
-- CTE that updates is not a statement Citus routes to one shard with the
-- shard's clock, so on Citus the mark and the read are two single-shard
-- statements with one now(), distributed by the key like idempotency_fetch,
-- and run on the node holding it. On plain PostgreSQL it exists and is
-- called only by the tests that run Citus's statements there.

CREATE FUNCTION idempotency_watch(p_namespace text, p_key text)
RETURNS TABLE (now timestamptz, state int2, fencing_token int8, lease_token bytea,
               fingerprint bytea, response bytea, retention_us int8,
               lease_expires_at timestamptz, expires_at timestamptz,
               created_at timestamptz, updated_at timestamptz,
               checkpoint bytea, checkpoint_fencing int8, remember_until timestamptz,
               watched bool, marked bool)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    t timestamptz := now();
    m bool;
BEGIN
    UPDATE idempotency_records AS r
    SET watched = true
    WHERE r.namespace = p_namespace AND r.key = p_key AND r.state = 1 AND NOT r.watched
      AND r.lease_expires_at > t AND r.expires_at > t;
    m := FOUND;
    RETURN QUERY
    SELECT t, r.state, r.fencing_token, r.lease_token, r.fingerprint, r.response,
           r.retention_us, r.lease_expires_at, r.expires_at, r.created_at, r.updated_at,
           r.checkpoint, r.checkpoint_fencing, r.remember_until,
           r.watched AND NOT m, m
    FROM idempotency_records AS r
    WHERE r.namespace = p_namespace AND r.key = p_key;
    IF NOT FOUND THEN
        now := t;
        watched := false;
        marked := false;
        RETURN NEXT;
    END IF;
END
$$;

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION idempotency_watch(text, text) SET search_path = %I',
                   current_schema());
    IF NOT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus') THEN
        RETURN;
    END IF;
    PERFORM create_distributed_function('idempotency_watch(text, text)'::regprocedure,
                                        'p_key', colocate_with := 'idempotency_records');
    -- The trigger functions on every node (Citus made them there when they
    -- were created; said again, in case a node was added without them).
    PERFORM create_distributed_function('idempotency_records_changed()'::regprocedure);
    PERFORM create_distributed_function('idempotency_records_truncated()'::regprocedure);
    PERFORM create_distributed_function('idempotency_records_settled()'::regprocedure);
    PERFORM set_config('citus.enable_unsafe_triggers', 'on', true);
    CREATE TRIGGER idempotency_records_changed
        AFTER UPDATE OR DELETE ON idempotency_records
        FOR EACH ROW
        WHEN (OLD.state = 2 AND OLD.expires_at > now())
        EXECUTE FUNCTION idempotency_records_changed();
    CREATE TRIGGER idempotency_records_truncated
        AFTER TRUNCATE ON idempotency_records
        FOR EACH STATEMENT
        EXECUTE FUNCTION idempotency_records_truncated();
    CREATE TRIGGER idempotency_records_settled
        AFTER UPDATE ON idempotency_records
        FOR EACH ROW
        WHEN (OLD.watched AND OLD.state = 1 AND NEW.state <> 1)
        EXECUTE FUNCTION idempotency_records_settled();
END
$$;
