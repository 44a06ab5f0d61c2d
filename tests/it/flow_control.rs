//! Flow control in deliveries and in bytes: a stream holds at most `max_in_flight`
//! unsettled deliveries and `max_in_flight_bytes` of them (always at least one delivery,
//! however large), and the gateway bounds the bytes waiting in its memory for streams
//! that do not read — so memory stays bounded whatever consumers do; and one claim leases
//! no more than the claim batch size.

use std::time::{Duration, Instant};

use crate::common::*;
use outbox_gateway::proto;
use sqlx::PgPool;
use tonic::Code;

const WAIT: Duration = Duration::from_secs(15);

/// `count` events of `bytes` bytes each (binary payloads).
fn large_events(count: usize, bytes: usize) -> Vec<proto::EventInput> {
    (0..count)
        .map(|i| proto::EventInput {
            content_type: "application/octet-stream".into(),
            payload: vec![b'x'; bytes],
            ..event(&format!("o-{i}"), "order.created")
        })
        .collect()
}

/// A stream that never reads, allowed far more than the gateway-wide bound. Its client's
/// HTTP/2 windows are tiny, so what it does not read stays in the gateway.
async fn unread_stream(
    gateway: &TestGateway,
    subscription: &str,
) -> tonic::Streaming<proto::Delivery> {
    let channel = tonic::transport::Endpoint::from_shared(gateway.endpoint())
        .unwrap()
        .initial_stream_window_size(Some(1024))
        .initial_connection_window_size(Some(1024))
        .connect()
        .await
        .unwrap();
    proto::subscriber_client::SubscriberClient::new(channel)
        .subscribe(proto::SubscribeRequest {
            subscription: subscription.into(),
            max_in_flight: 1000,
            max_in_flight_bytes: 64 * 1024 * 1024,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
}

async fn in_flight(pool: &PgPool, subscription: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM outbox_delivery_records d JOIN outbox_subscriptions s ON s.id = d.subscription_id \
         WHERE s.name = $1 AND d.state = 'in_flight'",
    )
    .bind(subscription)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn open_stream(
    gateway: &TestGateway,
    subscription: &str,
    max_in_flight: u32,
    max_in_flight_bytes: u64,
) -> tonic::Streaming<proto::Delivery> {
    gateway
        .subscriber()
        .await
        .subscribe(proto::SubscribeRequest {
            subscription: subscription.into(),
            max_in_flight,
            max_in_flight_bytes,
            ..Default::default()
        })
        .await
        .expect("subscribe")
        .into_inner()
}

/// Polls until `count` deliveries of the subscription are in flight, or fails.
async fn wait_for_in_flight(pool: &PgPool, subscription: &str, count: i64) {
    let deadline = Instant::now() + WAIT;
    while in_flight(pool, subscription).await < count {
        assert!(Instant::now() < deadline, "fewer than {count} in flight");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_stream_holds_at_most_its_bytes_of_unsettled_deliveries() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    let pool = database.pool().await;
    publish(&gateway, large_events(20, 16 * 1024)).await;

    // 64 KiB holds four of these events (16 KiB and the per-delivery allowance each).
    let _stream = open_stream(&gateway, "orders", 1000, 64 * 1024).await;
    wait_for_in_flight(&pool, "orders", 4).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(in_flight(&pool, "orders").await, 4);
}

#[tokio::test]
async fn a_delivery_larger_than_the_byte_limit_still_goes_out_one_at_a_time() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    publish(&gateway, large_events(2, 50 * 1024)).await;

    let mut stream = open_stream(&gateway, "orders", 100, 1024).await;
    let first = tokio::time::timeout(WAIT, stream.message())
        .await
        .expect("the first delivery goes out whatever its size")
        .unwrap()
        .unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(500), stream.message())
            .await
            .is_err(),
        "the second waits until the first is settled"
    );
    ack_all(&gateway, "orders", vec![first.ack_id]).await;
    let second = tokio::time::timeout(WAIT, stream.message())
        .await
        .unwrap()
        .unwrap();
    assert!(second.is_some());
}

#[tokio::test]
async fn a_byte_limit_beyond_the_gateways_is_refused() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    let refused = gateway
        .subscriber()
        .await
        .subscribe(proto::SubscribeRequest {
            subscription: "orders".into(),
            max_in_flight: 0,
            max_in_flight_bytes: u64::MAX,
            ..Default::default()
        })
        .await;
    assert_status(refused, Code::InvalidArgument, "max_in_flight_bytes");
}

