#!/usr/bin/env bash
# Build the Java client with Debian's jars (build.sh) and run its test program
# against a real idempotency-service (embedded store, temporary data dir, free
# loopback port): Claim, Complete, the replay, fingerprint mismatch, in
# progress, Release/ExtendLease/Get/Purge, the error classes, once() (replay,
# release on exception, waiting, heartbeat, lease lost), and every vector of
# clients/testdata/key_vectors.json; then bearer tokens, TLS and mutual TLS
# against a second server with an access policy (make-test-certs.sh, openssl).
# Run from anywhere.
#
#   IDEMPOTENCY_BIN   the server binary (default: target/release/idempotency-service)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
here="$repo/clients/java"
bin=${IDEMPOTENCY_BIN:-target/release/idempotency-service}
case "$bin" in /*) ;; *) bin="$repo/$bin" ;; esac
if [ ! -x "$bin" ]; then
  echo "java client: server binary not found at $bin (build it, or set IDEMPOTENCY_BIN)" >&2
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

# Three distinct free loopback ports: plain, TLS, and the TLS server's health listener.
read -r port tls_port health_port < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')

# start NAME PORT [VAR=VALUE...]: the server on the embedded store in $work/NAME.
start() {
  local name=$1 port=$2
  shift 2
  mkdir -p "$work/$name"
  env -u DATABASE_URL IDEMPOTENCY_LISTEN_ADDR="127.0.0.1:$port" IDEMPOTENCY_DATA_DIR="$work/$name" \
    IDEMPOTENCY_METRICS_ADDR= "$@" "$bin" >"$work/$name.log" 2>&1 &
  pids+=($!)
}

# The plain server: everything but the security checks.
start plain "$port"

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
start tls "$tls_port" IDEMPOTENCY_POLICY_FILE="$work/policy.toml" \
  IDEMPOTENCY_TLS_CERT_FILE="$work/certs/server.pem" IDEMPOTENCY_TLS_KEY_FILE="$work/certs/server.key" \
  IDEMPOTENCY_TLS_CLIENT_CA_FILE="$work/certs/ca.pem" IDEMPOTENCY_TLS_CLIENT_AUTH=optional \
  IDEMPOTENCY_HEALTH_LISTEN_ADDR="127.0.0.1:$health_port"

# The test waits for each server's health check to say SERVING (with a deadline).
if ! java -cp "$classpath" idempotency.client.ClientTest "127.0.0.1:$port" "$repo/clients/testdata/key_vectors.json" \
  "127.0.0.1:$tls_port" "127.0.0.1:$health_port" "$work/certs" "$token"; then
  for name in plain tls; do
    echo "--- $name server log ---" >&2
    tail -n 30 "$work/$name.log" >&2
  done
  exit 1
fi
