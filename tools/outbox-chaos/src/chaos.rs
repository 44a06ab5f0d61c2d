//! The fault injector: at random intervals it `kill -9`s a gateway and restarts it, or
//! terminates every database connection the gateways hold; once per run it restarts a
//! gateway gracefully (SIGTERM). Its choices come from a seeded generator, so a run's
//! sequence of faults can be replayed with `--seed`.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use rand::{Rng, SeedableRng, rngs::StdRng};
use tokio::time::Instant;

use crate::{check::Violation, cluster::Cluster, database::ChaosDatabase};

/// What the fault injector did, and what went wrong while doing it.
#[derive(Debug, Default)]
pub struct ChaosCounters {
    pub kills: AtomicU64,
    pub graceful_restarts: AtomicU64,
    /// Rounds of `pg_terminate_backend` over the gateways' connections.
    pub connection_cuts: AtomicU64,
    /// Connections terminated in those rounds.
    pub connections_cut: AtomicU64,
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
    database: ChaosDatabase,
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
        } else if choose_kill(&counters, &mut rng) {
            let also_cut = rng.random_bool(0.25);
            crash(&cluster, &database, &counters, gateway, also_cut, &mut rng).await;
        } else {
            cut_connections(&database, &counters).await;
        }
    }
    if !graceful_done {
        let gateway = rng.random_range(0..cluster.len());
        graceful_restart(&cluster, &counters, gateway, &mut rng).await;
    }
    cluster.ensure_all_running(&counters).await;
}

/// Kill or cut, at random, but each at least once as soon as the other happened.
fn choose_kill(counters: &ChaosCounters, rng: &mut StdRng) -> bool {
    let kills = ChaosCounters::get(&counters.kills);
    let cuts = ChaosCounters::get(&counters.connection_cuts);
    match (kills, cuts) {
        (0, 1..) => true,
        (1.., 0) => false,
        _ => rng.random_bool(0.5),
    }
}

/// `kill -9`, a pause, a restart; with `also_cut`, the survivors lose their database
/// connections while it is down.
async fn crash(
    cluster: &Cluster,
    database: &ChaosDatabase,
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
        cut_connections(database, counters).await;
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

async fn cut_connections(database: &ChaosDatabase, counters: &ChaosCounters) {
    match database.cut_gateway_connections().await {
        Ok(cut) => {
            counters.connection_cuts.fetch_add(1, Ordering::Relaxed);
            counters.connections_cut.fetch_add(cut, Ordering::Relaxed);
            eprintln!("outbox-chaos: terminated {cut} gateway connections");
        }
        Err(error) => eprintln!("outbox-chaos: cannot cut connections: {error:#}"),
    }
}
