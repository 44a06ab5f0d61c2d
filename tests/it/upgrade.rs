//! Upgrading: a database earlier releases wrote is migrated by the gateway at start and
//! served as before. One the previous release's schema wrote (events, a subscription, a
//! lease, a retry, a dead letter); and one that every release since the first wrote in
//! turn, in the tables of its schema, migrated one migration at a time.

use std::{collections::BTreeSet, path::Path, time::Duration};

use crate::common::*;
use outbox_gateway::proto;
use sqlx::{Connection, PgConnection, PgPool, migrate::Migrator};

const WAIT: Duration = Duration::from_secs(15);

/// Applies every migration but the newest, as sqlx would (with its bookkeeping), and
/// returns the newest version.
async fn migrate_to_previous_release(pool: &PgPool) -> i64 {
    let mut migrator = migrations().await;
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

/// Lease tokens the releases before this one handed out, which their ack ids name: o-1's
/// and o-2's leases (the oldest release), acct-1's first (0006), the claim batch (0011).
const HELD_TOKEN: i64 = 42;
const EXPIRING_TOKEN: i64 = 43;
const LEDGER_TOKEN: i64 = 7;
const BATCH_TOKEN: i64 = 119;

/// An event as a service writes it: aggregate type and id, version, event type, payload.
type Written = (
    &'static str,
    &'static str,
    Option<i64>,
    &'static str,
    &'static str,
);

/// What the release that shipped migration `version` wrote once it had run: `events` as
/// services write them (each in a transaction of its own), then `rows` as its gateway and
/// operators wrote them, in the tables of its schema.
struct Release {
    version: i64,
    events: &'static [Written],
    rows: &'static str,
}

/// Every release in turn. Those not listed changed functions only (0005, 0016), added
/// what needs more than rows (0012: sinks, which need a broker in the configuration), or
/// indexes (0018); 0013's key, names and consumer are [`consume_as_the_release_did`]. The
/// lease tokens in the SQL are the constants above.
const RELEASES: &[Release] = &[
    Release {
        version: 1,
        events: &[
            ("order", "o-1", None, "order.created", r#"{"total": 50}"#),
            ("order", "o-2", None, "order.created", r#"{"total": 100}"#),
            ("order", "o-3", None, "order.created", r#"{"total": 150}"#),
            ("order", "o-4", None, "order.created", r#"{"total": 200}"#),
            ("order", "o-5", None, "order.created", r#"{"total": 250}"#),
            ("order", "o-6", None, "order.created", r#"{"total": 300}"#),
        ],
        rows: "",
    },
    Release {
        version: 2,
        events: &[],
        // A subscription, read up to o-4: o-1 leased for an hour yet (HELD_TOKEN), o-2 for
        // two seconds more (EXPIRING_TOKEN), o-3 awaiting its retry, o-4 dead-lettered
        // after its three attempts.
        rows: "INSERT INTO outbox_subscriptions (name, event_types, ack_deadline_ms, max_attempts, \
             retry_backoff_min_ms, retry_backoff_max_ms, cursor_xact_id, cursor_position) \
         VALUES ('orders', '{order.*}', 30000, 3, 1000, 60000, \
                 pg_temp.xact_of('o-4'), pg_temp.position_of('o-4')); \
         INSERT INTO outbox_deliveries (subscription_id, position, state, attempt, lease_token, \
             due_at, last_error, dead_lettered_at) \
         VALUES (pg_temp.id_of('orders'), pg_temp.position_of('o-1'), 'in_flight', 1, 42, \
                 now() + interval '1 hour', NULL, NULL), \
                (pg_temp.id_of('orders'), pg_temp.position_of('o-2'), 'in_flight', 1, 43, \
                 now() + interval '2 seconds', NULL, NULL), \
                (pg_temp.id_of('orders'), pg_temp.position_of('o-3'), 'retry', 1, NULL, \
                 now(), 'timed out', NULL), \
                (pg_temp.id_of('orders'), pg_temp.position_of('o-4'), 'dead', 3, NULL, \
                 NULL, 'cannot parse', now());",
    },
    Release {
        version: 3,
        events: &[],
        // The deliveries counted (o-1 to o-3 once, o-4 three times), and the events
        // maintenance force-expired.
        rows: "INSERT INTO outbox_subscription_counters (subscription_id, shard, delivered, acked) \
         VALUES (pg_temp.id_of('orders'), 0, 6, 0); \
         INSERT INTO outbox_gateway_counters (name, value) VALUES ('events_force_expired', 2);",
    },
    Release {
        version: 4,
        events: &[],
        // A writer publishes through the function.
        rows: r#"SELECT outbox_publish('order', 'o-7', 'order.created', '{"total": 350}');"#,
    },
    Release {
        version: 6,
        events: &[
            ("account", "acct-2", Some(1), "account.opened", "{}"),
            ("account", "acct-1", Some(1), "account.opened", "{}"),
            ("account", "acct-1", Some(2), "account.credited", "{}"),
        ],
        // An ordered subscription whose read position passed acct-2's transaction while
        // it was still running (pending, nothing of it taken); acct-1's first event is
        // leased for an hour (LEDGER_TOKEN), its second waits behind it.
        rows: "INSERT INTO outbox_subscriptions (name, event_types, ordered, ack_deadline_ms, \
             max_attempts, retry_backoff_min_ms, retry_backoff_max_ms, cursor_xact_id, \
             cursor_position, pending_xact_ids, pending_positions) \
         VALUES ('ledger', '{account.*}', true, 30000, 5, 1000, 60000, \
                 pg_temp.xact_of('acct-1', 2), pg_temp.position_of('acct-1', 2), \
                 ARRAY[pg_temp.xact_of('acct-2')], ARRAY[0::bigint]); \
         INSERT INTO outbox_deliveries (subscription_id, position, state, attempt, lease_token, \
             due_at, ordering_key) \
         SELECT pg_temp.id_of('ledger'), e.position, \
                CASE e.aggregate_version WHEN 1 THEN 'in_flight' ELSE 'waiting' END, \
                CASE e.aggregate_version WHEN 1 THEN 1 ELSE 0 END, \
                CASE e.aggregate_version WHEN 1 THEN 7 END, \
                CASE e.aggregate_version WHEN 1 THEN now() + interval '1 hour' END, \
                hashtextextended(e.aggregate_type || E'\\x1f' || e.aggregate_id, 0) \
         FROM outbox_events e WHERE e.aggregate_id = 'acct-1' ORDER BY e.position;",
    },
    Release {
        version: 7,
        events: &[(
            "invoice",
            "inv-1",
            None,
            "invoice.issued",
            r#"{"total": 10}"#,
        )],
        // Read positions in a table of their own. A subscription of the default source
        // from a minute ago on: inv-0, of two hours ago, is before its start.
        rows: r#"INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload,
               occurred_at, created_at)
           VALUES ('invoice', 'inv-0', 'invoice.issued', convert_to('{"total": 20}', 'UTF8'),
                   now() - interval '2 hours', now() - interval '2 hours');
           INSERT INTO outbox_subscriptions (name, event_types, ack_deadline_ms, max_attempts,
               retry_backoff_min_ms, retry_backoff_max_ms, sources, start_kind, start_time)
           VALUES ('invoices', '{invoice.*}', 30000, 5, 1000, 60000, '{default}', 'time',
                   now() - interval '1 minute');
           INSERT INTO outbox_cursors (subscription_id, cursor_xact_id, cursor_position, not_before)
           SELECT id, 0, 0, start_time FROM outbox_subscriptions WHERE name = 'invoices';"#,
    },
    Release {
        version: 8,
        events: &[],
        // An operator pauses the invoices; an event expired before anyone read it.
        rows: r#"UPDATE outbox_subscriptions SET paused_at = now(), pause_reason = 'month-end close'
           WHERE name = 'invoices';
           INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload,
               occurred_at, expires_at)
           VALUES ('order', 'o-8', 'order.created', convert_to('{"total": 400}', 'UTF8'),
                   now() - interval '1 hour', now() - interval '1 minute');"#,
    },
    Release {
        version: 9,
        events: &[],
        // A push subscription, stopped when its endpoint answered 410 Gone, as that
        // release stored it (before push batches, whose settings it lacks).
        rows: r#"INSERT INTO outbox_subscriptions (name, event_types, ack_deadline_ms,
               max_attempts, retry_backoff_min_ms, retry_backoff_max_ms, push, push_secrets,
               push_stopped_at, push_stopped_reason)
           VALUES ('webhook', '{order.*}', 30000, 5, 1000, 60000,
                   '{"endpoint": "https://hooks.example.com/orders",
                     "headers": {"authorization": "Bearer receiver-secret"},
                     "structured": false, "timeout_ms": 10000, "max_concurrency": 4,
                     "rate_limit": null}',
                   '[{"key": "c2lnbmluZyBrZXkgb2YgdGhlIHJlbGVhc2U=", "expires_at_ms": null}]',
                   now(), 'the endpoint answered 410 Gone');
           INSERT INTO outbox_cursors (subscription_id, cursor_xact_id, cursor_position)
           VALUES (pg_temp.id_of('webhook'),
                   pg_snapshot_xmax(pg_current_snapshot())::text::bigint, 0);"#,
    },
    Release {
        version: 10,
        events: &[],
        // A subscription that expires after a minute unused, unused for an hour.
        rows: "INSERT INTO outbox_subscriptions (name, ack_deadline_ms, max_attempts, \
             retry_backoff_min_ms, retry_backoff_max_ms, expire_after_idle_ms, last_attached_at) \
         VALUES ('scratch', 30000, 5, 1000, 60000, 60000, now() - interval '1 hour'); \
         INSERT INTO outbox_cursors (subscription_id, cursor_xact_id, cursor_position) \
         VALUES (pg_temp.id_of('scratch'), pg_snapshot_xmax(pg_current_snapshot())::text::bigint, 0);",
    },
    Release {
        version: 11,
        events: &[],
        // A claim by a stream with room for three leases o-5 to o-7 in a batch for an
        // hour (BATCH_TOKEN), moves the read position past them and counts three
        // deliveries.
        rows: "INSERT INTO outbox_delivery_batches (subscription_id, lease_token, chunk, due_at, positions) \
         VALUES (pg_temp.id_of('orders'), 119, 0, now() + interval '1 hour', \
                 ARRAY[pg_temp.position_of('o-5'), pg_temp.position_of('o-6'), \
                       pg_temp.position_of('o-7')]); \
         UPDATE outbox_cursors \
         SET cursor_xact_id = pg_temp.xact_of('o-7'), cursor_position = pg_temp.position_of('o-7') \
         WHERE subscription_id = pg_temp.id_of('orders'); \
         UPDATE outbox_subscription_counters SET delivered = delivered + 3 \
         WHERE subscription_id = pg_temp.id_of('orders') AND shard = 0;",
    },
    Release {
        version: 14,
        events: &[],
        // A filtered subscription, started at the latest event, which has passed over two
        // orders since and could not evaluate one of them.
        rows: "INSERT INTO outbox_subscriptions (name, event_types, ack_deadline_ms, max_attempts, \
             retry_backoff_min_ms, retry_backoff_max_ms, filter) \
         VALUES ('big-orders', '{order.*}', 30000, 5, 1000, 60000, 'payload.total > 100.0'); \
         INSERT INTO outbox_cursors (subscription_id, cursor_xact_id, cursor_position, \
             last_filter_error, last_filter_error_at) \
         VALUES (pg_temp.id_of('big-orders'), \
                 pg_snapshot_xmax(pg_current_snapshot())::text::bigint, 0, \
                 'no such key: total', now()); \
         INSERT INTO outbox_subscription_counters (subscription_id, shard, filtered, filter_errors) \
         VALUES (pg_temp.id_of('big-orders'), 0, 2, 1); \
         INSERT INTO outbox_consumer_subscriptions (id, name) \
         VALUES (pg_temp.id_of('big-orders'), 'big-orders');",
    },
    Release {
        version: 15,
        events: &[],
        // Acks of claim batches go through a function: o-6 is acked.
        rows: "SELECT * FROM outbox_ack_batches(pg_temp.id_of('orders'), \
             ARRAY[pg_temp.position_of('o-6')], ARRAY[119::bigint]);",
    },
    Release {
        version: 17,
        events: &[],
        // A gateway that died an hour ago left its record of the streams it held.
        rows: "INSERT INTO outbox_subscription_streams (subscription_id, gateway, streams, seen_at) \
         VALUES (pg_temp.id_of('orders'), gen_random_uuid(), 2, now() - interval '1 hour');",
    },
];

/// The migration that brought exactly-once consumption.
const CONSUMPTION: i64 = 13;

/// Lookups for the rows above, in the session that writes them (PL/pgSQL, so that they
/// can be created before the tables they read).
const LOOKUPS: &str = "\
    CREATE FUNCTION pg_temp.position_of(aggregate text, version bigint DEFAULT NULL) \
    RETURNS bigint LANGUAGE plpgsql AS $$ BEGIN \
        RETURN (SELECT position FROM outbox_events WHERE aggregate_id = aggregate \
                AND (version IS NULL OR aggregate_version = version)); END $$; \
    CREATE FUNCTION pg_temp.xact_of(aggregate text, version bigint DEFAULT NULL) \
    RETURNS bigint LANGUAGE plpgsql AS $$ BEGIN \
        RETURN (SELECT xact_id FROM outbox_events WHERE aggregate_id = aggregate \
                AND (version IS NULL OR aggregate_version = version)); END $$; \
    CREATE FUNCTION pg_temp.id_of(subscription text) \
    RETURNS bigint LANGUAGE plpgsql AS $$ BEGIN \
        RETURN (SELECT id FROM outbox_subscriptions WHERE name = subscription); END $$;";

/// An ack id as the gateway writes it for the default source (without the seal, which
/// only `outbox_consume` reads).
fn ack_id_of(position: i64, attempt: i32, token: i64) -> String {
    format!("{position}-{attempt}-{token:016x}")
}

/// The position of an event (of the aggregate's `version`, when given).
async fn position_of(pool: &PgPool, aggregate: &str, version: Option<i64>) -> i64 {
    sqlx::query_scalar(
        "SELECT position FROM outbox_events \
         WHERE aggregate_id = $1 AND ($2::bigint IS NULL OR aggregate_version = $2)",
    )
    .bind(aggregate)
    .bind(version)
    .fetch_one(pool)
    .await
    .unwrap_or_else(|error| panic!("the position of {aggregate}: {error}"))
}

async fn id_of(pool: &PgPool, aggregate: &str) -> String {
    sqlx::query_scalar("SELECT id::text FROM outbox_events WHERE aggregate_id = $1")
        .bind(aggregate)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|error| panic!("the id of {aggregate}: {error}"))
}

/// 0013: the gateway stores its ack key and lets consumers record ack ids of every
/// subscription; a consumer records, in its own transaction, that it consumed o-5 of the
/// claim batch, by the ack id the gateway sealed for it. No gateway settled it since.
async fn consume_as_the_release_did(db: &mut PgConnection) {
    use outbox_domain::{AckId, AckSeal, SourceId, SourceName, SubscriptionId};
    let seal = AckSeal::generate();
    let (inner_pad, outer_pad) = seal.pads();
    sqlx::query("INSERT INTO outbox_consume_key (key, inner_pad, outer_pad) VALUES ($1, $2, $3)")
        .bind(seal.key())
        .bind(inner_pad)
        .bind(outer_pad)
        .execute(&mut *db)
        .await
        .expect("the ack key");
    sqlx::query(
        "INSERT INTO outbox_consumer_subscriptions (id, name) SELECT id, name FROM outbox_subscriptions",
    )
    .execute(&mut *db)
    .await
    .expect("the subscriptions consumers may record");
    let (orders, position): (i64, i64) =
        sqlx::query_as("SELECT pg_temp.id_of('orders'), pg_temp.position_of('o-5')")
            .fetch_one(&mut *db)
            .await
            .unwrap();
    let lease = AckId {
        source: SourceId(0),
        position,
        attempt: 1,
        lease_token: BATCH_TOKEN,
    };
    let ack_id = seal.seal(
        SubscriptionId(orders),
        &lease,
        &SourceName::default_source(),
    );
    let mut consumer = db.begin().await.unwrap();
    let first: bool = sqlx::query_scalar("SELECT outbox_consume('orders', $1)")
        .bind(&ack_id)
        .fetch_one(&mut *consumer)
        .await
        .expect("outbox_consume");
    consumer.commit().await.unwrap();
    assert!(first, "the first consumption of o-5");
}

/// The migrations of migrations/, as sqlx reads them.
async fn migrations() -> Migrator {
    Migrator::new(Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/migrations"
    )))
    .await
    .expect("read the migrations")
}

