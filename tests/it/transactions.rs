//! Every transaction the gateway opens is ended on every path — a conflict, a statement
//! the database refuses, a call cut short by its deadline or by the client going away,
//! a connection lost mid-transaction — before its connection is used again or given
//! back. A gateway connection left idle in a transaction would hold the read horizon,
//! and with it delivery, back for the whole cluster.

use std::time::Duration;

use crate::common::{
    Consumer, TestDatabase, TestGateway, assert_status, create_subscription, event,
    proxy::TcpProxy, publish, subscription, test_config,
};
use outbox_gateway::proto;
use sqlx::PgPool;
use tonic::Code;

/// Gateway sessions of this database that sit inside a transaction without running a
/// statement, and have done so for longer than `for_longer_than` (between two
/// statements of a healthy transaction a session is idle only for a moment).
async fn idle_in_transaction(
    pool: &PgPool,
    database: &str,
    for_longer_than: Duration,
) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT coalesce(query, '') FROM pg_stat_activity \
         WHERE datname = $1 AND application_name = $2 \
           AND state LIKE 'idle in transaction%' \
           AND clock_timestamp() - state_change >= make_interval(secs => $3)",
    )
    .bind(database)
    .bind(outbox_testkit::GATEWAY_APPLICATION)
    .bind(for_longer_than.as_secs_f64())
    .fetch_all(pool)
    .await
    .expect("read pg_stat_activity")
}

