//! Sink subscriptions into a real Kafka-protocol broker: the machine's at 127.0.0.1:9092
//! (each test with topics of its own), or a broker a test starts itself when it must
//! stop it. The broker is tansu (`.ci/run` installs it); `OUTBOX_TEST_KAFKA` names
//! another bootstrap broker.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::Duration,
};

use outbox_gateway::{proto, sinks::SinkSettings};
use rdkafka::{
    ClientConfig, Message, Offset, TopicPartitionList,
    admin::{AdminClient, AdminOptions, NewTopic, TopicReplication},
    client::DefaultClientContext,
    consumer::{BaseConsumer, Consumer as _},
    message::{Headers, OwnedMessage},
};
use tonic::Code;

use crate::{
    common::*,
    sinks::{assert_in_order_per_aggregate, through_outages, versioned_batch},
};

/// Generous: a busy machine slows everything down.
const WAIT: Duration = Duration::from_secs(30);

fn shared_kafka() -> String {
    std::env::var("OUTBOX_TEST_KAFKA").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

fn kafka_sink(name: &str, brokers: &str) -> SinkSettings {
    SinkSettings {
        name: name.into(),
        kind: "kafka".into(),
        brokers: vec![brokers.into()],
        ..Default::default()
    }
}

/// A gateway with the sink `kafka` on `brokers`.
async fn gateway_with_sink(database: &Arc<TestDatabase>, brokers: &str) -> TestGateway {
    let mut config = test_config(database.url());
    config.sinks = vec![kafka_sink("kafka", brokers)];
    TestGateway::start_with(database, config).await
}

fn sink_subscription(name: &str, topic: &str) -> proto::Subscription {
    proto::Subscription {
        sink: Some(proto::SinkConfig {
            name: "kafka".into(),
            topic: topic.into(),
            ..Default::default()
        }),
        ..subscription(name)
    }
}

/// A topic of this test's own.
struct TestTopic {
    brokers: String,
    name: String,
    partitions: i32,
}

impl TestTopic {
    async fn create(brokers: &str, name: &str, partitions: i32) -> TestTopic {
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()
            .expect("a Kafka admin client");
        let created = admin
            .create_topics(
                &[NewTopic::new(name, partitions, TopicReplication::Fixed(1))],
                &AdminOptions::new().operation_timeout(Some(WAIT)),
            )
            .await
            .expect("create the topic");
        for result in created {
            result.unwrap_or_else(|(topic, code)| panic!("create topic {topic}: {code}"));
        }
        TestTopic {
            brokers: brokers.into(),
            name: name.into(),
            partitions,
        }
    }

    /// Messages the topic holds, over all its partitions.
    async fn count(&self) -> i64 {
        let (brokers, name, partitions) =
            (self.brokers.clone(), self.name.clone(), self.partitions);
        tokio::task::spawn_blocking(move || {
            let consumer: BaseConsumer = ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .create()
                .expect("a Kafka consumer");
            (0..partitions)
                .map(|partition| {
                    let (low, high) = consumer
                        .fetch_watermarks(&name, partition, WAIT)
                        .expect("the topic's offsets");
                    high - low
                })
                .sum()
        })
        .await
        .expect("the offsets reader")
    }

    /// Every message of the topic once at least `expected` are there, by partition in
    /// offset order.
    async fn read(&self, expected: usize) -> Vec<OwnedMessage> {
        let (brokers, name, partitions) =
            (self.brokers.clone(), self.name.clone(), self.partitions);
        tokio::task::spawn_blocking(move || {
            let consumer: BaseConsumer = ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .set("group.id", format!("{name}-reader"))
                .set("enable.auto.commit", "false")
                .create()
                .expect("a Kafka consumer");
            let mut assignment = TopicPartitionList::new();
            for partition in 0..partitions {
                assignment
                    .add_partition_offset(&name, partition, Offset::Beginning)
                    .unwrap();
            }
            consumer.assign(&assignment).expect("assign the partitions");
            let deadline = std::time::Instant::now() + WAIT * 2;
            let mut messages = Vec::new();
            while messages.len() < expected {
                assert!(
                    std::time::Instant::now() < deadline,
                    "only {} of {expected} messages in topic {name}",
                    messages.len()
                );
                match consumer.poll(Duration::from_millis(200)) {
                    Some(Ok(message)) => messages.push(message.detach()),
                    Some(Err(error)) => panic!("reading topic {name}: {error}"),
                    None => {}
                }
            }
            // Anything beyond `expected` (a duplicate) shows up now too.
            while let Some(Ok(message)) = consumer.poll(Duration::from_millis(500)) {
                messages.push(message.detach());
            }
            messages
        })
        .await
        .expect("the reader")
    }
}

fn header(message: &impl Message, name: &str) -> Option<String> {
    message.headers()?.iter().find_map(|header| {
        (header.key == name)
            .then(|| String::from_utf8_lossy(header.value.unwrap_or_default()).into_owned())
    })
}

fn key(message: &OwnedMessage) -> String {
    String::from_utf8_lossy(message.key().unwrap_or_default()).into_owned()
}

fn event_id(message: &OwnedMessage) -> String {
    header(message, "outbox-event-id").expect("the event id header")
}

/// Checks that `messages` hold `expected` distinct events, the first copy of each in
/// its aggregate's version order. A message whose confirmation an outage swallowed may
/// be stored twice: Kafka keeps no duplicate window across producer sessions.
fn assert_each_event_arrived_in_order(messages: &[OwnedMessage], expected: usize) {
    let ids: HashSet<String> = messages.iter().map(event_id).collect();
    assert_eq!(ids.len(), expected, "every event, none lost");
    let mut seen = HashSet::new();
    assert_in_order_per_aggregate(
        messages
            .iter()
            .filter(|message| seen.insert(event_id(message)))
            .map(|message| {
                (
                    header(message, "outbox-aggregate-id").unwrap(),
                    header(message, "ce_aggregateversion").unwrap(),
                )
            }),
    );
}

#[tokio::test]
async fn events_reach_kafka_with_their_topic_key_and_cloudevents_headers() {
    let database = TestDatabase::create().await;
    let brokers = shared_kafka();
    let gateway = gateway_with_sink(&database, &brokers).await;
    let prefix = database.name().to_owned();
    let orders = TestTopic::create(&brokers, &format!("{prefix}-order"), 3).await;
    let created = create_subscription(
        &gateway,
        sink_subscription("orders-out", &format!("{prefix}-{{aggregate_type}}")),
    )
    .await;
    assert_eq!(
        created.sink.as_ref().unwrap().topic,
        format!("{prefix}-{{aggregate_type}}")
    );

    let mut events: Vec<proto::EventInput> = (0..30)
        .map(|index| proto::EventInput {
            aggregate_version: Some(index / 6 + 1),
            ..event(&format!("o-{}", index % 6), "order.created")
        })
        .collect();
    events[3].metadata = [
        ("tenant".to_owned(), "acme".to_owned()),
        (
            "traceparent".to_owned(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
        ),
    ]
    .into();
    let results = publish(&gateway, events.clone()).await;
    let ids: Vec<String> = results.iter().map(|result| result.id.clone()).collect();

    let messages = orders.read(30).await;
    let by_id: HashMap<String, &OwnedMessage> = messages
        .iter()
        .map(|message| (event_id(message), message))
        .collect();
    assert_eq!(by_id.len(), 30, "each event once");
    assert_eq!(messages.len(), 30, "and no event twice");
    let mut partition_of: HashMap<String, i32> = HashMap::new();
    for (index, id) in ids.iter().enumerate() {
        let message = by_id[id];
        let aggregate = format!("o-{}", index % 6);
        assert_eq!(
            key(message),
            format!("order/{aggregate}"),
            "the default key"
        );
        for (name, expected) in [
            ("ce_id", id.as_str()),
            ("ce_type", "order.created"),
            ("ce_specversion", "1.0"),
            ("ce_source", "/sources/default/aggregates/order"),
            ("ce_subject", aggregate.as_str()),
            ("content-type", "application/json"),
            ("outbox-source", "default"),
            ("outbox-aggregate-type", "order"),
            ("outbox-aggregate-id", aggregate.as_str()),
        ] {
            assert_eq!(header(message, name).as_deref(), Some(expected), "{name}");
        }
        assert_eq!(header(message, "Nats-Msg-Id"), None, "NATS's header only");
        assert_eq!(message.payload(), Some(events[index].payload.as_slice()));
        // One aggregate, one partition: its order is the partition's.
        let partition = *partition_of
            .entry(aggregate.clone())
            .or_insert(message.partition());
        assert_eq!(
            message.partition(),
            partition,
            "{aggregate} in one partition"
        );
    }
    let traced = by_id[&ids[3]];
    assert_eq!(header(traced, "ce_tenant").as_deref(), Some("acme"));
    assert_eq!(
        header(traced, "traceparent").as_deref(),
        Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    );
    assert_eq!(
        header(traced, "outbox-metadata").as_deref(),
        Some(
            r#"{"tenant":"acme","traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}"#
        )
    );
    let versions_in_partition_order = |aggregate: &str| -> Vec<String> {
        messages
            .iter()
            .filter(|message| header(*message, "outbox-aggregate-id").as_deref() == Some(aggregate))
            .map(|message| header(message, "ce_aggregateversion").unwrap())
            .collect()
    };
    assert_eq!(
        versions_in_partition_order("o-1"),
        ["1", "2", "3", "4", "5"]
    );

    eventually("the subscription has acked all 30", WAIT, || async {
        let stats = subscription_stats(&gateway, "orders-out").await;
        stats.acked_total == 30 && stats.lag_events == 0
    })
    .await;
    let stats = subscription_stats(&gateway, "orders-out").await;
    assert_eq!(
        (stats.sink_sent_total, stats.sink_confirmed_total),
        (30, 30)
    );

    // A key template of the subscription's own.
    let keyed = TestTopic::create(&brokers, &format!("{prefix}-keyed"), 1).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            sink: Some(proto::SinkConfig {
                name: "kafka".into(),
                topic: keyed.name.clone(),
                key: "{source}:{aggregate_id}".into(),
                ..Default::default()
            }),
            ..subscription("keyed-out")
        },
    )
    .await;
    let keyed_messages = keyed.read(30).await;
    assert_eq!(key(&keyed_messages[0]), "default:o-0");

    let sinks = gateway
        .admin()
        .await
        .list_sinks(proto::ListSinksRequest {})
        .await
        .unwrap()
        .into_inner()
        .sinks;
    assert_eq!(
        (
            sinks[0].name.as_str(),
            sinks[0].kind.as_str(),
            sinks[0].reachable
        ),
        ("kafka", "kafka", true),
        "{sinks:?}"
    );
}

