#!/usr/bin/env bash
# The service's cost as its table grows (issue 13): with 24 h retention, 5,000
# completions a second leave about 430 million live rows. Since issue 24 a
# completed record is remembered after its retention, as a marker (state 4:
# no response, its horizon in expires_at), until remember_for (7 days by
# default) after its Complete: the same 5,000 completions a second then leave
# about 2.6 billion markers beside the 430 million records, six markers per
# live record, and the reaper has two jobs a second: 5,000 expired records to
# turn into markers and 5,000 markers past their horizon to delete.
#
# One table, grown in steps: first empty (the baseline: 100 completed rows,
# analysed, as every point of compare.sh starts), then pre-filled in
# bulk to each of BENCH_SIZES rows (1, 10 and 50 million), adding rows between
# sizes rather than refilling. At each step, against a fresh server each time
# (the release binary, RUST_LOG=warn, one HTTP/2 connection per caller):
#   1. Claim+Complete of fresh keys at BENCH_CALLERS callers for BENCH_WINDOW
#      seconds, while completed records of the table expire at
#      BENCH_EXPIRY_RATE a second (and, with markers, as many markers reach
#      their horizon) and the server's reaper turns the records into markers
#      and deletes the markers (its default settings: every
#      BENCH_REAPER_INTERVAL, 60 s, batches of 1,000 until one comes back
#      short, resting as long as each batch took; both steps in each batch).
#      Recorded: cycles/s, p50/p99, the reaper's markers made and rows
#      deleted in the window (its metrics idempotency_reaper_remembered_total
#      and idempotency_reaper_deleted_total, read at the window's start and
#      end), and the backlog of expired rows still present at the start and
#      the end (how many records and markers, and how long the oldest has
#      waited). The baseline has no rows to expire, hence no reaper figures;
#   2. duplicate Claims of 100 completed keys at BENCH_CALLERS callers
#      (BENCH_SECONDS), answered by the replay cache after the first read;
#   3. ClaimBatch of 100 fresh keys at BENCH_BATCH_CALLERS callers (BENCH_SECONDS).
# Before and after the points of each step: the table's and each index's size
# and pg_stat_user_tables (live and dead tuples, autovacuum and autoanalyze
# runs, the last autovacuum). After the largest step, Claim+Complete runs once
# more on an empty table (a second database, seeded as the first baseline), so
# that a drift of the machine's speed during the run shows. The summary gives
# each step against the empty table, and the targets at the largest size:
# Claim+Complete at 64 callers at least 0.9x its empty-table rate (issue 24;
# issue 13 asked 0.8x), judged against the mean of the two empty-table runs
# that bracket it and, when BENCH_ROUNDS > 0, by the median ratio of rounds
# that alternate short Claim+Complete points on the largest table (nothing
# expiring then) and on the empty one (both must reach it: on a machine
# shared with other work, the drift of its speed between points minutes apart
# can be larger than the effect measured), the reaper keeping pace with 5,000 expiries a second (with
# markers: 5,000 records to turn into markers and 5,000 markers to delete),
# and the table's size.
#
#   bench/large-table.sh            full run (hours: the 50 million rows alone
#                                   take about 25 GB and a long fill)
#   bench/large-table.sh --smoke    sizes of 10,000 and 50,000 rows (one marker
#                                   per live record), 2 s points, a 5 s window
#                                   at 500 expiries/s and the reaper every
#                                   second: proves the script works (CI); fails
#                                   on any error or missing number
#
# The fill. A step of S rows holds S / (1 + M) live records and the rest
# markers, M = BENCH_MARKERS_PER_LIVE (6: the steady state of a 24 h
# retention under the default 7-day remember_for, where a key is a record for
# one day and a marker for six; so 50 million rows are 7.1 million records
# and 42.9 million markers). Live records: namespace 'fill', keys
# lpad(n, 12, '0') from 1 up, completed (state 2, fencing token 1, a 16-byte
# lease token, no fingerprint, a 200-byte response, retention 24 h), live far
# ahead: expires_at is now() + 7 days + n microseconds (distinct values, as
# real completions have, so that the reap_at index (expires_at's copy) has its
# real size: a single value would shrink it to almost nothing by B-tree
# deduplication), remembered until 6 days after that (remember_until; none
# with M = 0, when the table and the reaper are as before issue 24). Markers:
# namespace 'mark', keys lpad(n, 12, '0') from 1 up, the shape the reaper
# leaves of such a record (state 4, response and checkpoint NULL, expires_at
# the horizon: now() + 6 days + n microseconds, remember_until the expiry it
# had, a day ago + n microseconds). For speed, the throwaway cluster is
# restarted with bulk-load settings (maintenance_work_mem 1GB, max_wal_size
# 16GB, checkpoint_timeout 30min), the two indexes are dropped, the rows are
# inserted by generate_series in chunks of BENCH_FILL_CHUNK from
# BENCH_FILL_JOBS psql sessions at once, the indexes are rebuilt with the
# names and definitions of the migration, then VACUUM ANALYZE and CHECKPOINT;
# the cluster is restarted with its default settings before anything is
# measured. Growing a step adds the keys after the last one, of each kind. Free disk is
# checked before anything (under BENCH_PG_DIR, for the largest size) and
# again before each fill (where the data directory is): about 500 bytes a row
# for the table and its indexes, plus the WAL the fill keeps until its
# checkpoint (about 350 bytes a row, up to max_wal_size); short, the script
# refuses.
#
# The steady expiry. Just before the points of a step, one UPDATE over the
# next unused range of 'fill' keys (a step never reuses an earlier step's
# range) sets expires_at = start + (n / rate) seconds for the range's n-th
# row, rate x (window + BENCH_EXPIRY_MARGIN) rows, so that rows expire at the
# rate from start on (they stay remembered: the reaper turns them into
# markers); with markers, a second UPDATE does the same over the next range
# of 'mark' keys, half a period later (start + (n + 0.5) / rate), so that as
# many markers reach their horizon (the reaper deletes them); then VACUUM (the
# UPDATEs' old row versions) and CHECKPOINT. start is BENCH_EXPIRY_LEAD seconds after the end of this
# preparation (UPDATE, VACUUM and CHECKPOINT; its length is estimated from
# the rows involved, generously, and corrected by the previous step's), and
# the server starts only once start has passed: the window then sees steady
# expiry from its first second, and the reaper begins with no backlog. The
# summary says whether the expiries covered the whole window.
#
# Between steps, before the next fill (with the indexes dropped), everything
# the previous step left is deleted: the rows its points inserted (every
# namespace but 'fill' and 'mark', 24 h retention) and its expiring ranges
# (by key: rows still waiting for the reaper, markers it made of them, and
# those not yet due). So a step's table holds its size plus only the rows its
# own points insert, and its reaper starts clean.
#
# "Keeps pace": the reaper runs every interval, so one that keeps up leaves at
# most about one interval of expiries behind it, while one that falls behind
# leaves rows waiting for most of the window. The summary counts the target
# met when the oldest expired row (record or marker) at the end of the window
# has waited at most 1.5 reaper intervals; it judges only when the window
# spans at least two intervals, the expiries covered it and their rate is at
# least 5,000 a second. The backlog is read through the reap_at index (a
# bounded count), so the readings at the window's start and end cost little
# (before issue 24's figures they filtered on expires_at, which no index
# holds since reap_at replaced it: a full scan of the table at the start of
# each window). Note that the
# server also counts the whole table for its records gauge at start and every
# IDEMPOTENCY_RECORDS_GAUGE_INTERVAL (60 s; a full scan, which the server
# stops waiting for after IDEMPOTENCY_DB_TIMEOUT): it is part of the default
# cost measured here (BENCH_SERVER_ENV can turn it off).
#
# Settings (environment):
#   BENCH_PG_URL        use this PostgreSQL server (loopback only) instead of a
#                       throwaway cluster; the fill then runs with that server's
#                       settings (no restarts) and free disk is checked only if
#                       its data directory is visible here
#   BENCH_PG_DIR        where the throwaway cluster's data directory goes (/tmp)
#   BENCH_SIZES         rows of the steps, ascending ("1000000 10000000 50000000";
#                       smoke "10000 50000")
#   BENCH_WINDOW        seconds of the Claim+Complete point, the expiry window (150; smoke 5)
#   BENCH_SECONDS       seconds of the duplicate and ClaimBatch points (30; smoke 2)
#   BENCH_WARMUP        the load generator's unrecorded warm-up (2s; smoke 500ms)
#   BENCH_CALLERS       callers of Claim+Complete and duplicates (64)
#   BENCH_BATCH_CALLERS callers of ClaimBatch (8)
#   BENCH_MARKERS_PER_LIVE  markers per live record in each step's rows (6;
#                       smoke 1, so that the small tables hold a window's
#                       expiries of each kind); 0: no markers and nothing
#                       remembered (the table of before issue 24)
#   BENCH_REPEAT_BASELINE  1: Claim+Complete on an empty table again after the
#                       largest step (1); 0: not
#   BENCH_ROUNDS        pairs of shorter Claim+Complete points after that,
#                       alternating the largest table and the empty one (4;
#                       smoke 1); 0: none
#   BENCH_ROUND_SECONDS seconds of each of those points (30; smoke 2)
#   BENCH_EXPIRY_RATE   records expiring per second during the window, and as
#                       many markers reaching their horizon (5000; smoke 500)
#   BENCH_EXPIRY_MARGIN seconds of expiries scheduled beyond the window, for the
#                       server's start, the warm-up and the tail (10; smoke 3)
#   BENCH_EXPIRY_LEAD   seconds between the end of the expiry's preparation and
#                       its start (5; smoke 1)
#   BENCH_REAPER_INTERVAL  the server's IDEMPOTENCY_REAPER_INTERVAL (60s, the
#                       service's default; smoke 1s, so the short window sees it run)
#   BENCH_FILL_CHUNK    rows per INSERT of the fill (1000000; smoke 5000)
#   BENCH_FILL_JOBS     psql sessions filling at once (2)
#   BENCH_SERVER_ENV    extra environment for the server, e.g.
#                       "IDEMPOTENCY_REAPER_BATCH_SIZE=5000 IDEMPOTENCY_RECORDS_GAUGE_INTERVAL=0s"
#                       (the reaper's interval only through BENCH_REAPER_INTERVAL)
#   BENCH_SERVER_BIN    the server binary (default $IDEMPOTENCY_BIN, else
#                       target/release/idempotency-service)
#   BENCH_LOADGEN_BIN   the load generator (target/release/idempotency-bench)
#   BENCH_OUT           folder for results (target/bench/large-table-<date-time>)
#
# It creates the databases idempotency_bench_large and
# idempotency_bench_large_empty (the repeated baseline's; dropping any left
# over), applies the service's migrations to them with `idempotency-service
# migrate`, and drops them at the end (the throwaway cluster, with its data
# directory, is removed too). The binaries are copied into the results folder
# first (nothing is built: build them with `cargo build --release
# --workspace`), so a rebuild during the run changes nothing. Results:
# points/*.json (one per point, with the load generator's output and JSON
# beside it), tables/*.json (sizes and statistics per step, before and after
# its points, and the fill's timings), run.json (the settings), summary.md and
# summary.json (written by bench/large-table.py). Only loopback addresses are
# used. Unlike compare.sh it does not wait for a quiet machine: run it on one.
# Needs psql and python3 (and initdb/pg_ctl for the throwaway cluster).
set -eEuo pipefail
cd "$(dirname "$0")/.."
bench_name=large-table
source bench/lib.sh

