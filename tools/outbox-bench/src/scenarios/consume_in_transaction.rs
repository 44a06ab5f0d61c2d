//! consume-in-transaction: the deliver drain with consumers that write a side effect in
//! their own database transaction per delivery, the way a service does, four streams of
//! one subscription. Two ways of settling, alternately in the same minutes:
//! - `grpc-ack`: the transaction inserts the side-effect row and commits, then the
//!   delivery is acked over gRPC (acks sent in batches, as a throughput-minded consumer
//!   would, while the next transactions run);
//! - `outbox_consume`: the transaction calls `outbox_consume` first, inserts the row and
//!   commits; no ack, the gateway settles the delivery on the commit.
//!
//! Both are timed until the subscription's stats count every event acked, so both include
//! the settling. The report gives outbox_consume ÷ grpc-ack.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use anyhow::Context;
use outbox_client::proto;
use serde_json::json;
use sqlx::PgPool;
use tokio::{sync::mpsc, task::JoinSet, time::Instant};
use tokio_util::sync::CancellationToken;

use super::{Bench, insert_backlog, progress};
use crate::{
    database::Notify,
    gateway::Gateway,
    measure::{CpuUse, Series, round},
    report::{Report, Table, Target, format_number},
};

/// Base backlog (scaled by `--scale`): every event costs a commit, so far fewer than the
/// deliver drain's.
const BACKLOG: u64 = 20_000;
const CONSUMERS: usize = 4;
/// Runs of each way, alternating.
const ROUNDS: usize = 2;
const TARGET_RATIO: f64 = 0.8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settling {
    GrpcAck,
    OutboxConsume,
}

impl Settling {
    fn label(self) -> &'static str {
        match self {
            Settling::GrpcAck => "grpc-ack",
            Settling::OutboxConsume => "outbox_consume",
        }
    }
}

struct Run {
    settling: Settling,
    events: u64,
    seconds: f64,
    cpu: CpuUse,
    /// Events settled so far, over the run's seconds.
    settled: Series,
}

impl Run {
    fn per_second(&self) -> f64 {
        self.events as f64 / self.seconds
    }
}

pub async fn run(bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
    let scenario = "consume-in-transaction";
    let backlog = bench.settings.events(BACKLOG);
    insert_backlog(bench, scenario, backlog).await?;
    let pool = bench.database.pool(CONSUMERS as u32, Notify::Send).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS bench_side_effects (event_id uuid NOT NULL, body bytea NOT NULL)",
    )
    .execute(&pool)
    .await?;

    let mut runs = Vec::new();
    for round in 0..ROUNDS {
        for settling in [Settling::GrpcAck, Settling::OutboxConsume] {
            let name = format!("consume-{}-{round}", settling.label());
            gateway.create_subscription(&name, true).await?;
            let before = gateway.cpu_snapshot();
            let (seconds, settled) = drain(gateway, &pool, &name, settling, backlog, bench).await?;
            let cpu = CpuUse::between(&before, &gateway.cpu_snapshot());
            gateway.delete_subscription(&name).await?;
            let run = Run {
                settling,
                events: backlog,
                seconds,
                cpu,
                settled: settled.labelled(format!("{} {}", settling.label(), round + 1)),
            };
            progress(
                scenario,
                format!(
                    "{}: {} events/s",
                    settling.label(),
                    format_number(run.per_second())
                ),
            );
            runs.push(run);
            sqlx::query("TRUNCATE bench_side_effects")
                .execute(&pool)
                .await?;
            bench.database.settle().await?;
        }
    }
    pool.close().await;

    let best = |settling: Settling| {
        runs.iter()
            .filter(|run| run.settling == settling)
            .map(Run::per_second)
            .fold(f64::NAN, f64::max)
    };
    let ratio = best(Settling::OutboxConsume) / best(Settling::GrpcAck);
    let mut report = Report::new(
        scenario,
        format!(
            "draining {} events through {CONSUMERS} consumers that write a row per delivery in their own transaction",
            format_number(backlog as f64)
        ),
    );
    let mut table = Table::new(
        "until every delivery is settled",
        &[
            "settled by",
            "round",
            "events",
            "seconds",
            "events/s",
            "gateway CPU s/M ev",
            "postgres CPU s/M ev",
        ],
    );
    let mut figures = Vec::new();
    for (index, run) in runs.iter().enumerate() {
        let per_million = |seconds: f64| seconds / run.events as f64 * 1e6;
        table.row(vec![
            run.settling.label().to_owned(),
            (index / 2 + 1).to_string(),
            format_number(run.events as f64),
            format!("{:.2}", run.seconds),
            format_number(run.per_second()),
            format!("{:.1}", per_million(run.cpu.gateway)),
            format!("{:.1}", per_million(run.cpu.postgres)),
        ]);
        figures.push(json!({
            "settled_by": run.settling.label(),
            "events": run.events,
            "seconds": round(run.seconds, 3),
            "events_per_s": round(run.per_second(), 1),
            "cpu_s": run.cpu.to_json(),
        }));
    }
    report.tables.push(table);
    report.figure("runs", figures);
    let series: Vec<Series> = runs.iter().map(|run| run.settled.clone()).collect();
    bench.time_chart(
        &mut report,
        "consume-in-transaction-settled.svg",
        "consume-in-transaction: deliveries settled since the start of each run",
        "events settled",
        &series,
    )?;
    report.targets.push(Target::at_least(
        "outbox_consume ÷ gRPC ack after commit (best of each)",
        ratio,
        TARGET_RATIO,
        "×",
    ));
    report.notes.push(format!(
        "each delivery: BEGIN, [SELECT outbox_consume(..)], INSERT one row, COMMIT, one \
         transaction at a time per consumer; {CONSUMERS} Subscribe streams of one \
         subscription, max_in_flight 100; grpc-ack acks after the commit, in batches of up \
         to 100; timed until GetStats counts every event acked"
    ));
    Ok(report)
}

