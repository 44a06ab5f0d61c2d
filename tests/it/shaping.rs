//! What each consumer receives: transaction ids, CEL filters on the event's content and
//! transforms of the delivered payload.

use std::{collections::HashMap, time::Duration};

use outbox_client::proto;
use tonic::Code;

use crate::common::*;

const WAIT: Duration = Duration::from_secs(20);

/// An order event of `tenant` whose payload is `payload`.
fn order(aggregate_id: &str, tenant: &str, payload: serde_json::Value) -> proto::EventInput {
    proto::EventInput {
        aggregate_type: "order".into(),
        aggregate_id: aggregate_id.into(),
        event_type: "order.updated".into(),
        payload: payload.to_string().into_bytes(),
        metadata: [("tenant".to_owned(), tenant.to_owned())].into(),
        ..Default::default()
    }
}

fn filtered(name: &str, filter: &str) -> proto::Subscription {
    proto::Subscription {
        filter: filter.into(),
        ..subscription(name)
    }
}

/// The aggregate ids of everything delivered until nothing more comes for a while.
async fn drain(consumer: &mut Consumer, gateway: &TestGateway, name: &str) -> Vec<String> {
    let mut ids = Vec::new();
    while let Some(delivery) = consumer.next(Duration::from_secs(3)).await {
        ids.push(aggregate_of(&delivery));
        ack_all(gateway, name, vec![delivery.ack_id]).await;
    }
    ids
}

async fn update(
    gateway: &TestGateway,
    subscription: proto::Subscription,
    paths: &[&str],
) -> Result<proto::Subscription, tonic::Status> {
    gateway
        .admin()
        .await
        .update_subscription(proto::UpdateSubscriptionRequest {
            subscription: Some(subscription),
            update_mask: Some(prost_types::FieldMask {
                paths: paths.iter().map(|p| p.to_string()).collect(),
            }),
            validate_only: false,
        })
        .await
        .map(|response| response.into_inner())
}

#[tokio::test]
async fn a_filter_selects_by_content_and_passes_over_the_rest_without_records() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let examples = [
        (
            "big",
            r#"payload.total > 1000.0 && metadata.tenant == "acme""#,
        ),
        ("changed", "payload.status != payload.previous_status"),
        ("vip", "has(payload.customer.vip) && payload.customer.vip"),
        (
            "many",
            r#"event_type.startsWith("order.") && size(payload.items) > 3"#,
        ),
    ];
    for (name, filter) in examples {
        let created = create_subscription(&gateway, filtered(name, filter)).await;
        assert_eq!(created.filter, filter);
    }
    let full = |total: i64, status: &str, vip: bool, items: usize| {
        serde_json::json!({"total": total, "status": status, "previous_status": "new",
                           "customer": {"vip": vip}, "items": vec![1; items]})
    };
    let mut binary = order("o-binary", "acme", serde_json::json!({}));
    binary.payload = vec![0xff, 0x00, 0x01];
    binary.content_type = "application/octet-stream".into();
    publish(
        &gateway,
        vec![
            order("o-1", "acme", full(1500, "paid", true, 5)),
            order("o-2", "other", full(1500, "new", false, 1)),
            order("o-3", "acme", full(10, "new", false, 4)),
            // No customer, no total, no items: errors where read without `has()`.
            order(
                "o-4",
                "acme",
                serde_json::json!({"status": "new", "previous_status": "new"}),
            ),
            binary,
        ],
    )
    .await;

    let expected: [(&str, &[&str], u64, u64); 4] = [
        // name, delivered, passed over, of them on errors
        ("big", &["o-1"], 4, 2),
        ("changed", &["o-1"], 4, 1),
        ("vip", &["o-1"], 4, 2),
        ("many", &["o-1", "o-3"], 3, 2),
    ];
    let pool = database.pool().await;
    for (name, delivered, passed, errors) in expected {
        let mut consumer = Consumer::open(&gateway, name, 10).await;
        assert_eq!(
            drain(&mut consumer, &gateway, name).await,
            delivered,
            "{name}"
        );
        let stats = subscription_stats(&gateway, name).await;
        assert_eq!(stats.filtered_total, passed, "{name}: {stats:?}");
        assert_eq!(stats.filter_errors_total, errors, "{name}: {stats:?}");
        assert_eq!(stats.pending, 0, "{name}: read past the passed-over events");
        assert_eq!(stats.delivered_total, delivered.len() as u64, "{name}");
        assert!(stats.last_filter_error_at.is_some(), "{name}");
        assert!(!stats.last_filter_error.is_empty(), "{name}");
    }
    let records: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM outbox_deliveries) \
              + (SELECT count(*) FROM outbox_delivery_batches)",
    )
    .fetch_one(&pool)
    .await
    .expect("records");
    assert_eq!(records, 0, "passed-over events leave no record behind");
}

