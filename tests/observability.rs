//! Observability of a gateway running as its own process: Prometheus metrics after a
//! known scenario, OTLP traces from producer to consumer, JSON logs.

mod common;

use std::{
    collections::HashMap,
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
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, Command},
};
use tonic::transport::Channel;

/// Generous: a busy machine or a long transaction elsewhere in the cluster slows delivery.
const WAIT: Duration = Duration::from_secs(15);

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
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
        let port = free_port();
        let mut command = Command::new(env!("CARGO_BIN_EXE_outbox-gateway"));
        command
            .args([
                "serve",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--database-url",
                &database.url(),
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
        use tonic_health::pb::{
            HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
        };
        for _ in 0..200 {
            if let Ok(channel) = Channel::from_shared(self.endpoint.clone())
                .unwrap()
                .connect()
                .await
                && let Ok(response) = HealthClient::new(channel)
                    .check(HealthCheckRequest {
                        service: String::new(),
                    })
                    .await
                && response.into_inner().status == ServingStatus::Serving as i32
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "the gateway process did not become healthy; stderr: {:?}",
            self.stderr.lock().unwrap()
        );
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
        .publish(proto::PublishRequest { events })
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

/// Samples of a Prometheus text exposition, keyed by `name{labels}`; panics on a line
/// that is not valid exposition format.
fn parse_prometheus(text: &str) -> HashMap<String, f64> {
    let mut samples = HashMap::new();
    for line in text.lines().filter(|line| !line.is_empty()) {
        if let Some(comment) = line.strip_prefix('#') {
            let words: Vec<&str> = comment.split_whitespace().collect();
            assert!(
                matches!(words.first(), Some(&"HELP") | Some(&"TYPE")),
                "bad comment line {line:?}"
            );
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad sample line {line:?}"));
        let name_end = series.find('{').unwrap_or(series.len());
        assert!(
            series[..name_end]
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name in {line:?}"
        );
        if name_end < series.len() {
            assert!(series.ends_with('}'), "bad labels in {line:?}");
        }
        let value: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("bad value in {line:?}"));
        samples.insert(series.to_owned(), value);
    }
    samples
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
    let mut samples = HashMap::new();
    for _ in 0..50 {
        let text = http_get(&url).await;
        samples = parse_prometheus(&text);
        if samples.get("outbox_subscription_in_flight{subscription=\"orders\"}") == Some(&1.0)
            && samples.get("outbox_subscription_dead_letters{subscription=\"orders\"}")
                == Some(&1.0)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let expected = [
        (
            "outbox_events_published_total{event_type=\"order.created\"}",
            4.0,
        ),
        (
            "outbox_events_published_total{event_type=\"order.paid\"}",
            1.0,
        ),
        ("outbox_deliveries_total{subscription=\"orders\"}", 5.0),
        ("outbox_acks_total{subscription=\"orders\"}", 3.0),
        ("outbox_nacks_total{subscription=\"orders\"}", 1.0),
        ("outbox_dead_letters_total{subscription=\"orders\"}", 1.0),
        ("outbox_subscription_backlog{subscription=\"orders\"}", 0.0),
        (
            "outbox_subscription_in_flight{subscription=\"orders\"}",
            1.0,
        ),
        (
            "outbox_subscription_awaiting_retry{subscription=\"orders\"}",
            0.0,
        ),
        (
            "outbox_subscription_dead_letters{subscription=\"orders\"}",
            1.0,
        ),
        ("outbox_events_stored", 5.0),
        (
            "outbox_commit_to_delivery_seconds_count{subscription=\"orders\"}",
            5.0,
        ),
        (
            "outbox_deliver_to_ack_seconds_count{subscription=\"orders\"}",
            3.0,
        ),
        (
            "outbox_rpc_requests_total{method=\"/outbox.v1.Publisher/Publish\",code=\"Ok\"}",
            1.0,
        ),
    ];
    for (series, value) in expected {
        assert_eq!(
            samples.get(series),
            Some(&value),
            "{series}; scraped: {samples:#?}"
        );
    }
    assert!(samples.keys().any(|k| k.starts_with(
        "outbox_rpc_duration_seconds_bucket{method=\"/outbox.v1.Publisher/Publish\""
    )));
    assert!(
        samples
            .keys()
            .any(|k| k.starts_with("outbox_db_pool_connections{state=\"idle\"}"))
    );
    assert!(
        samples
            .keys()
            .any(|k| k.starts_with("outbox_relay_wakeups_total{cause=\"publish\"}"))
    );
    gateway.stop().await;
}

/// A minimal HTTP/1.1 GET, enough for the metrics endpoint.
async fn http_get(url: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let address = url
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap()
        .to_owned();
    let path = &url[url.find(&address).unwrap() + address.len()..];
    for _ in 0..100 {
        if let Ok(mut stream) = tokio::net::TcpStream::connect(&address).await {
            let request =
                format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
            stream.write_all(request.as_bytes()).await.unwrap();
            let mut response = String::new();
            stream.read_to_string(&mut response).await.unwrap();
            let (head, body) = response.split_once("\r\n\r\n").expect("HTTP response");
            assert!(head.starts_with("HTTP/1.1 200"), "{head}");
            if head
                .to_ascii_lowercase()
                .contains("transfer-encoding: chunked")
            {
                return dechunk(body);
            }
            return body.to_owned();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("metrics endpoint {url} unreachable");
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n").expect("chunk size");
        let size = usize::from_str_radix(size.trim(), 16).expect("hex chunk size");
        if size == 0 {
            return out;
        }
        out.push_str(&rest[..size]);
        body = &rest[size + 2..];
    }
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

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
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
    assert_eq!(hex(&publish.trace_id), trace_id);
    assert_eq!(
        hex(&publish.parent_span_id),
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
            .any(|link| hex(&link.trace_id) == trace_id && hex(&link.span_id) == producer_span),
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
