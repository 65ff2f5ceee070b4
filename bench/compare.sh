#!/usr/bin/env bash
# The service against PostgreSQL itself, in one run on one database.
#
# For each operation (a fresh Claim, a Claim+Complete cycle, a duplicate
# Claim) and each concurrency level, back to back so that both sides see the
# same machine:
#   - pgbench (-M prepared) with the issue's yardstick statements, and with
#     the statements the service sends today for that operation
#     (bench/pgbench/*.sql, generated from src/store/postgres.rs);
#   - idempotency-bench against the service (target/release/idempotency-service
#     on the same database, RUST_LOG=warn), recording the server's resident
#     memory after the point.
# Then pgbench's 64-key unnest claim against ClaimBatch of 100 fresh keys
# (keys per second on both sides), the service-only scenarios (contended, mixed), and Claim+Complete once more on a
# second server with the default info logging, to show what the per-call log
# line costs. It prints both sides with their ratio (service / pgbench), and
# the CPU each side spent per operation (PostgreSQL, the server, the rest).
#
#   bench/compare.sh            full run (BENCH_SECONDS per point, default 20)
#   bench/compare.sh --smoke    1 s per point, levels 1 and 8: proves the
#                               scripts work; fails on any error or missing number
#
# Settings (environment):
#   BENCH_PG_URL        PostgreSQL server, loopback only (postgres://postgres@127.0.0.1:5432)
#   BENCH_SECONDS       measured seconds per point (20; smoke 1)
#   BENCH_WARMUP        the load generator's unrecorded warm-up (2s; smoke 500ms)
#   BENCH_LEVELS        concurrency levels ("1 8 32 64 256"; smoke "1 8")
#   BENCH_CONNECTIONS   HTTP/2 connections of the load generator (4)
#   BENCH_INFO_LEVELS   levels run on both servers, warn and info logging ("1 64"; smoke "8")
#   BENCH_EXTRA_LEVELS  levels of the service-only scenarios contended and mixed ("64"; smoke "8")
#   BENCH_PGBENCH_MAX_CLIENTS  cap on pgbench -c (default: max_connections - 26,
#                       leaving room for the server's pool of 16)
#   BENCH_QUIET_WAIT    before each point, wait up to this many seconds for the
#                       machine to be quiet: under BENCH_QUIET_PERCENT (15) of
#                       its CPU busy over a second (180; smoke 0: no wait)
#   BENCH_RETRIES       run a point again, up to this many times, when other
#                       processes took over 2 x BENCH_QUIET_PERCENT of the CPU
#                       during it (2; smoke 0)
#   BENCH_SYNCHRONOUS_COMMIT  set synchronous_commit for the bench database
#                       (both sides), e.g. off; default: the server's setting
#   BENCH_OUT           folder for results (target/bench/<date-time>)
#   BENCH_SKIP_BUILD=1  use the binaries in target/release as they are
#   BENCH_SERVER_BIN    measure this server binary instead of target/release's
#                       (another checkout's build), and
#   BENCH_STORE_SQL     generate the pgbench scripts from this postgres.rs
#                       (that checkout's src/store/postgres.rs)
#   BENCH_KEEP_LOGS=1   keep pgbench's per-transaction logs
#
# It creates the database idempotency_bench (dropping any left over), applies
# the service's migrations to it with `idempotency-service migrate`, empties
# the table before every point, and drops the database at the end. The
# binaries are copied into the results folder first, so a rebuild during the
# run changes nothing. Only loopback addresses are used. Needs pgbench, psql
# and python3.
set -eEuo pipefail
cd "$(dirname "$0")/.."

smoke=0
case "${1:-}" in
  --smoke) smoke=1 ;;
  "") ;;
  -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
  *) echo "usage: $0 [--smoke]" >&2; exit 64 ;;
esac

if ((smoke)); then
  quiet_wait="${BENCH_QUIET_WAIT:-0}"
  retries="${BENCH_RETRIES:-0}"
  seconds="${BENCH_SECONDS:-1}"
  warmup="${BENCH_WARMUP:-500ms}"
  levels="${BENCH_LEVELS:-1 8}"
  info_levels="${BENCH_INFO_LEVELS:-8}"
  extra_levels="${BENCH_EXTRA_LEVELS:-8}"
else
  quiet_wait="${BENCH_QUIET_WAIT:-180}"
  retries="${BENCH_RETRIES:-2}"
  seconds="${BENCH_SECONDS:-20}"
  warmup="${BENCH_WARMUP:-2s}"
  levels="${BENCH_LEVELS:-1 8 32 64 256}"
  info_levels="${BENCH_INFO_LEVELS:-1 64}"
  extra_levels="${BENCH_EXTRA_LEVELS:-64}"
