-- Batches by worker on Citus (issue 31): one delegated call per worker with
-- all of that worker's keys, instead of one routed statement per key.
--
-- Each idempotency_routed_* function takes a routing key (`route`) before
-- the arguments of the function it wraps. On Citus it is distributed by that
-- argument and colocated with idempotency_records, so the coordinator (or
-- any node) sends the whole call to the worker holding the route's shard,
-- where it runs with local execution: Citus's routing, deparsing and
-- planning are paid once per call, not once per key. The store groups a
-- batch's keys by the worker its shard map says holds them, and routes each
-- group by one of its keys (src/store/postgres/shards.rs). A key of another
-- worker (a stale map, a shard moved meanwhile) is still found: the worker
-- runs that key's statement on its owner, as the coordinator would, so a
-- stale map costs a hop and never a wrong answer.
--
-- The clock: a delegated call reads now() on the worker that runs it, so the
-- worker's clock decides for the keys of its call (docs/scaling.md, "Whose
-- clock").
--
-- The read functions a single call uses (idempotency_fetch,
-- idempotency_claim_or_fetch) are distributed by their key the same way.
--
-- Every function a worker runs names the schema it was made in
-- (search_path): a delegated call arrives on the worker with the worker's
-- default search_path, not the caller's, and the table may be in another
-- schema (the tests make one schema each). A constant, set before Citus
-- distributes the function (it propagates the setting with it).
--
-- On plain PostgreSQL the functions exist (the store does not call them
-- there, and tests compare them with the set-based statements), and nothing
-- is distributed.

CREATE FUNCTION idempotency_routed_claim_or_fetch(
    route text, namespaces text[], keys text[], lease_tokens bytea[], fingerprints bytea[],
    leases_us int8[], retentions_us int8[])
RETURNS TABLE (ord int8, inserted bool, now timestamptz, state int2, fencing_token int8,
               lease_token bytea, fingerprint bytea, response bytea, retention_us int8,
               lease_expires_at timestamptz, expires_at timestamptz,
               created_at timestamptz, updated_at timestamptz,
               checkpoint bytea, checkpoint_fencing int8, remember_until timestamptz)
LANGUAGE plpgsql AS $fn$
BEGIN
    RETURN QUERY SELECT * FROM idempotency_claim_or_fetch_many(
        namespaces, keys, lease_tokens, fingerprints, leases_us, retentions_us);
END
$fn$;

CREATE FUNCTION idempotency_routed_try_claim(
    route text, namespaces text[], keys text[], lease_tokens bytea[], fingerprints bytea[],
    leases_us int8[], retentions_us int8[])
RETURNS TABLE (namespace text, key text, fencing_token int8, lease_expires_at timestamptz,
               expires_at timestamptz, checkpoint bytea, checkpoint_fencing int8)
LANGUAGE plpgsql AS $fn$
BEGIN
    RETURN QUERY SELECT * FROM idempotency_try_claim_many(
        namespaces, keys, lease_tokens, fingerprints, leases_us, retentions_us);
END
$fn$;

CREATE FUNCTION idempotency_routed_fetch(route text, namespaces text[], keys text[])
RETURNS TABLE (now timestamptz, state int2, fencing_token int8, lease_token bytea,
               fingerprint bytea, response bytea, retention_us int8,
               lease_expires_at timestamptz, expires_at timestamptz,
               created_at timestamptz, updated_at timestamptz,
               checkpoint bytea, checkpoint_fencing int8, remember_until timestamptz)
LANGUAGE plpgsql AS $fn$
BEGIN
    RETURN QUERY SELECT * FROM idempotency_fetch_many(namespaces, keys);
END
$fn$;

CREATE FUNCTION idempotency_routed_complete(
    route text, namespaces text[], keys text[], lease_tokens bytea[], responses bytea[],
    retentions_us int8[], remember_us int8[])
RETURNS TABLE (item int, new_expires_at timestamptz)
LANGUAGE plpgsql AS $fn$
BEGIN
    RETURN QUERY SELECT * FROM idempotency_complete_many(
        namespaces, keys, lease_tokens, responses, retentions_us, remember_us);
END
$fn$;

DO $$
DECLARE
    f text;
    routed text[] := ARRAY[
        'idempotency_routed_claim_or_fetch(text, text[], text[], bytea[], bytea[], int8[], int8[])',
        'idempotency_routed_try_claim(text, text[], text[], bytea[], bytea[], int8[], int8[])',
        'idempotency_routed_fetch(text, text[], text[])',
        'idempotency_routed_complete(text, text[], text[], bytea[], bytea[], int8[], int8[])'];
    by_key text[] := ARRAY[
        'idempotency_fetch(text, text)',
        'idempotency_claim_or_fetch(text, text, bytea, bytea, int8, int8)'];
BEGIN
    FOREACH f IN ARRAY routed || by_key LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I', f, current_schema());
    END LOOP;
    IF NOT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus') THEN
        RETURN;
    END IF;
    FOREACH f IN ARRAY routed LOOP
        PERFORM create_distributed_function(f::regprocedure, 'route', colocate_with := 'idempotency_records');
    END LOOP;
    FOREACH f IN ARRAY by_key LOOP
        PERFORM create_distributed_function(f::regprocedure, 'p_key', colocate_with := 'idempotency_records');
    END LOOP;
END
$$;
