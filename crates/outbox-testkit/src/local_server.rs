//! The PostgreSQL server of [`crate::test_server_url`] when none answers at its address:
//! a private cluster under the temporary directory (kept between runs, so it is created
//! once), started on first use and stopped when the process exits.

use std::{
    net::{SocketAddr, TcpStream},
    sync::OnceLock,
    time::{Duration, Instant},
};

use outbox_local_postgres::{ClusterError, ClusterOptions, Listen, LocalCluster};

/// Where the tests look for PostgreSQL.
pub(crate) const ADDRESS: &str = "127.0.0.1:5432";

/// The cluster this process started, to stop at exit.
static STARTED: OnceLock<Option<LocalCluster>> = OnceLock::new();

/// Starts the private cluster unless a server answers at [`ADDRESS`]. Panics, saying
/// what to do, when neither works: no test can run without a server.
pub(crate) fn ensure_running() {
    STARTED.get_or_init(|| {
        if answers() {
            return None;
        }
        // SAFETY: geteuid has no preconditions and cannot fail.
        let user = unsafe { libc::geteuid() };
        let directory = std::env::temp_dir().join(format!("outbox-test-postgres-{user}"));
        let address: SocketAddr = ADDRESS.parse().expect("a socket address");
        let options = ClusterOptions {
            listen: Listen::Tcp(address.ip(), address.port()),
            durable: false,
        };
        match LocalCluster::start(&directory, None, options) {
            Ok(cluster) => {
                // SAFETY: registers a function without arguments that the C runtime calls
                // once, at exit.
                unsafe { libc::atexit(stop_at_exit) };
                Some(cluster)
            }
            // Another test process is starting it.
            Err(ClusterError::Busy { .. }) if wait_for_answer() => None,
            Err(error) => panic!(
                "no PostgreSQL answers at {ADDRESS}, and the tests could not start one of their own: {error}. Start PostgreSQL there, or set TEST_POSTGRES_URL"
            ),
        }
    });
}

fn answers() -> bool {
    let address: SocketAddr = ADDRESS.parse().expect("a socket address");
    TcpStream::connect_timeout(&address, Duration::from_secs(1)).is_ok()
}

fn wait_for_answer() -> bool {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if answers() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    false
}

extern "C" fn stop_at_exit() {
    if let Some(Some(cluster)) = STARTED.get() {
        let _ = cluster.stop();
    }
}