fi
connections="${BENCH_CONNECTIONS:-4}"
quiet_percent="${BENCH_QUIET_PERCENT:-15}"
pg_server="${BENCH_PG_URL:-postgres://postgres@127.0.0.1:5432}"
pg_server="${pg_server%/}"
out="${BENCH_OUT:-target/bench/$(date +%Y%m%d-%H%M%S)}"
database=idempotency_bench
db_url="$pg_server/$database"

log() { printf '[compare %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# --- Only this machine --------------------------------------------------------------
[[ "$pg_server" =~ ^postgres(ql)?://([^@/]*@)?(127\.[0-9]+\.[0-9]+\.[0-9]+|localhost|\[::1\])(:[0-9]+)?$ ]] ||
  die "BENCH_PG_URL must be postgres://[user@]HOST[:port] with a loopback HOST (no database, no parameters): $pg_server"
[[ "$seconds" =~ ^[1-9][0-9]*$ ]] || die "BENCH_SECONDS must be a whole number of seconds: $seconds"
for tool in pgbench psql python3; do
  command -v "$tool" >/dev/null || die "$tool is not installed"
done

mkdir -p "$out/points" "$out/bin"
out="$(cd "$out" && pwd)"
log "results in $out"

# --- Binaries ---------------------------------------------------------------------
if [[ "${BENCH_SKIP_BUILD:-0}" != 1 ]]; then
  log "building the server and the load generator (release)"
  cargo build --release --quiet --bin idempotency-service --bin idempotency-bench
fi
server_source="${BENCH_SERVER_BIN:-target/release/idempotency-service}"
[[ -x "$server_source" ]] || die "missing $server_source"
[[ -x target/release/idempotency-bench ]] || die "missing target/release/idempotency-bench"
cp "$server_source" "$out/bin/idempotency-service"
cp target/release/idempotency-bench "$out/bin/"
server_bin="$out/bin/idempotency-service"
bench_bin="$out/bin/idempotency-bench"

# --- The pgbench scripts, from the store's current SQL -------------------------------
pgbench_dir="$out/pgbench"
store_sql="${BENCH_STORE_SQL:-src/store/postgres.rs}"
bench/pgbench/generate.sh "$pgbench_dir" "$store_sql"
for file in "$pgbench_dir"/*.sql; do
  if ! cmp -s "$file" "bench/pgbench/$(basename "$file")"; then
    log "warning: bench/pgbench/$(basename "$file") differs from the store's current SQL (using the regenerated one); run bench/pgbench/generate.sh"
  fi
done
cp bench/pgbench/claim-unnest64.sql "$pgbench_dir/"

# --- Servers and the database --------------------------------------------------------
# Two servers at most: "warn" for every point, "info" for the logging points.
declare -A pids=() targets=()
server_pid="" target=""
stop_server() { # name
  local pid="${pids[$1]:-}"
  if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
  pids[$1]=""
}
cleanup() {
  for name in "${!pids[@]}"; do stop_server "$name"; done
  psql "$pg_server/postgres" -qc "DROP DATABASE IF EXISTS $database WITH (FORCE)" >/dev/null 2>&1 || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM
trap 'log "error: line $LINENO: $BASH_COMMAND"' ERR

psql "$pg_server/postgres" -qc "DROP DATABASE IF EXISTS $database WITH (FORCE)" >/dev/null 2>&1
psql "$pg_server/postgres" -qc "CREATE DATABASE $database" >/dev/null
# Time the WAL flushes of this database's sessions (pgbench's and the
# server's), so each point can report how long a commit's fsync took: on a
# shared virtual disk it swings by ten times within seconds.
psql "$pg_server/postgres" -qc "ALTER DATABASE $database SET track_wal_io_timing = on" >/dev/null
if [[ -n "${BENCH_SYNCHRONOUS_COMMIT:-}" ]]; then
  psql "$pg_server/postgres" -qc "ALTER DATABASE $database SET synchronous_commit = '$BENCH_SYNCHRONOUS_COMMIT'" >/dev/null
fi
DATABASE_URL="$db_url" RUST_LOG=warn "$server_bin" migrate
sql() { psql "$db_url" -qAtX -v ON_ERROR_STOP=1 "$@"; }

max_connections=$(sql -c 'SHOW max_connections')
pgbench_cap="${BENCH_PGBENCH_MAX_CLIENTS:-$((max_connections - 26))}"

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  if [[ -n "${BENCH_SERVER_BIN:-}" ]]; then
    echo "server: $BENCH_SERVER_BIN; store SQL: $store_sql"
  else
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- src migrations 2>/dev/null || echo ' (src/ or migrations/ with uncommitted changes)')"
  fi
  echo "cpus: $(nproc) ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'))"
  echo "memory: $(awk '/MemTotal/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo)"
  echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "postgres: $(sql -c 'SHOW server_version')"
  for setting in synchronous_commit fsync wal_sync_method shared_buffers max_connections ssl; do
    echo "postgres $setting: $(sql -c "SHOW $setting")"
  done
  echo "postgres settings for the bench database: $(psql "$pg_server/postgres" -qAtX -c "SELECT array_to_string(setconfig, ', ') FROM pg_db_role_setting s JOIN pg_database d ON d.oid = s.setdatabase WHERE d.datname = '$database'")"
  echo "seconds per point: $seconds; warm-up (service): $warmup; levels: $levels; pgbench clients capped at $pgbench_cap"
  echo "load generator connections: $connections"
} >"$out/machine.txt"
cat "$out/machine.txt" >&2

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}
start_server() { # name RUST_LOG
  local name="$1" port metrics_port logfile="$out/server-$1.log"
  port=$(free_port)
  metrics_port=$(free_port)
  DATABASE_URL="$db_url" IDEMPOTENCY_LISTEN_ADDR="127.0.0.1:$port" IDEMPOTENCY_RUN_MIGRATIONS=false \
    IDEMPOTENCY_METRICS_ADDR="127.0.0.1:$metrics_port" RUST_LOG="$2" "$server_bin" >"$logfile" 2>&1 &
  pids[$name]=$!
  targets[$name]="http://127.0.0.1:$port"
  for _ in $(seq 1 100); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      log "server $name (RUST_LOG=$2): pid ${pids[$name]}, ${targets[$name]}"
      return 0
    fi
    kill -0 "${pids[$name]}" 2>/dev/null || die "server $name exited at start: see $logfile"
    sleep 0.1
  done
  die "server $name did not listen on $port within 10 s: see $logfile"
}
use_server() { server_pid="${pids[$1]}"; target="${targets[$1]}"; }

# --- CPU and memory accounting -------------------------------------------------------
# Clock ticks from /proc: the whole machine (busy, all CPUs); all of PostgreSQL
# (the postmaster with its exited children, and its children alive now); the
# server process.
clk_tck=$(getconf CLK_TCK)
postmaster_pid=$(head -1 "$(sql -c 'SHOW data_directory')/postmaster.pid" 2>/dev/null || true)
machine_ticks() { awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9; exit }' /proc/stat; }
pg_ticks() {
  [[ -n "$postmaster_pid" ]] || return 0
  # Processes come and go while this reads: cat's complaints are expected.
  { cat /proc/[0-9]*/stat 2>/dev/null || true; } | awk -v pm="$postmaster_pid" '
    { pid = $1; sub(/^[^)]*\) /, "")   # now $1 is the state, $2 the parent, $12.. the times
      if (pid == pm) total += $12 + $13 + $14 + $15
      else if ($2 == pm) total += $12 + $13 }
    END { print total + 0 }'
}
process_ticks() { sed 's/^[^)]*) //' "/proc/$1/stat" | awk '{ print $12 + $13 }'; }
memory_kib() { awk -v k="$2:" '$1 == k { print $2 }' "/proc/$1/status"; }

