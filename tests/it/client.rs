//! The Rust client library against a real gateway: idempotent publishing, the handler
//! loop (ack, nack, dead letter), extending the leases of slow handlers, reconnecting
//! across a gateway restart, draining.

use std::{
    collections::HashSet,
    sync::{Arc, Mutex},
    time::Duration,
};

use crate::common::*;
use outbox_client::{ClientError, Connection, HandlerError, Publisher, Subscriber, proto};
use tokio_util::sync::CancellationToken;

/// Generous: the subscriber reconnects with backoff after a gateway restart.
const WAIT: Duration = Duration::from_secs(20);

#[tokio::test]
async fn publisher_assigns_ids_so_a_repeated_call_is_a_duplicate() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let publisher = Publisher::new(Connection::new(gateway.endpoint()));
    let first = publisher
        .publish(vec![event("o-1", "order.created")])
        .await
        .unwrap();
    assert!(!first[0].duplicate);
    let mut again = event("o-1", "order.created");
    again.id = first[0].id.clone();
    assert!(publisher.publish(vec![again]).await.unwrap()[0].duplicate);

    let refused = publisher.publish(vec![event("o-1", "not valid")]).await;
    assert!(
        matches!(refused, Err(ClientError::Refused(status)) if status.code() == tonic::Code::InvalidArgument)
    );
    let unreachable = Publisher::new(Connection::new("http://127.0.0.1:1")).max_attempts(2);
    assert!(matches!(
        unreachable
            .publish(vec![event("o-2", "order.created")])
            .await,
        Err(ClientError::Unavailable(_))
    ));
}

#[tokio::test]
async fn subscriber_acks_nacks_dead_letters_and_survives_a_gateway_restart() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let address = gateway.address;
    create_subscription(
        &gateway,
        proto::Subscription {
            retry_backoff_min: seconds(0),
            ..subscription("orders")
        },
    )
    .await;
    let connection = Connection::new(gateway.endpoint());
    let publisher = Publisher::new(connection.clone());
    publisher
        .publish(vec![
            event("ok-1", "order.created"),
            event("flaky", "order.created"),
            event("poison", "order.created"),
        ])
        .await
        .unwrap();

    // "flaky" fails once, "poison" always (permanently); the rest succeed.
    let handled = Arc::new(Mutex::new(Vec::<(String, u32)>::new()));
    let shutdown = CancellationToken::new();
    let subscriber = {
        let handled = handled.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            Subscriber::new(connection, "orders")
                .concurrency(4)
                .run(
                    move |delivery| {
                        let handled = handled.clone();
                        async move {
                            let aggregate = delivery.event.as_ref().unwrap().aggregate_id.clone();
                            handled
                                .lock()
                                .unwrap()
                                .push((aggregate.clone(), delivery.attempt));
                            match (aggregate.as_str(), delivery.attempt) {
                                ("poison", _) => Err(HandlerError::permanent("cannot parse")),
                                ("flaky", 1) => Err(HandlerError::transient("try again")),
                                _ => Ok(()),
                            }
                        }
                    },
                    shutdown,
                )
                .await
        })
    };
    let seen = |handled: &Arc<Mutex<Vec<(String, u32)>>>| {
        handled
            .lock()
            .unwrap()
            .iter()
            .cloned()
            .collect::<HashSet<_>>()
    };
    eventually("the first events are handled", WAIT, || async {
        let seen = seen(&handled);
        seen.contains(&("ok-1".into(), 1))
            && seen.contains(&("flaky".into(), 2))
            && seen.contains(&("poison".into(), 1))
    })
    .await;

    // Restart the gateway on the same address; the subscriber reconnects by itself.
    gateway.stop().await.unwrap();
    let listener = bind_again(address).await;
    let gateway = TestGateway::spawn_on(&database, test_config(database.url()), listener).await;
    gateway
        .wait_for_health(tonic_health::pb::health_check_response::ServingStatus::Serving)
        .await;
    publisher
        .publish(vec![event("ok-2", "order.created")])
        .await
        .unwrap();
    eventually(
        "an event published after the restart is handled",
        WAIT,
        || async { seen(&handled).contains(&("ok-2".into(), 1)) },
    )
    .await;

    shutdown.cancel();
    subscriber.await.unwrap().unwrap();
    let pool = database.pool().await;
    let records = delivery_records(&pool, "orders").await;
    assert_eq!(
        records,
        vec![("poison".into(), "dead".into(), 1)],
        "everything else was acked"
    );
    let poison_attempts = handled
        .lock()
        .unwrap()
        .iter()
        .filter(|(a, _)| a == "poison")
        .count();
    assert_eq!(poison_attempts, 1, "a permanent failure is not retried");
}

