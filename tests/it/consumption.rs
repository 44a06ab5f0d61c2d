//! Exactly-once consumption: a consumer records what it consumed with `outbox_consume`
//! in its own transaction, in a database that is one of the gateway's sources, and the
//! gateway settles the delivery when that transaction commits.

use std::{sync::Arc, time::Duration};

use sqlx::{Connection, Executor, PgConnection, PgPool, Row};

use crate::common::*;
use outbox_gateway::{Config, proto};
use tonic_health::pb::health_check_response::ServingStatus;

const WAIT: Duration = Duration::from_secs(20);

/// The gateway's database, `orders` (a service publishing events) and `shipping` (the
/// consuming service's own database), all sources of one gateway.
struct Services {
    _default: Arc<TestDatabase>,
    orders: Arc<TestDatabase>,
    shipping: Arc<TestDatabase>,
    gateway: TestGateway,
}

impl Services {
    async fn start() -> Services {
        Self::start_with(|_| {}).await
    }

    async fn start_with(adjust: impl FnOnce(&mut Config)) -> Services {
        let (default, orders, shipping) = (
            TestDatabase::create().await,
            TestDatabase::create().await,
            TestDatabase::create().await,
        );
        let mut config = test_config(default.url());
        config.sources = vec![
            source_config("orders", &orders),
            source_config("shipping", &shipping),
        ];
        adjust(&mut config);
        let gateway = TestGateway::start_with(&default, config).await;
        // SERVING speaks for the default source only; subscriptions created before a
        // source is connected reach its consumers only at the next maintenance.
        for source in ["orders", "shipping"] {
            let service = format!("outbox.source.{source}");
            eventually(&format!("{service} serves"), WAIT, || async {
                gateway.health_of(&service).await == Some(ServingStatus::Serving)
            })
            .await;
        }
        let shipping_pool = shipping.pool().await;
        shipping_pool
            .execute("CREATE TABLE shipments (order_id text NOT NULL, event_id text NOT NULL)")
            .await
            .unwrap();
        Services {
            _default: default,
            orders,
            shipping,
            gateway,
        }
    }

    /// A subscription to the orders' events, with a long ack deadline: a delivery that
    /// settles did so because its consumption committed, not because its lease ran out.
    async fn subscribe_to_orders(&self, name: &str) {
        create_subscription(
            &self.gateway,
            proto::Subscription {
                sources: vec!["orders".into()],
                ack_deadline: seconds(120),
                ..subscription(name)
            },
        )
        .await;
    }

    async fn publish_orders(&self, ids: &[&str]) {
        self.gateway
            .publisher()
            .await
            .publish(proto::PublishRequest {
                events: ids.iter().map(|id| event(id, "order.created")).collect(),
                source: "orders".into(),
            })
            .await
            .expect("publish into orders");
    }
}

/// One consuming transaction in `connection`: records the delivery, and on the first
/// time inserts a shipment; commits. Whether it was the first time.
async fn consume_and_ship(
    connection: &mut PgConnection,
    subscription: &str,
    delivery: &proto::Delivery,
) -> Result<bool, sqlx::Error> {
    let mut transaction = connection.begin().await?;
    let first = consume(&mut transaction, subscription, &delivery.ack_id).await?;
    if first {
        let event = delivery.event.as_ref().unwrap();
        sqlx::query("INSERT INTO shipments (order_id, event_id) VALUES ($1, $2)")
            .bind(&event.aggregate_id)
            .bind(&event.id)
            .execute(&mut *transaction)
            .await?;
    }
    transaction.commit().await?;
    Ok(first)
}

async fn consume(
    connection: &mut PgConnection,
    subscription: &str,
    ack_id: &str,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT outbox_consume(subscription => $1, ack_id => $2)")
        .bind(subscription)
        .bind(ack_id)
        .fetch_one(connection)
        .await
}

/// The `application_name` of the second consumer's session, by which the tests find it
/// in `pg_stat_activity`.
const SECOND_CONSUMER: &str = "second-consumer";

