//! `outbox-bench`: measures outbox-gateway against the raw PostgreSQL ceiling in the same
//! run.
//!
//! It creates a throw-away database, starts the `outbox-gateway` binary as a child
//! process for each scenario (so the gateway's own memory and CPU can be read from
//! /proc), drives load through the real gRPC API — and, for comparison, straight into
//! PostgreSQL with sqlx — and prints a table and one JSON line per scenario on stdout.
//! SVG charts go to `--out`. BENCHMARKS.md describes the scenarios and targets.
//!
//! Modules:
//! - [`scenarios`]: the scenarios and what they share;
//! - [`publish`], [`consume`]: closed-loop publishers, Subscribe-stream consumers;
//! - [`gateway`]: the gateway child process, its gRPC channels and /proc readings;
//! - [`database`]: the benchmark database, backlog fills, direct-SQL pools;
//! - [`raw_delivery`]: the raw SQL ceiling of delivery;
//! - [`workload`]: the events written and the direct-SQL statements;
//! - [`measure`], [`report`], [`charts`]: figures, tables and JSON, SVG output.

mod charts;
mod consume;
mod database;
mod gateway;
mod measure;
mod publish;
mod raw_delivery;
mod report;
mod scenarios;
mod workload;

use std::{path::PathBuf, process::ExitCode, time::Duration};

use anyhow::Context;
use clap::Parser;

use crate::{
    database::BenchDatabase,
    gateway::GatewayLauncher,
    measure::Timing,
    report::Report,
    scenarios::{Bench, Scenario, Settings},
};

#[derive(Parser)]
#[command(
    name = "outbox-bench",
    version,
    about = "Benchmarks outbox-gateway against raw PostgreSQL in the same run",
    after_help = "Scenarios run in the order given, each against a freshly started gateway and an \
                  empty database. See BENCHMARKS.md."
)]
struct Cli {
    /// Scenarios to run; all of them when none is given.
    #[arg(value_enum)]
    scenarios: Vec<Scenario>,

    /// Smoke-test sizes: ~1-2 s per scenario (0.5 s windows, backlogs scaled by 0.02).
    #[arg(long)]
    quick: bool,

    /// Measured window of each timed run, e.g. 10, 30s, 500ms. [default: 10s; 0.5s with --quick]
    #[arg(long, value_parser = parse_duration)]
    duration: Option<Duration>,

    /// Unmeasured warm-up before each timed run. [default: 2s; 0.2s with --quick]
    #[arg(long, value_parser = parse_duration)]
    warmup: Option<Duration>,

    /// Multiplies every backlog size (200,000 for deliver, fanout, memory and cost;
    /// 100,000 and 1,000,000 for backlog-scaling). [default: 1; 0.02 with --quick]
    #[arg(long)]
    scale: Option<f64>,

    /// Length of backlog-scaling's sustained deliver run. [default: 60s; 2s with --quick]
    #[arg(long, value_parser = parse_duration)]
    sustain: Option<Duration>,

    /// Directory for the SVG charts (created when missing).
    #[arg(long, default_value = "docs/bench")]
    out: PathBuf,

    /// PostgreSQL server (on this machine) to create the benchmark database on.
    /// Without an sslmode in it, connections use sslmode=disable.
    #[arg(
        long,
        env = "OUTBOX_BENCH_POSTGRES_URL",
        default_value = "postgres://postgres@127.0.0.1:5432"
    )]
    postgres_url: String,

    /// The gateway binary. [default: outbox-gateway next to this executable]
    #[arg(long)]
    gateway_bin: Option<PathBuf>,

    /// Extra argument for `outbox-gateway serve`; repeatable, e.g.
    /// --gateway-arg=--db-max-connections=20
    #[arg(long = "gateway-arg", value_name = "ARG", allow_hyphen_values = true)]
    gateway_args: Vec<String>,

    /// gRPC connections (HTTP/2) the load is spread over.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=256))]
    channels: u16,

    /// Keep the benchmark database instead of dropping it at the end.
    #[arg(long)]
    keep_database: bool,
}

impl Cli {
    fn settings(&self) -> anyhow::Result<Settings> {
        let quick = self.quick;
        let preset =
            |full: f64, fast: f64| Duration::from_secs_f64(if quick { fast } else { full });
        let scale = self.scale.unwrap_or(if quick { 0.02 } else { 1.0 });
        if !(scale > 0.0 && scale <= 100.0) {
            anyhow::bail!("--scale must be above 0 and at most 100, got {scale}");
        }
        let settings = Settings {
            quick,
            timing: Timing {
                warmup: self.warmup.unwrap_or(preset(2.0, 0.2)),
                duration: self.duration.unwrap_or(preset(10.0, 0.5)),
                sample_interval: preset(1.0, 0.1),
            },
            scale,
            sustain: self.sustain.unwrap_or(preset(60.0, 2.0)),
            deliver_limit: preset(300.0, 20.0),
            settle: preset(2.0, 0.3),
            channels: self.channels.into(),
        };
        if settings.timing.duration < Duration::from_millis(100) {
            anyhow::bail!("--duration must be at least 100ms");
        }
        if settings.sustain < settings.timing.sample_interval * 6 {
            anyhow::bail!(
                "--sustain must be at least {:?}",
                settings.timing.sample_interval * 6
            );
        }
        Ok(settings)
    }

