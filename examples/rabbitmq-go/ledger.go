package main

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
)

// Ledger is the consumer's effect: one file per order in a folder (standing
// in for a table), written only by the newest lease holder, and only for the
// body that first wrote it.
//
//   - The fencing token: a consumer whose lease ran out while it was stalled
//     (a GC pause, a network partition) comes back with an older token than
//     the one that took the order over, and writes nothing, so a late writer
//     can never overwrite the newer one's result. A newer token rewrites the
//     same entry: a takeover after a consumer died before Complete, or a late
//     copy the service re-executes under the next token (the receipt expired,
//     the order is still remembered): still one entry.
//   - An equal or older token writes nothing, and gets the entry that is
//     there as its receipt (Complete then decides: refused for a stalled
//     holder). That is also the late copy after the service forgot the key
//     (past its horizon the record is deleted): its new record starts again
//     at token 1, the token the entry already has; it completes with the
//     entry as its receipt, and nothing is written twice.
//   - The body's fingerprint: another body under an order id already applied
//     is refused whatever its token (ErrConflict), because once the receipt
//     expired the service no longer compares fingerprints (a late retry is
//     re-executed; a forgotten key has none). The consumer parks it.
//
// Every write is also appended to applied.log (order and token), so a test
// can see how often the effect ran and under which leases. Each write is
// fsynced (the file, then its folder after the rename) before Apply returns,
// so an acked order's entry survives a crash of the machine.
type Ledger struct{ dir string }

// Entry is what the ledger keeps for an order.
type Entry struct {
	OrderID      string `json:"order_id"`
	AmountCents  int64  `json:"amount_cents"`
	FencingToken uint64 `json:"fencing_token"`
	// BodySHA256 is the fingerprint of the body that wrote it (hex).
	BodySHA256 string `json:"body_sha256"`
}

// ErrConflict: the order was applied with another body.
var ErrConflict = errors.New("ledger: this order was applied with another body")

func OpenLedger(dir string) (*Ledger, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	return &Ledger{dir: dir}, nil
}

// Apply writes the order's entry under the given fencing token and returns
// it with wrote=true, when there is no entry or the entry is the same body's
// under an older token (a takeover rewrites the same values). When the entry
// is the same body's under an equal or newer token, it writes nothing and
// returns that entry with wrote=false. Another body's entry: ErrConflict.
func (l *Ledger) Apply(order Order, bodySHA256 []byte, fencingToken uint64) (entry Entry, wrote bool, err error) {
	unlock, err := l.lock()
	if err != nil {
		return Entry{}, false, err
	}
	defer unlock()

	path := l.path(order.ID)
	fp := hex.EncodeToString(bodySHA256)
	if existing, err := l.read(path); err == nil {
		if existing.BodySHA256 != fp {
			return Entry{}, false, conflict(existing, order)
		}
		if existing.FencingToken >= fencingToken {
			return existing, false, nil
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return Entry{}, false, err
	}
	entry = Entry{OrderID: order.ID, AmountCents: order.AmountCents, FencingToken: fencingToken, BodySHA256: fp}
	data, _ := json.Marshal(entry)
	// Durable before Apply returns, since the message is acked after it: the
	// new file's bytes (fsync), then its name (rename, then fsync of the
	// folder). Without them a crash of the machine (power, kernel) after the
	// ack can lose an effect whose message is gone, or leave an empty file.
	tmp := path + ".tmp"
	if err := writeSynced(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, data); err != nil {
		return Entry{}, false, err
	}
	if err := os.Rename(tmp, path); err != nil {
		return Entry{}, false, err
	}
	if err := syncDir(l.dir); err != nil {
		return Entry{}, false, err
	}
	line := []byte(fmt.Sprintf("%s %d\n", order.ID, fencingToken))
	if err := writeSynced(filepath.Join(l.dir, "applied.log"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, line); err != nil {
		return Entry{}, false, err
	}
	return entry, true, nil
}

// writeSynced writes data to the file opened with flag, and fsyncs it.
func writeSynced(path string, flag int, data []byte) error {
	f, err := os.OpenFile(path, flag, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// syncDir fsyncs a folder, so that a rename (or a new file) in it is durable.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// Lookup is the order's entry, and whether there is one.
func (l *Ledger) Lookup(orderID string) (Entry, bool, error) {
	entry, err := l.read(l.path(orderID))
	if errors.Is(err, os.ErrNotExist) {
		return Entry{}, false, nil
	}
	return entry, err == nil, err
}

// conflict is ErrConflict with what the ledger holds and what this body says.
func conflict(existing Entry, order Order) error {
	return fmt.Errorf("%w (order %s: %d cents under token %d; this body: %d cents)",
		ErrConflict, order.ID, existing.AmountCents, existing.FencingToken, order.AmountCents)
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
