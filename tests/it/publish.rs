//! Foundation: Publish over gRPC, the direct-SQL write path, health and reflection.

use std::{collections::HashMap, time::Duration};

use crate::common::{
    TestDatabase, TestGateway, assert_status, count_events, event, eventually, proxy::TcpProxy,
    publish, test_config,
};
use outbox_gateway::proto::{self, PublishRequest};
use sqlx::Row;
use tokio_stream::StreamExt;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

#[tokio::test]
async fn publishes_one_event_with_every_field_stored() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let id = uuid::Uuid::new_v4().to_string();
    let input = proto::EventInput {
        id: id.clone(),
        aggregate_type: "order".into(),
        aggregate_id: "o-1".into(),
        aggregate_version: Some(3),
        event_type: "order.created".into(),
        payload: br#"{"total": 42}"#.to_vec(),
        content_type: String::new(),
        metadata: HashMap::from([("tenant".into(), "acme".into())]),
        occurred_at: Some(prost_types::Timestamp {
            seconds: 1_700_000_000,
            nanos: 123_456_789,
        }),
        // Due at once (a past time), expiring in the far future.
        deliver_at: Some(prost_types::Timestamp {
            seconds: 1_700_000_001,
            nanos: 0,
        }),
        expires_at: Some(prost_types::Timestamp {
            seconds: 4_000_000_000,
            nanos: 0,
        }),
    };
    let results = publish(&gateway, vec![input]).await;
    assert_eq!(
        results,
        vec![proto::PublishResult {
            id: id.clone(),
            duplicate: false
        }]
    );

    let pool = database.pool().await;
    let row = sqlx::query(
        "SELECT aggregate_type, aggregate_id, aggregate_version, event_type, payload, content_type, \
         metadata->>'tenant' AS tenant, extract(epoch FROM occurred_at)::float8 AS occurred, \
         extract(epoch FROM deliver_at)::float8 AS deliver, \
         extract(epoch FROM expires_at)::float8 AS expires \
         FROM outbox_events WHERE id = $1::uuid",
    )
    .bind(&id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(row.get::<String, _>("aggregate_type"), "order");
    assert_eq!(row.get::<String, _>("aggregate_id"), "o-1");
    assert_eq!(row.get::<Option<i64>, _>("aggregate_version"), Some(3));
    assert_eq!(row.get::<String, _>("event_type"), "order.created");
    assert_eq!(row.get::<Vec<u8>, _>("payload"), br#"{"total": 42}"#);
    assert_eq!(row.get::<String, _>("content_type"), "application/json");
    assert_eq!(row.get::<String, _>("tenant"), "acme");
    assert!((row.get::<f64, _>("occurred") - 1_700_000_000.123_456).abs() < 1e-6);
    assert_eq!(row.get::<f64, _>("deliver"), 1_700_000_001.0);
    assert_eq!(row.get::<f64, _>("expires"), 4_000_000_000.0);
}

#[tokio::test]
async fn publishes_a_batch_of_1000_in_request_order_with_generated_ids() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let events: Vec<_> = (0..1000)
        .map(|i| event(&format!("o-{i}"), "order.created"))
        .collect();
    let results = publish(&gateway, events).await;
    assert_eq!(results.len(), 1000);
    assert!(
        results
            .iter()
            .all(|r| !r.duplicate && uuid::Uuid::parse_str(&r.id).is_ok())
    );

    let pool = database.pool().await;
    let stored: Vec<(String, String)> =
        sqlx::query_as("SELECT id::text, aggregate_id FROM outbox_events ORDER BY position")
            .fetch_all(&pool)
            .await
            .unwrap();
    let expected: Vec<(String, String)> = results
        .iter()
        .enumerate()
        .map(|(i, r)| (r.id.clone(), format!("o-{i}")))
        .collect();
    assert_eq!(
        stored, expected,
        "events are stored in request order under the returned ids"
    );
}

#[tokio::test]
async fn republishing_identical_events_is_idempotent() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let mut first = event("o-1", "order.created");
    first.id = uuid::Uuid::new_v4().to_string();
    let mut second = event("o-2", "order.created");
    second.id = uuid::Uuid::new_v4().to_string();

    publish(&gateway, vec![first.clone()]).await;
    // One already stored, one new, and the new one repeated within the batch.
    let results = publish(
        &gateway,
        vec![first.clone(), second.clone(), second.clone()],
    )
    .await;
    let flags: Vec<bool> = results.iter().map(|r| r.duplicate).collect();
    assert_eq!(flags, vec![true, false, true]);
    assert_eq!(results[0].id, first.id);
    assert_eq!(count_events(&database.pool().await).await, 2);
}

