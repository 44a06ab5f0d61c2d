//! Subscriptions as code: `apply -f FILE` and `export`, run as the built binary
//! against a live gateway.

use outbox_domain::AllowedHosts;
use outbox_gateway::proto;
use outbox_gateway::sinks::SinkSettings;
use serde_json::Value;

use crate::cli::{Run, at_terminal, cli, cli_with_env, cli_with_input};
use crate::common::*;

/// Every setting a subscription has, over three subscriptions.
const EVERY_FIELD: &str = r#"
subscriptions:
  - name: billing.orders
    event_types: ["order.*", "invoice.**"]
    aggregate_types: [order]
    metadata_match: {tenant: acme}
    filter: payload.total > 1000.0
    transform: '{"id": id, "total": payload.total}'
    start: earliest
    ack_deadline: 1m
    max_attempts: 5
    retry_backoff_min: 2s
    retry_backoff_max: 1h
    persistent_event_types: [order.paid]
    max_event_age: 2h 30m
    dead_letter_expired: true
  - name: shipping
    ordered: true
    sources: [default]
    expire_after_idle: 1d
    paused: true
    pause_reason: waiting for the carrier's API
    sink:
      name: js
      subject: "shipping.{aggregate_type}.{event_type}"
  - name: webhooks
    start: "2026-01-01T00:00:00Z"
    paused: true
    push:
      endpoint: http://127.0.0.1:9/hooks
      headers:
        Authorization: "Bearer ${OUTBOX_TEST_RECEIVER_TOKEN}"
      format: structured
      timeout: 5s
      max_concurrency: 4
      rate_limit: 50.5
      max_batch_events: 100
      max_batch_bytes: 65536
      max_batch_wait: 50ms
"#;

const RECEIVER_TOKEN: (&str, &str) = ("OUTBOX_TEST_RECEIVER_TOKEN", "receiver-secret");

/// A gateway that may push to 127.0.0.1 and has the NATS sink `js`.
async fn gateway(database: &std::sync::Arc<TestDatabase>) -> TestGateway {
    let mut config = test_config(database.url());
    config.push.allowed_hosts = AllowedHosts::parse(
        &["127.0.0.1", "*.example.com", "*.svc.cluster.local"].map(String::from),
    )
    .unwrap();
    config.sinks = vec![SinkSettings {
        name: "js".into(),
        kind: "nats".into(),
        servers: vec!["nats://127.0.0.1:4222".into()],
        ..Default::default()
    }];
    TestGateway::start_with(database, config).await
}

/// `apply` with `args` after `-f -`, the file on standard input.
async fn apply(gateway: &TestGateway, file: &str, args: &[&str]) -> Run {
    let mut all = vec!["apply", "-f", "-"];
    all.extend_from_slice(args);
    // The header variables of EVERY_FIELD and of the example files.
    let env = [
        RECEIVER_TOKEN,
        ("CRM_TOKEN", "crm-secret"),
        ("RECEIVER_TOKEN", "receiver-secret"),
    ];
    cli_with_env(&gateway.endpoint(), &all, &env, Some(file)).await
}

/// `apply --json`, which must succeed: what it reports.
async fn applied(gateway: &TestGateway, file: &str, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    let run = apply(gateway, file, &all).await;
    run.json()
}

fn names(report: &Value, key: &str) -> Vec<String> {
    report[key]
        .as_array()
        .unwrap_or_else(|| panic!("{key} in {report}"))
        .iter()
        .map(|name| name.as_str().unwrap().to_owned())
        .collect()
}

/// The fields `apply` reports changed for `name`, as "field: from -> to".
fn changes(report: &Value, name: &str) -> Vec<String> {
    let changed = report["changed"].as_array().unwrap();
    let Some(entry) = changed.iter().find(|entry| entry["name"] == name) else {
        return Vec::new();
    };
    entry["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|change| {
            format!(
                "{}: {} -> {}",
                change["field"].as_str().unwrap(),
                change["from"],
                change["to"]
            )
        })
        .collect()
}

async fn subscriptions(gateway: &TestGateway) -> Vec<proto::Subscription> {
    gateway
        .admin()
        .await
        .list_subscriptions(proto::ListSubscriptionsRequest {})
        .await
        .unwrap()
        .into_inner()
        .subscriptions
}

