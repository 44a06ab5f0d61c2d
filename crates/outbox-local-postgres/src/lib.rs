//! outbox-local-postgres: a private PostgreSQL cluster run from the server binaries
//! installed on the machine, for a first run with nothing to set up (`outbox-gateway
//! serve` without a database URL) and for tests on a machine where PostgreSQL is
//! installed but not running.
//!
//! # Layout
//! - Owns: finding `initdb` and `pg_ctl` ([`find_binaries`]); a cluster in a directory
//!   ([`LocalCluster`]): created on first use, started (or adopted when a previous process
//!   left it running), stopped, and held by one process at a time through a lock file,
//!   saying which of these happened ([`Startup`]); refusing a directory another user can
//!   change (`directory`).
//! - May depend on: nothing of the gateway. Both the gateway and its test kit use it.
//!
//! PostgreSQL refuses to run as root: as root the tools run as the `postgres` system user
//! (which the distributions' packages create), and the cluster's directory belongs to it.

mod directory;

use std::{
    fs::File,
    io::{Read, Seek, Write},
    net::IpAddr,
    os::unix::{fs::OpenOptionsExt, process::CommandExt},
    path::{Path, PathBuf},
    process::Command,
};

/// Why the cluster could not be set up, started or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(
        "PostgreSQL's server binaries (initdb, pg_ctl) are not installed, or not where they are looked for (PATH, `pg_config --bindir`, /usr/lib/postgresql/*/bin, /usr/pgsql-*/bin, Homebrew). {INSTALL}"
    )]
    NotInstalled,
    #[error("no initdb and pg_ctl in {0} (--postgres-bin). {INSTALL}")]
    NotInDirectory(PathBuf),
    #[error(
        "PostgreSQL refuses to run as root, and there is no `postgres` system user to run it as: create one (`useradd --system --home-dir /var/lib/postgresql postgres`), run the gateway as another user, or give it a database with --database-url"
    )]
    RootWithoutPostgresUser,
    #[error(
        "another process (pid {pid}) runs the private PostgreSQL in {directory}; choose another --data-dir, or share its database through its socket in {}",
        socket_directory.display()
    )]
    Busy {
        directory: PathBuf,
        pid: String,
        socket_directory: PathBuf,
    },
    #[error(
        "the socket path {0} is longer than the 103 bytes Unix sockets allow; choose a shorter --data-dir"
    )]
    SocketPathTooLong(PathBuf),
    #[error(
        "refusing {} for the private PostgreSQL: {} {reason}, so another user could plant links there for the gateway to follow. Choose a --data-dir that only this user (or root) can change",
        directory.display(),
        culprit.display()
    )]
    UnsafeDirectory {
        /// The directory asked for.
        directory: PathBuf,
        /// What in or above it is unsafe.
        culprit: PathBuf,
        reason: String,
    },
    #[error("cannot {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{command} failed: {detail}")]
    Command { command: String, detail: String },
}

/// What to do when the server binaries cannot be found.
const INSTALL: &str = "Install them (Debian and Ubuntu: `apt install postgresql`; Fedora and RHEL: `dnf install postgresql-server`; macOS: `brew install postgresql@17`), name their directory with --postgres-bin, or give the gateway a database with --database-url (DATABASE_URL)";

/// Where the cluster accepts connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listen {
    /// A Unix socket in the cluster's directory only: nothing on the network can reach it.
    UnixSocket,
    /// TCP on this address and port, besides the Unix socket.
    Tcp(IpAddr, u16),
}

/// How the cluster runs.
#[derive(Debug, Clone, Copy)]
pub struct ClusterOptions {
    pub listen: Listen,
    /// Trade durability for speed (`fsync = off`): for throw-away test clusters only.
    pub durable: bool,
}

/// The port a Unix-socket-only cluster numbers its socket with (`.s.PGSQL.5432`).
const SOCKET_PORT: u16 = 5432;
/// The user the cluster's superuser is named after, and runs as under root.
const SUPERUSER: &str = "postgres";

