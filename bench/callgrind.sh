#!/usr/bin/env bash
# What a lone call costs the server, in counts that do not depend on the
# machine's noise: instructions (valgrind's callgrind) and system calls
# (strace -c), per Claim+Complete cycle at one caller. The figures of
# docs/benchmarks.md's "A lone call" come from here.
#
# For each RUST_LOG level (warn, then info: the per-call log line):
#   1. the server under callgrind on a fresh database; BENCH_WARMUP cycles,
#      then the counters are zeroed (callgrind_control -z), BENCH_CYCLES
#      cycles, and the counters dumped (callgrind_control -d);
#   2. the server under `strace -c -f`, the same sequence (strace counts from
#      the start, so the warm-up's calls are subtracted by running the warm-up
#      alone first under a separate strace).
# Prints instructions and system calls per cycle, and the top functions by
# inclusive instructions (callgrind_annotate) into BENCH_OUT.
#
#   bench/callgrind.sh
#   BENCH_CYCLES=100 BENCH_WARMUP=20 BENCH_LEVELS=warn BENCH_SKIP_BUILD=1 bench/callgrind.sh
#                       CI's smoke run: proves the script works; fails on any
#                       missing number
#
# Settings (environment):
#   BENCH_CYCLES        measured cycles (2000)
#   BENCH_WARMUP        warm-up cycles, not counted (500)
#   BENCH_LEVELS        RUST_LOG levels to measure ("warn info")
#   BENCH_PG_URL        PostgreSQL server, loopback only (default: a throwaway
#                       cluster made with initdb)
#   BENCH_OUT           folder for results (target/bench/callgrind-<date-time>)
#   BENCH_SKIP_BUILD=1  use the binaries in target/release as they are
#   BENCH_SERVER_BIN    measure this server binary instead of target/release's
#                       (an older commit's, to compare)
#
# Needs valgrind (callgrind_control, callgrind_annotate) and strace; installs
# them from Debian when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
bench_name=callgrind
source bench/lib.sh

