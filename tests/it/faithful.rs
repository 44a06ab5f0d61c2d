//! Whatever the protobuf allows a caller to send — any string, any bytes, any number —
//! is either accepted and stored exactly as sent, or refused with INVALID_ARGUMENT and
//! nothing written. Never INTERNAL: the database must not be the one to refuse it.

use std::{collections::BTreeMap, time::Duration};

use crate::common::*;
use outbox_gateway::proto;
use proptest::{
    prelude::*,
    strategy::ValueTree,
    test_runner::{Config as ProptestConfig, TestRng, TestRunner},
};
use sqlx::{PgPool, Row};
use tonic::Code;

/// Strings as a careless or hostile caller sends them: any Unicode, control characters,
/// NUL, the Kelvin sign that PostgreSQL lowercases to "k", and long runs.
fn any_text() -> impl Strategy<Value = String> {
    prop_oneof![
        12 => "[a-z0-9é_ -]{1,12}",
        4 => ".{0,12}",
        1 => "[a-z]{0,4}\u{0}[a-z]{0,4}",
        1 => "[\u{1}-\u{1f}\u{7f}]{1,6}",
        1 => "\u{212A}{1,3}",
        1 => "[a-zé]{250,300}",
    ]
}

fn any_payload() -> impl Strategy<Value = (String, Vec<u8>)> {
    let json_type = prop_oneof![
        6 => Just(String::new()),
        2 => Just("application/octet-stream".to_owned()),
        1 => Just("application/json".to_owned()),
        1 => Just("Application/JSON; charset=utf-8".to_owned()),
        1 => Just("application/vnd.\u{212A}+json".to_owned()),
        1 => Just("application/json\t".to_owned()),
        1 => any_text(),
    ];
    let body = prop_oneof![
        6 => Just(br#"{"total": 42}"#.to_vec()),
        3 => proptest::collection::vec(any::<u8>(), 0..40),
        2 => Just(br#"{"total": 42, "items": ["a", "\u0000", "\ud800"]}"#.to_vec()),
        1 => Just(b"{\"name\": \"\xff\xfe\"}".to_vec()),
        1 => (1usize..700).prop_map(|depth| format!("{}{}", "[".repeat(depth), "]".repeat(depth)).into_bytes()),
        1 => Just(format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)).into_bytes()),
    ];
    (json_type, body)
}

fn any_timestamp() -> impl Strategy<Value = Option<prost_types::Timestamp>> {
    let seconds = prop_oneof![
        3 => -100_000_000_000i64..400_000_000_000,
        1 => any::<i64>(),
        1 => Just(-210_866_803_201i64),
    ];
    let nanos = prop_oneof![3 => 0i32..1_000_000_000, 1 => any::<i32>()];
    proptest::option::weighted(
        0.3,
        (seconds, nanos).prop_map(|(seconds, nanos)| prost_types::Timestamp { seconds, nanos }),
    )
}

fn any_duration() -> impl Strategy<Value = Option<prost_types::Duration>> {
    let seconds = prop_oneof![12 => 1i64..600, 1 => any::<i64>(), 1 => Just(1i64 << 62)];
    let nanos = prop_oneof![12 => 0i32..1_000_000_000, 1 => any::<i32>()];
    proptest::option::of(
        (seconds, nanos).prop_map(|(seconds, nanos)| prost_types::Duration { seconds, nanos }),
    )
}

fn any_event() -> impl Strategy<Value = proto::EventInput> {
    (
        any_text(),
        any_text(),
        proptest::option::of(any::<i64>()),
        prop_oneof![3 => Just("order.created".to_owned()), 1 => any_text()],
        any_payload(),
        proptest::collection::btree_map(any_text(), any_text(), 0..2),
        (any_timestamp(), any_timestamp(), any_timestamp()),
    )
        .prop_map(
            |(
                aggregate_type,
                aggregate_id,
                version,
                event_type,
                (content_type, payload),
                metadata,
                (occurred_at, deliver_at, expires_at),
            )| {
                proto::EventInput {
                    id: uuid::Uuid::new_v4().to_string(),
                    aggregate_type,
                    aggregate_id,
                    aggregate_version: version,
                    event_type,
                    payload,
                    content_type,
                    metadata: metadata.into_iter().collect(),
                    occurred_at,
                    deliver_at,
                    expires_at,
                }
            },
        )
}

