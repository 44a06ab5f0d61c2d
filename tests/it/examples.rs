//! The Python and Node.js examples, run against a live gateway, and the generated API
//! reference. The test installs what the examples need: a Python virtual environment
//! under the target directory (reused while requirements.txt is unchanged) with the
//! Python client package (clients/python) installed editable, and the Node.js client
//! package (clients/node, installed and built) with `npm ci` in
//! examples/node, which links to it. A missing python3, pip, node or npm fails the test;
//! `PYTHON` names another Python 3 to build the environment with.

use std::{
    collections::BTreeSet,
    fs::File,
    path::{Path, PathBuf},
    time::Duration,
};

use crate::{clients::node::built_package, common::*};
use outbox_gateway::proto::{GetStatsRequest, ListDeadLettersRequest};
use serde_json::Value;
use tokio::process::Command;

const INSTALL_TIME: Duration = Duration::from_secs(300);
const RUN_TIME: Duration = Duration::from_secs(60);

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The examples' virtual environment, rebuilt when requirements.txt changes; returns its
/// Python. Its `-e ../../clients/python` line, relative to examples/python where a
/// reader runs pip, is handed to pip as an absolute path.
async fn python_env() -> PathBuf {
    let packages: Vec<String> = requirements("examples/python/requirements.txt")
        .into_iter()
        .map(|line| match line.strip_prefix("-e ") {
            Some(path) => format!(
                "--editable={}",
                repo().join("examples/python").join(path.trim()).display()
            ),
            None => line,
        })
        .collect();
    python_venv(
        "examples",
        &packages.iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .await
}

/// Installs and builds the client package the Node.js examples link to
/// (`file:../../clients/node`), then the examples' dependencies exactly as
/// package-lock.json pins them. Returns the shared lock on the built package (see
/// [`built_package`]).
async fn npm_ci() -> File {
    let lock = built_package().await;
    run(
        "`npm ci` in examples/node (Node.js and npm are required for the examples)",
        Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund"])
            .current_dir(repo().join("examples/node")),
        INSTALL_TIME,
    )
    .await;
    lock
}

/// One language's three example programs.
struct Examples {
    language: &'static str,
    interpreter: PathBuf,
    extension: &'static str,
    subscription: &'static str,
}

impl Examples {
    /// Runs program `name` against the gateway and its database, configured through the
    /// environment variables the examples document.
    async fn run(&self, gateway: &TestGateway, name: &str, args: &[&str]) -> String {
        let script = format!("{name}.{}", self.extension);
        run(
            &format!("examples/{}/{script}", self.language),
            Command::new(&self.interpreter)
                .arg(&script)
                .args(args)
                .current_dir(repo().join("examples").join(self.language))
                .env("OUTBOX_ENDPOINT", gateway.endpoint())
                .env("DATABASE_URL", gateway.database.url()),
            RUN_TIME,
        )
        .await
    }
}

fn json_lines(output: &str) -> Vec<Value> {
    output
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
        .collect()
}

fn text(value: &Value) -> String {
    value.as_str().expect("a string").to_owned()
}

#[tokio::test]
async fn python_and_node_examples_publish_and_consume_through_the_gateway() {
    let (python, _node_client) = tokio::join!(python_env(), npm_ci());

    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let languages = [
        Examples {
            language: "python",
            interpreter: python,
            extension: "py",
            subscription: "orders-python",
        },
        Examples {
            language: "node",
            interpreter: "node".into(),
            extension: "js",
            subscription: "orders-node",
        },
    ];

    // Both languages publish over gRPC (the last event is the poison one) and from SQL.
    let mut delivered = BTreeSet::new();
    let mut poison = BTreeSet::new();
    let mut rolled_back = Vec::new();
    for examples in &languages {
        let ids: Vec<String> = examples
            .run(&gateway, "publish", &["--poison"])
            .await
            .lines()
            .map(str::to_owned)
            .collect();
        assert_eq!(
            ids.len(),
            3,
            "{} publish printed {ids:?}",
            examples.language
        );
        poison.insert(ids[2].clone());
        delivered.extend(ids);

        for order in json_lines(&examples.run(&gateway, "transactional", &[]).await) {
            if order["committed"] == true {
                delivered.insert(text(&order["event_id"]));
            } else {
                rolled_back.push((text(&order["order_id"]), text(&order["event_id"])));
            }
        }
    }
    assert_eq!((delivered.len(), rolled_back.len()), (8, 2));

    // Each consumer has its own subscription, so each gets every event of both languages.
    let count = delivered.len().to_string();
    for examples in &languages {
        let output = examples
            .run(
                &gateway,
                "consumer",
                &["--max-deliveries", &count, "--timeout", "30"],
            )
            .await;
        let deliveries = json_lines(&output);
        let received: BTreeSet<String> = deliveries.iter().map(|d| text(&d["id"])).collect();
        assert_eq!(
            received, delivered,
            "{} consumer:\n{output}",
            examples.language
        );
        for delivery in &deliveries {
            let expected = if poison.contains(&text(&delivery["id"])) {
                "dead-lettered"
            } else {
                "acked"
            };
            assert_eq!(delivery["settled"], expected, "{delivery}");
        }
    }

    // Exactly once: each language consumes every event in its own transactions, never
    // acks, and the gateway settles every delivery all the same.
    for examples in &languages {
        let output = examples
            .run(
                &gateway,
                "exactly_once",
                &["--max-deliveries", &count, "--timeout", "30"],
            )
            .await;
        let consumed: BTreeSet<String> = json_lines(&output)
            .iter()
            .filter(|line| line["consumed"] == true)
            .map(|line| text(&line["event_id"]))
            .collect();
        assert_eq!(
            consumed, delivered,
            "{} exactly_once:\n{output}",
            examples.language
        );
        let subscription = format!("orders-exactly-once-{}", examples.language);
        eventually("the consumed deliveries are settled", RUN_TIME, || async {
            let stats = subscription_stats(&gateway, &subscription).await;
            (
                stats.lag_events,
                stats.acked_total,
                stats.consumption_records,
            ) == (0, 8, 8)
        })
        .await;
    }
    let shipped: (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM shipments), \
                (SELECT count(*) FROM outbox_events WHERE event_type = 'shipment.requested')",
    )
    .fetch_one(&database.pool().await)
    .await
    .expect("count shipments");
    assert_eq!(
        shipped,
        (16, 16),
        "a shipment and its event per event and language"
    );

    let mut admin = gateway.admin().await;
    for examples in &languages {
        let subscription = examples.subscription.to_owned();
        let letters = admin
            .list_dead_letters(ListDeadLettersRequest {
                subscription: subscription.clone(),
                ..Default::default()
            })
            .await
            .expect("list dead letters")
            .into_inner()
            .dead_letters;
        let ids: BTreeSet<String> = letters
            .iter()
            .map(|letter| letter.event.as_ref().expect("event").id.clone())
            .collect();
        assert_eq!(ids, poison, "dead letters of {subscription}");
        assert!(letters.iter().all(|l| l.last_error == "poison message"));

        // Nothing else is on its way: the rolled-back events were not merely late.
        let stats = admin
            .get_stats(GetStatsRequest {
                subscription: subscription.clone(),
            })
            .await
            .expect("stats")
            .into_inner()
            .subscriptions;
        assert_eq!(
            (
                stats[0].lag_events,
                stats[0].delivered_total,
                stats[0].acked_total
            ),
            (0, 8, 6),
            "stats of {subscription}"
        );
    }

    let pool = database.pool().await;
    for (order, event) in rolled_back {
        let stored: (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM orders WHERE id = $1), \
                    (SELECT count(*) FROM outbox_events WHERE id = $2::uuid)",
        )
        .bind(&order)
        .bind(&event)
        .fetch_one(&pool)
        .await
        .expect("look up the rolled-back order");
        assert_eq!(stored, (0, 0), "rolled-back order {order} / event {event}");
    }
}

