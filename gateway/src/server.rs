//! The listeners: the proxy's (HTTP/1.1 and HTTP/2 on one port: h2c with
//! prior knowledge, or both by ALPN over TLS, see [`crate::tls`]) and the
//! admin port's (`/healthz`, `/readyz`,
//! `/metrics`); and graceful shutdown, which stops accepting, lets the
//! requests in flight finish, then waits for the work their clients left
//! behind ([`crate::background`]), all within the configured timeout.

use std::convert::Infallible;
use std::future::Future;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tracing::{debug, info, warn};

use crate::Body;
use crate::flow::Gateway;
use crate::metrics;
use crate::tls::{self, Certificate};

/// Binds the ports, says where on stdout (`listening on http://ADDR`,
/// `admin on http://ADDR`: a port 0 in the config becomes the real one),
/// and serves until `shutdown` resolves.
pub async fn run(
    gateway: Gateway,
    metrics: Option<PrometheusHandle>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), String> {
    let gateway = Arc::new(gateway);
    // Before binding: a certificate that does not load stops the start.
    let certificate = match &gateway.config.tls {
        None => None,
        Some(files) => Some(Certificate::open(files)?),
    };
    let listener = TcpListener::bind(gateway.config.listen)
        .await
        .map_err(|e| format!("listen: cannot bind {}: {e}", gateway.config.listen))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let admin = match gateway.config.admin_listen {
        None => None,
        Some(admin_addr) => {
            let admin = TcpListener::bind(admin_addr)
                .await
                .map_err(|e| format!("admin_listen: cannot bind {admin_addr}: {e}"))?;
            Some(admin)
        }
    };
    let scheme = if certificate.is_some() {
        "https"
    } else {
        "http"
    };
    announce(&format!("listening on {scheme}://{addr}"));
    if let Some(admin) = admin {
        let admin_addr = admin.local_addr().map_err(|e| e.to_string())?;
        announce(&format!("admin on http://{admin_addr}"));
        tokio::spawn(serve_admin(admin, gateway.clone(), metrics));
    }
    let _reload = certificate
        .clone()
        .map(|certificate| AbortOnDrop(tokio::spawn(certificate.watch())));
    info!(%addr, tls = certificate.is_some(), upstream = %gateway.config.upstream, service = %gateway.config.service,
        routes = gateway.config.routes.len(), "idempotency-gateway started");

    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new());
    builder.http2().timer(TokioTimer::new());
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        // Out of file descriptors, or a connection reset
                        // before it was accepted: go on.
                        warn!(%error, "accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let gateway = gateway.clone();
                let service = service_fn(move |request: Request<Incoming>| {
                    let gateway = gateway.clone();
                    async move { Ok::<_, Infallible>(gateway.handle(request, peer).await) }
                });
                let builder = builder.clone();
                let watcher = graceful.watcher();
                match &certificate {
                    None => {
                        tokio::spawn(serve(builder, stream, service, watcher, peer));
                    }
                    Some(certificate) => {
                        // The handshake runs in the connection's own task,
                        // under a timeout, so a slow client delays no other.
                        let acceptor = certificate.acceptor();
                        tokio::spawn(async move {
                            let handshake = tokio::time::timeout(
                                tls::HANDSHAKE_TIMEOUT,
                                acceptor.accept(stream),
                            );
                            match handshake.await {
                                Ok(Ok(stream)) => {
                                    serve(builder, stream, service, watcher, peer).await;
                                }
                                Ok(Err(error)) => {
                                    debug!(%peer, %error, "TLS handshake failed");
                                    metrics::tls_handshake_failed();
                                }
                                Err(_) => {
                                    debug!(%peer, "TLS handshake timed out");
                                    metrics::tls_handshake_failed();
                                }
                            }
                        });
                    }
                }
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    // One grace for both steps: Kubernetes kills the pod at the end of its
    // terminationGracePeriodSeconds, however the time was spent.
    let deadline = tokio::time::Instant::now() + gateway.config.shutdown_timeout;
    info!("shutting down: finishing the requests in flight");
    tokio::select! {
        () = graceful.shutdown() => info!("every connection closed"),
        () = tokio::time::sleep_until(deadline) => {
            warn!("the shutdown timeout passed with requests still in flight");
        }
    }
    let background = &gateway.background;
    if background.running() > 0 {
        info!(
            running = background.running(),
            "waiting for the work of requests whose clients left (their Complete or Release)"
        );
        tokio::select! {
            () = background.idle() => info!("the background work is done"),
            () = tokio::time::sleep_until(deadline) => {
                // Not released: the upstream may still be working on them.
                // Their leases run out (the heartbeat ends with the process),
                // and a retry after that runs the request again.
                warn!(running = background.running(),
                    "the shutdown timeout passed with background work unfinished: \
                     its keys stay in progress until their leases run out");
            }
        }
    }
    Ok(())
}

/// Serves one connection (plain or TLS) until it closes, or until the
/// shutdown's watcher has let its requests in flight finish.
async fn serve<I, S>(
    builder: auto::Builder<TokioExecutor>,
    io: I,
    service: S,
    watcher: Watcher,
    peer: SocketAddr,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: hyper::service::Service<Request<Incoming>, Response = Response<Body>, Error = Infallible>
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let connection = builder.serve_connection(TokioIo::new(io), service);
    if let Err(error) = watcher.watch(connection.into_owned()).await {
        debug!(%peer, %error, "connection ended with an error");
    }
}

/// Aborts its task when dropped: the certificate's reload stops with the
/// server.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn announce(line: &str) {
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{line}");
    let _ = stdout.flush();
}

async fn serve_admin(
    listener: TcpListener,
    gateway: Arc<Gateway>,
    metrics: Option<PrometheusHandle>,
) {
    let metrics = Arc::new(metrics);
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let gateway = gateway.clone();
        let metrics = metrics.clone();
        let service = service_fn(move |request: Request<Incoming>| {
            let gateway = gateway.clone();
            let metrics = metrics.clone();
            async move {
                let (status, body) = match request.uri().path() {
                    "/healthz" => (StatusCode::OK, "ok\n".to_owned()),
                    "/readyz" => {
                        if gateway
                            .service
                            .ping(std::time::Duration::from_secs(1))
                            .await
                        {
                            (StatusCode::OK, "ready\n".to_owned())
                        } else {
                            (
                                StatusCode::SERVICE_UNAVAILABLE,
                                "the idempotency service does not answer\n".to_owned(),
                            )
                        }
                    }
                    "/metrics" => match metrics.as_ref() {
                        Some(handle) => (StatusCode::OK, handle.render()),
                        None => (StatusCode::NOT_FOUND, String::new()),
                    },
                    _ => (StatusCode::NOT_FOUND, String::new()),
                };
                let mut response = Response::new(Full::new(Bytes::from(body)));
                *response.status_mut() = status;
                Ok::<_, Infallible>(response)
            }
        });
        tokio::spawn(async move {
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
