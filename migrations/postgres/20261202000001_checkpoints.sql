-- Checkpoints: how far a lease holder's work got, saved with ExtendLease or
-- Release and handed to whoever claims the key next (an expired lease taken
-- over, or a released one). Complete discards it; a record that expired
-- starts without one.
--
-- Both columns NULL when there is none. Adding nullable columns without a
-- default changes only the catalog: no rewrite, a brief lock. Earlier
-- versions of the service name their columns and never read these, so
-- replicas of both versions can run side by side during a rolling upgrade.
ALTER TABLE idempotency_records
    -- The bytes the holder saved (at most IDEMPOTENCY_MAX_CHECKPOINT_BYTES).
    ADD COLUMN checkpoint bytea,
    -- The fencing token of the lease they were saved under.
    ADD COLUMN checkpoint_fencing bigint;

-- The batch Complete discards the checkpoint too, as the single one does.
CREATE OR REPLACE FUNCTION idempotency_complete_many(
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
            updated_at = now(), checkpoint = NULL, checkpoint_fencing = NULL
        WHERE r.namespace = namespaces[i] COLLATE "C" AND r.key = keys[i] COLLATE "C"
          AND r.state = 1 AND r.lease_token = lease_tokens[i] AND r.expires_at > now()
        RETURNING i, r.expires_at INTO item, new_expires_at;
        IF FOUND THEN
            RETURN NEXT;
        END IF;
    END LOOP;
END
$$;
