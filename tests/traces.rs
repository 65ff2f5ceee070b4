//! Traces: a span per call and per database statement, the call's span a
//! child of the caller's W3C trace context. Exported to an in-process
//! exporter; the binary exports the same spans over OTLP.

mod common;

use common::{Backend, TestServer, claim_request};
use opentelemetry::trace::{SpanKind, TraceId, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use tracing_subscriber::layer::SubscriberExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_makes_a_server_span_under_the_callers_trace_with_a_span_per_statement() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    tracing::subscriber::set_global_default(subscriber).unwrap();

    let (_store, server) = TestServer::fresh(Backend::Sqlite).await;
    let mut client = server.client.clone();
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller_span = "00f067aa0ba902b7";
    let mut request = tonic::Request::new(claim_request("ns", "k"));
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{trace_id}-{caller_span}-01").parse().unwrap(),
    );
    client.claim(request).await.unwrap();

    // The server closes the call's span as it answers; wait for the export.
    let spans = common::eventually(std::time::Duration::from_secs(10), || async {
        provider.force_flush().unwrap();
        let spans = exporter.get_finished_spans().unwrap();
        spans.iter().any(|s| s.name == "Claim").then_some(spans)
    })
    .await
    .unwrap_or_else(|| exporter.get_finished_spans().unwrap());
    let call = spans.iter().find(|s| s.name == "Claim").unwrap_or_else(|| {
        panic!(
            "no Claim span in {:?}",
            spans.iter().map(|s| &s.name).collect::<Vec<_>>()
        )
    });
    assert_eq!(
        call.span_context.trace_id(),
        TraceId::from_hex(trace_id).unwrap()
    );
    assert_eq!(call.parent_span_id.to_string(), caller_span);
    assert_eq!(call.span_kind, SpanKind::Server);
    let statements: Vec<_> = spans
        .iter()
        .filter(|s| s.parent_span_id == call.span_context.span_id())
        .map(|s| s.name.to_string())
        .collect();
    assert_eq!(
        statements,
        ["fetch", "try_claim"],
        "one span per statement of a fresh claim"
    );
}
