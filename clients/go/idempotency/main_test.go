package idempotency_test

// What the package's tests share: the servers (one on the embedded store and
// one on a fresh PostgreSQL database, each started on first use and stopped
// at the end), an interceptor that records and tampers with attempts, a
// relay that hides ClaimRequest.wait from the server, and small helpers.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "idempotencyservice/gen/idempotencyv1"
	"idempotencyservice/idempotency"
	"idempotencyservice/idempotency/idempotencytest"
)

// sharedServer is a server started on first use and stopped by TestMain.
type sharedServer struct {
	once   sync.Once
	server *idempotencytest.Server
	err    error
	dir    string
	dbURL  string
}

var (
	sqliteServer   sharedServer
	postgresServer sharedServer
)

func TestMain(m *testing.M) {
	if os.Getenv(workerEnv) != "" {
		os.Exit(workerMain())
	}
	code := m.Run()
	for _, s := range []*sharedServer{&sqliteServer, &postgresServer} {
		if s.server != nil {
			s.server.Stop()
		}
		if s.dbURL != "" {
			if err := idempotencytest.DropPostgresDatabase(s.dbURL); err != nil {
				fmt.Fprintln(os.Stderr, err)
			}
		}
		if s.dir != "" {
			os.RemoveAll(s.dir)
		}
	}
	os.Exit(code)
}

func binary(t testing.TB) string {
	t.Helper()
	bin := idempotencytest.Binary()
	if bin == "" {
		t.Fatal("idempotency-service binary not found: build it or set IDEMPOTENCY_BIN")
	}
	return bin
}

func (s *sharedServer) get(t testing.TB, postgres bool) *idempotencytest.Server {
	t.Helper()
	bin := binary(t)
	s.once.Do(func() {
		s.dir, s.err = os.MkdirTemp("", "idempotency-go-test-")
		if s.err != nil {
			return
		}
		var env []string
		if postgres {
			if s.dbURL, s.err = idempotencytest.CreatePostgresDatabase(); s.err != nil {
				return
			}
			env = append(env, "DATABASE_URL="+s.dbURL)
		}
		s.server, s.err = idempotencytest.StartProcess(bin, s.dir, env...)
	})
	if s.err != nil {
		t.Fatal(s.err)
	}
	return s.server
}

// sqlite is the package's server on the embedded store.
func sqlite(t testing.TB) *idempotencytest.Server { return sqliteServer.get(t, false) }

// postgres is the package's server on a fresh PostgreSQL database.
func postgres(t testing.TB) *idempotencytest.Server { return postgresServer.get(t, true) }

// client is a client of the package's server on the embedded store.
func client(t *testing.T) *idempotency.Client {
	t.Helper()
	return sqlite(t).Client(t)
}

// onEachStore runs test once per store, as a subtest named after it.
func onEachStore(t *testing.T, test func(t *testing.T, server *idempotencytest.Server)) {
	t.Run("sqlite", func(t *testing.T) { test(t, sqlite(t)) })
	t.Run("postgres", func(t *testing.T) { test(t, postgres(t)) })
}

func namespace(t *testing.T) string {
	b := make([]byte, 6)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return "go-test-" + hex.EncodeToString(b)
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return c
}

// dial is a client of targets whose every attempt goes through rec (nil: none).
func dial(t *testing.T, targets []string, rec *recorder) *idempotency.Client {
	t.Helper()
	opts := []grpc.DialOption{grpc.WithInsecure()}
	if rec != nil {
		opts = append(opts, grpc.WithUnaryInterceptor(rec.intercept))
	}
	c, err := idempotency.DialTargets(targets, opts...)
	if err != nil {
		t.Fatal(err)
	}
	c.Logf = t.Logf
	t.Cleanup(func() { c.Close() })
	return c
}

func targetsOf(servers ...*idempotencytest.Server) []string {
	var targets []string
	for _, s := range servers {
		targets = append(targets, s.Target)
	}
	return targets
}

