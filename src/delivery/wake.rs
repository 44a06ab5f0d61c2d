//! Wake-ups between processes. NOTIFY is only a hint — the dispatchers' poll is the
//! source of truth — so both directions coalesce freely and never block a publisher.

use std::{sync::Arc, time::Duration};

use tokio::sync::{Notify, watch};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use crate::storage::Store;

const PEER_NOTIFY_INTERVAL: Duration = Duration::from_millis(5);
const LISTENER_RETRY_MIN: Duration = Duration::from_millis(100);
const LISTENER_RETRY_MAX: Duration = Duration::from_secs(10);

/// Sends one NOTIFY for any number of publishes requested while the previous one was
/// on its way, outside the publishing transactions (a NOTIFY serializes commits), and
/// at most one per `PEER_NOTIFY_INTERVAL`: a lone publish is announced at once, while
/// under load peers hear of new events within the interval instead of the gateway
/// spending a statement per commit on them.
pub(super) struct PeerNotifier {
    requested: Arc<Notify>,
}

impl PeerNotifier {
    pub(super) fn start(store: Store, tasks: &TaskTracker, shutdown: CancellationToken) -> Self {
        let requested = Arc::new(Notify::new());
        let pending = requested.clone();
        tasks.spawn(async move {
            loop {
                tokio::select! {
                    _ = pending.notified() => {}
                    _ = shutdown.cancelled() => return,
                }
                let sent = tokio::time::Instant::now();
                if let Err(error) = store.notify_listeners().await {
                    tracing::debug!(%error, "could not notify other gateways; they will poll");
                }
                tokio::select! {
                    _ = tokio::time::sleep_until(sent + PEER_NOTIFY_INTERVAL) => {}
                    _ = shutdown.cancelled() => return,
                }
            }
        });
        PeerNotifier { requested }
    }

    pub(super) fn request(&self) {
        // notify_one keeps one permit when the task is busy: requests coalesce.
        self.requested.notify_one();
    }
}

/// Listens for the commit-time notifications of direct writers and other gateways,
/// re-connecting with backoff; every notification, and every re-connect (notifications
/// may have been missed), wakes the dispatchers.
pub(super) fn spawn_listener(
    store: Store,
    new_events: watch::Sender<u64>,
    tasks: &TaskTracker,
    shutdown: CancellationToken,
) {
    let wake = move || new_events.send_modify(|generation| *generation += 1);
    tasks.spawn(async move {
        let mut retry_delay = LISTENER_RETRY_MIN;
        loop {
            let connected = tokio::select! {
                connected = store.listen() => connected,
                _ = shutdown.cancelled() => return,
            };
            let mut listener = match connected {
                Ok(listener) => {
                    tracing::debug!("listening for outbox notifications");
                    retry_delay = LISTENER_RETRY_MIN;
                    wake();
                    listener
                }
                Err(error) => {
                    tracing::warn!(%error, retry_in = ?retry_delay, "cannot listen for outbox notifications");
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
                    Ok(_) => {
                        crate::metrics::wakeup("notify");
                        wake();
                    }
                    Err(error) => {
                        tracing::warn!(%error, "outbox notification connection lost");
                        break;
                    }
                }
            }
        }
    });
}
