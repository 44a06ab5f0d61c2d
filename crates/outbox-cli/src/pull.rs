//! `pull`: lease a few deliveries of a subscription, print them and settle them.

use std::time::Duration;

use serde_json::json;

use outbox_client::proto;

use crate::{CliError, Target, count, describe, pause_notice, render, usage};

#[derive(Debug, clap::Args)]
pub struct PullArgs {
    /// Subscription to pull from.
    subscription: String,
    /// Most deliveries to take (1 to 1000).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    max: u32,
    /// How long to wait for the first delivery.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    wait: Duration,
    /// Acknowledge what was pulled: done, never delivered again.
    #[arg(long, group = "settlement")]
    ack: bool,
    /// Give what was pulled back for a retry (after the subscription's backoff, or
    /// --retry-after).
    #[arg(long, group = "settlement")]
    nack: bool,
    /// With --nack: retry after this long instead of the subscription's backoff.
    #[arg(long, requires = "nack", value_parser = humantime::parse_duration)]
    retry_after: Option<Duration>,
    /// Send what was pulled to the dead-letter queue now; needs --reason.
    #[arg(long, group = "settlement", requires = "reason")]
    dead_letter: bool,
    /// Why (recorded as the delivery's last error) with --nack or --dead-letter.
    #[arg(long)]
    reason: Option<String>,
}

/// After the first delivery, how long `pull` waits for more before it settles.
const PULL_LINGER: Duration = Duration::from_millis(300);

/// Takes up to `--max` deliveries on a stream of its own, prints them and settles them
/// before the stream closes (closing it gives unsettled deliveries back at once).
pub(crate) async fn pull(target: &Target, args: PullArgs) -> Result<(), CliError> {
    if args.reason.is_some() && !(args.nack || args.dead_letter) {
        return Err(usage("--reason goes with --nack or --dead-letter"));
    }
    let gateway = target.connect(false).await?;
    if let Some(paused) = pause_notice(&gateway, &args.subscription).await {
        return Err(CliError::Failed(paused));
    }
    let mut subscriber = gateway.subscriber();
    let mut stream = subscriber
        .subscribe(proto::SubscribeRequest {
            subscription: args.subscription.clone(),
            max_in_flight: args.max,
            // Settling frees room on the stream: without this it would lease more while
            // the acks are under way, then give them back on closing, each at the cost
            // of an attempt.
            max_deliveries: args.max,
            ..Default::default()
        })
        .await
        .map_err(describe)?
        .into_inner();
    let mut deliveries = Vec::new();
    let mut wait = args.wait;
    while deliveries.len() < args.max as usize {
        match tokio::time::timeout(wait, stream.message()).await {
            Ok(Ok(Some(delivery))) => deliveries.push(delivery),
            Ok(Ok(None)) | Err(_) => break,
            Ok(Err(status)) => return Err(describe(status).into()),
        }
        wait = PULL_LINGER;
    }
    let settlement = if args.ack {
        "acked"
    } else if args.dead_letter {
        "dead-lettered"
    } else if args.nack {
        "nacked"
    } else {
        "released"
    };
    let retry_after = args
        .retry_after
        .and_then(|delay| prost_types::Duration::try_from(delay).ok());
    if args.ack && !deliveries.is_empty() {
        let answer = subscriber
            .ack(proto::AckRequest {
                subscription: args.subscription.clone(),
                ack_ids: deliveries.iter().map(|d| d.ack_id.clone()).collect(),
            })
            .await
            .map_err(describe)?
            .into_inner();
        if !answer.stale_ack_ids.is_empty() || !answer.unavailable_ack_ids.is_empty() {
            return Err(CliError::Failed(format!(
                "{} not acked (lease lost or source unreachable): {}",
                count(
                    (answer.stale_ack_ids.len() + answer.unavailable_ack_ids.len()) as u64,
                    "delivery"
                ),
                [answer.stale_ack_ids, answer.unavailable_ack_ids]
                    .concat()
                    .join(", ")
            )));
        }
    }
    if args.nack || args.dead_letter {
        for delivery in &deliveries {
            subscriber
                .nack(proto::NackRequest {
                    subscription: args.subscription.clone(),
                    ack_id: delivery.ack_id.clone(),
                    reason: args.reason.clone().unwrap_or_default(),
                    retry_after,
                    dead_letter: args.dead_letter,
                })
                .await
                .map_err(describe)?;
        }
    }
    drop(stream);
    for delivery in &deliveries {
        let mut value = render::delivery(delivery);
        value["settled"] = json!(settlement);
        target.print(value, || {
            let event = delivery.event.clone().unwrap_or_default();
            println!(
                "{}  {}  {}/{}  attempt {}  {}  {}",
                event.id,
                event.event_type,
                event.aggregate_type,
                event.aggregate_id,
                delivery.attempt,
                settlement,
                String::from_utf8_lossy(&event.payload)
            );
        });
    }
    if deliveries.is_empty() && !target.json {
        eprintln!(
            "no deliveries within {}",
            humantime::format_duration(args.wait)
        );
    }
    Ok(())
}
