-- Checkpoints: how far a lease holder's work got, saved with ExtendLease or
-- Release and handed to whoever claims the key next (as in PostgreSQL's
-- migration of the same name). Both NULL when there is none.
ALTER TABLE idempotency_records ADD COLUMN checkpoint BLOB;
ALTER TABLE idempotency_records ADD COLUMN checkpoint_fencing INTEGER;
