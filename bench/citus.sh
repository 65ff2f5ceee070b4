#!/usr/bin/env bash
# One PostgreSQL against a Citus cluster, the service in front of each, in one
# run on one machine (issue 21; docs/scaling.md has the model built on it).
#
# Side "postgres": one plain PostgreSQL, a throwaway cluster made with initdb
# as bench/compare.sh makes it (or BENCH_PG_URL). Side "citus": the Citus
# coordinator CITUS_URL names and the workers registered with it. On each
# side the service's own migration prepares a fresh database (on Citus it
# distributes idempotency_records by key), and for every point a fresh server
# (release binary, RUST_LOG=warn, default settings: replay cache and
# coalescing on) serves idempotency-bench: Claim+Complete cycles of fresh keys
# and duplicate Claims (replays of 100 completed keys) at a few concurrency
# levels, one HTTP/2 connection per caller. The two sides alternate point by
# point, so that both see the same machine.
#
# For every point: operations/s, p50 and p99, errors, and CPU per operation
# split by process, from /proc (utime + stime) before and after the measured
# window: the server; each postmaster's whole process tree (the postmaster,
# its exited children, its live children): PostgreSQL, or the coordinator and
# each worker; the load generator (its own count); and how much of the
# machine other processes took. Also WAL bytes per operation on each node.
#
# The yardstick (issue 31): the claim+complete cycle a team would write by
# hand (bench/handwritten/schema.sql's idempotency_keys), run by pgbench on
# the same nodes, in the same run, at the same Claim+Complete levels, right
# after the service's two points: side "postgres-sql" runs
# bench/handwritten/claim-complete.sql on the plain side, side "citus-sql"
# runs bench/handwritten/claim-complete-citus.sql (the same cycle without
# now() in the ON CONFLICT, which Citus refuses there) through the
# coordinator, with idempotency_keys distributed by key. pgbench -n -M
# prepared -c L -j min(L,2), with compare.sh's variables, for BENCH_SECONDS
# after a warm-up (BENCH_WARMUP rounded up to whole seconds) as the load
# generator has; the same CPU readings over the same kind of window,
# pgbench's own CPU in place of the load generator's, the cycles that ended
# in the window and their p50/p99 from pgbench's per-transaction log. The
# summary sets the service against it level by level (database CPU per
# cycle, the coordinator's share, the p50 excess of Citus over PostgreSQL).
#
#   CITUS_URL=postgres://postgres@127.0.0.1:9700/postgres bench/citus.sh
#
# Without CITUS_URL it prints one line and exits 0 without running.
#
# Settings (environment):
#   CITUS_URL           a Citus coordinator, postgres://user@HOST:port/db, on a
#                       loopback address: db (default postgres) has the citus
#                       extension and the workers registered (pg_dist_node),
#                       and user may create databases on every node. The run
#                       creates the database idempotency_citus_bench on the
#                       coordinator and on each worker (CREATE EXTENSION citus,
#                       the coordinator's host and the workers registered as in
#                       db) and drops it at the end. Query parameters are
#                       ignored; the service connects with sslmode=disable
#                       (Citus's self-signed v1 certificate: docs/scaling.md).
#   CITUS_POSTMASTER_PIDS  the postmasters' pids, coordinator first, then the
#                       workers in pg_dist_node's order; default: read from
#                       each node's postmaster.pid (SHOW data_directory), which
#                       needs the nodes on this machine
#   BENCH_PG_URL        the plain side's server instead of a throwaway cluster
#                       (bench/lib.sh)
#   BENCH_SECONDS       measured seconds per point (10)
#   BENCH_WARMUP        the load generator's unrecorded warm-up (2s)
#   BENCH_LEVELS        callers for Claim+Complete ("1 8 64")
#   BENCH_DUPLICATE_LEVELS  callers for duplicate Claims ("8 64"; empty: none)
#   BENCH_YARDSTICK     1 (default): the hand-written SQL points beside each
#                       Claim+Complete level (needs pgbench); 0: none
#   BENCH_QUIET_WAIT    before each point, wait up to this many seconds for the
#                       machine to be under 15% busy (20; 0: no wait)
#   BENCH_CITUS_SQL     a SQL file run on the Citus bench database after the
#                       migrations: to measure a change to the store's Citus
#                       functions before it is a migration (named in the summary)
#   BENCH_OUT           folder for results (target/bench/citus-<date-time>)
#   BENCH_SKIP_BUILD=1  use the binaries in target/release as they are
#
# About 4 minutes of load with the defaults (16 points of 10 s, 6 of them
# pgbench's), 5-9 in all with the set-up and the waits for a quiet machine.
# Writes OUT/summary.md (printed too) and OUT/points.jsonl; exits 1 when a
# point failed or reported errors. Only loopback addresses are used.
set -eEuo pipefail
cd "$(dirname "$0")/.."
bench_name=citus

case "${1:-}" in
  -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
  "") ;;
  *) echo "usage: CITUS_URL=postgres://user@127.0.0.1:port/db $0" >&2; exit 64 ;;
esac
if [[ -z "${CITUS_URL:-}" ]]; then
  echo "bench/citus.sh: not run: CITUS_URL is not set (a Citus coordinator with its workers registered, e.g. postgres://postgres@127.0.0.1:9700/postgres; docs/scaling.md)"
  exit 0
fi
source bench/lib.sh
log() { bench_log "$@"; }
# This script's own psql sessions, without Citus's notices (CREATE DATABASE
# is not propagated, and so on: handled here).
psql() { PGOPTIONS="-c client_min_messages=warning" command psql "$@"; }
die() { bench_die "$@"; }