smoke=0
case "${1:-}" in
  --smoke) smoke=1 ;;
  "") ;;
  -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
  *) echo "usage: $0 [--smoke]" >&2; exit 64 ;;
esac

if ((smoke)); then
  sizes="${BENCH_SIZES:-10000 50000}"
  window="${BENCH_WINDOW:-5}"
  seconds="${BENCH_SECONDS:-2}"
  warmup="${BENCH_WARMUP:-500ms}"
  expiry_rate="${BENCH_EXPIRY_RATE:-500}"
  expiry_margin="${BENCH_EXPIRY_MARGIN:-3}"
  expiry_lead="${BENCH_EXPIRY_LEAD:-1}"
  reaper_interval="${BENCH_REAPER_INTERVAL:-1s}"
  fill_chunk="${BENCH_FILL_CHUNK:-5000}"
  markers_per_live="${BENCH_MARKERS_PER_LIVE:-1}"
else
  sizes="${BENCH_SIZES:-1000000 10000000 50000000}"
  window="${BENCH_WINDOW:-150}"
  seconds="${BENCH_SECONDS:-30}"
  warmup="${BENCH_WARMUP:-2s}"
  expiry_rate="${BENCH_EXPIRY_RATE:-5000}"
  expiry_margin="${BENCH_EXPIRY_MARGIN:-10}"
  expiry_lead="${BENCH_EXPIRY_LEAD:-5}"
  reaper_interval="${BENCH_REAPER_INTERVAL:-60s}"
  fill_chunk="${BENCH_FILL_CHUNK:-1000000}"
  markers_per_live="${BENCH_MARKERS_PER_LIVE:-6}"
