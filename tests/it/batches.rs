//! Delivery bookkeeping per claim: on unordered subscriptions a claim's leases are kept as
//! rows of `outbox_delivery_batches`, not a record per event. Acks from any stream or
//! replica settle them exactly once, and neither a gateway that dies with claims half
//! acked nor claims cut off part-way by the database lose anything or deliver anything
//! acked again.

use std::{
    collections::BTreeSet,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use crate::common::*;
use outbox_gateway::proto::{self, subscriber_client::SubscriberClient};
use sqlx::PgPool;

const WAIT: Duration = Duration::from_secs(30);

async fn count(pool: &PgPool, query: &'static str) -> i64 {
    sqlx::query_scalar(query).fetch_one(pool).await.unwrap()
}

/// The `orders` subscription's delivered and acked totals, in flight and pending.
async fn delivered_acked_in_flight_pending(gateway: &TestGateway) -> (u64, u64, u64, u64) {
    let stats = subscription_stats(gateway, "orders").await;
    (
        stats.delivered_total,
        stats.acked_total,
        stats.in_flight,
        stats.pending,
    )
}

fn events(count: usize) -> Vec<proto::EventInput> {
    (0..count)
        .map(|index| event(&format!("o-{index}"), "order.created"))
        .collect()
}

#[tokio::test]
async fn a_claim_is_kept_as_rows_and_acks_through_several_replicas_settle_each_event_once() {
    let database = TestDatabase::create().await;
    let first = TestGateway::start(&database).await;
    let second = TestGateway::start(&database).await;
    create_subscription(&first, subscription("orders")).await;
    publish(&first, events(300)).await;
    let pool = database.pool().await;

    let mut consumer = Consumer::open(&first, "orders", 300).await;
    let deliveries = consumer.take(300, WAIT).await;
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM outbox_delivery_records WHERE state = 'in_flight'"
        )
        .await,
        300
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM outbox_deliveries").await,
        0,
        "no record per event"
    );
    let rows = count(&pool, "SELECT count(*) FROM outbox_delivery_batches").await;
    assert!(rows <= 30, "{rows} rows hold 300 leases");

    // Acks in groups that cut across the claims, through both replicas in turn.
    // (37 and 300 are coprime: every delivery once, in an order that jumps about.)
    let ack_ids: Vec<String> = (0..300)
        .map(|index| deliveries[(index * 37) % 300].ack_id.clone())
        .collect();
    for (index, group) in ack_ids.chunks(7).enumerate() {
        let through = if index % 2 == 0 { &first } else { &second };
        assert!(
            ack(through, "orders", group.to_vec()).await.is_empty(),
            "group {index} acked"
        );
    }
    // Settled once: acking again, on either replica, is stale.
    assert_eq!(
        ack(&first, "orders", ack_ids[..40].to_vec()).await.len(),
        40
    );
    assert_eq!(
        ack(&second, "orders", ack_ids[200..].to_vec()).await.len(),
        100
    );

    assert_eq!(
        count(&pool, "SELECT count(*) FROM outbox_delivery_records").await,
        0
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM outbox_delivery_batches").await,
        0,
        "settled rows are deleted"
    );
    assert_eq!(
        delivered_acked_in_flight_pending(&second).await,
        (300, 300, 0, 0)
    );
    assert!(
        consumer.next(Duration::from_secs(1)).await.is_none(),
        "nothing acked comes again"
    );
}