// until polls cond every 20 ms until it holds, or fails the test after timeout.
func until(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// attempt is one attempt a recorder saw.
type attempt struct {
	method  string // "Claim", ...
	target  string // the connection's address
	code    codes.Code
	request proto.Message
	reply   proto.Message // nil unless OK
}

// recorder is a client interceptor (one per connection, so it sees every
// attempt of every call) that records attempts, and can lose answers on
// purpose (the call reached the server, which did the work; the caller sees
// UNAVAILABLE instead of the answer, as after a dropped connection or a
// replica that died after committing), fail calls without sending them, or
// run an action before the first call of a method.
type recorder struct {
	mu       sync.Mutex
	attempts []attempt // answered
	// sent: attempts sent per method, answered or not (a waiting Claim is
	// recorded in attempts only once answered).
	sent map[string]int
	// drop: answers of a method left to lose.
	drop map[string]int
	// dropped: the answers it lost, in order.
	dropped []proto.Message
	// fail: methods failed with UNAVAILABLE without being sent.
	fail map[string]bool
	// before: actions run before the first call of a method (given its target).
	before map[string]func(target string)
}

const droppedMessage = "the answer was dropped on purpose by the test"

func newRecorder() *recorder {
	return &recorder{sent: map[string]int{}, drop: map[string]int{}, fail: map[string]bool{}, before: map[string]func(string){}}
}

func (r *recorder) intercept(ctx context.Context, fullMethod string, req, reply interface{}, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	method := fullMethod[strings.LastIndex(fullMethod, "/")+1:]
	request := proto.Clone(req.(proto.Message))
	r.mu.Lock()
	action := r.before[method]
	delete(r.before, method)
	failing := r.fail[method]
	r.sent[method]++
	r.mu.Unlock()
	if action != nil {
		action(cc.Target())
	}
	if failing {
		r.record(attempt{method: method, target: cc.Target(), code: codes.Unavailable, request: request})
		return status.Error(codes.Unavailable, "failed on purpose by the test")
	}
	err := invoker(ctx, fullMethod, req, reply, cc, opts...)
	seen := attempt{method: method, target: cc.Target(), code: status.Code(err), request: request}
	if err == nil {
		seen.reply = proto.Clone(reply.(proto.Message))
		r.mu.Lock()
		drop := r.drop[method] > 0
		if drop {
			r.drop[method]--
			r.dropped = append(r.dropped, seen.reply)
		}
		r.mu.Unlock()
		if drop {
			seen.code = codes.Unavailable
			r.record(seen)
			return status.Error(codes.Unavailable, droppedMessage)
		}
	}
	r.record(seen)
	return err
}

func (r *recorder) record(a attempt) {
	r.mu.Lock()
	r.attempts = append(r.attempts, a)
	r.mu.Unlock()
}

// count is the number of attempts of method ("": any) answered with code (nil: any).
func (r *recorder) count(method string, code ...codes.Code) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, a := range r.attempts {
		if (method == "" || a.method == method) && (len(code) == 0 || a.code == code[0]) {
			n++
		}
	}
	return n
}

// sentCount is the number of attempts of method sent so far, answered or not.
func (r *recorder) sentCount(method string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.sent[method]
}

// of is the attempts of method, in order.
func (r *recorder) of(method string) []attempt {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []attempt
	for _, a := range r.attempts {
		if a.method == method {
			out = append(out, a)
		}
	}
	return out
}

// relay is a gRPC server that forwards every call to a real server
// unchanged, except that it clears ClaimRequest.wait: what a server that
// predates waiting does (the field never takes effect, and `waited` is never
// set in the answer).
type relay struct {
	pb.UnimplementedIdempotencyServiceServer
	upstream pb.IdempotencyServiceClient
}

// startRelay relays to target from a free loopback port; stopped when the test ends.
func startRelay(t *testing.T, target string) string {
	t.Helper()
	conn, err := grpc.Dial(target, grpc.WithInsecure())
	if err != nil {
		t.Fatal(err)
	}
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	server := grpc.NewServer()
	pb.RegisterIdempotencyServiceServer(server, &relay{upstream: pb.NewIdempotencyServiceClient(conn)})
	go server.Serve(listener)
	t.Cleanup(func() {
		server.Stop()
		conn.Close()
	})
	return listener.Addr().String()
}

func (r *relay) Claim(ctx context.Context, req *pb.ClaimRequest) (*pb.ClaimResponse, error) {
	req = proto.Clone(req).(*pb.ClaimRequest)
	req.Wait = nil
	return r.upstream.Claim(ctx, req)
}

func (r *relay) Complete(ctx context.Context, req *pb.CompleteRequest) (*pb.CompleteResponse, error) {
	return r.upstream.Complete(ctx, req)
}

func (r *relay) Release(ctx context.Context, req *pb.ReleaseRequest) (*pb.ReleaseResponse, error) {
	return r.upstream.Release(ctx, req)
}

func (r *relay) ExtendLease(ctx context.Context, req *pb.ExtendLeaseRequest) (*pb.ExtendLeaseResponse, error) {
	return r.upstream.ExtendLease(ctx, req)
}

func (r *relay) Get(ctx context.Context, req *pb.GetRequest) (*pb.GetResponse, error) {
	return r.upstream.Get(ctx, req)
}

func (r *relay) Purge(ctx context.Context, req *pb.PurgeRequest) (*pb.PurgeResponse, error) {
	return r.upstream.Purge(ctx, req)
}

func (r *relay) ClaimBatch(ctx context.Context, req *pb.ClaimBatchRequest) (*pb.ClaimBatchResponse, error) {
	return r.upstream.ClaimBatch(ctx, req)
}

func (r *relay) CompleteBatch(ctx context.Context, req *pb.CompleteBatchRequest) (*pb.CompleteBatchResponse, error) {
	return r.upstream.CompleteBatch(ctx, req)
}