#[tokio::test]
async fn conflicting_republish_fails_the_whole_batch_and_writes_nothing() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let mut original = event("o-1", "order.created");
    original.id = uuid::Uuid::new_v4().to_string();
    publish(&gateway, vec![original.clone()]).await;

    let mut changed = original.clone();
    changed.payload = br#"{"different": true}"#.to_vec();
    let result = gateway
        .publisher()
        .await
        .publish(PublishRequest {
            events: vec![event("o-9", "order.created"), changed],
            ..Default::default()
        })
        .await;
    assert_status(result, Code::AlreadyExists, &original.id);
    assert_eq!(
        count_events(&database.pool().await).await,
        1,
        "the valid event of the batch was not written"
    );

    // The same id twice in one batch with different content is refused too.
    let mut twin = event("o-3", "order.created");
    twin.id = uuid::Uuid::new_v4().to_string();
    let mut other = twin.clone();
    other.aggregate_id = "o-4".into();
    let result = gateway
        .publisher()
        .await
        .publish(PublishRequest {
            events: vec![twin, other],
            ..Default::default()
        })
        .await;
    assert_status(result, Code::AlreadyExists, "events[1].id");
    assert_eq!(count_events(&database.pool().await).await, 1);
}

#[tokio::test]
async fn bad_input_is_refused_with_the_field_named_and_nothing_written() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.limits.max_payload_bytes = 64;
    config.limits.max_batch_events = 5;
    config.limits.max_metadata_entries = 2;
    let gateway = TestGateway::start_with(&database, config).await;
    let mut publisher = gateway.publisher().await;

    let with = |change: fn(&mut proto::EventInput)| {
        let mut input = event("o-1", "order.created");
        change(&mut input);
        // The bad event sits behind a good one: the index must point at it.
        vec![event("o-0", "order.created"), input]
    };
    let cases: Vec<(Vec<proto::EventInput>, &str)> = vec![
        (vec![], "events"),
        (
            (0..6)
                .map(|i| event(&format!("o-{i}"), "order.created"))
                .collect(),
            "events",
        ),
        (
            with(|e| e.aggregate_type.clear()),
            "events[1].aggregate_type",
        ),
        (
            with(|e| e.aggregate_id = "x".repeat(256)),
            "events[1].aggregate_id",
        ),
        (with(|e| e.event_type.clear()), "events[1].event_type"),
        (
            with(|e| e.event_type = "order..created".into()),
            "events[1].event_type",
        ),
        (
            with(|e| e.event_type = "order created".into()),
            "events[1].event_type",
        ),
        (
            with(|e| e.event_type = "x".repeat(256)),
            "events[1].event_type",
        ),
        (with(|e| e.id = "not-a-uuid".into()), "events[1].id"),
        (
            with(|e| e.payload = b"{broken".to_vec()),
            "events[1].payload",
        ),
        (with(|e| e.payload = vec![b' '; 65]), "events[1].payload"),
        (
            with(|e| e.aggregate_version = Some(0)),
            "events[1].aggregate_version",
        ),
        (
            with(|e| e.metadata = (0..3).map(|i| (format!("k{i}"), "v".into())).collect()),
            "events[1].metadata",
        ),
        (
            with(|e| e.metadata = HashMap::from([(String::new(), "v".into())])),
            "events[1].metadata",
        ),
        (
            with(|e| {
                e.occurred_at = Some(prost_types::Timestamp {
                    seconds: 0,
                    nanos: -1,
                })
            }),
            "events[1].occurred_at",
        ),
    ];
    for (events, field) in cases {
        let result = publisher
            .publish(PublishRequest {
                events,
                ..Default::default()
            })
            .await;
        assert_status(result, Code::InvalidArgument, field);
    }
    assert_eq!(count_events(&database.pool().await).await, 0);

    // A non-JSON content type carries any bytes.
    let mut binary = event("o-1", "order.created");
    binary.content_type = "application/octet-stream".into();
    binary.payload = vec![0, 159, 146, 150];
    publish(&gateway, vec![binary]).await;
}

