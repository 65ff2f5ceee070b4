//! Logging: tracing to stdout, text or JSON, filtered by RUST_LOG (default
//! `info`).

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// Installs the global subscriber. Call once, from main.
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stdout().is_terminal()).init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}
