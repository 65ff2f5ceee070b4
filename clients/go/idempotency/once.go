package idempotency

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"
)

// Once runs a piece of work once per key: the lifecycle every caller would
// otherwise rewrite. It claims the key, then by outcome:
//
//   - CLAIMED: runs fn while a heartbeat extends the lease; when fn returns a
//     result, Completes with it; when fn returns an error (or panics),
//     Releases the key so the next delivery retries, and returns fn's error.
//     If the lease is lost meanwhile (the heartbeat's ExtendLease or the
//     Complete answers NOT_FOUND or FAILED_PRECONDITION), fn's context is
//     cancelled, nothing is stored and Once returns a *LeaseLostError
//     (errors.Is(err, ErrLeaseLost)).
//   - COMPLETED: the replay; returns the stored result without running fn.
//   - FINGERPRINT_MISMATCH: returns a *FingerprintMismatch.
//   - IN_PROGRESS: by default waits (claims again with backoff) for up to
//     30 s, then returns an *InProgress; with FailOnInProgress returns it at once.
//
// Calls that fail return a *StatusError (errors.Is(err, ErrUnavailable), ...).
func (c *Client) Once(ctx context.Context, namespace, key string, fn func(ctx context.Context, lease Lease) ([]byte, error), opts ...Option) (*Result, error) {
	cfg := onceConfig{waitTimeout: DefaultWaitTimeout, heartbeat: true, wait: true}
	for _, opt := range opts {
		opt(&cfg)
	}
	start := time.Now()
	deadline := start.Add(cfg.waitTimeout)
	for attempt := 0; ; attempt++ {
		claim, err := c.Claim(ctx, namespace, key, ClaimOptions{
			Fingerprint: cfg.fingerprint, LeaseTTL: cfg.leaseTTL, Retention: cfg.retention,
		})
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
		case OutcomeInProgress:
			remaining := time.Until(deadline)
			if !cfg.wait || remaining <= 0 {
				e := &InProgress{Namespace: namespace, Key: key, RetryAfter: claim.RetryAfter, LeaseExpiresAt: claim.LeaseExpiresAt}
				if cfg.wait {
					e.Waited = time.Since(start)
				}
				return nil, e
			}
			timer := time.NewTimer(nextPause(attempt, claim.RetryAfter, remaining))
			select {
			case <-ctx.Done():
				timer.Stop()
				return nil, ctx.Err()
			case <-timer.C:
			}
		default:
			return nil, fmt.Errorf("idempotency: %s/%s: Claim answered an unknown outcome %s", namespace, key, claim.Outcome)
		}
	}
}

// DefaultWaitTimeout is how long Once waits on another claimant by default.
const DefaultWaitTimeout = 30 * time.Second

// serverDefaultLease is the server's default lease, used only to pace the
// heartbeat when the caller sets no lease.
const serverDefaultLease = 30 * time.Second

// firstWait is the first pause while waiting on another claimant; it doubles.
const firstWait = 100 * time.Millisecond

// Lease is what fn receives when this attempt holds the lease.
type Lease struct {
	Token string
	// FencingToken increases with every Claim that wins the key: hand it to
	// downstream writes so they can reject an older lease holder.
	FencingToken uint64
	// ExpiresAt is when the lease ran out at the Claim (the heartbeat moves it).
	ExpiresAt time.Time
}

// Result is what Once returns.
type Result struct {
	// Value is fn's result, or the stored one when Replayed.
	Value []byte
	// Replayed is true when the work was done before and Value is the stored result.
	Replayed bool
	// Claim is the Claim that won the lease, or the one that found the stored result.
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
	wait              bool
	waitTimeout       time.Duration
}

// WithFingerprint sets the payload's fingerprint (see Fingerprint): the same
// key with another fingerprint is a *FingerprintMismatch.
func WithFingerprint(fp []byte) Option { return func(c *onceConfig) { c.fingerprint = fp } }

// WithLeaseTTL sets the lease's length (default: the server's, 30 s).
func WithLeaseTTL(d time.Duration) Option { return func(c *onceConfig) { c.leaseTTL = d } }

// WithRetention sets how long the result is kept and replayed (default: the server's).
func WithRetention(d time.Duration) Option { return func(c *onceConfig) { c.retention = d } }

// WithHeartbeatInterval sets how often the lease is extended while fn runs
// (default: a third of the lease).
func WithHeartbeatInterval(d time.Duration) Option {
	return func(c *onceConfig) { c.heartbeat = true; c.heartbeatInterval = d }
}