wal_syncs() { sql -F ' ' -c 'SELECT wal_sync, wal_sync_time FROM pg_stat_wal'; }
# CPU seconds of this script's waited-for children (pgbench, the load
# generator; psql is small), from bash's `times` (second line, user and
# system). `times` must run in this shell, not in a $(...) subshell, whose
# children it would count instead.
children_cpu() { # variable to set
  times >"$out/.times"
  printf -v "$1" '%s' "$(awk 'NR == 2 { n = split($0, f, " "); for (i = 1; i <= n; i++) { split(f[i], p, /[ms]/); t += p[1] * 60 + p[2] } print t }' "$out/.times")"
}

# The cheap readings first and last, so the window is what it says; psql
# (slow to start on a loaded machine) inside it.
point_started() {
  t_wall=$(date +%s.%N)
  children_cpu t_children
  t_machine=$(machine_ticks)
  t_pg=$(pg_ticks)
  t_server=""
  if [[ -n "$server_pid" ]]; then t_server=$(process_ticks "$server_pid"); fi
  read -r t_syncs t_sync_ms < <(wal_syncs)
}
# Sets cpu to the point's CPU (ticks) and the server's memory, as JSON
# fields. It runs in this shell (not as $(point_finished)), for `times`.
point_finished() {
  local machine pg=null server=null rss=null hwm=null syncs sync_ms children wall
  if [[ -n "$server_pid" ]]; then server=$(($(process_ticks "$server_pid") - t_server)); fi
  if [[ -n "$t_pg" ]]; then pg=$(($(pg_ticks) - t_pg)); fi
  machine=$(($(machine_ticks) - t_machine))
  children_cpu children
  wall=$(date +%s.%N)
  read -r syncs sync_ms < <(wal_syncs)
  if [[ -n "$server_pid" ]]; then
    rss=$(memory_kib "$server_pid" VmRSS)
    hwm=$(memory_kib "$server_pid" VmHWM)
  fi
  printf -v cpu '"clk_tck": %s, "cpus": %s, "wall_s": %s, "machine_ticks": %s, "pg_ticks": %s, "server_ticks": %s, "client_cpu_s": %s, "server_rss_kib": %s, "server_hwm_kib": %s, "wal_syncs": %s, "wal_sync_ms": %s' \
    "$clk_tck" "$(nproc)" "$(python3 -c "print(round($wall - $t_wall, 3))")" "$machine" "$pg" "$server" \
    "$(python3 -c "print(round($children - $t_children, 3))")" "$rss" "$hwm" "$((syncs - t_syncs))" \
    "$(python3 -c "print(round($sync_ms - $t_sync_ms, 3))")"
}

