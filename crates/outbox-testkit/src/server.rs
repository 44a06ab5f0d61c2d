//! A second, independent PostgreSQL server for tests that need one they can stop and
//! start: created with the machine's `initdb` and run with `pg_ctl` in a temporary
//! directory, on a free loopback port, with trust authentication for `postgres`.
//! PostgreSQL refuses to run as root; as root the tools run as the `postgres` user.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

/// Why the server could not be set up or controlled.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(
        "no PostgreSQL server binaries (initdb, pg_ctl) under /usr/lib/postgresql/*/bin; install PostgreSQL"
    )]
    NoBinaries,
    #[error("{command} failed: {detail}")]
    Command { command: String, detail: String },
}

/// A PostgreSQL server of its own; stopped and removed when dropped.
pub struct PostgresServer {
    bin: PathBuf,
    directory: PathBuf,
    port: u16,
}

impl PostgresServer {
    /// Creates a cluster in a new temporary directory and starts it.
    pub fn start() -> Result<PostgresServer, ServerError> {
        let bin = binaries().ok_or(ServerError::NoBinaries)?;
        let port = crate::gateway::free_loopback_address()
            .map_err(|error| ServerError::Command {
                command: "finding a free port".into(),
                detail: error.to_string(),
            })?
            .port();
        let directory =
            std::env::temp_dir().join(format!("outbox-pg-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&directory).map_err(|error| ServerError::Command {
            command: format!("creating {}", directory.display()),
            detail: error.to_string(),
        })?;
        if running_as_root() {
            run(Command::new("chown")
                .arg("postgres:postgres")
                .arg(&directory))?;
        }
        let server = PostgresServer {
            bin,
            directory,
            port,
        };
        server.tool(
            "initdb",
            &[
                "-D",
                &server.data().to_string_lossy(),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
            ],
        )?;
        server.resume()?;
        Ok(server)
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
        self.pg_ctl(&["stop", "-m", "immediate", "-w"])
    }

    /// Starts the stopped server again on the same port and waits until it accepts
    /// connections.
    pub fn resume(&self) -> Result<(), ServerError> {
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories={} -c fsync=off",
            self.port,
            self.directory.display()
        );
        self.pg_ctl(&[
            "start",
            "-w",
            "-l",
            &self.directory.join("server.log").to_string_lossy(),
            "-o",
            &options,
        ])
    }

    fn data(&self) -> PathBuf {
        self.directory.join("data")
    }

    fn pg_ctl(&self, arguments: &[&str]) -> Result<(), ServerError> {
        let data = self.data().to_string_lossy().into_owned();
        let mut all = vec!["-D", &data];
        all.extend_from_slice(arguments);
        self.tool("pg_ctl", &all)
    }

    fn tool(&self, name: &str, arguments: &[&str]) -> Result<(), ServerError> {
        let program = self.bin.join(name);
        let mut command = if running_as_root() {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(&program);
            command
        } else {
            Command::new(&program)
        };
        run(command.args(arguments))
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        let _ = self.pg_ctl(&["stop", "-m", "immediate", "-w"]);
        let _ = std::fs::remove_dir_all(&self.directory);
    }
}

/// The newest `/usr/lib/postgresql/<version>/bin` that has `initdb` and `pg_ctl`.
fn binaries() -> Option<PathBuf> {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|entry| entry.ok().map(|entry| entry.path().join("bin")))
        .filter(|bin| bin.join("initdb").exists() && bin.join("pg_ctl").exists())
        .collect();
    versions.sort_by_key(|bin| version_of(bin));
    versions.pop()
}

fn version_of(bin: &Path) -> u32 {
    bin.parent()
        .and_then(Path::file_name)
        .and_then(|name| name.to_str())
        .and_then(|name| name.parse().ok())
        .unwrap_or(0)
}

fn running_as_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

fn run(command: &mut Command) -> Result<(), ServerError> {
    let described = format!("{command:?}");
    let output = command.output().map_err(|error| ServerError::Command {
        command: described.clone(),
        detail: error.to_string(),
    })?;
    if output.status.success() {
        return Ok(());
    }
    Err(ServerError::Command {
        command: described,
        detail: format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ),
    })
}
