//! many-subscriptions: what idle subscriptions cost. 50 active subscriptions, each with
//! one stream, share a steady 1,000 events/s (each takes its own event type); the run is
//! measured once alone and once beside 2,000 idle subscriptions that each hold an open
//! stream and match nothing. It reports the active subscriptions' acked rate and the
//! database's transactions per second in both runs: the difference is what the idle ones
//! cost.

use std::time::Duration;

use anyhow::Context;
use outbox_client::proto::{self, subscriber_client::SubscriberClient};
use serde_json::json;
use sqlx::PgPool;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Bench, progress};
use crate::{
    consume::{ConsumerConfig, ConsumerGroup, SubscriptionLoad},
    database::Notify,
    gateway::{self, Gateway},
    measure::Series,
    report::{Report, Table, Target, format_number},
    workload,
};

const ACTIVE: usize = 50;
const IDLE: usize = 2_000;
/// With `--quick`: a tenth of each, so the smoke run stays short.
const QUICK_DIVISOR: usize = 10;
const RATE: u64 = 1_000;
/// Events per Publish call.
const BATCH: u64 = 10;
/// Idle streams per HTTP/2 connection (the gateway allows 256 by default).
const STREAMS_PER_CONNECTION: usize = 100;
/// Longest the idle subscriptions and their streams may take to set up.
const SETUP_LIMIT: Duration = Duration::from_secs(300);

struct Run {
    acked_per_second: f64,
    transactions_per_second: f64,
    /// The active subscriptions' acked events/s over the run.
    acked: Series,
}

pub async fn run(bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
    let scenario = "many-subscriptions";
    let divisor = if bench.settings.quick {
        QUICK_DIVISOR
    } else {
        1
    };
    let (active, idle) = (ACTIVE / divisor, IDLE / divisor);
    for index in 0..active {
        create(
            gateway,
            &format!("active-{index}"),
            &format!("active.{index}"),
        )
        .await?;
    }
    let stats = bench.database.pool(1, Notify::Suppress).await?;

    progress(scenario, format!("{active} active subscriptions alone"));
    let alone = measure(bench, gateway, &stats, active).await?;

    progress(
        scenario,
        format!("creating {idle} idle subscriptions with a stream each"),
    );
    let mut idle_streams = Vec::with_capacity(idle);
    // The idle streams get connections of their own, well below the gateway's limit of
    // concurrent streams per connection, and leave the pool to the active ones.
    let idle_channels =
        gateway::connect_channels(gateway.address(), idle.div_ceil(STREAMS_PER_CONNECTION)).await?;
    // Each idle subscription with a stream may slow the next one down: past the limit,
    // report how far it got rather than run on for good.
    let setup = async {
        for index in 0..idle {
            let name = format!("idle-{index}");
            create(gateway, &name, &format!("idle.{index}")).await?;
            let channel = idle_channels[index / STREAMS_PER_CONNECTION].clone();
            let stream = SubscriberClient::new(channel)
                .subscribe(proto::SubscribeRequest {
                    subscription: name,
                    max_in_flight: 10,
                    ..Default::default()
                })
                .await
                .context("cannot open an idle stream")?
                .into_inner();
            idle_streams.push(stream);
        }
        anyhow::Ok(())
    };
    match tokio::time::timeout(SETUP_LIMIT, setup).await {
        Ok(done) => done?,
        Err(_) => anyhow::bail!(
            "creating {idle} idle subscriptions with a stream each took longer than {}: {} were created",
            humantime::format_duration(SETUP_LIMIT),
            idle_streams.len()
        ),
    }
    progress(scenario, format!("{active} active beside {idle} idle"));
    let beside = measure(bench, gateway, &stats, active).await?;
    drop(idle_streams);
    stats.close().await;

    let ratio = beside.acked_per_second / alone.acked_per_second.max(f64::EPSILON);
    let idle_transactions =
        (beside.transactions_per_second - alone.transactions_per_second).max(0.0);
    progress(
        scenario,
        format!(
            "active {:.0} → {:.0} acked/s ({ratio:.2}×); database {:.0} → {:.0} transactions/s",
            alone.acked_per_second,
            beside.acked_per_second,
            alone.transactions_per_second,
            beside.transactions_per_second
        ),
    );

    let mut report = Report::new(
        scenario,
        format!(
            "{active} active subscriptions sharing {RATE} events/s, alone and beside {idle} idle ones with a stream each"
        ),
    );
    let mut table = Table::new(
        "active subscriptions and the database",
        &["idle subscriptions", "acked/s", "database transactions/s"],
    );
    for (label, run) in [("none", &alone), (idle.to_string().as_str(), &beside)] {
        table.row(vec![
            label.to_owned(),
            format_number(run.acked_per_second),
            format_number(run.transactions_per_second),
        ]);
    }
    report.tables.push(table);
    report.figure(
        "runs",
        json!({
            "active": active,
            "idle": idle,
            "rate_per_s": RATE,
            "alone": {
                "acked_per_s": alone.acked_per_second,
                "transactions_per_s": alone.transactions_per_second,
            },
            "beside_idle": {
                "acked_per_s": beside.acked_per_second,
                "transactions_per_s": beside.transactions_per_second,
            },
            "idle_transactions_per_s": idle_transactions,
        }),
    );
    report.targets.push(Target::at_least(
        "active acked/s beside idle subscriptions ÷ alone",
        ratio,
        0.9,
        "×",
    ));
    // The target is 5 % of what 2,000 idle subscriptions cost before it was set
    // (~500 transactions/s): about 25 a second.
    report.targets.push(Target::at_most(
        "database transactions/s the idle subscriptions add",
        idle_transactions,
        25.0 / divisor as f64,
        "/s",
    ));
    bench.time_chart(
        &mut report,
        "many-subscriptions-throughput.svg",
        "many-subscriptions: the active subscriptions' acked events/s",
        "events/s",
        &[
            alone.acked.clone().labelled("alone"),
            beside.acked.clone().labelled(format!("beside {idle} idle")),
        ],
    )?;
    Ok(report)
}

