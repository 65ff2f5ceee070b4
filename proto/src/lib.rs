//! idempotency-proto: the wire contract of the idempotency service,
//! `idempotency.v1` (proto/idempotency/v1/idempotency.proto), compiled once
//! for every Rust member of the workspace: the service, the load generator,
//! and any other client. None of them compiles the proto again or depends on
//! the service crate for its types.
//!
//! - [`v1`]: the generated messages and enums, the client
//!   (`v1::idempotency_service_client::IdempotencyServiceClient`) and the
//!   server (`v1::idempotency_service_server`), and beside them
//!   [`v1::FILE_DESCRIPTOR_SET`] and [`v1::SERVICE_NAME`], what a server
//!   registers with reflection and health.
//! - [`codec`]: the codec the generated client and server use: prost's,
//!   except that a message that is not valid protobuf is INVALID_ARGUMENT
//!   rather than INTERNAL. A server installs the status it answers with
//!   ([`codec::install_decode_error`]); the idempotency service installs its
//!   own, with its error details.

#![forbid(unsafe_code)]

pub mod codec;

pub mod v1 {
    //! The code generated from idempotency/v1/idempotency.proto (messages,
    //! enums, `idempotency_service_client`, `idempotency_service_server`), and
    //! the names and descriptors a server registers it under.
    #![allow(clippy::all, missing_docs)]

    tonic::include_proto!("idempotency.v1");

    /// The encoded descriptors, served by reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("idempotency_descriptor");

    /// The fully qualified service name, as health and reflection know it.
    pub const SERVICE_NAME: &str = idempotency_service_server::SERVICE_NAME;
}
