//! The listeners: the proxy's (HTTP/1.1 and HTTP/2 with prior knowledge,
//! h2c, on one port) and the admin port's (`/healthz`, `/readyz`,
//! `/metrics`); and graceful shutdown, which stops accepting and lets the
//! requests in flight finish, up to the configured timeout.

use std::convert::Infallible;
use std::future::Future;
use std::io::Write;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tracing::{debug, info, warn};

use crate::flow::Gateway;

/// Binds the ports, says where on stdout (`listening on http://ADDR`,
/// `admin on http://ADDR`: a port 0 in the config becomes the real one),
/// and serves until `shutdown` resolves.
pub async fn run(
    gateway: Gateway,
    metrics: Option<PrometheusHandle>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), String> {
    let gateway = Arc::new(gateway);
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
    announce(&format!("listening on http://{addr}"));
    if let Some(admin) = admin {
        let admin_addr = admin.local_addr().map_err(|e| e.to_string())?;
        announce(&format!("admin on http://{admin_addr}"));
        tokio::spawn(serve_admin(admin, gateway.clone(), metrics));
    }
    info!(%addr, upstream = %gateway.config.upstream, service = %gateway.config.service,
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
                let connection = builder.serve_connection(TokioIo::new(stream), service).into_owned();
                let connection = graceful.watch(connection);
                tokio::spawn(async move {
                    if let Err(error) = connection.await {
                        debug!(%peer, %error, "connection ended with an error");
                    }
                });
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    info!("shutting down: finishing the requests in flight");
    tokio::select! {
        () = graceful.shutdown() => info!("every connection closed"),
        () = tokio::time::sleep(gateway.config.shutdown_timeout) => {
            warn!("the shutdown timeout passed with requests still in flight");
        }
    }
    Ok(())
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