fi
repeat_baseline="${BENCH_REPEAT_BASELINE:-1}"
if ((smoke)); then
  rounds="${BENCH_ROUNDS:-1}"
  round_seconds="${BENCH_ROUND_SECONDS:-2}"
else
  rounds="${BENCH_ROUNDS:-4}"
  round_seconds="${BENCH_ROUND_SECONDS:-30}"
fi
callers="${BENCH_CALLERS:-64}"
batch_callers="${BENCH_BATCH_CALLERS:-8}"
fill_jobs="${BENCH_FILL_JOBS:-2}"
read -r -a server_env <<<"${BENCH_SERVER_ENV:-}"
[[ " ${BENCH_SERVER_ENV:-}" != *" IDEMPOTENCY_REAPER_INTERVAL="* ]] ||
  { echo "large-table: set the reaper's interval with BENCH_REAPER_INTERVAL, not BENCH_SERVER_ENV" >&2; exit 64; }
out="${BENCH_OUT:-target/bench/large-table-$(date +%Y%m%d-%H%M%S)}"
database=idempotency_bench_large
empty_database=idempotency_bench_large_empty
response_bytes=200
duplicate_keys=100
batch_size=100

log() { bench_log "$@"; }
die() { bench_die "$@"; }

for name in window seconds expiry_rate expiry_margin expiry_lead callers batch_callers fill_chunk fill_jobs; do
  [[ "${!name}" =~ ^[1-9][0-9]*$ ]] || die "$name must be a whole number above 0: ${!name}"
done
[[ "$markers_per_live" =~ ^[0-9]+$ ]] || die "BENCH_MARKERS_PER_LIVE must be a whole number: $markers_per_live"
[[ "$repeat_baseline" =~ ^[01]$ ]] || die "BENCH_REPEAT_BASELINE must be 0 or 1: $repeat_baseline"
[[ "$rounds" =~ ^[0-9]+$ ]] || die "BENCH_ROUNDS must be a whole number: $rounds"
[[ "$round_seconds" =~ ^[1-9][0-9]*$ ]] || die "BENCH_ROUND_SECONDS must be a whole number above 0: $round_seconds"
# A step's rows: live records and markers.
live_of() { echo $(($1 / (1 + markers_per_live))); }
markers_of() { echo $(($1 - $1 / (1 + markers_per_live))); }
previous=0
for size in $sizes; do
  [[ "$size" =~ ^[1-9][0-9]*$ ]] && ((size > previous)) || die "BENCH_SIZES must be ascending row counts: $sizes"
  previous=$size
done
[[ -n "$sizes" ]] || die "BENCH_SIZES is empty"
largest=$previous
# Each step's expiring ranges come from its own fill rows (earlier ranges are
# deleted and their keys replaced), so the smallest size must hold one of
# each kind.
read -r smallest _ <<<"$sizes"
((expiry_rate * (window + expiry_margin) <= $(live_of "$smallest"))) &&
  ((markers_per_live == 0 || expiry_rate * (window + expiry_margin) <= $(markers_of "$smallest"))) ||
  die "$smallest rows ($(live_of "$smallest") records, $(markers_of "$smallest") markers) cannot hold a window's $((expiry_rate * (window + expiry_margin))) expiring rows of each kind (BENCH_EXPIRY_RATE x (BENCH_WINDOW + BENCH_EXPIRY_MARGIN)): raise the smallest size or lower the rate or the window"
