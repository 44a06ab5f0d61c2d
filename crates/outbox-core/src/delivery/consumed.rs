//! Settles what consumers recorded with `outbox_consume` in their own transactions.
//!
//! A consumer's database is one of the sources. When a consuming transaction commits, its
//! NOTIFY wakes this source's settler (a periodic poll is the safety net), which reads the
//! committed records whose delivery is not settled yet and acks them as an Ack call would,
//! in whichever source the events came from. The records are locked while that happens,
//! so gateways sharing the database split them rather than settle each one twice. An ack
//! id that is stale by then (the consumer's stream closed, or its lease expired, before
//! the commit was seen) still settles its event, whatever lease it is on now: the event
//! was consumed. A redelivery that got out meanwhile is found consumed by its consumer
//! (`outbox_consume` returns false and records its ack id), and is settled in turn.

use std::{
    collections::{BTreeMap, HashSet},
    sync::Arc,
};

use tokio::sync::Notify;

use super::Relay;
use crate::{
    domain::{AckId, SourceId},
    error::{Error, Result},
    sources::Source,
    storage::{Consumption, UnsettledConsumptions},
};

/// Most records settled in one round; a full round is followed by another at once.
const ROUND: usize = 1000;

/// Settles the consumptions recorded in `source` whenever `wake` is notified or the
/// poll interval passes, until the relay shuts down.
pub(super) async fn run(relay: Relay, source: Arc<Source>, wake: Arc<Notify>) {
    let poll_interval = relay.inner.config.poll_interval;
    loop {
        tokio::select! {
            _ = wake.notified() => {}
            _ = tokio::time::sleep(poll_interval) => {}
            _ = relay.inner.shutdown.cancelled() => return,
        }
        if !source.is_connected() {
            continue;
        }
        loop {
            match settle_round(&relay, &source).await {
                Ok(settled) if settled == ROUND => {}
                Ok(_) => break,
                Err(error) => {
                    tracing::debug!(source = %source.name, %error, "settling consumptions failed; retrying at the next wake-up");
                    break;
                }
            }
        }
    }
}

/// Settles up to [`ROUND`] records; how many were read.
async fn settle_round(relay: &Relay, source: &Source) -> Result<usize> {
    let Some(unsettled) = source
        .store
        .unsettled_consumptions(ROUND)
        .await
        .map_err(|error| source.error(error))?
    else {
        return Ok(0);
    };
    let read = unsettled.consumptions.len();
    match settle(relay, &unsettled).await {
        Ok(done) => unsettled
            .settled(&done)
            .await
            .map_err(|error| source.error(error))?,
        Err(error) => {
            if let Err(rollback) = unsettled.abandon().await {
                tracing::debug!(error = %rollback, "could not let unsettled consumptions go");
            }
            return Err(error);
        }
    }
    Ok(read)
}

/// Acks the recorded deliveries, per subscription; the records done with: settled,
/// stale, or of a subscription or source that no longer exists. Those of a source that
/// cannot be reached stay for a later round.
async fn settle(relay: &Relay, unsettled: &UnsettledConsumptions) -> Result<Vec<Consumption>> {
    let mut by_subscription: BTreeMap<_, Vec<&Consumption>> = BTreeMap::new();
    for consumption in &unsettled.consumptions {
        by_subscription
            .entry(consumption.subscription_id)
            .or_default()
            .push(consumption);
    }
    let sources = relay.sources();
    let mut done = Vec::new();
    for (subscription_id, consumptions) in by_subscription {
        let Some(subscription) = relay.subscription_by_id(subscription_id).await? else {
            done.extend(consumptions.into_iter().cloned());
            continue;
        };
        let mut acks = Vec::with_capacity(consumptions.len());
        for consumption in consumptions {
            match AckId::parse(&consumption.ack_id, |name| sources.id_of(name)) {
                Some(ack) => acks.push((ack, consumption)),
                // Of a source this gateway does not have (any more).
                None => done.push(consumption.clone()),
            }
        }
        let ids: Vec<AckId> = acks.iter().map(|(ack, _)| *ack).collect();
        let outcome = relay.ack_subscription(&subscription, &ids).await?;
        // Stale: settled whatever their lease, since the consumption committed.
        let mut stale: BTreeMap<SourceId, Vec<i64>> = BTreeMap::new();
        for ack in &outcome.stale {
            stale.entry(ack.source).or_default().push(ack.position);
        }
        let mut unavailable: HashSet<SourceId> =
            outcome.unavailable.iter().map(|ack| ack.source).collect();
        for (source_id, positions) in stale {
            let Some(source) = sources.get(source_id) else {
                continue;
            };
            match relay
                .settle_consumed(&subscription, source, &positions)
                .await
            {
                Ok(_) => {}
                Err(Error::SourceUnavailable(_)) => {
                    unavailable.insert(source_id);
                }
                Err(error) => return Err(error),
            }
        }
        done.extend(
            acks.into_iter()
                .filter(|(ack, _)| !unavailable.contains(&ack.source))
                .map(|(_, consumption)| consumption.clone()),
        );
    }
    Ok(done)
}
