//! Shared helpers of the integration tests: a throw-away database per test, a real
//! gateway served on 127.0.0.1:0, gRPC clients, and a TCP proxy that can cut the
//! gateway off from PostgreSQL.
#![allow(dead_code)]

pub mod proxy;

use std::{
    fs::File,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Stdio,
    sync::Arc,
    time::Duration,
};

use outbox_gateway::{
    Config,
    proto::{
        self, admin_client::AdminClient, publisher_client::PublisherClient,
        subscriber_client::SubscriberClient,
    },
};
pub use outbox_testkit::poll_until;
use outbox_testkit::{ThrowawayDatabase, test_server_url};
use sqlx::PgPool;
use tokio::{net::TcpListener, process::Command, sync::oneshot, task::JoinHandle};
use tonic::transport::Channel;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

/// How long building a Python virtual environment may take.
const PYTHON_INSTALL_TIME: Duration = Duration::from_secs(300);

/// A Python virtual environment holding `packages` (pip requirement specifiers), built
/// under the target directory in `name` and again when the list changes; returns its
/// Python. A file lock keeps concurrent tests (and test processes) from building it
/// twice. `PYTHON` names another Python 3 to build it with.
pub async fn python_venv(name: &str, packages: &[&str]) -> PathBuf {
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&cache).expect("create the venv cache");
    let lock = File::create(cache.join("venv.lock")).expect("create the venv lock");
    let _lock = tokio::task::spawn_blocking(move || lock.lock().map(|()| lock))
        .await
        .expect("lock task")
        .expect("lock the venv");
    let venv = cache.join("venv");
    let python = venv.join("bin").join("python");
    let installed = venv.join("installed-packages.txt");
    let wanted = packages.join("\n");
    if python.exists() && std::fs::read_to_string(&installed).ok().as_ref() == Some(&wanted) {
        return python;
    }
    let _ = std::fs::remove_dir_all(&venv);
    let system_python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    run(
        &format!("`{system_python} -m venv` (Python 3 with venv is required for this test)"),
        Command::new(&system_python)
            .arg("-m")
            .arg("venv")
            .arg(&venv),
        PYTHON_INSTALL_TIME,
    )
    .await;
    run(
        &format!("pip install {}", packages.join(" ")),
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(packages),
        PYTHON_INSTALL_TIME,
    )
    .await;
    std::fs::write(&installed, wanted).expect("record the installed packages");
    python
}

/// The requirement lines of a requirements.txt of the repository.
pub fn requirements(path: &str) -> Vec<String> {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&file)
        .unwrap_or_else(|error| panic!("read {path}: {error}"))
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(str::to_owned)
        .collect()
}

