//! push: a backlog inserted straight into the outbox table, drained first by pull (one
//! subscription, four Subscribe streams acking in batches, as in `deliver`), then by a
//! push subscription sending every event to a local HTTP receiver that answers 204 at
//! once, with 64 requests in flight, and then by one pushing CloudEvents batches of 100.
//! The report gives push ÷ pull of the same run and the gateway's CPU seconds per
//! million events of each.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context;
use axum::{Router, http::StatusCode, routing::post};
use outbox_client::proto;

use super::{BASELINE_STREAMS, Bench, progress, pull_baseline, yes_no};
use crate::{
    gateway::Gateway,
    measure::{CpuUse, Sampler, round},
    report::{Report, Table, Target, format_number},
};

/// The gateway settings the scenario needs: pushing to this machine.
pub const GATEWAY_CONFIG: &str = "[push]\nallowed_hosts = [\"127.0.0.1\"]\n";
const CONCURRENCY: u32 = 64;
/// Events per request of the batched run.
const BATCH: u32 = 100;
/// How often the receiver's count is checked for completion.
const CHECK_INTERVAL: Duration = Duration::from_millis(20);

pub async fn run(bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
    let scenario = "push";
    let (backlog, pull, pull_cpu) = pull_baseline(bench, gateway, scenario).await?;

    let mut report = Report::new(
        scenario,
        format!(
            "a backlog of {} events pulled (4 streams) and pushed to a local receiver answering 204 ({CONCURRENCY} in flight), one event per request and in batches of {BATCH}",
            format_number(backlog as f64)
        ),
    );
    let mut table = Table::new(
        "delivered and acked",
        &[
            "delivery",
            "events",
            "seconds",
            "events/s",
            "÷ pull",
            "drained",
            "gateway CPU s/M ev",
        ],
    );
    table.row(vec![
        format!("pull, {BASELINE_STREAMS} streams"),
        format_number(pull.acked() as f64),
        format!("{:.2}", pull.seconds),
        format_number(pull.per_second()),
        "1.00".into(),
        yes_no(pull.completed()),
        format!("{:.1}", pull_cpu.gateway_per_million(pull.acked())),
    ]);
    let mut series = vec![
        pull.total_samples
            .clone()
            .labelled(format!("pull, {BASELINE_STREAMS} streams")),
    ];
    let mut runs = Vec::new();
    for batch in [1, BATCH] {
        let label = if batch == 1 {
            format!("push, {CONCURRENCY} in flight")
        } else {
            format!("push, batches of {batch}, {CONCURRENCY} in flight")
        };
        let run = push_run(bench, gateway, backlog, batch).await?;
        let ratio = run.per_second() / pull.per_second();
        progress(
            scenario,
            format!(
                "{label}: {} events/s ({ratio:.2}x pull)",
                format_number(run.per_second())
            ),
        );
        table.row(vec![
            label.clone(),
            format_number(run.pushed as f64),
            format!("{:.2}", run.seconds),
            format_number(run.per_second()),
            format!("{ratio:.2}"),
            yes_no(run.pushed >= backlog),
            format!("{:.1}", run.cpu.gateway_per_million(run.pushed)),
        ]);
        if run.pushed < backlog {
            report.notes.push(format!(
                "{label}: cut off after {:.0} s with {} events answered; the rate covers that time",
                run.seconds,
                format_number(run.pushed as f64)
            ));
        }
        report.targets.push(Target::at_least(
            format!("{label} ÷ pull deliver rate"),
            ratio,
            if batch == 1 { 0.5 } else { 0.8 },
            "x",
        ));
        runs.push(serde_json::json!({
            "batch": batch,
            "events": run.pushed,
            "seconds": round(run.seconds, 3),
            "events_per_s": round(run.per_second(), 1),
            "requests": run.requests,
            "drained": run.pushed >= backlog,
            "cpu_s": run.cpu.to_json(),
            "gateway_cpu_s_per_million": round(run.cpu.gateway_per_million(run.pushed), 2),
            "push_to_pull": round(ratio, 3),
        }));
        series.extend(
            run.series
                .into_iter()
                .map(|line| line.labelled(label.clone())),
        );
    }
    report.tables.push(table);
    report.figure("backlog", backlog);
    report.figure("concurrency", CONCURRENCY);
    report.figure("pull_events_per_s", round(pull.per_second(), 1));
    report.figure(
        "pull_gateway_cpu_s_per_million",
        round(pull_cpu.gateway_per_million(pull.acked()), 2),
    );
    report.figure("push_runs", runs);
    bench.time_chart(
        &mut report,
        "push-throughput.svg",
        "push: events/s answered by the receiver, beside pull",
        "events/s",
        &series,
    )?;
    Ok(report)
}

