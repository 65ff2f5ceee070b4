package idempotency

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log"
	"strings"
	"time"

	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "idempotencyservice/gen/idempotencyv1"
)

// HealthService is the service name whose health check says the store is ready.
const HealthService = "idempotency.v1.IdempotencyService"

// DefaultCallTimeout bounds each call whose context has no deadline.
const DefaultCallTimeout = 10 * time.Second

// Client calls idempotency-service, over one connection per address, with
// retries (see RetryPolicy). It is safe for concurrent use; set its fields
// before the first call.
type Client struct {
	dialed []*grpc.ClientConn // the connections Dial made, closed by Close
	conns  *conns
	stub   pb.IdempotencyServiceClient

	// CallTimeout bounds each call, its retries included, whose context has
	// no deadline (DefaultCallTimeout unless changed; 0: no bound). A Claim
	// that waits (ClaimOptions.Wait) gets its wait on top.
	CallTimeout time.Duration
	// Retry is how failed calls are retried (DefaultRetryPolicy unless
	// changed; NoRetry: one attempt).
	Retry RetryPolicy
	// OnRetry, when set, is told about each retry before its pause (to log
	// it: Retry's String says what failed where).
	OnRetry func(Retry)
	// Logf reports what Once cannot return: a heartbeat's transient failure,
	// a failed Release after fn failed (log.Printf unless changed; nil: silent).
	Logf func(format string, args ...any)
}

// Dial connects to target: one address ("host:port"), several separated by
// commas ("10.0.0.11:50051,10.0.0.12:50051"), or a gRPC target such as
// "dns:///idempotency.internal:50051" (round-robin over every address the
// name resolves to). One connection per address; each call starts on the
// next one in turn that is connected, and each retry goes to the next.
//
// Without options the connections are plaintext (grpc.WithInsecure()); pass
// grpc.WithTransportCredentials(...) for TLS and BearerToken(token) (or
// grpc.WithPerRPCCredentials(...)) for a token, and grpc.WithUnaryInterceptor
// for interceptors, which see every attempt. Close the client when done.
func Dial(target string, opts ...grpc.DialOption) (*Client, error) {
	return DialTargets(SplitTargets(target), opts...)
}

// DialTargets is Dial with the addresses in a list.
func DialTargets(targets []string, opts ...grpc.DialOption) (*Client, error) {
	var addresses []string
	for _, target := range targets {
		if target = strings.TrimSpace(target); target != "" {
			addresses = append(addresses, target)
		}
	}
	if len(addresses) == 0 {
		return nil, errors.New("idempotency: dial: no address given")
	}
	if len(opts) == 0 {
		opts = []grpc.DialOption{grpc.WithInsecure()}
	}
	opts = append(append([]grpc.DialOption{}, defaultDialOptions...), opts...)
	var dialed []*grpc.ClientConn
	var endpoints []endpoint
	for _, target := range addresses {
		conn, err := grpc.Dial(target, opts...)
		if err != nil {
			for _, c := range dialed {
				c.Close()
			}
			return nil, fmt.Errorf("idempotency: dial %s: %w", target, err)
		}
		dialed = append(dialed, conn)
		endpoints = append(endpoints, newEndpoint(target, conn))
	}
	c := newClient(endpoints)
	c.dialed = dialed
	return c, nil
}

// BearerToken sends "authorization: Bearer <token>" with every call, for a
// server with an access policy. It does not require TLS: over a plaintext
// connection (grpc.WithInsecure()) the token travels in clear, so keep that
// to loopback or a network you trust.
//
//	idempotency.Dial(target, grpc.WithTransportCredentials(creds), idempotency.BearerToken(token))
func BearerToken(token string) grpc.DialOption {
	return grpc.WithPerRPCCredentials(bearerToken(token))
}

type bearerToken string

func (t bearerToken) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(t)}, nil
}

func (bearerToken) RequireTransportSecurity() bool { return false }

