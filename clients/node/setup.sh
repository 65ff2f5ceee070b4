#!/usr/bin/env bash
# Install the Node client's dependencies (npm ci, from package-lock.json) and
# build it: types generated from proto/, then tsc into dist/. Idempotent:
# node_modules is reinstalled only when package-lock.json changed.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
stamp="node_modules/.installed-$(sha256sum package-lock.json | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  npm ci --no-audit --no-fund --loglevel=error
  touch "$stamp"
fi
npm run --silent build