/// A second consumer: `outbox_consume` of `ack_id` in a transaction of its own, in a
/// session named [`SECOND_CONSUMER`], which the task's answer reports once it is over.
fn consume_on_a_connection_of_its_own(url: &str, ack_id: &str) -> tokio::task::JoinHandle<bool> {
    let options = url
        .parse::<sqlx::postgres::PgConnectOptions>()
        .unwrap()
        .application_name(SECOND_CONSUMER);
    let ack_id = ack_id.to_owned();
    tokio::spawn(async move {
        let mut connection = PgConnection::connect_with(&options).await.unwrap();
        consume(&mut connection, "shipping", &ack_id).await.unwrap()
    })
}

/// Waits until the second consumer's session waits for a lock (the first consumer's
/// record of the same event, not committed yet): the race is then set, whatever the
/// machine's speed.
async fn second_consumer_waits_for_a_lock(database: &TestDatabase) {
    let pool = database.pool().await;
    eventually(
        "the second consumer waits for the first one's lock",
        WAIT,
        || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT FROM pg_stat_activity \
                 WHERE datname = $1 AND application_name = $2 AND wait_event_type = 'Lock')",
            )
            .bind(database.name())
            .bind(SECOND_CONSUMER)
            .fetch_one(&pool)
            .await
            .unwrap()
        },
    )
    .await;
}