#[tokio::test]
async fn every_variable_is_bound() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let filter = r#"id.size() == 36 && event_type == "order.updated" && aggregate_type == "order"
        && aggregate_id == "a-7" && aggregate_version == 3 && source == "default"
        && metadata.tenant == "acme" && content_type == "application/json"
        && occurred_at < timestamp("2100-01-01T00:00:00Z") && created_at >= occurred_at
        && deliver_at == null && expires_at > created_at && transaction_id > 0
        && payload.n == 1"#;
    create_subscription(&gateway, filtered("all", filter)).await;
    let mut matching = order("a-7", "acme", serde_json::json!({"n": 1}));
    matching.aggregate_version = Some(3);
    matching.expires_at = Some(prost_types::Timestamp {
        seconds: chrono::Utc::now().timestamp() + 3600,
        nanos: 0,
    });
    let mut other_version = matching.clone();
    other_version.aggregate_version = Some(4);
    other_version.aggregate_id = "a-7".into();
    let mut other_payload = matching.clone();
    other_payload.payload = br#"{"n": 2}"#.to_vec();
    publish(&gateway, vec![other_version, matching, other_payload]).await;
    let mut consumer = Consumer::open(&gateway, "all", 10).await;
    let delivered = consumer.take(1, WAIT).await;
    assert_eq!(delivered.len(), 1);
    let event = delivered[0].event.as_ref().expect("event");
    assert_eq!(event.aggregate_version, Some(3));
    assert!(consumer.next(Duration::from_secs(2)).await.is_none());
    eventually("both others passed over", WAIT, || async {
        subscription_stats(&gateway, "all").await.filtered_total == 2
    })
    .await;
}

#[tokio::test]
async fn ordered_subscriptions_are_not_held_back_by_passed_over_events() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let subscription = proto::Subscription {
        ordered: true,
        ..filtered("ordered", "payload.step % 2 == 0")
    };
    create_subscription(&gateway, subscription).await;
    let events: Vec<proto::EventInput> = (0..10)
        .map(|step| order("same", "acme", serde_json::json!({"step": step})))
        .collect();
    publish(&gateway, events).await;
    let mut consumer = Consumer::open(&gateway, "ordered", 10).await;
    let mut steps = Vec::new();
    while let Some(delivery) = consumer.next(Duration::from_secs(3)).await {
        let payload: serde_json::Value =
            serde_json::from_slice(&delivery.event.as_ref().unwrap().payload).unwrap();
        steps.push(payload["step"].as_i64().unwrap());
        ack_all(&gateway, "ordered", vec![delivery.ack_id]).await;
    }
    assert_eq!(steps, [0, 2, 4, 6, 8]);
}

