//! Logs and traces: the process-wide tracing subscriber (text or JSON logs, plus an
//! OpenTelemetry exporter when the standard `OTEL_*` variables ask for one), W3C trace
//! context propagation, and the tower layer that gives every RPC a span and metrics.

use std::{
    pin::Pin,
    sync::atomic::{AtomicBool, Ordering},
    task::{Context, Poll},
    time::Instant,
};

use opentelemetry::{
    propagation::{Extractor, TextMapPropagator},
    trace::{TraceContextExt, TracerProvider as _},
};
use opentelemetry_sdk::{Resource, propagation::TraceContextPropagator, trace::SdkTracerProvider};
use tracing::{Instrument, Span};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::{EnvFilter, Layer, layer::SubscriberExt, util::SubscriberInitExt};

use crate::config::LogFormat;

/// Set once spans are exported; per-delivery spans are only made then.
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// True when spans leave the process (an OTLP endpoint is configured).
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// The installed telemetry; flushes pending spans when shut down.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Installs the global subscriber. Spans are exported over OTLP/gRPC when
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set; the
    /// service is named by `OTEL_SERVICE_NAME`, else `outbox-gateway`. Must be called
    /// inside the Tokio runtime.
    pub fn init(format: LogFormat, level: &str) -> Result<Telemetry, String> {
        // The driver's own warnings (a failed ping, a server notice per dropped
        // connection) repeat what the gateway says once in its own words; they show
        // when the filter names sqlx.
        let directives = if level.contains("sqlx") {
            level.to_owned()
        } else {
            format!("{level},sqlx=error")
        };
        let filter =
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(directives));
        let logs = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
        let logs = match format {
            LogFormat::Text => logs.boxed(),
            LogFormat::Json => logs.json().flatten_event(true).boxed(),
        };
        let provider = otlp_provider()?;
        let traces = provider.as_ref().map(|provider| {
            tracing_opentelemetry::layer().with_tracer(provider.tracer("outbox-gateway"))
        });
        tracing_subscriber::registry()
            .with(filter)
            .with(logs)
            .with(traces)
            .try_init()
            .map_err(|error| format!("cannot install logging: {error}"))?;
        if provider.is_some() {
            opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
            EXPORTING.store(true, Ordering::Relaxed);
        }
        Ok(Telemetry { provider })
    }

    /// Flushes spans still buffered.
    pub fn shutdown(self) {
        if let Some(provider) = self.provider
            && let Err(error) = provider.shutdown()
        {
            eprintln!("outbox-gateway: could not flush traces: {error}");
        }
    }
}

fn otlp_provider() -> Result<Option<SdkTracerProvider>, String> {
    let configured = [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|name| std::env::var_os(name).is_some_and(|value| !value.is_empty()));
    if !configured {
        return Ok(None);
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()
        .map_err(|error| format!("cannot set up the OTLP exporter: {error}"))?;
    let mut resource = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("outbox-gateway");
    }
    Ok(Some(
        SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource.build())
            .build(),
    ))
}

/// W3C `traceparent` / `tracestate` values as they travel with a call or an event.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceHeaders {
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
}

impl TraceHeaders {
    /// The trace headers of a request, when the traceparent is well-formed.
    pub fn from_headers(headers: &http::HeaderMap) -> TraceHeaders {
        Self::from_lookup(|name| headers.get(name).and_then(|value| value.to_str().ok()))
    }

    /// The same from gRPC request metadata.
    pub fn from_metadata(metadata: &tonic::metadata::MetadataMap) -> TraceHeaders {
        Self::from_lookup(|name| metadata.get(name).and_then(|value| value.to_str().ok()))
    }

    fn from_lookup<'a>(lookup: impl Fn(&str) -> Option<&'a str>) -> TraceHeaders {
        let value = |name: &str| lookup(name).map(str::to_owned);
        match value("traceparent").filter(|traceparent| is_traceparent(traceparent)) {
            Some(traceparent) => TraceHeaders {
                traceparent: Some(traceparent),
                tracestate: value("tracestate"),
            },
            None => TraceHeaders::default(),
        }
    }
}

/// `version-traceid-spanid-flags`, lowercase hex, the all-zero ids refused.
pub fn is_traceparent(value: &str) -> bool {
    let parts: Vec<&str> = value.split('-').collect();
    let hex = |part: &str, len: usize| {
        part.len() == len
            && part
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    parts.len() == 4
        && hex(parts[0], 2)
        && parts[0] != "ff"
        && hex(parts[1], 32)
        && parts[1].bytes().any(|b| b != b'0')
        && hex(parts[2], 16)
        && parts[2].bytes().any(|b| b != b'0')
        && hex(parts[3], 2)
}

struct MapExtractor<'a>(&'a dyn Fn(&str) -> Option<&'a str>);

impl Extractor for MapExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        (self.0)(key)
    }

    fn keys(&self) -> Vec<&str> {
        vec!["traceparent", "tracestate"]
    }
}

fn remote_context(traceparent: &str, tracestate: Option<&str>) -> opentelemetry::Context {
    let lookup = move |key: &str| match key {
        "traceparent" => Some(traceparent),
        "tracestate" => tracestate,
        _ => None,
    };
    TraceContextPropagator::new().extract(&MapExtractor(&lookup))
}

