# Shared by the benchmark scripts (source it; it defines functions and sets
# nothing else until called):
#   bench_log / bench_die         messages prefixed with the script's name ($bench_name)
#   free_port                     a free TCP port on 127.0.0.1
#   stop_pid PID                  SIGTERM, up to 10 s, then SIGKILL; reaps it
#   as_postgres CMD...            runs CMD as the postgres user when root (initdb refuses root)
#   start_postgres [-c name=value...]
#                                 sets pg_server: BENCH_PG_URL (loopback only) when set,
#                                 else a throwaway cluster made with initdb on a free
#                                 port (default settings and durability, plus
#                                 max_connections 300, pg_stat_statements and WAL
#                                 timing, plus the arguments); pg_bin, pg_cluster_dir
#   restart_postgres [-c name=value...]
#                                 the throwaway cluster again with other settings
#   stop_postgres                 stops and removes the throwaway cluster, if any
#   start_service DB_URL RUST_LOG LOGFILE [ENV=VALUE...]
#                                 starts $server_bin on free ports; sets service_pid,
#                                 service_target (http://…) and service_metrics (host:port);
#                                 under the command in $service_wrapper (an array:
#                                 valgrind, strace) when set, then waiting up to
#                                 $service_wait_s seconds (10) for its port

bench_log() { printf '[%s %s] %s\n' "${bench_name:-bench}" "$(date +%H:%M:%S)" "$*" >&2; }
bench_die() { bench_log "error: $*"; exit 1; }

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

stop_pid() { # pid
  local pid="$1"
  if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
}

as_postgres() { if [[ $(id -u) == 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi; }

pg_cluster_dir=""
pg_bin=""
pg_port=""

# The cluster's settings: the defaults, plus what the scripts need.
_pg_options() {
  local options="-c port=$pg_port -c listen_addresses=127.0.0.1 -c unix_socket_directories=$pg_cluster_dir"
  options+=" -c max_connections=300 -c shared_preload_libraries=pg_stat_statements -c track_wal_io_timing=on"
  while (($#)); do
    [[ "$1" == -c ]] && shift
    options+=" -c $1"
    shift
  done
  printf '%s' "$options"
}

start_postgres() {
  if [[ -n "${BENCH_PG_URL:-}" ]]; then
    pg_server="${BENCH_PG_URL%/}"
    [[ "$pg_server" =~ ^postgres(ql)?://([^@/]*@)?(127\.[0-9]+\.[0-9]+\.[0-9]+|localhost|\[::1\])(:[0-9]+)?$ ]] ||
      bench_die "BENCH_PG_URL must be postgres://[user@]HOST[:port] with a loopback HOST (no database, no parameters): $pg_server"
    return 0
  fi
  pg_bin="$(pg_config --bindir 2>/dev/null || true)"
  [[ -x "$pg_bin/initdb" ]] || pg_bin="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)"
  [[ -x "$pg_bin/initdb" ]] || bench_die "no initdb found: install PostgreSQL's server package, or set BENCH_PG_URL"
  pg_cluster_dir="$(mktemp -d "${BENCH_PG_DIR:-/tmp}/idempotency-bench-pg.XXXXXX")"
  chmod 755 "$pg_cluster_dir"
  [[ $(id -u) != 0 ]] || chown postgres: "$pg_cluster_dir"
  pg_port=$(free_port)
  bench_log "starting a throwaway PostgreSQL ($pg_bin) on 127.0.0.1:$pg_port"
  as_postgres "$pg_bin/initdb" -D "$pg_cluster_dir/data" -U postgres -A trust -E UTF8 --locale=C.UTF-8 \
    >"$pg_cluster_dir/initdb.log" 2>&1 || bench_die "initdb failed: $(tail -5 "$pg_cluster_dir/initdb.log")"
  as_postgres "$pg_bin/pg_ctl" -D "$pg_cluster_dir/data" -l "$pg_cluster_dir/postgres.log" -w -t 60 \
    -o "$(_pg_options "$@")" start >/dev/null || bench_die "PostgreSQL did not start: $(tail -5 "$pg_cluster_dir/postgres.log")"
  pg_server="postgres://postgres@127.0.0.1:$pg_port"
}

restart_postgres() {
  [[ -n "$pg_cluster_dir" ]] || bench_die "restart_postgres needs the throwaway cluster (BENCH_PG_URL is set)"
  as_postgres "$pg_bin/pg_ctl" -D "$pg_cluster_dir/data" -m fast -w stop >/dev/null
  as_postgres "$pg_bin/pg_ctl" -D "$pg_cluster_dir/data" -l "$pg_cluster_dir/postgres.log" -w -t 600 \
    -o "$(_pg_options "$@")" start >/dev/null || bench_die "PostgreSQL did not restart: $(tail -5 "$pg_cluster_dir/postgres.log")"
}

stop_postgres() {
  if [[ -n "$pg_cluster_dir" ]]; then
    as_postgres "$pg_bin/pg_ctl" -D "$pg_cluster_dir/data" -m fast -w stop >/dev/null 2>&1 || true
    rm -rf "$pg_cluster_dir"
    pg_cluster_dir=""
  fi
}

service_pid=""
service_target=""
service_metrics=""
service_wrapper=()
service_wait_s=10
start_service() { # db_url rust_log logfile [ENV=VALUE...]
  local db_url="$1" rust_log="$2" logfile="$3" port metrics_port
  shift 3
  port=$(free_port)
  metrics_port=$(free_port)
  env DATABASE_URL="$db_url" IDEMPOTENCY_LISTEN_ADDR="127.0.0.1:$port" IDEMPOTENCY_RUN_MIGRATIONS=false \
    IDEMPOTENCY_METRICS_ADDR="127.0.0.1:$metrics_port" RUST_LOG="$rust_log" "$@" \
    "${service_wrapper[@]}" "$server_bin" >"$logfile" 2>&1 &
  service_pid=$!
  service_target="http://127.0.0.1:$port"
  service_metrics="127.0.0.1:$metrics_port"
  for _ in $(seq 1 $((service_wait_s * 10))); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then return 0; fi
    kill -0 "$service_pid" 2>/dev/null || bench_die "the server exited at start: see $logfile"
    sleep 0.1
  done
  bench_die "the server did not listen on $port within $service_wait_s s: see $logfile"
}
