//! The web console in a real browser: Debian's chromium, driven by playwright-core
//! (tests/browser/console.js), signs in, watches a subscription's dead letters appear
//! while its consumer rejects events, requeues them by filter, watches them delivered
//! and the counts fall to zero, and looks an event up by id.
//!
//! The test installs playwright-core with `npm ci` in tests/browser; chromium must be at
//! /usr/bin/chromium (`apt-get install chromium`) or where `CHROMIUM` says. Screenshots
//! go under the target directory, or to docs/ with `OUTBOX_UPDATE_SCREENSHOTS=1`.

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
    time::Duration,
};

use crate::common::*;
use outbox_client::Connection;
use outbox_gateway::{
    auth::{Role, TokenConfig, token_digest},
    proto,
};
use tokio::{process::Command, sync::watch};
use uuid::Uuid;

const INSTALL_TIME: Duration = Duration::from_secs(300);
const RUN_TIME: Duration = Duration::from_secs(300);
/// Orders the producer writes; each has an order.created and an order.paid event.
const ORDERS: usize = 8;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn chromium() -> PathBuf {
    let path =
        PathBuf::from(std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into()));
    assert!(
        path.is_file(),
        "{} not found: install Debian's chromium (apt-get install chromium) or set CHROMIUM",
        path.display()
    );
    path
}

fn token(name: &str, roles: Vec<Role>) -> TokenConfig {
    TokenConfig {
        name: name.into(),
        sha256: token_digest(&format!("{name}-secret")),
        roles,
        event_types: Vec::new(),
        aggregate_types: Vec::new(),
        subscriptions: Vec::new(),
        sources: Vec::new(),
    }
}

fn subscription_of(name: &str, event_types: &[&str]) -> proto::Subscription {
    proto::Subscription {
        event_types: event_types
            .iter()
            .map(|pattern| pattern.to_string())
            .collect(),
        ..subscription(name)
    }
}

/// The events of one order, with ids chosen up front so the browser can look one up.
fn order_events(order: usize, paid_id: Uuid) -> Vec<proto::EventInput> {
    let order_id = format!("o-{}", 1040 + order);
    let traceparent = format!(
        "00-{}-{}-01",
        Uuid::new_v4().simple(),
        &Uuid::new_v4().simple().to_string()[..16]
    );
    let metadata = |kind: &str| {
        [
            ("tenant".to_owned(), "acme".to_owned()),
            ("source".to_owned(), format!("checkout/{kind}")),
            ("traceparent".to_owned(), traceparent.clone()),
        ]
        .into_iter()
        .collect()
    };
    let amount = format!("{}.90", 19 + order * 11);
    vec![
        proto::EventInput {
            id: Uuid::now_v7().to_string(),
            aggregate_type: "order".into(),
            aggregate_id: order_id.clone(),
            aggregate_version: Some(1),
            event_type: "order.created".into(),
            payload: serde_json::json!({
                "order_id": order_id,
                "customer": format!("c-{}", 300 + order % 3),
                "lines": [{"sku": "BOOK-42", "quantity": 1 + order % 2}],
            })
            .to_string()
            .into_bytes(),
            metadata: metadata("created"),
            ..Default::default()
        },
        proto::EventInput {
            id: paid_id.to_string(),
            aggregate_type: "order".into(),
            aggregate_id: order_id.clone(),
            aggregate_version: Some(2),
            event_type: "order.paid".into(),
            payload: serde_json::json!({
                "order_id": order_id,
                "amount": {"currency": "EUR", "value": amount},
                "method": if order.is_multiple_of(3) { "card" } else { "sepa" },
            })
            .to_string()
            .into_bytes(),
            metadata: metadata("paid"),
            ..Default::default()
        },
    ]
}

/// Reads the subscription and settles each delivery: rejects the first delivery of each
/// event `reject` names (with its reason) into the dead-letter queue, acks the rest,
/// until `stop` turns true. Any failure on the way panics, and the test joins the task.
async fn consume(
    connection: outbox_client::GatewayChannel,
    subscription: &'static str,
    reject: fn(&proto::Event) -> Option<&'static str>,
    mut stop: watch::Receiver<bool>,
) {
    let mut stream = connection
        .subscriber()
        .subscribe(proto::SubscribeRequest {
            subscription: subscription.into(),
            max_in_flight: 10,
            ..Default::default()
        })
        .await
        .expect("subscribe")
        .into_inner();
    let mut rejected = HashSet::new();
    loop {
        let delivery = tokio::select! {
            _ = stop.wait_for(|stop| *stop) => return,
            message = stream.message() => message
                .unwrap_or_else(|status| panic!("{subscription}: the stream failed: {status:?}"))
                .unwrap_or_else(|| panic!("{subscription}: the stream ended")),
        };
        let event = delivery.event.as_ref().expect("event");
        let mut subscriber = connection.subscriber();
        match reject(event) {
            Some(reason) if rejected.insert(event.id.clone()) => {
                subscriber
                    .nack(proto::NackRequest {
                        subscription: subscription.into(),
                        ack_id: delivery.ack_id,
                        reason: reason.into(),
                        dead_letter: true,
                        ..Default::default()
                    })
                    .await
                    .expect("nack");
            }
            _ => {
                let stale = subscriber
                    .ack(proto::AckRequest {
                        subscription: subscription.into(),
                        ack_ids: vec![delivery.ack_id],
                    })
                    .await
                    .expect("ack")
                    .into_inner()
                    .stale_ack_ids;
                assert!(stale.is_empty(), "{subscription}: stale acks {stale:?}");
            }
        }
    }
}

