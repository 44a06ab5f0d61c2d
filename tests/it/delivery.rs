//! The delivery engine: subscriptions, streams, leases, retries, dead letters, ordering,
//! flow control, and never skipping an event.

use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

use crate::common::*;
use outbox_gateway::proto::{self, SubscribeRequest};
use tonic::Code;

/// Generous: a busy machine or a long transaction elsewhere in the cluster slows delivery.
const WAIT: Duration = Duration::from_secs(15);
const QUIET: Duration = Duration::from_millis(400);

async fn insert_directly(
    executor: impl sqlx::PgExecutor<'_>,
    aggregate_id: &str,
    event_type: &str,
) {
    sqlx::query(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('order', $1, $2, '{}')",
    )
    .bind(aggregate_id)
    .bind(event_type)
    .execute(executor)
    .await
    .unwrap();
}

#[tokio::test]
async fn delivers_in_commit_order_and_acks_settle_for_good() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    publish(
        &gateway,
        (0..3)
            .map(|i| event(&format!("o-{i}"), "order.created"))
            .collect(),
    )
    .await;

    let mut consumer = Consumer::open(&gateway, "orders", 0).await;
    let deliveries = consumer.take(3, WAIT).await;
    let aggregates: Vec<String> = deliveries.iter().map(aggregate_of).collect();
    assert_eq!(aggregates, ["o-0", "o-1", "o-2"]);
    assert!(deliveries.iter().all(|d| d.attempt == 1));
    let event = deliveries[0].event.as_ref().unwrap();
    assert_eq!(event.payload, br#"{"aggregate":"o-0"}"#);
    assert!(event.created_at.is_some() && event.occurred_at.is_some());

    let ack_ids: Vec<String> = deliveries.iter().map(|d| d.ack_id.clone()).collect();
    assert!(ack(&gateway, "orders", ack_ids.clone()).await.is_empty());
    assert!(
        delivery_records(&database.pool().await, "orders")
            .await
            .is_empty()
    );
    // Acking again: already settled, so every id comes back stale.
    assert_eq!(ack(&gateway, "orders", ack_ids.clone()).await, ack_ids);
    assert!(
        consumer.next(QUIET).await.is_none(),
        "acked events are not delivered again"
    );
}

#[tokio::test]
async fn an_event_that_commits_after_a_later_one_is_not_skipped() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    let pool = database.pool().await;
    let mut consumer = Consumer::open(&gateway, "orders", 0).await;

    // The slow transaction takes its transaction id first and inserts first, so its row
    // gets the lower position, but commits last.
    let mut slow = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut *slow)
        .await
        .unwrap();
    insert_directly(&mut *slow, "slow", "order.created").await;
    insert_directly(&pool, "fast", "order.created").await;

    // "fast" goes out at once: nothing waits for an open transaction.
    let first = consumer.take(1, WAIT).await;
    assert_eq!(aggregate_of(&first[0]), "fast");
    assert!(
        consumer.next(QUIET).await.is_none(),
        "slow is not committed"
    );
    // "slow" was passed while open; it is delivered once it commits.
    slow.commit().await.unwrap();
    let late = consumer.take(1, WAIT).await;
    assert_eq!(aggregate_of(&late[0]), "slow");
    assert!(consumer.next(QUIET).await.is_none(), "nothing twice");
}

#[tokio::test]
async fn interleaved_writers_with_rollbacks_lose_nothing_and_leak_nothing() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("all")).await;
    let pool = database.pool().await;
    let mut consumer = Consumer::open(&gateway, "all", 1000).await;

    // Eight writers interleave transactions of random length; every third rolls back.
    let mut writers = Vec::new();
    for writer in 0..8 {
        let pool = pool.clone();
        writers.push(tokio::spawn(async move {
            let mut committed = Vec::new();
            for round in 0..15 {
                let mut transaction = pool.begin().await.unwrap();
                let aggregate = format!("w{writer}-{round}");
                insert_directly(&mut *transaction, &aggregate, "order.created").await;
                tokio::time::sleep(Duration::from_millis(rand_below(20))).await;
                if (writer + round) % 3 == 0 {
                    transaction.rollback().await.unwrap();
                } else {
                    transaction.commit().await.unwrap();
                    committed.push(aggregate);
                }
            }
            committed
        }));
    }
    let mut committed = HashSet::new();
    for writer in writers {
        committed.extend(writer.await.unwrap());
    }
    let deliveries = consumer.take(committed.len(), WAIT).await;
    let delivered: HashSet<String> = deliveries.iter().map(aggregate_of).collect();
    assert_eq!(
        delivered, committed,
        "exactly the committed events, each once"
    );
    assert!(
        consumer.next(QUIET).await.is_none(),
        "no rolled-back event and no duplicate"
    );
}