/// What [`LocalCluster::start`] found in its directory, for the caller to say so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Startup {
    /// There was no cluster: `initdb` created one, and it was started.
    Initialised,
    /// The cluster an earlier run stopped was started again.
    Reused,
    /// The run before ended without stopping its cluster (it crashed, or was killed):
    /// its server, still running, was taken over (`left_running`), or a new server
    /// replaced its stale pid file and recovered the data.
    Adopted {
        /// The process that held the directory before, as its lock file says.
        previous_pid: Option<u32>,
        left_running: bool,
    },
}

/// A PostgreSQL cluster in a directory of its own, started by this process or adopted
/// from one that left it running. Stop it with [`LocalCluster::stop`]; dropping it only
/// gives the directory up to other processes.
pub struct LocalCluster {
    bin: PathBuf,
    /// The data directory (PGDATA), which also holds the Unix socket.
    data: PathBuf,
    options: ClusterOptions,
    /// As root: the `postgres` user's uid and gid, which the server and its tools run as
    /// and the data directory belongs to.
    postgres_user: Option<(u32, u32)>,
    /// Whether the cluster was created, started again or taken over from a crashed run.
    startup: Startup,
    /// Held (locked) for as long as this process uses the cluster.
    _lock: File,
}

impl LocalCluster {
    /// Takes `directory` for this process, creates a cluster in `directory/postgres` on
    /// first use and starts it, or adopts the server a previous process left running;
    /// [`LocalCluster::startup`] says which. `bin` overrides where the server binaries are
    /// looked for. A directory another user can change is refused.
    pub fn start(
        directory: &Path,
        bin: Option<&Path>,
        options: ClusterOptions,
    ) -> Result<LocalCluster, ClusterError> {
        let bin = match bin {
            Some(bin) if has_server_tools(bin) => bin.to_owned(),
            Some(bin) => return Err(ClusterError::NotInDirectory(bin.to_owned())),
            None => find_binaries().ok_or(ClusterError::NotInstalled)?,
        };
        let postgres_user = match running_as_root() {
            true => Some(postgres_user().ok_or(ClusterError::RootWithoutPostgresUser)?),
            false => None,
        };
        let (directory, mut lock) = take_directory(directory)?;
        let data = directory.join("postgres");
        directory::check_entry(&directory, &data, postgres_user.map(|(uid, _)| uid))?;
        let lock_path = directory.join("postgres.lock");
        let socket = data.join(format!(".s.PGSQL.{}", options.port()));
        if socket.as_os_str().len() > 103 {
            return Err(ClusterError::SocketPathTooLong(socket));
        }
        let mut holder = String::new();
        // Unreadable: no pid to name, nothing else lost.
        let _ = lock.read_to_string(&mut holder);
        if lock.try_lock().is_err() {
            return Err(ClusterError::Busy {
                directory,
                pid: holder.trim().to_owned(),
                socket_directory: data,
            });
        }
        lock.set_len(0).map_err(io_error("write", &lock_path))?;
        lock.rewind().map_err(io_error("write", &lock_path))?;
        write!(lock, "{}", std::process::id()).map_err(io_error("write", &lock_path))?;
        let mut cluster = LocalCluster {
            bin,
            data,
            options,
            postgres_user,
            startup: Startup::Reused,
            _lock: lock,
        };
        // A cleanly stopped server removes its pid file: one still there means the run
        // before ended without stopping it.
        if !cluster.data.join("PG_VERSION").exists() {
            cluster.create()?;
            cluster.startup = Startup::Initialised;
        } else if cluster.data.join("postmaster.pid").exists() {
            cluster.startup = Startup::Adopted {
                previous_pid: holder.trim().parse().ok(),
                left_running: cluster.is_running(),
            };
        }
        cluster.write_settings()?;
        cluster.start_server()?;
        Ok(cluster)
    }

    /// Whether [`LocalCluster::start`] created the cluster, started it again, or took it
    /// over from a run that crashed.
    pub fn startup(&self) -> Startup {
        self.startup
    }

