// Package idempotencytest starts a real idempotency-service for tests: a
// process on a free loopback port with the embedded SQLite store in a
// temporary directory, ready once its health check says SERVING, stopped
// when the test ends.
//
//	server := idempotencytest.Start(t)
//	client := server.Client(t)
//
// The binary is $IDEMPOTENCY_BIN, else target/release/idempotency-service of
// the repository this package sits in. When neither exists the test is
// skipped, unless IDEMPOTENCY_BIN is set (then it fails).
package idempotencytest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
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
	cmd     *exec.Cmd
	exited  chan struct{}
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
	logPath := filepath.Join(dataDir, "server.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	defer logFile.Close()
	cmd := exec.Command(bin)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "DATABASE_URL=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	// Metrics off: the default port (8464) is one for every server here.
	cmd.Env = append(cmd.Env, "IDEMPOTENCY_LISTEN_ADDR="+target, "IDEMPOTENCY_DATA_DIR="+dataDir, "IDEMPOTENCY_METRICS_ADDR=")
	cmd.Env = append(cmd.Env, env...)
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	server := &Server{Target: target, DataDir: dataDir, LogPath: logPath, cmd: cmd, exited: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		close(server.exited)
	}()

	client, err := idempotency.Dial(target)
	if err != nil {
		server.Stop()
		return nil, err
	}
	defer client.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	ready := make(chan error, 1)
	go func() { ready <- client.WaitUntilServing(ctx) }()
	select {
	case err = <-ready:
	case <-server.exited:
		err = fmt.Errorf("idempotency-service exited: %v", cmd.ProcessState)
	}
	if err != nil {
		server.Stop()
		return nil, fmt.Errorf("%v\n--- server log ---\n%s", err, server.Log())
	}
	return server, nil
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
	select {
	case <-s.exited:
		return
	default:
	}
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.exited:
	case <-time.After(10 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.exited
	}
}
