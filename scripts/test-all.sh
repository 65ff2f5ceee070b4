#!/usr/bin/env bash
# Every test of the project, in one command (the README's):
#   0. what the tests need, started or installed when missing
#      (scripts/ensure-services.sh: PostgreSQL, RabbitMQ, NATS, cargo-nextest,
#      Node and npm, openssl, psql);
#   1. one release build of the workspace (the service, the proto crate,
#      proto/, and the load generator, bench/loadgen), shared by everything
#      below;
#   2. the Rust suites (unit tests, the conformance suite on PostgreSQL and
#      SQLite, outages, crashes, the binary) with cargo-nextest;
#   3. the client suites (Python, TypeScript, Go, Java, cross-language), each
#      against the real server binary, and a newcomer's quick start (a fresh
#      clone, both clients installed as the docs say, the docs' snippets run);
#   4. the examples (examples/), each against the real server and the real
#      broker: a webhook receiver, an HTTP API with Idempotency-Key, RabbitMQ
#      consumers in Python and Go and in batches, a NATS JetStream consumer
#      in TypeScript, consumers killed and redelivered;
#   5. the suites on Citus, only when TEST_CITUS_URL names a coordinator
#      (scripts/test-citus.sh; otherwise one line says they did not run);
#      the fault-injection harness (faults/run.sh --ci): every scenario
#      (replicas killed, rolling restart, PostgreSQL crash, network partition,
#      failover, PgBouncer, Patroni, clock skew, connection exhaustion, a full
#      disk; Citus's where Citus is installed) under a workload whose history
#      the checker reads;
#   6. the benchmark scripts' smoke runs (compare.sh: the hand-written SQL,
#      pgbench and idempotency-bench, briefly; large-table.sh on small tables;
#      marker-bytes.sh on a few thousand keys;
#      callgrind.sh for 100 cycles);
#   7. the deployment checks (Helm chart, proto lint and breaking changes).
#
# Uses PostgreSQL on 127.0.0.1:5432 with trust auth for user postgres
# (TEST_POSTGRES_URL overrides), RabbitMQ on 127.0.0.1:5672 (guest/guest) and
# NATS with JetStream on 127.0.0.1:4222; step 0 starts them when they are down
# and installs them from Debian when they are missing. Each later step installs
# what it lacks (pip and npm packages into gitignored folders; Debian packages
# for Go, Java, Python's venv, valgrind and strace).
set -euo pipefail
cd "$(dirname "$0")/.."

export TEST_POSTGRES_URL="${TEST_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
export IDEMPOTENCY_BIN="$PWD/target/release/idempotency-service"

step() { printf '\n=== %s\n' "$*"; }

step "what the tests need (PostgreSQL, RabbitMQ, NATS, tools)"
bash scripts/ensure-services.sh

step "release build (the workspace: the service, proto/, bench/loadgen and gateway/)"
cargo build --release --locked --workspace --bins --tests

step "Rust tests (cargo nextest, release)"
# The tests make one schema each in this database; start it empty.
psql "$TEST_POSTGRES_URL" -qc 'DROP DATABASE IF EXISTS idempotency_test WITH (FORCE)' >/dev/null
if command -v cargo-nextest >/dev/null 2>&1; then
  cargo nextest run --release --locked --workspace --no-fail-fast
else
  cargo test --release --locked --workspace --no-fail-fast
fi

step "Python client"
bash clients/python/run-tests.sh -q
step "TypeScript client"
bash clients/node/run-tests.sh
step "Cross-language (Python with Node, Go and Java)"
bash clients/cross-language-test.sh
step "Quick start (a fresh clone, the docs' install commands and snippets)"
bash scripts/check-quickstart.sh
step "Go package and example"
bash clients/go/run-tests.sh
step "Java client"
bash clients/java/run-tests.sh

step "Example: webhook receiver (Python, FastAPI)"
bash examples/webhook-python/run-tests.sh
step "Example: HTTP API with Idempotency-Key (Python, FastAPI), the draft's cases"
bash examples/http-api-python/run-tests.sh
step "Example: RabbitMQ consumer (Python), killed and redelivered"
bash examples/rabbitmq-python/run-tests.sh
step "Example: RabbitMQ consumer (Go), killed and redelivered"
bash examples/rabbitmq-go/run-tests.sh
step "Example: RabbitMQ consumer in batches (Python, ClaimBatch/CompleteBatch)"
bash examples/rabbitmq-batch-python/run-tests.sh
step "Example: NATS JetStream consumer (TypeScript)"
bash examples/nats-typescript/run-tests.sh

step "Citus (only with TEST_CITUS_URL: a Citus coordinator of yours; see docs/scaling.md)"
bash scripts/test-citus.sh

step "Fault injection (every scenario of faults/, a few seconds of load each)"
bash faults/run.sh --ci

step "Benchmark scripts (smoke: pgbench and the load generator, 1 s per point)"
# Each makes its own throwaway PostgreSQL cluster (initdb), as a full run does.
BENCH_SKIP_BUILD=1 bash bench/compare.sh --smoke
step "Waiting Claims against polling (smoke: 3 rounds of each, 64 duplicates)"
bash bench/wait.sh --smoke
step "Large-table benchmark (smoke: tens of thousands of rows)"
bash bench/large-table.sh --smoke
step "Bytes per remembered key's marker (smoke: a few thousand keys on each store)"
bash bench/marker-bytes.sh --smoke
step "A lone call's instructions and system calls (smoke: 100 cycles)"
BENCH_CYCLES=100 BENCH_WARMUP=20 BENCH_LEVELS=warn BENCH_SKIP_BUILD=1 bash bench/callgrind.sh

step "Proto: buf lint and buf breaking"
bash scripts/check-proto.sh
step "Helm chart"
bash scripts/check-helm.sh
