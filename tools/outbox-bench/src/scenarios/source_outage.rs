//! source-outage: a healthy source's delivery while another source of the same
//! subscription is down. The gateway reads `default` (the benchmark database) and
//! `remote`, a database on a second PostgreSQL server started for the run. A trickle of
//! events goes into `remote` throughout, so the consumer always holds some of its leases;
//! the open-loop latency run publishes into `default` once with `remote` up, once after
//! its server was stopped. Then the server starts again, and the run reports how long
//! `remote`'s deliveries took to resume.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::Context;
use outbox_client::proto;
use outbox_testkit::PostgresServer;
use serde_json::json;
use tokio::time::Instant;

use super::{Bench, latency, progress};
use crate::{
    database::BenchDatabase,
    gateway::Gateway,
    publish::Writer,
    report::{Report, Table, Target, format_number},
    workload,
};

const LATENCY_RATE: u64 = 500;
/// Events a second into `remote` while it is up.
const TRICKLE_RATE: u64 = 50;
const REMOTE_SUBSCRIPTION: &str = "remote-only";

pub async fn run(bench: &Bench) -> anyhow::Result<Report> {
    let server = tokio::task::spawn_blocking(PostgresServer::start)
        .await?
        .context("cannot start a second PostgreSQL server (initdb and pg_ctl are needed)")?;
    let remote = BenchDatabase::create(&server.url(), false).await?;
    let outcome = async {
        bench.launcher.for_database(remote.url(), &[]).migrate()?;
        let config = format!(
            "[[sources]]\nname = \"remote\"\ndatabase_url = {:?}\n",
            remote.url()
        );
        let gateway = bench
            .launcher
            .start_with_config(bench.settings.channels, &config)
            .await?;
        let report = measure(bench, &gateway, &server).await;
        gateway.stop().await?;
        report
    }
    .await;
    // The server may be stopped when a step failed.
    let _ = server.resume();
    if let Err(error) = remote.drop_database().await {
        eprintln!("[source-outage] note: {error:#}");
    }
    outcome
}

