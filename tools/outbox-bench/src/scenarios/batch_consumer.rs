//! batch-consumer: consumers that collect a batch of 100 deliveries before they ack any,
//! with leases of 1 s, 2 s and 10 s. Each stream is new, so its first batch goes through
//! the slow start of new streams; it must be complete within half the ack deadline, and
//! nothing may be delivered twice (a lease that expired before its batch was complete
//! would be). Reported beside `stalled-consumers`, whose protection the slow start is.

use std::time::{Duration, Instant};

use anyhow::Context;
use hdrhistogram::Histogram;
use outbox_client::proto;
use serde_json::json;

use super::{Bench, insert_backlog, progress};
use crate::{
    gateway::Gateway,
    measure::{new_histogram, record},
    report::{Report, Table, Target},
};

/// What each consumer collects before it acks.
const BATCH: usize = 100;
/// New streams per ack deadline, each taking [`BATCHES_PER_STREAM`] batches.
const STREAMS: usize = 5;
/// With `--quick`: one stream per deadline.
const QUICK_STREAMS: usize = 1;
const BATCHES_PER_STREAM: usize = 2;
const DEADLINES: [Duration; 3] = [
    Duration::from_secs(1),
    Duration::from_secs(2),
    Duration::from_secs(10),
];

/// One deadline's batches.
struct Outcome {
    deadline: Duration,
    /// How long each first batch of a new stream took, from opening the stream.
    first: Vec<Duration>,
    /// How long each later batch took, from the ack of the one before.
    later: Vec<Duration>,
    /// Deliveries of an attempt above 1.
    redelivered: usize,
    /// Acks answered stale: their lease had expired.
    stale: usize,
}

pub async fn run(bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
    let scenario = "batch-consumer";
    let streams = match bench.settings.quick {
        true => QUICK_STREAMS,
        false => STREAMS,
    };
    let per_subscription = (streams * BATCHES_PER_STREAM * BATCH) as u64;
    insert_backlog(bench, scenario, per_subscription).await?;
    let mut outcomes = Vec::new();
    for deadline in DEADLINES {
        let name = format!("batch-{}s", deadline.as_secs());
        gateway
            .create(proto::Subscription {
                ack_deadline: prost_types::Duration::try_from(deadline).ok(),
                ..Gateway::from_earliest(&name)
            })
            .await?;
        let outcome = consume(gateway, &name, deadline, streams).await?;
        progress(
            scenario,
            format!(
                "{} s leases: slowest first batch {:.0} ms, slowest later batch {:.0} ms, {} redelivered, {} stale acks",
                deadline.as_secs(),
                millis(outcome.first.iter().max()),
                millis(outcome.later.iter().max()),
                outcome.redelivered,
                outcome.stale
            ),
        );
        gateway.delete_subscription(&name).await?;
        outcomes.push(outcome);
    }

    let mut report = Report::new(
        scenario,
        format!(
            "new streams whose consumer collects {BATCH} deliveries before acking (max_in_flight {BATCH}), {streams} streams of {BATCHES_PER_STREAM} batches per ack deadline"
        ),
    );
    let mut table = Table::new(
        "batch completion",
        &[
            "ack deadline",
            "first batch, slowest ms",
            "first batch, median ms",
            "later batch, slowest ms",
            "redelivered",
            "stale acks",
        ],
    );
    for outcome in &outcomes {
        let mut first = outcome.first.clone();
        first.sort();
        table.row(vec![
            format!("{} s", outcome.deadline.as_secs()),
            format!("{:.0}", millis(first.last())),
            format!("{:.0}", millis(first.get(first.len() / 2))),
            format!("{:.0}", millis(outcome.later.iter().max())),
            outcome.redelivered.to_string(),
            outcome.stale.to_string(),
        ]);
        let seconds = outcome.deadline.as_secs();
        let slowest = outcome
            .first
            .iter()
            .chain(&outcome.later)
            .max()
            .copied()
            .unwrap_or_default();
        report.targets.push(Target::at_most(
            format!("{seconds} s leases: every batch within half the deadline"),
            slowest.as_secs_f64() * 1_000.0,
            outcome.deadline.as_secs_f64() * 500.0,
            " ms",
        ));
        report.targets.push(Target::at_most(
            format!("{seconds} s leases: deliveries made again"),
            (outcome.redelivered + outcome.stale) as f64,
            0.0,
            "",
        ));
        report.figure(
            &format!("deadline_{seconds}s"),
            json!({
                "first_batch_ms": outcome.first.iter().map(|d| millis(Some(d))).collect::<Vec<_>>(),
                "later_batch_ms": outcome.later.iter().map(|d| millis(Some(d))).collect::<Vec<_>>(),
                "redelivered": outcome.redelivered,
                "stale_acks": outcome.stale,
            }),
        );
    }
    report.tables.push(table);
    let histograms: Vec<(String, Histogram<u64>)> = outcomes
        .iter()
        .map(|outcome| {
            let mut histogram = new_histogram();
            for took in outcome.first.iter().chain(&outcome.later) {
                record(&mut histogram, *took);
            }
            (
                format!("{} s leases", outcome.deadline.as_secs()),
                histogram,
            )
        })
        .collect();
    let curves: Vec<(String, &Histogram<u64>)> = histograms
        .iter()
        .map(|(label, histogram)| (label.clone(), histogram))
        .collect();
    bench.latency_chart(
        &mut report,
        "batch-consumer-batches.svg",
        "batch-consumer: time to collect a batch of 100",
        &curves,
    )?;
    Ok(report)
}

