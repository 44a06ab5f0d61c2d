//! held-horizon: 800 events/s published and consumed for 30 minutes while a transaction
//! of the same database has written a row and stays open throughout — a batch job, or a
//! session left idle in a transaction. It holds the database's xmin horizon: no row
//! version the relay makes meanwhile (a moved read position, a settled lease) can be
//! vacuumed away. Whatever the relay reads past such versions gets slower the longer the
//! transaction stays; the latency of the last minute, beside the first, shows whether it
//! does.

use std::time::Duration;

use serde_json::json;

use super::{Bench, latency, progress};
use crate::{
    gateway::Gateway,
    measure::{LatencySummary, Series},
    report::{LATENCY_HEADERS, Report, Table, Target, latency_cells},
};

const RATE: u64 = 800;

pub async fn run(bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
    let scenario = "held-horizon";
    // --quick: three windows of a second, to show the scenario works.
    let (length, window) = if bench.settings.quick {
        (Duration::from_secs(3), Duration::from_secs(1))
    } else {
        (Duration::from_secs(30 * 60), Duration::from_secs(60))
    };
    let held = bench.database.hold_transaction_here().await?;
    progress(
        scenario,
        format!(
            "{RATE}/s for {} with a transaction held open",
            humantime::format_duration(length)
        ),
    );
    let run = latency::measure_windows(bench, gateway, RATE, length, window).await;
    let versions = bench.database.row_versions().await;
    held.release().await?;
    let run = run?;
    let versions = versions?;
    let windows: Vec<LatencySummary> = run.by_window.iter().map(LatencySummary::of).collect();
    let (Some(first), Some(last)) = (windows.first(), windows.last()) else {
        anyhow::bail!("no event of the run was delivered");
    };
    let ratio = last.p99 / first.p99.max(f64::EPSILON);
    progress(
        scenario,
        format!(
            "p99 first window {:.2} ms, last {:.2} ms ({ratio:.2} x)",
            first.p99, last.p99
        ),
    );

    let mut report = Report::new(
        scenario,
        format!(
            "{RATE} events/s through Publish to one stream for {}, a transaction of the same database held open throughout: commit-to-delivery latency per {}",
            humantime::format_duration(length),
            humantime::format_duration(window)
        ),
    );
    let mut headers = vec!["window"];
    headers.extend(LATENCY_HEADERS);
    let mut table = Table::new("commit-to-delivery, window by window", &headers);
    for (index, summary) in windows.iter().enumerate() {
        let mut cells = vec![(index + 1).to_string()];
        cells.extend(latency_cells(summary));
        table.row(cells);
    }
    report.tables.push(table);
    let mut dead = Table::new(
        "row versions of the outbox tables at the end (pg_stat_user_tables)",
        &["table", "dead", "live"],
    );
    for (table, dead_rows, live_rows) in &versions {
        dead.row(vec![
            table.clone(),
            dead_rows.to_string(),
            live_rows.to_string(),
        ]);
    }
    report.tables.push(dead);
    report.figure("run", run.to_json());
    report.figure(
        "windows",
        windows
            .iter()
            .map(|summary| summary.to_json())
            .collect::<Vec<_>>(),
    );
    report.figure("p99_last_to_first", (ratio * 1000.0).round() / 1000.0);
    report.figure(
        "row_versions",
        versions
            .iter()
            .map(|(table, dead, live)| json!({"table": table, "dead": dead, "live": live}))
            .collect::<Vec<_>>(),
    );
    report.targets.push(Target::at_most(
        "p99 of the last window ÷ the first",
        ratio,
        1.5,
        "x",
    ));
    let by_window = |label: &str, figure: fn(&LatencySummary) -> f64| Series {
        label: label.into(),
        points: windows
            .iter()
            .enumerate()
            .map(|(index, summary)| ((index + 1) as f64 * window.as_secs_f64(), figure(summary)))
            .collect(),
    };
    let (p50, p99) = (
        by_window("p50", |summary| summary.p50),
        by_window("p99", |summary| summary.p99),
    );
    bench.time_chart(
        &mut report,
        "held-horizon.svg",
        "held-horizon: commit-to-delivery by window, a transaction held open",
        "ms",
        &[p50, p99],
    )?;
    Ok(report)
}
