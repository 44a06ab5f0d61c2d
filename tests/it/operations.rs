//! Operations: requeues, dead-letter triage, seeks, setting changes, stats, retention and
//! lease reclaim.

use std::time::Duration;

use crate::common::*;
use outbox_gateway::proto::{self, admin_client::AdminClient};
use sqlx::PgPool;
use tonic::{Code, transport::Channel};

/// Generous: a busy machine or a long transaction elsewhere in the cluster slows delivery.
const WAIT: Duration = Duration::from_secs(15);
const QUIET: Duration = Duration::from_millis(400);

fn dead_letter_now(subscription: &str, ack_id: String) -> proto::NackRequest {
    proto::NackRequest {
        subscription: subscription.into(),
        ack_id,
        reason: "poison".into(),
        dead_letter: true,
        ..Default::default()
    }
}

async fn list_dead_letters(
    admin: &mut AdminClient<Channel>,
    request: proto::ListDeadLettersRequest,
) -> proto::ListDeadLettersResponse {
    admin
        .list_dead_letters(request)
        .await
        .expect("list dead letters")
        .into_inner()
}

fn listing(subscription: &str) -> proto::ListDeadLettersRequest {
    proto::ListDeadLettersRequest {
        subscription: subscription.into(),
        ..Default::default()
    }
}

async fn stats(
    admin: &mut AdminClient<Channel>,
    subscription: &str,
) -> (proto::SubscriptionStats, proto::OutboxStats) {
    let stats = admin
        .get_stats(proto::GetStatsRequest {
            subscription: subscription.into(),
        })
        .await
        .expect("stats")
        .into_inner();
    (
        stats
            .subscriptions
            .into_iter()
            .next()
            .expect("one subscription"),
        stats.outbox.expect("outbox stats"),
    )
}

#[tokio::test]
async fn requeue_event_is_refused_in_flight_and_redelivers_after_ack() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    create_subscription(&gateway, subscription("billing")).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            event_types: vec!["invoice.*".into()],
            ..subscription("invoices")
        },
    )
    .await;
    let id = publish(&gateway, vec![event("o-1", "order.created")]).await[0]
        .id
        .clone();
    let mut admin = gateway.admin().await;
    let requeue = |subscription: &str| proto::RequeueEventRequest {
        id: id.clone(),
        subscription: subscription.into(),
        ..Default::default()
    };

    let mut orders = Consumer::open(&gateway, "orders", 0).await;
    let first = orders.next(WAIT).await.unwrap();
    assert_status(
        admin.requeue_event(requeue("orders")).await,
        Code::FailedPrecondition,
        "in flight",
    );
    assert_status(
        admin.requeue_event(requeue("")).await,
        Code::FailedPrecondition,
        "in flight",
    );
    assert!(
        orders.next(QUIET).await.is_none(),
        "a refused requeue changed nothing"
    );

    assert!(ack(&gateway, "orders", vec![first.ack_id]).await.is_empty());
    let requeued = admin
        .requeue_event(requeue("orders"))
        .await
        .unwrap()
        .into_inner()
        .requeued_count;
    assert_eq!(requeued, 1);
    let again = orders
        .next(WAIT)
        .await
        .expect("requeued event delivered again");
    assert_eq!((again.attempt, again.event.unwrap().id), (1, id.clone()));
    assert!(ack(&gateway, "orders", vec![again.ack_id]).await.is_empty());

    // Every matching subscription that handed it out: "billing" has not read it yet, so
    // only "orders" counts; "invoices" does not match.
    let mut billing = Consumer::open(&gateway, "billing", 0).await;
    let billed = billing.next(WAIT).await.unwrap();
    assert!(
        ack(&gateway, "billing", vec![billed.ack_id])
            .await
            .is_empty()
    );
    let requeued = admin
        .requeue_event(requeue(""))
        .await
        .unwrap()
        .into_inner()
        .requeued_count;
    assert_eq!(requeued, 2);
    assert_status(
        admin.requeue_event(requeue("invoices")).await,
        Code::FailedPrecondition,
        "filters",
    );

    let unknown = proto::RequeueEventRequest {
        id: uuid::Uuid::new_v4().to_string(),
        subscription: String::new(),
        ..Default::default()
    };
    assert_status(
        admin.requeue_event(unknown).await,
        Code::NotFound,
        "does not exist",
    );
    assert_status(
        admin
            .requeue_event(proto::RequeueEventRequest {
                id: "x".into(),
                subscription: String::new(),
                ..Default::default()
            })
            .await,
        Code::InvalidArgument,
        "id",
    );
    assert_status(
        admin.requeue_event(requeue("missing")).await,
        Code::NotFound,
        "missing",
    );
}

#[tokio::test]
async fn requeue_latest_takes_the_newest_event_of_the_aggregate() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    let mut first = event("o-1", "order.updated");
    first.aggregate_version = Some(1);
    let mut second = event("o-1", "order.updated");
    second.aggregate_version = Some(2);
    publish(&gateway, vec![first]).await;
    publish(&gateway, vec![second, event("o-2", "order.updated")]).await;
    let mut consumer = Consumer::open(&gateway, "orders", 0).await;
    let deliveries = consumer.take(3, WAIT).await;
    assert!(
        ack(
            &gateway,
            "orders",
            deliveries.into_iter().map(|d| d.ack_id).collect()
        )
        .await
        .is_empty()
    );

    let mut admin = gateway.admin().await;
    let request = |aggregate_id: &str| proto::RequeueLatestRequest {
        aggregate_type: "order".into(),
        aggregate_id: aggregate_id.into(),
        event_type: "order.updated".into(),
        subscription: String::new(),
        ..Default::default()
    };
    assert_eq!(
        admin
            .requeue_latest(request("o-1"))
            .await
            .unwrap()
            .into_inner()
            .requeued_count,
        1
    );
    let again = consumer.next(WAIT).await.unwrap();
    assert_eq!(again.event.unwrap().aggregate_version, Some(2));
    assert!(consumer.next(QUIET).await.is_none());

    assert_status(
        admin.requeue_latest(request("o-404")).await,
        Code::NotFound,
        "o-404",
    );
    let missing_key = proto::RequeueLatestRequest {
        event_type: String::new(),
        ..request("o-1")
    };
    assert_status(
        admin.requeue_latest(missing_key).await,
        Code::InvalidArgument,
        "event_type",
    );
}

