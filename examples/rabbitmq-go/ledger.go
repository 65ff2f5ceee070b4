package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
)

// Ledger is the consumer's effect: one file per order in a folder (standing
// in for a table), written only by the newest lease holder. The fencing
// token is what makes that safe: a consumer whose lease ran out while it was
// stalled (a GC pause, a network partition) comes back with an older token
// than the one that took the order over, and its write is refused, so a
// late writer can never overwrite the newer one's result.
//
// Every write is also appended to applied.log (order and token), so a test
// can see how often the effect ran and under which leases.
type Ledger struct{ dir string }

// Entry is what the ledger keeps for an order.
type Entry struct {
	OrderID      string `json:"order_id"`
	AmountCents  int64  `json:"amount_cents"`
	FencingToken uint64 `json:"fencing_token"`
}

// ErrStaleLease: a newer lease holder already wrote this order.
var ErrStaleLease = errors.New("ledger: a newer lease holder wrote this order")

func OpenLedger(dir string) (*Ledger, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	return &Ledger{dir: dir}, nil
}

// Apply writes the order's entry under the given fencing token, unless an
// entry with a newer token is there (ErrStaleLease). The same token again
// rewrites the same entry: Apply is an upsert keyed by the order.
func (l *Ledger) Apply(order Order, fencingToken uint64) (Entry, error) {
	unlock, err := l.lock()
	if err != nil {
		return Entry{}, err
	}
	defer unlock()

	path := l.path(order.ID)
	if existing, err := l.read(path); err == nil && existing.FencingToken > fencingToken {
		return Entry{}, fmt.Errorf("%w (order %s: token %d, ours %d)", ErrStaleLease, order.ID, existing.FencingToken, fencingToken)
	} else if err != nil && !errors.Is(err, os.ErrNotExist) {
		return Entry{}, err
	}
	entry := Entry{OrderID: order.ID, AmountCents: order.AmountCents, FencingToken: fencingToken}
	data, _ := json.Marshal(entry)
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return Entry{}, err
	}
	if err := os.Rename(tmp, path); err != nil {
		return Entry{}, err
	}
	log, err := os.OpenFile(filepath.Join(l.dir, "applied.log"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return Entry{}, err
	}
	defer log.Close()
	if _, err := fmt.Fprintf(log, "%s %d\n", order.ID, fencingToken); err != nil {
		return Entry{}, err
	}
	return entry, nil
}

// Entries is every order's entry.
func (l *Ledger) Entries() (map[string]Entry, error) {
	paths, err := filepath.Glob(filepath.Join(l.dir, "order-*.json"))
	if err != nil {
		return nil, err
	}
	entries := map[string]Entry{}
	for _, path := range paths {
		entry, err := l.read(path)
		if err != nil {
			return nil, err
		}
		entries[entry.OrderID] = entry
	}
	return entries, nil
}

func (l *Ledger) path(orderID string) string {
	return filepath.Join(l.dir, "order-"+orderID+".json")
}

func (l *Ledger) read(path string) (Entry, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return Entry{}, err
	}
	var entry Entry
	err = json.Unmarshal(data, &entry)
	return entry, err
}

// lock serialises writers across processes (flock on the folder's .lock).
func (l *Ledger) lock() (func(), error) {
	f, err := os.OpenFile(filepath.Join(l.dir, ".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		f.Close()
		return nil, err
	}
	return func() { f.Close() }, nil // closing releases the lock
}
