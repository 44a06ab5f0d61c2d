//! `requeue`: requeue an event on the subscriptions that already settled it.

use serde_json::json;

use outbox_client::proto;

use crate::{Target, count, describe};

#[derive(Debug, clap::Args)]
pub struct RequeueArgs {
    /// The event's id.
    #[arg(long, conflicts_with = "latest", required_unless_present = "latest")]
    id: Option<String>,
    /// Requeue the latest event of --aggregate-type/--aggregate-id with --event-type.
    #[arg(long, requires_all = ["aggregate_type", "aggregate_id", "event_type"])]
    latest: bool,
    /// Aggregate type of the event (with --latest).
    #[arg(long)]
    aggregate_type: Option<String>,
    /// Aggregate id of the event (with --latest).
    #[arg(long)]
    aggregate_id: Option<String>,
    /// Event type of the event (with --latest).
    #[arg(long)]
    event_type: Option<String>,
    /// Only for this subscription (default: every matching one).
    #[arg(long, default_value = "")]
    subscription: String,
    /// Only in this source database (default: the event is looked up in every source).
    #[arg(long, default_value = "")]
    source: String,
    /// Also forget that the subscriptions consumed the event with `outbox_consume`, so
    /// their consumers run it again (by default a redelivery is reported as consumed).
    #[arg(long)]
    forget_consumption: bool,
}

pub(crate) async fn requeue(target: &Target, args: RequeueArgs) -> Result<(), String> {
    let mut admin = target.connect(true).await?.admin();
    let response = match args.id {
        Some(id) => {
            admin
                .requeue_event(proto::RequeueEventRequest {
                    id,
                    subscription: args.subscription,
                    source: args.source,
                    forget_consumption: args.forget_consumption,
                })
                .await
        }
        None => {
            admin
                .requeue_latest(proto::RequeueLatestRequest {
                    aggregate_type: args.aggregate_type.unwrap_or_default(),
                    aggregate_id: args.aggregate_id.unwrap_or_default(),
                    event_type: args.event_type.unwrap_or_default(),
                    subscription: args.subscription,
                    source: args.source,
                    forget_consumption: args.forget_consumption,
                })
                .await
        }
    };
    let requeued = response.map_err(describe)?.into_inner().requeued_count;
    target.print(json!({ "requeued_count": requeued }), || {
        println!("requeued on {}", count(requeued, "subscription"))
    });
    Ok(())
}
