//! The record, in the `default` database, of the Subscribe streams each gateway holds:
//! how every replica tells that a pull subscription has no consumer on any gateway.
//! `last_attached_at` only says when a stream was last seen somewhere, so a consumer
//! that left could not be told from one on another replica until that time grew old;
//! this record says when the last stream went, within a poll interval.
//!
//! Each gateway process records under an id of its own, rewrites its record when its
//! streams come or go (looked at every poll interval, at most [`ATTACHED_HEARTBEAT`]),
//! refreshes it every [`ATTACHED_HEARTBEAT`] while it holds any, and removes it when it
//! stops. The record of a gateway that died counts for [`STREAMS_RECORD_LIFETIME`].

use std::{
    collections::HashSet,
    time::{Duration, Instant},
};

use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::{
    delivery::Relay,
    domain::{ATTACHED_HEARTBEAT, STREAMS_RECORD_LIFETIME, SubscriptionId},
    error::Result,
};

/// Keeps this process's record up to date until `stop`, then removes it. `gateway`
/// names the process's record: the same across restarts of this task after a panic, so
/// a restart does not leave a record behind.
pub async fn record(relay: Relay, gateway: Uuid, poll_interval: Duration, stop: CancellationToken) {
    stop.run_until_cancelled(keep_recording(&relay, gateway, poll_interval))
        .await;
    // Its streams have ended (the relay shuts down first): none of them counts any more.
    let definitions = &relay.sources().default_source().store;
    if let Err(error) = definitions.forget_streams(gateway).await {
        tracing::debug!(%error, "cannot remove the record of this gateway's streams");
    }
}

async fn keep_recording(relay: &Relay, gateway: Uuid, poll_interval: Duration) {
    let mut looks = tokio::time::interval(poll_interval.min(ATTACHED_HEARTBEAT));
    looks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut recorded: Option<(Vec<(SubscriptionId, u32)>, Instant)> = None;
    loop {
        looks.tick().await;
        let held = held_streams(relay);
        let due = match &recorded {
            None => true,
            Some((streams, at)) => {
                *streams != held || (!held.is_empty() && at.elapsed() >= ATTACHED_HEARTBEAT)
            }
        };
        if !due {
            continue;
        }
        let definitions = &relay.sources().default_source().store;
        match definitions
            .record_streams(gateway, &held, STREAMS_RECORD_LIFETIME)
            .await
        {
            Ok(()) => recorded = Some((held, Instant::now())),
            // Tried again at the next look: the record differs from what is held.
            Err(error) => tracing::debug!(%error, "cannot record this gateway's streams"),
        }
    }
}

/// The Subscribe streams open in this process, per subscription with any, in id order.
fn held_streams(relay: &Relay) -> Vec<(SubscriptionId, u32)> {
    let mut held: Vec<(SubscriptionId, u32)> = relay
        .stream_counts()
        .into_iter()
        .filter(|(_, streams)| *streams > 0)
        .map(|(id, streams)| (id, u32::try_from(streams).unwrap_or(u32::MAX)))
        .collect();
    held.sort_unstable_by_key(|(id, _)| id.0);
    held
}

/// The subscriptions with a Subscribe stream on any gateway, this one's included:
/// those of its record and those of `relay` not recorded yet.
pub async fn attached_anywhere(relay: &Relay) -> Result<HashSet<SubscriptionId>> {
    let definitions = &relay.sources().default_source().store;
    let mut attached: HashSet<SubscriptionId> = definitions
        .subscriptions_with_streams(STREAMS_RECORD_LIFETIME)
        .await?
        .into_iter()
        .collect();
    attached.extend(relay.attached_subscriptions());
    Ok(attached)
}
