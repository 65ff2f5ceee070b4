package idempotency

import (
	crand "crypto/rand"
	"encoding/binary"
	"math"
	"math/rand"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
)

// RetryPolicy says how a Client retries a call that failed with a status
// worth another attempt: UNAVAILABLE (the server or its store cannot be
// reached, or is restarting), RESOURCE_EXHAUSTED (a rate limit, or the
// server's limit of calls in flight) and DEADLINE_EXCEEDED (an attempt's
// deadline passed), never a verdict on the request (INVALID_ARGUMENT,
// NOT_FOUND, FAILED_PRECONDITION, UNAUTHENTICATED, PERMISSION_DENIED).
//
// The n-th retry waits a pause drawn with full jitter from a capped
// exponential,
//
//	pause(n) = uniform(0, min(MaxBackoff, InitialBackoff * Multiplier^(n-1)))
//
// or the failed attempt's google.rpc.RetryInfo delay when that is longer
// (the server's advice: 250 ms on UNAVAILABLE, the rate limiter's next slot
// on RESOURCE_EXHAUSTED; never retried sooner: when the deadline leaves no
// room for it, the call fails at once with that status), as long as attempts are left (MaxAttempts counts the first) and the call's
// deadline (its context's, else Client.CallTimeout) leaves time for another
// attempt. Each attempt gets the time left, or PerAttemptTimeout when
// shorter, so an attempt that hangs leaves time for the next. With several
// addresses each retry goes to the next one.
//
// Every call is safe to repeat: Claim because the client sends its own lease
// token (a new one per Claim, the same on each retry of it) and the server
// answers a repeated token with the same lease (ClaimResult.Retried);
// Complete, Release and ExtendLease because repeating one that succeeded
// answers OK; Get changes nothing; Purge answers Purged false the second
// time.
type RetryPolicy struct {
	// MaxAttempts counts every attempt, the first included; 0 and 1 mean no retry.
	MaxAttempts int
	// InitialBackoff caps the pause before the first retry.
	InitialBackoff time.Duration
	// MaxBackoff caps every pause.
	MaxBackoff time.Duration
	// Multiplier is how much the cap grows per retry (below 1 counts as 1).
	Multiplier float64
	// PerAttemptTimeout bounds one attempt; 0: the time left of the call.
	PerAttemptTimeout time.Duration
	// RetryableCodes are the statuses worth another attempt; nil: RetryableCodes.
	RetryableCodes []codes.Code
}

// DefaultRetryPolicy is what NewClient and Dial set (the Python and
// TypeScript clients' defaults too): up to 10 attempts, pauses capped at
// 50 ms doubling to 2 s, about 4.6 s of pauses in all on average (9.2 s at
// most), cut short by the call's deadline (10 s unless set). It rides out a
// replica's restart.
var DefaultRetryPolicy = RetryPolicy{
	MaxAttempts:    10,
	InitialBackoff: 50 * time.Millisecond,
	MaxBackoff:     2 * time.Second,
	Multiplier:     2,
}

// NoRetry makes one attempt per call: client.Retry = idempotency.NoRetry.
var NoRetry = RetryPolicy{MaxAttempts: 1}

// RetryableCodes are the statuses a RetryPolicy retries unless it names others.
var RetryableCodes = []codes.Code{codes.Unavailable, codes.ResourceExhausted, codes.DeadlineExceeded}

// minAttempt: an attempt is not started with less time than this left
// before the call's deadline.
const minAttempt = 50 * time.Millisecond

// BackoffCap is the longest pause before the retry-th retry (1 for the first).
func (p RetryPolicy) BackoffCap(retry int) time.Duration {
	multiplier := math.Max(p.Multiplier, 1)
	cap := float64(p.InitialBackoff) * math.Pow(multiplier, float64(maxInt(retry-1, 0)))
	if math.IsInf(cap, 0) || math.IsNaN(cap) || cap > float64(p.MaxBackoff) {
		return maxDuration(p.MaxBackoff, 0)
	}
	return maxDuration(time.Duration(cap), 0)
}

// Backoff is the pause before the retry-th retry: uniform in [0, BackoffCap(retry)].
func (p RetryPolicy) Backoff(retry int) time.Duration {
	cap := p.BackoffCap(retry)
	if cap <= 0 {
		return 0
	}
	return time.Duration(jitter.int63n(int64(cap) + 1))
}

func (p RetryPolicy) retryable(code codes.Code) bool {
	retryable := p.RetryableCodes
	if retryable == nil {
		retryable = RetryableCodes
	}
	for _, c := range retryable {
		if c == code {
			return true
		}
	}
	return false
}

// jitter draws the pauses. Seeded from crypto/rand: math/rand's global source
// starts from the same seed in every process (before Go 1.20), which would
// line up the retries of many clients restarted together.
var jitter = newLockedRand()

type lockedRand struct {
	mu  sync.Mutex
	rng *rand.Rand
}

func newLockedRand() *lockedRand {
	var seed [8]byte
	if _, err := crand.Read(seed[:]); err != nil {
		binary.LittleEndian.PutUint64(seed[:], uint64(time.Now().UnixNano()))
	}
	return &lockedRand{rng: rand.New(rand.NewSource(int64(binary.LittleEndian.Uint64(seed[:]))))}
}

func (r *lockedRand) int63n(n int64) int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.rng.Int63n(n)
}

func maxInt(a, b int) int {
	if a > b {
		return a
	}
	return b
}