# The reaper's interval in seconds, for the judgement of the summary.
reaper_interval_s=$(python3 -c '
import re, sys
m = re.fullmatch(r"(\d+)(ms|s|m|min|h)", sys.argv[1])
if not m: sys.exit(1)
print(int(m[1]) * {"ms": 0.001, "s": 1, "m": 60, "min": 60, "h": 3600}[m[2]])' "$reaper_interval") ||
  die "BENCH_REAPER_INTERVAL must be like 60s, 5m or 500ms: $reaper_interval"
for tool in psql python3; do
  command -v "$tool" >/dev/null || die "$tool is not installed"
done

# --- Free disk ------------------------------------------------------------------------
bytes_per_row=500
wal_bytes_per_row=350
max_wal_bytes=$((16 * 1024 * 1024 * 1024))
disk_needed() { # new rows: bytes the fill needs free
  local wal=$(($1 * wal_bytes_per_row))
  ((wal < max_wal_bytes)) || wal=$max_wal_bytes
  echo $(($1 * bytes_per_row + wal))
}
check_disk() { # folder new_rows
  local folder="$1" rows="$2" free need
  free=$(df -P -B1 "$folder" | awk 'NR == 2 { print $4 }')
  need=$(disk_needed "$rows")
  if ((free < need)); then
    die "$folder has $((free / 1024 / 1024)) MiB free; adding $rows rows needs about $((need / 1024 / 1024)) MiB ($bytes_per_row bytes a row, plus the fill's WAL). Free some space, set BENCH_PG_DIR to a roomier disk, or lower BENCH_SIZES"
  fi
  log "free disk in $folder: $((free / 1024 / 1024)) MiB; adding $rows rows needs about $((need / 1024 / 1024)) MiB"
}
if [[ -z "${BENCH_PG_URL:-}" ]]; then
  pg_dir="${BENCH_PG_DIR:-/tmp}"
  [[ -d "$pg_dir" ]] || die "BENCH_PG_DIR is not a folder: $pg_dir"
  check_disk "$pg_dir" "$largest"
fi

mkdir -p "$out/points" "$out/tables" "$out/bin"
out="$(cd "$out" && pwd)"
log "results in $out"

# --- PostgreSQL: the one BENCH_PG_URL names, or a throwaway cluster --------------------
server_pid=""
bench_pid=""
fill_pids=()
cleanup() {
  for pid in "${fill_pids[@]}"; do stop_pid "$pid"; done
  stop_pid "$bench_pid"
  stop_pid "$server_pid"
  if [[ -n "${pg_server:-}" ]]; then
    for db in $database $empty_database; do
      psql "$pg_server/postgres" -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true
    done
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

# --- Binaries: copied, never built ---------------------------------------------------------
server_source="${BENCH_SERVER_BIN:-${IDEMPOTENCY_BIN:-target/release/idempotency-service}}"
bench_source="${BENCH_LOADGEN_BIN:-target/release/idempotency-bench}"
for binary in "$server_source" "$bench_source"; do
  [[ -x "$binary" ]] || die "missing $binary: run cargo build --release --workspace first (or set BENCH_SERVER_BIN, BENCH_LOADGEN_BIN)"
done
cp "$server_source" "$out/bin/idempotency-service"
cp "$bench_source" "$out/bin/idempotency-bench"
server_bin="$out/bin/idempotency-service"
bench_bin="$out/bin/idempotency-bench"

# --- The databases ------------------------------------------------------------------------
for db in $database $empty_database; do
  admin_sql -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null
done
admin_sql -c "CREATE DATABASE $database" >/dev/null
DATABASE_URL="$db_url" RUST_LOG=warn "$server_bin" migrate
if ((repeat_baseline || rounds > 0)); then
  admin_sql -c "CREATE DATABASE $empty_database" >/dev/null
  DATABASE_URL="$pg_server/$empty_database" RUST_LOG=warn "$server_bin" migrate
fi
# The indexes the fill drops and rebuilds must be the migration's: a new
# index would otherwise be left out of the fill (and slow it down unseen).
indexes=$(sql -c "SELECT string_agg(indexname, ' ' ORDER BY indexname) FROM pg_indexes WHERE schemaname = current_schema() AND tablename = 'idempotency_records'")
[[ "$indexes" == "idempotency_records_pkey idempotency_records_reap_at" ]] ||
  die "the migrations' indexes changed ($indexes): update the fill in this script"

# The data directory, for its free disk (the throwaway cluster's, or
# BENCH_PG_URL's when it is on this machine and readable).
data_dir=$(sql -c 'SHOW data_directory' 2>/dev/null || true)
[[ -n "$data_dir" && -d "$data_dir" ]] || data_dir=""
[[ -n "$data_dir" ]] || log "warning: cannot see the server's data directory: free disk is not checked"

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- src migrations 2>/dev/null || echo ' (src/ or migrations/ with uncommitted changes)')"
  echo "cpus: $(nproc) ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'))"
  echo "memory: $(awk '/MemTotal/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo)"
  echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "postgres: $(sql -c 'SHOW server_version') ($([[ -n "$pg_cluster_dir" ]] && echo "throwaway cluster in ${BENCH_PG_DIR:-/tmp}" || echo "$pg_server"))"
  for setting in synchronous_commit shared_buffers max_wal_size checkpoint_timeout autovacuum autovacuum_vacuum_scale_factor autovacuum_vacuum_insert_scale_factor; do
    echo "postgres $setting: $(sql -c "SHOW $setting")"
  done
  echo "sizes: $sizes ($markers_per_live markers per live record); window: ${window}s at $expiry_rate expiries/s of each kind (+${expiry_margin}s); other points: ${seconds}s; warm-up: $warmup"
  echo "binaries: $server_source, $bench_source"
  echo "callers: $callers (ClaimBatch of $batch_size: $batch_callers), one connection each; stored result: $response_bytes bytes"
  echo "server: IDEMPOTENCY_REAPER_INTERVAL=$reaper_interval ${BENCH_SERVER_ENV:-}"
} >"$out/machine.txt"
cat "$out/machine.txt" >&2
python3 - "$out/run.json" <<EOF
import json, sys
json.dump({"smoke": $smoke, "sizes": [int(s) for s in "$sizes".split()], "window_s": $window,
           "seconds": $seconds, "warmup": "$warmup", "callers": $callers, "batch_callers": $batch_callers,
           "batch_size": $batch_size, "expiry_rate": $expiry_rate, "expiry_margin_s": $expiry_margin,
           "reaper_interval": "$reaper_interval", "reaper_interval_s": $reaper_interval_s,
           "server_env": "${BENCH_SERVER_ENV:-}", "markers_per_live": $markers_per_live,
           "repeat_baseline": $repeat_baseline, "rounds": $rounds, "round_seconds": $round_seconds},
          open(sys.argv[1], "w"), indent=2)
EOF

now_s() { date +%s.%N; }
elapsed() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 3))" "$1" "$2"; }

# --- Table statistics ----------------------------------------------------------------------
# The table's and its indexes' sizes and pg_stat_user_tables, as JSON.
table_stats() { # step when file
  sql -c "SELECT json_build_object(
      'step', '$1', 'when', '$2', 'fill_rows', $fill_rows, 'marker_rows', $mark_rows,
      'table_bytes', pg_relation_size('idempotency_records'),
      'total_bytes', pg_total_relation_size('idempotency_records'),
      'database_bytes', pg_database_size(current_database()),
      'indexes', (SELECT json_object_agg(indexname, pg_relation_size(format('%I.%I', schemaname, indexname)::regclass))
                  FROM pg_indexes WHERE schemaname = current_schema() AND tablename = 'idempotency_records'),
      'n_live_tup', n_live_tup, 'n_dead_tup', n_dead_tup,
      'vacuum_count', vacuum_count, 'autovacuum_count', autovacuum_count,
      'analyze_count', analyze_count, 'autoanalyze_count', autoanalyze_count,
      'last_autovacuum', last_autovacuum, 'last_autoanalyze', last_autoanalyze,
      'autovacuum_running', EXISTS (SELECT 1 FROM pg_stat_activity
                                    WHERE backend_type = 'autovacuum worker' AND query LIKE '%idempotency_records%'))
    FROM pg_stat_user_tables WHERE relid = 'idempotency_records'::regclass" >"$3"
}

