#!/usr/bin/env bash
# Claims that wait against Claims that poll (issue 23), in one run.
#
# 64 concurrent duplicates of work that takes 200 ms. Each round: a holder
# Claims a fresh key; 64 duplicates start Claims on it; the holder Completes
# 200 ms after its Claim returned. Rounds alternate between the two ways a
# duplicate gets its answer (bench/wait/calls.py):
#   - waiting: one Claim with ClaimRequest.wait (30 s), answered when the
#     holder Completes;
#   - polling: what the helpers do without waiting (the loop of
#     clients/python/src/idempotency_client/_async/once.py): Claim, and on
#     OUTCOME_IN_PROGRESS Claim again after 100 ms, 200 ms, 400 ms …, never
#     past retry_after.
# After each pair, a floor round: the holder Completes at once, then the
# duplicates send one plain Claim each (what 64 answers cost this client,
# server and machine with nothing to wait for). Before the measured rounds:
# warm-up rounds of both, unrecorded, and holder-only rounds (no duplicates:
# what the holder's Claim and Complete cost, subtracted from the statement
# counts).
#
# Reported per mode (bench/wait/run.py; the table in DIR/summary.md):
#   - time from the holder's Complete returning to the last duplicate's final
#     answer, p50 / p99 / max over the rounds (and every answer's p50 / p99);
#   - Claims per duplicate (the RPCs it sent);
#   - database statements per duplicate: pg_stat_statements of the server's
#     database over the mode's rounds (calls, and rows returned or written),
#     without the health check and the purge feed's heartbeats (both run on
#     timers), minus the holder-only rounds' count per round, divided by the
#     duplicates; DIR/statements.md lists every statement per mode;
#   - CPU per duplicate: the server process (utime + stime from /proc over the
#     mode's rounds), all of PostgreSQL, and the generator itself;
#   - issue 23's targets: last answer within 20 ms of the Complete (p99), at
#     most 2 statements per duplicate, at least 10x fewer than polling.
#
#   bench/wait.sh            full run: BENCH_WAIT_ROUNDS (200) rounds of each mode
#   bench/wait.sh --smoke    3 rounds of each (a few seconds): proves the script
#                            works (CI); fails on a wrong answer, an error or a
#                            missing figure, never on the targets
#
# Settings (environment):
#   IDEMPOTENCY_BIN        the server (default target/release/idempotency-service).
#                          A server that predates `wait` ignores it: the run says
#                          so (`waited` unset), and the waiting duplicates poll.
#   BENCH_WAIT_ROUNDS      measured rounds of each mode (200; smoke 3)
#   BENCH_WAIT_WARMUP      unrecorded rounds of each mode first (5; smoke 1)
#   BENCH_WAIT_HOLDER_ROUNDS  holder-only rounds (20; smoke 3)
#   BENCH_WAIT_DUPLICATES  duplicates per round (64)
#   BENCH_WAIT_WORK_MS     the holder's work (200)
#   BENCH_WAIT_PROCESSES   processes the duplicates are spread over (2)
#   BENCH_WAIT_CONNECTIONS HTTP/2 connections per process (1)
#   BENCH_QUIET_WAIT       before each pair of rounds, wait up to this many seconds
#                          for the machine to be quiet: under BENCH_QUIET_PERCENT
#                          (15) of its CPU busy over 100 ms (3; smoke 0: no wait).
#                          The summary counts the rounds in which other processes
#                          took over twice that.
#   BENCH_SERVER_ENV       extra environment for the server, e.g.
#                          "IDEMPOTENCY_COALESCE=false IDEMPOTENCY_REPLAY_CACHE_BYTES=0"
#   BENCH_PG_URL           use this PostgreSQL (loopback only, with
#                          pg_stat_statements loaded) instead of a throwaway
#                          cluster made with initdb on a free port (bench/lib.sh)
#   BENCH_OUT              folder for results (target/bench/wait-<date-time>)
#
# Makes bench/wait/.venv (gitignored: grpcio, grpcio-tools, asyncpg from PyPI)
# and generates the stubs from proto/ into it. The database idempotency_bench_wait
# is made (dropping any left over), migrated by the server binary, and dropped
# at the end. Only loopback addresses are used.
set -eEuo pipefail
cd "$(dirname "$0")/.."
bench_name=wait
source bench/lib.sh

smoke=0
case "${1:-}" in
  --smoke) smoke=1 ;;
  "") ;;
  -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
  *) echo "usage: $0 [--smoke]" >&2; exit 64 ;;
esac
if ((smoke)); then
  rounds="${BENCH_WAIT_ROUNDS:-3}"
  warmup="${BENCH_WAIT_WARMUP:-1}"
  holder_rounds="${BENCH_WAIT_HOLDER_ROUNDS:-3}"
  quiet_wait="${BENCH_QUIET_WAIT:-0}"
else
  rounds="${BENCH_WAIT_ROUNDS:-200}"
  warmup="${BENCH_WAIT_WARMUP:-5}"
  holder_rounds="${BENCH_WAIT_HOLDER_ROUNDS:-20}"
  quiet_wait="${BENCH_QUIET_WAIT:-3}"
fi
quiet_percent="${BENCH_QUIET_PERCENT:-15}"
read -r -a server_env <<<"${BENCH_SERVER_ENV:-}"
out="${BENCH_OUT:-target/bench/wait-$(date +%Y%m%d-%H%M%S)}"
database=idempotency_bench_wait

