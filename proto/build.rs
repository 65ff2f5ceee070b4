//! Compiles idempotency/v1/idempotency.proto into Rust (tonic + prost) and
//! writes the file descriptor set that server reflection serves. protoc comes
//! from the vendored binary unless PROTOC is already set, so a fresh machine
//! needs no system protoc.

use std::{env, path::PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if env::var_os("PROTOC").is_none() {
        // SAFETY: build scripts are single-threaded; nothing reads the
        // environment concurrently.
        unsafe { env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    }
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    // The include root is this directory (the repository's proto/), so the
    // file is known as idempotency/v1/idempotency.proto, as buf and every
    // other client name it, and reflection serves it under that name.
    tonic_prost_build::configure()
        .file_descriptor_set_path(out_dir.join("idempotency_descriptor.bin"))
        // Requests that are not valid protobuf are INVALID_ARGUMENT, not INTERNAL.
        .codec_path("crate::codec::Codec")
        .compile_protos(&["idempotency/v1/idempotency.proto"], &["."])?;
    println!("cargo:rerun-if-changed=idempotency");
    Ok(())
}
