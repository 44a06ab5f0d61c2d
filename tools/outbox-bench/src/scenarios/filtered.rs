//! filtered: the deliver backlog read through subscriptions whose CEL filters select one
//! event in ten, four streams, against the unfiltered drain of the same backlog in the
//! same run: one filter reads every event's payload, one matches a regular expression
//! on every event. Passing over an event must cost less than delivering it: events
//! scanned per second ÷ events delivered per second ≥ 1, for each filter.

use anyhow::Context;
use outbox_client::proto;
use serde_json::json;

use super::{BASELINE_STREAMS, Bench, progress, pull_baseline};
use crate::{
    consume::GroupOutcome,
    gateway::Gateway,
    measure::{CpuUse, round},
    report::{Report, Table, Target, format_number},
};

/// The filters, each with a name for the report. The backlog's aggregate ids
/// (`ord-<n % 1000>`) make each select one event in ten.
const FILTERS: [(&str, &str); 2] = [
    (
        "payload",
        r#"payload.currency == "EUR" && aggregate_id.endsWith("0")"#,
    ),
    ("matches", r#"aggregate_id.matches("^ord-[0-9]*0$")"#),
];

/// One filter's drain of the backlog.
struct FilteredRun {
    name: &'static str,
    filter: &'static str,
    drain: GroupOutcome,
    cpu: CpuUse,
}

pub async fn run(bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
    let scenario = "filtered";
    let (backlog, pull, pull_cpu) = pull_baseline(bench, gateway, scenario).await?;
    let matching: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_events WHERE aggregate_id LIKE '%0'")
            .fetch_one(
                &bench
                    .database
                    .pool(1, crate::database::Notify::Suppress)
                    .await?,
            )
            .await
            .context("counting the events the filters select")?;
    let matching = u64::try_from(matching).unwrap_or_default();

    let mut runs = Vec::with_capacity(FILTERS.len());
    for (name, filter) in FILTERS {
        let subscription = format!("filtered-{name}");
        gateway
            .create(proto::Subscription {
                filter: filter.into(),
                ..Gateway::from_earliest(&subscription)
            })
            .await?;
        let before = gateway.cpu_snapshot();
        let drain = bench
            .consume(
                gateway,
                std::slice::from_ref(&subscription),
                BASELINE_STREAMS,
                matching,
                bench.settings.deliver_limit,
            )
            .await?;
        let cpu = CpuUse::between(&before, &gateway.cpu_snapshot());
        gateway.delete_subscription(&subscription).await?;
        progress(
            scenario,
            format!(
                "{name} filter: {} events scanned/s ({} delivered), unfiltered {} events/s",
                format_number(backlog as f64 / drain.seconds),
                format_number(drain.acked() as f64),
                format_number(pull.per_second())
            ),
        );
        runs.push(FilteredRun {
            name,
            filter,
            drain,
            cpu,
        });
    }

    let mut report = Report::new(
        scenario,
        format!(
            "reading a backlog of {} events through filters that select {} of them (one \
             reading payloads, one matching a regular expression), {BASELINE_STREAMS} \
             streams, against the unfiltered drain",
            format_number(backlog as f64),
            format_number(matching as f64)
        ),
    );
    let mut table = Table::new(
        "scanned and delivered",
        &[
            "run",
            "events scanned",
            "delivered",
            "seconds",
            "scanned/s",
            "gateway CPU s/M scanned",
        ],
    );
    table.row(vec![
        "unfiltered".into(),
        format_number(backlog as f64),
        format_number(pull.acked() as f64),
        format!("{:.2}", pull.seconds),
        format_number(pull.per_second()),
        format!("{:.1}", pull_cpu.gateway_per_million(backlog)),
    ]);
    let mut figures = serde_json::Map::new();
    figures.insert(
        "unfiltered".into(),
        json!({
            "events_per_s": round(pull.per_second(), 1),
            "seconds": round(pull.seconds, 3),
            "gateway_cpu_s_per_million": round(pull_cpu.gateway_per_million(backlog), 2),
        }),
    );
    for run in &runs {
        let scanned_per_second = backlog as f64 / run.drain.seconds;
        let ratio = scanned_per_second / pull.per_second();
        table.row(vec![
            format!("filter {}", run.filter),
            format_number(backlog as f64),
            format_number(run.drain.acked() as f64),
            format!("{:.2}", run.drain.seconds),
            format_number(scanned_per_second),
            format!("{:.1}", run.cpu.gateway_per_million(backlog)),
        ]);
        report.targets.push(Target::at_least(
            format!(
                "scanned through the {} filter ÷ delivered unfiltered",
                run.name
            ),
            ratio,
            1.0,
            "x",
        ));
        if !run.drain.completed() {
            report.notes.push(format!(
                "the {} filter's drain was cut off before it delivered every match",
                run.name
            ));
        }
        figures.insert(
            run.name.into(),
            json!({
                "filter": run.filter,
                "matching": matching,
                "delivered": run.drain.acked(),
                "seconds": round(run.drain.seconds, 3),
                "scanned_per_s": round(scanned_per_second, 1),
                "gateway_cpu_s_per_million_scanned": round(run.cpu.gateway_per_million(backlog), 2),
                "drained": run.drain.completed(),
                "scanned_to_unfiltered": round(ratio, 3),
            }),
        );
    }
    report.tables.push(table);
    report.figure("backlog", backlog);
    report.figure("runs", figures);
    let mut series = vec![pull.total_samples.clone().labelled("unfiltered")];
    series.extend(runs.iter().map(|run| {
        run.drain
            .total_samples
            .clone()
            .labelled(format!("{} filter (deliveries)", run.name))
    }));
    bench.time_chart(
        &mut report,
        "filtered-throughput.svg",
        "filtered: delivered events/s, unfiltered drain and one-in-ten filters",
        "events/s",
        &series,
    )?;
    Ok(report)
}
