//! The `idempotency-service` binary: parse the configuration, start logging,
//! then serve until SIGTERM or SIGINT, or apply the migrations and exit.

use clap::Parser;
use idempotency_service::config::{Cli, Command};
use idempotency_service::{server, store::AnyStore, telemetry};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    telemetry::init(cli.config.log_format);
    match cli.command.unwrap_or(Command::Serve) {
        Command::Serve => {
            let listener = tokio::net::TcpListener::bind(cli.config.listen_addr).await?;
            server::run(cli.config, listener, shutdown_signal()).await
        }
        Command::Migrate => {
            AnyStore::open(&cli.config.store_options(), true).await?;
            tracing::info!("migrations applied");
            Ok(())
        }
    }
}

/// Resolves on the first SIGTERM (Kubernetes, systemd) or SIGINT (Ctrl-C).
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .expect("installing the SIGTERM handler");
        tokio::select! {
            _ = interrupt => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
}
