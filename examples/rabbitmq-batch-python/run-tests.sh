#!/usr/bin/env bash
# Test the RabbitMQ batch consumer end to end: a real idempotency-service
# (started by the test on a free port, embedded store), the local RabbitMQ and
# PostgreSQL, batches with duplicates inside them, redeliveries, a key held
# elsewhere, a long batch kept alive by its heartbeat, and the consumer killed
# mid-batch. Run from anywhere; extra arguments go to pytest.
#
#   IDEMPOTENCY_BIN   the server binary (default: target/release/idempotency-service
#                     of this repository; a relative path is taken from the repo root)
#   AMQP_URL          RabbitMQ (default amqp://guest:guest@127.0.0.1:5672/)
#   ORDERS_POSTGRES   PostgreSQL on which the test creates the consumer's
#                     database orders_<random> (default postgres://postgres@127.0.0.1:5432)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)

bin=${IDEMPOTENCY_BIN:-target/release/idempotency-service}
case "$bin" in /*) ;; *) bin="$repo/$bin" ;; esac
if [ ! -x "$bin" ]; then
  echo "examples/rabbitmq-batch-python: server binary not found at $bin (cargo build --release, or set IDEMPOTENCY_BIN)" >&2
  exit 1
fi
export IDEMPOTENCY_BIN="$bin"

# The retention against the server's remember_for: docs/recipes.md's rule (check_settings.py).
python3 "$repo/examples/check_settings.py" rabbitmq-batch-python "$bin"

# The brokers this test needs must already be running (CI starts them).
amqp_url=${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/}
pg_url=${ORDERS_POSTGRES:-postgres://postgres@127.0.0.1:5432}
hostport() { local rest=${1#*://}; rest=${rest#*@}; rest=${rest%%/*}; echo "${rest%:*} ${rest##*:}"; }
check_up() {  # name url
  local host port
  read -r host port < <(hostport "$2")
  if ! (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null; then
    echo "examples/rabbitmq-batch-python: $1 is not reachable at $host:$port ($2); start it first" >&2
    exit 1
  fi
}
check_up RabbitMQ "$amqp_url"
check_up PostgreSQL "$pg_url"

# The example's own virtualenv: its pinned requirements and the client from
# this checkout. Reinstalled only when they change.
python=${PYTHON:-python3}
venv="$here/.venv"
if [ ! -x "$venv/bin/python" ]; then
  if ! "$python" -m venv "$venv" >/dev/null 2>&1; then
    rm -rf "$venv"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    "$python" -m venv "$venv"
  fi
fi
client="$repo/clients/python"
stamp="$venv/.installed-$(cat "$here/requirements.txt" "$client/pyproject.toml" "$client/setup.py" \
  $(find "$client/src" -name '*.py' -not -path '*/_proto/*' | sort) "$repo/proto/idempotency/v1/idempotency.proto" \
  | sha256sum | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  pip=("$venv/bin/pip" --quiet --disable-pip-version-check)
  # The client's build hook generates its stubs with grpcio-tools: install it
  # here and build without isolation (one download instead of two).
  "${pip[@]}" install "setuptools>=64" grpcio-tools==1.85.1 -r "$here/requirements.txt"
  "${pip[@]}" uninstall --yes idempotency-client >/dev/null 2>&1 || true  # same version, new code
  "${pip[@]}" install --no-build-isolation "$client"
  rm -f "$venv"/.installed-*
  touch "$stamp"
fi

cd "$here"
exec "$venv/bin/python" -m pytest -p no:cacheprovider -q -rA tests "$@"