fn rand_below(limit: u64) -> u64 {
    rand::random::<u64>() % limit
}

#[tokio::test]
async fn direct_inserts_wake_the_relay_without_waiting_for_the_poll() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.delivery.poll_interval = Duration::from_secs(60);
    let gateway = TestGateway::start_with(&database, config).await;
    create_subscription(&gateway, subscription("orders")).await;
    let mut consumer = Consumer::open(&gateway, "orders", 0).await;
    // Let the first (empty) claim pass so only a wake-up can deliver what follows.
    assert!(consumer.next(QUIET).await.is_none());

    insert_directly(&database.pool().await, "o-1", "order.created").await;
    let delivery = consumer
        .next(WAIT)
        .await
        .expect("delivered long before the 60 s poll");
    assert_eq!(aggregate_of(&delivery), "o-1");
}

#[tokio::test]
async fn latest_start_skips_history_and_earliest_replays_it() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    publish(&gateway, vec![event("before", "order.created")]).await;
    // LATEST starts at the read horizon: an event is "before" once every transaction
    // older than it has ended (other tests share the cluster and may hold it back).
    let pool = database.pool().await;
    eventually(
        "every transaction older than the first event has ended",
        Duration::from_secs(60),
        || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint > max(xact_id) \
                 FROM outbox_events",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
        },
    )
    .await;
    create_subscription(
        &gateway,
        proto::Subscription {
            name: "latest".into(),
            ..Default::default()
        },
    )
    .await;
    create_subscription(&gateway, subscription("earliest")).await;
    publish(&gateway, vec![event("after", "order.created")]).await;

    let mut latest = Consumer::open(&gateway, "latest", 0).await;
    assert_eq!(aggregate_of(&latest.next(WAIT).await.unwrap()), "after");
    assert!(latest.next(QUIET).await.is_none());
    let mut earliest = Consumer::open(&gateway, "earliest", 0).await;
    let all: Vec<String> = earliest
        .take(2, WAIT)
        .await
        .iter()
        .map(aggregate_of)
        .collect();
    assert_eq!(all, ["before", "after"]);
}

#[tokio::test]
async fn filters_give_each_subscription_exactly_its_events() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            event_types: vec!["order.*".into()],
            ..subscription("one-segment")
        },
    )
    .await;
    create_subscription(
        &gateway,
        proto::Subscription {
            event_types: vec!["order.**".into()],
            ..subscription("any-depth")
        },
    )
    .await;
    create_subscription(
        &gateway,
        proto::Subscription {
            aggregate_types: vec!["invoice".into()],
            ..subscription("invoices")
        },
    )
    .await;
    create_subscription(
        &gateway,
        proto::Subscription {
            metadata_match: HashMap::from([("tenant".into(), "acme".into())]),
            ..subscription("acme")
        },
    )
    .await;

    let mut invoice = event("i-1", "invoice.issued");
    invoice.aggregate_type = "invoice".into();
    let mut acme = event("o-acme", "order.created");
    acme.metadata = HashMap::from([
        ("tenant".into(), "acme".into()),
        ("region".into(), "eu".into()),
    ]);
    let mut other_tenant = event("o-globex", "order.created");
    other_tenant.metadata = HashMap::from([("tenant".into(), "globex".into())]);
    publish(
        &gateway,
        vec![
            acme,
            event("o-item", "order.item.added"),
            invoice,
            other_tenant,
            event("o-x", "orderx.created"),
        ],
    )
    .await;

    let expectations: [(&str, &[&str]); 4] = [
        ("one-segment", &["o-acme", "o-globex"]),
        ("any-depth", &["o-acme", "o-item", "o-globex"]),
        ("invoices", &["i-1"]),
        ("acme", &["o-acme"]),
    ];
    for (name, expected) in expectations {
        let mut consumer = Consumer::open(&gateway, name, 0).await;
        let got: Vec<String> = consumer
            .take(expected.len(), WAIT)
            .await
            .iter()
            .map(aggregate_of)
            .collect();
        assert_eq!(got, expected, "subscription {name}");
        assert!(
            consumer.next(QUIET).await.is_none(),
            "subscription {name} got more than its events"
        );
    }
}

#[tokio::test]
async fn an_expired_lease_is_redelivered_and_the_late_ack_is_stale() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            ack_deadline: seconds(1),
            ..subscription("orders")
        },
    )
    .await;
    publish(&gateway, vec![event("o-1", "order.created")]).await;

    let mut consumer = Consumer::open(&gateway, "orders", 0).await;
    let first = consumer.next(WAIT).await.unwrap();
    assert_eq!(first.attempt, 1);
    let started = Instant::now();
    let second = consumer
        .next(WAIT)
        .await
        .expect("redelivered after the deadline");
    assert!(
        started.elapsed() >= Duration::from_millis(700),
        "redelivered before the deadline"
    );
    assert_eq!(second.attempt, 2);
    assert_eq!(aggregate_of(&second), "o-1");

    assert_eq!(
        ack(&gateway, "orders", vec![first.ack_id.clone()]).await,
        vec![first.ack_id]
    );
    assert!(
        ack(&gateway, "orders", vec![second.ack_id])
            .await
            .is_empty()
    );
}

