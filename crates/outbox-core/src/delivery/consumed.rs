//! Settles what consumers recorded with `outbox_consume` in their own transactions.
//!
//! A consumer's database is one of the sources. The function queues the delivery's ack id
//! in `outbox_consumed_acks` and NOTIFYs when its transaction commits; that wakes this
//! source's settler (a periodic poll is the safety net; while acks keep coming it polls
//! every few milliseconds instead, and consumers send no NOTIFY), which takes them and
//! acks them as an Ack call would, in whichever source the events came from. It takes
//! them in a transaction that keeps other gateways from taking them too, and that puts
//! back those whose source cannot be reached. An ack id that is stale by then (the
//! consumer's stream closed, or its lease expired, before the commit was seen) still
//! settles its event, whatever lease it is on now: the event was consumed. A redelivery
//! that got out meanwhile is found consumed by its consumer (`outbox_consume` returns
//! false and queues its ack id), and is settled in turn.

use std::{
    collections::{BTreeMap, HashSet},
    sync::Arc,
    time::Duration,
};

use tokio::sync::Notify;

use super::Relay;
use crate::{
    domain::{AckId, SourceId, SubscriptionId},
    error::{Error, Result},
    sources::Source,
    storage::{ConsumedAck, ConsumedAcks},
};

/// Most acks settled in one round; a full round is followed by another at once.
const ROUND: usize = 1000;
/// After a wake-up, how long commits are let gather before a round: at thousands of
/// consuming commits a second, one round settles many rather than one each.
const GATHER: Duration = Duration::from_millis(2);
/// While rounds keep finding acks the settler polls every `GATHER` instead of waiting to
/// be woken, and tells consumers so for this long (renewed halfway): a NOTIFY serializes
/// the commits of the transactions that send one, so consumers send none meanwhile.
const AWAKE: Duration = Duration::from_secs(1);

/// Settles the consumed acks queued in `source` whenever `wake` is notified or the poll
/// interval passes, until the relay shuts down.
pub(super) async fn run(relay: Relay, source: Arc<Source>, wake: Arc<Notify>) {
    let poll_interval = relay.inner.config.poll_interval;
    loop {
        let woken = tokio::select! {
            _ = wake.notified() => true,
            _ = tokio::time::sleep(poll_interval) => false,
            _ = relay.inner.shutdown.cancelled() => return,
        };
        if !source.is_connected() {
            continue;
        }
        if let Err(error) = settle_while_busy(&relay, &source, woken).await {
            tracing::debug!(source = %source.name, %error, "settling consumed deliveries failed; retrying at the next wake-up");
        }
    }
}

/// Settles rounds, polling every `GATHER` while they find acks; then tells consumers
/// to notify again and settles what came meanwhile.
async fn settle_while_busy(relay: &Relay, source: &Source, woken: bool) -> Result<()> {
    if woken {
        tokio::time::sleep(GATHER).await;
    }
    let store = &source.store;
    let mut probe = !woken;
    let mut awake_until: Option<tokio::time::Instant> = None;
    let outcome = loop {
        let taken = match settle_round(relay, source, probe).await {
            Ok(taken) => taken,
            Err(error) => break Err(error),
        };
        probe = false;
        if taken == 0 {
            break Ok(());
        }
        if taken < ROUND {
            let now = tokio::time::Instant::now();
            if awake_until.is_none_or(|until| until - now < AWAKE / 2) {
                store
                    .settler_awake(Some(AWAKE))
                    .await
                    .map_err(|error| source.error(error))?;
                awake_until = Some(now + AWAKE);
            }
            tokio::time::sleep(GATHER).await;
        }
    };
    if awake_until.is_some() {
        store
            .settler_awake(None)
            .await
            .map_err(|error| source.error(error))?;
        // What committed while consumers did not notify.
        while settle_round(relay, source, false).await? == ROUND {}
    }
    outcome
}

/// Settles up to [`ROUND`] queued acks; how many were taken.
async fn settle_round(relay: &Relay, source: &Source, probe: bool) -> Result<usize> {
    let Some(queued) = source
        .store
        .take_consumed_acks(ROUND, probe)
        .await
        .map_err(|error| source.error(error))?
    else {
        return Ok(0);
    };
    let taken = queued.acks.len();
    match settle(relay, &queued).await {
        Ok(retry) => queued
            .settled(&retry)
            .await
            .map_err(|error| source.error(error))?,
        Err(error) => {
            if let Err(rollback) = queued.abandon().await {
                tracing::debug!(error = %rollback, "could not put consumed acks back");
            }
            return Err(error);
        }
    }
    Ok(taken)
}

/// Acks the queued deliveries, per subscription; those to try again later (their source
/// cannot be reached). Acks of a subscription or source that no longer exists are
/// dropped.
async fn settle(relay: &Relay, queued: &ConsumedAcks) -> Result<Vec<ConsumedAck>> {
    let sources = relay.sources();
    let mut by_subscription: BTreeMap<SubscriptionId, Vec<(AckId, &ConsumedAck)>> = BTreeMap::new();
    for queued in &queued.acks {
        // `None`: of a source this gateway does not have (any more).
        if let Some(ack) = AckId::parse(&queued.ack_id, |name| sources.id_of(name)) {
            by_subscription
                .entry(queued.subscription_id)
                .or_default()
                .push((ack, queued));
        }
    }
    let mut retry = Vec::new();
    for (subscription_id, acks) in by_subscription {
        let Some(subscription) = relay.subscription_by_id(subscription_id).await? else {
            continue;
        };
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
                Ok(()) => {}
                Err(Error::SourceUnavailable(_)) => {
                    unavailable.insert(source_id);
                }
                Err(error) => return Err(error),
            }
        }
        retry.extend(
            acks.into_iter()
                .filter(|(ack, _)| unavailable.contains(&ack.source))
                .map(|(_, queued)| queued.clone()),
        );
    }
    Ok(retry)
}
