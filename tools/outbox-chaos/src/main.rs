//! `outbox-chaos`: runs three gateway processes on a throw-away database, publishes
//! through them (gRPC and direct SQL, with rollbacks; some events scheduled, some
//! expiring) and consumes from several subscriptions (one of them pushed to an HTTP
//! receiver, one dead-lettering poison events, one consumed exactly once in database
//! transactions by consumers that crash) while gateways are killed, restarted and cut
//! off from PostgreSQL and an operator pauses, seeks and requeues dead letters and
//! consumed events; then lets the consumers drain and checks every delivery guarantee
//! against what the producers know they committed.
//!
//! Exits 0 when no guarantee was violated, 1 on a violation, 2 when the run itself could
//! not be carried out (no database, no gateway binary).

mod bookkeeping;
mod chaos;
mod check;
mod cluster;
mod consumers;
mod database;
mod exactly_once;
mod held;
mod ledger;
mod operator;
mod producers;
mod push;
mod report;

use std::{path::PathBuf, process::ExitCode, sync::Arc, time::Duration};

use anyhow::Context;
use clap::Parser;
use outbox_testkit::{PostgresServer, gateway};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::{
    chaos::ChaosCounters,
    cluster::Cluster,
    consumers::{Journal, SubscriptionSpec},
    database::{ChaosDatabase, Databases},
    ledger::Ledger,
    operator::{Operations, Operator},
    report::{Timing, Totals},
};

/// Name of the second source in the gateways' configuration.
pub const REMOTE_SOURCE: &str = "remote";

/// Chaos test of outbox-gateway: crash, restart and cut off gateways while events flow,
/// then check that nothing was lost, duplicated after an ack, or reordered.
#[derive(Debug, Parser)]
#[command(name = "outbox-chaos", version)]
struct Args {
    /// PostgreSQL server (without a database name); a database `outbox_chaos_<random>` is
    /// created on it and dropped at the end.
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432")]
    postgres_url: String,

    /// The `outbox-gateway` binary. Default: the one beside this executable.
    #[arg(long)]
    gateway_bin: Option<PathBuf>,

    /// Length of the chaos phase (producing while faults are injected), e.g. `60s`.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    duration: Duration,

    /// Longest wait for the consumers to drain once producing has stopped.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    drain_timeout: Duration,

    /// Producers publishing over gRPC.
    #[arg(long, default_value_t = 3)]
    rpc_producers: usize,

    /// Producers inserting events with SQL in their own transactions.
    #[arg(long, default_value_t = 2)]
    sql_producers: usize,

    /// Seed of the random choices of the fault injector (random when omitted).
    #[arg(long)]
    seed: Option<u64>,

    /// Directory for the gateways' logs. Default: a new directory under the system's
    /// temporary directory, removed after a run without violations.
    #[arg(long)]
    log_dir: Option<PathBuf>,

    /// Log filter passed to the gateways (`--log-level`).
    #[arg(long, default_value = "warn")]
    gateway_log_level: String,

    /// Keep the database after the run, for inspection.
    #[arg(long)]
    keep_database: bool,

    /// Relay from the gateway's own database only. By default a second source database
    /// runs on a PostgreSQL server of its own (started with the machine's initdb and
    /// pg_ctl), which the fault injector takes down and brings back.
    #[arg(long)]
    single_source: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(args).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("outbox-chaos: {error:#}");
            ExitCode::from(2)
        }
    }
}

