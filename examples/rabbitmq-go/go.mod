// For builds with modules (elsewhere than this repository's CI, which builds
// in GOPATH mode with Debian's packages: see README.md). The helper package
// comes from this repository's clients/go; run `go mod tidy` once after
// generating its stubs (clients/go/README.md).
module idempotencyservice/examples/rabbitmq-go

go 1.19

require (
	github.com/rabbitmq/amqp091-go v1.5.0
	idempotencyservice v0.0.0
)

replace idempotencyservice => ../../clients/go
