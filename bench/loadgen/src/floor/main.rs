//! idempotency-floor: the least a tonic server can cost for the RPCs the load
//! generator sends, so that bench/compare.sh can say how far above it the
//! service's own CPU per RPC is (issue 34).
//!
//! It serves the service's gRPC contract (`idempotency.v1.IdempotencyService`,
//! the generated server of the workspace's proto crate) on a loopback
//! address, in one of two modes:
//! - `bare`: no database; Claim answers OUTCOME_CLAIMED with a fixed lease,
//!   Complete answers OK, Get answers an absent key. What tonic, hyper, h2,
//!   prost and tokio cost for these calls, and nothing else.
//! - `database`: each Claim runs the yardstick's claiming upsert and each
//!   Complete its guarded UPDATE (bench/handwritten/claim-complete.sql, on
//!   the table of bench/handwritten/schema.sql), one prepared statement per
//!   RPC through a sqlx pool of PostgreSQL connections; Get answers at once.
//!   What a server that only forwards each call to PostgreSQL costs.
//!
//! Neither validates a request beyond decoding it, logs, counts or traces
//! (a subscriber that wants nothing is installed, so the libraries' spans
//! are off at their call sites): it is a floor, not a service. The other RPCs answer UNIMPLEMENTED.
//!
//! Settings are read from the same environment variables as the service's
//! (IDEMPOTENCY_LISTEN_ADDR, DATABASE_URL, IDEMPOTENCY_DB_POOL_SIZE), so the
//! bench scripts start either the same way; IDEMPOTENCY_FLOOR picks the mode.
//!
//! Modules: `yardstick` (the two statements, read from the pgbench script).

#![forbid(unsafe_code)]

mod yardstick;

use std::net::SocketAddr;

use anyhow::{Context, bail};
use clap::{Parser, ValueEnum};
use sqlx::postgres::{PgPool, PgPoolOptions, PgTypeInfo, PgValueRef, Postgres};
use sqlx::{Decode, Encode, Row, Type};
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

use idempotency_proto::v1::idempotency_service_server::{
    IdempotencyService, IdempotencyServiceServer,
};
use idempotency_proto::v1::{
    ClaimBatchRequest, ClaimBatchResponse, ClaimRequest, ClaimResponse, CompleteBatchRequest,
    CompleteBatchResponse, CompleteRequest, CompleteResponse, ExtendLeaseRequest,
    ExtendLeaseResponse, GetRequest, GetResponse, Outcome, PurgeRequest, PurgeResponse,
    ReleaseRequest, ReleaseResponse,
};

use crate::yardstick::Statements;

/// A minimal tonic server for the load generator's Claim and Complete: the
/// floor the service's own CPU per RPC is measured against.
#[derive(Parser, Debug)]
#[command(name = "idempotency-floor", version)]
struct Args {
    /// What each RPC does: fixed answers, or one statement on PostgreSQL.
    #[arg(long, env = "IDEMPOTENCY_FLOOR", value_enum)]
    mode: Mode,

    /// Where to serve gRPC; loopback addresses only.
    #[arg(
        long,
        env = "IDEMPOTENCY_LISTEN_ADDR",
        default_value = "127.0.0.1:50051"
    )]
    listen_addr: SocketAddr,

    /// The PostgreSQL database holding the yardstick's table (database mode).
    #[arg(long, env = "DATABASE_URL")]
    database_url: Option<String>,

    /// Connections of the pool (database mode): the service's default.
    #[arg(long, env = "IDEMPOTENCY_DB_POOL_SIZE", default_value_t = 16)]
    db_pool_size: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Mode {
    Bare,
    Database,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // A subscriber that wants nothing: every span and event of tonic's,
    // hyper's and h2's is switched off at its call site, as in a server whose
    // logging is off. Without one, tracing hands each span to the `log` crate.
    tracing::subscriber::set_global_default(tracing::subscriber::NoSubscriber::default())
        .context("installing the tracing subscriber")?;
    if !args.listen_addr.ip().is_loopback() {
        bail!(
            "--listen-addr {}: only loopback addresses are allowed",
            args.listen_addr
        );
    }
    let floor = match args.mode {
        Mode::Bare => Floor::Bare,
        Mode::Database => {
            let url = args
                .database_url
                .as_deref()
                .context("database mode needs DATABASE_URL")?;
            let statements = Statements::from_script()
                .map_err(|e| anyhow::anyhow!("bench/handwritten/claim-complete.sql: {e}"))?;
            let pool = PgPoolOptions::new()
                .max_connections(args.db_pool_size)
                .connect(url)
                .await
                .with_context(|| format!("connecting to {url}"))?;
            Floor::Database { pool, statements }
        }
    };
    let listener = tokio::net::TcpListener::bind(args.listen_addr)
        .await
        .with_context(|| format!("binding {}", args.listen_addr))?;
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .add_service(IdempotencyServiceServer::new(floor))
        .serve_with_incoming(incoming)
        .await?;
    Ok(())
}

/// The lease every bare Claim hands out (the bare Complete never checks it).
const BARE_LEASE: &str = "00000000000000000000000000000001";

enum Floor {
    Bare,
    Database {
        pool: PgPool,
        statements: Statements,
    },
}

