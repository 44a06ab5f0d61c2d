//! Inputs that the database once refused (and the gateway answered INTERNAL), durations
//! and timestamps that are not normalized, and oversized values that came back in full
//! inside the error: each is refused as INVALID_ARGUMENT naming its field, in a message
//! of bounded size, and changes nothing. The property tests in `faithful.rs` roam the
//! whole input space; these pin every case that was found, on every run.

use crate::common::*;
use outbox_gateway::proto;
use tonic::Code;

/// Every gateway error message fits in this, whatever the caller sent.
const MAX_MESSAGE_BYTES: usize = 1024;

/// Seconds since 1970 of 4714-11-24 BC, one day before PostgreSQL's first timestamp.
const BEFORE_POSTGRES: i64 = -210_866_889_601;
/// Seconds since 1970 of the year 300,000, past PostgreSQL's last timestamp.
const AFTER_POSTGRES: i64 = 9_404_975_635_200;

fn at(seconds: i64) -> Option<prost_types::Timestamp> {
    Some(prost_types::Timestamp { seconds, nanos: 0 })
}

/// A duration as sent, normalized or not.
fn duration(seconds: i64, nanos: i32) -> Option<prost_types::Duration> {
    Some(prost_types::Duration { seconds, nanos })
}

fn refused<T: std::fmt::Debug>(what: &str, answer: Result<T, tonic::Status>, field: &str) {
    match answer {
        Ok(value) => panic!("{what}: expected INVALID_ARGUMENT naming {field:?}, got {value:?}"),
        Err(status) => {
            assert_eq!(status.code(), Code::InvalidArgument, "{what}: {status:?}");
            assert!(
                status.message().contains(field),
                "{what}: {:?} does not name {field:?}",
                status.message()
            );
            assert!(
                status.message().len() <= MAX_MESSAGE_BYTES,
                "{what}: a message of {} bytes",
                status.message().len()
            );
        }
    }
}

#[tokio::test]
async fn events_the_database_would_refuse_are_refused_by_field() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let mut publisher = gateway.publisher().await;
    let nested = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let cases: Vec<(&str, proto::EventInput, &str)> = vec![
        (
            "NUL in the aggregate type",
            proto::EventInput {
                aggregate_type: "ord\0er".into(),
                ..event("o-1", "order.created")
            },
            "events[0].aggregate_type",
        ),
        (
            "NUL in the aggregate id",
            event("o\u{0}1", "order.created"),
            "events[0].aggregate_id",
        ),
        (
            "NUL in the content type",
            proto::EventInput {
                content_type: "text/plain\0".into(),
                payload: b"hello".to_vec(),
                ..event("o-1", "order.created")
            },
            "events[0].content_type",
        ),
        (
            "a content type PostgreSQL lowercases otherwise",
            proto::EventInput {
                content_type: "application/vnd.\u{212A}+json".into(),
                ..event("o-1", "order.created")
            },
            "events[0].content_type",
        ),
        (
            "NUL in a metadata key",
            proto::EventInput {
                metadata: [("ten\0ant".to_owned(), "acme".to_owned())].into(),
                ..event("o-1", "order.created")
            },
            "events[0].metadata",
        ),
        (
            "NUL in a metadata value",
            proto::EventInput {
                metadata: [("tenant".to_owned(), "ac\0me".to_owned())].into(),
                ..event("o-1", "order.created")
            },
            "events[0].metadata",
        ),
        (
            "a metadata value over 1,024 bytes",
            proto::EventInput {
                metadata: [("tenant".to_owned(), "a".repeat(1025))].into(),
                ..event("o-1", "order.created")
            },
            "events[0].metadata[\"tenant\"]",
        ),
        (
            "invalid UTF-8 inside a JSON string",
            proto::EventInput {
                payload: b"{\"name\": \"\xff\xfe\"}".to_vec(),
                ..event("o-1", "order.created")
            },
            "events[0].payload",
        ),
        (
            "JSON nested 100,000 deep",
            proto::EventInput {
                payload: nested.into_bytes(),
                ..event("o-1", "order.created")
            },
            "events[0].payload",
        ),
        (
            "occurred_at before 4713 BC",
            proto::EventInput {
                occurred_at: at(BEFORE_POSTGRES),
                ..event("o-1", "order.created")
            },
            "events[0].occurred_at",
        ),
        (
            "occurred_at after the database's range",
            proto::EventInput {
                occurred_at: at(AFTER_POSTGRES),
                ..event("o-1", "order.created")
            },
            "events[0].occurred_at",
        ),
        (
            "occurred_at with nanos past a second",
            proto::EventInput {
                occurred_at: Some(prost_types::Timestamp {
                    seconds: 1_700_000_000,
                    nanos: 1_000_000_000,
                }),
                ..event("o-1", "order.created")
            },
            "events[0].occurred_at",
        ),
        (
            "deliver_at after the database's range",
            proto::EventInput {
                deliver_at: at(AFTER_POSTGRES),
                ..event("o-1", "order.created")
            },
            "events[0].deliver_at",
        ),
    ];
    for (what, input, field) in cases {
        let answer = publisher
            .publish(proto::PublishRequest {
                events: vec![input],
                ..Default::default()
            })
            .await;
        refused(what, answer, field);
    }
    assert_eq!(count_events(&database.pool().await).await, 0);
}

