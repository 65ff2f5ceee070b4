//! sqlx::migrate! embeds the migrations at compile time, and a proc macro
//! cannot ask cargo to watch a directory: this tells cargo that a changed or
//! new migration must rebuild the crate. (The proto is compiled by
//! idempotency-proto, proto/build.rs.)

fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