#[tokio::test]
async fn a_gateway_killed_with_claims_half_acked_delivers_again_only_what_was_not_acked() {
    let database = TestDatabase::create().await;
    let (mut child, _log, _, channel) =
        start_gateway_process(&database, &["--metrics-listen", "off"]).await;
    proto::admin_client::AdminClient::new(channel.clone())
        .create_subscription(proto::CreateSubscriptionRequest {
            subscription: Some(proto::Subscription {
                ack_deadline: seconds(3),
                ..subscription("orders")
            }),
            validate_only: false,
        })
        .await
        .unwrap();
    proto::publisher_client::PublisherClient::new(channel.clone())
        .publish(proto::PublishRequest {
            events: events(200),
            ..Default::default()
        })
        .await
        .unwrap();

    // Every other delivery is acked as it comes; the rest stay leased.
    let mut subscriber = SubscriberClient::new(channel);
    let stream = subscriber
        .subscribe(proto::SubscribeRequest {
            subscription: "orders".into(),
            max_in_flight: 200,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut consumer = Consumer::from_stream(stream);
    let mut unacked = BTreeSet::new();
    let mut unacked_ids = Vec::new();
    for round in 0..10 {
        let deliveries = consumer.take(20, WAIT).await;
        let (acked, kept): (Vec<_>, Vec<_>) = deliveries
            .into_iter()
            .enumerate()
            .partition(|(index, _)| index % 2 == 0);
        let stale = subscriber
            .ack(proto::AckRequest {
                subscription: "orders".into(),
                ack_ids: acked.into_iter().map(|(_, d)| d.ack_id).collect(),
            })
            .await
            .unwrap()
            .into_inner()
            .stale_ack_ids;
        assert!(stale.is_empty(), "round {round}: {stale:?}");
        for (_, delivery) in kept {
            unacked.insert(aggregate_of(&delivery));
            unacked_ids.push(delivery.ack_id);
        }
    }
    assert_eq!(unacked.len(), 100);
    child.start_kill().expect("SIGKILL");
    child.wait().await.unwrap();

    let gateway = TestGateway::start(&database).await;
    let mut consumer = Consumer::open(&gateway, "orders", 200).await;
    let again = consumer.take(100, WAIT).await;
    let redelivered: BTreeSet<String> = again.iter().map(aggregate_of).collect();
    assert_eq!(redelivered, unacked, "exactly the unacked come again");
    assert!(again.iter().all(|delivery| delivery.attempt == 2));
    assert!(
        consumer.next(Duration::from_secs(1)).await.is_none(),
        "nothing acked comes again"
    );
    // The dead gateway's leases are gone: their ack ids settle nothing.
    assert_eq!(ack(&gateway, "orders", unacked_ids).await.len(), 100);
    ack_all(
        &gateway,
        "orders",
        again.into_iter().map(|delivery| delivery.ack_id).collect(),
    )
    .await;
    let stats = subscription_stats(&gateway, "orders").await;
    assert_eq!(
        (stats.acked_total, stats.in_flight, stats.awaiting_retry),
        (200, 0, 0)
    );
}

/// Streams with room for several claims at once (here 2 × 1,000 deliveries on each of two
/// replicas, claims of at most 300) are served by claims that overlap: the next reads on
/// from where the one before leaves the read position while that one commits, and leases
/// only if no other claim (here mostly the other replica's) moved the position meanwhile.
/// A backlog drained that way, acked as it goes, reaches the streams every event exactly
/// once.
#[tokio::test]
async fn overlapping_claims_deliver_a_backlog_exactly_once() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.delivery.claim_batch_size = 300;
    let first = TestGateway::start_with(&database, config.clone()).await;
    let second = TestGateway::start_with(&database, config).await;
    create_subscription(&first, subscription("orders")).await;
    let mut publisher = first.publisher().await;
    publish_in_calls(&mut publisher, &events(8000), 1000).await;

    let mut consumers = Vec::new();
    for gateway in [&first, &second] {
        for _ in 0..2 {
            consumers.push(drain(
                gateway,
                Consumer::open(gateway, "orders", 1000).await,
            ));
        }
    }
    let received: Vec<String> = futures_util::future::join_all(consumers)
        .await
        .into_iter()
        .flatten()
        .collect();
    let distinct: BTreeSet<&String> = received.iter().collect();
    assert_eq!(
        (received.len(), distinct.len()),
        (8000, 8000),
        "every event once"
    );
    assert_eq!(
        delivered_acked_in_flight_pending(&second).await,
        (8000, 8000, 0, 0)
    );
}

/// Reads `consumer` until it has been idle for a while (the other streams took the rest),
/// acking 100 at a time through `gateway`; the aggregates of what it received.
async fn drain(gateway: &TestGateway, mut consumer: Consumer) -> Vec<String> {
    let mut received = Vec::new();
    let mut unacked = Vec::new();
    while let Some(delivery) = consumer.next(Duration::from_secs(3)).await {
        received.push(aggregate_of(&delivery));
        unacked.push(delivery.ack_id);
        if unacked.len() == 100 {
            ack_all(gateway, "orders", std::mem::take(&mut unacked)).await;
        }
    }
    if !unacked.is_empty() {
        ack_all(gateway, "orders", unacked).await;
    }
    received
}

/// Overlapping claims cut off part-way: while two streams with room for a claim and a
/// following one drain a backlog (claims of at most 300), the database closes the
/// gateway's connections each time another fifth of it has been delivered, so claims,
/// following claims and batch acks fail at whatever statement they were at, some after
/// their commit. Nothing is lost: every event is delivered and, in the end, acked once;
/// and no event is delivered again after its ack was answered.
#[tokio::test]
async fn overlapping_claims_cut_off_lose_nothing_and_deliver_nothing_acked_again() {
    const EVENTS: usize = 20_000;
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.delivery.claim_batch_size = 300;
    let gateway = TestGateway::start_with(&database, config).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            ack_deadline: seconds(3),
            ..subscription("orders")
        },
    )
    .await;
    let mut publisher = gateway.publisher().await;
    publish_in_calls(&mut publisher, &events(EVENTS), 1000).await;

    let drain = Arc::new(Drain::default());
    let cutting = tokio::spawn({
        let (pool, name) = (database.pool().await, database.name().to_owned());
        let drain = drain.clone();
        async move {
            let deadline = tokio::time::Instant::now() + WAIT;
            let mut cut = 0;
            for fifth in 1..5 {
                while drain.received.load(Ordering::SeqCst) < fifth * EVENTS / 5
                    && tokio::time::Instant::now() < deadline
                {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                cut += outbox_testkit::cut_gateway_sessions(&pool, &name)
                    .await
                    .expect("cut the gateway's sessions");
            }
            drain.cuts_over.store(true, Ordering::SeqCst);
            cut
        }
    });
    let mut consumers = Vec::new();
    for _ in 0..2 {
        let consumer = Consumer::open(&gateway, "orders", 1000).await;
        consumers.push(drain_through_cuts(
            &gateway,
            consumer,
            &drain,
            EVENTS as u64,
        ));
    }
    let drained = futures_util::future::join_all(consumers).await;
    assert!(
        cutting.await.unwrap() > 0,
        "the gateway's sessions were cut"
    );

    let received: BTreeSet<&String> = drained.iter().flat_map(|(received, _)| received).collect();
    assert_eq!(received.len(), EVENTS, "every event was delivered");
    let again: Vec<&String> = drained.iter().flat_map(|(_, again)| again).collect();
    assert!(
        again.is_empty(),
        "delivered after their ack was answered: {again:?}"
    );
    let (_, acked_total, in_flight, pending) = delivered_acked_in_flight_pending(&gateway).await;
    assert_eq!((acked_total, in_flight, pending), (EVENTS as u64, 0, 0));
}

