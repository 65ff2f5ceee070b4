//! The `idempotency-gateway` binary: flags, logs, metrics, the config file,
//! then the server until SIGTERM or SIGINT.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use idempotency_gateway::config::Config;
use idempotency_gateway::flow::Gateway;
use tracing_subscriber::EnvFilter;

/// An HTTP reverse proxy that makes an API honour the Idempotency-Key
/// header, with idempotency-service as its store.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// The routes, the upstream and the service (TOML).
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_CONFIG")]
    config: PathBuf,
    /// `text` or `json`; the filter is RUST_LOG (default `info`).
    #[arg(long, env = "IDEMPOTENCY_LOG_FORMAT", default_value = "text")]
    log_format: String,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if args.log_format == "json" {
        logs.json().init();
    } else {
        logs.with_ansi(false).init();
    }
    let config = match Config::load(&args.config) {
        Ok(config) => config,
        Err(error) => {
            eprintln!("idempotency-gateway: {error}");
            return ExitCode::FAILURE;
        }
    };
    if config.identity.is_none() {
        tracing::warn!(
            "no [identity] header is configured: every caller shares one namespace per route"
        );
    }
    let metrics = if config.admin_listen.is_some() {
        match metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder() {
            Ok(handle) => Some(handle),
            Err(error) => {
                eprintln!("idempotency-gateway: metrics: {error}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        None
    };
    let gateway = match Gateway::new(config) {
        Ok(gateway) => gateway,
        Err(error) => {
            eprintln!("idempotency-gateway: {error}");
            return ExitCode::FAILURE;
        }
    };
    match idempotency_gateway::server::run(gateway, metrics, shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("idempotency-gateway: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn shutdown_signal() {
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
}
