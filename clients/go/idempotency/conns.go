package idempotency

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/status"

	pb "idempotencyservice/gen/idempotencyv1"
)

// Addresses and connections: one grpc.ClientConn per address given, each
// call started on the next one in turn that is connected (else the next that
// is not failing), and each retry sent to the next one. So a retry after
// UNAVAILABLE lands on another replica, and a replica that is down gets no
// call while another is connected.
//
// Every connection balances round-robin over the addresses its name resolves
// to (a "dns:///name:port" target with several A records spreads over all of
// them and skips one that does not answer), and tries a replica that went
// away again at least every second (gRPC's default backs off to 2 minutes).

// defaultDialOptions come before the caller's, which override them.
var defaultDialOptions = []grpc.DialOption{
	grpc.WithDefaultServiceConfig(`{"loadBalancingConfig": [{"round_robin": {}}]}`),
	grpc.WithConnectParams(grpc.ConnectParams{
		Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
		MinConnectTimeout: 20 * time.Second,
	}),
}

// SplitTargets is the addresses of a target string: one address
// ("host:port"), several separated by commas ("10.0.0.1:50051,10.0.0.2:50051"),
// or gRPC targets ("dns:///idempotency.internal:50051"), each trimmed.
func SplitTargets(target string) []string {
	var targets []string
	for _, part := range strings.Split(target, ",") {
		if part = strings.TrimSpace(part); part != "" {
			targets = append(targets, part)
		}
	}
	return targets
}

// endpoint is one address and its connection.
type endpoint struct {
	target string
	cc     grpc.ClientConnInterface
	// state tells the connection's state; nil for a connection the caller
	// made that does not say.
	state func() connectivity.State
}

func newEndpoint(target string, cc grpc.ClientConnInterface) endpoint {
	e := endpoint{target: target, cc: cc}
	if s, ok := cc.(interface{ GetState() connectivity.State }); ok {
		e.state = s.GetState
	}
	return e
}

// conns is the grpc.ClientConnInterface the generated stub calls through:
// every call with its retries (Client.Retry), each attempt on an endpoint
// chosen by pick.
type conns struct {
	client    *Client
	endpoints []endpoint
	turn      uint32
}

// pick is the endpoint for attempt number attempt (0 for the first) of a
// call that started at first: in turn from there, the first that is
// connected (READY), else the first that is not failing (connecting, or
// idle), else the one in turn.
func (c *conns) pick(first uint32, attempt int) endpoint {
	count := len(c.endpoints)
	if count == 1 {
		return c.endpoints[0]
	}
	start := int((first + uint32(attempt)) % uint32(count))
	var notFailing = -1
	for offset := 0; offset < count; offset++ {
		index := (start + offset) % count
		e := c.endpoints[index]
		if e.state == nil {
			continue
		}
		switch e.state() {
		case connectivity.Ready:
			return e
		case connectivity.TransientFailure, connectivity.Shutdown:
		default:
			if notFailing < 0 {
				notFailing = index
			}
		}
	}
	if notFailing >= 0 {
		return c.endpoints[notFailing]
	}
	return c.endpoints[start]
}

// Invoke makes one call with its retries, within ctx's deadline (or
// Client.CallTimeout when ctx has none). The error is the last attempt's,
// carrying the number of attempts made.
func (c *conns) Invoke(ctx context.Context, method string, args, reply interface{}, opts ...grpc.CallOption) error {
	ctx, cancel := c.client.callContext(ctx, 0)
	defer cancel()
	policy := c.client.Retry
	first := atomic.AddUint32(&c.turn, 1) - 1
	for attempt := 0; ; attempt++ {
		e := c.pick(first, attempt)
		attemptCtx, cancelAttempt := ctx, context.CancelFunc(func() {})
		if timeout := perAttemptTimeout(policy, args); timeout > 0 {
			attemptCtx, cancelAttempt = context.WithTimeout(ctx, timeout)
		}
		err := e.cc.Invoke(attemptCtx, method, args, reply, opts...)
		cancelAttempt()
		if err == nil {
			return nil
		}
		made := attempt + 1
		pause, again := c.pauseAfter(ctx, policy, made, err)
		if !again {
			return &attemptsError{err: err, attempts: made, target: e.target}
		}
		if c.client.OnRetry != nil {
			c.client.OnRetry(Retry{Method: methodName(method), Target: e.target, Attempt: made, Err: err, Pause: pause})
		}
		timer := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			timer.Stop()
			return &attemptsError{err: err, attempts: made, target: e.target}
		case <-timer.C:
		}
	}
}

