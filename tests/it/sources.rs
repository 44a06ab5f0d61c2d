//! Several source databases: every service's own database is relayed from, events know
//! their source, subscriptions span sources, acks mix them, operations take a source, and
//! a source that is down pauses only its own share.

use std::{collections::BTreeSet, sync::Arc, time::Duration};

use crate::common::*;
use outbox_gateway::{Config, config::SourceConfig, proto};
use outbox_testkit::PostgresServer;
use tonic::Code;

const WAIT: Duration = Duration::from_secs(15);
const QUIET: Duration = Duration::from_millis(500);

fn config_with(default: &TestDatabase, sources: Vec<SourceConfig>) -> Config {
    let mut config = test_config(default.url());
    config.sources = sources;
    config
}

/// The gateway's database and two services' databases on the local server.
struct ThreeSources {
    default: Arc<TestDatabase>,
    orders: Arc<TestDatabase>,
    billing: Arc<TestDatabase>,
    gateway: TestGateway,
}

impl ThreeSources {
    async fn start() -> ThreeSources {
        let (default, orders, billing) = (
            TestDatabase::create().await,
            TestDatabase::create().await,
            TestDatabase::create().await,
        );
        let config = config_with(
            &default,
            vec![
                source_config("orders", &orders),
                source_config("billing", &billing),
            ],
        );
        let gateway = TestGateway::start_with(&default, config).await;
        ThreeSources {
            default,
            orders,
            billing,
            gateway,
        }
    }
}

/// A gateway over `default` and `remote`, a database on a second PostgreSQL server that
/// a test can stop and start. Take it apart binding every field in this order: the
/// gateway is then dropped first and the server last.
struct RemoteSource {
    server: PostgresServer,
    _databases: [Arc<TestDatabase>; 2],
    gateway: TestGateway,
}

impl RemoteSource {
    /// Starts it; the gateway's connection attempts wait at most `acquire_timeout`.
    async fn start(acquire_timeout: Duration) -> RemoteSource {
        Self::start_with(acquire_timeout, |_| {}).await
    }

    /// [`RemoteSource::start`], with the gateway's configuration changed by `adjust`.
    async fn start_with(
        acquire_timeout: Duration,
        adjust: impl FnOnce(&mut Config),
    ) -> RemoteSource {
        let server = tokio::task::spawn_blocking(PostgresServer::start)
            .await
            .unwrap()
            .expect("a second PostgreSQL server");
        let default = TestDatabase::create().await;
        let remote = TestDatabase::create_on(&server.url()).await;
        let mut config = config_with(&default, vec![source_config("remote", &remote)]);
        config.db_acquire_timeout = acquire_timeout;
        adjust(&mut config);
        let gateway = TestGateway::start_with(&default, config).await;
        RemoteSource {
            server,
            _databases: [default, remote],
            gateway,
        }
    }
}

async fn publish_to(
    gateway: &TestGateway,
    source: &str,
    aggregate_id: &str,
    event_type: &str,
) -> String {
    gateway
        .publisher()
        .await
        .publish(proto::PublishRequest {
            events: vec![event(aggregate_id, event_type)],
            source: source.into(),
        })
        .await
        .unwrap_or_else(|status| panic!("publish to {source}: {status:?}"))
        .into_inner()
        .results[0]
        .id
        .clone()
}

fn with_sources(name: &str, sources: &[&str]) -> proto::Subscription {
    proto::Subscription {
        sources: sources.iter().map(|source| (*source).to_owned()).collect(),
        ..subscription(name)
    }
}

fn source_of(delivery: &proto::Delivery) -> String {
    delivery.event.as_ref().expect("event").source.clone()
}

