//! deliver and fanout: a backlog inserted straight into the outbox table, then consumed
//! through Subscribe streams that ack in batches. deliver drains it through one fresh
//! subscription with 1 and then 4 streams; fanout through four subscriptions at once.
//! Each run is followed by the raw SQL ceiling doing the same work with as many workers
//! ([`crate::raw_delivery`]), and the report gives gateway ÷ raw. The ceiling records
//! leases as the gateway does (a row per claim); the raw loop that records them per
//! event, as the gateway did before claim batches, is reported beside it.

use serde_json::json;

use super::{Bench, DELIVER_BACKLOG, insert_backlog, progress, yes_no};
use crate::{
    consume::GroupOutcome,
    gateway::Gateway,
    measure::{CpuUse, round},
    raw_delivery::{self, Bookkeeping, RawOutcome},
    report::{Report, Table, Target, format_number},
};

const DELIVER_STREAMS: [usize; 2] = [1, 4];
const FANOUT_SUBSCRIPTIONS: usize = 4;

pub async fn deliver(bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
    let scenario = "deliver";
    let backlog = bench.settings.events(DELIVER_BACKLOG);
    insert_backlog(bench, scenario, backlog).await?;

    let mut report = Report::new(
        scenario,
        format!(
            "draining a backlog of {} events through one subscription, acks in batches of 100",
            format_number(backlog as f64)
        ),
    );
    let mut table = Table::new(
        "delivered and acked",
        &[
            "streams",
            "events",
            "seconds",
            "events/s",
            "raw SQL events/s",
            "gateway ÷ raw",
            "raw per-event SQL events/s",
            "drained",
            "gateway CPU s/M ev",
        ],
    );
    let mut runs = Vec::new();
    let mut series = Vec::new();
    // Events/s of the gateway and of the raw ceiling, per number of streams.
    let mut rates = Vec::new();
    for streams in DELIVER_STREAMS {
        let before = gateway.cpu_snapshot();
        let outcome = bench
            .deliver(
                gateway,
                &format!("deliver-{streams}s"),
                1,
                streams,
                backlog,
                bench.settings.deliver_limit,
            )
            .await?;
        let cpu = CpuUse::between(&before, &gateway.cpu_snapshot());
        bench.database.settle().await?;
        let ceilings = raw_ceilings(bench, gateway, 1, streams, backlog).await?;
        let (raw, per_event) = (ceilings.per_claim, ceilings.per_event);
        let ratio = outcome.per_second() / raw.per_second();
        rates.push((streams, outcome.per_second(), raw.per_second()));
        report
            .notes
            .push(ceilings.cpu_note(&format!("{streams} stream(s)"), cpu, outcome.acked()));
        progress(
            scenario,
            format!(
                "{streams} stream(s): {} events/s, raw SQL {} events/s ({ratio:.2}x)",
                format_number(outcome.per_second()),
                format_number(raw.per_second())
            ),
        );
        table.row(vec![
            streams.to_string(),
            format_number(outcome.acked() as f64),
            format!("{:.2}", outcome.seconds),
            format_number(outcome.per_second()),
            format_number(raw.per_second()),
            format!("{ratio:.2}"),
            format_number(per_event.per_second()),
            yes_no(outcome.completed()),
            format!("{:.1}", cpu.gateway_per_million(outcome.acked())),
        ]);
        if !outcome.completed() {
            report.notes.push(cut_off_note(&outcome, streams));
        }
        series.push(
            outcome
                .total_samples
                .clone()
                .labelled(format!("{streams} stream(s)")),
        );
        runs.push(json!({
            "streams": streams,
            "events": outcome.acked(),
            "seconds": round(outcome.seconds, 3),
            "events_per_s": round(outcome.per_second(), 1),
            "raw_events_per_s": round(raw.per_second(), 1),
            "gateway_to_raw": round(ratio, 3),
            "raw_per_event_events_per_s": round(per_event.per_second(), 1),
            "drained": outcome.completed(),
            "stale_acks": outcome.subscriptions.iter().map(|s| s.stale).sum::<u64>(),
            "cpu_s": cpu.to_json(),
            "gateway_cpu_s_per_million": round(cpu.gateway_per_million(outcome.acked()), 2),
            "raw": ceilings.cpu_json(),
        }));
        if streams == 4 {
            report.targets.push(Target::at_least(
                "4 streams",
                outcome.per_second(),
                25_000.0,
                " events/s",
            ));
        }
        report.targets.push(Target::at_least(
            format!("{streams} stream(s), gateway ÷ raw SQL"),
            ratio,
            0.8,
            "x",
        ));
        // Vacuum the delivery records the acks deleted before the next run.
        bench.database.settle().await?;
    }
    report.tables.push(table);
    // One subscription's claims follow one another, so more streams add room, not
    // claims; the raw ceiling's workers, claiming one subscription, show what that
    // allows on this machine.
    let rate_with = |count| rates.iter().find(|(streams, _, _)| *streams == count);
    if let (Some(&(_, one, raw_one)), Some(&(_, four, raw_four))) = (rate_with(1), rate_with(4)) {
        let (gain, raw_gain) = (four / one, raw_four / raw_one);
        report.notes.push(format!(
            "4 streams ÷ 1 stream: gateway {gain:.2}x, raw SQL ceiling (4 workers ÷ 1) {raw_gain:.2}x"
        ));
        report.figure(
            "four_streams_over_one",
            json!({ "gateway": round(gain, 3), "raw": round(raw_gain, 3) }),
        );
        report
            .targets
            .push(Target::at_least("4 streams ÷ 1 stream", gain, 1.5, "x"));
    }
    report.figure("backlog", backlog);
    report.figure("runs", runs);
    bench.time_chart(
        &mut report,
        "deliver-throughput.svg",
        "deliver: acked events/s while draining the backlog",
        "events/s",
        &series,
    )?;
    Ok(report)
}

