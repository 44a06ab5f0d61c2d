//! Wake-ups between processes. NOTIFY is only a hint — the dispatchers' poll is the
//! source of truth — so both directions coalesce freely and never block a publisher.
//!
//! Two kinds of news travel between gateways: events were committed (wake the
//! dispatchers), and leases of a subscription were settled on another gateway than the
//! one that handed them out (behind a load balancer, the common case): the dispatcher
//! that holds them then re-reads which of its leases are still live, so its streams get
//! their room back at once instead of at the lease deadline.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::Relay;
use crate::{
    domain::SubscriptionId,
    sources::Source,
    storage::{Notice, Settled, Store},
    tasks::SubsystemTasks,
};

const PEER_NOTIFY_INTERVAL: Duration = Duration::from_millis(5);
const LISTENER_RETRY_MIN: Duration = Duration::from_millis(100);
const LISTENER_RETRY_MAX: Duration = Duration::from_secs(10);

/// Sends the notifications requested while the previous ones were on their way in one
/// statement, outside the publishing transactions (a NOTIFY serializes commits), and at
/// most once per `PEER_NOTIFY_INTERVAL`: a lone publish or settlement is announced at
/// once, while under load peers hear within the interval instead of the gateway
/// spending a statement per call on them.
pub(super) struct PeerNotifier {
    requested: Arc<Notify>,
    pending: Arc<Mutex<Pending>>,
}

#[derive(Default)]
struct Pending {
    events: bool,
    /// By subscription id.
    settled: HashMap<SubscriptionId, Settled>,
}

impl PeerNotifier {
    pub(super) fn start(store: Store, tasks: &SubsystemTasks, shutdown: CancellationToken) -> Self {
        let requested = Arc::new(Notify::new());
        let pending = Arc::new(Mutex::new(Pending::default()));
        let (wake, news) = (requested.clone(), pending.clone());
        tasks.spawn(async move {
            loop {
                tokio::select! {
                    _ = wake.notified() => {}
                    _ = shutdown.cancelled() => return,
                }
                let Pending { events, settled } =
                    std::mem::take(&mut *news.lock().expect("notifier lock"));
                let settled: Vec<Settled> = settled.into_values().collect();
                let sent = tokio::time::Instant::now();
                if let Err(error) = store.notify_listeners(events, &settled).await {
                    tracing::debug!(%error, "could not notify other gateways; they will poll");
                }
                tokio::select! {
                    _ = tokio::time::sleep_until(sent + PEER_NOTIFY_INTERVAL) => {}
                    _ = shutdown.cancelled() => return,
                }
            }
        });
        PeerNotifier { requested, pending }
    }

    /// Announces committed events.
    pub(super) fn events(&self) {
        self.pending.lock().expect("notifier lock").events = true;
        // notify_one keeps one permit when the task is busy: requests coalesce.
        self.requested.notify_one();
    }

    /// Announces that leases of a subscription were settled here for another gateway;
    /// announcements waiting to be sent are merged.
    pub(super) fn settled(&self, settled: Settled) {
        let mut pending = self.pending.lock().expect("notifier lock");
        match pending.settled.entry(settled.subscription_id) {
            std::collections::hash_map::Entry::Vacant(entry) => {
                entry.insert(settled);
            }
            std::collections::hash_map::Entry::Occupied(mut entry) => {
                let waiting = entry.get_mut();
                waiting.made_due |= settled.made_due;
                waiting.leases = match (waiting.leases.take(), settled.leases) {
                    (Some(mut leases), Some(more))
                        if leases.len() + more.len() <= Settled::MAX_NAMED_LEASES =>
                    {
                        leases.extend(more);
                        Some(leases)
                    }
                    _ => None,
                };
            }
        }
        drop(pending);
        self.requested.notify_one();
    }
}

/// Listens for the notifications of direct writers and other gateways on one source,
/// re-connecting with backoff. New events wake the dispatchers for that source; a
/// settlement notice makes that subscription's dispatcher forget or re-read its leases
/// there; a re-connect (notifications may have been missed) does both for all.
pub(super) fn spawn_listener(
    relay: Relay,
    source: Arc<Source>,
    tasks: &SubsystemTasks,
    shutdown: CancellationToken,
) {
    tasks.spawn(async move {
        let mut retry_delay = LISTENER_RETRY_MIN;
        loop {
            let connected = tokio::select! {
                connected = source.store.listen() => connected,
                _ = shutdown.cancelled() => return,
            };
            let mut listener = match connected {
                Ok(listener) => {
                    tracing::debug!(source = %source.name, "listening for outbox notifications");
                    retry_delay = LISTENER_RETRY_MIN;
                    relay.missed_notifications(source.id);
                    listener
                }
                Err(error) => {
                    // The source's health check reports the outage (once); this only
                    // retries.
                    tracing::debug!(source = %source.name, %error, retry_in = ?retry_delay, "cannot listen for outbox notifications");
                    tokio::select! {
                        _ = tokio::time::sleep(retry_delay) => {}
                        _ = shutdown.cancelled() => return,
                    }
                    retry_delay = (retry_delay * 2).min(LISTENER_RETRY_MAX);
                    continue;
                }
            };
            loop {
                let received = tokio::select! {
                    received = listener.next() => received,
                    _ = shutdown.cancelled() => return,
                };
                match received {
                    Ok(Notice::Events) => {
                        crate::metrics::wakeup("notify");
                        relay.wake(source.id);
                    }
                    Ok(Notice::Settled(settled)) => relay.settled_elsewhere(source.id, settled),
                    Ok(Notice::Consumed) => relay.consumed(source.id),
                    Ok(Notice::Reconnected) => relay.missed_notifications(source.id),
                    Err(error) => {
                        tracing::debug!(source = %source.name, %error, "outbox notification connection lost");
                        break;
                    }
                }
            }
        }
    });
}
