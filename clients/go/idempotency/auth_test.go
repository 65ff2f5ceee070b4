package idempotency_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/grpc"

	"idempotencyservice/idempotency"
	"idempotencyservice/idempotency/idempotencytest"
)

func TestABearerTokenIsSentWithEveryCallAndRefusalsAreTyped(t *testing.T) {
	const token = "idem_go_test_0123456789abcdef"
	sum := sha256.Sum256([]byte(token))
	policy := filepath.Join(t.TempDir(), "policy.toml")
	err := os.WriteFile(policy, []byte(`
[[identity]]
name = "go-test"
token_hashes = ["sha256:`+hex.EncodeToString(sum[:])+`"]
namespaces = ["go-auth/*"]
`), 0o644)
	if err != nil {
		t.Fatal(err)
	}
	server := idempotencytest.Start(t, "IDEMPOTENCY_POLICY_FILE="+policy)
	ctx := ctx(t)

	anonymous := server.Client(t)
	if _, err := anonymous.Claim(ctx, "go-auth/a", "k", idempotency.ClaimOptions{}); !errors.Is(err, idempotency.ErrUnauthenticated) {
		t.Errorf("without a token: %v, want ErrUnauthenticated", err)
	}

	client, err := idempotency.Dial(server.Target, grpc.WithInsecure(), idempotency.BearerToken(token))
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	r, err := client.Once(ctx, "go-auth/a", "k", func(ctx context.Context, _ idempotency.Lease) ([]byte, error) { return []byte("ok"), nil })
	if err != nil || string(r.Value) != "ok" {
		t.Fatalf("with the token: %+v %v", r, err)
	}
	if _, err := client.Claim(ctx, "elsewhere", "k", idempotency.ClaimOptions{}); !errors.Is(err, idempotency.ErrPermissionDenied) {
		t.Errorf("another namespace: %v, want ErrPermissionDenied", err)
	}
}