/// Applies the migrations one at a time from the first (as sqlx does, with its
/// bookkeeping), writing after each what its release wrote.
async fn migrate_release_by_release(db: &mut PgConnection) {
    let all = migrations().await;
    sqlx::raw_sql(LOOKUPS)
        .execute(&mut *db)
        .await
        .expect("the lookups");
    for (index, migration) in all.iter().enumerate() {
        let mut up_to = migrations().await;
        up_to.migrations = all.migrations[..=index].to_vec().into();
        up_to
            .run(&mut *db)
            .await
            .unwrap_or_else(|error| panic!("migration {}: {error}", migration.version));
        if migration.version == CONSUMPTION {
            consume_as_the_release_did(db).await;
        }
        let Some(release) = RELEASES
            .iter()
            .find(|release| release.version == migration.version)
        else {
            continue;
        };
        for (aggregate_type, aggregate_id, version, event_type, payload) in release.events {
            sqlx::query(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_version, \
                     event_type, payload) \
                 VALUES ($1, $2, $3, $4, convert_to($5, 'UTF8'))",
            )
            .bind(aggregate_type)
            .bind(aggregate_id)
            .bind(version)
            .bind(event_type)
            .bind(payload)
            .execute(&mut *db)
            .await
            .unwrap_or_else(|error| panic!("{aggregate_id} at {}: {error}", migration.version));
        }
        sqlx::raw_sql(release.rows)
            .execute(&mut *db)
            .await
            .unwrap_or_else(|error| panic!("the rows of {}: {error}", migration.version));
    }
}

