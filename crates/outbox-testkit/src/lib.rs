//! What outbox-gateway's integration tests, `outbox-bench` and `outbox-chaos` share, so
//! each is written once:
//!
//! - [`ThrowawayDatabase`]: a database of its own on a PostgreSQL server, dropped
//!   afterwards with whatever is still connected to it.
//! - [`poll_until`]: waiting for a condition by polling with a deadline, never by
//!   sleeping a guessed time.
//! - [`gateway`]: the `outbox-gateway` binary as a child process: a free port,
//!   migrating, waiting until it serves, stopping it; [`gateway_binary_beside`] finds the
//!   binary for tests of other packages.

use std::path::{Path, PathBuf};

mod database;
pub mod gateway;
mod poll;

pub use database::{DatabaseError, ThrowawayDatabase};
pub use poll::poll_until;

/// The PostgreSQL server tests create their databases on: `TEST_POSTGRES_URL`, or the
/// local server as user `postgres`.
pub fn test_server_url() -> String {
    std::env::var("TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into())
}

/// The `outbox-gateway` binary in the target directory of `own_binary` (a test's
/// `env!("CARGO_BIN_EXE_<name>")`): cargo builds the binaries of every package it tests
/// into one directory. Panics, saying how to build it, when it is not there.
pub fn gateway_binary_beside(own_binary: &str) -> PathBuf {
    let gateway = Path::new(own_binary)
        .with_file_name(format!("outbox-gateway{}", std::env::consts::EXE_SUFFIX));
    assert!(
        gateway.is_file(),
        "the gateway binary {} is missing: run the tests with `cargo test --workspace`, \
         or build it first with `cargo build --bin outbox-gateway`",
        gateway.display()
    );
    gateway
}
