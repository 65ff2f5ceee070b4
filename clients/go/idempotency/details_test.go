package idempotency_test

// The google.rpc details of the service's statuses, as *StatusError's
// Reason, RetryDelay and Field (decoded by grpc-go's status.Details), and
// late retries of a remembered key: refused (OutcomeExpired, *ResultExpired)
// and re-executed (the fencing token continues), on both stores.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "idempotencyservice/gen/idempotencyv1"
	"idempotencyservice/idempotency"
	"idempotencyservice/idempotency/idempotencytest"
)

// statusError is err as a *StatusError, or fails the test.
func statusError(t *testing.T, what string, err error) *idempotency.StatusError {
	t.Helper()
	var e *idempotency.StatusError
	if !errors.As(err, &e) {
		t.Fatalf("%s: %v (%T), want a *StatusError", what, err, err)
	}
	return e
}

// checkStatus checks a *StatusError's code, reason and domain, and that it
// carries no retry delay.
func checkStatus(t *testing.T, what string, err error, code codes.Code, reason string) *idempotency.StatusError {
	t.Helper()
	e := statusError(t, what, err)
	if e.Code() != code || e.Reason != reason || e.Domain != idempotency.ErrorDomain || e.RetryDelay != 0 || e.Attempts != 1 {
		t.Fatalf("%s: code %s reason %q domain %q retry delay %s attempts %d; want %s %q %q, no delay, 1 attempt (%v)",
			what, e.Code(), e.Reason, e.Domain, e.RetryDelay, e.Attempts, code, reason, idempotency.ErrorDomain, err)
	}
	return e
}