#[tokio::test]
async fn refusals_of_kafka_dead_letter_the_event_with_its_reason() {
    let database = TestDatabase::create().await;
    let brokers = shared_kafka();
    let mut config = test_config(database.url());
    config.sinks = vec![kafka_sink("kafka", &brokers)];
    config.limits.max_payload_bytes = 2 * 1024 * 1024;
    let gateway = TestGateway::start_with(&database, config).await;
    let prefix = database.name().to_owned();
    let topic = TestTopic::create(&brokers, &format!("{prefix}-present"), 1).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            event_types: vec!["x.lost".into()],
            ..sink_subscription("lost-out", &format!("{prefix}-absent"))
        },
    )
    .await;
    create_subscription(
        &gateway,
        proto::Subscription {
            event_types: vec!["x.kept".into()],
            ..sink_subscription("kept-out", &topic.name)
        },
    )
    .await;
    let large = proto::EventInput {
        payload: vec![b'x'; 1536 * 1024],
        content_type: "application/octet-stream".into(),
        ..event("big", "x.kept")
    };
    publish(
        &gateway,
        vec![event("l-1", "x.lost"), large, event("small", "x.kept")],
    )
    .await;

    eventually(
        "the event for a missing topic is dead-lettered",
        WAIT,
        || async { list_dead_letters(&gateway, "lost-out").await.len() == 1 },
    )
    .await;
    let lost = list_dead_letters(&gateway, "lost-out").await.remove(0);
    assert!(
        lost.last_error.contains("has no topic") && lost.last_error.contains("-absent"),
        "{}",
        lost.last_error
    );
    assert_eq!(lost.attempts, 1, "a permanent refusal is not retried");

    eventually("the oversized event is dead-lettered", WAIT, || async {
        list_dead_letters(&gateway, "kept-out").await.len() == 1
    })
    .await;
    let oversized = list_dead_letters(&gateway, "kept-out").await.remove(0);
    assert!(
        oversized.last_error.contains("larger than Kafka accepts"),
        "{}",
        oversized.last_error
    );
    let kept = topic.read(1).await;
    assert_eq!(kept.len(), 1);
    assert_eq!(
        header(&kept[0], "outbox-aggregate-id").as_deref(),
        Some("small")
    );
}

