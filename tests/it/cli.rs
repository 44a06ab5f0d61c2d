//! The admin CLI, run as the built binary against a live gateway.

use std::process::Stdio;

use crate::common::*;
use serde_json::Value;
use tokio::{io::AsyncWriteExt, process::Command};

/// Output of one CLI run.
pub(crate) struct Run {
    pub(crate) success: bool,
    /// The exit code; `None` when a signal ended the process.
    pub(crate) code: Option<i32>,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

impl Run {
    pub(crate) fn json(&self) -> Value {
        assert!(self.success, "command failed: {}", self.stderr);
        serde_json::from_str(self.stdout.trim())
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.stdout))
    }

    fn json_lines(&self) -> Vec<Value> {
        assert!(self.success, "command failed: {}", self.stderr);
        self.stdout
            .lines()
            .map(|line| serde_json::from_str(line).expect("JSON line"))
            .collect()
    }
}

/// A CLI command that has not ended by then hangs: the test fails instead of waiting
/// for ever. Generous, for a loaded machine.
const CLI_LIMIT: std::time::Duration = std::time::Duration::from_secs(60);

pub(crate) async fn cli(gateway: &TestGateway, args: &[&str]) -> Run {
    cli_with_input(&gateway.endpoint(), args, None).await
}

/// The CLI with `args` against `endpoint`, without the saved contexts of whoever runs
/// the tests.
fn cli_command(endpoint: &str, args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_outbox-gateway"));
    command
        .args(args)
        .env("OUTBOX_ENDPOINT", endpoint)
        .env(
            "XDG_CONFIG_HOME",
            std::env::temp_dir().join("outbox-cli-tests-no-contexts"),
        )
        .env_remove("OUTBOX_CONTEXT");
    command
}

pub(crate) async fn cli_with_input(endpoint: &str, args: &[&str], input: Option<&str>) -> Run {
    cli_with_env(endpoint, args, &[], input).await
}

/// The CLI with `args` against `endpoint`, these environment variables set and `input`
/// on its standard input.
pub(crate) async fn cli_with_env(
    endpoint: &str,
    args: &[&str],
    env: &[(&str, &str)],
    input: Option<&str>,
) -> Run {
    let mut child = cli_command(endpoint, args)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("run the CLI");
    let mut stdin = child.stdin.take().expect("stdin");
    if let Some(input) = input {
        stdin
            .write_all(input.as_bytes())
            .await
            .expect("write stdin");
    }
    drop(stdin);
    let output = tokio::time::timeout(CLI_LIMIT, child.wait_with_output())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "`outbox-gateway {}` ran longer than {CLI_LIMIT:?}",
                args.join(" ")
            )
        })
        .expect("CLI output");
    Run {
        success: output.status.success(),
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

#[tokio::test]
async fn subscriptions_are_managed_end_to_end() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;

    let created = cli(
        &gateway,
        &[
            "subscriptions",
            "create",
            "orders",
            "--event-type",
            "order.*",
            "--metadata",
            "tenant=acme",
            "--ack-deadline",
            "45s",
            "--ordered",
            "--start",
            "earliest",
            "--json",
        ],
    )
    .await
    .json();
    assert_eq!(created["name"], "orders");
    assert_eq!(created["event_types"][0], "order.*");
    assert_eq!(created["metadata_match"]["tenant"], "acme");
    assert_eq!(
        (
            created["ack_deadline"].as_str(),
            created["ordered"].as_bool()
        ),
        (Some("45s"), Some(true))
    );

    let updated = cli(
        &gateway,
        &[
            "subscriptions",
            "update",
            "orders",
            "--max-attempts",
            "3",
            "--json",
        ],
    )
    .await
    .json();
    assert_eq!(
        (
            updated["max_attempts"].as_u64(),
            updated["ack_deadline"].as_str()
        ),
        (Some(3), Some("45s"))
    );
    let listed = cli(&gateway, &["subscriptions", "list", "--json"])
        .await
        .json();
    assert_eq!(listed.as_array().unwrap().len(), 1);
    let text = cli(&gateway, &["subscriptions", "list"]).await;
    assert!(
        text.stdout.starts_with("NAME") && text.stdout.contains("orders"),
        "{}",
        text.stdout
    );
    assert_eq!(
        cli(&gateway, &["subscriptions", "get", "orders", "--json"])
            .await
            .json()["max_attempts"],
        3
    );
    assert!(
        cli(
            &gateway,
            &[
                "subscriptions",
                "seek",
                "orders",
                "--to",
                "2026-01-01T00:00:00Z"
            ]
        )
        .await
        .success
    );
    assert!(
        cli(&gateway, &["subscriptions", "delete", "orders", "--yes"])
            .await
            .success
    );

    let missing = cli(&gateway, &["subscriptions", "get", "orders"]).await;
    assert!(!missing.success);
    assert!(
        missing.stderr.contains("not found") && missing.stderr.contains("\"orders\""),
        "{}",
        missing.stderr
    );
    let invalid = cli(&gateway, &["subscriptions", "create", "Bad Name"]).await;
    assert!(
        !invalid.success
            && invalid
                .stderr
                .contains("invalid argument: subscription.name"),
        "{}",
        invalid.stderr
    );
}