/// Runs `command` to completion and returns its standard output. Panics, naming `what`
/// and showing its output, when it cannot start, fails or outlives `limit`.
pub async fn run(what: &str, command: &mut Command, limit: Duration) -> String {
    command.stdin(Stdio::null()).kill_on_drop(true);
    let output = tokio::time::timeout(limit, command.output())
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {limit:?}"))
        .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// What a gateway binary run as a child process writes to its piped standard output
/// and error, collected line by line.
#[derive(Clone, Default)]
pub struct ProcessLog {
    lines: Arc<std::sync::Mutex<Vec<String>>>,
}

impl ProcessLog {
    /// Collects what `child` writes from now on to whichever of its standard output and
    /// error are piped.
    pub fn collect(child: &mut tokio::process::Child) -> ProcessLog {
        use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
        let log = ProcessLog::default();
        let outputs: [Option<Box<dyn AsyncRead + Send + Unpin>>; 2] = [
            child.stdout.take().map(|out| Box::new(out) as _),
            child.stderr.take().map(|err| Box::new(err) as _),
        ];
        for output in outputs.into_iter().flatten() {
            let lines = log.lines.clone();
            tokio::spawn(async move {
                let mut reader = BufReader::new(output).lines();
                while let Ok(Some(line)) = reader.next_line().await {
                    lines.lock().unwrap().push(line);
                }
            });
        }
        log
    }

    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    pub fn text(&self) -> String {
        self.lines().join("\n")
    }

    /// The address the gateway says it serves `announcement` on (`"serving gRPC"`,
    /// `"serving metrics"`): started on port 0, it tells the port it bound. Fails the
    /// test, with the log, when the process ends or stays silent.
    pub async fn announced(
        &self,
        announcement: &str,
        child: &mut tokio::process::Child,
    ) -> SocketAddr {
        let announced = outbox_testkit::gateway::wait_for_announcement(
            announcement,
            Duration::from_secs(30),
            || self.text(),
            || matches!(child.try_wait(), Ok(None)),
        )
        .await;
        announced.unwrap_or_else(|error| {
            panic!(
                "no {announcement:?} from the gateway: {error}; its log:\n{}",
                self.text()
            )
        })
    }
}

/// The subscription `name` as the gateway shows it.
pub async fn stored_subscription(gateway: &TestGateway, name: &str) -> proto::Subscription {
    gateway
        .admin()
        .await
        .get_subscription(proto::GetSubscriptionRequest { name: name.into() })
        .await
        .expect("get the subscription")
        .into_inner()
}

/// Sends `signal` (`TERM`, `INT`, ...) to a child process.
pub fn send_signal(child: &tokio::process::Child, signal: &str) {
    let sent = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &child.id().unwrap().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
}

/// The gateway binary serving `database` as a child process (so a test can kill it),
/// with `extra` arguments after `serve`'s own, on ephemeral ports and with the console
/// off; returned with its log, its gRPC address and a channel to it once it serves.
pub async fn start_gateway_process(
    database: &TestDatabase,
    extra: &[&str],
) -> (tokio::process::Child, ProcessLog, SocketAddr, Channel) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_outbox-gateway"));
    command
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--console-listen",
            "off",
        ])
        .arg("--database-url")
        .arg(database.url())
        .args(extra)
        .env_remove("RUST_LOG");
    serving_process(command).await
}

