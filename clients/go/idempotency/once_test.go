package idempotency_test

// Once and the calls against a real idempotency-service (embedded store in
// a temporary directory), started once for the package's tests
// (main_test.go).

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "idempotencyservice/gen/idempotencyv1"
	"idempotencyservice/idempotency"
	"idempotencyservice/idempotency/idempotencytest"
)

func TestClaimCompleteReplayWithTheCalls(t *testing.T) {
	c, ns, ctx := client(t), namespace(t), ctx(t)
	fp := idempotency.MustFingerprint(map[string]any{"order_id": "o-1"})

	claim, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{Fingerprint: fp, LeaseTTL: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if !claim.Claimed() || claim.FencingToken != 1 || len(claim.LeaseToken) != 32 || claim.LeaseExpiresAt.IsZero() {
		t.Fatalf("first Claim: %+v", claim)
	}
	if _, err := c.ExtendLease(ctx, ns, "k", claim.LeaseToken, 20*time.Second); err != nil {
		t.Fatal(err)
	}
	expires, err := c.Complete(ctx, ns, "k", claim.LeaseToken, []byte("done"), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Until(expires); d < 50*time.Minute || d > 61*time.Minute {
		t.Errorf("Complete: expires in %s, want about an hour", d)
	}

	replay, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{Fingerprint: fp})
	if err != nil {
		t.Fatal(err)
	}
	if replay.Outcome != idempotency.OutcomeCompleted || string(replay.Response) != "done" {
		t.Fatalf("second Claim: %+v", replay)
	}
	record, err := c.Get(ctx, ns, "k")
	if err != nil {
		t.Fatal(err)
	}
	if record.State != idempotency.StateCompleted || string(record.Response) != "done" || record.FencingToken != 1 || string(record.Fingerprint) != string(fp) {
		t.Fatalf("Get: %+v", record)
	}
	absent, err := c.Get(ctx, ns, "other")
	if err != nil || absent.State != idempotency.StateAbsent {
		t.Fatalf("Get of an unknown key: %+v, %v", absent, err)
	}
}

func TestOnceRunsTheWorkOnceThenReplays(t *testing.T) {
	c, ns, ctx := client(t), namespace(t), ctx(t)
	key := idempotency.MustDeriveKey("shop", "order-paid", "o-1")
	var runs int32
	work := func(ctx context.Context, lease idempotency.Lease) ([]byte, error) {
		atomic.AddInt32(&runs, 1)
		if lease.FencingToken != 1 || lease.Token == "" {
			return nil, fmt.Errorf("unexpected lease %+v", lease)
		}
		return []byte(`{"charge":"ch_1"}`), nil
	}

	first, err := c.Once(ctx, ns, key, work)
	if err != nil {
		t.Fatal(err)
	}
	second, err := c.Once(ctx, ns, key, work)
	if err != nil {
		t.Fatal(err)
	}
	if first.Replayed || !second.Replayed || string(first.Value) != `{"charge":"ch_1"}` || string(second.Value) != string(first.Value) {
		t.Fatalf("first %+v, second %+v", first, second)
	}
	if runs != 1 {
		t.Fatalf("the work ran %d times, want 1", runs)
	}
}

func TestOnceJSONStoresJSONAndDecodesTheReplay(t *testing.T) {
	c, ns, ctx := client(t), namespace(t), ctx(t)
	type charge struct {
		ID     string `json:"id"`
		Amount int    `json:"amount"`
		Note   string `json:"note"`
	}
	work := func(ctx context.Context, lease idempotency.Lease) (charge, error) {
		return charge{"ch_2", 1998, "<&>"}, nil
	}
	value, result, err := idempotency.OnceJSON(ctx, c, ns, "k", work)
	if err != nil || result.Replayed || value.ID != "ch_2" {
		t.Fatalf("%+v %+v %v", value, result, err)
	}
	if string(result.Value) != `{"id":"ch_2","amount":1998,"note":"<&>"}` {
		t.Errorf("stored %s", result.Value)
	}
	replayed, result, err := idempotency.OnceJSON(ctx, c, ns, "k", func(context.Context, idempotency.Lease) (charge, error) {
		t.Error("the work ran on a replay")
		return charge{}, nil
	})
	if err != nil || !result.Replayed || replayed != value {
		t.Fatalf("%+v %+v %v", replayed, result, err)
	}
}

func TestAnotherPayloadForTheSameKeyIsAMismatch(t *testing.T) {
	c, ns, ctx := client(t), namespace(t), ctx(t)
	order := map[string]any{"order_id": "o-3", "total_cents": 1998}
	altered := map[string]any{"order_id": "o-3", "total_cents": 1}
	ok := func(context.Context, idempotency.Lease) ([]byte, error) { return []byte("ok"), nil }
	if _, err := c.Once(ctx, ns, "k", ok, idempotency.WithFingerprint(idempotency.MustFingerprint(order))); err != nil {
		t.Fatal(err)
	}

	ran := false
	_, err := c.Once(ctx, ns, "k", func(context.Context, idempotency.Lease) ([]byte, error) {
		ran = true
		return nil, nil
	}, idempotency.WithFingerprint(idempotency.MustFingerprint(altered)))

	var mismatch *idempotency.FingerprintMismatch
	if !errors.As(err, &mismatch) || mismatch.Namespace != ns || mismatch.Key != "k" {
		t.Fatalf("got %v, want a *FingerprintMismatch", err)
	}
	if ran {
		t.Error("the work ran on a mismatch")
	}
	// The same payload is still a replay.
	if r, err := c.Once(ctx, ns, "k", ok, idempotency.WithFingerprint(idempotency.MustFingerprint(order))); err != nil || !r.Replayed {
		t.Fatalf("%+v %v", r, err)
	}
}

func TestALeaseHeldElsewhereIsInProgressOrWaitedFor(t *testing.T) {
	c, ns, ctx := client(t), namespace(t), ctx(t)
	held, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{LeaseTTL: 30 * time.Second})
	if err != nil || !held.Claimed() {
		t.Fatalf("%+v %v", held, err)
	}
	never := func(context.Context, idempotency.Lease) ([]byte, error) {
		t.Error("the work ran while another claimant held the lease")
		return nil, nil
	}

	// Failing at once.
	start := time.Now()
	_, err = c.Once(ctx, ns, "k", never, idempotency.FailOnInProgress())
	var inProgress *idempotency.InProgress
	if !errors.As(err, &inProgress) {
		t.Fatalf("got %v, want an *InProgress", err)
	}
	if inProgress.RetryAfter <= 20*time.Second || inProgress.RetryAfter > 30*time.Second || inProgress.Waited != 0 {
		t.Errorf("InProgress %+v: RetryAfter should be the other lease's remaining time (~30 s)", inProgress)
	}
	if !inProgress.LeaseExpiresAt.Equal(held.LeaseExpiresAt) {
		t.Errorf("LeaseExpiresAt %s, want the holder's %s", inProgress.LeaseExpiresAt, held.LeaseExpiresAt)
	}
	if time.Since(start) > 5*time.Second {
		t.Errorf("FailOnInProgress waited %s", time.Since(start))
	}

	// Waiting, and giving up.
	_, err = c.Once(ctx, ns, "k", never, idempotency.WaitOnInProgress(400*time.Millisecond))
	if !errors.As(err, &inProgress) || inProgress.Waited < 400*time.Millisecond {
		t.Fatalf("got %v, want an *InProgress after waiting 400ms", err)
	}

	// Waiting, and seeing the holder's result once it completes.
	done := make(chan *idempotency.Result, 1)
	failed := make(chan error, 1)
	go func() {
		r, err := c.Once(ctx, ns, "k", never, idempotency.WaitOnInProgress(20*time.Second))
		if err != nil {
			failed <- err
			return
		}
		done <- r
	}()
	if _, err := c.Complete(ctx, ns, "k", held.LeaseToken, []byte("by the holder"), 0); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-done:
		if !r.Replayed || string(r.Value) != "by the holder" {
			t.Fatalf("%+v", r)
		}
	case err := <-failed:
		t.Fatal(err)
	case <-ctx.Done():
		t.Fatal("Once did not return")
	}
}

