//! Background maintenance of every source: brings read positions up to date with the
//! subscription definitions, deletes subscriptions unused past their `expire_after_idle`,
//! reclaims expired leases and enforces retention (of events, and of the consumption
//! records of events gone) on a timer, and vacuums the delivery
//! tables as soon as enough settlements have left dead rows in them. Safe with several
//! gateways: no step waits for another gateway doing the same.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::{
    delivery::Relay,
    domain::{Subscription, SubscriptionId},
    error::Error,
    sources::Source,
    subscriptions::Subscriptions,
};

/// Most batches one pass deletes, so a pass stays short; the next pass goes on.
const MAX_BATCHES_PER_PASS: usize = 100;

#[derive(Debug, Clone)]
pub struct MaintenanceConfig {
    pub enabled: bool,
    pub interval: Duration,
    /// Events older than this are deleted once no subscription needs them.
    pub retention: Duration,
    /// Events older than this are deleted whatever their state; `None`: never.
    pub max_retention: Option<Duration>,
    pub batch_size: usize,
    /// How often the delivery table's dead rows are counted, and how many make it worth
    /// a vacuum. At tens of thousands of acks a second a vacuum then clears a few
    /// hundred thousand rows, in well under a second; at a trickle it runs rarely.
    pub vacuum_check_interval: Duration,
    pub vacuum_min_dead_rows: i64,
}

impl Default for MaintenanceConfig {
    fn default() -> Self {
        MaintenanceConfig {
            enabled: true,
            interval: Duration::from_secs(30),
            retention: Duration::from_secs(72 * 60 * 60),
            max_retention: None,
            batch_size: 1000,
            vacuum_check_interval: Duration::from_secs(5),
            vacuum_min_dead_rows: 20_000,
        }
    }
}

/// Runs maintenance passes over every reachable source until `shutdown`.
pub async fn run(
    relay: Relay,
    subscriptions: Subscriptions,
    config: MaintenanceConfig,
    shutdown: CancellationToken,
) {
    if !config.enabled {
        return;
    }
    let mut passes = tokio::time::interval(config.interval);
    let mut vacuum_checks = tokio::time::interval(config.vacuum_check_interval);
    for timer in [&mut passes, &mut vacuum_checks] {
        timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    }
    loop {
        tokio::select! {
            _ = passes.tick() => {
                match expire_unused(&relay, &subscriptions).await {
                    Ok(()) => {}
                    Err(error) if lost_connection(&error) => tracing::debug!(%error, "expiring unused subscriptions failed"),
                    Err(error) => tracing::warn!(%error, "expiring unused subscriptions failed; retrying at the next interval"),
                }
                for source in relay.sources().iter().filter(|source| source.is_connected()) {
                    match pass(source, &relay, &subscriptions, &config).await {
                        Ok(()) => {}
                        Err(error) if lost_connection(&error) => tracing::debug!(source = %source.name, %error, "maintenance pass failed"),
                        Err(error) => tracing::warn!(source = %source.name, %error, "maintenance pass failed; retrying at the next interval"),
                    }
                }
            }
            _ = vacuum_checks.tick() => {
                for source in relay.sources().iter().filter(|source| source.is_connected()) {
                    match source.store.vacuum_deliveries(config.vacuum_min_dead_rows).await {
                        Ok(Some(dead_rows)) => tracing::debug!(source = %source.name, dead_rows, "vacuumed the delivery table"),
                        Ok(None) => {}
                        // A lost connection is logged once, by the health monitor.
                        Err(error) if error.is_unavailable() => tracing::debug!(source = %source.name, %error, "vacuuming the delivery table failed"),
                        Err(error) => tracing::warn!(source = %source.name, %error, "vacuuming the delivery table failed"),
                    }
                }
            }
            _ = shutdown.cancelled() => return,
        }
    }
}

/// A failure because a database went away: the health monitor logs that once.
fn lost_connection(error: &Error) -> bool {
    matches!(error, Error::Unavailable(_) | Error::SourceUnavailable(_))
}