#[tokio::test]
async fn subscriptions_the_database_would_refuse_are_refused_by_field() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let mut admin = gateway.admin().await;
    let cases: Vec<(&str, proto::Subscription, &str)> = vec![
        (
            "NUL in a metadata_match key",
            proto::Subscription {
                metadata_match: [("ten\0ant".to_owned(), "acme".to_owned())].into(),
                ..subscription("orders")
            },
            "subscription.metadata_match",
        ),
        (
            "NUL in a metadata_match value",
            proto::Subscription {
                metadata_match: [("tenant".to_owned(), "ac\0me".to_owned())].into(),
                ..subscription("orders")
            },
            "subscription.metadata_match",
        ),
        (
            "NUL in an aggregate-type filter",
            proto::Subscription {
                aggregate_types: vec!["ord\0er".into()],
                ..subscription("orders")
            },
            "subscription.aggregate_types",
        ),
        (
            "a start time before 4713 BC",
            proto::Subscription {
                start: Some(proto::StartPosition {
                    position: Some(proto::start_position::Position::Time(
                        at(BEFORE_POSTGRES).unwrap(),
                    )),
                }),
                ..subscription("orders")
            },
            "start",
        ),
        (
            "max_attempts of 2^31",
            proto::Subscription {
                max_attempts: Some(1 << 31),
                ..subscription("orders")
            },
            "subscription.max_attempts",
        ),
        (
            "an ack deadline of 5 s + 2,000,000,000 ns",
            proto::Subscription {
                ack_deadline: duration(5, 2_000_000_000),
                ..subscription("orders")
            },
            "subscription.ack_deadline",
        ),
        (
            "a backoff of 5 s - 1 ns (mixed signs)",
            proto::Subscription {
                retry_backoff_min: duration(5, -1),
                ..subscription("orders")
            },
            "subscription.retry_backoff_min",
        ),
        (
            "a 10 KB name",
            subscription(&"n".repeat(10_000)),
            "subscription.name",
        ),
        (
            "5,000 event-type patterns of 250 bytes",
            proto::Subscription {
                event_types: huge_patterns(5000),
                ..subscription("orders")
            },
            "subscription.event_types",
        ),
        (
            "101 event-type patterns",
            proto::Subscription {
                event_types: (0..101).map(|i| format!("t{i}")).collect(),
                ..subscription("orders")
            },
            "subscription.event_types",
        ),
        (
            "100 patterns over 8 KiB",
            proto::Subscription {
                persistent_event_types: huge_patterns(100),
                ..subscription("orders")
            },
            "subscription.persistent_event_types",
        ),
        (
            "101 aggregate types",
            proto::Subscription {
                aggregate_types: (0..101).map(|i| format!("a{i}")).collect(),
                ..subscription("orders")
            },
            "subscription.aggregate_types",
        ),
        (
            "101 metadata_match pairs",
            proto::Subscription {
                metadata_match: (0..101)
                    .map(|i| (format!("k{i}"), "v".to_owned()))
                    .collect(),
                ..subscription("orders")
            },
            "subscription.metadata_match",
        ),
    ];
    for (what, input, field) in cases {
        let answer = admin
            .create_subscription(proto::CreateSubscriptionRequest {
                subscription: Some(input),
                validate_only: false,
            })
            .await;
        refused(what, answer, field);
    }
    let listed = admin
        .list_subscriptions(proto::ListSubscriptionsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(listed.subscriptions.is_empty(), "{listed:?}");

    create_subscription(&gateway, subscription("orders")).await;
    let answer = admin
        .update_subscription(proto::UpdateSubscriptionRequest {
            subscription: Some(proto::Subscription {
                event_types: huge_patterns(5000),
                ..subscription("orders")
            }),
            update_mask: Some(prost_types::FieldMask {
                paths: vec!["event_types".into()],
            }),
            validate_only: false,
        })
        .await;
    refused(
        "an update to 5,000 patterns",
        answer,
        "subscription.event_types",
    );
    let answer = admin
        .seek_subscription(proto::SeekSubscriptionRequest {
            subscription: "orders".into(),
            to: Some(proto::StartPosition {
                position: Some(proto::start_position::Position::Time(
                    at(AFTER_POSTGRES).unwrap(),
                )),
            }),
        })
        .await;
    refused("a seek time after the database's range", answer, "to");
    let answer = admin
        .get_subscription(proto::GetSubscriptionRequest {
            name: "n".repeat(10_000),
        })
        .await;
    refused("GetSubscription of a 10 KB name", answer, "name");
}