#[tokio::test]
async fn filters_change_for_events_not_handed_out_yet() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, filtered("moving", r#"metadata.tenant == "acme""#)).await;
    publish(&gateway, vec![order("a-1", "acme", serde_json::json!({}))]).await;
    publish(&gateway, vec![order("b-1", "beta", serde_json::json!({}))]).await;
    let mut consumer = Consumer::open(&gateway, "moving", 10).await;
    assert_eq!(drain(&mut consumer, &gateway, "moving").await, ["a-1"]);

    let changed = update(
        &gateway,
        filtered("moving", r#"metadata.tenant == "beta""#),
        &["filter"],
    )
    .await
    .expect("update");
    assert_eq!(changed.filter, r#"metadata.tenant == "beta""#);
    publish(&gateway, vec![order("a-2", "acme", serde_json::json!({}))]).await;
    publish(&gateway, vec![order("b-2", "beta", serde_json::json!({}))]).await;
    assert_eq!(drain(&mut consumer, &gateway, "moving").await, ["b-2"]);

    let cleared = update(&gateway, subscription("moving"), &["filter"])
        .await
        .expect("clear");
    assert_eq!(cleared.filter, "");
    publish(&gateway, vec![order("a-3", "acme", serde_json::json!({}))]).await;
    assert_eq!(drain(&mut consumer, &gateway, "moving").await, ["a-3"]);
}

#[tokio::test]
async fn bad_expressions_are_refused_with_field_position_and_reason_and_nothing_stored() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let mut admin = gateway.admin().await;
    let nested = "payload.items.exists(x, payload.items.exists(y, x == y))";
    let long = format!("event_type == \"{}\"", "a".repeat(5000));
    let cases: [(&str, &str, &str); 8] = [
        (
            "filter",
            "payload.total >",
            "subscription.filter: syntax error at 1:16",
        ),
        (
            "filter",
            "tenant == 'acme'",
            "1:1: undeclared reference to \"tenant\"",
        ),
        ("filter", "event_type > 1", "subscription.filter: 1:12: "),
        ("filter", "payload.total", ""),
        ("filter", "aggregate_id", "must give a bool"),
        ("filter", nested, "comprehensions cannot be nested"),
        ("filter", &long, "bytes long"),
        (
            "transform",
            "event_type + \"x\"",
            "subscription.transform: must give a map or a list",
        ),
    ];
    for (field, text, needle) in cases {
        let mut subscription = subscription("refused");
        match field {
            "filter" => subscription.filter = text.into(),
            _ => subscription.transform = text.into(),
        }
        let result = admin
            .create_subscription(proto::CreateSubscriptionRequest {
                subscription: Some(subscription),
                validate_only: false,
            })
            .await;
        if needle.is_empty() {
            // A payload-dependent expression is accepted: its value is only known per
            // event (and a non-bool then counts as an error).
            assert!(result.is_ok(), "{text}: {result:?}");
            admin
                .delete_subscription(proto::DeleteSubscriptionRequest {
                    name: "refused".into(),
                })
                .await
                .expect("delete");
            continue;
        }
        assert_status(result, Code::InvalidArgument, needle);
    }
    let listed = admin
        .list_subscriptions(proto::ListSubscriptionsRequest::default())
        .await
        .expect("list")
        .into_inner();
    assert!(listed.subscriptions.is_empty(), "nothing stored");

    create_subscription(&gateway, filtered("kept", "payload.total > 1")).await;
    let refused = update(&gateway, filtered("kept", "payload.total >"), &["filter"]).await;
    assert_status(
        refused,
        Code::InvalidArgument,
        "subscription.filter: syntax error",
    );
    let kept = admin
        .get_subscription(proto::GetSubscriptionRequest {
            name: "kept".into(),
        })
        .await
        .expect("get")
        .into_inner();
    assert_eq!(kept.filter, "payload.total > 1", "unchanged");
}

#[tokio::test]
async fn a_transform_shapes_the_payload_and_dead_letters_what_it_fails_on() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let transform = r#"{"id": payload.id, "total": payload.total, "type": event_type}"#;
    let subscription = proto::Subscription {
        transform: transform.into(),
        ..subscription("trimmed")
    };
    assert_eq!(
        create_subscription(&gateway, subscription).await.transform,
        transform
    );
    publish(
        &gateway,
        vec![
            order(
                "o-1",
                "acme",
                serde_json::json!({"id": 7, "total": 12.5, "noise": [1, 2]}),
            ),
            order("o-2", "acme", serde_json::json!({"noise": true})),
        ],
    )
    .await;
    let mut consumer = Consumer::open(&gateway, "trimmed", 10).await;
    let delivered = consumer.take(1, WAIT).await;
    let event = delivered[0].event.as_ref().expect("event");
    assert_eq!(event.aggregate_id, "o-1");
    assert_eq!(event.content_type, "application/json");
    let payload: serde_json::Value = serde_json::from_slice(&event.payload).expect("JSON");
    assert_eq!(
        payload,
        serde_json::json!({"id": 7, "total": 12.5, "type": "order.updated"})
    );
    ack_all(&gateway, "trimmed", vec![delivered[0].ack_id.clone()]).await;
    assert!(consumer.next(Duration::from_secs(2)).await.is_none());

    eventually("the event it failed on is dead-lettered", WAIT, || async {
        !list_dead_letters(&gateway, "trimmed").await.is_empty()
    })
    .await;
    let dead = list_dead_letters(&gateway, "trimmed").await;
    assert_eq!(dead.len(), 1);
    let letter = &dead[0];
    assert_eq!(letter.event.as_ref().unwrap().aggregate_id, "o-2");
    assert!(
        letter.last_error.starts_with("transform: "),
        "{}",
        letter.last_error
    );
    let stored: Vec<u8> =
        sqlx::query_scalar("SELECT payload FROM outbox_events WHERE aggregate_id = 'o-1'")
            .fetch_one(&database.pool().await)
            .await
            .expect("stored payload");
    let stored: serde_json::Value = serde_json::from_slice(&stored).expect("stored JSON");
    assert_eq!(
        stored["noise"],
        serde_json::json!([1, 2]),
        "the stored event is unchanged"
    );
}