async fn shipments(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT order_id FROM shipments ORDER BY order_id")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Waits until nothing of the subscription is pending, in flight or awaiting retry,
/// and `acked` deliveries were acked in all; its stats then.
async fn settled(
    gateway: &TestGateway,
    subscription: &str,
    acked: u64,
) -> proto::SubscriptionStats {
    eventually("the consumed deliveries are settled", WAIT, || async {
        let stats = subscription_stats(gateway, subscription).await;
        stats.pending == 0
            && stats.in_flight == 0
            && stats.awaiting_retry == 0
            && stats.acked_total == acked
    })
    .await;
    subscription_stats(gateway, subscription).await
}

#[tokio::test]
async fn a_committed_consumption_settles_its_delivery_without_an_ack() {
    let services = Services::start().await;
    services.subscribe_to_orders("shipping").await;
    services.publish_orders(&["o-1", "o-2", "o-3"]).await;

    let mut consumer = Consumer::open(&services.gateway, "shipping", 10).await;
    let deliveries = consumer.take(3, WAIT).await;
    let mut connection = PgConnection::connect(&services.shipping.url())
        .await
        .unwrap();
    for delivery in &deliveries {
        assert!(
            consume_and_ship(&mut connection, "shipping", delivery)
                .await
                .unwrap()
        );
        // The same delivery again, as after a crash between commit and anything else.
        assert!(
            !consume_and_ship(&mut connection, "shipping", delivery)
                .await
                .unwrap()
        );
    }

    let stats = settled(&services.gateway, "shipping", 3).await;
    assert_eq!(stats.consumption_records, 3);
    assert_eq!(
        shipments(&services.shipping.pool().await).await,
        ["o-1", "o-2", "o-3"]
    );
    // Nothing comes again, and acking as well is harmless: the leases are settled.
    assert!(consumer.next(Duration::from_millis(500)).await.is_none());
    let stale = ack_deliveries(&services.gateway, "shipping", &deliveries).await;
    assert_eq!(stale.len(), 3);
}

#[tokio::test]
async fn a_rolled_back_consumption_records_nothing_and_the_lease_runs_on() {
    let services = Services::start().await;
    services.subscribe_to_orders("shipping").await;
    services.publish_orders(&["o-1", "o-2"]).await;
    let mut consumer = Consumer::open(&services.gateway, "shipping", 10).await;
    let deliveries = consumer.take(2, WAIT).await;
    let (rolled_back, committed) = match aggregate_of(&deliveries[0]).as_str() {
        "o-1" => (&deliveries[0], &deliveries[1]),
        _ => (&deliveries[1], &deliveries[0]),
    };

    let mut connection = PgConnection::connect(&services.shipping.url())
        .await
        .unwrap();
    let mut transaction = connection.begin().await.unwrap();
    assert!(
        consume(&mut transaction, "shipping", &rolled_back.ack_id)
            .await
            .unwrap()
    );
    transaction.rollback().await.unwrap();

    // A consumption committed after the rollback: once the gateway has settled it, it
    // has read the queue of consumed acks since the rollback, and the rolled-back one
    // is still in flight, on its lease: the consumer can nack it.
    assert!(
        consume_and_ship(&mut connection, "shipping", committed)
            .await
            .unwrap()
    );
    eventually("the committed consumption is settled", WAIT, || async {
        subscription_stats(&services.gateway, "shipping")
            .await
            .acked_total
            >= 1
    })
    .await;
    let stats = subscription_stats(&services.gateway, "shipping").await;
    assert_eq!((stats.in_flight, stats.acked_total), (1, 1));
    assert_eq!(stats.consumption_records, 1);
    nack(
        &services.gateway,
        proto::NackRequest {
            subscription: "shipping".into(),
            ack_id: rolled_back.ack_id.clone(),
            ..Default::default()
        },
    )
    .await;

    let again = consumer.take(1, WAIT).await.remove(0);
    assert_eq!((aggregate_of(&again).as_str(), again.attempt), ("o-1", 2));
    assert!(
        consume_and_ship(&mut connection, "shipping", &again)
            .await
            .unwrap()
    );
    settled(&services.gateway, "shipping", 2).await;
    assert_eq!(
        shipments(&services.shipping.pool().await).await,
        ["o-1", "o-2"]
    );
}

#[tokio::test]
async fn of_two_racing_consumers_exactly_one_gets_true() {
    let services = Services::start().await;
    services.subscribe_to_orders("shipping").await;
    services.publish_orders(&["o-1", "o-2"]).await;
    let mut consumer = Consumer::open(&services.gateway, "shipping", 10).await;
    let deliveries = consumer.take(2, WAIT).await;
    let url = services.shipping.url();

    // The first commits: the second, blocked meanwhile, then gets false.
    let mut first = PgConnection::connect(&url).await.unwrap();
    let mut first_transaction = first.begin().await.unwrap();
    assert!(
        consume(&mut first_transaction, "shipping", &deliveries[0].ack_id)
            .await
            .unwrap()
    );
    let second = consume_on_a_connection_of_its_own(&url, &deliveries[0].ack_id);
    second_consumer_waits_for_a_lock(&services.shipping).await;
    assert!(!second.is_finished(), "the second call waits for the first");
    first_transaction.commit().await.unwrap();
    assert!(!second.await.unwrap());

    // The first rolls back: the second then records it.
    let mut first_transaction = first.begin().await.unwrap();
    assert!(
        consume(&mut first_transaction, "shipping", &deliveries[1].ack_id)
            .await
            .unwrap()
    );
    let second = consume_on_a_connection_of_its_own(&url, &deliveries[1].ack_id);
    second_consumer_waits_for_a_lock(&services.shipping).await;
    first_transaction.rollback().await.unwrap();
    assert!(second.await.unwrap());
    settled(&services.gateway, "shipping", 2).await;
}

#[tokio::test]
async fn under_repeatable_read_the_loser_of_a_race_gets_a_serialization_failure() {
    let services = Services::start().await;
    services.subscribe_to_orders("shipping").await;
    services.publish_orders(&["o-1"]).await;
    let mut consumer = Consumer::open(&services.gateway, "shipping", 10).await;
    let delivery = consumer.take(1, WAIT).await.remove(0);
    let url = services.shipping.url();

    let mut loser = PgConnection::connect(&url).await.unwrap();
    loser
        .execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .await
        .unwrap();
    // The snapshot is taken before the winner commits.
    loser.execute("SELECT 1").await.unwrap();
    let mut winner = PgConnection::connect(&url).await.unwrap();
    assert!(
        consume(&mut winner, "shipping", &delivery.ack_id)
            .await
            .unwrap()
    );
    let error = consume(&mut loser, "shipping", &delivery.ack_id)
        .await
        .expect_err("a serialization failure");
    assert_eq!(
        error.as_database_error().and_then(|e| e.code()).as_deref(),
        Some("40001"),
        "{error}"
    );
}

#[tokio::test]
async fn a_requeued_or_replayed_event_is_reported_consumed_until_forgotten() {
    let services = Services::start().await;
    services.subscribe_to_orders("shipping").await;
    services.publish_orders(&["o-1"]).await;
    let mut consumer = Consumer::open(&services.gateway, "shipping", 10).await;
    let mut connection = PgConnection::connect(&services.shipping.url())
        .await
        .unwrap();
    let delivery = consumer.take(1, WAIT).await.remove(0);
    let event_id = delivery.event.as_ref().unwrap().id.clone();
    assert!(
        consume_and_ship(&mut connection, "shipping", &delivery)
            .await
            .unwrap()
    );
    settled(&services.gateway, "shipping", 1).await;

    let requeue = |forget_consumption: bool| proto::RequeueEventRequest {
        id: event_id.clone(),
        subscription: "shipping".into(),
        forget_consumption,
        ..Default::default()
    };
    // Requeued: delivered again, found consumed, and settled all the same.
    let mut admin = services.gateway.admin().await;
    admin.requeue_event(requeue(false)).await.unwrap();
    let again = consumer.take(1, WAIT).await.remove(0);
    assert!(
        !consume_and_ship(&mut connection, "shipping", &again)
            .await
            .unwrap()
    );
    settled(&services.gateway, "shipping", 2).await;

    // Replayed from the start: the same.
    admin
        .seek_subscription(proto::SeekSubscriptionRequest {
            subscription: "shipping".into(),
            to: subscription("x").start,
        })
        .await
        .unwrap();
    let replayed = consumer.take(1, WAIT).await.remove(0);
    assert!(
        !consume_and_ship(&mut connection, "shipping", &replayed)
            .await
            .unwrap()
    );
    settled(&services.gateway, "shipping", 3).await;
    assert_eq!(shipments(&services.shipping.pool().await).await, ["o-1"]);

    // Requeued forgetting the record: consumed again, on purpose.
    admin.requeue_event(requeue(true)).await.unwrap();
    let rerun = consumer.take(1, WAIT).await.remove(0);
    assert!(
        consume_and_ship(&mut connection, "shipping", &rerun)
            .await
            .unwrap()
    );
    settled(&services.gateway, "shipping", 4).await;
    assert_eq!(
        shipments(&services.shipping.pool().await).await,
        ["o-1", "o-1"]
    );
}

#[tokio::test]
async fn bad_arguments_raise_errors_naming_them_and_record_nothing() {
    let services = Services::start().await;
    services.subscribe_to_orders("shipping").await;
    services.subscribe_to_orders("billing").await;
    services.publish_orders(&["o-1"]).await;
    let delivery = Consumer::open(&services.gateway, "shipping", 10)
        .await
        .take(1, WAIT)
        .await
        .remove(0);
    let ack_id = delivery.ack_id.as_str();
    let (unsealed, seal) = ack_id.rsplit_once('-').unwrap();
    let forged = format!("{unsealed}-{}", "0".repeat(seal.len()));
    let mut connection = PgConnection::connect(&services.shipping.url())
        .await
        .unwrap();

    let cases: [(Option<&str>, Option<&str>, &str); 7] = [
        (Some("nobody"), Some(ack_id), "subscription 'nobody'"),
        (None, Some(ack_id), "subscription must not be null"),
        (
            Some("shipping"),
            Some("not-an-ack-id"),
            "ack_id 'not-an-ack-id'",
        ),
        (Some("shipping"), None, "ack_id NULL"),
        (Some("shipping"), Some(unsealed), "ack_id"),
        (
            Some("shipping"),
            Some(&forged),
            "not issued for subscription 'shipping'",
        ),
        (
            Some("billing"),
            Some(ack_id),
            "not issued for subscription 'billing'",
        ),
    ];
    for (subscription, ack_id, expected) in cases {
        let error = sqlx::query_scalar::<_, bool>("SELECT outbox_consume($1, $2)")
            .bind(subscription)
            .bind(ack_id)
            .fetch_one(&mut connection)
            .await
            .expect_err(expected);
        let database_error = error.as_database_error().expect("a database error");
        assert_eq!(database_error.code().as_deref(), Some("22023"), "{error}");
        assert!(
            database_error.message().starts_with("outbox_consume: ")
                && database_error.message().contains(expected),
            "{expected:?} in {error}"
        );
    }

    // An ack id of a subscription deleted since.
    services
        .gateway
        .admin()
        .await
        .delete_subscription(proto::DeleteSubscriptionRequest {
            name: "shipping".into(),
        })
        .await
        .unwrap();
    let error = consume(&mut connection, "shipping", ack_id)
        .await
        .expect_err("deleted");
    assert!(
        error.to_string().contains("no such subscription"),
        "{error}"
    );

    let records: (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM outbox_consumptions), \
                (SELECT count(*) FROM outbox_consumed_acks)",
    )
    .fetch_one(&mut connection)
    .await
    .unwrap();
    assert_eq!(records, (0, 0));
}

