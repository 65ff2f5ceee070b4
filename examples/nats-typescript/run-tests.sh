#!/usr/bin/env bash
# Test the NATS JetStream example end to end: a real idempotency-service
# (started by the test on a free port, embedded store), the local NATS with
# JetStream (a stream of its own per run, deleted at the end) and PostgreSQL
# (a ledger database of its own per run, dropped at the end). Run from anywhere.
#
#   IDEMPOTENCY_BIN   the server binary (default: target/release/idempotency-service
#                     of this repository; a relative path is taken from the repo root)
#   NATS_URL          NATS with JetStream (default nats://127.0.0.1:4222)
#   LEDGER_POSTGRES   PostgreSQL on which the test creates the consumer's database
#                     nats_example_<random> (default postgres://postgres@127.0.0.1:5432)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)

bin=${IDEMPOTENCY_BIN:-target/release/idempotency-service}
case "$bin" in /*) ;; *) bin="$repo/$bin" ;; esac
if [ ! -x "$bin" ]; then
  echo "examples/nats-typescript: server binary not found at $bin (cargo build --release, or set IDEMPOTENCY_BIN)" >&2
  exit 1
fi
export IDEMPOTENCY_BIN="$bin"

# The retention against the server's remember_for: docs/recipes.md's rule (check_settings.py).
python3 "$repo/examples/check_settings.py" nats-typescript "$bin"

# The services this test needs must already be running (CI starts them).
export NATS_URL=${NATS_URL:-nats://127.0.0.1:4222}
export LEDGER_POSTGRES=${LEDGER_POSTGRES:-postgres://postgres@127.0.0.1:5432}
hostport() { local rest=${1#*://}; rest=${rest#*@}; rest=${rest%%/*}; echo "${rest%:*} ${rest##*:}"; }
check_up() {  # name url
  local host port
  read -r host port < <(hostport "$2")
  if ! (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null; then
    echo "examples/nats-typescript: $1 is not reachable at $host:$port ($2); start it first" >&2
    exit 1
  fi
}
check_up NATS "$NATS_URL"
check_up PostgreSQL "$LEDGER_POSTGRES"

if ! command -v npm >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
fi

# The TypeScript client from this checkout (npm ci when its lock changed, then tsc).
bash "$repo/clients/node/setup.sh"

# The example's own node_modules, from package-lock.json; the client is a
# link to clients/node. Reinstalled only when the lock changes.
cd "$here"
stamp="node_modules/.installed-$(sha256sum package-lock.json | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  npm ci --no-audit --no-fund --loglevel=error
  touch "$stamp"
fi
npm run --silent build
exec node --test --test-reporter=spec --test-timeout=100000 dist/test/*.test.js
