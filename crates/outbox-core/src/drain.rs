//! What push and sink delivery share: the gateway drains such a subscription itself.
//!
//! A drainer is a consumer like any Subscribe stream: it takes deliveries from the relay
//! with leases (so ordering per aggregate, retries, dead letters and sharing the work
//! among gateway replicas are the relay's, unchanged) and settles each one by what its
//! destination answered. [`supervise`] keeps one drainer per such subscription in this
//! process and restarts it when the definition changes; a [`StatusBoard`] holds what
//! this process knows of each one's sends, for stats and the console.

use std::{
    collections::HashMap,
    future::Future,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use chrono::{DateTime, Utc};
use tokio::{sync::mpsc, task::JoinSet};
use tokio_util::sync::CancellationToken;

use crate::{
    delivery::{DeliveryStream, Relay},
    domain::{
        AckId, Delivery, Subscription, SubscriptionId, SubscriptionName, SubscriptionSettings,
    },
    error::Error,
    storage::{Store, StoreError},
    tasks::{RestartDelays, TaskName, keep_running},
};

/// Lease held beyond a send's timeout, for settling after the answer.
const SETTLE_MARGIN: Duration = Duration::from_secs(5);
/// Most acks applied in one statement.
const ACK_BATCH: usize = 500;
/// Wait before retrying to open a drainer's stream after a failure.
const REOPEN_DELAY: Duration = Duration::from_secs(1);

/// What this process knows of a drained subscription's sends.
#[derive(Debug, Clone, PartialEq)]
pub struct DrainStatus {
    pub in_flight: u64,
    /// Push: HTTP status of the last answer (0: none yet, or the last request got none).
    pub last_status: u16,
    /// The last failure: a refusal with its reason, a timeout, a connection error.
    pub last_error: Option<String>,
    pub last_error_at: Option<DateTime<Utc>>,
    /// Requests (push) or messages (sinks) sent.
    pub requests_total: u64,
    /// Of those, how many the destination accepted.
    pub confirmed_total: u64,
    /// Sends per second of the last [`RATE_WINDOW_SECONDS`], by second.
    rate_buckets: [u64; RATE_WINDOW_SECONDS],
    /// The second (since [`RATE_EPOCH`]) of the newest bucket.
    rate_second: u64,
}

impl Default for DrainStatus {
    fn default() -> Self {
        DrainStatus {
            in_flight: 0,
            last_status: 0,
            last_error: None,
            last_error_at: None,
            requests_total: 0,
            confirmed_total: 0,
            rate_buckets: [0; RATE_WINDOW_SECONDS],
            rate_second: rate_now(),
        }
    }
}

const RATE_WINDOW_SECONDS: usize = 60;
static RATE_EPOCH: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);

fn rate_now() -> u64 {
    RATE_EPOCH.elapsed().as_secs()
}

impl DrainStatus {
    /// Moves the window to `second`, emptying the buckets it passes.
    fn advance(&mut self, second: u64) {
        let passed = second.saturating_sub(self.rate_second);
        for step in 1..=passed.min(RATE_WINDOW_SECONDS as u64) {
            self.rate_buckets[((self.rate_second + step) % RATE_WINDOW_SECONDS as u64) as usize] =
                0;
        }
        self.rate_second = self.rate_second.max(second);
    }

    /// Counts one send that got an answer (or failed), accepted or not.
    pub(crate) fn count_send(&mut self, accepted: bool) {
        let second = rate_now();
        self.advance(second);
        self.rate_buckets[(second % RATE_WINDOW_SECONDS as u64) as usize] += 1;
        self.requests_total += 1;
        self.confirmed_total += u64::from(accepted);
    }

    pub(crate) fn failed(&mut self, reason: String) {
        self.last_error = Some(reason);
        self.last_error_at = Some(Utc::now());
    }

    /// Sends per second over the last minute (or since the first send, when that is
    /// more recent).
    pub fn rate(&self) -> f64 {
        let mut current = self.clone();
        current.advance(rate_now());
        let total: u64 = current.rate_buckets.iter().sum();
        let span = (RATE_EPOCH.elapsed().as_secs_f64()).clamp(1.0, RATE_WINDOW_SECONDS as f64);
        total as f64 / span
    }
}

/// What this process knows of its drained subscriptions, by subscription id. Cheap to
/// clone.
#[derive(Clone, Default)]
pub struct StatusBoard {
    inner: Arc<Mutex<HashMap<SubscriptionId, DrainStatus>>>,
}

impl StatusBoard {
    pub fn get(&self, subscription_id: SubscriptionId) -> Option<DrainStatus> {
        self.inner
            .lock()
            .expect("drain statuses lock")
            .get(&subscription_id)
            .cloned()
    }

