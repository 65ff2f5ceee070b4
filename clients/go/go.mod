// The Go client for builds with modules. This repository's CI builds in
// GOPATH mode with Debian's packages instead (run-tests.sh, lib.sh), so this
// file is not exercised here: generate the stubs (./generate.sh), then run
// `go mod tidy` to pin the rest and write go.sum. See README.md.
module idempotencyservice

go 1.19

require (
	google.golang.org/genproto v0.0.0-20200526211855-cb27e3aa2013 // googleapis/rpc/errdetails: the google.rpc error details
	google.golang.org/grpc v1.33.3
	google.golang.org/protobuf v1.28.1
)
