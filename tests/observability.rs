//! Observability of a gateway running as its own process: Prometheus metrics after a
//! known scenario, OTLP traces from producer to consumer, JSON logs.

mod common;

use std::{
    process::Stdio,
    sync::{Arc, Mutex},
    time::Duration,
};

use common::*;
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

fn free_port() -> u16 {
    gateway::free_loopback_address()
        .expect("a free loopback port")
        .port()
}

/// `outbox-gateway serve` as a child process, killed when dropped.
struct GatewayProcess {
    child: Child,
    endpoint: String,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl GatewayProcess {
    async fn start(
        database: &TestDatabase,
        args: &[&str],
        env: &[(&str, String)],
    ) -> GatewayProcess {
        Self::start_on(&database.url(), args, env).await
    }

    /// A gateway on the database at `database_url`.
    async fn start_on(database_url: &str, args: &[&str], env: &[(&str, String)]) -> GatewayProcess {
        let port = free_port();
        let mut command = Command::new(env!("CARGO_BIN_EXE_outbox-gateway"));
        command
            .args([
                "serve",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--database-url",
                database_url,
                // Tests run gateways side by side; the console has tests of its own.
                "--console-listen",
                "off",
            ])
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
        let gateway = GatewayProcess {
            child,
            endpoint: format!("http://127.0.0.1:{port}"),
            stderr,
        };
        gateway.wait_until_serving().await;
        gateway
    }

    async fn channel(&self) -> Channel {
        Channel::from_shared(self.endpoint.clone())
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    async fn wait_until_serving(&self) {
        let address = self
            .endpoint
            .trim_start_matches("http://")
            .parse()
            .expect("a socket address");
        if let Err(error) = gateway::wait_until_serving(address, WAIT, || true).await {
            panic!("{error}; stderr: {:?}", self.stderr.lock().unwrap());
        }
    }

    /// SIGTERM, then wait for a clean exit (flushing traces).
    async fn stop(mut self) {
        let pid = self.child.id().expect("running").to_string();
        let status = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap();
        assert!(status.success());
        let exit = tokio::time::timeout(Duration::from_secs(15), self.child.wait())
            .await
            .expect("exits")
            .unwrap();
        assert!(exit.success(), "gateway exited with {exit}");
    }
}

async fn setup_scenario(channel: Channel, events: Vec<proto::EventInput>) -> Vec<proto::Delivery> {
    let mut admin = proto::admin_client::AdminClient::new(channel.clone());
    admin
        .create_subscription(proto::CreateSubscriptionRequest {
            subscription: Some(subscription("orders")),
        })
        .await
        .unwrap();
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
    let metrics_port = free_port();
    let gateway = GatewayProcess::start(
        &database,
        &[
            "--metrics-listen",
            &format!("127.0.0.1:{metrics_port}"),
            "--metrics-refresh-interval",
            "200ms",
        ],
        &[],
    )
    .await;
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

    let url = format!("http://127.0.0.1:{metrics_port}/metrics");
    let orders = [("subscription", "orders"), ("source", "default")];
    let orders_only = [("subscription", "orders")];
    // The per-subscription gauges refresh every 200 ms.
    eventually("the gauges show the settled deliveries", WAIT, || async {
        let metrics = Metrics::scrape(&url).await;
        metrics.value("outbox_subscription_in_flight", &orders) == Some(1.0)
            && metrics.value("outbox_subscription_dead_letters", &orders) == Some(1.0)
    })
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
    let elsewhere = reqwest::get(format!("http://127.0.0.1:{metrics_port}/"))
        .await
        .unwrap();
    assert_eq!(elsewhere.status(), reqwest::StatusCode::NOT_FOUND);
    gateway.stop().await;
}

#[tokio::test]
async fn a_stream_ending_in_an_error_is_counted_with_its_code() {
    let database = TestDatabase::create().await;
    let metrics_port = free_port();
    let gateway = GatewayProcess::start(
        &database,
        &[
            "--metrics-listen",
            &format!("127.0.0.1:{metrics_port}"),
            "--metrics-refresh-interval",
            "200ms",
        ],
        &[],
    )
    .await;
    let url = format!("http://127.0.0.1:{metrics_port}/metrics");
    let orders = [("subscription", "orders"), ("source", "default")];
    let channel = gateway.channel().await;
    let mut admin = proto::admin_client::AdminClient::new(channel.clone());
    admin
        .create_subscription(proto::CreateSubscriptionRequest {
            subscription: Some(subscription("orders")),
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
    eventually("the subscription's series appear", WAIT, || async {
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
    let proxy = common::proxy::TcpProxy::start("127.0.0.1:5432".parse().unwrap()).await;
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
    create_subscription_over(&gateway, "orders").await;
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

async fn create_subscription_over(gateway: &GatewayProcess, name: &str) {
    proto::admin_client::AdminClient::new(gateway.channel().await)
        .create_subscription(proto::CreateSubscriptionRequest {
            subscription: Some(subscription(name)),
        })
        .await
        .unwrap();
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

#[tokio::test]
async fn traces_flow_from_producer_through_publish_to_delivery() {
    let collector = Collector::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let collector_address = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(collector.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let database = TestDatabase::create().await;
    let gateway = GatewayProcess::start(
        &database,
        &["--metrics-listen", "off"],
        &[
            (
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                format!("http://{collector_address}"),
            ),
            ("OTEL_BSP_SCHEDULE_DELAY", "100".into()),
        ],
    )
    .await;

    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let producer_span = "00f067aa0ba902b7";
    let channel = gateway.channel().await;
    let mut admin = proto::admin_client::AdminClient::new(channel.clone());
    admin
        .create_subscription(proto::CreateSubscriptionRequest {
            subscription: Some(subscription("orders")),
        })
        .await
        .unwrap();
    let mut request = tonic::Request::new(proto::PublishRequest {
        events: vec![event("o-1", "order.created")],
        ..Default::default()
    });
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{trace_id}-{producer_span}-01").parse().unwrap(),
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
    let traceparent = delivery.event.unwrap().metadata["traceparent"].clone();
    assert_eq!(
        traceparent,
        format!("00-{trace_id}-{producer_span}-01"),
        "the consumer can continue the producer's trace"
    );
    drop(stream);
    gateway.stop().await;

    let spans = collector.spans.lock().unwrap().clone();
    let publish = spans
        .iter()
        .find(|span| span.name.contains("Publisher/Publish"))
        .unwrap_or_else(|| {
            panic!(
                "no Publish span among {:?}",
                spans.iter().map(|s| &s.name).collect::<Vec<_>>()
            )
        });
    assert_eq!(hex::encode(&publish.trace_id), trace_id);
    assert_eq!(
        hex::encode(&publish.parent_span_id),
        producer_span,
        "the Publish span is the producer's child"
    );
    let deliver = spans
        .iter()
        .find(|span| span.name == "deliver")
        .expect("a deliver span");
    assert!(
        deliver
            .links
            .iter()
            .any(|link| hex::encode(&link.trace_id) == trace_id
                && hex::encode(&link.span_id) == producer_span),
        "the delivery is linked to the producer's context: {:?}",
        deliver.links
    );
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
        for field in ["timestamp", "level", "target", "message"] {
            assert!(value.get(field).is_some(), "{field} missing in {line}");
        }
        saw_serving |= value["message"] == "serving gRPC";
    }
    assert!(saw_serving, "{lines:?}");
}
