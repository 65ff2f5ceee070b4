#!/usr/bin/env bash
# Bytes per remembered key (issue 24): what a marker costs on disk, on
# PostgreSQL and on SQLite, against a completed record holding its result.
#
# For each store, two databases with the same BENCH_MARKER_ROWS keys of
# realistic sizes: a 20-character namespace ('orders/eu-west-1/api'), a
# 36-character UUID key (md5(n) as a UUID, so both databases hold the same
# keys in the same random order), a 32-byte fingerprint (sha-256), a 16-byte
# lease token, fencing token 1, a 24 h retention:
#   - "completed": completed records (state 2) with a RESPONSE_BYTES (200)
#     response, live for another day and remembered for 7 (remember_until
#     set, as Complete leaves a record under the default remember_for);
#   - "marker": the same records inserted already expired (expires_at a
#     second ago, remember_until 6 days ahead), then the server itself (the
#     release binary, its reaper every second, default batch of 1,000) turns
#     them into markers (every time distinct by a microsecond per key, as
#     real completions are: equal values would let PostgreSQL's B-tree
#     deduplication shrink the reap_at index to almost nothing); the script waits (polling, with a deadline) until
#     every row is in state 4, checks the shape the reaper left (response and
#     checkpoint NULL, remember_until = the old expiry in the past, expires_at
#     = the horizon ahead) and stops the server.
# So the markers are the reaper's own, not a hand-made imitation.
#
# Then each database is measured twice:
#   - after a plain VACUUM: the files as the service leaves them (the
#     reaper's UPDATE writes a new version of each row, and VACUUM only makes
#     the old version's space reusable: the file does not shrink);
#   - after VACUUM FULL (PostgreSQL) or VACUUM (SQLite): rewritten compactly,
#     the rows' and the indexes' own size (what a table full of markers
#     settles to as freed space is reused).
# PostgreSQL: pg_relation_size of the heap, each index, TOAST and the rest
# (pg_total_relation_size), and the average pg_column_size of a row. SQLite:
# dbstat's bytes per table and index (the page sizes, free space included),
# and the file's size.
#
#   bench/marker-bytes.sh            100,000 keys per database (about a minute)
#   bench/marker-bytes.sh --smoke    2,000 keys: proves the script works
#
# Settings (environment):
#   BENCH_MARKER_ROWS   keys per database (100000; smoke 2000)
#   BENCH_PG_URL        use this PostgreSQL server (loopback only) instead of a
#                       throwaway cluster
#   BENCH_SERVER_BIN    the server binary (default $IDEMPOTENCY_BIN, else
#                       target/release/idempotency-service); copied first,
#                       never built
#   BENCH_OUT           folder for results (target/bench/marker-bytes-<date-time>)
#
# Results: summary.md (printed too) and summary.json. Needs psql, python3
# (with its sqlite3 module built with dbstat) and initdb/pg_ctl for the
# throwaway cluster. Only loopback addresses are used.
set -eEuo pipefail
cd "$(dirname "$0")/.."
bench_name=marker-bytes
source bench/lib.sh

smoke=0
case "${1:-}" in
  --smoke) smoke=1 ;;
  "") ;;
  -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
  *) echo "usage: $0 [--smoke]" >&2; exit 64 ;;
esac
if ((smoke)); then rows="${BENCH_MARKER_ROWS:-2000}"; else rows="${BENCH_MARKER_ROWS:-100000}"; fi
[[ "$rows" =~ ^[1-9][0-9]*$ ]] || bench_die "BENCH_MARKER_ROWS must be a whole number above 0: $rows"
out="${BENCH_OUT:-target/bench/marker-bytes-$(date +%Y%m%d-%H%M%S)}"
namespace='orders/eu-west-1/api'
response_bytes=200
pg_marker_db=idempotency_bench_marker
pg_completed_db=idempotency_bench_completed
log() { bench_log "$@"; }
die() { bench_die "$@"; }
for tool in psql python3; do
  command -v "$tool" >/dev/null || die "$tool is not installed"
done
python3 -c 'import sqlite3; sqlite3.connect(":memory:").execute("SELECT 1 FROM dbstat LIMIT 1")' 2>/dev/null ||
  die "python3's sqlite3 module has no dbstat table (SQLITE_ENABLE_DBSTAT_VTAB)"

