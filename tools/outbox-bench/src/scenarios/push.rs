//! push: a backlog inserted straight into the outbox table, drained first by pull (one
//! subscription, four Subscribe streams acking in batches, as in `deliver`) and then by a
//! push subscription sending every event to a local HTTP receiver that answers 204 at
//! once, with 64 requests in flight. The report gives push ÷ pull of the same run and
//! the gateway's CPU seconds per million events of each.

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
/// How often the receiver's count is checked for completion.
const CHECK_INTERVAL: Duration = Duration::from_millis(20);

pub async fn run(bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
    let scenario = "push";
    let (backlog, pull, pull_cpu) = pull_baseline(bench, gateway, scenario).await?;

    let receiver = Receiver::start().await?;
    let before = gateway.cpu_snapshot();
    let sampler = Sampler::start(
        vec![receiver.answered.clone()],
        bench.settings.timing.sample_interval,
    );
    let started = Instant::now();
    create_push_subscription(gateway, "push", &receiver.endpoint()).await?;
    let limit = started + bench.settings.deliver_limit;
    while receiver.answered.load(Ordering::Relaxed) < backlog && Instant::now() < limit {
        tokio::time::sleep(CHECK_INTERVAL).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let pushed = receiver.answered.load(Ordering::Relaxed).min(backlog);
    let push_cpu = CpuUse::between(&before, &gateway.cpu_snapshot());
    let series = sampler.finish().await;
    let drained = pushed >= backlog;
    let push_rate = pushed as f64 / seconds;
    let ratio = push_rate / pull.per_second();
    progress(
        scenario,
        format!(
            "push with {CONCURRENCY} requests in flight: {} events/s ({ratio:.2}x pull)",
            format_number(push_rate)
        ),
    );
    gateway.delete_subscription("push").await?;

    let mut report = Report::new(
        scenario,
        format!(
            "a backlog of {} events pulled (4 streams) and pushed to a local receiver answering 204 ({CONCURRENCY} in flight)",
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
            "drained",
            "gateway CPU s/M ev",
        ],
    );
    table.row(vec![
        format!("pull, {BASELINE_STREAMS} streams"),
        format_number(pull.acked() as f64),
        format!("{:.2}", pull.seconds),
        format_number(pull.per_second()),
        yes_no(pull.completed()),
        format!("{:.1}", pull_cpu.gateway_per_million(pull.acked())),
    ]);
    table.row(vec![
        format!("push, {CONCURRENCY} in flight"),
        format_number(pushed as f64),
        format!("{seconds:.2}"),
        format_number(push_rate),
        yes_no(drained),
        format!("{:.1}", push_cpu.gateway_per_million(pushed)),
    ]);
    report.tables.push(table);
    if !drained {
        report.notes.push(format!(
            "the push run was cut off after {seconds:.0} s with {} events answered; the rate covers that time",
            format_number(pushed as f64)
        ));
    }
    report.figure("backlog", backlog);
    report.figure("concurrency", CONCURRENCY);
    report.figure("push_events", pushed);
    report.figure("push_seconds", round(seconds, 3));
    report.figure("push_events_per_s", round(push_rate, 1));
    report.figure("push_drained", drained);
    report.figure("push_cpu_s", push_cpu.to_json());
    report.figure(
        "push_gateway_cpu_s_per_million",
        round(push_cpu.gateway_per_million(pushed), 2),
    );
    report.figure("pull_events_per_s", round(pull.per_second(), 1));
    report.figure(
        "pull_gateway_cpu_s_per_million",
        round(pull_cpu.gateway_per_million(pull.acked()), 2),
    );
    report.figure("push_to_pull", round(ratio, 3));
    report.targets.push(Target::at_least(
        "push ÷ pull deliver rate",
        ratio,
        0.5,
        "x",
    ));
    let series: Vec<_> = series
        .into_iter()
        .map(|line| line.labelled(format!("push, {CONCURRENCY} in flight")))
        .chain(std::iter::once(
            pull.total_samples
                .clone()
                .labelled(format!("pull, {BASELINE_STREAMS} streams")),
        ))
        .collect();
    bench.time_chart(
        &mut report,
        "push-throughput.svg",
        "push: events/s answered by the receiver, beside pull",
        "events/s",
        &series,
    )?;
    Ok(report)
}

async fn create_push_subscription(
    gateway: &Gateway,
    name: &str,
    endpoint: &str,
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
                    ..Default::default()
                }),
                ..Default::default()
            }),
        })
        .await
        .with_context(|| format!("CreateSubscription {name:?} (push) failed"))?;
    Ok(())
}

/// An HTTP receiver on 127.0.0.1 that answers every POST with 204 at once.
struct Receiver {
    address: std::net::SocketAddr,
    answered: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Receiver {
    async fn start() -> anyhow::Result<Receiver> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("cannot listen for the push receiver")?;
        let address = listener.local_addr()?;
        let answered = Arc::new(AtomicU64::new(0));
        let counter = answered.clone();
        let app = Router::new().route(
            "/events",
            post(move || {
                let counter = counter.clone();
                async move {
                    counter.fetch_add(1, Ordering::Relaxed);
                    StatusCode::NO_CONTENT
                }
            }),
        );
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Receiver {
            address,
            answered,
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