#[tokio::test]
async fn dead_letters_are_listed_paged_resolved_and_requeued_exactly() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    let published = publish(
        &gateway,
        vec![
            event("o-1", "order.created"),
            event("o-2", "order.paid"),
            event("o-3", "order.created"),
            event("o-4", "order.created"),
        ],
    )
    .await;
    let mut consumer = Consumer::open(&gateway, "orders", 0).await;
    let deliveries = consumer.take(4, WAIT).await;
    for delivery in &deliveries[..3] {
        assert!(
            nack(&gateway, dead_letter_now("orders", delivery.ack_id.clone()))
                .await
                .dead_lettered
        );
    }
    let mut admin = gateway.admin().await;

    // Paging, oldest first.
    let first_page = list_dead_letters(
        &mut admin,
        proto::ListDeadLettersRequest {
            page_size: 2,
            ..listing("orders")
        },
    )
    .await;
    assert_eq!(first_page.dead_letters.len(), 2);
    assert!(!first_page.next_page_token.is_empty());
    let second_page = list_dead_letters(
        &mut admin,
        proto::ListDeadLettersRequest {
            page_size: 2,
            page_token: first_page.next_page_token.clone(),
            ..listing("orders")
        },
    )
    .await;
    assert_eq!(second_page.dead_letters.len(), 1);
    assert!(second_page.next_page_token.is_empty());
    let listed: Vec<String> = first_page
        .dead_letters
        .iter()
        .chain(&second_page.dead_letters)
        .map(|d| d.event.as_ref().unwrap().aggregate_id.clone())
        .collect();
    assert_eq!(listed, ["o-1", "o-2", "o-3"]);
    let letter = &first_page.dead_letters[0];
    assert_eq!(
        (letter.attempts, letter.last_error.as_str(), letter.resolved),
        (1, "poison", false)
    );
    let paid = list_dead_letters(
        &mut admin,
        proto::ListDeadLettersRequest {
            event_types: vec!["order.paid".into()],
            ..listing("orders")
        },
    )
    .await;
    assert_eq!(paid.dead_letters.len(), 1);

    // Resolve o-1: gone from the default listing, kept with include_resolved.
    let resolved = admin
        .resolve_dead_letter(proto::ResolveDeadLetterRequest {
            subscription: "orders".into(),
            id: published[0].id.clone(),
            resolved_by: "alice".into(),
            notes: "refunded by hand".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(resolved.resolved && resolved.resolved_at.is_some());
    assert_eq!(
        list_dead_letters(&mut admin, listing("orders"))
            .await
            .dead_letters
            .len(),
        2
    );
    let everything = list_dead_letters(
        &mut admin,
        proto::ListDeadLettersRequest {
            include_resolved: true,
            ..listing("orders")
        },
    )
    .await;
    assert_eq!(everything.dead_letters.len(), 3);
    assert_eq!(
        (
            everything.dead_letters[0].resolved_by.as_str(),
            everything.dead_letters[0].notes.as_str()
        ),
        ("alice", "refunded by hand")
    );
    let unknown = proto::ResolveDeadLetterRequest {
        subscription: "orders".into(),
        id: published[3].id.clone(),
        resolved_by: "alice".into(),
        notes: String::new(),
        ..Default::default()
    };
    assert_status(
        admin.resolve_dead_letter(unknown).await,
        Code::NotFound,
        "not a dead letter",
    );

    // Requeue needs a selector; by event type takes exactly o-2.
    let requeue = |selection: proto::RequeueDeadLettersRequest| proto::RequeueDeadLettersRequest {
        subscription: "orders".into(),
        ..selection
    };
    assert_status(
        admin
            .requeue_dead_letters(requeue(Default::default()))
            .await,
        Code::InvalidArgument,
        "all",
    );
    let by_type = requeue(proto::RequeueDeadLettersRequest {
        event_types: vec!["order.paid".into()],
        ..Default::default()
    });
    assert_eq!(
        admin
            .requeue_dead_letters(by_type)
            .await
            .unwrap()
            .into_inner()
            .requeued_count,
        1
    );
    let redelivered = consumer
        .next(WAIT)
        .await
        .expect("requeued dead letter delivered");
    assert_eq!(
        (aggregate_of(&redelivered).as_str(), redelivered.attempt),
        ("o-2", 1)
    );
    assert!(
        consumer.next(QUIET).await.is_none(),
        "only the chosen dead letter came back"
    );

    // all = true takes the unresolved rest (o-3), not the resolved o-1.
    let all = requeue(proto::RequeueDeadLettersRequest {
        all: true,
        ..Default::default()
    });
    assert_eq!(
        admin
            .requeue_dead_letters(all)
            .await
            .unwrap()
            .into_inner()
            .requeued_count,
        1
    );
    assert_eq!(aggregate_of(&consumer.next(WAIT).await.unwrap()), "o-3");
    // Chosen by id, a resolved dead letter does come back.
    let by_id = requeue(proto::RequeueDeadLettersRequest {
        ids: vec![published[0].id.clone()],
        ..Default::default()
    });
    assert_eq!(
        admin
            .requeue_dead_letters(by_id)
            .await
            .unwrap()
            .into_inner()
            .requeued_count,
        1
    );
    assert_eq!(aggregate_of(&consumer.next(WAIT).await.unwrap()), "o-1");
    assert_status(
        admin
            .requeue_dead_letters(requeue(proto::RequeueDeadLettersRequest {
                ids: vec!["nope".into()],
                ..Default::default()
            }))
            .await,
        Code::InvalidArgument,
        "ids[0]",
    );
    assert_status(
        admin
            .list_dead_letters(proto::ListDeadLettersRequest {
                page_token: "garbage".into(),
                ..listing("orders")
            })
            .await,
        Code::InvalidArgument,
        "page_token",
    );
}

#[tokio::test]
async fn seek_replays_exactly_the_events_since_a_time_or_skips_ahead() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    publish(
        &gateway,
        vec![event("a", "order.created"), event("b", "order.created")],
    )
    .await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let since = std::time::SystemTime::now();
    tokio::time::sleep(Duration::from_millis(20)).await;
    publish(
        &gateway,
        vec![event("c", "order.created"), event("d", "order.created")],
    )
    .await;

    let mut consumer = Consumer::open(&gateway, "orders", 0).await;
    let all = consumer.take(4, WAIT).await;
    assert!(
        ack(
            &gateway,
            "orders",
            all.into_iter().map(|d| d.ack_id).collect()
        )
        .await
        .is_empty()
    );

    let mut admin = gateway.admin().await;
    let seek = |position: proto::start_position::Position| proto::SeekSubscriptionRequest {
        subscription: "orders".into(),
        to: Some(proto::StartPosition {
            position: Some(position),
        }),
    };
    admin
        .seek_subscription(seek(proto::start_position::Position::Time(since.into())))
        .await
        .unwrap();
    let replayed: Vec<String> = consumer
        .take(2, WAIT)
        .await
        .iter()
        .map(aggregate_of)
        .collect();
    assert_eq!(replayed, ["c", "d"]);
    assert!(
        consumer.next(QUIET).await.is_none(),
        "nothing before the seek time"
    );

    // Skip ahead: what was replayed and not acked stays in flight; nothing new arrives.
    admin
        .seek_subscription(seek(proto::start_position::Position::Boundary(
            proto::Boundary::Latest as i32,
        )))
        .await
        .unwrap();
    let (figures, _) = stats(&mut admin, "orders").await;
    assert_eq!((figures.pending, figures.in_flight), (0, 2));

    assert_status(
        admin
            .seek_subscription(proto::SeekSubscriptionRequest {
                subscription: "orders".into(),
                to: None,
            })
            .await,
        Code::InvalidArgument,
        "to",
    );
    let missing = proto::SeekSubscriptionRequest {
        subscription: "missing".into(),
        ..seek(proto::start_position::Position::Boundary(0))
    };
    assert_status(
        admin.seek_subscription(missing).await,
        Code::NotFound,
        "missing",
    );
}