#[tokio::test]
async fn bad_kafka_sink_settings_are_refused_naming_the_field() {
    let database = TestDatabase::create().await;
    let gateway = gateway_with_sink(&database, &shared_kafka()).await;
    let mut admin = gateway.admin().await;
    let cases = [
        (
            proto::SinkConfig {
                name: "kafka".into(),
                ..Default::default()
            },
            "subscription.sink.topic",
            "is required",
        ),
        (
            proto::SinkConfig {
                name: "kafka".into(),
                topic: "orders/{aggregate_type}".into(),
                ..Default::default()
            },
            "subscription.sink.topic",
            "",
        ),
        (
            proto::SinkConfig {
                name: "kafka".into(),
                topic: "orders".into(),
                subject: "orders.created".into(),
                ..Default::default()
            },
            "subscription.sink.subject",
            "does not apply",
        ),
        (
            proto::SinkConfig {
                name: "kafka".into(),
                topic: "orders".into(),
                key: "{tenant}".into(),
                ..Default::default()
            },
            "subscription.sink.key",
            "is not a field",
        ),
    ];
    for (sink, field, reason) in cases {
        let result = admin
            .create_subscription(proto::CreateSubscriptionRequest {
                subscription: Some(proto::Subscription {
                    sink: Some(sink.clone()),
                    ..subscription("refused")
                }),
                validate_only: false,
            })
            .await;
        let status = result.expect_err(&format!("{sink:?} must be refused"));
        assert_eq!(status.code(), Code::InvalidArgument, "{sink:?}: {status:?}");
        assert!(
            status.message().contains(field) && status.message().contains(reason),
            "{sink:?}: {}",
            status.message()
        );
        let missing = admin
            .get_subscription(proto::GetSubscriptionRequest {
                name: "refused".into(),
            })
            .await;
        assert_status(missing, Code::NotFound, "refused");
    }
}

