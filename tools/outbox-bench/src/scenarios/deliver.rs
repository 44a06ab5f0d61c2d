//! deliver and fanout: a backlog inserted straight into the outbox table, then consumed
//! through Subscribe streams that ack in batches. deliver drains it through one fresh
//! subscription with 1 and then 4 streams; fanout through four subscriptions at once.
//! Each run is followed by the raw SQL ceiling doing the same work with as many workers
//! ([`crate::raw_delivery`]), and the report gives gateway ÷ raw. The ceiling records
//! leases as the gateway does (a row per claim); the raw loop that records them per
//! event, as the gateway did before claim batches, is reported beside it. deliver then
//! drains part of the backlog again through consumers that spend 100 µs per event, with
//! 1 and 4 streams: there the consumers bound the drain, and four streams should deliver
//! about four times what one does.

use std::time::Duration;

use serde_json::json;

use super::{Bench, DELIVER_BACKLOG, insert_backlog, progress, yes_no};
use crate::{
    consume::{ConsumerConfig, GroupOutcome},
    gateway::Gateway,
    measure::{CpuUse, round},
    raw_delivery::{self, Bookkeeping, RawOutcome},
    report::{Report, Table, Target, format_number},
};

const DELIVER_STREAMS: [usize; 2] = [1, 4];
const FANOUT_SUBSCRIPTIONS: usize = 4;
/// What each working consumer spends per event: one stream of them handles about 10,000
/// events/s, four about 40,000, well within what the gateway delivers.
const WORK_PER_EVENT: Duration = Duration::from_micros(100);
/// Events each run with working consumers acks, of the backlog.
const WORKING_EVENTS: u64 = 50_000;

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
            "cores busy",
        ],
    );
    let mut runs = Vec::new();
    let mut series = Vec::new();
    // Per number of streams: events/s of the gateway and of the raw ceiling, and the
    // gateway run's CPU seconds (all three processes) per event.
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
        let cpu_per_event = cpu.total() / outcome.acked().max(1) as f64;
        rates.push((
            streams,
            outcome.per_second(),
            raw.per_second(),
            cpu_per_event,
        ));
        // The cores the gateway, PostgreSQL and the consumers kept busy together.
        let cores_busy = cpu.total() / outcome.seconds;
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
            format!("{cores_busy:.2}"),
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
            "cores_busy": round(cores_busy, 2),
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
    // One subscription's claims read its events one at a time (a following claim
    // overlaps only the writes of the one before), so more streams add room more than
    // claims; the raw ceiling's workers, claiming one subscription, show what that
    // allows on this machine.
    let rate_with = |count| rates.iter().find(|(streams, ..)| *streams == count);
    if let (Some(&(_, one, raw_one, _)), Some(&(_, four, raw_four, four_cpu))) =
        (rate_with(1), rate_with(4))
    {
        let (gain, raw_gain) = (four / one, raw_four / raw_one);
        // Where one stream already keeps most cores busy, more streams can only add what
        // is left: 1.5 x one stream's rate, at the CPU per event of the run with four,
        // takes this many cores for the three processes together.
        let cores_for_target = 1.5 * one * four_cpu;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        report.notes.push(format!(
            "4 streams ÷ 1 stream: gateway {gain:.2}x, raw SQL ceiling (4 workers ÷ 1) {raw_gain:.2}x; \
             1.5x would keep {cores_for_target:.2} cores busy at the CPU per event of the run \
             with 4 streams, on a machine with {cores}"
        ));
        report.figure(
            "four_streams_over_one",
            json!({
                "gateway": round(gain, 3),
                "raw": round(raw_gain, 3),
                "cores_for_one_and_a_half": round(cores_for_target, 2),
                "cores": cores,
            }),
        );
        report
            .targets
            .push(Target::at_least("4 streams ÷ 1 stream", gain, 1.5, "x"));
    }
    working_consumers(bench, gateway, &mut report).await?;
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

/// Drains part of the backlog again through consumers that spend [`WORK_PER_EVENT`] on
/// each event, with 1 and then 4 streams. The consumers bound these runs, so four streams
/// deliver four times what one does unless the gateway holds a subscription's streams
/// back, one behind another.
async fn working_consumers(
    bench: &Bench,
    gateway: &Gateway,
    report: &mut Report,
) -> anyhow::Result<()> {
    let events = bench.settings.events(WORKING_EVENTS);
    let micros = WORK_PER_EVENT.as_micros();
    let mut table = Table::new(
        format!("consumers spending {micros} µs per event"),
        &["streams", "events", "seconds", "events/s", "drained"],
    );
    let mut rates = Vec::new();
    for streams in DELIVER_STREAMS {
        let outcome = bench
            .deliver_with(
                gateway,
                &format!("deliver-working-{streams}s"),
                1,
                streams,
                events,
                ConsumerConfig {
                    work_per_event: WORK_PER_EVENT,
                    ..ConsumerConfig::default()
                },
            )
            .await?;
        bench.database.settle().await?;
        table.row(vec![
            streams.to_string(),
            format_number(outcome.acked() as f64),
            format!("{:.2}", outcome.seconds),
            format_number(outcome.per_second()),
            yes_no(outcome.completed()),
        ]);
        rates.push(outcome.per_second());
    }
    report.tables.push(table);
    // DELIVER_STREAMS: 1, then 4.
    let gain = rates[1] / rates[0];
    progress(
        report.scenario,
        format!(
            "consumers spending {micros} µs per event: 1 stream {} events/s, 4 streams {} ({gain:.2}x)",
            format_number(rates[0]),
            format_number(rates[1])
        ),
    );
    report.figure(
        "working_consumers",
        json!({
            "work_per_event_us": micros,
            "events_per_s": rates.iter().map(|rate| round(*rate, 1)).collect::<Vec<_>>(),
            "four_streams_over_one": round(gain, 3),
        }),
    );
    report.targets.push(Target::at_least(
        format!("4 streams ÷ 1 stream, consumers spending {micros} µs per event"),
        gain,
        3.5,
        "x",
    ));
    Ok(())
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
