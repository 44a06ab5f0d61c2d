//! held-transaction: delivery while a transaction in another database of the same
//! cluster has written a row and stays open for the whole run — a batch job, or a session
//! left idle in a transaction. The `deliver` drain (one stream) and the 1,000/s latency
//! run are each measured once without and once with it; nothing may slow down, since the
//! relay reads past open transactions.

use serde_json::json;

use super::{Bench, DELIVER_BACKLOG, insert_backlog, latency, progress};
use crate::{
    gateway::Gateway,
    measure::round,
    publish::Writer,
    report::{Report, Table, Target, format_number},
};

const LATENCY_RATE: u64 = 1_000;

pub async fn run(bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
    let scenario = "held-transaction";
    let backlog = bench.settings.events(DELIVER_BACKLOG);
    let mut rates = Vec::new();
    let mut latencies = Vec::new();
    let mut latency_runs = Vec::new();
    for held in [false, true] {
        let label = if held { "held" } else { "free" };
        // The transaction starts before the backlog is written, so every event of the run
        // committed after it began.
        let holder = match held {
            true => Some(bench.database.hold_transaction_elsewhere().await?),
            false => None,
        };
        bench.database.reset().await?;
        insert_backlog(bench, scenario, backlog).await?;
        let outcome = bench
            .deliver(
                gateway,
                &format!("held-{label}"),
                1,
                1,
                backlog,
                bench.settings.deliver_limit,
            )
            .await?;
        let latency = latency::measure_run(bench, gateway, Writer::Gateway, LATENCY_RATE).await?;
        let summary = latency.commit_to_delivery();
        progress(
            scenario,
            format!(
                "{label}: {} events/s; at {LATENCY_RATE}/s p50 {:.2} ms, p99 {:.2} ms",
                format_number(outcome.per_second()),
                summary.p50,
                summary.p99
            ),
        );
        rates.push((outcome.per_second(), outcome.completed()));
        latencies.push(summary);
        latency_runs.push((format!("{label} at {LATENCY_RATE}/s"), latency));
        if let Some(holder) = holder {
            holder.release().await?;
        }
    }

    let mut report = Report::new(
        scenario,
        format!(
            "the deliver drain ({} events, 1 stream) and the {LATENCY_RATE}/s latency run, without and with a \
             transaction held open in another database of the cluster",
            format_number(backlog as f64)
        ),
    );
    let mut table = Table::new(
        "without and with the held transaction",
        &["run", "deliver events/s", "drained", "p50 ms", "p99 ms"],
    );
    for ((label, (rate, drained)), summary) in ["free", "held"].iter().zip(&rates).zip(&latencies) {
        table.row(vec![
            (*label).to_owned(),
            format_number(*rate),
            if *drained { "yes" } else { "no" }.to_owned(),
            format!("{:.2}", summary.p50),
            format!("{:.2}", summary.p99),
        ]);
    }
    report.tables.push(table);
    let ratio = rates[1].0 / rates[0].0;
    let p50_difference = latencies[1].p50 - latencies[0].p50;
    let p99_difference = latencies[1].p99 - latencies[0].p99;
    report.figure(
        "runs",
        ["free", "held"]
            .iter()
            .zip(&rates)
            .zip(&latencies)
            .map(|((label, (rate, drained)), summary)| {
                json!({
                    "run": label,
                    "deliver_events_per_s": round(*rate, 1),
                    "drained": drained,
                    "latency": summary.to_json(),
                })
            })
            .collect::<Vec<_>>(),
    );
    report.figure("throughput_held_to_free", round(ratio, 3));
    report.figure("p50_difference_ms", round(p50_difference, 2));
    report.figure("p99_difference_ms", round(p99_difference, 2));
    report.targets.push(Target::at_least(
        "deliver throughput, held ÷ free",
        ratio,
        0.9,
        "x",
    ));
    report.targets.push(Target::at_most(
        "p99 at 1,000/s, held − free",
        p99_difference,
        2.0,
        " ms",
    ));
    let curves: Vec<_> = latency_runs
        .iter()
        .map(|(label, run)| (label.clone(), run.commit_to_delivery_histogram()))
        .collect();
    bench.latency_chart(
        &mut report,
        "held-transaction-latency.svg",
        "held-transaction: commit-to-delivery without and with the held transaction",
        &curves,
    )?;
    Ok(report)
}
