//! Upgrading: a database the previous release's schema wrote, with events, a subscription,
//! a delivery awaiting its retry and a dead letter, is migrated by the gateway at start
//! and served as before.

use std::{collections::BTreeSet, path::Path, time::Duration};

use crate::common::*;
use outbox_gateway::proto;
use sqlx::{PgPool, migrate::Migrator};

const WAIT: Duration = Duration::from_secs(15);

/// Applies every migration but the newest, as sqlx would (with its bookkeeping), and
/// returns the newest version.
async fn migrate_to_previous_release(pool: &PgPool) -> i64 {
    let mut migrator = Migrator::new(Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/migrations"
    )))
    .await
    .expect("read the migrations");
    let newest = migrator
        .iter()
        .map(|migration| migration.version)
        .max()
        .expect("migrations");
    let previous: Vec<_> = migrator
        .iter()
        .filter(|migration| migration.version < newest)
        .cloned()
        .collect();
    migrator.migrations = previous.into();
    migrator
        .run(pool)
        .await
        .expect("migrate to the previous schema");
    newest
}

/// One event written as a service writes it, in a transaction of its own.
async fn insert_event(pool: &PgPool, aggregate_id: &str) -> (i64, i64) {
    sqlx::query_as(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('order', $1, 'order.created', convert_to($2, 'UTF8')) \
         RETURNING xact_id, position",
    )
    .bind(aggregate_id)
    .bind(format!(r#"{{"aggregate":"{aggregate_id}"}}"#))
    .fetch_one(pool)
    .await
    .expect("insert an event")
}

#[tokio::test]
async fn a_database_of_the_previous_schema_is_migrated_and_served_as_before() {
    let database = TestDatabase::create().await;
    let pool = database.pool().await;
    let newest = migrate_to_previous_release(&pool).await;

    // What the previous release left: o-0, o-1 and o-2 handed out (o-0 leased to a
    // consumer, o-1 awaiting a retry, o-2 a dead letter), o-3 and o-4 not yet read.
    let (_, leased) = insert_event(&pool, "o-0").await;
    let (_, first) = insert_event(&pool, "o-1").await;
    let (handed_out_xact, handed_out_position) = insert_event(&pool, "o-2").await;
    insert_event(&pool, "o-3").await;
    insert_event(&pool, "o-4").await;
    let subscription_id: i64 = sqlx::query_scalar(
        "INSERT INTO outbox_subscriptions (name, ack_deadline_ms, max_attempts, \
             retry_backoff_min_ms, retry_backoff_max_ms, start_kind) \
         VALUES ('orders', 30000, 5, 0, 1000, 'earliest') RETURNING id",
    )
    .fetch_one(&pool)
    .await
    .expect("a subscription of the previous schema");
    sqlx::query(
        "INSERT INTO outbox_cursors (subscription_id, cursor_xact_id, cursor_position) \
         VALUES ($1, $2, $3)",
    )
    .bind(subscription_id)
    .bind(handed_out_xact)
    .bind(handed_out_position)
    .execute(&pool)
    .await
    .expect("its read position");
    sqlx::query(
        "INSERT INTO outbox_deliveries (subscription_id, position, state, attempt, due_at, last_error) \
         VALUES ($1, $2, 'retry', 1, now(), 'timed out')",
    )
    .bind(subscription_id)
    .bind(first)
    .execute(&pool)
    .await
    .expect("a delivery awaiting its retry");
    sqlx::query(
        "INSERT INTO outbox_deliveries (subscription_id, position, state, attempt, last_error, dead_lettered_at) \
         VALUES ($1, $2, 'dead', 5, 'cannot parse', now())",
    )
    .bind(subscription_id)
    .bind(handed_out_position)
    .execute(&pool)
    .await
    .expect("a dead letter");

    sqlx::query(
        "INSERT INTO outbox_deliveries (subscription_id, position, state, attempt, lease_token, due_at) \
         VALUES ($1, $2, 'in_flight', 1, 42, now() + interval '1 hour')",
    )
    .bind(subscription_id)
    .bind(leased)
    .execute(&pool)
    .await
    .expect("a delivery in flight");

    let gateway = TestGateway::start(&database).await;

    let applied: Vec<(i64, bool)> =
        sqlx::query_as("SELECT version, success FROM _sqlx_migrations ORDER BY version")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(applied.last(), Some(&(newest, true)), "{applied:?}");
    assert!(applied.iter().all(|(_, success)| *success), "{applied:?}");

    let orders = gateway
        .admin()
        .await
        .get_subscription(proto::GetSubscriptionRequest {
            name: "orders".into(),
        })
        .await
        .expect("the subscription survives the upgrade")
        .into_inner();
    assert_eq!(orders.ack_deadline, seconds(30));
    assert_eq!(orders.max_attempts, Some(5));
    assert_eq!(
        orders.expire_after_idle, None,
        "kept until deleted, as before"
    );

    let dead_letters = list_dead_letters(&gateway, "orders").await;
    assert_eq!(dead_letters.len(), 1, "{dead_letters:?}");
    assert_eq!(dead_letters[0].event.as_ref().unwrap().aggregate_id, "o-2");
    assert_eq!(dead_letters[0].last_error, "cannot parse");
    assert_eq!(dead_letters[0].attempts, 5);

    // An ack id the previous release handed out is answered: stale when it names another
    // lease, applied when it names the one held.
    let ack_id = |token: u64| format!("{leased}-1-{token:016x}");
    assert_eq!(
        ack(&gateway, "orders", vec![ack_id(43)]).await,
        vec![ack_id(43)]
    );
    assert!(ack(&gateway, "orders", vec![ack_id(42)]).await.is_empty());

    // The retry comes as the second attempt; the unread events as first ones.
    let mut consumer = Consumer::open(&gateway, "orders", 10).await;
    let deliveries = consumer.take(3, WAIT).await;
    let delivered: BTreeSet<(String, u32)> = deliveries
        .iter()
        .map(|delivery| (aggregate_of(delivery), delivery.attempt))
        .collect();
    assert_eq!(
        delivered,
        BTreeSet::from([
            ("o-1".to_owned(), 2),
            ("o-3".to_owned(), 1),
            ("o-4".to_owned(), 1)
        ])
    );
    assert!(
        consumer.next(Duration::from_millis(500)).await.is_none(),
        "the dead letter is not delivered"
    );
    ack_all(
        &gateway,
        "orders",
        deliveries
            .into_iter()
            .map(|delivery| delivery.ack_id)
            .collect(),
    )
    .await;
    assert_eq!(
        delivery_records(&pool, "orders").await,
        vec![("o-2".to_owned(), "dead".to_owned(), 5)]
    );
}
