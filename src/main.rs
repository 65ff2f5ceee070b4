//! The `idempotency-service` binary: parse the configuration, start logging
//! (and metrics), then serve until SIGTERM or SIGINT; or run one of the
//! operator's commands (`migrate`, `get`, `purge`, `stats`) and exit.

use clap::Parser;
use idempotency_service::config::{Cli, Command, Config};
use idempotency_service::lifecycle::Lifecycle;
use idempotency_service::store::{AnyStore, Store};
use idempotency_service::{admin, metrics, server, telemetry};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let target = match cli.command {
        None | Some(Command::Serve) => telemetry::LogTarget::Stdout,
        Some(_) => telemetry::LogTarget::Stderr,
    };
    let telemetry = telemetry::init(cli.config.log_format, target)?;
    let result = run(cli).await;
    telemetry.shutdown();
    result
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let config = cli.config;
    match cli.command.unwrap_or(Command::Serve) {
        Command::Serve => {
            config.validate()?;
            if let Some(addr) = config.metrics_addr()? {
                metrics::install(addr)?;
            }
            let listener = tokio::net::TcpListener::bind(config.listen_addr).await?;
            server::run(config, listener, shutdown_signal()).await
        }
        Command::Migrate => {
            AnyStore::open(&config.store_options(), true).await?;
            tracing::info!("migrations applied");
            Ok(())
        }
        command => match AnyStore::open(&config.store_options(), false).await? {
            AnyStore::Postgres(store) => operate(store, &config, command).await,
            AnyStore::Sqlite(store) => operate(store, &config, command).await,
        },
    }
}

/// The operator's commands, printed to stdout.
async fn operate<S: Store>(store: S, config: &Config, command: Command) -> anyhow::Result<()> {
    let lifecycle = Lifecycle::new(store.clone(), config.limits());
    let output = match command {
        Command::Get { namespace, key } => admin::get(&lifecycle, namespace, key).await,
        Command::Purge {
            namespace,
            key,
            reason,
        } => admin::purge(&lifecycle, namespace, key, &reason).await,
        Command::Stats => admin::stats(&store).await,
        Command::Serve | Command::Migrate => unreachable!("handled by run"),
    };
    store.close().await;
    print!("{}", output?);
    Ok(())
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
