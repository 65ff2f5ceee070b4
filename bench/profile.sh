#!/usr/bin/env bash
# Where the CPU goes, and whether memory grows: runs the service under one
# load-generator scenario on a fresh database, samples the server's memory
# every few seconds, and (when perf works here) records the whole machine with
# perf for the measured part, then prints who used the CPU (PostgreSQL, the
# server, the load generator, the kernel) and the server's top symbols.
#
#   bench/profile.sh                 claim-complete, 64 callers, 20 s, perf
#   PROFILE_SECONDS=300 PROFILE_CONCURRENCY=256 PROFILE_PERF=0 bench/profile.sh
#                                    the issue's 5-minute memory check
#
# Settings (environment):
#   PROFILE_SCENARIO     load-generator scenario (claim-complete)
#   PROFILE_CONCURRENCY  callers (64)
#   PROFILE_SECONDS      measured seconds (20)
#   PROFILE_PERF         1 to record with perf, 0 not to (default: 1 when
#                        `perf record` works here)
#   PROFILE_RSS_EVERY    seconds between memory samples (5)
#   PROFILE_RUST_LOG     the server's RUST_LOG (warn)
#   BENCH_PG_URL         PostgreSQL server, loopback only (postgres://postgres@127.0.0.1:5432)
#   BENCH_CONNECTIONS    HTTP/2 connections of the load generator (4)
#   BENCH_OUT            folder for results (target/bench/profile-<date-time>)
#   BENCH_SKIP_BUILD=1   use the binaries in target/release as they are
#   BENCH_SERVER_BIN     profile this server binary instead of target/release's
#
# Uses its own database, idempotency_bench_profile, dropped at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

scenario="${PROFILE_SCENARIO:-claim-complete}"
concurrency="${PROFILE_CONCURRENCY:-64}"
seconds="${PROFILE_SECONDS:-20}"
every="${PROFILE_RSS_EVERY:-5}"
connections="${BENCH_CONNECTIONS:-4}"
pg_server="${BENCH_PG_URL:-postgres://postgres@127.0.0.1:5432}"
pg_server="${pg_server%/}"
out="${BENCH_OUT:-target/bench/profile-$(date +%Y%m%d-%H%M%S)}"
database=idempotency_bench_profile
db_url="$pg_server/$database"

