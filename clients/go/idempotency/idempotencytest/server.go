// Package idempotencytest starts a real idempotency-service for tests: a
// process on a free loopback port with the embedded SQLite store in a
// temporary directory (or a fresh PostgreSQL database), ready once its
// health check says SERVING, stopped when the test ends.
//
//	server := idempotencytest.Start(t)
//	client := server.Client(t)
//
//	url := idempotencytest.PostgresDatabase(t) // created with psql, dropped when the test ends
//	a := idempotencytest.Start(t, "DATABASE_URL="+url)
//	b := idempotencytest.Start(t, "DATABASE_URL="+url) // two replicas of one store
//	a.Restart()                                        // SIGTERM, then the same binary on the same port
//
// The binary is $IDEMPOTENCY_BIN, else target/release/idempotency-service of
// the repository this package sits in. When neither exists the test is
// skipped, unless IDEMPOTENCY_BIN is set (then it fails).
package idempotencytest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"idempotencyservice/idempotency"
)

// Server is a running idempotency-service.
type Server struct {
	// Target is its "127.0.0.1:port".
	Target  string
	DataDir string
	LogPath string

	bin string
	env []string

	mu     sync.Mutex // guards cmd and exited, which Restart replaces
	cmd    *exec.Cmd
	exited chan struct{}
}

// Binary is the server binary: $IDEMPOTENCY_BIN, else the repository's
// target/release/idempotency-service ("" when there is none).
func Binary() string {
	if bin := os.Getenv("IDEMPOTENCY_BIN"); bin != "" {
		return bin
	}
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return ""
	}
	// file is clients/go/idempotency/idempotencytest/server.go (links resolved).
	if resolved, err := filepath.EvalSymlinks(file); err == nil {
		file = resolved
	}
	bin := filepath.Join(filepath.Dir(file), "..", "..", "..", "..", "target", "release", "idempotency-service")
	if _, err := os.Stat(bin); err != nil {
		return ""
	}
	return bin
}

// FreePort is a loopback port that was free a moment ago.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// Start starts a server for the test (extra environment: "NAME=value") and
// stops it (SIGTERM) when the test ends.
func Start(t testing.TB, env ...string) *Server {
	t.Helper()
	bin := Binary()
	if bin == "" {
		t.Fatal("idempotency-service binary not found: build it (cargo build --release) or set IDEMPOTENCY_BIN")
	}
	server, err := StartProcess(bin, t.TempDir(), env...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(server.Stop)
	return server
}

// StartProcess starts bin on a free port with its data in dataDir and waits
// (up to 60 s) until it is SERVING. Stop it with Stop.
func StartProcess(bin, dataDir string, env ...string) (*Server, error) {
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	target := fmt.Sprintf("127.0.0.1:%d", port)
	server := &Server{Target: target, DataDir: dataDir, LogPath: filepath.Join(dataDir, "server.log"), bin: bin}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "DATABASE_URL=") {
			server.env = append(server.env, kv)
		}
	}
	// Metrics off: the default port (8464) is one for every server here.
	server.env = append(server.env, "IDEMPOTENCY_LISTEN_ADDR="+target, "IDEMPOTENCY_DATA_DIR="+dataDir, "IDEMPOTENCY_METRICS_ADDR=")
	server.env = append(server.env, env...)
	if err := server.start(60 * time.Second); err != nil {
		return nil, err
	}
	return server, nil
}

