//! Dead-letter triage and event lookup over gRPC: selectors shared by listing, requeue
//! and bulk resolve, counts without change, summaries by error, and where an event
//! stands on every subscription.

use std::time::Duration;

use crate::common::*;
use outbox_gateway::proto::{
    self, DeliveryState, GetEventRequest, ListDeadLettersRequest, RequeueDeadLettersRequest,
    ResolveDeadLettersRequest, SummarizeDeadLettersRequest,
};
use tonic::Code;

fn timestamp(seconds: i64) -> Option<prost_types::Timestamp> {
    Some(prost_types::Timestamp { seconds, nanos: 0 })
}

fn now_seconds() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// Dead-letters one event per (aggregate id, event type, error); returns the event ids.
async fn dead_letter(
    gateway: &TestGateway,
    subscription_name: &str,
    events: &[(&str, &str, &str)],
) -> Vec<String> {
    create_subscription(gateway, subscription(subscription_name)).await;
    let ids: Vec<String> = publish(
        gateway,
        events
            .iter()
            .map(|(aggregate, event_type, _)| event(aggregate, event_type))
            .collect(),
    )
    .await
    .into_iter()
    .map(|result| result.id)
    .collect();
    let mut consumer = Consumer::open(gateway, subscription_name, 100).await;
    for delivery in consumer.take(events.len(), Duration::from_secs(20)).await {
        let aggregate = aggregate_of(&delivery);
        let (_, _, reason) = events.iter().find(|(id, _, _)| *id == aggregate).unwrap();
        nack(
            gateway,
            proto::NackRequest {
                subscription: subscription_name.into(),
                ack_id: delivery.ack_id,
                reason: reason.to_string(),
                dead_letter: true,
                ..Default::default()
            },
        )
        .await;
    }
    ids
}

async fn listed(gateway: &TestGateway, request: ListDeadLettersRequest) -> Vec<String> {
    gateway
        .admin()
        .await
        .list_dead_letters(ListDeadLettersRequest {
            subscription: "orders".into(),
            ..request
        })
        .await
        .expect("list dead letters")
        .into_inner()
        .dead_letters
        .into_iter()
        .map(|letter| letter.event.unwrap().aggregate_id)
        .collect()
}