#[tokio::test]
async fn a_closed_stream_gives_its_deliveries_back_at_once() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            ack_deadline: seconds(600),
            ..subscription("orders")
        },
    )
    .await;
    publish(
        &gateway,
        (0..3)
            .map(|i| event(&format!("o-{i}"), "order.created"))
            .collect(),
    )
    .await;

    let mut first = Consumer::open(&gateway, "orders", 0).await;
    let taken = first.take(3, WAIT).await;
    drop(first);

    let mut second = Consumer::open(&gateway, "orders", 0).await;
    let again = second.take(3, WAIT).await;
    assert!(again.iter().all(|d| d.attempt == 2));
    let stale = ack_deliveries(&gateway, "orders", &taken).await;
    assert_eq!(stale.len(), 3, "the closed stream's ack ids are stale");
    assert!(ack_deliveries(&gateway, "orders", &again).await.is_empty());
}

/// One claim's deliveries settled three ways: the acked third never comes back, the
/// nacked third and the third left to expire come back once each as attempt 2, and the
/// stats count each event once.
#[tokio::test]
async fn a_batch_partly_acked_partly_nacked_partly_expired_comes_back_only_where_unsettled() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    // Long enough for a new stream to collect all 30 (its window starts at 10 and
    // doubles each second) before the first leases run out.
    create_subscription(
        &gateway,
        proto::Subscription {
            ack_deadline: seconds(5),
            ..subscription("orders")
        },
    )
    .await;
    publish(
        &gateway,
        (0..30)
            .map(|i| event(&format!("o-{i:02}"), "order.created"))
            .collect(),
    )
    .await;
    let mut consumer = Consumer::open(&gateway, "orders", 0).await;
    let first = consumer.take(30, WAIT).await;
    assert_eq!(first.len(), 30);
    assert!(first.iter().all(|delivery| delivery.attempt == 1));
    let (acked, rest) = first.split_at(10);
    let (nacked, left) = rest.split_at(10);
    assert!(ack_deliveries(&gateway, "orders", acked).await.is_empty());
    for delivery in nacked {
        nack(
            &gateway,
            proto::NackRequest {
                subscription: "orders".into(),
                ack_id: delivery.ack_id.clone(),
                reason: "try again".into(),
                retry_after: Some(prost_types::Duration::default()),
                ..Default::default()
            },
        )
        .await;
    }

    // A stream whose leases expired unsettled is offered one delivery at a time until it
    // settles again: ack each as it comes, as a consumer would.
    let mut again = Vec::new();
    while again.len() < 20 {
        let delivery = consumer
            .next(WAIT)
            .await
            .unwrap_or_else(|| panic!("got {} of 20 redeliveries", again.len()));
        assert!(
            ack(&gateway, "orders", vec![delivery.ack_id.clone()])
                .await
                .is_empty()
        );
        again.push(delivery);
    }
    let expected: HashSet<String> = nacked.iter().chain(left).map(aggregate_of).collect();
    let came_back: HashSet<String> = again.iter().map(aggregate_of).collect();
    assert_eq!(came_back, expected, "each unsettled event comes back once");
    assert!(again.iter().all(|delivery| delivery.attempt == 2));
    // The late acks of the expired leases are stale.
    assert_eq!(ack_deliveries(&gateway, "orders", left).await.len(), 10);
    assert!(
        consumer.next(QUIET).await.is_none(),
        "nothing acked comes back"
    );
    let stats = subscription_stats(&gateway, "orders").await;
    assert_eq!(
        (stats.acked_total, stats.in_flight, stats.pending),
        (30, 0, 0)
    );
}

