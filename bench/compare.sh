#!/usr/bin/env bash
# The service against the SQL a team would write by hand, in one run on one
# PostgreSQL.
#
# The yardstick (bench/handwritten/, issue 13) is a dedup table of the team's
# own (`idempotency_keys`) and the statements a team would write for it: a
# claiming upsert, then a guarded UPDATE that stores the result. pgbench runs
# them with -M prepared and per-transaction logs. For each operation and
# concurrency level, back to back so that both sides see the same machine:
#   - pgbench with the hand-written statements (the yardstick);
#   - pgbench with the statements the service's store sends for that
#     operation one call at a time (bench/pgbench/*.sql, generated from
#     src/store/postgres/sql.rs): what the service would cost without its own
#     batching and caching;
#   - idempotency-bench against a fresh server (the release binary, RUST_LOG=warn),
#     one HTTP/2 connection per caller.
# Operations: Claim+Complete of fresh keys, duplicate Claims of 100 completed
# keys, fresh Claims, and ClaimBatch of 100 keys against the hand-written
# 64-key upsert; then the service-only scenarios (contended, mixed) and
# Claim+Complete at the default info logging, to show the per-call log line.
#
# The floors (issue 34): at BENCH_FLOOR_LEVELS, right after the service's
# Claim+Complete at that level, the same load against idempotency-floor
# (bench/loadgen/src/floor), a minimal tonic server of the same RPCs: bare
# (fixed answers, no database), then with a database (each Claim the
# hand-written upsert, each Complete the guarded UPDATE, one prepared
# statement per RPC through sqlx, on the hand-written table). The summary
# prints the server's CPU per RPC for the three and the service's ratios to
# both floors.
#
# Every point starts the same way: the table emptied, 100 completed keys
# seeded, VACUUM ANALYZE, CHECKPOINT. So plans are made on a table analysed
# at 100 rows, as on a new deployment. Each point records throughput, p50 and
# p99, the CPU that PostgreSQL, the server and the client spent per
# operation, the statements PostgreSQL ran per operation (pg_stat_statements)
# and the tuples it read by sequential scan; the summary prints both sides
# with their ratio (service / hand-written SQL).
#
#   bench/compare.sh            full run (BENCH_SECONDS per point, default 15)
#   bench/compare.sh --smoke    1 s per point, levels 1 and 8: proves the
#                               scripts work; fails on any error or missing number
#
# Settings (environment):
#   BENCH_PG_URL        use this PostgreSQL server (loopback only) instead of a
#                       throwaway cluster; e.g. postgres://postgres@127.0.0.1:5432.
#                       Without it, compare.sh makes its own cluster with initdb
#                       (default settings and durability, max_connections 300 so
#                       that pgbench can serve 256 clients, pg_stat_statements),
#                       on a free port, and removes it at the end.
#   BENCH_SECONDS       measured seconds per point (15; smoke 1)
#   BENCH_WARMUP        the load generator's unrecorded warm-up (2s; smoke 500ms)
#   BENCH_LEVELS        concurrency levels ("1 8 32 64 256"; smoke "1 8")
#   BENCH_OPERATIONS    which comparisons ("claim-complete duplicate claim claim-batch")
#   BENCH_AS_SENT       1 (default) to also run the store's statements in pgbench
#   BENCH_CONNECTIONS   HTTP/2 connections of the load generator (default: one per caller)
#   BENCH_INFO_LEVELS   levels of Claim+Complete at RUST_LOG=info ("1 64"; smoke "8")
#   BENCH_EXTRA_LEVELS  levels of the service-only scenarios contended and mixed ("64"; smoke "8")
#   BENCH_FLOOR_LEVELS  levels of the two floors' Claim+Complete ("1 8 64"; smoke "8"; "" for none)
#   BENCH_RESPONSE_BYTES  the stored result's size (200)
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
#   BENCH_HANDWRITTEN_OPTIONS  PGOPTIONS for the hand-written statements (none:
#                       the server's defaults, as a team's code would have); e.g.
#                       "-c enable_seqscan=off -c plan_cache_mode=force_generic_plan",
#                       the store's settings, to see the yardstick without the
#                       stale-plan scans a fresh table gives it
#   BENCH_SERVER_ENV    extra environment for the server, e.g.
#                       "IDEMPOTENCY_COALESCE=false IDEMPOTENCY_REPLAY_CACHE_BYTES=0"
#   BENCH_OUT           folder for results (target/bench/<date-time>)
#   BENCH_SKIP_BUILD=1  use the binaries in target/release as they are
#   BENCH_SERVER_BIN    measure this server binary instead of target/release's
#                       (another checkout's build), and
#   BENCH_STORE_SQL     generate the as-sent pgbench scripts from this sql.rs
#                       (or an older checkout's src/store/postgres.rs)
#   BENCH_KEEP_LOGS=1   keep pgbench's per-transaction logs
#
# It creates the database idempotency_bench (dropping any left over), applies
# the service's migrations and bench/handwritten/schema.sql to it, and drops
# it at the end. The binaries are copied into the results folder first, so a
# rebuild during the run changes nothing. Only loopback addresses are used.
# Needs pgbench, psql and python3 (and initdb/pg_ctl for the throwaway cluster).
set -eEuo pipefail
cd "$(dirname "$0")/.."
bench_name=compare
source bench/lib.sh

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
  info_levels="${BENCH_INFO_LEVELS-8}"
  extra_levels="${BENCH_EXTRA_LEVELS-8}"
  floor_levels="${BENCH_FLOOR_LEVELS-8}"
