//! The fault injector: at random intervals it `kill -9`s a gateway and restarts it,
//! terminates every database connection the gateways hold, or takes the second source's
//! server down for a moment, each at least once; once per run it restarts a gateway
//! gracefully (SIGTERM). Its choices come from a seeded generator, so a run's sequence of
//! faults can be replayed with `--seed`.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use rand::{Rng, SeedableRng, rngs::StdRng};
use tokio::time::Instant;

use outbox_testkit::PostgresServer;

use crate::{check::Violation, cluster::Cluster, database::Databases};

/// What the fault injector did, and what went wrong while doing it.
#[derive(Debug, Default)]
pub struct ChaosCounters {
    pub kills: AtomicU64,
    pub graceful_restarts: AtomicU64,
    /// Rounds of `pg_terminate_backend` over the gateways' connections.
    pub connection_cuts: AtomicU64,
    /// Connections terminated in those rounds.
    pub connections_cut: AtomicU64,
    /// Times the second source's server was taken down and brought back.
    pub source_outages: AtomicU64,
    /// Samples of the gateways' sessions taken by the idle-in-transaction watchdog.
    pub idle_in_transaction_checks: AtomicU64,
    violations: Mutex<Vec<Violation>>,
}

impl ChaosCounters {
    pub fn violation(&self, violation: Violation) {
        self.violations
            .lock()
            .expect("violations lock")
            .push(violation);
    }

    pub fn violations(&self) -> Vec<Violation> {
        self.violations.lock().expect("violations lock").clone()
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// Injects faults for `duration`, then returns with every gateway running again.
pub async fn run(
    cluster: Arc<Cluster>,
    databases: Databases,
    remote_server: Option<Arc<PostgresServer>>,
    counters: Arc<ChaosCounters>,
    seed: u64,
    duration: Duration,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let started = Instant::now();
    // Leave the last seconds quiet so the last restart completes within the phase.
    let end = started + duration.saturating_sub(Duration::from_secs(3));
    let graceful_at = started + duration.mul_f64(rng.random_range(0.3..0.6));
    let mut graceful_done = false;
    loop {
        let pause = Duration::from_millis(rng.random_range(1500..4000));
        if Instant::now() + pause >= end {
            break;
        }
        tokio::time::sleep(pause).await;
        let gateway = rng.random_range(0..cluster.len());
        if !graceful_done && Instant::now() >= graceful_at {
            graceful_done = true;
            graceful_restart(&cluster, &counters, gateway, &mut rng).await;
        } else {
            match choose_fault(&counters, remote_server.as_ref(), &mut rng) {
                Fault::SourceOutage(server) => source_outage(server, &counters, &mut rng).await,
                Fault::Kill => {
                    let also_cut = rng.random_bool(0.25);
                    crash(&cluster, &databases, &counters, gateway, also_cut, &mut rng).await;
                }
                Fault::ConnectionCut => cut_connections(&databases, &counters).await,
            }
        }
    }
    if !graceful_done {
        let gateway = rng.random_range(0..cluster.len());
        graceful_restart(&cluster, &counters, gateway, &mut rng).await;
    }
    cluster.ensure_all_running(&counters).await;
}

/// The faults chosen from at random (the graceful restart has its own time).
#[derive(Clone, Copy)]
enum Fault<'a> {
    SourceOutage(&'a Arc<PostgresServer>),
    Kill,
    ConnectionCut,
}

/// The next fault: first each kind that has not happened yet, so that a short run still
/// injects every one; then kills and cuts as often as each other, and a source outage
/// now and then.
fn choose_fault<'a>(
    counters: &ChaosCounters,
    remote_server: Option<&'a Arc<PostgresServer>>,
    rng: &mut StdRng,
) -> Fault<'a> {
    let outage = remote_server.map(Fault::SourceOutage);
    let missing: Vec<Fault> = [
        (outage, &counters.source_outages),
        (Some(Fault::Kill), &counters.kills),
        (Some(Fault::ConnectionCut), &counters.connection_cuts),
    ]
    .into_iter()
    .filter(|(_, count)| ChaosCounters::get(count) == 0)
    .filter_map(|(fault, _)| fault)
    .collect();
    if !missing.is_empty() {
        return missing[rng.random_range(0..missing.len())];
    }
    if let Some(outage) = outage.filter(|_| rng.random_bool(0.15)) {
        outage
    } else if rng.random_bool(0.5) {
        Fault::Kill
    } else {
        Fault::ConnectionCut
    }
}

/// Takes the second source's server down (like a crash) for a moment, then brings it
/// back: the other source must keep flowing, and nothing of this one may be lost.
async fn source_outage(server: &Arc<PostgresServer>, counters: &ChaosCounters, rng: &mut StdRng) {
    let down_for = Duration::from_millis(rng.random_range(1000..3000));
    let stopping = server.clone();
    match tokio::task::spawn_blocking(move || stopping.stop()).await {
        Ok(Ok(())) => eprintln!("outbox-chaos: source server down for {down_for:?}"),
        outcome => {
            counters.violation(Violation::new(
                "source outage",
                format!("cannot stop the source's server: {outcome:?}"),
            ));
            return;
        }
    }
    counters.source_outages.fetch_add(1, Ordering::Relaxed);
    tokio::time::sleep(down_for).await;
    let starting = server.clone();
    if let Ok(Err(error)) | Err(error) = tokio::task::spawn_blocking(move || starting.resume())
        .await
        .map_err(|error| outbox_testkit::ServerError::Command {
            command: "resume".into(),
            detail: error.to_string(),
        })
    {
        counters.violation(Violation::new(
            "source outage",
            format!("cannot start the source's server again: {error}"),
        ));
    }
}

/// `kill -9`, a pause, a restart; with `also_cut`, the survivors lose their database
/// connections while it is down.
async fn crash(
    cluster: &Cluster,
    databases: &Databases,
    counters: &ChaosCounters,
    gateway: usize,
    also_cut: bool,
    rng: &mut StdRng,
) {
    if cluster.kill(gateway).await {
        counters.kills.fetch_add(1, Ordering::Relaxed);
        eprintln!("outbox-chaos: kill -9 gateway {gateway}");
    }
    if also_cut {
        cut_connections(databases, counters).await;
    }
    tokio::time::sleep(Duration::from_millis(rng.random_range(200..2000))).await;
    restart(cluster, counters, gateway).await;
}

async fn graceful_restart(
    cluster: &Cluster,
    counters: &ChaosCounters,
    gateway: usize,
    rng: &mut StdRng,
) {
    eprintln!("outbox-chaos: SIGTERM gateway {gateway}");
    if let Err(detail) = cluster.terminate(gateway).await {
        counters.violation(Violation::new("graceful shutdown", detail));
    }
    counters.graceful_restarts.fetch_add(1, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(rng.random_range(300..1000))).await;
    restart(cluster, counters, gateway).await;
}

async fn restart(cluster: &Cluster, counters: &ChaosCounters, gateway: usize) {
    if let Err(error) = cluster.restart(gateway).await {
        counters.violation(Violation::new("gateway restart", format!("{error:#}")));
    }
}

async fn cut_connections(databases: &Databases, counters: &ChaosCounters) {
    match databases.cut_gateway_connections().await {
        Ok(cut) => {
            counters.connection_cuts.fetch_add(1, Ordering::Relaxed);
            counters.connections_cut.fetch_add(cut, Ordering::Relaxed);
            eprintln!("outbox-chaos: terminated {cut} gateway connections");
        }
        Err(error) => eprintln!("outbox-chaos: cannot cut connections: {error:#}"),
    }
}
