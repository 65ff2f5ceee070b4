#!/usr/bin/env bash
# Lints the wire contract in proto/ with buf and checks it for breaking changes
# against the previous commit on main. The proto is a public contract: clients
# in other languages are generated from it, so a renamed or renumbered field is
# a failure here, not a review comment.
#
# Runs from any directory on a fresh machine: buf comes from the npm package
# @bufbuild/buf pinned in tools/package-lock.json, installed into
# tools/node_modules on first use.
#
# BUF_AGAINST_REF names the commit to compare with (default HEAD~1).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

if ! command -v npm >/dev/null 2>&1; then
  echo "check-proto: npm not found; installing Debian's nodejs and npm"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
fi

buf="tools/node_modules/.bin/buf"
pinned="$(node -p "require('./tools/package-lock.json').packages['node_modules/@bufbuild/buf'].version")"
installed="$("$buf" --version 2>/dev/null || true)"
if [[ "$installed" != "$pinned" ]]; then
  echo "check-proto: installing @bufbuild/buf $pinned into tools/node_modules"
  # --ignore-scripts: the package's bin/buf wrapper finds the platform binary
  # itself; its postinstall is only a speed-up, and npm 11 skips it anyway.
  (cd tools && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error)
fi
echo "check-proto: buf $("$buf" --version)"

echo "check-proto: buf lint"
"$buf" lint
echo "check-proto: buf lint passed"

against_ref="${BUF_AGAINST_REF:-HEAD~1}"
if ! git rev-parse --verify --quiet "${against_ref}^{commit}" >/dev/null; then
  echo "check-proto: skipping buf breaking: there is no commit $against_ref to compare with (first commit or shallow clone)"
elif [[ -z "$(git ls-tree --name-only "$against_ref" -- proto/)" ]]; then
  echo "check-proto: skipping buf breaking: $against_ref has no proto/ directory yet"
else
  echo "check-proto: buf breaking against $against_ref"
  # subdir=proto makes the old commit's proto/ the module root, so file paths
  # line up with this module's whatever buf.yaml that commit had (or lacked).
  if ! "$buf" breaking --against ".git#ref=${against_ref},subdir=proto"; then
    echo "check-proto: FAIL: the changes above break the wire contract published at $against_ref (add fields and messages; never rename, renumber or retype)"
    exit 1
  fi
  echo "check-proto: buf breaking passed (no breaking change since $against_ref)"
fi
