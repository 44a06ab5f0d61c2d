//! Sink subscriptions into a real NATS JetStream: the machine's server at
//! 127.0.0.1:4222 (each test with a stream and subjects of its own), or a `nats-server`
//! a test starts itself when it must stop the broker.

use std::{collections::HashMap, process::Stdio, sync::Arc, time::Duration};

use async_nats::jetstream::{self, message::StreamMessage, stream};
use outbox_gateway::{proto, sinks::SinkSettings};
use tokio::io::{AsyncBufReadExt, BufReader};
use tonic::Code;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

use crate::common::*;

/// Generous: a busy machine slows everything down.
const WAIT: Duration = Duration::from_secs(30);
const SHARED_NATS: &str = "nats://127.0.0.1:4222";

fn nats_sink(name: &str, server: &str) -> SinkSettings {
    SinkSettings {
        name: name.into(),
        kind: "nats".into(),
        servers: vec![server.into()],
        ..Default::default()
    }
}

/// A gateway with the sink `js` on `server`.
async fn gateway_with_sink(database: &Arc<TestDatabase>, server: &str) -> TestGateway {
    let mut config = test_config(database.url());
    config.sinks = vec![nats_sink("js", server)];
    TestGateway::start_with(database, config).await
}

/// A JetStream stream of this test's own, taking every subject under `prefix.`.
#[derive(Clone)]
struct TestStream {
    context: jetstream::Context,
    name: String,
}

impl TestStream {
    async fn create(server: &str, prefix: &str) -> TestStream {
        let stream = TestStream::open(server, prefix).await;
        let _ = stream.context.delete_stream(&stream.name).await;
        stream
            .context
            .create_stream(stream::Config {
                name: stream.name.clone(),
                subjects: vec![format!("{prefix}.>")],
                storage: stream::StorageType::File,
                duplicate_window: Duration::from_secs(120),
                ..Default::default()
            })
            .await
            .expect("create a stream");
        stream
    }

    async fn open(server: &str, prefix: &str) -> TestStream {
        let client = async_nats::connect(server).await.expect("connect to NATS");
        TestStream {
            context: jetstream::new(client),
            name: prefix.replace(['.', '-'], "_").to_uppercase(),
        }
    }

    async fn stored(&self) -> u64 {
        match self.context.get_stream(&self.name).await {
            Ok(stream) => stream.cached_info().state.messages,
            Err(_) => 0,
        }
    }

    /// Every message of the stream, in stream order.
    async fn read(&self) -> Vec<StreamMessage> {
        let stream = self
            .context
            .get_stream(&self.name)
            .await
            .expect("the stream");
        let count = stream.cached_info().state.messages;
        let mut messages = Vec::new();
        for sequence in 1..=count {
            messages.push(
                stream
                    .get_raw_message(sequence)
                    .await
                    .expect("read a stored message"),
            );
        }
        messages
    }

    async fn delete(&self) {
        let _ = self.context.delete_stream(&self.name).await;
    }
}

fn header(message: &StreamMessage, name: &str) -> Option<String> {
    message
        .headers
        .get(name)
        .map(|value| value.as_str().to_owned())
}

/// What the health service says of `outbox.sink.js`.
async fn sink_health(gateway: &TestGateway) -> Option<ServingStatus> {
    let answer = HealthClient::new(gateway.channel().await)
        .check(HealthCheckRequest {
            service: "outbox.sink.js".into(),
        })
        .await
        .ok()?;
    ServingStatus::try_from(answer.into_inner().status).ok()
}

fn sink_subscription(name: &str, subject: &str) -> proto::Subscription {
    proto::Subscription {
        sink: Some(proto::SinkConfig {
            name: "js".into(),
            subject: subject.into(),
            ..Default::default()
        }),
        ..subscription(name)
    }
}

/// `subscription`, ordered and retrying for ever, quickly: what a sink subscription
/// that must outlast a broker outage looks like.
pub(crate) fn through_outages(subscription: proto::Subscription) -> proto::Subscription {
    proto::Subscription {
        ordered: true,
        retry_backoff_min: seconds(1),
        retry_backoff_max: seconds(2),
        max_attempts: Some(0),
        ..subscription
    }
}

/// Fifty events from `from` on, over five aggregates, each with its version.
pub(crate) fn versioned_batch(from: usize) -> Vec<proto::EventInput> {
    (from..from + 50)
        .map(|index| proto::EventInput {
            aggregate_version: Some(index as i64 / 5 + 1),
            ..event(&format!("a-{}", index % 5), "order.changed")
        })
        .collect()
}