/// A subscription deleted and created again under its name is another subscription: an
/// ack id of the first names a lease the second never granted, though of the same event
/// at the same attempt. The Ack RPC reports it stale, a nack and an extension are
/// refused, and `outbox_consume` refuses it as not issued for the subscription: none of
/// them settles or records anything of the second.
#[tokio::test]
async fn ack_ids_of_a_deleted_subscription_are_refused_by_its_namesake() {
    let services = Services::start().await;
    services.subscribe_to_orders("shipping").await;
    services.publish_orders(&["o-1"]).await;
    let old = Consumer::open(&services.gateway, "shipping", 10)
        .await
        .take(1, WAIT)
        .await
        .remove(0);
    services
        .gateway
        .admin()
        .await
        .delete_subscription(proto::DeleteSubscriptionRequest {
            name: "shipping".into(),
        })
        .await
        .unwrap();
    services.subscribe_to_orders("shipping").await;
    let mut consumer = Consumer::open(&services.gateway, "shipping", 10).await;
    let new = consumer.take(1, WAIT).await.remove(0);
    assert_eq!(new.event, old.event, "the same event, from the start again");
    assert_eq!((new.attempt, old.attempt), (1, 1));
    assert_ne!(new.ack_id, old.ack_id);

    let gateway = &services.gateway;
    assert_eq!(
        ack(gateway, "shipping", vec![old.ack_id.clone()]).await,
        std::slice::from_ref(&old.ack_id),
        "the Ack RPC reports the old ack id stale"
    );
    assert_eq!(
        extend(
            gateway,
            "shipping",
            vec![old.ack_id.clone()],
            Duration::from_secs(60)
        )
        .await,
        std::slice::from_ref(&old.ack_id)
    );
    let nacked = gateway
        .subscriber()
        .await
        .nack(proto::NackRequest {
            subscription: "shipping".into(),
            ack_id: old.ack_id.clone(),
            ..Default::default()
        })
        .await;
    assert_status(nacked, tonic::Code::FailedPrecondition, &old.ack_id);

    let mut connection = PgConnection::connect(&services.shipping.url())
        .await
        .unwrap();
    let error = consume(&mut connection, "shipping", &old.ack_id)
        .await
        .expect_err("an ack id of the deleted subscription");
    let database_error = error.as_database_error().expect("a database error");
    assert_eq!(database_error.code().as_deref(), Some("22023"), "{error}");
    assert!(
        database_error
            .message()
            .contains("not issued for subscription 'shipping'"),
        "{error}"
    );

    // Nothing of the new subscription moved: its delivery is in flight on its lease,
    // nothing is recorded or queued for settling.
    let stats = subscription_stats(gateway, "shipping").await;
    assert_eq!(
        (
            stats.in_flight,
            stats.acked_total,
            stats.consumption_records
        ),
        (1, 0, 0)
    );
    let recorded: (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM outbox_consumptions), \
                (SELECT count(*) FROM outbox_consumed_acks)",
    )
    .fetch_one(&mut connection)
    .await
    .unwrap();
    assert_eq!(recorded, (0, 0));

    // Its own ack id is taken.
    assert!(
        consume_and_ship(&mut connection, "shipping", &new)
            .await
            .unwrap()
    );
    let stats = settled(gateway, "shipping", 1).await;
    assert_eq!(stats.consumption_records, 1);
    assert_eq!(shipments(&services.shipping.pool().await).await, ["o-1"]);
}