/// Draws `count` values with a seed printed on failure.
fn draw<S: Strategy>(strategy: S, count: usize, seed: u64) -> Vec<S::Value> {
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let mut runner = TestRunner::new_with_rng(
        ProptestConfig::default(),
        TestRng::from_seed(proptest::test_runner::RngAlgorithm::ChaCha, &seed_bytes),
    );
    (0..count)
        .map(|_| strategy.new_tree(&mut runner).expect("generates").current())
        .collect()
}

/// A refusal must be INVALID_ARGUMENT naming one of `fields`, in a bounded message.
#[track_caller]
fn assert_refused_as_invalid(status: &tonic::Status, what: &str, fields: &[&str], seed: u64) {
    assert_eq!(
        status.code(),
        Code::InvalidArgument,
        "{what} was answered {status:?} (seed {seed})"
    );
    assert!(
        fields.iter().any(|field| status.message().contains(field)),
        "{what}: {:?} names none of {fields:?} (seed {seed})",
        status.message()
    );
    assert!(
        status.message().len() <= 1100,
        "{what}: message of {} bytes (seed {seed})",
        status.message().len()
    );
}

/// A timestamp as the database stores it: to the microsecond.
fn stored_time(timestamp: prost_types::Timestamp) -> chrono::DateTime<chrono::Utc> {
    chrono::DateTime::from_timestamp(timestamp.seconds, timestamp.nanos as u32 / 1000 * 1000)
        .expect("an accepted time is representable")
}

async fn stored_event(pool: &PgPool, id: &str) -> Option<sqlx::postgres::PgRow> {
    sqlx::query(
        "SELECT aggregate_type, aggregate_id, aggregate_version, event_type, payload, \
                content_type, metadata::text AS metadata, occurred_at, deliver_at, expires_at \
         FROM outbox_events WHERE id = $1::uuid",
    )
    .bind(id)
    .fetch_optional(pool)
    .await
    .expect("read event")
}

#[tokio::test]
async fn any_published_event_is_stored_faithfully_or_refused_as_invalid() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let pool = database.pool().await;
    let mut publisher = gateway.publisher().await;
    let seed = rand::random();
    let (mut accepted, mut refused) = (0, 0);
    for input in draw(any_event(), 300, seed) {
        let answer = publisher
            .publish(proto::PublishRequest {
                events: vec![input.clone()],
                ..Default::default()
            })
            .await;
        let stored = stored_event(&pool, &input.id).await;
        let Ok(_) = answer else {
            let status = answer.unwrap_err();
            assert_refused_as_invalid(&status, &format!("{input:?}"), &["events[0]."], seed);
            assert!(stored.is_none(), "refused but stored: {input:?}");
            refused += 1;
            continue;
        };
        accepted += 1;
        let row = stored.unwrap_or_else(|| panic!("accepted but not stored: {input:?}"));
        let text = |column: &str| row.get::<String, _>(column);
        assert_eq!(text("aggregate_type"), input.aggregate_type, "seed {seed}");
        assert_eq!(text("aggregate_id"), input.aggregate_id, "seed {seed}");
        assert_eq!(text("event_type"), input.event_type, "seed {seed}");
        assert_eq!(
            row.get::<Option<i64>, _>("aggregate_version"),
            input.aggregate_version
        );
        assert_eq!(
            row.get::<Vec<u8>, _>("payload"),
            input.payload,
            "seed {seed}"
        );
        let content_type = if input.content_type.is_empty() {
            "application/json"
        } else {
            &input.content_type
        };
        assert_eq!(text("content_type"), content_type, "seed {seed}");
        let metadata: BTreeMap<String, String> =
            serde_json::from_str(&text("metadata")).expect("metadata is a JSON object");
        let sent: BTreeMap<String, String> = input.metadata.clone().into_iter().collect();
        assert_eq!(metadata, sent, "seed {seed}");
        if let Some(occurred_at) = input.occurred_at {
            let stored: chrono::DateTime<chrono::Utc> = row.get("occurred_at");
            assert_eq!(
                stored,
                stored_time(occurred_at),
                "occurred_at of {input:?} (seed {seed})"
            );
        }
        for (column, sent) in [
            ("deliver_at", input.deliver_at),
            ("expires_at", input.expires_at),
        ] {
            let stored: Option<chrono::DateTime<chrono::Utc>> = row.get(column);
            assert_eq!(
                stored,
                sent.map(stored_time),
                "{column} of {input:?} (seed {seed})"
            );
        }
    }
    // Both sides, each many times; a draw gave exactly 20 accepted once, so the bound
    // leaves the random draws room.
    assert!(
        accepted >= 10 && refused >= 10,
        "{accepted} accepted, {refused} refused (seed {seed})"
    );
}