    /// Starts the server unless it runs, and waits until it accepts connections.
    pub fn start_server(&self) -> Result<(), ClusterError> {
        if self.is_running() {
            return Ok(());
        }
        let log = self.data.join("server.log");
        self.pg_ctl(&["start", "-w", "-t", "60", "-l", &log.to_string_lossy()])
    }

    /// The URL of `database` on the cluster, as other programs on this machine can use
    /// it.
    pub fn url(&self, database: &str) -> String {
        url_of(&self.data, self.options, database)
    }

    /// The data directory.
    pub fn data_directory(&self) -> &Path {
        &self.data
    }

    /// Stops the server, letting it finish what it is doing (a fast shutdown: sessions
    /// are cut, nothing committed is lost).
    pub fn stop(&self) -> Result<(), ClusterError> {
        self.pg_ctl(&["stop", "-m", "fast", "-w"])
    }

    /// Stops the server at once, cutting every connection, as a crash would (tests).
    pub fn stop_immediately(&self) -> Result<(), ClusterError> {
        self.pg_ctl(&["stop", "-m", "immediate", "-w"])
    }

    /// Whether its server runs (`pg_ctl status`).
    pub fn is_running(&self) -> bool {
        self.pg_ctl(&["status"]).is_ok()
    }

    fn pg_ctl(&self, arguments: &[&str]) -> Result<(), ClusterError> {
        let data = self.data.to_string_lossy();
        let mut all = vec!["-D", &data];
        all.extend_from_slice(arguments);
        self.tool("pg_ctl", &all)
    }

    fn create(&self) -> Result<(), ClusterError> {
        std::fs::create_dir_all(&self.data).map_err(io_error("create", &self.data))?;
        if let Some((uid, gid)) = self.postgres_user {
            // A link could point anywhere: only a real directory is handed over.
            let metadata =
                std::fs::symlink_metadata(&self.data).map_err(io_error("inspect", &self.data))?;
            if metadata.is_symlink() {
                return Err(ClusterError::UnsafeDirectory {
                    directory: self.data.parent().unwrap_or(&self.data).to_owned(),
                    culprit: self.data.clone(),
                    reason: "is a symbolic link, and the cluster's directory is handed to the postgres user only as a real directory".to_owned(),
                });
            }
            directory::give_to(&self.data, uid, gid)?;
        }
        let mut arguments = vec![
            "-D".to_owned(),
            self.data.to_string_lossy().into_owned(),
            "-U".into(),
            SUPERUSER.into(),
            // Only this machine's users reach the socket, and the directory is theirs.
            "--auth=trust".into(),
            "--encoding=UTF8".into(),
            "--no-locale".into(),
        ];
        if !self.options.durable {
            arguments.push("--no-sync".into());
        }
        let arguments: Vec<&str> = arguments.iter().map(String::as_str).collect();
        self.tool("initdb", &arguments)?;
        let conf = self.data.join("postgresql.conf");
        let mut file = directory::open_no_follow(&self.data, &conf, File::options().append(true))?;
        writeln!(file, "\ninclude_if_exists = 'outbox-gateway.conf'")
            .map_err(io_error("write", &conf))
    }

    /// Where it listens, written before each start so that a moved directory or other
    /// options take effect.
    fn write_settings(&self) -> Result<(), ClusterError> {
        let quoted = |text: &str| format!("'{}'", text.replace('\'', "''"));
        let listen_addresses = match self.options.listen {
            Listen::UnixSocket => String::new(),
            Listen::Tcp(address, _) => address.to_string(),
        };
        let mut settings = format!(
            "# Written by outbox-gateway at each start.\nlisten_addresses = {}\nport = {}\nunix_socket_directories = {}\n",
            quoted(&listen_addresses),
            self.options.port(),
            quoted(&self.data.to_string_lossy()),
        );
        if !self.options.durable {
            // Commits still reach the operating system: a server stopped at once, as in a
            // crash, loses none of them; only the machine crashing would.
            settings.push_str("fsync = off\n");
        }
        let path = self.data.join("outbox-gateway.conf");
        // As root, the directory is the postgres user's: a link there is not followed.
        let mut file = directory::open_no_follow(
            &self.data,
            &path,
            File::options()
                .create(true)
                .write(true)
                .truncate(false)
                .mode(0o644),
        )?;
        file.set_len(0).map_err(io_error("write", &path))?;
        file.write_all(settings.as_bytes())
            .map_err(io_error("write", &path))
    }