/// What the streams of a drain under cuts share.
#[derive(Default)]
struct Drain {
    /// Deliveries received, redeliveries included.
    received: AtomicUsize,
    /// Aggregates of the events whose ack was answered.
    acked: Mutex<BTreeSet<String>>,
    cuts_over: AtomicBool,
}

/// Reads `consumer`, acking 100 at a time through [`ack_through_cuts`], until the cuts
/// are over and the subscription has all `events` acked and nothing in flight or
/// pending (or a minute passed): the aggregates it received, and those it received
/// after their ack was answered.
async fn drain_through_cuts(
    gateway: &TestGateway,
    mut consumer: Consumer,
    drain: &Drain,
    events: u64,
) -> (Vec<String>, Vec<String>) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let (mut received, mut again) = (Vec::new(), Vec::new());
    let mut unacked = Vec::new();
    loop {
        let delivery = consumer.next(Duration::from_secs(1)).await;
        if let Some(delivery) = &delivery {
            drain.received.fetch_add(1, Ordering::SeqCst);
            let aggregate = aggregate_of(delivery);
            if drain.acked.lock().unwrap().contains(&aggregate) {
                again.push(aggregate.clone());
            }
            received.push(aggregate.clone());
            unacked.push((aggregate, delivery.ack_id.clone()));
        }
        if unacked.len() == 100 || (delivery.is_none() && !unacked.is_empty()) {
            let batch = std::mem::take(&mut unacked);
            let stale = ack_through_cuts(gateway, batch.iter().map(|(_, id)| id.clone())).await;
            let mut acked = drain.acked.lock().unwrap();
            for (aggregate, ack_id) in batch {
                if !stale.contains(&ack_id) {
                    acked.insert(aggregate);
                }
            }
        } else if delivery.is_none() && drain.cuts_over.load(Ordering::SeqCst) {
            let (_, acked_total, in_flight, pending) =
                delivered_acked_in_flight_pending(gateway).await;
            if (acked_total, in_flight, pending) == (events, 0, 0)
                || tokio::time::Instant::now() > deadline
            {
                return (received, again);
            }
        }
    }
}

/// Acks `ack_ids`, sending the call again while it fails and the acks it answers as
/// unavailable (their source could not be reached) until each is answered; the stale
/// ones. An ack applied by a call whose answer was lost comes back stale.
async fn ack_through_cuts(
    gateway: &TestGateway,
    ack_ids: impl Iterator<Item = String>,
) -> Vec<String> {
    let mut request = proto::AckRequest {
        subscription: "orders".into(),
        ack_ids: ack_ids.collect(),
    };
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut subscriber = gateway.subscriber().await;
    let mut stale = Vec::new();
    loop {
        match subscriber.ack(request.clone()).await {
            Ok(response) => {
                let response = response.into_inner();
                stale.extend(response.stale_ack_ids);
                if response.unavailable_ack_ids.is_empty() {
                    return stale;
                }
                request.ack_ids = response.unavailable_ack_ids;
            }
            Err(status) => assert!(
                tokio::time::Instant::now() < deadline,
                "the ack kept failing: {status:?}"
            ),
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "acks stayed unavailable"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