/// Drains `events` from subscription `name` with [`CONSUMERS`] consumers settling the
/// `settling` way; the seconds until the subscription's stats count them all acked, and
/// the count they showed as it went.
async fn drain(
    gateway: &Gateway,
    pool: &PgPool,
    name: &str,
    settling: Settling,
    events: u64,
    bench: &Bench,
) -> anyhow::Result<(f64, Series)> {
    let stop = CancellationToken::new();
    let consumed = Arc::new(AtomicU64::new(0));
    let mut consumers = JoinSet::new();
    let started = Instant::now();
    for _ in 0..CONSUMERS {
        let stream = gateway
            .subscriber()
            .subscribe(proto::SubscribeRequest {
                subscription: name.to_owned(),
                max_in_flight: 100,
                ..Default::default()
            })
            .await
            .with_context(|| format!("Subscribe to {name:?} failed"))?
            .into_inner();
        consumers.spawn(consume(
            stream,
            gateway.subscriber(),
            pool.clone(),
            name.to_owned(),
            settling,
            consumed.clone(),
            stop.clone(),
        ));
    }
    let limit = started + bench.settings.deliver_limit;
    let mut admin = gateway.admin();
    let mut settled = Series {
        label: String::new(),
        points: vec![(0.0, 0.0)],
    };
    let outcome = loop {
        if let Some(result) = consumers.try_join_next() {
            // A consumer only ends early on a failure.
            break Err(result
                .context("a consumer panicked")?
                .err()
                .unwrap_or_else(|| anyhow::anyhow!("a consumer stopped early")));
        }
        let stats = admin
            .get_stats(proto::GetStatsRequest {
                subscription: name.to_owned(),
            })
            .await?
            .into_inner();
        let acked = stats.subscriptions.first().map_or(0, |s| s.acked_total);
        let elapsed = started.elapsed().as_secs_f64();
        settled.points.push((elapsed, acked as f64));
        if acked >= events {
            break Ok((elapsed, settled));
        }
        if Instant::now() > limit {
            break Err(anyhow::anyhow!(
                "{name}: not settled within {:?} ({} consumed)",
                bench.settings.deliver_limit,
                consumed.load(Ordering::Relaxed)
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    stop.cancel();
    while let Some(result) = consumers.join_next().await {
        result.context("a consumer panicked")??;
    }
    outcome
}

/// One consumer: a transaction per delivery, one at a time.
async fn consume(
    mut stream: tonic::Streaming<proto::Delivery>,
    mut subscriber: proto::subscriber_client::SubscriberClient<tonic::transport::Channel>,
    pool: PgPool,
    subscription: String,
    settling: Settling,
    consumed: Arc<AtomicU64>,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    // grpc-ack: the commits' ack ids go to a task that acks them in batches meanwhile.
    let (acks, mut to_ack) = mpsc::channel::<String>(1000);
    let acker = {
        let subscription = subscription.clone();
        tokio::spawn(async move {
            let mut batch = Vec::with_capacity(100);
            while to_ack.recv_many(&mut batch, 100).await > 0 {
                subscriber
                    .ack(proto::AckRequest {
                        subscription: subscription.clone(),
                        ack_ids: std::mem::take(&mut batch),
                    })
                    .await?;
            }
            anyhow::Ok(())
        })
    };
    loop {
        let delivery = tokio::select! {
            message = stream.message() => match message? {
                Some(delivery) => delivery,
                None => break,
            },
            _ = stop.cancelled() => break,
        };
        let event = delivery
            .event
            .as_ref()
            .context("a delivery without its event")?;
        let mut transaction = pool.begin().await?;
        if settling == Settling::OutboxConsume {
            sqlx::query("SELECT outbox_consume($1, $2)")
                .bind(&subscription)
                .bind(&delivery.ack_id)
                .execute(&mut *transaction)
                .await?;
        }
        sqlx::query("INSERT INTO bench_side_effects (event_id, body) VALUES ($1::uuid, $2)")
            .bind(&event.id)
            .bind(&event.payload)
            .execute(&mut *transaction)
            .await?;
        transaction.commit().await?;
        consumed.fetch_add(1, Ordering::Relaxed);
        if settling == Settling::GrpcAck {
            acks.send(delivery.ack_id).await?;
        }
    }
    drop(acks);
    acker.await.context("the acker panicked")??;
    Ok(())
}
