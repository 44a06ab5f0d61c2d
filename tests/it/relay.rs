//! The relay reads past transactions that are still open: only a writer waits for its
//! own transaction. Events committed meanwhile flow at normal latency; the open
//! transaction's own events go out once it commits (never if it rolls back); nothing is
//! skipped or doubled by the reading, whatever the commit order.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    time::{Duration, Instant},
};

use crate::common::*;
use outbox_gateway::proto;
use rand::{Rng, SeedableRng, rngs::StdRng};
use sqlx::{PgPool, Postgres, Transaction};

const WAIT: Duration = Duration::from_secs(15);
const QUIET: Duration = Duration::from_millis(500);

/// A transaction that wrote something and stays open: it holds a transaction id.
async fn open_writing_transaction(pool: &PgPool, table: &str) -> Transaction<'static, Postgres> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {table} (id serial PRIMARY KEY, note text)"
    )))
    .execute(pool)
    .await
    .unwrap();
    let mut transaction = pool.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {table} (note) VALUES ('held open')"
    )))
    .execute(&mut *transaction)
    .await
    .unwrap();
    transaction
}

async fn insert_event(executor: impl sqlx::PgExecutor<'_>, aggregate_id: &str, event_type: &str) {
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

/// Publishes `count` events in batches while a consumer acks them; returns the slowest
/// time from a batch's publish to the delivery of its events.
async fn flow(gateway: &TestGateway, subscription: &str, count: usize) -> Duration {
    let mut consumer = Consumer::open(gateway, subscription, 1000).await;
    let mut slowest = Duration::ZERO;
    for batch in 0..count / 100 {
        let sent = Instant::now();
        publish(
            gateway,
            (0..100)
                .map(|i| event(&format!("o-{batch}-{i}"), "order.created"))
                .collect(),
        )
        .await;
        let deliveries = consumer.take(100, WAIT).await;
        slowest = slowest.max(sent.elapsed());
        let acks = deliveries.into_iter().map(|d| d.ack_id).collect();
        assert!(ack(gateway, subscription, acks).await.is_empty());
    }
    slowest
}

#[tokio::test]
async fn a_transaction_open_in_another_database_delays_nothing() {
    let database = TestDatabase::create().await;
    let elsewhere = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    let other_pool = elsewhere.pool().await;
    let held = open_writing_transaction(&other_pool, "batch_job").await;

    let slowest = flow(&gateway, "orders", 1000).await;
    // Generous for a loaded machine; the old read horizon waited for the whole
    // transaction, here as long as the test.
    assert!(slowest < Duration::from_secs(5), "a batch took {slowest:?}");
    let still_open: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = $1 \
         AND state LIKE 'idle in transaction%' AND backend_xid IS NOT NULL)",
    )
    .bind(elsewhere.name())
    .fetch_one(&database.pool().await)
    .await
    .unwrap();
    assert!(still_open, "the transaction stayed open throughout");
    held.rollback().await.unwrap();
}

#[tokio::test]
async fn a_transaction_open_on_another_table_of_the_same_database_delays_nothing() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    let pool = database.pool().await;
    let held = open_writing_transaction(&pool, "inventory").await;
    let slowest = flow(&gateway, "orders", 500).await;
    assert!(slowest < Duration::from_secs(5), "a batch took {slowest:?}");
    held.commit().await.unwrap();
}

