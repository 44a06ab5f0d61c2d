//! Logs and traces: the process-wide tracing subscriber (text or JSON logs, plus an
//! OpenTelemetry exporter when the standard `OTEL_*` variables ask for one, over OTLP/gRPC
//! or OTLP/HTTP), W3C trace context propagation, and the tower layer that gives every RPC
//! a span and metrics. Span attributes follow the OpenTelemetry semantic conventions for
//! RPC and messaging.

use std::{
    io::IsTerminal,
    pin::Pin,
    sync::Mutex,
    task::{Context, Poll},
    time::{Duration, Instant},
};

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::{
    Resource, error::OTelSdkResult, propagation::TraceContextPropagator, trace::SdkTracerProvider,
};
use tracing::{Instrument, Span};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::{
    EnvFilter, Layer,
    fmt::{
        FmtContext, FormatEvent, FormatFields,
        format::{Format, Writer},
        time::{FormatTime, SystemTime},
    },
    layer::SubscriberExt,
    registry::LookupSpan,
    util::SubscriberInitExt,
};

pub use crate::trace_context::exporting;
use crate::trace_context::{self, TraceHeaders, remote_context};

use serde::Deserialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
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
        // The drivers' own messages (sqlx: a failed ping, a server notice per dropped
        // connection; async-nats: every failed reconnect attempt) repeat what the
        // gateway says once in its own words; they show when the filter names them.
        let mut directives = level.to_owned();
        for (driver, quiet) in [("sqlx", "sqlx=error"), ("async_nats", "async_nats=warn")] {
            if !level.contains(driver) {
                directives.push(',');
                directives.push_str(quiet);
            }
        }
        let filter =
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(directives));
        // Colours only for a person at a terminal: escape codes in a file or a log
        // collector are noise. `NO_COLOR` turns them off there too.
        let colours = std::io::stderr().is_terminal()
            && std::env::var_os("NO_COLOR").is_none_or(|value| value.is_empty());
        let logs = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(colours);
        let logs = match format {
            LogFormat::Text => logs.event_format(TextFormat::default()).boxed(),
            LogFormat::Json => logs.json().flatten_event(true).boxed(),
        };
        let destination = TraceDestination::from_env(|name| std::env::var(name).ok())?;
        let provider = destination.as_ref().map(otlp_provider).transpose()?;
        // Thread ids and busy/idle times say nothing about the gateway's work (its tasks
        // move between threads), and are not conventional attributes.
        let traces = provider.as_ref().map(|provider| {
            tracing_opentelemetry::layer()
                .with_tracer(provider.tracer("outbox-gateway"))
                .with_threads(false)
                .with_tracked_inactivity(false)
        });
        tracing_subscriber::registry()
            .with(filter)
            .with(logs)
            .with(traces)
            .try_init()
            .map_err(|error| format!("cannot install logging: {error}"))?;
        if let Some(destination) = &destination {
            tracing::info!(
                endpoint = %destination.endpoint,
                protocol = destination.protocol.as_str(),
                "exporting traces"
            );
            opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
            trace_context::set_exporting();
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

/// Text log lines: tracing's default format, except for audit lines, which leave out
/// the spans they were logged in. An audit line is read on its own, by a person looking
/// for who changed what; behind the request's span prefix (some 200 characters of RPC
/// attributes) its message came last. What those spans say, the RPC method and the
/// subscription, the audit line says itself; JSON logs keep the spans.
#[derive(Default)]
struct TextFormat {
    default: Format,
}

impl<S, N> FormatEvent<S, N> for TextFormat
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        context: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let metadata = event.metadata();
        if metadata.target() != outbox_core::audit::TARGET {
            return self.default.format_event(context, writer, event);
        }
        // The default format's timestamp, level and target, without the spans.
        SystemTime.format_time(&mut writer)?;
        write!(
            writer,
            " {:>5} {}: ",
            metadata.level().as_str(),
            metadata.target()
        )?;
        context.format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

/// How spans leave the process: `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, else
/// `OTEL_EXPORTER_OTLP_PROTOCOL`, else `grpc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceProtocol {
    Grpc,
    HttpProtobuf,
}

