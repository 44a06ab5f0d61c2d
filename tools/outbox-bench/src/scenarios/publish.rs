//! publish-batch and publish-single: closed-loop Publish callers against direct-SQL
//! writers with the same concurrency and batch size, writing the same rows into the same
//! table of the same database. Each run starts from an empty outbox table.

use serde_json::json;

use super::{Bench, progress};
use crate::{
    gateway::Gateway,
    measure::{LatencySummary, Throughput},
    publish::{self, Writer},
    report::{LATENCY_HEADERS, Report, Table, Target, format_number, format_ratio, latency_cells},
};

const BATCH_SIZE: usize = 100;
const BATCH_CALLERS: [usize; 2] = [1, 8];
const SINGLE_CALLERS: [usize; 2] = [8, 32];

/// The gateway and the direct-SQL writer at one concurrency.
struct Comparison {
    callers: usize,
    gateway: Throughput,
    sql: Throughput,
}

impl Comparison {
    fn ratio(&self) -> f64 {
        self.gateway.per_second() / self.sql.per_second()
    }

    fn to_json(&self) -> serde_json::Value {
        json!({
            "callers": self.callers,
            "gateway": self.gateway.to_json(),
            "sql": self.sql.to_json(),
            "ratio": crate::measure::round(self.ratio(), 3),
            "gateway_cpu_s_per_million": crate::measure::round(
                self.gateway.cpu.gateway_per_million(self.gateway.events), 2),
        })
    }
}

pub async fn batch(bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
    let scenario = "publish-batch";
    let runs = compare(bench, gateway, scenario, &BATCH_CALLERS, BATCH_SIZE).await?;
    let mut report = Report::new(
        scenario,
        format!(
            "Publish with {BATCH_SIZE} events per call vs the same rows by INSERT ... SELECT FROM UNNEST"
        ),
    );
    report.tables.push(throughput_table(&runs));
    report.figure("batch_size", BATCH_SIZE);
    report.figure(
        "runs",
        runs.iter().map(Comparison::to_json).collect::<Vec<_>>(),
    );
    for (callers, limit) in [(8, 0.6), (1, 0.7)] {
        if let Some(run) = runs.iter().find(|run| run.callers == callers) {
            report.targets.push(Target::at_least(
                format!("gateway / sql at {}", callers_label(callers)),
                run.ratio(),
                limit,
                "×",
            ));
        }
    }
    charts(bench, &mut report, scenario, &runs)?;
    Ok(report)
}

pub async fn single(bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
    let scenario = "publish-single";
    let runs = compare(bench, gateway, scenario, &SINGLE_CALLERS, 1).await?;
    let mut report = Report::new(
        scenario,
        "Publish with one event per call vs single-row INSERT commits",
    );
    report.tables.push(throughput_table(&runs));
    let mut headers = vec!["run"];
    headers.extend(LATENCY_HEADERS);
    let mut latency = Table::new("latency of one call (closed loop)", &headers);
    for run in &runs {
        for (writer, throughput) in [("gateway", &run.gateway), ("sql", &run.sql)] {
            let mut cells = vec![format!("{writer}, {}", callers_label(run.callers))];
            cells.extend(latency_cells(&LatencySummary::of(&throughput.latency)));
            latency.row(cells);
        }
    }
    report.tables.push(latency);
    report.figure("batch_size", 1);
    report.figure(
        "runs",
        runs.iter().map(Comparison::to_json).collect::<Vec<_>>(),
    );
    if let Some(run) = runs.iter().find(|run| run.callers == 32) {
        report.targets.push(Target::at_least(
            "gateway / sql at 32 callers",
            run.ratio(),
            1.0,
            "×",
        ));
    }
    charts(bench, &mut report, scenario, &runs)?;
    Ok(report)
}

/// Runs the gateway and then the direct-SQL writer at each concurrency, each from an
/// empty outbox table.
async fn compare(
    bench: &Bench,
    gateway: &Gateway,
    scenario: &str,
    concurrency: &[usize],
    batch: usize,
) -> anyhow::Result<Vec<Comparison>> {
    let timing = bench.settings.timing;
    let mut runs = Vec::new();
    for &callers in concurrency {
        let mut results = Vec::new();
        for writer in [Writer::Gateway, Writer::Sql] {
            bench.database.truncate_events().await?;
            let result =
                publish::run(writer, timing, gateway, &bench.database, callers, batch).await?;
            progress(
                scenario,
                format!(
                    "{}, {}: {} events/s{}",
                    writer.name(),
                    callers_label(callers),
                    format_number(result.per_second()),
                    errors_note(&result)
                ),
            );
            results.push(result);
        }
        let sql = results.pop().expect("two runs");
        let gateway = results.pop().expect("two runs");
        runs.push(Comparison {
            callers,
            gateway,
            sql,
        });
    }
    Ok(runs)
}

fn callers_label(callers: usize) -> String {
    match callers {
        1 => "1 caller".to_owned(),
        n => format!("{n} callers"),
    }
}

fn errors_note(result: &Throughput) -> String {
    match &result.first_error {
        Some(error) => format!(" ({} failed calls, first: {error})", result.errors),
        None => String::new(),
    }
}

fn throughput_table(runs: &[Comparison]) -> Table {
    let mut table = Table::new(
        "throughput (events/s) and gateway cost",
        &[
            "callers",
            "gateway ev/s",
            "sql ev/s",
            "ratio",
            "gateway p50 ms",
            "sql p50 ms",
            "gateway CPU s/M ev",
            "failed calls",
        ],
    );
    for run in runs {
        let gateway_latency = LatencySummary::of(&run.gateway.latency);
        let sql_latency = LatencySummary::of(&run.sql.latency);
        table.row(vec![
            run.callers.to_string(),
            format_number(run.gateway.per_second()),
            format_number(run.sql.per_second()),
            format_ratio(run.ratio()),
            format!("{:.2}", gateway_latency.p50),
            format!("{:.2}", sql_latency.p50),
            format!(
                "{:.1}",
                run.gateway.cpu.gateway_per_million(run.gateway.events)
            ),
            (run.gateway.errors + run.sql.errors).to_string(),
        ]);
    }
    table
}

fn charts(
    bench: &Bench,
    report: &mut Report,
    scenario: &str,
    runs: &[Comparison],
) -> anyhow::Result<()> {
    let mut series = Vec::new();
    let mut curves = Vec::new();
    for run in runs {
        for (writer, throughput) in [("gateway", &run.gateway), ("sql", &run.sql)] {
            let label = format!("{writer}, {}", callers_label(run.callers));
            series.push(throughput.samples.clone().labelled(label.clone()));
            curves.push((label, &throughput.latency));
        }
    }
    bench.time_chart(
        report,
        &format!("{scenario}-throughput.svg"),
        &format!("{scenario}: events/s over the measured window"),
        "events/s",
        &series,
    )?;
    bench.latency_chart(
        report,
        &format!("{scenario}-latency.svg"),
        &format!("{scenario}: latency of one call"),
        &curves,
    )
}