#[tokio::test]
async fn settlements_and_operations_the_database_would_refuse_are_refused_by_field() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("work")).await;
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    let mut consumer = Consumer::open(&gateway, "work", 10).await;
    let delivery = consumer
        .next(std::time::Duration::from_secs(15))
        .await
        .expect("a delivery");
    let mut subscriber = gateway.subscriber().await;
    let nack = |reason: &str, retry_after: Option<prost_types::Duration>| proto::NackRequest {
        subscription: "work".into(),
        ack_id: delivery.ack_id.clone(),
        reason: reason.into(),
        retry_after,
        dead_letter: false,
    };
    for (what, reason, retry_after, field) in [
        ("NUL in a nack reason", "bro\0ken", None, "reason"),
        (
            "a retry_after of 2^62 s",
            "later",
            duration(1 << 62, 0),
            "retry_after",
        ),
        (
            "a retry_after of 1 s + 1,000,000,000 ns",
            "later",
            duration(1, 1_000_000_000),
            "retry_after",
        ),
    ] {
        refused(
            what,
            subscriber.nack(nack(reason, retry_after)).await,
            field,
        );
    }
    refused(
        "an extension of 10 s + 2,000,000,000 ns",
        subscriber
            .extend_ack_deadline(proto::ExtendAckDeadlineRequest {
                subscription: "work".into(),
                ack_ids: vec![delivery.ack_id.clone()],
                extension: duration(10, 2_000_000_000),
            })
            .await,
        "extension",
    );

    let mut admin = gateway.admin().await;
    let requeue =
        |aggregate_type: &str, aggregate_id: &str, event_type: &str| proto::RequeueLatestRequest {
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            event_type: event_type.into(),
            ..Default::default()
        };
    for (what, request, field) in [
        (
            "NUL in RequeueLatest's aggregate type",
            requeue("ord\0er", "o-1", ""),
            "aggregate_type",
        ),
        (
            "NUL in RequeueLatest's aggregate id",
            requeue("order", "o\u{0}1", ""),
            "aggregate_id",
        ),
        (
            "NUL in RequeueLatest's event type",
            requeue("order", "o-1", "order.\0created"),
            "event_type",
        ),
        (
            "a pattern as RequeueLatest's event type",
            requeue("order", "o-1", "fx.*"),
            "event_type",
        ),
        (
            "a 1 MiB aggregate type in RequeueLatest",
            requeue(&"a".repeat(1 << 20), "o-1", "order.created"),
            "aggregate_type",
        ),
        (
            "a 1 MiB aggregate id in RequeueLatest",
            requeue("order", &"a".repeat(1 << 20), "order.created"),
            "aggregate_id",
        ),
    ] {
        refused(what, admin.requeue_latest(request).await, field);
    }
    let resolve = |resolved_by: &str, notes: &str| proto::ResolveDeadLettersRequest {
        subscription: "work".into(),
        all: true,
        resolved_by: resolved_by.into(),
        notes: notes.into(),
        ..Default::default()
    };
    refused(
        "NUL in resolved_by",
        admin.resolve_dead_letters(resolve("ops\0", "")).await,
        "resolved_by",
    );
    refused(
        "NUL in the notes",
        admin.resolve_dead_letters(resolve("ops", "fixed\0")).await,
        "notes",
    );
    refused(
        "NUL in a dead-letter selector",
        admin
            .list_dead_letters(proto::ListDeadLettersRequest {
                subscription: "work".into(),
                last_error: "time\0out".into(),
                ..Default::default()
            })
            .await,
        "last_error",
    );

    // The delivery's lease was untouched by every refusal: it acks cleanly.
    assert_eq!(
        ack(&gateway, "work", vec![delivery.ack_id]).await,
        Vec::<String>::new()
    );
}