#[tokio::test]
async fn selectors_choose_the_same_dead_letters_to_list_count_requeue_and_resolve() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    dead_letter(
        &gateway,
        "orders",
        &[
            ("a-1", "order.paid", "boom"),
            ("a-2", "order.paid", "bang"),
            ("a-3", "order.shipped", "boom"),
        ],
    )
    .await;
    let mut admin = gateway.admin().await;

    let by_aggregate = ListDeadLettersRequest {
        aggregate_type: "order".into(),
        aggregate_id: "a-2".into(),
        ..Default::default()
    };
    assert_eq!(listed(&gateway, by_aggregate).await, ["a-2"]);
    let by_error = ListDeadLettersRequest {
        last_error: "boom".into(),
        ..Default::default()
    };
    assert_eq!(listed(&gateway, by_error).await, ["a-1", "a-3"]);
    let later = ListDeadLettersRequest {
        dead_lettered_after: timestamp(now_seconds() + 3600),
        ..Default::default()
    };
    assert!(listed(&gateway, later).await.is_empty());
    let earlier = ListDeadLettersRequest {
        dead_lettered_before: timestamp(now_seconds() - 3600),
        ..Default::default()
    };
    assert!(listed(&gateway, earlier).await.is_empty());

    let summary = admin
        .summarize_dead_letters(SummarizeDeadLettersRequest {
            subscription: "orders".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .groups;
    let groups: Vec<(&str, u64)> = summary
        .iter()
        .map(|group| (group.last_error.as_str(), group.count))
        .collect();
    assert_eq!(groups, [("boom", 2), ("bang", 1)]);
    let seconds_of = |time: &Option<prost_types::Timestamp>| time.as_ref().unwrap().seconds;
    assert!(summary.iter().all(|group| {
        seconds_of(&group.first_dead_lettered_at) <= seconds_of(&group.last_dead_lettered_at)
            && !group.example_event_id.is_empty()
    }));

    // A count changes nothing; the requeue then takes exactly what was counted.
    let boom = RequeueDeadLettersRequest {
        subscription: "orders".into(),
        last_error: "boom".into(),
        validate_only: true,
        ..Default::default()
    };
    let counted = admin.requeue_dead_letters(boom.clone()).await.unwrap();
    assert_eq!(counted.into_inner().requeued_count, 2);
    assert_eq!(listed(&gateway, Default::default()).await.len(), 3);
    let shipped = RequeueDeadLettersRequest {
        aggregate_type: "order".into(),
        aggregate_id: "a-3".into(),
        validate_only: false,
        ..boom
    };
    let requeued = admin.requeue_dead_letters(shipped).await.unwrap();
    assert_eq!(requeued.into_inner().requeued_count, 1);
    assert_eq!(listed(&gateway, Default::default()).await, ["a-1", "a-2"]);

    // Bulk resolve: a selector or all, a resolver, and a count first if asked.
    let resolve = ResolveDeadLettersRequest {
        subscription: "orders".into(),
        resolved_by: "alice".into(),
        notes: "refunded".into(),
        ..Default::default()
    };
    assert_status(
        admin.resolve_dead_letters(resolve.clone()).await,
        Code::InvalidArgument,
        "all: give a selector",
    );
    assert_status(
        admin
            .resolve_dead_letters(ResolveDeadLettersRequest {
                all: true,
                resolved_by: String::new(),
                ..resolve.clone()
            })
            .await,
        Code::InvalidArgument,
        "resolved_by",
    );
    let counted = admin
        .resolve_dead_letters(ResolveDeadLettersRequest {
            last_error: "bang".into(),
            validate_only: true,
            ..resolve.clone()
        })
        .await
        .unwrap();
    assert_eq!(counted.into_inner().resolved_count, 1);
    assert_eq!(listed(&gateway, Default::default()).await.len(), 2);
    let resolved = admin
        .resolve_dead_letters(ResolveDeadLettersRequest {
            all: true,
            ..resolve
        })
        .await
        .unwrap();
    assert_eq!(resolved.into_inner().resolved_count, 2);
    assert!(listed(&gateway, Default::default()).await.is_empty());
    let all = admin
        .list_dead_letters(ListDeadLettersRequest {
            subscription: "orders".into(),
            include_resolved: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .dead_letters;
    assert!(
        all.iter()
            .all(|letter| letter.resolved && letter.resolved_by == "alice")
    );
}

#[tokio::test]
async fn bad_selectors_are_refused_naming_the_field_and_change_nothing() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    dead_letter(&gateway, "orders", &[("a-1", "order.paid", "boom")]).await;
    let pool = database.pool().await;
    let before = delivery_records(&pool, "orders").await;
    let mut admin = gateway.admin().await;
    let requeue = |request: RequeueDeadLettersRequest| RequeueDeadLettersRequest {
        subscription: "orders".into(),
        ..request
    };
    for (request, field) in [
        (
            requeue(RequeueDeadLettersRequest {
                dead_lettered_after: timestamp(now_seconds() + 3600),
                ..Default::default()
            }),
            "",
        ),
        (
            requeue(RequeueDeadLettersRequest {
                aggregate_id: "a\0b".into(),
                ..Default::default()
            }),
            "aggregate_id",
        ),
        (
            requeue(RequeueDeadLettersRequest {
                ids: vec!["x".into()],
                ..Default::default()
            }),
            "ids[0]",
        ),
        (
            requeue(RequeueDeadLettersRequest {
                aggregate_type: "t".repeat(256),
                all: true,
                ..Default::default()
            }),
            "aggregate_type",
        ),
    ] {
        let result = admin
            .requeue_dead_letters(RequeueDeadLettersRequest {
                validate_only: false,
                ..request
            })
            .await;
        if field.is_empty() {
            // A time range alone is a selector; nothing is dead-lettered in the future.
            assert_eq!(result.unwrap().into_inner().requeued_count, 0);
        } else {
            assert_status(result, Code::InvalidArgument, field);
        }
    }
    assert_status(
        admin
            .list_dead_letters(ListDeadLettersRequest {
                subscription: "orders".into(),
                dead_lettered_after: timestamp(now_seconds()),
                dead_lettered_before: timestamp(now_seconds() - 60),
                ..Default::default()
            })
            .await,
        Code::InvalidArgument,
        "dead_lettered_after: must be earlier than dead_lettered_before",
    );
    assert_status(
        admin
            .summarize_dead_letters(SummarizeDeadLettersRequest {
                subscription: "missing".into(),
                ..Default::default()
            })
            .await,
        Code::NotFound,
        "missing",
    );
    assert_eq!(delivery_records(&pool, "orders").await, before);
}

#[tokio::test]
async fn get_event_tells_where_the_event_stands_on_each_subscription() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    for name in ["acking", "retrying", "rejecting", "leased"] {
        create_subscription(&gateway, subscription(name)).await;
    }
    create_subscription(
        &gateway,
        proto::Subscription {
            event_types: vec!["order.shipped".into()],
            ..subscription("shipping")
        },
    )
    .await;
    let id = publish(&gateway, vec![event("a-1", "order.paid")]).await[0]
        .id
        .clone();
    for (name, reason, dead_letter) in [
        ("acking", "", false),
        ("retrying", "try later", false),
        ("rejecting", "poison", true),
    ] {
        let mut consumer = Consumer::open(&gateway, name, 1).await;
        let delivery = consumer
            .next(Duration::from_secs(20))
            .await
            .expect("delivery");
        if name == "acking" {
            ack_all(&gateway, name, vec![delivery.ack_id]).await;
        } else {
            nack(
                &gateway,
                proto::NackRequest {
                    subscription: name.into(),
                    ack_id: delivery.ack_id,
                    reason: reason.into(),
                    retry_after: seconds(3600),
                    dead_letter,
                },
            )
            .await;
        }
    }
    let mut in_flight = Consumer::open(&gateway, "leased", 1).await;
    in_flight
        .next(Duration::from_secs(20))
        .await
        .expect("delivery");

    let mut admin = gateway.admin().await;
    let found = admin
        .get_event(GetEventRequest {
            id: id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(found.event.unwrap().id, id);
    let states: Vec<(String, DeliveryState, u32, String)> = found
        .subscriptions
        .iter()
        .map(|delivery| {
            (
                delivery.subscription.clone(),
                delivery.state(),
                delivery.attempt,
                delivery.last_error.clone(),
            )
        })
        .collect();
    assert_eq!(
        states,
        [
            ("acking".to_owned(), DeliveryState::Acked, 0, String::new()),
            (
                "leased".to_owned(),
                DeliveryState::InFlight,
                1,
                String::new()
            ),
            (
                "rejecting".to_owned(),
                DeliveryState::Dead,
                1,
                "poison".to_owned()
            ),
            (
                "retrying".to_owned(),
                DeliveryState::AwaitingRetry,
                1,
                "try later".to_owned()
            ),
            (
                "shipping".to_owned(),
                DeliveryState::NotMatched,
                0,
                String::new()
            ),
        ]
    );
    let due = |name: &str| {
        found
            .subscriptions
            .iter()
            .find(|delivery| delivery.subscription == name)
            .and_then(|delivery| delivery.due_at)
            .map(|due| due.seconds)
    };
    assert!(due("leased").is_some_and(|due| due > now_seconds()));
    assert!(due("retrying").is_some_and(|due| due > now_seconds() + 3000));

    // A subscription that has not handed it out yet has it pending.
    create_subscription(&gateway, subscription("late")).await;
    let found = admin
        .get_event(GetEventRequest {
            id: id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let late = found
        .subscriptions
        .iter()
        .find(|delivery| delivery.subscription == "late")
        .unwrap();
    assert_eq!(late.state(), DeliveryState::Pending);

    assert_status(
        admin
            .get_event(GetEventRequest {
                id: uuid::Uuid::new_v4().to_string(),
                ..Default::default()
            })
            .await,
        Code::NotFound,
        "does not exist",
    );
    assert_status(
        admin
            .get_event(GetEventRequest {
                id: "x".into(),
                ..Default::default()
            })
            .await,
        Code::InvalidArgument,
        "id",
    );
}