pub async fn fanout(bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
    let scenario = "fanout";
    let backlog = bench.settings.events(DELIVER_BACKLOG);
    insert_backlog(bench, scenario, backlog).await?;

    let before = gateway.cpu_snapshot();
    let outcome = bench
        .deliver(
            gateway,
            "fanout",
            FANOUT_SUBSCRIPTIONS,
            1,
            backlog,
            bench.settings.deliver_limit,
        )
        .await?;
    let cpu = CpuUse::between(&before, &gateway.cpu_snapshot());
    bench.database.settle().await?;
    let ceilings = raw_ceilings(bench, gateway, FANOUT_SUBSCRIPTIONS, 1, backlog).await?;
    let (raw, per_event) = (ceilings.per_claim, ceilings.per_event);
    let ratio = outcome.per_second() / raw.per_second();
    progress(
        scenario,
        format!(
            "{} events/s in total, raw SQL {} events/s ({ratio:.2}x)",
            format_number(outcome.per_second()),
            format_number(raw.per_second())
        ),
    );

    let mut report = Report::new(
        scenario,
        format!(
            "{FANOUT_SUBSCRIPTIONS} subscriptions (one stream each) draining the same backlog of {} events at once",
            format_number(backlog as f64)
        ),
    );
    let mut table = Table::new(
        "delivered and acked",
        &["subscription", "events", "seconds", "events/s", "drained"],
    );
    for subscription in &outcome.subscriptions {
        table.row(vec![
            subscription.name.clone(),
            format_number(subscription.acked as f64),
            format!("{:.2}", subscription.seconds),
            format_number(subscription.per_second()),
            yes_no(subscription.completed),
        ]);
    }
    table.row(vec![
        "total".into(),
        format_number(outcome.acked() as f64),
        format!("{:.2}", outcome.seconds),
        format_number(outcome.per_second()),
        yes_no(outcome.completed()),
    ]);
    report.tables.push(table);
    if !outcome.completed() {
        report.notes.push(cut_off_note(&outcome, 1));
    }
    report.figure("backlog", backlog);
    report.figure(
        "subscriptions",
        outcome
            .subscriptions
            .iter()
            .map(|s| {
                json!({
                    "name": s.name,
                    "events": s.acked,
                    "seconds": round(s.seconds, 3),
                    "events_per_s": round(s.per_second(), 1),
                    "drained": s.completed,
                })
            })
            .collect::<Vec<_>>(),
    );
    report.figure("total_events", outcome.acked());
    report.figure("total_seconds", round(outcome.seconds, 3));
    report.figure("total_events_per_s", round(outcome.per_second(), 1));
    report.figure("raw_events_per_s", round(raw.per_second(), 1));
    report.figure("gateway_to_raw", round(ratio, 3));
    report.figure(
        "raw_per_event_events_per_s",
        round(per_event.per_second(), 1),
    );
    report.figure("cpu_s", cpu.to_json());
    report.figure(
        "gateway_cpu_s_per_million",
        round(cpu.gateway_per_million(outcome.acked()), 2),
    );
    report.figure("raw", ceilings.cpu_json());
    report.targets.push(Target::at_least(
        "total over 4 subscriptions",
        outcome.per_second(),
        20_000.0,
        " events/s",
    ));
    report.targets.push(Target::at_least(
        "4 subscriptions, gateway ÷ raw SQL",
        ratio,
        0.8,
        "x",
    ));
    report.notes.push(format!(
        "raw SQL ceiling: {} events/s over {FANOUT_SUBSCRIPTIONS} subscriptions with one worker \
         each (recording leases per event: {} events/s)",
        format_number(raw.per_second()),
        format_number(per_event.per_second())
    ));
    report
        .notes
        .push(ceilings.cpu_note("fan-out", cpu, outcome.acked()));
    let mut series: Vec<_> = outcome
        .subscriptions
        .iter()
        .map(|s| s.samples.clone())
        .collect();
    series.push(outcome.total_samples.clone());
    bench.time_chart(
        &mut report,
        "fanout-throughput.svg",
        "fanout: acked events/s per subscription and in total",
        "events/s",
        &series,
    )?;
    Ok(report)
}