/// Deletes the subscriptions whose `expire_after_idle` has passed with no stream
/// attached anywhere.
async fn expire_unused(relay: &Relay, subscriptions: &Subscriptions) -> Result<(), Error> {
    if !relay.sources().default_source().is_connected() {
        return Ok(());
    }
    let attached_here = relay.attached_subscriptions();
    let definitions = &relay.sources().default_source().store;
    for name in definitions.idle_expired(&attached_here).await? {
        match subscriptions.delete(&name).await {
            Ok(()) => {
                tracing::info!(subscription = %name, "deleted a subscription unused for longer than its expire_after_idle");
            }
            // Another gateway deleted it first.
            Err(Error::NotFound(_)) => {}
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

/// One maintenance pass over one source: bring its read positions up to date with the
/// definitions, reclaim expired leases, then retention.
pub async fn pass(
    source: &Source,
    relay: &Relay,
    subscriptions: &Subscriptions,
    config: &MaintenanceConfig,
) -> Result<(), Error> {
    // Before retention: a subscription that has not started reading this source yet
    // still needs its events.
    subscriptions.reconcile(source).await?;
    let store = &source.store;
    let mut reclaimed = 0;
    let reading: Vec<Subscription> = subscriptions
        .list()
        .await?
        .into_iter()
        .filter(|subscription| subscription.reads(&source.name))
        .collect();
    // One statement finds the few with expired leases, rather than a transaction for
    // every subscription, most of which have none.
    let ids: Vec<SubscriptionId> = reading.iter().map(|subscription| subscription.id).collect();
    let expired = store.subscriptions_with_expired_leases(&ids).await?;
    for subscription in reading.iter().filter(|s| expired.contains(&s.id)) {
        let outcome = store
            .reclaim_expired_leases(subscription)
            .await?
            .unwrap_or_default();
        reclaimed += outcome.leases;
        if outcome.leases > 0 {
            relay.due(subscription.id, source.id);
        }
        if outcome.dead_lettered > 0 {
            crate::metrics::dead_lettered(
                subscription.name.as_str(),
                source.name.as_str(),
                outcome.dead_lettered,
            );
        }
    }
    if reclaimed > 0 {
        tracing::info!(source = %source.name, reclaimed, "reclaimed expired leases");
    }

    let mut deleted = 0;
    for _ in 0..MAX_BATCHES_PER_PASS {
        let Some(batch) = store
            .delete_retired_events(config.retention, config.batch_size)
            .await?
        else {
            break;
        };
        deleted += batch;
        if batch < config.batch_size as u64 {
            break;
        }
    }
    if deleted > 0 {
        tracing::info!(source = %source.name, deleted, retention = ?config.retention, "deleted events past retention");
    }

    if let Some(max_retention) = config.max_retention {
        let (mut deleted, mut still_needed) = (0, 0);
        for _ in 0..MAX_BATCHES_PER_PASS {
            let Some(batch) = store
                .force_expire_events(max_retention, config.batch_size)
                .await?
            else {
                break;
            };
            deleted += batch.deleted;
            still_needed += batch.still_needed;
            if batch.deleted < config.batch_size as u64 {
                break;
            }
        }
        if still_needed > 0 {
            tracing::warn!(
                source = %source.name,
                deleted,
                still_needed,
                ?max_retention,
                "maximum retention deleted events that subscriptions had not finished"
            );
        } else if deleted > 0 {
            tracing::info!(
                source = %source.name,
                deleted,
                ?max_retention,
                "deleted events past the maximum retention"
            );
        }
    }
    forget_consumptions_of_deleted_events(source, relay, config).await
}

/// Deletes the `outbox_consume` records, in every source (a consumer's database can be
/// any of them), of this source's events that are gone from its outbox: such an event
/// can never be delivered again, so its record has nothing left to deduplicate.
async fn forget_consumptions_of_deleted_events(
    source: &Source,
    relay: &Relay,
    config: &MaintenanceConfig,
) -> Result<(), Error> {
    let first = source
        .store
        .first_retained_position()
        .await
        .map_err(|error| source.error(error))?;
    for consumers in relay.sources().iter().filter(|s| s.is_connected()) {
        let mut deleted = 0;
        for _ in 0..MAX_BATCHES_PER_PASS {
            let batch = consumers
                .store
                .delete_consumptions_before(&source.name, first, config.batch_size)
                .await
                .map_err(|error| consumers.error(error))?;
            deleted += batch;
            if batch < config.batch_size as u64 {
                break;
            }
        }
        if deleted > 0 {
            tracing::info!(source = %consumers.name, event_source = %source.name, deleted, "deleted consumption records of events no longer retained");
        }
    }
    Ok(())
}