func TestRefusalsCarryTheirReason(t *testing.T) {
	onEachStore(t, func(t *testing.T, server *idempotencytest.Server) {
		c, ns, ctx := server.Client(t), namespace(t), ctx(t)

		// LEASE_LOST: the lease ran out and another Claim took the key; the
		// first lease is stale.
		stale, err := c.Claim(ctx, ns, "lost", idempotency.ClaimOptions{LeaseTTL: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		var current *idempotency.ClaimResult
		until(t, 10*time.Second, "the 1 s lease to run out", func() bool {
			current, err = c.Claim(ctx, ns, "lost", idempotency.ClaimOptions{})
			if err != nil {
				t.Fatal(err)
			}
			return current.Claimed()
		})
		if current.FencingToken != 2 {
			t.Fatalf("Claim after the lease ran out: %+v", current)
		}
		_, err = c.Complete(ctx, ns, "lost", stale.LeaseToken, []byte("x"), 0)
		e := checkStatus(t, "Complete with a stale token", err, codes.FailedPrecondition, idempotency.ReasonLeaseLost)
		if !errors.Is(err, idempotency.ErrLeaseNotCurrent) || errors.Is(err, idempotency.ErrKeyExpired) || e.Field != "" {
			t.Errorf("Complete with a stale token: %+v", e)
		}
		if want := "idempotency Complete: FailedPrecondition LEASE_LOST: "; len(e.Error()) < len(want) || e.Error()[:len(want)] != want {
			t.Errorf("message %q, want it to start with %q", e.Error(), want)
		}

		// LEASE_RELEASED and KEY_COMPLETED.
		released, err := c.Claim(ctx, ns, "released", idempotency.ClaimOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Release(ctx, ns, "released", released.LeaseToken); err != nil {
			t.Fatal(err)
		}
		_, err = c.Complete(ctx, ns, "released", released.LeaseToken, nil, 0)
		checkStatus(t, "Complete after Release", err, codes.FailedPrecondition, idempotency.ReasonLeaseReleased)
		if _, err := c.Complete(ctx, ns, "lost", current.LeaseToken, []byte("x"), 0); err != nil {
			t.Fatal(err)
		}
		err = c.Release(ctx, ns, "lost", current.LeaseToken)
		checkStatus(t, "Release of a completed key", err, codes.FailedPrecondition, idempotency.ReasonKeyCompleted)

		// NOT_FOUND: nothing was ever claimed.
		_, err = c.Complete(ctx, ns, "never", idempotency.NewLeaseToken(), nil, 0)
		e = checkStatus(t, "Complete of an unknown key", err, codes.NotFound, idempotency.ReasonNotFound)
		if !errors.Is(err, idempotency.ErrNotFound) || errors.Is(err, idempotency.ErrKeyExpired) || !e.CompletedAt.IsZero() {
			t.Errorf("Complete of an unknown key: %+v", e)
		}

		// INVALID_ARGUMENT names its field, in BadRequest and in ErrorInfo.
		_, err = c.Claim(ctx, ns, "k", idempotency.ClaimOptions{LeaseToken: "not-hex"})
		e = checkStatus(t, "a malformed lease token", err, codes.InvalidArgument, idempotency.ReasonInvalidArgument)
		if e.Field != "lease_token" || e.Metadata["field"] != "lease_token" || e.FieldDescription == "" || !errors.Is(err, idempotency.ErrInvalidArgument) {
			t.Errorf("a malformed lease token: field %q metadata %v description %q", e.Field, e.Metadata, e.FieldDescription)
		}
		_, err = c.Claim(ctx, "", "k", idempotency.ClaimOptions{})
		if e = checkStatus(t, "an empty namespace", err, codes.InvalidArgument, idempotency.ReasonInvalidArgument); e.Field != "namespace" {
			t.Errorf("an empty namespace: field %q", e.Field)
		}

		// The same details, decoded with nothing but grpc-go and genproto.
		details := status.Convert(err).Details()
		var info *errdetails.ErrorInfo
		var bad *errdetails.BadRequest
		for _, d := range details {
			switch d := d.(type) {
			case *errdetails.ErrorInfo:
				info = d
			case *errdetails.BadRequest:
				bad = d
			}
		}
		if info == nil || info.GetReason() != "INVALID_ARGUMENT" || info.GetDomain() != "idempotency-service" ||
			bad == nil || len(bad.GetFieldViolations()) != 1 || bad.GetFieldViolations()[0].GetField() != "namespace" {
			t.Errorf("status.Details(): %v", details)
		}
	})
}

// remembered completes key with a retention of 1 s (the least) and waits
// until Get says it is remembered (its result expired, its marker kept).
func remembered(t *testing.T, c *idempotency.Client, ns, key string, fp []byte) (*idempotency.ClaimResult, *idempotency.Record) {
	t.Helper()
	ctx := ctx(t)
	claim, err := c.Claim(ctx, ns, key, idempotency.ClaimOptions{Fingerprint: fp, Retention: time.Second})
	if err != nil || !claim.Claimed() || claim.FencingToken != 1 || !claim.CompletedAt.IsZero() || claim.Reexecuted() {
		t.Fatalf("first Claim: %+v %v", claim, err)
	}
	before := time.Now()
	if _, err := c.Complete(ctx, ns, key, claim.LeaseToken, []byte(`"first"`), 0); err != nil {
		t.Fatal(err)
	}
	after := time.Now()
	completed, err := c.Get(ctx, ns, key)
	if err != nil {
		t.Fatal(err)
	}
	// The server remembers keys for 7 days unless configured.
	if completed.State != idempotency.StateCompleted || completed.CompletedAt.Before(before.Add(-time.Second)) || completed.CompletedAt.After(after.Add(time.Second)) ||
		completed.RememberedUntil.Sub(completed.CompletedAt) != 7*24*time.Hour {
		t.Fatalf("Get of the completed key: %+v", completed)
	}
	var record *idempotency.Record
	until(t, 15*time.Second, "the key to be remembered", func() bool {
		record, err = c.Get(ctx, ns, key)
		if err != nil {
			t.Fatal(err)
		}
		return record.Remembered()
	})
	if record.State != idempotency.StateAbsent || record.FencingToken != 1 || string(record.Fingerprint) != string(fp) ||
		!record.CompletedAt.Equal(completed.CompletedAt) || !record.RememberedUntil.Equal(completed.RememberedUntil) ||
		!record.ExpiresAt.Equal(completed.ExpiresAt) || record.Response != nil {
		t.Fatalf("Get of the remembered key: %+v (completed: %+v)", record, completed)
	}
	return claim, record
}

func TestALateRetryIsRefusedOrReexecutedAndTheFencingTokenContinues(t *testing.T) {
	onEachStore(t, func(t *testing.T, server *idempotencytest.Server) {
		c, ns, ctx := server.Client(t), namespace(t), ctx(t)
		fp := idempotency.MustFingerprint(map[string]any{"order": "o-1"})
		first, marker := remembered(t, c, ns, "k", fp)

		// Refused: OutcomeExpired with when it completed and the last fencing token.
		refused, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{Fingerprint: fp, LateRetry: idempotency.LateRetryRefuse})
		if err != nil {
			t.Fatal(err)
		}
		if refused.Outcome != idempotency.OutcomeExpired || refused.Outcome.String() != "EXPIRED" || refused.FencingToken != 1 ||
			!refused.CompletedAt.Equal(marker.CompletedAt) || refused.LeaseToken != "" || refused.Response != nil || refused.Claimed() || refused.Reexecuted() {
			t.Fatalf("a refused late retry: %+v", refused)
		}
		// Another payload is a mismatch, not EXPIRED.
		other, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{Fingerprint: []byte("other"), LateRetry: idempotency.LateRetryRefuse})
		if err != nil || other.Outcome != idempotency.OutcomeFingerprintMismatch {
			t.Fatalf("a late retry with another payload: %+v %v", other, err)
		}

		// Once, refused: a *ResultExpired; the work does not run.
		var runs int32
		work := func(ctx context.Context, lease idempotency.Lease) ([]byte, error) {
			atomic.AddInt32(&runs, 1)
			if lease.FencingToken != 2 || !lease.PreviouslyCompletedAt.Equal(marker.CompletedAt) {
				t.Errorf("the re-executed lease: %+v, want fencing token 2, completed at %s", lease, marker.CompletedAt)
			}
			return []byte(`"again"`), nil
		}
		_, err = c.Once(ctx, ns, "k", work, idempotency.WithFingerprint(fp), idempotency.WithLateRetry(idempotency.LateRetryRefuse))
		var expired *idempotency.ResultExpired
		if !errors.As(err, &expired) || !errors.Is(err, idempotency.ErrKeyExpired) || expired.FencingToken != 1 ||
			!expired.CompletedAt.Equal(marker.CompletedAt) || expired.Namespace != ns || expired.Key != "k" || atomic.LoadInt32(&runs) != 0 {
			t.Fatalf("Once, refused: %v (%+v), runs %d", err, expired, runs)
		}

		// Remembered: Complete, Release and ExtendLease answer KEY_EXPIRED,
		// with when it completed and until when it is remembered.
		_, err = c.Complete(ctx, ns, "k", first.LeaseToken, []byte("late"), 0)
		e := checkStatus(t, "Complete of a remembered key", err, codes.NotFound, idempotency.ReasonKeyExpired)
		if !errors.Is(err, idempotency.ErrKeyExpired) || !errors.Is(err, idempotency.ErrNotFound) ||
			!e.CompletedAt.Equal(marker.CompletedAt.Truncate(time.Second)) && !e.CompletedAt.Equal(marker.CompletedAt) ||
			!e.RememberedUntil.Equal(marker.RememberedUntil.Truncate(time.Second)) && !e.RememberedUntil.Equal(marker.RememberedUntil) {
			t.Errorf("KEY_EXPIRED: completed at %s remembered until %s (metadata %v); Get says %s and %s",
				e.CompletedAt, e.RememberedUntil, e.Metadata, marker.CompletedAt, marker.RememberedUntil)
		}
		err = c.Release(ctx, ns, "k", first.LeaseToken)
		checkStatus(t, "Release of a remembered key", err, codes.NotFound, idempotency.ReasonKeyExpired)
		_, err = c.ExtendLease(ctx, ns, "k", first.LeaseToken, 0)
		checkStatus(t, "ExtendLease of a remembered key", err, codes.NotFound, idempotency.ReasonKeyExpired)

		// Once, re-executed: the work runs with the next fencing token.
		result, err := c.Once(ctx, ns, "k", work, idempotency.WithFingerprint(fp), idempotency.WithLateRetry(idempotency.LateRetryReexecute))
		if err != nil || string(result.Value) != `"again"` || result.Replayed || !result.Claim.Reexecuted() ||
			result.Claim.FencingToken != 2 || !result.Claim.CompletedAt.Equal(marker.CompletedAt) || atomic.LoadInt32(&runs) != 1 {
			t.Fatalf("Once, re-executed: %+v %v, runs %d", result, err, runs)
		}
		replay, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{Fingerprint: fp, LateRetry: idempotency.LateRetryRefuse})
		if err != nil || replay.Outcome != idempotency.OutcomeCompleted || string(replay.Response) != `"again"` {
			t.Fatalf("the Claim after the re-execution: %+v %v", replay, err)
		}

		// The server's default policy (re-execute), with the calls.
		_, marker = remembered(t, c, ns, "default", nil)
		again, err := c.Claim(ctx, ns, "default", idempotency.ClaimOptions{})
		if err != nil || !again.Claimed() || !again.Reexecuted() || again.FencingToken != 2 || !again.CompletedAt.Equal(marker.CompletedAt) {
			t.Fatalf("a late retry under the server's default: %+v %v", again, err)
		}

		// Purge makes a remembered key claimable whatever the policy; the
		// fencing token continues.
		remembered(t, c, ns, "purged", nil)
		purged, err := c.Stub().Purge(ctx, &pb.PurgeRequest{Namespace: ns, Key: "purged", Reason: "go test"})
		if err != nil || !purged.GetPurged() || purged.GetPreviousState() != pb.State_STATE_ABSENT {
			t.Fatalf("Purge of a remembered key: %v %v", purged, err)
		}
		taken, err := c.Claim(ctx, ns, "purged", idempotency.ClaimOptions{LateRetry: idempotency.LateRetryRefuse})
		if err != nil || !taken.Claimed() || taken.FencingToken != 2 {
			t.Fatalf("a refusing Claim after Purge: %+v %v", taken, err)
		}
	})
}