#[tokio::test]
async fn publish_tail_stats_and_dead_letters_work_from_the_command_line() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    cli(
        &gateway,
        &[
            "subscriptions",
            "create",
            "orders",
            "--start",
            "earliest",
            "--json",
        ],
    )
    .await
    .json();

    let published = cli(
        &gateway,
        &[
            "publish",
            "--aggregate-type",
            "order",
            "--aggregate-id",
            "o-1",
            "--event-type",
            "order.created",
            "--payload",
            r#"{"total":5}"#,
            "--metadata",
            "tenant=acme",
            "--json",
        ],
    )
    .await
    .json();
    assert_eq!(published["duplicate"], false);
    // tail acks what it prints.
    let tailed = cli(&gateway, &["tail", "orders", "--limit", "1"])
        .await
        .json_lines();
    let aggregates: Vec<&str> = tailed
        .iter()
        .map(|d| d["event"]["aggregate_id"].as_str().unwrap())
        .collect();
    assert_eq!(aggregates, ["o-1"]);
    assert_eq!(tailed[0]["event"]["payload"]["total"], 5);

    let lines = "{\"aggregate_type\":\"order\",\"aggregate_id\":\"o-2\",\"event_type\":\"order.paid\",\"payload\":{\"n\":[1,2]}}\n\
                 {\"aggregate_type\":\"order\",\"aggregate_id\":\"o-3\",\"event_type\":\"order.paid\"}\n";
    let from_stdin = cli_with_input(
        &gateway.endpoint(),
        &["publish", "--stdin", "--json"],
        Some(lines),
    )
    .await
    .json_lines();
    assert_eq!(from_stdin.len(), 2);
    let bad_line = cli_with_input(
        &gateway.endpoint(),
        &["publish", "--stdin"],
        Some("{\"oops\": 1}\n"),
    )
    .await;
    assert!(
        !bad_line.success && bad_line.stderr.contains("line 1"),
        "{}",
        bad_line.stderr
    );

    // A consumer acks o-2 and dead-letters o-3; triage it from the CLI.
    let mut consumer = Consumer::open(&gateway, "orders", 0).await;
    let [second, third]: [_; 2] = consumer
        .take(2, std::time::Duration::from_secs(5))
        .await
        .try_into()
        .unwrap();
    assert_eq!(second.event.as_ref().unwrap().payload, br#"{"n":[1,2]}"#);
    assert!(
        ack(&gateway, "orders", vec![second.ack_id])
            .await
            .is_empty()
    );
    nack(
        &gateway,
        outbox_gateway::proto::NackRequest {
            subscription: "orders".into(),
            ack_id: third.ack_id,
            dead_letter: true,
            reason: "bad data".into(),
            ..Default::default()
        },
    )
    .await;
    let stats = cli(&gateway, &["stats", "--subscription", "orders", "--json"])
        .await
        .json();
    let figures = &stats["subscriptions"][0];
    assert_eq!(
        (
            figures["acked_total"].as_u64(),
            figures["dead_lettered"].as_u64(),
            figures["delivered_total"].as_u64()
        ),
        (Some(2), Some(1), Some(3))
    );
    assert_eq!(stats["outbox"]["events_stored"], 3);
    let table = cli(&gateway, &["stats"]).await.stdout;
    // Both ages, the one against the clock first.
    assert!(
        table.contains("SUBSCRIPTION")
            && table.contains("OLDEST UNACKED")
            && table.contains("BEHIND NEWEST"),
        "{table}"
    );

    let letters = cli(&gateway, &["dlq", "list", "orders", "--json"])
        .await
        .json();
    let letter = &letters["dead_letters"][0];
    assert_eq!(
        (
            letter["last_error"].as_str(),
            letter["event"]["aggregate_id"].as_str()
        ),
        (Some("bad data"), Some("o-3"))
    );
    let id = letter["event"]["id"].as_str().unwrap().to_owned();
    assert!(
        !cli(&gateway, &["dlq", "requeue", "orders"]).await.success,
        "a selector is required"
    );
    let requeued = cli(
        &gateway,
        &["dlq", "requeue", "orders", "--id", &id, "--json"],
    )
    .await
    .json();
    assert_eq!(requeued["requeued_count"], 1);
    let again = consumer
        .next(std::time::Duration::from_secs(5))
        .await
        .expect("requeued");
    assert_eq!(again.attempt, 1);
    nack(
        &gateway,
        outbox_gateway::proto::NackRequest {
            subscription: "orders".into(),
            ack_id: again.ack_id,
            dead_letter: true,
            ..Default::default()
        },
    )
    .await;
    let resolved = cli(
        &gateway,
        &[
            "dlq",
            "resolve",
            "orders",
            &id,
            "--by",
            "ops",
            "--notes",
            "fixed upstream",
            "--json",
        ],
    )
    .await
    .json();
    assert_eq!(
        (
            resolved["resolved"].as_bool(),
            resolved["resolved_by"].as_str()
        ),
        (Some(true), Some("ops"))
    );
    assert_eq!(
        cli(&gateway, &["dlq", "list", "orders", "--json"])
            .await
            .json()["dead_letters"]
            .as_array()
            .unwrap()
            .len(),
        0
    );

    let requeue = cli(
        &gateway,
        &[
            "requeue",
            "--latest",
            "--aggregate-type",
            "order",
            "--aggregate-id",
            "o-1",
            "--event-type",
            "order.created",
            "--json",
        ],
    )
    .await
    .json();
    assert_eq!(requeue["requeued_count"], 1);
    let unknown = cli(
        &gateway,
        &["requeue", "--id", &uuid::Uuid::new_v4().to_string()],
    )
    .await;
    assert!(
        !unknown.success && unknown.stderr.contains("not found"),
        "{}",
        unknown.stderr
    );
}

#[tokio::test]
async fn an_unreachable_gateway_is_a_clear_failure() {
    let run = cli_with_input("http://127.0.0.1:1", &["stats"], None).await;
    assert!(!run.success);
    assert!(
        run.stderr
            .contains("cannot reach the gateway at http://127.0.0.1:1: connection refused"),
        "{}",
        run.stderr
    );
    let health = cli_with_input("http://127.0.0.1:1", &["health"], None).await;
    assert!(!health.success);
    let unknown_host = cli_with_input("nosuchhost.invalid:50051", &["stats"], None).await;
    assert!(
        !unknown_host.success && unknown_host.stderr.contains("host name was not found"),
        "{}",
        unknown_host.stderr
    );
}

#[tokio::test]
async fn endpoints_without_a_scheme_work_and_tls_mismatches_are_named() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let address = gateway.endpoint().trim_start_matches("http://").to_owned();
    let run = cli_with_input(&address, &["health"], None).await;
    assert!(run.success, "{}", run.stderr);
    let tls = cli_with_input(&format!("https://{address}"), &["health"], None).await;
    assert!(
        !tls.success && tls.stderr.contains("does not speak TLS"),
        "{}",
        tls.stderr
    );
    // Accepts connections and never answers.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_address = silent.local_addr().unwrap().to_string();
    let _held = tokio::spawn(async move {
        let mut connections = Vec::new();
        while let Ok((connection, _)) = silent.accept().await {
            connections.push(connection);
        }
    });
    let timed_out = cli_with_input(&silent_address, &["stats", "--timeout", "1s"], None).await;
    assert!(
        !timed_out.success && timed_out.stderr.contains("no answer"),
        "{}",
        timed_out.stderr
    );
}

#[tokio::test]
async fn health_command_reports_a_serving_gateway() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let run = cli(&gateway, &["health"]).await;
    assert!(
        run.success && run.stdout.trim() == "SERVING",
        "{} {}",
        run.stdout,
        run.stderr
    );
}

/// Names of the gateway's subscriptions.
async fn subscription_names(gateway: &TestGateway) -> Vec<String> {
    gateway
        .admin()
        .await
        .list_subscriptions(outbox_gateway::proto::ListSubscriptionsRequest {})
        .await
        .unwrap()
        .into_inner()
        .subscriptions
        .into_iter()
        .map(|subscription| subscription.name)
        .collect()
}

/// `tail` with an ephemeral subscription, standard output piped to the test.
fn spawn_tail(endpoint: &str) -> tokio::process::Child {
    Command::new(env!("CARGO_BIN_EXE_outbox-gateway"))
        .args(["tail", "--event-type", "order.*", "--from", "earliest"])
        .env("OUTBOX_ENDPOINT", endpoint)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("run tail")
}

