#!/usr/bin/env bash
# Generate the Go stubs from proto/ into clients/go/gen/idempotencyv1 (the
# package idempotencyservice/gen/idempotencyv1, gitignored), for builds with
# modules. CI does not need it: lib.sh generates into a temporary GOPATH.
#
# Needs protoc-gen-go and protoc-gen-go-grpc on PATH (Debian's packages, or
# `go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.28.1` and
# `go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.1.0`);
# protoc is PyPI's grpcio-tools in clients/go/.venv (made when missing).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
go_venv
for plugin in protoc-gen-go protoc-gen-go-grpc; do
  command -v "$plugin" >/dev/null || { echo "generate.sh: $plugin is not on PATH" >&2; exit 1; }
done
mapping="idempotency/v1/idempotency.proto=idempotencyservice/gen/idempotencyv1"
well_known=$("$go_venv_dir/bin/python" -c 'import grpc_tools, os; print(os.path.join(os.path.dirname(grpc_tools.__file__), "_proto"))')
mkdir -p "$go_here/gen"
"$go_venv_dir/bin/python" -m grpc_tools.protoc \
  -I "$go_repo/proto" -I "$well_known" \
  --plugin=protoc-gen-go="$(command -v protoc-gen-go)" \
  --plugin=protoc-gen-go-grpc="$(command -v protoc-gen-go-grpc)" \
  --go_out="$go_here" --go_opt="M$mapping" --go_opt=module=idempotencyservice \
  --go-grpc_out="$go_here" --go-grpc_opt="M$mapping" --go-grpc_opt=module=idempotencyservice \
  idempotency/v1/idempotency.proto
echo "generated $go_here/gen/idempotencyv1"