fn any_subscription() -> impl Strategy<Value = proto::Subscription> {
    (
        proptest::collection::vec(any_text(), 0..2),
        proptest::collection::btree_map(any_text(), any_text(), 0..2),
        (any_duration(), any_duration(), any_duration()),
        proptest::option::of(prop_oneof![6 => 0u32..100, 1 => any::<u32>()]),
        any_timestamp(),
    )
        .prop_map(
            |(
                aggregate_types,
                metadata_match,
                (ack_deadline, backoff_min, backoff_max),
                max_attempts,
                start,
            )| {
                proto::Subscription {
                    name: format!("s-{}", uuid::Uuid::new_v4().simple()),
                    aggregate_types,
                    metadata_match: metadata_match.into_iter().collect(),
                    ack_deadline,
                    retry_backoff_min: backoff_min,
                    retry_backoff_max: backoff_max,
                    max_attempts,
                    start: start.map(|time| proto::StartPosition {
                        position: Some(proto::start_position::Position::Time(time)),
                    }),
                    ..Default::default()
                }
            },
        )
}

/// Milliseconds of a protobuf duration as the gateway stores it.
fn millis(duration: prost_types::Duration) -> i64 {
    duration.seconds * 1000 + i64::from(duration.nanos) / 1_000_000
}

#[tokio::test]
async fn any_subscription_is_stored_faithfully_or_refused_as_invalid() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let pool = database.pool().await;
    let mut admin = gateway.admin().await;
    let seed = rand::random();
    let (mut accepted, mut refused) = (0, 0);
    for input in draw(any_subscription(), 200, seed) {
        let answer = admin
            .create_subscription(proto::CreateSubscriptionRequest {
                subscription: Some(input.clone()),
                validate_only: false,
            })
            .await;
        let stored = sqlx::query(
            "SELECT aggregate_types, metadata_match::text AS metadata_match, ack_deadline_ms, \
                    max_attempts, retry_backoff_min_ms, retry_backoff_max_ms \
             FROM outbox_subscriptions WHERE name = $1",
        )
        .bind(&input.name)
        .fetch_optional(&pool)
        .await
        .unwrap();
        let Ok(_) = answer else {
            assert_refused_as_invalid(
                &answer.unwrap_err(),
                &format!("{input:?}"),
                &["subscription.", "start"],
                seed,
            );
            assert!(stored.is_none(), "refused but stored: {input:?}");
            refused += 1;
            continue;
        };
        accepted += 1;
        let row = stored.unwrap_or_else(|| panic!("accepted but not stored: {input:?}"));
        assert_eq!(
            row.get::<Vec<String>, _>("aggregate_types"),
            input.aggregate_types
        );
        let metadata: BTreeMap<String, String> =
            serde_json::from_str(&row.get::<String, _>("metadata_match")).unwrap();
        assert_eq!(metadata, input.metadata_match.clone().into_iter().collect());
        let defaults = [
            ("ack_deadline_ms", input.ack_deadline, 30_000),
            ("retry_backoff_min_ms", input.retry_backoff_min, 1_000),
            ("retry_backoff_max_ms", input.retry_backoff_max, 900_000),
        ];
        for (column, sent, default) in defaults {
            assert_eq!(
                row.get::<i64, _>(column),
                sent.map_or(default, millis),
                "{column} of {input:?} (seed {seed})"
            );
        }
        assert_eq!(
            row.get::<i32, _>("max_attempts") as u32,
            input.max_attempts.unwrap_or(10)
        );
    }
    // Both sides, each many times; a draw gave exactly 20 accepted once, so the bound
    // leaves the random draws room.
    assert!(
        accepted >= 10 && refused >= 10,
        "{accepted} accepted, {refused} refused (seed {seed})"
    );
}