log() { printf '[profile %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

[[ "$pg_server" =~ ^postgres(ql)?://([^@/]*@)?(127\.[0-9]+\.[0-9]+\.[0-9]+|localhost|\[::1\])(:[0-9]+)?$ ]] ||
  die "BENCH_PG_URL must be postgres://[user@]HOST[:port] with a loopback HOST: $pg_server"
[[ "$seconds" =~ ^[1-9][0-9]*$ && "$every" =~ ^[1-9][0-9]*$ ]] || die "PROFILE_SECONDS and PROFILE_RSS_EVERY are whole seconds"

if [[ -z "${PROFILE_PERF:-}" ]]; then
  PROFILE_PERF=0
  if command -v perf >/dev/null && perf record -q -o /dev/null -e cpu-clock -- true >/dev/null 2>&1; then
    PROFILE_PERF=1
  fi
fi

mkdir -p "$out"
out="$(cd "$out" && pwd)"
if [[ "${BENCH_SKIP_BUILD:-0}" != 1 ]]; then
  log "building the server and the load generator (release)"
  cargo build --release --quiet --workspace --bins
fi
cp "${BENCH_SERVER_BIN:-target/release/idempotency-service}" "$out/idempotency-service"
cp target/release/idempotency-bench "$out/"

server_pid="" bench_pid="" perf_pid=""
cleanup() {
  for pid in "$perf_pid" "$bench_pid"; do
    [[ -n "$pid" ]] && kill -INT "$pid" 2>/dev/null || true
  done
  if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$server_pid" 2>/dev/null || true
  fi
  psql "$pg_server/postgres" -qc "DROP DATABASE IF EXISTS $database WITH (FORCE)" >/dev/null 2>&1 || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

psql "$pg_server/postgres" -qc "DROP DATABASE IF EXISTS $database WITH (FORCE)" >/dev/null 2>&1
psql "$pg_server/postgres" -qc "CREATE DATABASE $database" >/dev/null
DATABASE_URL="$db_url" RUST_LOG=warn "$out/idempotency-service" migrate

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}
port=$(free_port)
DATABASE_URL="$db_url" IDEMPOTENCY_LISTEN_ADDR="127.0.0.1:$port" IDEMPOTENCY_RUN_MIGRATIONS=false \
  IDEMPOTENCY_METRICS_ADDR="127.0.0.1:$(free_port)" RUST_LOG="${PROFILE_RUST_LOG:-warn}" \
  "$out/idempotency-service" >"$out/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 1 100); do
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
  kill -0 "$server_pid" 2>/dev/null || die "the server exited at start: see $out/server.log"
  sleep 0.1
done

log "$scenario, $concurrency callers, ${seconds}s, perf=$PROFILE_PERF; results in $out"
"$out/idempotency-bench" --target "http://127.0.0.1:$port" --scenario "$scenario" \
  --concurrency "$concurrency" --connections "$connections" --duration "${seconds}s" --warmup 2s \
  --json "$out/bench.json" >"$out/bench.out" 2>&1 &
bench_pid=$!
load_pid=$bench_pid
deadline=$((SECONDS + 300))
until grep -q '^measuring' "$out/bench.out" 2>/dev/null; do
  kill -0 "$bench_pid" 2>/dev/null && ((SECONDS < deadline)) || break
  sleep 0.05
done

if ((PROFILE_PERF)); then
  # The whole machine at 999 Hz: the server, PostgreSQL and the load generator
  # share two cores, so who takes what is half the answer.
  perf record -q -a -F 999 -e cpu-clock -o "$out/perf.data" -- sleep "$seconds" 2>"$out/perf-record.err" &
  perf_pid=$!
fi

echo "seconds,vm_rss_kib,vm_hwm_kib" >"$out/memory.csv"
started=$SECONDS
while kill -0 "$bench_pid" 2>/dev/null && ((SECONDS - started <= seconds + 60)); do
  awk -v t=$((SECONDS - started)) '/^VmRSS:/ { rss = $2 } /^VmHWM:/ { hwm = $2 } END { print t "," rss "," hwm }' \
    "/proc/$server_pid/status" >>"$out/memory.csv"
  sleep "$every"
done
status=0
wait "$bench_pid" || status=$?
bench_pid=""
if [[ -n "$perf_pid" ]]; then wait "$perf_pid" || true; perf_pid=""; fi

cat "$out/bench.out"
echo
echo "## Server memory (KiB), every ${every}s"
column -s, -t "$out/memory.csv" 2>/dev/null || cat "$out/memory.csv"

if ((PROFILE_PERF)) && [[ -s "$out/perf.data" ]]; then
  report() { perf report -i "$out/perf.data" --stdio --no-children "$@" 2>/dev/null | grep -v '^#' | grep -v '^$'; }
  {
    echo
    echo "## CPU by process (share of all samples on both cores; idle is the rest)"
    perf script -i "$out/perf.data" -F pid,comm 2>/dev/null | awk -v server="$server_pid" -v loadgen="$load_pid" '
      { n++; pid = $NF   # perf prints the command (which may hold spaces), then the pid
        if (pid == server) who = "idempotency-service"
        else if (pid == loadgen) who = "idempotency-bench (load generator)"
        else if (pid == 0) who = "idle"
        else if ($1 == "postgres") who = "PostgreSQL"
        else who = "other: " $1
        count[who]++ }
      END { for (w in count) printf "%6.1f%%  %s\n", 100 * count[w] / n, w }' | sort -rn
    echo
    echo "## CPU by binary or library (all processes)"
    report --sort comm,dso --percent-limit 0.5
    echo
    echo "## The server's top symbols (share of the server's own samples)"
    report --pid "$server_pid" --percentage relative --sort dso,sym --percent-limit 0.4 | head -60
    echo
    echo "## PostgreSQL's top symbols (share of PostgreSQL's samples)"
    report --comm postgres --percentage relative --sort dso,sym --percent-limit 0.8 | head -30
  } | tee "$out/perf-report.txt"
fi
exit "$status"