mkdir -p "$out/bin" "$out/sqlite"
out="$(cd "$out" && pwd)"
log "results in $out"
server_source="${BENCH_SERVER_BIN:-${IDEMPOTENCY_BIN:-target/release/idempotency-service}}"
[[ -x "$server_source" ]] || die "no server binary at $server_source (cargo build --release, or set BENCH_SERVER_BIN)"
cp "$server_source" "$out/bin/idempotency-service"
server_bin="$out/bin/idempotency-service"

server_pid=""
cleanup() {
  stop_pid "$server_pid"
  if [[ -n "${pg_server:-}" ]]; then
    for db in $pg_marker_db $pg_completed_db; do
      psql "$pg_server/postgres" -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true
    done
  fi
  stop_postgres
}
trap cleanup EXIT
trap 'exit 130' INT TERM
trap 'log "error: line $LINENO: $BASH_COMMAND"' ERR

# Runs the server on a database until its reaper has turned every row into a
# marker (polled with COUNT_CMD, which prints the rows not yet markers).
reap_to_markers() { # db_url logfile count_cmd...
  local url="$1" logfile="$2" left deadline=$((SECONDS + 300))
  shift 2
  start_service "$url" warn "$logfile" IDEMPOTENCY_REAPER_INTERVAL=1s
  server_pid=$service_pid
  while :; do
    left=$("$@")
    ((left == 0)) && break
    ((SECONDS < deadline)) || die "the reaper left $left of $rows rows unmarked after 300 s: see $logfile"
    kill -0 "$server_pid" 2>/dev/null || die "the server exited: see $logfile"
    sleep 0.2
  done
  stop_pid "$server_pid"
  server_pid=""
}

# --- PostgreSQL ------------------------------------------------------------------------
start_postgres
admin_sql() { psql "$pg_server/postgres" -qAtX -v ON_ERROR_STOP=1 "$@"; }
pg_version=$(admin_sql -c 'SHOW server_version')
response="\\x$(printf '72%.0s' $(seq "$response_bytes"))"
for db in $pg_marker_db $pg_completed_db; do
  admin_sql -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null
  admin_sql -c "CREATE DATABASE $db" >/dev/null
  DATABASE_URL="$pg_server/$db" RUST_LOG=warn "$server_bin" migrate
done
pg_fill() { # db expires_at remember_until (SQL expressions over g)
  psql "$pg_server/$1" -qAtX -v ON_ERROR_STOP=1 -c "
    INSERT INTO idempotency_records (namespace, key, state, fencing_token, lease_token, fingerprint,
        response, retention_us, lease_expires_at, expires_at, created_at, updated_at, remember_until)
    SELECT '$namespace', md5(g::text)::uuid::text, 2, 1, uuid_send(md5('lease' || g)::uuid),
           sha256(md5(g::text)::bytea), '$response'::bytea, 86400000000, NULL, $2,
           now() - interval '1 day', now() - interval '1 day', $3
    FROM generate_series(1, $rows) AS g" -c 'VACUUM ANALYZE idempotency_records'
}
log "PostgreSQL $pg_version: $rows completed records in each database"
pg_fill $pg_completed_db "now() + interval '1 day' + g * interval '1 microsecond'" "now() + interval '7 days' + g * interval '1 microsecond'"
pg_fill $pg_marker_db "now() - interval '1 second' - g * interval '1 microsecond'" "now() + interval '6 days' + g * interval '1 microsecond'"
pg_marker_sql() { psql "$pg_server/$pg_marker_db" -qAtX -v ON_ERROR_STOP=1 "$@"; }
log "PostgreSQL: the server's reaper turns the expired records into markers"
reap_to_markers "$pg_server/$pg_marker_db" "$out/pg-server.log" \
  pg_marker_sql -c 'SELECT count(*) FROM idempotency_records WHERE state <> 4'
