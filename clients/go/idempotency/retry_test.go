package idempotency_test

// Retries, and the Claim whose answer is lost: the Claim reached the server,
// which gave the lease, and the caller saw UNAVAILABLE instead of the answer.
// The client's retry sends the same lease token and gets the same lease back
// at once (Retried), instead of OUTCOME_IN_PROGRESS against itself until the
// lease runs out. The same for every other call a retry repeats.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "idempotencyservice/gen/idempotencyv1"
	"idempotencyservice/idempotency"
	"idempotencyservice/idempotency/idempotencytest"
)

// sameLease checks that retried repeats the lease of the lost answer.
func sameLease(t *testing.T, retried *idempotency.ClaimResult, lost *pb.ClaimResponse) {
	t.Helper()
	if retried.Outcome != idempotency.OutcomeClaimed || !retried.Retried {
		t.Fatalf("the retried Claim: %+v, want CLAIMED with Retried", retried)
	}
	if retried.LeaseToken != lost.GetLeaseToken() || retried.FencingToken != lost.GetFencingToken() ||
		!retried.LeaseExpiresAt.Equal(lost.GetLeaseExpiresAt().AsTime()) || !retried.ExpiresAt.Equal(lost.GetExpiresAt().AsTime()) {
		t.Fatalf("the retried Claim %+v is not the lease of the lost answer %v", retried, lost)
	}
	if lost.GetRetried() {
		t.Fatalf("the lost answer says retried: %v", lost)
	}
}

func TestAClaimWhoseAnswerWasLostIsRetriedAndGetsTheSameLease(t *testing.T) {
	onEachStore(t, func(t *testing.T, server *idempotencytest.Server) {
		rec := newRecorder()
		rec.drop["Claim"] = 1
		c, ns, ctx := dial(t, []string{server.Target}, rec), namespace(t), ctx(t)

		claim, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{LeaseTTL: 30 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		if n := rec.count("Claim"); n != 2 {
			t.Fatalf("%d Claim attempts, want 2 (the lost one and its retry)", n)
		}
		sameLease(t, claim, rec.dropped[0].(*pb.ClaimResponse))
		attempts := rec.of("Claim")
		first, second := attempts[0].request.(*pb.ClaimRequest), attempts[1].request.(*pb.ClaimRequest)
		if len(first.LeaseToken) != 32 || first.LeaseToken != strings.ToLower(first.LeaseToken) || second.LeaseToken != first.LeaseToken {
			t.Fatalf("lease tokens sent %q then %q: want one 32-hex token, the same on the retry", first.LeaseToken, second.LeaseToken)
		}
		if claim.FencingToken != 1 {
			t.Fatalf("fencing token %d, want 1", claim.FencingToken)
		}
		if _, err := c.Complete(ctx, ns, "k", claim.LeaseToken, []byte("done"), 0); err != nil {
			t.Fatal(err)
		}
		if record, err := c.Get(ctx, ns, "k"); err != nil || record.State != idempotency.StateCompleted {
			t.Fatalf("%+v %v", record, err)
		}
	})
}

func TestOnceRidesOverALostClaimAnswerAndRunsTheWorkOnce(t *testing.T) {
	onEachStore(t, func(t *testing.T, server *idempotencytest.Server) {
		rec := newRecorder()
		rec.drop["Claim"] = 1
		c, ns, ctx := dial(t, []string{server.Target}, rec), namespace(t), ctx(t)
		var runs int32
		work := func(context.Context, idempotency.Lease) ([]byte, error) {
			atomic.AddInt32(&runs, 1)
			return []byte(`"ok"`), nil
		}
		first, err := c.Once(ctx, ns, "k", work)
		if err != nil {
			t.Fatal(err)
		}
		if first.Replayed || string(first.Value) != `"ok"` || !first.Claim.Retried || first.Claim.FencingToken != 1 {
			t.Fatalf("%+v (claim %+v): want the work's result under the retried Claim's lease", first, first.Claim)
		}
		again, err := c.Once(ctx, ns, "k", work)
		if err != nil || !again.Replayed || string(again.Value) != `"ok"` {
			t.Fatalf("%+v %v", again, err)
		}
		if runs != 1 {
			t.Fatalf("the work ran %d times, want 1", runs)
		}
	})
}

func TestALostAnswerOfCompleteReleaseOrExtendLeaseIsRetriedToOK(t *testing.T) {
	for _, method := range []string{"Complete", "Release", "ExtendLease"} {
		t.Run(method, func(t *testing.T) {
			rec := newRecorder()
			rec.drop[method] = 1
			c, ns, ctx := dial(t, []string{sqlite(t).Target}, rec), namespace(t), ctx(t)
			claim, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{})
			if err != nil {
				t.Fatal(err)
			}
			want := idempotency.StateInProgress
			switch method {
			case "Complete":
				_, err = c.Complete(ctx, ns, "k", claim.LeaseToken, []byte("r"), 0)
				want = idempotency.StateCompleted
			case "Release":
				err = c.Release(ctx, ns, "k", claim.LeaseToken)
				want = idempotency.StateReleased
			default:
				_, err = c.ExtendLease(ctx, ns, "k", claim.LeaseToken, time.Minute)
			}
			if err != nil {
				t.Fatal(err)
			}
			if n := rec.count(method); n != 2 || len(rec.dropped) != 1 {
				t.Fatalf("%d attempts, %d dropped: want 2 and 1", n, len(rec.dropped))
			}
			if record, err := c.Get(ctx, ns, "k"); err != nil || record.State != want {
				t.Fatalf("%+v %v, want %s", record, err, want)
			}
		})
	}
}

