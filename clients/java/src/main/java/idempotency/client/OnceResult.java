package idempotency.client;

/**
 * What once() did: the value (the work's result, or the stored one when
 * {@code replayed}), and the Claim that decided it.
 */
public record OnceResult(byte[] value, boolean replayed, ClaimResult claim) {}