bad=$(pg_marker_sql -c "SELECT count(*) FROM idempotency_records
                        WHERE NOT (state = 4 AND response IS NULL AND checkpoint IS NULL
                                   AND remember_until < now() AND expires_at > now() + interval '5 days'
                                   AND reap_at = expires_at AND octet_length(fingerprint) = 32)")
((bad == 0)) || die "PostgreSQL: $bad markers are not in the shape the reaper should leave"

pg_measure() { # db label
  psql "$pg_server/$1" -qAtX -v ON_ERROR_STOP=1 -c "SELECT json_build_object(
      'label', '$2', 'rows', (SELECT count(*) FROM idempotency_records),
      'heap_bytes', pg_relation_size('idempotency_records'),
      'total_bytes', pg_total_relation_size('idempotency_records'),
      'indexes_bytes', pg_indexes_size('idempotency_records'),
      'indexes', (SELECT json_object_agg(indexname, pg_relation_size(format('%I.%I', schemaname, indexname)::regclass))
                  FROM pg_indexes WHERE schemaname = current_schema() AND tablename = 'idempotency_records'),
      'avg_row_bytes', (SELECT round(avg(pg_column_size(r.*)), 1) FROM idempotency_records AS r))"
}
pg_results=()
for db in $pg_marker_db $pg_completed_db; do
  label=${db#idempotency_bench_}
  psql "$pg_server/$db" -qAtX -v ON_ERROR_STOP=1 -c 'VACUUM ANALYZE idempotency_records' -c CHECKPOINT
  pg_results+=("$(pg_measure "$db" "$label, after VACUUM")")
  psql "$pg_server/$db" -qAtX -v ON_ERROR_STOP=1 -c 'VACUUM FULL ANALYZE idempotency_records' -c CHECKPOINT
  pg_results+=("$(pg_measure "$db" "$label, after VACUUM FULL")")
done
printf '%s\n' "${pg_results[@]}" >"$out/postgres.jsonl"

# --- SQLite -----------------------------------------------------------------------------
sqlite_version=$(python3 -c 'import sqlite3; print(sqlite3.sqlite_version)')
sqlite_fill() { # file expired(0|1)
  DATABASE_URL="sqlite://$1" RUST_LOG=warn "$server_bin" migrate
  python3 - "$1" "$2" "$rows" "$namespace" "$response_bytes" <<'EOF'
import hashlib, sqlite3, sys, time, uuid
path, expired, rows, namespace, response_bytes = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
now = int(time.time() * 1e6)
day = 86400 * 10**6
db = sqlite3.connect(path)
def row(g):
    key = str(uuid.UUID(hashlib.md5(str(g).encode()).hexdigest()))
    lease = uuid.UUID(hashlib.md5(f"lease{g}".encode()).hexdigest()).bytes
    fingerprint = hashlib.sha256(hashlib.md5(str(g).encode()).hexdigest().encode()).digest()
    if expired:
        expires, remember = now - 10**6 - g, now + 6 * day + g
    else:
        expires, remember = now + day + g, now + 7 * day + g
    return (namespace, key, 2, 1, lease, fingerprint, b"r" * response_bytes, day, None,
            expires, now - day, now - day, None, None, remember)
with db:
    db.executemany("INSERT INTO idempotency_records (namespace, key, state, fencing_token, lease_token, "
                   "fingerprint, response, retention_us, lease_expires_at, expires_at, created_at, updated_at, "
                   "checkpoint, checkpoint_fencing, remember_until) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                   (row(g) for g in range(1, rows + 1)))
db.close()
EOF
}
sqlite_marker="$out/sqlite/marker.db"
sqlite_completed="$out/sqlite/completed.db"
log "SQLite $sqlite_version: $rows completed records in each database"
sqlite_fill "$sqlite_completed" 0
sqlite_fill "$sqlite_marker" 1
sqlite_left() {
  python3 - "$sqlite_marker" <<'EOF'
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], timeout=10)
print(db.execute("SELECT count(*) FROM idempotency_records WHERE state <> 4").fetchone()[0])
EOF
}
log "SQLite: the server's reaper turns the expired records into markers"
reap_to_markers "sqlite://$sqlite_marker" "$out/sqlite-server.log" sqlite_left
python3 - "$sqlite_marker" "$sqlite_completed" "$out/sqlite.jsonl" <<'EOF'
import json, os, sqlite3, sys, time
marker, completed, out = sys.argv[1:4]
now = int(time.time() * 1e6)
db = sqlite3.connect(marker)
bad = db.execute("""SELECT count(*) FROM idempotency_records
                    WHERE NOT (state = 4 AND response IS NULL AND checkpoint IS NULL
                               AND remember_until < ? AND expires_at > ? + 5 * 86400000000
                               AND length(fingerprint) = 32)""", (now, now)).fetchone()[0]
db.close()
if bad:
    sys.exit(f"SQLite: {bad} markers are not in the shape the reaper should leave")