func TestAFailedAttemptIsReleasedAndTheRetrySucceeds(t *testing.T) {
	c, ns, ctx := client(t), namespace(t), ctx(t)
	boom := errors.New("boom")
	_, err := c.Once(ctx, ns, "k", func(context.Context, idempotency.Lease) ([]byte, error) { return nil, boom })
	if !errors.Is(err, boom) {
		t.Fatalf("got %v, want the work's error", err)
	}
	record, err := c.Get(ctx, ns, "k")
	if err != nil || record.State != idempotency.StateReleased {
		t.Fatalf("after a failure: %+v %v, want RELEASED", record, err)
	}

	r, err := c.Once(ctx, ns, "k", func(ctx context.Context, lease idempotency.Lease) ([]byte, error) {
		if lease.FencingToken != 2 {
			return nil, fmt.Errorf("fencing token %d, want 2", lease.FencingToken)
		}
		return []byte("second time"), nil
	})
	if err != nil || r.Replayed || string(r.Value) != "second time" {
		t.Fatalf("%+v %v", r, err)
	}
	if r, err := c.Once(ctx, ns, "k", nil); err != nil || !r.Replayed || string(r.Value) != "second time" {
		t.Fatalf("%+v %v", r, err)
	}
}

func TestAPanickingAttemptIsReleased(t *testing.T) {
	c, ns, ctx := client(t), namespace(t), ctx(t)
	func() {
		defer func() {
			if recover() != "kaboom" {
				t.Error("the panic did not go on")
			}
		}()
		_, _ = c.Once(ctx, ns, "k", func(context.Context, idempotency.Lease) ([]byte, error) { panic("kaboom") })
	}()
	record, err := c.Get(ctx, ns, "k")
	if err != nil || record.State != idempotency.StateReleased {
		t.Fatalf("after a panic: %+v %v, want RELEASED", record, err)
	}
}

