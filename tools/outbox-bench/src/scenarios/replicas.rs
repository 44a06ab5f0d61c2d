//! replicas: two gateways on one database, as behind a load balancer. A consumer's stream
//! lives on the first; it works 50 ms on each delivery with up to 20 in hand (so at most
//! 400 a second), nacks every tenth first delivery for an immediate retry and acks the
//! rest — sending every settlement to the stream's gateway, one in ten to the other
//! replica, or every other one there. The stream's room must follow its leases wherever
//! they were settled: the split runs keep at least 0.8 of the first's rate.

use std::{sync::Arc, time::Duration};

use anyhow::Context;
use hdrhistogram::Histogram;
use outbox_client::proto::{self, subscriber_client::SubscriberClient};
use serde_json::json;
use tokio::sync::Semaphore;
use tonic::transport::Channel;

use super::{Bench, insert_backlog, progress};
use crate::{
    gateway::Gateway,
    measure::{RunShared, new_histogram, round, timed_run},
    report::{Report, Table, Target, format_number},
};

/// The consumer's time per delivery and how many it works on at once.
const WORK: Duration = Duration::from_millis(50);
const MAX_IN_FLIGHT: u32 = 20;
/// One settlement in this many goes to the other replica (`None`: none).
const SPLITS: [(Option<usize>, &str); 3] =
    [(None, "none"), (Some(10), "1 in 10"), (Some(2), "1 in 2")];
/// Every tenth first delivery is nacked for an immediate retry.
const NACK_EVERY: usize = 10;

pub async fn run(bench: &Bench, gateway: &Gateway) -> anyhow::Result<Report> {
    let scenario = "replicas";
    let timing = bench.settings.timing;
    // What the consumer can take in a run at its fastest, and then some.
    let ideal = f64::from(MAX_IN_FLIGHT) / WORK.as_secs_f64();
    let backlog = ((ideal * (timing.warmup + timing.duration).as_secs_f64() * 1.5) as u64)
        .max(bench.settings.events(1_000));
    insert_backlog(bench, scenario, backlog).await?;
    let other = bench
        .launcher
        .start(bench.settings.channels)
        .await
        .context("cannot start the second replica")?;

    let mut report = Report::new(
        scenario,
        format!(
            "one stream on one of two gateways, {} ms of work per delivery with {MAX_IN_FLIGHT} in hand, settlements split between the replicas",
            WORK.as_millis()
        ),
    );
    let mut table = Table::new(
        "acked per second",
        &[
            "to the other replica",
            "acked/s",
            "÷ all on the stream's",
            "errors",
        ],
    );
    let mut local_rate = None;
    let mut runs = Vec::new();
    let mut series = Vec::new();
    for (index, (split, label)) in SPLITS.into_iter().enumerate() {
        let name = format!("replicas-{index}");
        gateway.create_subscription(&name, true).await?;
        let clients = [gateway.subscriber(), other.subscriber()];
        let throughput = timed_run(timing, gateway, 1, |_, shared| {
            consume(
                gateway.subscriber(),
                clients.clone(),
                name.clone(),
                split,
                shared,
            )
        })
        .await?;
        gateway.delete_subscription(&name).await?;
        let rate = throughput.per_second();
        let ratio = rate / *local_rate.get_or_insert(rate);
        progress(
            scenario,
            format!(
                "{label} to the other replica: {} acked/s ({ratio:.2}x)",
                format_number(rate)
            ),
        );
        table.row(vec![
            label.to_owned(),
            format_number(rate),
            format!("{ratio:.2}"),
            throughput.errors.to_string(),
        ]);
        if split.is_some() {
            report.targets.push(Target::at_least(
                format!("{label} settled on the other replica ÷ all on the stream's"),
                ratio,
                0.8,
                "",
            ));
        }
        series.push(
            throughput
                .samples
                .clone()
                .labelled(format!("{label} to the other replica")),
        );
        runs.push(json!({
            "to_other_replica": label,
            "acked_per_s": round(rate, 1),
            "ratio": round(ratio, 3),
            "run": throughput.to_json(),
        }));
    }
    other.stop().await?;
    report.tables.push(table);
    report.figure("ideal_per_s", round(ideal, 1));
    report.figure("runs", json!(runs));
    bench.time_chart(
        &mut report,
        "replicas-throughput.svg",
        "replicas: acked/s of one stream, settlements split between two gateways",
        "acked/s",
        &series,
    )?;
    Ok(report)
}

/// The consumer: reads its stream on `stream_client`'s gateway until the run stops,
/// settling each delivery after `WORK` through `settlers[0]` (the stream's gateway) or,
/// for one settlement in `split`, `settlers[1]`. Counts the acks applied.
async fn consume(
    mut stream_client: SubscriberClient<Channel>,
    settlers: [SubscriberClient<Channel>; 2],
    subscription: String,
    split: Option<usize>,
    shared: Arc<RunShared>,
) -> Histogram<u64> {
    let opened = stream_client
        .subscribe(proto::SubscribeRequest {
            subscription: subscription.clone(),
            max_in_flight: MAX_IN_FLIGHT,
            ..Default::default()
        })
        .await;
    let mut stream = match opened {
        Ok(stream) => stream.into_inner(),
        Err(status) => {
            shared.failed(status);
            return new_histogram();
        }
    };
    let working = Arc::new(Semaphore::new(MAX_IN_FLIGHT as usize));
    let mut settled = 0usize;
    let mut first_deliveries = 0usize;
    while !shared.stopped() {
        let delivery =
            match tokio::time::timeout(Duration::from_millis(200), stream.message()).await {
                Ok(Ok(Some(delivery))) => delivery,
                Ok(Ok(None)) => break,
                Ok(Err(status)) => {
                    shared.failed(status);
                    break;
                }
                Err(_) => continue,
            };
        let Ok(permit) = working.clone().acquire_owned().await else {
            break;
        };
        let elsewhere = split.is_some_and(|split| settled % split == split - 1);
        let mut client = settlers[usize::from(elsewhere)].clone();
        settled += 1;
        let nack = delivery.attempt == 1 && {
            first_deliveries += 1;
            first_deliveries.is_multiple_of(NACK_EVERY)
        };
        let (subscription, shared) = (subscription.clone(), shared.clone());
        tokio::spawn(async move {
            tokio::time::sleep(WORK).await;
            let outcome = if nack {
                client
                    .nack(proto::NackRequest {
                        subscription,
                        ack_id: delivery.ack_id,
                        reason: "try again".into(),
                        retry_after: Some(prost_types::Duration::default()),
                        dead_letter: false,
                    })
                    .await
                    .map(|_| ())
            } else {
                client
                    .ack(proto::AckRequest {
                        subscription,
                        ack_ids: vec![delivery.ack_id],
                    })
                    .await
                    .map(|answer| {
                        if answer.into_inner().stale_ack_ids.is_empty() {
                            shared.completed(1);
                        }
                    })
            };
            if let Err(status) = outcome {
                shared.failed(status);
            }
            drop(permit);
        });
    }
    new_histogram()
}