async fn stderr_of(child: tokio::process::Child) -> (std::process::ExitStatus, String) {
    let output = tokio::time::timeout(WAIT, child.wait_with_output())
        .await
        .expect("tail exits")
        .unwrap();
    (
        output.status,
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

const WAIT: std::time::Duration = std::time::Duration::from_secs(20);

#[tokio::test]
async fn tail_into_a_closed_pipe_exits_quietly_and_cleans_up() {
    use tokio::io::AsyncBufReadExt;
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    let mut tail = spawn_tail(&gateway.endpoint());
    let mut lines = tokio::io::BufReader::new(tail.stdout.take().unwrap()).lines();
    let first = tokio::time::timeout(WAIT, lines.next_line())
        .await
        .expect("a delivery")
        .unwrap()
        .expect("a line");
    assert!(first.contains("order.created"), "{first}");
    // Like `tail ... | head -1`: the reader goes away, then more arrives.
    drop(lines);
    publish(&gateway, vec![event("o-2", "order.created")]).await;
    let (status, stderr) = stderr_of(tail).await;
    assert!(status.success(), "{status}: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(subscription_names(&gateway).await, Vec::<String>::new());
}

#[tokio::test]
async fn tail_ended_by_sigterm_deletes_its_ephemeral_subscription() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let tail = spawn_tail(&gateway.endpoint());
    eventually("tail creates its subscription", WAIT, || async {
        !subscription_names(&gateway).await.is_empty()
    })
    .await;
    let pid = tail.id().unwrap().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
    let (status, stderr) = stderr_of(tail).await;
    assert!(status.success(), "{status}: {stderr}");
    assert_eq!(subscription_names(&gateway).await, Vec::<String>::new());
}

#[tokio::test]
async fn tail_carries_on_after_a_gateway_restart() {
    use tokio::io::AsyncBufReadExt;
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let address = gateway.endpoint().trim_start_matches("http://").to_owned();
    create_subscription(&gateway, subscription("orders")).await;
    let mut tail = Command::new(env!("CARGO_BIN_EXE_outbox-gateway"))
        .args(["tail", "orders"])
        .env("OUTBOX_ENDPOINT", gateway.endpoint())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(tail.stdout.take().unwrap()).lines();
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    let first = tokio::time::timeout(WAIT, lines.next_line())
        .await
        .unwrap()
        .unwrap();
    assert!(first.unwrap().contains("o-1"));

    gateway.stop().await.unwrap();
    let listener = tokio::net::TcpListener::bind(&address).await.unwrap();
    let restarted = TestGateway::spawn_on(&database, test_config(database.url()), listener).await;
    restarted
        .wait_for_health(tonic_health::pb::health_check_response::ServingStatus::Serving)
        .await;
    publish(&restarted, vec![event("o-2", "order.created")]).await;
    // o-1 may come again first: its ack can be cut off by the restart.
    loop {
        let next = tokio::time::timeout(WAIT, lines.next_line())
            .await
            .expect("tail reconnects and prints the next delivery")
            .unwrap();
        match next {
            Some(line) if line.contains("o-2") => break,
            Some(line) => assert!(line.contains("o-1"), "{line}"),
            None => {
                let (status, stderr) = stderr_of(tail).await;
                panic!("tail ended ({status}): {stderr}");
            }
        }
    }
}

/// Every option and argument of every command says what it is for.
#[tokio::test]
async fn every_flag_has_help_and_migrate_lists_only_its_own() {
    let commands: &[&[&str]] = &[
        &["serve"],
        &["migrate"],
        &["subscriptions", "create"],
        &["subscriptions", "list"],
        &["subscriptions", "get"],
        &["subscriptions", "update"],
        &["subscriptions", "delete"],
        &["subscriptions", "seek"],
        &["dlq", "list"],
        &["dlq", "requeue"],
        &["dlq", "resolve"],
        &["dlq", "summarize"],
        &["events", "get"],
        &["requeue"],
        &["stats"],
        &["publish"],
        &["tail"],
        &["health"],
        &["token", "generate"],
        &["token", "hash"],
        &["pull"],
        &["context", "save"],
        &["context", "list"],
        &["context", "select"],
        &["context", "delete"],
    ];
    for command in commands {
        let mut args = command.to_vec();
        args.push("--help");
        let run = cli_with_input("http://127.0.0.1:1", &args, None).await;
        assert!(run.success, "{command:?}: {}", run.stderr);
        let lines: Vec<&str> = run.stdout.lines().collect();
        for (index, line) in lines.iter().enumerate() {
            let entry = line.trim_start();
            let indent = line.len() - entry.len();
            if !(2..10).contains(&indent) || !entry.starts_with(['-', '<', '[']) {
                continue;
            }
            // Short help puts the text on the same line, after two spaces.
            let same_line = entry
                .split_once("  ")
                .is_some_and(|(_, text)| !text.trim().is_empty());
            let next_line = lines
                .get(index + 1)
                .is_some_and(|next| next.starts_with("          ") && !next.trim().is_empty());
            assert!(
                same_line || next_line,
                "{command:?}: {line:?} has no help text"
            );
        }
    }
    let migrate = cli_with_input("http://127.0.0.1:1", &["migrate", "--help"], None).await;
    assert!(
        migrate.stdout.contains("--database-url"),
        "{}",
        migrate.stdout
    );
    for serve_only in [
        "--listen",
        "--retention",
        "--metrics-listen",
        "--insecure-no-auth",
    ] {
        assert!(
            !migrate.stdout.contains(serve_only),
            "migrate --help lists {serve_only}"
        );
    }
}

#[tokio::test]
async fn commands_speak_in_flags_plurals_and_exit_codes() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let created = cli(
        &gateway,
        &["subscriptions", "create", "orders", "--start", "earliest"],
    )
    .await;
    assert!(created.success, "{}", created.stderr);
    assert!(
        !created.stdout.trim_start().starts_with('{') && created.stdout.contains("name:"),
        "text without --json: {}",
        created.stdout
    );

    let no_selector = cli(&gateway, &["dlq", "requeue", "orders"]).await;
    assert!(!no_selector.success);
    assert!(
        no_selector.stderr.contains("--id") && no_selector.stderr.contains("--all"),
        "{}",
        no_selector.stderr
    );
    assert!(
        !no_selector.stderr.contains("dead_lettered_before"),
        "{}",
        no_selector.stderr
    );

    let unknown = uuid::Uuid::new_v4().to_string();
    let nothing = cli(&gateway, &["dlq", "requeue", "orders", "--id", &unknown]).await;
    assert!(!nothing.success, "{}", nothing.stdout);
    assert!(
        nothing.stderr.contains("requeued 0 dead letters of 1"),
        "{}",
        nothing.stderr
    );

    publish(&gateway, vec![event("o-1", "order.created")]).await;
    let mut consumer = Consumer::open(&gateway, "orders", 0).await;
    let delivery = consumer
        .next(std::time::Duration::from_secs(10))
        .await
        .expect("a delivery");
    let id = delivery.event.as_ref().unwrap().id.clone();
    nack(
        &gateway,
        outbox_gateway::proto::NackRequest {
            subscription: "orders".into(),
            ack_id: delivery.ack_id,
            dead_letter: true,
            ..Default::default()
        },
    )
    .await;
    let one = cli(&gateway, &["dlq", "requeue", "orders", "--id", &id]).await;
    assert!(one.success, "{}", one.stderr);
    assert_eq!(one.stdout.trim(), "requeued 1 dead letter");

    let token = cli(&gateway, &["token", "generate", "--json"]).await.json();
    assert_eq!(token["token"].as_str().map(str::len), Some(64));
    assert_eq!(token["sha256"].as_str().map(str::len), Some(64));
}

#[tokio::test]
async fn destructive_commands_need_yes_without_a_terminal() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    for command in [
        &["subscriptions", "delete", "orders"][..],
        &["dlq", "requeue", "orders", "--all"],
        &["subscriptions", "seek", "orders", "--to", "earliest"],
    ] {
        let refused = cli(&gateway, command).await;
        assert!(!refused.success, "{command:?} ran without --yes");
        assert!(
            refused.stderr.contains("--yes"),
            "{command:?}: {}",
            refused.stderr
        );
    }
    let refused = cli(&gateway, &["subscriptions", "delete", "orders"]).await;
    assert!(
        refused.stderr.contains("delete subscription orders")
            && refused.stderr.contains("0 unresolved dead letters"),
        "shows what it would affect: {}",
        refused.stderr
    );
    assert_eq!(subscription_names(&gateway).await, ["orders"]);
    for command in [
        &["dlq", "requeue", "orders", "--all", "--yes"][..],
        &[
            "subscriptions",
            "seek",
            "orders",
            "--to",
            "earliest",
            "--yes",
        ],
        &["subscriptions", "delete", "orders", "--yes"],
    ] {
        let run = cli(&gateway, command).await;
        assert!(run.success, "{command:?}: {}", run.stderr);
    }
    assert_eq!(subscription_names(&gateway).await, Vec::<String>::new());
}

