#!/usr/bin/env bash
# The suites on Citus, run by hand: the conformance suite (both PostgreSQL
# variants: coalesced and not, the replay cache on, two servers where a test
# uses two) and the replay-cache suites, through the real server, against a
# Citus coordinator whose workers are registered: once with every server
# given the coordinator, once with the servers spread over the nodes.
#
#   TEST_CITUS_URL='postgres://postgres@127.0.0.1:9700/postgres?sslmode=disable' \
#     bash scripts/test-citus.sh
#
# The project neither ships nor installs Citus: build it yourself, following
# its own documentation, and see docs/scaling.md ("Running the Citus tests by
# hand") for the cluster this expects. Without TEST_CITUS_URL this prints one
# line saying it did not run, and runs nothing (it is not a pass).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${TEST_CITUS_URL:-}" ]; then
  echo "Citus suites: NOT RUN (TEST_CITUS_URL is not set; it names a Citus coordinator with registered workers: see docs/scaling.md)"
  exit 0
fi

# The tests make one schema each in the database idempotency_test of the
# server TEST_CITUS_URL names; Citus does not create a database on its
# workers, so it must exist on every node, with the extension.
db_url=$(python3 -c 'import sys,urllib.parse as u; p=u.urlsplit(sys.argv[1]); print(u.urlunsplit(p._replace(path="/idempotency_test")))' "$TEST_CITUS_URL")
workers=$(psql "$db_url" -Atc "SELECT count(*) FROM citus_get_active_worker_nodes()") || {
  echo "Citus suites: cannot use database idempotency_test on the coordinator with the citus extension (see docs/scaling.md)" >&2
  exit 1
}
if [ "$workers" -lt 1 ]; then
  echo "Citus suites: the coordinator has no active workers" >&2
  exit 1
fi
echo "Citus coordinator with $workers active workers"

export IDEMPOTENCY_BIN="$PWD/target/release/idempotency-service"
cargo build --release --locked --bins --tests
# Left out: postgres_citus_sql (plain PostgreSQL running Citus's statements:
# on Citus it is the postgres variant with made-up workers). Everything else
# runs, the changes made in SQL behind the service's back included: their
# triggers run on the node holding the key, which every replica's feed
# listens on (docs/scaling.md, "Every change heard on every node").
# Twice: every server given the coordinator, then (TEST_CITUS_SPREAD=1) the
# servers of each store given a worker first, then the coordinator, then the
# other workers, so that the suites pass with replicas connected to any node.
# The coordinator must be registered (citus_set_coordinator_host).
status=0
for spread in 0 1; do
  echo "Citus suites: TEST_CITUS_SPREAD=$spread"
  TEST_CITUS_SPREAD=$spread TEST_POSTGRES_URL="$TEST_CITUS_URL" cargo nextest run --release --locked --no-fail-fast \
    --test conformance --test replay_cache --test replay_linearizable \
    -E 'not test(/^sqlite::/) and not test(/^postgres_citus_sql::/)' || status=1
done
exit $status
