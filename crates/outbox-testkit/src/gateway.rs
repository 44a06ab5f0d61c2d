//! Running the `outbox-gateway` binary as a child process, as the benchmark, the chaos
//! tool and the process-level tests do: finding the binary, learning the port it bound
//! on port 0 from its log, migrating, waiting until it serves, stopping it.

use std::{
    net::{Ipv4Addr, SocketAddr, TcpListener},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    time::Duration,
};

use outbox_client::Connection;

use crate::poll_until;

/// How often a starting or stopping gateway is looked at.
const POLL: Duration = Duration::from_millis(50);

/// Why a started gateway is not serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StartError {
    /// The process ended while starting; its log says why.
    #[error("the gateway exited while starting")]
    Exited,
    /// It did not report SERVING in time.
    #[error("the gateway did not report SERVING in time")]
    TimedOut,
}

/// The `outbox-gateway` binary in the directory of `executable` (a tool's own binary,
/// or a test's `env!("CARGO_BIN_EXE_<tool>")`): cargo builds every binary of the
/// workspace it builds into one directory. The error says how to build it.
pub fn binary_beside(executable: &Path) -> Result<PathBuf, String> {
    let gateway =
        executable.with_file_name(format!("outbox-gateway{}", std::env::consts::EXE_SUFFIX));
    if gateway.is_file() {
        Ok(gateway)
    } else {
        Err(format!(
            "gateway binary {} not found: build it with `cargo build --bins` (with \
             `--release` for release builds); `cargo test --workspace` builds it for the tests",
            gateway.display()
        ))
    }
}

/// Where a gateway says, in one line of its log (text or JSON), that it serves
/// `announcement` — `"serving gRPC"`, `"serving metrics"`, `"serving the web console"` —
/// with the address it bound. A gateway started on port 0 tells its port this way, so no
/// other process can take the port between choosing and binding it.
pub fn announced_address(line: &str, announcement: &str) -> Option<SocketAddr> {
    if !line.contains(announcement) {
        return None;
    }
    let (_, rest) = line
        .split_once("address=")
        .or_else(|| line.split_once("\"address\":\""))?;
    let end = rest
        .find(|c: char| c.is_whitespace() || c == '"')
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// Waits until the gateway's log, as `log` returns it so far, announces `announcement`
/// (see [`announced_address`]) and returns the address, for at most `within`; gives up
/// early once `running` says the process has ended. Start the gateway on port 0 and ask
/// this for the port it bound.
pub async fn wait_for_announcement(
    announcement: &str,
    within: Duration,
    mut log: impl FnMut() -> String,
    mut running: impl FnMut() -> bool,
) -> Result<SocketAddr, StartError> {
    let outcome = poll_until(within, POLL, || {
        let announced = log()
            .lines()
            .find_map(|line| announced_address(line, announcement));
        let running = running();
        async move {
            match announced {
                Some(address) => Some(Ok(address)),
                None if !running => Some(Err(StartError::Exited)),
                None => None,
            }
        }
    })
    .await;
    outcome.unwrap_or(Err(StartError::TimedOut))
}

/// The log filter `level` (RUST_LOG syntax), keeping the INFO lines in which the gateway
/// announces its gRPC and metrics addresses, whatever `level` leaves out.
pub fn log_level_with_announcements(level: &str) -> String {
    format!("{level},{ANNOUNCING_TARGET}=info")
}

/// The log target of the lines announcing the gRPC and metrics addresses.
pub const ANNOUNCING_TARGET: &str = "outbox_gateway::server";

/// A loopback address nobody listens on right now. Another process may take it before
/// it is used: give a gateway port 0 instead and read the port it bound from its log.
pub fn free_loopback_address() -> std::io::Result<SocketAddr> {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()
}

/// Applies the schema to `database_url` with `outbox-gateway migrate`; the error carries
/// what the gateway printed.
pub fn migrate(binary: &Path, database_url: &str) -> Result<(), String> {
    let output = Command::new(binary)
        .args([
            "migrate",
            "--log-level",
            "warn",
            "--database-url",
            database_url,
        ])
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .map_err(|error| format!("cannot run {}: {error}", binary.display()))?;
    if !output.status.success() {
        return Err(format!(
            "`{} migrate` failed ({}): {}",
            binary.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    Ok(())
}

/// Waits until the gateway at `address` reports SERVING, for at most `within`; gives up
/// early once `running` says the process has ended.
pub async fn wait_until_serving(
    address: SocketAddr,
    within: Duration,
    mut running: impl FnMut() -> bool,
) -> Result<(), StartError> {
    let gateway = Connection::new(format!("http://{address}"))
        .connect_timeout(Duration::from_secs(1))
        .timeout(Duration::from_secs(1))
        .connect_lazy()
        .expect("a loopback endpoint without TLS is valid");
    let outcome = poll_until(within, POLL, || {
        let running = running();
        let gateway = gateway.clone();
        async move {
            if !running {
                return Some(Err(StartError::Exited));
            }
            gateway.is_serving().await.ok()?.then_some(Ok(()))
        }
    })
    .await;
    outcome.unwrap_or(Err(StartError::TimedOut))
}

/// Sends SIGTERM, the signal a gateway shuts down gracefully on.
pub fn terminate(process: &Child) {
    // SAFETY: plain kill(2) on the pid of a child this process has not reaped yet.
    unsafe {
        libc::kill(process.id() as libc::pid_t, libc::SIGTERM);
    }
}

/// The exit status of `process`, polled for at most `within`.
pub async fn wait_for_exit(process: &mut Child, within: Duration) -> Option<ExitStatus> {
    poll_until(within, Duration::from_millis(20), || {
        let status = process.try_wait().ok().flatten();
        async move { status }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_announced_address_from_text_and_json_logs() {
        let text =
            "2026-01-01T00:00:00.000000Z  INFO outbox_gateway: serving gRPC address=127.0.0.1:4321";
        assert_eq!(
            announced_address(text, "serving gRPC"),
            Some("127.0.0.1:4321".parse().unwrap())
        );
        let json = r#"{"timestamp":"2026-01-01T00:00:00Z","level":"INFO","message":"serving metrics at /metrics","address":"127.0.0.1:9999","target":"outbox_gateway"}"#;
        assert_eq!(
            announced_address(json, "serving metrics"),
            Some("127.0.0.1:9999".parse().unwrap())
        );
        assert_eq!(announced_address(text, "serving metrics"), None);
        assert_eq!(
            announced_address("serving gRPC address=nowhere", "serving gRPC"),
            None
        );
    }
}