# --- The fill ----------------------------------------------------------------------------------
fill_rows=0   # live records in namespace 'fill'
fill_top=0    # the highest 'fill' key the fill has inserted
mark_rows=0   # markers in namespace 'mark'
mark_top=0    # the highest 'mark' key the fill has inserted
token='\x00112233445566778899aabbccddeeff'
response="\\x$(printf '72%.0s' $(seq "$response_bytes"))"
if ((markers_per_live > 0)); then
  remember_until="now() + interval '13 days' + g * interval '1 microsecond'"
else
  remember_until=NULL
fi

bulk_settings() { # on|off: restart the throwaway cluster for the fill, or with its defaults
  if [[ -z "$pg_cluster_dir" ]]; then
    [[ "$1" == off ]] || log "BENCH_PG_URL: filling with the server's own settings"
    return 0
  fi
  if [[ "$1" == on ]]; then
    restart_postgres -c maintenance_work_mem=1GB -c max_wal_size=16GB -c checkpoint_timeout=30min
  else
    restart_postgres
  fi
}

fill_chunk_rows() { # fill|mark first last
  if [[ "$1" == fill ]]; then
    sql -c "INSERT INTO idempotency_records (namespace, key, state, fencing_token, lease_token, fingerprint,
              response, retention_us, lease_expires_at, expires_at, created_at, updated_at, remember_until)
            SELECT 'fill', lpad(g::text, 12, '0'), 2, 1, '$token'::bytea, NULL, '$response'::bytea,
                   86400000000, NULL, now() + interval '7 days' + g * interval '1 microsecond', now(), now(),
                   $remember_until
            FROM generate_series($2, $3) AS g"
  else
    # What the reaper leaves of a 'fill' record: no response, the horizon in
    # expires_at, the expiry it had in remember_until.
    sql -c "INSERT INTO idempotency_records (namespace, key, state, fencing_token, lease_token, fingerprint,
              response, retention_us, lease_expires_at, expires_at, created_at, updated_at, remember_until)
            SELECT 'mark', lpad(g::text, 12, '0'), 4, 1, '$token'::bytea, NULL, NULL,
                   86400000000, NULL, now() + interval '6 days' + g * interval '1 microsecond',
                   now() - interval '2 days', now() - interval '2 days',
                   now() - interval '1 day' + g * interval '1 microsecond'
            FROM generate_series($2, $3) AS g"
  fi
}

# Inserts keys first..last of a kind, chunk by chunk, from fill_jobs
# sessions at once (job j takes chunks j, j + jobs, ...).
fill_parallel() { # fill|mark first last
  local kind="$1" first="$2" last="$3" job from to status=0 pid
  ((last >= first)) || return 0
  for ((job = 0; job < fill_jobs; job++)); do
    (
      for ((from = first + job * fill_chunk; from <= last; from += fill_jobs * fill_chunk)); do
        to=$((from + fill_chunk - 1 < last ? from + fill_chunk - 1 : last))
        fill_chunk_rows "$kind" "$from" "$to"
        log "fill: '$kind' keys $from-$to inserted"
      done
    ) &
    fill_pids+=($!)
  done
  for pid in "${fill_pids[@]}"; do wait "$pid" || status=$?; done
  fill_pids=()
  ((status == 0)) || die "the fill failed (exit $status)"
}

# Deletes what the previous step left, so that each step's table is its size
# plus only its own points' rows, and its reaper starts with no backlog: the
# rows the points inserted (every namespace but 'fill' and 'mark') and the
# previous steps' expiring ranges, by key (rows still waiting for the reaper,
# the markers it made of them, and those the schedule had not reached yet).
# Run with the indexes dropped: a sequential scan, and nothing to clean in
# the indexes. The VACUUM makes the space reusable by the fill.
clear_previous_step() {
  local counts
  counts=$(sql -F ' ' -c "WITH d AS (DELETE FROM idempotency_records
                                     WHERE namespace NOT IN ('fill', 'mark')
                                        OR (namespace = 'fill' AND key < lpad('$next_expiry_key', 12, '0'))
                                        OR (namespace = 'mark' AND key < lpad('$next_marker_expiry_key', 12, '0'))
                                     RETURNING namespace)
                          SELECT count(*) FILTER (WHERE namespace = 'fill'), count(*) FILTER (WHERE namespace = 'mark'),
                                 count(*) FILTER (WHERE namespace NOT IN ('fill', 'mark')) FROM d")
  sql -c 'VACUUM idempotency_records'
  # Every earlier expiring range is gone now.
  fill_rows=$((fill_top - (next_expiry_key - 1)))
  mark_rows=$((mark_top - (next_marker_expiry_key - 1)))
  read -r deleted_fill deleted_mark deleted_points <<<"$counts"
  log "fill: deleted the previous step's $deleted_points rows of its points and $deleted_fill + $deleted_mark remaining rows of its expiring ranges (records + markers)"
}

