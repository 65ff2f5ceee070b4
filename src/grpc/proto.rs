//! The code generated from proto/idempotency/v1/idempotency.proto, and the
//! names and descriptors the server registers it under: idempotency-proto's
//! `v1`, re-exported here so that the service and its tests name it
//! `grpc::proto`. The proto is compiled once, by that crate.

pub use idempotency_proto::v1::*;