/// The same, when the consumer's database could not be reached while the subscription was
/// deleted, so it still lists the deleted subscription when its namesake is created: the
/// creation replaces it there at once, rather than leaving it to the next maintenance
/// pass (which runs once here, at start, so that only the creation can do it).
#[tokio::test]
async fn ack_ids_of_a_deleted_subscription_are_refused_by_its_namesake_after_an_outage() {
    let proxy = crate::common::proxy::TcpProxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let services = Services::start_with(|config| {
        config.maintenance.interval = Duration::from_secs(3600);
        let shipping = &mut config.sources[1];
        let name = shipping.database_url.rsplit('/').next().unwrap().to_owned();
        shipping.database_url = proxy.database_url(&name);
    })
    .await;
    let gateway = &services.gateway;
    let shipping_serves = |expected: bool| async move {
        let what = format!("outbox.source.shipping serving is {expected}");
        eventually(&what, WAIT, || async {
            (gateway.health_of("outbox.source.shipping").await == Some(ServingStatus::Serving))
                == expected
        })
        .await;
    };
    services.subscribe_to_orders("shipping").await;
    services.publish_orders(&["o-1"]).await;
    let old = Consumer::open(gateway, "shipping", 10)
        .await
        .take(1, WAIT)
        .await
        .remove(0);

    proxy.cut();
    shipping_serves(false).await;
    gateway
        .admin()
        .await
        .delete_subscription(proto::DeleteSubscriptionRequest {
            name: "shipping".into(),
        })
        .await
        .unwrap();
    proxy.restore();
    shipping_serves(true).await;
    services.subscribe_to_orders("shipping").await;
    let mut consumer = Consumer::open(gateway, "shipping", 10).await;
    let new = consumer.take(1, WAIT).await.remove(0);

    let mut connection = PgConnection::connect(&services.shipping.url())
        .await
        .unwrap();
    let refused = consume(&mut connection, "shipping", &old.ack_id).await;
    assert!(
        refused
            .as_ref()
            .is_err_and(|error| error.to_string().contains("not issued for subscription")),
        "the old ack id: {refused:?}"
    );
    assert!(
        consume(&mut connection, "shipping", &new.ack_id)
            .await
            .unwrap(),
        "the new ack id"
    );
}

