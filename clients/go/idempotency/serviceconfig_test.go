package idempotency_test

// grpc-go's own retries (not this package's) honour the service config the
// repository publishes (clients/service-config.json): a retry-safe Claim (a
// lease token of the caller's) made while the server's PostgreSQL is cut off
// is answered UNAVAILABLE (STORE_UNAVAILABLE), and grpc-go retries it by
// itself until the store is back; with retries disabled the caller gets
// the UNAVAILABLE. The server's metrics count its UNAVAILABLE answers.
//
// Debian's grpc-go is 1.33, which applies a service config's retryPolicy
// only when GRPC_GO_RETRY=on (1.40 and later retry by default): the test
// runs itself again in a child process with that set.

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "idempotencyservice/gen/idempotencyv1"
	"idempotencyservice/idempotency"
	"idempotencyservice/idempotency/idempotencytest"
)

// serviceConfig is clients/service-config.json, found from this file's
// place in the repository.
func serviceConfig(t *testing.T) string {
	t.Helper()
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("runtime.Caller: no file")
	}
	if resolved, err := filepath.EvalSymlinks(file); err == nil {
		file = resolved
	}
	path := filepath.Join(filepath.Dir(file), "..", "..", "service-config.json")
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("the service config: %v", err)
	}
	return string(data)
}

const retryEnv = "GRPC_GO_RETRY"

func TestGrpcGoRetriesAClaimAsTheServiceConfigSays(t *testing.T) {
	if os.Getenv(retryEnv) != "on" {
		// grpc-go 1.33 reads GRPC_GO_RETRY once, at start: run this test in a
		// child process that has it.
		cmd := exec.Command(os.Args[0], "-test.run=^TestGrpcGoRetriesAClaimAsTheServiceConfigSays$", "-test.count=1", "-test.v", "-test.timeout=120s")
		cmd.Env = append(os.Environ(), retryEnv+"=on")
		out, err := cmd.CombinedOutput()
		t.Logf("with %s=on:\n%s", retryEnv, out)
		if err != nil {
			t.Fatalf("the test with %s=on failed: %v", retryEnv, err)
		}
		return
	}
	config := serviceConfig(t)

	base := os.Getenv("IDEMPOTENCY_TEST_POSTGRES")
	if base == "" {
		base = idempotencytest.DefaultPostgres
	}
	pgURL, err := url.Parse(strings.TrimRight(base, "/"))
	if err != nil {
		t.Fatal(err)
	}
	relay := startTCPRelay(t, pgURL.Host)
	db := idempotencytest.PostgresDatabase(t)
	viaRelay, err := url.Parse(db)
	if err != nil {
		t.Fatal(err)
	}
	viaRelay.Host = relay.addr()
	metricsPort, err := idempotencytest.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	metricsAddr := fmt.Sprintf("127.0.0.1:%d", metricsPort)
	server := idempotencytest.Start(t, "DATABASE_URL="+viaRelay.String(), "IDEMPOTENCY_DB_TIMEOUT=1s",
		"IDEMPOTENCY_METRICS_ADDR="+metricsAddr)
	unavailable := func() int {
		t.Helper()
		return metric(t, metricsAddr, "idempotency_errors_total", `method="Claim"`, `reason="STORE_UNAVAILABLE"`)
	}
	ns := namespace(t)

	// claimWhileCut Claims key (with its own lease token) over conn while the
	// relay is cut; once the server has answered UNAVAILABLE once, the relay
	// is restored. It returns the Claim's answer, and how many UNAVAILABLE
	// answers the server gave it.
	claimWhileCut := func(conn *grpc.ClientConn, key, token string) (*pb.ClaimResponse, int, error) {
		before := unavailable()
		relay.cut()
		type answer struct {
			reply *pb.ClaimResponse
			err   error
		}
		done := make(chan answer, 1)
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			reply, err := pb.NewIdempotencyServiceClient(conn).Claim(ctx, &pb.ClaimRequest{Namespace: ns, Key: key, LeaseToken: token})
			done <- answer{reply, err}
		}()
		until(t, 10*time.Second, "the server's first UNAVAILABLE", func() bool { return unavailable() > before })
		relay.restore()
		a := <-done
		return a.reply, unavailable() - before, a.err
	}

	// Retries as the service config says: the Claim succeeds by itself.
	withRetries, err := grpc.Dial(server.Target, grpc.WithInsecure(), grpc.WithDefaultServiceConfig(config))
	if err != nil {
		t.Fatal(err)
	}
	defer withRetries.Close()
	token := idempotency.NewLeaseToken()
	reply, failed, err := claimWhileCut(withRetries, "retried", token)
	if err != nil {
		t.Fatalf("the Claim with the service config's retries: %v (the server answered UNAVAILABLE %d times)", err, failed)
	}
	if reply.GetOutcome() != pb.Outcome_OUTCOME_CLAIMED || reply.GetLeaseToken() != token || reply.GetFencingToken() != 1 {
		t.Fatalf("the retried Claim: %v", reply)
	}
	// maxAttempts 5: 1 to 4 attempts failed before the one that succeeded.
	if failed < 1 || failed > 4 {
		t.Fatalf("the server answered the retried Claim UNAVAILABLE %d times, want 1 to 4", failed)
	}
	t.Logf("the server answered UNAVAILABLE %d time(s) before the attempt that succeeded", failed)

	// Retries disabled: the same Claim fails with the server's UNAVAILABLE
	// and its details.
	withoutRetries, err := grpc.Dial(server.Target, grpc.WithInsecure(), grpc.WithDefaultServiceConfig(config), grpc.WithDisableRetry())
	if err != nil {
		t.Fatal(err)
	}
	defer withoutRetries.Close()
	reply, failed, err = claimWhileCut(withoutRetries, "not-retried", idempotency.NewLeaseToken())
	if status.Code(err) != codes.Unavailable || failed != 1 {
		t.Fatalf("without retries: %v %v, UNAVAILABLE answered %d times; want UNAVAILABLE, once", reply, err, failed)
	}
	var info *errdetails.ErrorInfo
	var retry *errdetails.RetryInfo
	for _, d := range status.Convert(err).Details() {
		switch d := d.(type) {
		case *errdetails.ErrorInfo:
			info = d
		case *errdetails.RetryInfo:
			retry = d
		}
	}
	if info.GetReason() != "STORE_UNAVAILABLE" || retry.GetRetryDelay().AsDuration() != 250*time.Millisecond {
		t.Fatalf("the UNAVAILABLE's details: %v %v", info, retry)
	}
	// Nothing was claimed; the store is back.
	record, err := pb.NewIdempotencyServiceClient(withRetries).Get(ctx(t), &pb.GetRequest{Namespace: ns, Key: "not-retried"})
	if err != nil || record.GetState() != pb.State_STATE_ABSENT {
		t.Fatalf("Get of the failed Claim's key: %v %v", record, err)
	}
}

