#!/usr/bin/env bash
# Run the Node client's tests (node --test, after tsc) against a real
# idempotency-service: the embedded store, and PostgreSQL for the suites
# marked [postgres]. Run from anywhere. setup.sh installs the dependencies
# from package-lock.json (npm ci, into the gitignored node_modules), among
# them the pinned @aws-lambda-powertools/idempotency that
# test/powertools.test.ts runs idempotency-client/powertools against.
#
#   IDEMPOTENCY_BIN   the server binary (default: target/release/idempotency-service)
#   IDEMPOTENCY_TEST_POSTGRES   PostgreSQL to create test databases on
#                     (default: postgres://postgres@127.0.0.1:5432)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
bin=${IDEMPOTENCY_BIN:-target/release/idempotency-service}
case "$bin" in /*) ;; *) bin="$repo/$bin" ;; esac
if [ ! -x "$bin" ]; then
  echo "node client tests: server binary not found at $bin (build it, or set IDEMPOTENCY_BIN)" >&2
  exit 1
fi
export IDEMPOTENCY_BIN="$bin"

bash "$repo/clients/node/setup.sh"
cd "$repo/clients/node"
exec node --test --test-reporter=spec dist/test/*.test.js