/// A tansu broker of this test's own, storing in SQLite under `store`, so the test can
/// stop it and start it again with what it stored.
struct OwnKafka {
    child: tokio::process::Child,
    port: u16,
}

impl OwnKafka {
    async fn start(store: &std::path::Path, port: u16) -> OwnKafka {
        OwnKafka::start_advertising(store, port, port).await
    }

    /// Listening on `port`, and telling clients to connect to `advertised` (where a
    /// proxy may stand in front of it).
    async fn start_advertising(store: &std::path::Path, port: u16, advertised: u16) -> OwnKafka {
        std::fs::create_dir_all(store).unwrap();
        let listener = format!("tcp://127.0.0.1:{port}");
        let advertised = format!("tcp://127.0.0.1:{advertised}");
        // Its log stays beside its data, for when a test fails.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(store.join("tansu.log"))
            .unwrap();
        let child = tokio::process::Command::new(tansu_binary())
            .args([
                "broker",
                "--listener-url",
                &listener,
                "--advertised-listener-url",
                &advertised,
                "--storage-engine",
                "sqlite://tansu.db",
            ])
            .current_dir(store)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("tansu must be installed for the Kafka sink tests (see README)");
        let broker = OwnKafka { child, port };
        eventually("the broker listens", WAIT, || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
        })
        .await;
        broker
    }

    fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    async fn stop(mut self) -> u16 {
        self.child.kill().await.expect("stop the broker");
        self.port
    }
}

