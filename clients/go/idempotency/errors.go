package idempotency

import (
	"errors"
	"fmt"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Sentinels for the gRPC statuses the service uses. A failed call returns a
// *StatusError that matches one of them with errors.Is:
//
//	if errors.Is(err, idempotency.ErrUnavailable) { /* retry with backoff */ }
var (
	// ErrInvalidArgument: INVALID_ARGUMENT, a field is missing, too long or
	// malformed (the message names it). Nothing was changed; retrying cannot help.
	ErrInvalidArgument = errors.New("invalid argument")
	// ErrNotFound: NOT_FOUND, Complete, Release or ExtendLease on a key that
	// does not exist or whose record expired (or was purged).
	ErrNotFound = errors.New("key not found")
	// ErrLeaseNotCurrent: FAILED_PRECONDITION, the lease token is not the key's
	// current one (the lease was lost to another claimant, was released, or
	// the key is completed).
	ErrLeaseNotCurrent = errors.New("lease not current")
	// ErrUnavailable: UNAVAILABLE or DEADLINE_EXCEEDED, the service or its
	// store cannot be reached; retry with backoff.
	ErrUnavailable = errors.New("unavailable")
	// ErrUnauthenticated: UNAUTHENTICATED, no credentials, or ones the
	// server's access policy does not know.
	ErrUnauthenticated = errors.New("unauthenticated")
	// ErrPermissionDenied: PERMISSION_DENIED, the policy does not grant the
	// caller this RPC or namespace. Nothing was changed.
	ErrPermissionDenied = errors.New("permission denied")
	// ErrResourceExhausted: RESOURCE_EXHAUSTED, over the caller's rate limit or
	// too many calls in flight on the server; retry with backoff.
	ErrResourceExhausted = errors.New("resource exhausted")

	// ErrLeaseLost: returned by Once (as a *LeaseLostError) when the lease was
	// lost while the work ran, so the result was NOT stored.
	ErrLeaseLost = errors.New("lease lost")

	// ErrKeyExpired: the key was completed, its stored result has expired,
	// and the server still remembers it: the effect happened, the result is
	// gone. Matched by a *StatusError whose Reason is ReasonKeyExpired (a
	// Complete, Release or ExtendLease of a remembered key: NOT_FOUND, so
	// errors.Is(err, ErrNotFound) holds too) and by Once's *ResultExpired (a
	// Claim refused as a late retry: OutcomeExpired).
	ErrKeyExpired = errors.New("key expired")
)

// The stable reasons the service puts in google.rpc.ErrorInfo on every
// status other than OK (StatusError.Reason); the proto's ErrorReason
// documents each. Reasons are added, never renamed.
const (
	ReasonInvalidArgument  = "INVALID_ARGUMENT"  // fix the request; StatusError.Field names the field
	ReasonNotFound         = "NOT_FOUND"         // no unexpired record: the lease and record expired, or the key was purged
	ReasonKeyExpired       = "KEY_EXPIRED"       // completed, result expired, still remembered (StatusError.CompletedAt, RememberedUntil)
	ReasonLeaseLost        = "LEASE_LOST"        // the token is not the key's current lease
	ReasonLeaseReleased    = "LEASE_RELEASED"    // this lease was released
	ReasonKeyCompleted     = "KEY_COMPLETED"     // completed under another lease, or cannot be released or extended
	ReasonContended        = "CONTENDED"         // ABORTED: the key kept changing during the Claim; retry at once
	ReasonStoreUnavailable = "STORE_UNAVAILABLE" // UNAVAILABLE: the store cannot be reached; retry after RetryDelay
	ReasonUnauthenticated  = "UNAUTHENTICATED"
	ReasonPermissionDenied = "PERMISSION_DENIED"
	ReasonRateLimited      = "RATE_LIMITED" // RESOURCE_EXHAUSTED: retry after RetryDelay
	ReasonOverloaded       = "OVERLOADED"   // RESOURCE_EXHAUSTED: retry after RetryDelay, preferably elsewhere
	ReasonDeadlineExceeded = "DEADLINE_EXCEEDED"
	ReasonInternal         = "INTERNAL"
)

// ErrorDomain is the ErrorInfo domain of the service's statuses.
const ErrorDomain = "idempotency-service"

var byCode = map[codes.Code]error{
	codes.InvalidArgument:    ErrInvalidArgument,
	codes.NotFound:           ErrNotFound,
	codes.FailedPrecondition: ErrLeaseNotCurrent,
	codes.Unavailable:        ErrUnavailable,
	codes.DeadlineExceeded:   ErrUnavailable,
	codes.Unauthenticated:    ErrUnauthenticated,
	codes.PermissionDenied:   ErrPermissionDenied,
	codes.ResourceExhausted:  ErrResourceExhausted,
}

// StatusError is a call that failed with a gRPC status. errors.Is matches it
// against the sentinel of its code (ErrNotFound, ErrUnavailable, ...), and
// status.FromError / status.Code see the original status.
type StatusError struct {
	// Method is the RPC ("Claim", "Complete", ...).
	Method string
	// Status is the gRPC status the server (or the channel) answered, to
	// the last attempt.
	Status *status.Status
	// Attempts is how many attempts were made (1 when the call was not
	// retried; see RetryPolicy).
	Attempts int
	// Target is the address the last attempt went to ("" when unknown).
	Target string

	// The status's google.rpc details, decoded from the last attempt's
	// answer (empty when the status carries none: a server that predates
	// them, or a status the channel made, such as a connection refused).

	// Reason is google.rpc.ErrorInfo's stable reason (ReasonLeaseLost,
	// ReasonKeyExpired, ...); "" when there is none.
	Reason string
	// Domain is ErrorInfo's domain (ErrorDomain for the service's).
	Domain string
	// Metadata is ErrorInfo's metadata: "field" for INVALID_ARGUMENT,
	// "completed_at" and "remembered_until" (RFC 3339) for KEY_EXPIRED.
	Metadata map[string]string
	// RetryDelay is google.rpc.RetryInfo's retry_delay: how long to wait
	// before retrying the same call (UNAVAILABLE, RESOURCE_EXHAUSTED,
	// ABORTED); 0 when there is none. The client's retries never wait less.
	RetryDelay time.Duration
	// Field names the request field an INVALID_ARGUMENT is about (the
	// google.rpc.BadRequest field violation, else ErrorInfo's "field"); ""
	// otherwise.
	Field string
	// FieldDescription is the field violation's description.
	FieldDescription string
	// CompletedAt and RememberedUntil: for ReasonKeyExpired, when the key
	// was completed and until when it is remembered (zero otherwise).
	CompletedAt, RememberedUntil time.Time
}

func (e *StatusError) Error() string {
	code := e.Status.Code().String()
	if e.Reason != "" {
		code += " " + e.Reason
	}
	msg := fmt.Sprintf("idempotency %s: %s: %s", e.Method, code, e.Status.Message())
	if e.Attempts > 1 {
		msg += fmt.Sprintf(" (after %d attempts)", e.Attempts)
	}
	return msg
}

// Code is the gRPC status code.
func (e *StatusError) Code() codes.Code { return e.Status.Code() }

// GRPCStatus makes status.FromError and status.Code work on the error.
func (e *StatusError) GRPCStatus() *status.Status { return e.Status }

// Unwrap is the sentinel of the code (nil for codes without one).
func (e *StatusError) Unwrap() error { return byCode[e.Status.Code()] }

// Is makes errors.Is(err, ErrKeyExpired) true for ReasonKeyExpired (the
// code's sentinel, ErrNotFound, matches through Unwrap).
func (e *StatusError) Is(target error) bool {
	return target == ErrKeyExpired && e.Reason == ReasonKeyExpired
}

// fromRPC turns a failed call's error into a *StatusError; an error that
// carries no status (a cancelled context) is kept as it is.
func fromRPC(method string, err error) error {
	if err == nil {
		return nil
	}
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	attempts, target := attemptsOf(err)
	e := &StatusError{Method: method, Status: st, Attempts: attempts, Target: target}
	e.decodeDetails()
	return e
}

// decodeDetails reads the status's google.rpc details (ErrorInfo,
// RetryInfo, BadRequest) with grpc-go's own decoding (status.Details).
func (e *StatusError) decodeDetails() {
	d := detailsOf(e.Status)
	e.Reason, e.Domain, e.Metadata, e.RetryDelay = d.reason, d.domain, d.metadata, d.retryDelay
	e.Field, e.FieldDescription = d.field, d.fieldDescription
	if e.Field == "" && e.Reason == ReasonInvalidArgument {
		e.Field = e.Metadata["field"]
	}
	if e.Reason == ReasonKeyExpired {
		e.CompletedAt = parseRFC3339(e.Metadata["completed_at"])
		e.RememberedUntil = parseRFC3339(e.Metadata["remembered_until"])
	}
}

// details is what a status's google.rpc details say.
type details struct {
	reason, domain          string
	metadata                map[string]string
	retryDelay              time.Duration
	field, fieldDescription string
}

func detailsOf(st *status.Status) details {
	var d details
	if st == nil {
		return d
	}
	for _, detail := range st.Details() {
		switch detail := detail.(type) {
		case *errdetails.ErrorInfo:
			if d.reason == "" {
				d.reason, d.domain, d.metadata = detail.GetReason(), detail.GetDomain(), detail.GetMetadata()
			}
		case *errdetails.RetryInfo:
			if delay := detail.GetRetryDelay(); delay != nil && d.retryDelay == 0 {
				d.retryDelay = time.Duration(delay.GetSeconds())*time.Second + time.Duration(delay.GetNanos())
				if d.retryDelay < 0 {
					d.retryDelay = 0
				}
			}
		case *errdetails.BadRequest:
			if violations := detail.GetFieldViolations(); len(violations) > 0 && d.field == "" {
				d.field, d.fieldDescription = violations[0].GetField(), violations[0].GetDescription()
			}
		}
	}
	return d
}

// retryDelayOf is an attempt's error's RetryInfo delay (0 when none).
func retryDelayOf(err error) time.Duration {
	st, ok := status.FromError(err)
	if !ok {
		return 0
	}
	return detailsOf(st).retryDelay
}

func parseRFC3339(s string) time.Time {
	if s == "" {
		return time.Time{}
	}
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return time.Time{}
	}
	return t
}

