//! The gateway under test, run as a child process: started on loopback port 0 against
//! the benchmark database (its log tells the port it bound), health-checked over gRPC, reached through a pool of gRPC
//! channels, sampled through /proc (resident memory, CPU seconds) and stopped with
//! SIGTERM. Also reads the CPU time of PostgreSQL and of this process, for the cost
//! figures.

use std::{
    io::{BufRead, BufReader},
    net::SocketAddr,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, ChildStderr, Command, Stdio},
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use anyhow::{Context, bail};
use outbox_client::proto::{
    self, admin_client::AdminClient, publisher_client::PublisherClient,
    subscriber_client::SubscriberClient,
};
use outbox_testkit::gateway::{self, StartError};
use tonic::transport::{Channel, Endpoint};

/// How long a starting gateway may take to report SERVING.
const HEALTHY_WITHIN: Duration = Duration::from_secs(30);
/// How long a stopping gateway may take to exit after SIGTERM before it is killed.
const EXIT_WITHIN: Duration = Duration::from_secs(15);

/// Starts gateway processes for one benchmark database.
pub struct GatewayLauncher {
    binary: PathBuf,
    database_url: String,
    extra_args: Vec<String>,
}

impl GatewayLauncher {
    pub fn new(binary: PathBuf, database_url: String, extra_args: Vec<String>) -> Self {
        GatewayLauncher {
            binary,
            database_url,
            extra_args,
        }
    }

    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// A launcher of the same binary and flags for another database, with `more` flags.
    pub fn for_database(&self, database_url: &str, more: &[String]) -> GatewayLauncher {
        let mut extra_args = self.extra_args.clone();
        extra_args.extend_from_slice(more);
        GatewayLauncher::new(self.binary.clone(), database_url.to_owned(), extra_args)
    }

    /// Applies the schema with `outbox-gateway migrate`.
    pub fn migrate(&self) -> anyhow::Result<()> {
        gateway::migrate(&self.binary, &self.database_url).map_err(anyhow::Error::msg)
    }

    /// Starts a gateway on a free loopback port, waits until it reports SERVING and
    /// connects `channels` gRPC channels to it.
    pub async fn start(&self, channels: usize) -> anyhow::Result<Gateway> {
        self.start_with_file(channels, None).await
    }

