//! What a new user meets when starting `outbox-gateway serve`: clear, bounded failures
//! for a wrong database URL or a taken port, no secrets in help, host names accepted;
//! without a database URL, a private PostgreSQL of its own, and a refusal to guess when
//! both it and a server at the default URL could be meant.

use std::{path::PathBuf, process::Output, time::Duration};

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
    let _cleanup = ClusterCleanup(data_dir.clone());
    let socket_directory = data_dir.join("postgres");
    let url = format!(
        "postgres://postgres@localhost/outbox?host={}",
        socket_directory.display()
    );

    let (child, log, channel) = start_without_database(&data_dir).await;
    // One line says what it did and why, the next gives the URL other services can use.
    let announced = announcement(&log, "initialised a new private PostgreSQL cluster");
    assert!(announced.contains("--data-dir given"), "{announced}");
    assert!(
        !announced.contains("none answers"),
        "PostgreSQL answers at the default URL: {announced}"
    );
    assert_url_line(&log, &url);
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
    announcement(&log, "reused the private PostgreSQL cluster");
    assert_url_line(&log, &url);
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

/// The beginnings of the lines saying what became of the private cluster.
const LIFECYCLE: [&str; 3] = [
    "initialised a new private PostgreSQL cluster",
    "reused the private PostgreSQL cluster",
    "adopted the private PostgreSQL cluster",
];

/// The one line of `log` saying what became of the private cluster, which must say
/// `what`; fails the test when there is none, or more than one.
fn announcement(log: &ProcessLog, what: &str) -> String {
    let lifecycle: Vec<String> = log
        .lines()
        .into_iter()
        .filter(|line| LIFECYCLE.iter().any(|start| line.contains(start)))
        .collect();
    assert_eq!(
        lifecycle.len(),
        1,
        "one line on the cluster: {}",
        log.text()
    );
    assert!(
        lifecycle[0].contains(what),
        "not {what:?}: {}",
        lifecycle[0]
    );
    lifecycle[0].clone()
}

/// Fails the test unless the line after the cluster's announcement carries `url` and
/// nothing else, so that it can be copied whole.
fn assert_url_line(log: &ProcessLog, url: &str) {
    let lines = log.lines();
    let announced = lines
        .iter()
        .position(|line| LIFECYCLE.iter().any(|start| line.contains(start)))
        .unwrap_or_else(|| panic!("no announcement in:\n{}", log.text()));
    let next = lines.get(announced + 1).map(String::as_str).unwrap_or("");
    assert!(
        next.ends_with(&format!("outbox_gateway::local_database: {url}")),
        "not the URL alone: {next}"
    );
}

/// A temporary directory holding a private cluster (in `postgres/` under it, or under
/// `outbox-gateway/postgres`): when dropped, even after a failed assertion, stops a
/// server left running there and removes the directory.
struct ClusterCleanup(PathBuf);

