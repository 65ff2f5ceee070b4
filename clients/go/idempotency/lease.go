package idempotency

import (
	"context"
	"errors"
	"sync"
	"time"
)

// Lease is what fn receives when this attempt holds the lease. Copies share
// the lease's checkpoint.
type Lease struct {
	Token string
	// FencingToken increases with every Claim that wins the key: hand it to
	// downstream writes so they can reject an older lease holder.
	FencingToken uint64
	// ExpiresAt is when the lease ran out at the Claim (the heartbeat moves it).
	ExpiresAt time.Time
	// PreviouslyCompletedAt is when the key was completed before, for a late
	// retry re-executed (the key was remembered after its result expired:
	// the effect ran once already, at that time); zero otherwise.
	PreviouslyCompletedAt time.Time

	held *heldLease
}

// Checkpoint is the last checkpoint: the one an earlier holder of the key
// saved (a worker that died or failed midway: how far the work got, to
// resume from), or the last one this work saved. nil when there is none
// (start from the beginning); non-nil and empty for an empty one.
func (l Lease) Checkpoint() []byte {
	if l.held == nil {
		return nil
	}
	checkpoint, _ := l.held.lastCheckpoint()
	return checkpoint
}

// CheckpointFencingToken is the fencing token of the lease that saved
// Checkpoint (lower than FencingToken when an earlier holder saved it); 0
// when there is no checkpoint.
func (l Lease) CheckpointFencingToken() uint64 {
	if l.held == nil {
		return 0
	}
	_, fencingToken := l.held.lastCheckpoint()
	return fencingToken
}

// SaveCheckpoint saves how far the work got (at most the server's limit,
// 64 KiB unless configured) under the lease, replacing the last one, and
// extends the lease: one ExtendLease. If this worker dies, whoever claims the
// key next receives it as its Checkpoint(); if fn fails, Once's Release
// carries it; Complete discards it. Saves are made one at a time, so the
// last one saved is the last one asked for.
//
// When the lease is gone it returns a *LeaseLostError (errors.Is(err,
// ErrLeaseLost)) and fn's context is cancelled: stop, someone else may be
// doing the work. Another failure (ErrUnavailable after the client's
// retries) is returned as it is; the lease may well still be ours.
func (l Lease) SaveCheckpoint(ctx context.Context, checkpoint []byte) error {
	h := l.held
	if h == nil {
		return errors.New("idempotency: SaveCheckpoint: this Lease was not handed to the work by Once")
	}
	h.saving.Lock()
	defer h.saving.Unlock()
	if lost := h.lostErr(); lost != nil {
		return &LeaseLostError{Namespace: h.namespace, Key: h.key, When: "before the checkpoint was saved", Cause: lost}
	}
	// A copy (the caller may reuse its buffer), never nil: nil would keep
	// the checkpoint saved before.
	saved := append([]byte{}, checkpoint...)
	h.mu.Lock()
	h.lastAsked = saved
	h.mu.Unlock()
	if _, err := h.client.ExtendLeaseWithCheckpoint(ctx, h.namespace, h.key, h.token, h.leaseTTL, saved); err != nil {
		if leaseGone(err) {
			h.markLost(err)
			return &LeaseLostError{Namespace: h.namespace, Key: h.key, When: "while saving a checkpoint", Cause: err}
		}
		return err
	}
	h.mu.Lock()
	h.checkpoint, h.checkpointFencingToken = saved, l.FencingToken
	h.mu.Unlock()
	return nil
}

// heldLease is the state of a lease Once holds while fn runs, shared by
// fn's Lease, the heartbeat and Once.
type heldLease struct {
	client                *Client
	namespace, key, token string
	leaseTTL              time.Duration
	// cancelWork cancels fn's context when the lease is found gone.
	cancelWork context.CancelFunc

	saving sync.Mutex // one SaveCheckpoint at a time

	mu                     sync.Mutex
	checkpoint             []byte
	checkpointFencingToken uint64
	// lastAsked is the last checkpoint fn asked to save, saved or not: the
	// Release after a failure carries it.
	lastAsked []byte
	lost      error
}

func (h *heldLease) lastCheckpoint() ([]byte, uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.checkpoint, h.checkpointFencingToken
}

func (h *heldLease) lastAskedCheckpoint() []byte {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.lastAsked
}

// markLost records that the server says the lease is over, and cancels fn's context.
func (h *heldLease) markLost(err error) {
	h.mu.Lock()
	if h.lost == nil {
		h.lost = err
	}
	h.mu.Unlock()
	h.cancelWork()
}

func (h *heldLease) lostErr() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.lost
}

// heartbeat extends the lease every interval while fn runs.
type heartbeat struct {
	quit chan struct{}
	done chan struct{}
	once sync.Once
}

func (c *Client) startHeartbeat(ctx context.Context, held *heldLease, cfg *onceConfig) *heartbeat {
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
	// A beat's ExtendLease, retries included, ends before the next beat is
	// due (at least 1 s): one that cannot get through in time is the next
	// one's job, and stopping never waits long.
	beatTimeout := maxDuration(interval, time.Second)
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
			beatCtx, cancelBeat := context.WithTimeout(callCtx, beatTimeout)
			_, err := c.ExtendLease(beatCtx, held.namespace, held.key, held.token, cfg.leaseTTL)
			cancelBeat()
			if err == nil {
				continue
			}
			if leaseGone(err) {
				held.markLost(err)
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