/// Opens `streams` new streams one after another; each collects [`BATCH`] deliveries,
/// acks them all at once, [`BATCHES_PER_STREAM`] times, then closes.
async fn consume(
    gateway: &Gateway,
    name: &str,
    deadline: Duration,
    streams: usize,
) -> anyhow::Result<Outcome> {
    let mut outcome = Outcome {
        deadline,
        first: Vec::new(),
        later: Vec::new(),
        redelivered: 0,
        stale: 0,
    };
    // A batch that never completes is reported, not waited for forever.
    let give_up = deadline * 4 + Duration::from_secs(10);
    for _ in 0..streams {
        let mut started = Instant::now();
        let mut stream = gateway
            .subscriber()
            .subscribe(proto::SubscribeRequest {
                subscription: name.to_owned(),
                max_in_flight: BATCH as u32,
                // Exactly what it will read: nothing is left leased to give back when it
                // closes, which the next stream would get again as a second attempt.
                max_deliveries: (BATCH * BATCHES_PER_STREAM) as u32,
                ..Default::default()
            })
            .await
            .context("cannot open a batch consumer's stream")?
            .into_inner();
        for batch in 0..BATCHES_PER_STREAM {
            let mut ack_ids = Vec::with_capacity(BATCH);
            while ack_ids.len() < BATCH {
                let next = tokio::time::timeout(give_up, stream.message())
                    .await
                    .with_context(|| {
                        format!(
                            "{name}: a batch had {} of {BATCH} after {give_up:?}",
                            ack_ids.len()
                        )
                    })?
                    .context("the stream failed")?
                    .context("the stream ended")?;
                if next.attempt > 1 {
                    outcome.redelivered += 1;
                }
                ack_ids.push(next.ack_id);
            }
            let took = started.elapsed();
            if batch == 0 {
                outcome.first.push(took);
            } else {
                outcome.later.push(took);
            }
            let answer = gateway
                .subscriber()
                .ack(proto::AckRequest {
                    subscription: name.to_owned(),
                    ack_ids,
                })
                .await
                .context("Ack failed")?
                .into_inner();
            outcome.stale += answer.stale_ack_ids.len();
            started = Instant::now();
        }
    }
    Ok(outcome)
}

fn millis(duration: Option<&Duration>) -> f64 {
    duration.map_or(f64::NAN, |duration| duration.as_secs_f64() * 1_000.0)
}