/// A subscription with 10,000 deliveries in flight at once: all arrive once, acks in
/// shuffled batches settle every one, and nothing comes back.
#[tokio::test]
async fn ten_thousand_deliveries_in_flight_settle_exactly_once() {
    const EVENTS: usize = 10_000;
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            ack_deadline: seconds(600),
            ..subscription("orders")
        },
    )
    .await;
    for chunk in (0..EVENTS).collect::<Vec<_>>().chunks(500) {
        publish(
            &gateway,
            chunk
                .iter()
                .map(|i| event(&format!("o-{i}"), "order.created"))
                .collect(),
        )
        .await;
    }
    let mut consumer = Consumer::open(&gateway, "orders", EVENTS as u32).await;
    let mut deliveries = consumer.take(EVENTS, Duration::from_secs(120)).await;
    assert_eq!(deliveries.len(), EVENTS);
    let distinct: HashSet<String> = deliveries.iter().map(aggregate_of).collect();
    assert_eq!(distinct.len(), EVENTS, "each event once");
    let in_flight = subscription_stats(&gateway, "orders").await.in_flight;
    assert_eq!(in_flight, EVENTS as u64);

    // Settled out of order, in batches that mix the claims they came in.
    deliveries.reverse();
    let (odd, even): (Vec<_>, Vec<_>) = deliveries
        .into_iter()
        .enumerate()
        .partition(|(index, _)| index % 2 == 1);
    for half in [odd, even] {
        for batch in half.chunks(700) {
            let stale = ack(
                &gateway,
                "orders",
                batch.iter().map(|(_, d)| d.ack_id.clone()).collect(),
            )
            .await;
            assert!(stale.is_empty(), "{} stale acks", stale.len());
        }
    }
    assert!(
        consumer.next(QUIET).await.is_none(),
        "nothing acked comes back"
    );
    let stats = subscription_stats(&gateway, "orders").await;
    assert_eq!(
        (stats.acked_total, stats.in_flight, stats.pending),
        (EVENTS as u64, 0, 0)
    );
}

#[tokio::test]
async fn an_old_lease_named_beside_the_current_one_is_stale() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    for (name, ordered) in [("unordered", false), ("ordered", true)] {
        create_subscription(
            &gateway,
            proto::Subscription {
                ack_deadline: seconds(600),
                ordered,
                ..subscription(name)
            },
        )
        .await;
    }
    publish(&gateway, vec![event("o-1", "order.created")]).await;

    for name in ["unordered", "ordered"] {
        let mut first = Consumer::open(&gateway, name, 0).await;
        let old = first.next(WAIT).await.expect("first delivery");
        drop(first);
        let mut second = Consumer::open(&gateway, name, 0).await;
        let current = second.next(WAIT).await.expect("redelivery");
        assert_eq!(current.attempt, 2, "{name}");
        let both = vec![old.ack_id.clone(), current.ack_id.clone()];

        let stale = extend(&gateway, name, both.clone(), Duration::from_secs(60)).await;
        assert_eq!(stale, vec![old.ack_id.clone()], "{name}: extension");
        assert_eq!(
            ack(&gateway, name, both.clone()).await,
            vec![old.ack_id.clone()],
            "{name}: ack"
        );
        assert_eq!(ack(&gateway, name, both).await.len(), 2, "{name}: settled");
    }
}

#[tokio::test]
async fn nacks_retry_after_the_backoff_or_the_given_delay() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            retry_backoff_min: seconds(1),
            retry_backoff_max: seconds(60),
            ..subscription("orders")
        },
    )
    .await;
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    let mut consumer = Consumer::open(&gateway, "orders", 0).await;
    let mut delivery = consumer.next(WAIT).await.unwrap();
    let pool = database.pool().await;

    // Attempt 1 fails: backoff 1 s. Attempt 2 fails: backoff 2 s.
    for (attempt, backoff_ms) in [(1u32, 1000u64), (2, 2000)] {
        assert_eq!(delivery.attempt, attempt);
        let response = nack(
            &gateway,
            proto::NackRequest {
                subscription: "orders".into(),
                ack_id: delivery.ack_id,
                reason: format!("failure {attempt}"),
                ..Default::default()
            },
        )
        .await;
        assert!(!response.dead_lettered);
        let nacked = Instant::now();
        // The retry is scheduled exactly one backoff after the nack (the database's
        // clock on both sides, so a loaded machine cannot blur it)...
        let (state, scheduled_ms): (String, f64) = sqlx::query_as(
            "SELECT state::text, \
                    (extract(epoch FROM due_at - updated_at) * 1000)::float8 \
             FROM outbox_deliveries",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(
            (state.as_str(), scheduled_ms),
            ("retry", backoff_ms as f64),
            "attempt {attempt}: the retry is scheduled one backoff after the nack"
        );
        // ...and not delivered before then.
        delivery = consumer.next(WAIT).await.expect("retried");
        let waited = nacked.elapsed().as_millis() as u64;
        assert!(
            waited + 100 >= backoff_ms,
            "attempt {attempt}: retried after {waited} ms, before its {backoff_ms} ms backoff"
        );
    }
    // retry_after overrides the backoff (which would now be 4 s).
    nack(
        &gateway,
        proto::NackRequest {
            subscription: "orders".into(),
            ack_id: delivery.ack_id,
            retry_after: Some(prost_types::Duration {
                seconds: 0,
                nanos: 200_000_000,
            }),
            ..Default::default()
        },
    )
    .await;
    let quick = consumer
        .next(Duration::from_millis(1500))
        .await
        .expect("retry_after replaces the backoff");
    assert_eq!(quick.attempt, 4);
}