/// `count` distinct literal patterns of 250 bytes: 5,000 of them make a regular
/// expression PostgreSQL refuses as too complex.
fn huge_patterns(count: usize) -> Vec<String> {
    (0..count)
        .map(|i| format!("t{i:04}{}", "x".repeat(245)))
        .collect()
}

/// Patterns at the bounds: 100 of them, 8,000 bytes in all, in the costliest shape.
fn patterns_at_the_limit() -> Vec<String> {
    (0..100)
        .map(|i| format!("t{i:02}.{}.**", vec!["*"; 37].join(".")))
        .collect()
}

#[tokio::test]
async fn filters_at_their_bounds_work_in_the_database() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let patterns = patterns_at_the_limit();
    assert_eq!(patterns.len(), 100);
    assert!(patterns.iter().map(String::len).sum::<usize>() <= 8 * 1024);
    let event_type = format!("t42.{}.x.y", vec!["s"; 37].join("."));
    create_subscription(
        &gateway,
        proto::Subscription {
            event_types: patterns.clone(),
            persistent_event_types: patterns,
            aggregate_types: (0..100).map(|i| format!("{i:0>80}")).collect(),
            start: Some(proto::StartPosition {
                position: Some(proto::start_position::Position::Boundary(
                    proto::Boundary::Earliest as i32,
                )),
            }),
            ..subscription("wide")
        },
    )
    .await;
    let aggregate = format!("{:0>80}", 42);
    publish(
        &gateway,
        vec![
            proto::EventInput {
                aggregate_type: aggregate.clone(),
                ..event("o-1", &event_type)
            },
            proto::EventInput {
                aggregate_type: aggregate,
                ..event("o-2", "other.type")
            },
        ],
    )
    .await;
    let mut consumer = Consumer::open(&gateway, "wide", 10).await;
    let delivery = consumer
        .next(std::time::Duration::from_secs(15))
        .await
        .expect("the matching event is delivered");
    assert_eq!(delivery.event.as_ref().unwrap().event_type, event_type);
    let stats = gateway
        .admin()
        .await
        .get_stats(proto::GetStatsRequest::default())
        .await
        .expect("stats of a subscription at the bounds")
        .into_inner();
    assert_eq!(stats.subscriptions[0].in_flight, 1, "{stats:?}");
    assert_eq!(stats.subscriptions[0].pending, 0, "{stats:?}");
}

/// The forms of one event id that parse as a UUID but are not its canonical text.
fn non_canonical(id: &uuid::Uuid) -> Vec<(&'static str, String)> {
    vec![
        ("braces", format!("{{{id}}}")),
        ("a URN", format!("urn:uuid:{id}")),
        ("no hyphens", id.simple().to_string()),
        ("upper case", id.to_string().to_uppercase()),
    ]
}

#[tokio::test]
async fn event_ids_are_taken_only_in_canonical_form() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("work")).await;
    let id = uuid::Uuid::now_v7();
    let mut publisher = gateway.publisher().await;
    for (form, text) in non_canonical(&id) {
        let answer = publisher
            .publish(proto::PublishRequest {
                events: vec![proto::EventInput {
                    id: text,
                    ..event("o-1", "order.created")
                }],
                ..Default::default()
            })
            .await;
        refused(&format!("Publish with {form}"), answer, "events[0].id");
    }
    assert_eq!(count_events(&database.pool().await).await, 0);

    publisher
        .publish(proto::PublishRequest {
            events: vec![proto::EventInput {
                id: id.to_string(),
                ..event("o-1", "order.created")
            }],
            ..Default::default()
        })
        .await
        .expect("the canonical form is taken");
    let mut admin = gateway.admin().await;
    admin
        .get_event(proto::GetEventRequest {
            id: id.to_string(),
            ..Default::default()
        })
        .await
        .expect("the canonical form finds the event");
    for (form, text) in non_canonical(&id) {
        let answer = admin
            .get_event(proto::GetEventRequest {
                id: text.clone(),
                ..Default::default()
            })
            .await;
        refused(&format!("GetEvent with {form}"), answer, "id");
        let answer = admin
            .requeue_event(proto::RequeueEventRequest {
                id: text.clone(),
                ..Default::default()
            })
            .await;
        refused(&format!("RequeueEvent with {form}"), answer, "id");
        let answer = admin
            .requeue_dead_letters(proto::RequeueDeadLettersRequest {
                subscription: "work".into(),
                ids: vec![text],
                ..Default::default()
            })
            .await;
        refused(&format!("RequeueDeadLetters with {form}"), answer, "ids[0]");
    }
}
