#!/usr/bin/env bash
# Build the Java client with Debian's jars (build.sh) and test it against real
# idempotency-service processes (the binary named by IDEMPOTENCY_BIN), on free
# loopback ports:
#
#  1. ClientTest, against a plain server (embedded store) started here: Claim,
#     Complete, the replay, fingerprint mismatch, in progress,
#     Release/ExtendLease/Get/Purge, the error classes, once() (replay, release
#     on exception, waiting, heartbeat, lease lost), every vector of
#     clients/testdata/key_vectors.json; then bearer tokens, TLS and mutual TLS
#     against a second server with an access policy (make-test-certs.sh, openssl).
#  2. ServerSuite, whose suites start their own servers, on the embedded store
#     and on a fresh PostgreSQL database (psql; IDEMPOTENCY_TEST_POSTGRES, else
#     postgres://postgres@127.0.0.1:5432): retries and lost answers
#     (RetryTest), checkpoints with a worker JVM killed mid-job
#     (CheckpointTest), two PostgreSQL replicas stopped and restarted under
#     once() (ReplicaTest), and once() waiting for a holder, directly and
#     behind a relay that clears ClaimRequest.wait (WaitTest); the
#     google.rpc details of refusals and late retries of remembered keys,
#     refused and re-executed, with servers of its own that refuse late
#     retries or rate limit (DetailsTest).
#
# Run from anywhere.
#
#   IDEMPOTENCY_BIN            the server binary (default: target/release/idempotency-service)
#   IDEMPOTENCY_TEST_POSTGRES  the PostgreSQL the suites create their databases on
#   JAVA_SUITES                the ServerSuite suites to run (default: all:
#                              "retry checkpoint replica wait details")
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
here="$repo/clients/java"
bin=${IDEMPOTENCY_BIN:-target/release/idempotency-service}
case "$bin" in /*) ;; *) bin="$repo/$bin" ;; esac
if [ ! -x "$bin" ]; then
  echo "java client: server binary not found at $bin (build it, or set IDEMPOTENCY_BIN)" >&2
  exit 1
fi
export IDEMPOTENCY_BIN="$bin"

# ServerSuite creates its PostgreSQL databases with psql.
postgres=${IDEMPOTENCY_TEST_POSTGRES:-postgres://postgres@127.0.0.1:5432}
if ! command -v psql >/dev/null && command -v apt-get >/dev/null; then
  echo "java client: installing postgresql-client (psql) from Debian" >&2
  apt-get update -qq -o DPkg::Lock::Timeout=300
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 postgresql-client >/dev/null
fi
if ! psql "$postgres/postgres" -qAtc 'select 1' >/dev/null 2>&1; then
  echo "java client: PostgreSQL not reachable at $postgres (start it, or set IDEMPOTENCY_TEST_POSTGRES)" >&2
  exit 1
fi

work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid"
      wait "$pid" || true
    fi
  done
  rm -rf "$work"
}
trap cleanup EXIT

bash "$here/build.sh" "$work/build"
classpath=$(cat "$work/build/classpath")

free_ports() { # N: N distinct free loopback ports, on one line
  python3 -c '
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))' "$1"
}

# start NAME PORT [VAR=VALUE...]: the server on the embedded store in
# $work/NAME, until its log says it is listening. Returns 2 when a port was
# taken between free_ports and the server's bind (other test runs share this
# machine), so the caller picks others; exits on any other failure.
start() {
  local name=$1 port=$2
  shift 2
  mkdir -p "$work/$name"
  env -u DATABASE_URL IDEMPOTENCY_LISTEN_ADDR="127.0.0.1:$port" IDEMPOTENCY_DATA_DIR="$work/$name" \
    IDEMPOTENCY_METRICS_ADDR= "$@" "$bin" >"$work/$name.log" 2>&1 &
  local pid=$!
  pids+=("$pid")
  local deadline=$((SECONDS + 60))
  while ((SECONDS < deadline)); do
    if grep -q "listening" "$work/$name.log"; then
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      if grep -q "is in use" "$work/$name.log"; then
        return 2
      fi
      break
    fi
    sleep 0.05
  done
  echo "java client: the $name server did not start:" >&2
  tail -n 30 "$work/$name.log" >&2
  exit 1
}

# The plain server: everything but the security checks.
for attempt in 1 2 3 4 5; do
  port=$(free_ports 1)
  status=0
  start plain "$port" || status=$?
  [ "$status" -eq 2 ] || break
done
[ "$status" -eq 0 ] || { echo "java client: no free port for the plain server" >&2; exit 1; }

# The TLS server with an access policy (a token for orders/*, the test client
# certificate's CN for billing/*) and a plaintext health listener.
bash "$repo/clients/testdata/make-test-certs.sh" "$work/certs" >/dev/null
token="idem_$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')"
token_hash=$(printf '%s' "$token" | sha256sum | cut -d' ' -f1)
cat >"$work/policy.toml" <<POLICY
[[identity]]
name = "orders"
token_hashes = ["sha256:$token_hash"]
namespaces = ["orders/*"]

[[identity]]
name = "orders-by-certificate"
client_cert_cn = "orders-client"
namespaces = ["billing/*"]
POLICY
for attempt in 1 2 3 4 5; do
  read -r tls_port health_port < <(free_ports 2)
  status=0
  start tls "$tls_port" IDEMPOTENCY_POLICY_FILE="$work/policy.toml" \
    IDEMPOTENCY_TLS_CERT_FILE="$work/certs/server.pem" IDEMPOTENCY_TLS_KEY_FILE="$work/certs/server.key" \
    IDEMPOTENCY_TLS_CLIENT_CA_FILE="$work/certs/ca.pem" IDEMPOTENCY_TLS_CLIENT_AUTH=optional \
    IDEMPOTENCY_HEALTH_LISTEN_ADDR="127.0.0.1:$health_port" || status=$?
  [ "$status" -eq 2 ] || break
done
[ "$status" -eq 0 ] || { echo "java client: no free ports for the TLS server" >&2; exit 1; }

# The test waits for each server's health check to say SERVING (with a deadline).
if ! java -cp "$classpath" idempotency.client.ClientTest "127.0.0.1:$port" "$repo/clients/testdata/key_vectors.json" \
  "127.0.0.1:$tls_port" "127.0.0.1:$health_port" "$work/certs" "$token"; then
  for name in plain tls; do
    echo "--- $name server log ---" >&2
    tail -n 30 "$work/$name.log" >&2
  done
  exit 1
fi

# The suites that start (and stop, and kill) their own servers.
mkdir -p "$work/suites"
# shellcheck disable=SC2086 # JAVA_SUITES is a list of words
java -cp "$classpath" idempotency.client.ServerSuite "$work/suites" ${JAVA_SUITES:-}