#[tokio::test]
async fn subscriber_reports_an_unknown_subscription() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let result = Subscriber::new(Connection::new(gateway.endpoint()), "missing")
        .run(|_| async { Ok(()) }, CancellationToken::new())
        .await;
    assert!(
        matches!(result, Err(ClientError::Refused(status)) if status.code() == tonic::Code::NotFound)
    );
}

/// A handler that holds a delivery for several ack deadlines keeps it: the client
/// extends the lease while the handler runs, so the gateway does not hand the event to
/// anyone else, and the ack at the end takes.
#[tokio::test]
async fn a_slow_handler_keeps_its_delivery_past_the_ack_deadline() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            ack_deadline: seconds(1),
            ..subscription("orders")
        },
    )
    .await;
    publish(&gateway, vec![event("slow", "order.created")]).await;

    let handled = Arc::new(Mutex::new(Vec::<u32>::new()));
    let shutdown = CancellationToken::new();
    let subscriber = {
        let handled = handled.clone();
        let shutdown = shutdown.clone();
        let connection = Connection::new(gateway.endpoint());
        tokio::spawn(async move {
            Subscriber::new(connection, "orders")
                .concurrency(4)
                .run(
                    move |delivery| {
                        let handled = handled.clone();
                        async move {
                            handled.lock().unwrap().push(delivery.attempt);
                            // Three and a half ack deadlines.
                            tokio::time::sleep(Duration::from_millis(3500)).await;
                            Ok(())
                        }
                    },
                    shutdown,
                )
                .await
        })
    };
    let pool = database.pool().await;
    eventually("the slow handler finishes and acks", WAIT, || async {
        !handled.lock().unwrap().is_empty() && delivery_records(&pool, "orders").await.is_empty()
    })
    .await;
    assert_eq!(
        *handled.lock().unwrap(),
        vec![1],
        "the event was delivered again while its handler held it"
    );
    shutdown.cancel();
    subscriber.await.unwrap().unwrap();
}

