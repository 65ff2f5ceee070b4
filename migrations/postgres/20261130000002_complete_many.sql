-- Completes many keys in one statement, one primary-key UPDATE per item, in
-- the order given (the store sorts by key, so concurrent batches lock rows in
-- the same order). Each item gets the guard of a single Complete: the record
-- is unexpired, in progress, and held by that token.
--
-- A function rather than UPDATE ... FROM unnest(...): the join's plan is made
-- once per connection and cached, and a plan made while the table is new (a
-- hash join over a sequential scan) reads the whole table for every batch as
-- it grows. Each UPDATE here looks its row up by key whatever the statistics
-- say, and items are applied one after another, so one key named twice (two
-- tokens) gets each item's guard checked against the other's result.
--
-- Returns the position (from 1) and new expiry of every item it completed.
CREATE FUNCTION idempotency_complete_many(
    namespaces text[], keys text[], lease_tokens bytea[], responses bytea[],
    retentions_us int8[])
RETURNS TABLE (item int, new_expires_at timestamptz)
LANGUAGE plpgsql
AS $$
BEGIN
    FOR i IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        UPDATE idempotency_records AS r
        SET state = 2, response = responses[i], lease_expires_at = NULL,
            expires_at = now()
                + coalesce(retentions_us[i], r.retention_us)::float8 * interval '1 microsecond',
            updated_at = now()
        WHERE r.namespace = namespaces[i] COLLATE "C" AND r.key = keys[i] COLLATE "C"
          AND r.state = 1 AND r.lease_token = lease_tokens[i] AND r.expires_at > now()
        RETURNING i, r.expires_at INTO item, new_expires_at;
        IF FOUND THEN
            RETURN NEXT;
        END IF;
    END LOOP;
END
$$;
