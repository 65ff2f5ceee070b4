package idempotency_test

// Waiting (issue 23): Once meets a holder and waits for it on the server
// (ClaimRequest.wait) instead of polling: it gets the holder's result, or
// the lease when the holder gives the key up. Against a server that predates
// waiting (here: a relay that clears ClaimRequest.wait) it falls back to
// polling and still gets the result.
//
// The tests of the real server need one that implements waiting.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "idempotencyservice/gen/idempotencyv1"
	"idempotencyservice/idempotency"
	"idempotencyservice/idempotency/idempotencytest"
)

// requireWaiting fails the test unless the server honours ClaimRequest.wait.
func requireWaiting(t *testing.T, c *idempotency.Client) {
	t.Helper()
	ns, ctx := namespace(t), ctx(t)
	if _, err := c.Claim(ctx, ns, "probe", idempotency.ClaimOptions{}); err != nil {
		t.Fatal(err)
	}
	probe, err := c.Claim(ctx, ns, "probe", idempotency.ClaimOptions{Wait: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if !probe.WaitHonored {
		t.Fatalf("the server at %s does not wait (ClaimResponse.waited unset): run these tests against one that implements ClaimRequest.wait (IDEMPOTENCY_BIN)", idempotencytest.Binary())
	}
}

// holderWork is the work of concurrent Once callers of one key: the first to
// run it (the holder) waits until ready() holds (the other callers have
// claimed), works for 200 ms, and returns first's answer; any later run
// returns later's.
type holderWork struct {
	runs  int32
	ready func() bool
	first func(ctx context.Context, lease idempotency.Lease, i int) ([]byte, error)
	later func(ctx context.Context, lease idempotency.Lease, i int) ([]byte, error)
}

func (h *holderWork) fn(i int) func(context.Context, idempotency.Lease) ([]byte, error) {
	return func(ctx context.Context, lease idempotency.Lease) ([]byte, error) {
		if atomic.AddInt32(&h.runs, 1) > 1 {
			return h.later(ctx, lease, i)
		}
		deadline := time.Now().Add(20 * time.Second)
		for !h.ready() {
			if time.Now().After(deadline) {
				return nil, errors.New("the other callers did not all claim")
			}
			time.Sleep(5 * time.Millisecond)
		}
		time.Sleep(200 * time.Millisecond) // the work
		return h.first(ctx, lease, i)
	}
}

// onceTogether calls Once on one key from n goroutines at once.
func onceTogether(ctx context.Context, c *idempotency.Client, ns string, n int, fn func(i int) func(context.Context, idempotency.Lease) ([]byte, error), opts ...idempotency.Option) ([]*idempotency.Result, []error) {
	results, errs := make([]*idempotency.Result, n), make([]error, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			<-start
			results[i], errs[i] = c.Once(ctx, ns, "k", fn(i), opts...)
		}(i)
	}
	close(start)
	wg.Wait()
	return results, errs
}

func byCaller(_ context.Context, _ idempotency.Lease, i int) ([]byte, error) {
	return []byte(fmt.Sprintf(`"by caller %d"`, i)), nil
}

func again(_ context.Context, _ idempotency.Lease, i int) ([]byte, error) {
	return nil, fmt.Errorf("caller %d ran the work again", i)
}

func never(context.Context, idempotency.Lease) ([]byte, error) {
	return nil, errors.New("the work ran while another claimant held the lease")
}

// claimsSent checks that every Claim asked to wait (or none did), and returns how many there were.
func claimsSent(t *testing.T, rec *recorder, waiting bool) int {
	t.Helper()
	claims := rec.of("Claim")
	for _, a := range claims {
		if wait := a.request.(*pb.ClaimRequest).GetWait(); (wait.AsDuration() > 0) != waiting {
			t.Fatalf("a Claim was sent with wait %v, want waiting %v", wait, waiting)
		}
	}
	return len(claims)
}

func TestOnceWaitsForTheHolderAndEveryCallerGetsItsResultWithOneClaim(t *testing.T) {
	onEachStore(t, func(t *testing.T, server *idempotencytest.Server) {
		const n = 16
		requireWaiting(t, server.Client(t))
		rec := newRecorder()
		c, ns, ctx := dial(t, []string{server.Target}, rec), namespace(t), ctx(t)
		work := &holderWork{
			ready: func() bool { return rec.sentCount("Claim") >= n },
			first: byCaller,
			later: again,
		}
		results, errs := onceTogether(ctx, c, ns, n, work.fn, idempotency.WaitOnInProgress(20*time.Second))
		fresh := 0
		for i := range results {
			if errs[i] != nil {
				t.Fatalf("caller %d: %v", i, errs[i])
			}
			if string(results[i].Value) != string(results[0].Value) {
				t.Fatalf("caller %d got %s, caller 0 %s", i, results[i].Value, results[0].Value)
			}
			if !results[i].Replayed {
				fresh++
			} else if !results[i].Claim.WaitHonored {
				t.Fatalf("caller %d: the server did not say it waited: %+v", i, results[i].Claim)
			}
		}
		if work.runs != 1 || fresh != 1 {
			t.Fatalf("the work ran %d times (%d results not replayed), want once", work.runs, fresh)
		}
		// Waiting, not polling: one Claim per caller.
		if claims := claimsSent(t, rec, true); claims != n {
			t.Fatalf("%d Claims for %d callers, want one each", claims, n)
		}
		var longest time.Duration
		for _, r := range results {
			if r.Claim.Waited > longest {
				longest = r.Claim.Waited
			}
		}
		t.Logf("%d callers, %d Claims, the work ran once; the longest wait the server reported: %s", n, n, longest)
	})
}

func TestOnceWaitingOnAHolderThatFailsTakesTheLeaseWithItsCheckpoint(t *testing.T) {
	onEachStore(t, func(t *testing.T, server *idempotencytest.Server) {
		const n = 8
		requireWaiting(t, server.Client(t))
		rec := newRecorder()
		c, ns, ctx := dial(t, []string{server.Target}, rec), namespace(t), ctx(t)
		var handed []string
		var mu sync.Mutex
		hand := func(lease idempotency.Lease) {
			mu.Lock()
			handed = append(handed, fmt.Sprintf("%s@%d/%d", lease.Checkpoint(), lease.CheckpointFencingToken(), lease.FencingToken))
			mu.Unlock()
		}
		work := &holderWork{
			ready: func() bool { return rec.sentCount("Claim") >= n },
			first: func(ctx context.Context, lease idempotency.Lease, i int) ([]byte, error) {
				hand(lease)
				if err := lease.SaveCheckpoint(ctx, []byte("half")); err != nil {
					return nil, err
				}
				return nil, errors.New("the holder failed")
			},
			later: func(ctx context.Context, lease idempotency.Lease, i int) ([]byte, error) {
				hand(lease)
				return byCaller(ctx, lease, i)
			},
		}
		results, errs := onceTogether(ctx, c, ns, n, work.fn, idempotency.WaitOnInProgress(20*time.Second))
		failed, fresh, value := 0, 0, ""
		for i := range results {
			if errs[i] != nil {
				if errs[i].Error() != "the holder failed" {
					t.Fatalf("caller %d: %v", i, errs[i])
				}
				failed++
				continue
			}
			if value == "" {
				value = string(results[i].Value)
			}
			if string(results[i].Value) != value {
				t.Fatalf("caller %d got %s, another %s", i, results[i].Value, value)
			}
			if !results[i].Replayed {
				fresh++
			}
		}
		if failed != 1 || fresh != 1 || work.runs != 2 {
			t.Fatalf("%d failed, %d ran the work afresh, %d runs: want the holder failing and one waiter taking over", failed, fresh, work.runs)
		}
		if fmt.Sprint(handed) != "[@0/1 half@1/2]" {
			t.Fatalf("the runs were handed %v, want no checkpoint, then the failed holder's", handed)
		}
		if claims := claimsSent(t, rec, true); claims != n {
			t.Fatalf("%d Claims for %d callers, want one each", claims, n)
		}
	})
}

func TestAClaimCanWaitForTheHolder(t *testing.T) {
	rec := newRecorder()
	c, ns, ctx := dial(t, []string{sqlite(t).Target}, rec), namespace(t), ctx(t)
	requireWaiting(t, c)
	held, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{})
	if err != nil || !held.Claimed() || held.WaitHonored {
		t.Fatalf("%+v %v", held, err)
	}

	// The wait runs out.
	timedOut, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{Wait: 300 * time.Millisecond})
	if err != nil || timedOut.Outcome != idempotency.OutcomeInProgress || !timedOut.WaitHonored || timedOut.Waited <= 0 || timedOut.RetryAfter <= 0 {
		t.Fatalf("%+v %v: want IN_PROGRESS after waiting", timedOut, err)
	}

	// The holder completes while a Claim waits.
	answer := make(chan *idempotency.ClaimResult, 1)
	failed := make(chan error, 1)
	sent := rec.sentCount("Claim")
	go func() {
		r, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{Wait: 20 * time.Second})
		if err != nil {
			failed <- err
			return
		}
		answer <- r
	}()
	until(t, 10*time.Second, "the waiting Claim to be sent", func() bool { return rec.sentCount("Claim") > sent })
	if _, err := c.Complete(ctx, ns, "k", held.LeaseToken, []byte("by the holder"), 0); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-answer:
		if r.Outcome != idempotency.OutcomeCompleted || string(r.Response) != "by the holder" || !r.WaitHonored {
			t.Fatalf("%+v: want the holder's result", r)
		}
	case err := <-failed:
		t.Fatal(err)
	case <-ctx.Done():
		t.Fatal("the waiting Claim did not return")
	}
}