#[tokio::test]
async fn the_writer_role_consumes_without_rights_on_the_tables() {
    let services = Services::start().await;
    services.subscribe_to_orders("shipping").await;
    services.publish_orders(&["o-1"]).await;
    let delivery = Consumer::open(&services.gateway, "shipping", 10)
        .await
        .take(1, WAIT)
        .await
        .remove(0);

    let ack_id = delivery.ack_id.clone();
    as_writer(&services.shipping, |url| async move {
        let mut service = PgConnection::connect(&url).await.unwrap();
        assert!(consume(&mut service, "shipping", &ack_id).await.unwrap());
        assert_forbidden(
            &mut service,
            &[
                "SELECT * FROM outbox_consumptions",
                "SELECT * FROM outbox_consumed_acks",
                "SELECT * FROM outbox_consume_key",
                "SELECT * FROM outbox_consumer_subscriptions",
                "DELETE FROM outbox_consumptions",
            ],
        )
        .await;
    })
    .await;
    settled(&services.gateway, "shipping", 1).await;
}

#[tokio::test]
async fn consumption_records_go_once_their_events_are_gone() {
    let services = Services::start_with(|config| {
        config.maintenance.interval = Duration::from_millis(200);
        config.maintenance.retention = Duration::from_secs(1);
    })
    .await;
    services.subscribe_to_orders("shipping").await;
    services.publish_orders(&["o-1", "o-2"]).await;
    let mut consumer = Consumer::open(&services.gateway, "shipping", 10).await;
    let mut connection = PgConnection::connect(&services.shipping.url())
        .await
        .unwrap();
    for delivery in consumer.take(2, WAIT).await {
        assert!(
            consume_and_ship(&mut connection, "shipping", &delivery)
                .await
                .unwrap()
        );
    }
    settled(&services.gateway, "shipping", 2).await;

    let orders = services.orders.pool().await;
    eventually("the events and their records are gone", WAIT, || async {
        count_events(&orders).await == 0
            && subscription_stats(&services.gateway, "shipping")
                .await
                .consumption_records
                == 0
    })
    .await;
    let left: i64 = sqlx::query("SELECT count(*) AS n FROM outbox_consumptions")
        .fetch_one(&mut connection)
        .await
        .unwrap()
        .get("n");
    assert_eq!(left, 0);
}

/// What a consumer does with one delivery, chosen at random: a crash leaves its
/// transaction uncommitted or its stream closed before anything else happened.
#[derive(Clone, Copy)]
enum Fate {
    CrashBeforeCommit,
    CrashAfterCommit,
    Consume,
}

