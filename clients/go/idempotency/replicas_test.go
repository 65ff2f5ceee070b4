package idempotency_test

// Several replicas: two servers on one fresh PostgreSQL database, the client
// given both addresses. A replica stopped during a Once, one sent a Complete
// as it stops, one that stays down, and a rolling restart (SIGTERM, start
// again on the same port, one replica after the other) under a running Once
// loop: the caller's code sees no error, and every piece of work runs once.

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"idempotencyservice/idempotency"
	"idempotencyservice/idempotency/idempotencytest"
)

// replicas starts two servers on a fresh PostgreSQL database for the test.
func replicas(t *testing.T) []*idempotencytest.Server {
	t.Helper()
	url := idempotencytest.PostgresDatabase(t)
	a := idempotencytest.Start(t, "DATABASE_URL="+url)
	b := idempotencytest.Start(t, "DATABASE_URL="+url)
	return []*idempotencytest.Server{a, b}
}

func TestAReplicaStoppedDuringAOnceIsRiddenOver(t *testing.T) {
	servers := replicas(t)
	for victim := range servers {
		t.Run(fmt.Sprintf("replica %d stopped", victim), func(t *testing.T) {
			for _, s := range servers {
				if !s.Running() {
					if err := s.Restart(); err != nil {
						t.Fatal(err)
					}
				}
			}
			c, ns, ctx := dial(t, targetsOf(servers...), nil), namespace(t), ctx(t)
			runs := 0
			work := func(context.Context, idempotency.Lease) ([]byte, error) {
				// The Claim has been answered; the Complete is next.
				servers[victim].Stop()
				runs++
				return []byte(`{"charged":true}`), nil
			}
			r, err := c.Once(ctx, ns, "order-1", work)
			if err != nil || r.Replayed || string(r.Value) != `{"charged":true}` {
				t.Fatalf("%+v %v", r, err)
			}
			record, err := c.Get(ctx, ns, "order-1")
			if err != nil || record.State != idempotency.StateCompleted {
				t.Fatalf("%+v %v", record, err)
			}
			again, err := c.Once(ctx, ns, "order-1", work)
			if err != nil || !again.Replayed || string(again.Value) != `{"charged":true}` || runs != 1 {
				t.Fatalf("%+v %v; the work ran %d times", again, err, runs)
			}
		})
	}
}

func TestACompleteSentToAReplicaThatJustStoppedIsRetriedOnTheOther(t *testing.T) {
	servers := replicas(t)
	rec := newRecorder()
	c, ns, ctx := dial(t, targetsOf(servers...), rec), namespace(t), ctx(t)
	// Both connections up, so that calls go to each in turn.
	until(t, 10*time.Second, "both replicas to answer", func() bool {
		_, _ = c.Get(ctx, ns, "warm-up")
		answered := map[string]bool{}
		for _, a := range rec.of("Get") {
			answered[a.target] = a.code == codes.OK
		}
		return answered[servers[0].Target] && answered[servers[1].Target]
	})
	var stopped string
	rec.before["Complete"] = func(target string) {
		// The Complete is on its way to this replica: stop it first.
		for _, s := range servers {
			if s.Target == target {
				s.Stop()
				stopped = target
			}
		}
	}
	var retries []idempotency.Retry
	c.OnRetry = func(r idempotency.Retry) { retries = append(retries, r) }
	r, err := c.Once(ctx, ns, "k", func(context.Context, idempotency.Lease) ([]byte, error) { return []byte(`"ok"`), nil })
	if err != nil || string(r.Value) != `"ok"` {
		t.Fatalf("%+v %v", r, err)
	}
	claims, completes := rec.of("Claim"), rec.of("Complete")
	if len(claims) != 1 || claims[0].code != codes.OK || claims[0].target == stopped {
		t.Fatalf("Claims %+v: want one, answered by the replica that stays up", claims)
	}
	if len(completes) != 2 || completes[0].target != stopped || completes[0].code != codes.Unavailable ||
		completes[1].target == stopped || completes[1].code != codes.OK {
		t.Fatalf("Completes %+v: want UNAVAILABLE from the stopped replica %s, then OK from the other", completes, stopped)
	}
	if len(retries) != 1 || retries[0].Method != "Complete" || retries[0].Target != stopped || retries[0].Attempt != 1 {
		t.Fatalf("retries %+v", retries)
	}
	if record, err := c.Get(ctx, ns, "k"); err != nil || record.State != idempotency.StateCompleted {
		t.Fatalf("%+v %v", record, err)
	}
}

func TestCallsKeepWorkingWhileOneReplicaIsDown(t *testing.T) {
	servers := replicas(t)
	servers[1].Stop()
	rec := newRecorder()
	c, ns, ctx := dial(t, targetsOf(servers...), rec), namespace(t), ctx(t)
	for i := 0; i < 20; i++ {
		want := fmt.Sprint(i)
		r, err := c.Once(ctx, ns, fmt.Sprintf("k%d", i), func(context.Context, idempotency.Lease) ([]byte, error) { return []byte(want), nil })
		if err != nil || string(r.Value) != want {
			t.Fatalf("%+v %v", r, err)
		}
	}
	if ok := rec.count("", codes.OK); ok != 40 {
		t.Fatalf("%d calls answered OK, want 40 (a Claim and a Complete each)", ok)
	}
	// Once its connection is known to fail, the stopped replica is passed over.
	if failed := rec.count("", codes.Unavailable); failed > 10 {
		t.Fatalf("%d attempts went to the stopped replica", failed)
	}
}