async fn measure(
    bench: &Bench,
    gateway: &Gateway,
    server: &PostgresServer,
) -> anyhow::Result<Report> {
    let scenario = "source-outage";
    gateway
        .admin()
        .create_subscription(proto::CreateSubscriptionRequest {
            subscription: Some(proto::Subscription {
                name: REMOTE_SUBSCRIPTION.into(),
                sources: vec!["remote".into()],
                ..Default::default()
            }),
            validate_only: false,
        })
        .await
        .context("CreateSubscription remote-only failed")?;
    let mut remote_stream = gateway
        .subscriber()
        .subscribe(proto::SubscribeRequest {
            subscription: REMOTE_SUBSCRIPTION.into(),
            ..Default::default()
        })
        .await
        .context("cannot open the remote-only stream")?
        .into_inner();
    let stop_trickle = Arc::new(AtomicBool::new(false));
    let trickle = tokio::spawn(trickle_into_remote(
        gateway.publisher(),
        stop_trickle.clone(),
    ));

    progress(
        scenario,
        format!("both sources up: {LATENCY_RATE}/s into default"),
    );
    let before = latency::measure_run(bench, gateway, Writer::Gateway, LATENCY_RATE).await?;

    progress(scenario, "stopping the remote source's server");
    server.stop().context("cannot stop the second server")?;
    wait_for_source(gateway, proto::SourceStatus::Unavailable).await?;
    progress(
        scenario,
        format!("remote down: {LATENCY_RATE}/s into default"),
    );
    let during = latency::measure_run(bench, gateway, Writer::Gateway, LATENCY_RATE).await?;

    progress(scenario, "starting the remote source's server again");
    server
        .resume()
        .context("cannot start the second server again")?;
    let resumed_at = Instant::now();
    // The first remote event published after the restart, and when it was delivered.
    let marker = loop {
        let mut publisher = gateway.publisher();
        let published = publisher
            .publish(proto::PublishRequest {
                source: "remote".into(),
                events: vec![workload::event_input("marker".into(), Default::default())],
            })
            .await;
        if let Ok(published) = published {
            break published.into_inner().results[0].id.clone();
        }
        anyhow::ensure!(
            resumed_at.elapsed() < Duration::from_secs(120),
            "the remote source did not take events within 2 minutes of its restart"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let back = loop {
        let delivery = tokio::time::timeout(Duration::from_secs(120), remote_stream.message())
            .await
            .context("no delivery from the remote source within 2 minutes of its restart")??
            .context("the remote-only stream ended")?;
        let mut subscriber = gateway.subscriber();
        subscriber
            .ack(proto::AckRequest {
                subscription: REMOTE_SUBSCRIPTION.into(),
                ack_ids: vec![delivery.ack_id.clone()],
            })
            .await?;
        if delivery
            .event
            .as_ref()
            .is_some_and(|event| event.id == marker)
        {
            break resumed_at.elapsed();
        }
    };
    stop_trickle.store(true, Ordering::Relaxed);
    trickle.await??;

    let (before_summary, during_summary) =
        (before.commit_to_delivery(), during.commit_to_delivery());
    let delivered =
        |run: &latency::LatencyRun| (run.measured - run.lost) as f64 / (run.measured.max(1)) as f64;
    let delivered_ratio = delivered(&during) / delivered(&before).max(f64::EPSILON);
    progress(
        scenario,
        format!(
            "default p50 {:.2} → {:.2} ms, p99 {:.2} → {:.2} ms; remote resumed after {:.2} s",
            before_summary.p50,
            during_summary.p50,
            before_summary.p99,
            during_summary.p99,
            back.as_secs_f64()
        ),
    );

    let mut report = Report::new(
        scenario,
        format!(
            "{LATENCY_RATE}/s into one source of a subscription while its other source is up, then down"
        ),
    );
    let mut table = Table::new(
        "the healthy source, commit-to-delivery",
        &[
            "other source",
            "events",
            "delivered",
            "p50 ms",
            "p99 ms",
            "max ms",
        ],
    );
    for (label, run, summary) in [
        ("up", &before, &before_summary),
        ("down", &during, &during_summary),
    ] {
        table.row(vec![
            label.into(),
            format_number(run.measured as f64),
            format_number((run.measured - run.lost) as f64),
            format!("{:.2}", summary.p50),
            format!("{:.2}", summary.p99),
            format!("{:.2}", summary.max),
        ]);
    }
    report.tables.push(table);
    report.figure(
        "healthy_source",
        json!({
            "rate_per_s": LATENCY_RATE,
            "other_up": before_summary.to_json(),
            "other_down": during_summary.to_json(),
            "delivered_ratio": delivered_ratio,
        }),
    );
    report.figure("remote_resumed_after_s", back.as_secs_f64());
    report.targets.push(Target::at_least(
        "healthy source delivered while the other is down ÷ while it is up",
        delivered_ratio,
        0.9,
        "×",
    ));
    // "Unchanged" latency, with room for this machine's noise.
    report.targets.push(Target::at_most(
        "healthy source p50 while the other is down",
        during_summary.p50,
        before_summary.p50 * 1.5 + 2.0,
        " ms",
    ));
    report.targets.push(Target::at_most(
        "remote deliveries resume after its restart",
        back.as_secs_f64(),
        5.0,
        " s",
    ));
    bench.latency_chart(
        &mut report,
        "source-outage-latency.svg",
        "source-outage: the healthy source's commit-to-delivery",
        &[
            (
                "other source up".to_owned(),
                before.commit_to_delivery_histogram(),
            ),
            (
                "other source down".to_owned(),
                during.commit_to_delivery_histogram(),
            ),
        ],
    )?;
    Ok(report)
}

/// Publishes into `remote` at [`TRICKLE_RATE`] until `stop`; failures (while it is down)
/// are expected and skipped.
async fn trickle_into_remote(
    mut publisher: proto::publisher_client::PublisherClient<tonic::transport::Channel>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    let mut tick = tokio::time::interval(Duration::from_millis(1000 / TRICKLE_RATE));
    let mut sequence = 0usize;
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        sequence += 1;
        let _ = tokio::time::timeout(
            Duration::from_secs(1),
            publisher.publish(proto::PublishRequest {
                source: "remote".into(),
                events: vec![workload::event_input(
                    workload::aggregate_id(1, sequence),
                    Default::default(),
                )],
            }),
        )
        .await;
    }
    Ok(())
}

/// Waits until the gateway reports `remote` in `status`.
async fn wait_for_source(gateway: &Gateway, status: proto::SourceStatus) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let sources = gateway
            .admin()
            .list_sources(proto::ListSourcesRequest {})
            .await?
            .into_inner()
            .sources;
        if sources
            .iter()
            .any(|source| source.name == "remote" && source.status == status as i32)
        {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the gateway did not report the remote source {status:?} within a minute"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
