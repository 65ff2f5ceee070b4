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
            // Handlers first: a SIGTERM that arrives while the store opens
            // must drain, not kill.
            let shutdown = shutdown_signal()?;
            let listener = tokio::net::TcpListener::bind(config.listen_addr).await?;
            server::run(config, listener, shutdown).await
        }
        Command::Migrate => {
            AnyStore::open(&config.store_options()?, true).await?;
            tracing::info!("migrations applied");
            Ok(())
        }
        Command::Token { hash } => {
            print!("{}", admin::token(hash)?);
            Ok(())
        }
        command => match AnyStore::open(&config.store_options()?, false).await? {
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
        Command::Serve | Command::Migrate | Command::Token { .. } => {
            unreachable!("handled by run")
        }
    };
    store.close().await;
    print!("{}", output?);
    Ok(())
}

/// Installs the handlers now, and resolves on the first SIGTERM (Kubernetes,
/// systemd) or SIGINT (Ctrl-C).
fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
    })
}
