//! deliver-scheduled: does a table full of events scheduled for later slow down the
//! delivery of everything else? A plain run drains the deliver backlog through one
//! stream; then, on the same gateway and an emptied table, a subscription reads past
//! 100,000 events scheduled an hour ahead (each becomes a record due in an hour — the
//! one-time cost of scheduling, timed apart) and drains the same backlog with them in
//! the table. The report gives the scheduled run's rate ÷ the plain run's.

use std::time::{Duration, Instant};

use outbox_client::proto;

use super::{Bench, DELIVER_BACKLOG, insert_backlog, progress};
use crate::{
    gateway::Gateway,
    measure::round,
    report::{Report, Table, Target, format_number},
};

/// Events scheduled ahead (scaled by `--scale`).
const SCHEDULED: u64 = 100_000;
/// How far ahead they are due: well after the run ends.
const AHEAD: Duration = Duration::from_secs(60 * 60);
/// How often recording progress is looked at.
const POLL: Duration = Duration::from_millis(100);

pub async fn run(bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
    let scenario = "deliver-scheduled";
    let backlog = bench.settings.events(DELIVER_BACKLOG);
    let scheduled = bench.settings.events(SCHEDULED);
    let limit = bench.settings.deliver_limit;

    insert_backlog(bench, scenario, backlog).await?;
    let plain = bench
        .deliver(gateway, "plain", 1, 1, backlog, limit)
        .await?;
    progress(
        scenario,
        format!("plain: {} events/s", format_number(plain.per_second())),
    );
    bench.database.truncate_events().await?;

    let name = "scheduled-1".to_owned();
    gateway.create_subscription(&name, false).await?;
    progress(
        scenario,
        format!(
            "scheduling {} events an hour ahead",
            format_number(scheduled as f64)
        ),
    );
    bench.database.fill_scheduled(scheduled, AHEAD).await?;
    let recording = record_scheduled(bench, gateway, &name, scheduled, limit).await?;
    progress(
        scenario,
        format!(
            "the subscription recorded them in {:.2} s",
            recording.as_secs_f64()
        ),
    );
    insert_backlog(bench, scenario, backlog).await?;
    let with_scheduled = bench
        .consume(gateway, std::slice::from_ref(&name), 1, backlog, limit)
        .await?;
    let still_scheduled = scheduled_count(gateway, &name).await?;
    gateway.delete_subscription(&name).await?;
    let ratio = with_scheduled.per_second() / plain.per_second();
    progress(
        scenario,
        format!(
            "with them in the table: {} events/s ({ratio:.2} of plain)",
            format_number(with_scheduled.per_second())
        ),
    );

    let mut report = Report::new(
        scenario,
        format!(
            "draining {} events through one stream, plain and with {} events scheduled an hour ahead in the table",
            format_number(backlog as f64),
            format_number(scheduled as f64)
        ),
    );
    let mut table = Table::new(
        "delivered and acked",
        &["run", "events", "seconds", "events/s", "drained"],
    );
    for (label, outcome) in [("plain", &plain), ("with scheduled", &with_scheduled)] {
        table.row(vec![
            label.into(),
            format_number(outcome.acked() as f64),
            format!("{:.2}", outcome.seconds),
            format_number(outcome.per_second()),
            if outcome.completed() { "yes" } else { "no" }.into(),
        ]);
    }
    report.tables.push(table);
    report.figure("backlog", backlog);
    report.figure("scheduled", scheduled);
    report.figure("recording_seconds", round(recording.as_secs_f64(), 3));
    report.figure("plain_events_per_s", round(plain.per_second(), 1));
    report.figure(
        "scheduled_events_per_s",
        round(with_scheduled.per_second(), 1),
    );
    report.figure("scheduled_to_plain", round(ratio, 3));
    report.figure("still_scheduled_after", still_scheduled);
    report.notes.push(format!(
        "reading past the scheduled events once (one record each, due in an hour) took {:.2} s \
         before the measured run; {} were still scheduled after it",
        recording.as_secs_f64(),
        format_number(still_scheduled as f64)
    ));
    report
        .targets
        .push(Target::at_least("with scheduled ÷ plain", ratio, 0.9, "x"));
    let series = [
        plain.total_samples.clone().labelled("plain"),
        with_scheduled.total_samples.clone().labelled(format!(
            "with {} scheduled",
            format_number(scheduled as f64)
        )),
    ];
    bench.time_chart(
        &mut report,
        "deliver-scheduled-throughput.svg",
        "deliver-scheduled: acked events/s without and with events scheduled ahead",
        "events/s",
        &series,
    )?;
    Ok(report)
}

/// Opens a stream on the subscription until it has read past the scheduled events
/// (each has its record); how long that took.
async fn record_scheduled(
    bench: &Bench,
    gateway: &Gateway,
    name: &str,
    count: u64,
    limit: Duration,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let stream = gateway
        .subscriber()
        .subscribe(proto::SubscribeRequest {
            subscription: name.into(),
            max_in_flight: 1000,
            ..Default::default()
        })
        .await?
        .into_inner();
    while bench.database.delivery_records().await? < count {
        anyhow::ensure!(
            started.elapsed() < limit,
            "the subscription did not read past {count} scheduled events within {limit:?}"
        );
        tokio::time::sleep(POLL).await;
    }
    drop(stream);
    Ok(started.elapsed())
}

/// Events the subscription holds as scheduled (due later).
async fn scheduled_count(gateway: &Gateway, name: &str) -> anyhow::Result<u64> {
    let stats = gateway
        .admin()
        .get_stats(proto::GetStatsRequest {
            subscription: name.into(),
        })
        .await?
        .into_inner();
    Ok(stats
        .subscriptions
        .first()
        .map_or(0, |subscription| subscription.scheduled))
}