#[tokio::test]
async fn direct_sql_insert_is_stored_and_notifies_only_on_commit() {
    let database = TestDatabase::create().await;
    let _gateway = TestGateway::start(&database).await;
    let pool = database.pool().await;
    let mut listener = sqlx::postgres::PgListener::connect_with(&pool)
        .await
        .unwrap();
    listener.listen("outbox_events").await.unwrap();

    // Rolled back: no row, no notification.
    let mut transaction = pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('order', 'o-1', 'order.created', '{}')",
    )
    .execute(&mut *transaction)
    .await
    .unwrap();
    transaction.rollback().await.unwrap();
    assert_eq!(count_events(&pool).await, 0);
    let nothing = tokio::time::timeout(Duration::from_millis(300), listener.recv()).await;
    assert!(nothing.is_err(), "a rolled-back insert must not notify");

    // Committed with several rows: visible, and exactly one notification.
    let mut transaction = pool.begin().await.unwrap();
    for i in 0..3 {
        sqlx::query(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('order', $1, 'order.created', '{}')",
        )
        .bind(format!("o-{i}"))
        .execute(&mut *transaction)
        .await
        .unwrap();
    }
    transaction.commit().await.unwrap();
    assert_eq!(count_events(&pool).await, 3);
    let notification = tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("a committed insert notifies")
        .unwrap();
    assert_eq!(notification.channel(), "outbox_events");
    let second = tokio::time::timeout(Duration::from_millis(300), listener.recv()).await;
    assert!(
        second.is_err(),
        "one transaction sends one notification, not one per row"
    );
}

#[tokio::test]
async fn sql_function_applies_the_rpc_rules() {
    let database = TestDatabase::create().await;
    let _gateway = TestGateway::start(&database).await;
    let pool = database.pool().await;

    let id: uuid::Uuid = sqlx::query_scalar(
        "SELECT outbox_publish('order', 'o-1', 'order.created', '{\"total\": 1}'::jsonb, \
         '{\"tenant\": \"acme\"}'::jsonb, 'a8f5f167-f44f-4964-a6c3-08f5f1f3c7a1')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(id.to_string(), "a8f5f167-f44f-4964-a6c3-08f5f1f3c7a1");

    // Identical re-publish is a no-op; different content is a unique violation.
    sqlx::query(
        "SELECT outbox_publish('order', 'o-1', 'order.created', '{\"total\": 1}'::jsonb, \
         '{\"tenant\": \"acme\"}'::jsonb, 'a8f5f167-f44f-4964-a6c3-08f5f1f3c7a1')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let conflict = sqlx::query(
        "SELECT outbox_publish('order', 'o-1', 'order.created', '{\"total\": 2}'::jsonb, \
         '{}'::jsonb, 'a8f5f167-f44f-4964-a6c3-08f5f1f3c7a1')",
    )
    .execute(&pool)
    .await
    .unwrap_err();
    assert_eq!(
        conflict.as_database_error().unwrap().code().as_deref(),
        Some("23505")
    );

    let refused = [
        (
            "SELECT outbox_publish('', 'o-1', 'order.created', '{}')",
            "outbox_events_aggregate_type_length",
        ),
        (
            "SELECT outbox_publish('order', 'o-1', 'order..created', '{}')",
            "outbox_events_event_type_format",
        ),
        (
            "SELECT outbox_publish('order', 'o-1', 'order.created', '{}', '{\"n\": 1}')",
            "outbox_events_metadata_format",
        ),
        (
            "SELECT outbox_publish('order', 'o-1', 'order.created', '{}', '{}', NULL, 0)",
            "outbox_events_aggregate_version_positive",
        ),
        (
            "SELECT outbox_publish_bytes('order', 'o-1', 'order.created', '\\x7b'::bytea)",
            "json",
        ),
    ];
    for (statement, needle) in refused {
        let error = sqlx::query(sqlx::AssertSqlSafe(statement))
            .execute(&pool)
            .await
            .unwrap_err();
        assert!(error.to_string().contains(needle), "{statement}: {error}");
    }
    // Binary payloads under a non-JSON type are fine.
    sqlx::query("SELECT outbox_publish_bytes('order', 'o-2', 'order.created', '\\x00ff'::bytea, 'application/octet-stream')")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(count_events(&pool).await, 2);
}

#[tokio::test]
async fn database_loss_answers_unavailable_and_health_follows_it_but_not_liveness() {
    let database = TestDatabase::create().await;
    let proxy = TcpProxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let gateway =
        TestGateway::start_with(&database, test_config(proxy.database_url(database.name()))).await;

    proxy.cut();
    gateway.wait_for_health(ServingStatus::NotServing).await;
    // What liveness probes ask: the process itself is fine.
    assert_eq!(
        gateway.health_of("outbox.process").await,
        Some(ServingStatus::Serving)
    );
    let result = gateway
        .publisher()
        .await
        .publish(PublishRequest {
            events: vec![event("o-1", "order.created")],
            ..Default::default()
        })
        .await;
    assert_status(result, Code::Unavailable, "database");

    proxy.restore();
    gateway.wait_for_health(ServingStatus::Serving).await;
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    assert_eq!(count_events(&database.pool().await).await, 1);
}

#[tokio::test]
async fn health_is_not_serving_until_the_schema_is_migrated() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.migrate = false;
    let gateway = TestGateway::spawn(&database, config).await;
    gateway.wait_for_health(ServingStatus::NotServing).await;

    let migrator = TestGateway::start(&database).await;
    gateway.wait_for_health(ServingStatus::Serving).await;
    migrator.stop().await.unwrap();

    gateway.stop().await.expect("clean shutdown");
}

