//! memory: the gateway's resident memory (VmRSS) when idle, with 1,000 idle Subscribe
//! streams open (over 10 subscriptions and 20 connections), and while and after 4 streams
//! drain the deliver scenario's backlog. RSS is sampled throughout for the chart.

use std::time::Duration;

use anyhow::Context;
use outbox_client::proto::{self, subscriber_client::SubscriberClient};
use serde_json::json;
use tokio::{task::JoinSet, time::Instant};
use tokio_util::sync::CancellationToken;

use super::{Bench, DELIVER_BACKLOG, insert_backlog, progress};
use crate::{
    gateway::{self, Gateway, ProcessStats},
    measure::{Series, round},
    report::{Report, Table, Target, format_number},
};

const IDLE_STREAMS: usize = 1_000;
const IDLE_SUBSCRIPTIONS: usize = 10;
const IDLE_CHANNELS: usize = 20;
const MIB: f64 = 1024.0 * 1024.0;

pub async fn run(bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
    let scenario = "memory";
    let settings = &bench.settings;
    let sampler = RssSampler::start(gateway.pid(), settings.timing.sample_interval);

    tokio::time::sleep(settings.settle).await;
    let idle = gateway.stats()?;
    let idle_cpu = cpu_per_second(gateway, settings.settle).await?;
    progress(scenario, format!("idle: {:.1} MiB", idle.rss_mib()));

    let names: Vec<String> = (1..=IDLE_SUBSCRIPTIONS)
        .map(|index| format!("memory-idle-{index}"))
        .collect();
    for name in &names {
        gateway.create_subscription(name, false).await?;
    }
    let channels = gateway::connect_channels(gateway.address(), IDLE_CHANNELS).await?;
    let mut opening = JoinSet::new();
    for index in 0..IDLE_STREAMS {
        let mut client = SubscriberClient::new(channels[index % channels.len()].clone());
        let subscription = names[index % names.len()].clone();
        opening.spawn(async move {
            client
                .subscribe(proto::SubscribeRequest {
                    subscription,
                    ..Default::default()
                })
                .await
                .map(tonic::Response::into_inner)
        });
    }
    let mut streams = Vec::with_capacity(IDLE_STREAMS);
    while let Some(opened) = opening.join_next().await {
        streams.push(
            opened
                .context("a Subscribe task panicked")?
                .context("Subscribe failed")?,
        );
    }
    tokio::time::sleep(settings.settle).await;
    let with_streams = gateway.stats()?;
    let streams_cpu = cpu_per_second(gateway, settings.settle).await?;
    progress(
        scenario,
        format!(
            "{} idle streams: {:.1} MiB",
            format_number(IDLE_STREAMS as f64),
            with_streams.rss_mib()
        ),
    );
    drop(streams);
    drop(channels);
    for name in &names {
        gateway.delete_subscription(name).await?;
    }

    let backlog = settings.events(DELIVER_BACKLOG);
    insert_backlog(bench, scenario, backlog).await?;
    let load_started = sampler.elapsed();
    let outcome = bench
        .deliver(
            gateway,
            "memory-load",
            1,
            4,
            backlog,
            settings.deliver_limit,
        )
        .await?;
    let after_load = gateway.stats()?;
    let timeline = sampler.finish().await;
    let load_peak = timeline
        .points
        .iter()
        .filter(|(at, _)| *at >= load_started)
        .map(|(_, mib)| *mib)
        .fold(after_load.rss_mib(), f64::max);
    progress(scenario, format!("under load: peak {load_peak:.1} MiB"));

    let mut report = Report::new(scenario, "gateway resident memory (VmRSS)");
    let mut table = Table::new(
        "resident memory",
        &["state", "RSS MiB", "gateway CPU (cores)"],
    );
    table.row(vec![
        "idle".into(),
        format!("{:.1}", idle.rss_mib()),
        format!("{idle_cpu:.3}"),
    ]);
    table.row(vec![
        format!(
            "{} idle Subscribe streams",
            format_number(IDLE_STREAMS as f64)
        ),
        format!("{:.1}", with_streams.rss_mib()),
        format!("{streams_cpu:.3}"),
    ]);
    table.row(vec![
        format!(
            "peak while draining {} events with 4 streams ({} events/s)",
            format_number(backlog as f64),
            format_number(outcome.per_second())
        ),
        format!("{load_peak:.1}"),
        String::new(),
    ]);
    table.row(vec![
        "after that deliver run".into(),
        format!("{:.1}", after_load.rss_mib()),
        String::new(),
    ]);
    table.row(vec![
        "process peak so far (VmHWM)".into(),
        format!("{:.1}", after_load.peak_rss_mib()),
        String::new(),
    ]);
    report.tables.push(table);
    report.figure(
        "rss_mib",
        json!({
            "idle": round(idle.rss_mib(), 1),
            "idle_streams": round(with_streams.rss_mib(), 1),
            "load_peak": round(load_peak, 1),
            "after_load": round(after_load.rss_mib(), 1),
            "process_peak": round(after_load.peak_rss_mib(), 1),
        }),
    );
    report.figure(
        "idle_cpu_cores",
        json!({ "idle": round(idle_cpu, 4), "idle_streams": round(streams_cpu, 4) }),
    );
    report.figure("idle_streams", IDLE_STREAMS);
    report.figure("load_backlog", backlog);
    report.figure("load_events_per_s", round(outcome.per_second(), 1));
    report
        .targets
        .push(Target::at_most("idle", idle.rss_mib(), 64.0, " MiB"));
    report.targets.push(Target::at_most(
        format!("{} idle streams", format_number(IDLE_STREAMS as f64)),
        with_streams.rss_mib(),
        256.0,
        " MiB",
    ));
    report.targets.push(Target::at_most(
        "under load (peak)",
        load_peak,
        256.0,
        " MiB",
    ));
    bench.time_chart(
        &mut report,
        "memory-rss.svg",
        "memory: gateway RSS (idle, 1,000 idle streams, then draining a backlog)",
        "MiB",
        &[timeline.labelled("gateway RSS")],
    )?;
    Ok(report)
}

/// Gateway CPU seconds per second over `window`: the cores it keeps busy.
async fn cpu_per_second(gateway: &Gateway, window: Duration) -> anyhow::Result<f64> {
    let before = gateway.stats()?.cpu_seconds;
    let started = Instant::now();
    tokio::time::sleep(window).await;
    let after = gateway.stats()?.cpu_seconds;
    Ok((after - before) / started.elapsed().as_secs_f64())
}

/// Samples a process's RSS (MiB) every interval until finished.
struct RssSampler {
    started: Instant,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Vec<(f64, f64)>>,
}

impl RssSampler {
    fn start(pid: u32, interval: Duration) -> RssSampler {
        let started = Instant::now();
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            let mut points = Vec::new();
            let mut ticker = tokio::time::interval(interval);
            loop {
                tokio::select! {
                    _ = stopped.cancelled() => break,
                    _ = ticker.tick() => {
                        if let Ok(stats) = ProcessStats::read(pid) {
                            points.push((started.elapsed().as_secs_f64(), stats.rss_bytes as f64 / MIB));
                        }
                    }
                }
            }
            points
        });
        RssSampler {
            started,
            stop,
            task,
        }
    }

    /// Seconds since sampling started, on the timeline's clock.
    fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    async fn finish(self) -> Series {
        self.stop.cancel();
        Series {
            label: String::new(),
            points: self.task.await.unwrap_or_default(),
        }
    }
}