func TestAServerThatRefusesLateRetriesByDefault(t *testing.T) {
	server := idempotencytest.Start(t, "IDEMPOTENCY_LATE_RETRY=refuse")
	c, ns, ctx := server.Client(t), namespace(t), ctx(t)
	_, marker := remembered(t, c, ns, "k", nil)
	refused, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{})
	if err != nil || refused.Outcome != idempotency.OutcomeExpired || refused.FencingToken != 1 || !refused.CompletedAt.Equal(marker.CompletedAt) {
		t.Fatalf("a late retry under IDEMPOTENCY_LATE_RETRY=refuse: %+v %v", refused, err)
	}
	// The caller's policy wins over the server's.
	again, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{LateRetry: idempotency.LateRetryReexecute})
	if err != nil || !again.Reexecuted() || again.FencingToken != 2 {
		t.Fatalf("re-execute asked of a refusing server: %+v %v", again, err)
	}
}

func TestARateLimitedCallCarriesItsRetryDelayAndTheRetryWaitsAtLeastThat(t *testing.T) {
	const token = "idem_go_test_rate_0123456789abcdef"
	sum := sha256.Sum256([]byte(token))
	policy := filepath.Join(t.TempDir(), "policy.toml")
	err := os.WriteFile(policy, []byte(`
[[identity]]
name = "go-rate"
token_hashes = ["sha256:`+hex.EncodeToString(sum[:])+`"]
namespaces = ["go-rate/*"]
rate_limit_per_second = 2
`), 0o644)
	if err != nil {
		t.Fatal(err)
	}
	server := idempotencytest.Start(t, "IDEMPOTENCY_POLICY_FILE="+policy)
	ctx := ctx(t)
	c, err := idempotency.Dial(server.Target, grpc.WithInsecure(), idempotency.BearerToken(token))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Logf = t.Logf

	// Without retries: the calls past the limit are RATE_LIMITED, with the
	// time until the limiter allows the next call (at most 1/2 s at 2 a second).
	c.Retry = idempotency.NoRetry
	var limited *idempotency.StatusError
	for i := 0; i < 10 && limited == nil; i++ {
		_, err := c.Get(ctx, "go-rate/a", "k")
		if err != nil {
			limited = statusError(t, "Get past the rate limit", err)
		}
	}
	if limited == nil {
		t.Fatal("10 Gets in a row were not rate limited at 2 a second")
	}
	if limited.Code() != codes.ResourceExhausted || limited.Reason != idempotency.ReasonRateLimited || !errors.Is(limited, idempotency.ErrResourceExhausted) ||
		limited.RetryDelay <= 0 || limited.RetryDelay > 500*time.Millisecond {
		t.Fatalf("rate limited: code %s reason %q retry delay %s", limited.Code(), limited.Reason, limited.RetryDelay)
	}

	// With retries: no retry comes sooner than the server said.
	c.Retry = idempotency.DefaultRetryPolicy
	var retries []idempotency.Retry
	c.OnRetry = func(r idempotency.Retry) { retries = append(retries, r) }
	for i := 0; i < 5; i++ {
		if _, err := c.Get(ctx, "go-rate/a", "k"); err != nil {
			t.Fatalf("Get %d with retries: %v", i, err)
		}
	}
	if len(retries) == 0 {
		t.Fatal("5 Gets in a row at 2 a second were never retried")
	}
	for _, r := range retries {
		var delay time.Duration
		for _, d := range status.Convert(r.Err).Details() {
			if info, ok := d.(*errdetails.RetryInfo); ok {
				delay = info.GetRetryDelay().AsDuration()
			}
		}
		if status.Code(r.Err) != codes.ResourceExhausted || delay <= 0 || r.Pause < delay {
			t.Errorf("%s: the pause is shorter than the server's delay %s", r, delay)
		}
	}
}
