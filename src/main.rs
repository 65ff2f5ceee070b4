//! The `idempotency-service` binary: parse the configuration, start logging
//! (and metrics), then serve until SIGTERM or SIGINT; or run one of the
//! operator's commands (`migrate`, `get`, `purge`, `stats`) and exit.
//!
//! A failure (a port in use, a database that cannot be reached, a file that
//! does not load) ends the process with exit code 1 and one line on stderr,
//! whatever the log format, naming the setting to change.

use std::process::ExitCode;

use idempotency_service::config::{Cli, Command, Config};
use idempotency_service::lifecycle::Lifecycle;
use idempotency_service::store::{AnyStore, Open, Operations, Store};
use idempotency_service::{admin, listen, metrics, server, telemetry};

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse_noting_defaults();
    let target = match cli.command {
        None | Some(Command::Serve) => telemetry::LogTarget::Stdout,
        Some(_) => telemetry::LogTarget::Stderr,
    };
    let telemetry = match telemetry::init(cli.config.log_format, target) {
        Ok(telemetry) => telemetry,
        Err(error) => return fail(&error),
    };
    let result = run(cli).await;
    telemetry.shutdown();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => fail(&error),
    }
}

/// Prints the error and its causes as one line on stderr.
fn fail(error: &anyhow::Error) -> ExitCode {
    eprintln!("error: {}", one_line(error));
    ExitCode::FAILURE
}

/// The error's chain joined with ": ", any line breaks inside a message
/// (a parser quoting the input, say) folded into single spaces.
fn one_line(error: &anyhow::Error) -> String {
    format!("{error:#}")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let config = cli.config;
    match cli.command.unwrap_or(Command::Serve) {
        Command::Serve => {
            config.validate()?;
            // The ports first, so that one in use stops the start at once;
            // the health-only port is bound by server::run, before the store.
            let listener = listen::GRPC.bind(config.listen_addr)?;
            if let Some(addr) = config.metrics_addr()? {
                metrics::install(addr, config.metrics_addr_is_default)?;
            }
            // Handlers before the store: a SIGTERM that arrives while the
            // store opens must drain, not kill.
            let shutdown = shutdown_signal()?;
            server::run(config, listener, shutdown).await
        }
        Command::Migrate => {
            AnyStore::open(&config.store_options()?, Open::Migrate).await?;
            tracing::info!("migrations applied");
            Ok(())
        }
        Command::Token { hash } => {
            print!("{}", admin::token(hash)?);
            Ok(())
        }
        command => match AnyStore::open(&config.store_options()?, Open::Connect).await? {
            AnyStore::Postgres(store) => operate(store, &config, command).await,
            AnyStore::Sqlite(store) => operate(store, &config, command).await,
        },
    }
}

/// The operator's commands, printed to stdout.
async fn operate<S: Store + Operations>(
    store: S,
    config: &Config,
    command: Command,
) -> anyhow::Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_and_its_causes_are_one_line() {
        let error = anyhow::anyhow!("TOML parse error at line 1\n  |\n1 | x =\n  |    ^\n")
            .context("IDEMPOTENCY_POLICY_FILE=p.toml");
        assert_eq!(
            one_line(&error),
            "IDEMPOTENCY_POLICY_FILE=p.toml: TOML parse error at line 1 | 1 | x = | ^"
        );
    }
}
