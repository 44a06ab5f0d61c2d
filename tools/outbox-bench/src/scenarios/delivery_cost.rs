//! delivery-cost: what delivering costs the service's database per event, beside the
//! events themselves — rows the gateway writes in its own tables (inserts, updates and
//! deletes counted by `pg_stat_user_tables`, `outbox_events` left out), WAL bytes, and the
//! CPU of PostgreSQL and of the gateway — for the deliver drain with 1 and 4 streams
//! acking in batches of 100, the same with one ack per call, and the fan-out to four
//! subscriptions. A subscription that costs the database more than its events did is the
//! first limit a growing user meets, in the database their business needs.

use std::time::Duration;

use serde_json::json;

use super::{Bench, DELIVER_BACKLOG, insert_backlog, progress};
use crate::{
    consume::ConsumerConfig,
    gateway::Gateway,
    measure::{CpuUse, round},
    report::{Report, Table, Target, format_number},
};

/// The backlog of the run that acks one event per call, a quarter of the others: it is
/// several times slower.
const SINGLE_ACK_BACKLOG: u64 = DELIVER_BACKLOG / 4;
/// Bounds on the row writes per delivered event: bookkeeping per batch, not per event.
const BATCHED_ACKS_ROW_WRITES: f64 = 0.1;
const SINGLE_ACKS_ROW_WRITES: f64 = 1.2;
/// What each stream holds in the run with deep streams, three times the default.
const DEEP_MAX_IN_FLIGHT: u32 = 3000;
/// Bound on what an event costs PostgreSQL with deep streams, against the default: an
/// ack must cost no more the more deliveries are in flight.
const DEEP_POSTGRES_CPU_RATIO: f64 = 1.5;

struct Workload {
    label: &'static str,
    subscriptions: usize,
    streams: usize,
    /// Events each subscription consumes.
    events: u64,
    consumer: ConsumerConfig,
    row_writes_bound: f64,
}

struct Cost {
    workload: Workload,
    delivered: u64,
    seconds: f64,
    row_writes: u64,
    wal_bytes: u64,
    cpu: CpuUse,
}

impl Cost {
    fn per_event(&self, total: f64) -> f64 {
        match self.delivered {
            0 => f64::NAN,
            delivered => total / delivered as f64,
        }
    }
}