#[tokio::test]
async fn the_last_attempt_goes_to_the_dead_letter_queue_of_that_subscription_only() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            max_attempts: Some(2),
            ..subscription("strict")
        },
    )
    .await;
    create_subscription(&gateway, subscription("relaxed")).await;
    publish(&gateway, vec![event("o-1", "order.created")]).await;

    let mut strict = Consumer::open(&gateway, "strict", 0).await;
    for attempt in 1..=2 {
        let delivery = strict.next(WAIT).await.unwrap();
        assert_eq!(delivery.attempt, attempt);
        let response = nack(
            &gateway,
            proto::NackRequest {
                subscription: "strict".into(),
                ack_id: delivery.ack_id,
                reason: "cannot handle".into(),
                retry_after: Some(prost_types::Duration::default()),
                ..Default::default()
            },
        )
        .await;
        assert_eq!(response.dead_lettered, attempt == 2);
    }
    assert!(
        strict.next(QUIET).await.is_none(),
        "a dead letter is not delivered again"
    );
    let pool = database.pool().await;
    assert_eq!(
        delivery_records(&pool, "strict").await,
        vec![("o-1".into(), "dead".into(), 2)]
    );
    let last_error: String =
        sqlx::query_scalar("SELECT last_error FROM outbox_deliveries WHERE state = 'dead'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(last_error, "cannot handle");

    let mut relaxed = Consumer::open(&gateway, "relaxed", 0).await;
    let delivery = relaxed
        .next(WAIT)
        .await
        .expect("the other subscription is unaffected");
    assert!(
        ack(&gateway, "relaxed", vec![delivery.ack_id])
            .await
            .is_empty()
    );
}

#[tokio::test]
async fn an_expired_last_attempt_is_dead_lettered_too() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            max_attempts: Some(1),
            ack_deadline: seconds(1),
            ..subscription("orders")
        },
    )
    .await;
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    let mut consumer = Consumer::open(&gateway, "orders", 0).await;
    consumer.next(WAIT).await.unwrap();
    let pool = database.pool().await;
    eventually(
        "the expired last attempt is dead-lettered",
        WAIT,
        || async {
            delivery_records(&pool, "orders").await == vec![("o-1".into(), "dead".into(), 1)]
        },
    )
    .await;
    assert!(consumer.next(QUIET).await.is_none(), "no second attempt");
}

/// A delivery given back when its stream closed used its attempt like one whose lease
/// expired: on the last attempt it is dead-lettered, not delivered once more than
/// `max_attempts` allows.
#[tokio::test]
async fn a_last_attempt_given_back_by_a_closed_stream_is_dead_lettered() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            max_attempts: Some(1),
            ack_deadline: seconds(600),
            ..subscription("orders")
        },
    )
    .await;
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    let mut first = Consumer::open(&gateway, "orders", 0).await;
    assert_eq!(
        first.next(WAIT).await.expect("the first attempt").attempt,
        1
    );
    drop(first);

    let mut second = Consumer::open(&gateway, "orders", 0).await;
    let pool = database.pool().await;
    eventually("the last attempt is dead-lettered", WAIT, || async {
        delivery_records(&pool, "orders").await == vec![("o-1".into(), "dead".into(), 1)]
    })
    .await;
    assert!(second.next(QUIET).await.is_none(), "no second attempt");
    let listed = list_dead_letters(&gateway, "orders").await;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].attempts, 1);
    assert_eq!(listed[0].last_error, "stream closed before settling");
}

#[tokio::test]
async fn dead_letter_nack_is_immediate_but_persistent_types_keep_retrying() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            max_attempts: Some(1),
            persistent_event_types: vec!["audit.**".into()],
            ..subscription("orders")
        },
    )
    .await;
    publish(
        &gateway,
        vec![
            event("o-1", "order.created"),
            event("a-1", "audit.login.failed"),
        ],
    )
    .await;
    let mut consumer = Consumer::open(&gateway, "orders", 0).await;
    for delivery in consumer.take(2, WAIT).await {
        let response = nack(
            &gateway,
            proto::NackRequest {
                subscription: "orders".into(),
                ack_id: delivery.ack_id.clone(),
                dead_letter: true,
                retry_after: Some(prost_types::Duration::default()),
                ..Default::default()
            },
        )
        .await;
        let persistent = aggregate_of(&delivery) == "a-1";
        assert_eq!(response.dead_lettered, !persistent);
        assert_eq!(response.retry_at.is_some(), persistent);
    }
    // The persistent event comes back past max_attempts, and again after that.
    for attempt in 2..=3 {
        let retried = consumer.next(WAIT).await.expect("persistent event retried");
        assert_eq!(
            (aggregate_of(&retried).as_str(), retried.attempt),
            ("a-1", attempt)
        );
        nack(
            &gateway,
            proto::NackRequest {
                subscription: "orders".into(),
                ack_id: retried.ack_id,
                retry_after: Some(prost_types::Duration::default()),
                ..Default::default()
            },
        )
        .await;
    }
}