#[tokio::test]
async fn stats_match_a_known_scenario_exactly() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    publish(
        &gateway,
        (0..5)
            .map(|i| event(&format!("o-{i}"), "order.created"))
            .collect(),
    )
    .await;
    let mut consumer = Consumer::open(&gateway, "orders", 4).await;
    let deliveries = consumer.take(4, WAIT).await;
    assert!(
        ack(
            &gateway,
            "orders",
            vec![deliveries[0].ack_id.clone(), deliveries[1].ack_id.clone()]
        )
        .await
        .is_empty()
    );
    nack(
        &gateway,
        dead_letter_now("orders", deliveries[2].ack_id.clone()),
    )
    .await;
    // The dispatcher refills the freed room with the fifth event.
    let fifth = consumer.next(WAIT).await.unwrap();

    let mut admin = gateway.admin().await;
    let (figures, outbox) = stats(&mut admin, "orders").await;
    assert_eq!(figures.pending, 0);
    assert_eq!(figures.in_flight, 2);
    assert_eq!(figures.awaiting_retry, 0);
    assert_eq!(figures.dead_lettered, 1);
    assert_eq!(figures.lag_events, 2);
    assert_eq!(figures.delivered_total, 5);
    assert_eq!(figures.acked_total, 2);
    assert!(figures.oldest_unacked_age.unwrap().seconds >= 0);
    assert_eq!(outbox.events_stored, 5);
    assert!(outbox.oldest_event_at.is_some() && outbox.newest_event_at.is_some());

    nack(
        &gateway,
        proto::NackRequest {
            subscription: "orders".into(),
            ack_id: fifth.ack_id,
            retry_after: seconds(60),
            ..Default::default()
        },
    )
    .await;
    drop(consumer);
    eventually(
        "the closed stream's lease is released",
        Duration::from_secs(10),
        || async {
            let (figures, _) = stats(&mut gateway.admin().await, "orders").await;
            figures.awaiting_retry == 2
        },
    )
    .await;
    // With no stream left, a new event stays pending.
    publish(&gateway, vec![event("o-5", "order.created")]).await;
    let (figures, outbox) = stats(&mut admin, "orders").await;
    assert_eq!(
        (
            figures.pending,
            figures.in_flight,
            figures.awaiting_retry,
            figures.dead_lettered
        ),
        (1, 0, 2, 1)
    );
    assert_eq!(figures.lag_events, 3);
    assert_eq!(outbox.events_stored, 6);
    let all = admin
        .get_stats(proto::GetStatsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(all.subscriptions.len(), 1);
    assert_status(
        admin
            .get_stats(proto::GetStatsRequest {
                subscription: "missing".into(),
            })
            .await,
        Code::NotFound,
        "missing",
    );
}

