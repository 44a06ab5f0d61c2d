//! Observability of a gateway running as its own process: Prometheus metrics after a
//! known scenario, OTLP traces from producer to consumer, JSON logs.

use std::{
    process::Stdio,
    sync::{Arc, Mutex},
    time::Duration,
};

use crate::common::*;
use opentelemetry_proto::tonic::{
    collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
        trace_service_server::{TraceService, TraceServiceServer},
    },
    trace::v1::Span,
};
use outbox_gateway::proto;
use outbox_testkit::gateway;
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, Command},
};
use tonic::transport::Channel;

/// Generous: a busy machine or a long transaction elsewhere in the cluster slows delivery.
const WAIT: Duration = Duration::from_secs(15);
/// For the per-subscription gauges: their refresh waits 20 times as long as it last took
/// (at least its 200 ms interval), so on a loaded machine a refresh that took a second,
/// as the first one on a cold pool can, puts the next one 20 s away.
const REFRESH_WAIT: Duration = Duration::from_secs(60);

fn free_port() -> u16 {
    gateway::free_loopback_address()
        .expect("a free loopback port")
        .port()
}

/// `outbox-gateway serve` as a child process, killed when dropped. It listens on port 0
/// and the test reads the ports it bound from its log, so gateways started side by side
/// never race for a port.
struct GatewayProcess {
    child: Child,
    endpoint: String,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl GatewayProcess {
    /// A gateway serving metrics on a port of its own, refreshed every 200 ms; returns
    /// it and the metrics server's base URL.
    async fn with_metrics(database: &TestDatabase) -> (GatewayProcess, String) {
        let mut gateway = GatewayProcess::start(
            database,
            &[
                "--metrics-listen",
                "127.0.0.1:0",
                "--metrics-refresh-interval",
                "200ms",
            ],
            &[],
        )
        .await;
        let metrics = gateway.announced("serving metrics").await;
        (gateway, format!("http://{metrics}"))
    }

    async fn start(
        database: &TestDatabase,
        args: &[&str],
        env: &[(&str, String)],
    ) -> GatewayProcess {
        Self::start_on(&database.url(), args, env).await
    }

    /// A gateway on the database at `database_url`.
    async fn start_on(database_url: &str, args: &[&str], env: &[(&str, String)]) -> GatewayProcess {
        let mut command = Command::new(env!("CARGO_BIN_EXE_outbox-gateway"));
        command.args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--database-url",
            database_url,
        ]);
        if !args.contains(&"--console-listen") {
            // Tests run gateways side by side; the console has tests of its own.
            command.args(["--console-listen", "off"]);
        }
        command
            .args(args)
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        for (name, value) in env {
            command.env(name, value);
        }
        let mut child = command.spawn().expect("start the gateway binary");
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let lines = stderr.clone();
        let mut reader = BufReader::new(child.stderr.take().unwrap()).lines();
        tokio::spawn(async move {
            while let Ok(Some(line)) = reader.next_line().await {
                lines.lock().unwrap().push(line);
            }
        });
        let mut gateway = GatewayProcess {
            child,
            endpoint: String::new(),
            stderr,
        };
        let address = gateway.announced("serving gRPC").await;
        gateway.endpoint = format!("http://{address}");
        gateway.wait_until_serving(address).await;
        gateway
    }

    /// The address the gateway's log says it serves `announcement` on; fails the test
    /// when the gateway exits or stays silent.
    async fn announced(&mut self, announcement: &str) -> std::net::SocketAddr {
        let stderr = &self.stderr;
        let child = &mut self.child;
        let announced = gateway::wait_for_announcement(
            announcement,
            WAIT,
            || stderr.lock().unwrap().join("\n"),
            || matches!(child.try_wait(), Ok(None)),
        )
        .await;
        announced.unwrap_or_else(|error| {
            panic!(
                "no {announcement:?} from the gateway: {error}; stderr: {:?}",
                self.stderr.lock().unwrap()
            )
        })
    }

    async fn channel(&self) -> Channel {
        Channel::from_shared(self.endpoint.clone())
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    async fn wait_until_serving(&mut self, address: std::net::SocketAddr) {
        let child = &mut self.child;
        let running = || matches!(child.try_wait(), Ok(None));
        if let Err(error) = gateway::wait_until_serving(address, WAIT, running).await {
            panic!("{error}; stderr: {:?}", self.stderr.lock().unwrap());
        }
    }

    /// SIGTERM, then wait for a clean exit (flushing traces).
    async fn stop(mut self) {
        send_signal(&self.child, "TERM");
        let exit = tokio::time::timeout(Duration::from_secs(15), self.child.wait())
            .await
            .expect("exits")
            .unwrap();
        assert!(exit.success(), "gateway exited with {exit}");
    }
}