#[tokio::test]
async fn flow_control_caps_unsettled_deliveries_per_stream() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    publish(
        &gateway,
        (0..20)
            .map(|i| event(&format!("o-{i}"), "order.created"))
            .collect(),
    )
    .await;

    let mut consumer = Consumer::open(&gateway, "orders", 5).await;
    let first = consumer.take(5, WAIT).await;
    assert!(
        consumer.next(QUIET).await.is_none(),
        "more than max_in_flight unsettled"
    );
    ack_all(
        &gateway,
        "orders",
        first[..2].iter().map(|d| d.ack_id.clone()).collect(),
    )
    .await;
    consumer.take(2, WAIT).await;
    assert!(consumer.next(QUIET).await.is_none());
}

#[tokio::test]
async fn extending_the_deadline_keeps_the_lease() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            ack_deadline: seconds(1),
            ..subscription("orders")
        },
    )
    .await;
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    let mut consumer = Consumer::open(&gateway, "orders", 0).await;
    let delivery = consumer.next(WAIT).await.unwrap();
    let stale = extend(
        &gateway,
        "orders",
        vec![delivery.ack_id.clone()],
        Duration::from_secs(10),
    )
    .await;
    assert!(stale.is_empty());
    assert!(
        consumer.next(Duration::from_millis(1800)).await.is_none(),
        "redelivered despite the extension"
    );
    assert!(
        ack(&gateway, "orders", vec![delivery.ack_id])
            .await
            .is_empty()
    );
}

#[tokio::test]
async fn fan_out_and_competing_consumers_across_two_gateways() {
    let database = TestDatabase::create().await;
    let first = TestGateway::start(&database).await;
    let second = TestGateway::start(&database).await;
    create_subscription(
        &first,
        proto::Subscription {
            ack_deadline: seconds(120),
            ..subscription("shared")
        },
    )
    .await;
    create_subscription(&first, subscription("audit")).await;

    // Two streams on each gateway share "shared"; one stream reads "audit".
    let mut consumers = Vec::new();
    for gateway in [&first, &second, &first, &second] {
        consumers.push(Consumer::open(gateway, "shared", 50).await);
    }
    let mut audit = Consumer::open(&second, "audit", 1000).await;
    let total = 400;
    for chunk in 0..4 {
        let gateway = if chunk % 2 == 0 { &first } else { &second };
        publish(
            gateway,
            (0..100)
                .map(|i| event(&format!("o-{}", chunk * 100 + i), "order.created"))
                .collect(),
        )
        .await;
    }

    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut per_stream = vec![0usize; consumers.len()];
    let deadline = Instant::now() + Duration::from_secs(30);
    while seen.len() < total && Instant::now() < deadline {
        for (index, consumer) in consumers.iter_mut().enumerate() {
            while let Some(delivery) = consumer.next(Duration::from_millis(20)).await {
                *seen.entry(aggregate_of(&delivery)).or_default() += 1;
                per_stream[index] += 1;
                // Ack through the other gateway half of the time.
                let gateway = if index % 2 == 0 { &second } else { &first };
                assert!(
                    ack(gateway, "shared", vec![delivery.ack_id])
                        .await
                        .is_empty()
                );
            }
        }
    }
    assert_eq!(seen.len(), total, "every event delivered");
    assert!(
        seen.values().all(|&count| count == 1),
        "no event leased to two streams"
    );
    assert!(
        per_stream.iter().all(|&n| n > 0),
        "every stream got work: {per_stream:?}"
    );
    let audited: HashSet<String> = audit
        .take(total, WAIT)
        .await
        .iter()
        .map(aggregate_of)
        .collect();
    assert_eq!(
        audited.len(),
        total,
        "the second subscription gets its own copy of every event"
    );
}