#[tokio::test]
async fn pull_takes_prints_and_settles_deliveries() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    publish(
        &gateway,
        vec![
            event("o-1", "order.created"),
            event("o-2", "order.created"),
            event("o-3", "order.created"),
        ],
    )
    .await;
    let aggregates = |lines: &[Value]| -> Vec<String> {
        lines
            .iter()
            .map(|line| line["event"]["aggregate_id"].as_str().unwrap().to_owned())
            .collect()
    };
    let acked = cli(
        &gateway,
        &["pull", "orders", "--max", "2", "--ack", "--json"],
    )
    .await
    .json_lines();
    assert_eq!(aggregates(&acked), ["o-1", "o-2"]);
    assert!(acked.iter().all(|line| line["settled"] == "acked"));

    let released = cli(&gateway, &["pull", "orders"]).await;
    assert!(released.success, "{}", released.stderr);
    assert!(
        released.stdout.contains("o-3") && released.stdout.contains("released"),
        "{}",
        released.stdout
    );
    let dead = cli(
        &gateway,
        &[
            "pull",
            "orders",
            "--dead-letter",
            "--reason",
            "bad data",
            "--json",
        ],
    )
    .await
    .json_lines();
    assert_eq!(aggregates(&dead), ["o-3"]);
    // Released deliveries come again, their release counted as an attempt.
    assert_eq!(dead[0]["attempt"].as_u64(), Some(2), "{dead:?}");
    let letters = cli(&gateway, &["dlq", "list", "orders", "--json"])
        .await
        .json();
    assert_eq!(letters["dead_letters"][0]["last_error"], "bad data");

    let empty = cli(&gateway, &["pull", "orders", "--wait", "1s"]).await;
    assert!(empty.success, "{}", empty.stderr);
    assert!(empty.stderr.contains("no deliveries"), "{}", empty.stderr);
    let no_reason = cli(&gateway, &["pull", "orders", "--dead-letter"]).await;
    assert!(
        !no_reason.success && no_reason.stderr.contains("--reason"),
        "{}",
        no_reason.stderr
    );
}

#[tokio::test]
async fn publish_stdin_sends_large_inputs_in_batches_with_progress() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let lines: String = (0..1500)
        .map(|n| {
            format!(
                "{{\"aggregate_type\":\"order\",\"aggregate_id\":\"o-{n}\",\"event_type\":\"order.created\"}}\n"
            )
        })
        .collect();
    let run = cli_with_input(&gateway.endpoint(), &["publish", "--stdin"], Some(&lines)).await;
    assert!(run.success, "{}", run.stderr);
    assert_eq!(run.stdout.lines().count(), 1500);
    assert!(
        run.stderr.contains("published 1500 of 1500 events"),
        "{}",
        run.stderr
    );
    assert_eq!(count_events(&database.pool().await).await, 1500);

    // Lines piped in without --stdin: say so rather than only "missing flags".
    let one_line = lines.lines().next().unwrap();
    let forgotten = cli_with_input(&gateway.endpoint(), &["publish"], Some(one_line)).await;
    assert!(!forgotten.success);
    assert!(
        forgotten.stderr.contains("--aggregate-type") && forgotten.stderr.contains("add --stdin"),
        "{}",
        forgotten.stderr
    );
}

/// The binary with a configuration directory of its own and no endpoint in the
/// environment.
async fn cli_in(config_home: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut command = Command::new(env!("CARGO_BIN_EXE_outbox-gateway"));
    command
        .args(args)
        .env("XDG_CONFIG_HOME", config_home)
        .env_remove("OUTBOX_ENDPOINT")
        .env_remove("OUTBOX_CONTEXT")
        .env_remove("OUTBOX_TOKEN")
        .stdin(Stdio::null());
    for (name, value) in env {
        command.env(name, value);
    }
    command.kill_on_drop(true);
    let output = tokio::time::timeout(CLI_LIMIT, command.output())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "`outbox-gateway {}` ran longer than {CLI_LIMIT:?}",
                args.join(" ")
            )
        })
        .expect("run the CLI");
    Run {
        success: output.status.success(),
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

#[tokio::test]
async fn contexts_save_connections_by_name() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let home = std::env::temp_dir().join(format!("outbox-contexts-{}", uuid::Uuid::new_v4()));
    let address = gateway.endpoint().trim_start_matches("http://").to_owned();

    let saved = cli_in(
        &home,
        &[
            "context",
            "save",
            "local",
            "--endpoint",
            &address,
            "--token",
            "s3cret",
        ],
        &[],
    )
    .await;
    assert!(saved.success, "{}", saved.stderr);
    let file = home.join("outbox-gateway/contexts.toml");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&file).unwrap().permissions().mode();
        assert_eq!(
            mode & 0o777,
            0o600,
            "the token is readable by its owner only"
        );
    }

    let named = cli_in(&home, &["health", "--context", "local"], &[]).await;
    assert!(named.success, "{}", named.stderr);
    let by_env = cli_in(&home, &["health"], &[("OUTBOX_CONTEXT", "local")]).await;
    assert!(by_env.success, "{}", by_env.stderr);
    let selected = cli_in(&home, &["context", "select", "local"], &[]).await;
    assert!(selected.success, "{}", selected.stderr);
    let plain = cli_in(&home, &["health"], &[]).await;
    assert!(plain.success, "{}", plain.stderr);
    // A flag wins over the named context.
    let overridden = cli_in(
        &home,
        &["health", "--context", "local", "--endpoint", "127.0.0.1:1"],
        &[],
    )
    .await;
    assert!(
        !overridden.success && overridden.stderr.contains("connection refused"),
        "{}",
        overridden.stderr
    );

    let listed = cli_in(&home, &["context", "list"], &[]).await;
    assert!(listed.stdout.contains("local *"), "{}", listed.stdout);
    assert!(
        !listed.stdout.contains("s3cret"),
        "the token is shown: {}",
        listed.stdout
    );
    let unknown = cli_in(&home, &["health", "--context", "prod"], &[]).await;
    assert!(
        !unknown.success
            && unknown.stderr.contains("no context named \"prod\"")
            && unknown.stderr.contains("local"),
        "{}",
        unknown.stderr
    );
    let deleted = cli_in(&home, &["context", "delete", "local"], &[]).await;
    assert!(deleted.success, "{}", deleted.stderr);
    let _ = std::fs::remove_dir_all(&home);
}

/// At a terminal (here a pseudo-terminal from util-linux `script`), a destructive
/// command shows what it will affect and asks; only "y" goes ahead.
/// Runs `command` (a shell command line) at a pseudo-terminal that types `answer`:
/// whether it succeeded, and what the terminal showed.
pub(crate) async fn at_terminal(command: &str, answer: &str) -> (bool, String) {
    let mut child = Command::new("script")
        .args(["-qec", command, "/dev/null"])
        .env(
            "XDG_CONFIG_HOME",
            std::env::temp_dir().join("outbox-cli-tests-no-contexts"),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("run script(1) from util-linux");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(answer.as_bytes()).await.unwrap();
    drop(stdin);
    let output = tokio::time::timeout(WAIT, child.wait_with_output())
        .await
        .expect("answers")
        .unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
    )
}

#[tokio::test]
async fn destructive_commands_ask_at_a_terminal() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    let command = format!(
        "{} subscriptions delete orders --endpoint {}",
        env!("CARGO_BIN_EXE_outbox-gateway"),
        gateway.endpoint()
    );
    let at_terminal = |answer| at_terminal(&command, answer);
    let (declined, screen) = at_terminal("n\n").await;
    assert!(!declined, "{screen}");
    assert!(
        screen.contains("delete subscription orders") && screen.contains("Continue? [y/N]"),
        "{screen}"
    );
    assert!(screen.contains("nothing was changed"), "{screen}");
    assert_eq!(subscription_names(&gateway).await, ["orders"]);
    let (confirmed, screen) = at_terminal("y\n").await;
    assert!(confirmed, "{screen}");
    assert_eq!(subscription_names(&gateway).await, Vec::<String>::new());
}

