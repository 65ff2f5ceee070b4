# Shared by clients/go/run-tests.sh, clients/go/build.sh and
# examples/rabbitmq-go/run-tests.sh (sourced, not run): Debian's Go packages,
# protoc from PyPI's grpcio-tools, and a temporary GOPATH holding the stubs
# generated from proto/ and the helper package.
#
# GOPATH mode (GO111MODULE=off, GOPROXY=off): there is no module proxy here,
# and Debian's golang-*-dev packages install their sources under
# /usr/share/gocode, which GOPATH mode reads as is.

go_repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
go_here="$go_repo/clients/go"

# golang-github-golang-protobuf-1-5-dev, not the -1-3 variant: that one panics
# at run time against the newer protobuf runtime.
# golang-google-genproto-dev: googleapis/rpc/errdetails, the google.rpc error
# details the service puts on its statuses (grpc-go depends on it anyway).
GO_DEBS=(golang-go protoc-gen-go protoc-gen-go-grpc golang-google-grpc-dev golang-github-golang-protobuf-1-5-dev golang-google-genproto-dev)

# go_install_debs [more packages]: apt-get install what is missing.
go_install_debs() {
  local deb missing=()
  for deb in "${GO_DEBS[@]}" "$@"; do
    dpkg-query -W -f='${Status}' "$deb" 2>/dev/null | grep -q "install ok installed" || missing+=("$deb")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "go: installing ${missing[*]} from Debian" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

# go_venv: clients/go/.venv with grpcio-tools (its protoc and the well-known
# .proto files). Under a lock: several scripts may build at once.
go_venv() {
  go_venv_dir="$go_here/.venv"
  (
    flock 9
    if [ ! -x "$go_venv_dir/bin/python" ] || ! "$go_venv_dir/bin/python" -c "import grpc_tools" 2>/dev/null; then
      "${PYTHON:-python3}" -m venv "$go_venv_dir"
      "$go_venv_dir/bin/pip" install --quiet --disable-pip-version-check grpcio-tools==1.85.1
    fi
  ) 9>"$go_here/.venv.lock"
}

# go_gopath WORKDIR: GOPATH=WORKDIR/gopath:/usr/share/gocode, holding
#   idempotencyservice/gen/idempotencyv1   generated from proto/ (never committed)
#   idempotencyservice/idempotency         a link to clients/go/idempotency
# and the environment for GOPATH mode.
go_gopath() {
  local work=$1
  export GO111MODULE=off GOPROXY=off GOFLAGS=
  export GOPATH="$work/gopath:/usr/share/gocode"
  local src="$work/gopath/src"
  mkdir -p "$src/idempotencyservice"
  ln -sfn "$go_here/idempotency" "$src/idempotencyservice/idempotency"
  local mapping="idempotency/v1/idempotency.proto=idempotencyservice/gen/idempotencyv1"
  local well_known
  well_known=$("$go_venv_dir/bin/python" -c 'import grpc_tools, os; print(os.path.join(os.path.dirname(grpc_tools.__file__), "_proto"))')
  "$go_venv_dir/bin/python" -m grpc_tools.protoc \
    -I "$go_repo/proto" -I "$well_known" \
    --plugin=protoc-gen-go=/usr/bin/protoc-gen-go \
    --plugin=protoc-gen-go-grpc=/usr/bin/protoc-gen-go-grpc \
    --go_out="$src" --go_opt="M$mapping" \
    --go-grpc_out="$src" --go-grpc_opt="M$mapping" \
    idempotency/v1/idempotency.proto
}

# go_server_bin: the server binary ($IDEMPOTENCY_BIN, default
# target/release/idempotency-service), exported as an absolute path.
go_server_bin() {
  local bin=${IDEMPOTENCY_BIN:-target/release/idempotency-service}
  case "$bin" in /*) ;; *) bin="$go_repo/$bin" ;; esac
  if [ ! -x "$bin" ]; then
    echo "go: server binary not found at $bin (build it, or set IDEMPOTENCY_BIN)" >&2
    return 1
  fi
  export IDEMPOTENCY_BIN="$bin"
}
