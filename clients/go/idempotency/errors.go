package idempotency

import (
	"errors"
	"fmt"
	"time"

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
)

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
}

func (e *StatusError) Error() string {
	msg := fmt.Sprintf("idempotency %s: %s: %s", e.Method, e.Status.Code(), e.Status.Message())
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
	return &StatusError{Method: method, Status: st, Attempts: attempts, Target: target}
}

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
