//! After the run: what delivering costs the gateway's own tables when events come in bulk.
//! With every gateway stopped (their sessions flushed their statistics as they ended),
//! one gateway is started again and a subscription of its own drains a burst of events,
//! acking 100 at a time; then it is stopped. Delivery state is kept per claim, so the
//! rows it wrote per event must stay far below the two (an insert and a delete) that a
//! record per event costs. The chaos traffic itself cannot show this: events trickle in,
//! so its claims hold a few events each and cost about what records did.

use std::time::Duration;

use anyhow::{Context, bail};
use outbox_client::proto::{self, admin_client::AdminClient, subscriber_client::SubscriberClient};
use tokio::time::{Instant, timeout};

use crate::{cluster::Cluster, database::Databases};

/// Events in the burst.
const BURST: i64 = 5_000;
/// Most rows the gateway may write in its tables per event of the burst.
pub const MAX_ROW_WRITES_PER_EVENT: f64 = 0.2;
const SUBSCRIPTION: &str = "chaos-bookkeeping";
const EVENT_TYPE: &str = "chaos.bookkeeping";
const DRAIN_LIMIT: Duration = Duration::from_secs(60);

/// Row writes per event of the burst. Every gateway of `cluster` must be stopped; they
/// are stopped again on return.
pub async fn row_writes_per_event(cluster: &Cluster, databases: &Databases) -> anyhow::Result<f64> {
    let before = databases.settled_row_writes().await?;
    cluster.restart(0).await?;
    let drained = drain_burst(cluster, databases).await;
    let problems = cluster.stop_all().await;
    drained?;
    if let Some(problem) = problems.first() {
        bail!(
            "the gateway did not stop after the burst: {}",
            problem.detail
        );
    }
    let written = databases.settled_row_writes().await?.saturating_sub(before);
    Ok(written as f64 / BURST as f64)
}

async fn drain_burst(cluster: &Cluster, databases: &Databases) -> anyhow::Result<()> {
    AdminClient::new(cluster.channel(0))
        .create_subscription(proto::CreateSubscriptionRequest {
            subscription: Some(proto::Subscription {
                name: SUBSCRIPTION.into(),
                event_types: vec![EVENT_TYPE.into()],
                ..Default::default()
            }),
            validate_only: false,
        })
        .await
        .context("cannot create the bookkeeping subscription")?;
    sqlx::query(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'probe', 'p-' || n, $2, '{}' FROM generate_series(1, $1) AS n",
    )
    .bind(BURST)
    .bind(EVENT_TYPE)
    .execute(databases.gateway().pool())
    .await
    .context("cannot insert the burst")?;

    let mut client = SubscriberClient::new(cluster.channel(0));
    let mut stream = client
        .subscribe(proto::SubscribeRequest {
            subscription: SUBSCRIPTION.into(),
            max_in_flight: 1_000,
            ..Default::default()
        })
        .await
        .context("cannot subscribe for the burst")?
        .into_inner();
    let deadline = Instant::now() + DRAIN_LIMIT;
    let (mut acked, mut batch) = (0, Vec::with_capacity(100));
    while acked < BURST {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(Ok(Some(delivery))) = timeout(left, stream.message()).await else {
            bail!("the burst was not drained: {acked} of {BURST} acked");
        };
        batch.push(delivery.ack_id);
        if batch.len() == 100 || acked + batch.len() as i64 == BURST {
            let count = batch.len() as i64;
            let stale = client
                .ack(proto::AckRequest {
                    subscription: SUBSCRIPTION.into(),
                    ack_ids: std::mem::take(&mut batch),
                })
                .await
                .context("cannot ack the burst")?
                .into_inner()
                .stale_ack_ids;
            acked += count - stale.len() as i64;
        }
    }
    Ok(())
}