/// Links `span` to the producer context an event carries in its metadata.
pub fn link_to_producer(span: &Span, metadata: &std::collections::BTreeMap<String, String>) {
    if let Some(traceparent) = metadata.get("traceparent").filter(|t| is_traceparent(t)) {
        let context = remote_context(traceparent, metadata.get("tracestate").map(String::as_str));
        let span_context = context.span().span_context().clone();
        if span_context.is_valid() {
            span.add_link(span_context);
        }
    }
}

/// Tower layer that wraps every RPC in a span (method, gRPC status code, duration; the
/// parent taken from the caller's `traceparent`) and records its metrics.
#[derive(Debug, Clone, Copy, Default)]
pub struct RpcLayer;

impl<S> tower::Layer<S> for RpcLayer {
    type Service = RpcService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RpcService { inner }
    }
}

#[derive(Debug, Clone)]
pub struct RpcService<S> {
    inner: S,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, RequestBody, ResponseBody> tower::Service<http::Request<RequestBody>> for RpcService<S>
where
    S: tower::Service<http::Request<RequestBody>, Response = http::Response<ResponseBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    RequestBody: Send + 'static,
{
    type Response = http::Response<RecordedBody<ResponseBody>>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<RequestBody>) -> Self::Future {
        // The clone that was driven to readiness serves this call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let method = request.uri().path().to_owned();
        let span = tracing::info_span!(
            "rpc",
            otel.name = %method.trim_start_matches('/'),
            otel.kind = "server",
            rpc.method = %method,
            rpc.grpc.status_code = tracing::field::Empty,
            duration_ms = tracing::field::Empty,
        );
        if exporting() {
            let headers = TraceHeaders::from_headers(request.headers());
            if let Some(traceparent) = &headers.traceparent {
                let _ = span.set_parent(remote_context(traceparent, headers.tracestate.as_deref()));
            }
        }
        let started = Instant::now();
        let call = inner.call(request);
        Box::pin(
            async move {
                let outcome = RpcOutcome {
                    method,
                    started,
                    span: Span::current(),
                };
                match call.await {
                    Ok(response) => {
                        // An error answered at once carries grpc-status in the headers
                        // (trailers-only); otherwise the status comes in the trailers at
                        // the end of the body, which for a stream can be hours later.
                        match grpc_status(response.headers()) {
                            Some(code) => {
                                outcome.finish(code);
                                Ok(response.map(|inner| RecordedBody {
                                    inner,
                                    outcome: None,
                                }))
                            }
                            None => Ok(response.map(|inner| RecordedBody {
                                inner,
                                outcome: Some(outcome),
                            })),
                        }
                    }
                    Err(error) => {
                        outcome.finish(tonic::Code::Unknown);
                        Err(error)
                    }
                }
            }
            .instrument(span),
        )
    }
}

/// The `grpc-status` of a header or trailer map, when it has one.
fn grpc_status(headers: &http::HeaderMap) -> Option<tonic::Code> {
    headers
        .get("grpc-status")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<i32>().ok())
        .map(tonic::Code::from_i32)
}

/// What is recorded when an RPC ends: its span gets the status and duration, and the
/// RPC metrics count it.
struct RpcOutcome {
    method: String,
    started: Instant,
    /// Kept open until the answer ends, so a stream's span covers the whole stream.
    span: Span,
}

impl RpcOutcome {
    fn finish(self, code: tonic::Code) {
        let elapsed = self.started.elapsed();
        self.span.record("rpc.grpc.status_code", code as i32);
        self.span.record("duration_ms", elapsed.as_secs_f64() * 1e3);
        crate::metrics::rpc_finished(&self.method, code, elapsed);
        self.span
            .in_scope(|| tracing::debug!(code = ?code, "rpc finished"));
    }
}

pin_project_lite::pin_project! {
    /// A response body that records the RPC's outcome from its trailers; a body dropped
    /// before its trailers (the client went away) records CANCELLED.
    pub struct RecordedBody<B> {
        #[pin]
        inner: B,
        outcome: Option<RpcOutcome>,
    }

    impl<B> PinnedDrop for RecordedBody<B> {
        fn drop(this: Pin<&mut Self>) {
            if let Some(outcome) = this.project().outcome.take() {
                outcome.finish(tonic::Code::Cancelled);
            }
        }
    }
}

impl<B: http_body::Body> http_body::Body for RecordedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let frame = std::task::ready!(this.inner.poll_frame(cx));
        let code = match &frame {
            Some(Ok(frame)) => frame
                .trailers_ref()
                .map(|trailers| grpc_status(trailers).unwrap_or(tonic::Code::Unknown)),
            Some(Err(_)) => Some(tonic::Code::Unknown),
            // Ended without trailers: not a proper gRPC answer.
            None => Some(tonic::Code::Unknown),
        };
        if let Some(code) = code
            && let Some(outcome) = this.outcome.take()
        {
            outcome.finish(code);
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_only_well_formed_traceparents() {
        assert!(is_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        ));
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(!is_traceparent(bad), "{bad:?}");
        }
    }
}