/// A consumer task that ended: its panic goes on in the test; ending by itself before
/// it was told to stop is a failure too.
fn consumer_ended(name: &str, ended: Result<(), tokio::task::JoinError>) -> ! {
    match ended {
        Err(failed) if failed.is_panic() => std::panic::resume_unwind(failed.into_panic()),
        Err(failed) => panic!("the {name} consumer was cancelled: {failed}"),
        Ok(()) => panic!("the {name} consumer stopped before the test ended"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_requeues_dead_letters_from_a_browser() {
    let chromium = chromium();
    run(
        "`npm ci` in tests/browser (Node.js and npm are required for the browser test)",
        Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund"])
            .current_dir(repo().join("tests/browser")),
        INSTALL_TIME,
    )
    .await;

    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.tokens = vec![
        token("alice", vec![Role::Admin]),
        token(
            "checkout",
            vec![Role::Publisher, Role::Subscriber, Role::Admin],
        ),
    ];
    config.console_rate_interval = Duration::from_secs(1);
    let gateway = TestGateway::start_with_console(&database, config).await;
    let connection = Connection::new(gateway.endpoint())
        .token("checkout-secret")
        .connect()
        .await
        .expect("connect with a token");
    let mut admin = connection.admin();
    for subscription in [
        subscription_of("orders-billing", &["order.*"]),
        subscription_of("orders-shipping", &["order.paid"]),
        subscription_of("analytics", &[]),
    ] {
        admin
            .create_subscription(proto::CreateSubscriptionRequest {
                subscription: Some(subscription),
                validate_only: false,
            })
            .await
            .expect("create subscription");
    }

    let (stop, stopped) = watch::channel(false);
    let mut billing = tokio::spawn(consume(
        connection.clone(),
        "orders-billing",
        |event| {
            (event.event_type == "order.paid").then(|| {
                if event.aggregate_id.ends_with(['1', '5']) {
                    "payment provider timed out after 30 s"
                } else {
                    "card declined: insufficient funds"
                }
            })
        },
        stopped.clone(),
    ));
    let mut shipping = tokio::spawn(consume(
        connection.clone(),
        "orders-shipping",
        |_| None,
        stopped,
    ));
    let paid: Vec<Uuid> = (0..ORDERS).map(|_| Uuid::now_v7()).collect();
    let producer = {
        let connection = connection.clone();
        let paid = paid.clone();
        tokio::spawn(async move {
            for (order, paid_id) in paid.into_iter().enumerate() {
                connection
                    .publisher()
                    .publish(proto::PublishRequest {
                        events: order_events(order, paid_id),
                        ..Default::default()
                    })
                    .await
                    .expect("publish");
                tokio::time::sleep(Duration::from_millis(700)).await;
            }
        })
    };

    let screenshots = if std::env::var_os("OUTBOX_UPDATE_SCREENSHOTS").is_some() {
        repo().join("docs")
    } else {
        Path::new(env!("CARGO_TARGET_TMPDIR")).join("console-screenshots")
    };
    std::fs::create_dir_all(&screenshots).expect("screenshot directory");
    let mut node = Command::new("node");
    node.arg("console.js")
        .current_dir(repo().join("tests/browser"))
        .env(
            "CONSOLE_URL",
            format!("http://{}", gateway.console.unwrap()),
        )
        .env("CONSOLE_TOKEN", "alice-secret")
        .env("SUBSCRIPTION", "orders-billing")
        .env("EVENT_TYPE", "order.paid")
        .env("EXPECTED_DEAD", ORDERS.to_string())
        .env("EVENT_ID", paid[0].to_string())
        .env("SCREENSHOTS", &screenshots)
        .env("CHROMIUM", &chromium);
    let browser = run("tests/browser/console.js", &mut node, RUN_TIME);
    // A consumer that fails meanwhile fails the test at once, with its own message.
    let output = tokio::select! {
        output = browser => output,
        ended = &mut billing => consumer_ended("orders-billing", ended),
        ended = &mut shipping => consumer_ended("orders-shipping", ended),
    };
    let steps: Vec<String> = output
        .lines()
        .map(|line| {
            let step: serde_json::Value =
                serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
            step["step"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(
        steps,
        [
            "signed in",
            "dead letters appeared",
            "subscription page",
            "requeued by filter",
            "delivered",
            "event looked up",
            "phone width"
        ]
    );
    producer.await.expect("producer");

    // What the browser saw is what the API says.
    let dead = admin
        .list_dead_letters(proto::ListDeadLettersRequest {
            subscription: "orders-billing".into(),
            include_resolved: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .dead_letters;
    assert!(dead.is_empty(), "{dead:?}");
    let stats = admin
        .get_stats(proto::GetStatsRequest {
            subscription: "orders-billing".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .subscriptions
        .remove(0);
    let events = 2 * ORDERS as u64;
    assert_eq!(
        (
            stats.lag_events,
            stats.dead_lettered,
            stats.acked_total,
            stats.delivered_total
        ),
        (0, 0, events, events + ORDERS as u64)
    );
    for name in [
        "console-overview.png",
        "console-subscription.png",
        "console-event.png",
    ] {
        let png = std::fs::read(screenshots.join(name)).expect(name);
        assert!(
            png.starts_with(b"\x89PNG") && png.len() > 10_000,
            "{name} is no screenshot"
        );
    }
    let _ = stop.send(true);
    for (name, consumer) in [("orders-billing", billing), ("orders-shipping", shipping)] {
        if let Err(failed) = consumer.await {
            consumer_ended(name, Err(failed));
        }
    }
}