/// Runs the whole scenario; `Ok(true)` when every check passed.
async fn run(args: Args) -> anyhow::Result<bool> {
    let gateway_bin = match &args.gateway_bin {
        Some(path) => path.clone(),
        None => gateway::binary_beside(
            &std::env::current_exe().context("cannot locate this executable")?,
        )
        .map_err(|error| anyhow::anyhow!("{error}, or pass --gateway-bin"))?,
    };
    let database = ChaosDatabase::create(&args.postgres_url).await?;
    eprintln!("outbox-chaos: database {}", database.name());
    let remote = match args.single_source {
        true => None,
        false => {
            let server = tokio::task::spawn_blocking(PostgresServer::start)
                .await?
                .context("cannot start a second PostgreSQL server for the remote source")?;
            let remote_database = ChaosDatabase::create(&server.url()).await?;
            gateway::migrate(&gateway_bin, &remote_database.url()).map_err(anyhow::Error::msg)?;
            Some((Arc::new(server), remote_database))
        }
    };
    let log_dir = match &args.log_dir {
        Some(dir) => dir.clone(),
        None => std::env::temp_dir().join(database.name()),
    };
    let mut databases = vec![database.clone()];
    databases.extend(remote.iter().map(|(_, remote)| remote.clone()));
    let outcome = run_on(
        &args,
        gateway_bin,
        &Databases(databases),
        remote.as_ref().map(|(server, _)| server.clone()),
        &log_dir,
    )
    .await;
    // Logs of a clean run in a directory of our own are of no further use.
    if matches!(outcome, Ok(true)) && args.log_dir.is_none() {
        let _ = std::fs::remove_dir_all(&log_dir);
    }
    if args.keep_database {
        eprintln!("outbox-chaos: kept database {}", database.name());
        database.close().await;
    } else {
        database.drop_database().await;
        if let Some((_, remote)) = &remote {
            remote.drop_database().await;
        }
    }
    outcome
}

async fn run_on(
    args: &Args,
    gateway_bin: PathBuf,
    databases: &Databases,
    remote_server: Option<Arc<PostgresServer>>,
    log_dir: &std::path::Path,
) -> anyhow::Result<bool> {
    let database = databases.gateway();
    std::fs::create_dir_all(log_dir)
        .with_context(|| format!("cannot create {}", log_dir.display()))?;
    let seed = args.seed.unwrap_or_else(rand::random);
    eprintln!(
        "outbox-chaos: seed {seed}, gateway logs in {}",
        log_dir.display()
    );

    // Pushing is off until the receiver's host is allowed.
    let mut config = "[push]\nallowed_hosts = [\"127.0.0.1\"]\n".to_owned();
    if let Some(remote) = databases.0.get(1) {
        config.push_str(&format!(
            "\n[[sources]]\nname = \"{REMOTE_SOURCE}\"\ndatabase_url = \"{}\"\n",
            remote.url()
        ));
    }
    let config_file = log_dir.join("gateways.toml");
    std::fs::write(&config_file, config)
        .with_context(|| format!("cannot write {}", config_file.display()))?;
    let cluster = Arc::new(
        Cluster::start(
            gateway_bin,
            database.url(),
            Some(config_file),
            log_dir.to_path_buf(),
            args.gateway_log_level.clone(),
            3,
        )
        .await?,
    );
    let specs = SubscriptionSpec::all();
    let ledger = Arc::new(Ledger::default());
    let journal = Arc::new(Journal::new(specs.clone()));
    let counters = Arc::new(ChaosCounters::default());
    let operations = Arc::new(Operations::default());

    let stop_receiver = CancellationToken::new();
    let push_endpoint = push::start(journal.clone(), stop_receiver.clone()).await?;
    for spec in &specs {
        spec.create(&cluster, &push_endpoint).await?;
    }
    exactly_once::create_table(database)
        .await
        .context("cannot create the exactly-once consumers' table")?;

    let stop_consumers = CancellationToken::new();
    let calm = CancellationToken::new();
    let consumers = consumers::spawn_all(
        cluster.clone(),
        journal.clone(),
        database,
        ledger.clone(),
        stop_consumers.clone(),
        calm.clone(),
    );

    let started = Instant::now();
    let stop_producing = CancellationToken::new();
    let producers = producers::spawn_all(
        cluster.clone(),
        databases,
        ledger.clone(),
        args.rpc_producers,
        args.sql_producers,
        stop_producing.clone(),
    );
    let chaos = tokio::spawn(chaos::run(
        cluster.clone(),
        databases.clone(),
        remote_server,
        counters.clone(),
        seed,
        args.duration,
    ));
    let operator = tokio::spawn(
        Operator::new(cluster.clone(), journal.clone(), operations.clone(), seed)
            .run(args.duration),
    );
    let holder = tokio::spawn(held::run(
        database.clone(),
        ledger.clone(),
        seed,
        stop_producing.clone(),
    ));
    let stop_watchdog = CancellationToken::new();
    let watchdog = tokio::spawn(watch_for_idle_transactions(
        databases.clone(),
        counters.clone(),
        stop_watchdog.clone(),
    ));

    tokio::time::sleep(args.duration).await;
    stop_producing.cancel();
    eprintln!("outbox-chaos: chaos phase over, waiting for producers and the fault injector");
    let ((), chaos_result, _, operator_result) =
        tokio::join!(producers.join(), chaos, holder, operator);
    if let Err(error) = chaos_result {
        anyhow::bail!("the fault injector failed: {error}");
    }
    if let Err(error) = operator_result {
        anyhow::bail!("the operator failed: {error}");
    }
    cluster.ensure_all_running(&counters).await;

    calm.cancel();
    eprintln!("outbox-chaos: draining");
    let drain_started = Instant::now();
    let drained = drain(databases, &ledger, &journal, args.drain_timeout).await?;
    let drain_time = drain_started.elapsed();
    stop_consumers.cancel();
    consumers.join().await;
    stop_watchdog.cancel();
    let _ = watchdog.await;

    let snapshot = databases.final_state().await?;
    let admin_view = operator::final_view(&cluster, &specs, &operations).await;
    let shutdown_problems = cluster.stop_all().await;
    stop_receiver.cancel();
    let row_writes_per_event = bookkeeping::row_writes_per_event(&cluster, databases).await?;
    let panics = cluster.panics();

    let operations_log = operations.log();
    let operated = check::Operated {
        log: &operations_log,
        view: &admin_view,
    };
    let mut violations = check::run(&ledger, &journal, &snapshot, operated, started);
    violations.extend(operations_log.violations.iter().cloned());
    violations.extend(ledger.state().violations.iter().cloned());
    violations.extend(counters.violations());
    violations.extend(shutdown_problems);
    violations.extend(panics);
    if row_writes_per_event > bookkeeping::MAX_ROW_WRITES_PER_EVENT {
        violations.push(check::Violation::new(
            "bookkeeping per event",
            format!(
                "draining a burst wrote {row_writes_per_event:.2} rows per event in the \
                 gateway's tables, more than {}",
                bookkeeping::MAX_ROW_WRITES_PER_EVENT
            ),
        ));
    }

    let timing = Timing {
        run: started.elapsed(),
        drain: drain_time,
        drained,
    };
    let mut totals = Totals::gather(
        &ledger,
        &journal,
        &snapshot,
        &counters,
        check::Operated {
            log: &operations_log,
            view: &admin_view,
        },
        &violations,
        timing,
        seed,
    );
    totals.burst_row_writes_per_event = row_writes_per_event;
    report::print(&totals, &violations);
    Ok(violations.is_empty())
}

