//! sink: a backlog inserted straight into the outbox table, drained first by pull (one
//! subscription, four Subscribe streams acking in batches, as in `deliver`) and then by a
//! sink subscription publishing every event into a JetStream stream (file storage, one
//! replica) of the NATS server at 127.0.0.1:4222. An event counts once the stream holds
//! it. The report gives sink ÷ pull of the same run and the CPU seconds per million
//! events of the gateway and of the broker (it runs on the same cores). Then events are
//! published one per call at 1,000/s into a second sink subscription, and the latency
//! from each call's return to the message's arrival at the broker (a plain subscriber
//! on the stream's subjects sees it as the server routes it) is measured.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context;
use async_nats::jetstream::{self, stream};
use outbox_client::proto;

use super::{BASELINE_STREAMS, Bench, latency, progress, pull_baseline, yes_no};
use crate::{
    gateway::{Gateway, processes_cpu_seconds},
    measure::{CpuUse, Sampler, round},
    report::{LATENCY_HEADERS, Report, Table, Target, format_number, latency_cells},
};

const NATS_URL: &str = "nats://127.0.0.1:4222";
/// The gateway settings the scenario needs: a sink on the local NATS server.
pub const GATEWAY_CONFIG: &str =
    "[[sinks]]\nname = \"bench-js\"\nkind = \"nats\"\nservers = [\"nats://127.0.0.1:4222\"]\n";
const STREAM: &str = "OUTBOX_BENCH_SINK";
/// Publish calls per second of the latency run.
const LATENCY_RATE: u64 = 1_000;
/// How often the stream's count is checked for completion.
const CHECK_INTERVAL: Duration = Duration::from_millis(50);