#[tokio::test]
async fn update_subscription_changes_filters_for_events_not_yet_delivered() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            event_types: vec!["order.created".into()],
            ..subscription("orders")
        },
    )
    .await;
    let mut admin = gateway.admin().await;
    let update = |changes: proto::Subscription, paths: &[&str]| proto::UpdateSubscriptionRequest {
        subscription: Some(proto::Subscription {
            name: "orders".into(),
            ..changes
        }),
        update_mask: Some(prost_types::FieldMask {
            paths: paths.iter().map(|p| p.to_string()).collect(),
        }),
        validate_only: false,
    };
    let updated = admin
        .update_subscription(update(
            proto::Subscription {
                event_types: vec!["order.paid".into()],
                ack_deadline: seconds(90),
                ..Default::default()
            },
            &["event_types", "ack_deadline"],
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (
            updated.event_types,
            updated.ack_deadline,
            updated.max_attempts
        ),
        (vec!["order.paid".to_string()], seconds(90), Some(10))
    );

    publish(
        &gateway,
        vec![event("o-1", "order.created"), event("o-1", "order.paid")],
    )
    .await;
    let mut consumer = Consumer::open(&gateway, "orders", 0).await;
    let delivery = consumer.next(WAIT).await.unwrap();
    assert_eq!(delivery.event.unwrap().event_type, "order.paid");
    assert!(consumer.next(QUIET).await.is_none());

    assert_status(
        admin
            .update_subscription(update(Default::default(), &["ordered"]))
            .await,
        Code::InvalidArgument,
        "update_mask.paths[0]",
    );
    assert_status(
        admin
            .update_subscription(update(Default::default(), &["colour"]))
            .await,
        Code::InvalidArgument,
        "colour",
    );
    assert_status(
        admin
            .update_subscription(update(Default::default(), &[]))
            .await,
        Code::InvalidArgument,
        "update_mask",
    );
    assert_status(
        admin
            .update_subscription(update(Default::default(), &["ack_deadline"]))
            .await,
        Code::InvalidArgument,
        "ack_deadline",
    );
    let bad = update(
        proto::Subscription {
            retry_backoff_min: seconds(3600),
            ..Default::default()
        },
        &["retry_backoff_min", "retry_backoff_max"],
    );
    assert_status(
        admin.update_subscription(bad).await,
        Code::InvalidArgument,
        "retry_backoff",
    );
    let missing = proto::UpdateSubscriptionRequest {
        subscription: Some(subscription("missing")),
        ..update(Default::default(), &["event_types"])
    };
    assert_status(
        admin.update_subscription(missing).await,
        Code::NotFound,
        "missing",
    );
    let unchanged = admin
        .get_subscription(proto::GetSubscriptionRequest {
            name: "orders".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        unchanged.ack_deadline,
        seconds(90),
        "refused updates changed nothing"
    );
}

async fn event_positions(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT aggregate_id FROM outbox_events ORDER BY position")
        .fetch_all(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn retention_deletes_only_what_no_subscription_needs() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.maintenance.interval = Duration::from_millis(200);
    config.maintenance.retention = Duration::from_millis(300);
    let gateway = TestGateway::start_with(&database, config).await;
    create_subscription(&gateway, subscription("fast")).await;
    create_subscription(&gateway, subscription("slow")).await;
    create_subscription(&gateway, subscription("triage")).await;
    publish(
        &gateway,
        (0..5)
            .map(|i| event(&format!("o-{i}"), "order.created"))
            .collect(),
    )
    .await;

    // fast acks everything; slow reads only o-0 and o-1 and acks o-0 (o-1 stays in
    // flight); triage dead-letters o-0 (unresolved) and o-1 (resolved), acks the rest.
    let mut fast = Consumer::open(&gateway, "fast", 0).await;
    let all = fast.take(5, WAIT).await;
    assert!(
        ack(
            &gateway,
            "fast",
            all.into_iter().map(|d| d.ack_id).collect()
        )
        .await
        .is_empty()
    );
    let mut slow = Consumer::open(&gateway, "slow", 2).await;
    let slow_deliveries = slow.take(2, WAIT).await;
    assert!(
        ack(&gateway, "slow", vec![slow_deliveries[0].ack_id.clone()])
            .await
            .is_empty()
    );
    let mut triage = Consumer::open(&gateway, "triage", 0).await;
    let triaged = triage.take(5, WAIT).await;
    nack(
        &gateway,
        dead_letter_now("triage", triaged[0].ack_id.clone()),
    )
    .await;
    nack(
        &gateway,
        dead_letter_now("triage", triaged[1].ack_id.clone()),
    )
    .await;
    assert!(
        ack(
            &gateway,
            "triage",
            triaged[2..].iter().map(|d| d.ack_id.clone()).collect()
        )
        .await
        .is_empty()
    );
    gateway
        .admin()
        .await
        .resolve_dead_letter(proto::ResolveDeadLetterRequest {
            subscription: "triage".into(),
            id: triaged[1].event.as_ref().unwrap().id.clone(),
            resolved_by: "ops".into(),
            notes: String::new(),
            ..Default::default()
        })
        .await
        .unwrap();

    // Kept: o-0 (unresolved dead letter), o-1 (in flight on slow), o-2..o-4 (slow's
    // cursor has not passed them). Nothing is old enough to go while slow holds them.
    let pool = database.pool().await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        event_positions(&pool).await,
        ["o-0", "o-1", "o-2", "o-3", "o-4"]
    );

    // slow finishes o-1 and reads the rest; the triage dead letter o-0 still holds.
    assert!(
        ack(&gateway, "slow", vec![slow_deliveries[1].ack_id.clone()])
            .await
            .is_empty()
    );
    let rest = slow.take(2, WAIT).await;
    assert!(
        ack(
            &gateway,
            "slow",
            rest.into_iter().map(|d| d.ack_id).collect()
        )
        .await
        .is_empty()
    );
    let rest = slow.take(1, WAIT).await;
    assert!(
        ack(
            &gateway,
            "slow",
            rest.into_iter().map(|d| d.ack_id).collect()
        )
        .await
        .is_empty()
    );
    eventually(
        "retention deletes every event nobody needs",
        Duration::from_secs(10),
        || async { event_positions(&pool).await == ["o-0"] },
    )
    .await;
    let resolved_records: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_deliveries WHERE resolved_at IS NOT NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        resolved_records, 0,
        "the resolved dead letter went with its event"
    );
}

/// Events of these aggregates, written "two hours ago" (created_at is the writing
/// transaction's start).
async fn insert_events_two_hours_old(pool: &PgPool, aggregates: &[&str]) {
    for aggregate in aggregates {
        sqlx::query(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, created_at) \
             VALUES ('order', $1, 'order.created', '{}', now() - interval '2 hours')",
        )
        .bind(aggregate)
        .execute(pool)
        .await
        .unwrap();
    }
}

#[tokio::test]
async fn maximum_retention_deletes_regardless_and_is_counted() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.maintenance.interval = Duration::from_millis(200);
    config.maintenance.retention = Duration::from_secs(3600);
    config.maintenance.max_retention = Some(Duration::from_secs(3600));
    let gateway = TestGateway::start_with(&database, config).await;
    create_subscription(&gateway, subscription("orders")).await;
    let pool = database.pool().await;
    insert_events_two_hours_old(&pool, &["old-1", "old-2"]).await;
    publish(&gateway, vec![event("new", "order.created")]).await;
    eventually(
        "the old events are force-expired",
        Duration::from_secs(10),
        || async { event_positions(&pool).await == ["new"] },
    )
    .await;
    let (_, outbox) = stats(&mut gateway.admin().await, "orders").await;
    assert_eq!(
        outbox.events_force_expired, 2,
        "both were still needed by the subscription"
    );
}

/// Events force-expired while leased leave the claim that holds them: they are no
/// longer counted in flight, and their ack ids are stale.
#[tokio::test]
async fn maximum_retention_takes_leased_events_out_of_their_claim() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    let pool = database.pool().await;
    insert_events_two_hours_old(&pool, &["old-1", "old-2"]).await;
    publish(&gateway, vec![event("new", "order.created")]).await;
    let mut consumer = Consumer::open(&gateway, "orders", 10).await;
    let deliveries = consumer.take(3, WAIT).await;

    // A second gateway with a maximum retention sweeps the old events away.
    let mut config = test_config(database.url());
    config.maintenance.interval = Duration::from_millis(200);
    config.maintenance.retention = Duration::from_secs(3600);
    config.maintenance.max_retention = Some(Duration::from_secs(3600));
    let _sweeper = TestGateway::start_with(&database, config).await;
    eventually(
        "the old events are force-expired",
        Duration::from_secs(10),
        || async { event_positions(&pool).await == ["new"] },
    )
    .await;
    let (orders, outbox) = stats(&mut gateway.admin().await, "orders").await;
    assert_eq!(outbox.events_force_expired, 2, "both were in flight");
    assert_eq!(orders.in_flight, 1);

    let (old, new): (Vec<_>, Vec<_>) = deliveries
        .into_iter()
        .partition(|delivery| aggregate_of(delivery).starts_with("old"));
    let old_ids: Vec<String> = old.into_iter().map(|d| d.ack_id).collect();
    assert_eq!(ack(&gateway, "orders", old_ids.clone()).await, old_ids);
    ack_all(
        &gateway,
        "orders",
        new.into_iter().map(|d| d.ack_id).collect(),
    )
    .await;
    let (orders, _) = stats(&mut gateway.admin().await, "orders").await;
    assert_eq!((orders.in_flight, orders.acked_total), (0, 1));
}