#[tokio::test]
async fn text_output_tells_the_status_the_pause_and_scheduled_events() {
    use tokio::io::AsyncBufReadExt;
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("work")).await;
    publish(
        &gateway,
        vec![outbox_gateway::proto::EventInput {
            deliver_at: Some(prost_types::Timestamp::from(
                std::time::SystemTime::now() + std::time::Duration::from_secs(15 * 60),
            )),
            ..event("r-1", "reminder.due")
        }],
    )
    .await;

    let stats = cli(&gateway, &["stats"]).await;
    assert!(stats.success, "{}", stats.stderr);
    let header = stats.stdout.lines().next().unwrap_or_default();
    let columns: Vec<&str> = header.split_whitespace().collect();
    assert_eq!(
        &columns[..4],
        ["SUBSCRIPTION", "STATUS", "PENDING", "SCHEDULED"],
        "{}",
        stats.stdout
    );
    let row = stats.stdout.lines().nth(1).unwrap_or_default();
    let cells: Vec<&str> = row
        .split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect();
    assert_eq!(
        &cells[..4],
        ["work", "scheduled only", "0", "1"],
        "a scheduled event is neither pending nor lag:\n{}",
        stats.stdout
    );

    let paused = cli(
        &gateway,
        &[
            "subscriptions",
            "pause",
            "work",
            "--reason",
            "downstream outage",
            "--until",
            "1h",
        ],
    )
    .await;
    assert!(paused.success, "{}", paused.stderr);
    let pause_line = paused
        .stdout
        .lines()
        .find(|line| line.starts_with("paused:"))
        .unwrap_or_else(|| panic!("no pause in:\n{}", paused.stdout));
    assert!(
        pause_line.contains(" until ") && pause_line.ends_with(": downstream outage"),
        "{pause_line}"
    );

    let got = cli(&gateway, &["subscriptions", "get", "work"]).await;
    assert!(got.success, "{}", got.stderr);
    assert!(got.stdout.contains("downstream outage"), "{}", got.stdout);
    let status_line = got
        .stdout
        .lines()
        .find(|line| line.starts_with("status:"))
        .unwrap_or_else(|| panic!("no status in:\n{}", got.stdout));
    assert!(status_line.contains(" paused ("), "{status_line}");

    let stats = cli(&gateway, &["stats", "--subscription", "work"]).await;
    assert!(stats.success, "{}", stats.stderr);
    assert!(
        stats
            .stdout
            .lines()
            .nth(1)
            .unwrap_or_default()
            .contains(" paused "),
        "{}",
        stats.stdout
    );
    assert!(
        stats
            .stdout
            .lines()
            .any(|line| line.starts_with("work: paused since")
                && line.ends_with("downstream outage")),
        "{}",
        stats.stdout
    );

    // Nothing comes from a paused subscription: pull says so at once and fails.
    let started = std::time::Instant::now();
    let pulled = cli(&gateway, &["pull", "work", "--wait", "10s"]).await;
    assert!(!pulled.success, "pull of a paused subscription succeeded");
    assert!(
        pulled.stderr.contains("work is paused")
            && pulled
                .stderr
                .contains("outbox-gateway subscriptions resume work"),
        "{}",
        pulled.stderr
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(8),
        "pull waited for deliveries that cannot come"
    );

    // tail streams on, and says why nothing comes.
    let mut tail = Command::new(env!("CARGO_BIN_EXE_outbox-gateway"))
        .args(["tail", "work"])
        .env("OUTBOX_ENDPOINT", gateway.endpoint())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("run tail");
    let mut lines = tokio::io::BufReader::new(tail.stderr.take().expect("stderr")).lines();
    let notice = tokio::time::timeout(WAIT, lines.next_line())
        .await
        .expect("tail says something")
        .expect("read stderr")
        .unwrap_or_default();
    assert!(notice.contains("work is paused"), "{notice}");
    tail.kill().await.expect("stop tail");
}

#[tokio::test]
async fn pull_leases_no_more_than_it_prints() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    publish(
        &gateway,
        (1..=8)
            .map(|n| event(&format!("o-{n}"), "order.created"))
            .collect(),
    )
    .await;
    // Each pull acks what it took while its stream is still open. A stream that leased
    // again once those acks freed its room would take the next event and give it back
    // on closing, and that event's next delivery would be its second attempt.
    let mut attempts = Vec::new();
    for _ in 0..4 {
        let pulled = cli(
            &gateway,
            &["pull", "orders", "--max", "2", "--ack", "--json"],
        )
        .await
        .json_lines();
        assert_eq!(pulled.len(), 2, "{pulled:?}");
        attempts.extend(pulled.iter().map(|line| line["attempt"].as_u64()));
    }
    assert_eq!(attempts, [Some(1); 8]);
    let stats = subscription_stats(&gateway, "orders").await;
    assert_eq!((stats.delivered_total, stats.acked_total), (8, 8));
}

/// Runs the CLI with its standard output a pipe whose reader is already gone, like
/// `outbox-gateway stats | head -0`; returns its exit code and standard error.
async fn into_closed_pipe(endpoint: &str, args: &[&str]) -> (Option<i32>, String) {
    let mut child = cli_command(endpoint, args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("run the CLI");
    drop(child.stdout.take());
    let output = tokio::time::timeout(WAIT, child.wait_with_output())
        .await
        .expect("the CLI exits")
        .unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test]
async fn table_commands_exit_quietly_into_a_closed_pipe() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    for command in [
        &["stats"][..],
        &["stats", "--json"],
        &["subscriptions", "list"],
        &["subscriptions", "get", "orders"],
        &["dlq", "list", "orders"],
        &["sources"],
        &["health"],
        &["token", "generate"],
    ] {
        let (code, stderr) = into_closed_pipe(&gateway.endpoint(), command).await;
        assert_eq!(code, Some(0), "{command:?}: {stderr}");
        assert_eq!(stderr, "", "{command:?}");
    }
}

#[tokio::test]
async fn settings_clear_from_the_command_line_and_unchangeable_ones_are_named() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let created = cli(
        &gateway,
        &[
            "subscriptions",
            "create",
            "orders",
            "--event-type",
            "order.*",
            "--aggregate-type",
            "order",
            "--metadata",
            "tenant=acme",
            "--persistent-event-type",
            "order.paid",
            "--max-event-age",
            "1h",
            "--source",
            "default",
            "--json",
        ],
    )
    .await
    .json();
    assert_eq!(created["sources"], serde_json::json!(["default"]));
    assert_eq!(created["max_event_age"], "1h");

    let cleared = cli(
        &gateway,
        &[
            "subscriptions",
            "update",
            "orders",
            "--clear-event-types",
            "--clear-aggregate-types",
            "--clear-metadata",
            "--clear-persistent-event-types",
            "--no-max-event-age",
            "--json",
        ],
    )
    .await
    .json();
    assert_eq!(
        (
            &cleared["event_types"],
            &cleared["aggregate_types"],
            &cleared["metadata_match"],
            &cleared["persistent_event_types"],
            &cleared["max_event_age"],
        ),
        (
            &serde_json::json!([]),
            &serde_json::json!([]),
            &serde_json::json!({}),
            &serde_json::json!([]),
            &Value::Null,
        )
    );

    // A setting and its clearing at once is a usage error.
    let both = cli(
        &gateway,
        &[
            "subscriptions",
            "update",
            "orders",
            "--metadata",
            "tenant=acme",
            "--clear-metadata",
        ],
    )
    .await;
    assert_eq!(both.code, Some(2), "{}", both.stderr);

    for (flag, named) in [
        (&["--ordered"][..], "ordered"),
        (&["--source", "default"], "sources"),
    ] {
        let mut args = vec!["subscriptions", "update", "orders"];
        args.extend_from_slice(flag);
        let refused = cli(&gateway, &args).await;
        assert_eq!(refused.code, Some(2), "{flag:?}: {}", refused.stderr);
        assert!(
            refused.stderr.contains(named)
                && refused.stderr.contains("cannot change")
                && !refused.stderr.contains("tip:"),
            "{flag:?}: {}",
            refused.stderr
        );
    }
}