else
  quiet_wait="${BENCH_QUIET_WAIT:-180}"
  retries="${BENCH_RETRIES:-2}"
  seconds="${BENCH_SECONDS:-15}"
  warmup="${BENCH_WARMUP:-2s}"
  levels="${BENCH_LEVELS:-1 8 32 64 256}"
  info_levels="${BENCH_INFO_LEVELS-1 64}"
  extra_levels="${BENCH_EXTRA_LEVELS-64}"
  floor_levels="${BENCH_FLOOR_LEVELS-1 8 64}"
fi
operations="${BENCH_OPERATIONS:-claim-complete duplicate claim claim-batch}"
as_sent="${BENCH_AS_SENT:-1}"
quiet_percent="${BENCH_QUIET_PERCENT:-15}"
response_bytes="${BENCH_RESPONSE_BYTES:-200}"
read -r -a server_env <<<"${BENCH_SERVER_ENV:-}"
out="${BENCH_OUT:-target/bench/$(date +%Y%m%d-%H%M%S)}"
database=idempotency_bench
duplicate_keys=100

log() { bench_log "$@"; }
die() { bench_die "$@"; }

[[ "$seconds" =~ ^[1-9][0-9]*$ ]] || die "BENCH_SECONDS must be a whole number of seconds: $seconds"
for tool in pgbench psql python3; do
  command -v "$tool" >/dev/null || die "$tool is not installed"
done

mkdir -p "$out/points" "$out/bin"
out="$(cd "$out" && pwd)"
log "results in $out"

# --- PostgreSQL: the one BENCH_PG_URL names, or a throwaway cluster --------------
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
db_url="$pg_server/$database"
admin_sql() { psql "$pg_server/postgres" -qAtX -v ON_ERROR_STOP=1 "$@"; }
sql() { psql "$db_url" -qAtX -v ON_ERROR_STOP=1 "$@"; }

# --- Binaries ---------------------------------------------------------------------
if [[ "${BENCH_SKIP_BUILD:-0}" != 1 ]]; then
  log "building the server and the load generator (release)"
  cargo build --release --quiet --workspace --bins
fi
server_source="${BENCH_SERVER_BIN:-target/release/idempotency-service}"
[[ -x "$server_source" ]] || die "missing $server_source"
[[ -x target/release/idempotency-bench ]] || die "missing target/release/idempotency-bench"
cp "$server_source" "$out/bin/idempotency-service"
cp target/release/idempotency-bench "$out/bin/"
server_bin="$out/bin/idempotency-service"
bench_bin="$out/bin/idempotency-bench"
if [[ -n "$floor_levels" ]]; then
  [[ -x target/release/idempotency-floor ]] || die "missing target/release/idempotency-floor"
  cp target/release/idempotency-floor "$out/bin/"
fi
floor_bin="$out/bin/idempotency-floor"

