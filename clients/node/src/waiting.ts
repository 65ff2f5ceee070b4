// Waiting for another holder on the server (ClaimRequest.wait), and what a
// client learns about servers that predate it.
//
// A Claim that asks to wait holds the call open until the holder completes
// (the stored result), releases or loses its lease (this Claim may take the
// key), or the wait runs out (IN_PROGRESS). A server built before the field
// ignores it and never sets ClaimResponse.waited: the client then knows to
// poll instead. client.ts and once.ts both use this module.
import type { ClaimResult } from "./types";

/**
 * The longest part of a call's timeout a waiting Claim keeps for its answer to
 * come back: the wait it sends ends this long (or a tenth of the timeout, when
 * that is shorter) before the call's deadline.
 */
export const WAIT_HEADROOM_MS = 500;

/** Waits shorter than this are not asked for (zero would mean "do not wait"). */
export const MIN_WAIT_MS = 10;

/**
 * After a server ignored `wait`, once() polls without asking for this long,
 * then asks again (so a server upgraded under a long-lived client is noticed).
 */
export const WAIT_RECHECK_MS = 300_000;

/** The wait a Claim sends: `waitMs`, ending WAIT_HEADROOM_MS (or a tenth of the timeout) before the call's deadline. */
export function waitWithin(waitMs: number, timeoutMs: number): number {
  return Math.min(waitMs, timeoutMs - Math.min(WAIT_HEADROOM_MS, timeoutMs / 10));
}

/** once()'s first pause when it polls; a server's wait shorter than this counts as none. */
export const FIRST_POLL_MS = 100;

/**
 * Whether the server did the waiting for an IN_PROGRESS answer, so that the
 * next Claim may go at once. False when it did not: it predates waiting
 * (waitedMs null) or its waiter limit was reached (0). A wait shorter than
 * the first poll pause counts as none (a server answering its waiters as it
 * shuts down, say): once() then pauses as when polling, so it never spins on
 * a server that keeps answering at once.
 */
export function serverWaited(claim: ClaimResult): boolean {
  return claim.waitedMs !== null && claim.waitedMs >= FIRST_POLL_MS;
}

/** What a client has learned about its servers and ClaimRequest.wait. */
export class ServerWaits {
  /** true: an answer carried `waited`; false: a server ignored `wait`; null: no Claim asked yet. */
  supported: boolean | null = null;
  private ignoredAt: number | undefined;

  /** Whether once() should ask the server to wait, or go straight to polling. */
  worthAsking(): boolean {
    return this.ignoredAt === undefined || Date.now() - this.ignoredAt >= WAIT_RECHECK_MS;
  }

  /** The answer to a Claim that asked to wait: its waitedMs, null when unset. */
  saw(waitedMs: number | null): void {
    if (waitedMs !== null) {
      this.supported = true;
      this.ignoredAt = undefined;
    } else {
      this.supported = false;
      this.ignoredAt = Date.now();
    }
  }
}
