#!/usr/bin/env bash
# Build Go programs that use the idempotency package, in GOPATH mode with
# Debian's Go packages: installs what is missing (lib.sh), generates the stubs
# from proto/ into a temporary GOPATH, and writes one binary per program into
# OUTDIR (named after its folder). Run from anywhere.
#
#   clients/go/build.sh OUTDIR [PROGRAM_DIR...]
#
# PROGRAM_DIR is relative to the repository (default:
# clients/cross-language/go_side, which the cross-language test runs).
# GO_EXTRA_DEBS names more Debian packages the programs need, e.g.
# golang-github-rabbitmq-amqp091-go-dev for examples/rabbitmq-go.
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 OUTDIR [PROGRAM_DIR...]" >&2
  exit 2
fi
source "$(dirname "$0")/lib.sh"
mkdir -p "$1"
out=$(cd "$1" && pwd)
shift
programs=("$@")
[ ${#programs[@]} -gt 0 ] || programs=(clients/cross-language/go_side)

# shellcheck disable=SC2086 # a list of package names
go_install_debs ${GO_EXTRA_DEBS:-}
go_venv
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
go_gopath "$work"
for program in "${programs[@]}"; do
  (cd "$go_repo/$program" && go build -o "$out/$(basename "$program")" .)
done