/// Shutting down drains: the running handler finishes and its ack is sent before `run`
/// returns, and deliveries the stream held but no handler took are given back at once
/// rather than at their (long) ack deadline.
#[tokio::test]
async fn shutdown_lets_running_handlers_finish_and_gives_the_rest_back() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            ack_deadline: seconds(600),
            ..subscription("orders")
        },
    )
    .await;
    publish(
        &gateway,
        vec![
            event("a-1", "order.created"),
            event("a-2", "order.created"),
            event("a-3", "order.created"),
        ],
    )
    .await;

    let started = Arc::new(Mutex::new(Vec::<String>::new()));
    let release = Arc::new(tokio::sync::Notify::new());
    let shutdown = CancellationToken::new();
    let mut subscriber = {
        let (started, release) = (started.clone(), release.clone());
        let shutdown = shutdown.clone();
        let connection = Connection::new(gateway.endpoint());
        tokio::spawn(async move {
            Subscriber::new(connection, "orders")
                .concurrency(1)
                .max_in_flight(3)
                .run(
                    move |delivery| {
                        let (started, release) = (started.clone(), release.clone());
                        async move {
                            started.lock().unwrap().push(aggregate_of(&delivery));
                            release.notified().await;
                            Ok(())
                        }
                    },
                    shutdown,
                )
                .await
        })
    };
    let pool = database.pool().await;
    let leased = || async {
        delivery_records(&pool, "orders")
            .await
            .into_iter()
            .filter(|(_, state, _)| state == "in_flight")
            .count()
    };
    eventually(
        "one handler runs and the stream holds all three",
        WAIT,
        || async { started.lock().unwrap().len() == 1 && leased().await == 3 },
    )
    .await;

    shutdown.cancel();
    assert!(
        tokio::time::timeout(Duration::from_millis(500), &mut subscriber)
            .await
            .is_err(),
        "run returned while a handler was still running"
    );
    release.notify_one();
    tokio::time::timeout(WAIT, subscriber)
        .await
        .expect("run returns once the handler finished")
        .unwrap()
        .unwrap();

    let handled = started.lock().unwrap().clone();
    assert_eq!(handled.len(), 1, "no handler starts after shutdown");
    // The gateway sees the stream close a moment after `run` returns.
    eventually(
        "the handled event is acked and the others are given back",
        WAIT,
        || async {
            delivery_records(&pool, "orders")
                .await
                .iter()
                .all(|(aggregate, state, _)| *aggregate != handled[0] && state != "in_flight")
        },
    )
    .await;
    // Given back, not held until the 600-second deadline: another reader gets them now.
    let mut next_reader = Consumer::open(&gateway, "orders", 10).await;
    let mut redelivered: Vec<String> = next_reader
        .take(2, WAIT)
        .await
        .iter()
        .map(aggregate_of)
        .collect();
    redelivered.sort();
    let mut expected: Vec<String> = ["a-1", "a-2", "a-3"]
        .into_iter()
        .filter(|aggregate| *aggregate != handled[0])
        .map(String::from)
        .collect();
    expected.sort();
    assert_eq!(redelivered, expected);
    assert!(
        next_reader.next(Duration::from_millis(500)).await.is_none(),
        "the handled event came again"
    );
}

async fn bind_again(address: std::net::SocketAddr) -> tokio::net::TcpListener {
    poll_until(Duration::from_secs(5), POLL, || async {
        tokio::net::TcpListener::bind(address).await.ok()
    })
    .await
    .unwrap_or_else(|| panic!("cannot bind {address} again"))
}

#[tokio::test]
async fn an_exactly_once_handler_writes_each_event_once_and_needs_no_ack() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("shipping")).await;
    let pool = database.pool().await;
    sqlx::query("CREATE TABLE shipments (order_id text NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let orders: Vec<String> = (0..20).map(|n| format!("o-{n:02}")).collect();
    publish(
        &gateway,
        orders.iter().map(|id| event(id, "order.created")).collect(),
    )
    .await;

    // One handler fails after writing: its transaction rolls back and the event comes
    // again.
    let failed_once = Arc::new(Mutex::new(false));
    let shutdown = CancellationToken::new();
    let subscriber = Subscriber::new(Connection::new(gateway.endpoint()), "shipping");
    let running = tokio::spawn({
        let (pool, shutdown, failed_once) = (pool.clone(), shutdown.clone(), failed_once.clone());
        async move {
            subscriber
                .run_exactly_once(
                    pool,
                    move |delivery, connection| {
                        let failed_once = failed_once.clone();
                        Box::pin(async move {
                            let event = delivery.event.unwrap_or_default();
                            sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)")
                                .bind(&event.aggregate_id)
                                .execute(&mut *connection)
                                .await
                                .map_err(|error| HandlerError::transient(error.to_string()))?;
                            if event.aggregate_id == "o-07"
                                && !std::mem::replace(&mut *failed_once.lock().unwrap(), true)
                            {
                                return Err(HandlerError::transient("the carrier is down"));
                            }
                            Ok(())
                        })
                    },
                    shutdown,
                )
                .await
        }
    });

    eventually("every delivery is settled", WAIT, || async {
        let stats = subscription_stats(&gateway, "shipping").await;
        stats.lag_events == 0 && stats.acked_total == 20
    })
    .await;
    shutdown.cancel();
    running.await.unwrap().unwrap();
    let shipped: Vec<String> = sqlx::query_scalar("SELECT order_id FROM shipments ORDER BY 1")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(shipped, orders);
    assert!(*failed_once.lock().unwrap());
    let stats = subscription_stats(&gateway, "shipping").await;
    assert_eq!((stats.delivered_total, stats.consumption_records), (21, 20));
}