/// Checks that the (aggregate id, version) pairs, in the order the broker stored them,
/// hold each aggregate's versions in ascending order.
pub(crate) fn assert_in_order_per_aggregate(stored: impl Iterator<Item = (String, String)>) {
    let mut versions: HashMap<String, Vec<i64>> = HashMap::new();
    for (aggregate, version) in stored {
        versions
            .entry(aggregate)
            .or_default()
            .push(version.parse().expect("a version"));
    }
    for (aggregate, versions) in versions {
        assert!(
            versions.is_sorted(),
            "{aggregate} stored out of order: {versions:?}"
        );
    }
}

/// Two sink subscriptions publishing the same events into one JetStream stream each store
/// every event: JetStream's deduplication tells them apart, and still drops a re-send of
/// one subscription's delivery (a requeue of acked events).
#[tokio::test]
async fn two_sink_subscriptions_into_one_stream_both_store_every_event_and_a_re_send_once() {
    let database = TestDatabase::create().await;
    let gateway = gateway_with_sink(&database, SHARED_NATS).await;
    let prefix = database.name().to_owned();
    let stream = TestStream::create(SHARED_NATS, &prefix).await;
    for name in ["audit", "billing"] {
        create_subscription(
            &gateway,
            sink_subscription(name, &format!("{prefix}.{name}.{{aggregate_type}}")),
        )
        .await;
    }
    let ids = publish_ids(&gateway, orders(30)).await;
    eventually("both subscriptions settle all 30", WAIT, || async {
        let audit = subscription_stats(&gateway, "audit").await;
        let billing = subscription_stats(&gateway, "billing").await;
        audit.acked_total == 30 && billing.acked_total == 30
    })
    .await;
    let per_subject = |messages: &[StreamMessage]| {
        let mut counts: HashMap<String, usize> = HashMap::new();
        for message in messages {
            let subscription = message.subject.as_str().split('.').nth(1).unwrap();
            *counts.entry(subscription.to_owned()).or_default() += 1;
        }
        counts
    };
    let stored = per_subject(&stream.read().await);
    assert_eq!(stored.get("audit"), Some(&30), "{stored:?}");
    assert_eq!(stored.get("billing"), Some(&30), "{stored:?}");

    // Requeue five of audit's acked events: they are sent again, and JetStream drops them.
    for id in &ids[..5] {
        gateway
            .admin()
            .await
            .requeue_event(proto::RequeueEventRequest {
                id: id.clone(),
                subscription: "audit".into(),
                ..Default::default()
            })
            .await
            .expect("requeue");
    }
    eventually("audit sends the five again", WAIT, || async {
        subscription_stats(&gateway, "audit")
            .await
            .sink_confirmed_total
            >= 35
    })
    .await;
    let stored = per_subject(&stream.read().await);
    assert_eq!(
        stored.get("audit"),
        Some(&30),
        "re-sends dropped: {stored:?}"
    );
    stream.delete().await;
}