    /// [`GatewayLauncher::start`] with settings that exist only in the configuration
    /// file (`[push]`, say), written to a temporary file for it. (A `--config` among the
    /// extra arguments then clashes.)
    pub async fn start_with_config(
        &self,
        channels: usize,
        config_toml: &str,
    ) -> anyhow::Result<Gateway> {
        let path = std::env::temp_dir().join(format!(
            "outbox-bench-{}-{}.toml",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::write(&path, config_toml)
            .with_context(|| format!("cannot write {}", path.display()))?;
        let gateway = self.start_with_file(channels, Some(&path)).await;
        // The gateway has read it by the time it serves.
        let _ = std::fs::remove_file(&path);
        gateway
    }

    async fn start_with_file(
        &self,
        channels: usize,
        config_file: Option<&Path>,
    ) -> anyhow::Result<Gateway> {
        let mut command = Command::new(&self.binary);
        command
            .arg("serve")
            // Port 0: no other process can take the port between choosing and binding it.
            .args(["--listen", "127.0.0.1:0"])
            .arg("--database-url")
            .arg(&self.database_url)
            .args([
                "--log-level",
                &gateway::log_level_with_announcements("warn"),
            ])
            // Several gateways may run at once (fan-in, or beside a gateway of your own);
            // none needs the web console or a metrics port.
            .args(["--console-listen", "off"])
            .args(["--metrics-listen", "off"])
            .args(
                config_file
                    .map(|path| ["--config".as_ref(), path.as_os_str()])
                    .into_iter()
                    .flatten(),
            )
            .args(&self.extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // RUST_LOG wins over --log-level: keep the announcement in it too.
        if let Ok(filter) = std::env::var("RUST_LOG") {
            command.env("RUST_LOG", gateway::log_level_with_announcements(&filter));
        }
        // SAFETY: prctl is async-signal-safe; it only asks the kernel to send SIGTERM to
        // the gateway when the thread that started it (a runtime worker, alive as long as
        // the benchmark) exits, so a killed benchmark leaves no gateway behind.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("cannot start the gateway {}", self.binary.display()))?;
        let log = forward_log(child.stderr.take().expect("stderr is piped"));
        let announced = gateway::wait_for_announcement(
            "serving gRPC",
            HEALTHY_WITHIN,
            || log.lock().expect("log lock").clone(),
            || matches!(child.try_wait(), Ok(None)),
        )
        .await;
        let address = match announced {
            Ok(address) => address,
            Err(StartError::Exited) => bail!(
                "the gateway exited ({}) before it listened; its log is above",
                child
                    .try_wait()?
                    .map_or_else(|| "unknown status".into(), |status| status.to_string())
            ),
            Err(StartError::TimedOut) => bail!(
                "the gateway did not say where it listens within {} s",
                HEALTHY_WITHIN.as_secs()
            ),
        };
        let mut gateway = Gateway {
            child,
            address,
            channels: Vec::new(),
            next_channel: Arc::new(AtomicUsize::new(0)),
        };
        gateway.wait_until_serving().await?;
        gateway.channels = connect_channels(address, channels.max(1)).await?;
        Ok(gateway)
    }
}

/// Passes the gateway's log on to the benchmark's standard error, as if inherited, and
/// keeps it until the gateway has said where it listens (the text returned). The INFO
/// lines saying so, enabled for that alone, are not passed on.
fn forward_log(stderr: ChildStderr) -> Arc<Mutex<String>> {
    let kept = Arc::new(Mutex::new(String::new()));
    let log = kept.clone();
    std::thread::spawn(move || {
        let mut announced = false;
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            let announcing = line.contains(gateway::ANNOUNCING_TARGET) && line.contains("INFO");
            if !announced {
                let mut kept = log.lock().expect("log lock");
                kept.push_str(&line);
                kept.push('\n');
                announced = gateway::announced_address(&line, "serving gRPC").is_some();
            }
            if !announcing {
                eprintln!("{line}");
            }
        }
    });
    kept
}

/// A running gateway process. Dropping it kills the process.
pub struct Gateway {
    child: Child,
    address: SocketAddr,
    channels: Vec<Channel>,
    next_channel: Arc<AtomicUsize>,
}

impl Gateway {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// The next channel of the pool, round-robin: callers and streams spread over the
    /// pool's HTTP/2 connections.
    pub fn channel(&self) -> Channel {
        let index = self.next_channel.fetch_add(1, Ordering::Relaxed);
        self.channels[index % self.channels.len()].clone()
    }

    pub fn publisher(&self) -> PublisherClient<Channel> {
        PublisherClient::new(self.channel())
    }

    pub fn subscriber(&self) -> SubscriberClient<Channel> {
        SubscriberClient::new(self.channel())
    }

    pub fn admin(&self) -> AdminClient<Channel> {
        AdminClient::new(self.channel())
    }

    /// Creates a subscription to every event type, starting at the earliest retained
    /// event (`earliest`) or at the latest.
    pub async fn create_subscription(&self, name: &str, earliest: bool) -> anyhow::Result<()> {
        let mut subscription = Gateway::from_earliest(name);
        if !earliest {
            subscription.start = Some(proto::StartPosition {
                position: Some(proto::start_position::Position::Boundary(
                    proto::Boundary::Latest as i32,
                )),
            });
        }
        self.create(subscription).await
    }

    /// Creates `subscription` as it is.
    pub async fn create(&self, subscription: proto::Subscription) -> anyhow::Result<()> {
        let name = subscription.name.clone();
        self.admin()
            .create_subscription(proto::CreateSubscriptionRequest {
                subscription: Some(subscription),
                validate_only: false,
            })
            .await
            .with_context(|| format!("CreateSubscription {name:?} failed"))?;
        Ok(())
    }

    /// The settings of a subscription to every event type from the earliest retained
    /// event, to fill in with what a scenario sets.
    pub fn from_earliest(name: &str) -> proto::Subscription {
        proto::Subscription {
            name: name.into(),
            start: Some(proto::StartPosition {
                position: Some(proto::start_position::Position::Boundary(
                    proto::Boundary::Earliest as i32,
                )),
            }),
            ..Default::default()
        }
    }

    pub async fn delete_subscription(&self, name: &str) -> anyhow::Result<()> {
        self.admin()
            .delete_subscription(proto::DeleteSubscriptionRequest { name: name.into() })
            .await
            .with_context(|| format!("DeleteSubscription {name:?} failed"))?;
        Ok(())
    }

    /// Resident memory and CPU time of the gateway process now.
    pub fn stats(&self) -> anyhow::Result<ProcessStats> {
        ProcessStats::read(self.child.id())
            .with_context(|| format!("cannot read /proc for the gateway (pid {})", self.pid()))
    }

    /// CPU seconds used so far by the gateway, PostgreSQL and this process.
    pub fn cpu_snapshot(&self) -> CpuSnapshot {
        CpuSnapshot {
            gateway: self.stats().map(|s| s.cpu_seconds).unwrap_or(f64::NAN),
            postgres: postgres_cpu_seconds(),
            bench: ProcessStats::read(std::process::id())
                .map(|s| s.cpu_seconds)
                .unwrap_or(f64::NAN),
        }
    }

    /// Fails when the gateway process has exited.
    pub fn check_running(&mut self) -> anyhow::Result<()> {
        match self.child.try_wait()? {
            Some(status) => bail!("the gateway exited ({status}); its log is above"),
            None => Ok(()),
        }
    }

    /// Asks the gateway to shut down (SIGTERM) and waits for it to exit.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.channels.clear();
        if self.child.try_wait()?.is_some() {
            return Ok(());
        }
        gateway::terminate(&self.child);
        match gateway::wait_for_exit(&mut self.child, EXIT_WITHIN).await {
            Some(status) if status.success() => Ok(()),
            Some(status) => bail!("the gateway exited with {status} after SIGTERM"),
            None => {
                self.child.kill()?;
                self.child.wait()?;
                bail!(
                    "the gateway did not exit within {} s of SIGTERM and was killed",
                    EXIT_WITHIN.as_secs()
                )
            }
        }
    }

    async fn wait_until_serving(&mut self) -> anyhow::Result<()> {
        let child = &mut self.child;
        let started = gateway::wait_until_serving(self.address, HEALTHY_WITHIN, || {
            matches!(child.try_wait(), Ok(None))
        })
        .await;
        match started {
            Ok(()) => Ok(()),
            Err(StartError::Exited) => bail!(
                "the gateway exited ({}) before it became healthy; its log is above",
                child
                    .try_wait()?
                    .map_or_else(|| "unknown status".into(), |status| status.to_string())
            ),
            Err(StartError::TimedOut) => bail!(
                "the gateway at {} did not report SERVING within {} s",
                self.address,
                HEALTHY_WITHIN.as_secs()
            ),
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Opens `count` gRPC channels (HTTP/2 connections) to the gateway.
pub async fn connect_channels(address: SocketAddr, count: usize) -> anyhow::Result<Vec<Channel>> {
    let endpoint = endpoint(address)?;
    let mut channels = Vec::with_capacity(count);
    for _ in 0..count {
        channels.push(
            endpoint
                .connect()
                .await
                .with_context(|| format!("cannot connect to the gateway at {address}"))?,
        );
    }
    Ok(channels)
}

fn endpoint(address: SocketAddr) -> anyhow::Result<Endpoint> {
    Ok(Endpoint::from_shared(format!("http://{address}"))?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(5)))
}

/// Resident memory and CPU time of one process, from /proc.
#[derive(Debug, Clone, Copy)]
pub struct ProcessStats {
    /// VmRSS.
    pub rss_bytes: u64,
    /// VmHWM: the peak resident set size so far.
    pub peak_rss_bytes: u64,
    /// utime + stime.
    pub cpu_seconds: f64,
}

impl ProcessStats {
    pub fn read(pid: u32) -> anyhow::Result<ProcessStats> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let kilobytes = |key: &str| -> anyhow::Result<u64> {
            let line = status
                .lines()
                .find(|line| line.starts_with(key))
                .with_context(|| format!("no {key} in /proc/{pid}/status"))?;
            let value = line[key.len()..]
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .with_context(|| format!("malformed {line:?} in /proc/{pid}/status"))?;
            Ok(value * 1024)
        };
        Ok(ProcessStats {
            rss_bytes: kilobytes("VmRSS:")?,
            peak_rss_bytes: kilobytes("VmHWM:")?,
            cpu_seconds: cpu_seconds(pid)?,
        })
    }

    pub fn rss_mib(&self) -> f64 {
        self.rss_bytes as f64 / (1024.0 * 1024.0)
    }

    pub fn peak_rss_mib(&self) -> f64 {
        self.peak_rss_bytes as f64 / (1024.0 * 1024.0)
    }
}

/// CPU seconds at one moment, for [`crate::measure::CpuUse`].
#[derive(Debug, Clone, Copy)]
pub struct CpuSnapshot {
    pub gateway: f64,
    pub postgres: f64,
    pub bench: f64,
}

/// utime + stime of a process from /proc/<pid>/stat, in seconds.
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    stat_seconds(pid, &[14, 15])
}

/// The sum of the numbered fields of /proc/<pid>/stat (clock ticks), in seconds.
fn stat_seconds(pid: u32, fields: &[usize]) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (field 2) is in parentheses and may contain spaces: count fields
    // after its closing parenthesis, where field 3 (state) comes first.
    let after_name = stat
        .rfind(')')
        .map(|index| &stat[index + 1..])
        .with_context(|| format!("malformed /proc/{pid}/stat"))?;
    let values: Vec<&str> = after_name.split_whitespace().collect();
    fields
        .iter()
        .map(|&field| {
            values
                .get(field - 3)
                .and_then(|value| value.parse::<u64>().ok())
                .with_context(|| format!("malformed field {field} of /proc/{pid}/stat"))
        })
        .sum::<anyhow::Result<u64>>()
        .map(|ticks| ticks as f64 / clock_ticks_per_second())
}