fn seconds_of(duration: &Option<prost_types::Duration>) -> i64 {
    duration.as_ref().map_or(-1, |duration| duration.seconds)
}

#[tokio::test]
async fn apply_creates_every_setting_and_then_reports_no_change() {
    let database = TestDatabase::create().await;
    let gateway = gateway(&database).await;

    let report = applied(&gateway, EVERY_FIELD, &[]).await;
    assert_eq!(
        names(&report, "created"),
        ["billing.orders", "shipping", "webhooks"]
    );
    let secret = report["signing_secrets"]["webhooks"]
        .as_str()
        .unwrap_or_default();
    assert!(secret.starts_with("whsec_"), "{report}");

    let billing = stored_subscription(&gateway, "billing.orders").await;
    assert_eq!(billing.event_types, ["order.*", "invoice.**"]);
    assert_eq!(billing.aggregate_types, ["order"]);
    assert_eq!(billing.metadata_match["tenant"], "acme");
    assert_eq!(billing.filter, "payload.total > 1000.0");
    assert_eq!(billing.transform, r#"{"id": id, "total": payload.total}"#);
    assert_eq!(seconds_of(&billing.ack_deadline), 60);
    assert_eq!(billing.max_attempts, Some(5));
    assert_eq!(seconds_of(&billing.retry_backoff_min), 2);
    assert_eq!(seconds_of(&billing.retry_backoff_max), 3600);
    assert_eq!(billing.persistent_event_types, ["order.paid"]);
    assert_eq!(seconds_of(&billing.max_event_age), 9000);
    assert!(billing.dead_letter_expired && !billing.paused && !billing.ordered);

    let shipping = stored_subscription(&gateway, "shipping").await;
    assert!(shipping.ordered && shipping.paused);
    assert_eq!(shipping.sources, ["default"]);
    assert_eq!(seconds_of(&shipping.expire_after_idle), 86_400);
    assert_eq!(shipping.pause_reason, "waiting for the carrier's API");
    let sink = shipping.sink.expect("a sink");
    assert_eq!(
        (sink.name.as_str(), sink.subject.as_str()),
        ("js", "shipping.{aggregate_type}.{event_type}")
    );

    let webhooks = stored_subscription(&gateway, "webhooks").await;
    let push = webhooks.push.expect("push");
    assert_eq!(push.endpoint, "http://127.0.0.1:9/hooks");
    // The variable was read from the environment; the gateway shows its fingerprint.
    assert_eq!(
        push.headers["authorization"],
        outbox_domain::fingerprint("Bearer receiver-secret")
    );
    assert_eq!(push.format, proto::PushFormat::CloudeventsStructured as i32);
    assert_eq!(seconds_of(&push.timeout), 5);
    assert_eq!(push.max_concurrency, 4);
    assert_eq!(push.rate_limit, Some(50.5));
    assert_eq!(push.max_batch_events, 100);
    assert_eq!(push.max_batch_bytes, 65536);
    assert_eq!(
        push.max_batch_wait.as_ref().map(|wait| wait.nanos),
        Some(50_000_000)
    );

    // Idempotent: nothing differs the second time.
    let again = applied(&gateway, EVERY_FIELD, &[]).await;
    assert_eq!(
        names(&again, "unchanged"),
        ["billing.orders", "shipping", "webhooks"],
        "{again}"
    );
    assert!(
        names(&again, "created").is_empty() && again["changed"] == serde_json::json!([]),
        "{again}"
    );
    assert!(
        again["signing_secrets"].as_object().unwrap().is_empty(),
        "{again}"
    );

    // export | apply -f - is a no-op, and the export holds no secret.
    let exported = cli(&gateway, &["export"]).await;
    assert!(exported.success, "{}", exported.stderr);
    assert!(
        !exported.stdout.contains("receiver-secret"),
        "{}",
        exported.stdout
    );
    assert!(!exported.stdout.contains("whsec_"), "{}", exported.stdout);
    assert!(
        exported.stdout.contains("max_event_age: 2h 30m"),
        "{}",
        exported.stdout
    );
    let round_trip = applied(&gateway, &exported.stdout, &[]).await;
    assert_eq!(
        names(&round_trip, "unchanged"),
        ["billing.orders", "shipping", "webhooks"],
        "{round_trip}"
    );

    // The export also sets up an empty gateway the same way, once the header's value
    // is given: a fingerprint keeps a stored value, and a new gateway has none.
    let fresh_database = TestDatabase::create().await;
    let fresh = self::gateway(&fresh_database).await;
    let refused = apply(&fresh, &exported.stdout, &[]).await;
    assert_eq!(refused.code, Some(2), "{}", refused.stderr);
    assert!(
        refused
            .stderr
            .contains("subscriptions[2].push.headers.authorization: sha256:"),
        "{}",
        refused.stderr
    );
    assert!(subscriptions(&fresh).await.is_empty());
    let with_value = exported.stdout.replace(
        &outbox_domain::fingerprint("Bearer receiver-secret"),
        "Bearer ${OUTBOX_TEST_RECEIVER_TOKEN}",
    );
    let recreated = applied(&fresh, &with_value, &[]).await;
    assert_eq!(
        names(&recreated, "created"),
        ["billing.orders", "shipping", "webhooks"]
    );
    let exported_again = cli(&fresh, &["export"]).await;
    assert_eq!(exported_again.stdout, exported.stdout);
}

#[tokio::test]
async fn apply_shows_changes_field_by_field_and_a_dry_run_changes_nothing() {
    let database = TestDatabase::create().await;
    let gateway = gateway(&database).await;
    applied(&gateway, EVERY_FIELD, &[]).await;
    let before = subscriptions(&gateway).await;

    let edited = EVERY_FIELD
        .replace("ack_deadline: 1m", "ack_deadline: 90s")
        .replace(
            r#"event_types: ["order.*", "invoice.**"]"#,
            r#"event_types: ["order.*"]"#,
        )
        .replace("    filter: payload.total > 1000.0\n", "")
        .replace("max_batch_events: 100", "max_batch_events: 10")
        .replace(
            "    paused: true\n    pause_reason: waiting for the carrier's API\n",
            "    paused: false\n",
        );
    let dry = applied(&gateway, &edited, &["--dry-run"]).await;
    assert_eq!(dry["dry_run"], true);
    assert_eq!(
        changes(&dry, "billing.orders"),
        [
            r#"event_types: ["order.*","invoice.**"] -> ["order.*"]"#,
            r#"filter: "payload.total > 1000.0" -> null"#,
            r#"ack_deadline: "1m" -> "1m 30s""#,
        ]
    );
    assert_eq!(
        changes(&dry, "shipping"),
        [
            "paused: true -> false",
            r#"pause_reason: "waiting for the carrier's API" -> null"#
        ]
    );
    assert_eq!(
        changes(&dry, "webhooks"),
        ["push.max_batch_events: 100 -> 10"]
    );
    assert_eq!(
        subscriptions(&gateway).await,
        before,
        "a dry run changed something"
    );

    // The text says the same, in words.
    let text = apply(&gateway, &edited, &["--dry-run"]).await;
    assert!(text.success, "{}", text.stderr);
    assert!(text.stdout.contains("would change billing.orders\n  event_types: [\"order.*\",\"invoice.**\"] -> [\"order.*\"]\n"), "{}", text.stdout);
    assert!(
        text.stdout.contains("  ack_deadline: 1m -> 1m 30s\n"),
        "{}",
        text.stdout
    );
    assert!(
        text.stdout
            .contains("dry run, nothing was changed: 0 created, 3 changed, 0 unchanged, 0 deleted"),
        "{}",
        text.stdout
    );

    let report = applied(&gateway, &edited, &[]).await;
    assert_eq!(report["dry_run"], false);
    assert_eq!(
        changes(&report, "webhooks"),
        ["push.max_batch_events: 100 -> 10"]
    );
    let billing = stored_subscription(&gateway, "billing.orders").await;
    assert_eq!(seconds_of(&billing.ack_deadline), 90);
    assert_eq!(billing.event_types, ["order.*"]);
    assert_eq!(billing.filter, "");
    assert!(!stored_subscription(&gateway, "shipping").await.paused);
    let webhooks = stored_subscription(&gateway, "webhooks").await;
    assert_eq!(webhooks.push.as_ref().unwrap().max_batch_events, 10);
    // The push stayed on: no new signing secret.
    assert!(
        report["signing_secrets"].as_object().unwrap().is_empty(),
        "{report}"
    );

    let again = applied(&gateway, &edited, &[]).await;
    assert_eq!(names(&again, "unchanged").len(), 3, "{again}");

    // A pause made by hand outlives an apply of a file that does not mention it.
    let paused = cli(
        &gateway,
        &[
            "subscriptions",
            "pause",
            "billing.orders",
            "--reason",
            "incident",
        ],
    )
    .await;
    assert!(paused.success, "{}", paused.stderr);
    let kept = applied(&gateway, &edited, &[]).await;
    assert_eq!(names(&kept, "unchanged").len(), 3, "{kept}");
    assert!(stored_subscription(&gateway, "billing.orders").await.paused);
}

#[tokio::test]
async fn a_broken_file_is_refused_whole_with_the_path_of_the_bad_field() {
    let database = TestDatabase::create().await;
    let gateway = gateway(&database).await;
    applied(
        &gateway,
        "subscriptions:\n  - name: existing\n    ordered: true\n",
        &[],
    )
    .await;
    let before = subscriptions(&gateway).await;

    let valid = "subscriptions:\n  - name: fresh\n  - name: existing\n    ordered: true\n    ack_deadline: 2m\n";
    let cases: Vec<(String, &str)> = vec![
        // Checked by the gateway: nothing before the bad entry is applied either.
        (
            format!("{valid}  - name: other\n  - name: bad\n    ack_deadline: 0s\n"),
            "subscriptions[3].ack_deadline: ",
        ),
        (
            format!("{valid}  - name: bad\n    filter: 'payload.total >'\n"),
            "subscriptions[2].filter: syntax error at 1:",
        ),
        (
            format!("{valid}  - name: bad\n    push: {{endpoint: 'http://elsewhere.example/x'}}\n"),
            "subscriptions[2].push.endpoint: ",
        ),
        (
            format!("{valid}  - name: bad\n    sink: {{name: missing}}\n"),
            "subscriptions[2].sink",
        ),
        (
            format!("{valid}  - name: bad\n    sources: [nowhere]\n"),
            "subscriptions[2].sources[0]: ",
        ),
        (
            format!("{valid}  - name: Bad Name\n"),
            "subscriptions[2].name: ",
        ),
        // Fixed at creation.
        (
            "subscriptions:\n  - name: fresh\n  - name: existing\n".into(),
            "subscriptions[1].ordered: cannot change after creation",
        ),
        // Checked before asking the gateway.
        (
            format!("{valid}  - name: bad\n    max_attempts: many\n"),
            "subscriptions[2].max_attempts: ",
        ),
        (
            format!("{valid}  - name: bad\n    ack_deadline: soon\n"),
            "subscriptions[2].ack_deadline: \"soon\" is not a duration",
        ),
        (
            format!("{valid}  - name: bad\n    ackdeadline: 1s\n"),
            "subscriptions[2].ackdeadline: unknown field",
        ),
        (
            format!("{valid}  - name: fresh\n"),
            "subscriptions[2].name: \"fresh\" is named already by subscriptions[0]",
        ),
        (
            format!(
                "{valid}  - name: bad\n    push:\n      endpoint: http://127.0.0.1:9/\n      headers: {{X-Key: '${{OUTBOX_TEST_UNSET_VARIABLE}}'}}\n"
            ),
            "subscriptions[2].push.headers.X-Key: the environment variable OUTBOX_TEST_UNSET_VARIABLE is not set",
        ),
        (
            "subscriptions: {name: x}\n".into(),
            "subscriptions: invalid type",
        ),
    ];
    for (file, expected) in cases {
        let run = apply(&gateway, &file, &[]).await;
        assert_eq!(run.code, Some(2), "{file}\n{}", run.stderr);
        assert!(
            run.stderr.contains(expected),
            "expected {expected:?} for\n{file}\ngot: {}",
            run.stderr
        );
        assert_eq!(
            subscriptions(&gateway).await,
            before,
            "{file} changed something"
        );
    }
    let missing = cli(
        &gateway,
        &["apply", "-f", "/nonexistent/subscriptions.yaml"],
    )
    .await;
    assert_eq!(missing.code, Some(2));
    assert!(
        missing
            .stderr
            .contains("cannot read /nonexistent/subscriptions.yaml"),
        "{}",
        missing.stderr
    );
}

#[tokio::test]
async fn prune_deletes_what_the_file_does_not_name_once_confirmed() {
    let database = TestDatabase::create().await;
    let gateway = gateway(&database).await;
    for name in ["alpha", "beta", "gamma"] {
        create_subscription(&gateway, subscription(name)).await;
    }
    let file = "subscriptions:\n  - name: alpha\n";
    let all = || async {
        subscriptions(&gateway)
            .await
            .into_iter()
            .map(|s| s.name)
            .collect::<Vec<_>>()
    };

    let kept = applied(&gateway, file, &[]).await;
    assert_eq!(names(&kept, "not_in_file"), ["beta", "gamma"]);
    assert_eq!(all().await, ["alpha", "beta", "gamma"]);

    let dry = applied(&gateway, file, &["--prune", "--dry-run"]).await;
    assert_eq!(names(&dry, "deleted"), ["beta", "gamma"]);
    assert_eq!(all().await, ["alpha", "beta", "gamma"]);

    // Not at a terminal, pruning needs --yes, and nothing changes without it.
    let unconfirmed = apply(
        &gateway,
        "subscriptions:\n  - name: alpha\n  - name: delta\n",
        &["--prune"],
    )
    .await;
    assert_eq!(unconfirmed.code, Some(1), "{}", unconfirmed.stderr);
    assert!(
        unconfirmed.stderr.contains("pass --yes"),
        "{}",
        unconfirmed.stderr
    );
    assert!(
        unconfirmed.stderr.contains("beta, gamma"),
        "{}",
        unconfirmed.stderr
    );
    assert_eq!(all().await, ["alpha", "beta", "gamma"]);

    // At a terminal it shows them and asks.
    let path = std::env::temp_dir().join(format!("outbox-apply-{}.yaml", uuid::Uuid::new_v4()));
    std::fs::write(&path, file).unwrap();
    let command = format!(
        "{} apply -f {} --prune --endpoint {}",
        env!("CARGO_BIN_EXE_outbox-gateway"),
        path.display(),
        gateway.endpoint()
    );
    let (declined, screen) = at_terminal(&command, "n\n").await;
    assert!(!declined, "{screen}");
    assert!(
        screen.contains("delete 2 subscriptions, which the file does not name")
            && screen.contains("beta, gamma"),
        "{screen}"
    );
    assert_eq!(all().await, ["alpha", "beta", "gamma"]);
    let (confirmed, screen) = at_terminal(&command, "y\n").await;
    assert!(confirmed, "{screen}");
    assert!(
        screen.contains("deleted beta") && screen.contains("deleted gamma"),
        "{screen}"
    );
    assert_eq!(all().await, ["alpha"]);
    std::fs::remove_file(&path).unwrap();

    create_subscription(&gateway, subscription("epsilon")).await;
    // An ephemeral one, as `tail` makes, is not the file's to prune.
    create_subscription(
        &gateway,
        proto::Subscription {
            expire_after_idle: Some(prost_types::Duration {
                seconds: 300,
                nanos: 0,
            }),
            ..subscription("tail-1")
        },
    )
    .await;
    let pruned = applied(&gateway, file, &["--prune", "--yes"]).await;
    assert_eq!(names(&pruned, "deleted"), ["epsilon"]);
    assert_eq!(all().await, ["alpha", "tail-1"]);
}

#[tokio::test]
async fn concurrent_applies_of_one_file_agree() {
    let database = TestDatabase::create().await;
    let gateway = gateway(&database).await;
    let file: String = std::iter::once("subscriptions:\n".to_owned())
        .chain((0..8).map(|i| format!("  - name: s{i}\n    ack_deadline: {}s\n", 10 + i)))
        .collect();
    let (first, second) = tokio::join!(
        apply(&gateway, &file, &["--json"]),
        apply(&gateway, &file, &["--json"])
    );
    let (first, second) = (first.json(), second.json());
    // Each subscription was created by one of them; the other found it made.
    for i in 0..8 {
        let name = format!("s{i}");
        let created = [&first, &second]
            .iter()
            .filter(|report| names(report, "created").contains(&name))
            .count();
        assert!(created <= 1, "{name} created twice: {first} {second}");
    }
    let stored = subscriptions(&gateway).await;
    assert_eq!(stored.len(), 8);
    for (i, subscription) in stored.iter().enumerate() {
        assert_eq!(seconds_of(&subscription.ack_deadline), 10 + i as i64);
    }
    let again = applied(&gateway, &file, &[]).await;
    assert_eq!(names(&again, "unchanged").len(), 8, "{again}");
}

#[tokio::test]
async fn apply_needs_an_admin_token_and_export_a_viewer_one() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    let token = |name: &str, role| outbox_gateway::auth::TokenConfig {
        name: name.into(),
        sha256: outbox_gateway::auth::token_digest(&format!("{name}-secret")),
        roles: vec![role],
        event_types: Vec::new(),
        aggregate_types: Vec::new(),
        subscriptions: Vec::new(),
        sources: Vec::new(),
    };
    config.tokens = vec![
        token("ops", outbox_gateway::auth::Role::Admin),
        token("watcher", outbox_gateway::auth::Role::Viewer),
    ];
    let gateway = TestGateway::start_with(&database, config).await;
    let file = "subscriptions:\n  - name: orders\n";
    let as_token = |token: &'static str, args: &'static [&'static str]| {
        let endpoint = gateway.endpoint();
        async move { cli_with_env(&endpoint, args, &[("OUTBOX_TOKEN", token)], Some(file)).await }
    };

    for args in [
        &["apply", "-f", "-"][..],
        &["apply", "-f", "-", "--dry-run"],
    ] {
        let viewer = as_token("watcher-secret", args).await;
        assert_eq!(viewer.code, Some(1), "{}", viewer.stderr);
        assert!(
            viewer.stderr.contains("permission denied"),
            "{}",
            viewer.stderr
        );
    }
    let anonymous = cli_with_input(&gateway.endpoint(), &["apply", "-f", "-"], Some(file)).await;
    assert!(
        anonymous.stderr.contains("unauthenticated"),
        "{}",
        anonymous.stderr
    );

    let admin = as_token("ops-secret", &["apply", "-f", "-"]).await;
    assert!(admin.success, "{}", admin.stderr);
    assert!(admin.stdout.contains("created orders"), "{}", admin.stdout);
    let exported = as_token("watcher-secret", &["export"]).await;
    assert!(exported.success, "{}", exported.stderr);
    assert!(
        exported.stdout.contains("- name: orders"),
        "{}",
        exported.stdout
    );
}

