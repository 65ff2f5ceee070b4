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
#   BENCH_QUIET_WAIT    before each point, wait up to this many seconds for the
#                       machine to be under 15% busy (20; 0: no wait)
#   BENCH_CITUS_SQL     a SQL file run on the Citus bench database after the
#                       migrations: to measure a change to the store's Citus
#                       functions before it is a migration (named in the summary)
#   BENCH_OUT           folder for results (target/bench/citus-<date-time>)
#   BENCH_SKIP_BUILD=1  use the binaries in target/release as they are
#
# About 3 minutes of load with the defaults (10 points of 10 s), 4-7 in all
# with the set-up and the waits for a quiet machine.
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
quiet_wait="${BENCH_QUIET_WAIT:-20}"
out="${BENCH_OUT:-target/bench/citus-$(date +%Y%m%d-%H%M%S)}"
database=idempotency_citus_bench
duplicate_keys=100
response_bytes=200

[[ "$seconds" =~ ^[1-9][0-9]*$ ]] || die "BENCH_SECONDS must be a whole number of seconds: $seconds"
for tool in psql python3; do
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
cleanup() {
  stop_pid "$server_pid"
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

for level in $levels; do
  for side in postgres citus; do point "$side" claim-complete "$level"; done
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
    server = us(p["server_ticks"], clk, ops)
    nodes = [(n["node"], us(n["ticks"], clk, ops), n["wal_bytes"] / ops if ops else None) for n in p["nodes"]]
    client = (r.get("client_cpu_s") or 0) * 1e6 / ops if ops else None
    counted = p["server_ticks"] + sum(n["ticks"] or 0 for n in p["nodes"]) + (r.get("client_cpu_s") or 0) * clk
    other = max(0.0, 100 * (p["machine_ticks"] - counted) / (p["wall_s"] * clk * p["cpus"]))
    total = sum(v for v in [server, client] + [n[1] for n in nodes] if v is not None)
    by[(p["side"], p["scenario"], p["level"])] = dict(ops_s=r["ops_per_s"], server=server, nodes=nodes, client=client)
    if p["side"] == "citus":
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
        f"{fmt(server)} | {db} | {fmt(client)} | {fmt(total)} | {wal} | {commits} | {sessions} | {other:.0f}% |")

print("# One PostgreSQL against Citus (bench/citus.sh)\n")
print(open(os.path.join(out, "machine.txt")).read())
print("CPU in µs per operation (a cycle is a Claim and its Complete). Database: PostgreSQL's "
      "processes, or the coordinator's + each worker's = all Citus nodes. WAL: bytes per operation "
      "written on each node (PostgreSQL, or coordinator / workers; the whole node, other databases "
      "included). Commits/op: transactions committed in the bench database per operation on each node; "
      "sessions: connections opened to it on each node during the point, warm-up included (both from "
      "the statistics, which lag up to a second). Other: the machine's CPU taken by other processes "
      "during the window.\n")
print("| side | operation | callers | ops/s | p50 / p99 ms | errors | service µs | database µs | load generator µs | total µs | WAL B/op | commits/op | sessions | other |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
print("\n".join(rows))

if warnings:
    print("\nDisturbed:\n" + "\n".join(f"- {w}" for w in warnings))

ratios = []
for (side, scenario, level), v in sorted(by.items()):
    if side != "citus" or ("postgres", scenario, level) not in by:
        continue
    ratios.append(f"| {titles[scenario]} | {level} | {v['ops_s'] / by[('postgres', scenario, level)]['ops_s']:.2f}x |")
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
EOF

if ((failures)); then
  log "$failures point(s) failed"
  exit 1
fi
log "summary: $out/summary.md"
