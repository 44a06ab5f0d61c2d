//! Filters and transforms that could stall a subscription or could never run: refused
//! when set, or bounded per event and counted as errors while the events behind them
//! are still delivered.

use std::time::{Duration, Instant};

use outbox_client::proto;
use tonic::Code;

use crate::common::*;

fn event(aggregate_id: &str, payload: serde_json::Value) -> proto::EventInput {
    proto::EventInput {
        aggregate_type: "order".into(),
        aggregate_id: aggregate_id.into(),
        event_type: "order.updated".into(),
        payload: payload.to_string().into_bytes(),
        ..Default::default()
    }
}

#[tokio::test]
async fn expressions_that_can_never_run_are_refused_alike_with_and_without_validate_only() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let mut admin = gateway.admin().await;
    let cases: [(&str, &str, &str); 4] = [
        (
            "filter",
            "event_type == \"a\0\"",
            "subscription.filter: must not contain the NUL character",
        ),
        (
            "transform",
            "{\"a\": event_type}\0",
            "subscription.transform: must not contain the NUL character",
        ),
        (
            "filter",
            r#"event_type.matches("(a")"#,
            "the pattern \"(a\" is not a valid regular expression",
        ),
        (
            "filter",
            r#"event_type.matches("\\w{1000}")"#,
            "compiles to more than the regular expression engine's limit",
        ),
    ];
    for (field, text, needle) in cases {
        for validate_only in [true, false] {
            let mut subscription = subscription("refused");
            match field {
                "filter" => subscription.filter = text.into(),
                _ => subscription.transform = text.into(),
            }
            let result = admin
                .create_subscription(proto::CreateSubscriptionRequest {
                    subscription: Some(subscription),
                    validate_only,
                })
                .await;
            let status = result.expect_err(text);
            assert_eq!(status.code(), Code::InvalidArgument, "{text}: {status:?}");
            assert!(status.message().contains(needle), "{text}: {status:?}");
            assert!(!status.message().contains("Error("), "{text}: {status:?}");
        }
    }
    let listed = admin
        .list_subscriptions(proto::ListSubscriptionsRequest::default())
        .await
        .expect("list")
        .into_inner();
    assert!(listed.subscriptions.is_empty(), "nothing stored");
}

#[tokio::test]
async fn a_filter_over_its_budget_counts_errors_and_the_subscription_keeps_delivering() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    // Doubles a 60 KB string ten times over unless stopped, and matches a pattern that
    // costs a tenth of a second to compile: the events it cannot afford are passed over
    // as errors, the others are delivered.
    let filter = format!(
        "payload.cheap || ([payload.text]{}.size() > 0 && \
         !event_type.matches(\"\\\\w{{100}}\"))",
        ".map(x, x + x)".repeat(10)
    );
    create_subscription(
        &gateway,
        proto::Subscription {
            filter: filter.clone(),
            ..subscription("bounded")
        },
    )
    .await;
    let text = "x".repeat(60_000);
    let mut events: Vec<proto::EventInput> = (0..30)
        .map(|i| {
            event(
                &format!("costly-{i}"),
                serde_json::json!({"cheap": false, "text": text}),
            )
        })
        .collect();
    events.push(event(
        "cheap",
        serde_json::json!({"cheap": true, "text": ""}),
    ));
    publish(&gateway, events).await;

    let started = Instant::now();
    let mut consumer = Consumer::open(&gateway, "bounded", 10).await;
    let delivery = consumer
        .next(Duration::from_secs(30))
        .await
        .expect("the cheap event is delivered past the costly ones");
    assert_eq!(aggregate_of(&delivery), "cheap");
    ack_all(&gateway, "bounded", vec![delivery.ack_id]).await;
    let stats = subscription_stats(&gateway, "bounded").await;
    assert_eq!(stats.filter_errors_total, 30, "{stats:?}");
    assert!(
        stats.last_filter_error.contains("exceeded its cost budget")
            || stats.last_filter_error.contains("deadline of its budget"),
        "{stats:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
}

/// A transform's result is capped at the gateway's `--max-payload-bytes`: what it would
/// make larger is dead-lettered with the reason, and what fits is delivered.
#[tokio::test]
async fn a_transform_larger_than_the_payload_limit_is_dead_lettered_with_the_reason() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.limits.max_payload_bytes = 2_000;
    let gateway = TestGateway::start_with(&database, config).await;
    let doubled = proto::Subscription {
        transform: r#"{"twice": [payload.text, payload.text]}"#.into(),
        ..subscription("doubled")
    };
    create_subscription(&gateway, doubled).await;
    publish(
        &gateway,
        vec![
            event("large", serde_json::json!({"text": "x".repeat(1_500)})),
            event("small", serde_json::json!({"text": "x".repeat(10)})),
        ],
    )
    .await;
    let mut consumer = Consumer::open(&gateway, "doubled", 10).await;
    let delivered = consumer.take(1, Duration::from_secs(15)).await;
    assert_eq!(aggregate_of(&delivered[0]), "small");
    eventually(
        "the event it would make too large is dead-lettered",
        Duration::from_secs(15),
        || async { !list_dead_letters(&gateway, "doubled").await.is_empty() },
    )
    .await;
    let dead = list_dead_letters(&gateway, "doubled").await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].event.as_ref().unwrap().aggregate_id, "large");
    assert!(
        dead[0].last_error.contains("at most 2000 bytes"),
        "{}",
        dead[0].last_error
    );
}