#[tokio::test]
async fn expired_leases_of_a_crashed_gateway_are_reclaimed_without_any_stream() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.maintenance.interval = Duration::from_millis(200);
    let gateway = TestGateway::start_with(&database, config).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            max_attempts: Some(3),
            ..subscription("orders")
        },
    )
    .await;
    publish(
        &gateway,
        vec![event("o-1", "order.created"), event("o-2", "order.created")],
    )
    .await;
    let pool = database.pool().await;
    // What a gateway that died mid-delivery leaves behind: expired leases, one of them on
    // its last attempt.
    sqlx::query(
        "INSERT INTO outbox_deliveries (subscription_id, position, state, attempt, lease_token, due_at) \
         SELECT s.id, e.position, 'in_flight', CASE e.aggregate_id WHEN 'o-1' THEN 1 ELSE 3 END, 42, \
                now() - interval '1 minute' \
         FROM outbox_subscriptions s, outbox_events e WHERE s.name = 'orders'",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("UPDATE outbox_cursors SET cursor_xact_id = 9223372036854775807")
        .execute(&pool)
        .await
        .unwrap();

    eventually(
        "expired leases are reclaimed",
        Duration::from_secs(10),
        || async {
            delivery_records(&pool, "orders").await
                == vec![
                    ("o-1".to_string(), "retry".to_string(), 1),
                    ("o-2".to_string(), "dead".to_string(), 3),
                ]
        },
    )
    .await;
    let mut consumer = Consumer::open(&gateway, "orders", 0).await;
    let delivery = consumer.next(WAIT).await.unwrap();
    assert_eq!(
        (aggregate_of(&delivery).as_str(), delivery.attempt),
        ("o-1", 2)
    );
    let letters = list_dead_letters(&mut gateway.admin().await, listing("orders")).await;
    assert_eq!(letters.dead_letters[0].last_error, "ack deadline exceeded");
}

/// Arguments of a gateway process that only serves consumers: no maintenance (what
/// reclaims leases is the test's own gateway), no metrics port.
const SERVES_CONSUMERS_ONLY: [&str; 3] = ["--no-maintenance", "--metrics-listen", "off"];

/// A Subscribe stream on the gateway behind `channel`.
async fn consumer_through(channel: Channel, subscription: &str) -> Consumer {
    let stream = proto::subscriber_client::SubscriberClient::new(channel)
        .subscribe(proto::SubscribeRequest {
            subscription: subscription.into(),
            max_in_flight: 10,
            ..Default::default()
        })
        .await
        .expect("subscribe")
        .into_inner();
    Consumer::from_stream(stream)
}

/// Where the event stands on each subscription, as GetEvent tells: its name, the state,
/// the attempts made and the last error.
async fn standing(
    gateway: &TestGateway,
    id: &str,
) -> Vec<(String, proto::DeliveryState, u32, String)> {
    gateway
        .admin()
        .await
        .get_event(proto::GetEventRequest {
            id: id.into(),
            ..Default::default()
        })
        .await
        .expect("get the event")
        .into_inner()
        .subscriptions
        .into_iter()
        .map(|on| {
            (
                on.subscription.clone(),
                on.state(),
                on.attempt,
                on.last_error,
            )
        })
        .collect()
}

/// Leases held in claim batches, and delivery records of their own, of every
/// subscription.
async fn leases_in_batches_and_records(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT coalesce(sum(cardinality(positions)), 0) FROM outbox_delivery_batches), \
                (SELECT count(*) FROM outbox_deliveries)",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Consumers that take claims and vanish with their gateway replica (scaled to zero