/// A subscription from now on to one event type.
async fn create(gateway: &Gateway, name: &str, event_type: &str) -> anyhow::Result<()> {
    gateway
        .admin()
        .create_subscription(proto::CreateSubscriptionRequest {
            subscription: Some(proto::Subscription {
                name: name.into(),
                event_types: vec![event_type.into()],
                ..Default::default()
            }),
            validate_only: false,
        })
        .await
        .with_context(|| format!("CreateSubscription {name:?} failed"))?;
    Ok(())
}

/// Publishes [`RATE`] events/s round-robin over the active subscriptions' event types
/// while they consume, for the warm-up and the measured window; returns their acked rate
/// over the window and the database's transactions per second meanwhile.
async fn measure(
    bench: &Bench,
    gateway: &Gateway,
    stats: &PgPool,
    active: usize,
) -> anyhow::Result<Run> {
    let timing = bench.settings.timing;
    let loads: Vec<SubscriptionLoad> = (0..active)
        .map(|index| SubscriptionLoad {
            name: format!("active-{index}"),
            streams: 1,
            target: u64::MAX,
        })
        .collect();
    let consumers = ConsumerGroup::start(
        gateway,
        &loads,
        ConsumerConfig::default(),
        timing.sample_interval,
        |_| {},
    )
    .await?;
    let stop = CancellationToken::new();
    let publisher = tokio::spawn(publish_steadily(gateway.publisher(), active, stop.clone()));
    tokio::time::sleep(timing.warmup).await;
    let acked_before = consumers.acked();
    let transactions_before = transactions(stats).await?;
    let started = Instant::now();
    tokio::time::sleep(timing.duration).await;
    let seconds = started.elapsed().as_secs_f64();
    let acked = consumers.acked() - acked_before;
    let transactions = transactions(stats).await? - transactions_before;
    stop.cancel();
    publisher.await??;
    let outcome = consumers.finish().await?;
    Ok(Run {
        acked_per_second: acked as f64 / seconds,
        transactions_per_second: transactions as f64 / seconds,
        acked: outcome.total_samples,
    })
}

async fn publish_steadily(
    mut publisher: proto::publisher_client::PublisherClient<tonic::transport::Channel>,
    active: usize,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 * BATCH / RATE));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sequence = 0usize;
    while !stop.is_cancelled() {
        tick.tick().await;
        let events = (0..BATCH)
            .map(|_| {
                sequence += 1;
                proto::EventInput {
                    event_type: format!("active.{}", sequence % active),
                    ..workload::event_input(workload::aggregate_id(0, sequence), Default::default())
                }
            })
            .collect();
        publisher
            .publish(proto::PublishRequest {
                source: String::new(),
                events,
            })
            .await
            .context("Publish failed")?;
    }
    Ok(())
}

/// Transactions committed or rolled back in the benchmark database so far.
async fn transactions(pool: &PgPool) -> anyhow::Result<i64> {
    // Statistics reach the shared counters at most once a second per backend; clear this
    // backend's snapshot so the read is fresh.
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(pool)
        .await?;
    let total: i64 = sqlx::query_scalar(
        "SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database \
         WHERE datname = current_database()",
    )
    .fetch_one(pool)
    .await?;
    Ok(total)
}
