// Command go_side is the Go half of the cross-language test
// (test_cross_language_go.py): it derives the key and fingerprint from the
// fields and payload it is given, runs Once with a work that returns
// `result`, and prints what happened as one JSON line.
//
//	go_side '{"target": "...", "namespace": "...", "fields": [...],
//	          "payload": {...}, "result": {...}, "onInProgress": "throw"}'
//
// Built by clients/go/build.sh (GOPATH mode, Debian's Go packages).
package main

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"os"
	"time"

	"idempotencyservice/idempotency"
)

type request struct {
	Target       string          `json:"target"`
	Namespace    string          `json:"namespace"`
	Fields       []any           `json:"fields"`
	Payload      any             `json:"payload"`
	Result       json.RawMessage `json:"result"`
	OnInProgress string          `json:"onInProgress"`
}

type report struct {
	Key         string          `json:"key"`
	Fingerprint string          `json:"fingerprint"`
	Ran         bool            `json:"ran"`
	Replayed    *bool           `json:"replayed,omitempty"`
	Value       json.RawMessage `json:"value,omitempty"`
	Error       string          `json:"error,omitempty"`
	Message     string          `json:"message,omitempty"`
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: go_side REQUEST_JSON")
		os.Exit(2)
	}
	out, err := run(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, "go_side:", err)
		os.Exit(2)
	}
	line, err := json.Marshal(out)
	if err != nil {
		fmt.Fprintln(os.Stderr, "go_side:", err)
		os.Exit(2)
	}
	fmt.Println(string(line))
}

func run(arg string) (*report, error) {
	dec := json.NewDecoder(bytes.NewReader([]byte(arg)))
	dec.UseNumber() // integers stay exact: they are key fields and payload numbers
	var req request
	if err := dec.Decode(&req); err != nil {
		return nil, fmt.Errorf("the request: %w", err)
	}
	fields := make([]any, len(req.Fields))
	for i, f := range req.Fields {
		if n, ok := f.(json.Number); ok {
			integer, ok := new(big.Int).SetString(n.String(), 10)
			if !ok {
				return nil, fmt.Errorf("field %d: %s is not an integer", i, n)
			}
			fields[i] = integer
		} else {
			fields[i] = f
		}
	}
	key, err := idempotency.DeriveKey(fields...)
	if err != nil {
		return nil, err
	}
	fp, err := idempotency.Fingerprint(req.Payload)
	if err != nil {
		return nil, err
	}
	out := &report{Key: key, Fingerprint: hex.EncodeToString(fp)}

	client, err := idempotency.Dial(req.Target)
	if err != nil {
		return nil, err
	}
	defer client.Close()
	opts := []idempotency.Option{idempotency.WithFingerprint(fp), idempotency.WaitOnInProgress(5 * time.Second)}
	switch req.OnInProgress {
	case "", "wait":
	case "throw":
		opts = append(opts, idempotency.FailOnInProgress())
	default:
		return nil, fmt.Errorf(`onInProgress must be "wait" or "throw", got %q`, req.OnInProgress)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	value, result, err := idempotency.OnceJSON(ctx, client, req.Namespace, key,
		func(context.Context, idempotency.Lease) (json.RawMessage, error) {
			out.Ran = true
			return req.Result, nil
		}, opts...)
	if err != nil {
		out.Error, out.Message = errorName(err), err.Error()
		return out, nil
	}
	out.Replayed = &result.Replayed
	out.Value = value
	return out, nil
}

// errorName is the error's class as the other clients name it.
func errorName(err error) string {
	var mismatch *idempotency.FingerprintMismatch
	var inProgress *idempotency.InProgress
	switch {
	case errors.As(err, &mismatch):
		return "FingerprintMismatch"
	case errors.As(err, &inProgress):
		return "InProgress"
	case errors.Is(err, idempotency.ErrLeaseLost):
		return "LeaseLost"
	case errors.Is(err, idempotency.ErrUnavailable):
		return "Unavailable"
	}
	return fmt.Sprintf("%T", err)
}