/// One consuming transaction of the chaos test: the record, a shipment row (no unique
/// constraint) and, for every third order, a reaction event published in the same
/// transaction; committed unless the fate is a crash before the commit.
async fn consume_with_reaction(
    connection: &mut PgConnection,
    delivery: &proto::Delivery,
    fate: Fate,
) -> Result<(), sqlx::Error> {
    let event = delivery.event.as_ref().unwrap();
    let mut transaction = connection.begin().await?;
    if consume(&mut transaction, "shipping", &delivery.ack_id).await? {
        sqlx::query("INSERT INTO shipments (order_id, event_id) VALUES ($1, $2)")
            .bind(&event.aggregate_id)
            .bind(&event.id)
            .execute(&mut *transaction)
            .await?;
        let number: u32 = event.aggregate_id[2..].parse().unwrap();
        if number.is_multiple_of(3) {
            sqlx::query("SELECT outbox_publish('shipment', $1, 'shipment.requested', '{}'::jsonb)")
                .bind(&event.aggregate_id)
                .execute(&mut *transaction)
                .await?;
        }
    }
    if matches!(fate, Fate::CrashBeforeCommit) {
        // Dropped with the connection: the server rolls it back.
        return Ok(());
    }
    transaction.commit().await
}

/// A consumer that crashes now and then: it reads the subscription from whichever
/// gateway process is current, consumes every delivery in a transaction and never acks.
/// Stops when `stop` is set.
async fn crashing_consumer(
    gateway: Arc<std::sync::Mutex<String>>,
    shipping_url: String,
    seed: u64,
    stop: Arc<std::sync::atomic::AtomicBool>,
) {
    use rand::{Rng, SeedableRng};
    let mut random = rand::rngs::StdRng::seed_from_u64(seed);
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let endpoint = gateway.lock().unwrap().clone();
        let Ok(mut subscriber) =
            outbox_gateway::proto::subscriber_client::SubscriberClient::connect(endpoint).await
        else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let Ok(mut connection) = PgConnection::connect(&shipping_url).await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let Ok(stream) = subscriber
            .subscribe(proto::SubscribeRequest {
                subscription: "shipping".into(),
                max_in_flight: 5,
                ..Default::default()
            })
            .await
        else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let mut stream = stream.into_inner();
        // Reads until a crash, a failure or the end of the gateway, then starts over.
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let delivery =
                match tokio::time::timeout(Duration::from_millis(500), stream.message()).await {
                    Err(_) => continue,
                    Ok(Ok(Some(delivery))) => delivery,
                    Ok(_) => break,
                };
            let fate = match random.random_range(0..20) {
                0 => Fate::CrashBeforeCommit,
                1 => Fate::CrashAfterCommit,
                _ => Fate::Consume,
            };
            let consumed = consume_with_reaction(&mut connection, &delivery, fate).await;
            if consumed.is_err() || !matches!(fate, Fate::Consume) {
                break;
            }
        }
    }
}

