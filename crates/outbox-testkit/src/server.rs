//! A second, independent PostgreSQL server for tests that need one they can stop and
//! start: a private cluster (`outbox-local-postgres`, as the gateway's first run makes
//! one) in a temporary directory, on a free loopback port, with trust authentication for
//! `postgres`.

use std::path::PathBuf;

use outbox_local_postgres::{ClusterOptions, Listen, LocalCluster};

pub use outbox_local_postgres::ClusterError as ServerError;

/// A PostgreSQL server of its own; stopped and removed when dropped.
pub struct PostgresServer {
    cluster: LocalCluster,
    directory: PathBuf,
    port: u16,
}

impl PostgresServer {
    /// Creates a cluster in a new temporary directory and starts it.
    pub fn start() -> Result<PostgresServer, ServerError> {
        let port = crate::gateway::free_loopback_address()
            .map_err(|error| ServerError::Command {
                command: "finding a free port".into(),
                detail: error.to_string(),
            })?
            .port();
        let directory =
            std::env::temp_dir().join(format!("outbox-pg-{}", uuid::Uuid::new_v4().simple()));
        let cluster = LocalCluster::start(
            &directory,
            None,
            ClusterOptions {
                listen: Listen::Tcp([127, 0, 0, 1].into(), port),
                durable: false,
            },
        )?;
        Ok(PostgresServer {
            cluster,
            directory,
            port,
        })
    }

    /// Connection URL of the server (without a database), like `TEST_POSTGRES_URL`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stops the server at once, cutting every connection (like a crash).
    pub fn stop(&self) -> Result<(), ServerError> {
        self.cluster.stop_immediately()
    }

    /// Starts the stopped server again on the same port and waits until it accepts
    /// connections.
    pub fn resume(&self) -> Result<(), ServerError> {
        self.cluster.start_server()
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        let _ = self.cluster.stop_immediately();
        let _ = std::fs::remove_dir_all(&self.directory);
    }
}