/// Runs `command` (the gateway binary's `serve`, on an ephemeral gRPC port) as a child
/// process; returned with its log, its gRPC address and a channel to it once it serves.
pub async fn serving_process(
    mut command: Command,
) -> (tokio::process::Child, ProcessLog, SocketAddr, Channel) {
    let mut child = command
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the gateway binary");
    let log = ProcessLog::collect(&mut child);
    let address = log.announced("serving gRPC", &mut child).await;
    outbox_testkit::gateway::wait_until_serving(address, Duration::from_secs(30), || {
        matches!(child.try_wait(), Ok(None))
    })
    .await
    .expect("the gateway serves");
    let channel = Channel::from_shared(format!("http://{address}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect to the gateway process");
    (child, log, address, channel)
}

/// How often the tests poll for a condition (with `poll_until` and a deadline).
pub const POLL: Duration = Duration::from_millis(50);

/// Polls `check` every [`POLL`] until it holds; fails the test, naming `what`, when it
/// still does not after `within`.
pub async fn eventually<F, Fut>(what: &str, within: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let held = poll_until(within, POLL, || {
        let check = check();
        async move { check.await.then_some(()) }
    })
    .await;
    assert!(
        held.is_some(),
        "timed out after {within:?} waiting until {what}"
    );
}

/// A database of its own for one test, dropped (with its connections) afterwards.
pub struct TestDatabase {
    database: ThrowawayDatabase,
}

impl TestDatabase {
    pub async fn create() -> Arc<TestDatabase> {
        Self::create_on(&test_server_url()).await
    }

    /// A database of its own on another server (see `outbox_testkit::PostgresServer`).
    pub async fn create_on(server_url: &str) -> Arc<TestDatabase> {
        let database = ThrowawayDatabase::create(server_url, "outbox_test")
            .await
            .expect("PostgreSQL must be running for the integration tests (see README)");
        Arc::new(TestDatabase { database })
    }

    pub fn name(&self) -> &str {
        self.database.name()
    }

    pub fn url(&self) -> String {
        self.database.url().to_owned()
    }

    /// A pool for writing and inspecting rows directly, like a producer service would.
    pub async fn pool(&self) -> PgPool {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(8)
            .connect_with(self.database.connect_options())
            .await
            .expect("connect to test database")
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        self.database.drop_blocking();
    }
}

/// A `[[sources]]` entry named `name` for `database`, with default settings.
pub fn source_config(name: &str, database: &TestDatabase) -> outbox_gateway::config::SourceConfig {
    outbox_gateway::config::SourceConfig {
        name: name.into(),
        database_url: database.url(),
        max_connections: None,
        migrate: None,
    }
}

/// Configuration for a test gateway on `database_url`: quick health checks, and a poll
/// interval long enough that a test passing by polling alone would stand out.
pub fn test_config(database_url: String) -> Config {
    let mut config = Config {
        database_url,
        health_check_interval: Duration::from_millis(100),
        shutdown_grace: Duration::from_secs(2),
        db_acquire_timeout: Duration::from_secs(2),
        // The metrics recorder is process-wide: in-process gateways go without.
        metrics_listen: None,
        // Tests that use the console give it a port of its own.
        console_listen: None,
        ..Config::default()
    };
    config.delivery.poll_interval = Duration::from_secs(5);
    config
}

/// A real gateway serving on an ephemeral port.
pub struct TestGateway {
    pub address: SocketAddr,
    /// The web console's address, when started with one.
    pub console: Option<SocketAddr>,
    pub database: Arc<TestDatabase>,
    shutdown: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<Result<(), outbox_gateway::RunError>>>,
}

impl TestGateway {
    pub async fn start(database: &Arc<TestDatabase>) -> TestGateway {
        Self::start_with(database, test_config(database.url())).await
    }

    /// Starts a gateway with `config` and waits until it reports SERVING.
    pub async fn start_with(database: &Arc<TestDatabase>, config: Config) -> TestGateway {
        let gateway = Self::spawn(database, config).await;
        gateway.wait_for_health(ServingStatus::Serving).await;
        gateway
    }

    /// Starts a gateway without waiting for it to become healthy.
    pub async fn spawn(database: &Arc<TestDatabase>, config: Config) -> TestGateway {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        Self::spawn_on(database, config, listener).await
    }

    /// Starts a gateway with its web console on an ephemeral port and waits until it
    /// reports SERVING.
    pub async fn start_with_console(database: &Arc<TestDatabase>, config: Config) -> TestGateway {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let console = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let gateway = Self::spawn_with(database, config, listener, Some(console)).await;
        gateway.wait_for_health(ServingStatus::Serving).await;
        gateway
    }

    /// Starts a gateway on a given listener (to restart one on the same address).
    pub async fn spawn_on(
        database: &Arc<TestDatabase>,
        config: Config,
        listener: TcpListener,
    ) -> TestGateway {
        Self::spawn_with(database, config, listener, None).await
    }

    async fn spawn_with(
        database: &Arc<TestDatabase>,
        config: Config,
        listener: TcpListener,
        console: Option<TcpListener>,
    ) -> TestGateway {
        // What `serve` would refuse, a test must not run either.
        if let Err(error) = config.validate() {
            panic!("the test gateway's configuration is invalid: {error}");
        }
        let address = listener.local_addr().expect("local address");
        let console_address = console
            .as_ref()
            .map(|console| console.local_addr().expect("local address"));
        let (shutdown, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(outbox_gateway::run_with_console(
            config,
            listener,
            console,
            async {
                let _ = stopped.await;
            },
        ));
        TestGateway {
            address,
            console: console_address,
            database: database.clone(),
            shutdown: Some(shutdown),
            server: Some(server),
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }

    pub async fn channel(&self) -> Channel {
        Channel::from_shared(self.endpoint())
            .expect("endpoint")
            .connect()
            .await
            .expect("connect to test gateway")
    }

    pub async fn publisher(&self) -> PublisherClient<Channel> {
        PublisherClient::new(self.channel().await)
    }

    pub async fn subscriber(&self) -> SubscriberClient<Channel> {
        SubscriberClient::new(self.channel().await)
    }

    pub async fn admin(&self) -> AdminClient<Channel> {
        AdminClient::new(self.channel().await)
    }

    pub async fn health(&self) -> Option<ServingStatus> {
        self.health_of("").await
    }

    /// The status the health service reports for `service`.
    pub async fn health_of(&self, service: &str) -> Option<ServingStatus> {
        let mut client = HealthClient::new(self.channel().await);
        let response = client
            .check(HealthCheckRequest {
                service: service.to_owned(),
            })
            .await
            .ok()?;
        ServingStatus::try_from(response.into_inner().status).ok()
    }

    pub async fn wait_for_health(&self, expected: ServingStatus) {
        let what = format!("the gateway reports {expected:?}");
        eventually(&what, Duration::from_secs(20), || async {
            self.health().await == Some(expected)
        })
        .await;
    }

    /// Asks the gateway to shut down and returns how `run` ended.
    pub async fn stop(mut self) -> Result<(), outbox_gateway::RunError> {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        self.server
            .take()
            .expect("running")
            .await
            .expect("server task")
    }
}

impl Drop for TestGateway {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            server.abort();
        }
    }
}

/// An event input with sensible defaults.
pub fn event(aggregate_id: &str, event_type: &str) -> proto::EventInput {
    proto::EventInput {
        aggregate_type: "order".into(),
        aggregate_id: aggregate_id.into(),
        event_type: event_type.into(),
        payload: format!(r#"{{"aggregate":"{aggregate_id}"}}"#).into_bytes(),
        ..Default::default()
    }
}

pub async fn publish(
    gateway: &TestGateway,
    events: Vec<proto::EventInput>,
) -> Vec<proto::PublishResult> {
    gateway
        .publisher()
        .await
        .publish(proto::PublishRequest {
            events,
            ..Default::default()
        })
        .await
        .expect("publish")
        .into_inner()
        .results
}

/// `count` events of type `order.created` on aggregates `o-0`, `o-1`, ….
pub fn orders(count: usize) -> Vec<proto::EventInput> {
    (0..count)
        .map(|i| event(&format!("o-{i}"), "order.created"))
        .collect()
}

/// Publishes `events` in one call; the ids of the events, in order.
pub async fn publish_ids(gateway: &TestGateway, events: Vec<proto::EventInput>) -> Vec<String> {
    publish(gateway, events)
        .await
        .into_iter()
        .map(|result| result.id)
        .collect()
}

/// Publishes `events` through `publisher`, `per_call` events to a call.
pub async fn publish_in_calls(
    publisher: &mut PublisherClient<Channel>,
    events: &[proto::EventInput],
    per_call: usize,
) {
    for chunk in events.chunks(per_call) {
        publisher
            .publish(proto::PublishRequest {
                events: chunk.to_vec(),
                ..Default::default()
            })
            .await
            .expect("publish");
    }
}

/// A subscription with defaults but the given name, starting at the earliest event.
pub fn subscription(name: &str) -> proto::Subscription {
    proto::Subscription {
        name: name.into(),
        start: Some(proto::StartPosition {
            position: Some(proto::start_position::Position::Boundary(
                proto::Boundary::Earliest as i32,
            )),
        }),
        ..Default::default()
    }
}

/// Acks every one of `deliveries`; returns the stale ack ids.
pub async fn ack_deliveries(
    gateway: &TestGateway,
    subscription: &str,
    deliveries: &[proto::Delivery],
) -> Vec<String> {
    let ack_ids = deliveries.iter().map(|d| d.ack_id.clone()).collect();
    ack(gateway, subscription, ack_ids).await
}

/// The first page of a subscription's unresolved dead letters.
pub async fn list_dead_letters(
    gateway: &TestGateway,
    subscription: &str,
) -> Vec<proto::DeadLetter> {
    gateway
        .admin()
        .await
        .list_dead_letters(proto::ListDeadLettersRequest {
            subscription: subscription.into(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|status| panic!("ListDeadLetters {subscription:?}: {status}"))
        .into_inner()
        .dead_letters
}

/// The stats of one subscription, which must answer.
pub async fn subscription_stats(
    gateway: &TestGateway,
    subscription: &str,
) -> proto::SubscriptionStats {
    stats_through(gateway.admin().await, subscription).await
}

/// The stats of one subscription as the gateway behind `admin` reports them (another
/// gateway process, say), which must answer.
pub async fn stats_through(
    mut admin: AdminClient<Channel>,
    subscription: &str,
) -> proto::SubscriptionStats {
    admin
        .get_stats(proto::GetStatsRequest {
            subscription: subscription.into(),
        })
        .await
        .unwrap_or_else(|status| panic!("GetStats {subscription:?}: {status}"))
        .into_inner()
        .subscriptions
        .remove(0)
}

pub async fn create_subscription(
    gateway: &TestGateway,
    subscription: proto::Subscription,
) -> proto::Subscription {
    create_subscription_over(gateway.channel().await, subscription).await
}

/// [`create_subscription`] on a gateway reached through `channel` (a gateway process).
pub async fn create_subscription_over(
    channel: Channel,
    subscription: proto::Subscription,
) -> proto::Subscription {
    AdminClient::new(channel)
        .create_subscription(proto::CreateSubscriptionRequest {
            subscription: Some(subscription),
            validate_only: false,
        })
        .await
        .expect("create subscription")
        .into_inner()
}

/// Asserts a call failed with `code` and that the message mentions `needle`.
#[track_caller]
pub fn assert_status<T: std::fmt::Debug>(
    result: Result<T, tonic::Status>,
    code: tonic::Code,
    needle: &str,
) {
    match result {
        Ok(value) => panic!("expected {code:?} mentioning {needle:?}, got Ok({value:?})"),
        Err(status) => {
            assert_eq!(status.code(), code, "unexpected status: {status:?}");
            assert!(
                status.message().contains(needle),
                "message {:?} does not mention {needle:?}",
                status.message()
            );
        }
    }
}

/// Counts rows of the outbox table.
pub async fn count_events(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox_events")
        .fetch_one(pool)
        .await
        .expect("count events")
}

/// One Subscribe stream, read with timeouts.
pub struct Consumer {
    stream: tonic::Streaming<proto::Delivery>,
}

impl Consumer {
    pub async fn open(gateway: &TestGateway, subscription: &str, max_in_flight: u32) -> Consumer {
        let stream = gateway
            .subscriber()
            .await
            .subscribe(proto::SubscribeRequest {
                subscription: subscription.into(),
                max_in_flight,
                ..Default::default()
            })
            .await
            .expect("subscribe")
            .into_inner();
        Consumer { stream }
    }

    /// A consumer of a stream the test opened itself.
    pub fn from_stream(stream: tonic::Streaming<proto::Delivery>) -> Consumer {
        Consumer { stream }
    }

    /// The next delivery, or `None` when none arrives within `wait`.
    pub async fn next(&mut self, wait: Duration) -> Option<proto::Delivery> {
        match tokio::time::timeout(wait, self.stream.message()).await {
            Ok(Ok(Some(delivery))) => Some(delivery),
            Ok(Ok(None)) => panic!("the delivery stream ended"),
            Ok(Err(status)) => panic!("the delivery stream failed: {status:?}"),
            Err(_) => None,
        }
    }

    /// Exactly `count` deliveries, each within `wait` of the previous one.
    pub async fn take(&mut self, count: usize, wait: Duration) -> Vec<proto::Delivery> {
        let mut deliveries = Vec::with_capacity(count);
        while deliveries.len() < count {
            match self.next(wait).await {
                Some(delivery) => deliveries.push(delivery),
                None => panic!("got {} of {count} deliveries", deliveries.len()),
            }
        }
        deliveries
    }

    /// How the stream ended, waiting at most `wait`.
    pub async fn end(&mut self, wait: Duration) -> Option<tonic::Status> {
        match tokio::time::timeout(wait, self.stream.message()).await {
            Ok(Err(status)) => Some(status),
            _ => None,
        }
    }
}

/// Acks `ack_ids`; returns the stale ones, which the caller must look at (or use
/// `ack_all` when every ack must take).
#[must_use = "an ack may be stale: check the returned ids, or use ack_all"]
pub async fn ack(gateway: &TestGateway, subscription: &str, ack_ids: Vec<String>) -> Vec<String> {
    gateway
        .subscriber()
        .await
        .ack(proto::AckRequest {
            subscription: subscription.into(),
            ack_ids,
        })
        .await
        .expect("ack")
        .into_inner()
        .stale_ack_ids
}

/// Acks `ack_ids` and checks that every one of them took (none was stale).
#[track_caller]
pub fn ack_all<'a>(
    gateway: &'a TestGateway,
    subscription: &'a str,
    ack_ids: Vec<String>,
) -> impl Future<Output = ()> + 'a {
    let caller = std::panic::Location::caller();
    async move {
        let stale = ack(gateway, subscription, ack_ids).await;
        assert!(
            stale.is_empty(),
            "acks on {subscription} were stale: {stale:?} (acked at {caller})"
        );
    }
}

/// Extends leases by `extension`; returns the stale ack ids.
#[must_use = "an extension may be stale: check the returned ids"]
pub async fn extend(
    gateway: &TestGateway,
    subscription: &str,
    ack_ids: Vec<String>,
    extension: Duration,
) -> Vec<String> {
    gateway
        .subscriber()
        .await
        .extend_ack_deadline(proto::ExtendAckDeadlineRequest {
            subscription: subscription.into(),
            ack_ids,
            extension: prost_types::Duration::try_from(extension).ok(),
        })
        .await
        .expect("extend")
        .into_inner()
        .stale_ack_ids
}

pub async fn nack(gateway: &TestGateway, request: proto::NackRequest) -> proto::NackResponse {
    gateway
        .subscriber()
        .await
        .nack(request)
        .await
        .expect("nack")
        .into_inner()
}

/// Aggregate id of a delivery's event.
pub fn aggregate_of(delivery: &proto::Delivery) -> String {
    delivery.event.as_ref().expect("event").aggregate_id.clone()
}

pub fn seconds(seconds: u64) -> Option<prost_types::Duration> {
    Some(prost_types::Duration {
        seconds: seconds as i64,
        nanos: 0,
    })
}

/// State and attempt of every delivery record of a subscription, by aggregate id.
pub async fn delivery_records(pool: &PgPool, subscription: &str) -> Vec<(String, String, i32)> {
    sqlx::query_as(
        "SELECT e.aggregate_id, d.state, d.attempt FROM outbox_delivery_records d \
         JOIN outbox_subscriptions s ON s.id = d.subscription_id \
         JOIN outbox_events e ON e.position = d.position \
         WHERE s.name = $1 ORDER BY d.position",
    )
    .bind(subscription)
    .fetch_all(pool)
    .await
    .expect("delivery records")
}

/// Runs `body` with the URL of a new login role of `database` that has the rights of
/// deploy/writer-role.sql (under a role name of its own: roles are cluster-wide), then
/// drops both roles whatever happened, and fails if `body` did.
pub async fn as_writer<F, Fut>(database: &TestDatabase, body: F)
where
    F: FnOnce(String) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    use sqlx::{Connection, Executor};
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let (writer_role, login) = (
        format!("outbox_writer_{suffix}"),
        format!("outbox_service_{suffix}"),
    );
    let script =
        include_str!("../../deploy/writer-role.sql").replace("outbox_writer", &writer_role);
    let mut owner = sqlx::PgConnection::connect(&database.url()).await.unwrap();
    owner
        .execute(sqlx::raw_sql(sqlx::AssertSqlSafe(script)))
        .await
        .unwrap();
    owner
        .execute(sqlx::AssertSqlSafe(format!(
            "CREATE ROLE {login} LOGIN IN ROLE {writer_role}"
        )))
        .await
        .unwrap();
    let url = format!("postgres://{login}@127.0.0.1:5432/{}", database.name());
    let outcome = tokio::spawn(body(url)).await;
    for role in [&login, &writer_role] {
        owner
            .execute(sqlx::AssertSqlSafe(format!("DROP OWNED BY {role}")))
            .await
            .unwrap();
        owner
            .execute(sqlx::AssertSqlSafe(format!("DROP ROLE {role}")))
            .await
            .unwrap();
    }
    outcome.unwrap();
}

/// Asserts that `connection` may run none of `statements`: each is refused for lack of
/// privilege (SQLSTATE 42501).
pub async fn assert_forbidden(connection: &mut sqlx::PgConnection, statements: &[&'static str]) {
    use sqlx::Executor;
    for &forbidden in statements {
        let error = connection.execute(forbidden).await.expect_err(forbidden);
        assert_eq!(
            error.as_database_error().and_then(|e| e.code()).as_deref(),
            Some("42501"),
            "{forbidden}: {error}"
        );
    }
}