    pub(crate) fn update(
        &self,
        subscription_id: SubscriptionId,
        change: impl FnOnce(&mut DrainStatus),
    ) {
        change(
            self.inner
                .lock()
                .expect("drain statuses lock")
                .entry(subscription_id)
                .or_default(),
        );
    }
}

/// One kind of drained subscription (push, sinks): which subscriptions want a drainer
/// and how one runs.
pub(crate) trait Drains: Clone + Send + Sync + 'static {
    /// Task names: `"pusher"`, `"sinker"`.
    const TASK: &'static str;

    /// The subscriptions that should have a drainer now.
    fn wanted(
        &self,
        store: &Store,
    ) -> impl Future<Output = Result<Vec<Subscription>, StoreError>> + Send;

    fn board(&self) -> &StatusBoard;

    /// Called on every round for each wanted subscription, running or not.
    fn refresh(&self, _subscription: &Subscription) {}

    /// Drops what this process keeps of a subscription it no longer drains, besides its
    /// status: what was sent and the last answer stay to be seen (a push stopped by a
    /// 410 still shows that answer), and counting goes on if draining starts again.
    fn forget(&self, _subscription_id: SubscriptionId) {}

    /// Drains the subscription until `stop`, or until its stream ends (on a clone).
    fn drain(
        self,
        subscription: Arc<Subscription>,
        stop: CancellationToken,
    ) -> impl Future<Output = ()> + Send + 'static;
}

/// A running drainer.
struct Running {
    settings: SubscriptionSettings,
    stop: CancellationToken,
    /// Tells this drainer from an earlier one of the same subscription when it ends.
    generation: u64,
}

