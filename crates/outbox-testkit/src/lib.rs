//! What outbox-gateway's integration tests, `outbox-bench` and `outbox-chaos` share, so
//! each is written once:
//!
//! - [`ThrowawayDatabase`]: a database of its own on a PostgreSQL server, dropped
//!   afterwards with whatever is still connected to it.
//! - [`poll_until`]: waiting for a condition by polling with a deadline, never by
//!   sleeping a guessed time; [`settled`]: for a figure to stop moving.
//! - [`gateway`]: the `outbox-gateway` binary as a child process: a free port,
//!   migrating, waiting until it serves, stopping it.
//! - [`PostgresServer`]: a second PostgreSQL server a test can stop and start.
//! - [`gateway_row_writes`]: the rows the gateway has written in its own tables.

mod database;
pub mod gateway;
mod poll;
mod server;

pub use database::{DatabaseError, ThrowawayDatabase, gateway_row_writes};
pub use poll::{poll_until, settled};
pub use server::{PostgresServer, ServerError};

/// The PostgreSQL server tests create their databases on: `TEST_POSTGRES_URL`, or the
/// local server as user `postgres`.
pub fn test_server_url() -> String {
    std::env::var("TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into())
}
