#!/usr/bin/env bash
# Run the Python client's tests (sync, asyncio, key vectors) against a real
# idempotency-service: the embedded store, and PostgreSQL for the tests marked
# `postgres`; first check that the generated synchronous client is current
# (gen_sync.py --check). Run from anywhere; extra arguments go to pytest.
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

# The PostgreSQL tests (and test_replicas.py's two replicas) create their
# databases with psql.
postgres=${IDEMPOTENCY_TEST_POSTGRES:-postgres://postgres@127.0.0.1:5432}
if ! command -v psql >/dev/null && command -v apt-get >/dev/null; then
  echo "python client tests: installing postgresql-client (psql) from Debian" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql-client >/dev/null
fi
if ! psql "$postgres/postgres" -qAtc 'select 1' >/dev/null 2>&1; then
  echo "python client tests: PostgreSQL not reachable at $postgres (start it, or set IDEMPOTENCY_TEST_POSTGRES)" >&2
  exit 1
fi

bash "$repo/clients/python/setup-venv.sh"
cd "$repo/clients/python"
# The synchronous client is generated from the asyncio one and committed:
# fail when _sync/ is not what gen_sync.py writes from _async/ today.
.venv/bin/python gen_sync.py --check
exec .venv/bin/python -m pytest "$@"