/// `TANSU`, or `tansu` on the PATH, or where `cargo install` puts it.
fn tansu_binary() -> std::path::PathBuf {
    if let Ok(path) = std::env::var("TANSU") {
        return path.into();
    }
    let installed = std::env::var("CARGO_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|_| std::env::var("HOME").map(|home| std::path::Path::new(&home).join(".cargo")))
        .map(|home| home.join("bin/tansu"));
    match installed {
        Ok(path) if path.exists() => path,
        _ => "tansu".into(),
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test]
async fn a_kafka_broker_stopped_mid_flow_loses_nothing_and_keeps_each_aggregates_order() {
    let database = TestDatabase::create().await;
    let store = std::env::temp_dir().join(format!("{}-kafka", database.name()));
    let _ = std::fs::remove_dir_all(&store);
    let kafka = OwnKafka::start(&store, free_port()).await;
    let gateway = gateway_with_sink(&database, &kafka.brokers()).await;
    let topic = TestTopic::create(&kafka.brokers(), "flow", 2).await;
    create_subscription(
        &gateway,
        through_outages(sink_subscription("ordered-out", "flow")),
    )
    .await;
    publish(&gateway, versioned_batch(0)).await;
    topic.read(10).await;

    // The broker goes away mid-flow; more events are published meanwhile.
    let port = kafka.stop().await;
    publish(&gateway, versioned_batch(50)).await;
    eventually("stats say why nothing is confirmed", WAIT, || async {
        let stats = subscription_stats(&gateway, "ordered-out").await;
        !stats.sink_last_error.is_empty() && stats.lag_events > 0
    })
    .await;
    let sinks = gateway
        .admin()
        .await
        .list_sinks(proto::ListSinksRequest {})
        .await
        .unwrap()
        .into_inner()
        .sinks;
    assert!(!sinks[0].reachable, "{sinks:?}");
    assert!(
        sinks[0].error.contains(&format!("127.0.0.1:{port}")),
        "{sinks:?}"
    );

    let kafka = OwnKafka::start(&store, port).await;
    eventually(
        "the subscription caught up after the restart",
        WAIT * 2,
        || async { subscription_stats(&gateway, "ordered-out").await.lag_events == 0 },
    )
    .await;
    assert_each_event_arrived_in_order(&topic.read(100).await, 100);
    drop(kafka);
    let _ = std::fs::remove_dir_all(&store);
}

/// A TCP proxy that holds every chunk of bytes, each way, for a random time up to
/// `max_delay` (in order, as TCP keeps it): a broker answering at random latencies.
async fn delaying_proxy(
    listen: u16,
    upstream: u16,
    max_delay: Duration,
) -> tokio::task::JoinHandle<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    async fn pump(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        max_delay: Duration,
    ) {
        let mut buffer = vec![0; 64 * 1024];
        while let Ok(read) = from.read(&mut buffer).await {
            if read == 0 {
                break;
            }
            let delay = rand::random_range(0..=max_delay.as_millis() as u64);
            tokio::time::sleep(Duration::from_millis(delay)).await;
            if to.write_all(&buffer[..read]).await.is_err() {
                break;
            }
        }
    }
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", listen))
        .await
        .expect("bind the proxy");
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await else {
                continue;
            };
            let (client_read, client_write) = client.into_split();
            let (server_read, server_write) = server.into_split();
            tokio::spawn(pump(client_read, server_write, max_delay));
            tokio::spawn(pump(server_read, client_write, max_delay));
        }
    })
}

#[tokio::test]
async fn each_aggregate_keeps_its_order_when_the_broker_answers_at_random_delays() {
    let database = TestDatabase::create().await;
    let store = std::env::temp_dir().join(format!("{}-kafka-slow", database.name()));
    let _ = std::fs::remove_dir_all(&store);
    let (port, proxied) = (free_port(), free_port());
    let kafka = OwnKafka::start_advertising(&store, port, proxied).await;
    let proxy = delaying_proxy(proxied, port, Duration::from_millis(40)).await;
    let brokers = format!("127.0.0.1:{proxied}");
    let gateway = gateway_with_sink(&database, &brokers).await;
    let topic = TestTopic::create(&brokers, "slow", 3).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            ordered: true,
            ..sink_subscription("ordered-out", "slow")
        },
    )
    .await;
    for from in [0, 50, 100, 150] {
        publish(&gateway, versioned_batch(from)).await;
    }
    assert_each_event_arrived_in_order(&topic.read(200).await, 200);
    proxy.abort();
    drop(kafka);
    let _ = std::fs::remove_dir_all(&store);
}

