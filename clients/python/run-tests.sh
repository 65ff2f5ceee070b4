#!/usr/bin/env bash
# Run the Python client's tests (sync, asyncio, key vectors) against a real
# idempotency-service: the embedded store, and PostgreSQL for the tests marked
# `postgres`. Run from anywhere; extra arguments go to pytest.
#
#   IDEMPOTENCY_BIN   the server binary (default: target/release/idempotency-service)
#   IDEMPOTENCY_TEST_POSTGRES   PostgreSQL to create test databases on
#                     (default: postgres://postgres@127.0.0.1:5432)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
bin=${IDEMPOTENCY_BIN:-target/release/idempotency-service}
case "$bin" in /*) ;; *) bin="$repo/$bin" ;; esac
if [ ! -x "$bin" ]; then
  echo "python client tests: server binary not found at $bin (build it, or set IDEMPOTENCY_BIN)" >&2
  exit 1
fi
export IDEMPOTENCY_BIN="$bin"

bash "$repo/clients/python/setup-venv.sh"
cd "$repo/clients/python"
exec .venv/bin/python -m pytest "$@"