pub async fn run(bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
    let scenario = "sink";
    let (backlog, pull, pull_cpu) = pull_baseline(bench, gateway, scenario).await?;

    let client = async_nats::connect(NATS_URL)
        .await
        .with_context(|| format!("the sink scenario needs NATS with JetStream at {NATS_URL}"))?;
    let context = jetstream::new(client);
    let _ = context.delete_stream(STREAM).await;
    context
        .create_stream(stream::Config {
            name: STREAM.into(),
            subjects: vec!["outbox-bench.>".into()],
            storage: stream::StorageType::File,
            num_replicas: 1,
            ..Default::default()
        })
        .await
        .context("cannot create the benchmark's JetStream stream")?;

    let before = gateway.cpu_snapshot();
    let broker_before = processes_cpu_seconds("nats-server");
    let stored_counter = Arc::new(AtomicU64::new(0));
    let sampler = Sampler::start(
        vec![stored_counter.clone()],
        bench.settings.timing.sample_interval,
    );
    let started = Instant::now();
    create_sink_subscription(
        gateway,
        "sink",
        "outbox-bench.backlog.{aggregate_type}",
        true,
    )
    .await?;
    let limit = started + bench.settings.deliver_limit;
    let mut stored = 0;
    while stored < backlog && Instant::now() < limit {
        tokio::time::sleep(CHECK_INTERVAL).await;
        stored = context
            .get_stream(STREAM)
            .await
            .context("cannot read the stream's state")?
            .cached_info()
            .state
            .messages;
        stored_counter.store(stored, Ordering::Relaxed);
    }
    let seconds = started.elapsed().as_secs_f64();
    let sink_cpu = CpuUse::between(&before, &gateway.cpu_snapshot());
    let broker_cpu = processes_cpu_seconds("nats-server") - broker_before;
    let series = sampler.finish().await;
    let sent = stored.min(backlog);
    let drained = sent >= backlog;
    let sink_rate = sent as f64 / seconds;
    let ratio = sink_rate / pull.per_second();
    progress(
        scenario,
        format!(
            "sink into JetStream: {} events/s ({ratio:.2}x pull)",
            format_number(sink_rate)
        ),
    );
    gateway.delete_subscription("sink").await?;

    let latency = latency::measure_sink_run(bench, gateway, LATENCY_RATE, context.client()).await?;
    let commit_to_broker = latency.commit_to_delivery();
    progress(
        scenario,
        format!(
            "at {LATENCY_RATE}/s: commit-to-broker p50 {:.2} ms, p99 {:.2} ms",
            commit_to_broker.p50, commit_to_broker.p99
        ),
    );
    let _ = context.delete_stream(STREAM).await;

    let mut report = Report::new(
        scenario,
        format!(
            "a backlog of {} events pulled (4 streams) and published into a JetStream stream (file storage, one replica) on this machine",
            format_number(backlog as f64)
        ),
    );
    let mut table = Table::new(
        "delivered and acked (pull), stored in the stream (sink)",
        &[
            "delivery",
            "events",
            "seconds",
            "events/s",
            "drained",
            "gateway CPU s/M ev",
            "PostgreSQL CPU s/M ev",
            "broker CPU s/M ev",
        ],
    );
    let per_million = |seconds: f64, events: u64| seconds / events.max(1) as f64 * 1e6;
    table.row(vec![
        format!("pull, {BASELINE_STREAMS} streams"),
        format_number(pull.acked() as f64),
        format!("{:.2}", pull.seconds),
        format_number(pull.per_second()),
        yes_no(pull.completed()),
        format!("{:.1}", pull_cpu.gateway_per_million(pull.acked())),
        format!("{:.1}", per_million(pull_cpu.postgres, pull.acked())),
        "-".into(),
    ]);
    table.row(vec![
        "sink into JetStream".into(),
        format_number(sent as f64),
        format!("{seconds:.2}"),
        format_number(sink_rate),
        yes_no(drained),
        format!("{:.1}", sink_cpu.gateway_per_million(sent)),
        format!("{:.1}", per_million(sink_cpu.postgres, sent)),
        format!("{:.1}", per_million(broker_cpu, sent)),
    ]);
    report.tables.push(table);
    let mut headers = vec!["run", "events", "lost"];
    headers.extend(LATENCY_HEADERS);
    let mut latency_table = Table::new(
        "commit-to-broker (from the Publish call's return to the message's arrival at the broker)",
        &headers,
    );
    let mut cells = vec![
        latency.label(),
        format_number(latency.measured as f64),
        latency.lost.to_string(),
    ];
    cells.extend(latency_cells(&commit_to_broker));
    latency_table.row(cells);
    report.tables.push(latency_table);
    report.figure("latency", latency.to_json());
    if !drained {
        report.notes.push(format!(
            "the sink run was cut off after {seconds:.0} s with {} events stored; the rate covers that time",
            format_number(sent as f64)
        ));
    }
    report.figure("backlog", backlog);
    report.figure("sink_events", sent);
    report.figure("sink_seconds", round(seconds, 3));
    report.figure("sink_events_per_s", round(sink_rate, 1));
    report.figure("sink_drained", drained);
    report.figure("sink_cpu_s", sink_cpu.to_json());
    report.figure("broker_cpu_s", round(broker_cpu, 3));
    report.figure(
        "sink_gateway_cpu_s_per_million",
        round(sink_cpu.gateway_per_million(sent), 2),
    );
    report.figure(
        "broker_cpu_s_per_million",
        round(per_million(broker_cpu, sent), 2),
    );
    report.figure("pull_events_per_s", round(pull.per_second(), 1));
    report.figure("pull_cpu_s", pull_cpu.to_json());
    report.figure("sink_to_pull", round(ratio, 3));
    report.targets.push(Target::at_least(
        "sink ÷ pull deliver rate",
        ratio,
        0.8,
        "x",
    ));
    let series: Vec<_> = series
        .into_iter()
        .map(|line| line.labelled("sink into JetStream"))
        .chain(std::iter::once(
            pull.total_samples
                .clone()
                .labelled(format!("pull, {BASELINE_STREAMS} streams")),
        ))
        .collect();
    bench.time_chart(
        &mut report,
        "sink-throughput.svg",
        "sink: events/s stored in the JetStream stream, beside pull",
        "events/s",
        &series,
    )?;
    bench.latency_chart(
        &mut report,
        "sink-latency.svg",
        "sink: commit-to-broker at 1,000/s",
        &[(latency.label(), latency.commit_to_delivery_histogram())],
    )?;
    Ok(report)
}

/// A sink subscription into the scenario's sink, from the earliest event or the latest.
pub(super) async fn create_sink_subscription(
    gateway: &Gateway,
    name: &str,
    subject: &str,
    earliest: bool,
) -> anyhow::Result<()> {
    let boundary = if earliest {
        proto::Boundary::Earliest
    } else {
        proto::Boundary::Latest
    };
    gateway
        .admin()
        .create_subscription(proto::CreateSubscriptionRequest {
            subscription: Some(proto::Subscription {
                name: name.into(),
                start: Some(proto::StartPosition {
                    position: Some(proto::start_position::Position::Boundary(boundary as i32)),
                }),
                sink: Some(proto::SinkConfig {
                    name: "bench-js".into(),
                    subject: subject.into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
        })
        .await
        .with_context(|| format!("CreateSubscription {name:?} (sink) failed"))?;
    Ok(())
}