// ResultExpired is Once's answer to a late retry its policy refuses
// (LateRetryRefuse, or the namespace's or server's policy): the key was
// completed at CompletedAt, its stored result has expired, and the server
// still remembers it (OutcomeExpired). The effect happened; the result is
// gone; the work did not run. errors.Is(err, ErrKeyExpired) is true.
type ResultExpired struct {
	Namespace, Key string
	// CompletedAt is when the key was completed.
	CompletedAt time.Time
	// FencingToken is the fencing token of the last lease (the one that
	// completed); a later holder of the key gets a higher one.
	FencingToken uint64
}

func (e *ResultExpired) Error() string {
	return fmt.Sprintf("idempotency: %s/%s: completed at %s, its result has expired (a late retry, refused)",
		e.Namespace, e.Key, e.CompletedAt.UTC().Format(time.RFC3339))
}

// Is makes errors.Is(err, ErrKeyExpired) true.
func (e *ResultExpired) Is(target error) bool { return target == ErrKeyExpired }

// FingerprintMismatch is Once's answer when the key was already seen with
// another payload fingerprint: the same event identity arrived with a
// different payload. Nothing was changed and the work did not run.
type FingerprintMismatch struct {
	Namespace, Key string
}

func (e *FingerprintMismatch) Error() string {
	return fmt.Sprintf("idempotency: %s/%s: the key was seen with another payload fingerprint", e.Namespace, e.Key)
}

