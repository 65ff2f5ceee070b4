//! The code generated from proto/idempotency/v1/idempotency.proto, and the
//! names and descriptors the server registers it under.
#![allow(clippy::all, missing_docs)]

tonic::include_proto!("idempotency.v1");

/// The encoded descriptors, served by reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    tonic::include_file_descriptor_set!("idempotency_descriptor");

/// The fully qualified service name, as health and reflection know it.
pub const SERVICE_NAME: &str = idempotency_service_server::SERVICE_NAME;