#[tokio::test]
async fn events_reach_jetstream_with_their_subject_msg_id_and_cloudevents_headers() {
    let database = TestDatabase::create().await;
    let gateway = gateway_with_sink(&database, SHARED_NATS).await;
    let prefix = database.name().to_owned();
    let stream = TestStream::create(SHARED_NATS, &prefix).await;
    let created = create_subscription(
        &gateway,
        sink_subscription(
            "orders-out",
            &format!("{prefix}.{{aggregate_type}}.{{event_type}}"),
        ),
    )
    .await;
    assert_eq!(created.sink.as_ref().unwrap().name, "js");

    let mut events: Vec<proto::EventInput> = (0..20)
        .map(|index| event(&format!("o-{}", index % 4), "order.created"))
        .collect();
    events[3].metadata = [
        ("tenant".to_owned(), "acme".to_owned()),
        (
            "traceparent".to_owned(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
        ),
    ]
    .into();
    events[3].aggregate_type = "order line".into();
    let results = publish(&gateway, events.clone()).await;
    let ids: Vec<String> = results.iter().map(|result| result.id.clone()).collect();

    eventually("20 messages are stored in the stream", WAIT, || async {
        stream.stored().await == 20
    })
    .await;
    let messages = stream.read().await;
    let by_id: HashMap<String, &StreamMessage> = messages
        .iter()
        .map(|message| (header(message, "ce-id").unwrap(), message))
        .collect();
    assert_eq!(by_id.len(), 20, "each event once");
    for (index, id) in ids.iter().enumerate() {
        let message = by_id[id];
        assert_eq!(
            header(message, "Nats-Msg-Id"),
            Some(format!("{id}/orders-out")),
            "the event id and the subscription's name"
        );
        assert_eq!(header(message, "ce-type").as_deref(), Some("order.created"));
        assert_eq!(header(message, "ce-specversion").as_deref(), Some("1.0"));
        assert!(
            header(message, "ce-transactionid")
                .and_then(|id| id.parse::<u64>().ok())
                .is_some_and(|id| id > 0)
        );
        assert_eq!(header(message, "outbox-source").as_deref(), Some("default"));
        assert_eq!(
            header(message, "content-type").as_deref(),
            Some("application/json")
        );
        assert_eq!(message.payload.as_ref(), events[index].payload.as_slice());
        let expected_subject = if index == 3 {
            format!("{prefix}.order%20line.order%2Ecreated")
        } else {
            format!("{prefix}.order.order%2Ecreated")
        };
        assert_eq!(message.subject.as_str(), expected_subject);
    }
    let traced = by_id[&ids[3]];
    assert_eq!(header(traced, "ce-tenant").as_deref(), Some("acme"));
    assert_eq!(
        header(traced, "traceparent").as_deref(),
        Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    );
    assert_eq!(
        header(traced, "ce-source").as_deref(),
        Some("/sources/default/aggregates/order%2520line")
    );

    // Settled as acked once confirmed, and counted.
    eventually("the subscription has acked all 20", WAIT, || async {
        let stats = subscription_stats(&gateway, "orders-out").await;
        stats.acked_total == 20 && stats.lag_events == 0
    })
    .await;
    let stats = subscription_stats(&gateway, "orders-out").await;
    assert_eq!(stats.sink_confirmed_total, 20);
    assert_eq!(stats.sink_sent_total, 20);
    assert_eq!(stats.sink_in_flight, 0);

    // The gateway drains it: Subscribe is refused, naming the sink.
    let refused = gateway
        .subscriber()
        .await
        .subscribe(proto::SubscribeRequest {
            subscription: "orders-out".into(),
            ..Default::default()
        })
        .await;
    assert_status(refused, Code::FailedPrecondition, "sink subscription");

    // ListSinks names the sink and finds it reachable.
    let sinks = gateway
        .admin()
        .await
        .list_sinks(proto::ListSinksRequest {})
        .await
        .unwrap()
        .into_inner()
        .sinks;
    assert_eq!(sinks.len(), 1);
    assert_eq!(
        (sinks[0].name.as_str(), sinks[0].kind.as_str()),
        ("js", "nats")
    );
    assert!(sinks[0].reachable, "{sinks:?}");
    eventually("health reports the sink SERVING", WAIT, || async {
        sink_health(&gateway).await == Some(ServingStatus::Serving)
    })
    .await;
    stream.delete().await;
}

#[tokio::test]
async fn a_subject_no_stream_takes_is_dead_lettered_with_the_reason() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.sinks = vec![nats_sink("js", SHARED_NATS)];
    let gateway = TestGateway::start_with_console(&database, config).await;
    let subject = format!("{}.nowhere", database.name());
    create_subscription(&gateway, sink_subscription("lost", &subject)).await;
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    eventually("the event is dead-lettered", WAIT, || async {
        list_dead_letters(&gateway, "lost").await.len() == 1
    })
    .await;
    let dead = list_dead_letters(&gateway, "lost").await.remove(0);
    assert!(
        dead.last_error
            .contains("no JetStream stream takes subject"),
        "{}",
        dead.last_error
    );
    assert_eq!(dead.attempts, 1, "a permanent refusal is not retried");
    let stats = subscription_stats(&gateway, "lost").await;
    assert!(stats.sink_last_error.contains(&subject), "{stats:?}");

    // The console's page of the subscription shows the sink and why it fails.
    let page = reqwest::get(format!(
        "http://{}/subscriptions/lost",
        gateway.console.unwrap()
    ))
    .await
    .expect("the console answers")
    .text()
    .await
    .unwrap();
    assert!(page.contains("into sink"), "{page}");
    assert!(page.contains(&subject), "the subject: {page}");
    assert!(
        page.contains("no JetStream stream takes subject"),
        "the last error: {page}"
    );
}