pub async fn run(bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
    let scenario = "delivery-cost";
    let settings = &bench.settings;
    let backlog = settings.events(DELIVER_BACKLOG);
    insert_backlog(bench, scenario, backlog).await?;
    // Statistics reach `pg_stat_user_tables` when a session flushes them: at most ten
    // seconds after the gateway's connections went idle. A quick run does not wait that
    // long, so its row counts can land in the wrong run.
    let quiet = match settings.quick {
        true => Duration::from_millis(500),
        false => Duration::from_secs(11),
    };
    let batched = ConsumerConfig::default();
    let workloads = [
        Workload {
            label: "deliver, 1 stream, acks of 100",
            subscriptions: 1,
            streams: 1,
            events: backlog,
            consumer: batched,
            row_writes_bound: BATCHED_ACKS_ROW_WRITES,
        },
        Workload {
            label: "deliver, 4 streams, acks of 100",
            subscriptions: 1,
            streams: 4,
            events: backlog,
            consumer: batched,
            row_writes_bound: BATCHED_ACKS_ROW_WRITES,
        },
        Workload {
            label: "deliver, 4 streams holding 3,000 each, acks of 100",
            subscriptions: 1,
            streams: 4,
            events: backlog,
            consumer: ConsumerConfig {
                max_in_flight: DEEP_MAX_IN_FLIGHT,
                ..batched
            },
            row_writes_bound: BATCHED_ACKS_ROW_WRITES,
        },
        Workload {
            label: "deliver, 1 stream, one ack per call",
            subscriptions: 1,
            streams: 1,
            events: settings.events(SINGLE_ACK_BACKLOG),
            consumer: ConsumerConfig {
                ack_batch: 1,
                acks_in_flight: 64,
                ..batched
            },
            row_writes_bound: SINGLE_ACKS_ROW_WRITES,
        },
        Workload {
            label: "fan-out, 4 subscriptions × 1 stream, acks of 100",
            subscriptions: 4,
            streams: 1,
            events: backlog,
            consumer: batched,
            row_writes_bound: BATCHED_ACKS_ROW_WRITES,
        },
    ];

    let mut costs = Vec::new();
    let mut series = Vec::new();
    for (index, workload) in workloads.into_iter().enumerate() {
        let before = bench.database.settled_bookkeeping(quiet).await?;
        let cpu_before = gateway.cpu_snapshot();
        let outcome = bench
            .deliver_with(
                gateway,
                &format!("delivery-cost-{index}"),
                workload.subscriptions,
                workload.streams,
                workload.events,
                workload.consumer,
            )
            .await?;
        let cpu = CpuUse::between(&cpu_before, &gateway.cpu_snapshot());
        let after = bench.database.settled_bookkeeping(quiet).await?;
        let cost = Cost {
            delivered: outcome.acked(),
            seconds: outcome.seconds,
            row_writes: after.row_writes.saturating_sub(before.row_writes),
            wal_bytes: after.wal_bytes.saturating_sub(before.wal_bytes),
            cpu,
            workload,
        };
        progress(
            scenario,
            format!(
                "{}: {} events/s, {:.2} row writes and {:.0} WAL bytes per event",
                cost.workload.label,
                format_number(outcome.per_second()),
                cost.per_event(cost.row_writes as f64),
                cost.per_event(cost.wal_bytes as f64),
            ),
        );
        series.push(outcome.total_samples.clone().labelled(cost.workload.label));
        costs.push(cost);
    }

    let mut report = Report::new(
        scenario,
        format!(
            "what delivering a backlog of {} events costs the database per event, beside the events",
            format_number(backlog as f64)
        ),
    );
    let mut table = Table::new(
        "per delivered and acked event (CPU: seconds per million events)",
        &[
            "workload",
            "events",
            "events/s",
            "row writes",
            "WAL bytes",
            "postgres CPU",
            "gateway CPU",
        ],
    );
    let mut runs = Vec::new();
    for cost in &costs {
        let per_second = match cost.seconds {
            seconds if seconds > 0.0 => cost.delivered as f64 / seconds,
            _ => f64::NAN,
        };
        let row_writes = cost.per_event(cost.row_writes as f64);
        let wal_bytes = cost.per_event(cost.wal_bytes as f64);
        let postgres = cost.per_event(cost.cpu.postgres) * 1e6;
        let gateway_cpu = cost.per_event(cost.cpu.gateway) * 1e6;
        table.row(vec![
            cost.workload.label.to_owned(),
            format_number(cost.delivered as f64),
            format_number(per_second),
            format!("{row_writes:.2}"),
            format!("{wal_bytes:.0}"),
            format!("{postgres:.1}"),
            format!("{gateway_cpu:.1}"),
        ]);
        report.targets.push(Target::at_most(
            format!("{}: row writes per event", cost.workload.label),
            row_writes,
            cost.workload.row_writes_bound,
            "",
        ));
        runs.push(json!({
            "workload": cost.workload.label,
            "subscriptions": cost.workload.subscriptions,
            "streams": cost.workload.streams,
            "ack_batch": cost.workload.consumer.ack_batch,
            "max_in_flight": cost.workload.consumer.max_in_flight,
            "events": cost.delivered,
            "seconds": round(cost.seconds, 3),
            "events_per_s": round(per_second, 1),
            "row_writes_per_event": round(row_writes, 3),
            "wal_bytes_per_event": round(wal_bytes, 1),
            "postgres_cpu_s_per_million": round(postgres, 2),
            "gateway_cpu_s_per_million": round(gateway_cpu, 2),
            "cpu_s": cost.cpu.to_json(),
        }));
    }
    // The deep streams' run against the default's (the second and third runs).
    let postgres_per_event = |cost: &Cost| cost.per_event(cost.cpu.postgres);
    report.targets.push(Target::at_most(
        "4 streams holding 3,000 each: PostgreSQL CPU per event ÷ holding 1,000".to_owned(),
        postgres_per_event(&costs[2]) / postgres_per_event(&costs[1]),
        DEEP_POSTGRES_CPU_RATIO,
        "×",
    ));
    report.tables.push(table);
    report.figure("runs", runs);
    bench.time_chart(
        &mut report,
        "delivery-cost-throughput.svg",
        "delivery-cost: acked events/s of the measured runs",
        "events/s",
        &series,
    )?;
    report.notes.push(
        "row writes: inserts, updates and deletes in the gateway's tables other than \
         outbox_events (pg_stat_user_tables); WAL bytes: the whole server's, over the run; \
         postgres CPU: every process named postgres on this machine"
            .to_owned(),
    );
    Ok(report)
}