# Waits (bounded) until the machine is quiet: this project's builds and tests
# share its two cores, and a point measured beside a compiler is noise.
wait_quiet() {
  ((quiet_wait > 0)) || return 0
  local until=$((SECONDS + quiet_wait)) before after busy
  while :; do
    before=$(awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9, $5 + $6; exit }' /proc/stat)
    sleep 1
    after=$(awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9, $5 + $6; exit }' /proc/stat)
    busy=$(awk -v b="$before" -v a="$after" 'BEGIN { split(b, x, " "); split(a, y, " ");
      t = (y[1] - x[1]) + (y[2] - x[2]); print (t > 0 ? int(100 * (y[1] - x[1]) / t) : 0) }')
    ((busy < quiet_percent)) && return 0
    if ((SECONDS >= until)); then
      log "the machine is still busy (${busy}% of its CPU): measuring anyway"
      return 0
    fi
    log "waiting for a quiet machine (${busy}% of its CPU busy)"
    sleep 4
  done
}

# Runs a point (a function and its arguments) until other processes took at
# most 2 x BENCH_QUIET_PERCENT of the CPU during it, at most 1 + BENCH_RETRIES
# times. The point's JSON is the last one it wrote (in $point_json).
measured() {
  local attempt load
  for ((attempt = 0; attempt <= retries; attempt++)); do
    wait_quiet
    "$@"
    ((retries > 0)) || return 0
    load=$(python3 bench/summarize.py --other-load "$point_json" 2>/dev/null || echo -1)
    if ((load <= 2 * quiet_percent)); then return 0; fi
    if ((attempt < retries)); then
      log "disturbed: other processes took ${load}% of the CPU; again"
    else
      log "disturbed: other processes took ${load}% of the CPU; keeping it (see 'other load %')"
    fi
  done
}

# Every point starts from an empty table after a checkpoint, whatever ran before.
fresh_table() {
  sql -c 'TRUNCATE idempotency_records' -c 'CHECKPOINT'
}

# --- One pgbench point ------------------------------------------------------------------
token='\x00112233445566778899aabbccddeeff'
response="\\x$(printf '72%.0s' $(seq 64))"
duplicate_keys=1000