/// One push drain of the backlog through a fresh subscription.
struct PushRun {
    pushed: u64,
    requests: u64,
    seconds: f64,
    cpu: CpuUse,
    series: Vec<crate::measure::Series>,
}

impl PushRun {
    fn per_second(&self) -> f64 {
        self.pushed as f64 / self.seconds
    }
}

/// Pushes the backlog to a fresh receiver, `batch` events per request at most.
async fn push_run(
    bench: &Bench,
    gateway: &Gateway,
    backlog: u64,
    batch: u32,
) -> anyhow::Result<PushRun> {
    let name = format!("push-{batch}");
    let receiver = Receiver::start().await?;
    let before = gateway.cpu_snapshot();
    let sampler = Sampler::start(
        vec![receiver.events.clone()],
        bench.settings.timing.sample_interval,
    );
    let started = Instant::now();
    create_push_subscription(gateway, &name, &receiver.endpoint(), batch).await?;
    let limit = started + bench.settings.deliver_limit;
    while receiver.events.load(Ordering::Relaxed) < backlog && Instant::now() < limit {
        tokio::time::sleep(CHECK_INTERVAL).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let pushed = receiver.events.load(Ordering::Relaxed).min(backlog);
    let cpu = CpuUse::between(&before, &gateway.cpu_snapshot());
    let series = sampler.finish().await;
    gateway.delete_subscription(&name).await?;
    bench.database.settle().await?;
    Ok(PushRun {
        pushed,
        requests: receiver.requests.load(Ordering::Relaxed),
        seconds,
        cpu,
        series,
    })
}

async fn create_push_subscription(
    gateway: &Gateway,
    name: &str,
    endpoint: &str,
    batch: u32,
) -> anyhow::Result<()> {
    gateway
        .admin()
        .create_subscription(proto::CreateSubscriptionRequest {
            subscription: Some(proto::Subscription {
                name: name.into(),
                start: Some(proto::StartPosition {
                    position: Some(proto::start_position::Position::Boundary(
                        proto::Boundary::Earliest as i32,
                    )),
                }),
                push: Some(proto::PushConfig {
                    endpoint: endpoint.into(),
                    max_concurrency: CONCURRENCY,
                    max_batch_events: batch,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            validate_only: false,
        })
        .await
        .with_context(|| format!("CreateSubscription {name:?} (push) failed"))?;
    Ok(())
}

/// An HTTP receiver on 127.0.0.1 that answers every POST with 204 at once, counting
/// the requests and the events they carry.
struct Receiver {
    address: std::net::SocketAddr,
    events: Arc<AtomicU64>,
    requests: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Receiver {
    async fn start() -> anyhow::Result<Receiver> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("cannot listen for the push receiver")?;
        let address = listener.local_addr()?;
        let events = Arc::new(AtomicU64::new(0));
        let requests = Arc::new(AtomicU64::new(0));
        let (event_counter, request_counter) = (events.clone(), requests.clone());
        let app = Router::new().route(
            "/events",
            post(
                move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                    let (events, requests) = (event_counter.clone(), request_counter.clone());
                    async move {
                        let batched = headers.get("content-type").is_some_and(|value| {
                            value
                                .as_bytes()
                                .starts_with(b"application/cloudevents-batch")
                        });
                        let count = if batched {
                            serde_json::from_slice::<Vec<serde::de::IgnoredAny>>(&body)
                                .map_or(0, |batch| batch.len() as u64)
                        } else {
                            1
                        };
                        events.fetch_add(count, Ordering::Relaxed);
                        requests.fetch_add(1, Ordering::Relaxed);
                        StatusCode::NO_CONTENT
                    }
                },
            ),
        );
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Receiver {
            address,
            events,
            requests,
            task,
        })
    }

    fn endpoint(&self) -> String {
        format!("http://{}/events", self.address)
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}
