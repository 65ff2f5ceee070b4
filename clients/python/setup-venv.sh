#!/usr/bin/env bash
# Make clients/python/.venv: the client installed (editable) with its test
# dependencies and the powertools extra, and the stubs generated from proto/. Idempotent: dependencies
# are reinstalled only when pyproject.toml changed; the stubs are regenerated
# every time (a fraction of a second), so they always match the proto.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv="$here/.venv"
python=${PYTHON:-python3}

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
stamp="$venv/.installed-$(sha256sum "$here/pyproject.toml" | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  # grpcio-tools first: it is the build hook's requirement, and building in
  # this venv (--no-build-isolation) saves a second download of it.
  "$venv/bin/pip" install --quiet --disable-pip-version-check "setuptools>=64" grpcio-tools==1.85.1
  "$venv/bin/python" "$here/gen_proto.py"
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-build-isolation -e "$here[test,powertools]"
  rm -f "$venv"/.installed-*
  touch "$stamp"
fi
"$venv/bin/python" "$here/gen_proto.py"
