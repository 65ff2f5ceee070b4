package idempotency

import (
	"context"
	"fmt"
	"log"
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

// Client calls idempotency-service. It is safe for concurrent use.
type Client struct {
	conn *grpc.ClientConn // nil when the caller owns the connection
	stub pb.IdempotencyServiceClient
	cc   grpc.ClientConnInterface

	// CallTimeout bounds each call whose context has no deadline
	// (DefaultCallTimeout unless changed; 0: no bound).
	CallTimeout time.Duration
	// Logf reports what Once cannot return: a heartbeat's transient failure,
	// a failed Release after fn failed (log.Printf unless changed; nil: silent).
	Logf func(format string, args ...any)
}

// Dial connects to target ("host:port"). Without options the connection is
// plaintext (grpc.WithInsecure()); pass grpc.WithTransportCredentials(...) for
// TLS and grpc.WithPerRPCCredentials(...) for a bearer token. Close the
// client when done.
func Dial(target string, opts ...grpc.DialOption) (*Client, error) {
	if len(opts) == 0 {
		opts = []grpc.DialOption{grpc.WithInsecure()}
	}
	conn, err := grpc.Dial(target, opts...)
	if err != nil {
		return nil, fmt.Errorf("idempotency: dial %s: %w", target, err)
	}
	c := NewClient(conn)
	c.conn = conn
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

// NewClient uses a connection the caller made (and closes).
func NewClient(cc grpc.ClientConnInterface) *Client {
	return &Client{stub: pb.NewIdempotencyServiceClient(cc), cc: cc, CallTimeout: DefaultCallTimeout, Logf: log.Printf}
}

// Stub is the generated client, for the calls this package does not wrap
// (Purge, ClaimBatch, CompleteBatch).
func (c *Client) Stub() pb.IdempotencyServiceClient { return c.stub }

// Close closes the connection Dial made (a no-op for NewClient's).
func (c *Client) Close() error {
	if c.conn == nil {
		return nil
	}
	return c.conn.Close()
}

func (c *Client) callContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok || c.CallTimeout <= 0 {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, c.CallTimeout)
}

// WaitUntilServing polls the health check until the service (and its store)
// is SERVING, or ctx ends.
func (c *Client) WaitUntilServing(ctx context.Context) error {
	health := healthpb.NewHealthClient(c.cc)
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
	}
	return fmt.Sprintf("Outcome(%d)", int(o))
}

// ClaimOptions are Claim's optional fields; the zero value uses the server's defaults.
type ClaimOptions struct {
	// Fingerprint of the payload (see Fingerprint), at most 64 bytes; nil: no check.
	Fingerprint []byte
	// LeaseTTL is the lease's length if this Claim wins (0: the server's default, 30 s).
	LeaseTTL time.Duration
	// Retention is how long the completed result is replayed (0: the server's default, 24 h).
	Retention time.Duration
}

// ClaimResult is what a Claim found; Outcome says which fields are set.
type ClaimResult struct {
	Outcome Outcome
	// OutcomeClaimed: the lease's secret, for Complete, Release and ExtendLease.
	LeaseToken string
	// OutcomeClaimed: increases by one on every successful Claim of the key;
	// hand it to downstream writes so they can reject an older lease holder.
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
}

// Claimed reports whether the caller now holds the lease.
func (r *ClaimResult) Claimed() bool { return r.Outcome == OutcomeClaimed }

// Claim tries to take the lease on a key. Losing a race is an outcome
// (OutcomeInProgress), never an error.
func (c *Client) Claim(ctx context.Context, namespace, key string, opts ClaimOptions) (*ClaimResult, error) {
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	reply, err := c.stub.Claim(ctx, &pb.ClaimRequest{
		Namespace:   namespace,
		Key:         key,
		Fingerprint: opts.Fingerprint,
		LeaseTtl:    duration(opts.LeaseTTL),
		Retention:   duration(opts.Retention),
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
	}
	if reply.GetRetryAfter() != nil {
		r.RetryAfter = reply.GetRetryAfter().AsDuration()
	}
	if r.Response == nil && r.Outcome == OutcomeCompleted {
		r.Response = []byte{}
	}
	return r
}

// Complete stores the result of the work done under a lease; later Claims of
// the key replay it. retention 0: the Claim's retention, else the server's
// default. It returns when the stored result expires. Retrying a Complete
// that succeeded returns the same answer.
func (c *Client) Complete(ctx context.Context, namespace, key, leaseToken string, response []byte, retention time.Duration) (time.Time, error) {
	ctx, cancel := c.callContext(ctx)
	defer cancel()
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
func (c *Client) Release(ctx context.Context, namespace, key, leaseToken string) error {
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	_, err := c.stub.Release(ctx, &pb.ReleaseRequest{Namespace: namespace, Key: key, LeaseToken: leaseToken})
	return fromRPC("Release", err)
}

// ExtendLease sets the lease to run out leaseTTL from now (0: the server's
// default) and returns when it now runs out.
func (c *Client) ExtendLease(ctx context.Context, namespace, key, leaseToken string, leaseTTL time.Duration) (time.Time, error) {
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	reply, err := c.stub.ExtendLease(ctx, &pb.ExtendLeaseRequest{
		Namespace: namespace, Key: key, LeaseToken: leaseToken, LeaseTtl: duration(leaseTTL),
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

// Record is what Get found. For StateAbsent no other field is set.
type Record struct {
	State          State
	FencingToken   uint64
	Fingerprint    []byte
	Response       []byte    // StateCompleted only
	LeaseExpiresAt time.Time // StateInProgress only (may be past)
	ExpiresAt      time.Time
	CreatedAt      time.Time
	UpdatedAt      time.Time
}

// Get inspects a key without changing it.
func (c *Client) Get(ctx context.Context, namespace, key string) (*Record, error) {
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	reply, err := c.stub.Get(ctx, &pb.GetRequest{Namespace: namespace, Key: key})
	if err != nil {
		return nil, fromRPC("Get", err)
	}
	return &Record{
		State:          State(reply.GetState()),
		FencingToken:   reply.GetFencingToken(),
		Fingerprint:    reply.GetFingerprint(),
		Response:       reply.GetResponse(),
		LeaseExpiresAt: timestamp(reply.GetLeaseExpiresAt()),
		ExpiresAt:      timestamp(reply.GetExpiresAt()),
		CreatedAt:      timestamp(reply.GetCreatedAt()),
		UpdatedAt:      timestamp(reply.GetUpdatedAt()),
	}, nil
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