func TestTheDroppedAnswerReachedTheServer(t *testing.T) {
	// The recorder's premise: the first Claim did take the lease.
	rec := newRecorder()
	rec.drop["Claim"] = 1
	c, ns, ctx := dial(t, []string{sqlite(t).Target}, rec), namespace(t), ctx(t)
	c.Retry = idempotency.NoRetry
	_, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{})
	var statusErr *idempotency.StatusError
	if !errors.Is(err, idempotency.ErrUnavailable) || !errors.As(err, &statusErr) || statusErr.Attempts != 1 {
		t.Fatalf("got %v, want UNAVAILABLE after one attempt", err)
	}
	record, err := c.Get(ctx, ns, "k")
	if err != nil || record.State != idempotency.StateInProgress || record.FencingToken != 1 {
		t.Fatalf("%+v %v", record, err)
	}
}

func TestAClaimRepeatingTheHoldersTokenGetsTheSameLeaseAndOthersDoNot(t *testing.T) {
	onEachStore(t, func(t *testing.T, server *idempotencytest.Server) {
		c, ns, ctx := server.Client(t), namespace(t), ctx(t)
		token := idempotency.NewLeaseToken()
		first, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{LeaseToken: token})
		if err != nil || !first.Claimed() || first.LeaseToken != token || first.Retried {
			t.Fatalf("%+v %v", first, err)
		}
		again, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{LeaseToken: token})
		if err != nil || !again.Retried || again.LeaseToken != token || again.FencingToken != first.FencingToken ||
			!again.LeaseExpiresAt.Equal(first.LeaseExpiresAt) || !again.ExpiresAt.Equal(first.ExpiresAt) {
			t.Fatalf("the repeated Claim: %+v %v, want the same lease as %+v", again, err, first)
		}
		other, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{})
		if err != nil || other.Outcome != idempotency.OutcomeInProgress || other.LeaseToken != "" {
			t.Fatalf("another Claim: %+v %v", other, err)
		}
	})
}

func TestEveryClaimSendsANewTokenAndAMalformedOneIsRefused(t *testing.T) {
	seen := map[string]bool{}
	for i := 0; i < 100; i++ {
		token := idempotency.NewLeaseToken()
		if len(token) != 32 || strings.Trim(token, "0123456789abcdef") != "" || seen[token] {
			t.Fatalf("token %q: want 32 lowercase hex characters, new each time", token)
		}
		seen[token] = true
	}
	rec := newRecorder()
	c, ns, ctx := dial(t, []string{sqlite(t).Target}, rec), namespace(t), ctx(t)
	a, errA := c.Claim(ctx, ns, "a", idempotency.ClaimOptions{})
	b, errB := c.Claim(ctx, ns, "b", idempotency.ClaimOptions{})
	if errA != nil || errB != nil || a.LeaseToken == b.LeaseToken {
		t.Fatalf("%+v %+v %v %v", a, b, errA, errB)
	}
	claims := rec.of("Claim")
	if claims[0].request.(*pb.ClaimRequest).LeaseToken != a.LeaseToken || claims[1].request.(*pb.ClaimRequest).LeaseToken != b.LeaseToken {
		t.Fatal("the lease tokens won are not the ones the client sent")
	}
	_, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{LeaseToken: "not-hex"})
	if !errors.Is(err, idempotency.ErrInvalidArgument) || !strings.Contains(err.Error(), "lease_token") {
		t.Fatalf("got %v, want INVALID_ARGUMENT naming lease_token", err)
	}
	if n := rec.count("Claim", codes.InvalidArgument); n != 1 {
		t.Fatalf("INVALID_ARGUMENT was attempted %d times, want once (never retried)", n)
	}
}

