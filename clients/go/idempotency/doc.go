// Package idempotency is the Go client of idempotency-service: a shared
// deduplication store that makes at-least-once delivery (webhooks, queue
// messages, retried RPCs) apply its effect once per event.
//
// The package has these parts:
//
//   - Client (client.go): the service's calls (Claim, Complete, Release,
//     ExtendLease, Get, and their checkpoint variants) with typed results,
//     over the generated stub (idempotencyservice/gen/idempotencyv1,
//     generated from the proto). Every Claim carries its own lease token,
//     so it is safe to retry; a Claim may wait for another holder.
//   - Connections and retries (conns.go, retry.go): one connection per
//     address (Dial takes several), each call started on the next connected
//     one, and failed attempts (UNAVAILABLE, RESOURCE_EXHAUSTED,
//     DEADLINE_EXCEEDED) retried on the next with capped exponential
//     backoff and full jitter (RetryPolicy) within the call's deadline.
//   - Once and OnceJSON (once.go, lease.go): the whole lifecycle in one
//     call: claim, run the work while a heartbeat extends the lease,
//     complete with its result or release on error, replay a stored result,
//     wait for (or fail on) another claimant's lease. The work's Lease
//     carries the checkpoint an earlier holder saved and saves its own.
//   - DeriveKey, Fingerprint and CanonicalJSON (keys.go): the key and
//     fingerprint forms of clients/KEYS.md, byte for byte those of the
//     Python and TypeScript clients.
//
// Errors (errors.go) are a *StatusError for a failed call, matched with
// errors.Is against ErrNotFound, ErrLeaseNotCurrent, ErrUnavailable and the
// other sentinels, and Once's own *FingerprintMismatch, *InProgress and
// *LeaseLostError (errors.Is(err, ErrLeaseLost)).
//
//	client, err := idempotency.Dial("127.0.0.1:50051")
//	result, err := client.Once(ctx, "payments/stripe-webhooks", idempotency.MustDeriveKey("stripe", event.ID),
//	    func(ctx context.Context, lease idempotency.Lease) ([]byte, error) { return charge(ctx, event, lease.FencingToken) },
//	    idempotency.WithFingerprint(idempotency.MustFingerprint(body)))
//
// The subpackage idempotencytest starts a real server for tests.
package idempotency