impl TraceProtocol {
    pub fn as_str(self) -> &'static str {
        match self {
            TraceProtocol::Grpc => "grpc",
            TraceProtocol::HttpProtobuf => "http/protobuf",
        }
    }
}

/// Where and how spans are exported, as the standard variables say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceDestination {
    pub protocol: TraceProtocol,
    /// The full URL spans are sent to.
    pub endpoint: String,
}

impl TraceDestination {
    /// Spans are exported when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` is set (and neither `OTEL_SDK_DISABLED=true` nor
    /// `OTEL_TRACES_EXPORTER=none` says otherwise). The traces endpoint is used as it is;
    /// the general one gets `/v1/traces` appended over HTTP, as the OTLP exporter
    /// specification says. An unknown protocol is an error naming its variable.
    pub fn from_env(
        variable: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<TraceDestination>, String> {
        let set = |name: &str| variable(name).filter(|value| !value.trim().is_empty());
        if set("OTEL_SDK_DISABLED").is_some_and(|value| value.trim().eq_ignore_ascii_case("true"))
            || set("OTEL_TRACES_EXPORTER")
                .is_some_and(|value| value.trim().eq_ignore_ascii_case("none"))
        {
            return Ok(None);
        }
        let protocol = match [
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ]
        .into_iter()
        .find_map(|name| set(name).map(|value| (name, value)))
        {
            None => TraceProtocol::Grpc,
            Some((name, value)) => match value.trim() {
                "grpc" => TraceProtocol::Grpc,
                "http/protobuf" => TraceProtocol::HttpProtobuf,
                other => {
                    return Err(format!(
                        "{name}: {other:?} is not a trace protocol of this gateway; use grpc or http/protobuf"
                    ));
                }
            },
        };
        let endpoint = match (
            set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
            set("OTEL_EXPORTER_OTLP_ENDPOINT"),
        ) {
            (Some(traces), _) => traces.trim().to_owned(),
            (None, Some(base)) => match protocol {
                TraceProtocol::Grpc => base.trim().to_owned(),
                TraceProtocol::HttpProtobuf => {
                    format!("{}/v1/traces", base.trim().trim_end_matches('/'))
                }
            },
            (None, None) => return Ok(None),
        };
        Ok(Some(TraceDestination { protocol, endpoint }))
    }
}

fn otlp_provider(destination: &TraceDestination) -> Result<SdkTracerProvider, String> {
    use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
    let builder = opentelemetry_otlp::SpanExporter::builder();
    let exporter = match destination.protocol {
        TraceProtocol::Grpc => builder
            .with_tonic()
            .with_endpoint(destination.endpoint.clone())
            .build(),
        TraceProtocol::HttpProtobuf => builder
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(destination.endpoint.clone())
            .with_http_client(otlp_http::Client::new(export_timeout())?)
            .build(),
    }
    .map_err(|error| format!("cannot set up the OTLP exporter: {error}"))?;
    let mut resource = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("outbox-gateway");
    }
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(ReportingExporter::new(exporter, &destination.endpoint))
        .with_resource(resource.build())
        .build())
}

/// `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`, else `OTEL_EXPORTER_OTLP_TIMEOUT`, in
/// milliseconds; 10 s by default. The HTTP client enforces it.
fn export_timeout() -> Duration {
    [
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
        "OTEL_EXPORTER_OTLP_TIMEOUT",
    ]
    .iter()
    .find_map(|name| std::env::var(name).ok()?.trim().parse::<u64>().ok())
    .map_or(Duration::from_secs(10), Duration::from_millis)
}

/// How often a failing export is reported at most.
const EXPORT_WARNING_INTERVAL: Duration = Duration::from_secs(300);