seconds="${BENCH_SECONDS:-10}"
warmup="${BENCH_WARMUP:-2s}"
levels="${BENCH_LEVELS:-1 8 64}"
duplicate_levels="${BENCH_DUPLICATE_LEVELS-8 64}"
yardstick="${BENCH_YARDSTICK:-1}"
quiet_wait="${BENCH_QUIET_WAIT:-20}"
out="${BENCH_OUT:-target/bench/citus-$(date +%Y%m%d-%H%M%S)}"
database=idempotency_citus_bench
duplicate_keys=100
response_bytes=200

[[ "$seconds" =~ ^[1-9][0-9]*$ ]] || die "BENCH_SECONDS must be a whole number of seconds: $seconds"
[[ "$yardstick" =~ ^[01]$ ]] || die "BENCH_YARDSTICK must be 1 or 0: $yardstick"
# pgbench's warm-up: BENCH_WARMUP in whole seconds, rounded up.
warmup_whole=0
((yardstick == 0)) || warmup_whole=$(python3 - "$warmup" <<'EOF'
import math, re, sys
units = {"ms": 0.001, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
parts = re.findall(r"(\d+(?:\.\d+)?)\s*(ms|sec|s|min|m|h)\s*", sys.argv[1])
if not parts or "".join(a + b for a, b in parts) != re.sub(r"\s", "", sys.argv[1]):
    print("bad")
else:
    print(math.ceil(sum(float(a) * units[b] for a, b in parts)))
EOF
)
[[ "$warmup_whole" =~ ^[0-9]+$ ]] || die "BENCH_WARMUP must be a duration such as 2s or 500ms: $warmup"
tools=(psql python3)
((yardstick)) && tools+=(pgbench)
for tool in "${tools[@]}"; do
  command -v "$tool" >/dev/null || die "$tool is not installed"
done

# --- CITUS_URL: postgres://[user[:password]@]host[:port][/db][?...] ------------------
read -r citus_userinfo citus_host citus_port citus_db < <(python3 - "$CITUS_URL" <<'EOF'
import sys, urllib.parse
u = urllib.parse.urlsplit(sys.argv[1])
if u.scheme not in ("postgres", "postgresql") or not u.hostname:
    print("- - - -"); sys.exit()
userinfo = u.netloc.rsplit("@", 1)[0] + "@" if "@" in u.netloc else ""
print(userinfo or "-", u.hostname, u.port or 5432, u.path.lstrip("/") or "postgres")
EOF
)
[[ "$citus_host" =~ ^(127\.[0-9]+\.[0-9]+\.[0-9]+|localhost|::1)$ ]] ||
  die "CITUS_URL must be postgres://[user@]HOST[:port][/db] with a loopback HOST: $CITUS_URL"
[[ "$citus_userinfo" == - ]] && citus_userinfo=""
node_url() { # host port
  local host="$1"
  [[ "$host" != *:* ]] || host="[$host]"
  printf 'postgres://%s%s:%s' "$citus_userinfo" "$host" "$2"
}

mkdir -p "$out/points" "$out/bin"
out="$(cd "$out" && pwd)"
log "results in $out"

# The nodes: the coordinator, then each active primary worker.
node_names=(coordinator)
node_urls=("$(node_url "$citus_host" "$citus_port")")
workers=$(psql "${node_urls[0]}/$citus_db" -qAtX -v ON_ERROR_STOP=1 -F ' ' -c \
  "SELECT nodename, nodeport FROM pg_dist_node
   WHERE groupid <> 0 AND noderole = 'primary' AND isactive ORDER BY nodeid") ||
  die "CITUS_URL: cannot read pg_dist_node in $citus_db on the coordinator (is it a Citus coordinator?)"
[[ -n "$workers" ]] || die "CITUS_URL: no worker is registered in $citus_db on the coordinator"
i=0
while read -r host port; do
  [[ "$host" =~ ^(127\.[0-9]+\.[0-9]+\.[0-9]+|localhost|::1)$ ]] || die "worker $host:$port is not on a loopback address"
  i=$((i + 1))
  node_names+=("worker$i")
  node_urls+=("$(node_url "$host" "$port")")
done <<<"$workers"
worker_hosts=$workers

# The postmasters whose process trees are counted.
node_pids=()
if [[ -n "${CITUS_POSTMASTER_PIDS:-}" ]]; then
  read -r -a node_pids <<<"$CITUS_POSTMASTER_PIDS"
  ((${#node_pids[@]} == ${#node_urls[@]})) ||
    die "CITUS_POSTMASTER_PIDS names ${#node_pids[@]} pids for ${#node_urls[@]} nodes"
else
  for url in "${node_urls[@]}"; do
    dir=$(psql "$url/$citus_db" -qAtX -c 'SHOW data_directory' 2>/dev/null || true)
    pid=$(head -1 "$dir/postmaster.pid" 2>/dev/null || true)
    [[ -n "$pid" ]] || log "no postmaster.pid readable for $url (data directory '$dir'): its CPU is not counted"
    node_pids+=("${pid:-}")
  done
fi

# --- The two sides ------------------------------------------------------------------
server_pid=""
citus_created=0
runner_pid=""
cleanup() {
  stop_pid "$server_pid"
  if [[ -n "$runner_pid" ]]; then
    stop_pid "$(pgrep -P "$runner_pid" -x pgbench || true)"
    stop_pid "$runner_pid"
  fi
  if ((citus_created)); then
    for url in "${node_urls[@]}"; do
      psql "$url/$citus_db" -qAtX -c "DROP DATABASE IF EXISTS $database WITH (FORCE)" >/dev/null 2>&1 || true
    done
  fi
  if [[ -n "${pg_server:-}" ]]; then
    psql "$pg_server/postgres" -qAtX -c "DROP DATABASE IF EXISTS $database WITH (FORCE)" >/dev/null 2>&1 || true
  fi
  stop_postgres
}
trap cleanup EXIT
trap 'exit 130' INT TERM
trap 'log "error: line $LINENO: $BASH_COMMAND"' ERR

# Citus 12.1 does not propagate CREATE DATABASE: made on every node, the
# extension in each, the nodes registered from the coordinator.
log "Citus: creating $database on the coordinator and $((${#node_urls[@]} - 1)) workers"
citus_created=1
for url in "${node_urls[@]}"; do
  psql "$url/$citus_db" -qAtX -v ON_ERROR_STOP=1 -c "DROP DATABASE IF EXISTS $database WITH (FORCE)" >/dev/null
  psql "$url/$citus_db" -qAtX -v ON_ERROR_STOP=1 -c "CREATE DATABASE $database" >/dev/null
  psql "$url/$database" -qAtX -v ON_ERROR_STOP=1 -c 'CREATE EXTENSION citus' >/dev/null
done
citus_sql() { psql "${node_urls[0]}/$database" -qAtX -v ON_ERROR_STOP=1 "$@"; }
citus_sql -c "SELECT citus_set_coordinator_host('$citus_host', $citus_port)" >/dev/null
while read -r host port; do
  citus_sql -c "SELECT citus_add_node('$host', $port)" >/dev/null
done <<<"$worker_hosts"

start_postgres
pg_sql() { psql "$pg_server/$database" -qAtX -v ON_ERROR_STOP=1 "$@"; }
psql "$pg_server/postgres" -qAtX -v ON_ERROR_STOP=1 -c "DROP DATABASE IF EXISTS $database WITH (FORCE)" -c "CREATE DATABASE $database" >/dev/null
pg_pid=$(head -1 "$(pg_sql -c 'SHOW data_directory')/postmaster.pid" 2>/dev/null || true)

# --- Binaries -----------------------------------------------------------------------
if [[ "${BENCH_SKIP_BUILD:-0}" != 1 ]]; then
  log "building the server and the load generator (release)"
  cargo build --release --quiet --workspace --bins
fi
for binary in idempotency-service idempotency-bench; do
  [[ -x "target/release/$binary" ]] || die "missing target/release/$binary"
  cp "target/release/$binary" "$out/bin/"
done
server_bin="$out/bin/idempotency-service"
bench_bin="$out/bin/idempotency-bench"

pg_service_url="$pg_server/$database"
citus_service_url="${node_urls[0]}/$database?sslmode=disable"
DATABASE_URL="$pg_service_url" RUST_LOG=warn "$server_bin" migrate
DATABASE_URL="$citus_service_url" RUST_LOG=info "$server_bin" migrate 2>&1 | tee "$out/citus-migrate.log" | grep -i 'shards\|citus' >&2 || true
if [[ -n "${BENCH_CITUS_SQL:-}" ]]; then
  log "Citus: running $BENCH_CITUS_SQL on the bench database"
  citus_sql -f "$BENCH_CITUS_SQL" >/dev/null
  cp "$BENCH_CITUS_SQL" "$out/citus-extra.sql"
fi
shards=$(citus_sql -c "SELECT count(*) FROM pg_dist_shard WHERE logicalrelid = 'idempotency_records'::regclass")
((shards > 0)) || die "the migration did not distribute idempotency_records on Citus: see $out/citus-migrate.log"
# The yardstick's table on both sides; on Citus distributed by key with
# Citus's default shard count, as a team would, in a colocation group of its
# own (its key's collation is not idempotency_records', which Citus's default
# colocation refuses; a team's database has no idempotency_records).
yardstick_shards=0
if ((yardstick)); then
  mkdir -p "$out/handwritten"
  cp bench/handwritten/schema.sql bench/handwritten/claim-complete.sql bench/handwritten/claim-complete-citus.sql "$out/handwritten/"
  pg_sql -f bench/handwritten/schema.sql >/dev/null
  citus_sql -f bench/handwritten/schema.sql -c "SELECT create_distributed_table('idempotency_keys', 'key', colocate_with => 'none')" >/dev/null
  yardstick_shards=$(citus_sql -c "SELECT count(*) FROM pg_dist_shard WHERE logicalrelid = 'idempotency_keys'::regclass")
fi

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- src migrations 2>/dev/null || echo ' (src/ or migrations/ with uncommitted changes)')"
  echo "cpus: $(nproc) ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'))"
  echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "postgres: $(pg_sql -c 'SHOW server_version') ($([[ -n "$pg_cluster_dir" ]] && echo "throwaway cluster" || echo "$pg_server"))"
  echo "citus: $(citus_sql -c "SELECT extversion FROM pg_extension WHERE extname = 'citus'") on PostgreSQL $(citus_sql -c 'SHOW server_version'); coordinator and $((${#node_urls[@]} - 1)) workers; idempotency_records in $shards shards (distributed by $(citus_sql -c "SELECT column_to_column_name(logicalrelid, partkey) FROM pg_dist_partition WHERE logicalrelid = 'idempotency_records'::regclass"))"
  for setting in synchronous_commit fsync shared_buffers max_connections; do
    echo "$setting: postgres $(pg_sql -c "SHOW $setting"); citus nodes $(for url in "${node_urls[@]}"; do psql "$url/$database" -qAtX -c "SHOW $setting"; done | paste -sd/)"
  done
  echo "citus.max_cached_conns_per_worker: $(citus_sql -c 'SHOW citus.max_cached_conns_per_worker'); citus.max_shared_pool_size: $(citus_sql -c 'SHOW citus.max_shared_pool_size')"
  echo "extra SQL on the Citus bench database: ${BENCH_CITUS_SQL:-none (the migrations as they are)}"
  if ((yardstick)); then
    echo "yardstick: the hand-written cycle by $(pgbench --version | sed 's/ (PostgreSQL)//'), -M prepared, -j min(callers, 2): postgres-sql (bench/handwritten/claim-complete.sql), citus-sql (claim-complete-citus.sql through the coordinator; idempotency_keys in $yardstick_shards shards by key); sslmode=disable and the servers' default settings"
  else
    echo "yardstick: none (BENCH_YARDSTICK=0)"
  fi
  echo "seconds per point: $seconds; warm-up: $warmup; Claim+Complete callers: $levels; duplicate callers: ${duplicate_levels:-none}"
  echo "server: default settings (replay cache and coalescing on), RUST_LOG=warn; one HTTP/2 connection per caller; stored result $response_bytes bytes"
} >"$out/machine.txt"
cat "$out/machine.txt" >&2

# --- Readings -----------------------------------------------------------------------
machine_ticks() { awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9; exit }' /proc/stat; }
# A postmaster's whole tree: its own time and its exited children's, plus its
# live children's. Processes come and go while this reads.
tree_ticks() { # postmaster pid
  [[ -n "$1" ]] || { echo null; return 0; }
  { cat /proc/[0-9]*/stat 2>/dev/null || true; } | awk -v pm="$1" '
    { pid = $1; sub(/^[^)]*\) /, "")
      if (pid == pm) total += $12 + $13 + $14 + $15
      else if ($2 == pm) total += $12 + $13 }
    END { print total + 0 }'
}
process_ticks() { sed 's/^[^)]*) //' "/proc/$1/stat" | awk '{ print $12 + $13 }'; }
# WAL bytes written by the node (any database); the bench database's
# sessions opened and transactions committed, and the other databases'
# commits (a shared cluster's other users: their CPU counts in the node's
# process tree). Statistics a backend reports within a second, or as it exits.
node_counts() { # url
  psql "$1/$database" -qAtX -F ' ' -c "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint,
      sum(sessions) FILTER (WHERE datname = current_database()),
      sum(xact_commit) FILTER (WHERE datname = current_database()),
      coalesce(sum(xact_commit) FILTER (WHERE datname <> current_database()), 0)
    FROM pg_stat_database"
}

side_urls() { if [[ "$1" == citus ]]; then printf '%s\n' "${node_urls[@]}"; else echo "$pg_server"; fi; }
side_pids() { if [[ "$1" == citus ]]; then printf '%s\n' "${node_pids[@]}"; else echo "${pg_pid:-}"; fi; }

wait_quiet() {
  ((quiet_wait > 0)) || return 0
  local until=$((SECONDS + quiet_wait)) before after busy
  while :; do
    before=$(awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9, $5 + $6; exit }' /proc/stat)
    sleep 1
    after=$(awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9, $5 + $6; exit }' /proc/stat)
    busy=$(awk -v b="$before" -v a="$after" 'BEGIN { split(b, x, " "); split(a, y, " ");
      t = (y[1] - x[1]) + (y[2] - x[2]); print (t > 0 ? int(100 * (y[1] - x[1]) / t) : 0) }')
    ((busy < 15)) && return 0
    if ((SECONDS >= until)); then
      log "the machine is still busy (${busy}% of its CPU): measuring anyway"
      return 0
    fi
    sleep 2
  done
}

# --- One point ----------------------------------------------------------------------
failures=0
point() { # side scenario level
  local side="$1" scenario="$2" level="$3" status=0 bench_pid deadline name url db_url
  local -a urls pids wal0 wal1 tree0 tree1
  name="$side-$scenario-c$level"
  mapfile -t urls < <(side_urls "$side")
  mapfile -t pids < <(side_pids "$side")
  if [[ "$side" == citus ]]; then db_url="$citus_service_url"; else db_url="$pg_service_url"; fi
  # The same start for every point: an empty, analysed table, a checkpoint
  # on every node.
  psql "${urls[0]}/$database" -qAtX -v ON_ERROR_STOP=1 \
    -c 'TRUNCATE idempotency_records' -c 'VACUUM ANALYZE idempotency_records' >/dev/null
  for url in "${urls[@]}"; do psql "$url/$database" -qAtX -c CHECKPOINT >/dev/null; done
  wait_quiet
  start_service "$db_url" warn "$out/points/$name.server.log"
  server_pid=$service_pid
  log "$side $scenario: $level callers, ${seconds}s (+$warmup warm-up)"
  "$bench_bin" --target "$service_target" --scenario "$scenario" --concurrency "$level" \
    --connections "$level" --duration "${seconds}s" --warmup "$warmup" \
    --duplicate-keys "$duplicate_keys" --response-bytes "$response_bytes" \
    --json "$out/points/$name.bench.json" >"$out/points/$name.out" 2>&1 &
  bench_pid=$!
  deadline=$((SECONDS + 120))
  until grep -q '^measuring' "$out/points/$name.out" 2>/dev/null; do
    kill -0 "$bench_pid" 2>/dev/null && ((SECONDS < deadline)) || break
    sleep 0.02
  done
  # psql (slow to start on a loaded machine) outside the CPU window.
  wal0=()
  for url in "${urls[@]}"; do wal0+=("$(node_counts "$url")"); done
  local t_wall t_machine t_server
  t_wall=$(date +%s.%N)
  t_machine=$(machine_ticks)
  t_server=$(process_ticks "$server_pid")
  tree0=()
  for pid in "${pids[@]}"; do tree0+=("$(tree_ticks "$pid")"); done
  wait "$bench_pid" || status=$?
  tree1=()
  for pid in "${pids[@]}"; do tree1+=("$(tree_ticks "$pid")"); done
  local server machine wall
  server=$(($(process_ticks "$server_pid") - t_server))
  machine=$(($(machine_ticks) - t_machine))
  wall=$(python3 -c "print(round($(date +%s.%N) - $t_wall, 3))")
  wal1=()
  for url in "${urls[@]}"; do wal1+=("$(node_counts "$url" | cut -d' ' -f1)"); done
  # Sessions and commits: read once the server's connections (and the
  # coordinator's to the workers) have closed and reported.
  stop_pid "$server_pid"
  server_pid=""
  sleep 1.5
  local nodes="" i delta w0 s0 x0 o0 s1 x1 o1
  for i in "${!urls[@]}"; do
    if [[ "${tree0[$i]}" == null ]]; then delta=null; else delta=$((tree1[i] - tree0[i])); fi
    read -r w0 s0 x0 o0 <<<"${wal0[$i]}"
    read -r _ s1 x1 o1 < <(node_counts "${urls[$i]}")
    [[ -z "$nodes" ]] || nodes+=", "
    nodes+="{\"node\": \"$([[ "$side" == citus ]] && echo "${node_names[$i]}" || echo postgres)\", \"ticks\": $delta, \"wal_bytes\": $((wal1[i] - w0)), \"sessions\": $((s1 - s0)), \"commits\": $((x1 - x0)), \"other_databases_commits\": $((o1 - o0))}"
  done
  printf '{"side": "%s", "scenario": "%s", "level": %s, "exit_status": %s, "bench_json": "%s", "output": "%s", "clk_tck": %s, "cpus": %s, "wall_s": %s, "machine_ticks": %s, "server_ticks": %s, "nodes": [%s]}\n' \
    "$side" "$scenario" "$level" "$status" "$out/points/$name.bench.json" "$out/points/$name.out" \
    "$(getconf CLK_TCK)" "$(nproc)" "$wall" "$machine" "$server" "$nodes" >>"$out/points.jsonl"
  if ((status != 0)); then
    failures=$((failures + 1))
    log "$side $scenario at $level callers failed (exit $status): see $out/points/$name.out"
  fi
}

# --- One yardstick point: pgbench and the hand-written cycle ------------------------
# compare.sh's pgbench variables: the namespace, the counter, a 200-byte result.
yardstick_token='\x00112233445566778899aabbccddeeff'
yardstick_response="\\x$(printf '72%.0s' $(seq "$response_bytes"))"
# The postmaster's children serving the bench database (their process titles
# name it), one pid a line: pgbench's backends, on the workers the
# coordinator's connections, and Citus's maintenance daemon's own.
bench_backends() { # postmaster pid
  [[ -z "$1" ]] || pgrep -P "$1" -f " $database " || true
}
sql_point() { # side (postgres-sql|citus-sql) level
  local side="$1" level="$2" status=0 threads name script db_url namespace pid i left deadline
  local -a urls pids wal0 wal1 tree0 tree1 backends0
  threads=$((level < 2 ? level : 2))
  name="$side-claim-complete-c$level"
  namespace="pgb-$side-c$level"
  if [[ "$side" == citus-sql ]]; then
    mapfile -t urls < <(side_urls citus)
    mapfile -t pids < <(side_pids citus)
    script=claim-complete-citus db_url="$citus_service_url"
  else
    mapfile -t urls < <(side_urls postgres)
    mapfile -t pids < <(side_pids postgres)
    script=claim-complete db_url="$pg_service_url"
  fi
  # The same start as the service's points: an empty, analysed table, a
  # checkpoint on every node.
  psql "${urls[0]}/$database" -qAtX -v ON_ERROR_STOP=1 \
    -c 'TRUNCATE idempotency_keys' -c 'VACUUM ANALYZE idempotency_keys' >/dev/null
  for url in "${urls[@]}"; do psql "$url/$database" -qAtX -c CHECKPOINT >/dev/null; done
  wait_quiet
  log "$side claim-complete: $level pgbench clients, ${seconds}s (+${warmup_whole}s warm-up)"
  rm -f "$out/points/$name".log*
  backends0=()
  for pid in "${pids[@]}"; do backends0+=("$(bench_backends "$pid")"); done
  # As the load generator does: a warm-up (connections, plans), then the
  # measured window. pgbench's CPU in all: `times` in the subshell that
  # waited for it, and for nothing else; its warm-up's from /proc.
  (
    code=0
    pgbench -n -M prepared -c "$level" -j "$threads" -T "$((seconds + warmup_whole))" \
      -D ns="$namespace" -D n=0 -D token="$yardstick_token" -D ttl_us=30000000 -D ret_us=86400000000 \
      -D resp="$yardstick_response" -D dupkeys="$duplicate_keys" \
      --log --log-prefix="$out/points/$name.log" \
      -f "$out/handwritten/$script.sql" "$db_url" >"$out/points/$name.out" 2>&1 || code=$?
    times >"$out/points/$name.times"
    exit "$code"
  ) &
  runner_pid=$!
  sleep "$warmup_whole"
  local pgbench_pid client0=0
  pgbench_pid=$(pgrep -P "$runner_pid" -x pgbench || true)
  # psql (slow to start on a loaded machine) outside the CPU window.
  wal0=()
  for url in "${urls[@]}"; do wal0+=("$(node_counts "$url")"); done
  local t_wall t_machine
  t_wall=$(date +%s.%N)
  t_machine=$(machine_ticks)
  [[ -z "$pgbench_pid" ]] || client0=$(process_ticks "$pgbench_pid" 2>/dev/null || echo 0)
  tree0=()
  for pid in "${pids[@]}"; do tree0+=("$(tree_ticks "$pid")"); done
  wait "$runner_pid" || status=$?
  runner_pid=""
  # pgbench's backends exit as it does (and on Citus the coordinator's
  # connections to the workers with them): their CPU reaches each
  # postmaster's count of exited children once it has reaped them.
  deadline=$((SECONDS + 5))
  while :; do
    left=0
    for i in "${!pids[@]}"; do
      [[ -z "$(comm -13 <(sort <<<"${backends0[$i]}") <(bench_backends "${pids[$i]}" | sort))" ]] || left=1
    done
    ((left == 0)) && break
    if ((SECONDS >= deadline)); then
      log "$side at $level: sessions of the bench database still open 5 s after pgbench ended: their CPU so far is counted"
      break
    fi
    sleep 0.05
  done
  sleep 0.1
  tree1=()
  for pid in "${pids[@]}"; do tree1+=("$(tree_ticks "$pid")"); done
  local machine wall
  machine=$(($(machine_ticks) - t_machine))
  wall=$(python3 -c "print(round($(date +%s.%N) - $t_wall, 3))")
  wal1=()
  for url in "${urls[@]}"; do wal1+=("$(node_counts "$url" | cut -d' ' -f1)"); done
  sleep 1.5
  local nodes="" delta w0 s0 x0 o0 s1 x1 o1
  for i in "${!urls[@]}"; do
    if [[ "${tree0[$i]}" == null ]]; then delta=null; else delta=$((tree1[i] - tree0[i])); fi
    read -r w0 s0 x0 o0 <<<"${wal0[$i]}"
    read -r _ s1 x1 o1 < <(node_counts "${urls[$i]}")
    [[ -z "$nodes" ]] || nodes+=", "
    nodes+="{\"node\": \"$([[ "$side" == citus-sql ]] && echo "${node_names[$i]}" || echo postgres)\", \"ticks\": $delta, \"wal_bytes\": $((wal1[i] - w0)), \"sessions\": $((s1 - s0)), \"commits\": $((x1 - x0)), \"other_databases_commits\": $((o1 - o0))}"
  done
  # The load generator's report, as far as pgbench tells it: the cycles that
  # ended in the window (from its per-transaction log), cycles/s from the
  # window's start to the last one's end, failed transactions, latency, its
  # CPU in the window. None when pgbench failed (the summary says so).
  python3 - "$out/points/$name" "$status" "$t_wall" "$client0" "$(getconf CLK_TCK)" <<'EOF'
import glob, json, re, sys
base, status, start, client0, clk = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
text = open(base + ".out").read()
tps = re.search(r"^tps = ([0-9.]+) \(without initial connection time\)", text, re.M)
done = re.search(r"^number of transactions actually processed: (\d+)", text, re.M)
failed = re.search(r"^number of failed transactions: (\d+)", text, re.M)
if status != 0 or not tps or not done:
    sys.exit()
# client_id transaction_no latency_us script_no end_epoch_s end_us
ends, latencies = [], []
for path in glob.glob(base + ".log.*"):
    for f in (line.split() for line in open(path)):
        if len(f) >= 6 and f[2].isdigit():
            end = int(f[4]) + int(f[5]) / 1e6
            if end >= start:
                ends.append(end)
                latencies.append(int(f[2]))
latencies.sort()

def percentile(q):  # bench/summarize.py's
    i = min(len(latencies) - 1, max(0, int(round(q * len(latencies) + 0.5)) - 1))
    return latencies[i] if latencies else 0

cpu = None
lines = open(base + ".times").read().splitlines()
if len(lines) >= 2:
    cpu = 0.0
    for field in lines[1].split():
        minutes, secs = field.rstrip("s").split("m")
        cpu += int(minutes) * 60 + float(secs)
if cpu is not None:
    cpu -= client0 / clk
elapsed = max(ends) - start if ends else 0
json.dump({"source": "pgbench", "scenario": "claim-complete", "ops": len(ends),
           "ops_per_s": len(ends) / elapsed if elapsed > 0 else 0.0,
           "errors_total": int(failed.group(1)) if failed else 0,
           "pgbench_transactions": int(done.group(1)), "pgbench_tps": float(tps.group(1)),
           "latency_us": {"op:claim-complete": {
               "count": len(latencies), "p50": percentile(0.50), "p90": percentile(0.90),
               "p99": percentile(0.99), "max": latencies[-1] if latencies else 0}},
           "client_cpu_s": cpu}, open(base + ".bench.json", "w"), indent=2)
EOF
  # The logs were only needed for the percentiles.
  rm -f "$out/points/$name".log.*
  printf '{"side": "%s", "scenario": "%s", "level": %s, "exit_status": %s, "bench_json": "%s", "output": "%s", "clk_tck": %s, "cpus": %s, "wall_s": %s, "machine_ticks": %s, "server_ticks": null, "nodes": [%s]}\n' \
    "$side" claim-complete "$level" "$status" "$out/points/$name.bench.json" "$out/points/$name.out" \
    "$(getconf CLK_TCK)" "$(nproc)" "$wall" "$machine" "$nodes" >>"$out/points.jsonl"
  if ((status != 0)) || [[ ! -f "$out/points/$name.bench.json" ]]; then
    failures=$((failures + 1))
    log "$side claim-complete at $level clients failed (exit $status): see $out/points/$name.out"
  elif [[ $(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["errors_total"])' "$out/points/$name.bench.json") != 0 ]]; then
    failures=$((failures + 1))
    log "$side claim-complete at $level clients: failed transactions: see $out/points/$name.out"
  fi
}

for level in $levels; do
  for side in postgres citus; do point "$side" claim-complete "$level"; done
  if ((yardstick)); then
    for side in postgres-sql citus-sql; do sql_point "$side" "$level"; done
  fi
done
for level in $duplicate_levels; do
  for side in postgres citus; do point "$side" duplicate "$level"; done
done

# --- The table ----------------------------------------------------------------------
python3 - "$out" <<'EOF' | tee "$out/summary.md"
import json, os, sys
out = sys.argv[1]
points = [json.loads(line) for line in open(os.path.join(out, "points.jsonl"))]
titles = {"claim-complete": "Claim+Complete cycles", "duplicate": "duplicate Claims (replays)"}
sql_sides = {"postgres-sql": "postgres", "citus-sql": "citus"}

def us(ticks, clk, ops):
    return None if ticks is None or not ops else ticks / clk * 1e6 / ops

def fmt(v):
    return "n/a" if v is None else f"{v:,.0f}"

rows, by, warnings = [], {}, []
for p in points:
    try:
        r = json.load(open(p["bench_json"]))
    except OSError:
        rows.append(f"| {p['side']} | {titles[p['scenario']]} | {p['level']} | failed (exit {p['exit_status']}) |")
        continue
    ops = r["ops"]
    clk = p["clk_tck"]
    lat = r["latency_us"].get(f"op:{p['scenario']}", {})
    # The hand-written SQL's points have no server (server_ticks null).
    server = us(p["server_ticks"], clk, ops)
    nodes = [(n["node"], us(n["ticks"], clk, ops), n["wal_bytes"] / ops if ops else None) for n in p["nodes"]]
    client = (r.get("client_cpu_s") or 0) * 1e6 / ops if ops else None
    counted = (p["server_ticks"] or 0) + sum(n["ticks"] or 0 for n in p["nodes"]) + (r.get("client_cpu_s") or 0) * clk
    other = max(0.0, 100 * (p["machine_ticks"] - counted) / (p["wall_s"] * clk * p["cpus"]))
    total = sum(v for v in [server, client] + [n[1] for n in nodes] if v is not None)
    by[(p["side"], p["scenario"], p["level"])] = dict(ops_s=r["ops_per_s"], server=server, nodes=nodes, client=client,
                                                      p50_ms=lat["p50"] / 1000 if "p50" in lat else None)
    if len(nodes) > 1:
        db = " + ".join(f"{fmt(n[1])}" for n in nodes) + f" = {fmt(sum(n[1] or 0 for n in nodes))}"
    else:
        db = fmt(nodes[0][1])
    wal = " / ".join(fmt(n[2]) for n in nodes)
    commits = " / ".join(f"{n['commits'] / ops:.2f}" if ops else "n/a" for n in p["nodes"])
    sessions = " / ".join(str(n["sessions"]) for n in p["nodes"])
    foreign = sum(n.get("other_databases_commits", 0) for n in p["nodes"])
    if foreign > 10 * p["wall_s"]:
        warnings.append(f"{p['side']} {p['scenario']} at {p['level']}: other databases on the same "
                        f"server(s) committed {foreign} transactions during the point: their CPU is in "
                        f"the database figures")
    rows.append(
        f"| {p['side']} | {titles[p['scenario']]} | {p['level']} | {r['ops_per_s']:,.0f} | "
        f"{lat.get('p50', 0) / 1000:.2f} / {lat.get('p99', 0) / 1000:.2f} | {r['errors_total']} | "
        f"{'–' if p['side'] in sql_sides else fmt(server)} | {db} | {fmt(client)} | {fmt(total)} | {wal} | {commits} | {sessions} | {other:.0f}% |")

print("# One PostgreSQL against Citus (bench/citus.sh)\n")
print(open(os.path.join(out, "machine.txt")).read())
print("CPU in µs per operation (a cycle is a Claim and its Complete). Database: PostgreSQL's "
      "processes, or the coordinator's + each worker's = all Citus nodes. WAL: bytes per operation "
      "written on each node (PostgreSQL, or coordinator / workers; the whole node, other databases "
      "included). Commits/op: transactions committed in the bench database per operation on each node; "
      "sessions: connections opened to it on each node during the point, warm-up included (both from "
      "the statistics, which lag up to a second). Other: the machine's CPU taken by other processes "
      "during the window. Sides postgres-sql and citus-sql: the hand-written cycle (the yardstick) run "
      "by pgbench on the same servers, no service; its client is pgbench, its latency pgbench's per "
      "transaction (both statements), its window from the end of its warm-up to its end.\n")
print("| side | operation | callers | ops/s | p50 / p99 ms | errors | service µs | database µs | load generator / pgbench µs | total µs | WAL B/op | commits/op | sessions | other |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
print("\n".join(rows))

if warnings:
    print("\nDisturbed:\n" + "\n".join(f"- {w}" for w in warnings))

ratios = []
for (side, scenario, level), v in sorted(by.items()):
    peer = {"citus": "postgres", "citus-sql": "postgres-sql"}.get(side)
    if peer is None or (peer, scenario, level) not in by:
        continue
    base = by[(peer, scenario, level)]
    what = titles[scenario] + (", hand-written SQL (pgbench)" if side == "citus-sql" else "")
    ratios.append(f"| {what} | {level} | {v['ops_s'] / base['ops_s']:.2f}x |")
if ratios:
    print("\n| operation | callers | Citus / PostgreSQL ops/s |\n|---|---:|---:|")
    print("\n".join(ratios))

# The model's inputs: CPU per cycle at the busiest Claim+Complete level.
levels = sorted(l for (s, sc, l) in by if s == "citus" and sc == "claim-complete" and ("postgres", sc, l) in by)
if levels:
    l = levels[-1]
    pg, ct = by[("postgres", "claim-complete", l)], by[("citus", "claim-complete", l)]
    pg_us = pg["nodes"][0][1]
    coord_us = ct["nodes"][0][1]
    worker_us = sum(n[1] or 0 for n in ct["nodes"][1:])
    if pg_us and coord_us and worker_us:
        print(f"\nModel inputs (Claim+Complete at {l} callers): PostgreSQL {pg_us:.0f} µs/cycle, "
              f"{1e6 / pg_us:,.0f} cycles/s per core; Citus coordinator {coord_us:.0f} µs/cycle, "
              f"{1e6 / coord_us:,.0f} cycles/s per coordinator core; workers {worker_us:.0f} µs/cycle "
              f"in all, {1e6 / worker_us:,.0f} cycles/s per worker core; the coordinator saturates "
              f"first once the workers have more than {worker_us / coord_us:.2f} cores per coordinator core; "
              f"service {ct['server']:.0f} µs/cycle on Citus ({pg['server']:.0f} on PostgreSQL).")

# The service against the hand-written SQL (issue 31's first and fourth
# targets), level by level.
def all_nodes(v):
    return None if any(n[1] is None for n in v["nodes"]) else sum(n[1] for n in v["nodes"])

def share(v):
    total = all_nodes(v)
    return f"{100 * v['nodes'][0][1] / total:.0f}%" if total else "n/a"

def over(a, b):
    return "n/a" if a is None or not b else f"{a / b:.2f}x"

def excess(citus, postgres):
    if not citus or not postgres or citus["p50_ms"] is None or postgres["p50_ms"] is None:
        return "n/a"
    return f"{citus['p50_ms'] - postgres['p50_ms']:.2f}"

yard = []
for l in sorted({l for (s, sc, l) in by if s in sql_sides and sc == "claim-complete"}):
    sv_ct, sv_pg = by.get(("citus", "claim-complete", l)), by.get(("postgres", "claim-complete", l))
    sq_ct, sq_pg = by.get(("citus-sql", "claim-complete", l)), by.get(("postgres-sql", "claim-complete", l))
    a_ct, b_ct = all_nodes(sv_ct) if sv_ct else None, all_nodes(sq_ct) if sq_ct else None
    a_pg, b_pg = all_nodes(sv_pg) if sv_pg else None, all_nodes(sq_pg) if sq_pg else None
    yard.append(
        f"| {l} | {fmt(a_ct)} | {fmt(b_ct)} | {over(a_ct, b_ct)} | {fmt(a_pg)} | {fmt(b_pg)} | {over(a_pg, b_pg)} | "
        f"{share(sv_ct) if sv_ct else 'n/a'} / {share(sq_ct) if sq_ct else 'n/a'} | "
        f"{excess(sv_ct, sv_pg)} / {excess(sq_ct, sq_pg)} |")
if yard:
    print("\n## The service against the hand-written SQL\n")
    print("Database CPU per Claim+Complete cycle in µs, all nodes (Citus: the coordinator and the workers), "
          "of the service and of the hand-written cycle run by pgbench on the same servers "
          "(citus-sql: bench/handwritten/claim-complete-citus.sql through the coordinator; postgres-sql: "
          "bench/handwritten/claim-complete.sql); ÷: the service's over the SQL's. Coordinator's share: "
          "of the cycle's database CPU on Citus, the service's / the SQL's. p50 excess: p50 on Citus "
          "minus p50 on PostgreSQL, the service's / the SQL's, in ms. Issue 31's targets: the service's "
          "Citus CPU per cycle at most the SQL's (÷ at most 1.00x) at every level; at 1 caller, the "
          "service's p50 excess at most the SQL's.\n")
    print("| callers | Citus: service µs | citus-sql µs | ÷ | PostgreSQL: service µs | postgres-sql µs | ÷ | coordinator's share: service / citus-sql | p50 excess ms: service / SQL |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(yard))
EOF

if ((failures)); then
  log "$failures point(s) failed"
  exit 1
fi
log "summary: $out/summary.md"