// WithoutHeartbeat does not extend the lease: fn must finish within it.
func WithoutHeartbeat() Option { return func(c *onceConfig) { c.heartbeat = false } }

// WaitOnInProgress: when another claimant holds the lease, claim again with
// backoff for up to timeout, then return an *InProgress (the default, with
// DefaultWaitTimeout).
func WaitOnInProgress(timeout time.Duration) Option {
	return func(c *onceConfig) { c.wait = true; c.waitTimeout = timeout }
}

// FailOnInProgress: when another claimant holds the lease, return an
// *InProgress at once (a broker consumer then requeues the message).
func FailOnInProgress() Option { return func(c *onceConfig) { c.wait = false } }

// nextPause is how long to wait before claiming again: exponential from
// 100 ms, so an early Complete is seen soon, but never past the other lease's
// expiry (retryAfter) nor the time left to wait.
func nextPause(attempt int, retryAfter, remaining time.Duration) time.Duration {
	pause := firstWait
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
	hb := c.startHeartbeat(ctx, namespace, key, claim.LeaseToken, cfg, cancelWork)

	finished := false
	defer func() {
		if finished {
			return
		}
		// fn panicked: give the key back, then let the panic go on.
		hb.stop()
		if hb.lostErr() == nil {
			c.releaseAfterFailure(namespace, key, claim.LeaseToken)
		}
	}()
	value, err = fn(workCtx, Lease{Token: claim.LeaseToken, FencingToken: claim.FencingToken, ExpiresAt: claim.LeaseExpiresAt})
	finished = true
	hb.stop()
	if lost := hb.lostErr(); lost != nil {
		return nil, &LeaseLostError{Namespace: namespace, Key: key, When: "while the work ran", Cause: lost}
	}
	if err != nil {
		// Give the key back so the next delivery retries; never hide the failure.
		c.releaseAfterFailure(namespace, key, claim.LeaseToken)
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

func (c *Client) releaseAfterFailure(namespace, key, token string) {
	ctx, cancel := context.WithTimeout(context.Background(), c.finalTimeout())
	defer cancel()
	if err := c.Release(ctx, namespace, key, token); err != nil {
		c.logf("idempotency Once: Release after a failed attempt failed: %v", err)
	}
}

func (c *Client) logf(format string, args ...any) {
	if c.Logf != nil {
		c.Logf(format, args...)
	}
}

type heartbeat struct {
	quit chan struct{}
	done chan struct{}
	once sync.Once
	mu   sync.Mutex
	lost error
}

func (c *Client) startHeartbeat(ctx context.Context, namespace, key, token string, cfg *onceConfig, cancelWork context.CancelFunc) *heartbeat {
	hb := &heartbeat{quit: make(chan struct{}), done: make(chan struct{})}
	if !cfg.heartbeat {
		close(hb.done)
		return hb
	}
	interval := cfg.heartbeatInterval
	if interval <= 0 {
		lease := cfg.leaseTTL
		if lease <= 0 {
			lease = serverDefaultLease
		}
		interval = lease / 3
	}
	callCtx, cancelCalls := context.WithCancel(ctx)
	go func() {
		defer close(hb.done)
		defer cancelCalls()
		ticker := time.NewTicker(interval)
		defer ticker.Stop()
		for {
			select {
			case <-hb.quit:
				return
			case <-ctx.Done():
				return
			case <-ticker.C:
			}
			_, err := c.ExtendLease(callCtx, namespace, key, token, cfg.leaseTTL)
			if err == nil {
				continue
			}
			if leaseGone(err) {
				hb.mu.Lock()
				hb.lost = err
				hb.mu.Unlock()
				cancelWork()
				return
			}
			select {
			case <-hb.quit:
				return // stopped while the call was in flight
			default:
			}
			// Transient: the lease may well still be ours, and the final Complete tells for sure.
			c.logf("idempotency heartbeat: ExtendLease failed: %v", err)
		}
	}()
	// Stopping cancels a call in flight.
	go func() {
		select {
		case <-hb.quit:
			cancelCalls()
		case <-hb.done:
		}
	}()
	return hb
}

func (hb *heartbeat) stop() {
	hb.once.Do(func() { close(hb.quit) })
	<-hb.done
}

func (hb *heartbeat) lostErr() error {
	hb.mu.Lock()
	defer hb.mu.Unlock()
	return hb.lost
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
