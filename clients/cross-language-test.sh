#!/usr/bin/env bash
# Cross-language test: one idempotency-service, the Python, Node, Go and Java
# clients against it; a key completed from Python is replayed to Node, Go and
# Java and the reverse, with the same derived keys and fingerprints. Builds the
# Python and Node clients first (into clients/python/.venv and
# clients/node/node_modules); the Go and Java tests build their sides
# themselves (clients/go/build.sh, clients/java/build.sh, with Debian's Go and
# Java packages). Also: every error path's google.rpc details decoded by
# grpcio and @grpc/grpc-js, and grpcio's built-in retry following
# clients/service-config.json (both on PostgreSQL: IDEMPOTENCY_TEST_POSTGRES,
# through a relay the tests cut). Run from anywhere.
#
#   IDEMPOTENCY_BIN   the server binary (default: target/release/idempotency-service)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bin=${IDEMPOTENCY_BIN:-target/release/idempotency-service}
case "$bin" in /*) ;; *) bin="$repo/$bin" ;; esac
if [ ! -x "$bin" ]; then
  echo "cross-language test: server binary not found at $bin (build it, or set IDEMPOTENCY_BIN)" >&2
  exit 1
fi
export IDEMPOTENCY_BIN="$bin"

bash "$repo/clients/python/setup-venv.sh"
bash "$repo/clients/node/setup.sh"
cd "$repo/clients/cross-language"
exec "$repo/clients/python/.venv/bin/python" -m pytest -p no:cacheprovider \
  test_cross_language.py test_error_details_conformance.py test_service_config.py \
  test_cross_language_go.py test_cross_language_java.py