// InProgress is Once's answer when another claimant holds the key's lease
// (when waiting: still held it when the wait ran out, or when the context's
// deadline came near). The work did not run; try again after RetryAfter.
type InProgress struct {
	Namespace, Key string
	// RetryAfter is the time that was left on the other claimant's lease.
	RetryAfter time.Duration
	// LeaseExpiresAt is when the other claimant's lease runs out.
	LeaseExpiresAt time.Time
	// Waited is how long Once waited before giving up (0 with FailOnInProgress).
	Waited time.Duration
	// Polled is true when Once claimed again with backoff because the
	// server did not wait (one that predates waiting), or was not asked to
	// (PollOnInProgress).
	Polled bool
}

func (e *InProgress) Error() string {
	how := "in progress"
	if e.Waited > 0 {
		how = fmt.Sprintf("still in progress after waiting %s", e.Waited)
	}
	return fmt.Sprintf("idempotency: %s/%s: %s (another claimant holds the lease; retry after %s)",
		e.Namespace, e.Key, how, e.RetryAfter)
}

// LeaseLostError is Once's answer when the lease was lost while the work ran:
// the heartbeat's ExtendLease, or the final Complete, answered NOT_FOUND or
// FAILED_PRECONDITION. The result was not stored and someone else may be
// doing the work; the work's effect happened, and whether to compensate is
// the caller's decision. errors.Is(err, ErrLeaseLost) is true; Cause is the
// call's error (a *StatusError).
type LeaseLostError struct {
	Namespace, Key string
	// When says where the loss was seen: "while the work ran" (the heartbeat)
	// or "before Complete".
	When  string
	Cause error
}

func (e *LeaseLostError) Error() string {
	return fmt.Sprintf("idempotency: %s/%s: the lease was lost %s; the result was not stored: %v",
		e.Namespace, e.Key, e.When, e.Cause)
}

// Is makes errors.Is(err, ErrLeaseLost) true.
func (e *LeaseLostError) Is(target error) bool { return target == ErrLeaseLost }

// Unwrap is the call's error.
func (e *LeaseLostError) Unwrap() error { return e.Cause }

// leaseGone: the server says this lease is over (NOT_FOUND or FAILED_PRECONDITION).
func leaseGone(err error) bool {
	return errors.Is(err, ErrNotFound) || errors.Is(err, ErrLeaseNotCurrent)
}