#[tokio::test]
async fn bad_sink_settings_are_refused_naming_the_field_and_store_nothing() {
    let database = TestDatabase::create().await;
    let gateway = gateway_with_sink(&database, SHARED_NATS).await;
    let mut admin = gateway.admin().await;
    let cases: Vec<(proto::SinkConfig, Option<proto::PushConfig>, &str, &str)> = vec![
        (
            proto::SinkConfig {
                name: "elsewhere".into(),
                subject: "a.b".into(),
                ..Default::default()
            },
            None,
            "subscription.sink.name",
            "its sinks are js",
        ),
        (
            proto::SinkConfig {
                name: "js".into(),
                subject: "orders.*".into(),
                ..Default::default()
            },
            None,
            "subscription.sink.subject",
            "wildcards",
        ),
        (
            proto::SinkConfig {
                name: "js".into(),
                subject: "$JS.API.STREAM.DELETE.{aggregate_id}".into(),
                ..Default::default()
            },
            None,
            "subscription.sink.subject",
            "system subject",
        ),
        (
            proto::SinkConfig {
                name: "js".into(),
                subject: "orders.{customer}".into(),
                ..Default::default()
            },
            None,
            "subscription.sink.subject",
            "is not a field",
        ),
        (
            proto::SinkConfig {
                name: "js".into(),
                ..Default::default()
            },
            None,
            "subscription.sink.subject",
            "is required",
        ),
        (
            proto::SinkConfig {
                name: "js".into(),
                subject: "a.b".into(),
                topic: "orders".into(),
                ..Default::default()
            },
            None,
            "subscription.sink.topic",
            "does not apply",
        ),
        (
            proto::SinkConfig {
                name: "js".into(),
                subject: "a.b".into(),
                ..Default::default()
            },
            Some(proto::PushConfig {
                endpoint: "http://127.0.0.1:9/hook".into(),
                ..Default::default()
            }),
            "subscription.sink",
            "beside push",
        ),
    ];
    for (sink, push, field, reason) in cases {
        let result = admin
            .create_subscription(proto::CreateSubscriptionRequest {
                subscription: Some(proto::Subscription {
                    sink: Some(sink.clone()),
                    push,
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

#[tokio::test]
async fn a_subscription_switches_between_pull_and_sink() {
    let database = TestDatabase::create().await;
    let gateway = gateway_with_sink(&database, SHARED_NATS).await;
    let prefix = database.name().to_owned();
    let stream = TestStream::create(SHARED_NATS, &prefix).await;
    create_subscription(&gateway, subscription("switching")).await;
    let mut admin = gateway.admin().await;
    let update = |sink: Option<proto::SinkConfig>| proto::UpdateSubscriptionRequest {
        subscription: Some(proto::Subscription {
            sink,
            ..subscription("switching")
        }),
        update_mask: Some(prost_types::FieldMask {
            paths: vec!["sink".into()],
        }),
        validate_only: false,
    };
    admin
        .update_subscription(update(Some(proto::SinkConfig {
            name: "js".into(),
            subject: format!("{prefix}.{{aggregate_id}}"),
            ..Default::default()
        })))
        .await
        .expect("switch to the sink");
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    eventually("the event reaches the stream", WAIT, || async {
        stream.stored().await == 1
    })
    .await;

    admin
        .update_subscription(update(None))
        .await
        .expect("switch back to pull");
    publish(&gateway, vec![event("o-2", "order.created")]).await;
    let mut consumer = Consumer::open(&gateway, "switching", 10).await;
    let delivery = consumer.next(WAIT).await.expect("a delivery");
    assert_eq!(aggregate_of(&delivery), "o-2");
    assert_eq!(stream.stored().await, 1, "nothing more went out");
    stream.delete().await;
}

/// A `nats-server` with JetStream of this test's own, so the test can stop it.
struct OwnNats {
    child: tokio::process::Child,
    port: u16,
    store: std::path::PathBuf,
}

impl OwnNats {
    /// Listening on `port`, or on a port of its own choosing.
    async fn start(store: std::path::PathBuf, port: Option<u16>) -> OwnNats {
        let port_argument = port.map_or_else(|| "-1".to_owned(), |port| port.to_string());
        let arguments = ["-a", "127.0.0.1", "-p", &port_argument, "-js", "-sd"];
        let mut arguments: Vec<String> = arguments.iter().map(|a| a.to_string()).collect();
        arguments.push(store.display().to_string());
        Self::start_with(store, arguments).await
    }

    async fn start_with(store: std::path::PathBuf, arguments: Vec<String>) -> OwnNats {
        // Debian installs it under /usr/sbin, which not every PATH holds.
        let binary = ["/usr/sbin/nats-server", "/usr/bin/nats-server"]
            .into_iter()
            .find(|path| std::path::Path::new(path).exists())
            .unwrap_or("nats-server");
        let mut child = tokio::process::Command::new(binary)
            .args(arguments)
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("nats-server must be installed for the sink tests (see README)");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let listening = tokio::time::timeout(WAIT, async {
            while let Some(line) = lines.next_line().await.unwrap() {
                if let Some((_, address)) = line.split_once("Listening for client connections on ")
                {
                    return address
                        .rsplit_once(':')
                        .unwrap()
                        .1
                        .trim()
                        .parse::<u16>()
                        .unwrap();
                }
            }
            panic!("nats-server ended before listening");
        })
        .await
        .expect("nats-server listens");
        // Keep reading its log so it never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        OwnNats {
            child,
            port: listening,
            store,
        }
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    async fn stop(mut self) -> (std::path::PathBuf, u16) {
        self.child.kill().await.expect("stop nats-server");
        (self.store.clone(), self.port)
    }
}

#[tokio::test]
async fn a_broker_stopped_mid_flow_loses_nothing_and_keeps_each_aggregates_order() {
    let database = TestDatabase::create().await;
    let store = std::env::temp_dir().join(format!("{}-nats", database.name()));
    let _ = std::fs::remove_dir_all(&store);
    let nats = OwnNats::start(store.clone(), None).await;
    let gateway = gateway_with_sink(&database, &nats.url()).await;
    let stream = TestStream::create(&nats.url(), "flow").await;
    create_subscription(
        &gateway,
        through_outages(sink_subscription("ordered-out", "flow.{aggregate_id}")),
    )
    .await;
    publish(&gateway, versioned_batch(0)).await;
    eventually("the first events are stored", WAIT, || async {
        stream.stored().await >= 10
    })
    .await;
    drop(stream);

    // The broker goes away mid-flow; more events are published meanwhile.
    let (store, port) = nats.stop().await;
    publish(&gateway, versioned_batch(50)).await;
    eventually("stats say why nothing is confirmed", WAIT, || async {
        let stats = subscription_stats(&gateway, "ordered-out").await;
        !stats.sink_last_error.is_empty() && stats.lag_events > 0
    })
    .await;
    eventually("health reports the sink NOT_SERVING", WAIT, || async {
        sink_health(&gateway).await == Some(ServingStatus::NotServing)
    })
    .await;

    let nats = OwnNats::start(store.clone(), Some(port)).await;
    let stream = TestStream::open(&nats.url(), "flow").await;
    eventually(
        "all 100 events are stored after the restart",
        WAIT * 2,
        || async { stream.stored().await >= 100 },
    )
    .await;
    let messages = stream.read().await;
    let mut ids = std::collections::HashSet::new();
    for message in &messages {
        ids.insert(header(message, "Nats-Msg-Id").unwrap());
    }
    assert_eq!(ids.len(), 100, "every event, none lost");
    assert_eq!(messages.len(), 100, "re-sends were dropped as duplicates");
    assert_in_order_per_aggregate(messages.iter().map(|message| {
        (
            header(message, "outbox-aggregate-id").unwrap(),
            header(message, "ce-aggregateversion").unwrap(),
        )
    }));
    eventually("the subscription caught up", WAIT, || async {
        subscription_stats(&gateway, "ordered-out").await.lag_events == 0
    })
    .await;
    drop(nats);
    let _ = std::fs::remove_dir_all(&store);
}

#[tokio::test]
async fn refusals_of_the_broker_dead_letter_the_event_with_its_reason() {
    let database = TestDatabase::create().await;
    let store = std::env::temp_dir().join(format!("{}-nats-refusing", database.name()));
    let _ = std::fs::remove_dir_all(&store);
    std::fs::create_dir_all(&store).unwrap();
    // The gateway may publish under `allowed.` only; messages are at most 4 KiB.
    let config = store.join("nats.conf");
    std::fs::write(
        &config,
        format!(
            r#"listen: "127.0.0.1:-1"
max_payload: 4096
jetstream {{ store_dir: "{}" }}
authorization {{
  users = [
    {{ user: gateway, password: gateway-secret, permissions: {{
        publish: {{ allow: ["allowed.>", "$JS.API.>"] }},
        subscribe: {{ allow: ["_INBOX.>"] }} }} }},
    {{ user: admin, password: admin-secret }}
  ]
}}
"#,
            store.display()
        ),
    )
    .unwrap();
    let nats = OwnNats::start_with(
        store.clone(),
        vec!["-c".into(), config.display().to_string()],
    )
    .await;
    let client =
        async_nats::ConnectOptions::with_user_and_password("admin".into(), "admin-secret".into())
            .connect(nats.url())
            .await
            .expect("connect as admin");
    jetstream::new(client)
        .create_stream(stream::Config {
            name: "REFUSALS".into(),
            subjects: vec!["allowed.>".into(), "denied.>".into()],
            ..Default::default()
        })
        .await
        .expect("create the stream");
    let mut config = test_config(database.url());
    config.sinks = vec![SinkSettings {
        user: Some("gateway".into()),
        password: Some("gateway-secret".into()),
        ..nats_sink("js", &nats.url())
    }];
    let gateway = TestGateway::start_with(&database, config).await;
    for (name, event_type, subject) in [
        ("denied-out", "x.denied", "denied.{aggregate_id}"),
        ("allowed-out", "x.allowed", "allowed.{aggregate_id}"),
    ] {
        create_subscription(
            &gateway,
            proto::Subscription {
                event_types: vec![event_type.into()],
                ..sink_subscription(name, subject)
            },
        )
        .await;
    }
    let large = proto::EventInput {
        payload: vec![b'x'; 8 * 1024],
        content_type: "application/octet-stream".into(),
        ..event("big", "x.allowed")
    };
    publish(
        &gateway,
        vec![event("d-1", "x.denied"), large, event("small", "x.allowed")],
    )
    .await;

    eventually("the oversized event is dead-lettered", WAIT, || async {
        list_dead_letters(&gateway, "allowed-out").await.len() == 1
    })
    .await;
    let oversized = list_dead_letters(&gateway, "allowed-out").await.remove(0);
    assert!(
        oversized
            .last_error
            .contains("larger than the NATS server accepts"),
        "{}",
        oversized.last_error
    );
    eventually("the small event is acked", WAIT, || async {
        subscription_stats(&gateway, "allowed-out")
            .await
            .acked_total
            == 1
    })
    .await;
    // A denied publish is dropped by the server without an answer: it shows once the
    // confirmation is overdue (10 s).
    eventually("the denied event is dead-lettered", WAIT * 2, || async {
        list_dead_letters(&gateway, "denied-out").await.len() == 1
    })
    .await;
    let denied = list_dead_letters(&gateway, "denied-out").await.remove(0);
    assert!(
        denied
            .last_error
            .to_lowercase()
            .contains("permissions violation"),
        "{}",
        denied.last_error
    );
    assert_eq!(denied.attempts, 1);
    drop(nats);
    let _ = std::fs::remove_dir_all(&store);
}

#[tokio::test]
async fn two_gateways_share_a_sink_and_a_killed_ones_re_sends_are_dropped_by_jetstream() {
    let database = TestDatabase::create().await;
    let prefix = database.name().to_owned();
    let stream = TestStream::create(SHARED_NATS, &prefix).await;
    let config_file = std::env::temp_dir().join(format!("{prefix}-sinks.toml"));
    std::fs::write(
        &config_file,
        format!("[[sinks]]\nname = \"js\"\nkind = \"nats\"\nservers = [\"{SHARED_NATS}\"]\n"),
    )
    .unwrap();
    let config_argument = config_file.to_str().expect("a UTF-8 path");
    let arguments = ["--config", config_argument, "--metrics-listen", "off"];
    let (mut doomed, _doomed_log, _, doomed_channel) =
        start_gateway_process(&database, &arguments).await;
    let (mut survivor, survivor_log, _, survivor_channel) = start_gateway_process(
        &database,
        &[
            "--config",
            config_argument,
            "--metrics-listen",
            "127.0.0.1:0",
        ],
    )
    .await;
    let metrics = survivor_log
        .announced("serving metrics", &mut survivor)
        .await;
    proto::admin_client::AdminClient::new(doomed_channel.clone())
        .create_subscription(proto::CreateSubscriptionRequest {
            subscription: Some(proto::Subscription {
                ack_deadline: seconds(2),
                ..sink_subscription("shared-out", &format!("{prefix}.{{aggregate_id}}"))
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
    eventually("the stream holds the first events", WAIT, || async {
        stream.stored().await >= 100
    })
    .await;
    // Killed mid-flow: what it published but had not acked yet goes out again.
    doomed.start_kill().expect("SIGKILL");
    doomed.wait().await.unwrap();

    let admin = proto::admin_client::AdminClient::new(survivor_channel);
    eventually("the survivor settles every event", WAIT * 2, || async {
        let stats = stats_through(admin.clone(), "shared-out").await;
        stats.lag_events == 0 && stats.acked_total >= 1000
    })
    .await;
    let messages = stream.read().await;
    let ids: std::collections::HashSet<String> = messages
        .iter()
        .map(|message| header(message, "Nats-Msg-Id").unwrap())
        .collect();
    assert_eq!(ids.len(), 1000, "every event is in the stream");
    assert_eq!(messages.len(), 1000, "and none twice");

    // The survivor counts what it sent by outcome, and how long each took.
    let scrape_url = format!("http://{metrics}/metrics");
    let counted = |text: &str, outcome: &str| -> Option<f64> {
        text.lines()
            .find(|line| {
                line.starts_with("outbox_sink_messages_total{")
                    && line.contains("subscription=\"shared-out\"")
                    && line.contains("sink=\"js\"")
                    && line.contains(&format!("outcome=\"{outcome}\""))
            })
            .and_then(|line| line.rsplit_once(' '))
            .and_then(|(_, value)| value.parse().ok())
    };
    eventually(
        "the sink metrics count the survivor's messages",
        WAIT,
        || async {
            let Ok(response) = reqwest::get(&scrape_url).await else {
                return false;
            };
            let text = response.text().await.unwrap_or_default();
            counted(&text, "confirmed").is_some_and(|confirmed| confirmed >= 1.0)
                && counted(&text, "refused") == Some(0.0)
                && text.lines().any(|line| {
                    line.starts_with("outbox_sink_duration_seconds_count{")
                        && line.contains("subscription=\"shared-out\"")
                })
        },
    )
    .await;
    stream.delete().await;
    let _ = std::fs::remove_file(&config_file);
}

#[tokio::test]
async fn a_transform_shapes_what_reaches_the_broker() {
    let database = TestDatabase::create().await;
    let gateway = gateway_with_sink(&database, SHARED_NATS).await;
    let prefix = database.name().to_owned();
    let stream = TestStream::create(SHARED_NATS, &prefix).await;
    let subscription = proto::Subscription {
        transform: r#"{"order": aggregate_id, "kind": event_type}"#.into(),
        ..sink_subscription("trimmed-out", &format!("{prefix}.{{aggregate_type}}"))
    };
    create_subscription(&gateway, subscription).await;
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    eventually("the message is stored", WAIT, || async {
        stream.stored().await == 1
    })
    .await;
    let messages = stream.read().await;
    let payload: serde_json::Value =
        serde_json::from_slice(&messages[0].payload).expect("a JSON payload");
    assert_eq!(
        payload,
        serde_json::json!({"order": "o-1", "kind": "order.created"})
    );
    assert_eq!(
        header(&messages[0], "content-type").as_deref(),
        Some("application/json")
    );
}

/// Whether `subscriber` holds a message now, after a round trip to the server.
async fn has_pending(client: &async_nats::Client, subscriber: &mut async_nats::Subscriber) -> bool {
    use futures_util::{FutureExt, StreamExt};
    client.flush().await.expect("flush");
    subscriber.next().now_or_never().is_some()
}

#[tokio::test]
async fn an_aggregate_type_of_inbox_is_escaped_and_never_reaches_a_request_reply_inbox() {
    let database = TestDatabase::create().await;
    let gateway = gateway_with_sink(&database, SHARED_NATS).await;
    let prefix = database.name().to_owned();
    // Someone waiting for a reply on an inbox whose subject the event could spell.
    let client = async_nats::connect(SHARED_NATS).await.expect("connect");
    let mut inbox = client
        .subscribe(format!("_INBOX.{prefix}"))
        .await
        .expect("subscribe to the inbox");
    client.flush().await.expect("flush");
    let escaped = TestStream::create(SHARED_NATS, &format!("%5FINBOX.{prefix}")).await;
    create_subscription(
        &gateway,
        sink_subscription("by-type", "{aggregate_type}.{aggregate_id}.{event_type}"),
    )
    .await;
    publish(
        &gateway,
        vec![proto::EventInput {
            aggregate_type: "_INBOX".into(),
            ..event(&prefix, "created")
        }],
    )
    .await;

    eventually(
        "the event is stored under the escaped subject",
        WAIT,
        || async { escaped.stored().await == 1 },
    )
    .await;
    let stored = escaped.read().await;
    assert_eq!(
        stored[0].subject.as_str(),
        format!("%5FINBOX.{prefix}.created")
    );
    eventually("the delivery is acked", WAIT, || async {
        subscription_stats(&gateway, "by-type").await.acked_total == 1
    })
    .await;
    let stats = subscription_stats(&gateway, "by-type").await;
    assert_eq!(stats.sink_sent_total, 1, "sent once, there: {stats:?}");
    assert!(list_dead_letters(&gateway, "by-type").await.is_empty());
    assert!(
        !has_pending(&client, &mut inbox).await,
        "nothing reached the inbox"
    );
    escaped.delete().await;
}

#[tokio::test]
async fn a_tokens_placeholder_lets_subscribers_match_event_types_with_wildcards() {
    let database = TestDatabase::create().await;
    let gateway = gateway_with_sink(&database, SHARED_NATS).await;
    let prefix = database.name().to_owned();
    let stream = TestStream::create(SHARED_NATS, &prefix).await;
    let client = async_nats::connect(SHARED_NATS).await.expect("connect");
    let mut orders = client
        .subscribe(format!("{prefix}.order.*"))
        .await
        .expect("subscribe with a wildcard");
    client.flush().await.expect("flush");
    let created = create_subscription(
        &gateway,
        sink_subscription("by-tokens", &format!("{prefix}.{{event_type:tokens}}")),
    )
    .await;
    assert_eq!(
        created.sink.unwrap().subject,
        format!("{prefix}.{{event_type:tokens}}")
    );
    publish(
        &gateway,
        [
            "order.created",
            "invoice.paid",
            "order.line.added",
            "order.shipped",
        ]
        .into_iter()
        .map(|event_type| event("o-1", event_type))
        .collect(),
    )
    .await;

    let mut matched = Vec::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    while matched.len() < 2 {
        use futures_util::StreamExt;
        let message = tokio::time::timeout_at(deadline, orders.next())
            .await
            .expect("two messages match order.* in time")
            .expect("the subscription is open");
        matched.push(message.subject.to_string());
    }
    matched.sort();
    assert_eq!(
        matched,
        [
            format!("{prefix}.order.created"),
            format!("{prefix}.order.shipped")
        ]
    );
    eventually("all four are stored", WAIT, || async {
        stream.stored().await == 4
    })
    .await;
    let mut subjects: Vec<String> = stream
        .read()
        .await
        .iter()
        .map(|message| message.subject.to_string())
        .collect();
    subjects.sort();
    assert_eq!(
        subjects,
        [
            format!("{prefix}.invoice.paid"),
            format!("{prefix}.order.created"),
            format!("{prefix}.order.line.added"),
            format!("{prefix}.order.shipped"),
        ]
    );
    assert!(
        !has_pending(&client, &mut orders).await,
        "order.* matches no other"
    );
    stream.delete().await;
}

#[tokio::test]
async fn a_sink_subscription_outlasts_a_jetstream_outage_without_setting_max_attempts() {
    let database = TestDatabase::create().await;
    let store = std::env::temp_dir().join(format!("{}-nats-no-js", database.name()));
    let _ = std::fs::remove_dir_all(&store);
    // A server without JetStream, as while JetStream restarts: every send fails at
    // once, as worth retrying.
    let arguments = ["-a", "127.0.0.1", "-p", "-1"];
    let nats = OwnNats::start_with(store.clone(), arguments.map(String::from).to_vec()).await;
    let gateway = gateway_with_sink(&database, &nats.url()).await;
    // Created as operators do, without --max-attempts: the answer says what it got.
    let created = crate::cli::cli(
        &gateway,
        &[
            "subscriptions",
            "create",
            "patient",
            "--start",
            "earliest",
            "--sink",
            "js",
            "--subject",
            "patient.{aggregate_id}",
            "--retry-backoff-min",
            "1s",
            "--retry-backoff-max",
            "1s",
        ],
    )
    .await;
    assert!(created.success, "{}", created.stderr);
    let shown = created
        .stdout
        .lines()
        .find(|line| line.contains("max attempts"))
        .unwrap_or_default();
    assert!(shown.contains("0 (retries forever)"), "{}", created.stdout);
    let stored = gateway
        .admin()
        .await
        .get_subscription(proto::GetSubscriptionRequest {
            name: "patient".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        stored.max_attempts,
        Some(0),
        "sinks retry forever by default"
    );
    publish(&gateway, vec![event("o-1", "order.created")]).await;

    // More attempts than any other subscription gets by default, and still no dead letter.
    let pool = database.pool().await;
    let beyond =
        i32::try_from(outbox_gateway::domain::SubscriptionSettings::default().max_attempts)
            .unwrap();
    eventually(
        "the event is tried more often than the usual max_attempts",
        WAIT * 2,
        || async {
            let records = delivery_records(&pool, "patient").await;
            assert!(
                records.iter().all(|(_, state, _)| state != "dead"),
                "dead-lettered during the outage: {records:?}"
            );
            records.iter().any(|(_, _, attempt)| *attempt > beyond)
        },
    )
    .await;
    assert!(list_dead_letters(&gateway, "patient").await.is_empty());
    let stats = subscription_stats(&gateway, "patient").await;
    assert!(
        stats.sink_last_error.contains("JetStream"),
        "stats say why: {stats:?}"
    );
    // The status says so in plain words, naming the sink and its broker, not "behind".
    eventually("the status says the sink is unreachable", WAIT, || async {
        let stats = subscription_stats(&gateway, "patient").await;
        stats.status() == proto::SubscriptionStatus::SinkUnreachable
    })
    .await;
    let detail = subscription_stats(&gateway, "patient").await.status_detail;
    assert!(
        detail.starts_with("sink \"js\" cannot reach its broker (JetStream at ")
            && detail.contains(&nats.url()),
        "{detail}"
    );

    // JetStream is back: the event is stored and acked.
    let (store, port) = nats.stop().await;
    let nats = OwnNats::start(store.clone(), Some(port)).await;
    let stream = TestStream::create(&nats.url(), "patient").await;
    eventually(
        "the event is stored once JetStream is back",
        WAIT * 2,
        || async { stream.stored().await == 1 },
    )
    .await;
    eventually("the delivery is acked", WAIT, || async {
        subscription_stats(&gateway, "patient").await.acked_total == 1
    })
    .await;
    eventually("the status says the sink answers again", WAIT, || async {
        subscription_stats(&gateway, "patient").await.status()
            == proto::SubscriptionStatus::CaughtUp
    })
    .await;
    drop(nats);
    let _ = std::fs::remove_dir_all(&store);
}
