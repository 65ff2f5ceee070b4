//! Who may call and on what, over the wire: the access policy confines each
//! identity to its namespaces and RPCs (every RPC tried across the line, and
//! every record checked unchanged afterwards), credentials are required, TLS
//! refuses plaintext, mutual TLS refuses unknown, expired and foreign client
//! certificates, certificates and the policy reload when their files change,
//! and secrets stay out of logs and `--help`.
//!
//! The tests live in tests/security/, one module a subject: `access` (the
//! policy), `tls` and `secrets`; the callers they share are here.

mod common;

#[path = "security/access.rs"]
mod access;
#[path = "security/secrets.rs"]
mod secrets;
#[path = "security/tls.rs"]
mod tls;

use idempotency_service::access::{hash_token, new_token};
use tonic::Request;

/// Three callers: `team-a` confined to its namespaces, `team-b` likewise, and
/// an operator with everything, Purge included.
struct Callers {
    a: String,
    b: String,
    operator: String,
}

impl Callers {
    fn new() -> Self {
        Self {
            a: new_token(),
            b: new_token(),
            operator: new_token(),
        }
    }

    fn policy(&self) -> String {
        format!(
            r#"
            [[identity]]
            name = "team-a"
            token_hashes = ["{}"]
            namespaces = ["team-a", "team-a/*"]

            [[identity]]
            name = "team-b"
            token_hashes = ["{}"]
            client_cert_cn = "team-b.internal"
            namespaces = ["team-b"]

            [[identity]]
            name = "operator"
            token_hashes = ["{}"]
            namespaces = ["*"]
            rpcs = ["*"]
            "#,
            hash_token(&self.a),
            hash_token(&self.b),
            hash_token(&self.operator),
        )
    }
}

/// `message` with `authorization: Bearer <token>`.
fn as_caller<T>(token: &str, message: T) -> Request<T> {
    let mut request = Request::new(message);
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    request
}