func TestTheHeartbeatKeepsTheLeasePastItsTTL(t *testing.T) {
	c, ns, ctx := client(t), namespace(t), ctx(t)
	other := client(t)
	// A heartbeat every 300 ms keeps a 2 s lease with room for a slow call
	// on a busy machine.
	const ttl = 2 * time.Second
	var seen *idempotency.ClaimResult
	r, err := c.Once(ctx, ns, "k", func(ctx context.Context, lease idempotency.Lease) ([]byte, error) {
		// Work for 2 leases; at 1.5 leases another claimant must still find it in progress.
		start := time.Now()
		time.Sleep(ttl * 3 / 2)
		claim, err := other.Claim(ctx, ns, "k", idempotency.ClaimOptions{})
		if err != nil {
			return nil, err
		}
		seen = claim
		time.Sleep(ttl*2 - time.Since(start))
		return []byte("long work"), ctx.Err()
	}, idempotency.WithLeaseTTL(ttl), idempotency.WithHeartbeatInterval(300*time.Millisecond))
	if err != nil || r.Replayed || string(r.Value) != "long work" {
		t.Fatalf("%+v %v", r, err)
	}
	if seen.Outcome != idempotency.OutcomeInProgress {
		t.Fatalf("another Claim past the TTL: %s, want IN_PROGRESS (the heartbeat keeps the lease)", seen.Outcome)
	}
	record, err := c.Get(ctx, ns, "k")
	if err != nil || record.State != idempotency.StateCompleted || record.FencingToken != 1 {
		t.Fatalf("%+v %v", record, err)
	}
}

func TestALostLeaseCancelsTheWorkAndNothingIsStored(t *testing.T) {
	c, ns, ctx := client(t), namespace(t), ctx(t)
	cancelled := false
	_, err := c.Once(ctx, ns, "k", func(work context.Context, lease idempotency.Lease) ([]byte, error) {
		// An operator purges the key: the lease is revoked, the next ExtendLease says NOT_FOUND.
		if _, err := c.Stub().Purge(ctx, &pb.PurgeRequest{Namespace: ns, Key: "k", Reason: "go test"}); err != nil {
			return nil, err
		}
		select {
		case <-work.Done():
			cancelled = true
			return nil, work.Err()
		case <-time.After(10 * time.Second):
			return []byte("not cancelled"), nil
		}
	}, idempotency.WithLeaseTTL(5*time.Second), idempotency.WithHeartbeatInterval(100*time.Millisecond))

	if !cancelled {
		t.Error("the work's context was not cancelled when the lease was lost")
	}
	var lost *idempotency.LeaseLostError
	if !errors.Is(err, idempotency.ErrLeaseLost) || !errors.As(err, &lost) || !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("got %v, want a *LeaseLostError caused by NOT_FOUND", err)
	}
	record, err := c.Get(ctx, ns, "k")
	if err != nil || record.State != idempotency.StateAbsent {
		t.Fatalf("%+v %v, want ABSENT", record, err)
	}
}

