#!/usr/bin/env bash
# A newcomer's first hour, checked: clone the repository afresh, install the
# Python and the TypeScript client exactly as README.md and docs/clients.md
# say, each into a new environment (a new venv; a new npm project), and run
# the quick-start snippets of those docs against the real server binary.
#
# - The snippets are read out of the markdown at run time (the fenced python
#   and ts blocks of docs/clients.md's Python, TypeScript and Batches sections
#   and of README's "Try it"), so what runs is what the docs show. The only
#   edit is the address: 127.0.0.1:50051 becomes the port this run's server
#   got. docs/clients.md's snippets must print exactly the output block shown
#   under them; README's are fragments (they use an `event`, a `body` and a
#   `charge()` of the reader's), so a few lines defining those are put
#   around them, and they must charge once and replay the receipt.
# - The install commands are written below as the docs give them, and the
#   check fails if the docs stop saying them word for word.
#
# It clones the committed HEAD of the repository it lives in: uncommitted
# changes are not what a newcomer gets. Installs come from PyPI and npm, as
# the clients' own scripts'. Each language gets its own server (embedded
# SQLite store in a temporary data directory, metrics off, a free port).
#
#   IDEMPOTENCY_BIN   the server binary (default: target/release/idempotency-service)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bin=${IDEMPOTENCY_BIN:-target/release/idempotency-service}
case "$bin" in /*) ;; *) bin="$repo/$bin" ;; esac
if [ ! -x "$bin" ]; then
  echo "check-quickstart: server binary not found at $bin (build it, or set IDEMPOTENCY_BIN)" >&2
  exit 1
fi

started=$SECONDS
tmp=$(mktemp -d "${TMPDIR:-/tmp}/check-quickstart.XXXXXX")
server_pids=()
cleanup() {
  local pid
  for pid in "${server_pids[@]}"; do
    kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
  done
  rm -rf "$tmp"
}
trap cleanup EXIT

say() { printf 'check-quickstart: %s\n' "$*"; }
fail() {
  printf 'check-quickstart: FAILED: %s\n' "$*" >&2
  exit 1
}

# run LOG CMD...: run a command with its output in LOG; on failure show the
# log's end and stop.
run() {
  local log=$1
  shift
  if ! "$@" >"$log" 2>&1; then
    tail -n 60 "$log" >&2
    fail "$* (the end of its output above)"
  fi
}

# check NAME EXPECTED_FILE CMD...: run a snippet; it must exit 0 and print
# (on stdout) exactly EXPECTED_FILE.
check() {
  local name=$1 expected=$2 out
  shift 2
  out="$tmp/out.$((++checks))"
  if ! "$@" >"$out" 2>"$out.err"; then
    cat "$out" "$out.err" >&2
    fail "$name: \`$*\` exited with an error (its output above)"
  fi
  if ! diff -u "$expected" "$out" >"$out.diff"; then
    cat "$out.diff" "$out.err" >&2
    fail "$name: printed something else than expected (- expected, + printed; then its stderr)"
  fi
  say "$name: printed what was expected"
}
checks=0

# doc_says FILE TEXT: the clone's doc gives this command word for word.
doc_says() {
  grep -qF -- "$2" "$clone/$1" || fail "$1 no longer says \`$2\`: update this script with the doc"
}

# --- the clone -------------------------------------------------------------

# Named as `git clone` names it, so the docs' relative paths hold: the npm
# project below is a folder beside it.
clone="$tmp/idempotency-service"
run "$tmp/clone.log" git clone --quiet "$repo" "$clone"
say "cloned $(git -C "$clone" rev-parse --short HEAD) into a temporary directory"

# The snippets, out of the clone's docs: NAME.{py,mjs} and, where the doc shows
# one, NAME.expected (the plain block right after the snippet).
mkdir "$tmp/snippets"
python3 - "$clone" "$tmp/snippets" <<'PY'
import pathlib
import re
import sys

clone, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
FENCE = re.compile(r"^```(\S*)\n(.*?)^```\n", re.M | re.S)


def blocks(doc, heading):
    """The fenced blocks (language, text) of the `## heading` section."""
    text = (clone / doc).read_text()
    parts = re.split(r"^## ", text, flags=re.M)
    sections = [p for p in parts if p.split("\n", 1)[0].strip() == heading]
    if len(sections) != 1:
        sys.exit(f"check-quickstart: {doc} has no section '## {heading}' (or more than one)")
    return FENCE.findall(sections[0])


def take(doc, heading, lang, name, ext, with_output):
    found = blocks(doc, heading)
    index = [i for i, (l, _) in enumerate(found) if l == lang]
    if len(index) != 1:
        sys.exit(f"check-quickstart: {doc} '## {heading}' has {len(index)} {lang} blocks, expected one")
    i = index[0]
    code = found[i][1]
    if code.count("127.0.0.1:50051") != 1:
        sys.exit(f"check-quickstart: the {lang} snippet of {doc} '## {heading}' no longer connects to 127.0.0.1:50051")
    (out / f"{name}.{ext}").write_text(code)
    if with_output:
        if i + 1 >= len(found) or found[i + 1][0] != "":
            sys.exit(f"check-quickstart: no output block after the {lang} snippet of {doc} '## {heading}'")
        (out / f"{name}.expected").write_text(found[i + 1][1])


take("docs/clients.md", "Python", "python", "clients-python", "py", True)
take("docs/clients.md", "TypeScript (Node 20+)", "ts", "clients-ts", "mjs", True)
take("docs/clients.md", "Batches (Python and TypeScript)", "python", "clients-batch", "py", True)
take("README.md", "Try it", "python", "readme-python", "py", False)
take("README.md", "Try it", "ts", "readme-ts", "mjs", False)
PY
say "read 5 snippets out of docs/clients.md and README.md"

# snippet NAME FILE ADDR [PRELUDE_FILE EPILOGUE_FILE]: the snippet, pointed at
# ADDR, saved as FILE (with the harness's lines around a README fragment).
snippet() {
  local name=$1 file=$2 addr=$3
  {
    [ -z "${4:-}" ] || cat "$4"
    sed "s/127\.0\.0\.1:50051/$addr/" "$tmp/snippets/$name"
    [ -z "${5:-}" ] || cat "$5"
  } >"$file"
}

# --- the server --------------------------------------------------------------

# start_server NAME: a fresh server on the embedded store; sets $addr.
start_server() {
  local name=$1 port
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  addr="127.0.0.1:$port"
  mkdir -p "$tmp/server-$name"
  env -u DATABASE_URL -u DATABASE_URL_FILE \
    IDEMPOTENCY_LISTEN_ADDR="$addr" IDEMPOTENCY_METRICS_ADDR= \
    IDEMPOTENCY_DATA_DIR="$tmp/server-$name/data" \
    "$bin" >"$tmp/server-$name/log" 2>&1 &
  server_pids+=($!)
  # Ready once the health check says SERVING; the venv's grpcio asks it, with
  # the request written by hand (grpcio-health-checking is not installed).
  if ! "$tmp/pyenv/bin/python" - "$addr" "$!" >"$tmp/server-$name/ready" 2>&1 <<'PY'; then
import pathlib
import sys
import time

import grpc

addr, pid = sys.argv[1], sys.argv[2]
service = b"idempotency.v1.IdempotencyService"
request = b"\x0a" + bytes([len(service)]) + service  # HealthCheckRequest{service}
check = grpc.insecure_channel(addr).unary_unary("/grpc.health.v1.Health/Check")
deadline = time.monotonic() + 30
last = "no answer"
while time.monotonic() < deadline:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    if state in ("Z", "gone"):
        sys.exit("the server exited")
    try:
        if check(request, timeout=1) == b"\x08\x01":  # status: SERVING
            sys.exit(0)
        last = "not SERVING"
    except grpc.RpcError as error:
        last = f"{error.code().name}: {error.details()}"
    time.sleep(0.05)
sys.exit(f"not SERVING after 30 s ({last})")
PY
    cat "$tmp/server-$name/ready" >&2
    tail -n 20 "$tmp/server-$name/log" >&2
    fail "the server for the $name check did not become ready (its log above)"
  fi
  say "server for the $name check serving on $addr"
}

# --- Python ------------------------------------------------------------------

doc_says README.md 'pip install ./clients/python'
doc_says docs/clients.md 'pip install ./clients/python'
python3 -m venv "$tmp/pyenv"
# What a newcomer types: the venv activated, in the checkout.
run "$tmp/pip-install.log" bash -c \
  "source '$tmp/pyenv/bin/activate' && cd '$clone' && pip install ./clients/python"
say "pip install ./clients/python: installed into a new venv"
# Snippets run outside the checkout, so only the installed package can answer.
mkdir "$tmp/py-app"
cd "$tmp/py-app"
py="$tmp/pyenv/bin/python"
run "$tmp/py-import.log" "$py" -c 'import idempotency_client'

start_server python
python_addr=$addr

snippet clients-python.py demo.py "$addr"
check "docs/clients.md Python snippet" "$tmp/snippets/clients-python.expected" "$py" demo.py
# "Run a snippet a second time and both deliveries are replays."
sed 's/replayed=False$/replayed=True/' "$tmp/snippets/clients-python.expected" >"$tmp/again.expected"
check "docs/clients.md Python snippet, run again (both replayed)" "$tmp/again.expected" "$py" demo.py

snippet clients-batch.py batch.py "$addr"
check "docs/clients.md Batches snippet" "$tmp/snippets/clients-batch.expected" "$py" batch.py
# "Run it again and m-1 and m-2 (both copies) replay, the other body is still
# parked and m-3 is still held elsewhere, so there is nothing to complete."
echo "['ack: replay', 'ack: replay', 'ack: replay', 'park', 'retry later']" >"$tmp/batch-again.expected"
check "docs/clients.md Batches snippet, run again (replays, nothing to complete)" "$tmp/batch-again.expected" "$py" batch.py

cat >"$tmp/readme-prelude.py" <<'PY'
# check-quickstart: what README's fragment takes from the reader's code.
import json
event = {"id": "evt_readme", "amount_cents": 1998}
body = json.dumps(event).encode()
def charge(event):
    print("charged", event["id"])
    return {"charged_cents": event["amount_cents"]}
# --- README.md, "Try it", Python ---
PY
cat >"$tmp/readme-epilogue.py" <<'PY'
# --- end of README's fragment ---
print("receipt", json.dumps(receipt))
PY
snippet readme-python.py readme.py "$addr" "$tmp/readme-prelude.py" "$tmp/readme-epilogue.py"
printf '%s\n' 'charged evt_readme' 'receipt {"charged_cents": 1998}' >"$tmp/readme-python-1.expected"
printf '%s\n' 'receipt {"charged_cents": 1998}' >"$tmp/readme-python-2.expected"
check "README Python snippet (the first delivery charges)" "$tmp/readme-python-1.expected" "$py" readme.py
check "README Python snippet (a redelivery replays)" "$tmp/readme-python-2.expected" "$py" readme.py

# --- TypeScript --------------------------------------------------------------

doc_says docs/clients.md '(cd clients/node && npm ci && npm pack)'
doc_says docs/clients.md 'npm install ../idempotency-service/clients/node/idempotency-client-0.1.0.tgz'
doc_says docs/clients.md 'node demo.mjs'
cd "$clone"
run "$tmp/npm-pack.log" bash -c '(cd clients/node && npm ci && npm pack)'
say "(cd clients/node && npm ci && npm pack): built the tarball"
# A new npm project beside the checkout.
mkdir "$tmp/my-app"
cd "$tmp/my-app"
run "$tmp/npm-init.log" npm init -y
run "$tmp/npm-install.log" npm install ../idempotency-service/clients/node/idempotency-client-0.1.0.tgz
say "npm install ../idempotency-service/clients/node/idempotency-client-0.1.0.tgz: installed into a new npm project"

start_server typescript

snippet clients-ts.mjs demo.mjs "$addr"
check "docs/clients.md TypeScript snippet" "$tmp/snippets/clients-ts.expected" node demo.mjs

cat >"$tmp/readme-prelude.mjs" <<'JS'
// check-quickstart: what README's fragment takes from the reader's code.
const event = { id: "evt_readme", amountCents: 1998 };
const rawBody = JSON.stringify(event);
function charge(event) {
  console.log("charged", event.id);
  return { chargedCents: event.amountCents };
}
// --- README.md, "Try it", TypeScript ---
JS
cat >"$tmp/readme-epilogue.mjs" <<'JS'
// --- end of README's fragment ---
console.log("receipt", JSON.stringify(receipt));
client.close();
JS
snippet readme-ts.mjs readme.mjs "$addr" "$tmp/readme-prelude.mjs" "$tmp/readme-epilogue.mjs"
printf '%s\n' 'charged evt_readme' 'receipt {"chargedCents":1998}' >"$tmp/readme-ts-1.expected"
printf '%s\n' 'receipt {"chargedCents":1998}' >"$tmp/readme-ts-2.expected"
check "README TypeScript snippet (the first delivery charges)" "$tmp/readme-ts-1.expected" node readme.mjs
check "README TypeScript snippet (a redelivery replays)" "$tmp/readme-ts-2.expected" node readme.mjs

# docs/clients.md: the two snippets share a namespace and a key, so the
# TypeScript one against the Python one's server replays the Python result.
snippet clients-ts.mjs cross.mjs "$python_addr"
printf '%s\n' "delivery 1: { charged_cents: 1998, by_delivery: 1 } replayed=true" \
  "delivery 2: { charged_cents: 1998, by_delivery: 1 } replayed=true" >"$tmp/cross.expected"
check "docs/clients.md TypeScript snippet after the Python one (a cross-language replay)" \
  "$tmp/cross.expected" node cross.mjs

say "passed in $((SECONDS - started)) s"
