//! stalled-consumers: a healthy subscription's latency while 1,000 other streams misbehave
//! on 100 other subscriptions — 990 read their deliveries and never ack them (their short
//! leases expire and come back every few seconds, in waves), 10 never read at all. The
//! healthy consumer receives the 1,000/s open-loop latency run; it must not notice.

use std::{collections::HashMap, time::Duration};

use anyhow::Context;
use outbox_client::proto;
use serde_json::json;
use tokio::task::JoinSet;

use super::{Bench, insert_backlog, latency, progress};
use crate::{
    gateway::Gateway,
    measure::round,
    publish::Writer,
    report::{Report, Table, Target, format_number},
    workload,
};

const STALLED_SUBSCRIPTIONS: usize = 100;
/// With `--quick`: a tenth of the streams, so the smoke run stays short.
const QUICK_STALLED_SUBSCRIPTIONS: usize = 10;
/// Streams per stalled subscription; the first `NEVER_READ` subscriptions have one that
/// never reads, every other stream reads and never acks.
const STREAMS_PER_SUBSCRIPTION: usize = 10;
const NEVER_READ: usize = 10;
/// Short leases, so unacked deliveries come back in waves during the run.
const ACK_DEADLINE: Duration = Duration::from_secs(5);
const MAX_IN_FLIGHT: u32 = 100;
const LATENCY_RATE: u64 = 1_000;

pub async fn run(bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
    let scenario = "stalled-consumers";
    // Enough for every stalled stream to fill its room; only they match it (tenant
    // metadata), the healthy subscription starts after it.
    let backlog = bench.settings.events(20_000);
    insert_backlog(bench, scenario, backlog).await?;
    let stalled_subscriptions = if bench.settings.quick {
        QUICK_STALLED_SUBSCRIPTIONS
    } else {
        STALLED_SUBSCRIPTIONS
    };
    for index in 0..stalled_subscriptions {
        create_stalled_subscription(gateway, &format!("stalled-{index}")).await?;
    }
    // The healthy subscription is measured twice: while the stalled streams attach and
    // take their first deliveries, and once their first leases have expired.
    let (attaching, opened) = tokio::join!(
        latency::measure_run(bench, gateway, Writer::Gateway, LATENCY_RATE),
        async {
            // Once the warm-up is over, so the measured window sees them attach.
            tokio::time::sleep(bench.settings.timing.warmup).await;
            open_stalled_streams(gateway, stalled_subscriptions).await
        },
    );
    let attaching = attaching?;
    let (mut streams, held_open) = opened?;
    let attaching_summary = attaching.commit_to_delivery();
    progress(
        scenario,
        format!(
            "while they attached, healthy at {LATENCY_RATE}/s: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            attaching_summary.p50, attaching_summary.p99, attaching_summary.max
        ),
    );
    // Let the stalled streams fill their room and the first leases expire.
    if !bench.settings.quick {
        tokio::time::sleep(ACK_DEADLINE + Duration::from_secs(1)).await;
    }
    let run = latency::measure_run(bench, gateway, Writer::Gateway, LATENCY_RATE).await?;
    let summary = run.commit_to_delivery();
    let before_stop = gateway.stats()?;
    streams.abort_all();
    drop(held_open);
    progress(
        scenario,
        format!(
            "healthy at {LATENCY_RATE}/s: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            summary.p50, summary.p99, summary.max
        ),
    );

    let mut report = Report::new(
        scenario,
        format!(
            "a healthy subscription at {LATENCY_RATE}/s beside {} streams that never ack ({} s leases) or never read",
            stalled_subscriptions * STREAMS_PER_SUBSCRIPTION,
            ACK_DEADLINE.as_secs()
        ),
    );
    let mut table = Table::new(
        "healthy subscription, commit-to-delivery",
        &["stalled streams", "events", "p50 ms", "p99 ms", "max ms"],
    );
    for (label, run, summary) in [
        ("attaching", &attaching, &attaching_summary),
        ("settled", &run, &summary),
    ] {
        table.row(vec![
            label.into(),
            format_number(run.measured as f64),
            format!("{:.2}", summary.p50),
            format!("{:.2}", summary.p99),
            format!("{:.2}", summary.max),
        ]);
    }
    report.tables.push(table);
    report.figure(
        "healthy",
        json!({
            "rate_per_s": LATENCY_RATE,
            "events": run.measured,
            "lost": run.lost,
            "commit_to_delivery": summary.to_json(),
            "while_attaching": {
                "events": attaching.measured,
                "lost": attaching.lost,
                "commit_to_delivery": attaching_summary.to_json(),
            },
        }),
    );
    report.figure("rss_mib", round(before_stop.rss_mib(), 1));
    report.targets.push(Target::at_most(
        "healthy p99 beside stalled streams",
        summary.p99,
        50.0,
        " ms",
    ));
    report.targets.push(Target::at_most(
        "healthy p99 while the stalled streams attach",
        attaching_summary.p99,
        50.0,
        " ms",
    ));
    report.targets.push(Target::at_most(
        "healthy worst delivery (no stall)",
        summary.max,
        1_000.0,
        " ms",
    ));
    bench.latency_chart(
        &mut report,
        "stalled-consumers-latency.svg",
        "stalled-consumers: the healthy subscription's commit-to-delivery",
        &[(
            format!("healthy at {LATENCY_RATE}/s"),
            run.commit_to_delivery_histogram(),
        )],
    )?;
    Ok(report)
}

/// Opens the stalled streams: on the first [`NEVER_READ`] subscriptions one stream that
/// never reads (returned, held open), every other stream reads everything and acks
/// nothing.
async fn open_stalled_streams(
    gateway: &Gateway,
    subscriptions: usize,
) -> anyhow::Result<(JoinSet<()>, Vec<tonic::Streaming<proto::Delivery>>)> {
    let mut streams = JoinSet::new();
    let mut held_open = Vec::new();
    for index in 0..subscriptions {
        for stream in 0..STREAMS_PER_SUBSCRIPTION {
            let mut client = gateway.subscriber();
            let opened = client
                .subscribe(proto::SubscribeRequest {
                    subscription: format!("stalled-{index}"),
                    max_in_flight: MAX_IN_FLIGHT,
                    ..Default::default()
                })
                .await
                .context("cannot open a stalled stream")?
                .into_inner();
            if index < NEVER_READ && stream == 0 {
                held_open.push(opened);
            } else {
                streams.spawn(async move {
                    let mut opened = opened;
                    while let Ok(Some(_)) = opened.message().await {}
                });
            }
        }
    }
    Ok((streams, held_open))
}

/// A subscription to the backlog only (its events carry the tenant metadata; the latency
/// probes do not), with short leases and unlimited attempts.
async fn create_stalled_subscription(gateway: &Gateway, name: &str) -> anyhow::Result<()> {
    gateway
        .create(proto::Subscription {
            metadata_match: HashMap::from([(
                workload::METADATA_KEY.to_owned(),
                workload::METADATA_VALUE.to_owned(),
            )]),
            ack_deadline: prost_types::Duration::try_from(ACK_DEADLINE).ok(),
            max_attempts: Some(0),
            ..Gateway::from_earliest(name)
        })
        .await
}