pgbench_point() { # script level
  local scenario="$1" level="$2" clients threads name namespace status=0
  clients=$((level < pgbench_cap ? level : pgbench_cap))
  threads=$((clients < 2 ? clients : 2))
  name="pgbench-$scenario-c$level"
  namespace="pgb-$scenario-c$level"
  fresh_table
  if [[ "$scenario" == duplicate-* ]]; then
    # Completed keys '1'..'1000', as the store's Complete leaves them.
    sql -c "INSERT INTO idempotency_records
            SELECT '$namespace', g::text, 2, 1, '$token'::bytea, NULL, '$response'::bytea,
                   86400000000, NULL, now() + interval '24 hours', now(), now()
            FROM generate_series(1, $duplicate_keys) AS g"
  fi
  log "pgbench $scenario: $clients clients, ${seconds}s"
  rm -f "$out/points/$name".log*
  server_pid=""
  point_started
  pgbench -n -M prepared -c "$clients" -j "$threads" -T "$seconds" \
    -D ns="$namespace" -D n=0 -D token="$token" -D ttl_us=30000000 -D ret_us=86400000000 \
    -D resp="$response" -D dupkeys="$duplicate_keys" \
    --log --log-prefix="$out/points/$name.log" \
    -f "$pgbench_dir/$scenario.sql" "$db_url" >"$out/points/$name.out" 2>&1 || status=$?
  point_finished
  printf '{"source": "pgbench", "scenario": "%s", "level": %s, "clients": %s, "exit_status": %s, "output": "%s", "log_prefix": "%s", %s}\n' \
    "$scenario" "$level" "$clients" "$status" "$out/points/$name.out" "$out/points/$name.log" "$cpu" \
    >"$out/points/$name.json"
  point_json="$out/points/$name.json"
  ((status == 0)) || log "pgbench $scenario at $clients clients failed (exit $status): see $out/points/$name.out"
}

# --- One service point ------------------------------------------------------------------
service_point() { # server label scenario level
  local server="$1" label="$2" scenario="$3" level="$4" status=0 bench_pid deadline
  local name="service-$label-c$level"
  use_server "$server"
  fresh_table
  log "service $label: $level callers, ${seconds}s (+$warmup warm-up)"
  "$bench_bin" --target "$target" --scenario "$scenario" --concurrency "$level" \
    --connections "$connections" --duration "${seconds}s" --warmup "$warmup" \
    --namespace "svc-$label-c$level" --json "$out/points/$name.bench.json" \
    >"$out/points/$name.out" 2>&1 &
  bench_pid=$!
  # Count CPU from the end of the load generator's setup and warm-up, which it
  # announces, to its exit: the window its operation count covers.
  deadline=$((SECONDS + 300))
  until grep -q '^measuring' "$out/points/$name.out" 2>/dev/null; do
    kill -0 "$bench_pid" 2>/dev/null && ((SECONDS < deadline)) || break
    sleep 0.02
  done
  point_started
  wait "$bench_pid" || status=$?
  point_finished
  printf '{"source": "service", "scenario": "%s", "label": "%s", "level": %s, "clients": %s, "exit_status": %s, "output": "%s", "bench_json": "%s", %s}\n' \
    "$scenario" "$label" "$level" "$level" "$status" "$out/points/$name.out" "$out/points/$name.bench.json" "$cpu" \
    >"$out/points/$name.json"
  point_json="$out/points/$name.json"
  ((status == 0)) || log "idempotency-bench $label at $level failed (exit $status): see $out/points/$name.out"
}

# --- The run ----------------------------------------------------------------------------
start_server warn warn
# operation (load generator scenario) : the yardstick script : the script as sent today
for pair in claim:claim:claim-as-sent \
  claim-complete:claim-complete:claim-complete-as-sent \
  duplicate:duplicate-upsert:duplicate-as-sent; do
  IFS=: read -r scenario yardstick as_sent <<<"$pair"
  for level in $levels; do
    measured pgbench_point "$yardstick" "$level"
    measured pgbench_point "$as_sent" "$level"
    measured service_point warn "$scenario" "$scenario" "$level"
  done
done
for level in $levels; do
  measured pgbench_point claim-unnest64 "$level"
  measured service_point warn claim-batch claim-batch "$level"
done
for scenario in contended mixed; do
  for level in $extra_levels; do measured service_point warn "$scenario" "$scenario" "$level"; done
done
if [[ -n "$info_levels" ]]; then
  start_server info info
  for level in $info_levels; do
    measured service_point warn claim-complete-warn claim-complete "$level"
    measured service_point info claim-complete-info claim-complete "$level"
  done
  stop_server info
  log "info log: $(wc -l <"$out/server-info.log") lines, $(du -h "$out/server-info.log" | cut -f1)"
fi
stop_server warn

# --- The tables -------------------------------------------------------------------------
status=0
python3 bench/summarize.py "$out" || status=$?
# The per-transaction logs were only needed for pgbench's percentiles.
[[ "${BENCH_KEEP_LOGS:-0}" == 1 ]] || rm -f "$out"/points/pgbench-*.log.*
log "summary: $out/summary.md"
exit "$status"
