#!/usr/bin/env bash
# The Go client's checks, against real idempotency-service processes (free
# ports, temporary data directories; the embedded store, and fresh
# PostgreSQL databases made with psql on $IDEMPOTENCY_TEST_POSTGRES, default
# postgres://postgres@127.0.0.1:5432, dropped afterwards):
#   1. go vet and go test of the idempotency package (clients/go/idempotency):
#      the key and fingerprint vectors of clients/testdata/key_vectors.json;
#      Claim/Complete/replay, mismatch, in-progress, release on error,
#      heartbeat and lost leases (once_test.go); retries and lost answers
#      (retry_test.go); two PostgreSQL replicas, one stopped during a Once and
#      a rolling restart under a Once loop (replicas_test.go); checkpoints and
#      a worker killed after step 2 of 3 (checkpoints_test.go); Once waiting
#      for a holder, and polling through a relay that hides
#      ClaimRequest.wait (wait_test.go: needs a server that waits); the
#      google.rpc details of refusals (Reason, RetryDelay, Field) and late
#      retries of remembered keys, refused and re-executed, on both stores
#      (details_test.go); grpc-go's own retries following the service config
#      while a TCP relay cuts the server off its PostgreSQL
#      (serviceconfig_test.go: it runs itself again with GRPC_GO_RETRY=on,
#      which Debian's grpc-go 1.33 needs);
#   2. the example (clients/go/example): Claim, Complete, replay, mismatch
#      with the generated stub alone.
#
# Go and grpc-go come from Debian's packages (GOPATH mode, no module proxy);
# protoc is the one inside PyPI's grpcio-tools (in clients/go/.venv), with
# Debian's protoc-gen-go and protoc-gen-go-grpc as plugins. The generated code
# goes to a temporary GOPATH and is never committed (lib.sh). Run from anywhere.
#
#   IDEMPOTENCY_BIN            the server binary (default: target/release/idempotency-service)
#   IDEMPOTENCY_TEST_POSTGRES  where the PostgreSQL tests create their databases
set -euo pipefail
source "$(dirname "$0")/lib.sh"
go_server_bin
bin=$IDEMPOTENCY_BIN
go_install_debs
go_venv

# The PostgreSQL tests (two replicas, and the shared PostgreSQL server)
# create their databases with psql.
postgres=${IDEMPOTENCY_TEST_POSTGRES:-postgres://postgres@127.0.0.1:5432}
if ! command -v psql >/dev/null && command -v apt-get >/dev/null; then
  echo "go: installing postgresql-client (psql) from Debian" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql-client >/dev/null
fi
if ! psql "$postgres/postgres" -qAtc 'select 1' >/dev/null 2>&1; then
  echo "go: PostgreSQL not reachable at $postgres (start it, or set IDEMPOTENCY_TEST_POSTGRES)" >&2
  exit 1
fi

work=$(mktemp -d)
server_pid=""
cleanup() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid"
    wait "$server_pid" || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
go_gopath "$work"

echo "== go: the idempotency package (vet, test)"
(
  cd "$work/gopath/src/idempotencyservice/idempotency"
  go vet ./...
  IDEMPOTENCY_KEY_VECTORS="$go_repo/clients/testdata/key_vectors.json" go test -count=1 -timeout 300s ./...
)

echo "== go: the example"
(cd "$go_here/example" && go vet . && go build -o "$work/example" .)
port=$("$go_venv_dir/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mkdir -p "$work/data"
env -u DATABASE_URL IDEMPOTENCY_LISTEN_ADDR="127.0.0.1:$port" IDEMPOTENCY_DATA_DIR="$work/data" IDEMPOTENCY_METRICS_ADDR= \
  "$bin" >"$work/server.log" 2>&1 &
server_pid=$!

# The example waits for the health check to say SERVING (with a deadline).
if ! "$work/example" -target "127.0.0.1:$port" -wait 60s; then
  echo "--- server log ---" >&2
  tail -n 50 "$work/server.log" >&2
  exit 1
fi