/// Checks that no gateway session of the database is left idle in a transaction; the
/// bounds are far below the guard timeout the tests configure, so only the gateway's own
/// rollback can make this pass.
///
/// A single clean look proves little: the gateway's statement may still be running and
/// leave its transaction open a moment later. So after the first clean look, the check
/// holds for a window, failing on any session that stays idle in a transaction.
async fn assert_no_open_transaction(pool: &PgPool, database: &TestDatabase) {
    const WINDOW: Duration = Duration::from_secs(2);
    const LINGERING: Duration = Duration::from_millis(250);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let open = idle_in_transaction(pool, database.name(), Duration::ZERO).await;
        if open.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "gateway sessions left idle in a transaction after: {open:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let window_ends = tokio::time::Instant::now() + WINDOW;
    while tokio::time::Instant::now() < window_ends {
        let open = idle_in_transaction(pool, database.name(), LINGERING).await;
        assert!(
            open.is_empty(),
            "gateway sessions stayed idle in a transaction for {LINGERING:?} after: {open:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A gateway whose guard would end an abandoned transaction only after a minute.
async fn gateway(database: &std::sync::Arc<TestDatabase>, database_url: String) -> TestGateway {
    let mut config = test_config(database_url);
    config.db_idle_in_transaction_timeout = Duration::from_secs(60);
    TestGateway::start_with(database, config).await
}

/// Events written by a direct SQL writer still reach a subscriber: nothing holds the
/// relay back.
async fn assert_delivery_flows(gateway: &TestGateway, pool: &PgPool, name: &str) {
    // After a lost connection, a pooled connection that died with it fails its next
    // statement once (UNAVAILABLE, which clients retry) before the pool replaces it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let stream = loop {
        let opened = gateway
            .subscriber()
            .await
            .subscribe(proto::SubscribeRequest {
                subscription: name.into(),
                max_in_flight: 10,
                ..Default::default()
            })
            .await;
        match opened {
            Ok(stream) => break stream.into_inner(),
            Err(status) if status.code() == Code::Unavailable => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "Subscribe stays unavailable: {status:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(status) => panic!("subscribe: {status:?}"),
        }
    };
    let mut consumer = Consumer::from_stream(stream);
    let id: uuid::Uuid =
        sqlx::query_scalar("SELECT outbox_publish('probe', 'p-1', 'probe.sent', '{}'::jsonb)")
            .fetch_one(pool)
            .await
            .expect("direct publish");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let delivery = consumer
            .next(Duration::from_secs(10))
            .await
            .expect("the probe event is delivered");
        if delivery.event.as_ref().expect("event").id == id.to_string() {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "probe not delivered"
        );
    }
}

fn with_id(mut input: proto::EventInput, id: &str) -> proto::EventInput {
    input.id = id.into();
    input
}

#[tokio::test]
async fn a_conflicting_republish_ends_its_transaction() {
    let database = TestDatabase::create().await;
    let gateway = gateway(&database, database.url()).await;
    let pool = database.pool().await;
    create_subscription(&gateway, subscription("all")).await;
    let id = uuid::Uuid::now_v7().to_string();
    publish(&gateway, vec![with_id(event("o-1", "order.created"), &id)]).await;

    let refused = gateway
        .publisher()
        .await
        .publish(proto::PublishRequest {
            events: vec![with_id(event("o-2", "order.created"), &id)],
            ..Default::default()
        })
        .await;
    assert_status(refused, Code::AlreadyExists, &id);
    // The refusal is answered after the rollback: nothing may be open even for a moment.
    assert_eq!(
        idle_in_transaction(&pool, database.name(), Duration::ZERO).await,
        Vec::<String>::new()
    );
    assert_no_open_transaction(&pool, &database).await;
    assert_delivery_flows(&gateway, &pool, "all").await;
}

#[tokio::test]
async fn a_statement_the_database_refuses_ends_its_transaction() {
    let database = TestDatabase::create().await;
    let gateway = gateway(&database, database.url()).await;
    let pool = database.pool().await;
    create_subscription(&gateway, subscription("all")).await;
    // A rule of the database the gateway does not know about.
    sqlx::query(
        "ALTER TABLE outbox_events ADD CONSTRAINT no_forbidden CHECK (aggregate_id <> 'forbidden')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let existing = uuid::Uuid::now_v7().to_string();
    publish(
        &gateway,
        vec![with_id(event("o-1", "order.created"), &existing)],
    )
    .await;

    // The stored id sends the batch down the transactional path, where the new event
    // is refused by the constraint.
    let refused = gateway
        .publisher()
        .await
        .publish(proto::PublishRequest {
            events: vec![
                with_id(event("o-1", "order.created"), &existing),
                event("forbidden", "order.created"),
            ],
            ..Default::default()
        })
        .await;
    assert_status(refused, Code::InvalidArgument, "no_forbidden");
    assert_no_open_transaction(&pool, &database).await;
    assert_eq!(
        crate::common::count_events(&pool).await,
        1,
        "nothing was written"
    );
    assert_delivery_flows(&gateway, &pool, "all").await;
}

/// A Publish whose transactional insert waits for a producer's open transaction that
/// writes the same id.
struct BlockedPublish {
    producer: sqlx::Transaction<'static, sqlx::Postgres>,
    request: proto::PublishRequest,
}

async fn blocked_publish(gateway: &TestGateway, pool: &PgPool) -> BlockedPublish {
    let existing = uuid::Uuid::now_v7().to_string();
    publish(
        gateway,
        vec![with_id(event("o-1", "order.created"), &existing)],
    )
    .await;
    let contested = uuid::Uuid::now_v7();
    let mut producer = pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ($1, 'order', 'o-2', 'order.created', '{\"aggregate\":\"o-2\"}')",
    )
    .bind(contested)
    .execute(&mut *producer)
    .await
    .unwrap();
    BlockedPublish {
        producer,
        request: proto::PublishRequest {
            events: vec![
                with_id(event("o-1", "order.created"), &existing),
                with_id(event("o-2", "order.created"), &contested.to_string()),
            ],
            ..Default::default()
        },
    }
}

/// The call ended at its deadline: on the server's clock (DEADLINE_EXCEEDED) or on the
/// client's, which gives up at the same moment (CANCELLED).
#[track_caller]
fn assert_cut_short<T: std::fmt::Debug>(answer: Result<T, tonic::Status>) {
    let code = answer.expect_err("the call cannot finish in time").code();
    assert!(
        matches!(code, Code::DeadlineExceeded | Code::Cancelled),
        "{code:?}"
    );
}

/// Waits until a gateway session of the database waits for a lock.
async fn wait_for_lock_wait(pool: &PgPool, database: &TestDatabase) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 \
             AND application_name = $2 AND wait_event_type = 'Lock'",
        )
        .bind(database.name())
        .bind(outbox_testkit::GATEWAY_APPLICATION)
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no gateway statement started waiting"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_publish_past_its_deadline_ends_its_transaction() {
    let database = TestDatabase::create().await;
    let gateway = gateway(&database, database.url()).await;
    let pool = database.pool().await;
    create_subscription(&gateway, subscription("all")).await;
    let blocked = blocked_publish(&gateway, &pool).await;

    let mut request = tonic::Request::new(blocked.request);
    request.set_timeout(Duration::from_millis(300));
    let answer = gateway.publisher().await.publish(request).await;
    assert_cut_short(answer);
    wait_for_lock_wait(&pool, &database).await;
    blocked.producer.rollback().await.unwrap();

    assert_no_open_transaction(&pool, &database).await;
    assert_delivery_flows(&gateway, &pool, "all").await;
}

#[tokio::test]
async fn a_publish_whose_client_went_away_ends_its_transaction() {
    let database = TestDatabase::create().await;
    let gateway = gateway(&database, database.url()).await;
    let pool = database.pool().await;
    create_subscription(&gateway, subscription("all")).await;
    let blocked = blocked_publish(&gateway, &pool).await;

    let mut publisher = gateway.publisher().await;
    let call = tokio::spawn(async move { publisher.publish(blocked.request).await });
    wait_for_lock_wait(&pool, &database).await;
    call.abort();
    let _ = call.await;
    // The producer commits the same event: the gateway's insert then finds it stored.
    blocked.producer.commit().await.unwrap();

    assert_no_open_transaction(&pool, &database).await;
    assert_delivery_flows(&gateway, &pool, "all").await;
}