// metric is the value of the counter name whose labels include every one
// of labels, from the metrics endpoint at addr (0 when absent).
func metric(t *testing.T, addr, name string, labels ...string) int {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	total := 0
	scanner := bufio.NewScanner(resp.Body)
	for scanner.Scan() {
		line := scanner.Text()
		if !strings.HasPrefix(line, name+"{") {
			continue
		}
		cut := strings.LastIndex(line, " ")
		series, value := line[:cut], line[cut+1:]
		matches := true
		for _, label := range labels {
			matches = matches && strings.Contains(series, label)
		}
		if !matches {
			continue
		}
		v, err := strconv.ParseFloat(value, 64)
		if err != nil {
			t.Fatalf("metrics: %q: %v", line, err)
		}
		total += int(v)
	}
	if err := scanner.Err(); err != nil {
		t.Fatal(err)
	}
	return total
}

// tcpRelay forwards TCP connections from a free loopback port to upstream;
// cut closes every connection and closes new ones at once, until restore.
type tcpRelay struct {
	listener net.Listener
	upstream string

	mu    sync.Mutex
	isCut bool
	conns map[net.Conn]struct{}
}

func startTCPRelay(t *testing.T, upstream string) *tcpRelay {
	t.Helper()
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &tcpRelay{listener: listener, upstream: upstream, conns: map[net.Conn]struct{}{}}
	go r.serve()
	t.Cleanup(func() {
		listener.Close()
		r.cut()
	})
	return r
}

func (r *tcpRelay) addr() string { return r.listener.Addr().String() }

func (r *tcpRelay) serve() {
	for {
		client, err := r.listener.Accept()
		if err != nil {
			return
		}
		go r.forward(client)
	}
}

func (r *tcpRelay) forward(client net.Conn) {
	if !r.track(client) {
		client.Close()
		return
	}
	server, err := net.DialTimeout("tcp", r.upstream, 5*time.Second)
	if err != nil || !r.track(server) {
		if server != nil {
			server.Close()
		}
		r.drop(client)
		return
	}
	go func() {
		io.Copy(server, client)
		r.drop(client)
		r.drop(server)
	}()
	io.Copy(client, server)
	r.drop(client)
	r.drop(server)
}

// track adds conn, unless the relay is cut.
func (r *tcpRelay) track(conn net.Conn) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.isCut {
		return false
	}
	r.conns[conn] = struct{}{}
	return true
}

func (r *tcpRelay) drop(conn net.Conn) {
	conn.Close()
	r.mu.Lock()
	delete(r.conns, conn)
	r.mu.Unlock()
}

func (r *tcpRelay) cut() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.isCut = true
	for conn := range r.conns {
		conn.Close()
		delete(r.conns, conn)
	}
}

func (r *tcpRelay) restore() {
	r.mu.Lock()
	r.isCut = false
	r.mu.Unlock()
}
