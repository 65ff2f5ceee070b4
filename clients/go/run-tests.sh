#!/usr/bin/env bash
# Build and run the Go example against a real idempotency-service (embedded
# store): Claim, Complete, Claim again -> replay, another payload -> mismatch.
#
# Go and grpc-go come from Debian's packages (GOPATH mode, no module proxy);
# protoc is the one inside PyPI's grpcio-tools (in clients/go/.venv), with
# Debian's protoc-gen-go and protoc-gen-go-grpc as plugins. The generated code
# goes to a temporary GOPATH and is never committed. Run from anywhere.
#
#   IDEMPOTENCY_BIN   the server binary (default: target/release/idempotency-service)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
here="$repo/clients/go"
bin=${IDEMPOTENCY_BIN:-target/release/idempotency-service}
case "$bin" in /*) ;; *) bin="$repo/$bin" ;; esac
if [ ! -x "$bin" ]; then
  echo "go example: server binary not found at $bin (build it, or set IDEMPOTENCY_BIN)" >&2
  exit 1
fi

# golang-github-golang-protobuf-1-5-dev, not the -1-3 variant: that one
# panics at run time against the newer protobuf runtime.
debs=(golang-go protoc-gen-go protoc-gen-go-grpc golang-google-grpc-dev golang-github-golang-protobuf-1-5-dev)
missing=()
for deb in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$deb" 2>/dev/null | grep -q "install ok installed" || missing+=("$deb")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "go example: installing ${missing[*]} from Debian" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

venv="$here/.venv"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import grpc_tools" 2>/dev/null; then
  "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check grpcio-tools==1.85.1
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

export GO111MODULE=off GOPROXY=off GOFLAGS=
export GOPATH="$work/gopath:/usr/share/gocode"
gen="$work/gopath/src"
mkdir -p "$gen"
mapping="idempotency/v1/idempotency.proto=idempotencyservice/gen/idempotencyv1"
well_known=$("$venv/bin/python" -c 'import grpc_tools, os; print(os.path.join(os.path.dirname(grpc_tools.__file__), "_proto"))')
"$venv/bin/python" -m grpc_tools.protoc \
  -I "$repo/proto" -I "$well_known" \
  --plugin=protoc-gen-go=/usr/bin/protoc-gen-go \
  --plugin=protoc-gen-go-grpc=/usr/bin/protoc-gen-go-grpc \
  --go_out="$gen" --go_opt="M$mapping" \
  --go-grpc_out="$gen" --go-grpc_opt="M$mapping" \
  idempotency/v1/idempotency.proto
(cd "$here/example" && go vet . && go build -o "$work/example" .)

port=$("$venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
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