/// without a chance to give their leases back) leave claim batches that no stream will
/// ever ask for again. The maintenance of the gateway that stays, with no stream of its
/// own, takes them out once expired: a retry while attempts are left, counted, for the
/// next consumer to attach; a dead letter once the last attempt expired too.
#[tokio::test]
async fn expired_claim_batches_go_through_retries_to_dead_letters_with_no_stream_attached() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.maintenance.interval = Duration::from_millis(200);
    let gateway = TestGateway::start_with(&database, config).await;
    for (name, max_attempts) in [("orders", 2), ("audit", 1)] {
        create_subscription(
            &gateway,
            proto::Subscription {
                // Short, yet long enough on a loaded machine for the claims to be taken
                // and the acks below made well within it.
                ack_deadline: seconds(8),
                max_attempts: Some(max_attempts),
                ..subscription(name)
            },
        )
        .await;
    }
    let ids = publish_ids(&gateway, orders(4)).await;
    let pool = database.pool().await;
    let reclaim_within = Duration::from_secs(30);

    // A replica's consumers take a claim of each subscription; the replica dies.
    let (mut first_replica, _first_log, _, first_channel) =
        start_gateway_process(&database, &SERVES_CONSUMERS_ONLY).await;
    let mut attached = Vec::new();
    for name in ["orders", "audit"] {
        let mut consumer = consumer_through(first_channel.clone(), name).await;
        let attempts: Vec<u32> = consumer
            .take(4, WAIT)
            .await
            .iter()
            .map(|delivery| delivery.attempt)
            .collect();
        assert_eq!(attempts, [1, 1, 1, 1]);
        attached.push(consumer);
    }
    assert_eq!(
        leases_in_batches_and_records(&pool).await,
        (8, 0),
        "every lease is in a claim batch"
    );
    first_replica.start_kill().expect("SIGKILL");
    first_replica.wait().await.unwrap();
    drop(attached);

    eventually(
        "maintenance reclaims the expired claim batches",
        reclaim_within,
        || async {
            leases_in_batches_and_records(&pool).await == (0, 8)
                && delivery_records(&pool, "orders")
                    .await
                    .iter()
                    .all(|(_, state, attempt)| (state.as_str(), *attempt) == ("retry", 1))
                && delivery_records(&pool, "audit")
                    .await
                    .iter()
                    .all(|(_, state, attempt)| (state.as_str(), *attempt) == ("dead", 1))
        },
    )
    .await;
    let expired = || "ack deadline exceeded".to_owned();
    for id in &ids {
        assert_eq!(
            standing(&gateway, id).await,
            [
                ("audit".into(), proto::DeliveryState::Dead, 1, expired()),
                (
                    "orders".into(),
                    proto::DeliveryState::AwaitingRetry,
                    1,
                    expired()
                ),
            ]
        );
    }
    let retrying = subscription_stats(&gateway, "orders").await;
    assert_eq!(
        (
            retrying.in_flight,
            retrying.awaiting_retry,
            retrying.dead_lettered,
            retrying.delivered_total
        ),
        (0, 4, 0, 4)
    );
    let audit_letters = crate::common::list_dead_letters(&gateway, "audit").await;
    assert_eq!(audit_letters.len(), 4, "{audit_letters:?}");
    assert!(
        audit_letters
            .iter()
            .all(|letter| letter.attempts == 1 && letter.last_error == expired()),
        "{audit_letters:?}"
    );

    // A consumer attaching later, on another replica, gets the retries on their last
    // attempt; it acks two and its replica dies with the other two.
    let (mut second_replica, _second_log, _, second_channel) =
        start_gateway_process(&database, &SERVES_CONSUMERS_ONLY).await;
    let mut consumer = consumer_through(second_channel.clone(), "orders").await;
    let mut retried = consumer.take(4, WAIT).await;
    retried.sort_by_key(aggregate_of);
    let retried_as: Vec<(String, u32)> = retried
        .iter()
        .map(|delivery| (aggregate_of(delivery), delivery.attempt))
        .collect();
    assert_eq!(
        retried_as,
        [("o-0", 2), ("o-1", 2), ("o-2", 2), ("o-3", 2)].map(|(a, n)| (a.to_owned(), n))
    );
    let stale = proto::subscriber_client::SubscriberClient::new(second_channel)
        .ack(proto::AckRequest {
            subscription: "orders".into(),
            ack_ids: retried[..2].iter().map(|d| d.ack_id.clone()).collect(),
        })
        .await
        .expect("ack")
        .into_inner()
        .stale_ack_ids;
    assert!(stale.is_empty(), "{stale:?}");
    second_replica.start_kill().expect("SIGKILL");
    second_replica.wait().await.unwrap();
    drop(consumer);

    eventually(
        "maintenance dead-letters the leases that used the last attempt",
        reclaim_within,
        || async {
            delivery_records(&pool, "orders").await
                == [("o-2", "dead", 2), ("o-3", "dead", 2)]
                    .map(|(aggregate, state, attempt)| (aggregate.into(), state.into(), attempt))
        },
    )
    .await;
    let letters = crate::common::list_dead_letters(&gateway, "orders").await;
    let lettered: Vec<(String, u32, String)> = letters
        .iter()
        .map(|letter| {
            let event = letter.event.as_ref().expect("event");
            (
                event.aggregate_id.clone(),
                letter.attempts,
                letter.last_error.clone(),
            )
        })
        .collect();
    assert_eq!(
        lettered,
        [("o-2".into(), 2, expired()), ("o-3".into(), 2, expired())]
    );
    let finished = subscription_stats(&gateway, "orders").await;
    assert_eq!(
        (
            finished.in_flight,
            finished.awaiting_retry,
            finished.dead_lettered,
            finished.acked_total,
            finished.delivered_total
        ),
        (0, 0, 2, 2, 8)
    );
}

/// Dead rows of the delivery table, and how often it has been vacuumed by hand.
async fn delivery_table_vacuum_stats(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as(
        "SELECT n_dead_tup, vacuum_count FROM pg_stat_user_tables \
         WHERE relid = 'outbox_deliveries'::regclass",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn maintenance_vacuums_the_delivery_table_once_acks_left_enough_dead_rows() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.maintenance.vacuum_check_interval = Duration::from_millis(200);
    config.maintenance.vacuum_min_dead_rows = 300;
    let gateway = TestGateway::start_with(&database, config).await;
    // Ordered: its deliveries have records of their own (elsewhere a claim's acks
    // settle one batch row).
    create_subscription(
        &gateway,
        proto::Subscription {
            ordered: true,
            ..subscription("orders")
        },
    )
    .await;
    let pool = database.pool().await;

    let events = (0..500)
        .map(|index| event(&format!("o-{index}"), "order.created"))
        .collect();
    publish(&gateway, events).await;
    assert_eq!(delivery_table_vacuum_stats(&pool).await.1, 0);
    let mut consumer = Consumer::open(&gateway, "orders", 100).await;
    for _ in 0..5 {
        let deliveries = consumer.take(100, WAIT).await;
        let ack_ids = deliveries.into_iter().map(|d| d.ack_id).collect();
        assert!(ack(&gateway, "orders", ack_ids).await.is_empty());
    }

    // Statistics reach pg_stat_user_tables up to ten seconds after the acks.
    eventually(
        "maintenance vacuums the delivery table",
        Duration::from_secs(30),
        || async { delivery_table_vacuum_stats(&pool).await.1 > 0 },
    )
    .await;
    let (dead_rows, _) = delivery_table_vacuum_stats(&pool).await;
    assert!(dead_rows < 300, "{dead_rows} dead rows left after a vacuum");
}

/// A mask that names a setting without sending it is refused for every setting alike,
/// so an update never resets one to its default by omission.
#[tokio::test]
async fn update_mask_naming_an_unsent_setting_is_refused() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            max_attempts: Some(3),
            ack_deadline: seconds(45),
            ..subscription("orders")
        },
    )
    .await;
    let mut admin = gateway.admin().await;
    for path in ["max_attempts", "ack_deadline", "retry_backoff_min"] {
        let refused = admin
            .update_subscription(proto::UpdateSubscriptionRequest {
                subscription: Some(proto::Subscription {
                    name: "orders".into(),
                    ..Default::default()
                }),
                update_mask: Some(prost_types::FieldMask {
                    paths: vec![path.into()],
                }),
                validate_only: false,
            })
            .await;
        assert_status(
            refused,
            Code::InvalidArgument,
            &format!("subscription.{path}"),
        );
    }
    let unchanged = admin
        .get_subscription(proto::GetSubscriptionRequest {
            name: "orders".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (unchanged.max_attempts, unchanged.ack_deadline),
        (Some(3), seconds(45))
    );
}