cycles="${BENCH_CYCLES:-2000}"
warmup="${BENCH_WARMUP:-500}"
levels="${BENCH_LEVELS:-warn info}"
out="${BENCH_OUT:-target/bench/callgrind-$(date +%Y%m%d-%H%M%S)}"
[[ "$cycles" =~ ^[1-9][0-9]*$ && "$warmup" =~ ^[1-9][0-9]*$ ]] || bench_die "BENCH_CYCLES and BENCH_WARMUP are whole numbers above 0"
# valgrind and strace from Debian when missing (as the Go example's script
# installs Go), so that scripts/test-all.sh needs nothing installed by hand.
missing=()
command -v callgrind_control >/dev/null || missing+=(valgrind)
command -v strace >/dev/null || missing+=(strace)
if ((${#missing[@]})); then
  bench_log "installing ${missing[*]} from Debian"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
for tool in valgrind callgrind_control callgrind_annotate strace; do
  command -v "$tool" >/dev/null || bench_die "$tool is missing (Debian: valgrind, strace)"
done

mkdir -p "$out"
out="$(cd "$out" && pwd)"
if [[ "${BENCH_SKIP_BUILD:-0}" != 1 ]]; then
  bench_log "building the server and the load generator (release)"
  cargo build --release --quiet --workspace --bins
fi
server_bin="$out/idempotency-service"
cp "${BENCH_SERVER_BIN:-target/release/idempotency-service}" "$server_bin"
cp target/release/idempotency-bench "$out/"

cleanup() {
  stop_pid "$service_pid"
  stop_postgres
}
trap cleanup EXIT
trap 'exit 130' INT TERM

start_postgres
service_wait_s=60 # valgrind starts slowly

# A fresh database with the migrations applied; sets db_url.
fresh_database() {
  local name=idempotency_bench_callgrind
  psql "$pg_server/postgres" -qc "DROP DATABASE IF EXISTS $name WITH (FORCE)" >/dev/null
  psql "$pg_server/postgres" -qc "CREATE DATABASE $name" >/dev/null
  db_url="$pg_server/$name"
  DATABASE_URL="$db_url" RUST_LOG=warn "$server_bin" migrate >/dev/null
}

# Runs COUNT Claim+Complete cycles at one caller against $service_target.
cycles_of() { # count json
  "$out/idempotency-bench" --target "$service_target" --scenario claim-complete --concurrency 1 \
    --connections 1 --requests "$1" --warmup 0s --wait-ready 120s --json "$2" >/dev/null 2>>"$out/load-generator.log"
}

# The server under a wrapper (valgrind, strace), metrics off as in the figures.
start_wrapped() { # rust_log logfile wrapper...
  local rust_log="$1" logfile="$2"
  shift 2
  service_wrapper=("$@")
  start_service "$db_url" "$rust_log" "$logfile" IDEMPOTENCY_METRICS_ADDR=
}

# strace -c's total calls from its summary table.
strace_total() { awk '$NF == "total" { print $4 }' "$1" | tail -1; }

# Stops the server under strace (its child), and strace with it, which then
# writes its summary.
stop_traced() {
  local child
  child=$(pgrep -P "$service_pid" | head -1 || true)
  [[ -n "$child" ]] && kill -TERM "$child" 2>/dev/null || true
  for _ in $(seq 1 100); do kill -0 "$service_pid" 2>/dev/null || break; sleep 0.1; done
  stop_pid "$service_pid"
  service_pid=""
}

results="$out/results.txt"
: >"$results"
for level in $levels; do
  bench_log "RUST_LOG=$level: callgrind, $warmup warm-up cycles, then $cycles counted"
  fresh_database
  start_wrapped "$level" "$out/server-callgrind-$level.log" \
    valgrind --tool=callgrind --callgrind-out-file="$out/callgrind-$level.%p.out"
  cycles_of "$warmup" "$out/warmup-$level.json"
  callgrind_control -z "$service_pid" >/dev/null
  cycles_of "$cycles" "$out/cycles-$level.json"
  callgrind_control -d "$service_pid" >/dev/null
  stop_pid "$service_pid"
  service_pid=""
  # The dump after zeroing is the file with the highest part number.
  dump=$(ls -v "$out"/callgrind-"$level".*.out.* 2>/dev/null | tail -1)
  [[ -n "$dump" ]] || bench_die "no callgrind dump in $out"
  instructions=$(awk '/^summary:/ { print $2 }' "$dump")
  [[ "$instructions" =~ ^[0-9]+$ ]] || bench_die "no summary line in $dump"
  callgrind_annotate --inclusive=yes "$dump" 2>/dev/null | head -60 >"$out/top-$level.txt" || true

  bench_log "RUST_LOG=$level: strace -c -f, the warm-up alone, then warm-up and $cycles cycles"
  counts=()
  for run in warmup all; do
    fresh_database
    start_wrapped "$level" "$out/server-strace-$level-$run.log" \
      strace -c -f -o "$out/strace-$level-$run.txt"
    cycles_of "$warmup" "$out/strace-warmup-$level-$run.json"
    [[ $run == warmup ]] || cycles_of "$cycles" "$out/strace-cycles-$level.json"
    stop_traced
    counts+=("$(strace_total "$out/strace-$level-$run.txt")")
  done
  [[ "${counts[0]}" =~ ^[0-9]+$ && "${counts[1]}" =~ ^[0-9]+$ ]] || bench_die "no strace summary in $out/strace-$level-*.txt"
  syscalls=$(( counts[1] - counts[0] ))
  printf '%s\t%s\t%s\n' "$level" \
    "$(python3 -c "print(f'{$instructions / $cycles:,.0f}')")" \
    "$(python3 -c "print(f'{$syscalls / $cycles:.1f}')")" | tee -a "$results"
done

{
  printf '\n| RUST_LOG | instructions per cycle | system calls per cycle |\n|---|---:|---:|\n'
  while IFS=$'\t' read -r level ins sys; do printf '| %s | %s | %s |\n' "$level" "$ins" "$sys"; done <"$results"
} | tee "$out/summary.md"
bench_log "results in $out"