/// The OTLP exporter, saying when exports fail — once, then at most every
/// [`EXPORT_WARNING_INTERVAL`] while they go on failing — and when they work again.
/// Without it a wrong endpoint or a collector that is down goes unnoticed.
#[derive(Debug)]
struct ReportingExporter {
    inner: opentelemetry_otlp::SpanExporter,
    endpoint: String,
    health: Mutex<ExportHealth>,
}

#[derive(Debug, Default)]
struct ExportHealth {
    /// Batches that failed since the last success.
    failed_batches: u64,
    last_warning: Option<Instant>,
}

impl ReportingExporter {
    fn new(inner: opentelemetry_otlp::SpanExporter, endpoint: &str) -> ReportingExporter {
        ReportingExporter {
            inner,
            endpoint: endpoint.to_owned(),
            health: Mutex::new(ExportHealth::default()),
        }
    }
}

impl opentelemetry_sdk::trace::SpanExporter for ReportingExporter {
    async fn export(&self, batch: Vec<opentelemetry_sdk::trace::SpanData>) -> OTelSdkResult {
        let spans = batch.len();
        let result = self.inner.export(batch).await;
        let mut health = self
            .health
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match &result {
            Ok(()) if health.failed_batches > 0 => {
                tracing::info!(
                    endpoint = %self.endpoint,
                    failed_batches = health.failed_batches,
                    "exporting traces again"
                );
                *health = ExportHealth::default();
            }
            Ok(()) => {}
            Err(error) => {
                health.failed_batches += 1;
                if health
                    .last_warning
                    .is_none_or(|at| at.elapsed() >= EXPORT_WARNING_INTERVAL)
                {
                    health.last_warning = Some(Instant::now());
                    tracing::warn!(
                        endpoint = %self.endpoint,
                        %error,
                        spans,
                        failed_batches = health.failed_batches,
                        "cannot export traces; their spans are dropped (said again at most every 5 minutes while it lasts)"
                    );
                }
            }
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The HTTP client of OTLP/HTTP export: the hyper and rustls (ring) stack the rest of
/// the gateway uses, with the public web roots. The batch processor exports from a
/// thread of its own, outside the Tokio runtime, so each request runs as a task on the
/// runtime the telemetry was set up in.
mod otlp_http {
    use std::time::Duration;

    use bytes::Bytes;
    use http_body_util::{BodyExt, Full, Limited};
    use hyper_rustls::HttpsConnector;
    use hyper_util::{
        client::legacy::{Client as HyperClient, connect::HttpConnector},
        rt::TokioExecutor,
    };
    use opentelemetry_http::{HttpClient, HttpError, Request, Response};

    /// Largest collector answer read.
    const MAX_ANSWER_BYTES: usize = 4 * 1024 * 1024;

    #[derive(Debug)]
    pub struct Client {
        http: HyperClient<HttpsConnector<HttpConnector>, Full<Bytes>>,
        runtime: tokio::runtime::Handle,
        timeout: Duration,
    }

    impl Client {
        /// Must be called inside the Tokio runtime.
        pub fn new(timeout: Duration) -> Result<Client, String> {
            let runtime = tokio::runtime::Handle::try_current()
                .map_err(|error| format!("cannot set up the OTLP/HTTP exporter: {error}"))?;
            let roots = rustls::RootCertStore {
                roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
            };
            let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
            let tls = rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|error| format!("cannot set up TLS for the OTLP/HTTP exporter: {error}"))?
                .with_root_certificates(roots)
                .with_no_client_auth();
            let https = hyper_rustls::HttpsConnectorBuilder::new()
                .with_tls_config(tls)
                .https_or_http()
                .enable_http1()
                .build();
            Ok(Client {
                http: HyperClient::builder(TokioExecutor::new()).build(https),
                runtime,
                timeout,
            })
        }
    }

    #[tonic::async_trait]
    impl HttpClient for Client {
        async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
            let http = self.http.clone();
            let timeout = self.timeout;
            let exchange = async move {
                let response = http.request(request.map(Full::new)).await?;
                let (parts, body) = response.into_parts();
                let body = Limited::new(body, MAX_ANSWER_BYTES).collect().await?;
                Ok::<_, HttpError>(Response::from_parts(parts, body.to_bytes()))
            };
            // The timer, too, is made on the runtime: this thread has none.
            let exchange = async move { tokio::time::timeout(timeout, exchange).await };
            match self.runtime.spawn(exchange).await {
                Ok(Ok(answer)) => answer,
                Ok(Err(_)) => {
                    Err(format!("no answer within {}", humantime::format_duration(timeout)).into())
                }
                Err(error) => Err(Box::new(error)),
            }
        }
    }
}

/// The trace headers of gRPC request metadata.
pub fn trace_headers(metadata: &tonic::metadata::MetadataMap) -> TraceHeaders {
    TraceHeaders::from_lookup(|name| metadata.get(name).and_then(|value| value.to_str().ok()))
}

/// Tower layer that wraps every RPC in a span (`rpc.system`, `rpc.service`, `rpc.method`
/// and `rpc.grpc.status_code`, as the RPC conventions name them; the parent taken from
/// the caller's `traceparent`) and records its metrics.
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
        // `/package.Service/Method`, named `package.Service/Method` by the conventions.
        let full_name = method.trim_start_matches('/');
        let (service, method_name) = full_name.split_once('/').unwrap_or(("", full_name));
        let span = tracing::info_span!(
            "rpc",
            otel.name = %full_name,
            otel.kind = "server",
            rpc.system = "grpc",
            rpc.service = %service,
            rpc.method = %method_name,
            rpc.grpc.status_code = tracing::field::Empty,
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

/// What is recorded when an RPC ends: its span gets the status, and the RPC metrics
/// count it and its duration.
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
        crate::metrics_endpoint::rpc_finished(&self.method, code, elapsed);
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
mod destination_tests {
    use super::*;

    fn destination(variables: &[(&str, &str)]) -> Result<Option<TraceDestination>, String> {
        TraceDestination::from_env(|name| {
            variables
                .iter()
                .find(|(key, _)| *key == name)
                .map(|(_, value)| (*value).to_owned())
        })
    }

    fn to(protocol: TraceProtocol, endpoint: &str) -> Result<Option<TraceDestination>, String> {
        Ok(Some(TraceDestination {
            protocol,
            endpoint: endpoint.to_owned(),
        }))
    }

    #[test]
    fn the_standard_variables_choose_protocol_and_endpoint() {
        assert_eq!(destination(&[]), Ok(None));
        assert_eq!(
            destination(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")]),
            Ok(None),
            "no endpoint, no export"
        );
        assert_eq!(
            destination(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")]),
            to(TraceProtocol::Grpc, "http://collector:4317")
        );
        assert_eq!(
            destination(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ]),
            to(
                TraceProtocol::HttpProtobuf,
                "http://collector:4318/v1/traces"
            )
        );
        assert_eq!(
            destination(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
                (
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                    "https://traces.example/ingest"
                ),
                ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
            ]),
            to(TraceProtocol::HttpProtobuf, "https://traces.example/ingest")
        );
        assert_eq!(
            destination(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317"),
                ("OTEL_TRACES_EXPORTER", "none"),
            ]),
            Ok(None)
        );
        assert_eq!(
            destination(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317"),
                ("OTEL_SDK_DISABLED", "true"),
            ]),
            Ok(None)
        );
    }

    #[test]
    fn an_unknown_protocol_names_its_variable() {
        let error = destination(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json"),
        ])
        .unwrap_err();
        assert!(
            error.starts_with("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: \"http/json\""),
            "{error}"
        );
    }
}