    fn tool(&self, name: &str, arguments: &[&str]) -> Result<(), ClusterError> {
        let mut command = as_server_user(&self.bin.join(name));
        // A process group of its own: a Ctrl-C at the terminal interrupts the gateway,
        // which then stops the server in order, not the server at once.
        command.process_group(0);
        run(command.args(arguments))
    }
}

impl ClusterOptions {
    fn port(&self) -> u16 {
        match self.listen {
            Listen::UnixSocket => SOCKET_PORT,
            Listen::Tcp(_, port) => port,
        }
    }
}

fn url_of(data: &Path, options: ClusterOptions, database: &str) -> String {
    match options.listen {
        Listen::UnixSocket => socket_url(data, database),
        Listen::Tcp(address, port) => {
            format!("postgres://{SUPERUSER}@{address}:{port}/{database}")
        }
    }
}

/// The URL of `database` through the socket in `socket_directory`. libpq, sqlx, psycopg
/// and pgx take a `host=` beginning with `/` as the socket's directory; the host of the
/// URL's authority is then not used.
pub fn socket_url(socket_directory: &Path, database: &str) -> String {
    format!(
        "postgres://{SUPERUSER}@localhost/{database}?host={}",
        socket_directory.display()
    )
}

/// The directory of the newest PostgreSQL server binaries (`initdb` and `pg_ctl`) found:
/// on PATH, through `pg_config --bindir`, or in the usual package locations.
pub fn find_binaries() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .unwrap_or_default();
    let from_pg_config = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|output| output.status.success())
        .map(|output| PathBuf::from(String::from_utf8_lossy(&output.stdout).trim()));
    let mut packaged = Vec::new();
    for pattern in [
        // Debian and Ubuntu: /usr/lib/postgresql/<major>/bin
        ("/usr/lib/postgresql", "bin"),
        // Homebrew: /opt/homebrew/opt/postgresql@<major>/bin (Apple silicon), /usr/local/... (Intel)
        ("/opt/homebrew/opt", "bin"),
        ("/usr/local/opt", "bin"),
    ] {
        packaged.extend(versions_under(Path::new(pattern.0), pattern.1));
    }
    // PGDG's RPMs: /usr/pgsql-<major>/bin
    packaged.extend(
        std::fs::read_dir("/usr")
            .into_iter()
            .flatten()
            .flatten()
            .filter(|entry| entry.file_name().to_string_lossy().starts_with("pgsql-"))
            .map(|entry| entry.path().join("bin")),
    );
    packaged.sort_by_key(|bin| std::cmp::Reverse(major_version(bin)));
    on_path
        .into_iter()
        .chain(from_pg_config)
        .chain(packaged)
        .chain([PathBuf::from("/usr/local/pgsql/bin")])
        .find(|bin| has_server_tools(bin))
}

fn versions_under(root: &Path, bin: &str) -> Vec<PathBuf> {
    std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            root.ends_with("postgresql") || name.starts_with("postgresql")
        })
        .map(|entry| entry.path().join(bin))
        .collect()
}

/// The major version a package directory is named after (`.../15/bin`,
/// `postgresql@17/bin`, `pgsql-16/bin`); 0 when none.
fn major_version(bin: &Path) -> u32 {
    let name = bin
        .parent()
        .and_then(Path::file_name)
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default();
    let digits: String = name
        .chars()
        .skip_while(|c| !c.is_ascii_digit())
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().unwrap_or(0)
}

fn has_server_tools(bin: &Path) -> bool {
    bin.join("initdb").is_file() && bin.join("pg_ctl").is_file()
}

