package idempotency

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"time"
)

// Once runs a piece of work once per key: the lifecycle every caller would
// otherwise rewrite. It claims the key, then by outcome:
//
//   - CLAIMED: runs fn while a heartbeat extends the lease; when fn returns a
//     result, Completes with it; when fn returns an error (or panics),
//     Releases the key so the next delivery retries (with the last
//     checkpoint fn asked to save), and returns fn's error. If the lease is
//     lost meanwhile (the heartbeat's ExtendLease, a SaveCheckpoint or the
//     Complete answers NOT_FOUND or FAILED_PRECONDITION), fn's context is
//     cancelled, nothing is stored and Once returns a *LeaseLostError
//     (errors.Is(err, ErrLeaseLost)). fn's Lease carries the checkpoint an
//     earlier holder saved (lease.Checkpoint()) and saves its own
//     (lease.SaveCheckpoint).
//   - COMPLETED: the replay; returns the stored result without running fn.
//   - FINGERPRINT_MISMATCH: returns a *FingerprintMismatch.
//   - EXPIRED: a late retry refused (WithLateRetry(LateRetryRefuse), or the
//     namespace's or server's policy): returns a *ResultExpired
//     (errors.Is(err, ErrKeyExpired)) with when the key was completed; the
//     work does not run. Re-executed (the default), a late retry is CLAIMED
//     as above, with Lease.PreviouslyCompletedAt set.
//   - IN_PROGRESS: by default waits for the holder, for up to 30 s
//     (WaitOnInProgress) and never past ctx's deadline: the Claim asks the
//     server to wait (ClaimOptions.Wait) and is answered when the holder
//     completes (the stored result) or gives the key up (the lease, and fn
//     runs here); against a server that predates waiting, it claims again
//     with backoff instead. When the wait runs out, an *InProgress. With
//     FailOnInProgress, the *InProgress at once.
//
// Calls that fail (after the client's retries) return a *StatusError
// (errors.Is(err, ErrUnavailable), ...).
func (c *Client) Once(ctx context.Context, namespace, key string, fn func(ctx context.Context, lease Lease) ([]byte, error), opts ...Option) (*Result, error) {
	cfg := onceConfig{waitTimeout: DefaultWaitTimeout, heartbeat: true, wait: true}
	for _, opt := range opts {
		opt(&cfg)
	}
	claim, err := c.claimOrWait(ctx, namespace, key, &cfg)
	if err != nil {
		return nil, err
	}
	switch claim.Outcome {
	case OutcomeClaimed:
		value, err := c.runClaimed(ctx, namespace, key, claim, fn, &cfg)
		if err != nil {
			return nil, err
		}
		return &Result{Value: value, Replayed: false, Claim: claim}, nil
	case OutcomeCompleted:
		return &Result{Value: claim.Response, Replayed: true, Claim: claim}, nil
	case OutcomeFingerprintMismatch:
		return nil, &FingerprintMismatch{Namespace: namespace, Key: key}
	case OutcomeExpired:
		return nil, &ResultExpired{Namespace: namespace, Key: key, CompletedAt: claim.CompletedAt, FencingToken: claim.FencingToken}
	}
	return nil, fmt.Errorf("idempotency: %s/%s: Claim answered an unknown outcome %s", namespace, key, claim.Outcome)
}

// DefaultWaitTimeout is how long Once waits on another claimant by default.
const DefaultWaitTimeout = 30 * time.Second

// serverDefaultLease is the server's default lease, used only to pace the
// heartbeat when the caller sets no lease.
const serverDefaultLease = 30 * time.Second

// firstPoll is the first pause while polling another claimant; it doubles.
const firstPoll = 100 * time.Millisecond

// deadlineMargin: a wait ends this long before ctx's deadline, so that Once
// answers *InProgress rather than running into the deadline.
const deadlineMargin = 100 * time.Millisecond