/// A writer's transaction inserts events and stays open while others flow; then it
/// commits (its events arrive, nothing skipped or doubled) or rolls back (none arrive).
async fn own_events_wait_for_their_transaction(ordered: bool, commit: bool) {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let mut definition = subscription("orders");
    definition.ordered = ordered;
    create_subscription(&gateway, definition).await;
    let pool = database.pool().await;
    let mut consumer = Consumer::open(&gateway, "orders", 1000).await;

    let mut writer = pool.begin().await.unwrap();
    for i in 0..3 {
        insert_event(&mut *writer, "held", &format!("order.step{i}")).await;
    }
    // Others commit meanwhile, some on the same aggregate.
    for i in 0..20 {
        let aggregate = if i % 5 == 0 {
            "held".to_owned()
        } else {
            format!("o-{i}")
        };
        insert_event(&pool, &aggregate, "order.created").await;
    }
    let mut delivered: Vec<proto::Delivery> = Vec::new();
    let deadline = Instant::now() + WAIT;
    while delivered.len() < 20 {
        let delivery = consumer
            .next(deadline.saturating_duration_since(Instant::now()))
            .await
            .expect("events committed meanwhile arrive while the writer is open");
        ack_all(&gateway, "orders", vec![delivery.ack_id.clone()]).await;
        delivered.push(delivery);
    }
    assert!(
        consumer.next(QUIET).await.is_none(),
        "nothing of the open transaction"
    );

    if commit {
        writer.commit().await.unwrap();
        // On an ordered subscription they come one at a time: ack each before the next.
        let mut types = Vec::new();
        for _ in 0..3 {
            let late = consumer.take(1, WAIT).await.remove(0);
            types.push(late.event.as_ref().unwrap().event_type.clone());
            ack_all(&gateway, "orders", vec![late.ack_id]).await;
        }
        if !ordered {
            types.sort();
        }
        assert_eq!(types, ["order.step0", "order.step1", "order.step2"]);
    } else {
        writer.rollback().await.unwrap();
    }
    assert!(
        consumer.next(QUIET).await.is_none(),
        "nothing more, nothing twice"
    );
}

#[tokio::test]
async fn a_writers_own_events_arrive_when_it_commits() {
    own_events_wait_for_their_transaction(false, true).await;
}

#[tokio::test]
async fn a_writers_own_events_never_arrive_when_it_rolls_back() {
    own_events_wait_for_their_transaction(false, false).await;
}

#[tokio::test]
async fn an_ordered_subscription_keeps_order_across_an_open_writer() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let mut definition = subscription("orders");
    definition.ordered = true;
    create_subscription(&gateway, definition).await;
    let pool = database.pool().await;
    let mut consumer = Consumer::open(&gateway, "orders", 1000).await;

    // The writer holds the aggregate's first event open; later events of the same
    // aggregate, committed meanwhile, go out first — they became visible first.
    let mut writer = pool.begin().await.unwrap();
    insert_event(&mut *writer, "a-1", "order.first").await;
    insert_event(&pool, "a-1", "order.second").await;
    insert_event(&pool, "a-1", "order.third").await;
    let second = consumer.take(1, WAIT).await.remove(0);
    assert_eq!(second.event.as_ref().unwrap().event_type, "order.second");
    assert!(
        consumer.next(QUIET).await.is_none(),
        "one at a time per aggregate"
    );
    writer.commit().await.unwrap();
    // The late event queues behind "third", which was visible before it.
    ack_all(&gateway, "orders", vec![second.ack_id]).await;
    let mut order = Vec::new();
    for _ in 0..2 {
        let next = consumer.take(1, WAIT).await.remove(0);
        assert!(
            consumer.next(QUIET).await.is_none(),
            "one at a time per aggregate"
        );
        order.push(next.event.as_ref().unwrap().event_type.clone());
        ack_all(&gateway, "orders", vec![next.ack_id]).await;
    }
    assert_eq!(order, ["order.third", "order.first"]);
}

#[tokio::test]
async fn events_of_a_transaction_passed_while_open_survive_retention_until_delivered() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.maintenance.interval = Duration::from_millis(100);
    config.maintenance.retention = Duration::from_millis(1);
    let gateway = TestGateway::start_with(&database, config).await;
    create_subscription(&gateway, subscription("orders")).await;
    let pool = database.pool().await;
    let mut consumer = Consumer::open(&gateway, "orders", 100).await;

    let mut writer = pool.begin().await.unwrap();
    insert_event(&mut *writer, "late", "order.created").await;
    insert_event(&pool, "early", "order.created").await;
    let early = consumer.take(1, WAIT).await.remove(0);
    assert_eq!(aggregate_of(&early), "early");
    ack_all(&gateway, "orders", vec![early.ack_id]).await;
    // Past the cursor and long past retention: maintenance must keep it.
    let pending: Vec<i64> = sqlx::query_scalar(
        "SELECT unnest(c.pending_xact_ids) FROM outbox_cursors c \
         JOIN outbox_subscriptions s ON s.id = c.subscription_id WHERE s.name = 'orders'",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(!pending.is_empty(), "the open writer is remembered");
    // Maintenance has run past the open writer once it retires the delivered event
    // beside it.
    eventually(
        "maintenance deletes the delivered event",
        Duration::from_secs(20),
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM outbox_events WHERE aggregate_id = 'early'",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
                == 0
        },
    )
    .await;
    writer.commit().await.unwrap();
    let late = consumer.take(1, WAIT).await.remove(0);
    assert_eq!(aggregate_of(&late), "late");
}