log() { bench_log "$@"; }
die() { bench_die "$@"; }

for tool in psql python3; do
  command -v "$tool" >/dev/null || die "$tool is not installed"
done
server_source="${IDEMPOTENCY_BIN:-target/release/idempotency-service}"
[[ -x "$server_source" ]] || die "no server binary at $server_source (cargo build --release, or set IDEMPOTENCY_BIN)"

mkdir -p "$out/bin"
out="$(cd "$out" && pwd)"
log "results in $out"

# --- The venv and the stubs ----------------------------------------------------------
venv=bench/wait/.venv
python=${PYTHON:-python3}
mkdir -p "$venv"
(
  flock 9
  if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv" || die "python3 -m venv failed (Debian: apt-get install python3-venv)"
  fi
  stamp="$venv/.installed-1"
  if [[ ! -e "$stamp" ]]; then
    log "installing grpcio, grpcio-tools and asyncpg into $venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
      grpcio==1.85.1 grpcio-tools==1.85.1 asyncpg==0.32.0 >&2
    rm -f "$venv"/.installed-*
    touch "$stamp"
  fi
  rm -rf "$venv/stubs"
  mkdir -p "$venv/stubs"
  "$venv/bin/python" - "$venv/stubs" <<'EOF'
import os, sys
import grpc_tools
from grpc_tools import protoc
well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
status = protoc.main(["protoc", "-Iproto", f"-I{well_known}", f"--python_out={sys.argv[1]}",
                      f"--grpc_python_out={sys.argv[1]}", "proto/idempotency/v1/idempotency.proto"])
sys.exit(status)
EOF
) 9>"$venv/.lock"

# --- PostgreSQL and the server --------------------------------------------------------
server_pid=""
cleanup() {
  stop_pid "$server_pid"
  if [[ -n "${pg_server:-}" ]]; then
    psql "$pg_server/postgres" -qc "DROP DATABASE IF EXISTS $database WITH (FORCE)" >/dev/null 2>&1 || true
  fi
  stop_postgres
}
trap cleanup EXIT
trap 'exit 130' INT TERM
trap 'log "error: line $LINENO: $BASH_COMMAND"' ERR
start_postgres
admin_sql() { psql "$pg_server/postgres" -qAtX -v ON_ERROR_STOP=1 "$@"; }
admin_sql -c "SET client_min_messages = warning" -c "DROP DATABASE IF EXISTS $database WITH (FORCE)" >/dev/null
admin_sql -c "CREATE DATABASE $database" >/dev/null
admin_sql -c 'CREATE EXTENSION IF NOT EXISTS pg_stat_statements' >/dev/null
admin_sql -c 'SELECT count(*) FROM pg_stat_statements' >/dev/null 2>&1 ||
  die "pg_stat_statements is not loaded on this PostgreSQL (shared_preload_libraries): no statement counts"
db_url="$pg_server/$database"

cp "$server_source" "$out/bin/idempotency-service"
server_bin="$out/bin/idempotency-service"
DATABASE_URL="$db_url" RUST_LOG=warn "$server_bin" migrate
start_service "$db_url" warn "$out/server.log" "${server_env[@]}"
server_pid=$service_pid
postmaster_pid=""
if [[ -n "$pg_cluster_dir" ]]; then
  postmaster_pid=$(head -1 "$pg_cluster_dir/data/postmaster.pid")
fi

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "server: $server_source ($(sha256sum "$server_source" | cut -c1-12)); commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "cpus: $(nproc) ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'))"
  echo "memory: $(awk '/MemTotal/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo)"
  echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "postgres: $(admin_sql -c 'SHOW server_version') ($([[ -n "$pg_cluster_dir" ]] && echo "throwaway cluster" || echo "$pg_server"))"
  echo "server environment: ${BENCH_SERVER_ENV:-(defaults)}"
  echo "python: $("$venv/bin/python" -c 'import sys, grpc; print(sys.version.split()[0], "grpcio", grpc.__version__)')"
} >"$out/machine.txt"
cat "$out/machine.txt" >&2

# --- The rounds -------------------------------------------------------------------------
log "$rounds rounds of each mode ($warmup warm-up, $holder_rounds holder-only)"
smoke_flag=()
((smoke)) && smoke_flag=(--smoke)
status=0
PYTHONPATH="$PWD/$venv/stubs:$PWD/bench/wait" "$venv/bin/python" bench/wait/run.py \
  --target "${service_target#http://}" --admin-url "$pg_server/postgres" --database "$database" \
  --server-pid "$server_pid" --postmaster-pid "${postmaster_pid:-0}" --out "$out" \
  --rounds "$rounds" --warmup "$warmup" --holder-rounds "$holder_rounds" \
  --duplicates "${BENCH_WAIT_DUPLICATES:-64}" --work-ms "${BENCH_WAIT_WORK_MS:-200}" \
  --processes "${BENCH_WAIT_PROCESSES:-2}" --connections "${BENCH_WAIT_CONNECTIONS:-1}" \
  --quiet-percent "$quiet_percent" --quiet-wait "$quiet_wait" \
  "${smoke_flag[@]}" || status=$?
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$out/machine.txt"
kill -0 "$server_pid" 2>/dev/null || die "the server exited during the run: see $out/server.log"
((status == 0)) || die "bench/wait/run.py failed (exit $status)"
log "summary: $out/summary.md"