#[tokio::test]
async fn a_publish_that_loses_its_connection_mid_transaction_recovers() {
    let database = TestDatabase::create().await;
    let proxy = TcpProxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let gateway = gateway(&database, proxy.database_url(database.name())).await;
    let pool = database.pool().await;
    create_subscription(&gateway, subscription("all")).await;
    let blocked = blocked_publish(&gateway, &pool).await;

    let mut publisher = gateway.publisher().await;
    let call = tokio::spawn(async move { publisher.publish(blocked.request).await });
    wait_for_lock_wait(&pool, &database).await;
    proxy.cut();
    let answer = call.await.unwrap();
    assert_eq!(answer.unwrap_err().code(), Code::Unavailable);
    blocked.producer.rollback().await.unwrap();
    proxy.restore();

    // The next publish works on a fresh connection, and nothing is left open.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let result = gateway
            .publisher()
            .await
            .publish(proto::PublishRequest {
                events: vec![event("o-3", "order.created")],
                ..Default::default()
            })
            .await;
        if result.is_ok() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "publish never recovered: {result:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_no_open_transaction(&pool, &database).await;
    assert_delivery_flows(&gateway, &pool, "all").await;
}

/// An Ack on an ordered subscription runs in a transaction that first takes the
/// subscription's lock; a test session holding that lock keeps it waiting.
async fn blocked_ordered_ack(
    gateway: &TestGateway,
    pool: &PgPool,
) -> (
    sqlx::pool::PoolConnection<sqlx::Postgres>,
    Consumer,
    proto::AckRequest,
) {
    let mut ordered = subscription("ordered");
    ordered.ordered = true;
    create_subscription(gateway, ordered).await;
    publish(gateway, vec![event("o-1", "order.created")]).await;
    let mut consumer = Consumer::open(gateway, "ordered", 10).await;
    let delivery = consumer.take(1, Duration::from_secs(10)).await.remove(0);
    let mut locker = pool.acquire().await.unwrap();
    sqlx::query(
        "SELECT pg_advisory_lock(x'6f627801'::int, id::int) FROM outbox_subscriptions \
         WHERE name = 'ordered'",
    )
    .execute(&mut *locker)
    .await
    .unwrap();
    // The caller keeps the stream open so the lease stays valid.
    (
        locker,
        consumer,
        proto::AckRequest {
            subscription: "ordered".into(),
            ack_ids: vec![delivery.ack_id],
        },
    )
}

#[tokio::test]
async fn an_ack_past_its_deadline_ends_its_transaction() {
    let database = TestDatabase::create().await;
    let gateway = gateway(&database, database.url()).await;
    let pool = database.pool().await;
    let (mut locker, _consumer, ack) = blocked_ordered_ack(&gateway, &pool).await;

    let mut request = tonic::Request::new(ack);
    request.set_timeout(Duration::from_millis(300));
    let answer = gateway.subscriber().await.ack(request).await;
    assert_cut_short(answer);
    sqlx::query("SELECT pg_advisory_unlock_all()")
        .execute(&mut *locker)
        .await
        .unwrap();

    assert_no_open_transaction(&pool, &database).await;
    create_subscription(&gateway, subscription("all")).await;
    assert_delivery_flows(&gateway, &pool, "all").await;
}

#[tokio::test]
async fn an_ack_whose_client_went_away_ends_its_transaction() {
    let database = TestDatabase::create().await;
    let gateway = gateway(&database, database.url()).await;
    let pool = database.pool().await;
    let (mut locker, _consumer, ack) = blocked_ordered_ack(&gateway, &pool).await;

    let mut subscriber = gateway.subscriber().await;
    let call = tokio::spawn(async move { subscriber.ack(ack).await });
    wait_for_advisory_wait(&pool, &database).await;
    call.abort();
    let _ = call.await;
    sqlx::query("SELECT pg_advisory_unlock_all()")
        .execute(&mut *locker)
        .await
        .unwrap();

    assert_no_open_transaction(&pool, &database).await;
    create_subscription(&gateway, subscription("all")).await;
    assert_delivery_flows(&gateway, &pool, "all").await;
}

/// Waits until a gateway session waits for an advisory lock.
async fn wait_for_advisory_wait(pool: &PgPool, database: &TestDatabase) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 \
             AND application_name = $2 AND wait_event = 'advisory'",
        )
        .bind(database.name())
        .bind(outbox_testkit::GATEWAY_APPLICATION)
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the ack never waited for the lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