#[tokio::test]
async fn a_latest_start_includes_transactions_still_open_at_creation() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let pool = database.pool().await;
    insert_event(&pool, "history", "order.created").await;
    let mut writer = pool.begin().await.unwrap();
    insert_event(&mut *writer, "in-progress", "order.created").await;
    let mut latest = subscription("orders");
    latest.start = None;
    create_subscription(&gateway, latest).await;
    writer.commit().await.unwrap();
    insert_event(&pool, "after", "order.created").await;

    let mut consumer = Consumer::open(&gateway, "orders", 100).await;
    let deliveries = consumer.take(2, WAIT).await;
    let aggregates: BTreeSet<String> = deliveries.iter().map(aggregate_of).collect();
    assert_eq!(
        aggregates,
        BTreeSet::from(["in-progress".to_owned(), "after".to_owned()])
    );
    assert!(consumer.next(QUIET).await.is_none(), "history is skipped");
}

/// Events each subscription must see, by filter.
fn expected_for(name: &str, aggregate_type: &str, event_type: &str) -> bool {
    match name {
        "all" | "all-ordered" => true,
        "orders-only" => aggregate_type == "order",
        "created-only" => event_type.ends_with(".created"),
        _ => unreachable!(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_committing_in_random_order_lose_and_double_nothing() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let pool = database.pool().await;
    sqlx::query("CREATE TABLE business (id serial PRIMARY KEY, note text)")
        .execute(&pool)
        .await
        .unwrap();
    let filters: [(&str, Option<&str>, Option<&str>, bool); 4] = [
        ("all", None, None, false),
        ("all-ordered", None, None, true),
        ("orders-only", Some("order"), None, false),
        ("created-only", None, Some("*.created"), false),
    ];
    for (name, aggregate_type, event_type, ordered) in filters {
        let mut definition = subscription(name);
        definition.aggregate_types = aggregate_type.map(|t| vec![t.into()]).unwrap_or_default();
        definition.event_types = event_type.map(|t| vec![t.into()]).unwrap_or_default();
        definition.ordered = ordered;
        create_subscription(&gateway, definition).await;
    }
    // Consumers ack everything they receive and record it.
    let mut consumers = Vec::new();
    for (name, ..) in filters {
        let mut consumer = Consumer::open(&gateway, name, 1000).await;
        let subscriber = gateway.subscriber().await;
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        consumers.push((
            name,
            stop,
            tokio::spawn(async move {
                let mut subscriber = subscriber;
                let mut seen: Vec<String> = Vec::new();
                loop {
                    tokio::select! {
                        delivery = consumer.next(Duration::from_secs(60)) => {
                            let delivery = delivery.expect("the stream stays open");
                            let event = delivery.event.as_ref().unwrap();
                            seen.push(event.id.clone());
                            subscriber
                                .ack(proto::AckRequest {
                                    subscription: name.into(),
                                    ack_ids: vec![delivery.ack_id.clone()],
                                })
                                .await
                                .unwrap();
                        }
                        _ = &mut stopped => return seen,
                    }
                }
            }),
        ));
    }

    let seed: u64 = rand::random();
    let writers = 8;
    let mut tasks = Vec::new();
    for writer in 0..writers {
        let pool = pool.clone();
        let mut publisher = gateway.publisher().await;
        tasks.push(tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(seed + writer);
            // (id, aggregate type, aggregate id, event type) of every committed event.
            let mut committed = Vec::new();
            for round in 0..25 {
                let aggregate_type = ["order", "invoice"][rng.random_range(0..2)];
                let event_type = ["order.created", "order.paid", "invoice.created"]
                    [rng.random_range(0..3)];
                let aggregate_id = format!("agg-{}", rng.random_range(0..6));
                let id = uuid::Uuid::new_v4();
                let delay = Duration::from_millis(rng.random_range(0..30));
                if rng.random_bool(0.3) {
                    // By RPC (the gateway's own transaction).
                    publisher
                        .publish(proto::PublishRequest {
                            events: vec![proto::EventInput {
                                id: id.to_string(),
                                aggregate_type: aggregate_type.into(),
                                ..event(&aggregate_id, event_type)
                            }],
                            ..Default::default()
                        })
                        .await
                        .unwrap();
                    committed.push((id.to_string(), aggregate_type, aggregate_id, event_type));
                    continue;
                }
                // Direct SQL, sometimes with a business write first, held open a while.
                let mut transaction = pool.begin().await.unwrap();
                if rng.random_bool(0.5) {
                    sqlx::query("INSERT INTO business (note) VALUES ($1)")
                        .bind(format!("{writer}-{round}"))
                        .execute(&mut *transaction)
                        .await
                        .unwrap();
                }
                sqlx::query(
                    "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
                     VALUES ($1, $2, $3, $4, '{}')",
                )
                .bind(id)
                .bind(aggregate_type)
                .bind(&aggregate_id)
                .bind(event_type)
                .execute(&mut *transaction)
                .await
                .unwrap();
                tokio::time::sleep(delay).await;
                if rng.random_bool(0.2) {
                    transaction.rollback().await.unwrap();
                } else {
                    transaction.commit().await.unwrap();
                    committed.push((id.to_string(), aggregate_type, aggregate_id, event_type));
                }
            }
            committed
        }));
    }
    let mut committed = Vec::new();
    for task in tasks {
        committed.extend(task.await.unwrap());
    }
    let mut expected: HashMap<&str, BTreeSet<String>> = HashMap::new();
    for (name, ..) in filters {
        expected.insert(
            name,
            committed
                .iter()
                .filter(|(_, aggregate_type, _, event_type)| {
                    expected_for(name, aggregate_type, event_type)
                })
                .map(|(id, ..)| id.clone())
                .collect(),
        );
    }

    // Wait until every subscription has seen what it should, then stop the consumers.
    let pool_ref = &pool;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let pending: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox_delivery_records WHERE state <> 'dead'",
        )
        .fetch_one(pool_ref)
        .await
        .unwrap();
        let stats = gateway
            .admin()
            .await
            .get_stats(proto::GetStatsRequest::default())
            .await
            .unwrap()
            .into_inner();
        let backlog: u64 = stats.subscriptions.iter().map(|s| s.lag_events).sum();
        if pending == 0 && backlog == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "never drained (seed {seed})");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut seen_by: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for (name, stop, task) in consumers {
        let _ = stop.send(());
        seen_by.insert(name, task.await.unwrap());
    }
    for (name, seen) in &seen_by {
        let unique: BTreeSet<String> = seen.iter().cloned().collect();
        assert_eq!(
            unique.len(),
            seen.len(),
            "{name}: an event was delivered twice (seed {seed})"
        );
        assert_eq!(
            &unique, &expected[name],
            "{name}: delivered set differs (seed {seed})"
        );
    }
}