/// An order event with a total, for publishing.
fn order(aggregate_id: &str, total: u32) -> proto::EventInput {
    proto::EventInput {
        payload: format!(r#"{{"total": {total}}}"#).into_bytes(),
        ..event(aggregate_id, "order.created")
    }
}

/// What a subscription's deliveries are, as (aggregate id, attempt), in any order.
fn delivered(deliveries: &[proto::Delivery]) -> BTreeSet<(String, u32)> {
    deliveries
        .iter()
        .map(|delivery| (aggregate_of(delivery), delivery.attempt))
        .collect()
}

/// Waits until nothing of the subscription is pending, in flight or awaiting retry and it
/// has no dead letter, with `acked` acks in all; its stats then.
async fn all_settled(
    gateway: &TestGateway,
    subscription: &str,
    acked: u64,
) -> proto::SubscriptionStats {
    eventually(&format!("{subscription} is settled"), WAIT, || async {
        let stats = subscription_stats(gateway, subscription).await;
        (
            stats.pending,
            stats.in_flight,
            stats.awaiting_retry,
            stats.dead_lettered,
            stats.acked_total,
        ) == (0, 0, 0, 0, acked)
    })
    .await;
    subscription_stats(gateway, subscription).await
}

/// A database that every release since the first has written to, each in the tables of
/// its schema (see [`RELEASES`]), migrated one release at a time, is served by this one
/// as those releases served it: held leases are honoured and expired ones redelivered,
/// the retry, the dead letter, the late transaction, the waiting event of an aggregate,
/// the pause, the start time, the filter, the claim batch, the consumption not yet
/// settled and the consumption record all do what they did, and the figures go on from
/// where they were.
#[tokio::test]
async fn a_database_written_by_every_release_since_the_first_is_served_as_before() {
    let database = TestDatabase::create().await;
    let pool = database.pool().await;
    let mut db = PgConnection::connect(&database.url()).await.unwrap();
    migrate_release_by_release(&mut db).await;
    drop(db);

    let mut config = test_config(database.url());
    config.maintenance.interval = Duration::from_millis(500);
    let gateway = TestGateway::start_with(&database, config).await;
    let versions: Vec<(i64, bool)> =
        sqlx::query_as("SELECT version, success FROM _sqlx_migrations ORDER BY version")
            .fetch_all(&pool)
            .await
            .unwrap();
    let expected: Vec<(i64, bool)> = migrations()
        .await
        .iter()
        .map(|migration| (migration.version, true))
        .collect();
    assert_eq!(versions, expected, "each migration applied once");

    // The definitions, as written.
    let orders = stored_subscription(&gateway, "orders").await;
    assert_eq!(
        (
            orders.event_types.as_slice(),
            orders.ack_deadline,
            orders.max_attempts
        ),
        (&["order.*".to_owned()][..], seconds(30), Some(3))
    );
    assert!(stored_subscription(&gateway, "ledger").await.ordered);
    let invoices = stored_subscription(&gateway, "invoices").await;
    assert!(invoices.paused, "{invoices:?}");
    assert_eq!(invoices.pause_reason, "month-end close");
    let webhook = stored_subscription(&gateway, "webhook").await;
    let push = webhook.push.as_ref().expect("still a push subscription");
    assert_eq!(
        (
            push.endpoint.as_str(),
            push.timeout,
            push.max_concurrency,
            push.headers.get("authorization")
        ),
        (
            "https://hooks.example.com/orders",
            seconds(10),
            4,
            Some(&outbox_domain::fingerprint("Bearer receiver-secret"))
        )
    );
    assert_eq!(
        webhook
            .push_stopped
            .map(|stopped| stopped.reason)
            .as_deref(),
        Some("the endpoint answered 410 Gone")
    );
    let big_orders = stored_subscription(&gateway, "big-orders").await;
    assert_eq!(big_orders.filter, "payload.total > 100.0");
    eventually(
        "the subscription unused past its expire_after_idle is deleted",
        WAIT,
        || async {
            gateway
                .admin()
                .await
                .get_subscription(proto::GetSubscriptionRequest {
                    name: "scratch".into(),
                })
                .await
                .is_err_and(|status| status.code() == tonic::Code::NotFound)
        },
    )
    .await;

    // The figures go on from where they were.
    let figures = gateway
        .admin()
        .await
        .get_stats(proto::GetStatsRequest {
            subscription: "orders".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let carried = &figures.subscriptions[0];
    assert_eq!((carried.delivered_total, carried.dead_lettered), (9, 1));
    let outbox = figures.outbox.as_ref().expect("outbox stats");
    assert_eq!(outbox.events_force_expired, 2);
    let filtered = subscription_stats(&gateway, "big-orders").await;
    assert_eq!(
        (
            filtered.filtered_total,
            filtered.filter_errors_total,
            filtered.last_filter_error.as_str()
        ),
        (2, 1, "no such key: total")
    );

    // The consumption of o-5 recorded before the upgrade is settled: its lease in the
    // claim batch is gone (o-6 was acked before the upgrade).
    eventually("the consumption of o-5 is settled", WAIT, || async {
        let stats = subscription_stats(&gateway, "orders").await;
        (stats.acked_total, stats.consumption_records) == (2, 1)
    })
    .await;
    let position = |aggregate| position_of(&pool, aggregate, None);
    let settled_by_consumption = ack_id_of(position("o-5").await, 1, BATCH_TOKEN);
    assert_eq!(
        ack(&gateway, "orders", vec![settled_by_consumption.clone()]).await,
        [settled_by_consumption]
    );
    // The leases held are honoured: o-1's record, o-7's place in the claim batch.
    ack_all(
        &gateway,
        "orders",
        vec![
            ack_id_of(position("o-1").await, 1, HELD_TOKEN),
            ack_id_of(position("o-7").await, 1, BATCH_TOKEN),
        ],
    )
    .await;

    // The dead letter is listed and requeued; o-5 is requeued; two orders come.
    let dead_letters = list_dead_letters(&gateway, "orders").await;
    let listed: Vec<(String, u32, &str)> = dead_letters
        .iter()
        .map(|letter| {
            let event = letter.event.as_ref().expect("event");
            (
                event.aggregate_id.clone(),
                letter.attempts,
                letter.last_error.as_str(),
            )
        })
        .collect();
    assert_eq!(listed, [("o-4".to_owned(), 3, "cannot parse")]);
    let mut admin = gateway.admin().await;
    let requeued = admin
        .requeue_dead_letters(proto::RequeueDeadLettersRequest {
            subscription: "orders".into(),
            ids: vec![id_of(&pool, "o-4").await],
            ..Default::default()
        })
        .await
        .expect("requeue the dead letter")
        .into_inner();
    assert_eq!(requeued.requeued_count, 1);
    admin
        .requeue_event(proto::RequeueEventRequest {
            id: id_of(&pool, "o-5").await,
            subscription: "orders".into(),
            ..Default::default()
        })
        .await
        .expect("requeue o-5");
    publish(&gateway, vec![order("o-10", 5), order("o-11", 500)]).await;

    // o-2's lease ran out: it comes again, as does the retry; o-8 expired unread.
    let mut consumer = Consumer::open(&gateway, "orders", 10).await;
    let deliveries = consumer.take(6, WAIT).await;
    assert_eq!(
        delivered(&deliveries),
        BTreeSet::from([
            ("o-2".to_owned(), 2),
            ("o-3".to_owned(), 2),
            ("o-4".to_owned(), 1),
            ("o-5".to_owned(), 1),
            ("o-10".to_owned(), 1),
            ("o-11".to_owned(), 1),
        ])
    );
    let expired_lease = ack_id_of(position("o-2").await, 1, EXPIRING_TOKEN);
    assert_eq!(
        ack(&gateway, "orders", vec![expired_lease.clone()]).await,
        [expired_lease]
    );
    // The consumption record made before the upgrade still answers: o-5 was consumed.
    let (requeued_o5, others): (Vec<_>, Vec<_>) = deliveries
        .into_iter()
        .partition(|delivery| aggregate_of(delivery) == "o-5");
    let mut consumer_db = PgConnection::connect(&database.url()).await.unwrap();
    let first: bool = sqlx::query_scalar("SELECT outbox_consume('orders', $1)")
        .bind(&requeued_o5[0].ack_id)
        .fetch_one(&mut consumer_db)
        .await
        .expect("outbox_consume");
    assert!(!first, "o-5 was consumed before the upgrade");
    ack_all(
        &gateway,
        "orders",
        others.into_iter().map(|delivery| delivery.ack_id).collect(),
    )
    .await;
    // o-1, o-5, o-6, o-7 before; o-2, o-3, o-4, o-5, o-10, o-11 since.
    let orders_settled = all_settled(&gateway, "orders", 10).await;
    assert_eq!(
        (
            orders_settled.delivered_total,
            orders_settled.expired_total,
            orders_settled.consumption_records
        ),
        (15, 1, 1)
    );

    // The ordered subscription: acct-2's transaction, finished, goes out; acct-1's second
    // event waits until its first, leased before the upgrade, is acked.
    let before = subscription_stats(&gateway, "ledger").await;
    assert_eq!(
        (before.pending, before.in_flight, before.late_transactions),
        (2, 1, 1),
        "acct-2 and acct-1's second pending, acct-1's first in flight"
    );
    let mut ledger = Consumer::open(&gateway, "ledger", 10).await;
    let late = ledger.take(1, WAIT).await.remove(0);
    assert_eq!((aggregate_of(&late).as_str(), late.attempt), ("acct-2", 1));
    let taken = subscription_stats(&gateway, "ledger").await;
    assert_eq!((taken.pending, taken.in_flight), (1, 2));
    let first_of_acct_1 = position_of(&pool, "acct-1", Some(1)).await;
    ack_all(
        &gateway,
        "ledger",
        vec![ack_id_of(first_of_acct_1, 1, LEDGER_TOKEN)],
    )
    .await;
    let second = ledger.take(1, WAIT).await.remove(0);
    let second_event = second.event.as_ref().expect("event");
    assert_eq!(
        (
            second_event.aggregate_id.as_str(),
            second_event.aggregate_version,
            second.attempt
        ),
        ("acct-1", Some(2), 1)
    );
    ack_all(&gateway, "ledger", vec![late.ack_id, second.ack_id]).await;
    all_settled(&gateway, "ledger", 3).await;

    // The paused subscription holds inv-1 until resumed; inv-0 is before its start.
    let skipped = gateway
        .admin()
        .await
        .get_event(proto::GetEventRequest {
            id: id_of(&pool, "inv-0").await,
            ..Default::default()
        })
        .await
        .expect("get inv-0")
        .into_inner()
        .subscriptions
        .into_iter()
        .find(|on| on.subscription == "invoices")
        .expect("inv-0 on invoices");
    assert_eq!(skipped.state(), proto::DeliveryState::Skipped);
    assert_eq!(subscription_stats(&gateway, "invoices").await.pending, 1);
    gateway
        .admin()
        .await
        .resume_subscription(proto::ResumeSubscriptionRequest {
            name: "invoices".into(),
        })
        .await
        .expect("resume");
    let mut invoice_consumer = Consumer::open(&gateway, "invoices", 10).await;
    let invoice = invoice_consumer.take(1, WAIT).await.remove(0);
    assert_eq!(
        (aggregate_of(&invoice).as_str(), invoice.attempt),
        ("inv-1", 1)
    );
    ack_all(&gateway, "invoices", vec![invoice.ack_id]).await;
    all_settled(&gateway, "invoices", 1).await;

    // The filter passes over o-10 and lets o-11 through.
    let mut big_consumer = Consumer::open(&gateway, "big-orders", 10).await;
    let big = big_consumer.take(1, WAIT).await.remove(0);
    assert_eq!(aggregate_of(&big), "o-11");
    ack_all(&gateway, "big-orders", vec![big.ack_id]).await;
    let big_settled = all_settled(&gateway, "big-orders", 1).await;
    assert_eq!(
        (big_settled.delivered_total, big_settled.filtered_total),
        (1, 3)
    );

    // The dead gateway's record of its streams goes once this one records its own.
    eventually("the dead gateway's stream record is gone", WAIT, || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM outbox_subscription_streams \
             WHERE seen_at < now() - interval '30 minutes'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
            == 0
    })
    .await;
}