// NewClient uses a connection the caller made (and closes), with the
// client's retries.
func NewClient(cc grpc.ClientConnInterface) *Client {
	return newClient([]endpoint{newEndpoint("<connection>", cc)})
}

func newClient(endpoints []endpoint) *Client {
	c := &Client{CallTimeout: DefaultCallTimeout, Retry: DefaultRetryPolicy, Logf: log.Printf}
	c.conns = &conns{client: c, endpoints: endpoints}
	c.stub = pb.NewIdempotencyServiceClient(c.conns)
	return c
}

// Stub is the generated client, for the calls this package does not wrap
// (Purge, ClaimBatch, CompleteBatch). Its calls go through the client's
// connections and retries too; give each ClaimBatch item its own
// LeaseToken (NewLeaseToken()) to make the batch safe to retry.
func (c *Client) Stub() pb.IdempotencyServiceClient { return c.stub }

// Targets is the addresses the client calls, one connection each.
func (c *Client) Targets() []string {
	targets := make([]string, len(c.conns.endpoints))
	for i, e := range c.conns.endpoints {
		targets[i] = e.target
	}
	return targets
}

// Close closes the connections Dial made (a no-op for NewClient's).
func (c *Client) Close() error {
	var first error
	for _, conn := range c.dialed {
		if err := conn.Close(); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// callContext gives ctx the client's CallTimeout (plus extra) when it has no
// deadline.
func (c *Client) callContext(ctx context.Context, extra time.Duration) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok || c.CallTimeout <= 0 {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, c.CallTimeout+extra)
}

// WaitUntilServing polls the health check until the service (and its store)
// is SERVING, or ctx ends.
func (c *Client) WaitUntilServing(ctx context.Context) error {
	health := healthpb.NewHealthClient(c.conns)
	last := "no answer yet"
	for {
		callCtx, cancel := context.WithTimeout(ctx, time.Second)
		reply, err := health.Check(callCtx, &healthpb.HealthCheckRequest{Service: HealthService})
		cancel()
		if err == nil && reply.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return nil
		}
		if err != nil {
			last = err.Error()
		} else {
			last = reply.GetStatus().String()
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("idempotency: service not SERVING (%s): %w", last, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Outcome is what a Claim found.
type Outcome int

const (
	// OutcomeClaimed: the caller now holds the lease; do the work, then
	// Complete or Release with the lease token.
	OutcomeClaimed Outcome = Outcome(pb.Outcome_OUTCOME_CLAIMED)
	// OutcomeInProgress: another claimant holds a live lease.
	OutcomeInProgress Outcome = Outcome(pb.Outcome_OUTCOME_IN_PROGRESS)
	// OutcomeCompleted: the work was done; Response is the stored result.
	OutcomeCompleted Outcome = Outcome(pb.Outcome_OUTCOME_COMPLETED)
	// OutcomeFingerprintMismatch: the key was seen with another payload fingerprint.
	OutcomeFingerprintMismatch Outcome = Outcome(pb.Outcome_OUTCOME_FINGERPRINT_MISMATCH)
	// OutcomeExpired: a late retry refused (LateRetryRefuse, the Claim's or
	// its namespace's policy): the key was completed (CompletedAt), its
	// result has expired, and the server still remembers it. The effect
	// happened; the result is gone; nothing was changed. FencingToken is the
	// last lease's.
	OutcomeExpired Outcome = Outcome(pb.Outcome_OUTCOME_EXPIRED)
)

func (o Outcome) String() string {
	switch o {
	case OutcomeClaimed:
		return "CLAIMED"
	case OutcomeInProgress:
		return "IN_PROGRESS"
	case OutcomeCompleted:
		return "COMPLETED"
	case OutcomeFingerprintMismatch:
		return "FINGERPRINT_MISMATCH"
	case OutcomeExpired:
		return "EXPIRED"
	}
	return fmt.Sprintf("Outcome(%d)", int(o))
}

// LateRetry is what a Claim of a remembered key does: one whose completed
// result's retention ended, and which the server remembers (a compact
// marker: fingerprint, fencing token, when it completed) until its horizon
// (IDEMPOTENCY_REMEMBER_FOR after its Complete, 7 days unless configured,
// or the namespace's remember_for).
type LateRetry int

const (
	// LateRetryDefault: the namespace's policy (the policy file's
	// late_retry), else the server's (IDEMPOTENCY_LATE_RETRY; re-execute
	// unless configured).
	LateRetryDefault LateRetry = LateRetry(pb.LateRetry_LATE_RETRY_UNSPECIFIED)
	// LateRetryReexecute: claim the key anew with the next fencing token
	// (never 1 again): OutcomeClaimed with ClaimResult.CompletedAt set, so
	// the caller knows the effect ran before.
	LateRetryReexecute LateRetry = LateRetry(pb.LateRetry_LATE_RETRY_REEXECUTE)
	// LateRetryRefuse: answer OutcomeExpired (Once: a *ResultExpired),
	// changing nothing.
	LateRetryRefuse LateRetry = LateRetry(pb.LateRetry_LATE_RETRY_REFUSE)
)

func (l LateRetry) String() string {
	switch l {
	case LateRetryDefault:
		return "DEFAULT"
	case LateRetryReexecute:
		return "REEXECUTE"
	case LateRetryRefuse:
		return "REFUSE"
	}
	return fmt.Sprintf("LateRetry(%d)", int(l))
}

// ClaimOptions are Claim's optional fields; the zero value uses the server's
// defaults, a new lease token, and no waiting.
type ClaimOptions struct {
	// Fingerprint of the payload (see Fingerprint), at most 64 bytes; nil: no check.
	Fingerprint []byte
	// LeaseTTL is the lease's length if this Claim wins (0: the server's default, 30 s).
	LeaseTTL time.Duration
	// Retention is how long the completed result is replayed (0: the server's default, 24 h).
	Retention time.Duration
	// LeaseToken is the lease token to use if this Claim wins; "": a new
	// one (NewLeaseToken). It is sent on every retry of the Claim, so a retry
	// whose first answer was lost gets the same lease back (Retried). Pass
	// your own only to repeat a Claim yourself; never reuse one across Claims.
	LeaseToken string
	// Wait is how long the Claim may wait for another holder's live lease to
	// end before answering (0: answer at once). While it waits: the holder
	// Completes, and the Claim answers OutcomeCompleted with the stored
	// result; the holder Releases, its lease runs out or the key is purged,
	// and the Claim tries to take the key (OutcomeClaimed, or it goes on
	// waiting for whoever took it); the wait runs out, and it answers
	// OutcomeInProgress. The server shortens it to its maximum (60 s unless
	// configured) and to the call's deadline; a context without a deadline
	// gets CallTimeout plus Wait, and RetryPolicy.PerAttemptTimeout gives a
	// waiting Claim's attempts at least Wait and 0.5 s more. A server that
	// predates waiting answers at once: WaitHonored is then false.
	Wait time.Duration
	// LateRetry is what to do if the key is remembered (completed, its
	// result expired): re-execute (OutcomeClaimed with CompletedAt set) or
	// refuse (OutcomeExpired). LateRetryDefault: the namespace's policy,
	// else the server's (re-execute unless configured).
	LateRetry LateRetry
}

// ClaimResult is what a Claim found; Outcome says which fields are set.
type ClaimResult struct {
	Outcome Outcome
	// OutcomeClaimed: the lease's secret, for Complete, Release and ExtendLease.
	LeaseToken string
	// OutcomeClaimed: increases by one on every successful Claim of the key;
	// hand it to downstream writes so they can reject an older lease holder.
	// It goes on counting while a key is remembered (a re-executed late
	// retry gets the next one, never 1). OutcomeExpired: the last lease's.
	FencingToken uint64
	// OutcomeClaimed: when the new lease runs out. OutcomeInProgress: when the
	// other claimant's lease runs out.
	LeaseExpiresAt time.Time
	// OutcomeCompleted: the stored result (the replay).
	Response []byte
	// When the record expires (see the proto).
	ExpiresAt time.Time
	// OutcomeInProgress: the time left on the other claimant's lease.
	RetryAfter time.Duration
	// OutcomeClaimed: the last checkpoint an earlier holder of the key saved
	// (with ExtendLeaseWithCheckpoint or ReleaseWithCheckpoint), to resume
	// from; nil when there is none (non-nil and empty for an empty one).
	Checkpoint []byte
	// OutcomeClaimed: the fencing token of the lease that saved Checkpoint;
	// 0 when there is none.
	CheckpointFencingToken uint64
	// OutcomeClaimed: true when this answer repeats the lease an earlier
	// attempt of this Claim won (a retry whose first answer was lost).
	Retried bool
	// WaitHonored: the Claim asked to wait (ClaimOptions.Wait) and the server
	// knows how: Waited is how long it waited. False for a Claim that did not
	// ask, and for a server that predates waiting (poll instead).
	WaitHonored bool
	// Waited is how long the server waited before answering (with
	// WaitHonored); 0 when there was nothing to wait for, or when the
	// server's limit of waiters was reached (then the answer is an immediate
	// OutcomeInProgress).
	Waited time.Duration
	// CompletedAt is when the key was completed before: set on
	// OutcomeExpired, and on OutcomeClaimed when the Claim re-executed a
	// late retry of a remembered key (the effect ran once already, and its
	// result is gone; see Reexecuted). Zero otherwise.
	CompletedAt time.Time
}

// Claimed reports whether the caller now holds the lease.
func (r *ClaimResult) Claimed() bool { return r.Outcome == OutcomeClaimed }

// Reexecuted reports whether the caller holds the lease of a key that was
// completed before (at CompletedAt) and whose result has expired: a late
// retry, re-executed.
func (r *ClaimResult) Reexecuted() bool {
	return r.Outcome == OutcomeClaimed && !r.CompletedAt.IsZero()
}

// NewLeaseToken is a fresh lease token for one Claim: 128 bits from
// crypto/rand as 32 lowercase hexadecimal characters (what the server expects).
func NewLeaseToken() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		// crypto/rand does not fail on the systems Go supports; a token from
		// anything weaker would let another caller guess the lease.
		panic(fmt.Sprintf("idempotency: crypto/rand: %v", err))
	}
	return hex.EncodeToString(b[:])
}

// Claim tries to take the lease on a key. Losing a race is an outcome
// (OutcomeInProgress), never an error. The Claim carries its own lease token
// (opts.LeaseToken, or a new one), the same on every retry, so it is safe to
// retry. With opts.Wait it may wait for another holder (see ClaimOptions).
func (c *Client) Claim(ctx context.Context, namespace, key string, opts ClaimOptions) (*ClaimResult, error) {
	ctx, cancel := c.callContext(ctx, maxDuration(opts.Wait, 0))
	defer cancel()
	token := opts.LeaseToken
	if token == "" {
		token = NewLeaseToken()
	}
	reply, err := c.stub.Claim(ctx, &pb.ClaimRequest{
		Namespace:   namespace,
		Key:         key,
		Fingerprint: opts.Fingerprint,
		LeaseTtl:    duration(opts.LeaseTTL),
		Retention:   duration(opts.Retention),
		LeaseToken:  token,
		Wait:        duration(opts.Wait),
		LateRetry:   pb.LateRetry(opts.LateRetry),
	})
	if err != nil {
		return nil, fromRPC("Claim", err)
	}
	return claimResult(reply), nil
}

func claimResult(reply *pb.ClaimResponse) *ClaimResult {
	r := &ClaimResult{
		Outcome:        Outcome(reply.GetOutcome()),
		LeaseToken:     reply.GetLeaseToken(),
		FencingToken:   reply.GetFencingToken(),
		LeaseExpiresAt: timestamp(reply.GetLeaseExpiresAt()),
		Response:       reply.GetResponse(),
		ExpiresAt:      timestamp(reply.GetExpiresAt()),
		CompletedAt:    timestamp(reply.GetCompletedAt()),
	}
	if reply.GetRetryAfter() != nil {
		r.RetryAfter = reply.GetRetryAfter().AsDuration()
	}
	if r.Response == nil && r.Outcome == OutcomeCompleted {
		r.Response = []byte{}
	}
	if r.Outcome == OutcomeClaimed {
		r.Checkpoint, r.CheckpointFencingToken = checkpoint(reply.GetCheckpoint(), reply.GetCheckpointFencingToken())
		r.Retried = reply.GetRetried()
	}
	if reply.GetWaited() != nil {
		r.WaitHonored = true
		r.Waited = reply.GetWaited().AsDuration()
	}
	return r
}

// checkpoint: nil when there is none (its fencing token is 0), else the
// bytes (non-nil, possibly empty).
func checkpoint(data []byte, fencingToken uint64) ([]byte, uint64) {
	if fencingToken == 0 {
		return nil, 0
	}
	if data == nil {
		data = []byte{}
	}
	return data, fencingToken
}

// Complete stores the result of the work done under a lease; later Claims of
// the key replay it. retention 0: the Claim's retention, else the server's
// default. It returns when the stored result expires. Retrying a Complete
// that succeeded returns the same answer.
func (c *Client) Complete(ctx context.Context, namespace, key, leaseToken string, response []byte, retention time.Duration) (time.Time, error) {
	reply, err := c.stub.Complete(ctx, &pb.CompleteRequest{
		Namespace:  namespace,
		Key:        key,
		LeaseToken: leaseToken,
		Response:   response,
		Retention:  duration(retention),
	})
	if err != nil {
		return time.Time{}, fromRPC("Complete", err)
	}
	return timestamp(reply.GetExpiresAt()), nil
}

// Release gives a failed attempt back: the key is claimable again at once.
// The checkpoint saved before, if any, is kept for the next holder.
func (c *Client) Release(ctx context.Context, namespace, key, leaseToken string) error {
	return c.ReleaseWithCheckpoint(ctx, namespace, key, leaseToken, nil)
}

// ReleaseWithCheckpoint is Release that saves a checkpoint (how far the
// failed attempt got, at most the server's limit: 64 KiB unless configured)
// for the next holder of the key; nil keeps the one saved before, and a
// non-nil empty slice saves an empty one.
func (c *Client) ReleaseWithCheckpoint(ctx context.Context, namespace, key, leaseToken string, checkpoint []byte) error {
	_, err := c.stub.Release(ctx, &pb.ReleaseRequest{
		Namespace: namespace, Key: key, LeaseToken: leaseToken, Checkpoint: checkpoint, // proto3 optional bytes: nil is unset, empty is set
	})
	return fromRPC("Release", err)
}

// ExtendLease sets the lease to run out leaseTTL from now (0: the server's
// default) and returns when it now runs out.
func (c *Client) ExtendLease(ctx context.Context, namespace, key, leaseToken string, leaseTTL time.Duration) (time.Time, error) {
	return c.ExtendLeaseWithCheckpoint(ctx, namespace, key, leaseToken, leaseTTL, nil)
}

// ExtendLeaseWithCheckpoint is ExtendLease that also saves a checkpoint:
// how far the work got (the steps done, the ids they produced), at most the
// server's limit (64 KiB unless configured), replacing the one saved
// before. Whoever takes the key over after this lease runs out or is
// released receives it (ClaimResult.Checkpoint); Complete discards it. nil
// keeps the one saved before; a non-nil empty slice saves an empty one.
func (c *Client) ExtendLeaseWithCheckpoint(ctx context.Context, namespace, key, leaseToken string, leaseTTL time.Duration, checkpoint []byte) (time.Time, error) {
	reply, err := c.stub.ExtendLease(ctx, &pb.ExtendLeaseRequest{
		Namespace: namespace, Key: key, LeaseToken: leaseToken, LeaseTtl: duration(leaseTTL),
		Checkpoint: checkpoint, // proto3 optional bytes: nil is unset, empty is set
	})
	if err != nil {
		return time.Time{}, fromRPC("ExtendLease", err)
	}
	return timestamp(reply.GetLeaseExpiresAt()), nil
}

// State is the state of a key's record, as Get reports it.
type State int

const (
	// StateAbsent: no record, or an expired one.
	StateAbsent State = State(pb.State_STATE_ABSENT)
	// StateInProgress: claimed and not yet completed or released (the lease may have run out).
	StateInProgress State = State(pb.State_STATE_IN_PROGRESS)
	// StateCompleted: the stored response is replayed to every Claim.
	StateCompleted State = State(pb.State_STATE_COMPLETED)
	// StateReleased: released after a failed attempt; the next Claim takes it.
	StateReleased State = State(pb.State_STATE_RELEASED)
)

func (s State) String() string {
	switch s {
	case StateAbsent:
		return "ABSENT"
	case StateInProgress:
		return "IN_PROGRESS"
	case StateCompleted:
		return "COMPLETED"
	case StateReleased:
		return "RELEASED"
	}
	return fmt.Sprintf("State(%d)", int(s))
}

// Record is what Get found. For StateAbsent no other field is set, unless
// the key is remembered (Remembered: its completed result expired, its
// marker is kept until RememberedUntil): then FencingToken, Fingerprint,
// ExpiresAt (when the result expired), CreatedAt, CompletedAt and
// RememberedUntil describe the marker.
type Record struct {
	State          State
	FencingToken   uint64
	Fingerprint    []byte
	Response       []byte    // StateCompleted only
	LeaseExpiresAt time.Time // StateInProgress only (may be past)
	ExpiresAt      time.Time
	CreatedAt      time.Time
	UpdatedAt      time.Time
	// StateInProgress and StateReleased: the last checkpoint saved; nil when
	// there is none.
	Checkpoint []byte
	// The fencing token of the lease that saved Checkpoint; 0 when none.
	CheckpointFencingToken uint64
	// StateCompleted, or a remembered key: when it was completed.
	CompletedAt time.Time
	// StateCompleted: until when the key will be remembered once its result
	// expires (zero when the server or namespace remembers nothing past the
	// retention). StateAbsent: set only for a remembered key.
	RememberedUntil time.Time
}

// Remembered reports whether the key is remembered: completed, its result
// expired, and a Claim before RememberedUntil follows its late-retry policy.
func (r *Record) Remembered() bool { return r.State == StateAbsent && !r.RememberedUntil.IsZero() }

// Get inspects a key without changing it.
func (c *Client) Get(ctx context.Context, namespace, key string) (*Record, error) {
	reply, err := c.stub.Get(ctx, &pb.GetRequest{Namespace: namespace, Key: key})
	if err != nil {
		return nil, fromRPC("Get", err)
	}
	record := &Record{
		State:           State(reply.GetState()),
		FencingToken:    reply.GetFencingToken(),
		Fingerprint:     reply.GetFingerprint(),
		Response:        reply.GetResponse(),
		LeaseExpiresAt:  timestamp(reply.GetLeaseExpiresAt()),
		ExpiresAt:       timestamp(reply.GetExpiresAt()),
		CreatedAt:       timestamp(reply.GetCreatedAt()),
		UpdatedAt:       timestamp(reply.GetUpdatedAt()),
		CompletedAt:     timestamp(reply.GetCompletedAt()),
		RememberedUntil: timestamp(reply.GetRememberedUntil()),
	}
	record.Checkpoint, record.CheckpointFencingToken = checkpoint(reply.GetCheckpoint(), reply.GetCheckpointFencingToken())
	return record, nil
}

func duration(d time.Duration) *durationpb.Duration {
	if d == 0 {
		return nil
	}
	return durationpb.New(d)
}

func timestamp(t *timestamppb.Timestamp) time.Time {
	if t == nil {
		return time.Time{}
	}
	return t.AsTime()
}