#[tokio::test]
async fn streams_that_never_read_cannot_hold_the_gateways_memory_or_starve_readers() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.delivery.max_buffered_bytes = 64 * 1024;
    let gateway = TestGateway::start_with(&database, config).await;
    create_subscription(&gateway, subscription("stalled")).await;
    create_subscription(&gateway, subscription("healthy")).await;
    let pool = database.pool().await;
    let events = 60;
    publish(&gateway, large_events(events, 16 * 1024)).await;

    let mut stalled = Vec::new();
    for _ in 0..3 {
        stalled.push(unread_stream(&gateway, "stalled").await);
    }
    let mut reader = Consumer::open(&gateway, "healthy", 1000).await;
    let mut received = 0;
    while received < events {
        let delivery = reader
            .next(WAIT)
            .await
            .expect("a stream that reads keeps receiving");
        ack_all(&gateway, "healthy", vec![delivery.ack_id]).await;
        received += 1;
    }
    // What the stalled streams hold is bounded by the gateway-wide budget (four of these
    // events) plus one each and what HTTP/2 lets travel: far below the 60 they have room
    // for.
    let held = in_flight(&pool, "stalled").await;
    assert!(held < 15, "streams that never read hold {held} deliveries");
}

#[tokio::test]
async fn many_streams_ending_at_once_give_their_leases_back_on_a_busy_pool() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    // A small pool that runs out at once: waiting for it is back-pressure, not an outage.
    config.db_max_connections = 2;
    config.db_acquire_timeout = Duration::from_millis(100);
    let gateway = TestGateway::start_with(&database, config).await;
    let mut busy = subscription("busy");
    // Far beyond the test: a lease that is not given back is not redelivered in time.
    busy.ack_deadline = seconds(600);
    create_subscription(&gateway, busy).await;
    const STREAMS: usize = 1000;
    let mut consumers = Vec::new();
    for _ in 0..STREAMS {
        consumers.push(Consumer::open(&gateway, "busy", 1).await);
    }
    let events: Vec<_> = (0..STREAMS)
        .map(|index| event(&format!("a-{index}"), "order.created"))
        .collect();
    publish_in_calls(&mut gateway.publisher().await, &events, 100).await;
    for consumer in &mut consumers {
        assert!(consumer.next(WAIT).await.is_some(), "every stream gets one");
    }

    // Every stream ends at once; the gateway stays healthy while it gives the leases back.
    drop(consumers);
    let watching = tokio::spawn({
        let endpoint = gateway.endpoint();
        async move {
            let channel = tonic::transport::Endpoint::from_shared(endpoint)
                .unwrap()
                .connect()
                .await
                .unwrap();
            let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
            let started = std::time::Instant::now();
            let mut statuses = Vec::new();
            while started.elapsed() < Duration::from_secs(3) {
                let status = health
                    .check(tonic_health::pb::HealthCheckRequest::default())
                    .await
                    .map(|answer| answer.into_inner().status);
                statuses.push(status.map_err(|status| status.code()));
                tokio::time::sleep(POLL).await;
            }
            statuses
        }
    });
    let mut again = Consumer::open(&gateway, "busy", STREAMS as u32).await;
    let redelivered = again.take(STREAMS, WAIT).await;
    assert_eq!(redelivered.len(), STREAMS, "leases given back at once");
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    let statuses = watching.await.unwrap();
    assert!(
        statuses.iter().all(|status| *status == Ok(serving)),
        "health while the pool was busy: {statuses:?}"
    );
}

#[tokio::test]
async fn streams_that_never_read_hold_at_most_the_budget_and_two_deliveries_each() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    const EVENT_BYTES: usize = 64 * 1024;
    const BUDGET_EVENTS: i64 = 4;
    config.delivery.max_buffered_bytes = BUDGET_EVENTS as u64 * EVENT_BYTES as u64;
    let gateway = TestGateway::start_with(&database, config).await;
    create_subscription(&gateway, subscription("stalled")).await;
    let pool = database.pool().await;
    publish(&gateway, large_events(100, EVENT_BYTES)).await;

    const STREAMS: i64 = 10;
    let mut stalled = Vec::new();
    for _ in 0..STREAMS {
        stalled.push(unread_stream(&gateway, "stalled").await);
    }
    // Until what they hold stops growing.
    let deadline = Instant::now() + WAIT;
    let mut last = -1;
    let mut steady_since = Instant::now();
    while last <= 0 || steady_since.elapsed() < Duration::from_secs(2) {
        assert!(
            Instant::now() < deadline,
            "what the streams hold never settled"
        );
        let held = in_flight(&pool, "stalled").await;
        if held != last {
            last = held;
            steady_since = Instant::now();
        }
        tokio::time::sleep(POLL).await;
    }
    // The budget, plus per stream the delivery HTTP/2 is still sending and the one the
    // transport asked for since.
    assert!(
        last <= BUDGET_EVENTS + 2 * STREAMS,
        "{STREAMS} streams that never read hold {last} deliveries of {EVENT_BYTES} bytes \
         against a budget of {BUDGET_EVENTS}"
    );
}