#[tokio::test]
async fn a_subscription_unused_past_its_expire_after_idle_is_deleted() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.maintenance.interval = Duration::from_millis(200);
    let gateway = TestGateway::start_with(&database, config).await;
    let mut admin = gateway.admin().await;
    // Too short to tell from an attached stream; too long for the database's time
    // arithmetic (the expiry sweep would fail for every subscription).
    for refused in [seconds(1), seconds(200 * 365 * 24 * 3600)] {
        let answer = admin
            .create_subscription(proto::CreateSubscriptionRequest {
                subscription: Some(proto::Subscription {
                    expire_after_idle: refused,
                    ..subscription("reader")
                }),
                validate_only: false,
            })
            .await;
        assert_status(
            answer,
            Code::InvalidArgument,
            "subscription.expire_after_idle",
        );
    }
    let created = create_subscription(
        &gateway,
        proto::Subscription {
            expire_after_idle: seconds(10),
            ..subscription("reader")
        },
    )
    .await;
    assert_eq!(created.expire_after_idle, seconds(10));
    create_subscription(&gateway, subscription("durable")).await;
    let names = || async {
        let mut admin = gateway.admin().await;
        let list = admin
            .list_subscriptions(proto::ListSubscriptionsRequest {})
            .await
            .unwrap()
            .into_inner()
            .subscriptions;
        list.into_iter().map(|s| s.name).collect::<Vec<_>>()
    };

    // A stream attached for longer than expire_after_idle keeps it.
    let consumer = Consumer::open(&gateway, "reader", 0).await;
    tokio::time::sleep(Duration::from_secs(14)).await;
    assert_eq!(names().await, ["durable", "reader"]);

    drop(consumer);
    eventually(
        "the unused subscription is deleted",
        Duration::from_secs(60),
        || async { names().await == ["durable"] },
    )
    .await;
}

/// Each subscription's status and what it means, as GetStats gives them.
async fn statuses(gateway: &TestGateway) -> Vec<(String, proto::SubscriptionStatus, String)> {
    gateway
        .admin()
        .await
        .get_stats(proto::GetStatsRequest::default())
        .await
        .expect("stats")
        .into_inner()
        .subscriptions
        .into_iter()
        .map(|stats| (stats.name.clone(), stats.status(), stats.status_detail))
        .collect()
}

async fn status_of(gateway: &TestGateway, name: &str) -> (proto::SubscriptionStatus, String) {
    statuses(gateway)
        .await
        .into_iter()
        .find(|(found, _, _)| found == name)
        .map(|(_, status, detail)| (status, detail))
        .unwrap_or_else(|| panic!("no stats of {name}"))
}

fn only(name: &str, event_type: &str) -> proto::Subscription {
    proto::Subscription {
        event_types: vec![event_type.into()],
        ..subscription(name)
    }
}

#[tokio::test]
async fn stats_give_each_subscription_its_most_pressing_status() {
    use proto::SubscriptionStatus as Status;
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let pool = database.pool().await;
    for (name, event_type) in [
        ("idle", "nothing.*"),
        ("later", "reminder.*"),
        ("orphan", "order.*"),
        ("held", "order.*"),
        ("dead", "invoice.*"),
        ("late", "old.*"),
    ] {
        create_subscription(&gateway, only(name, event_type)).await;
    }
    gateway
        .admin()
        .await
        .pause_subscription(proto::PauseSubscriptionRequest {
            name: "held".into(),
            reason: "deploy".into(),
            until: None,
        })
        .await
        .expect("pause");
    publish(
        &gateway,
        vec![
            proto::EventInput {
                deliver_at: Some(prost_types::Timestamp::from(
                    std::time::SystemTime::now() + Duration::from_secs(15 * 60),
                )),
                ..event("r-1", "reminder.due")
            },
            event("o-1", "order.created"),
            event("i-1", "invoice.created"),
        ],
    )
    .await;
    sqlx::query(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, created_at) \
         VALUES ('old', 'x-1', 'old.event', '{}', now() - interval '10 minutes')",
    )
    .execute(&pool)
    .await
    .expect("an event ten minutes old");
    let mut consumer = Consumer::open(&gateway, "dead", 1).await;
    let invoice = consumer.take(1, WAIT).await.remove(0);
    nack(&gateway, dead_letter_now("dead", invoice.ack_id)).await;

    let (status, detail) = status_of(&gateway, "held").await;
    assert_eq!(status, Status::Paused, "{detail}");
    assert!(detail.contains("deploy"), "{detail}");
    assert_eq!(status_of(&gateway, "idle").await.0, Status::CaughtUp);
    let (status, detail) = status_of(&gateway, "later").await;
    assert_eq!(status, Status::ScheduledOnly, "{detail}");
    eventually("the dead letter shows", WAIT, || async {
        status_of(&gateway, "dead").await.0 == Status::DeadLetters
    })
    .await;
    // No stream anywhere: the missing consumer is what to fix, late or not.
    let (status, detail) = status_of(&gateway, "orphan").await;
    assert_eq!(status, Status::NoConsumer, "{detail}");
    assert!(detail.contains("no consumer"), "{detail}");
    let (status, detail) = status_of(&gateway, "late").await;
    assert_eq!(status, Status::NoConsumer, "no consumer outranks behind");
    assert!(
        detail.contains("the oldest due event has waited"),
        "{detail}"
    );
    let _late_consumer = Consumer::open(&gateway, "late", 1).await;
    eventually(
        "a late subscription with a consumer is behind",
        WAIT,
        || async { status_of(&gateway, "late").await.0 == Status::Behind },
    )
    .await;

    // A stream attached again: the consumer is back.
    let _orphan_consumer = Consumer::open(&gateway, "orphan", 1).await;
    eventually("the consumer counts as attached", WAIT, || async {
        status_of(&gateway, "orphan").await.0 != Status::NoConsumer
    })
    .await;
}

/// The relay's poll interval in the replicas test, and how long after a stream comes or
/// goes each replica may take to say so: a poll interval, and slack for a loaded machine
/// (the old reading took 30 s).
const REPLICA_POLL: Duration = Duration::from_secs(1);
const WITHIN_A_POLL: Duration = Duration::from_secs(4);

