// The side effect: one ledger row per event, in the consumer's OWN PostgreSQL
// database (not the idempotency service's), written only by the newest lease
// holder of the event's key.
//
// The fencing token from Claim goes into the row. The upsert only replaces a
// row written under a LOWER token, and only with the same account and amount,
// so:
//   - a worker that took the key over after an earlier holder's lease ran out
//     (fencing + 1) rewrites that holder's row: still one row per event; so
//     does a late copy after the receipt expired, which the service
//     re-executes under the next token while it remembers the event;
//   - a late holder whose lease was taken over (a lower token than the row's)
//     changes nothing: its write is rejected by the guard, and its Complete
//     will be refused by the service as well;
//   - once the service forgot the event (past its horizon the record is
//     deleted), its token restarts at 1 and climbs again: a copy then writes
//     nothing and the row is its receipt; the row is never rewritten with
//     another amount, whatever the token (consumer.ts refuses such a body
//     before its Claim; the guard holds in a race too).
import type { Pool } from "pg";

export const LEDGER_SCHEMA = `
CREATE TABLE IF NOT EXISTS ledger (
  event_key     text        PRIMARY KEY,   -- deriveKey("orders", event_id): the key claimed in the service
  event_id      text        NOT NULL,
  account       text        NOT NULL,
  amount_cents  bigint      NOT NULL,
  fencing       bigint      NOT NULL,      -- the Claim's fencing token of the attempt that wrote the row
  applied_by    text        NOT NULL,      -- which worker (for the logs and the test)
  applied_at    timestamptz NOT NULL DEFAULT now()
)`;

/** The guarded write: insert, or replace a row written under a lower fencing token; else nothing. */
export const GUARDED_UPSERT = `
INSERT INTO ledger AS l (event_key, event_id, account, amount_cents, fencing, applied_by)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (event_key) DO UPDATE
   SET event_id = EXCLUDED.event_id, account = EXCLUDED.account,
       amount_cents = EXCLUDED.amount_cents, fencing = EXCLUDED.fencing,
       applied_by = EXCLUDED.applied_by, applied_at = now()
 WHERE l.fencing < EXCLUDED.fencing
   AND l.account = EXCLUDED.account AND l.amount_cents = EXCLUDED.amount_cents
RETURNING event_id, account, amount_cents::text, fencing::text, applied_by`;

const CURRENT_ROW = `
SELECT event_id, account, amount_cents::text, fencing::text, applied_by
  FROM ledger WHERE event_key = $1`;

/** What Complete stores and every redelivery replays: the event's ledger row as it stands. */
export interface Receipt {
  event_id: string;
  account: string;
  amount_cents: number;
  /** The fencing token the row was written under (a decimal string: JSON has no bigint). */
  fencing: string;
  applied_by: string;
}

export interface LedgerEntry {
  eventKey: string;
  eventId: string;
  account: string;
  amountCents: number;
  fencing: bigint;
  worker: string;
}

export interface EffectResult {
  /** True when this attempt's write went in; false when the guard rejected it (a row with a token >= ours exists). */
  applied: boolean;
  /** The row as it stands after the attempt: ours, or the one that fenced us out. */
  receipt: Receipt;
}

/** The event's row as it stands, if the effect was ever applied. */
export async function currentRow(pool: Pool, eventKey: string): Promise<Receipt | undefined> {
  const current = await pool.query(CURRENT_ROW, [eventKey]);
  return current.rowCount === 1 ? toReceipt(current.rows[0]) : undefined;
}

export async function ensureLedger(pool: Pool): Promise<void> {
  await pool.query(LEDGER_SCHEMA);
}

function toReceipt(row: Record<string, string>): Receipt {
  return {
    event_id: row.event_id,
    account: row.account,
    amount_cents: Number(row.amount_cents),
    fencing: row.fencing,
    applied_by: row.applied_by,
  };
}

/**
 * Apply the effect under the fencing guard. Never throws for a stale token:
 * it reports `applied: false` and the row that is there, and the caller goes
 * on to Complete, whose answer decides (a takeover's lease refuses it; see
 * consumer.ts). A row with an equal or higher token is this attempt's own
 * earlier write (a retried statement), a newer holder's, or one written
 * before the service forgot the event (its token restarted): Complete
 * tells them apart, and the receipt describes the row either way.
 */
export async function applyEffect(pool: Pool, entry: LedgerEntry): Promise<EffectResult> {
  const written = await pool.query(GUARDED_UPSERT, [
    entry.eventKey,
    entry.eventId,
    entry.account,
    entry.amountCents,
    entry.fencing.toString(),
    entry.worker,
  ]);
  if (written.rowCount === 1) return { applied: true, receipt: toReceipt(written.rows[0]) };
  const current = await pool.query(CURRENT_ROW, [entry.eventKey]);
  if (current.rowCount !== 1) throw new Error(`ledger: the guard rejected ${entry.eventKey} but no row is there`);
  return { applied: false, receipt: toReceipt(current.rows[0]) };
}
