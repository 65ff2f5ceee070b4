#!/usr/bin/env bash
# The fault-injection harness (issue 14): faults/run.sh [--ci] [--duration S] [--list] [SCENARIO...]
# Makes faults/.venv (the Python client from ../clients/python, asyncpg,
# grpcio-health-checking), checks the machine's services, and runs the
# scenarios. Exits non-zero when a scenario's counts are not all 0 or its
# expectations fail. --ci: a few seconds of load per scenario.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
venv="$here/.venv"
python=${PYTHON:-python3}

die() { echo "faults/run.sh: $*" >&2; exit 2; }

# Debian tools the harness needs: psql, the PostgreSQL server (initdb, pg_ctl).
need_apt=()
command -v psql >/dev/null || need_apt+=(postgresql-client)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need_apt+=(postgresql)
command -v runuser >/dev/null || need_apt+=(util-linux)
if ((${#need_apt[@]})); then
  command -v apt-get >/dev/null || die "missing ${need_apt[*]} and no apt-get to install them"
  echo "faults/run.sh: installing ${need_apt[*]} (apt-get)" >&2
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then
  die "running as root needs a 'postgres' user (PostgreSQL refuses to run as root); install Debian's postgresql"
fi

# The ledger lives in a fresh database on the machine's PostgreSQL.
pg_isready -q -h 127.0.0.1 -p 5432 -t 5 2>/dev/null \
  || psql "postgres://postgres@127.0.0.1:5432/postgres" -qAtc 'select 1' >/dev/null 2>&1 \
  || die "PostgreSQL is not answering on 127.0.0.1:5432 (user postgres, trust auth); start it first"

bin=${IDEMPOTENCY_BIN:-$repo/target/release/idempotency-service}
[ -x "$bin" ] || die "no server binary at $bin (cargo build --release, or set IDEMPOTENCY_BIN)"
export IDEMPOTENCY_BIN="$bin"

# The venv: reinstalled when the client's sources (_async/ and _sync/
# included) or the proto change.
stamp_src=$( { cat "$repo/clients/python/pyproject.toml" "$repo/proto/idempotency/v1/idempotency.proto" "$here/run.sh";
  find "$repo/clients/python/src/idempotency_client" -name '*.py' -not -path '*/_proto/*' | LC_ALL=C sort | xargs cat; } \
  | sha256sum | cut -c1-16)
stamp="$venv/.installed-$stamp_src"
(
  flock 9
  if [ ! -x "$venv/bin/python" ]; then "$python" -m venv "$venv"; fi
  if [ ! -e "$stamp" ]; then
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
      "$repo/clients/python" grpcio-health-checking==1.85.1 asyncpg==0.32.0 >&2
    rm -f "$venv"/.installed-*
    touch "$stamp"
  fi
) 9>"$here/.venv.lock"

cd "$here"
exec "$venv/bin/python" -m faults "$@"
