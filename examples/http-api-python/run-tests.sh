#!/usr/bin/env bash
# The HTTP API example's tests: the API under uvicorn, against the real
# idempotency-service binary, with the Idempotency-Key draft's cases.
# Run from anywhere; extra arguments go to pytest.
#
#   IDEMPOTENCY_BIN   the server binary (default: target/release/idempotency-service
#                     of this repository; a relative path is taken from the repo root)
#   PYTHON            the interpreter that makes the venv (default: python3)
#
# Installs into examples/http-api-python/.venv (gitignored): the client from
# ../../clients/python, and requirements.txt and requirements-test.txt.
# Reinstalls only when one of those changed.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
bin=${IDEMPOTENCY_BIN:-target/release/idempotency-service}
case "$bin" in /*) ;; *) bin="$repo/$bin" ;; esac
if [ ! -x "$bin" ]; then
  echo "http-api-python: server binary not found at $bin (cargo build --release, or set IDEMPOTENCY_BIN)" >&2
  exit 1
fi
export IDEMPOTENCY_BIN="$bin"

# The retention against the server's remember_for: docs/recipes.md's rule (check_settings.py).
python3 "$repo/examples/check_settings.py" http-api-python "$bin"
# The README's tables of retried status codes against the helpers' code and
# clients/service-config.json (the codes an API's 503 relies on being retried).
python3 "$repo/examples/check_retried_codes.py"

python=${PYTHON:-python3}
if ! "$python" -c 'import venv, ensurepip' 2>/dev/null; then
  # Debian splits venv (and its pip) out of python3.
  if command -v apt-get >/dev/null; then
    echo "http-api-python: installing python3-venv from Debian" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
  else
    echo "http-api-python: $python has no venv module; install python3-venv" >&2
    exit 1
  fi
fi

venv="$here/.venv"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
stamp="$venv/.installed-$(cat "$here/requirements.txt" "$here/requirements-test.txt" \
  "$repo/clients/python/pyproject.toml" "$repo/proto/idempotency/v1/idempotency.proto" | sha256sum | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  pip=("$venv/bin/pip" install --quiet --disable-pip-version-check)
  # The client's build generates its stubs with grpcio-tools: install it
  # first and build in this venv (--no-build-isolation), as
  # clients/python/setup-venv.sh does, rather than download it twice.
  "${pip[@]}" "setuptools>=64" grpcio-tools==1.85.1
  "${pip[@]}" --no-build-isolation "$repo/clients/python" -r "$here/requirements.txt" -r "$here/requirements-test.txt"
  # Rebuilt every time the proto or the client changed, even at the same version.
  "${pip[@]}" --no-build-isolation --force-reinstall --no-deps "$repo/clients/python"
  rm -f "$venv"/.installed-*
  touch "$stamp"
fi

cd "$here"
exec "$venv/bin/python" -m pytest "$@"