func TestFailOnInProgressDoesNotAskToWait(t *testing.T) {
	rec := newRecorder()
	c, ns, ctx := dial(t, []string{sqlite(t).Target}, rec), namespace(t), ctx(t)
	if _, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{}); err != nil {
		t.Fatal(err)
	}
	_, err := c.Once(ctx, ns, "k", func(context.Context, idempotency.Lease) ([]byte, error) { return nil, nil }, idempotency.FailOnInProgress())
	var inProgress *idempotency.InProgress
	if !errors.As(err, &inProgress) || inProgress.Waited != 0 {
		t.Fatalf("got %v, want an *InProgress at once", err)
	}
	if claims := claimsSent(t, rec, false); claims != 2 {
		t.Fatalf("%d Claims, want 2", claims)
	}
}

func TestOnceFallsBackToPollingWhenTheServerIgnoresWait(t *testing.T) {
	onEachStore(t, func(t *testing.T, server *idempotencytest.Server) {
		const n = 8
		rec := newRecorder()
		c, ns, ctx := dial(t, []string{startRelay(t, server.Target)}, rec), namespace(t), ctx(t)
		inProgressAnswers := func() int {
			count := 0
			for _, a := range rec.of("Claim") {
				if a.reply != nil && a.reply.(*pb.ClaimResponse).GetOutcome() == pb.Outcome_OUTCOME_IN_PROGRESS {
					count++
				}
			}
			return count
		}
		work := &holderWork{
			// Every other caller has been answered IN_PROGRESS, at once.
			ready: func() bool { return inProgressAnswers() >= n-1 },
			first: byCaller,
			later: again,
		}
		results, errs := onceTogether(ctx, c, ns, n, work.fn, idempotency.WaitOnInProgress(20*time.Second))
		fresh := 0
		for i := range results {
			if errs[i] != nil {
				t.Fatalf("caller %d: %v", i, errs[i])
			}
			if string(results[i].Value) != string(results[0].Value) {
				t.Fatalf("caller %d got %s, caller 0 %s", i, results[i].Value, results[0].Value)
			}
			if !results[i].Replayed {
				fresh++
			} else if results[i].Claim.WaitHonored {
				t.Fatalf("caller %d: waited set through a relay that clears wait: %+v", i, results[i].Claim)
			}
		}
		if work.runs != 1 || fresh != 1 {
			t.Fatalf("the work ran %d times (%d results not replayed), want once", work.runs, fresh)
		}
		// Polling: the callers that met the holder claimed again.
		claims := claimsSent(t, rec, true)
		if claims <= n {
			t.Fatalf("%d Claims for %d callers: nobody polled", claims, n)
		}
		t.Logf("through the relay: %d callers, %d Claims (polling), the work ran once", n, claims)

		// A wait that runs out says it polled.
		if _, err := c.Claim(ctx, ns, "held", idempotency.ClaimOptions{}); err != nil {
			t.Fatal(err)
		}
		_, err := c.Once(ctx, ns, "held", never, idempotency.WaitOnInProgress(300*time.Millisecond))
		var inProgress *idempotency.InProgress
		if !errors.As(err, &inProgress) || !inProgress.Polled || inProgress.Waited <= 0 {
			t.Fatalf("got %v, want an *InProgress after polling", err)
		}
	})
}