/// Dead-letters events of `orders` with the reasons given, in order; returns their ids.
async fn dead_letter_all(gateway: &TestGateway, reasons: &[&str]) -> Vec<String> {
    let mut consumer = Consumer::open(gateway, "orders", 0).await;
    let mut ids = Vec::new();
    for reason in reasons {
        let delivery = consumer
            .next(std::time::Duration::from_secs(10))
            .await
            .expect("a delivery");
        ids.push(delivery.event.as_ref().unwrap().id.clone());
        nack(
            gateway,
            outbox_gateway::proto::NackRequest {
                subscription: "orders".into(),
                ack_id: delivery.ack_id,
                reason: (*reason).into(),
                dead_letter: true,
                ..Default::default()
            },
        )
        .await;
    }
    ids
}

#[tokio::test]
async fn dead_letters_resolve_in_bulk_and_summarize_and_events_show_where_they_stand() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    create_subscription(
        &gateway,
        outbox_gateway::proto::Subscription {
            event_types: vec!["invoice.*".into()],
            ..subscription("invoices")
        },
    )
    .await;
    publish(
        &gateway,
        vec![
            event("o-1", "order.created"),
            event("o-2", "order.created"),
            event("o-3", "order.paid"),
        ],
    )
    .await;
    let ids = dead_letter_all(&gateway, &["bad data", "bad data", "timeout"]).await;

    let summary = cli(&gateway, &["dlq", "summarize", "orders"]).await;
    assert!(summary.success, "{}", summary.stderr);
    let bad_data = summary
        .stdout
        .lines()
        .find(|line| line.contains("bad data"))
        .unwrap_or_else(|| panic!("{}", summary.stdout));
    assert!(
        bad_data.split_whitespace().any(|word| word == "2"),
        "{bad_data}"
    );
    let groups = cli(&gateway, &["dlq", "summarize", "orders", "--json"])
        .await
        .json();
    assert_eq!(
        (
            groups["groups"][0]["last_error"].as_str(),
            groups["groups"][0]["count"].as_u64(),
            groups["groups"][1]["last_error"].as_str(),
        ),
        (Some("bad data"), Some(2), Some("timeout"))
    );

    let event = cli(&gateway, &["events", "get", &ids[2], "--json"])
        .await
        .json();
    assert_eq!(event["event"]["event_type"], "order.paid");
    let states: Vec<(&str, &str)> = event["subscriptions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| {
            (
                entry["subscription"].as_str().unwrap(),
                entry["state"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(states, [("invoices", "not_matched"), ("orders", "dead")]);
    let text = cli(&gateway, &["events", "get", &ids[2]]).await;
    assert!(
        text.success && text.stdout.contains("order.paid") && text.stdout.contains("timeout"),
        "{} {}",
        text.stdout,
        text.stderr
    );
    let missing = cli(
        &gateway,
        &["events", "get", &uuid::Uuid::new_v4().to_string()],
    )
    .await;
    assert!(
        !missing.success && missing.stderr.contains("not found"),
        "{}",
        missing.stderr
    );

    let no_selector = cli(&gateway, &["dlq", "resolve", "orders", "--by", "ops"]).await;
    assert_eq!(no_selector.code, Some(2), "{}", no_selector.stderr);
    assert!(
        no_selector.stderr.contains("--id") && no_selector.stderr.contains("--all"),
        "{}",
        no_selector.stderr
    );
    let everything = cli(
        &gateway,
        &["dlq", "resolve", "orders", "--all", "--by", "ops"],
    )
    .await;
    assert!(
        !everything.success && everything.stderr.contains("--yes"),
        "{}",
        everything.stderr
    );
    let by_error = cli(
        &gateway,
        &[
            "dlq",
            "resolve",
            "orders",
            "--last-error",
            "bad data",
            "--by",
            "ops",
            "--notes",
            "fixed upstream",
        ],
    )
    .await;
    assert!(by_error.success, "{}", by_error.stderr);
    assert_eq!(by_error.stdout.trim(), "resolved 2 dead letters");
    let by_id = cli(
        &gateway,
        &[
            "dlq", "resolve", "orders", "--id", &ids[2], "--by", "ops", "--json",
        ],
    )
    .await
    .json();
    assert_eq!(by_id["resolved_count"], 1);
    assert_eq!(
        subscription_stats(&gateway, "orders").await.dead_lettered,
        0
    );
}

#[tokio::test]
async fn a_wrong_port_and_a_missing_token_say_what_to_do() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.tokens = vec![outbox_gateway::auth::TokenConfig {
        name: "ops".into(),
        sha256: outbox_gateway::auth::token_digest("ops-secret"),
        roles: vec![outbox_gateway::auth::Role::Admin],
        event_types: Vec::new(),
        aggregate_types: Vec::new(),
        subscriptions: Vec::new(),
        sources: Vec::new(),
    }];
    let gateway = TestGateway::start_with_console(&database, config).await;
    let console = gateway.console.expect("a console").to_string();

    let http = cli_with_input(&console, &["stats"], None).await;
    assert!(!http.success);
    assert!(
        http.stderr
            .contains("that port speaks HTTP, not gRPC: is it --listen (default 50051)?"),
        "{}",
        http.stderr
    );

    // An HTTP/1 server only, as the metrics endpoint is: it answers the HTTP/2 preface
    // with 400 and hangs up.
    let http1 = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http1_address = http1.local_addr().unwrap().to_string();
    let _served = tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        while let Ok((mut connection, _)) = http1.accept().await {
            let mut request = [0u8; 1024];
            let _ = connection.read(&mut request).await;
            let _ = connection
                .write_all(b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\n\r\n")
                .await;
        }
    });
    let metrics_like = cli_with_input(&http1_address, &["stats"], None).await;
    assert!(
        !metrics_like.success
            && metrics_like
                .stderr
                .contains("that port speaks HTTP, not gRPC: is it --listen (default 50051)?"),
        "{}",
        metrics_like.stderr
    );

    let anonymous = cli(&gateway, &["stats"]).await;
    assert!(!anonymous.success);
    for hint in ["--token", "OUTBOX_TOKEN", "context"] {
        assert!(
            anonymous.stderr.contains(hint),
            "{hint}: {}",
            anonymous.stderr
        );
    }
    let with_token = cli(&gateway, &["stats", "--token", "ops-secret"]).await;
    assert!(with_token.success, "{}", with_token.stderr);

    // A selected context holds the token, but --endpoint names the gateway: the context
    // is not used, and the answer says so.
    let home = std::env::temp_dir().join(format!("outbox-contexts-{}", uuid::Uuid::new_v4()));
    let saved = cli_in(
        &home,
        &[
            "context",
            "save",
            "prod",
            "--endpoint",
            &gateway.endpoint(),
            "--token",
            "ops-secret",
            "--select",
        ],
        &[],
    )
    .await;
    assert!(saved.success, "{}", saved.stderr);
    let bypassed = cli_in(&home, &["stats", "--endpoint", &gateway.endpoint()], &[]).await;
    assert!(!bypassed.success);
    assert!(
        bypassed.stderr.contains("context \"prod\"")
            && bypassed.stderr.contains("--endpoint")
            && bypassed.stderr.contains("--context prod"),
        "{}",
        bypassed.stderr
    );
    let _ = std::fs::remove_dir_all(&home);
}

