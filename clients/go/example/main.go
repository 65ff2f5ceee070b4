// Command example walks one event through idempotency-service from Go: Claim,
// Complete, then Claim again to see the replay (and a different payload to see
// the fingerprint check). It prints each outcome and exits non-zero on any
// outcome it did not expect.
//
//	go run ./clients/go/example -target 127.0.0.1:50051
//
// The idempotency.v1 package is generated from proto/ by clients/go/run-tests.sh
// (protoc with protoc-gen-go and protoc-gen-go-grpc); it is not committed.
package main

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"flag"
	"fmt"
	"os"
	"time"

	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "idempotencyservice/gen/idempotencyv1"
)

func main() {
	target := flag.String("target", "127.0.0.1:50051", "the service's address")
	namespace := flag.String("namespace", "go-example", "the namespace to use")
	key := flag.String("key", "", "the event's key (default: a new random key, so every run starts fresh)")
	wait := flag.Duration("wait", 30*time.Second, "how long to wait for the service to be SERVING")
	flag.Parse()
	if *key == "" {
		*key = "order-" + randomHex(8)
	}

	conn, err := grpc.Dial(*target, grpc.WithInsecure())
	if err != nil {
		fail("dial %s: %v", *target, err)
	}
	defer conn.Close()
	if err := waitUntilServing(conn, *wait); err != nil {
		fail("%v", err)
	}
	client := idempotencyv1.NewIdempotencyServiceClient(conn)
	check := checker{}

	payload := []byte(`{"order_id":"o-42","total_cents":1998}`)
	fingerprint := sha256.Sum256(payload)

	// 1. The first delivery wins the lease.
	claim, err := call(func(ctx context.Context) (*idempotencyv1.ClaimResponse, error) {
		return client.Claim(ctx, &idempotencyv1.ClaimRequest{
			Namespace:   *namespace,
			Key:         *key,
			Fingerprint: fingerprint[:],
			LeaseTtl:    durationpb.New(30 * time.Second),
		})
	})
	check.expect("first Claim", err, claim.GetOutcome(), idempotencyv1.Outcome_OUTCOME_CLAIMED)
	fmt.Printf("  lease_token=%s fencing_token=%d lease_expires_at=%s\n",
		claim.GetLeaseToken(), claim.GetFencingToken(), claim.GetLeaseExpiresAt().AsTime().Format(time.RFC3339))

	// 2. The work is done (here: nothing); store its result.
	result := []byte(`{"charge":"ch_go_1"}`)
	completed, err := call(func(ctx context.Context) (*idempotencyv1.CompleteResponse, error) {
		return client.Complete(ctx, &idempotencyv1.CompleteRequest{
			Namespace:  *namespace,
			Key:        *key,
			LeaseToken: claim.GetLeaseToken(),
			Response:   result,
		})
	})
	check.ok("Complete", err)
	fmt.Printf("  expires_at=%s\n", completed.GetExpiresAt().AsTime().Format(time.RFC3339))

	// 3. A redelivery of the same event gets the stored result: the replay.
	replay, err := call(func(ctx context.Context) (*idempotencyv1.ClaimResponse, error) {
		return client.Claim(ctx, &idempotencyv1.ClaimRequest{Namespace: *namespace, Key: *key, Fingerprint: fingerprint[:]})
	})
	check.expect("second Claim", err, replay.GetOutcome(), idempotencyv1.Outcome_OUTCOME_COMPLETED)
	fmt.Printf("  response=%s\n", replay.GetResponse())
	if string(replay.GetResponse()) != string(result) {
		check.failf("second Claim replayed %q, want %q", replay.GetResponse(), result)
	}

	// 4. The same key with another payload is a mismatch, not a replay.
	other := sha256.Sum256([]byte(`{"order_id":"o-42","total_cents":1}`))
	mismatch, err := call(func(ctx context.Context) (*idempotencyv1.ClaimResponse, error) {
		return client.Claim(ctx, &idempotencyv1.ClaimRequest{Namespace: *namespace, Key: *key, Fingerprint: other[:]})
	})
	check.expect("Claim with another payload", err, mismatch.GetOutcome(), idempotencyv1.Outcome_OUTCOME_FINGERPRINT_MISMATCH)

	fmt.Printf("go example: %d passed, %d failed\n", check.passed, check.failed)
	if check.failed > 0 {
		os.Exit(1)
	}
}

// call runs one RPC with a deadline.
func call[T any](rpc func(context.Context) (T, error)) (T, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return rpc(ctx)
}

// waitUntilServing polls the health check until the service (and its store) is ready.
func waitUntilServing(conn *grpc.ClientConn, timeout time.Duration) error {
	health := healthpb.NewHealthClient(conn)
	deadline := time.Now().Add(timeout)
	last := "no answer yet"
	for time.Now().Before(deadline) {
		reply, err := call(func(ctx context.Context) (*healthpb.HealthCheckResponse, error) {
			return health.Check(ctx, &healthpb.HealthCheckRequest{Service: "idempotency.v1.IdempotencyService"})
		})
		if err == nil && reply.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return nil
		}
		if err != nil {
			last = err.Error()
		} else {
			last = reply.GetStatus().String()
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("service not SERVING after %s (%s)", timeout, last)
}

type checker struct{ passed, failed int }

func (c *checker) ok(step string, err error) {
	if err != nil {
		c.failf("%s: %v", step, err)
		return
	}
	c.passed++
	fmt.Printf("ok   %s\n", step)
}

func (c *checker) expect(step string, err error, got, want idempotencyv1.Outcome) {
	if err != nil {
		c.failf("%s: %v", step, err)
		return
	}
	if got != want {
		c.failf("%s: outcome %s, want %s", step, got, want)
		return
	}
	c.passed++
	fmt.Printf("ok   %s: %s\n", step, got)
}

func (c *checker) failf(format string, args ...any) {
	c.failed++
	fmt.Printf("FAIL "+format+"\n", args...)
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "go example: "+format+"\n", args...)
	os.Exit(1)
}

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}