/// Nack reasons and delays, resolution notes, requeue keys and seek times: stored as
/// sent or refused as INVALID_ARGUMENT.
#[tokio::test]
async fn any_operator_or_consumer_input_is_stored_faithfully_or_refused_as_invalid() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let pool = database.pool().await;
    let seed = rand::random();
    let mut sub = subscription("orders");
    sub.max_attempts = Some(1);
    create_subscription(&gateway, sub).await;
    let count = 60;
    publish(
        &gateway,
        (0..count)
            .map(|i| event(&format!("o-{i}"), "order.created"))
            .collect(),
    )
    .await;
    let mut consumer = Consumer::open(&gateway, "orders", count as u32).await;
    let deliveries = consumer.take(count, Duration::from_secs(10)).await;
    let mut subscriber = gateway.subscriber().await;
    let mut admin = gateway.admin().await;
    let inputs = draw(
        (
            any_text(),
            any_duration(),
            any_text(),
            any_text(),
            any_timestamp(),
        ),
        count,
        seed,
    );
    let mut nacked = 0;
    for (delivery, (reason, retry_after, resolved_by, notes, seek_to)) in
        deliveries.iter().zip(inputs)
    {
        let event_id = delivery.event.as_ref().unwrap().id.clone();
        let answer = subscriber
            .nack(proto::NackRequest {
                subscription: "orders".into(),
                ack_id: delivery.ack_id.clone(),
                reason: reason.clone(),
                retry_after,
                dead_letter: true,
            })
            .await;
        let last_error: Option<Option<String>> = sqlx::query_scalar(
            "SELECT d.last_error FROM outbox_delivery_records d JOIN outbox_events e USING (position) \
             WHERE e.id = $1::uuid",
        )
        .bind(&event_id)
        .fetch_optional(&pool)
        .await
        .unwrap();
        match answer {
            Ok(_) => {
                nacked += 1;
                assert_eq!(last_error, Some(Some(reason.clone())), "seed {seed}");
            }
            Err(status) => {
                assert_refused_as_invalid(
                    &status,
                    &format!("nack {reason:?} {retry_after:?}"),
                    &["reason", "retry_after"],
                    seed,
                );
                assert_eq!(last_error, Some(None), "a refused nack changed nothing");
                continue;
            }
        }
        let resolved = admin
            .resolve_dead_letter(proto::ResolveDeadLetterRequest {
                subscription: "orders".into(),
                id: event_id.clone(),
                resolved_by: resolved_by.clone(),
                notes: notes.clone(),
                ..Default::default()
            })
            .await;
        match resolved {
            Ok(dead_letter) => {
                let dead_letter = dead_letter.into_inner();
                assert_eq!(
                    (dead_letter.resolved_by, dead_letter.notes),
                    (resolved_by, notes)
                );
            }
            Err(status) => assert_refused_as_invalid(
                &status,
                &format!("resolve {resolved_by:?} {notes:?}"),
                &["resolved_by", "notes"],
                seed,
            ),
        }
        let requeued = admin
            .requeue_latest(proto::RequeueLatestRequest {
                aggregate_type: reason.clone(),
                aggregate_id: format!("{reason}-1"),
                event_type: "order.created".into(),
                subscription: String::new(),
                ..Default::default()
            })
            .await;
        if let Err(status) = requeued
            && status.code() != Code::NotFound
        {
            assert_refused_as_invalid(
                &status,
                &format!("requeue_latest {reason:?}"),
                &["aggregate_type", "aggregate_id"],
                seed,
            );
        }
        if let Some(time) = seek_to {
            let sought = admin
                .seek_subscription(proto::SeekSubscriptionRequest {
                    subscription: "orders".into(),
                    to: Some(proto::StartPosition {
                        position: Some(proto::start_position::Position::Time(time)),
                    }),
                })
                .await;
            if let Err(status) = sought {
                assert_refused_as_invalid(&status, &format!("seek to {time:?}"), &["to"], seed);
            }
        }
    }
    assert!(nacked > 5, "only {nacked} nacks accepted (seed {seed})");
}
