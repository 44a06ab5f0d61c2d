//! The Node.js client package's own tests, run against live gateways.
//!
//! The package (clients/node) is installed with `npm ci` and built with `npm run build`,
//! then `npm test` runs its suite (clients/node/test, node's test runner) with this
//! build's gateway binary in `OUTBOX_GATEWAY_BIN` and a database of its own in
//! `OUTBOX_TEST_DATABASE_URL`: the suite starts, kills and restarts gateway processes on
//! free ports itself. Node.js 20.11 or newer and npm are required.

use std::{
    fs::File,
    path::{Path, PathBuf},
    time::Duration,
};

use crate::common::*;
use tokio::process::Command;

const INSTALL_TIME: Duration = Duration::from_secs(300);
const TEST_TIME: Duration = Duration::from_secs(600);

fn package() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/node")
}

/// Installs and builds clients/node, and returns a shared lock on the result.
/// tests/it/examples.rs builds it too (the Node.js examples link to it): each builds
/// under the exclusive lock and uses the package under the shared one, so neither
/// rebuilds it while the other runs it.
pub async fn built_package() -> File {
    let lock = File::create(Path::new(env!("CARGO_TARGET_TMPDIR")).join("node-client.lock"))
        .expect("create the Node.js client's lock");
    let lock = tokio::task::spawn_blocking(move || lock.lock().map(|()| lock))
        .await
        .expect("lock task")
        .expect("lock the Node.js client");
    run(
        "`npm ci` in clients/node (Node.js and npm are required)",
        Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund"])
            .current_dir(package()),
        INSTALL_TIME,
    )
    .await;
    run(
        "`npm run build` in clients/node",
        Command::new("npm")
            .args(["run", "build"])
            .current_dir(package()),
        INSTALL_TIME,
    )
    .await;
    tokio::task::spawn_blocking(move || {
        lock.unlock()?;
        lock.lock_shared().map(|()| lock)
    })
    .await
    .expect("lock task")
    .expect("share the Node.js client's lock")
}

#[tokio::test]
async fn node_client_package_passes_its_tests_against_live_gateways() {
    let _package = built_package().await;
    let database = TestDatabase::create().await;
    let output = run(
        "`npm test` in clients/node",
        Command::new("npm")
            .arg("test")
            .current_dir(package())
            .env("OUTBOX_GATEWAY_BIN", env!("CARGO_BIN_EXE_outbox-gateway"))
            .env("OUTBOX_TEST_DATABASE_URL", database.url())
            .env_remove("RUST_LOG"),
        TEST_TIME,
    )
    .await;
    // The runner's summary, for the test log: counts of passed and failed tests.
    for line in output.lines().filter(|line| {
        ["# tests", "# pass", "# fail", "ℹ tests", "ℹ pass", "ℹ fail"]
            .iter()
            .any(|prefix| line.trim_start().starts_with(prefix))
    }) {
        println!("{line}");
    }
}
