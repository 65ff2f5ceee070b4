//! The connections to the target: the loopback check, one generated client
//! per HTTP/2 connection (hyper's client driven directly, or tonic's
//! `Channel`), and the wait for the server to answer.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::ValueEnum;
use serde::Serialize;
use tonic::transport::{Channel, Endpoint, Uri};

use idempotency_proto::v1::GetRequest;
use idempotency_proto::v1::idempotency_service_client::IdempotencyServiceClient;

pub type Client = IdempotencyServiceClient<Transport>;

/// How the callers' requests reach a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ClientKind {
    /// hyper's HTTP/2 client connection, driven directly: the leanest gRPC
    /// client, as pgbench is the leanest SQL one (the default).
    H2,
    /// tonic's `Channel`, which puts a tower `Buffer` task in front of each
    /// connection: one more task hand-over per call.
    Channel,
}

/// A connection as the generated client needs it: a service from HTTP
/// requests to HTTP responses.
#[derive(Clone)]
pub enum Transport {
    H2(hyper::client::conn::http2::SendRequest<tonic::body::Body>),
    Channel(Channel),
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower::Service<http::Request<tonic::body::Body>> for Transport {
    type Response = http::Response<tonic::body::Body>;
    type Error = BoxError;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, BoxError>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), BoxError>> {
        match self {
            Transport::H2(send) => send.poll_ready(cx).map_err(Into::into),
            Transport::Channel(channel) => {
                tower::Service::poll_ready(channel, cx).map_err(Into::into)
            }
        }
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        match self {
            Transport::H2(send) => {
                let response = send.send_request(request);
                Box::pin(async move { Ok(response.await?.map(tonic::body::Body::new)) })
            }
            Transport::Channel(channel) => {
                let response = tower::Service::call(channel, request);
                Box::pin(async move { Ok(response.await?) })
            }
        }
    }
}

/// Refuses any target that is not on this machine's loopback interface.
pub fn check_loopback(target: &str) -> anyhow::Result<()> {
    let uri: Uri = target.parse().context("--target is not a URI")?;
    let host = uri.host().context("--target has no host")?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let loopback = host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if !loopback {
        bail!(
            "--target {target}: only loopback addresses (127.0.0.0/8, ::1, localhost) are allowed"
        );
    }
    Ok(())
}

pub async fn connect(
    target: &str,
    connections: usize,
    kind: ClientKind,
) -> anyhow::Result<Vec<Client>> {
    let endpoint = Endpoint::from_shared(target.to_owned())
        .context("--target")?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(5));
    let origin: Uri = target.parse().context("--target")?;
    let mut clients = Vec::with_capacity(connections);
    for _ in 0..connections {
        let transport = match kind {
            ClientKind::Channel => Transport::Channel(
                endpoint
                    .connect()
                    .await
                    .with_context(|| format!("connecting to {target}"))?,
            ),
            ClientKind::H2 => {
                let authority = origin.authority().context("--target has no host")?.as_str();
                let stream = tokio::time::timeout(
                    Duration::from_secs(5),
                    tokio::net::TcpStream::connect(authority),
                )
                .await
                .with_context(|| format!("connecting to {target}: timed out"))?
                .with_context(|| format!("connecting to {target}"))?;
                stream.set_nodelay(true)?;
                let (send, connection) = hyper::client::conn::http2::handshake(
                    hyper_util::rt::TokioExecutor::new(),
                    hyper_util::rt::TokioIo::new(stream),
                )
                .await
                .with_context(|| format!("HTTP/2 handshake with {target}"))?;
                tokio::spawn(connection);
                Transport::H2(send)
            }
        };
        clients.push(IdempotencyServiceClient::with_origin(
            transport,
            origin.clone(),
        ));
    }
    Ok(clients)
}

/// Waits until the server answers a Get (its store is reachable), bounded.
pub async fn wait_ready(
    client: &mut Client,
    namespace: &str,
    within: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    loop {
        let request = GetRequest {
            namespace: namespace.to_owned(),
            key: "ready".to_owned(),
        };
        match client.get(request).await {
            Ok(_) => return Ok(()),
            Err(status) if Instant::now() >= deadline => {
                bail!("the server did not answer within {within:?}: {status}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}
