#!/usr/bin/env bash
# The RabbitMQ example in Go (examples/rabbitmq-go): go vet, then its test
# against the real RabbitMQ ($RABBITMQ_URL, default guest on 127.0.0.1:5672;
# a queue of its own, deleted at the end) and an idempotency-service it starts
# on a free port. Builds in GOPATH mode with Debian's Go packages
# (golang-github-rabbitmq-amqp091-go-dev for the broker), like clients/go.
# The broker restart test runs a RabbitMQ node of its own (Debian's
# rabbitmq-server, installed when missing; its own node name, ports and data
# folder: the machine's broker is never restarted). Run from anywhere.
#
#   IDEMPOTENCY_BIN   the server binary (default: target/release/idempotency-service)
#   RABBITMQ_URL      the broker (default: amqp://guest:guest@127.0.0.1:5672/)
#   RABBITMQ_SERVER_BIN  the private node's start script (default: Debian's
#                     /usr/lib/rabbitmq/bin/rabbitmq-server)
set -euo pipefail
source "$(dirname "$0")/../../clients/go/lib.sh"
go_server_bin
# The retention against the server's remember_for: docs/recipes.md's rule (check_settings.py).
python3 "$go_repo/examples/check_settings.py" rabbitmq-go "$IDEMPOTENCY_BIN"

url=${RABBITMQ_URL:-amqp://guest:guest@127.0.0.1:5672/}
hostport=${url#*://}; hostport=${hostport#*@}; hostport=${hostport%%/*}
host=${hostport%%:*}; port=${hostport##*:}; [ "$port" != "$host" ] || port=5672
if ! timeout 5 bash -c ": </dev/tcp/$host/$port" 2>/dev/null; then
  echo "rabbitmq-go example: RabbitMQ is not reachable at $host:$port (start it, or set RABBITMQ_URL)" >&2
  exit 1
fi

go_install_debs golang-github-rabbitmq-amqp091-go-dev rabbitmq-server strace  # strace: the ledger fsync test
go_venv
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
go_gopath "$work"
# The example is a package of the temporary GOPATH too, so that its test
# (which imports idempotencyservice/idempotency) builds in GOPATH mode.
ln -sfn "$go_repo/examples/rabbitmq-go" "$work/gopath/src/idempotencyservice/examples-rabbitmq-go"
cd "$work/gopath/src/idempotencyservice/examples-rabbitmq-go"
go vet .
RABBITMQ_URL=$url go test -count=1 -timeout 240s -v .