    fn gateway_binary(&self) -> anyhow::Result<PathBuf> {
        match &self.gateway_bin {
            Some(path) if path.is_file() => Ok(path.clone()),
            Some(path) => anyhow::bail!("gateway binary {} not found", path.display()),
            None => outbox_testkit::gateway::binary_beside(
                &std::env::current_exe().context("cannot locate this executable")?,
            )
            .map_err(|error| anyhow::anyhow!("{error}, or pass --gateway-bin")),
        }
    }
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    if let Ok(seconds) = text.parse::<f64>() {
        return Duration::try_from_secs_f64(seconds).map_err(|error| error.to_string());
    }
    humantime::parse_duration(text).map_err(|error| error.to_string())
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let scenarios = if cli.scenarios.is_empty() {
        Scenario::ALL.to_vec()
    } else {
        cli.scenarios.clone()
    };
    let bench = match set_up(&cli).await {
        Ok(bench) => bench,
        Err(error) => {
            eprintln!("outbox-bench: {error:#}");
            return ExitCode::from(2);
        }
    };

    let outcome = tokio::select! {
        failures = run_scenarios(&bench, &scenarios) => Some(failures),
        _ = tokio::signal::ctrl_c() => {
            eprintln!("outbox-bench: interrupted");
            None
        }
    };

    if cli.keep_database {
        eprintln!("kept database {}", bench.database.name());
    } else if let Err(error) = bench.database.drop_database().await {
        eprintln!("outbox-bench: {error:#}");
    }
    match outcome {
        Some(0) => ExitCode::SUCCESS,
        Some(_) => ExitCode::FAILURE,
        None => ExitCode::from(130),
    }
}

/// Checks the options, creates the database and applies the schema.
async fn set_up(cli: &Cli) -> anyhow::Result<Bench> {
    let settings = cli.settings()?;
    let binary = cli.gateway_binary()?;
    std::fs::create_dir_all(&cli.out)
        .with_context(|| format!("cannot create the output directory {}", cli.out.display()))?;
    let database = BenchDatabase::create(&cli.postgres_url, !settings.quick).await?;
    eprintln!("created database {}", database.name());
    let launcher =
        GatewayLauncher::new(binary, database.url().to_owned(), cli.gateway_args.clone());
    if let Err(error) = launcher.migrate() {
        let _ = database.drop_database().await;
        return Err(error);
    }
    let server = database
        .describe_server()
        .await
        .unwrap_or_else(|error| format!("PostgreSQL ({error:#})"));
    println!(
        "outbox-bench: gateway {}, database {} on {server}, {} s windows after {} s warm-up, backlogs × {}, charts in {}",
        launcher.binary().display(),
        database.url(),
        settings.timing.duration.as_secs_f64(),
        settings.timing.warmup.as_secs_f64(),
        settings.scale,
        cli.out.display()
    );
    Ok(Bench {
        settings,
        database,
        out_dir: cli.out.clone(),
        launcher,
    })
}

/// Runs each scenario against a fresh gateway and an empty database, printing its report
/// as it completes; returns how many failed.
async fn run_scenarios(bench: &Bench, scenarios: &[Scenario]) -> usize {
    let mut failures = 0;
    let mut verdicts = Vec::new();
    for &scenario in scenarios {
        eprintln!("[{}] starting", scenario.name());
        let started = std::time::Instant::now();
        let result = run_scenario(bench, scenario).await;
        eprintln!(
            "[{}] took {:.1} s",
            scenario.name(),
            started.elapsed().as_secs_f64()
        );
        match result {
            Ok(report) => {
                print!("{}", report.render());
                println!("{}", report.json_line());
                verdicts.extend(
                    report
                        .targets
                        .iter()
                        .map(|target| format!("{}: {}", scenario.name(), target.render())),
                );
            }
            Err(error) => {
                failures += 1;
                eprintln!("[{}] failed: {error:#}", scenario.name());
                println!("{}", report::error_line(scenario.name(), &error));
            }
        }
    }
    if !verdicts.is_empty() {
        println!("\n== targets");
        for verdict in verdicts {
            println!("  {verdict}");
        }
    }
    failures
}

async fn run_scenario(bench: &Bench, scenario: Scenario) -> anyhow::Result<Report> {
    bench.database.reset().await?;
    let mut gateway = match scenario.gateway_config() {
        Some(config) => {
            bench
                .launcher
                .start_with_config(bench.settings.channels, config)
                .await?
        }
        None => bench.launcher.start(bench.settings.channels).await?,
    };
    let result = scenario.run(bench, &gateway).await;
    // A gateway that died mid-run explains whatever error the scenario saw.
    if let Err(exited) = gateway.check_running() {
        return Err(match result {
            Err(error) => error.context(exited.to_string()),
            Ok(_) => exited,
        });
    }
    let report = result?;
    if let Err(error) = gateway.stop().await {
        eprintln!("[{}] note: {error:#}", scenario.name());
    }
    Ok(report)
}
