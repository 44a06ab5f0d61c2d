//! What outbox-gateway's integration tests, `outbox-bench` and `outbox-chaos` share, so
//! each is written once:
//!
//! - [`ThrowawayDatabase`]: a database of its own on a PostgreSQL server, dropped
//!   afterwards with whatever is still connected to it.
//! - [`poll_until`]: waiting for a condition by polling with a deadline, never by
//!   sleeping a guessed time; [`settled`]: for a figure to stop moving.
//! - [`gateway`]: the `outbox-gateway` binary as a child process: a free port,
//!   migrating, waiting until it serves, stopping it.
//! - [`PostgresServer`]: a second PostgreSQL server a test can stop and start (or a hot
//!   standby of one); [`Pooler`]: PgBouncer in front of one.
//! - [`test_server_url`]: the server tests use, started here when none runs.
//! - [`gateway_row_writes`]: the rows the gateway has written in its own tables.

mod database;
pub mod gateway;
mod local_server;
mod poll;
mod server;

pub use database::{
    DatabaseError, GATEWAY_APPLICATION, ThrowawayDatabase, cut_gateway_sessions, gateway_row_writes,
};
pub use poll::{poll_until, settled};
pub use server::{PoolMode, Pooler, PostgresServer, ServerError};

/// The PostgreSQL server tests create their databases on: `TEST_POSTGRES_URL`, or the
/// local server as user `postgres`. When nothing answers there, this process starts a
/// private cluster on that address, the way a gateway given no database does, and stops
/// it when it exits: the tests need PostgreSQL installed, not running.
pub fn test_server_url() -> String {
    if let Ok(url) = std::env::var("TEST_POSTGRES_URL") {
        return url;
    }
    local_server::ensure_running();
    format!("postgres://postgres@{}", local_server::ADDRESS)
}