// claimOrWait claims the key and, meeting another holder, waits (unless
// told not to) until the answer is no longer IN_PROGRESS or the wait runs
// out. The answer is CLAIMED, COMPLETED, FINGERPRINT_MISMATCH or EXPIRED.
func (c *Client) claimOrWait(ctx context.Context, namespace, key string, cfg *onceConfig) (*ClaimResult, error) {
	start := time.Now()
	end := start.Add(cfg.waitTimeout)
	if deadline, ok := ctx.Deadline(); ok && deadline.Add(-deadlineMargin).Before(end) {
		end = deadline.Add(-deadlineMargin)
	}
	polled := false
	for polls := 0; ; {
		var wait time.Duration
		if cfg.wait && !cfg.poll {
			wait = maxDuration(time.Until(end), 0)
		}
		claim, err := c.Claim(ctx, namespace, key, ClaimOptions{
			Fingerprint: cfg.fingerprint, LeaseTTL: cfg.leaseTTL, Retention: cfg.retention, Wait: wait,
			LateRetry: cfg.lateRetry,
		})
		if err != nil {
			return nil, err
		}
		if claim.Outcome != OutcomeInProgress {
			return claim, nil
		}
		remaining := time.Until(end)
		if !cfg.wait || remaining <= 0 {
			e := &InProgress{Namespace: namespace, Key: key, RetryAfter: claim.RetryAfter, LeaseExpiresAt: claim.LeaseExpiresAt, Polled: polled}
			if cfg.wait {
				e.Waited = time.Since(start)
			}
			return nil, e
		}
		if wait > 0 && claim.WaitHonored && claim.Waited > 0 {
			// The server waited, and the key is held still (by a new holder,
			// or its maximum wait cut ours short): wait again.
			continue
		}
		// The server did not wait: it predates waiting (WaitHonored false),
		// its limit of waiters was reached (Waited 0), or it was not asked
		// (PollOnInProgress). Claim again after a pause.
		polled = polled || !claim.WaitHonored
		timer := time.NewTimer(nextPause(polls, claim.RetryAfter, remaining))
		polls++
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil, ctx.Err()
		case <-timer.C:
		}
	}
}

// Result is what Once returns.
type Result struct {
	// Value is fn's result, or the stored one when Replayed.
	Value []byte
	// Replayed is true when the work was done before and Value is the stored result.
	Replayed bool
	// Claim is the Claim that won the lease, or the one that found the stored
	// result (Claim.WaitHonored and Claim.Waited tell whether the server waited).
	Claim *ClaimResult
}

// Option changes what Once does.
type Option func(*onceConfig)

type onceConfig struct {
	fingerprint       []byte
	leaseTTL          time.Duration
	retention         time.Duration
	heartbeat         bool
	heartbeatInterval time.Duration
	wait              bool // false: fail on in progress
	poll              bool // wait by claiming again with backoff, not on the server
	waitTimeout       time.Duration
	lateRetry         LateRetry
}

// WithFingerprint sets the payload's fingerprint (see Fingerprint): the same
// key with another fingerprint is a *FingerprintMismatch.
func WithFingerprint(fp []byte) Option { return func(c *onceConfig) { c.fingerprint = fp } }

// WithLeaseTTL sets the lease's length (default: the server's, 30 s).
func WithLeaseTTL(d time.Duration) Option { return func(c *onceConfig) { c.leaseTTL = d } }

// WithRetention sets how long the result is kept and replayed (default: the server's).
func WithRetention(d time.Duration) Option { return func(c *onceConfig) { c.retention = d } }

// WithLateRetry sets what a Claim of a remembered key does (completed, its
// result expired, still remembered): LateRetryReexecute runs fn again
// (Lease.PreviouslyCompletedAt says when the key was completed before),
// LateRetryRefuse returns a *ResultExpired without running it. Default:
// the namespace's policy, else the server's (re-execute unless configured).
func WithLateRetry(policy LateRetry) Option { return func(c *onceConfig) { c.lateRetry = policy } }

// WithHeartbeatInterval sets how often the lease is extended while fn runs
// (default: a third of the lease).
func WithHeartbeatInterval(d time.Duration) Option {
	return func(c *onceConfig) { c.heartbeat = true; c.heartbeatInterval = d }
}

// WithoutHeartbeat does not extend the lease: fn must finish within it.
func WithoutHeartbeat() Option { return func(c *onceConfig) { c.heartbeat = false } }

// WaitOnInProgress: when another claimant holds the lease, wait for it for
// up to timeout (and never past ctx's deadline), then return an *InProgress
// (the default, with DefaultWaitTimeout). The server does the waiting
// (ClaimOptions.Wait); one that predates waiting is polled with backoff.
func WaitOnInProgress(timeout time.Duration) Option {
	return func(c *onceConfig) { c.wait, c.poll, c.waitTimeout = true, false, timeout }
}

// PollOnInProgress: when another claimant holds the lease, claim again with
// backoff (100 ms doubling, never past the holder's RetryAfter) for up to
// timeout, without asking the server to wait, then return an *InProgress
// (what Once did before servers could wait).
func PollOnInProgress(timeout time.Duration) Option {
	return func(c *onceConfig) { c.wait, c.poll, c.waitTimeout = true, true, timeout }
}

// FailOnInProgress: when another claimant holds the lease, return an
// *InProgress at once (a broker consumer then requeues the message, and its
// prefetch is not held up by a waiting handler).
func FailOnInProgress() Option { return func(c *onceConfig) { c.wait, c.poll = false, false } }

