//! The gateways under test: `outbox-gateway serve` child processes, each on a loopback
//! port of its own that it keeps across restarts, so one lazily connected gRPC channel
//! per gateway serves for the whole run. The first start binds port 0 and the port is
//! read from the log, so no other process can take it between choosing and binding it.
//! Each process logs to `gateway-<n>.log`.

use std::{
    fs::{File, OpenOptions},
    io::Write,
    net::SocketAddr,
    os::unix::process::CommandExt,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::Mutex,
    time::Duration,
};

use anyhow::{Context, bail};
use outbox_testkit::gateway::{self, StartError};
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};

use crate::{chaos::ChaosCounters, check::Violation};

/// How long a starting gateway may take to report SERVING.
const HEALTHY_WITHIN: Duration = Duration::from_secs(30);
/// How long a gateway may take to exit after SIGTERM (its shutdown grace is 3 s).
const EXIT_WITHIN: Duration = Duration::from_secs(15);

/// Begins the line that marks where a start of a gateway begins in its log.
const START_MARKER: &str = "===== outbox-chaos: starting gateway";

/// Flags of every gateway: quick polls, health checks and maintenance, so that the
/// faults are noticed and repaired within the run; no metrics endpoint and no console.
const GATEWAY_FLAGS: &[&str] = &[
    "--no-migrate",
    "--metrics-listen",
    "off",
    "--console-listen",
    "off",
    "--poll-interval",
    "200ms",
    "--maintenance-interval",
    "1s",
    "--health-check-interval",
    "200ms",
    "--shutdown-grace",
    "3s",
    "--db-acquire-timeout",
    "2s",
    "--db-max-connections",
    "6",
    "--rpc-timeout",
    "10s",
];

pub struct Cluster {
    binary: PathBuf,
    database_url: String,
    /// A configuration file with the other sources, when there are any.
    config_file: Option<PathBuf>,
    log_dir: PathBuf,
    log_level: String,
    slots: Vec<Mutex<Slot>>,
    channels: Vec<Channel>,
}

struct Slot {
    /// Where it listens; `None` until its first start has bound it.
    address: Option<SocketAddr>,
    process: Option<Child>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(process) = &mut self.process {
            let _ = process.kill();
            let _ = process.wait();
        }
    }
}

impl Cluster {
    /// Migrates the database once, then starts `count` gateways and waits until each
    /// reports SERVING.
    pub async fn start(
        binary: PathBuf,
        database_url: String,
        config_file: Option<PathBuf>,
        log_dir: PathBuf,
        log_level: String,
        count: usize,
    ) -> anyhow::Result<Cluster> {
        gateway::migrate(&binary, &database_url).map_err(anyhow::Error::msg)?;
        let slots = (0..count)
            .map(|_| {
                Mutex::new(Slot {
                    address: None,
                    process: None,
                })
            })
            .collect();
        let mut cluster = Cluster {
            binary,
            database_url,
            config_file,
            log_dir,
            log_level,
            slots,
            channels: Vec::with_capacity(count),
        };
        for index in 0..count {
            let address = cluster.restart(index).await?;
            let endpoint = Endpoint::from_shared(format!("http://{address}"))?
                .connect_timeout(Duration::from_secs(1))
                .http2_keep_alive_interval(Duration::from_secs(1))
                .keep_alive_timeout(Duration::from_secs(2))
                .keep_alive_while_idle(true);
            cluster.channels.push(endpoint.connect_lazy());
        }
        Ok(cluster)
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// `http://address` of every gateway.
    pub fn endpoints(&self) -> impl Iterator<Item = String> + '_ {
        self.slots.iter().map(|slot| {
            let address = slot.lock().expect("slot lock").address;
            format!("http://{}", address.expect("every gateway started once"))
        })
    }

    /// The channel to gateway `index`; it reconnects by itself after a restart.
    pub fn channel(&self, index: usize) -> Channel {
        self.channels[index % self.channels.len()].clone()
    }