# Grows the rows to the step's size (its records and markers): indexes
# dropped, the previous step's rows deleted, rows inserted, indexes rebuilt
# (as the migration defines them), VACUUM ANALYZE, CHECKPOINT.
fill_to() { # rows step
  local target="$1" step="$2" live_target mark_target add add_marks t0 t1 t2 t3 t4
  live_target=$(live_of "$target")
  mark_target=$(markers_of "$target")
  # At most this many rows to add: the previous expiring ranges are deleted.
  [[ -z "$data_dir" ]] ||
    check_disk "$data_dir" "$((target - fill_rows - mark_rows + expiry_rows * (1 + (markers_per_live > 0))))"
  t0=$(now_s)
  bulk_settings on
  sql -c 'ALTER TABLE idempotency_records DROP CONSTRAINT idempotency_records_pkey' \
    -c 'DROP INDEX idempotency_records_reap_at'
  clear_previous_step
  add=$((live_target - fill_rows))
  add_marks=$((mark_target - mark_rows))
  log "fill: adding $add records (keys $((fill_top + 1))-$((fill_top + add))) and $add_marks markers (keys $((mark_top + 1))-$((mark_top + add_marks))) to reach $target rows"
  t1=$(now_s)
  fill_parallel fill "$((fill_top + 1))" "$((fill_top + add))"
  fill_parallel mark "$((mark_top + 1))" "$((mark_top + add_marks))"
  t2=$(now_s)
  log "fill: rows inserted in $(elapsed "$t1" "$t2") s; rebuilding the indexes"
  sql -c 'ALTER TABLE idempotency_records ADD CONSTRAINT idempotency_records_pkey PRIMARY KEY (namespace, key)' \
    -c 'CREATE INDEX idempotency_records_reap_at ON idempotency_records (reap_at)'
  t3=$(now_s)
  log "fill: indexes rebuilt in $(elapsed "$t2" "$t3") s; VACUUM ANALYZE and CHECKPOINT"
  sql -c 'VACUUM ANALYZE idempotency_records' -c 'CHECKPOINT'
  bulk_settings off
  t4=$(now_s)
  fill_top=$((fill_top + add))
  fill_rows=$live_target
  mark_top=$((mark_top + add_marks))
  mark_rows=$mark_target
  log "fill: $((add + add_marks)) rows in $(elapsed "$t0" "$t4") s (deleting the previous step's rows $(elapsed "$t0" "$t1"), insert $(elapsed "$t1" "$t2"), indexes $(elapsed "$t2" "$t3"), vacuum, checkpoint and restart $(elapsed "$t3" "$t4")); database $(($(sql -c 'SELECT pg_database_size(current_database())') / 1024 / 1024)) MiB"
  printf '{"step": "%s", "rows": %s, "rows_added": %s, "records_added": %s, "markers_added": %s, "fill_rows": %s, "marker_rows": %s, "seconds": %s, "clear_s": %s, "insert_s": %s, "indexes_s": %s, "vacuum_checkpoint_restart_s": %s, "jobs": %s, "chunk": %s}\n' \
    "$step" "$target" "$((add + add_marks))" "$add" "$add_marks" "$live_target" "$mark_target" "$(elapsed "$t0" "$t4")" \
    "$(elapsed "$t0" "$t1")" "$(elapsed "$t1" "$t2")" \
    "$(elapsed "$t2" "$t3")" "$(elapsed "$t3" "$t4")" "$fill_jobs" "$fill_chunk" >"$out/tables/fill-$step.json"
}

# --- The steady expiry ----------------------------------------------------------------------------
next_expiry_key=1         # the next unused 'fill' key for an expiring range
next_marker_expiry_key=1  # the next unused 'mark' key for an expiring range
# Estimated seconds of the preparation (UPDATEs, VACUUM, CHECKPOINT):
# microseconds per updated row and per row of the table (VACUUM scans the
# whole of both indexes), on the generous side: a late start only costs
# waiting, an early one a backlog before the window. Raised after each step
# whose preparation took longer.
prep_us_per_updated_row=100
prep_us_per_table_row=3
expiry_start=""  # epoch seconds of the first expiry
expiry_rows=0    # rows of each kind in the step's expiring ranges
marker_expiry_rows=0

# Sets expires_at of keys first..first+rows-1 of a kind so that one expires
# every 1/rate seconds from start + offset periods on; prints how many rows
# it found.
expire_range() { # fill|mark first rows offset
  local kind="$1" first="$2" rows="$3" offset="$4"
  sql -c "WITH u AS (
            UPDATE idempotency_records
            SET expires_at = to_timestamp($expiry_start)
                             + (key::bigint - $first + $offset) / $expiry_rate::float8 * interval '1 second'
            WHERE namespace = '$kind'
              AND key BETWEEN lpad('$first', 12, '0') AND lpad('$((first + rows - 1))', 12, '0')
            RETURNING 1)
          SELECT count(*) FROM u"
}

schedule_expiry() { # step
  local step="$1" first last first_marker="" estimate t0 t1 took early updated scale
  expiry_rows=$((expiry_rate * (window + expiry_margin)))
  marker_expiry_rows=$((markers_per_live > 0 ? expiry_rows : 0))
  first=$next_expiry_key
  last=$((first + expiry_rows - 1))
  ((last <= fill_top)) ||
    die "step $step: $expiry_rows expiring records (rate x (window + margin)) need keys up to $last, but the fill has $fill_top (earlier steps used keys up to $((first - 1))): raise the size or lower BENCH_EXPIRY_RATE or BENCH_WINDOW"
  next_expiry_key=$((last + 1))
  if ((marker_expiry_rows > 0)); then
    first_marker=$next_marker_expiry_key
    ((first_marker + marker_expiry_rows - 1 <= mark_top)) ||
      die "step $step: $marker_expiry_rows markers reaching their horizon need keys up to $((first_marker + marker_expiry_rows - 1)), but the fill has $mark_top: raise the size or lower BENCH_EXPIRY_RATE or BENCH_WINDOW"
    next_marker_expiry_key=$((first_marker + marker_expiry_rows))
  fi
  estimate=$((((expiry_rows + marker_expiry_rows) * prep_us_per_updated_row + (fill_rows + mark_rows) * prep_us_per_table_row) / 1000000 + 1))
  t0=$(now_s)
  expiry_start=$(python3 -c "print(round($t0 + $estimate + $expiry_lead, 3))")
  log "expiry: $expiry_rows records (keys $first-$last) to expire at $expiry_rate/s$( ((marker_expiry_rows == 0)) || echo " and $marker_expiry_rows markers (keys $first_marker-$((first_marker + marker_expiry_rows - 1))) to reach their horizon at $expiry_rate/s"), from $((estimate + expiry_lead)) s from now"
  updated=$(expire_range fill "$first" "$expiry_rows" 0)
  ((updated == expiry_rows)) || die "expiry: the UPDATE found $updated records of keys $first-$last, not $expiry_rows"
  if ((marker_expiry_rows > 0)); then
    updated=$(expire_range mark "$first_marker" "$marker_expiry_rows" 0.5)
    ((updated == marker_expiry_rows)) || die "expiry: the UPDATE found $updated markers from key $first_marker, not $marker_expiry_rows"
  fi
  sql -c 'VACUUM idempotency_records' -c 'CHECKPOINT'
  t1=$(now_s)
  took=$(elapsed "$t0" "$t1")
  log "expiry: prepared in $took s (estimated $estimate s)"
  early=$(elapsed "$expiry_start" "$t1")
  if python3 -c "import sys; sys.exit(0 if $early > 0 else 1)"; then
    log "warning: the preparation overran its estimate: the expiries began $early s before it ended"
  fi
  # The next step's estimate: at least this one's actual ratio, with half again.
  scale=$(python3 -c "print(max(1.0, 1.5 * $took / $estimate))")
  prep_us_per_updated_row=$(python3 -c "print(int($prep_us_per_updated_row * $scale + 0.999))")
  prep_us_per_table_row=$(python3 -c "print(int($prep_us_per_table_row * $scale + 0.999))")
  printf '{"step": "%s", "first_key": %s, "rows": %s, "first_marker_key": %s, "marker_rows": %s, "rate": %s, "start": %s, "prepare_s": %s, "estimated_s": %s}\n' \
    "$step" "$first" "$expiry_rows" "${first_marker:-null}" "$marker_expiry_rows" "$expiry_rate" "$expiry_start" \
    "$took" "$estimate" >"$out/tables/expiry-$step.json"
  wait_until "$expiry_start"
}