#[tokio::test]
async fn events_from_every_source_reach_a_subscription_and_one_ack_settles_them_all() {
    let setup = ThreeSources::start().await;
    let gateway = &setup.gateway;
    create_subscription(gateway, subscription("all")).await;
    create_subscription(gateway, with_sources("orders-only", &["orders"])).await;
    let mut filtered = with_sources("created-elsewhere", &["orders", "billing"]);
    filtered.event_types = vec!["*.created".into()];
    create_subscription(gateway, filtered).await;

    publish_to(gateway, "", "d-1", "order.created").await;
    publish_to(gateway, "orders", "o-1", "order.created").await;
    publish_to(gateway, "orders", "o-2", "order.paid").await;
    // A service writing its own database directly, in its own transaction.
    sqlx::query("SELECT outbox_publish('invoice', 'b-1', 'invoice.created', '{}'::jsonb)")
        .execute(&setup.billing.pool().await)
        .await
        .unwrap();

    let mut all = Consumer::open(gateway, "all", 100).await;
    let deliveries = all.take(4, WAIT).await;
    let seen: BTreeSet<(String, String)> = deliveries
        .iter()
        .map(|d| (source_of(d), aggregate_of(d)))
        .collect();
    let expected: BTreeSet<(String, String)> = [
        ("default", "d-1"),
        ("orders", "o-1"),
        ("orders", "o-2"),
        ("billing", "b-1"),
    ]
    .iter()
    .map(|(s, a)| ((*s).to_owned(), (*a).to_owned()))
    .collect();
    assert_eq!(seen, expected);
    // Ack ids name their source; one call settles all four.
    let ack_ids: Vec<String> = deliveries.iter().map(|d| d.ack_id.clone()).collect();
    assert!(ack_ids.iter().any(|id| id.starts_with("billing/")));
    let answer = gateway
        .subscriber()
        .await
        .ack(proto::AckRequest {
            subscription: "all".into(),
            ack_ids: ack_ids.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(answer.stale_ack_ids.is_empty() && answer.unavailable_ack_ids.is_empty());
    assert_eq!(
        ack(gateway, "all", ack_ids.clone()).await,
        ack_ids,
        "settled for good"
    );
    assert!(all.next(QUIET).await.is_none());

    let mut orders_only = Consumer::open(gateway, "orders-only", 100).await;
    let orders: BTreeSet<String> = orders_only
        .take(2, WAIT)
        .await
        .iter()
        .map(aggregate_of)
        .collect();
    assert_eq!(orders, BTreeSet::from(["o-1".to_owned(), "o-2".to_owned()]));
    assert!(
        orders_only.next(QUIET).await.is_none(),
        "nothing of other sources"
    );

    let mut filtered = Consumer::open(gateway, "created-elsewhere", 100).await;
    let created: BTreeSet<String> = filtered
        .take(2, WAIT)
        .await
        .iter()
        .map(aggregate_of)
        .collect();
    assert_eq!(
        created,
        BTreeSet::from(["o-1".to_owned(), "b-1".to_owned()])
    );
    assert!(filtered.next(QUIET).await.is_none());

    // Figures per source and in total.
    let stats = gateway
        .admin()
        .await
        .get_stats(proto::GetStatsRequest {
            subscription: "all".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let total = &stats.subscriptions[0];
    assert_eq!(total.acked_total, 4);
    let per_source: BTreeSet<(String, u64)> = total
        .sources
        .iter()
        .map(|s| (s.source.clone(), s.acked_total))
        .collect();
    assert_eq!(
        per_source,
        BTreeSet::from([
            ("default".to_owned(), 1),
            ("orders".to_owned(), 2),
            ("billing".to_owned(), 1)
        ])
    );
    assert_eq!(stats.outbox.unwrap().events_stored, 4);

    let sources = gateway
        .admin()
        .await
        .list_sources(proto::ListSourcesRequest {})
        .await
        .unwrap()
        .into_inner()
        .sources;
    let names: Vec<(String, i32, u64)> = sources
        .iter()
        .map(|s| (s.name.clone(), s.status, s.events_stored))
        .collect();
    let connected = proto::SourceStatus::Connected as i32;
    assert_eq!(
        names,
        vec![
            ("default".to_owned(), connected, 1),
            ("orders".to_owned(), connected, 2),
            ("billing".to_owned(), connected, 1)
        ]
    );
    assert!(sources.iter().all(|s| s.schema_version > 0));
    drop(setup.default);
    drop(setup.orders);
}

#[tokio::test]
async fn dead_letters_requeues_and_seeks_work_per_source() {
    let setup = ThreeSources::start().await;
    let gateway = &setup.gateway;
    let mut definition = subscription("all");
    definition.max_attempts = Some(1);
    create_subscription(gateway, definition).await;
    let billing_id = publish_to(gateway, "billing", "b-1", "invoice.created").await;
    publish_to(gateway, "orders", "o-1", "order.created").await;

    let mut consumer = Consumer::open(gateway, "all", 100).await;
    for delivery in consumer.take(2, WAIT).await {
        nack(
            gateway,
            proto::NackRequest {
                subscription: "all".into(),
                reason: format!("broken in {}", source_of(&delivery)),
                ack_id: delivery.ack_id,
                dead_letter: true,
                ..Default::default()
            },
        )
        .await;
    }
    let mut admin = gateway.admin().await;
    let list = |source: &str| proto::ListDeadLettersRequest {
        subscription: "all".into(),
        source: source.into(),
        ..Default::default()
    };
    let dead = admin
        .list_dead_letters(list(""))
        .await
        .unwrap()
        .into_inner();
    let listed: BTreeSet<(String, String)> = dead
        .dead_letters
        .iter()
        .map(|d| (d.source.clone(), d.last_error.clone()))
        .collect();
    assert_eq!(
        listed,
        BTreeSet::from([
            ("billing".to_owned(), "broken in billing".to_owned()),
            ("orders".to_owned(), "broken in orders".to_owned())
        ])
    );
    let only_billing = admin
        .list_dead_letters(list("billing"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(only_billing.dead_letters.len(), 1);
    let unknown = admin.list_dead_letters(list("nope")).await;
    assert_status(unknown, Code::InvalidArgument, "source");

    // Pages go across sources.
    let first = admin
        .list_dead_letters(proto::ListDeadLettersRequest {
            page_size: 1,
            ..list("")
        })
        .await
        .unwrap()
        .into_inner();
    let second = admin
        .list_dead_letters(proto::ListDeadLettersRequest {
            page_size: 1,
            page_token: first.next_page_token.clone(),
            ..list("")
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.dead_letters.len() + second.dead_letters.len(), 2);
    assert_ne!(
        first.dead_letters[0].source, second.dead_letters[0].source,
        "the second page goes on in the other source"
    );

    // Requeue only billing's dead letters; it comes back, orders' stays dead.
    let requeued = admin
        .requeue_dead_letters(proto::RequeueDeadLettersRequest {
            subscription: "all".into(),
            all: true,
            source: "billing".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(requeued.requeued_count, 1);
    let again = consumer.take(1, WAIT).await.remove(0);
    assert_eq!(source_of(&again), "billing");
    ack_all(gateway, "all", vec![again.ack_id]).await;

    // An event id is looked up in every source.
    let requeued = admin
        .requeue_event(proto::RequeueEventRequest {
            id: billing_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(requeued.requeued_count, 1);
    let again = consumer.take(1, WAIT).await.remove(0);
    assert_eq!(again.event.as_ref().unwrap().id, billing_id);
    ack_all(gateway, "all", vec![again.ack_id]).await;

    // Seek replays every source.
    admin
        .seek_subscription(proto::SeekSubscriptionRequest {
            subscription: "all".into(),
            to: Some(proto::StartPosition {
                position: Some(proto::start_position::Position::Boundary(
                    proto::Boundary::Earliest as i32,
                )),
            }),
        })
        .await
        .unwrap();
    let replayed = consumer.take(1, WAIT).await;
    // orders' event is still a dead letter there: a replay never duplicates it.
    assert_eq!(source_of(&replayed[0]), "billing");
    assert!(consumer.next(QUIET).await.is_none());
}

#[tokio::test]
async fn a_seek_that_fails_in_one_source_moves_none() {
    let setup = ThreeSources::start().await;
    let gateway = &setup.gateway;
    create_subscription(gateway, subscription("all")).await;
    publish_to(gateway, "orders", "o-1", "order.created").await;
    publish_to(gateway, "billing", "b-1", "invoice.created").await;
    let mut consumer = Consumer::open(gateway, "all", 100).await;
    let acks = consumer.take(2, WAIT).await.into_iter().map(|d| d.ack_id);
    ack_all(gateway, "all", acks.collect()).await;

    // billing, sought after orders, refuses to move its read position back.
    let billing = setup.billing.pool().await;
    sqlx::raw_sql(
        "CREATE FUNCTION refuse_seek() RETURNS trigger LANGUAGE plpgsql \
             AS $$ BEGIN RAISE EXCEPTION 'read position frozen'; END $$; \
         CREATE TRIGGER frozen BEFORE UPDATE ON outbox_cursors FOR EACH ROW \
             WHEN (NEW.cursor_position = 0 AND OLD.cursor_position <> 0) \
             EXECUTE FUNCTION refuse_seek()",
    )
    .execute(&billing)
    .await
    .unwrap();
    let mut admin = gateway.admin().await;
    let seek = proto::SeekSubscriptionRequest {
        subscription: "all".into(),
        to: Some(proto::StartPosition {
            position: Some(proto::start_position::Position::Boundary(
                proto::Boundary::Earliest as i32,
            )),
        }),
    };
    let refused = admin.seek_subscription(seek.clone()).await;
    assert_status(refused, Code::Internal, "internal");
    // Had orders moved back, its next claim would replay o-1 with the new event.
    publish_to(gateway, "orders", "o-2", "order.shipped").await;
    let next = consumer.take(1, WAIT).await.remove(0);
    assert_eq!(next.event.as_ref().unwrap().event_type, "order.shipped");
    ack_all(gateway, "all", vec![next.ack_id]).await;
    assert!(
        consumer.next(QUIET).await.is_none(),
        "a refused seek replays nothing, in orders either"
    );

    sqlx::raw_sql("DROP TRIGGER frozen ON outbox_cursors")
        .execute(&billing)
        .await
        .unwrap();
    admin.seek_subscription(seek).await.unwrap();
    let mut replayed: Vec<String> = consumer.take(3, WAIT).await.iter().map(source_of).collect();
    replayed.sort();
    assert_eq!(replayed, ["billing", "orders", "orders"]);
    assert!(consumer.next(QUIET).await.is_none(), "replayed once");
}

#[tokio::test]
async fn ordering_holds_per_aggregate_within_each_source() {
    let setup = ThreeSources::start().await;
    let gateway = &setup.gateway;
    let mut ordered = subscription("ordered");
    ordered.ordered = true;
    create_subscription(gateway, ordered).await;
    // The same aggregate id in two sources is two aggregates.
    for step in ["order.first", "order.second"] {
        publish_to(gateway, "orders", "a-1", step).await;
        publish_to(gateway, "billing", "a-1", step).await;
    }
    let mut consumer = Consumer::open(gateway, "ordered", 100).await;
    let first = consumer.take(2, WAIT).await;
    let sources: BTreeSet<String> = first.iter().map(source_of).collect();
    assert_eq!(sources.len(), 2, "one per source at a time");
    assert!(
        first
            .iter()
            .all(|d| d.event.as_ref().unwrap().event_type == "order.first")
    );
    assert!(consumer.next(QUIET).await.is_none());
    ack_all(
        gateway,
        "ordered",
        first.iter().map(|d| d.ack_id.clone()).collect(),
    )
    .await;
    let second = consumer.take(2, WAIT).await;
    assert!(
        second
            .iter()
            .all(|d| d.event.as_ref().unwrap().event_type == "order.second")
    );
}

#[tokio::test]
async fn bad_sources_are_refused_with_the_source_named() {
    let setup = ThreeSources::start().await;
    let gateway = &setup.gateway;
    let unknown = gateway
        .publisher()
        .await
        .publish(proto::PublishRequest {
            events: vec![event("x", "order.created")],
            source: "nope".into(),
        })
        .await;
    assert_status(unknown, Code::InvalidArgument, "nope");
    let malformed = gateway
        .publisher()
        .await
        .publish(proto::PublishRequest {
            events: vec![event("x", "order.created")],
            source: "Not/A/Name".into(),
        })
        .await;
    assert_status(malformed, Code::InvalidArgument, "source");
    let subscription = gateway
        .admin()
        .await
        .create_subscription(proto::CreateSubscriptionRequest {
            subscription: Some(with_sources("s", &["orders", "nope"])),
            validate_only: false,
        })
        .await;
    assert_status(
        subscription,
        Code::InvalidArgument,
        "subscription.sources[1]",
    );
    let stale = gateway
        .subscriber()
        .await
        .ack(proto::AckRequest {
            subscription: "s".into(),
            ack_ids: vec!["nope/1-1-0000000000000001".into()],
        })
        .await;
    assert!(stale.is_err());
    for pool in [setup.orders.pool().await, setup.billing.pool().await] {
        assert_eq!(count_events(&pool).await, 0, "nothing written");
    }
}

#[test]
fn a_configuration_with_clashing_sources_is_refused_naming_the_source() {
    let source = |name: &str, database: &str| SourceConfig {
        name: name.into(),
        database_url: format!("postgres://postgres@127.0.0.1:5432/{database}"),
        max_connections: None,
        migrate: None,
    };
    let cases = [
        (vec![source("Orders", "orders")], "Orders"),
        (vec![source("default", "orders")], "default"),
        (
            vec![source("orders", "orders"), source("orders", "other")],
            "already used",
        ),
        (vec![source("orders", "gateway")], "same database"),
        (
            vec![source("a", "orders"), source("b", "orders")],
            "same database",
        ),
    ];
    for (sources, needle) in cases {
        let settings = outbox_gateway::config::Settings {
            database_url: Some("postgres://postgres@127.0.0.1:5432/gateway".into()),
            sources: Some(sources.clone()),
            ..Default::default()
        };
        let error = Config::from_settings(settings)
            .err()
            .unwrap_or_else(|| panic!("{sources:?} was accepted"))
            .to_string();
        assert!(
            error.contains(needle),
            "{error:?} does not mention {needle:?}"
        );
    }
}

#[tokio::test]
async fn a_source_not_migrated_with_migrate_off_stops_the_start_naming_it() {
    let default = TestDatabase::create().await;
    let service = TestDatabase::create().await;
    let mut not_migrated = source_config("orders", &service);
    not_migrated.migrate = Some(false);
    let config = config_with(&default, vec![not_migrated]);
    config
        .validate()
        .expect("a configuration serve would accept");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let outcome = tokio::time::timeout(
        WAIT,
        outbox_gateway::run(config, listener, std::future::pending()),
    )
    .await
    .expect("the start is refused at once");
    let error = outcome.expect_err("refused").to_string();
    assert!(
        error.contains("orders") && error.contains("migrate"),
        "{error}"
    );
}

#[tokio::test]
async fn a_source_that_goes_down_pauses_only_its_own_share() {
    let RemoteSource {
        server,
        _databases,
        gateway,
    } = RemoteSource::start(Duration::from_secs(1)).await;
    create_subscription(&gateway, subscription("all")).await;
    let mut consumer = Consumer::open(&gateway, "all", 100).await;
    publish_to(&gateway, "remote", "r-1", "order.created").await;
    publish_to(&gateway, "", "d-1", "order.created").await;
    let before = consumer.take(2, WAIT).await;
    let remote_delivery = before
        .iter()
        .find(|d| source_of(d) == "remote")
        .expect("the remote event")
        .clone();
    let default_delivery = before
        .iter()
        .find(|d| source_of(d) == "default")
        .expect("the default event")
        .clone();

    server.stop().expect("stop the second server");

    // The other source keeps flowing.
    publish_to(&gateway, "", "d-2", "order.created").await;
    let during = consumer.take(1, WAIT).await.remove(0);
    assert_eq!(aggregate_of(&during), "d-2");
    // Health and ListSources show the outage.
    let health = |service: &'static str| {
        let gateway = &gateway;
        async move {
            let mut client =
                tonic_health::pb::health_client::HealthClient::new(gateway.channel().await);
            client
                .check(tonic_health::pb::HealthCheckRequest {
                    service: service.into(),
                })
                .await
                .map(|r| r.into_inner().status)
        }
    };
    let not_serving = tonic_health::pb::health_check_response::ServingStatus::NotServing as i32;
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    eventually("the source reports NOT_SERVING", WAIT, || async {
        health("outbox.source.remote").await.ok() == Some(not_serving)
    })
    .await;
    assert_eq!(
        health("").await.ok(),
        Some(serving),
        "the gateway stays SERVING"
    );
    let (status, last_error) = source_state(&gateway, "remote").await;
    assert_eq!(status, proto::SourceStatus::Unavailable as i32);
    assert!(!last_error.is_empty());
    // Acks of its ids come back unavailable; the others are applied.
    let answer = gateway
        .subscriber()
        .await
        .ack(proto::AckRequest {
            subscription: "all".into(),
            ack_ids: vec![
                remote_delivery.ack_id.clone(),
                default_delivery.ack_id.clone(),
                during.ack_id.clone(),
            ],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        answer.unavailable_ack_ids,
        vec![remote_delivery.ack_id.clone()]
    );
    assert!(answer.stale_ack_ids.is_empty());
    let nacked = gateway
        .subscriber()
        .await
        .nack(proto::NackRequest {
            subscription: "all".into(),
            ack_id: remote_delivery.ack_id.clone(),
            ..Default::default()
        })
        .await;
    assert_status(nacked, Code::Unavailable, "remote");

    // Back: delivery resumes by itself and nothing is lost.
    server.resume().expect("start the second server again");
    eventually("the source reports SERVING again", WAIT, || async {
        health("outbox.source.remote").await.ok() == Some(serving)
    })
    .await;
    publish_to(&gateway, "remote", "r-2", "order.created").await;
    let after = consumer.take(1, WAIT).await.remove(0);
    assert_eq!(aggregate_of(&after), "r-2");
    // The unacked remote event comes back once its lease runs out, or is acked now.
    let answer = ack(&gateway, "all", vec![remote_delivery.ack_id, after.ack_id]).await;
    assert!(
        answer.is_empty(),
        "leases held through the outage: {answer:?}"
    );
}

#[tokio::test]
async fn migrate_installs_the_schema_in_one_source_or_in_every_one() {
    let default = TestDatabase::create().await;
    let orders = TestDatabase::create().await;
    let billing = TestDatabase::create().await;
    let config_file =
        std::env::temp_dir().join(format!("outbox-migrate-{}.toml", uuid::Uuid::new_v4()));
    std::fs::write(
        &config_file,
        format!(
            "database_url = {:?}\n\n[[sources]]\nname = \"orders\"\ndatabase_url = {:?}\n\n[[sources]]\nname = \"billing\"\ndatabase_url = {:?}\n",
            default.url(),
            orders.url(),
            billing.url()
        ),
    )
    .unwrap();
    let migrate = |source: Option<&str>| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-gateway"));
        command.arg("migrate").arg("--config").arg(&config_file);
        command.env_remove("DATABASE_URL");
        if let Some(source) = source {
            command.args(["--source", source]);
        }
        command.output().expect("run outbox-gateway migrate")
    };
    async fn has_schema(database: &TestDatabase) -> bool {
        let pool = database.pool().await;
        let found: bool = sqlx::query_scalar("SELECT to_regclass('outbox_events') IS NOT NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
        pool.close().await;
        found
    }

    let unknown = migrate(Some("shipping"));
    let stderr = String::from_utf8_lossy(&unknown.stderr);
    assert_eq!(unknown.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--source") && stderr.contains("shipping") && stderr.contains("billing"),
        "{stderr}"
    );
    assert!(!has_schema(&orders).await && !has_schema(&billing).await);

    let one = migrate(Some("orders"));
    assert!(
        one.status.success(),
        "{}",
        String::from_utf8_lossy(&one.stderr)
    );
    assert!(String::from_utf8_lossy(&one.stdout).contains("\"orders\""));
    assert!(has_schema(&orders).await);
    assert!(!has_schema(&billing).await, "only the named source");

    let every = migrate(None);
    assert!(
        every.status.success(),
        "{}",
        String::from_utf8_lossy(&every.stderr)
    );
    let stdout = String::from_utf8_lossy(&every.stdout);
    for name in ["default", "orders", "billing"] {
        assert!(stdout.contains(&format!("{name:?}")), "{stdout}");
    }
    assert!(has_schema(&default).await && has_schema(&billing).await);

    // With every schema installed, a gateway that may not migrate them starts.
    let mut config = config_with(
        &default,
        vec![
            source_config("orders", &orders),
            source_config("billing", &billing),
        ],
    );
    for source in &mut config.sources {
        source.migrate = Some(false);
    }
    let gateway = TestGateway::start_with(&default, config).await;
    publish_to(&gateway, "billing", "b-1", "invoice.sent").await;
    std::fs::remove_file(&config_file).unwrap();
}

#[tokio::test]
async fn the_cli_lists_the_sources_and_their_state() {
    let sources = ThreeSources::start().await;
    // The gateway runs on this test's runtime: the CLI must not block it.
    let cli = async |args: &[&str]| {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox-gateway"))
            .args(args)
            .env("OUTBOX_ENDPOINT", sources.gateway.endpoint())
            .output()
            .await
            .expect("run outbox-gateway")
    };
    let run = async |json: bool| {
        let output = cli(if json {
            &["sources", "--json"]
        } else {
            &["sources"]
        })
        .await;
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let publish = [
        "publish",
        "--aggregate-type",
        "invoice",
        "--aggregate-id",
        "b-1",
    ];
    let published = cli(&[
        &publish[..],
        &["--event-type", "invoice.sent", "--source", "billing"],
    ]
    .concat())
    .await;
    assert!(
        published.status.success(),
        "{}",
        String::from_utf8_lossy(&published.stderr)
    );
    let refused = cli(&[
        &publish[..],
        &["--event-type", "invoice.sent", "--source", "shipping"],
    ]
    .concat())
    .await;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && stderr.contains("shipping"),
        "{stderr}"
    );

    let listed: serde_json::Value = serde_json::from_str(run(true).await.trim()).unwrap();
    let names: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|source| source["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["default", "orders", "billing"]);
    for source in listed.as_array().unwrap() {
        assert_eq!(source["status"], "connected", "{source}");
    }
    assert_eq!(listed[2]["events_stored"], 1);

    let table = run(false).await;
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("SOURCE") && lines[0].contains("STATUS"),
        "{table}"
    );
    for (line, name) in lines[1..].iter().zip(["default", "orders", "billing"]) {
        assert!(
            line.starts_with(name) && line.contains("connected"),
            "{table}"
        );
    }
}

#[tokio::test]
async fn scheduled_and_expiring_events_work_in_every_source() {
    let setup = ThreeSources::start().await;
    let gateway = &setup.gateway;
    create_subscription(
        gateway,
        proto::Subscription {
            dead_letter_expired: true,
            ..subscription("all")
        },
    )
    .await;
    let mut consumer = Consumer::open(gateway, "all", 10).await;
    // In the orders database: one event due in two seconds and one already expired,
    // written directly; in billing, one plain event.
    let orders = setup.orders.pool().await;
    sqlx::query(
        "SELECT outbox_publish('order', 'o-later', 'order.remind', '{}'::jsonb, \
             p_deliver_at => now() + interval '2 seconds')",
    )
    .execute(&orders)
    .await
    .unwrap();
    sqlx::query(
        "SELECT outbox_publish('order', 'o-stale', 'order.quote', '{}'::jsonb, \
             p_occurred_at => now() - interval '1 hour', p_expires_at => now() - interval '1 minute')",
    )
    .execute(&orders)
    .await
    .unwrap();
    publish_to(gateway, "billing", "b-1", "invoice.created").await;

    let mut seen = BTreeSet::new();
    for _ in 0..2 {
        let delivery = consumer.take(1, WAIT).await.remove(0);
        let event = delivery.event.as_ref().unwrap();
        if let Some(deliver_at) = event.deliver_at {
            let due = std::time::SystemTime::try_from(deliver_at).unwrap();
            assert!(
                std::time::SystemTime::now() >= due,
                "delivered before its time"
            );
        }
        seen.insert((source_of(&delivery), aggregate_of(&delivery)));
    }
    assert_eq!(
        seen,
        BTreeSet::from([
            ("billing".to_owned(), "b-1".to_owned()),
            ("orders".to_owned(), "o-later".to_owned())
        ])
    );
    eventually(
        "the expired event is a dead letter in orders",
        WAIT,
        || async {
            let total = subscription_stats(gateway, "all").await;
            total.expired_total == 1
                && total.dead_lettered == 1
                && total.sources.iter().any(|per_source| {
                    per_source.source == "orders" && per_source.expired_total == 1
                })
        },
    )
    .await;
    assert!(consumer.next(QUIET).await.is_none());
}

/// The state ListSources reports for `name`: (status, last error).
async fn source_state(gateway: &TestGateway, name: &str) -> (i32, String) {
    let sources = gateway
        .admin()
        .await
        .list_sources(proto::ListSourcesRequest {})
        .await
        .unwrap()
        .into_inner()
        .sources;
    let source = sources.into_iter().find(|s| s.name == name).unwrap();
    (source.status, source.last_error)
}

#[tokio::test]
async fn a_down_source_neither_holds_acks_back_nor_slows_the_others() {
    // What a connection attempt to the stopped server may take: no ack may wait for it.
    let RemoteSource {
        server,
        _databases,
        gateway,
    } = RemoteSource::start(Duration::from_secs(5)).await;
    let ack_deadline = Duration::from_secs(3);
    let mut all = subscription("all");
    all.ack_deadline = seconds(ack_deadline.as_secs());
    create_subscription(&gateway, all).await;
    let mut consumer = Consumer::open(&gateway, "all", 4).await;
    publish_to(&gateway, "remote", "r-1", "order.created").await;
    let remote_delivery = consumer.take(1, WAIT).await.remove(0);
    let remote_leased_at = std::time::Instant::now();

    server.stop().expect("stop the second server");
    let unavailable = proto::SourceStatus::Unavailable as i32;
    eventually("the gateway knows the source is down", WAIT, || async {
        source_state(&gateway, "remote").await.0 == unavailable
    })
    .await;

    // An ack that mixes sources answers at once, the down source's ids unavailable.
    publish_to(&gateway, "", "d-0", "order.created").await;
    let healthy = consumer.take(1, WAIT).await.remove(0);
    let started = std::time::Instant::now();
    let answer = gateway
        .subscriber()
        .await
        .ack(proto::AckRequest {
            subscription: "all".into(),
            ack_ids: vec![remote_delivery.ack_id.clone(), healthy.ack_id.clone()],
        })
        .await
        .unwrap()
        .into_inner();
    let took = started.elapsed();
    assert_eq!(answer.unavailable_ack_ids, vec![remote_delivery.ack_id]);
    assert!(answer.stale_ack_ids.is_empty());
    assert!(
        took < Duration::from_secs(2),
        "the ack waited {took:?} for a source known to be down"
    );

    // The down source's lease runs past its deadline: that is no stalled consumer, so the
    // stream still takes as many of the other source's deliveries as it may hold.
    eventually("the remote lease's deadline passed", WAIT, || async {
        remote_leased_at.elapsed() > ack_deadline + Duration::from_millis(500)
    })
    .await;
    for index in 1..=4 {
        publish_to(&gateway, "", &format!("d-{index}"), "order.created").await;
    }
    let held = consumer
        .take(4, ack_deadline - Duration::from_millis(500))
        .await;
    let aggregates: BTreeSet<String> = held.iter().map(aggregate_of).collect();
    assert_eq!(
        aggregates.len(),
        4,
        "unacked deliveries held at once: {aggregates:?}"
    );
    let acked = held.into_iter().map(|delivery| delivery.ack_id).collect();
    assert!(ack(&gateway, "all", acked).await.is_empty());

    // Back: its deliveries resume within a poll interval or two.
    server.resume().expect("start the second server again");
    let connected = proto::SourceStatus::Connected as i32;
    eventually("the source is reachable again", WAIT, || async {
        source_state(&gateway, "remote").await.0 == connected
    })
    .await;
    publish_to(&gateway, "remote", "r-2", "order.created").await;
    let resumed = std::time::Instant::now();
    let mut arrived = false;
    while let Some(delivery) = consumer.next(Duration::from_secs(10)).await {
        if aggregate_of(&delivery) == "r-2" {
            arrived = true;
            break;
        }
    }
    assert!(
        arrived,
        "no delivery from the source within {:?} of its return",
        resumed.elapsed()
    );
}

/// Admin calls and shutdown never wait for a source known to be down (its connection
/// attempts would take the whole acquire timeout): what they would do there is deferred,
/// and done once it is back.
#[tokio::test]
async fn admin_calls_and_shutdown_do_not_wait_for_a_source_known_to_be_down() {
    const PROMPT: Duration = Duration::from_secs(3);
    let RemoteSource {
        server,
        _databases,
        gateway,
    } = RemoteSource::start_with(Duration::from_secs(10), |config| {
        config.maintenance.interval = Duration::from_millis(500);
    })
    .await;
    create_subscription(&gateway, subscription("all")).await;
    create_subscription(&gateway, subscription("doomed")).await;
    let mut consumer = Consumer::open(&gateway, "all", 10).await;
    publish_to(&gateway, "remote", "r-1", "order.created").await;
    assert_eq!(aggregate_of(&consumer.take(1, WAIT).await[0]), "r-1");

    server.stop().expect("stop the second server");
    let unavailable = proto::SourceStatus::Unavailable as i32;
    eventually("the gateway knows the source is down", WAIT, || async {
        source_state(&gateway, "remote").await.0 == unavailable
    })
    .await;
    let started = std::time::Instant::now();
    create_subscription(&gateway, subscription("late")).await;
    let took = started.elapsed();
    assert!(took < PROMPT, "CreateSubscription waited {took:?}");
    let started = std::time::Instant::now();
    gateway
        .admin()
        .await
        .delete_subscription(proto::DeleteSubscriptionRequest {
            name: "doomed".into(),
        })
        .await
        .expect("delete");
    let took = started.elapsed();
    assert!(took < PROMPT, "DeleteSubscription waited {took:?}");

    // Back: the subscription created meanwhile reads the source from where it started.
    server.resume().expect("start the second server again");
    let connected = proto::SourceStatus::Connected as i32;
    eventually("the source is reachable again", WAIT, || async {
        source_state(&gateway, "remote").await.0 == connected
    })
    .await;
    let mut late = Consumer::open(&gateway, "late", 10).await;
    publish_to(&gateway, "remote", "r-2", "order.created").await;
    let arrived: Vec<String> = late.take(2, WAIT).await.iter().map(aggregate_of).collect();
    assert_eq!(
        arrived,
        ["r-1", "r-2"],
        "the late subscription starts at the earliest"
    );

    // Down again, with a remote lease held: the gateway still stops at once.
    publish_to(&gateway, "remote", "r-3", "order.created").await;
    consumer.take(2, WAIT).await;
    server.stop().expect("stop the second server again");
    eventually(
        "the gateway knows the source is down again",
        WAIT,
        || async { source_state(&gateway, "remote").await.0 == unavailable },
    )
    .await;
    drop((consumer, late));
    let started = std::time::Instant::now();
    gateway.stop().await.expect("the gateway stops");
    let took = started.elapsed();
    assert!(took < PROMPT, "shutdown waited {took:?}");
}

/// Calls caught waiting for a source as it goes down answer once it is found down, not
/// after a connection attempt's whole timeout: Publish to it, and Ack of its ids once it
/// is known to be down; the other source's events keep flowing.
#[tokio::test]
async fn calls_waiting_for_a_source_that_goes_down_answer_once_it_is_found_down() {
    const PROMPT: Duration = Duration::from_secs(3);
    let RemoteSource {
        server,
        _databases,
        gateway,
    } = RemoteSource::start(Duration::from_secs(10)).await;
    create_subscription(&gateway, subscription("all")).await;
    let mut consumer = Consumer::open(&gateway, "all", 100).await;
    publish_to(&gateway, "remote", "r-1", "order.created").await;
    let remote_delivery = consumer.take(1, WAIT).await.remove(0);

    server.stop().expect("stop the second server");
    for attempt in 0..3 {
        let started = std::time::Instant::now();
        let published = gateway
            .publisher()
            .await
            .publish(proto::PublishRequest {
                events: vec![event(&format!("r-{attempt}"), "order.created")],
                source: "remote".into(),
            })
            .await;
        let took = started.elapsed();
        assert!(
            took < PROMPT,
            "Publish {attempt} to the down source waited {took:?}"
        );
        if let Err(status) = published {
            assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        }
    }
    let unavailable = proto::SourceStatus::Unavailable as i32;
    eventually("the gateway knows the source is down", WAIT, || async {
        source_state(&gateway, "remote").await.0 == unavailable
    })
    .await;
    for attempt in 0..3 {
        let started = std::time::Instant::now();
        let answer = gateway
            .subscriber()
            .await
            .ack(proto::AckRequest {
                subscription: "all".into(),
                ack_ids: vec![remote_delivery.ack_id.clone()],
            })
            .await
            .expect("an ack is answered");
        let took = started.elapsed();
        assert!(
            took < PROMPT,
            "Ack {attempt} naming the down source waited {took:?}"
        );
        assert!(answer.into_inner().stale_ack_ids.is_empty());
    }
    // The default source's events keep flowing meanwhile.
    for index in 0..5 {
        publish_to(&gateway, "", &format!("d-{index}"), "order.created").await;
        let started = std::time::Instant::now();
        let delivery = consumer
            .next(WAIT)
            .await
            .expect("the default source's event is delivered");
        let took = started.elapsed();
        assert_eq!(source_of(&delivery), "default");
        assert!(
            took < PROMPT,
            "a default event waited {took:?} behind the down source"
        );
    }
}

#[tokio::test]
async fn an_ack_for_a_source_whose_database_is_gone_is_unavailable_and_says_why() {
    let default = TestDatabase::create().await;
    let gone = TestDatabase::create().await;
    let config = config_with(&default, vec![source_config("gone", &gone)]);
    let gateway = TestGateway::start_with(&default, config).await;
    create_subscription(&gateway, subscription("all")).await;
    let mut consumer = Consumer::open(&gateway, "all", 10).await;
    publish_to(&gateway, "gone", "g-1", "order.created").await;
    let delivery = consumer.take(1, WAIT).await.remove(0);

    let pool = default.pool().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE \"{}\" WITH (FORCE)",
        gone.name()
    )))
    .execute(&pool)
    .await
    .expect("drop the source's database");

    let answer = gateway
        .subscriber()
        .await
        .ack(proto::AckRequest {
            subscription: "all".into(),
            ack_ids: vec![delivery.ack_id.clone()],
        })
        .await
        .expect("an ack of an unreachable source is answered")
        .into_inner();
    assert_eq!(answer.unavailable_ack_ids, vec![delivery.ack_id]);
    let unavailable = proto::SourceStatus::Unavailable as i32;
    eventually(
        "the source says its database does not exist",
        WAIT,
        || async {
            let (status, last_error) = source_state(&gateway, "gone").await;
            status == unavailable && last_error.contains("does not exist")
        },
    )
    .await;
}

#[tokio::test]
async fn a_source_down_at_start_is_logged_once_and_healthy_ones_are_not_called_back() {
    let default = TestDatabase::create().await;
    let up = TestDatabase::create().await;
    // Port 1 (tcpmux) is privileged and unused: connecting there is refused.
    let nothing_there = "127.0.0.1:1";
    let config_file =
        std::env::temp_dir().join(format!("outbox-sources-{}.toml", uuid::Uuid::new_v4()));
    std::fs::write(
        &config_file,
        format!(
            "database_url = {:?}\n\n[[sources]]\nname = \"up\"\ndatabase_url = {:?}\n\n[[sources]]\nname = \"down\"\ndatabase_url = \"postgres://postgres@{nothing_there}/outbox\"\n",
            default.url(),
            up.url(),
        ),
    )
    .unwrap();
    let mut gateway = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox-gateway"))
        .args(["serve", "--config"])
        .arg(&config_file)
        .args(["--listen", "127.0.0.1:0", "--console-listen", "off"])
        .args(["--metrics-listen", "off", "--db-acquire-timeout", "1s"])
        .env_remove("RUST_LOG")
        .env_remove("DATABASE_URL")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the gateway");
    let lines = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    for output in [
        Box::new(gateway.stdout.take().unwrap()) as Box<dyn tokio::io::AsyncRead + Send + Unpin>,
        Box::new(gateway.stderr.take().unwrap()),
    ] {
        let lines = lines.clone();
        tokio::spawn(async move {
            use tokio::io::AsyncBufReadExt;
            let mut reader = tokio::io::BufReader::new(output).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                lines.lock().unwrap().push(line);
            }
        });
    }
    let logged = |needle: &'static str| {
        let lines = lines.clone();
        move || {
            lines
                .lock()
                .unwrap()
                .iter()
                .filter(|line| line.contains(needle))
                .cloned()
                .collect::<Vec<_>>()
        }
    };
    let down_lines = logged("unreachable");
    eventually("the source down at start is logged", WAIT, || {
        let found = !down_lines().is_empty();
        async move { found }
    })
    .await;
    // Let a few health checks pass: the down source is not logged again while it stays
    // down, and no source is said to be back.
    let serving = logged("serving gRPC");
    eventually("the gateway serves", WAIT, || {
        let found = !serving().is_empty();
        async move { found }
    })
    .await;
    let checks_done = std::time::Instant::now();
    eventually("a few health checks pass", WAIT, || async {
        checks_done.elapsed() > Duration::from_secs(3)
    })
    .await;
    let down = down_lines();
    assert_eq!(down.len(), 1, "{down:#?}");
    assert!(down[0].contains("down"), "{}", down[0]);
    let back = logged("reachable again")();
    assert!(back.is_empty(), "{back:#?}");
    let _ = gateway.kill().await;
    let _ = std::fs::remove_file(config_file);
}

#[tokio::test]
async fn a_source_down_at_start_is_not_said_to_be_back_when_it_first_answers() {
    let server = tokio::task::spawn_blocking(PostgresServer::start)
        .await
        .unwrap()
        .expect("a second PostgreSQL server");
    let late = TestDatabase::create_on(&server.url()).await;
    let default = TestDatabase::create().await;
    server.stop().expect("stop the second server");
    let config_file =
        std::env::temp_dir().join(format!("outbox-sources-{}.toml", uuid::Uuid::new_v4()));
    std::fs::write(
        &config_file,
        format!(
            "database_url = {:?}\n\n[[sources]]\nname = \"late\"\ndatabase_url = {:?}\n",
            default.url(),
            late.url(),
        ),
    )
    .unwrap();
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox-gateway"));
    command
        .args(["serve", "--config"])
        .arg(&config_file)
        .args(["--listen", "127.0.0.1:0", "--console-listen", "off"])
        .args(["--metrics-listen", "off", "--db-acquire-timeout", "1s"])
        .args(["--health-check-interval", "200ms"])
        .env_remove("RUST_LOG")
        .env_remove("DATABASE_URL")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut gateway = command.spawn().expect("start the gateway");
    let log = ProcessLog::collect(&mut gateway);
    let logged = |needle: &str| {
        log.lines()
            .into_iter()
            .filter(|line| line.contains(needle))
            .count()
    };
    eventually("the source down at start is logged", WAIT, || async {
        logged("source is unreachable") == 1
    })
    .await;

    server.resume().expect("start the second server");
    eventually("the source's first answer is logged", WAIT, || async {
        logged("source is reachable, for the first time since the start") == 1
    })
    .await;
    assert_eq!(logged("reachable again"), 0, "{}", log.text());
    let _ = gateway.kill().await;
    let _ = std::fs::remove_file(config_file);
}