#[tokio::test]
async fn ordered_subscriptions_deliver_one_event_per_aggregate_at_a_time_in_order() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            ordered: true,
            ..subscription("ordered")
        },
    )
    .await;
    let aggregates = 5;
    let per_aggregate = 8;
    // Interleave aggregates within and across batches.
    for round in 0..per_aggregate {
        let batch = (0..aggregates)
            .map(|a| {
                let mut input = event(&format!("agg-{a}"), "order.updated");
                input.aggregate_version = Some(round + 1);
                input
            })
            .collect();
        publish(&gateway, batch).await;
    }

    let mut streams = vec![
        Consumer::open(&gateway, "ordered", 100).await,
        Consumer::open(&gateway, "ordered", 100).await,
    ];
    let mut next_version: HashMap<String, i64> = HashMap::new();
    let mut received = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    while received < aggregates * per_aggregate && Instant::now() < deadline {
        // Collect what both streams hold right now: it must never contain two events of
        // one aggregate.
        let mut in_flight = Vec::new();
        for stream in &mut streams {
            while let Some(delivery) = stream.next(Duration::from_millis(50)).await {
                in_flight.push(delivery);
            }
        }
        let mut busy = HashSet::new();
        for delivery in &in_flight {
            let event = delivery.event.as_ref().unwrap();
            assert!(
                busy.insert(event.aggregate_id.clone()),
                "two events of {} in flight",
                event.aggregate_id
            );
            let expected = next_version.entry(event.aggregate_id.clone()).or_insert(1);
            assert_eq!(
                event.aggregate_version,
                Some(*expected),
                "out of order for {}",
                event.aggregate_id
            );
            *expected += 1;
        }
        received += in_flight.len() as i64;
        let ack_ids = in_flight.into_iter().map(|d| d.ack_id).collect::<Vec<_>>();
        if !ack_ids.is_empty() {
            assert!(ack(&gateway, "ordered", ack_ids).await.is_empty());
        }
    }
    assert_eq!(received, aggregates * per_aggregate);
    assert!(next_version.values().all(|&v| v == per_aggregate + 1));
}

#[tokio::test]
async fn a_dead_letter_does_not_hold_back_its_aggregate() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            ordered: true,
            ..subscription("ordered")
        },
    )
    .await;
    publish(
        &gateway,
        vec![event("a", "order.created"), event("a", "order.paid")],
    )
    .await;
    let mut consumer = Consumer::open(&gateway, "ordered", 0).await;
    let first = consumer.next(WAIT).await.unwrap();
    assert_eq!(first.event.as_ref().unwrap().event_type, "order.created");
    assert!(
        consumer.next(QUIET).await.is_none(),
        "the second waits for the first"
    );
    nack(
        &gateway,
        proto::NackRequest {
            subscription: "ordered".into(),
            ack_id: first.ack_id,
            dead_letter: true,
            ..Default::default()
        },
    )
    .await;
    let second = consumer
        .next(WAIT)
        .await
        .expect("released by the dead letter");
    assert_eq!(second.event.as_ref().unwrap().event_type, "order.paid");
}

#[tokio::test]
async fn deleting_a_subscription_ends_its_streams() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    let mut consumer = Consumer::open(&gateway, "orders", 0).await;
    let mut admin = gateway.admin().await;
    admin
        .delete_subscription(proto::DeleteSubscriptionRequest {
            name: "orders".into(),
        })
        .await
        .unwrap();
    let status = consumer.end(WAIT).await.expect("the stream ends");
    assert_eq!(status.code(), Code::NotFound);
    assert_status(
        admin
            .get_subscription(proto::GetSubscriptionRequest {
                name: "orders".into(),
            })
            .await,
        Code::NotFound,
        "orders",
    );
}

#[tokio::test]
async fn subscription_admin_round_trips_settings() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let created = create_subscription(
        &gateway,
        proto::Subscription {
            event_types: vec!["order.*".into()],
            aggregate_types: vec!["order".into()],
            metadata_match: HashMap::from([("tenant".into(), "acme".into())]),
            ack_deadline: seconds(45),
            max_attempts: Some(0),
            retry_backoff_min: seconds(2),
            retry_backoff_max: seconds(120),
            ordered: true,
            persistent_event_types: vec!["audit.**".into()],
            ..subscription("orders")
        },
    )
    .await;
    assert_eq!(
        created.max_attempts,
        Some(0),
        "0 means retry forever and is kept"
    );
    assert_eq!(created.ack_deadline, seconds(45));
    let mut admin = gateway.admin().await;
    let fetched = admin
        .get_subscription(proto::GetSubscriptionRequest {
            name: "orders".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(fetched, created);
    let defaults = create_subscription(&gateway, subscription("defaults")).await;
    assert_eq!(
        (
            defaults.max_attempts,
            defaults.ack_deadline,
            defaults.retry_backoff_max
        ),
        (Some(10), seconds(30), seconds(900))
    );
    let names: Vec<String> = admin
        .list_subscriptions(proto::ListSubscriptionsRequest {})
        .await
        .unwrap()
        .into_inner()
        .subscriptions
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, ["defaults", "orders"]);
    let again = admin
        .create_subscription(proto::CreateSubscriptionRequest {
            subscription: Some(subscription("orders")),
            validate_only: false,
        })
        .await;
    assert_status(again, Code::AlreadyExists, "orders");
}