// nextPause is how long to wait before claiming again when polling:
// exponential from 100 ms, so an early Complete is seen soon, but never past
// the other lease's expiry (retryAfter) nor the time left to wait.
func nextPause(attempt int, retryAfter, remaining time.Duration) time.Duration {
	pause := firstPoll
	for i := 0; i < attempt && pause < time.Hour; i++ {
		pause *= 2
	}
	if cap := maxDuration(retryAfter, 10*time.Millisecond); pause > cap {
		pause = cap
	}
	if pause > remaining {
		pause = remaining
	}
	return maxDuration(pause, 0)
}

func maxDuration(a, b time.Duration) time.Duration {
	if a > b {
		return a
	}
	return b
}

func (c *Client) runClaimed(ctx context.Context, namespace, key string, claim *ClaimResult, fn func(context.Context, Lease) ([]byte, error), cfg *onceConfig) (value []byte, err error) {
	workCtx, cancelWork := context.WithCancel(ctx)
	defer cancelWork()
	held := &heldLease{
		client: c, namespace: namespace, key: key, token: claim.LeaseToken, leaseTTL: cfg.leaseTTL,
		cancelWork: cancelWork, checkpoint: claim.Checkpoint, checkpointFencingToken: claim.CheckpointFencingToken,
	}
	hb := c.startHeartbeat(ctx, held, cfg)

	finished := false
	defer func() {
		if finished {
			return
		}
		// fn panicked: give the key back, then let the panic go on.
		hb.stop()
		if held.lostErr() == nil {
			c.releaseAfterFailure(held)
		}
	}()
	value, err = fn(workCtx, Lease{
		Token: claim.LeaseToken, FencingToken: claim.FencingToken, ExpiresAt: claim.LeaseExpiresAt,
		PreviouslyCompletedAt: claim.CompletedAt, held: held,
	})
	finished = true
	hb.stop()
	if lost := held.lostErr(); lost != nil {
		return nil, &LeaseLostError{Namespace: namespace, Key: key, When: "while the work ran", Cause: lost}
	}
	if err != nil {
		// Give the key back so the next delivery retries; never hide the failure.
		c.releaseAfterFailure(held)
		return nil, err
	}
	if value == nil {
		value = []byte{}
	}
	// Complete even if ctx was cancelled meanwhile: the work is done.
	completeCtx, cancel := context.WithTimeout(context.Background(), c.finalTimeout())
	defer cancel()
	if _, err := c.Complete(completeCtx, namespace, key, claim.LeaseToken, value, cfg.retention); err != nil {
		if leaseGone(err) {
			return nil, &LeaseLostError{Namespace: namespace, Key: key, When: "before Complete", Cause: err}
		}
		return nil, err
	}
	return value, nil
}

func (c *Client) finalTimeout() time.Duration {
	if c.CallTimeout > 0 {
		return c.CallTimeout
	}
	return DefaultCallTimeout
}

// releaseAfterFailure gives the key back with the last checkpoint the work
// asked to save (also one whose ExtendLease failed), so the next holder
// resumes from there.
func (c *Client) releaseAfterFailure(held *heldLease) {
	ctx, cancel := context.WithTimeout(context.Background(), c.finalTimeout())
	defer cancel()
	if err := c.ReleaseWithCheckpoint(ctx, held.namespace, held.key, held.token, held.lastAskedCheckpoint()); err != nil {
		c.logf("idempotency Once: Release after a failed attempt failed: %v", err)
	}
}

func (c *Client) logf(format string, args ...any) {
	if c.Logf != nil {
		c.Logf(format, args...)
	}
}

// OnceJSON is Once for a result that is stored as JSON (compact UTF-8, as
// the Python and TypeScript clients' once() store it by default, so a result
// completed from one language is replayed to the others). It returns the
// value (fn's, or the stored one decoded) and Once's Result.
func OnceJSON[T any](ctx context.Context, c *Client, namespace, key string, fn func(ctx context.Context, lease Lease) (T, error), opts ...Option) (T, *Result, error) {
	var value T
	result, err := c.Once(ctx, namespace, key, func(ctx context.Context, lease Lease) ([]byte, error) {
		v, err := fn(ctx, lease)
		if err != nil {
			return nil, err
		}
		value = v
		return marshalJSON(v)
	}, opts...)
	if err != nil {
		var zero T
		return zero, nil, err
	}
	if result.Replayed {
		var stored T
		if err := json.Unmarshal(result.Value, &stored); err != nil {
			var zero T
			return zero, result, fmt.Errorf("idempotency: %s/%s: the stored result is not JSON for %T: %w", namespace, key, stored, err)
		}
		return stored, result, nil
	}
	return value, result, nil
}

// marshalJSON is json.Marshal without HTML escaping (<, >, & as themselves,
// as Python's json.dumps and JSON.stringify write them).
func marshalJSON(v any) ([]byte, error) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n")), nil
}