#[tokio::test]
async fn token_generate_takes_roles() {
    let generated = cli_with_input(
        "http://127.0.0.1:1",
        &[
            "token", "generate", "--name", "ops", "--role", "admin", "--role", "viewer",
        ],
        None,
    )
    .await;
    assert!(generated.success, "{}", generated.stderr);
    assert!(
        generated.stdout.contains("roles = [\"admin\", \"viewer\"]"),
        "{}",
        generated.stdout
    );
    let json = cli_with_input(
        "http://127.0.0.1:1",
        &["token", "generate", "--role", "subscriber", "--json"],
        None,
    )
    .await
    .json();
    assert_eq!(json["roles"], serde_json::json!(["subscriber"]));
    let unknown = cli_with_input(
        "http://127.0.0.1:1",
        &["token", "generate", "--role", "root"],
        None,
    )
    .await;
    assert_eq!(unknown.code, Some(2), "{}", unknown.stderr);
}

/// `stats --watch --json`, one JSON line per refresh, its output piped to the test.
fn spawn_stats_watch(endpoint: &str, interval: &str) -> tokio::process::Child {
    cli_command(
        endpoint,
        &["stats", "--watch", "--json", "--interval", interval],
    )
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .kill_on_drop(true)
    .spawn()
    .expect("run stats --watch")
}

/// Reads refreshes of `stats --watch --json` until one shows `events_stored` at `stored`.
async fn watch_until_stored(
    lines: &mut tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    stored: i64,
) -> usize {
    let mut refreshes = 0;
    loop {
        let line = tokio::time::timeout(WAIT, lines.next_line())
            .await
            .unwrap_or_else(|_| panic!("no refresh within {WAIT:?}"))
            .unwrap()
            .expect("stats --watch ended early");
        refreshes += 1;
        let figures: Value = serde_json::from_str(&line).expect("a JSON line per refresh");
        if figures["outbox"]["events_stored"] == stored {
            return refreshes;
        }
    }
}

/// `--watch` refreshes until interrupted: each refresh shows what changed since, and
/// Ctrl-C (SIGINT) or SIGTERM ends it with success, whenever the signal comes — also
/// while a refresh is being fetched, which a short interval makes the usual case.
#[tokio::test]
async fn stats_watch_refreshes_until_interrupted() {
    use tokio::io::AsyncBufReadExt;
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("orders")).await;
    for (signal, interval) in [("INT", "100ms"), ("TERM", "100ms"), ("INT", "1ms")] {
        let mut watch = spawn_stats_watch(&gateway.endpoint(), interval);
        let mut lines = tokio::io::BufReader::new(watch.stdout.take().unwrap()).lines();
        let stored = count_events(&database.pool().await).await;
        watch_until_stored(&mut lines, stored).await;
        publish(&gateway, vec![event("o-1", "order.created")]).await;
        watch_until_stored(&mut lines, stored + 1).await;
        send_signal(&watch, signal);
        drop(lines);
        let (status, stderr) = stderr_of(watch).await;
        assert!(
            status.success(),
            "SIG{signal} with --interval {interval}: {status}: {stderr}"
        );
        assert!(stderr.is_empty(), "{stderr}");
    }
}

/// A watched gateway that goes away ends `--watch` like any failed command: non-zero,
/// with one line saying the gateway cannot be reached.
#[tokio::test]
async fn stats_watch_ends_with_a_clear_failure_when_the_gateway_goes_away() {
    use tokio::io::AsyncBufReadExt;
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let mut watch = spawn_stats_watch(&gateway.endpoint(), "100ms");
    let mut lines = tokio::io::BufReader::new(watch.stdout.take().unwrap()).lines();
    assert!(watch_until_stored(&mut lines, 0).await >= 1);
    gateway.stop().await.unwrap();
    // Refreshes printed before the gateway was gone are still in the pipe.
    while let Ok(Ok(Some(_))) = tokio::time::timeout(WAIT, lines.next_line()).await {}
    let (status, stderr) = stderr_of(watch).await;
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("gateway"), "{stderr}");
}

#[tokio::test]
async fn sink_subscriptions_are_created_shown_and_switched_from_the_command_line() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.sinks = vec![outbox_gateway::sinks::SinkSettings {
        name: "events-kafka".into(),
        kind: "kafka".into(),
        brokers: vec![
            std::env::var("OUTBOX_TEST_KAFKA").unwrap_or_else(|_| "127.0.0.1:9092".into()),
        ],
        ..Default::default()
    }];
    let gateway = TestGateway::start_with(&database, config).await;

    let sinks = cli(&gateway, &["sinks", "--json"]).await.json();
    assert_eq!(sinks[0]["name"], "events-kafka");
    assert_eq!(sinks[0]["kind"], "kafka");
    assert_eq!(sinks[0]["status"], "reachable", "{sinks}");

    let created = cli(
        &gateway,
        &[
            "subscriptions",
            "create",
            "orders-kafka",
            "--sink",
            "events-kafka",
            "--topic",
            "orders-{aggregate_type}",
            "--sink-key",
            "{aggregate_id}",
            "--json",
        ],
    )
    .await
    .json();
    assert_eq!(created["sink"]["name"], "events-kafka");
    assert_eq!(created["sink"]["topic"], "orders-{aggregate_type}");
    assert_eq!(created["sink"]["key"], "{aggregate_id}");
    let shown = cli(&gateway, &["subscriptions", "get", "orders-kafka"]).await;
    assert!(
        shown
            .stdout
            .contains("sink events-kafka (topic orders-{aggregate_type}, key {aggregate_id})"),
        "{}",
        shown.stdout
    );

    // A subject on a Kafka sink is refused, naming the field; nothing is stored.
    let refused = cli(
        &gateway,
        &[
            "subscriptions",
            "create",
            "refused",
            "--sink",
            "events-kafka",
            "--topic",
            "orders",
            "--subject",
            "orders.created",
        ],
    )
    .await;
    assert!(!refused.success);
    assert!(
        refused.stderr.contains("subscription.sink.subject"),
        "{}",
        refused.stderr
    );
    let listed = cli(&gateway, &["subscriptions", "list", "--json"])
        .await
        .json();
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");

    // Back to pull.
    let pulled = cli(
        &gateway,
        &[
            "subscriptions",
            "update",
            "orders-kafka",
            "--pull",
            "--json",
        ],
    )
    .await
    .json();
    assert!(pulled["sink"].is_null(), "{pulled}");
}

#[tokio::test]
async fn filters_transforms_and_push_batches_are_set_from_the_command_line() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.push.allowed_hosts =
        outbox_gateway::domain::AllowedHosts::parse(&["127.0.0.1".to_owned()]).unwrap();
    let gateway = TestGateway::start_with(&database, config).await;
    let filter = r#"payload.total > 1000.0 && metadata.tenant == "acme""#;
    let transform = r#"{"id": payload.id}"#;
    let created = cli(
        &gateway,
        &[
            "subscriptions",
            "create",
            "big-orders",
            "--filter",
            filter,
            "--transform",
            transform,
            "--push-endpoint",
            "http://127.0.0.1:9/hook",
            "--push-batch",
            "100",
            "--push-batch-wait",
            "50ms",
            "--json",
        ],
    )
    .await
    .json();
    assert_eq!(created["filter"], filter);
    assert_eq!(created["transform"], transform);
    assert_eq!(created["push"]["max_batch_events"], 100);
    assert_eq!(created["push"]["max_batch_wait"], "50ms");

    let shown = cli(&gateway, &["subscriptions", "get", "big-orders"]).await;
    assert!(shown.success, "{}", shown.stderr);
    assert!(shown.stdout.contains(filter), "{}", shown.stdout);
    assert!(
        shown.stdout.contains("in batches of up to 100 events"),
        "{}",
        shown.stdout
    );

    let refused = cli(
        &gateway,
        &[
            "subscriptions",
            "update",
            "big-orders",
            "--filter",
            "payload.total >",
        ],
    )
    .await;
    assert!(!refused.success);
    assert!(
        refused
            .stderr
            .contains("subscription.filter: syntax error at 1:16"),
        "{}",
        refused.stderr
    );

    let cleared = cli(
        &gateway,
        &[
            "subscriptions",
            "update",
            "big-orders",
            "--clear-filter",
            "--clear-transform",
            "--json",
        ],
    )
    .await
    .json();
    assert_eq!(
        (&cleared["filter"], &cleared["transform"]),
        (&Value::from(""), &Value::from(""))
    );
}

