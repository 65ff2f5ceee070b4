#!/usr/bin/env bash
# Install the Node client's dependencies (npm ci, from package-lock.json) and
# build it: types generated from proto/, then tsc into dist/. Idempotent:
# node_modules is reinstalled only when package-lock.json changed, and dist/
# rebuilt only when the proto, the sources, the tests or the build settings
# changed. Runs one at a time (a lock), so that suites sharing the checkout
# (this one, the cross-language test) never build over each other.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
exec 9>"$here/.setup.lock"
flock 9
stamp="node_modules/.installed-$(sha256sum package-lock.json | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  npm ci --no-audit --no-fund --loglevel=error
  touch "$stamp"
fi
inputs=$( { find ../../proto -name '*.proto'; find src test -name '*.ts' -not -path 'src/generated/*';
            echo package.json package-lock.json tsconfig.json scripts/generate.mjs; } | tr ' ' '\n' | LC_ALL=C sort)
built="dist/.built-$(cat $inputs | sha256sum | cut -c1-16)"
if [ ! -e "$built" ]; then
  npm run --silent build
  touch "$built"
fi