/// The transaction id of each delivered event, by aggregate id.
async fn transaction_ids(consumer: &mut Consumer, count: usize) -> HashMap<String, u64> {
    let deliveries = consumer.take(count, WAIT).await;
    assert_eq!(deliveries.len(), count, "deliveries");
    deliveries
        .iter()
        .map(|d| {
            let event = d.event.as_ref().expect("event");
            (event.aggregate_id.clone(), event.transaction_id)
        })
        .collect()
}

#[tokio::test]
async fn events_of_one_transaction_share_its_id_and_others_differ() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("all")).await;
    let mut consumer = Consumer::open(&gateway, "all", 100).await;

    publish(&gateway, vec![event("a1", "t"), event("a2", "t")]).await;
    publish(&gateway, vec![event("b1", "t")]).await;
    let pool = database.pool().await;
    let mut transaction = pool.begin().await.expect("begin");
    for id in ["c1", "c2"] {
        sqlx::query("SELECT outbox_publish('order', $1, 't', '{}'::jsonb)")
            .bind(id)
            .execute(&mut *transaction)
            .await
            .expect("publish in SQL");
    }
    transaction.commit().await.expect("commit");
    sqlx::query("SELECT outbox_publish('order', 'd1', 't', '{}'::jsonb)")
        .execute(&pool)
        .await
        .expect("publish in SQL");

    let ids = transaction_ids(&mut consumer, 6).await;
    assert!(ids.values().all(|&id| id > 0), "{ids:?}");
    assert_eq!(ids["a1"], ids["a2"], "one Publish call");
    assert_eq!(ids["c1"], ids["c2"], "one SQL transaction");
    let distinct: std::collections::HashSet<u64> =
        ["a1", "b1", "c1", "d1"].iter().map(|id| ids[*id]).collect();
    assert_eq!(distinct.len(), 4, "separate transactions: {ids:?}");
    let stored: i64 =
        sqlx::query_scalar("SELECT xact_id FROM outbox_events WHERE aggregate_id = 'c1'")
            .fetch_one(&pool)
            .await
            .expect("stored transaction id");
    assert_eq!(ids["c1"], stored as u64);
}
