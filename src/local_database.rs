//! The private PostgreSQL a gateway runs itself when it is given no database, so that a
//! first run needs nothing set up: without `--database-url`, when nothing answers at the
//! default URL (or `--data-dir` is given, or a previous run left a cluster in the data
//! directory), `serve` starts a cluster of its own under the data directory, reached
//! through a Unix socket only, and stops it on shutdown. The cluster itself is
//! [`outbox_local_postgres::LocalCluster`].

use std::{path::PathBuf, time::Duration};

use outbox_local_postgres::{
    ClusterError, ClusterOptions, Listen, LocalCluster, running_as_root, socket_url,
};

use crate::config::{Config, DEFAULT_DATABASE_URL};

/// Where the default database URL points: what is tried before a private cluster.
const DEFAULT_SERVER: &str = "127.0.0.1:5432";
/// How long the default server has to accept a connection.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// The database the gateway uses in its private cluster.
const DATABASE: &str = "outbox";

/// A private cluster this process runs; [`LocalDatabase::stop`] it after the gateway.
pub struct LocalDatabase {
    cluster: LocalCluster,
}

/// Starts the private cluster when the configuration needs one, and points
/// `config.database_url` at it; `None` when the configured or default database is used.
pub async fn start_if_needed(config: &mut Config) -> Result<Option<LocalDatabase>, String> {
    if config.database_url_given {
        return Ok(None);
    }
    let directory = match &config.data_dir {
        Some(directory) => directory.clone(),
        None => {
            let directory = default_data_dir()?;
            let created_before = directory.join("postgres").join("PG_VERSION").exists();
            if !created_before && default_server_answers().await {
                return Ok(None);
            }
            directory
        }
    };
    let bin = config.postgres_bin.clone();
    let cluster = tokio::task::spawn_blocking(move || {
        LocalCluster::start(
            &directory,
            bin.as_deref(),
            ClusterOptions {
                listen: Listen::UnixSocket,
                durable: true,
            },
        )
    })
    .await
    .map_err(|error| format!("starting the private PostgreSQL failed: {error}"))?
    .map_err(|error| match error {
        ClusterError::Busy {
            directory,
            pid,
            socket_directory,
        } => format!(
            "another process (pid {pid}) runs the private PostgreSQL in {}; to share its database, give this one --database-url '{}', or choose another --data-dir",
            directory.display(),
            socket_url(&socket_directory, DATABASE)
        ),
        error => error.to_string(),
    })?;
    let url = cluster.url(DATABASE);
    tracing::info!(
        %url,
        data_directory = %cluster.data_directory().display(),
        "no --database-url, and none answers at {DEFAULT_DATABASE_URL} (or --data-dir was given): running a private PostgreSQL, reached through its Unix socket only; services on this machine can use that URL"
    );
    config.database_url = url;
    Ok(Some(LocalDatabase { cluster }))
}

impl LocalDatabase {
    /// Stops the server (after the gateway has closed its connections).
    pub async fn stop(self) -> Result<(), String> {
        tokio::task::spawn_blocking(move || self.cluster.stop())
            .await
            .map_err(|error| format!("stopping the private PostgreSQL failed: {error}"))?
            .map_err(|error| format!("stopping the private PostgreSQL failed: {error}"))
    }
}

/// `$XDG_DATA_HOME/outbox-gateway` (`~/.local/share/outbox-gateway`); as root, where the
/// `postgres` user can reach it, `/var/lib/outbox-gateway`.
fn default_data_dir() -> Result<PathBuf, String> {
    if running_as_root() {
        return Ok(PathBuf::from("/var/lib/outbox-gateway"));
    }
    let non_empty = |name| std::env::var_os(name).filter(|value| !value.is_empty());
    non_empty("XDG_DATA_HOME")
        .map(PathBuf::from)
        .or_else(|| non_empty("HOME").map(|home| PathBuf::from(home).join(".local/share")))
        .map(|data| data.join("outbox-gateway"))
        .ok_or_else(|| {
            "no --database-url, and neither XDG_DATA_HOME nor HOME says where to keep a private PostgreSQL: give --database-url or --data-dir".to_owned()
        })
}

async fn default_server_answers() -> bool {
    matches!(
        tokio::time::timeout(
            PROBE_TIMEOUT,
            tokio::net::TcpStream::connect(DEFAULT_SERVER)
        )
        .await,
        Ok(Ok(_))
    )
}
