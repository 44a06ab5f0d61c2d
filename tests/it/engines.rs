//! Engines at start (docs/engines.md): a server the relay cannot serve is refused before
//! anything is written, with one message naming the problem and the fix — a hot standby,
//! a pooler in transaction mode — while PgBouncer in session mode serves as a direct
//! connection does, LISTEN/NOTIFY included.

use std::{process::Stdio, str::FromStr, time::Duration};

use crate::common::*;
use outbox_testkit::{PoolMode, Pooler, PostgresServer};
use sqlx::postgres::PgConnectOptions;
use tokio::process::Command;

/// Runs `serve` on `database_url` and returns what it wrote to standard error, failing
/// the test unless it exits with a failure within a minute.
async fn refused_start(database_url: &str) -> String {
    let output = tokio::time::timeout(
        Duration::from_secs(60),
        Command::new(env!("CARGO_BIN_EXE_outbox-gateway"))
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--console-listen",
                "off",
                "--metrics-listen",
                "off",
                "--database-url",
                database_url,
            ])
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the gateway gives up within a minute")
    .expect("run the gateway binary");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        !output.status.success(),
        "the gateway started on {database_url}:\n{stderr}"
    );
    stderr
}

/// The test server's port, for a pooler in front of it.
fn test_server_port() -> u16 {
    PgConnectOptions::from_str(&outbox_testkit::test_server_url())
        .expect("the test server's URL")
        .get_port()
}

async fn pooler(mode: PoolMode) -> Pooler {
    let port = test_server_port();
    tokio::task::spawn_blocking(move || Pooler::start(port, mode))
        .await
        .expect("start PgBouncer")
        .expect("PgBouncer runs (Debian's pgbouncer package)")
}

#[tokio::test]
async fn a_hot_standby_is_refused_pointing_at_the_primary() {
    let primary = tokio::task::spawn_blocking(PostgresServer::start)
        .await
        .unwrap()
        .expect("start a primary");
    // The gateway's database exists on the primary, so the standby has it too.
    let database = TestDatabase::create_on(&primary.url()).await;
    let (primary, standby) = tokio::task::spawn_blocking(move || {
        let standby = primary.start_standby();
        (primary, standby)
    })
    .await
    .unwrap();
    let standby = standby.expect("start a hot standby");
    for database_name in [database.name(), "not_created_yet"] {
        let message = refused_start(&format!("{}/{database_name}", standby.url())).await;
        for needle in [
            "cannot use PostgreSQL at",
            "the server is read-only (a hot standby or read replica)",
            "connect to the primary / writer endpoint",
        ] {
            assert!(message.contains(needle), "{needle:?} not in:\n{message}");
        }
        assert!(
            !message.contains("read-only transaction"),
            "refused by a failed write rather than at the check:\n{message}"
        );
    }
    // Nothing was installed on the primary either.
    let installed: Option<String> = sqlx::query_scalar("SELECT to_regclass('outbox_events')::text")
        .fetch_one(&database.pool().await)
        .await
        .unwrap();
    assert_eq!(installed, None);
    drop(primary);
}

#[tokio::test]
async fn a_pooler_in_transaction_mode_is_refused_suggesting_session_pooling() {
    let database = TestDatabase::create().await;
    let pooler = pooler(PoolMode::Transaction).await;
    let message = refused_start(&format!("{}/{}", pooler.url(), database.name())).await;
    for needle in [
        "a pooler in transaction or statement mode",
        "LISTEN/NOTIFY does not round-trip",
        "connect directly, or use session pooling",
    ] {
        assert!(message.contains(needle), "{needle:?} not in:\n{message}");
    }
    let installed: Option<String> = sqlx::query_scalar("SELECT to_regclass('outbox_events')::text")
        .fetch_one(&database.pool().await)
        .await
        .unwrap();
    assert_eq!(installed, None, "the refused gateway migrated the database");
}

#[tokio::test]
async fn through_a_session_pooler_the_gateway_serves_and_hears_direct_inserts() {
    let database = TestDatabase::create().await;
    let pooler = pooler(PoolMode::Session).await;
    let mut config = test_config(format!("{}/{}", pooler.url(), database.name()));
    // Only a notification can wake the relay within the test's wait.
    config.delivery.poll_interval = Duration::from_secs(600);
    let gateway = TestGateway::start_with(&database, config).await;
    create_subscription(&gateway, subscription("through-pooler")).await;
    let mut consumer = Consumer::open(&gateway, "through-pooler", 10).await;
    // A service's own transaction, straight to the database: its NOTIFY reaches the
    // gateway's LISTEN through the pooler.
    sqlx::query(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('order', 'o-1', 'order.created', '{}')",
    )
    .execute(&database.pool().await)
    .await
    .unwrap();
    let delivery = consumer
        .next(Duration::from_secs(30))
        .await
        .expect("the direct insert is delivered without waiting for a poll");
    let inserted = delivery.event.expect("an event");
    assert_eq!(inserted.aggregate_id, "o-1");
    let stale = ack(&gateway, "through-pooler", vec![delivery.ack_id]).await;
    assert!(stale.is_empty(), "the ack did not take: {stale:?}");
    // Published through the API, too.
    let ids = publish_ids(&gateway, vec![event("o-2", "order.created")]).await;
    let next = consumer
        .next(Duration::from_secs(30))
        .await
        .expect("the published event is delivered");
    assert_eq!(next.event.expect("an event").id, ids[0]);
    gateway.stop().await.expect("a clean stop");
}

#[tokio::test]
async fn a_source_behind_a_transaction_pooler_stops_the_start_naming_the_source() {
    let database = TestDatabase::create().await;
    let service = TestDatabase::create().await;
    let pooler = pooler(PoolMode::Transaction).await;
    let mut config = test_config(database.url());
    let mut source = source_config("orders", &service);
    source.database_url = format!("{}/{}", pooler.url(), service.name());
    config.sources = vec![source];
    let error = TestGateway::spawn(&database, config)
        .await
        .stop()
        .await
        .expect_err("the start is refused")
        .to_string();
    assert!(
        error.contains("source \"orders\"") && error.contains("use session pooling"),
        "{error}"
    );
}
