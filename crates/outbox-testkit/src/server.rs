//! A second, independent PostgreSQL server for tests that need one they can stop and
//! start: a private cluster (`outbox-local-postgres`, as the gateway's first run makes
//! one) in a temporary directory, on a free loopback port, with trust authentication for
//! `postgres`. Also a hot standby of such a server, and PgBouncer in front of one, for
//! the tests of which engines the gateway refuses.

use std::{
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use outbox_local_postgres::{
    ClusterOptions, Listen, LocalCluster, as_server_user, run, running_as_root,
};

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
        PostgresServer::start_in(new_directory(), free_port()?)
    }

    /// A hot standby of this server: a base backup (`pg_basebackup -R`) streaming from
    /// it, started on a port of its own. It answers reads and refuses writes.
    pub fn start_standby(&self) -> Result<PostgresServer, ServerError> {
        let directory = new_directory();
        let data = directory.join("postgres");
        std::fs::create_dir_all(&data).map_err(|error| failed("creating", &data, error))?;
        // The server refuses a data directory others can read.
        std::fs::set_permissions(&data, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .map_err(|error| failed("restricting", &data, error))?;
        let data_text = data.to_string_lossy().into_owned();
        if running_as_root() {
            run(Command::new("chown").args(["postgres:postgres", &data_text]))?;
        }
        // Where the server's tools really are: `initdb` and `pg_ctl` may be links in a
        // directory without pg_basebackup.
        let pg_ctl = outbox_local_postgres::find_binaries()
            .ok_or(ServerError::NotInstalled)?
            .join("pg_ctl");
        let pg_ctl =
            std::fs::canonicalize(&pg_ctl).map_err(|error| failed("resolving", &pg_ctl, error))?;
        let pg_basebackup = pg_ctl.with_file_name("pg_basebackup");
        let port = self.port.to_string();
        run(as_server_user(&pg_basebackup).args([
            "-D",
            &data_text,
            "-R",
            "-X",
            "stream",
            "-c",
            "fast",
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-U",
            "postgres",
        ]))?;
        PostgresServer::start_in(directory, free_port()?)
    }

    fn start_in(directory: PathBuf, port: u16) -> Result<PostgresServer, ServerError> {
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

/// How a [`Pooler`] shares server sessions between its clients.
#[derive(Debug, Clone, Copy)]
pub enum PoolMode {
    /// A client keeps one server session from connecting to disconnecting.
    Session,
    /// A client holds a server session only for the length of a transaction.
    Transaction,
}

/// PgBouncer (Debian's `pgbouncer` package) in front of a server, trusting `postgres`;
/// stopped when dropped.
pub struct Pooler {
    process: Child,
    directory: PathBuf,
    port: u16,
}

impl Pooler {
    /// Starts PgBouncer on a free loopback port, passing every database through to the
    /// server on `server_port`, and waits until it accepts connections.
    pub fn start(server_port: u16, mode: PoolMode) -> Result<Pooler, ServerError> {
        let program = ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"]
            .into_iter()
            .map(Path::new)
            .find(|path| path.is_file())
            .ok_or_else(|| ServerError::Command {
                command: "pgbouncer".into(),
                detail: "PgBouncer is not installed (apt-get install pgbouncer)".into(),
            })?;
        let port = free_port()?;
        let directory = new_directory();
        std::fs::create_dir_all(&directory)
            .map_err(|error| failed("creating", &directory, error))?;
        let users = directory.join("users.txt");
        std::fs::write(&users, "\"postgres\" \"\"\n")
            .map_err(|error| failed("writing", &users, error))?;
        let mode = match mode {
            PoolMode::Session => "session",
            PoolMode::Transaction => "transaction",
        };
        let config = directory.join("pgbouncer.ini");
        let settings = format!(
            "[databases]\n* = host=127.0.0.1 port={server_port}\n\
             [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
             auth_type = trust\nauth_file = {}\npool_mode = {mode}\n",
            users.display()
        );
        std::fs::write(&config, settings).map_err(|error| failed("writing", &config, error))?;
        let mut command = Command::new(program);
        // PgBouncer refuses to run as root; it switches to the user it is given.
        if running_as_root() {
            command.args(["-u", "postgres"]);
        }
        let process = command
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|error| failed("starting", program, error))?;
        let pooler = Pooler {
            process,
            directory,
            port,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                return Err(ServerError::Command {
                    command: format!("{} {}", program.display(), config.display()),
                    detail: "PgBouncer did not listen within 30 s".into(),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(pooler)
    }

    /// Connection URL through the pooler (without a database).
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}", self.port)
    }
}

impl Drop for Pooler {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
        let _ = std::fs::remove_dir_all(&self.directory);
    }
}

fn new_directory() -> PathBuf {
    std::env::temp_dir().join(format!("outbox-pg-{}", uuid::Uuid::new_v4().simple()))
}

fn free_port() -> Result<u16, ServerError> {
    Ok(crate::gateway::free_loopback_address()
        .map_err(|error| ServerError::Command {
            command: "finding a free port".into(),
            detail: error.to_string(),
        })?
        .port())
}

fn failed(doing: &str, path: &Path, error: std::io::Error) -> ServerError {
    ServerError::Command {
        command: format!("{doing} {}", path.display()),
        detail: error.to_string(),
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        let _ = self.cluster.stop_immediately();
        let _ = std::fs::remove_dir_all(&self.directory);
    }
}