#[tonic::async_trait]
impl IdempotencyService for Floor {
    async fn claim(
        &self,
        request: Request<ClaimRequest>,
    ) -> Result<Response<ClaimResponse>, Status> {
        let (pool, statements) = match self {
            Floor::Bare => {
                return Ok(Response::new(ClaimResponse {
                    outcome: Outcome::Claimed as i32,
                    lease_token: BARE_LEASE.to_owned(),
                    fencing_token: 1,
                    ..Default::default()
                }));
            }
            Floor::Database { pool, statements } => (pool, statements),
        };
        let ClaimRequest { namespace, key, .. } = request.into_inner();
        let row = sqlx::query(&statements.claim)
            .bind(namespace)
            .bind(key)
            .fetch_optional(pool)
            .await
            .map_err(database_error)?;
        let response = match row {
            Some(row) => {
                let fencing: i64 = row.try_get(0).map_err(database_error)?;
                let lease: Uuid = row.try_get(1).map_err(database_error)?;
                ClaimResponse {
                    outcome: Outcome::Claimed as i32,
                    lease_token: lease.to_hex(),
                    fencing_token: fencing as u64,
                    ..Default::default()
                }
            }
            // The upsert's WHERE kept a live lease or a completed record.
            None => ClaimResponse {
                outcome: Outcome::InProgress as i32,
                ..Default::default()
            },
        };
        Ok(Response::new(response))
    }

    async fn complete(
        &self,
        request: Request<CompleteRequest>,
    ) -> Result<Response<CompleteResponse>, Status> {
        let (pool, statements) = match self {
            Floor::Bare => return Ok(Response::new(CompleteResponse::default())),
            Floor::Database { pool, statements } => (pool, statements),
        };
        let CompleteRequest {
            namespace,
            key,
            lease_token,
            response,
            ..
        } = request.into_inner();
        let lease = Uuid::from_hex(&lease_token)
            .ok_or_else(|| Status::invalid_argument("lease_token: not 32 hex digits"))?;
        let done = sqlx::query(&statements.complete)
            .bind(response)
            .bind(namespace)
            .bind(key)
            .bind(lease)
            .execute(pool)
            .await
            .map_err(database_error)?;
        if done.rows_affected() == 0 {
            return Err(Status::failed_precondition("the lease is not held"));
        }
        Ok(Response::new(CompleteResponse::default()))
    }

    /// The load generator's readiness probe.
    async fn get(&self, _: Request<GetRequest>) -> Result<Response<GetResponse>, Status> {
        Ok(Response::new(GetResponse::default()))
    }

    async fn release(
        &self,
        _: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        Err(not_in_the_floor())
    }

    async fn extend_lease(
        &self,
        _: Request<ExtendLeaseRequest>,
    ) -> Result<Response<ExtendLeaseResponse>, Status> {
        Err(not_in_the_floor())
    }

    async fn purge(&self, _: Request<PurgeRequest>) -> Result<Response<PurgeResponse>, Status> {
        Err(not_in_the_floor())
    }

    async fn claim_batch(
        &self,
        _: Request<ClaimBatchRequest>,
    ) -> Result<Response<ClaimBatchResponse>, Status> {
        Err(not_in_the_floor())
    }

    async fn complete_batch(
        &self,
        _: Request<CompleteBatchRequest>,
    ) -> Result<Response<CompleteBatchResponse>, Status> {
        Err(not_in_the_floor())
    }
}

fn not_in_the_floor() -> Status {
    Status::unimplemented("the floor serves Claim, Complete and Get only")
}

fn database_error(error: sqlx::Error) -> Status {
    Status::unavailable(format!("database: {error}"))
}

/// A PostgreSQL uuid as its 16 bytes: the yardstick's lease_token column,
/// without the uuid crate (not in the workspace's build). Encoded and decoded
/// in PostgreSQL's binary format, as sqlx's own uuid support does.
struct Uuid([u8; 16]);

/// PostgreSQL's type oid of uuid.
const UUID_OID: u32 = 2950;

impl Uuid {
    fn to_hex(&self) -> String {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut text = String::with_capacity(32);
        for byte in self.0 {
            text.push(DIGITS[usize::from(byte >> 4)] as char);
            text.push(DIGITS[usize::from(byte & 0xf)] as char);
        }
        text
    }

    fn from_hex(text: &str) -> Option<Self> {
        let text = text.as_bytes();
        if text.len() != 32 {
            return None;
        }
        let mut bytes = [0u8; 16];
        for (i, pair) in text.chunks_exact(2).enumerate() {
            let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
            bytes[i] = (digit(pair[0])? << 4) | digit(pair[1])?;
        }
        Some(Uuid(bytes))
    }
}

impl Type<Postgres> for Uuid {
    fn type_info() -> PgTypeInfo {
        PgTypeInfo::with_oid(sqlx::postgres::types::Oid(UUID_OID))
    }
}

impl Encode<'_, Postgres> for Uuid {
    fn encode_by_ref(
        &self,
        buf: &mut sqlx::postgres::PgArgumentBuffer,
    ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        buf.extend_from_slice(&self.0);
        Ok(sqlx::encode::IsNull::No)
    }
}

impl Decode<'_, Postgres> for Uuid {
    fn decode(value: PgValueRef<'_>) -> Result<Self, sqlx::error::BoxDynError> {
        let bytes: [u8; 16] = value
            .as_bytes()?
            .try_into()
            .map_err(|_| "a uuid is 16 bytes")?;
        Ok(Uuid(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_token_goes_to_hex_and_back() {
        let lease = Uuid(*b"\x00\x11\x22\x33\x44\x55\x66\x77\x88\x99\xaa\xbb\xcc\xdd\xee\xff");
        let text = lease.to_hex();
        assert_eq!(text, "00112233445566778899aabbccddeeff");
        assert_eq!(Uuid::from_hex(&text).unwrap().0, lease.0);
    }

    #[test]
    fn a_lease_token_that_is_not_32_hex_digits_is_refused() {
        assert!(Uuid::from_hex("0011").is_none());
        assert!(Uuid::from_hex("zz112233445566778899aabbccddeeff").is_none());
    }
}