fn cut_off_note(outcome: &GroupOutcome, streams: usize) -> String {
    format!(
        "the run with {streams} stream(s) per subscription was cut off after {:.0} s with {} events acked; \
         the rate covers that time",
        outcome.seconds,
        format_number(outcome.acked() as f64)
    )
}

/// The raw SQL ceilings of a run: leases recorded per claim as the gateway does (per
/// event on a schema from before claim batches), then per event, as the gateway did
/// before.
struct RawCeilings {
    per_claim: RawOutcome,
    per_event: RawOutcome,
    /// What the per-claim loop cost PostgreSQL and this process (the gateway idles).
    per_claim_cpu: CpuUse,
}

impl RawCeilings {
    /// The CPU note of a run: where a ceiling that pays neither gRPC nor consumers
    /// spends its CPU, beside the gateway's run, per million events.
    fn cpu_note(&self, label: &str, gateway_run: CpuUse, acked: u64) -> String {
        let raw = self.per_claim_cpu.per_million(self.per_claim.acked);
        let run = gateway_run.per_million(acked);
        format!(
            "{label}: CPU s per million events — gateway run: postgres {:.1}, gateway {:.1}, \
             consumers {:.1}; raw SQL ceiling: postgres {:.1}, its loop {:.1}",
            run.postgres, run.gateway, run.bench, raw.postgres, raw.bench
        )
    }

    fn cpu_json(&self) -> serde_json::Value {
        let raw = self.per_claim_cpu.per_million(self.per_claim.acked);
        json!({
            "cpu_s": self.per_claim_cpu.to_json(),
            "postgres_cpu_s_per_million": round(raw.postgres, 2),
            "loop_cpu_s_per_million": round(raw.bench, 2),
        })
    }
}

/// Runs the raw SQL ceilings of a run, with the gateway idle beside them.
async fn raw_ceilings(
    bench: &Bench,
    gateway: &Gateway,
    subscriptions: usize,
    workers: usize,
    backlog: u64,
) -> anyhow::Result<RawCeilings> {
    let drain = |bookkeeping| {
        raw_delivery::drain(
            &bench.database,
            bookkeeping,
            subscriptions,
            workers,
            backlog,
            bench.settings.deliver_limit,
        )
    };
    let measured = |bookkeeping| async move {
        let before = gateway.cpu_snapshot();
        let outcome = drain(bookkeeping).await?;
        anyhow::Ok((outcome, CpuUse::between(&before, &gateway.cpu_snapshot())))
    };
    let (per_event, per_event_cpu) = measured(Bookkeeping::PerEvent).await?;
    bench.database.settle().await?;
    let (per_claim, per_claim_cpu) = match Bookkeeping::PerClaim.available(&bench.database).await? {
        true => measured(Bookkeeping::PerClaim).await?,
        false => (per_event, per_event_cpu),
    };
    Ok(RawCeilings {
        per_claim,
        per_event,
        per_claim_cpu,
    })
}