func TestAWaitEndsBeforeTheContextsDeadlineWithInProgress(t *testing.T) {
	for name, relayed := range map[string]bool{"the server waits": false, "through the relay": true} {
		t.Run(name, func(t *testing.T) {
			c, ns := client(t), namespace(t)
			if relayed {
				c = dial(t, []string{startRelay(t, sqlite(t).Target)}, nil)
			} else {
				requireWaiting(t, c)
			}
			if _, err := c.Claim(ctx(t), ns, "k", idempotency.ClaimOptions{}); err != nil {
				t.Fatal(err)
			}
			short, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			_, err := c.Once(short, ns, "k", never) // waits 30 s by default
			var inProgress *idempotency.InProgress
			if !errors.As(err, &inProgress) || inProgress.Polled != relayed {
				t.Fatalf("got %v, want an *InProgress (polled: %v) rather than the deadline's error", err, relayed)
			}
		})
	}
}

func TestPollOnInProgressClaimsAgainWithoutAskingToWait(t *testing.T) {
	rec := newRecorder()
	c, ns, ctx := dial(t, []string{sqlite(t).Target}, rec), namespace(t), ctx(t)
	held, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan *idempotency.Result, 1)
	failed := make(chan error, 1)
	go func() {
		r, err := c.Once(ctx, ns, "k", never, idempotency.PollOnInProgress(20*time.Second))
		if err != nil {
			failed <- err
			return
		}
		done <- r
	}()
	until(t, 10*time.Second, "the poller to claim twice", func() bool {
		return rec.count("Claim") >= 3 // the holder's, and two of the poller's
	})
	if _, err := c.Complete(ctx, ns, "k", held.LeaseToken, []byte("by the holder"), 0); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-done:
		if !r.Replayed || string(r.Value) != "by the holder" || r.Claim.WaitHonored {
			t.Fatalf("%+v (claim %+v)", r, r.Claim)
		}
	case err := <-failed:
		t.Fatal(err)
	case <-ctx.Done():
		t.Fatal("Once did not return")
	}
	claimsSent(t, rec, false)
}

func TestThePerAttemptTimeoutDoesNotCutAWaitShort(t *testing.T) {
	rec := newRecorder()
	c, ns, ctx := dial(t, []string{sqlite(t).Target}, rec), namespace(t), ctx(t)
	requireWaiting(t, c)
	c.Retry.PerAttemptTimeout = 200 * time.Millisecond
	if _, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{}); err != nil {
		t.Fatal(err)
	}
	sent := rec.count("Claim")
	r, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{Wait: time.Second})
	if err != nil || r.Outcome != idempotency.OutcomeInProgress || !r.WaitHonored {
		t.Fatalf("%+v %v", r, err)
	}
	// The server reports how long it waited: the whole second, not the 200 ms of an attempt.
	if r.Waited < 500*time.Millisecond || rec.count("Claim") != sent+1 {
		t.Fatalf("waited %s in %d attempts, want the whole wait in one", r.Waited, rec.count("Claim")-sent)
	}
}