async fn setup_scenario(channel: Channel, events: Vec<proto::EventInput>) -> Vec<proto::Delivery> {
    create_subscription_over(channel.clone(), subscription("orders")).await;
    let count = events.len();
    proto::publisher_client::PublisherClient::new(channel.clone())
        .publish(proto::PublishRequest {
            events,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut stream = proto::subscriber_client::SubscriberClient::new(channel)
        .subscribe(proto::SubscribeRequest {
            subscription: "orders".into(),
            max_in_flight: 0,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut deliveries = Vec::new();
    while deliveries.len() < count {
        let delivery = tokio::time::timeout(WAIT, stream.message())
            .await
            .expect("delivery in time")
            .unwrap()
            .unwrap();
        deliveries.push(delivery);
    }
    // Keep the stream open: leaving it would give the unsettled leases back.
    tokio::spawn(async move {
        let _keep = stream;
        tokio::time::sleep(Duration::from_secs(60)).await;
    });
    deliveries
}

/// Label names and values of a sample.
type Labels<'a> = &'a [(&'a str, &'a str)];

/// A scrape of the metrics endpoint.
struct Metrics(Vec<prometheus_parse::Sample>);

impl Metrics {
    /// Scrapes `url`; fails the test on anything but a 200 with valid exposition text.
    async fn scrape(url: &str) -> Metrics {
        let response = reqwest::get(url).await.expect("metrics endpoint reachable");
        assert_eq!(response.status(), reqwest::StatusCode::OK, "{url}");
        let text = response.text().await.expect("a metrics body");
        let scrape = prometheus_parse::Scrape::parse(text.lines().map(|line| Ok(line.to_owned())))
            .expect("Prometheus exposition format");
        Metrics(scrape.samples)
    }

    /// The value of the counter or gauge `metric` with these labels.
    fn value(&self, metric: &str, labels: Labels) -> Option<f64> {
        match self.find(metric, labels)?.value {
            prometheus_parse::Value::Counter(value)
            | prometheus_parse::Value::Gauge(value)
            | prometheus_parse::Value::Untyped(value) => Some(value),
            _ => None,
        }
    }

    /// The sample of `metric` with exactly these labels.
    fn find(&self, metric: &str, labels: Labels) -> Option<&prometheus_parse::Sample> {
        self.0.iter().find(|sample| {
            sample.metric == metric
                && sample.labels.len() == labels.len()
                && labels
                    .iter()
                    .all(|(name, value)| sample.labels.get(name) == Some(value))
        })
    }
}

#[tokio::test]
async fn metrics_match_a_known_scenario_exactly() {
    let database = TestDatabase::create().await;
    let (gateway, metrics_base) = GatewayProcess::with_metrics(&database).await;
    let channel = gateway.channel().await;
    // A direct writer's event that expired before anyone could read it.
    sqlx::query(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, \
             occurred_at, expires_at) \
         VALUES ('quote', 'q-1', 'quote.offered', '{}', now() - interval '1 hour', \
                 now() - interval '1 minute')",
    )
    .execute(&database.pool().await)
    .await
    .unwrap();
    let events = vec![
        event("o-1", "order.created"),
        event("o-2", "order.created"),
        event("o-3", "order.created"),
        event("o-4", "order.created"),
        event("o-5", "order.paid"),
    ];
    let deliveries = setup_scenario(channel.clone(), events).await;
    let mut subscriber = proto::subscriber_client::SubscriberClient::new(channel);
    let ack_ids = deliveries[..3].iter().map(|d| d.ack_id.clone()).collect();
    subscriber
        .ack(proto::AckRequest {
            subscription: "orders".into(),
            ack_ids,
        })
        .await
        .unwrap();
    subscriber
        .nack(proto::NackRequest {
            subscription: "orders".into(),
            ack_id: deliveries[3].ack_id.clone(),
            dead_letter: true,
            ..Default::default()
        })
        .await
        .unwrap();

    let url = format!("{metrics_base}/metrics");
    let orders = [("subscription", "orders"), ("source", "default")];
    let orders_only = [("subscription", "orders")];
    // The per-subscription gauges refresh every 200 ms, less often when a refresh is slow.
    eventually(
        "the gauges show the settled deliveries",
        REFRESH_WAIT,
        || async {
            let metrics = Metrics::scrape(&url).await;
            metrics.value("outbox_subscription_in_flight", &orders) == Some(1.0)
                && metrics.value("outbox_subscription_dead_letters", &orders) == Some(1.0)
        },
    )
    .await;
    let metrics = Metrics::scrape(&url).await;
    let publish = ("method", "/outbox.v1.Publisher/Publish");
    let expected: [(&str, Labels, f64); 15] = [
        (
            "outbox_events_published_total",
            &[("event_type", "order.created")],
            4.0,
        ),
        (
            "outbox_events_published_total",
            &[("event_type", "order.paid")],
            1.0,
        ),
        ("outbox_deliveries_total", &orders, 5.0),
        ("outbox_acks_total", &orders, 3.0),
        ("outbox_nacks_total", &orders, 1.0),
        ("outbox_dead_letters_total", &orders, 1.0),
        ("outbox_subscription_backlog", &orders, 0.0),
        ("outbox_subscription_in_flight", &orders, 1.0),
        ("outbox_subscription_awaiting_retry", &orders, 0.0),
        ("outbox_subscription_dead_letters", &orders, 1.0),
        ("outbox_events_stored", &[], 6.0),
        ("outbox_events_expired_total", &orders_only, 1.0),
        ("outbox_commit_to_delivery_seconds_count", &orders_only, 5.0),
        ("outbox_deliver_to_ack_seconds_count", &orders_only, 3.0),
        ("outbox_rpc_requests_total", &[publish, ("code", "Ok")], 1.0),
    ];
    for (metric, labels, value) in expected {
        assert_eq!(
            metrics.value(metric, labels),
            Some(value),
            "{metric}{labels:?}; scraped: {:#?}",
            metrics.0
        );
    }
    // How many claims ran depends on when the stream attached; each took some time.
    let claims = metrics.value("outbox_claim_duration_seconds_count", &orders);
    let claiming = metrics.value("outbox_claim_duration_seconds_sum", &orders);
    assert!(
        claims.is_some_and(|claims| claims >= 1.0)
            && claiming.is_some_and(|seconds| seconds > 0.0 && seconds < 60.0),
        "claims of orders timed: {claims:?} taking {claiming:?} s"
    );
    assert!(
        metrics
            .0
            .iter()
            .any(|sample| sample.metric == "outbox_rpc_duration_seconds"
                && sample.labels.get("method") == Some(publish.1)
                && matches!(sample.value, prometheus_parse::Value::Histogram(_))),
        "a latency histogram of Publish"
    );
    assert!(
        metrics
            .0
            .iter()
            .any(|sample| sample.metric == "outbox_db_pool_connections"
                && sample.labels.get("state") == Some("idle"))
    );
    assert!(
        metrics
            .0
            .iter()
            .any(|sample| sample.metric == "outbox_relay_wakeups_total"
                && sample.labels.get("cause") == Some("publish"))
    );
    let text = reqwest::get(&url).await.unwrap().text().await.unwrap();
    for line in text.lines().filter(|line| line.starts_with("# TYPE ")) {
        let name = line.split(' ').nth(2).unwrap();
        assert!(
            text.contains(&format!("# HELP {name} ")),
            "{name} has no # HELP line"
        );
    }
    let elsewhere = reqwest::get(format!("{metrics_base}/")).await.unwrap();
    assert_eq!(elsewhere.status(), reqwest::StatusCode::NOT_FOUND);
    gateway.stop().await;
}

#[tokio::test]
async fn a_stream_ending_in_an_error_is_counted_with_its_code() {
    let database = TestDatabase::create().await;
    let (gateway, metrics_base) = GatewayProcess::with_metrics(&database).await;
    let url = format!("{metrics_base}/metrics");
    let orders = [("subscription", "orders"), ("source", "default")];
    let channel = gateway.channel().await;
    let mut admin = proto::admin_client::AdminClient::new(channel.clone());
    admin
        .create_subscription(proto::CreateSubscriptionRequest {
            subscription: Some(subscription("orders")),
            validate_only: false,
        })
        .await
        .unwrap();
    let mut stream = proto::subscriber_client::SubscriberClient::new(channel)
        .subscribe(proto::SubscribeRequest {
            subscription: "orders".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    proto::publisher_client::PublisherClient::new(gateway.channel().await)
        .publish(proto::PublishRequest {
            events: vec![event("o-1", "order.created")],
            ..Default::default()
        })
        .await
        .unwrap();
    tokio::time::timeout(WAIT, stream.message())
        .await
        .expect("a delivery in time")
        .unwrap()
        .expect("a delivery");
    eventually("the subscription's series appear", REFRESH_WAIT, || async {
        let metrics = Metrics::scrape(&url).await;
        metrics
            .value("outbox_subscription_backlog", &orders)
            .is_some()
            && metrics.value("outbox_deliveries_total", &orders) == Some(1.0)
    })
    .await;
    admin
        .delete_subscription(proto::DeleteSubscriptionRequest {
            name: "orders".into(),
        })
        .await
        .unwrap();
    let end = tokio::time::timeout(WAIT, stream.message())
        .await
        .expect("the stream ends once its subscription is deleted")
        .expect_err("with an error");
    assert_eq!(end.code(), tonic::Code::NotFound);

    let subscribe = ("method", "/outbox.v1.Subscriber/Subscribe");
    eventually("the stream's final status is counted", WAIT, || async {
        Metrics::scrape(&url).await.value(
            "outbox_rpc_requests_total",
            &[subscribe, ("code", "NotFound")],
        ) == Some(1.0)
    })
    .await;
    let metrics = Metrics::scrape(&url).await;
    assert_eq!(
        metrics.value("outbox_rpc_requests_total", &[subscribe, ("code", "Ok")]),
        None,
        "the stream's opening headers are not an Ok answer"
    );
    eventually(
        "a deleted subscription's series go, counters too",
        WAIT,
        || async {
            let metrics = Metrics::scrape(&url).await;
            !metrics
                .0
                .iter()
                .any(|sample| sample.labels.get("subscription") == Some("orders"))
        },
    )
    .await;
    gateway.stop().await;
}

#[tokio::test]
async fn losing_the_database_is_one_line_and_its_return_another() {
    let database = TestDatabase::create().await;
    let proxy = crate::common::proxy::TcpProxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let gateway = GatewayProcess::start_on(
        &proxy.database_url(database.name()),
        &[
            "--metrics-listen",
            "off",
            "--health-check-interval",
            "200ms",
        ],
        &[],
    )
    .await;
    // Some traffic, so calls and claims fail too while the database is away.
    create_subscription_over(gateway.channel().await, subscription("orders")).await;
    let _stream = proto::subscriber_client::SubscriberClient::new(gateway.channel().await)
        .subscribe(proto::SubscribeRequest {
            subscription: "orders".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let logged = |needle: &str| {
        gateway
            .stderr
            .lock()
            .unwrap()
            .iter()
            .filter(|line| line.contains(needle))
            .count()
    };
    proxy.cut();
    eventually("the loss is logged", WAIT, || async {
        logged("lost the database") == 1
    })
    .await;
    // Let many health checks (every 200 ms) and claims fail meanwhile.
    tokio::time::sleep(Duration::from_secs(3)).await;
    proxy.restore();
    eventually("the return is logged", WAIT, || async {
        logged("reachable again") == 1
    })
    .await;
    let lines = gateway.stderr.lock().unwrap().clone();
    assert_eq!(logged("lost the database"), 1, "{lines:#?}");
    let warnings: Vec<&String> = lines.iter().filter(|line| line.contains("WARN")).collect();
    assert_eq!(warnings.len(), 1, "one warning, the loss: {warnings:#?}");
    for line in &lines {
        assert!(!line.contains(" at line "), "driver noise: {line}");
        assert!(
            !(line.contains("WARN") && line.contains("sqlx")),
            "raw driver warning: {line}"
        );
        assert!(!line.contains("health check failed"), "repeated: {line}");
    }
    gateway.stop().await;
}

/// Receives OTLP trace exports.
#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<Span>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for resource in request.into_inner().resource_spans {
            for scope in resource.scope_spans {
                spans.extend(scope.spans);
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

impl Collector {
    /// Serves OTLP over gRPC on a loopback port; returns its address.
    async fn serve_grpc(&self) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(self.clone()))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        address
    }

    /// Serves OTLP over HTTP (binary protobuf) at `path` on a loopback port; returns its
    /// address.
    async fn serve_http(&self, path: &str) -> std::net::SocketAddr {
        use prost::Message;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let spans = self.spans.clone();
        let router = axum::Router::new().route(
            path,
            axum::routing::post(
                move |headers: axum::http::HeaderMap, body: axum::body::Bytes| async move {
                    assert_eq!(
                        headers.get("content-type").unwrap(),
                        "application/x-protobuf"
                    );
                    let request = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
                    let mut spans = spans.lock().unwrap();
                    for resource in request.resource_spans {
                        for scope in resource.scope_spans {
                            spans.extend(scope.spans);
                        }
                    }
                    (
                        [("content-type", "application/x-protobuf")],
                        ExportTraceServiceResponse {
                            partial_success: None,
                        }
                        .encode_to_vec(),
                    )
                },
            ),
        );
        tokio::spawn(async move { axum::serve(listener, router).await });
        address
    }
}

/// A string, integer or boolean attribute of `span`, as text.
fn attribute(span: &Span, key: &str) -> Option<String> {
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    let value = span
        .attributes
        .iter()
        .find(|attribute| attribute.key == key)?
        .value
        .as_ref()?
        .value
        .as_ref()?;
    match value {
        Value::StringValue(text) => Some(text.clone()),
        Value::IntValue(number) => Some(number.to_string()),
        Value::BoolValue(flag) => Some(flag.to_string()),
        other => Some(format!("{other:?}")),
    }
}

/// Publishes one event with a producer's trace context through a gateway exporting
/// with `env`, consumes it and stops the gateway; returns the event's id, what the
/// collector received and the gateway's log.
async fn traced_delivery(
    collector: &Collector,
    env: &[(&str, String)],
) -> (String, Vec<Span>, Vec<String>) {
    let database = TestDatabase::create().await;
    let mut env = env.to_vec();
    env.push(("OTEL_BSP_SCHEDULE_DELAY", "100".into()));
    let gateway = GatewayProcess::start(&database, &["--metrics-listen", "off"], &env).await;

    let channel = gateway.channel().await;
    create_subscription_over(channel.clone(), subscription("orders")).await;
    let mut request = tonic::Request::new(proto::PublishRequest {
        events: vec![event("o-1", "order.created")],
        ..Default::default()
    });
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{TRACE_ID}-{PRODUCER_SPAN}-01").parse().unwrap(),
    );
    proto::publisher_client::PublisherClient::new(channel.clone())
        .publish(request)
        .await
        .unwrap();
    let mut stream = proto::subscriber_client::SubscriberClient::new(channel)
        .subscribe(proto::SubscribeRequest {
            subscription: "orders".into(),
            max_in_flight: 0,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let delivery = tokio::time::timeout(WAIT, stream.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let event = delivery.event.unwrap();
    assert_eq!(
        event.metadata["traceparent"],
        format!("00-{TRACE_ID}-{PRODUCER_SPAN}-01"),
        "the consumer can continue the producer's trace"
    );
    drop(stream);
    let stderr = gateway.stderr.clone();
    gateway.stop().await;
    let spans = collector.spans.lock().unwrap().clone();
    let lines = stderr.lock().unwrap().clone();
    (event.id, spans, lines)
}

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PRODUCER_SPAN: &str = "00f067aa0ba902b7";

/// The Publish span continues the producer's trace and the deliver span links to it,
/// both described by the OpenTelemetry semantic conventions, without thread ids or
/// busy/idle timings; the log says once where the traces go.
fn check_trace(event_id: &str, spans: &[Span], lines: &[String], endpoint: &str) {
    let publish = spans
        .iter()
        .find(|span| span.name == "outbox.v1.Publisher/Publish")
        .unwrap_or_else(|| {
            panic!(
                "no Publish span among {:?}",
                spans.iter().map(|s| &s.name).collect::<Vec<_>>()
            )
        });
    assert_eq!(hex::encode(&publish.trace_id), TRACE_ID);
    assert_eq!(
        hex::encode(&publish.parent_span_id),
        PRODUCER_SPAN,
        "the Publish span is the producer's child"
    );
    for (key, value) in [
        ("rpc.system", "grpc"),
        ("rpc.service", "outbox.v1.Publisher"),
        ("rpc.method", "Publish"),
        ("rpc.grpc.status_code", "0"),
    ] {
        assert_eq!(
            attribute(publish, key).as_deref(),
            Some(value),
            "{key}: {publish:?}"
        );
    }
    let deliver = spans
        .iter()
        .find(|span| attribute(span, "messaging.operation.type").is_some())
        .expect("a delivery span");
    assert_eq!(deliver.name, "deliver orders");
    for (key, value) in [
        ("messaging.system", "outbox"),
        ("messaging.operation.type", "send"),
        ("messaging.destination.name", "orders"),
        ("messaging.message.id", event_id),
    ] {
        assert_eq!(
            attribute(deliver, key).as_deref(),
            Some(value),
            "{key}: {deliver:?}"
        );
    }
    assert!(
        deliver
            .links
            .iter()
            .any(|link| hex::encode(&link.trace_id) == TRACE_ID
                && hex::encode(&link.span_id) == PRODUCER_SPAN),
        "the delivery is linked to the producer's context: {:?}",
        deliver.links
    );
    for span in spans {
        for noise in [
            "thread.id",
            "thread.name",
            "busy_ns",
            "idle_ns",
            "duration_ms",
        ] {
            assert!(attribute(span, noise).is_none(), "{noise} on {span:?}");
        }
    }
    let told: Vec<&String> = lines
        .iter()
        .filter(|line| line.contains("exporting traces"))
        .collect();
    assert_eq!(told.len(), 1, "{lines:#?}");
    assert!(told[0].contains(endpoint), "{told:?} names {endpoint}");
}

#[tokio::test]
async fn traces_flow_from_producer_through_publish_to_delivery() {
    let collector = Collector::default();
    let address = collector.serve_grpc().await;
    let endpoint = format!("http://{address}");
    let (event_id, spans, lines) = traced_delivery(
        &collector,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.clone()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc".into()),
        ],
    )
    .await;
    check_trace(&event_id, &spans, &lines, &endpoint);
}

#[tokio::test]
async fn traces_go_over_http_protobuf_when_the_protocol_says_so() {
    let collector = Collector::default();
    let address = collector.serve_http("/v1/traces").await;
    let (event_id, spans, lines) = traced_delivery(
        &collector,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{address}")),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf".into()),
        ],
    )
    .await;
    check_trace(
        &event_id,
        &spans,
        &lines,
        &format!("http://{address}/v1/traces"),
    );
}

#[tokio::test]
async fn the_traces_variables_take_precedence_over_the_general_ones() {
    let collector = Collector::default();
    let address = collector.serve_http("/collector/traces").await;
    let endpoint = format!("http://{address}/collector/traces");
    let (event_id, spans, lines) = traced_delivery(
        &collector,
        &[
            // The general ones point at nothing.
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9".into()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc".into()),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint.clone()),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf".into()),
        ],
    )
    .await;
    check_trace(&event_id, &spans, &lines, &endpoint);
}

#[tokio::test]
async fn failing_trace_exports_are_one_warning_not_one_per_batch() {
    let database = TestDatabase::create().await;
    // Nothing listens there.
    let endpoint = format!("http://127.0.0.1:{}", free_port());
    let gateway = GatewayProcess::start(
        &database,
        &["--metrics-listen", "off"],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.clone()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf".into()),
            ("OTEL_BSP_SCHEDULE_DELAY", "100".into()),
        ],
    )
    .await;
    let warnings = || {
        gateway
            .stderr
            .lock()
            .unwrap()
            .iter()
            .filter(|line| line.contains("WARN") && line.contains("cannot export traces"))
            .cloned()
            .collect::<Vec<_>>()
    };
    create_subscription_over(gateway.channel().await, subscription("a")).await;
    eventually("the failure is logged", WAIT, || async {
        !warnings().is_empty()
    })
    .await;
    // More spans, more batches (one every 100 ms) failing within the next second or so:
    // a fixed window, since what is checked is that nothing more is logged.
    for name in ["b", "c", "d"] {
        create_subscription_over(gateway.channel().await, subscription(name)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let logged = warnings();
    assert_eq!(logged.len(), 1, "{logged:#?}");
    assert!(logged[0].contains(&endpoint), "{logged:?}");
    gateway.stop().await;
}

#[tokio::test]
async fn json_logs_are_one_object_per_line() {
    let database = TestDatabase::create().await;
    let gateway = GatewayProcess::start(
        &database,
        &["--log-format", "json", "--metrics-listen", "off"],
        &[],
    )
    .await;
    let stderr = gateway.stderr.clone();
    gateway.stop().await;
    let lines = stderr.lock().unwrap().clone();
    assert!(!lines.is_empty());
    let mut saw_serving = false;
    for line in &lines {
        let value: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        if let Err(error) = serde_json::from_str::<UniqueKeys>(line) {
            panic!("{error}: {line}");
        }
        for field in ["timestamp", "level", "target", "message"] {
            assert!(value.get(field).is_some(), "{field} missing in {line}");
        }
        saw_serving |= value["message"] == "serving gRPC";
    }
    assert!(saw_serving, "{lines:?}");
}

/// A JSON value whose objects, nested ones too, have each key once: serde_json itself
/// keeps the last of duplicated keys silently, and log shippers differ in which one they
/// keep.
struct UniqueKeys;

impl<'de> serde::Deserialize<'de> for UniqueKeys {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = UniqueKeys;

            fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
                formatter.write_str("a JSON value")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<UniqueKeys, A::Error> {
                let mut seen = std::collections::HashSet::new();
                while let Some(key) = map.next_key::<String>()? {
                    map.next_value::<UniqueKeys>()?;
                    if !seen.insert(key.clone()) {
                        return Err(serde::de::Error::custom(format!("duplicated key {key:?}")));
                    }
                }
                Ok(UniqueKeys)
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<UniqueKeys, A::Error> {
                while seq.next_element::<UniqueKeys>()?.is_some() {}
                Ok(UniqueKeys)
            }

            fn visit_str<E>(self, _: &str) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }

            fn visit_bool<E>(self, _: bool) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }

            fn visit_i64<E>(self, _: i64) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }

            fn visit_u64<E>(self, _: u64) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }

            fn visit_f64<E>(self, _: f64) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }

            fn visit_unit<E>(self) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

#[tokio::test]
async fn piped_text_logs_have_no_colours_and_no_debug_wrappers() {
    let database = TestDatabase::create().await;
    let gateway = GatewayProcess::start(&database, &["--metrics-listen", "off"], &[]).await;
    let address = gateway.endpoint.trim_start_matches("http://").to_owned();
    create_subscription_over(gateway.channel().await, subscription("orders")).await;
    let stderr = gateway.stderr.clone();
    gateway.stop().await;
    let lines = stderr.lock().unwrap().clone();
    assert!(
        lines.iter().any(|line| line.contains(" INFO ")
            && line.contains(" audit: admin action ")
            && line.contains("principal=\"anonymous\"")
            && line.contains("action=\"CreateSubscription\"")
            && line.contains("subscription=orders")),
        "the action of an open gateway is the anonymous caller's: {lines:#?}"
    );
    assert!(
        lines
            .iter()
            .any(|line| line.contains("serving gRPC")
                && line.contains(&format!("address={address}"))),
        "{lines:#?}"
    );
    for line in &lines {
        assert!(
            !line.contains('\u{1b}'),
            "terminal colours in a pipe: {line:?}"
        );
        assert!(!line.contains("Some("), "a Debug-formatted Option: {line}");
    }
}

/// The first audit line under `target` in a gateway's log, waiting for it.
async fn audit_line(gateway: &GatewayProcess, target: &str) -> String {
    let found = poll_until(WAIT, Duration::from_millis(50), || async {
        let lines = gateway.stderr.lock().unwrap();
        lines.iter().find(|line| line.contains(target)).cloned()
    })
    .await;
    found.unwrap_or_else(|| {
        panic!(
            "no audit line: {:#?}",
            gateway.stderr.lock().unwrap().clone()
        )
    })
}

/// A text audit line reads on its own: timestamp, level, target and message first, then
/// who did what; the request's spans stay in the JSON logs.
#[tokio::test]
async fn text_audit_lines_start_with_what_happened() {
    let database = TestDatabase::create().await;
    let gateway = GatewayProcess::start(&database, &["--metrics-listen", "off"], &[]).await;
    create_subscription_over(gateway.channel().await, subscription("orders")).await;
    let line = audit_line(&gateway, " audit: ").await;
    gateway.stop().await;
    let message = line.find("admin action").expect("the message");
    assert!(message <= 45, "the message comes at {message}: {line}");
    let mut words = line.split_whitespace();
    let timestamp = words.next().unwrap_or_default();
    assert!(
        chrono::DateTime::parse_from_rfc3339(timestamp).is_ok(),
        "{line}"
    );
    assert_eq!(
        words.take(4).collect::<Vec<_>>(),
        ["INFO", "audit:", "admin", "action"],
        "{line}"
    );
    for said in [
        "principal=\"anonymous\"",
        "via=\"grpc\"",
        "action=\"CreateSubscription\"",
        "subscription=orders",
        "changed=1",
    ] {
        assert!(line.contains(said), "{said} in {line}");
    }
    assert!(!line.contains("rpc{"), "{line}");

    let gateway = GatewayProcess::start(
        &database,
        &["--metrics-listen", "off", "--log-format", "json"],
        &[],
    )
    .await;
    proto::admin_client::AdminClient::new(gateway.channel().await)
        .delete_subscription(proto::DeleteSubscriptionRequest {
            name: "orders".into(),
        })
        .await
        .expect("delete");
    let line = audit_line(&gateway, r#""target":"audit""#).await;
    gateway.stop().await;
    let line: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(line["action"], "DeleteSubscription", "{line}");
    assert_eq!(line["spans"][0]["name"], "rpc", "{line}");
}

#[tokio::test]
async fn a_taken_listen_address_says_how_to_choose_another() {
    let database = TestDatabase::create().await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = taken.local_addr().unwrap().to_string();
    let output = tokio::time::timeout(
        WAIT,
        Command::new(env!("CARGO_BIN_EXE_outbox-gateway"))
            .args([
                "serve",
                "--listen",
                &address,
                "--database-url",
                &database.url(),
                "--console-listen",
                "off",
                "--metrics-listen",
                "off",
            ])
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the gateway gives up at once")
    .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("cannot listen on {address}"))
            && stderr.contains("Choose another address with --listen"),
        "{stderr}"
    );
}

#[tokio::test]
async fn counters_start_at_zero_beside_build_and_process_figures() {
    let database = TestDatabase::create().await;
    let (gateway, metrics_base) = GatewayProcess::with_metrics(&database).await;
    create_subscription_over(gateway.channel().await, subscription("orders")).await;
    let url = format!("{metrics_base}/metrics");
    let orders = [("subscription", "orders"), ("source", "default")];
    eventually(
        "the new subscription's series appear",
        REFRESH_WAIT,
        || async {
            Metrics::scrape(&url)
                .await
                .value("outbox_subscription_backlog", &orders)
                .is_some()
        },
    )
    .await;
    let metrics = Metrics::scrape(&url).await;
    for counter in [
        "outbox_deliveries_total",
        "outbox_redeliveries_total",
        "outbox_acks_total",
        "outbox_nacks_total",
        "outbox_dead_letters_total",
        "outbox_requeued_total",
    ] {
        assert_eq!(
            metrics.value(counter, &orders),
            Some(0.0),
            "{counter}; scraped: {:#?}",
            metrics.0
        );
    }
    assert_eq!(
        metrics.value("outbox_events_expired_total", &[("subscription", "orders")]),
        Some(0.0)
    );
    assert_eq!(
        metrics.value(
            "outbox_build_info",
            &[
                ("version", env!("CARGO_PKG_VERSION")),
                ("commit", env!("OUTBOX_GIT_COMMIT"))
            ]
        ),
        Some(1.0)
    );
    let started = metrics
        .value("process_start_time_seconds", &[])
        .expect("the process start time");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        started > now - 600.0 && started <= now + 1.0,
        "{started} vs {now}"
    );
    assert!(metrics.value("process_resident_memory_bytes", &[]).unwrap() > 1e6);
    assert!(metrics.value("process_open_fds", &[]).unwrap() >= 3.0);
    assert!(metrics.value("process_cpu_seconds_total", &[]).is_some());
    let text = reqwest::get(&url).await.unwrap().text().await.unwrap();
    let help = text
        .lines()
        .find(|line| line.starts_with("# HELP outbox_oldest_open_transaction_age_seconds "))
        .expect("a HELP line");
    assert!(!help.contains("holds delivery back"), "{help}");
    gateway.stop().await;
}