/// Whether this process runs as root, where PostgreSQL runs as the `postgres` user.
pub fn running_as_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The `postgres` user's uid and gid, when there is one.
fn postgres_user() -> Option<(u32, u32)> {
    let name = std::ffi::CString::new(SUPERUSER).expect("no NUL in the name");
    // SAFETY: getpwnam reads a NUL-terminated name; the entry it returns is read at once
    // (before any other call could reuse it) and not kept.
    unsafe {
        let entry = libc::getpwnam(name.as_ptr());
        (!entry.is_null()).then(|| ((*entry).pw_uid, (*entry).pw_gid))
    }
}

/// Creates `requested` unless it exists, refusing it (before anything is made) when
/// another user can change it or a directory above it, and opens its lock file: returns
/// the directory without symbolic links and the lock file, not yet locked.
fn take_directory(requested: &Path) -> Result<(PathBuf, File), ClusterError> {
    let requested = std::path::absolute(requested).map_err(io_error("resolve", requested))?;
    if let Some(existing) = requested.ancestors().find(|path| path.exists()) {
        let canonical = existing
            .canonicalize()
            .map_err(io_error("resolve", existing))?;
        directory::check_directory(&requested, &canonical)?;
    }
    std::fs::create_dir_all(&requested).map_err(io_error("create", &requested))?;
    let directory = requested
        .canonicalize()
        .map_err(io_error("resolve", &requested))?;
    directory::check_directory(&requested, &directory)?;
    let lock_path = directory.join("postgres.lock");
    let lock = directory::open_own_file(
        &directory,
        &lock_path,
        File::options()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .mode(0o644),
    )?;
    Ok((directory, lock))
}

/// Maps an I/O error of `action` on `path` to [`ClusterError::Io`].
pub(crate) fn io_error(
    action: &'static str,
    path: &Path,
) -> impl FnOnce(std::io::Error) -> ClusterError {
    let path = path.to_owned();
    move |source| ClusterError::Io {
        action,
        path,
        source,
    }
}

