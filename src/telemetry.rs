//! Logs and traces. Logs go to stdout, text or JSON, filtered by RUST_LOG
//! (default `info`). Traces are off unless `OTEL_EXPORTER_OTLP_ENDPOINT` is
//! set: then spans (one per call, one per database statement) are exported
//! over OTLP/gRPC, and incoming W3C trace context (`traceparent`) becomes the
//! parent of each call's span.

use std::io::IsTerminal;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Level;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::config::LogFormat;

/// Keeps the trace exporter alive; `shutdown` flushes what is buffered.
pub struct Telemetry {
    tracer_provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    pub fn shutdown(self) {
        if let Some(provider) = self.tracer_provider
            && let Err(error) = provider.shutdown()
        {
            eprintln!("flushing traces failed: {error}");
        }
    }
}

/// Whether the standard OpenTelemetry variable asks for trace export.
fn otlp_requested() -> bool {
    std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").is_ok_and(|v| !v.trim().is_empty())
        || std::env::var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_ok_and(|v| !v.trim().is_empty())
}

/// Where log lines go: the server logs to stdout; the operator's commands log
/// to stderr, so that their stdout is only their answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogTarget {
    Stdout,
    Stderr,
}

/// Installs the global subscriber (and the OTLP exporter when asked for).
/// Call once, from main, inside the Tokio runtime.
pub fn init(format: LogFormat, target: LogTarget) -> anyhow::Result<Telemetry> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = match (format, target) {
        (LogFormat::Text, LogTarget::Stdout) => tracing_subscriber::fmt::layer()
            .with_ansi(std::io::stdout().is_terminal())
            .boxed(),
        (LogFormat::Text, LogTarget::Stderr) => tracing_subscriber::fmt::layer()
            .with_ansi(std::io::stderr().is_terminal())
            .with_writer(std::io::stderr)
            .boxed(),
        (LogFormat::Json, LogTarget::Stdout) => tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .boxed(),
        (LogFormat::Json, LogTarget::Stderr) => tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_writer(std::io::stderr)
            .boxed(),
    };
    let tracer_provider = if otlp_requested() {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()?;
        Some(
            SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(
                    opentelemetry_sdk::Resource::builder()
                        .with_service_name("idempotency-service")
                        .build(),
                )
                .build(),
        )
    } else {
        None
    };
    let traces = tracer_provider.as_ref().map(|provider| {
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        // Only this crate's spans (calls, statements), not the HTTP/2
        // internals. The spans are at DEBUG so that, with traces off, the
        // log filter (INFO by default) skips creating them at all: with the
        // per-call log line they made up the 15% of throughput that INFO
        // logging cost at 64 callers (docs/benchmarks.md).
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("idempotency-service"))
            .with_filter(Targets::new().with_target("idempotency_service", Level::DEBUG))
    });
    tracing_subscriber::registry()
        .with(logs.with_filter(filter))
        .with(traces)
        .try_init()?;
    if tracer_provider.is_some() {
        tracing::info!("exporting traces over OTLP");
    }
    Ok(Telemetry { tracer_provider })
}