/// Waits until every committed event is known to be acked on every subscription that
/// matches it, or `timeout` passes. Returns whether the consumers drained.
async fn drain(
    databases: &Databases,
    ledger: &Ledger,
    journal: &Journal,
    timeout: Duration,
) -> anyhow::Result<bool> {
    let started = Instant::now();
    let mut next_progress = started;
    loop {
        let unsettled = databases.unsettled_records().await.unwrap_or_default();
        let outstanding = journal.outstanding(ledger, &unsettled);
        if outstanding.iter().all(|&count| count == 0) {
            return Ok(true);
        }
        let by_subscription: Vec<String> = (journal.specs.iter())
            .zip(&outstanding)
            .map(|(spec, count)| format!("{} {count}", spec.name))
            .collect();
        if started.elapsed() >= timeout {
            eprintln!(
                "outbox-chaos: drain timed out; still to ack: {}",
                by_subscription.join(", ")
            );
            return Ok(false);
        }
        if Instant::now() >= next_progress {
            eprintln!(
                "outbox-chaos: draining, still to ack: {}",
                by_subscription.join(", ")
            );
            next_progress += Duration::from_secs(5);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Samples the gateways' sessions in every source twice a second until `stop`: one left
/// idle inside a transaction for more than two seconds is a violation. A source that
/// cannot be sampled is one the fault injector has taken down.
async fn watch_for_idle_transactions(
    databases: Databases,
    counters: Arc<ChaosCounters>,
    stop: CancellationToken,
) {
    while !stop.is_cancelled() {
        for database in &databases.0 {
            let Ok(sessions) = database
                .gateway_sessions_idle_in_transaction(Duration::from_secs(2))
                .await
            else {
                continue;
            };
            if !sessions.is_empty() {
                counters.violation(check::Violation::new(
                    "idle in transaction",
                    format!(
                        "gateway sessions left idle in a transaction in {}: {sessions:?}",
                        database.name()
                    ),
                ));
            }
            counters
                .idle_in_transaction_checks
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = stop.cancelled() => {}
        }
    }
}