/// Transactions committed in the test's database so far, as the statistics show them
/// (each backend reports within about a second of going idle).
async fn committed_transactions(pool: &PgPool, database: &str) -> i64 {
    sqlx::query_scalar("SELECT xact_commit FROM pg_stat_database WHERE datname = $1")
        .bind(database)
        .fetch_one(pool)
        .await
        .unwrap()
}

fn typed(name: &str, event_type: &str) -> proto::Subscription {
    proto::Subscription {
        event_types: vec![event_type.into()],
        ..subscription(name)
    }
}

#[tokio::test]
async fn idle_subscriptions_with_streams_cost_the_database_next_to_nothing() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    // Frequent polls, so what each idle subscription costs per poll shows as well.
    config.delivery.poll_interval = Duration::from_millis(500);
    let gateway = TestGateway::start_with(&database, config).await;
    create_subscription(&gateway, typed("busy", "busy.happened")).await;
    const IDLE: usize = 40;
    let mut idle = Vec::new();
    for index in 0..IDLE {
        let name = format!("idle-{index}");
        create_subscription(&gateway, typed(&name, "idle.wanted")).await;
        idle.push(Consumer::open(&gateway, &name, 10).await);
    }
    let mut busy = Consumer::open(&gateway, "busy", 100).await;
    let pool = database.pool().await;
    // Let the streams settle in before counting.
    publish(&gateway, vec![event("warm-up", "busy.happened")]).await;
    let warm_up = busy.take(1, WAIT).await;
    assert!(
        ack(&gateway, "busy", vec![warm_up[0].ack_id.clone()])
            .await
            .is_empty()
    );
    tokio::time::sleep(Duration::from_secs(2)).await;

    let before = committed_transactions(&pool, database.name()).await;
    const EVENTS: usize = 40;
    for index in 0..EVENTS {
        publish(
            &gateway,
            vec![event(&format!("o-{index}"), "busy.happened")],
        )
        .await;
        let delivered = busy.take(1, WAIT).await;
        assert!(
            ack(&gateway, "busy", vec![delivered[0].ack_id.clone()])
                .await
                .is_empty()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The statistics of the last calls arrive within a second or two.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let spent = committed_transactions(&pool, database.name()).await - before;
    // A publish, a claim and an ack each, a few reads of what is new, the heartbeats and
    // polls (more per event the longer a loaded machine takes): about 10 per event.
    // Claiming for every idle subscription at every publish and poll spent over 120.
    let per_event = spent as f64 / EVENTS as f64;
    assert!(
        per_event < 40.0,
        "{spent} transactions for {EVENTS} events ({per_event:.1} per event) beside {IDLE} idle subscriptions"
    );
    // And the idle subscriptions still get what they select.
    publish(&gateway, vec![event("wanted", "idle.wanted")]).await;
    for consumer in &mut idle {
        let delivered = consumer.take(1, WAIT).await;
        assert_eq!(delivered[0].event.as_ref().unwrap().aggregate_id, "wanted");
    }
}

#[tokio::test]
async fn idle_read_positions_move_past_other_events_and_still_wait_for_open_transactions() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.delivery.poll_interval = Duration::from_millis(300);
    let gateway = TestGateway::start_with(&database, config).await;
    create_subscription(&gateway, typed("quiet", "quiet.wanted")).await;
    let mut quiet = Consumer::open(&gateway, "quiet", 10).await;
    let pool = database.pool().await;
    // A writer's event for it, in a transaction that stays open while others pass.
    let mut held = pool.begin().await.unwrap();
    insert_event(&mut *held, "late", "quiet.wanted").await;
    for batch in 0..5 {
        publish(
            &gateway,
            (0..20)
                .map(|i| event(&format!("n-{batch}-{i}"), "noise.happened"))
                .collect(),
        )
        .await;
    }
    let newest_noise: i64 = sqlx::query_scalar(
        "SELECT max(xact_id) FROM outbox_events WHERE event_type = 'noise.happened'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    // Its read position moves past the events it does not select.
    eventually(
        "the idle subscription's read position passes the other events",
        WAIT,
        || {
            let pool = pool.clone();
            async move {
                let cursor: i64 = sqlx::query_scalar(
                    "SELECT c.cursor_xact_id FROM outbox_cursors c \
                     JOIN outbox_subscriptions s ON s.id = c.subscription_id \
                     WHERE s.name = 'quiet'",
                )
                .fetch_one(&pool)
                .await
                .unwrap();
                cursor >= newest_noise
            }
        },
    )
    .await;
    assert!(
        quiet.next(QUIET).await.is_none(),
        "nothing of the noise is delivered"
    );
    // The open transaction's event was passed while it ran, not skipped.
    held.commit().await.unwrap();
    let late = quiet.take(1, WAIT).await;
    assert_eq!(late[0].event.as_ref().unwrap().aggregate_id, "late");
    publish(&gateway, vec![event("fresh", "quiet.wanted")]).await;
    let fresh = quiet.take(1, WAIT).await;
    assert_eq!(fresh[0].event.as_ref().unwrap().aggregate_id, "fresh");
    assert!(quiet.next(QUIET).await.is_none(), "each arrives once");
}
