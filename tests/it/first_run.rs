//! What a new user meets when starting `outbox-gateway serve`: clear, bounded failures
//! for a wrong database URL or a taken port, no secrets in help, host names accepted;
//! without a database URL, a private PostgreSQL of its own.

use std::{process::Output, time::Duration};

use crate::common::*;
use outbox_gateway::proto::{self, admin_client::AdminClient};
use outbox_testkit::gateway;
use tokio::{net::TcpListener, process::Command};

/// Far above the 1 s connect bound the tests set; a hang would exceed it.
const LIMIT: Duration = Duration::from_secs(60);

fn gateway_command(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_outbox-gateway"));
    command
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove("DATABASE_URL")
        .kill_on_drop(true);
    command
}

/// Runs the binary until it exits; fails the test when it outlives [`LIMIT`].
async fn exit_of(mut command: Command) -> Output {
    tokio::time::timeout(LIMIT, command.output())
        .await
        .expect("the gateway gives up instead of hanging")
        .expect("the binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test]
async fn a_url_that_is_not_postgresql_is_refused_before_connecting() {
    let output = exit_of(gateway_command(&[
        "serve",
        "--database-url",
        "mysql://root:hunter2@127.0.0.1:3306/outbox",
        "--console-listen",
        "off",
        "--metrics-listen",
        "off",
    ]))
    .await;
    assert_eq!(output.status.code(), Some(2), "{}", text(&output.stderr));
    let stderr = text(&output.stderr);
    assert!(stderr.contains("--database-url"), "{stderr}");
    assert!(stderr.contains("mysql://"), "{stderr}");
    assert!(
        !stderr.contains("hunter2"),
        "the password is shown: {stderr}"
    );
}

#[tokio::test]
async fn a_port_that_is_not_postgresql_fails_within_the_connect_timeout() {
    // Accepts connections and never says a word, like a port of some other server.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = silent.local_addr().unwrap().port();
    let held = tokio::spawn(async move {
        let mut connections = Vec::new();
        while let Ok((connection, _)) = silent.accept().await {
            connections.push(connection);
        }
    });
    let output = exit_of(gateway_command(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--database-url",
        &format!("postgres://postgres:hunter2@127.0.0.1:{port}/outbox"),
        "--db-connect-timeout",
        "1s",
        "--console-listen",
        "off",
        "--metrics-listen",
        "off",
    ]))
    .await;
    held.abort();
    let stderr = text(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("connecting to PostgreSQL"),
        "says what it waits for: {stderr}"
    );
    assert!(
        stderr.contains(&format!("no answer from PostgreSQL at 127.0.0.1:{port}")),
        "{stderr}"
    );
    assert!(stderr.contains("--db-connect-timeout"), "{stderr}");
    assert!(
        !stderr.contains("hunter2"),
        "the password is shown: {stderr}"
    );
}

#[tokio::test]
async fn a_taken_metrics_port_is_fatal() {
    let database = TestDatabase::create().await;
    let taken = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics = taken.local_addr().unwrap().to_string();
    let output = exit_of(gateway_command(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--database-url",
        &database.url(),
        "--console-listen",
        "off",
        "--metrics-listen",
        &metrics,
    ]))
    .await;
    let stderr = text(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("cannot serve metrics on {metrics}")),
        "{stderr}"
    );
    assert!(stderr.contains("--metrics-listen off"), "{stderr}");
}

#[tokio::test]
async fn help_never_shows_the_database_password() {
    let output = exit_of({
        let mut command = gateway_command(&["serve", "--help"]);
        command.env("DATABASE_URL", "postgres://app:hunter2@db.internal/outbox");
        command
    })
    .await;
    let help = text(&output.stdout);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert!(help.contains("--database-url"), "{help}");
    assert!(!help.contains("hunter2"), "the password is shown: {help}");
}

#[tokio::test]
async fn host_names_are_accepted_where_addresses_are() {
    let database = TestDatabase::create().await;
    // Port 0: the gateway binds a free port and says which in its log.
    let mut command = gateway_command(&[
        "serve",
        "--listen",
        "localhost:0",
        "--database-url",
        &database.url(),
        "--console-listen",
        "off",
        "--metrics-listen",
        "localhost:0",
    ]);
    command
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    let mut child = command.spawn().unwrap();
    let log = ProcessLog::collect(&mut child);
    let address = log.announced("serving gRPC", &mut child).await;
    let metrics_port = log.announced("serving metrics", &mut child).await.port();
    let serving =
        gateway::wait_until_serving(address, LIMIT, || matches!(child.try_wait(), Ok(None))).await;
    assert_eq!(serving, Ok(()), "not serving on localhost: {}", log.text());
    let scrape = reqwest::get(format!("http://localhost:{metrics_port}/metrics"))
        .await
        .expect("metrics on localhost");
    assert_eq!(scrape.status(), reqwest::StatusCode::OK);
    child.start_kill().unwrap();
    let _ = child.wait().await;
}