#[tokio::test]
async fn reflection_lists_the_services() {
    use tonic_reflection::pb::v1::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
    };
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let mut client = ServerReflectionClient::new(gateway.channel().await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = client
        .server_reflection_info(tokio_stream::iter(vec![request]))
        .await
        .unwrap()
        .into_inner();
    let response = responses.next().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("unexpected reflection answer");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    for expected in [
        "outbox.v1.Publisher",
        "outbox.v1.Subscriber",
        "outbox.v1.Admin",
        "grpc.health.v1.Health",
    ] {
        assert!(
            names.contains(&expected.to_string()),
            "{expected} missing from {names:?}"
        );
    }
}

#[tokio::test]
async fn concurrent_calls_share_transactions_without_failing_each_other() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let mut stored = event("taken", "order.created");
    stored.id = uuid::Uuid::new_v4().to_string();
    publish(&gateway, vec![stored.clone()]).await;
    let mut shared = event("shared", "order.created");
    shared.id = uuid::Uuid::new_v4().to_string();

    // 40 calls at once: one conflicts with a stored event, two publish the same new id.
    let channel = gateway.channel().await;
    let mut calls = Vec::new();
    for i in 0..40 {
        let mut client = proto::publisher_client::PublisherClient::new(channel.clone());
        let events = match i {
            7 => {
                let mut conflicting = stored.clone();
                conflicting.payload = br#"{"changed": true}"#.to_vec();
                vec![event("c-7", "order.created"), conflicting]
            }
            11 | 12 => vec![shared.clone()],
            _ => vec![event(&format!("c-{i}"), "order.created")],
        };
        calls.push(tokio::spawn(async move {
            (
                i,
                client
                    .publish(PublishRequest {
                        events,
                        ..Default::default()
                    })
                    .await,
            )
        }));
    }
    let mut shared_duplicates = Vec::new();
    for call in calls {
        let (i, result) = call.await.unwrap();
        match i {
            7 => assert_status(result, Code::AlreadyExists, &stored.id),
            11 | 12 => shared_duplicates.push(result.unwrap().into_inner().results[0].duplicate),
            _ => assert!(!result.unwrap().into_inner().results[0].duplicate),
        }
    }
    shared_duplicates.sort();
    assert_eq!(
        shared_duplicates,
        [false, true],
        "one call stored the shared id, the other saw it"
    );
    let pool = database.pool().await;
    // 1 stored before + 37 single calls + the shared one; nothing of call 7.
    assert_eq!(count_events(&pool).await, 1 + 37 + 1);
    let c7: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_events WHERE aggregate_id = 'c-7'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(c7, 0, "the refused call wrote nothing");
}