#[tokio::test]
async fn a_new_stream_is_leased_a_few_deliveries_at_first_and_the_rest_in_time_without_acking() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    let pool = database.pool().await;
    let events: Vec<_> = (0..150)
        .map(|i| event(&format!("o-{i}"), "order.created"))
        .collect();
    publish(&gateway, events).await;

    // A consumer that collects 100 deliveries before it acks any.
    let mut consumer = Consumer::open(&gateway, "orders", 100).await;
    let mut collected = consumer.take(1, WAIT).await;
    // Its first claim leased only the initial window, not its whole `max_in_flight`: a
    // thousand such streams attaching at once cannot lease a hundred thousand deliveries
    // in a moment. (The window doubles each second it settles nothing; 20 allows one
    // doubling on a slow machine.)
    let held = in_flight(&pool, "orders").await;
    assert!(
        (1..=20).contains(&held),
        "a new stream holds {held} deliveries in its first moments"
    );

    // Without a single ack it still gets all it waits for, a few seconds later.
    collected.extend(consumer.take(99, WAIT).await);
    assert_eq!(in_flight(&pool, "orders").await, 100);
    assert!(
        consumer.next(Duration::from_millis(200)).await.is_none(),
        "never more than its max_in_flight"
    );
    let acks = collected.into_iter().map(|d| d.ack_id).collect();
    assert!(ack(&gateway, "orders", acks).await.is_empty());
    assert_eq!(consumer.take(50, WAIT).await.len(), 50);
}

/// A consumer that collects a batch before it acks any, with short leases: a new
/// stream's window grows with its ack deadline, so each batch is complete long before the
/// first of its leases expires, and nothing is delivered twice. (With a window doubling
/// each second, this consumer had 10, 20, then 40 over 2 s, its first leases expired
/// unsettled and the stream was throttled as stalled.)
#[tokio::test]
async fn a_consumer_that_collects_a_batch_before_acking_is_not_starved_by_short_leases() {
    const BATCH: usize = 50;
    const BATCHES: usize = 4;
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let mut orders = subscription("orders");
    orders.ack_deadline = seconds(2);
    create_subscription(&gateway, orders).await;
    let events: Vec<_> = (0..BATCH * BATCHES)
        .map(|i| event(&format!("o-{i}"), "order.created"))
        .collect();
    publish(&gateway, events).await;

    let mut consumer = Consumer::open(&gateway, "orders", 100).await;
    let mut delivered = Vec::new();
    for batch in 0..BATCHES {
        let collected = consumer.take(BATCH, WAIT).await;
        assert_eq!(
            collected.len(),
            BATCH,
            "batch {batch}: collected {} of {BATCH}",
            collected.len()
        );
        delivered.extend(collected.iter().map(|d| (aggregate_of(d), d.attempt)));
        let acks = collected.into_iter().map(|d| d.ack_id).collect();
        let stale = ack(&gateway, "orders", acks).await;
        assert!(
            stale.is_empty(),
            "batch {batch}: {} leases expired before the batch was complete",
            stale.len()
        );
    }
    let redelivered: Vec<_> = delivered
        .iter()
        .filter(|(_, attempt)| *attempt > 1)
        .collect();
    assert!(redelivered.is_empty(), "delivered again: {redelivered:?}");
    let distinct: std::collections::BTreeSet<_> = delivered.iter().map(|(id, _)| id).collect();
    assert_eq!(distinct.len(), BATCH * BATCHES);
}

/// `--claim-batch-size` bounds what one claim leases, however much room the stream has:
/// the deliveries of one claim share its lease deadline (set in one statement), so no
/// more than that many share one.
#[tokio::test]
async fn one_claim_leases_at_most_the_claim_batch_size() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.delivery.claim_batch_size = 3;
    let gateway = TestGateway::start_with(&database, config).await;
    create_subscription(&gateway, subscription("orders")).await;
    publish(
        &gateway,
        (0..30)
            .map(|i| event(&format!("o-{i}"), "order.created"))
            .collect(),
    )
    .await;
    let mut consumer = Consumer::open(&gateway, "orders", 1000).await;
    let deliveries = consumer.take(30, WAIT).await;
    let mut per_claim = std::collections::HashMap::<(i64, i32), usize>::new();
    for delivery in &deliveries {
        let deadline = delivery.ack_deadline.expect("an ack deadline");
        *per_claim
            .entry((deadline.seconds, deadline.nanos))
            .or_default() += 1;
    }
    let largest = per_claim.values().copied().max().unwrap();
    assert!(
        largest <= 3,
        "{largest} deliveries leased by one claim: {per_claim:?}"
    );
    assert!(per_claim.len() >= 10, "{per_claim:?}");
}