/// Keeps one drainer per subscription `drains` wants, re-reading the definitions when
/// one changes here, and every `poll_interval` for changes made elsewhere.
pub(crate) async fn supervise<D: Drains>(relay: Relay, drains: D, poll_interval: Duration) {
    let shutdown = relay.stopping();
    let mut definitions = relay.watch_definitions();
    let mut running: HashMap<SubscriptionId, Running> = HashMap::new();
    let mut drainers = JoinSet::new();
    let mut generations = 0u64;
    loop {
        let store = &relay.sources().default_source().store;
        match drains.wanted(store).await {
            Ok(subscriptions) => {
                let wanted: HashMap<SubscriptionId, Subscription> = subscriptions
                    .into_iter()
                    .map(|subscription| (subscription.id, subscription))
                    .collect();
                running.retain(|id, drainer| {
                    let keep = wanted
                        .get(id)
                        .is_some_and(|subscription| subscription.settings == drainer.settings);
                    if !keep {
                        drainer.stop.cancel();
                        drains.forget(*id);
                    }
                    keep
                });
                for (id, subscription) in wanted {
                    drains.refresh(&subscription);
                    if running.contains_key(&id) {
                        continue;
                    }
                    let stop = shutdown.child_token();
                    generations += 1;
                    let generation = generations;
                    running.insert(
                        id,
                        Running {
                            settings: subscription.settings.clone(),
                            stop: stop.clone(),
                            generation,
                        },
                    );
                    let subscription = Arc::new(subscription);
                    let start = {
                        let (drains, subscription, stop) =
                            (drains.clone(), subscription.clone(), stop.clone());
                        move || drains.clone().drain(subscription.clone(), stop.clone())
                    };
                    // Shown as the last error, where the API and the console show why
                    // sending fails.
                    let board = drains.board().clone();
                    let on_panic = move |message: &str| {
                        board.update(id, |status| {
                            status.failed(format!(
                                "the {} panicked and restarts: {message}",
                                D::TASK
                            ));
                        });
                    };
                    drainers.spawn(async move {
                        let name = TaskName {
                            task: D::TASK,
                            name: subscription.name.as_str(),
                        };
                        keep_running(name, RestartDelays::default(), stop, start, on_panic).await;
                        (id, generation)
                    });
                }
            }
            Err(error) => {
                tracing::debug!(%error, task = D::TASK, "cannot read the subscriptions to drain")
            }
        }
        // A drainer that ended by itself (its stream closed, or pushing stopped) is
        // forgotten, so the next round starts a new one if the subscription still wants it.
        while let Some(ended) = drainers.try_join_next() {
            match ended {
                Ok((id, generation)) => {
                    if running
                        .get(&id)
                        .is_some_and(|drainer| drainer.generation == generation)
                    {
                        running.remove(&id);
                    }
                }
                // keep_running catches the drainer's panics; this is only for the record.
                Err(error) => tracing::error!(%error, task = D::TASK, "a drainer task failed"),
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = definitions.changed() => {}
            _ = tokio::time::sleep(poll_interval) => {}
        }
    }
    for drainer in running.values() {
        drainer.stop.cancel();
    }
    while drainers.join_next().await.is_some() {}
}

/// Opens the delivery stream a drainer takes its deliveries from, holding at most
/// `max_in_flight` unsettled, retrying every [`REOPEN_DELAY`] while it cannot; `None`
/// when stopped, shutting down, or the subscription is gone.
pub(crate) async fn open_stream(
    relay: &Relay,
    name: &SubscriptionName,
    max_in_flight: u32,
    stop: &CancellationToken,
) -> Option<DeliveryStream> {
    loop {
        match relay.subscribe_for_drain(name, max_in_flight).await {
            Ok(stream) => return Some(stream),
            Err(Error::NotFound(_) | Error::ShuttingDown) => return None,
            Err(error) => {
                tracing::warn!(subscription = %name, %error, "cannot open the delivery stream to drain; retrying");
                tokio::select! {
                    _ = stop.cancelled() => return None,
                    _ = tokio::time::sleep(REOPEN_DELAY) => {}
                }
            }
        }
    }
}

/// Makes sure the delivery's lease outlasts a send of up to `timeout` and its
/// settlement. False when the lease already ran out while the delivery waited: it is
/// someone else's now (or will be), so sending it would only duplicate.
pub(crate) async fn hold_lease(
    relay: &Relay,
    name: &SubscriptionName,
    delivery: &Delivery,
    timeout: Duration,
) -> bool {
    hold_leases(relay, name, std::slice::from_ref(delivery), timeout).await[0]
}

/// [`hold_lease`] for the deliveries of one request, extended in one call: whether each
/// is still held.
pub(crate) async fn hold_leases(
    relay: &Relay,
    name: &SubscriptionName,
    deliveries: &[Delivery],
    timeout: Duration,
) -> Vec<bool> {
    let needed = timeout + SETTLE_MARGIN;
    let held_until = Utc::now() + needed;
    let short: Vec<AckId> = deliveries
        .iter()
        .filter(|delivery| delivery.ack_deadline < held_until)
        .map(|delivery| delivery.ack_id)
        .collect();
    let mut held = vec![true; deliveries.len()];
    if short.is_empty() {
        return held;
    }
    // Boxed: the store's future is large, and rarely needed; inline, it would be
    // copied with every send future a drainer starts.
    match Box::pin(relay.extend(name, &short, needed)).await {
        Ok(stale) => {
            for (held, delivery) in held.iter_mut().zip(deliveries) {
                *held = !stale.contains(&delivery.ack_id);
            }
        }
        Err(error) => {
            tracing::debug!(subscription = %name, %error, "cannot extend a drained delivery's lease");
        }
    }
    held
}

/// A send task's panic is its drainer's: raised again there, so the drainer restarts
/// (and says so) instead of losing a slot and its in-flight count quietly.
pub(crate) fn reraise_panic(done: Result<(), tokio::task::JoinError>) {
    if let Err(error) = done
        && error.is_panic()
    {
        std::panic::resume_unwind(error.into_panic());
    }
}

/// Acks what the destination accepted, as many at a time as have piled up meanwhile,
/// until the drainer's sends are all done.
pub(crate) async fn send_acks(
    relay: Relay,
    name: SubscriptionName,
    mut accepted: mpsc::UnboundedReceiver<AckId>,
) {
    let mut batch = Vec::with_capacity(ACK_BATCH);
    while accepted.recv_many(&mut batch, ACK_BATCH).await > 0 {
        match relay.ack(&name, &batch).await {
            Ok(outcome) if !outcome.stale.is_empty() || !outcome.unavailable.is_empty() => {
                tracing::debug!(subscription = %name, stale = outcome.stale.len(), unavailable = outcome.unavailable.len(), "some acks of sent events were not applied; those events are sent again");
            }
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(subscription = %name, %error, "cannot ack sent events; their leases will expire and they are sent again");
            }
        }
        batch.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_counts_the_last_minute() {
        let mut status = DrainStatus::default();
        for index in 0..30 {
            status.count_send(index % 3 != 0);
        }
        assert_eq!(status.requests_total, 30);
        assert_eq!(status.confirmed_total, 20);
        assert!(status.rate() > 0.0);
        // A minute later the window is empty again.
        status.advance(rate_now() + RATE_WINDOW_SECONDS as u64);
        assert_eq!(status.rate_buckets.iter().sum::<u64>(), 0);
        assert_eq!(status.requests_total, 30);
    }
}