#[tokio::test]
async fn two_gateways_share_a_kafka_sink_and_a_killed_ones_events_all_arrive() {
    let database = TestDatabase::create().await;
    let brokers = shared_kafka();
    let prefix = database.name().to_owned();
    let topic = TestTopic::create(&brokers, &format!("{prefix}-shared"), 3).await;
    let config_file = std::env::temp_dir().join(format!("{prefix}-kafka-sinks.toml"));
    std::fs::write(
        &config_file,
        format!("[[sinks]]\nname = \"kafka\"\nkind = \"kafka\"\nbrokers = [\"{brokers}\"]\n"),
    )
    .unwrap();
    let config_argument = config_file.to_str().expect("a UTF-8 path");
    let arguments = ["--config", config_argument, "--metrics-listen", "off"];
    let (mut doomed, _doomed_log, _, doomed_channel) =
        start_gateway_process(&database, &arguments).await;
    let (_survivor, _survivor_log, _, survivor_channel) =
        start_gateway_process(&database, &arguments).await;
    proto::admin_client::AdminClient::new(doomed_channel.clone())
        .create_subscription(proto::CreateSubscriptionRequest {
            subscription: Some(proto::Subscription {
                ack_deadline: seconds(2),
                ..sink_subscription("shared-out", &topic.name)
            }),
            validate_only: false,
        })
        .await
        .expect("create the sink subscription");
    let events: Vec<proto::EventInput> = (0..1000)
        .map(|index| event(&format!("o-{index}"), "order.created"))
        .collect();
    let mut publisher = proto::publisher_client::PublisherClient::new(survivor_channel.clone());
    publish_in_calls(&mut publisher, &events, 100).await;
    topic.read(100).await;
    doomed.start_kill().expect("SIGKILL");
    doomed.wait().await.unwrap();

    let admin = proto::admin_client::AdminClient::new(survivor_channel);
    eventually("the survivor settles every event", WAIT * 2, || async {
        let stats = stats_through(admin.clone(), "shared-out").await;
        stats.lag_events == 0 && stats.acked_total >= 1000
    })
    .await;
    let messages = topic.read(1000).await;
    let ids: HashSet<String> = messages.iter().map(event_id).collect();
    assert_eq!(ids.len(), 1000, "every event is in the topic");
    let _ = std::fs::remove_file(&config_file);
}

#[tokio::test]
async fn a_paused_kafka_sink_subscription_sends_nothing_until_resumed() {
    let database = TestDatabase::create().await;
    let brokers = shared_kafka();
    let gateway = gateway_with_sink(&database, &brokers).await;
    let prefix = database.name().to_owned();
    let paused = TestTopic::create(&brokers, &format!("{prefix}-paused"), 1).await;
    let running = TestTopic::create(&brokers, &format!("{prefix}-running"), 1).await;
    create_subscription(&gateway, sink_subscription("paused-out", &paused.name)).await;
    create_subscription(&gateway, sink_subscription("running-out", &running.name)).await;
    let mut admin = gateway.admin().await;
    admin
        .pause_subscription(proto::PauseSubscriptionRequest {
            name: "paused-out".into(),
            reason: "broker maintenance".into(),
            ..Default::default()
        })
        .await
        .expect("pause");
    let events: Vec<proto::EventInput> = (0..20)
        .map(|index| event(&format!("o-{index}"), "order.created"))
        .collect();
    publish(&gateway, events).await;

    // The running subscription's topic fills while the paused one's stays empty.
    running.read(20).await;
    eventually("the running subscription settled all 20", WAIT, || async {
        subscription_stats(&gateway, "running-out").await.lag_events == 0
    })
    .await;
    assert_eq!(
        paused.count().await,
        0,
        "a paused subscription sends nothing"
    );
    assert_eq!(
        subscription_stats(&gateway, "paused-out").await.lag_events,
        20
    );

    admin
        .resume_subscription(proto::ResumeSubscriptionRequest {
            name: "paused-out".into(),
        })
        .await
        .expect("resume");
    let messages = paused.read(20).await;
    assert_eq!(messages.len(), 20);
}