// onceLoop runs Once on new keys evt-0, evt-1, ... until stopped, recording
// what completed, how often each key's work ran and any error.
type onceLoop struct {
	mu        sync.Mutex
	runs      map[string]int
	completed []string
	errs      []error
	stop      chan struct{}
	stopOnce  sync.Once
	done      chan struct{}
}

// startOnceLoop starts the loop; it stops when the test ends at the latest.
func startOnceLoop(t *testing.T, c *idempotency.Client, ns string, opts ...idempotency.Option) *onceLoop {
	l := &onceLoop{runs: map[string]int{}, stop: make(chan struct{}), done: make(chan struct{})}
	t.Cleanup(func() {
		l.halt()
		<-l.done
	})
	go func() {
		defer close(l.done)
		for i := 0; ; i++ {
			select {
			case <-l.stop:
				return
			default:
			}
			key := fmt.Sprintf("evt-%d", i)
			r, err := c.Once(context.Background(), ns, key, func(context.Context, idempotency.Lease) ([]byte, error) {
				l.mu.Lock()
				l.runs[key]++
				l.mu.Unlock()
				return []byte(key), nil
			}, opts...)
			l.mu.Lock()
			if err == nil && string(r.Value) != key {
				err = fmt.Errorf("%s: got %q", key, r.Value)
			}
			if err != nil {
				l.errs = append(l.errs, err) // anything at all reaching the caller's code
			} else {
				l.completed = append(l.completed, key)
			}
			l.mu.Unlock()
		}
	}()
	return l
}

func (l *onceLoop) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.completed)
}

func (l *onceLoop) halt() { l.stopOnce.Do(func() { close(l.stop) }) }

// finish stops the loop and checks that nothing failed and each key's work ran once.
func (l *onceLoop) finish(t *testing.T) []string {
	t.Helper()
	l.halt()
	select {
	case <-l.done:
	case <-time.After(30 * time.Second):
		t.Fatal("the Once loop did not stop")
	}
	if len(l.errs) > 0 {
		t.Fatalf("%d errors reached the caller, the first: %v", len(l.errs), l.errs[0])
	}
	for key, runs := range l.runs {
		if runs != 1 {
			t.Fatalf("the work of %s ran %d times", key, runs)
		}
	}
	return l.completed
}

func TestARollingRestartUnderARunningOnceLoopRaisesNothing(t *testing.T) {
	servers := replicas(t)
	c, ns, ctx := dial(t, targetsOf(servers...), nil), namespace(t), ctx(t)
	var retries int32
	c.OnRetry = func(idempotency.Retry) { atomic.AddInt32(&retries, 1) }
	loop := startOnceLoop(t, c, ns, idempotency.WithLeaseTTL(10*time.Second))
	until(t, 20*time.Second, "the loop to run", func() bool { return loop.count() >= 10 })
	for _, s := range servers {
		// SIGTERM, wait for it to exit; the loop goes on on the other
		// replica meanwhile; then start it again on the same port.
		s.Stop()
		down := loop.count()
		until(t, 20*time.Second, "progress while a replica is down", func() bool { return loop.count() >= down+10 })
		if err := s.Restart(); err != nil {
			t.Fatal(err)
		}
		up := loop.count()
		until(t, 20*time.Second, "progress after a restart", func() bool { return loop.count() >= up+10 })
	}
	completed := loop.finish(t)
	t.Logf("%d pieces of work done once each across two restarts; %d attempts retried", len(completed), atomic.LoadInt32(&retries))
	for i := 0; i < len(completed); i += len(completed)/10 + 1 {
		if record, err := c.Get(ctx, ns, completed[i]); err != nil || record.State != idempotency.StateCompleted {
			t.Fatalf("%s: %+v %v", completed[i], record, err)
		}
	}
}

func TestARestartOfTheOnlyAddressUnderAOnceLoopRaisesNothing(t *testing.T) {
	// One address (a load balancer, or a single replica): the retries wait
	// out the restart within the calls' deadline.
	server := idempotencytest.Start(t)
	c, ns := dial(t, []string{server.Target}, nil), namespace(t)
	var retries int32
	c.OnRetry = func(idempotency.Retry) { atomic.AddInt32(&retries, 1) }
	loop := startOnceLoop(t, c, ns)
	until(t, 20*time.Second, "the loop to run", func() bool { return loop.count() >= 10 })
	if err := server.Restart(); err != nil {
		t.Fatal(err)
	}
	after := loop.count()
	until(t, 20*time.Second, "progress after the restart", func() bool { return loop.count() >= after+10 })
	completed := loop.finish(t)
	t.Logf("%d pieces of work done once each across the restart; %d attempts retried", len(completed), atomic.LoadInt32(&retries))
}