#[tokio::test]
async fn database_errors_are_in_the_gateways_words() {
    let output = exit_of(gateway_command(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--database-url",
        "postgres://no_such_role_for_outbox@127.0.0.1:5432/outbox",
        "--console-listen",
        "off",
        "--metrics-listen",
        "off",
    ]))
    .await;
    let stderr = text(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("does not exist (SQLSTATE 28000)"),
        "PostgreSQL's message with its code: {stderr}"
    );
    assert!(!stderr.contains(" at line "), "driver noise: {stderr}");
    assert!(!stderr.contains("error returned from database"), "{stderr}");
}

/// `serve` without a database URL, keeping its private PostgreSQL in `data_dir`, with
/// `extra` arguments.
fn without_database(data_dir: &std::path::Path, extra: &[&str]) -> Command {
    let data_dir = data_dir.to_string_lossy();
    let mut args = vec![
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--console-listen",
        "off",
        "--metrics-listen",
        "off",
        "--data-dir",
        &data_dir,
    ];
    args.extend_from_slice(extra);
    gateway_command(&args)
}

/// A gateway given no database URL, keeping its private PostgreSQL in `data_dir`; with
/// its log and gRPC address once it serves.
async fn start_without_database(
    data_dir: &std::path::Path,
) -> (tokio::process::Child, ProcessLog, tonic::transport::Channel) {
    let (child, log, _, channel) = serving_process(without_database(data_dir, &[])).await;
    (child, log, channel)
}

/// Ends the gateway with SIGTERM and waits for it to exit.
async fn stop_gateway(mut child: tokio::process::Child, log: &ProcessLog) {
    send_signal(&child, "TERM");
    let status = tokio::time::timeout(LIMIT, child.wait())
        .await
        .unwrap_or_else(|_| panic!("the gateway did not stop; its log:\n{}", log.text()))
        .unwrap();
    assert!(status.success(), "{status}: {}", log.text());
}

#[tokio::test]
async fn without_a_database_the_gateway_runs_a_private_postgresql_and_keeps_its_data() {
    let data_dir = std::env::temp_dir().join(format!(
        "outbox-first-run-{}",
        uuid::Uuid::new_v4().simple()
    ));
    let socket_directory = data_dir.join("postgres");
    let url = format!(
        "postgres://postgres@localhost/outbox?host={}",
        socket_directory.display()
    );

    let (child, log, channel) = start_without_database(&data_dir).await;
    // One line says so, with the URL other services can use.
    let announced = log
        .lines()
        .into_iter()
        .find(|line| line.contains("running a private PostgreSQL"))
        .unwrap_or_else(|| panic!("no announcement in:\n{}", log.text()));
    assert!(announced.contains(&url), "{announced}");
    create_subscription_over(channel, subscription("orders")).await;
    // Another service publishes through the URL, in its own transaction.
    let pool = sqlx::PgPool::connect(&url)
        .await
        .expect("connect through the socket");
    sqlx::query("SELECT outbox_publish('order', 'o-1', 'order.created', '{}'::jsonb)")
        .execute(&pool)
        .await
        .expect("publish through SQL");
    pool.close().await;

    // A second gateway on the same directory is refused, saying how to share it.
    let second = exit_of(without_database(&data_dir, &[])).await;
    let stderr = text(&second.stderr);
    assert_eq!(second.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("another process (pid"), "{stderr}");
    assert!(
        stderr.contains(&format!("--database-url '{url}'")),
        "{stderr}"
    );

    // Shutdown stops the server.
    stop_gateway(child, &log).await;
    assert!(
        !socket_directory.join("postmaster.pid").exists(),
        "the server still runs after the gateway stopped"
    );

    // A restart finds the data where it was.
    let (child, log, channel) = start_without_database(&data_dir).await;
    let mut admin = AdminClient::new(channel);
    let subscriptions = admin
        .list_subscriptions(proto::ListSubscriptionsRequest {})
        .await
        .unwrap()
        .into_inner()
        .subscriptions;
    assert_eq!(subscriptions.len(), 1);
    let stats = admin
        .get_stats(proto::GetStatsRequest {
            subscription: "orders".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.outbox.map(|outbox| outbox.events_stored), Some(1));
    stop_gateway(child, &log).await;
    std::fs::remove_dir_all(&data_dir).unwrap();
}

#[tokio::test]
async fn without_postgresql_binaries_the_gateway_says_how_to_get_them() {
    let data_dir = std::env::temp_dir().join(format!(
        "outbox-first-run-{}",
        uuid::Uuid::new_v4().simple()
    ));
    let output = exit_of(without_database(
        &data_dir,
        &["--postgres-bin", "/nonexistent/postgresql/bin"],
    ))
    .await;
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("no initdb and pg_ctl in /nonexistent/postgresql/bin (--postgres-bin)"),
        "{stderr}"
    );
    // How to install them, or to do without.
    for way in [
        "apt install postgresql",
        "dnf install postgresql-server",
        "brew install postgresql@17",
        "--database-url",
    ] {
        assert!(stderr.contains(way), "{way} is not named: {stderr}");
    }
    let _ = std::fs::remove_dir_all(&data_dir);
}