wait_until() { # epoch seconds
  local wait
  wait=$(python3 -c "import time; print(max(0.0, round($1 - time.time(), 3)))")
  if [[ "$wait" != 0.0 ]]; then
    log "waiting $wait s for the expiries to begin"
    sleep "$wait"
  fi
}

# --- Readings during the Claim+Complete point ------------------------------------------------------
# The reaper's counters so far, as "deleted remembered" (they appear after
# its first run).
reaper_counters() {
  python3 - "http://$service_metrics/metrics" <<'EOF2'
import sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode()
def total(name):
    return int(sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.split("{")[0].split(" ")[0] == name))
print(total("idempotency_reaper_deleted_total"), total("idempotency_reaper_remembered_total"))
EOF2
}
# Expired rows still present, through the reap_at index (bounded: cheap while
# the backlog is small), as "rows oldest_s records markers records_oldest_s
# markers_oldest_s": records (state 2 and the rest) wait to become markers or
# to be deleted, markers (state 4) past their horizon to be deleted.
backlog() {
  sql -F ' ' -c "SELECT count(*), coalesce(round(extract(epoch FROM now() - min(reap_at))::numeric, 1), 0),
                        count(*) FILTER (WHERE state <> 4), count(*) FILTER (WHERE state = 4),
                        coalesce(round(extract(epoch FROM now() - min(reap_at) FILTER (WHERE state <> 4))::numeric, 1), 0),
                        coalesce(round(extract(epoch FROM now() - min(reap_at) FILTER (WHERE state = 4))::numeric, 1), 0)
                 FROM (SELECT reap_at, state FROM idempotency_records WHERE reap_at <= now() LIMIT 100000000) AS b"
}

# --- One point: a fresh server, the load generator, the server stopped -----------------------------
# Starts the load generator and waits for the end of its setup and warm-up:
# the window its operation count covers starts there (window_start). The
# server uses the database $point_database.
point_database=$database
load_start() { # name scenario callers seconds [extra args...]
  local name="$1" scenario="$2" level="$3" duration="$4" deadline
  shift 4
  start_service "$pg_server/$point_database" warn "$out/points/$name.server.log" IDEMPOTENCY_REAPER_INTERVAL="$reaper_interval" "${server_env[@]}"
  server_pid=$service_pid
  log "$name: $scenario at $level callers, ${duration}s (+$warmup warm-up)"
  "$bench_bin" --target "$service_target" --scenario "$scenario" --concurrency "$level" \
    --connections "$level" --duration "${duration}s" --warmup "$warmup" --namespace "$name" \
    --response-bytes "$response_bytes" --json "$out/points/$name.bench.json" "$@" \
    >"$out/points/$name.out" 2>&1 &
  bench_pid=$!
  deadline=$((SECONDS + 300))
  until grep -q '^measuring' "$out/points/$name.out" 2>/dev/null; do
    kill -0 "$bench_pid" 2>/dev/null && ((SECONDS < deadline)) || break
    sleep 0.02
  done
  window_start=$(now_s)
  load_avg_start=$(cut -d' ' -f1 /proc/loadavg)
  read -r blocks_read_start blocks_hit_start < <(blocks)
}

# Blocks this database read from outside shared_buffers (the OS cache or the
# disk), and found in them, so far: how much of a point ran from memory.
blocks() { admin_sql -F ' ' -c "SELECT blks_read, blks_hit FROM pg_stat_database WHERE datname = '$point_database'"; }

# Waits for the load generator (its status in load_status), notes the end.
load_wait() { # name
  load_status=0
  wait "$bench_pid" || load_status=$?
  bench_pid=""
  window_end=$(now_s)
  read -r blocks_read_end blocks_hit_end < <(blocks)
  ((load_status == 0)) || log "$1: the load generator failed (exit $load_status): see $out/points/$1.out"
}

load_finish() { # name
  stop_pid "$server_pid"
  server_pid=""
}

point_json() { # name scenario level step [extra JSON fields]
  printf '{"step": "%s", "scenario": "%s", "level": %s, "exit_status": %s, "output": "%s", "bench_json": "%s", "window_start": %s, "window_end": %s, "load_average_start": %s, "blocks_read": %s, "blocks_hit": %s%s}\n' \
    "$4" "$2" "$3" "$load_status" "$out/points/$1.out" "$out/points/$1.bench.json" "$window_start" "$window_end" \
    "$load_avg_start" "$((blocks_read_end - blocks_read_start))" "$((blocks_hit_end - blocks_hit_start))" \
    "${5:+, $5}" >"$out/points/$1.json"
}