func TestCompleteIsRefusedWhenTheLeaseRanOutAndWasTaken(t *testing.T) {
	c, ns, ctx := client(t), namespace(t), ctx(t)
	other := client(t)
	var taken *idempotency.ClaimResult
	_, err := c.Once(ctx, ns, "k", func(work context.Context, lease idempotency.Lease) ([]byte, error) {
		// No heartbeat: once the 1 s lease runs out another claimant takes the key.
		deadline := time.Now().Add(15 * time.Second)
		for time.Now().Before(deadline) {
			claim, err := other.Claim(ctx, ns, "k", idempotency.ClaimOptions{LeaseTTL: 30 * time.Second})
			if err != nil {
				return nil, err
			}
			if claim.Claimed() {
				taken = claim
				return []byte("too late"), nil
			}
			time.Sleep(50 * time.Millisecond)
		}
		return nil, errors.New("the lease never ran out")
	}, idempotency.WithLeaseTTL(time.Second), idempotency.WithoutHeartbeat())

	if taken == nil || taken.FencingToken != 2 {
		t.Fatalf("the other claimant's Claim: %+v", taken)
	}
	var lost *idempotency.LeaseLostError
	if !errors.As(err, &lost) || !errors.Is(err, idempotency.ErrLeaseNotCurrent) || lost.When != "before Complete" {
		t.Fatalf("got %v, want a *LeaseLostError caused by FAILED_PRECONDITION at Complete", err)
	}
	record, err := c.Get(ctx, ns, "k")
	if err != nil || record.State != idempotency.StateInProgress || record.FencingToken != 2 || len(record.Response) != 0 {
		t.Fatalf("%+v %v: want the other claimant's lease, no stored result", record, err)
	}
}

func TestFailedCallsAreTypedErrors(t *testing.T) {
	c, ns, ctx := client(t), namespace(t), ctx(t)

	_, err := c.Claim(ctx, ns, "", idempotency.ClaimOptions{})
	if !errors.Is(err, idempotency.ErrInvalidArgument) || status.Code(err) != codes.InvalidArgument {
		t.Errorf("Claim with no key: %v", err)
	}
	_, err = c.Complete(ctx, ns, "nobody", "0123456789abcdef0123456789abcdef", nil, 0)
	if !errors.Is(err, idempotency.ErrNotFound) {
		t.Errorf("Complete of an unknown key: %v", err)
	}
	claim, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{})
	if err != nil {
		t.Fatal(err)
	}
	err = c.Release(ctx, ns, "k", "0123456789abcdef0123456789abcdef")
	var statusErr *idempotency.StatusError
	if !errors.Is(err, idempotency.ErrLeaseNotCurrent) || !errors.As(err, &statusErr) || statusErr.Method != "Release" || statusErr.Code() != codes.FailedPrecondition {
		t.Errorf("Release with another token: %v", err)
	}
	if err := c.Release(ctx, ns, "k", claim.LeaseToken); err != nil {
		t.Error(err)
	}

	port, err := idempotencytest.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	down, err := idempotency.Dial(fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatal(err)
	}
	defer down.Close()
	short, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	_, err = down.Once(short, ns, "k", func(context.Context, idempotency.Lease) ([]byte, error) { return nil, nil })
	if !errors.Is(err, idempotency.ErrUnavailable) {
		t.Errorf("a server that is down: %v, want ErrUnavailable", err)
	}
}

func TestConcurrentCallersRunTheWorkOnceAndTheOthersWaitForItsResult(t *testing.T) {
	c, ns, ctx := client(t), namespace(t), ctx(t)
	var runs int32
	results := make(chan *idempotency.Result, 5)
	errs := make(chan error, 5)
	for i := 0; i < 5; i++ {
		go func(i int) {
			r, err := c.Once(ctx, ns, "k", func(context.Context, idempotency.Lease) ([]byte, error) {
				atomic.AddInt32(&runs, 1)
				time.Sleep(300 * time.Millisecond) // long enough for the others to find it in progress
				return []byte(fmt.Sprintf("by caller %d", i)), nil
			}, idempotency.WaitOnInProgress(20*time.Second))
			if err != nil {
				errs <- err
				return
			}
			results <- r
		}(i)
	}
	var values []string
	fresh := 0
	for i := 0; i < 5; i++ {
		select {
		case r := <-results:
			values = append(values, string(r.Value))
			if !r.Replayed {
				fresh++
			}
		case err := <-errs:
			t.Fatal(err)
		}
	}
	if runs != 1 || fresh != 1 {
		t.Fatalf("the work ran %d times (%d results not replayed), want once", runs, fresh)
	}
	for _, v := range values {
		if v != values[0] {
			t.Fatalf("results differ: %q", values)
		}
	}
}