// start runs the process and waits until it is SERVING (or exits, or timeout passes).
func (s *Server) start(timeout time.Duration) error {
	logFile, err := os.OpenFile(s.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logFile.Close()
	cmd := exec.Command(s.bin)
	cmd.Env = s.env
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", s.bin, err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
	s.mu.Lock()
	s.cmd, s.exited = cmd, exited
	s.mu.Unlock()

	client, err := idempotency.Dial(s.Target)
	if err != nil {
		s.Stop()
		return err
	}
	defer client.Close()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	ready := make(chan error, 1)
	go func() { ready <- client.WaitUntilServing(ctx) }()
	select {
	case err = <-ready:
	case <-exited:
		err = errExited{cmd.ProcessState}
	}
	if err != nil {
		s.Stop()
		return fmt.Errorf("%v\n--- server log ---\n%s", err, s.Log())
	}
	return nil
}

type errExited struct{ state *os.ProcessState }

func (e errExited) Error() string { return fmt.Sprintf("idempotency-service exited: %v", e.state) }

// Restart stops the server (SIGTERM) if it runs and starts the same binary
// with the same settings on the same port, as a rolling restart does; it
// returns once the new process is SERVING. A port the old process still
// holds is tried again for up to 60 s.
func (s *Server) Restart() error {
	s.Stop()
	deadline := time.Now().Add(60 * time.Second)
	for {
		if f, err := os.OpenFile(s.LogPath, os.O_WRONLY|os.O_APPEND, 0o644); err == nil {
			fmt.Fprintln(f, "--- restart ---")
			f.Close()
		}
		err := s.start(time.Until(deadline))
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("restart: %w", err)
		}
		time.Sleep(100 * time.Millisecond) // the port may still be held for a moment
	}
}

// Running reports whether the process has not exited.
func (s *Server) Running() bool {
	s.mu.Lock()
	exited := s.exited
	s.mu.Unlock()
	select {
	case <-exited:
		return false
	default:
		return true
	}
}

// Client is a client of the server, closed when the test ends.
func (s *Server) Client(t testing.TB) *idempotency.Client {
	t.Helper()
	client, err := idempotency.Dial(s.Target)
	if err != nil {
		t.Fatal(err)
	}
	client.Logf = t.Logf
	t.Cleanup(func() { client.Close() })
	return client
}

// Log is the end of the server's log.
func (s *Server) Log() string {
	data, _ := os.ReadFile(s.LogPath)
	if len(data) > 4000 {
		data = data[len(data)-4000:]
	}
	return string(data)
}

// Stop sends SIGTERM and waits (SIGKILL after 10 s).
func (s *Server) Stop() {
	s.mu.Lock()
	cmd, exited := s.cmd, s.exited
	s.mu.Unlock()
	select {
	case <-exited:
		return
	default:
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
	case <-time.After(10 * time.Second):
		_ = cmd.Process.Kill()
		<-exited
	}
}

// Kill sends SIGKILL and waits: a crash, with no drain.
func (s *Server) Kill() {
	s.mu.Lock()
	cmd, exited := s.cmd, s.exited
	s.mu.Unlock()
	_ = cmd.Process.Kill()
	<-exited
}

// DefaultPostgres is the PostgreSQL on which PostgresDatabase creates
// databases unless $IDEMPOTENCY_TEST_POSTGRES names another.
const DefaultPostgres = "postgres://postgres@127.0.0.1:5432"

// CreatePostgresDatabase creates a fresh database with psql on
// $IDEMPOTENCY_TEST_POSTGRES (default DefaultPostgres) and returns its URL.
func CreatePostgresDatabase() (string, error) {
	base := os.Getenv("IDEMPOTENCY_TEST_POSTGRES")
	if base == "" {
		base = DefaultPostgres
	}
	base = strings.TrimRight(base, "/")
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	name := "idempotency_go_" + hex.EncodeToString(b[:])
	if err := psql(base, "CREATE DATABASE "+name); err != nil {
		return "", fmt.Errorf("could not create a database on %s: %w", base, err)
	}
	return base + "/" + name, nil
}

// DropPostgresDatabase drops a database CreatePostgresDatabase made
// (its connections closed first).
func DropPostgresDatabase(url string) error {
	cut := strings.LastIndex(url, "/")
	return psql(url[:cut], "DROP DATABASE IF EXISTS "+url[cut+1:]+" WITH (FORCE)")
}

// PostgresDatabase is a fresh database for the test, dropped when it ends.
func PostgresDatabase(t testing.TB) string {
	t.Helper()
	url, err := CreatePostgresDatabase()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := DropPostgresDatabase(url); err != nil {
			t.Logf("drop %s: %v", url, err)
		}
	})
	return url
}

func psql(url, statement string) error {
	out, err := exec.Command("psql", url+"/postgres", "-v", "ON_ERROR_STOP=1", "-q", "-c", statement).CombinedOutput()
	if err != nil {
		return fmt.Errorf("psql: %v: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}
