#!/usr/bin/env bash
# Where a server's instructions go, per Claim and per Complete, by component
# (issue 34): tonic/hyper/h2, prost, tracing, metrics, the access policy, the
# replay cache, the coalescer, sqlx, tokio, malloc/free and the rest.
#
# For each server (the service with its default settings at RUST_LOG=warn;
# idempotency-floor with a database; idempotency-floor bare) and each of two
# load-generator scenarios at one caller, on one HTTP/2 connection:
#   - `claim`: lone Claims of fresh keys;
#   - `claim-complete`: Claim+Complete cycles of fresh keys;
# it starts the server under valgrind's callgrind on a throwaway PostgreSQL,
# runs BENCH_WARMUP operations, zeroes the counters (callgrind_control -z),
# runs BENCH_CALLS operations, dumps the counters (callgrind_control -d) and
# stops the server. Then bench/components.py groups each dump's functions by
# component: per Claim is the claim dump / BENCH_CALLS, per Complete the cycle
# dump's per-cycle figure minus that. Instruction counts do not depend on the
# machine's load (times do); they do include what the server did in the
# window besides the calls (its background tasks, the load generator's
# connection set-up and its readiness Get: a few hundred instructions per
# call at 1000 calls).
#
#   bench/breakdown.sh
#   BENCH_CALLS=50 BENCH_WARMUP=10 BENCH_SKIP_BUILD=1 bench/breakdown.sh
#                       a quick check that the script works
#
# Settings (environment):
#   BENCH_CALLS         measured operations per dump (1000)
#   BENCH_WARMUP        operations before the counters are zeroed (200)
#   BENCH_SERVERS       which servers ("service database bare")
#   BENCH_SERVER_ENV    extra environment for the service, e.g.
#                       "IDEMPOTENCY_COALESCE=false IDEMPOTENCY_REPLAY_CACHE_BYTES=0"
#   BENCH_PG_URL        PostgreSQL server, loopback only (default: a throwaway
#                       cluster made with initdb)
#   BENCH_OUT           folder for results (target/bench/breakdown-<date-time>)
#   BENCH_SKIP_BUILD=1  use the binaries in target/release as they are
#   BENCH_SERVER_BIN    measure this service binary instead of target/release's
#
# Writes BENCH_OUT/breakdown.md (printed too) and breakdown.json; the dumps
# stay in BENCH_OUT for callgrind_annotate. Needs valgrind and python3.
set -euo pipefail
cd "$(dirname "$0")/.."
bench_name=breakdown
source bench/lib.sh

calls="${BENCH_CALLS:-1000}"
warmup="${BENCH_WARMUP:-200}"
servers="${BENCH_SERVERS:-service database bare}"
read -r -a service_env <<<"${BENCH_SERVER_ENV:-}"
out="${BENCH_OUT:-target/bench/breakdown-$(date +%Y%m%d-%H%M%S)}"
[[ "$calls" =~ ^[1-9][0-9]*$ && "$warmup" =~ ^[1-9][0-9]*$ ]] || bench_die "BENCH_CALLS and BENCH_WARMUP are whole numbers above 0"
for tool in valgrind callgrind_control python3 psql; do
  command -v "$tool" >/dev/null || bench_die "$tool is missing"
done

mkdir -p "$out"
out="$(cd "$out" && pwd)"
if [[ "${BENCH_SKIP_BUILD:-0}" != 1 ]]; then
  bench_log "building the server, the load generator and the floor (release)"
  cargo build --release --quiet --workspace --bins
fi
for binary in "${BENCH_SERVER_BIN:-target/release/idempotency-service}" target/release/idempotency-bench target/release/idempotency-floor; do
  [[ -x "$binary" ]] || bench_die "missing $binary"
done
cp "${BENCH_SERVER_BIN:-target/release/idempotency-service}" "$out/idempotency-service"
cp target/release/idempotency-bench target/release/idempotency-floor "$out/"

cleanup() {
  stop_pid "$service_pid"
  stop_postgres
}
trap cleanup EXIT
trap 'exit 130' INT TERM

start_postgres
service_wait_s=60 # valgrind starts slowly
database=idempotency_bench_breakdown
psql "$pg_server/postgres" -qc "DROP DATABASE IF EXISTS $database WITH (FORCE)" >/dev/null
psql "$pg_server/postgres" -qc "CREATE DATABASE $database" >/dev/null
db_url="$pg_server/$database"
DATABASE_URL="$db_url" RUST_LOG=warn "$out/idempotency-service" migrate >/dev/null
psql "$db_url" -qX -v ON_ERROR_STOP=1 -f bench/handwritten/schema.sql >/dev/null

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "service: ${BENCH_SERVER_BIN:-target/release/idempotency-service}, RUST_LOG=warn, settings: defaults ${BENCH_SERVER_ENV:-}"
  echo "calls per dump: $calls after $warmup unmeasured; one caller, one HTTP/2 connection"
  echo "valgrind: $(valgrind --version); postgres: $(psql "$db_url" -qAtX -c 'SHOW server_version')"
  echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
} >"$out/machine.txt"

# COUNT operations of SCENARIO at one caller against $service_target.
operations() { # scenario count json
  "$out/idempotency-bench" --target "$service_target" --scenario "$1" --concurrency 1 \
    --connections 1 --requests "$2" --warmup 0s --wait-ready 120s --json "$3" >/dev/null 2>>"$out/load-generator.log"
}

specs=()
for server in $servers; do
  dumps=()
  for scenario in claim claim-complete; do
    name="$server-$scenario"
    service_wrapper=(valgrind --tool=callgrind --callgrind-out-file="$out/$name.%p.out")
    case "$server" in
      service) server_bin="$out/idempotency-service" start_service "$db_url" warn "$out/$name.server.log" "${service_env[@]}" ;;
      database | bare) server_bin="$out/idempotency-floor" start_service "$db_url" warn "$out/$name.server.log" IDEMPOTENCY_FLOOR="$server" ;;
      *) bench_die "BENCH_SERVERS: unknown server $server (service, database, bare)" ;;
    esac
    bench_log "$server, $scenario: $warmup unmeasured, then $calls under callgrind"
    operations "$scenario" "$warmup" "$out/$name.warmup.json"
    callgrind_control -z "$service_pid" >/dev/null 2>&1
    operations "$scenario" "$calls" "$out/$name.json"
    callgrind_control -d "$service_pid" >/dev/null 2>&1
    stop_pid "$service_pid"
    service_pid=""
    # The dump after zeroing is the file with the highest part number.
    dump=$(ls -v "$out/$name".*.out.* 2>/dev/null | tail -1)
    [[ -n "$dump" ]] || bench_die "no callgrind dump for $name in $out"
    grep -q '^summary: [0-9]' "$dump" || bench_die "no summary line in $dump"
    dumps+=("$dump")
  done
  specs+=("$server=$calls:${dumps[0]}:${dumps[1]}")
done

{
  echo '```'
  cat "$out/machine.txt"
  echo '```'
  echo
  python3 bench/components.py --json "$out/breakdown.json" "${specs[@]}"
} >"$out/breakdown.md"
cat "$out/breakdown.md"
bench_log "results in $out"