#[tokio::test]
async fn the_example_files_apply_and_the_schema_is_printed() {
    let database = TestDatabase::create().await;
    let gateway = gateway(&database).await;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for example in [
        "examples/subscriptions.yaml",
        "deploy/kubernetes/subscriptions/subscriptions.yaml",
    ] {
        let file = std::fs::read_to_string(root.join(example)).unwrap();
        let report = applied(&gateway, &file, &["--dry-run"]).await;
        assert!(!names(&report, "created").is_empty(), "{example}: {report}");
    }
    let schema = cli(&gateway, &["export", "--schema"]).await;
    let published = std::fs::read_to_string(root.join("docs/subscriptions.schema.json")).unwrap();
    assert!(
        schema.success && schema.stdout == published,
        "`export --schema` differs from docs/subscriptions.schema.json: {}",
        schema.stderr
    );
}

#[tokio::test]
async fn validate_only_checks_a_create_or_update_and_changes_nothing() {
    let database = TestDatabase::create().await;
    let gateway = gateway(&database).await;
    let mut admin = gateway.admin().await;
    let create = |subscription: proto::Subscription| proto::CreateSubscriptionRequest {
        subscription: Some(subscription),
        validate_only: true,
    };

    let would_be = admin
        .create_subscription(create(proto::Subscription {
            push: Some(proto::PushConfig {
                endpoint: "http://127.0.0.1:9/hooks".into(),
                ..Default::default()
            }),
            ..subscription("orders")
        }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(would_be.name, "orders");
    // As created, with its defaults, but no secret is made.
    assert_eq!(seconds_of(&would_be.ack_deadline), 30);
    assert_eq!(would_be.push.as_ref().unwrap().signing_secret, "");
    assert!(subscriptions(&gateway).await.is_empty());

    let refused = admin
        .create_subscription(create(proto::Subscription {
            ack_deadline: Some(prost_types::Duration {
                seconds: 0,
                nanos: 0,
            }),
            ..subscription("orders")
        }))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused.message().starts_with("subscription.ack_deadline"),
        "{refused:?}"
    );

    create_subscription(&gateway, subscription("orders")).await;
    let taken = admin
        .create_subscription(create(subscription("orders")))
        .await
        .unwrap_err();
    assert_eq!(taken.code(), tonic::Code::AlreadyExists);

    let before = subscriptions(&gateway).await;
    let would_be = admin
        .update_subscription(proto::UpdateSubscriptionRequest {
            subscription: Some(proto::Subscription {
                ack_deadline: Some(prost_types::Duration {
                    seconds: 90,
                    nanos: 0,
                }),
                ..subscription("orders")
            }),
            update_mask: Some(prost_types::FieldMask {
                paths: vec!["ack_deadline".into()],
            }),
            validate_only: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(seconds_of(&would_be.ack_deadline), 90);
    assert_eq!(subscriptions(&gateway).await, before);
}

/// A refused `apply`: exit code 2, and what it says.
async fn refused(gateway: &TestGateway, file: &str, args: &[&str]) -> String {
    let run = apply(gateway, file, args).await;
    assert_eq!(
        run.code,
        Some(2),
        "{file:.200}\nstdout: {}\nstderr: {}",
        run.stdout,
        run.stderr
    );
    run.stderr
}

#[tokio::test]
async fn a_file_without_a_subscriptions_list_prunes_nothing() {
    let database = TestDatabase::create().await;
    let gateway = gateway(&database).await;
    applied(
        &gateway,
        "subscriptions:\n  - name: alpha\n  - name: beta\n",
        &[],
    )
    .await;
    let before = subscriptions(&gateway).await;

    // What a job's `export > file` leaves when the export failed, and near misses.
    for file in [
        "",
        "# exported by the nightly job\n",
        "subscriptions:\n",
        "{}\n",
    ] {
        let said = refused(&gateway, file, &["--prune", "--yes"]).await;
        let missing = said.contains("holds no `subscriptions` list")
            || said.contains("subscriptions: has no value");
        assert!(
            said.contains("<stdin>") && missing && said.contains("`subscriptions: []`"),
            "{file:?}: {said}"
        );
        assert_eq!(
            subscriptions(&gateway).await,
            before,
            "{file:?} changed something"
        );
    }
    // A list where the mapping belongs is said in plain words, not a type of the code.
    let said = refused(&gateway, "- name: alpha\n", &["--prune", "--yes"]).await;
    assert!(
        said.contains("<stdin>:1:1: holds a list, not a mapping") && !said.contains("struct"),
        "{said}"
    );
    assert_eq!(subscriptions(&gateway).await, before);

    // Pruning everything is still possible, when the file says so.
    let pruned = applied(&gateway, "subscriptions: []\n", &["--prune", "--yes"]).await;
    assert_eq!(names(&pruned, "deleted"), ["alpha", "beta"]);
    assert!(subscriptions(&gateway).await.is_empty());
}

#[tokio::test]
async fn a_pause_the_gateway_would_refuse_refuses_the_file_before_any_change() {
    let database = TestDatabase::create().await;
    let gateway = gateway(&database).await;
    applied(&gateway, "subscriptions:\n  - name: existing\n", &[]).await;
    let before = subscriptions(&gateway).await;

    let long = "x".repeat(2000);
    let files = [
        format!(
            "subscriptions:\n  - name: fresh\n  - name: existing\n    ack_deadline: 2m\n  - name: paused\n    paused: true\n    pause_reason: {long}\n"
        ),
        // A NUL, written as YAML's escape.
        "subscriptions:\n  - name: fresh\n  - name: existing\n    paused: true\n    pause_reason: \"before\\0after\"\n".to_owned(),
    ];
    let expected = [
        "<stdin>:7:19: subscriptions[2].pause_reason: must be at most 1024 bytes",
        "<stdin>:5:19: subscriptions[1].pause_reason: must not contain the NUL character",
    ];
    for (file, expected) in files.iter().zip(expected) {
        let said = refused(&gateway, file, &[]).await;
        assert!(
            said.contains(expected),
            "expected {expected:?}, got: {said}"
        );
        assert_eq!(
            subscriptions(&gateway).await,
            before,
            "{file:.200} changed something"
        );
    }
}

#[tokio::test]
async fn durations_out_of_range_and_deep_nesting_are_refused() {
    let database = TestDatabase::create().await;
    let gateway = gateway(&database).await;
    applied(&gateway, "subscriptions:\n  - name: existing\n", &[]).await;
    let before = subscriptions(&gateway).await;

    let said = refused(
        &gateway,
        "subscriptions:\n  - name: existing\n    ack_deadline: 10000000000000000000s\n",
        &[],
    )
    .await;
    assert!(
        said.contains("<stdin>:3:19: subscriptions[0].ack_deadline: \"10000000000000000000s\" is longer than any setting takes"),
        "{said}"
    );
    assert_eq!(subscriptions(&gateway).await, before);

    // Parsing time grows with the square of the nesting: 100,000 levels took 40 s.
    let deep = format!(
        "subscriptions: {}{}\n",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let started = std::time::Instant::now();
    let said = refused(&gateway, &deep, &["--dry-run"]).await;
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    assert!(
        said.contains("<stdin>:1:80: nested more than 64 deep"),
        "{said}"
    );
    assert_eq!(subscriptions(&gateway).await, before);
}

#[tokio::test]
async fn refusals_point_into_the_file_and_every_problem_is_reported() {
    let database = TestDatabase::create().await;
    let gateway = gateway(&database).await;
    applied(
        &gateway,
        "subscriptions:\n  - name: existing\n    ordered: true\n",
        &[],
    )
    .await;
    let before = subscriptions(&gateway).await;

    // The gateway's refusals are located like the parser's: at the field, or at least
    // at the entry; every entry's problem is reported, in one run.
    let file = "subscriptions:\n  - name: fresh\n  - name: bad\n    ack_deadline: 0s\n  - name: existing\n    ordered: false\n  - name: worse\n    filter: 'payload.total >'\n";
    let said = refused(&gateway, file, &[]).await;
    for expected in [
        "<stdin>: 3 problems, nothing was changed",
        "\n<stdin>:4:19: subscriptions[1].ack_deadline: ",
        // An explicit `false` is said as such, not as "(unset)".
        "\n<stdin>:6:14: subscriptions[2].ordered: cannot change after creation (it would break the order of the events in flight): it is true and the file says false;",
        "\n<stdin>:8:13: subscriptions[3].filter: syntax error",
    ] {
        assert!(said.contains(expected), "expected {expected:?} in: {said}");
    }
    assert_eq!(subscriptions(&gateway).await, before);

    // A dry run still shows what the rest would do, with every problem.
    let run = apply(&gateway, file, &["--dry-run", "--json"]).await;
    assert_eq!(run.code, Some(2), "{}", run.stderr);
    let report: Value = serde_json::from_str(run.stdout.trim()).expect("a JSON report");
    assert_eq!(names(&report, "created"), ["fresh"], "{report}");
    assert_eq!(
        report["problems"].as_array().map(Vec::len),
        Some(3),
        "{report}"
    );
    assert_eq!(subscriptions(&gateway).await, before);
}

#[tokio::test]
async fn a_dry_run_of_the_example_without_its_variable_shows_the_plan_and_the_problem() {
    let database = TestDatabase::create().await;
    let gateway = gateway(&database).await;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let example = root.join("examples/subscriptions.yaml");
    let path = example.to_str().unwrap();
    // CRM_TOKEN, which the example's push header names, is not set.
    let run = cli_with_env(
        &gateway.endpoint(),
        &["apply", "-f", path, "--dry-run"],
        &[],
        None,
    )
    .await;
    assert_eq!(run.code, Some(2), "{}\n{}", run.stdout, run.stderr);
    for planned in [
        "would create billing.large-orders",
        "would create shipping.orders",
    ] {
        assert!(run.stdout.contains(planned), "{}", run.stdout);
    }
    assert!(
        run.stdout.contains("the file is refused for 1 problem"),
        "{}",
        run.stdout
    );
    assert!(
        run.stderr.contains(&format!(
            "{path}:34:24: subscriptions[2].push.headers.Authorization: the environment variable CRM_TOKEN is not set"
        )),
        "{}",
        run.stderr
    );
    assert!(subscriptions(&gateway).await.is_empty());
}