#[tokio::test]
async fn bad_subscription_and_delivery_input_is_refused_without_changes() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let mut admin = gateway.admin().await;
    let create = |subscription: proto::Subscription| proto::CreateSubscriptionRequest {
        subscription: Some(subscription),
        validate_only: false,
    };
    let negative = Some(prost_types::Duration {
        seconds: -1,
        nanos: 0,
    });
    let cases = vec![
        (create(subscription("Bad Name")), "subscription.name"),
        (
            create(proto::Subscription {
                event_types: vec!["order.**.x".into()],
                ..subscription("a")
            }),
            "subscription.event_types[0]",
        ),
        (
            create(proto::Subscription {
                event_types: vec!["ok".into(), "a..b".into()],
                ..subscription("a")
            }),
            "subscription.event_types[1]",
        ),
        (
            create(proto::Subscription {
                persistent_event_types: vec!["".into()],
                ..subscription("a")
            }),
            "subscription.persistent_event_types[0]",
        ),
        (
            create(proto::Subscription {
                ack_deadline: negative,
                ..subscription("a")
            }),
            "subscription.ack_deadline",
        ),
        (
            create(proto::Subscription {
                ack_deadline: Some(prost_types::Duration {
                    seconds: 0,
                    nanos: 10,
                }),
                ..subscription("a")
            }),
            "subscription.ack_deadline",
        ),
        (
            create(proto::Subscription {
                retry_backoff_min: negative,
                ..subscription("a")
            }),
            "subscription.retry_backoff_min",
        ),
        (
            create(proto::Subscription {
                retry_backoff_min: seconds(10),
                retry_backoff_max: seconds(5),
                ..subscription("a")
            }),
            "subscription.retry_backoff_min",
        ),
        (
            create(proto::Subscription {
                aggregate_types: vec!["".into()],
                ..subscription("a")
            }),
            "subscription.aggregate_types[0]",
        ),
        (
            proto::CreateSubscriptionRequest {
                subscription: None,
                validate_only: false,
            },
            "subscription",
        ),
    ];
    for (request, field) in cases {
        assert_status(
            admin.create_subscription(request).await,
            Code::InvalidArgument,
            field,
        );
    }
    let listed = admin
        .list_subscriptions(proto::ListSubscriptionsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(
        listed.subscriptions.is_empty(),
        "refused calls created nothing"
    );

    let mut subscriber = gateway.subscriber().await;
    let subscribe = |name: &str, max_in_flight| SubscribeRequest {
        subscription: name.into(),
        max_in_flight,
        ..Default::default()
    };
    assert_status(
        subscriber.subscribe(subscribe("missing", 0)).await,
        Code::NotFound,
        "missing",
    );
    assert_status(
        subscriber.subscribe(subscribe("Bad!", 0)).await,
        Code::InvalidArgument,
        "subscription",
    );
    create_subscription(&gateway, subscription("orders")).await;
    assert_status(
        subscriber.subscribe(subscribe("orders", 10_001)).await,
        Code::InvalidArgument,
        "max_in_flight",
    );

    let ack = |ack_ids: Vec<&str>| proto::AckRequest {
        subscription: "orders".into(),
        ack_ids: ack_ids.into_iter().map(String::from).collect(),
    };
    assert_status(
        subscriber.ack(ack(vec![])).await,
        Code::InvalidArgument,
        "ack_ids",
    );
    assert_status(
        subscriber
            .ack(ack(vec!["1-1-0000000000000001", "garbage"]))
            .await,
        Code::InvalidArgument,
        "ack_ids[1]",
    );
    assert_status(
        subscriber
            .ack(proto::AckRequest {
                subscription: "missing".into(),
                ack_ids: vec!["1-1-0000000000000001".into()],
            })
            .await,
        Code::NotFound,
        "missing",
    );
    assert_status(
        subscriber
            .nack(proto::NackRequest {
                subscription: "orders".into(),
                ack_id: "nope".into(),
                ..Default::default()
            })
            .await,
        Code::InvalidArgument,
        "ack_id",
    );
    assert_status(
        subscriber
            .nack(proto::NackRequest {
                subscription: "orders".into(),
                ack_id: "1-1-0000000000000001".into(),
                retry_after: negative,
                ..Default::default()
            })
            .await,
        Code::InvalidArgument,
        "retry_after",
    );
    assert_status(
        subscriber
            .nack(proto::NackRequest {
                subscription: "orders".into(),
                ack_id: "1-1-0000000000000001".into(),
                ..Default::default()
            })
            .await,
        Code::FailedPrecondition,
        "stale",
    );
    assert_status(
        subscriber
            .extend_ack_deadline(proto::ExtendAckDeadlineRequest {
                subscription: "orders".into(),
                ack_ids: vec!["1-1-0000000000000001".into()],
                extension: negative,
            })
            .await,
        Code::InvalidArgument,
        "extension",
    );
}
