//! ordered-backlog: an ordered subscription reading a backlog where every aggregate has
//! many events waiting behind its first (60 × 100, 75 × 300 and 100 × 1,000 aggregates ×
//! events), drained beside an unordered subscription over the same backlog. Each ack of
//! the ordered one releases the next waiting event of the aggregates it settled, under the
//! subscription's lock: that step must cost what the aggregates freed cost, not grow with
//! the events waiting behind them, or every claim queues behind it.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context;
use hdrhistogram::Histogram;
use outbox_client::proto;
use serde_json::json;
use tokio::task::JoinSet;

use super::{Bench, progress};
use crate::{
    database::Notify,
    gateway::Gateway,
    measure::{new_histogram, record},
    report::{Report, Table, Target, format_number},
};

/// Aggregates × events per aggregate.
const CASES: [(u64, u64); 3] = [(60, 100), (75, 300), (100, 1_000)];
/// With `--quick`: a small case only.
const QUICK_CASES: [(u64, u64); 1] = [(10, 20)];
const STREAMS: usize = 4;
/// Ack ids per Ack call at most; a stream acks what it has once deliveries pause.
const ACK_BATCH: usize = 100;
const LINGER: Duration = Duration::from_millis(2);

/// One drain of one subscription.
struct Drain {
    seconds: f64,
    acked: u64,
    /// Every Ack call's round trip.
    ack_latencies: Vec<Duration>,
}

impl Drain {
    fn per_second(&self) -> f64 {
        self.acked as f64 / self.seconds
    }

    fn ack_p99_ms(&self) -> f64 {
        let mut latencies = self.ack_latencies.clone();
        latencies.sort();
        match latencies.len() {
            0 => f64::NAN,
            n => latencies[(n * 99 / 100).min(n - 1)].as_secs_f64() * 1_000.0,
        }
    }
}

pub async fn run(bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
    let scenario = "ordered-backlog";
    let cases = match bench.settings.quick {
        true => &QUICK_CASES[..],
        false => &CASES[..],
    };
    let mut ack_histograms: Vec<(String, Histogram<u64>)> = Vec::new();
    let limit = bench.settings.deliver_limit;
    let mut report = Report::new(
        scenario,
        format!(
            "an ordered subscription draining aggregates with events waiting behind their first, beside an unordered one ({STREAMS} streams each)"
        ),
    );
    let mut table = Table::new(
        "drain",
        &[
            "aggregates × waiting",
            "unordered events/s",
            "ordered events/s",
            "ordered ÷ unordered",
            "unordered Ack p99 ms",
            "ordered Ack p99 ms",
        ],
    );
    for &(aggregates, per_aggregate) in cases {
        let events = aggregates * per_aggregate;
        bench.database.truncate_events().await?;
        insert(bench, aggregates, events).await?;
        bench.database.settle().await?;
        let label = format!("{aggregates}x{per_aggregate}");
        let unordered =
            drain_new(gateway, &format!("unordered-{label}"), false, events, limit).await?;
        let ordered = drain_new(gateway, &format!("ordered-{label}"), true, events, limit).await?;
        let ratio = ordered.per_second() / unordered.per_second();
        progress(
            scenario,
            format!(
                "{aggregates} × {per_aggregate}: unordered {} events/s, ordered {} events/s ({ratio:.2} ×), ordered Ack p99 {:.1} ms",
                format_number(unordered.per_second()),
                format_number(ordered.per_second()),
                ordered.ack_p99_ms()
            ),
        );
        table.row(vec![
            format!("{aggregates} × {}", format_number(per_aggregate as f64)),
            format_number(unordered.per_second()),
            format_number(ordered.per_second()),
            format!("{ratio:.2}"),
            format!("{:.1}", unordered.ack_p99_ms()),
            format!("{:.1}", ordered.ack_p99_ms()),
        ]);
        report.targets.push(Target::at_least(
            format!("{label}: ordered drain ÷ unordered"),
            ratio,
            0.8,
            " ×",
        ));
        report.targets.push(Target::at_most(
            format!("{label}: ordered Ack p99"),
            ordered.ack_p99_ms(),
            100.0,
            " ms",
        ));
        for (kind, drain) in [("unordered", &unordered), ("ordered", &ordered)] {
            let mut histogram = new_histogram();
            for latency in &drain.ack_latencies {
                record(&mut histogram, *latency);
            }
            ack_histograms.push((format!("{kind}, {aggregates} × {per_aggregate}"), histogram));
        }
        report.figure(
            &label,
            json!({
                "events": events,
                "unordered": {"per_second": unordered.per_second(), "acked": unordered.acked, "ack_p99_ms": unordered.ack_p99_ms()},
                "ordered": {"per_second": ordered.per_second(), "acked": ordered.acked, "ack_p99_ms": ordered.ack_p99_ms()},
            }),
        );
    }
    report.tables.push(table);
    let curves: Vec<(String, &Histogram<u64>)> = ack_histograms
        .iter()
        .map(|(label, histogram)| (label.clone(), histogram))
        .collect();
    bench.latency_chart(
        &mut report,
        "ordered-backlog-acks.svg",
        "ordered-backlog: Ack round trips",
        &curves,
    )?;
    Ok(report)
}