/// `program` run as PostgreSQL's tools run: as the `postgres` user when this process is
/// root (PostgreSQL refuses to run as root), as this user otherwise.
pub fn as_server_user(program: &Path) -> Command {
    if running_as_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", SUPERUSER, "--"]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

/// Runs `command` to completion; when it fails, the error names it and holds its output.
pub fn run(command: &mut Command) -> Result<(), ClusterError> {
    let described = format!("{command:?}");
    let output = command.output().map_err(|error| ClusterError::Command {
        command: described.clone(),
        detail: error.to_string(),
    })?;
    if output.status.success() {
        return Ok(());
    }
    Err(ClusterError::Command {
        command: described,
        detail: format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
        .trim()
        .to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn package_directories_are_ordered_by_major_version() {
        assert_eq!(major_version(Path::new("/usr/lib/postgresql/15/bin")), 15);
        assert_eq!(
            major_version(Path::new("/opt/homebrew/opt/postgresql@17/bin")),
            17
        );
        assert_eq!(major_version(Path::new("/usr/pgsql-16/bin")), 16);
        assert_eq!(major_version(Path::new("/usr/local/pgsql/bin")), 0);
    }

    #[test]
    fn urls_name_the_socket_directory_or_the_address() {
        let socket = ClusterOptions {
            listen: Listen::UnixSocket,
            durable: true,
        };
        assert_eq!(
            url_of(
                Path::new("/var/lib/outbox-gateway/postgres"),
                socket,
                "outbox"
            ),
            "postgres://postgres@localhost/outbox?host=/var/lib/outbox-gateway/postgres"
        );
        let tcp = ClusterOptions {
            listen: Listen::Tcp("127.0.0.1".parse().unwrap(), 5432),
            durable: false,
        };
        assert_eq!(
            url_of(Path::new("/tmp/x"), tcp, "outbox"),
            "postgres://postgres@127.0.0.1:5432/outbox"
        );
    }

    /// A cluster directory for one test: its server stopped and the directory removed
    /// when dropped, even after a failed assertion.
    struct Scratch(PathBuf);

    impl Drop for Scratch {
        fn drop(&mut self) {
            let data = self.0.join("postgres");
            if data.join("postmaster.pid").exists()
                && let Some(bin) = find_binaries()
            {
                let mut command = Command::new("setpriv");
                if running_as_root() {
                    command.args(["--reuid=postgres", "--regid=postgres", "--clear-groups"]);
                }
                let _ = command
                    .arg(bin.join("pg_ctl"))
                    .args(["stop", "-m", "immediate", "-w", "-D"])
                    .arg(&data)
                    .output();
            }
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn scratch(what: &str) -> Scratch {
        Scratch(std::env::temp_dir().join(format!(
            "outbox-local-postgres-{what}-{}",
            std::process::id()
        )))
    }

    const SOCKET_ONLY: ClusterOptions = ClusterOptions {
        listen: Listen::UnixSocket,
        durable: false,
    };

    /// The pid the server wrote in its pid file.
    fn server_pid(data: &Path) -> i32 {
        let pid_file = std::fs::read_to_string(data.join("postmaster.pid")).unwrap();
        pid_file.lines().next().unwrap().trim().parse().unwrap()
    }

    /// The process group in a `/proc/<pid>/stat` line: the third field after the
    /// command, which is in parentheses.
    fn process_group(stat: &str) -> Option<String> {
        let (_, rest) = stat.rsplit_once(')')?;
        rest.split_whitespace().nth(2).map(str::to_owned)
    }

    fn group_of(pid: i32) -> String {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        process_group(&stat).unwrap()
    }

    /// Whether a process of `group` is left (a zombie not yet reaped counts: its pid
    /// still looks alive to `pg_ctl status`).
    fn group_left(group: &str) -> bool {
        std::fs::read_dir("/proc").unwrap().flatten().any(|entry| {
            std::fs::read_to_string(entry.path().join("stat"))
                .is_ok_and(|stat| process_group(&stat).as_deref() == Some(group))
        })
    }

    #[test]
    fn a_cluster_is_initialised_then_reused() {
        let scratch = scratch("reused");
        let cluster = LocalCluster::start(&scratch.0, None, SOCKET_ONLY).unwrap();
        assert_eq!(cluster.startup(), Startup::Initialised);
        cluster.stop().unwrap();
        drop(cluster);
        let cluster = LocalCluster::start(&scratch.0, None, SOCKET_ONLY).unwrap();
        assert_eq!(cluster.startup(), Startup::Reused);
        cluster.stop().unwrap();
    }

    #[test]
    fn a_cluster_whose_server_crashed_is_adopted_over_its_stale_pid_file() {
        let scratch = scratch("crashed");
        let cluster = LocalCluster::start(&scratch.0, None, SOCKET_ONLY).unwrap();
        let data = cluster.data_directory().to_owned();
        let pid = server_pid(&data);
        // The server and its processes run in a group of their own.
        let group = group_of(pid);
        // The holder crashes (giving up the lock), and its server with it.
        drop(cluster);
        // SAFETY: kill has no memory preconditions; pid is the server's.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
        // The server's processes end on finding it gone; a new server waits for that.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while group_left(&group) {
            assert!(
                std::time::Instant::now() < deadline,
                "the server's processes outlive it"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        assert!(data.join("postmaster.pid").exists(), "no stale pid file");

        let cluster = LocalCluster::start(&scratch.0, None, SOCKET_ONLY).unwrap();
        assert_eq!(
            cluster.startup(),
            Startup::Adopted {
                previous_pid: Some(std::process::id()),
                left_running: false
            }
        );
        assert_ne!(server_pid(&data), pid, "a new server runs");
        cluster.stop().unwrap();
    }

    #[test]
    fn a_directory_without_the_tools_is_named() {
        let error = LocalCluster::start(
            &std::env::temp_dir().join("outbox-local-postgres-unused"),
            Some(Path::new("/nonexistent/bin")),
            ClusterOptions {
                listen: Listen::UnixSocket,
                durable: true,
            },
        )
        .err()
        .expect("refused");
        assert!(
            error.to_string().starts_with(
                "no initdb and pg_ctl in /nonexistent/bin (--postgres-bin). Install them"
            ),
            "{error}"
        );
    }
}