// perAttemptTimeout is the policy's bound on one attempt (0: none). It
// does not cut a Claim's wait short: a waiting Claim's attempts get at
// least the wait and waitAnswerMargin more (within the call's deadline).
func perAttemptTimeout(policy RetryPolicy, args interface{}) time.Duration {
	timeout := policy.PerAttemptTimeout
	if claim, ok := args.(*pb.ClaimRequest); ok && timeout > 0 && claim.GetWait() != nil {
		if least := claim.GetWait().AsDuration() + waitAnswerMargin; timeout < least {
			timeout = least
		}
	}
	return timeout
}

// waitAnswerMargin is the time a waiting Claim's answer is given to arrive
// after its wait ends.
const waitAnswerMargin = 500 * time.Millisecond

// pauseAfter is the pause before the next attempt, and whether there is one:
// not when the caller's context ended, the status is final, no attempt is
// left, or the deadline leaves no time for another. The pause is the
// policy's backoff, or the status's RetryInfo delay when that is longer
// (there is no next attempt when the deadline leaves no room for that delay).
func (c *conns) pauseAfter(ctx context.Context, policy RetryPolicy, made int, err error) (time.Duration, bool) {
	if ctx.Err() != nil || !policy.retryable(status.Code(err)) || made >= policy.MaxAttempts {
		return 0, false
	}
	pause := policy.Backoff(made)
	// The server's advice (google.rpc.RetryInfo) is the least pause: it
	// knows when the rate limit allows the next call, or the store may be back.
	delay := retryDelayOf(err)
	if pause < delay {
		pause = delay
	}
	if deadline, ok := ctx.Deadline(); ok {
		// A pause that would leave too little time is cut short, so the last
		// attempt still happens before the deadline; but never below the
		// server's delay: then the call fails now.
		room := time.Until(deadline) - minAttempt
		if room <= 0 || delay > room {
			return 0, false
		}
		if pause > room {
			pause = room
		}
	}
	return pause, true
}

// NewStream opens a stream on the next endpoint in turn, without retries
// (the service has no streaming calls; this is for other services' stubs on
// the same connections).
func (c *conns) NewStream(ctx context.Context, desc *grpc.StreamDesc, method string, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	return c.pick(atomic.AddUint32(&c.turn, 1)-1, 0).cc.NewStream(ctx, desc, method, opts...)
}

// Retry is what Client.OnRetry is told before a retry.
type Retry struct {
	// Method is the RPC ("Claim", "Complete", ...).
	Method string
	// Target is the address the failed attempt went to.
	Target string
	// Attempt is the failed attempt's number (1 for the first).
	Attempt int
	// Err is the failed attempt's error (a gRPC status error).
	Err error
	// Pause is the wait before the next attempt.
	Pause time.Duration
}

func (r Retry) String() string {
	st := status.Convert(r.Err)
	return fmt.Sprintf("idempotency: %s attempt %d on %s failed (%s: %s); retrying in %s",
		r.Method, r.Attempt, r.Target, st.Code(), st.Message(), r.Pause.Round(time.Millisecond))
}

// attemptsError is a call's last error with the number of attempts made.
// status.FromError sees the status through GRPCStatus.
type attemptsError struct {
	err      error
	attempts int
	target   string
}

func (e *attemptsError) Error() string { return e.err.Error() }

func (e *attemptsError) Unwrap() error { return e.err }

func (e *attemptsError) GRPCStatus() *status.Status { return status.Convert(e.err) }

// attemptsOf is the number of attempts a call's error records (1 when it does not).
func attemptsOf(err error) (int, string) {
	var attempts *attemptsError
	if errors.As(err, &attempts) {
		return attempts.attempts, attempts.target
	}
	return 1, ""
}

// methodName is "Claim" for "/idempotency.v1.IdempotencyService/Claim".
func methodName(fullMethod string) string {
	return fullMethod[strings.LastIndex(fullMethod, "/")+1:]
}