/// The status every replica gives `name`, read on each within `within`.
async fn on_every_replica(
    replicas: [&TestGateway; 2],
    name: &str,
    expected: proto::SubscriptionStatus,
    within: Duration,
) {
    for (replica, gateway) in replicas.into_iter().enumerate() {
        let read = poll_until(within, POLL, || async {
            let (status, detail) = status_of(gateway, name).await;
            (status == expected).then_some(detail)
        })
        .await;
        let detail = match read {
            Some(detail) => detail,
            None => {
                let (status, detail) = status_of(gateway, name).await;
                panic!("replica {replica} reads {status:?} ({detail}), not {expected:?}")
            }
        };
        assert!(!detail.is_empty(), "replica {replica}: no detail");
    }
}

/// A pull subscription with due events and no Subscribe stream on any of two gateways
/// sharing a database reads "no consumer" on both within a poll interval — when it never
/// had a consumer, and when its only stream, on one of them, ends — and not "behind",
/// though its oldest event is late; the command line says so too. While the stream is
/// there, the replica without it knows.
#[tokio::test]
async fn no_consumer_shows_on_every_replica_within_a_poll_interval() {
    use proto::SubscriptionStatus as Status;
    let database = TestDatabase::create().await;
    let replica_config = || {
        let mut config = test_config(database.url());
        config.delivery.poll_interval = REPLICA_POLL;
        config
    };
    let first = TestGateway::start_with(&database, replica_config()).await;
    let second = TestGateway::start_with(&database, replica_config()).await;
    create_subscription(&first, subscription("orders")).await;
    sqlx::query(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, created_at) \
         VALUES ('order', 'o-0', 'order.created', '{}', now() - interval '10 minutes')",
    )
    .execute(&database.pool().await)
    .await
    .expect("an event ten minutes old");
    publish(&first, orders(2)).await;

    on_every_replica(
        [&first, &second],
        "orders",
        Status::NoConsumer,
        WITHIN_A_POLL,
    )
    .await;
    let (_, detail) = status_of(&second, "orders").await;
    assert!(detail.contains("no consumer"), "{detail}");
    assert!(
        detail.contains("the oldest due event has waited"),
        "{detail}"
    );
    let stats = crate::cli::cli(&second, &["stats"]).await;
    assert!(stats.success, "{}", stats.stderr);
    assert!(stats.stdout.contains("no consumer"), "{}", stats.stdout);
    let got = crate::cli::cli(&second, &["subscriptions", "get", "orders"]).await;
    assert!(got.success, "{}", got.stderr);
    let status_line = got
        .stdout
        .lines()
        .find(|line| line.starts_with("status:"))
        .unwrap_or_else(|| panic!("no status in:\n{}", got.stdout));
    assert!(status_line.contains(" no consumer ("), "{status_line}");

    // A stream on the first: both know a consumer is there, and that it is behind.
    let mut consumer = Consumer::open(&first, "orders", 1).await;
    consumer.take(1, WAIT).await;
    on_every_replica([&first, &second], "orders", Status::Behind, WITHIN_A_POLL).await;

    // It ends: both say so within a poll interval, though a stream was seen a moment ago.
    drop(consumer);
    on_every_replica(
        [&first, &second],
        "orders",
        Status::NoConsumer,
        WITHIN_A_POLL,
    )
    .await;
    let got = crate::cli::cli(&first, &["subscriptions", "get", "orders"]).await;
    assert!(got.stdout.contains(" no consumer ("), "{}", got.stdout);

    // A replica that stops takes the record of its streams with it.
    let mut consumer = Consumer::open(&second, "orders", 1).await;
    consumer.take(1, WAIT).await;
    on_every_replica([&first, &second], "orders", Status::Behind, WITHIN_A_POLL).await;
    second.stop().await.expect("the second replica stops");
    drop(consumer);
    let records: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_subscription_streams")
        .fetch_one(&database.pool().await)
        .await
        .expect("count the stream records");
    assert_eq!(
        records, 0,
        "a stopped gateway's record of its streams is left"
    );
}

/// With `--no-maintenance` a gateway deletes nothing past retention (nor reclaims or
/// expires anything): another gateway on the same database, with maintenance, does.
#[tokio::test]
async fn without_maintenance_a_gateway_leaves_retention_to_another() {
    let database = TestDatabase::create().await;
    let upkeep = |enabled: bool| {
        let mut config = test_config(database.url());
        config.maintenance.enabled = enabled;
        config.maintenance.interval = Duration::from_millis(100);
        config.maintenance.retention = Duration::from_millis(1);
        config
    };
    let idle = TestGateway::start_with(&database, upkeep(false)).await;
    publish(
        &idle,
        (0..5)
            .map(|i| event(&format!("o-{i}"), "order.created"))
            .collect(),
    )
    .await;
    let pool = database.pool().await;
    // Ten maintenance intervals, each of which would have deleted them all.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        count_events(&pool).await,
        5,
        "retention ran without maintenance"
    );

    let _keeper = TestGateway::start_with(&database, upkeep(true)).await;
    eventually(
        "the other gateway's maintenance deletes them",
        WAIT,
        || async { count_events(&pool).await == 0 },
    )
    .await;
}

/// `--retention-batch-size` bounds each retention batch, and a maintenance pass runs at
/// most 100 batches: with batches of one, a pass deletes 100 of 150 events and the next
/// pass the rest.
#[tokio::test]
async fn retention_deletes_in_batches_of_the_configured_size() {
    let database = TestDatabase::create().await;
    let mut without_maintenance = test_config(database.url());
    without_maintenance.maintenance.enabled = false;
    let publisher = TestGateway::start_with(&database, without_maintenance).await;
    publish(
        &publisher,
        (0..150)
            .map(|i| event(&format!("o-{i}"), "order.created"))
            .collect(),
    )
    .await;
    publisher.stop().await.unwrap();

    let mut config = test_config(database.url());
    config.maintenance.interval = Duration::from_secs(2);
    config.maintenance.retention = Duration::from_millis(1);
    config.maintenance.batch_size = 1;
    let _gateway = TestGateway::start_with(&database, config).await;
    let pool = database.pool().await;
    let seen = std::sync::Mutex::new(Vec::new());
    eventually("retention deletes everything", WAIT, || async {
        let count = count_events(&pool).await;
        let mut seen = seen.lock().unwrap();
        if seen.last() != Some(&count) {
            seen.push(count);
        }
        count == 0
    })
    .await;
    let seen = seen.into_inner().unwrap();
    // A pass deletes while the test looks, so it sees counts on the way; but the first
    // pass stops at 50 and the rest wait two seconds for the next one.
    assert!(
        seen.contains(&50),
        "no pause at 50 events left: one pass deleted more than 100 batches of one ({seen:?})"
    );
}
