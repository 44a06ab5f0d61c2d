//! filtered: the deliver backlog read through a subscription whose CEL filter reads every
//! event's payload and selects one event in ten, four streams, against the unfiltered
//! drain of the same backlog in the same run. Passing over an event must cost less than
//! delivering it: events scanned per second ÷ events delivered per second ≥ 1.

use anyhow::Context;
use outbox_client::proto;
use serde_json::json;

use super::{BASELINE_STREAMS, Bench, progress, pull_baseline};
use crate::{
    gateway::Gateway,
    measure::{CpuUse, round},
    report::{Report, Table, Target, format_number},
};

/// Reads the payload of every event; the backlog's aggregate ids (`ord-<n % 1000>`) make
/// it select one event in ten.
const FILTER: &str = r#"payload.currency == "EUR" && aggregate_id.endsWith("0")"#;
const SUBSCRIPTION: &str = "filtered-1";

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
            .context("counting the events the filter selects")?;
    let matching = u64::try_from(matching).unwrap_or_default();

    gateway
        .admin()
        .create_subscription(proto::CreateSubscriptionRequest {
            subscription: Some(proto::Subscription {
                name: SUBSCRIPTION.into(),
                filter: FILTER.into(),
                start: Some(proto::StartPosition {
                    position: Some(proto::start_position::Position::Boundary(
                        proto::Boundary::Earliest as i32,
                    )),
                }),
                ..Default::default()
            }),
            validate_only: false,
        })
        .await
        .context("CreateSubscription with a filter failed")?;
    let before = gateway.cpu_snapshot();
    let filtered = bench
        .consume(
            gateway,
            &[SUBSCRIPTION.to_owned()],
            BASELINE_STREAMS,
            matching,
            bench.settings.deliver_limit,
        )
        .await?;
    let cpu = CpuUse::between(&before, &gateway.cpu_snapshot());
    gateway.delete_subscription(SUBSCRIPTION).await?;

    let scanned_per_second = backlog as f64 / filtered.seconds;
    let ratio = scanned_per_second / pull.per_second();
    progress(
        scenario,
        format!(
            "filtered: {} events scanned/s ({} delivered), unfiltered {} events/s ({ratio:.2}x)",
            format_number(scanned_per_second),
            format_number(filtered.acked() as f64),
            format_number(pull.per_second())
        ),
    );

    let mut report = Report::new(
        scenario,
        format!(
            "reading a backlog of {} events through a payload filter that selects {} of them, \
             {BASELINE_STREAMS} streams, against the unfiltered drain",
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
    table.row(vec![
        format!("filter {FILTER}"),
        format_number(backlog as f64),
        format_number(filtered.acked() as f64),
        format!("{:.2}", filtered.seconds),
        format_number(scanned_per_second),
        format!("{:.1}", cpu.gateway_per_million(backlog)),
    ]);
    report.tables.push(table);
    report.targets.push(Target::at_least(
        "scanned through the filter ÷ delivered unfiltered",
        ratio,
        1.0,
        "x",
    ));
    if !filtered.completed() {
        report
            .notes
            .push("the filtered drain was cut off before it delivered every match".into());
    }
    report.figure("backlog", backlog);
    report.figure("filter", FILTER);
    report.figure(
        "runs",
        json!({
            "unfiltered": {
                "events_per_s": round(pull.per_second(), 1),
                "seconds": round(pull.seconds, 3),
                "gateway_cpu_s_per_million": round(pull_cpu.gateway_per_million(backlog), 2),
            },
            "filtered": {
                "matching": matching,
                "delivered": filtered.acked(),
                "seconds": round(filtered.seconds, 3),
                "scanned_per_s": round(scanned_per_second, 1),
                "gateway_cpu_s_per_million_scanned": round(cpu.gateway_per_million(backlog), 2),
                "drained": filtered.completed(),
            },
            "scanned_to_unfiltered": round(ratio, 3),
        }),
    );
    bench.time_chart(
        &mut report,
        "filtered-throughput.svg",
        "filtered: delivered events/s, unfiltered drain and one-in-ten filter",
        "events/s",
        &[
            pull.total_samples.clone().labelled("unfiltered"),
            filtered
                .total_samples
                .clone()
                .labelled("filtered (deliveries)"),
        ],
    )?;
    Ok(report)
}