/// `events` events over `aggregates` aggregates, one after another in turn.
async fn insert(bench: &Bench, aggregates: u64, events: u64) -> anyhow::Result<()> {
    let pool = bench.database.pool(1, Notify::Suppress).await?;
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, content_type)
         SELECT gen_random_uuid(), 'order', 'agg-' || (n % $1), 'order.changed', '{}'::bytea, 'application/json'
         FROM generate_series(1, $2) AS n",
    )
    .bind(i64::try_from(aggregates)?)
    .bind(i64::try_from(events)?)
    .execute(&pool)
    .await
    .context("cannot insert the ordered backlog")?;
    pool.close().await;
    Ok(())
}

/// Creates the subscription at the earliest event, drains `events` through [`STREAMS`]
/// streams (or until `limit`), and deletes it.
async fn drain_new(
    gateway: &Gateway,
    name: &str,
    ordered: bool,
    events: u64,
    limit: Duration,
) -> anyhow::Result<Drain> {
    gateway
        .create(proto::Subscription {
            ordered,
            ..Gateway::from_earliest(name)
        })
        .await?;
    let acked = Arc::new(AtomicU64::new(0));
    let latencies = Arc::new(Mutex::new(Vec::new()));
    let started = Instant::now();
    let deadline = started + limit;
    let mut streams = JoinSet::new();
    for _ in 0..STREAMS {
        let (gateway_subscriber, name) = (gateway.subscriber(), name.to_owned());
        let (acked, latencies) = (acked.clone(), latencies.clone());
        streams.spawn(async move {
            consume(gateway_subscriber, name, events, deadline, acked, latencies).await
        });
    }
    while let Some(outcome) = streams.join_next().await {
        outcome.context("a consumer panicked")??;
    }
    let drain = Drain {
        seconds: started.elapsed().as_secs_f64(),
        acked: acked.load(Ordering::Relaxed),
        ack_latencies: std::mem::take(&mut *latencies.lock().expect("latencies lock")),
    };
    gateway.delete_subscription(name).await?;
    Ok(drain)
}

/// One stream: reads, acks what it has every [`ACK_BATCH`] deliveries or once they pause
/// for [`LINGER`], timing each Ack, until `events` are acked over all streams.
async fn consume(
    mut client: proto::subscriber_client::SubscriberClient<tonic::transport::Channel>,
    name: String,
    events: u64,
    deadline: Instant,
    acked: Arc<AtomicU64>,
    latencies: Arc<Mutex<Vec<Duration>>>,
) -> anyhow::Result<()> {
    let mut stream = client
        .subscribe(proto::SubscribeRequest {
            subscription: name.clone(),
            max_in_flight: 1_000,
            ..Default::default()
        })
        .await
        .context("cannot open a stream")?
        .into_inner();
    let mut ack_ids = Vec::with_capacity(ACK_BATCH);
    while acked.load(Ordering::Relaxed) < events && Instant::now() < deadline {
        let wait = if ack_ids.is_empty() {
            Duration::from_millis(100)
        } else {
            LINGER
        };
        match tokio::time::timeout(wait, stream.message()).await {
            Ok(next) => {
                let delivery = next
                    .context("the stream failed")?
                    .context("the stream ended")?;
                ack_ids.push(delivery.ack_id);
                if ack_ids.len() < ACK_BATCH {
                    continue;
                }
            }
            Err(_) if ack_ids.is_empty() => continue,
            Err(_) => {}
        }
        let count = ack_ids.len() as u64;
        let sent = Instant::now();
        client
            .ack(proto::AckRequest {
                subscription: name.clone(),
                ack_ids: std::mem::take(&mut ack_ids),
            })
            .await
            .context("Ack failed")?;
        latencies
            .lock()
            .expect("latencies lock")
            .push(sent.elapsed());
        acked.fetch_add(count, Ordering::Relaxed);
    }
    Ok(())
}