impl Drop for ClusterCleanup {
    fn drop(&mut self) {
        for data in [
            self.0.join("postgres"),
            self.0.join("outbox-gateway/postgres"),
        ] {
            if data.join("postmaster.pid").exists()
                && let Some(bin) = outbox_local_postgres::find_binaries()
            {
                let pg_ctl = bin.join("pg_ctl");
                let mut command = std::process::Command::new("setpriv");
                if outbox_local_postgres::running_as_root() {
                    // As root the server runs as postgres; pg_ctl refuses root.
                    command.args(AS_POSTGRES);
                }
                let _ = command
                    .arg(&pg_ctl)
                    .args(["stop", "-m", "immediate", "-w", "-D"])
                    .arg(&data)
                    .output();
            }
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `setpriv` arguments that run the rest as the `postgres` user, with its group only.
const AS_POSTGRES: [&str; 4] = [
    "--reuid=postgres",
    "--regid=postgres",
    "--clear-groups",
    "--",
];

fn temporary_directory(what: &str) -> PathBuf {
    std::env::temp_dir().join(format!("outbox-{what}-{}", uuid::Uuid::new_v4().simple()))
}

#[tokio::test]
async fn a_cluster_a_killed_gateway_left_running_is_adopted_and_said_so() {
    let data_dir = temporary_directory("first-run");
    let _cleanup = ClusterCleanup(data_dir.clone());
    let pid_file = data_dir.join("postgres/postmaster.pid");
    let url = format!(
        "postgres://postgres@localhost/outbox?host={}",
        data_dir.join("postgres").display()
    );
    let (mut child, log, _) = start_without_database(&data_dir).await;
    announcement(&log, "initialised a new private PostgreSQL cluster");
    let killed = child.id().expect("the gateway runs");
    // As a crash would: the server, in a process group of its own, outlives it.
    child.kill().await.unwrap();
    assert!(pid_file.exists(), "the server stopped with the gateway");

    let (child, log, channel) = start_without_database(&data_dir).await;
    let adopted = announcement(&log, "left running when it ended without stopping it");
    assert!(
        adopted.contains(&format!("previous_pid={killed}")),
        "{adopted}"
    );
    assert_url_line(&log, &url);
    create_subscription_over(channel, subscription("orders")).await;
    stop_gateway(child, &log).await;
    assert!(
        !pid_file.exists(),
        "the adopted server still runs after the gateway stopped"
    );
}

/// The default URL, which a plain `serve` probes.
const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/outbox";

/// Where a plain `outbox-gateway serve` (no --database-url, no --data-dir) runs in
/// these tests.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Network {
    /// The machine's, where the tests' PostgreSQL answers at the default URL.
    Shared,
    /// A network namespace of its own (`unshare --net`), where nothing answers there.
    Empty,
}

/// A home for plain `outbox-gateway serve`, whose default data directory is
/// `$XDG_DATA_HOME/outbox-gateway`, here under a temporary directory. As root the
/// default would be the machine's /var/lib/outbox-gateway, which a test must not touch:
/// there the gateway runs as the `postgres` user instead, for whom the default is the
/// XDG one, as for any user. The gateway is started as it runs for a user, with no
/// setting of its own pointing it elsewhere.
struct PlainHome {
    root: PathBuf,
    /// The gateway binary, where the user it runs as can reach it.
    binary: PathBuf,
    _cleanup: ClusterCleanup,
}

impl PlainHome {
    fn new() -> PlainHome {
        let root = temporary_directory("plain-serve");
        std::fs::create_dir(&root).unwrap();
        let cleanup = ClusterCleanup(root.clone());
        let mut binary = PathBuf::from(env!("CARGO_BIN_EXE_outbox-gateway"));
        if outbox_local_postgres::running_as_root() {
            // The checkout may sit where only root can reach (under /root): the postgres
            // user runs a link to (or a copy of) the binary in its own home.
            let reachable = root.join("outbox-gateway-bin");
            if std::fs::hard_link(&binary, &reachable).is_err() {
                std::fs::copy(&binary, &reachable).expect("copy the gateway binary");
            }
            binary = reachable;
            let chown = std::process::Command::new("chown")
                .arg("postgres:")
                .arg(&root)
                .status()
                .expect("chown runs");
            assert!(chown.success(), "the postgres user owns the home");
        }
        PlainHome {
            root,
            binary,
            _cleanup: cleanup,
        }
    }

    /// The default data directory there.
    fn cluster_directory(&self) -> PathBuf {
        self.root.join("outbox-gateway")
    }

    fn url(&self) -> String {
        format!(
            "postgres://postgres@localhost/outbox?host={}",
            self.cluster_directory().join("postgres").display()
        )
    }

    fn pid_file(&self) -> PathBuf {
        self.cluster_directory().join("postgres/postmaster.pid")
    }

    /// `outbox-gateway serve` with no database settings, in `network`.
    fn serve(&self, network: Network) -> Command {
        let root = outbox_local_postgres::running_as_root();
        let mut program: Vec<&str> = Vec::new();
        if network == Network::Empty {
            program.extend(["unshare", "--net"]);
            if !root {
                // Without root, a user namespace mapping this user to itself allows it.
                program.push("--map-current-user");
            }
        }
        if root {
            program.push("setpriv");
            program.extend(AS_POSTGRES);
        }
        let binary = self.binary.to_str().expect("a UTF-8 path");
        program.push(binary);
        let mut command = Command::new(program[0]);
        command
            .args(&program[1..])
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(["--console-listen", "off", "--metrics-listen", "off"])
            .current_dir(&self.root)
            .env("XDG_DATA_HOME", &self.root)
            .env("HOME", &self.root)
            .env_remove("RUST_LOG")
            .env_remove("DATABASE_URL")
            .env_remove("OUTBOX_CONFIG")
            .env_remove("OUTBOX_DATA_DIR")
            .env_remove("OUTBOX_POSTGRES_BIN")
            .kill_on_drop(true);
        command
    }

    /// A plain `serve` in `network`, once it says it serves gRPC (which the test cannot
    /// reach in an [`Network::Empty`] one; its database it can, through the socket).
    async fn serving(&self, network: Network) -> (tokio::process::Child, ProcessLog) {
        let mut child = self
            .serve(network)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start the gateway");
        let log = ProcessLog::collect(&mut child);
        log.announced("serving gRPC", &mut child).await;
        (child, log)
    }
}

/// How many events the outbox behind `url` holds.
async fn events_stored(url: &str) -> i64 {
    let pool = sqlx::PgPool::connect(url)
        .await
        .expect("connect through the socket");
    let count = sqlx::query_scalar("SELECT count(*) FROM outbox_events")
        .fetch_one(&pool)
        .await
        .expect("count the events");
    pool.close().await;
    count
}

#[tokio::test]
async fn plain_serve_makes_a_cluster_in_the_default_directory_when_none_answers_then_reuses_it() {
    let home = PlainHome::new();
    let url = home.url();

    // Nothing answers at the default URL, and there is no cluster: one is made.
    let (child, log) = home.serving(Network::Empty).await;
    let announced = announcement(&log, "initialised a new private PostgreSQL cluster");
    assert!(
        announced.contains(&format!("none answers at {DEFAULT_URL}")),
        "{announced}"
    );
    assert!(
        announced.contains(&home.cluster_directory().display().to_string()),
        "not in the default directory: {announced}"
    );
    assert_url_line(&log, &url);
    // Another service on this machine publishes through the URL.
    let pool = sqlx::PgPool::connect(&url)
        .await
        .expect("connect through the socket");
    sqlx::query("SELECT outbox_publish('order', 'o-1', 'order.created', '{}'::jsonb)")
        .execute(&pool)
        .await
        .expect("publish through SQL");
    pool.close().await;
    stop_gateway(child, &log).await;
    assert!(!home.pid_file().exists(), "the server outlived the gateway");

    // Only the cluster: it is used again, and says so.
    let (child, log) = home.serving(Network::Empty).await;
    let announced = announcement(&log, "reused the private PostgreSQL cluster");
    assert!(
        announced.contains(&format!("none answers at {DEFAULT_URL}")),
        "{announced}"
    );
    assert_url_line(&log, &url);
    assert_eq!(events_stored(&url).await, 1, "the data was kept");
    stop_gateway(child, &log).await;
    assert!(!home.pid_file().exists(), "the server outlived the gateway");
}

#[tokio::test]
async fn plain_serve_refuses_to_guess_between_the_default_url_and_its_cluster() {
    // The tests' PostgreSQL answers at the default URL.
    let _database = TestDatabase::create().await;
    assert!(
        tokio::net::TcpStream::connect("127.0.0.1:5432")
            .await
            .is_ok(),
        "this test needs PostgreSQL at 127.0.0.1:5432"
    );
    let home = PlainHome::new();
    let (child, log) = home.serving(Network::Empty).await;
    announcement(&log, "initialised a new private PostgreSQL cluster");
    stop_gateway(child, &log).await;
    let lock = home.cluster_directory().join("postgres.lock");
    let holder = std::fs::read_to_string(&lock).unwrap();

    // Both could be meant: it names both, and how to choose, and starts nothing.
    let output = exit_of(home.serve(Network::Shared)).await;
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    let socket_directory = home.cluster_directory().join("postgres");
    for named in [
        format!("PostgreSQL answers at the default URL {DEFAULT_URL}"),
        format!(
            "cluster an earlier run created is in {}",
            socket_directory.display()
        ),
        format!("URL {}", home.url()),
        format!("--database-url '{DEFAULT_URL}'"),
        format!("--data-dir '{}'", home.cluster_directory().display()),
    ] {
        assert!(stderr.contains(&named), "{named:?} is not said: {stderr}");
    }
    assert!(!stderr.contains("none answers"), "{stderr}");
    assert!(!stderr.contains("serving gRPC"), "{stderr}");
    assert!(!home.pid_file().exists(), "the private server was started");
    assert_eq!(
        std::fs::read_to_string(&lock).unwrap(),
        holder,
        "the cluster's directory was taken"
    );
}