    fn slot(&self, index: usize) -> std::sync::MutexGuard<'_, Slot> {
        self.slots[index].lock().expect("slot lock")
    }

    pub fn is_running(&self, index: usize) -> bool {
        let mut slot = self.slot(index);
        match &mut slot.process {
            Some(process) => matches!(process.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Starts gateway `index` (again) on its port, or on port 0 the first time, and
    /// waits until it is SERVING; returns its address.
    pub async fn restart(&self, index: usize) -> anyhow::Result<SocketAddr> {
        let known_address = {
            let mut slot = self.slot(index);
            if slot.process.is_some() {
                bail!("gateway {index} is still running");
            }
            let log = self.open_log(index)?;
            let mut command = Command::new(&self.binary);
            command
                .arg("serve")
                .arg("--listen")
                .arg(
                    slot.address
                        .map_or_else(|| "127.0.0.1:0".to_owned(), |address| address.to_string()),
                )
                .arg("--database-url")
                .arg(&self.database_url)
                .args([
                    "--log-level",
                    &gateway::log_level_with_announcements(&self.log_level),
                ])
                .args(GATEWAY_FLAGS)
                .args(
                    self.config_file
                        .iter()
                        .flat_map(|path| ["--config".as_ref(), path.as_os_str()]),
                )
                .env_remove("RUST_LOG")
                .env("NO_COLOR", "1")
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log);
            // SAFETY: prctl is async-signal-safe; it asks the kernel to kill the gateway
            // when the runtime thread that started it exits, so a killed chaos run leaves
            // no gateway behind.
            unsafe {
                command.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    Ok(())
                });
            }
            slot.process = Some(
                command
                    .spawn()
                    .with_context(|| format!("cannot start {}", self.binary.display()))?,
            );
            slot.address
        };
        let address = match known_address {
            Some(address) => address,
            None => {
                let address = self.announced_address(index).await?;
                self.slot(index).address = Some(address);
                address
            }
        };
        self.wait_until_serving(index, address).await?;
        Ok(address)
    }

    /// The address gateway `index` says, in its log since its latest start, it bound.
    async fn announced_address(&self, index: usize) -> anyhow::Result<SocketAddr> {
        let path = self.log_path(index);
        let since_latest_start = || {
            let log = std::fs::read_to_string(&path).unwrap_or_default();
            log.rsplit_once(START_MARKER)
                .map_or(String::new(), |(_, latest)| latest.to_owned())
        };
        let announced = gateway::wait_for_announcement(
            "serving gRPC",
            HEALTHY_WITHIN,
            since_latest_start,
            || self.is_running(index),
        )
        .await;
        match announced {
            Ok(address) => Ok(address),
            Err(StartError::Exited) => bail!(
                "gateway {index} exited while starting; see {}",
                path.display()
            ),
            Err(StartError::TimedOut) => bail!(
                "gateway {index} did not say where it listens within {HEALTHY_WITHIN:?}; see {}",
                path.display()
            ),
        }
    }

    /// Appends to the gateway's log file, marking where this start begins.
    fn open_log(&self, index: usize) -> anyhow::Result<File> {
        let path = self.log_path(index);
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        writeln!(
            file,
            "{START_MARKER} {index} at {} =====",
            chrono::Utc::now().to_rfc3339()
        )?;
        Ok(file)
    }

    fn log_path(&self, index: usize) -> PathBuf {
        self.log_dir.join(format!("gateway-{index}.log"))
    }

    async fn wait_until_serving(&self, index: usize, address: SocketAddr) -> anyhow::Result<()> {
        let started =
            gateway::wait_until_serving(address, HEALTHY_WITHIN, || self.is_running(index)).await;
        match started {
            Ok(()) => Ok(()),
            Err(StartError::Exited) => bail!(
                "gateway {index} exited while starting; see {}",
                self.log_path(index).display()
            ),
            Err(StartError::TimedOut) => bail!(
                "gateway {index} on {address} did not report SERVING within {HEALTHY_WITHIN:?}"
            ),
        }
    }

    /// `kill -9` gateway `index`; false when it was not running.
    pub async fn kill(&self, index: usize) -> bool {
        let Some(mut process) = self.slot(index).process.take() else {
            return false;
        };
        let _ = process.kill();
        let _ = gateway::wait_for_exit(&mut process, EXIT_WITHIN).await;
        true
    }

    /// SIGTERM gateway `index` and waits for it to exit; an error describes a gateway
    /// that did not exit in time (it is killed then) or exited with a failure.
    pub async fn terminate(&self, index: usize) -> Result<(), String> {
        let Some(mut process) = self.slot(index).process.take() else {
            return Ok(());
        };
        gateway::terminate(&process);
        self.await_termination(index, &mut process).await
    }

    async fn await_termination(&self, index: usize, process: &mut Child) -> Result<(), String> {
        let started = Instant::now();
        match gateway::wait_for_exit(process, EXIT_WITHIN).await {
            Some(status) if status.success() => Ok(()),
            Some(status) => Err(format!(
                "gateway {index} exited with {status} after SIGTERM; see {}",
                self.log_path(index).display()
            )),
            None => {
                let _ = process.kill();
                let _ = gateway::wait_for_exit(process, EXIT_WITHIN).await;
                Err(format!(
                    "gateway {index} had not exited {:?} after SIGTERM (shutdown grace 3s); killed it",
                    started.elapsed()
                ))
            }
        }
    }

    /// Restarts every gateway that is not running (one crashed on its own, or the
    /// fault injector left it down).
    pub async fn ensure_all_running(&self, counters: &ChaosCounters) {
        for index in 0..self.len() {
            if self.is_running(index) {
                continue;
            }
            if self.slot(index).process.take().is_some() {
                counters.violation(Violation::new(
                    "gateway crash",
                    format!(
                        "gateway {index} exited on its own; see {}",
                        self.log_path(index).display()
                    ),
                ));
            }
            if let Err(error) = self.restart(index).await {
                counters.violation(Violation::new("gateway restart", format!("{error:#}")));
            }
        }
    }

    /// SIGTERM every gateway at once; reports those that did not stop cleanly.
    pub async fn stop_all(&self) -> Vec<Violation> {
        let stopping: Vec<(usize, Child)> = (0..self.len())
            .filter_map(|index| self.slot(index).process.take().map(|p| (index, p)))
            .collect();
        stopping
            .iter()
            .for_each(|(_, process)| gateway::terminate(process));
        let mut violations = Vec::new();
        for (index, mut process) in stopping {
            if let Err(detail) = self.await_termination(index, &mut process).await {
                violations.push(Violation::new("graceful shutdown", detail));
            }
        }
        violations
    }

    /// Panics the gateways logged during the run.
    pub fn panics(&self) -> Vec<Violation> {
        (0..self.len())
            .flat_map(|index| {
                let path = self.log_path(index);
                let log = std::fs::read_to_string(&path).unwrap_or_default();
                log.lines()
                    .filter(|line| line.contains("panicked at"))
                    .map(|line| {
                        Violation::new(
                            "gateway panic",
                            format!("gateway {index} ({}): {line}", path.display()),
                        )
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}