#[tokio::test]
async fn side_effects_happen_once_through_consumer_gateway_and_database_crashes() {
    const ORDERS: u32 = 300;
    let server = tokio::task::spawn_blocking(outbox_testkit::PostgresServer::start)
        .await
        .unwrap()
        .expect("a PostgreSQL server of its own");
    let default = TestDatabase::create_on(&server.url()).await;
    let orders = TestDatabase::create_on(&server.url()).await;
    let shipping = TestDatabase::create_on(&server.url()).await;
    let config_file = std::env::temp_dir().join(format!("{}-consumption.toml", default.name()));
    std::fs::write(
        &config_file,
        format!(
            "poll_interval = \"500ms\"\nmaintenance_interval = \"1s\"\n\
             [[sources]]\nname = \"orders\"\ndatabase_url = \"{}\"\n\
             [[sources]]\nname = \"shipping\"\ndatabase_url = \"{}\"\n",
            orders.url(),
            shipping.url()
        ),
    )
    .unwrap();
    let config_argument = config_file.to_str().unwrap().to_owned();
    let arguments = [
        "--config",
        config_argument.as_str(),
        "--metrics-listen",
        "off",
    ];
    let (mut first, _log, address, channel) = start_gateway_process(&default, &arguments).await;
    let mut admin = proto::admin_client::AdminClient::new(channel);
    admin
        .create_subscription(proto::CreateSubscriptionRequest {
            subscription: Some(proto::Subscription {
                sources: vec!["orders".into()],
                ack_deadline: seconds(3),
                ..subscription("shipping")
            }),
            validate_only: false,
        })
        .await
        .unwrap();
    let shipping_pool = shipping.pool().await;
    shipping_pool
        .execute("CREATE TABLE shipments (order_id text NOT NULL, event_id text NOT NULL)")
        .await
        .unwrap();

    let endpoint = Arc::new(std::sync::Mutex::new(format!("http://{address}")));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let consumers: Vec<_> = (0..2)
        .map(|seed| {
            tokio::spawn(crashing_consumer(
                endpoint.clone(),
                shipping.url(),
                seed,
                stop.clone(),
            ))
        })
        .collect();

    let orders_pool = orders.pool().await;
    let publish = |from: u32, to: u32| {
        let orders_pool = orders_pool.clone();
        async move {
            for number in from..to {
                sqlx::query("SELECT outbox_publish('order', $1, 'order.created', '{}'::jsonb)")
                    .bind(format!("o-{number:04}"))
                    .execute(&orders_pool)
                    .await
                    .unwrap();
            }
        }
    };
    let shipped = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(DISTINCT event_id) FROM shipments")
            .fetch_one(&shipping_pool)
            .await
            .unwrap_or_default()
    };

    // A third, then the gateway is killed mid-flow and another one takes over.
    publish(0, ORDERS / 3).await;
    eventually("a few orders are shipped", WAIT, || async {
        shipped().await >= 20
    })
    .await;
    first.kill().await.unwrap();
    let (_second, _log, address, _) = start_gateway_process(&default, &arguments).await;
    *endpoint.lock().unwrap() = format!("http://{address}");
    publish(ORDERS / 3, 2 * ORDERS / 3).await;

    // Then PostgreSQL restarts under everyone.
    eventually("more orders are shipped", WAIT * 3, || async {
        shipped().await >= i64::from(ORDERS / 3) + 20
    })
    .await;
    server.stop().expect("stop PostgreSQL");
    server.resume().expect("start PostgreSQL again");
    let orders_pool = orders.pool().await;
    for number in 2 * ORDERS / 3..ORDERS {
        sqlx::query("SELECT outbox_publish('order', $1, 'order.created', '{}'::jsonb)")
            .bind(format!("o-{number:04}"))
            .execute(&orders_pool)
            .await
            .unwrap();
    }

    let shipping_pool = shipping.pool().await;
    let current = endpoint.lock().unwrap().clone();
    let admin = proto::admin_client::AdminClient::connect(current)
        .await
        .unwrap();
    eventually("every order is consumed and settled", WAIT * 6, || {
        let (shipping_pool, mut admin) = (&shipping_pool, admin.clone());
        async move {
            let shipped: i64 = sqlx::query_scalar("SELECT count(DISTINCT event_id) FROM shipments")
                .fetch_one(shipping_pool)
                .await
                .unwrap_or_default();
            let Ok(stats) = admin
                .get_stats(proto::GetStatsRequest {
                    subscription: "shipping".into(),
                })
                .await
            else {
                return false;
            };
            let stats = &stats.get_ref().subscriptions[0];
            shipped == i64::from(ORDERS)
                && stats.pending == 0
                && stats.in_flight == 0
                && stats.awaiting_retry == 0
        }
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for consumer in consumers {
        consumer.await.unwrap();
    }

    // Exactly one shipment per order, and one reaction event per third order.
    let duplicated: Vec<String> =
        sqlx::query_scalar("SELECT order_id FROM shipments GROUP BY order_id HAVING count(*) > 1")
            .fetch_all(&shipping_pool)
            .await
            .unwrap();
    assert_eq!(duplicated, Vec::<String>::new(), "shipped more than once");
    let shipments: i64 = sqlx::query_scalar("SELECT count(*) FROM shipments")
        .fetch_one(&shipping_pool)
        .await
        .unwrap();
    assert_eq!(shipments, i64::from(ORDERS));
    let reactions: Vec<(String, i64)> = sqlx::query_as(
        "SELECT aggregate_id, count(*) FROM outbox_events \
         WHERE event_type = 'shipment.requested' GROUP BY aggregate_id ORDER BY 1",
    )
    .fetch_all(&shipping_pool)
    .await
    .unwrap();
    let expected: Vec<(String, i64)> = (0..ORDERS)
        .filter(|number| number.is_multiple_of(3))
        .map(|number| (format!("o-{number:04}"), 1))
        .collect();
    assert_eq!(reactions, expected);
    let _ = std::fs::remove_file(&config_file);
}