func TestCallsToAServerThatIsDownAreRetriedUntilTheDeadline(t *testing.T) {
	port, err := idempotencytest.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	c := dial(t, []string{fmt.Sprintf("127.0.0.1:%d", port)}, rec)
	var mu sync.Mutex
	var retries []idempotency.Retry
	c.OnRetry = func(r idempotency.Retry) {
		mu.Lock()
		retries = append(retries, r)
		mu.Unlock()
	}
	short, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_, err = c.Claim(short, namespace(t), "k", idempotency.ClaimOptions{})
	var statusErr *idempotency.StatusError
	if !errors.Is(err, idempotency.ErrUnavailable) || !errors.As(err, &statusErr) {
		t.Fatalf("got %v, want UNAVAILABLE", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if statusErr.Attempts < 2 || statusErr.Attempts != rec.count("Claim") || len(retries) != statusErr.Attempts-1 {
		t.Fatalf("%d attempts reported, %d made, %d retries told: want several, all the same count", statusErr.Attempts, rec.count("Claim"), len(retries))
	}
	if !strings.Contains(err.Error(), fmt.Sprintf("(after %d attempts)", statusErr.Attempts)) {
		t.Errorf("the message %q does not say how many attempts", err)
	}
	if r := retries[0]; r.Method != "Claim" || r.Attempt != 1 || r.Target != fmt.Sprintf("127.0.0.1:%d", port) || status.Code(r.Err) != codes.Unavailable {
		t.Errorf("the first retry: %+v", r)
	}

	// Without retries: one attempt.
	c.Retry = idempotency.NoRetry
	_, err = c.Get(context.Background(), "ns", "k")
	if !errors.As(err, &statusErr) || statusErr.Attempts != 1 || rec.count("Get") != 1 {
		t.Fatalf("got %v after %d attempts, want one", err, rec.count("Get"))
	}
}

func TestAnAttemptThatHangsIsCutAtThePerAttemptTimeoutAndRetried(t *testing.T) {
	// A listener that accepts connections and never answers.
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer listener.Close()
	go func() {
		for {
			conn, err := listener.Accept()
			if err != nil {
				return
			}
			defer conn.Close()
		}
	}()
	rec := newRecorder()
	c := dial(t, []string{listener.Addr().String()}, rec)
	c.Retry.PerAttemptTimeout = 200 * time.Millisecond
	short, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	_, err = c.Get(short, "ns", "k")
	if !errors.Is(err, idempotency.ErrUnavailable) || rec.count("Get", codes.DeadlineExceeded) < 2 {
		t.Fatalf("got %v after %d attempts cut by their deadline, want several", err, rec.count("Get", codes.DeadlineExceeded))
	}
}

func TestBackoffIsCappedExponentialWithFullJitter(t *testing.T) {
	p := idempotency.DefaultRetryPolicy
	want := []time.Duration{50, 100, 200, 400, 800, 1600, 2000, 2000}
	for i, w := range want {
		if got := p.BackoffCap(i + 1); got != w*time.Millisecond {
			t.Errorf("BackoffCap(%d) = %s, want %s", i+1, got, w*time.Millisecond)
		}
	}
	if got := p.BackoffCap(1000); got != 2*time.Second {
		t.Errorf("BackoffCap(1000) = %s", got)
	}
	low, high := false, false
	for i := 0; i < 2000; i++ {
		pause := p.Backoff(3)
		if pause < 0 || pause > 200*time.Millisecond {
			t.Fatalf("Backoff(3) = %s, outside [0, 200ms]", pause)
		}
		low = low || pause < 50*time.Millisecond
		high = high || pause > 150*time.Millisecond
	}
	if !low || !high {
		t.Error("2000 pauses did not spread over [0, 200ms]")
	}
}

func TestSplitTargets(t *testing.T) {
	got := idempotency.SplitTargets(" 10.0.0.1:50051, 10.0.0.2:50051 ,,dns:///idempotency.internal:50051")
	want := []string{"10.0.0.1:50051", "10.0.0.2:50051", "dns:///idempotency.internal:50051"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("%q, want %q", got, want)
	}
	if _, err := idempotency.Dial(" , "); err == nil {
		t.Fatal("Dial with no address: no error")
	}
	c, err := idempotency.Dial("127.0.0.1:1,127.0.0.1:2")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if fmt.Sprint(c.Targets()) != "[127.0.0.1:1 127.0.0.1:2]" {
		t.Fatalf("Targets %q", c.Targets())
	}
}