#[tokio::test]
async fn a_shutdown_past_its_grace_period_ends_once_a_blocked_publish_is_released() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.shutdown_grace = Duration::from_millis(200);
    let gateway = TestGateway::start_with(&database, config).await;
    let pool = database.pool().await;

    // A producer's open transaction holds an id; a Publish of the same id waits for it.
    let id = uuid::Uuid::new_v4();
    let mut producer = pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ($1, 'order', 'o-1', 'order.created', '{}')",
    )
    .bind(id)
    .execute(&mut *producer)
    .await
    .unwrap();
    let mut publisher = gateway.publisher().await;
    let blocked = proto::EventInput {
        id: id.to_string(),
        ..event("o-1", "order.created")
    };
    let call = tokio::spawn(async move {
        publisher
            .publish(PublishRequest {
                events: vec![blocked],
                ..Default::default()
            })
            .await
    });
    eventually(
        "Publish blocks on the lock",
        Duration::from_secs(10),
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
                > 0
        },
    )
    .await;

    let stopping = tokio::spawn(gateway.stop());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !stopping.is_finished(),
        "stopped while a statement was running"
    );
    producer.rollback().await.unwrap();
    let stopped = tokio::time::timeout(Duration::from_secs(10), stopping)
        .await
        .expect("the gateway stops once the publishing statement is done")
        .unwrap();
    assert!(stopped.is_ok(), "{stopped:?}");
    call.abort();
}

/// The Publish RPC and `outbox_publish()` judge a re-published event alike: trace
/// context alone never makes it a conflict, any other metadata does.
#[tokio::test]
async fn rpc_and_sql_agree_on_duplicates_and_conflicts() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let pool = database.pool().await;
    let trace_a = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let trace_b = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let metadata = |entries: &[(&str, &str)]| -> HashMap<String, String> {
        entries
            .iter()
            .map(|(key, value)| (key.to_string(), value.to_string()))
            .collect()
    };
    // (stored metadata, re-published metadata, is a duplicate)
    let cases = [
        (
            metadata(&[("tenant", "acme"), ("traceparent", trace_a)]),
            metadata(&[("tenant", "acme"), ("traceparent", trace_b)]),
            true,
        ),
        (
            metadata(&[("traceparent", trace_a), ("tracestate", "a=1")]),
            metadata(&[("traceparent", trace_a), ("tracestate", "b=2")]),
            true,
        ),
        (
            metadata(&[("tenant", "acme")]),
            metadata(&[
                ("tenant", "acme"),
                ("traceparent", trace_b),
                ("tracestate", "b=2"),
            ]),
            true,
        ),
        (
            metadata(&[("tenant", "acme"), ("traceparent", trace_a)]),
            metadata(&[("tenant", "other"), ("traceparent", trace_a)]),
            false,
        ),
    ];
    for (number, (stored, republished, duplicate)) in cases.into_iter().enumerate() {
        let event_with = |id: &str, metadata: HashMap<String, String>| proto::EventInput {
            id: id.to_owned(),
            metadata,
            ..event("o-1", "order.created")
        };
        let rpc_id = uuid::Uuid::new_v4().to_string();
        publish(&gateway, vec![event_with(&rpc_id, stored.clone())]).await;
        let rpc = gateway
            .publisher()
            .await
            .publish(PublishRequest {
                events: vec![event_with(&rpc_id, republished.clone())],
                ..Default::default()
            })
            .await;
        match (duplicate, rpc) {
            (true, Ok(response)) => assert!(
                response.into_inner().results[0].duplicate,
                "case {number}: the RPC calls it a duplicate"
            ),
            (false, Err(status)) => assert_eq!(status.code(), Code::AlreadyExists, "case {number}"),
            (_, outcome) => panic!("case {number}: the RPC answered {outcome:?}"),
        }

        let sql_id = uuid::Uuid::new_v4();
        let sql_publish = |metadata: HashMap<String, String>| {
            sqlx::query(
                "SELECT outbox_publish('order', 'o-1', 'order.created', '{}'::jsonb, $1, $2)",
            )
            .bind(sqlx::types::Json(metadata))
            .bind(sql_id)
            .execute(&pool)
        };
        sql_publish(stored).await.unwrap();
        let sql = sql_publish(republished).await;
        match (duplicate, sql) {
            (true, Ok(_)) => {}
            (false, Err(error)) => assert_eq!(
                error.as_database_error().and_then(|e| e.code()).as_deref(),
                Some("23505"),
                "case {number}"
            ),
            (_, outcome) => panic!("case {number}: outbox_publish answered {outcome:?}"),
        }
    }
}