claim_complete_point() { # step
  local step="$1" name="claim-complete-$1" deleted_start deleted_end remembered_start remembered_end extra
  local b_rows b_oldest b_records b_markers b_records_oldest b_markers_oldest
  load_start "$name" claim-complete "$callers" "$window"
  read -r deleted_start remembered_start < <(reaper_counters)
  read -r b_rows b_oldest b_records b_markers b_records_oldest b_markers_oldest < <(backlog)
  extra="\"backlog_start_rows\": $b_rows, \"backlog_start_oldest_s\": $b_oldest"
  extra+=", \"backlog_start_records\": $b_records, \"backlog_start_markers\": $b_markers"
  load_wait "$name"
  # Right away, while the server (and its reaper) still runs.
  read -r b_rows b_oldest b_records b_markers b_records_oldest b_markers_oldest < <(backlog)
  read -r deleted_end remembered_end < <(reaper_counters)
  load_finish "$name"
  extra+=", \"reaper_deleted_start\": $deleted_start, \"reaper_deleted_end\": $deleted_end"
  extra+=", \"reaper_remembered_start\": $remembered_start, \"reaper_remembered_end\": $remembered_end"
  extra+=", \"backlog_end_rows\": $b_rows, \"backlog_end_oldest_s\": $b_oldest"
  extra+=", \"backlog_end_records\": $b_records, \"backlog_end_records_oldest_s\": $b_records_oldest"
  extra+=", \"backlog_end_markers\": $b_markers, \"backlog_end_markers_oldest_s\": $b_markers_oldest"
  if [[ -n "$expiry_start" ]]; then
    extra+=", \"expiry_start\": $expiry_start, \"expiry_rows\": $expiry_rows, \"expiry_rate\": $expiry_rate"
    extra+=", \"marker_expiry_rows\": $marker_expiry_rows"
  fi
  point_json "$name" claim-complete "$callers" "$step" "$extra"
  log "$name: the reaper made $((remembered_end - remembered_start)) markers and deleted $((deleted_end - deleted_start)) rows in the window; backlog at the end $b_records records and $b_markers markers, oldest $b_oldest s"
}

other_point() { # step scenario level seconds [extra args...]
  local step="$1" scenario="$2" level="$3" duration="$4" name="$2-$1"
  shift 4
  load_start "$name" "$scenario" "$level" "$duration" "$@"
  load_wait "$name"
  load_finish "$name"
  point_json "$name" "$scenario" "$level" "$step"
}

measure_step() { # step
  local step="$1"
  table_stats "$step" before "$out/tables/$step-before.json"
  claim_complete_point "$step"
  other_point "$step" duplicate "$callers" "$seconds" --duplicate-keys "$duplicate_keys"
  other_point "$step" claim-batch "$batch_callers" "$seconds" --batch-size "$batch_size"
  table_stats "$step" after "$out/tables/$step-after.json"
}

# --- The run ------------------------------------------------------------------------------------------
log "step empty: the baseline"
# 100 completed rows, as compare.sh seeds every point. (Before the reap_at
# migration, plans made on a table analysed with no rows at all scanned the
# whole expires_at index in the Complete inside idempotency_complete_many,
# which flattered every ratio against the baseline.)
sql -c "INSERT INTO idempotency_records (namespace, key, state, fencing_token, lease_token, fingerprint,
          response, retention_us, lease_expires_at, expires_at, created_at, updated_at)
        SELECT 'seed', 'dup-' || g, 2, 1, '$token'::bytea, NULL, '$response'::bytea,
               86400000000, NULL, now() + interval '24 hours', now(), now()
        FROM generate_series(0, 99) AS g"
sql -c 'VACUUM ANALYZE idempotency_records' -c 'CHECKPOINT'
measure_step empty
for size in $sizes; do
  log "step $size rows"
  fill_to "$size" "$size"
  schedule_expiry "$size"
  measure_step "$size"
done
# The empty table of the repeated baseline and the rounds: emptied, 100
# completed rows seeded, VACUUM ANALYZE, CHECKPOINT, as the first baseline.
reset_empty_table() {
  psql "$pg_server/$empty_database" -qAtX -v ON_ERROR_STOP=1 -c 'TRUNCATE idempotency_records' \
    -c "INSERT INTO idempotency_records
          (namespace, key, state, fencing_token, lease_token, fingerprint,
           response, retention_us, lease_expires_at, expires_at, created_at, updated_at)
        SELECT 'seed', 'dup-' || g, 2, 1, '$token'::bytea, NULL, '$response'::bytea,
               86400000000, NULL, now() + interval '24 hours', now(), now()
        FROM generate_series(0, 99) AS g" -c 'VACUUM ANALYZE idempotency_records' -c 'CHECKPOINT'
}
if ((repeat_baseline)); then
  # Claim+Complete on an empty table again (its own database, seeded as the
  # first), right after the largest step: how far the machine drifted.
  log "step empty-after: the baseline's Claim+Complete again"
  reset_empty_table
  point_database=$empty_database
  other_point empty-after claim-complete "$callers" "$window"
  point_database=$database
fi
# Rounds: shorter Claim+Complete points, alternating between the largest
# table (its markers and records; its expiring ranges are past and reaped by
# now, so nothing expires) and the empty table, in the order large, empty,
# empty, large, ...: a drift of the machine's speed during the rounds falls
# on both sides alike. Each point starts with a CHECKPOINT, and the empty
# table is reset before each of its points.
for ((round = 1; round <= rounds; round++)); do
  if ((round % 2)); then order="large empty"; else order="empty large"; fi
  for which in $order; do
    log "round $round of $rounds: Claim+Complete on the $which table"
    if [[ "$which" == empty ]]; then
      reset_empty_table
      point_database=$empty_database
    else
      sql -c 'CHECKPOINT'
      point_database=$database
    fi
    other_point "round$round-$which" claim-complete "$callers" "$round_seconds"
  done
  point_database=$database
done

status=0
python3 bench/large-table.py "$out" || status=$?
log "summary: $out/summary.md"
exit "$status"