/// CPU seconds of every process named `postgres`: the server and its backends, and
/// the backends that exited (see [`processes_cpu_seconds`]).
fn postgres_cpu_seconds() -> f64 {
    processes_cpu_seconds("postgres")
}

/// CPU seconds of every process of this name (its `comm`), summed, with those of the
/// children they reaped (utime, stime, cutime and cstime); NaN when /proc cannot be
/// read. A PostgreSQL backend that exits between two readings moves into its server's
/// children's time, so the difference of two readings keeps its CPU rather than losing
/// all of it.
pub fn processes_cpu_seconds(name: &str) -> f64 {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return f64::NAN;
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|comm| comm.trim_end() == name)
        })
        .filter_map(|pid| stat_seconds(pid, &[14, 15, 16, 17]).ok())
        .sum()
}

/// The kernel's clock tick rate (what `getconf CLK_TCK` prints), normally 100.
fn clock_ticks_per_second() -> f64 {
    static TICKS: OnceLock<f64> = OnceLock::new();
    *TICKS.get_or_init(|| {
        // SAFETY: sysconf only reads a configuration value.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        if ticks > 0 { ticks as f64 } else { 100.0 }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let before = ProcessStats::read(std::process::id()).unwrap();
        assert!(before.rss_bytes > 0);
        assert!(before.peak_rss_bytes >= before.rss_bytes);
        // Work on one thread for a while: the CPU time read back must grow by about as
        // much, and by no more than the wall time that passed (one thread, one core).
        let started = std::time::Instant::now();
        let mut spin = 0u64;
        while started.elapsed() < std::time::Duration::from_millis(300) {
            spin = std::hint::black_box(spin.wrapping_mul(31).wrapping_add(7));
        }
        let after = ProcessStats::read(std::process::id()).unwrap();
        let used = after.cpu_seconds - before.cpu_seconds;
        let wall = started.elapsed().as_secs_f64();
        // This test runs beside others of the binary, so the process may use more
        // than one core; a whole machine's worth is the ceiling.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        assert!(
            used >= 0.05 && used <= wall * cores + 0.05,
            "{used} CPU seconds counted for {wall} s of work on one thread"
        );
    }
}
