#!/usr/bin/env bash
# What scripts/test-all.sh needs running or installed before its first step,
# started or installed when missing, so that the test command needs nothing
# done by hand on a Debian machine (run as root, as CI does):
#   - PostgreSQL on 127.0.0.1:5432, user postgres with trust auth
#     (TEST_POSTGRES_URL's server): started when it is down; Debian's
#     `postgresql` installed when there is no cluster at all, its loopback
#     connections then trusted (a fresh cluster asks for a password);
#   - RabbitMQ on 127.0.0.1:5672 (guest/guest) and NATS with JetStream on
#     127.0.0.1:4222, for the examples: Debian's `rabbitmq-server` and
#     `nats-server`, installed when missing and started when down;
#   - cargo-nextest, for the Rust suites (`cargo install`);
#   - node and npm (the TypeScript client, the NATS example, buf), openssl
#     (the clients' TLS tests make certificates with it) and psql: Debian's.
# The steps after it install the rest themselves: Python packages into
# gitignored venvs (python3-venv from Debian), Go and Java from Debian,
# valgrind and strace for bench/callgrind.sh.
#
# Each check is cheap when the thing is there; nothing is changed then.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf 'ensure-services: %s\n' "$*" >&2; }

apt_updated=0
apt_install() {
  command -v apt-get >/dev/null 2>&1 || {
    log "missing $* and no apt-get to install it: install it by hand"
    return 1
  }
  log "installing $* (Debian)"
  if ((!apt_updated)); then
    apt-get update -qq
    apt_updated=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_port() { # port name
  for _ in $(seq 1 60); do port_open "$1" && return 0; sleep 1; done
  log "$2 did not open port $1 within 60 s"
  return 1
}

# --- PostgreSQL ------------------------------------------------------------
pg_ready() { command -v pg_isready >/dev/null 2>&1 && pg_isready -h 127.0.0.1 -p 5432 -q; }
newest_cluster() { ls /etc/postgresql 2>/dev/null | sort -V | tail -1; }
if ! pg_ready; then
  if [[ -z "$(newest_cluster)" ]]; then
    apt_install postgresql
    version="$(newest_cluster)"
    [[ -n "$version" ]] || { log "installing postgresql made no cluster"; exit 1; }
    # The tests connect as postgres over TCP without a password.
    hba="/etc/postgresql/$version/main/pg_hba.conf"
    sed -i '1i host all postgres 127.0.0.1/32 trust\nhost all postgres ::1/128 trust' "$hba"
    log "PostgreSQL $version: loopback connections as postgres trusted ($hba)"
    pg_ctlcluster --skip-systemctl-redirect "$version" main reload 2>/dev/null || true
  fi
  if ! pg_ready; then
    log "starting PostgreSQL"
    pg_ctlcluster --skip-systemctl-redirect "$(newest_cluster)" main start
    for _ in $(seq 1 30); do pg_ready && break; sleep 1; done
    pg_isready -h 127.0.0.1 -p 5432
  fi
fi

# --- The brokers the examples run against ----------------------------------
if ! port_open 5672; then
  command -v rabbitmq-server >/dev/null 2>&1 || apt_install rabbitmq-server
  log "starting RabbitMQ"
  service rabbitmq-server start || /etc/init.d/rabbitmq-server start
  wait_port 5672 RabbitMQ
fi
if ! port_open 4222; then
  command -v nats-server >/dev/null 2>&1 || apt_install nats-server
  log "starting NATS (JetStream)"
  mkdir -p /var/lib/nats-server
  setsid nohup nats-server -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server \
    -l /var/log/nats-server.log >/dev/null 2>&1 </dev/null &
  wait_port 4222 NATS
fi

# --- Tools -----------------------------------------------------------------
command -v cargo-nextest >/dev/null 2>&1 || {
  log "installing cargo-nextest (cargo install)"
  cargo install cargo-nextest --locked
}
missing=()
command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
command -v psql >/dev/null 2>&1 || missing+=(postgresql-client)
if ((${#missing[@]})); then
  apt_install "${missing[@]}"
fi