# --- The pgbench scripts ------------------------------------------------------------
pgbench_dir="$out/pgbench"
store_sql="${BENCH_STORE_SQL:-src/store/postgres/sql.rs}"
bench/pgbench/generate.sh "$pgbench_dir" "$store_sql"
for file in "$pgbench_dir"/*.sql; do
  if ! cmp -s "$file" "bench/pgbench/$(basename "$file")"; then
    log "warning: bench/pgbench/$(basename "$file") differs from the store's current SQL (using the regenerated one); run bench/pgbench/generate.sh"
  fi
done
mkdir -p "$out/handwritten"
cp bench/handwritten/*.sql "$out/handwritten/"

# --- The database ---------------------------------------------------------------------
admin_sql -c "DROP DATABASE IF EXISTS $database WITH (FORCE)" >/dev/null
admin_sql -c "CREATE DATABASE $database" >/dev/null
# Time the WAL flushes of this database's sessions, so each point can report
# how long a commit's fsync took: on a shared virtual disk it swings by ten
# times within seconds.
admin_sql -c "ALTER DATABASE $database SET track_wal_io_timing = on" >/dev/null 2>&1 || true
if [[ -n "${BENCH_SYNCHRONOUS_COMMIT:-}" ]]; then
  admin_sql -c "ALTER DATABASE $database SET synchronous_commit = '$BENCH_SYNCHRONOUS_COMMIT'" >/dev/null
fi
DATABASE_URL="$db_url" RUST_LOG=warn "$server_bin" migrate
sql -f bench/handwritten/schema.sql >/dev/null
# Statements per operation come from pg_stat_statements, when the server
# loads it (the throwaway cluster does).
statements_known=0
if admin_sql -c 'CREATE EXTENSION IF NOT EXISTS pg_stat_statements' >/dev/null 2>&1 &&
  admin_sql -c 'SELECT count(*) FROM pg_stat_statements' >/dev/null 2>&1; then
  statements_known=1
else
  log "pg_stat_statements is not loaded on this server: no statement counts"
fi
db_oid=$(admin_sql -c "SELECT oid FROM pg_database WHERE datname = '$database'")

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
  echo "postgres: $(sql -c 'SHOW server_version') ($([[ -n "$pg_cluster_dir" ]] && echo "throwaway cluster" || echo "$pg_server"))"
  for setting in synchronous_commit fsync wal_sync_method shared_buffers max_connections ssl; do
    echo "postgres $setting: $(sql -c "SHOW $setting")"
  done
  echo "postgres settings for the bench database: $(admin_sql -c "SELECT array_to_string(setconfig, ', ') FROM pg_db_role_setting s JOIN pg_database d ON d.oid = s.setdatabase WHERE d.datname = '$database'")"
  echo "server environment: ${BENCH_SERVER_ENV:-(defaults)}"
  echo "hand-written statements' PGOPTIONS: ${BENCH_HANDWRITTEN_OPTIONS:-(none)}"
  echo "seconds per point: $seconds; warm-up (service): $warmup; levels: $levels; pgbench clients capped at $pgbench_cap"
  echo "floors (bare, database) at: ${floor_levels:-(none)}"
  echo "load generator connections: ${BENCH_CONNECTIONS:-one per caller}; stored result: $response_bytes bytes"
} >"$out/machine.txt"
cat "$out/machine.txt" >&2

# --- CPU, memory and statement accounting ---------------------------------------------
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

# WAL flushes (count, ms) of the whole server; read from the postgres database
# so that these readings never count as the bench database's statements.
wal_syncs() { admin_sql -F ' ' -c 'SELECT wal_sync, wal_sync_time FROM pg_stat_wal'; }
# Statements the bench database ran since the last reset (the health check's
# SELECT 1 and this script's own reading of seq_tuples left out), and a dump
# of the busiest ones.
statements_reset() { ((statements_known)) && admin_sql -c 'SELECT pg_stat_statements_reset()' >/dev/null || true; }
statements_count() {
  if ((statements_known)); then
    admin_sql -c "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements WHERE dbid = $db_oid AND query NOT IN ('SELECT 1', 'SELECT \$1') AND query NOT LIKE '%pg_stat_user_tables%'"
  else
    echo null
  fi
}
statements_dump() { # file
  ((statements_known)) || return 0
  admin_sql -F ' | ' -c "SELECT calls, round(total_exec_time::numeric, 1) AS total_ms,
      round((total_exec_time / greatest(calls, 1) * 1000)::numeric, 1) AS mean_us,
      round(shared_blks_hit::numeric / greatest(calls, 1), 1) AS buffers_per_call,
      regexp_replace(left(query, 160), '\s+', ' ', 'g')
    FROM pg_stat_statements WHERE dbid = $db_oid ORDER BY total_exec_time DESC LIMIT 12" >"$1" || true
}
# Tuples read by sequential scans of the two tables: a plan that lost its
# index shows here.
seq_tuples() { sql -c "SELECT coalesce(sum(seq_tup_read), 0) FROM pg_stat_user_tables WHERE relname IN ('idempotency_records', 'idempotency_keys')"; }
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
  statements_reset
  t_seq=$(seq_tuples)
  read -r t_syncs t_sync_ms < <(wal_syncs)
  t_wall=$(date +%s.%N)
  children_cpu t_children
  t_machine=$(machine_ticks)
  t_pg=$(pg_ticks)
  t_server=""
  if [[ -n "$server_pid" ]]; then t_server=$(process_ticks "$server_pid"); fi
}
# Sets cpu to the point's CPU (ticks), memory and statements as JSON fields.
# It runs in this shell (not as $(point_finished)), for `times`.
point_finished() { # statements dump file
  local machine pg=null server=null rss=null hwm=null syncs sync_ms children wall statements seq
  if [[ -n "$server_pid" ]]; then server=$(($(process_ticks "$server_pid") - t_server)); fi
  if [[ -n "$t_pg" ]]; then pg=$(($(pg_ticks) - t_pg)); fi
  machine=$(($(machine_ticks) - t_machine))
  children_cpu children
  wall=$(date +%s.%N)
  if [[ -n "$server_pid" ]]; then
    rss=$(memory_kib "$server_pid" VmRSS)
    hwm=$(memory_kib "$server_pid" VmHWM)
  fi
  read -r syncs sync_ms < <(wal_syncs)
  statements=$(statements_count)
  statements_dump "$1"
  seq=$(($(seq_tuples) - t_seq))
  printf -v cpu '"clk_tck": %s, "cpus": %s, "wall_s": %s, "machine_ticks": %s, "pg_ticks": %s, "server_ticks": %s, "client_cpu_s": %s, "server_rss_kib": %s, "server_hwm_kib": %s, "wal_syncs": %s, "wal_sync_ms": %s, "statements": %s, "seq_tuples_read": %s' \
    "$clk_tck" "$(nproc)" "$(python3 -c "print(round($wall - $t_wall, 3))")" "$machine" "$pg" "$server" \
    "$(python3 -c "print(round($children - $t_children, 3))")" "$rss" "$hwm" "$((syncs - t_syncs))" \
    "$(python3 -c "print(round($sync_ms - $t_sync_ms, 3))")" "$statements" "$seq"
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

# --- Every point starts here --------------------------------------------------------------
token='\x00112233445566778899aabbccddeeff'
response="\\x$(printf '72%.0s' $(seq "$response_bytes"))"

# Empties both tables, seeds 100 completed keys into the one the point uses
# (hand-written: '1'..'100' in the point's namespace; the service's:
# 'dup-0'..'dup-99', the keys the load generator replays), then VACUUM
# ANALYZE and CHECKPOINT: plans are made on a table analysed at 100 rows.
prepare_tables() { # table namespace
  local table="$1" namespace="$2"
  sql -c 'TRUNCATE idempotency_records, idempotency_keys'
  if [[ "$table" == idempotency_keys ]]; then
    sql -c "INSERT INTO idempotency_keys (namespace, key, state, lease_token, response, expires_at)
            SELECT '$namespace', g::text, 2, gen_random_uuid(), '$response'::bytea, now() + interval '24 hours'
            FROM generate_series(1, $duplicate_keys) AS g"
  else
    sql -c "INSERT INTO idempotency_records
            SELECT '$namespace', 'dup-' || g, 2, 1, '$token'::bytea, NULL, '$response'::bytea,
                   86400000000, NULL, now() + interval '24 hours', now(), now()
            FROM generate_series(0, $duplicate_keys - 1) AS g"
  fi
  sql -c 'VACUUM ANALYZE idempotency_records' -c 'VACUUM ANALYZE idempotency_keys' -c 'CHECKPOINT'
}

# --- One pgbench point ------------------------------------------------------------------
pgbench_point() { # side (handwritten|as-sent) script level
  local side="$1" script="$2" level="$3" clients threads name namespace status=0 dir table
  clients=$((level < pgbench_cap ? level : pgbench_cap))
  threads=$((clients < 2 ? clients : 2))
  name="pgbench-$side-$script-c$level"
  namespace="pgb-$side-$script-c$level"
  if [[ "$side" == handwritten ]]; then
    dir="$out/handwritten" table=idempotency_keys
  else
    dir="$pgbench_dir" table=idempotency_records
  fi
  if [[ "$side" == as-sent && "$script" == duplicate-as-sent ]]; then
    # The store's scripts replay keys '1'..'100' as pgbench numbers them.
    sql -c 'TRUNCATE idempotency_records, idempotency_keys'
    sql -c "INSERT INTO idempotency_records
            SELECT '$namespace', g::text, 2, 1, '$token'::bytea, NULL, '$response'::bytea,
                   86400000000, NULL, now() + interval '24 hours', now(), now()
            FROM generate_series(1, $duplicate_keys) AS g"
    sql -c 'VACUUM ANALYZE idempotency_records' -c 'VACUUM ANALYZE idempotency_keys' -c 'CHECKPOINT'
  else
    prepare_tables "$table" "$namespace"
  fi
  log "pgbench $side $script: $clients clients, ${seconds}s"
  rm -f "$out/points/$name".log*
  server_pid=""
  # The store's statements run with the settings the store gives its
  # sessions (SESSION_SETTINGS in src/store/postgres/sql.rs); the hand-written
  # ones with the server's defaults, as a team's own code would.
  local session_settings="${BENCH_HANDWRITTEN_OPTIONS:-}"
  [[ "$side" == handwritten ]] || session_settings="-c enable_seqscan=off -c plan_cache_mode=force_generic_plan -c jit=off"
  point_started
  PGOPTIONS="$session_settings" pgbench -n -M prepared -c "$clients" -j "$threads" -T "$seconds" \
    -D ns="$namespace" -D n=0 -D token="$token" -D ttl_us=30000000 -D ret_us=86400000000 \
    -D resp="$response" -D dupkeys="$duplicate_keys" \
    --log --log-prefix="$out/points/$name.log" \
    -f "$dir/$script.sql" "$db_url" >"$out/points/$name.out" 2>&1 || status=$?
  # pgbench's backends exit as it does; their CPU reaches the postmaster's
  # count of exited children once it has reaped them.
  for _ in $(seq 1 50); do
    [[ $(admin_sql -c "SELECT count(*) FROM pg_stat_activity WHERE datname = '$database'") == 0 ]] && break
    sleep 0.1
  done
  sleep 0.1
  point_finished "$out/points/$name.statements.txt"
  printf '{"source": "pgbench", "side": "%s", "scenario": "%s", "level": %s, "clients": %s, "exit_status": %s, "output": "%s", "log_prefix": "%s", %s}\n' \
    "$side" "$script" "$level" "$clients" "$status" "$out/points/$name.out" "$out/points/$name.log" "$cpu" \
    >"$out/points/$name.json"
  point_json="$out/points/$name.json"
  ((status == 0)) || log "pgbench $side $script at $clients clients failed (exit $status): see $out/points/$name.out"
}

# --- One service point: a fresh server, the load generator, the server stopped ------------
start_server() { # rust_log logfile
  start_service "$db_url" "$1" "$2" "${server_env[@]}"
  server_pid=$service_pid
  target=$service_target
}

# A floor instead of the service: idempotency-floor in MODE (bare, database),
# on the hand-written table, with none of BENCH_SERVER_ENV (the service's
# settings).
start_floor() { # mode logfile
  server_bin="$floor_bin" start_service "$db_url" warn "$2" IDEMPOTENCY_FLOOR="$1"
  server_pid=$service_pid
  target=$service_target
}

service_point() { # label scenario level rust_log [floor mode]
  local label="$1" scenario="$2" level="$3" rust_log="$4" floor="${5:-}" status=0 bench_pid deadline
  local name="service-$label-c$level" namespace="svc-$label-c$level"
  if [[ -n "$floor" ]]; then
    prepare_tables idempotency_keys "$namespace"
    start_floor "$floor" "$out/points/$name.server.log"
  else
    prepare_tables idempotency_records "$namespace"
    start_server "$rust_log" "$out/points/$name.server.log"
  fi
  log "service $label: $level callers, ${seconds}s (+$warmup warm-up)"
  "$bench_bin" --target "$target" --scenario "$scenario" --concurrency "$level" \
    --connections "${BENCH_CONNECTIONS:-$level}" --duration "${seconds}s" --warmup "$warmup" \
    --namespace "$namespace" --duplicate-keys "$duplicate_keys" --response-bytes "$response_bytes" \
    --json "$out/points/$name.bench.json" >"$out/points/$name.out" 2>&1 &
  bench_pid=$!
  # Count from the end of the load generator's setup and warm-up, which it
  # announces, to its exit: the window its operation count covers.
  deadline=$((SECONDS + 300))
  until grep -q '^measuring' "$out/points/$name.out" 2>/dev/null; do
    kill -0 "$bench_pid" 2>/dev/null && ((SECONDS < deadline)) || break
    sleep 0.02
  done
  point_started
  wait "$bench_pid" || status=$?
  point_finished "$out/points/$name.statements.txt"
  stop_pid "$server_pid"
  server_pid=""
  if [[ "$rust_log" == info ]]; then
    log "info log: $(wc -l <"$out/points/$name.server.log") lines, $(du -h "$out/points/$name.server.log" | cut -f1)"
  fi
  printf '{"source": "service", "scenario": "%s", "label": "%s", "level": %s, "clients": %s, "exit_status": %s, "output": "%s", "bench_json": "%s", %s}\n' \
    "$scenario" "$label" "$level" "$level" "$status" "$out/points/$name.out" "$out/points/$name.bench.json" "$cpu" \
    >"$out/points/$name.json"
  point_json="$out/points/$name.json"
  ((status == 0)) || log "idempotency-bench $label at $level failed (exit $status): see $out/points/$name.out"
}

# The two floors' Claim+Complete at one level.
floors_done=" "
floor_points() { # level
  measured service_point floor-bare claim-complete "$1" warn bare
  measured service_point floor-database claim-complete "$1" warn database
  floors_done+="$1 "
}
is_floor_level() { [[ " $floor_levels " == *" $1 "* ]]; }

# --- The run ----------------------------------------------------------------------------
# operation (the load generator's scenario) : hand-written script : the store's script
declare -A comparisons=(
  [claim-complete]="claim-complete:claim-complete-as-sent"
  [duplicate]="duplicate:duplicate-as-sent"
  [claim]="claim:claim-as-sent"
  [claim-batch]="claim-unnest64:"
)
for operation in $operations; do
  [[ -n "${comparisons[$operation]:-}" ]] || die "BENCH_OPERATIONS: unknown operation $operation"
  IFS=: read -r handwritten store_script <<<"${comparisons[$operation]}"
  for level in $levels; do
    measured pgbench_point handwritten "$handwritten" "$level"
    if [[ "$as_sent" == 1 && -n "$store_script" ]]; then
      measured pgbench_point as-sent "$store_script" "$level"
    fi
    measured service_point "$operation" "$operation" "$level" warn
    if [[ "$operation" == claim-complete ]] && is_floor_level "$level"; then floor_points "$level"; fi
  done
done
# Floor levels the loop above did not reach (not in BENCH_LEVELS, or no
# claim-complete in BENCH_OPERATIONS).
for level in $floor_levels; do
  [[ "$floors_done" == *" $level "* ]] || floor_points "$level"
done
for scenario in contended mixed; do
  for level in $extra_levels; do measured service_point "$scenario" "$scenario" "$level" warn; done
done
for level in $info_levels; do
  measured service_point claim-complete-warn claim-complete "$level" warn
  measured service_point claim-complete-info claim-complete "$level" info
done

# --- The tables -------------------------------------------------------------------------
status=0
python3 bench/summarize.py "$out" || status=$?
# The per-transaction logs were only needed for pgbench's percentiles.
[[ "${BENCH_KEEP_LOGS:-0}" == 1 ]] || rm -f "$out"/points/pgbench-*.log.*
log "summary: $out/summary.md"
exit "$status"