def measure(path, label):
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    page_size = db.execute("PRAGMA page_size").fetchone()[0]
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    free = db.execute("PRAGMA freelist_count").fetchone()[0]
    objects = {name: (size, unused) for name, size, unused in
               db.execute("SELECT name, sum(pgsize), sum(unused) FROM dbstat GROUP BY name")}
    result = {
        "label": label,
        "rows": db.execute("SELECT count(*) FROM idempotency_records").fetchone()[0],
        "file_bytes": os.path.getsize(path),
        "page_size": page_size, "pages": pages, "free_pages": free,
        "table_bytes": objects.get("idempotency_records", (0, 0))[0],
        "table_unused_bytes": objects.get("idempotency_records", (0, 0))[1],
        "indexes": {name: size for name, (size, _) in objects.items()
                    if name.startswith("sqlite_autoindex_idempotency_records") or name == "idempotency_records_expires_at"},
        "avg_row_bytes": db.execute(
            "SELECT round(avg(length(namespace) + length(key) + 2 + length(lease_token) + coalesce(length(fingerprint), 0)"
            " + coalesce(length(response), 0) + 7 * 8), 1) FROM idempotency_records").fetchone()[0],
    }
    db.close()
    return result

results = []
for path, label in ((marker, "marker"), (completed, "completed")):
    results.append(measure(path, f"{label}, as the service left it"))
    db = sqlite3.connect(path)
    db.execute("VACUUM")
    db.close()
    results.append(measure(path, f"{label}, after VACUUM"))
with open(out, "w") as f:
    for r in results:
        f.write(json.dumps(r) + "\n")
EOF

# --- The summary ----------------------------------------------------------------------------
python3 - "$out" "$rows" "$pg_version" "$sqlite_version" "$response_bytes" <<'EOF'
import json, os, sys
out, rows, pg_version, sqlite_version, response_bytes = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
pg = [json.loads(l) for l in open(os.path.join(out, "postgres.jsonl"))]
lite = [json.loads(l) for l in open(os.path.join(out, "sqlite.jsonl"))]
problems = [f"{r['label']}: {r['rows']} rows, not {rows}" for r in pg + lite if r["rows"] != rows]
per = lambda n, r: n / r["rows"]
lines = [
    f"Bytes per key: {rows:,} keys per database (20-character namespace, 36-character UUID keys, "
    f"32-byte fingerprint, 16-byte lease token); markers made by the server's reaper; "
    f"completed records hold a {response_bytes}-byte response.",
    "",
    f"PostgreSQL {pg_version}:",
    "",
    "| database | heap B/row | primary key B/row | reap_at index B/row | TOAST and the rest B/row | total B/row | avg row (pg_column_size) B |",
    "|---|---:|---:|---:|---:|---:|---:|",
]
for r in pg:
    rest = r["total_bytes"] - r["heap_bytes"] - r["indexes_bytes"]
    lines.append(
        f"| {r['label']} | {per(r['heap_bytes'], r):.1f} | {per(r['indexes']['idempotency_records_pkey'], r):.1f} "
        f"| {per(r['indexes']['idempotency_records_reap_at'], r):.1f} | {per(rest, r):.1f} "
        f"| **{per(r['total_bytes'], r):.1f}** | {r['avg_row_bytes']} |")
lines += [
    "",
    f"SQLite {sqlite_version} (dbstat: whole pages, free space in them included):",
    "",
    "| database | table B/row | primary key B/row | expires_at index B/row | file B/row | free pages | avg row (payload estimate) B |",
    "|---|---:|---:|---:|---:|---:|---:|",
]
for r in lite:
    pk = sum(v for k, v in r["indexes"].items() if k.startswith("sqlite_autoindex"))
    exp = r["indexes"].get("idempotency_records_expires_at", 0)
    lines.append(
        f"| {r['label']} | {per(r['table_bytes'], r):.1f} | {per(pk, r):.1f} | {per(exp, r):.1f} "
        f"| **{per(r['file_bytes'], r):.1f}** | {r['free_pages']:,} | {r['avg_row_bytes']} |")
text = "\n".join(lines) + "\n"
print(text)
open(os.path.join(out, "summary.md"), "w").write(text)
json.dump({"rows": rows, "postgres": pg, "sqlite": lite, "problems": problems},
          open(os.path.join(out, "summary.json"), "w"), indent=2)
if problems:
    print("problems:\n  " + "\n  ".join(problems), file=sys.stderr)
    sys.exit(1)
EOF
log "summary: $out/summary.md"