/// `message` with the bearer token of the audit test.
fn authorized<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request
        .metadata_mut()
        .insert("authorization", "Bearer audit-secret".parse().unwrap());
    request
}

#[tokio::test]
async fn every_admin_change_leaves_one_audit_line() {
    let database = TestDatabase::create().await;
    let directory = std::env::temp_dir().join(format!("outbox-audit-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&directory).unwrap();
    let config = directory.join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "[[tokens]]\nname = \"ops\"\nsha256 = \"{}\"\nroles = [\"admin\", \"publisher\", \"subscriber\"]\n",
            outbox_gateway::auth::token_digest("audit-secret")
        ),
    )
    .unwrap();
    let mut gateway = GatewayProcess::start(
        &database,
        &[
            "--config",
            config.to_str().unwrap(),
            "--log-format",
            "json",
            "--metrics-listen",
            "off",
            "--console-listen",
            "127.0.0.1:0",
        ],
        &[],
    )
    .await;
    let channel = gateway.channel().await;
    let mut admin = proto::admin_client::AdminClient::new(channel.clone());
    admin
        .create_subscription(authorized(proto::CreateSubscriptionRequest {
            subscription: Some(subscription("orders")),
            validate_only: false,
        }))
        .await
        .unwrap();
    proto::publisher_client::PublisherClient::new(channel.clone())
        .publish(authorized(proto::PublishRequest {
            events: vec![event("o-1", "order.created"), event("o-2", "order.created")],
            ..Default::default()
        }))
        .await
        .unwrap();
    let mut subscriber = proto::subscriber_client::SubscriberClient::new(channel.clone());
    let mut stream = subscriber
        .subscribe(authorized(proto::SubscribeRequest {
            subscription: "orders".into(),
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner();
    for _ in 0..2 {
        let delivery = tokio::time::timeout(WAIT, stream.message())
            .await
            .expect("a delivery in time")
            .unwrap()
            .unwrap();
        subscriber
            .nack(authorized(proto::NackRequest {
                subscription: "orders".into(),
                ack_id: delivery.ack_id,
                dead_letter: true,
                ..Default::default()
            }))
            .await
            .unwrap();
    }
    drop(stream);
    // A dry run and a reading call change nothing and leave no audit line.
    let dry_run = admin
        .requeue_dead_letters(authorized(proto::RequeueDeadLettersRequest {
            subscription: "orders".into(),
            all: true,
            validate_only: true,
            ..Default::default()
        }))
        .await
        .unwrap();
    assert_eq!(dry_run.into_inner().requeued_count, 2);
    admin
        .get_stats(authorized(proto::GetStatsRequest::default()))
        .await
        .unwrap();
    let requeued = admin
        .requeue_dead_letters(authorized(proto::RequeueDeadLettersRequest {
            subscription: "orders".into(),
            all: true,
            event_types: vec!["order.*".into()],
            ..Default::default()
        }))
        .await
        .unwrap();
    assert_eq!(requeued.into_inner().requeued_count, 2);
    admin
        .pause_subscription(authorized(proto::PauseSubscriptionRequest {
            name: "orders".into(),
            reason: "maintenance".into(),
            ..Default::default()
        }))
        .await
        .unwrap();

    // The console: sign in with the same token and resume.
    let console = format!(
        "http://{}",
        gateway.announced("serving the web console").await
    );
    let browser = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let signed_in = browser
        .post(format!("{console}/sign-in"))
        .form(&[("token", "audit-secret"), ("next", "/")])
        .send()
        .await
        .unwrap();
    let cookie = signed_in
        .headers()
        .get(reqwest::header::SET_COOKIE)
        .expect("a session cookie")
        .to_str()
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_owned();
    let page = browser
        .get(format!("{console}/subscriptions/orders"))
        .header(reqwest::header::COOKIE, &cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let marker = "name=\"csrf\" value=\"";
    let start = page.find(marker).expect("a CSRF field") + marker.len();
    let csrf = &page[start..start + page[start..].find('"').unwrap()];
    let resumed = browser
        .post(format!("{console}/subscriptions/orders/resume"))
        .header(reqwest::header::COOKIE, &cookie)
        .form(&[("csrf", csrf)])
        .send()
        .await
        .unwrap();
    assert_eq!(resumed.status(), reqwest::StatusCode::SEE_OTHER);

    admin
        .delete_subscription(authorized(proto::DeleteSubscriptionRequest {
            name: "orders".into(),
        }))
        .await
        .unwrap();
    let stderr = gateway.stderr.clone();
    gateway.stop().await;
    std::fs::remove_dir_all(&directory).unwrap();

    let lines = stderr.lock().unwrap().clone();
    let audit: Vec<serde_json::Value> = lines
        .iter()
        .map(|line| {
            if let Err(error) = serde_json::from_str::<UniqueKeys>(line) {
                panic!("{error}: {line}");
            }
            serde_json::from_str::<serde_json::Value>(line).unwrap()
        })
        .filter(|line| line["target"] == "audit")
        .collect();
    let seen: Vec<(&str, &str, &str, u64)> = audit
        .iter()
        .map(|line| {
            assert_eq!(line["level"], "INFO", "{line}");
            assert_eq!(line["principal"], "ops", "{line}");
            (
                line["via"].as_str().unwrap_or_default(),
                line["action"].as_str().unwrap_or_default(),
                line["subscription"].as_str().unwrap_or_default(),
                line["changed"].as_u64().unwrap_or(u64::MAX),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("grpc", "CreateSubscription", "orders", 1),
            ("grpc", "RequeueDeadLetters", "orders", 2),
            ("grpc", "PauseSubscription", "orders", 1),
            ("console", "resume", "orders", 1),
            ("grpc", "DeleteSubscription", "orders", 1),
        ],
        "{audit:#?}"
    );
    let selector = audit[1]["selector"].as_str().unwrap_or_default();
    assert!(
        selector.contains("all") && selector.contains("order.*"),
        "the selector says which dead letters: {selector:?}"
    );
}

/// A gateway process serving metrics (refreshed every 200 ms) with the sink `down`,
/// whose NATS broker is not there, and the pull subscription `orders` with one event
/// due and no consumer; returns it and its metrics URL.
async fn gateway_with_a_waiting_subscription(database: &TestDatabase) -> (GatewayProcess, String) {
    let config = std::env::temp_dir().join(format!("{}-down-sink.toml", database.name()));
    std::fs::write(
        &config,
        format!(
            "[[sinks]]\nname = \"down\"\nkind = \"nats\"\nservers = [\"nats://127.0.0.1:{}\"]\n",
            free_port()
        ),
    )
    .expect("write the configuration");
    let mut gateway = GatewayProcess::start(
        database,
        &[
            "--config",
            config.to_str().expect("a UTF-8 path"),
            "--metrics-listen",
            "127.0.0.1:0",
            "--metrics-refresh-interval",
            "200ms",
        ],
        &[],
    )
    .await;
    let metrics = gateway.announced("serving metrics").await;
    let channel = gateway.channel().await;
    create_subscription_over(channel.clone(), subscription("orders")).await;
    proto::publisher_client::PublisherClient::new(channel)
        .publish(proto::PublishRequest {
            events: vec![event("o-1", "order.created")],
            ..Default::default()
        })
        .await
        .expect("publish");
    (gateway, format!("http://{metrics}/metrics"))
}

/// The value of `outbox_subscription_status` of `orders` for each status, in the order
/// the scrape lists them.
fn statuses_of_orders(metrics: &Metrics) -> Vec<(String, f64)> {
    metrics
        .0
        .iter()
        .filter(|sample| {
            sample.metric == "outbox_subscription_status"
                && sample.labels.get("subscription") == Some("orders")
        })
        .filter_map(|sample| {
            let status = sample.labels.get("status")?.to_owned();
            match sample.value {
                prometheus_parse::Value::Gauge(value) => Some((status, value)),
                _ => None,
            }
        })
        .collect()
}

#[tokio::test]
async fn status_streams_sinks_panics_and_the_build_commit_have_series_to_alert_on() {
    let database = TestDatabase::create().await;
    let (gateway, url) = gateway_with_a_waiting_subscription(&database).await;
    let orders = [("subscription", "orders")];
    let status_is = |expected: &'static str| {
        let url = url.clone();
        async move {
            let statuses = statuses_of_orders(&Metrics::scrape(&url).await);
            statuses.len() == 9
                && statuses
                    .iter()
                    .all(|(status, value)| *value == if status == expected { 1.0 } else { 0.0 })
        }
    };
    eventually(
        "orders reads no_consumer, and 0 for every other status",
        REFRESH_WAIT,
        || status_is("no_consumer"),
    )
    .await;
    let metrics = Metrics::scrape(&url).await;
    let mut labels: Vec<String> = statuses_of_orders(&metrics)
        .into_iter()
        .map(|(status, _)| status)
        .collect();
    labels.sort();
    assert_eq!(
        labels,
        [
            "behind",
            "caught_up",
            "dead_letters",
            "delivering",
            "no_consumer",
            "paused",
            "push_stopped",
            "scheduled_only",
            "sink_unreachable"
        ]
    );
    assert_eq!(
        metrics.value("outbox_subscription_streams", &orders),
        Some(0.0)
    );
    assert_eq!(
        metrics.value("outbox_sink_up", &[("sink", "down")]),
        Some(0.0)
    );
    for task in outbox_gateway::metrics::TASKS {
        assert_eq!(
            metrics.value("outbox_task_panics_total", &[("task", task)]),
            Some(0.0),
            "{task}"
        );
    }
    let commit = env!("OUTBOX_GIT_COMMIT");
    let in_a_checkout = std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .is_ok_and(|output| output.status.success());
    if in_a_checkout {
        assert!(
            commit.len() == 40 && commit.chars().all(|c| c.is_ascii_hexdigit()),
            "{commit}"
        );
    }
    assert_eq!(
        metrics.value(
            "outbox_build_info",
            &[("version", env!("CARGO_PKG_VERSION")), ("commit", commit)]
        ),
        Some(1.0)
    );
    let help = reqwest::get(&url).await.unwrap().text().await.unwrap();
    let help = help
        .lines()
        .find(|line| line.starts_with("# HELP outbox_subscription_streams "))
        .expect("a HELP line");
    assert!(help.contains("per replica"), "{help}");

    // A consumer attaches: one stream here, and the subscription is delivering.
    let mut consumer = Consumer::from_stream(
        proto::subscriber_client::SubscriberClient::new(gateway.channel().await)
            .subscribe(proto::SubscribeRequest {
                subscription: "orders".into(),
                max_in_flight: 1,
                ..Default::default()
            })
            .await
            .expect("subscribe")
            .into_inner(),
    );
    consumer.take(1, WAIT).await;
    eventually(
        "orders has one stream and delivers",
        REFRESH_WAIT,
        || async {
            Metrics::scrape(&url)
                .await
                .value("outbox_subscription_streams", &orders)
                == Some(1.0)
                && status_is("delivering").await
        },
    )
    .await;
    drop(consumer);
    gateway.stop().await;
}

/// The rules of deploy/prometheus/alerts.yaml: each alert's name and expression.
fn alert_rules() -> Vec<(String, String)> {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/prometheus/alerts.yaml");
    let text = std::fs::read_to_string(&path).expect("deploy/prometheus/alerts.yaml");
    let file: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).expect("valid YAML");
    let groups = file["groups"].as_sequence().expect("a list of groups");
    let mut rules = Vec::new();
    for group in groups {
        for rule in group["rules"].as_sequence().expect("a list of rules") {
            let alert = rule["alert"].as_str().expect("every rule is an alert");
            let expr = rule["expr"].as_str().expect("every rule has an expr");
            rules.push((alert.to_owned(), expr.to_owned()));
        }
    }
    rules
}

/// A metric name and the `label="value"` matchers of its selector.
type Selector = (String, Vec<(String, String)>);

/// The gateway's series a PromQL expression selects: each `outbox_` metric name, with
/// the `label="value"` matchers of its selector. Quoted text is skipped, so a name in a
/// string is no selector.
fn gateway_selectors(expr: &str) -> Vec<Selector> {
    let chars: Vec<char> = expr.chars().collect();
    let mut selectors = Vec::new();
    let mut at = 0;
    while at < chars.len() {
        let c = chars[at];
        if matches!(c, '"' | '\'' | '`') {
            at += 1;
            while at < chars.len() && chars[at] != c {
                at += if chars[at] == '\\' { 2 } else { 1 };
            }
            at += 1;
            continue;
        }
        if !(c.is_ascii_alphabetic() || c == '_' || c == ':') {
            at += 1;
            continue;
        }
        let start = at;
        while at < chars.len()
            && (chars[at].is_ascii_alphanumeric() || matches!(chars[at], '_' | ':'))
        {
            at += 1;
        }
        let name: String = chars[start..at].iter().collect();
        if !name.starts_with("outbox_") {
            continue;
        }
        let mut matchers = Vec::new();
        let brace = (at..chars.len()).find(|index| !chars[*index].is_whitespace());
        if let Some(open) = brace.filter(|index| chars[*index] == '{') {
            let close = (open..chars.len())
                .find(|index| chars[*index] == '}')
                .expect("a selector's closing brace");
            let inside: String = chars[open + 1..close].iter().collect();
            for matcher in inside.split(',') {
                let (label, value) = matcher.split_once('=').expect("label matchers");
                // Only equality names a value that must exist; !=, =~ and !~ do not.
                if !label.ends_with('!') && !value.starts_with('~') {
                    matchers.push((
                        label.trim().to_owned(),
                        value.trim().trim_matches('"').to_owned(),
                    ));
                }
            }
            at = close + 1;
        }
        selectors.push((name, matchers));
    }
    selectors
}

#[test]
fn selectors_are_read_out_of_expressions_but_not_out_of_strings() {
    assert_eq!(
        gateway_selectors(
            r#"sum by (subscription) (increase(outbox_dead_letters_total{source!="x", subscription = "a"}[5m])) > 0 or label_replace(vector(1), "l", "outbox_fake", "", "")"#
        ),
        [(
            "outbox_dead_letters_total".to_owned(),
            vec![("subscription".to_owned(), "a".to_owned())]
        )]
    );
}

/// Every metric (and every label value matched with `=`) the shipped alert rules use is
/// one a live gateway serves — a renamed metric would make its alert silently never fire
/// — and promtool, where installed, accepts the file.
#[tokio::test]
async fn alert_rules_use_only_series_the_gateway_serves() {
    let rules = alert_rules();
    let alerts: Vec<&str> = rules.iter().map(|(alert, _)| alert.as_str()).collect();
    for expected in [
        "OutboxSubscriptionNoConsumer",
        "OutboxPushStopped",
        "OutboxSinkDown",
        "OutboxDeadLettersRising",
        "OutboxOldestUnackedTooOld",
    ] {
        assert!(alerts.contains(&expected), "{expected} in {alerts:?}");
    }
    let database = TestDatabase::create().await;
    let (gateway, url) = gateway_with_a_waiting_subscription(&database).await;
    // By alert.
    let wanted: Vec<(String, Selector)> = rules
        .iter()
        .flat_map(|(alert, expr)| {
            let selectors = gateway_selectors(expr);
            assert!(
                !selectors.is_empty(),
                "{alert} uses no metric of the gateway: {expr}"
            );
            selectors
                .into_iter()
                .map(|selector| (alert.clone(), selector))
        })
        .collect();
    let missing = |metrics: &Metrics| -> Vec<String> {
        wanted
            .iter()
            .filter(|(_, (metric, matchers))| {
                !metrics.0.iter().any(|sample| {
                    sample.metric == *metric
                        && matchers
                            .iter()
                            .all(|(label, value)| sample.labels.get(label) == Some(value.as_str()))
                })
            })
            .map(|(alert, (metric, matchers))| format!("{alert}: {metric} {matchers:?}"))
            .collect()
    };
    // The per-subscription series come with the first stats refresh.
    let served = poll_until(REFRESH_WAIT, Duration::from_millis(200), || async {
        let metrics = Metrics::scrape(&url).await;
        missing(&metrics).is_empty().then_some(())
    })
    .await;
    if served.is_none() {
        panic!(
            "series the alert rules use that the gateway does not serve: {:#?}",
            missing(&Metrics::scrape(&url).await)
        );
    }
    gateway.stop().await;

    let Ok(promtool) = std::process::Command::new("promtool")
        .args(["check", "rules"])
        .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/prometheus/alerts.yaml"))
        .output()
    else {
        return; // promtool is not installed: the checks above stand alone.
    };
    assert!(
        promtool.status.success(),
        "promtool check rules: {}{}",
        String::from_utf8_lossy(&promtool.stdout),
        String::from_utf8_lossy(&promtool.stderr)
    );
}
