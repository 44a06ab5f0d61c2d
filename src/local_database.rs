//! The private PostgreSQL a gateway runs itself when it is given no database, so that a
//! first run needs nothing set up: without `--database-url`, when nothing answers at the
//! default URL (or `--data-dir` is given), `serve` starts a cluster of its own under the
//! data directory, reached through a Unix socket only, and stops it on shutdown. The
//! cluster itself is [`outbox_local_postgres::LocalCluster`].
//!
//! It never chooses between two databases silently: when a server answers at the
//! default URL and a cluster an earlier run made is in the default data directory, the
//! start is refused, naming both, until `--database-url` or `--data-dir` says which.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use outbox_local_postgres::{
    ClusterError, ClusterOptions, Listen, LocalCluster, Startup, running_as_root, socket_url,
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
    let (directory, why) = match &config.data_dir {
        Some(directory) => (directory.clone(), "--data-dir given".to_owned()),
        None => {
            let directory = default_data_dir()?;
            let cluster_exists = directory.join("postgres").join("PG_VERSION").exists();
            match (cluster_exists, default_server_answers().await) {
                (true, true) => return Err(two_databases(&directory)),
                (false, true) => return Ok(None),
                (_, false) => (
                    directory,
                    format!("no --database-url, and none answers at {DEFAULT_DATABASE_URL}"),
                ),
            }
        }
    };
    let cluster = start_cluster(directory, config.postgres_bin.clone()).await?;
    let url = cluster.url(DATABASE);
    announce(&cluster, &why);
    // A line of its own, so that it can be copied whole.
    tracing::info!("{url}");
    config.database_url = url;
    Ok(Some(LocalDatabase { cluster }))
}

/// Why the gateway will not choose: a server answers at the default URL, and a cluster
/// is in the default data directory `directory`. Names both, and how to pick one.
fn two_databases(directory: &Path) -> String {
    let socket_directory = directory.join("postgres");
    format!(
        "two databases could be meant, and the gateway does not guess: PostgreSQL answers at the default URL {DEFAULT_DATABASE_URL}, and a private PostgreSQL cluster an earlier run created is in {} (URL {} while it runs). Choose one: --database-url '{DEFAULT_DATABASE_URL}' for the server, or --data-dir '{}' to run the private cluster (--database-url with its URL shares it while another gateway runs it)",
        socket_directory.display(),
        socket_url(&socket_directory, DATABASE),
        directory.display(),
    )
}

/// Starts (or creates, or takes over) the cluster in `directory`.
async fn start_cluster(directory: PathBuf, bin: Option<PathBuf>) -> Result<LocalCluster, String> {
    tokio::task::spawn_blocking(move || {
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
    })
}

/// One line saying what became of the cluster, and `why` it runs at all.
fn announce(cluster: &LocalCluster, why: &str) {
    let data_directory = cluster.data_directory().display();
    match cluster.startup() {
        Startup::Initialised => tracing::info!(
            %data_directory,
            why,
            "initialised a new private PostgreSQL cluster and started it, reached through its Unix socket only; services on this machine can use the URL on the next line"
        ),
        Startup::Reused => tracing::info!(
            %data_directory,
            why,
            "reused the private PostgreSQL cluster an earlier run created, and started it, reached through its Unix socket only; services on this machine can use the URL on the next line"
        ),
        Startup::Adopted {
            previous_pid,
            left_running: true,
        } => tracing::warn!(
            %data_directory,
            why,
            previous_pid,
            "adopted the private PostgreSQL cluster an earlier run left running when it ended without stopping it (a crash): took its server over; services on this machine can use the URL on the next line"
        ),
        Startup::Adopted {
            previous_pid,
            left_running: false,
        } => tracing::warn!(
            %data_directory,
            why,
            previous_pid,
            "adopted the private PostgreSQL cluster of an earlier run that crashed with its server: started it over the stale pid file, recovering what was committed; services on this machine can use the URL on the next line"
        ),
    }
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