/// Invalid input exits 2 whichever command carries it: a flag clap refuses, a file
/// `apply` refuses, or a setting the gateway refuses; a subscription that does not
/// exist is a failure (1).
#[tokio::test]
async fn invalid_settings_exit_2_from_subscriptions_as_from_apply() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let created = cli(&gateway, &["subscriptions", "create", "orders"]).await;
    assert!(created.success, "{}", created.stderr);
    let list = || async {
        gateway
            .admin()
            .await
            .list_subscriptions(outbox_gateway::proto::ListSubscriptionsRequest {})
            .await
            .unwrap()
            .into_inner()
            .subscriptions
    };
    let before = list().await;

    let long_reason = "x".repeat(2000);
    for args in [
        &["subscriptions", "create", "Bad Name"][..],
        &["subscriptions", "create", "other", "--ack-deadline", "0s"],
        &[
            "subscriptions",
            "update",
            "orders",
            "--filter",
            "payload.total >",
        ],
        &["subscriptions", "pause", "orders", "--reason", &long_reason],
    ] {
        let run = cli(&gateway, args).await;
        assert_eq!(run.code, Some(2), "{args:?}: {}", run.stderr);
        assert!(
            run.stderr.contains("invalid argument: "),
            "{args:?}: {}",
            run.stderr
        );
        assert_eq!(list().await, before, "{args:?} changed something");
    }
    let applied = cli_with_input(
        &gateway.endpoint(),
        &["apply", "-f", "-"],
        Some("subscriptions:\n  - name: Bad Name\n  - name: orders\n"),
    )
    .await;
    assert_eq!(applied.code, Some(2), "{}", applied.stderr);
    assert_eq!(list().await, before);

    let missing = cli(
        &gateway,
        &["subscriptions", "update", "nowhere", "--max-attempts", "3"],
    )
    .await;
    assert_eq!(missing.code, Some(1), "{}", missing.stderr);
}

/// `outbox-gateway tail SUB --no-ack | head -1` while nothing more is due: tail notices
/// the reader is gone without waiting for a delivery to write.
#[tokio::test]
async fn tail_ends_when_its_reader_goes_away_while_nothing_arrives() {
    use tokio::io::AsyncBufReadExt;
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    // The printed delivery, unacked, comes back only after its deadline: long past the
    // bound below, so no write can be what ends tail.
    create_subscription(
        &gateway,
        outbox_gateway::proto::Subscription {
            ack_deadline: Some(prost_types::Duration {
                seconds: 120,
                nanos: 0,
            }),
            ..subscription("orders")
        },
    )
    .await;
    publish(&gateway, vec![event("o-1", "order.created")]).await;
    let mut tail = cli_command(&gateway.endpoint(), &["tail", "orders", "--no-ack"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("run tail");
    let mut lines = tokio::io::BufReader::new(tail.stdout.take().unwrap()).lines();
    let first = tokio::time::timeout(WAIT, lines.next_line())
        .await
        .expect("a delivery")
        .unwrap()
        .expect("a line");
    assert!(first.contains("order.created"), "{first}");
    drop(lines);
    let within = std::time::Duration::from_secs(5);
    let Ok(output) = tokio::time::timeout(within, tail.wait_with_output()).await else {
        panic!("tail still runs {within:?} after its reader went away");
    };
    let output = output.unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{}: {stderr}", output.status);
    assert_eq!(stderr, "");
}

/// `dead-letters`, the console's word, is `dlq`, and a near miss is pointed to it;
/// `subscriptions list` says how each subscription delivers and what its filter takes.
#[tokio::test]
async fn dead_letters_is_dlq_and_the_list_shows_kind_and_filter() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    config.push.allowed_hosts =
        outbox_gateway::domain::AllowedHosts::parse(&["127.0.0.1".to_owned()]).unwrap();
    config.sinks = vec![outbox_gateway::sinks::SinkSettings {
        name: "js".into(),
        kind: "nats".into(),
        servers: vec!["nats://127.0.0.1:4222".into()],
        ..Default::default()
    }];
    let gateway = TestGateway::start_with(&database, config).await;
    let filter =
        "payload.total > 1000.0 &&\n  metadata.tenant == \"acme\" && payload.region == \"eu\"";
    for args in [
        &[
            "create",
            "orders",
            "--event-type",
            "order.*",
            "--filter",
            filter,
        ][..],
        &[
            "create",
            "hooks",
            "--push-endpoint",
            "http://127.0.0.1:9/hook",
        ],
        &[
            "create",
            "bus",
            "--sink",
            "js",
            "--subject",
            "orders.created",
        ],
    ] {
        let created = cli(&gateway, &[&["subscriptions"], args].concat()).await;
        assert!(created.success, "{args:?}: {}", created.stderr);
    }

    let by_alias = cli(&gateway, &["dead-letters", "list", "orders", "--json"]).await;
    assert!(by_alias.success, "{}", by_alias.stderr);
    let by_name = cli(&gateway, &["dlq", "list", "orders", "--json"]).await;
    assert_eq!(by_alias.stdout, by_name.stdout);
    let near_miss = cli(&gateway, &["dead-letter", "list", "orders"]).await;
    assert_eq!(near_miss.code, Some(2), "{}", near_miss.stderr);
    assert!(
        near_miss.stderr.contains("'dead-letters'"),
        "{}",
        near_miss.stderr
    );
    let help = cli(&gateway, &["--help"]).await;
    assert!(help.stdout.contains("dead-letters"), "{}", help.stdout);

    let text = cli(&gateway, &["subscriptions", "list"]).await;
    assert!(text.success, "{}", text.stderr);
    let lines: Vec<&str> = text.stdout.lines().collect();
    let header: Vec<&str> = lines[0].split_whitespace().collect();
    assert!(
        header.starts_with(&["NAME", "KIND", "EVENT", "TYPES"]) && header.contains(&"FILTER"),
        "{}",
        text.stdout
    );
    let row = |name: &str| {
        lines
            .iter()
            .find(|line| line.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no row for {name}: {}", text.stdout))
            .to_string()
    };
    let orders = row("orders");
    assert!(
        orders.contains(" pull ")
            && orders.contains("order.*")
            && orders.contains("payload.total > 1000.0 && metadata.ten")
            && orders.contains('…')
            && !orders.contains("eu"),
        "the filter on one line, shortened: {}",
        text.stdout
    );
    assert!(row("hooks").contains(" push "), "{}", text.stdout);
    assert!(row("bus").contains(" sink:js "), "{}", text.stdout);

    let listed = cli(&gateway, &["subscriptions", "list", "--json"])
        .await
        .json();
    let kinds: Vec<(&str, &str)> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["name"].as_str().unwrap(), s["kind"].as_str().unwrap()))
        .collect();
    for expected in [("bus", "sink"), ("hooks", "push"), ("orders", "pull")] {
        assert!(kinds.contains(&expected), "{listed}");
    }
    let orders = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "orders")
        .unwrap();
    assert_eq!(
        (&orders["filter"], &orders["event_types"][0]),
        (&Value::from(filter), &Value::from("order.*"))
    );
}