#[tokio::test]
async fn api_reference_matches_the_proto_comments() {
    let python = python_env().await;
    let generated = run(
        "scripts/gen-api-docs.py",
        Command::new(&python)
            .arg(repo().join("scripts/gen-api-docs.py"))
            .arg("-"),
        RUN_TIME,
    )
    .await;
    let committed = std::fs::read_to_string(repo().join("docs/api.md")).expect("docs/api.md");
    if generated != committed {
        let line = generated
            .lines()
            .zip(committed.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| generated.lines().count().min(committed.lines().count()));
        panic!(
            "docs/api.md is stale (first difference at line {}): regenerate it with \
             `{} scripts/gen-api-docs.py`",
            line + 1,
            python.display()
        );
    }
}

#[tokio::test]
async fn python_push_receiver_verifies_signatures_with_standardwebhooks() {
    python_push_receiver(None).await;
}

#[tokio::test]
async fn python_push_receiver_verifies_batches_with_standardwebhooks() {
    python_push_receiver(Some(10)).await;
}

/// The example receiver verifies and reads every event pushed to it, one per request or
/// in batches of `batch` events.
async fn python_push_receiver(batch: Option<u32>) {
    const EVENTS: usize = 6;
    let python = python_env().await;
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.push.allowed_hosts =
        outbox_gateway::domain::AllowedHosts::parse(&["127.0.0.1".to_owned()]).unwrap();
    config.push.poll_interval = Duration::from_millis(500);
    let gateway = TestGateway::start_with(&database, config).await;
    let port = outbox_testkit::gateway::free_loopback_address()
        .expect("a free port")
        .port()
        .to_string();
    let created = create_subscription(
        &gateway,
        outbox_gateway::proto::Subscription {
            push: Some(outbox_gateway::proto::PushConfig {
                endpoint: format!("http://127.0.0.1:{port}/events"),
                max_batch_events: batch.unwrap_or(0),
                max_batch_wait: batch.map(|_| prost_types::Duration {
                    seconds: 0,
                    nanos: 300_000_000,
                }),
                ..Default::default()
            }),
            // Until the receiver listens the gateway's requests are refused: retry soon.
            retry_backoff_min: Some(prost_types::Duration {
                seconds: 0,
                nanos: 200_000_000,
            }),
            retry_backoff_max: Some(prost_types::Duration {
                seconds: 1,
                nanos: 0,
            }),
            max_attempts: Some(0),
            ..subscription("orders-push")
        },
    )
    .await;
    let secret = created.push.expect("push").signing_secret;

    let mut command = Command::new(&python);
    command
        .args([
            "push_receiver.py",
            "--port",
            &port,
            "--max-events",
            &EVENTS.to_string(),
            "--timeout",
            "60",
        ])
        .current_dir(repo().join("examples/python"))
        .env("PUSH_SECRET", &secret);
    let receiver = tokio::spawn(async move {
        run("examples/python/push_receiver.py", &mut command, RUN_TIME).await
    });

    // A request with a forged signature is refused by the package's verification.
    let forged = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{port}/events");
    let refused = poll_until(RUN_TIME, POLL, || async {
        let answer = forged
            .post(&url)
            .header("webhook-id", "forged")
            .header(
                "webhook-timestamp",
                chrono::Utc::now().timestamp().to_string(),
            )
            .header(
                "webhook-signature",
                "v1,AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
            )
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .ok()?;
        Some(answer.status().as_u16())
    })
    .await;
    assert_eq!(refused, Some(401), "a forged signature is refused");

    let published: BTreeSet<String> = publish_ids(&gateway, orders(EVENTS))
        .await
        .into_iter()
        .collect();
    let output = receiver.await.expect("receiver task");
    let events = json_lines(&output);
    let received: BTreeSet<String> = events.iter().map(|e| text(&e["id"])).collect();
    assert_eq!(received, published, "receiver output:\n{output}");
    let transactions: BTreeSet<String> = events.iter().map(|e| text(&e["transactionid"])).collect();
    assert_eq!(transactions.len(), 1, "one Publish call: {transactions:?}");
    for event in &events {
        assert_eq!(event["type"], "order.created");
        assert_eq!(event["source"], "/sources/default/aggregates/order");
        assert_eq!(
            event["mode"],
            if batch.is_some() { "batch" } else { "binary" }
        );
        assert_eq!(event["data"]["aggregate"], event["subject"]);
    }
}
