//! The relay: hands committed events to Subscribe streams and settles their deliveries.
//!
//! Each gateway process runs one [`dispatcher`] per subscription that has streams
//! attached here. The dispatcher claims work for all of them at once (batched claims
//! sized by their free room) and spreads it over them; several processes compete for
//! the same subscription through the database, never through memory. Wake-ups come from
//! this process's own Publish calls, from PostgreSQL NOTIFY (direct writers and other
//! gateways, see [`wake`]) and from a periodic poll, the safety net.

mod dispatcher;
mod flow;
mod stream;
mod wake;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use chrono::{DateTime, Utc};
use tokio::sync::watch;
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use dispatcher::{Dispatcher, Settlement};
use flow::{BufferBudget, StreamLimits};
pub use stream::DeliveryStream;

use crate::{
    domain::{AckId, MAX_BACKOFF, Subscription, SubscriptionName, check_text},
    error::{Error, Result},
    metrics,
    storage::{NackOutcome, Settled, Store},
};

/// Relay settings; see the configuration reference.
#[derive(Debug, Clone)]
pub struct DeliveryConfig {
    /// Safety-net poll when no wake-up arrives.
    pub poll_interval: Duration,
    /// `max_in_flight` of a Subscribe call that leaves it 0.
    pub default_max_in_flight: u32,
    /// Largest `max_in_flight` a Subscribe call may ask for.
    pub max_in_flight_limit: u32,
    /// `max_in_flight_bytes` of a Subscribe call that leaves it 0.
    pub default_max_in_flight_bytes: u64,
    /// Largest `max_in_flight_bytes` a Subscribe call may ask for.
    pub max_in_flight_bytes_limit: u64,
    /// Most bytes of deliveries held in memory for Subscribe streams that have not read
    /// them yet, across all streams.
    pub max_buffered_bytes: u64,
    /// Most deliveries one claim leases.
    pub claim_batch_size: usize,
    /// Most Subscribe streams open at once in this process.
    pub max_streams: usize,
}

impl Default for DeliveryConfig {
    fn default() -> Self {
        DeliveryConfig {
            poll_interval: Duration::from_secs(1),
            default_max_in_flight: 100,
            max_in_flight_limit: 10_000,
            default_max_in_flight_bytes: 16 * 1024 * 1024,
            max_in_flight_bytes_limit: 256 * 1024 * 1024,
            max_buffered_bytes: 256 * 1024 * 1024,
            claim_batch_size: 500,
            max_streams: 10_000,
        }
    }
}

/// Longest nack reason kept.
const MAX_REASON_BYTES: usize = 4096;

/// Longest lease extension a consumer may ask for.
pub const MAX_EXTENSION: Duration = crate::domain::MAX_ACK_DEADLINE;

/// Handle to the relay; cheap to clone.
#[derive(Clone)]
pub struct Relay {
    inner: Arc<RelayInner>,
}

struct RelayInner {
    store: Store,
    config: DeliveryConfig,
    /// Bumped whenever new events may have committed.
    new_events: watch::Sender<u64>,
    /// Dispatchers of this process by subscription id.
    dispatchers: Mutex<HashMap<i64, Arc<Dispatcher>>>,
    shutdown: CancellationToken,
    tasks: TaskTracker,
    peer_notifier: wake::PeerNotifier,
    /// One permit per open Subscribe stream.
    stream_permits: Arc<tokio::sync::Semaphore>,
    /// Deliveries waiting in memory for their streams, across all subscriptions.
    buffer_budget: Arc<BufferBudget>,
}

impl Relay {
    /// Starts the relay's background tasks: the NOTIFY listener and the notifier that
    /// tells other gateways about this one's publishes.
    pub fn start(store: Store, config: DeliveryConfig) -> Relay {
        let (new_events, _) = watch::channel(0);
        let shutdown = CancellationToken::new();
        let tasks = TaskTracker::new();
        let peer_notifier = wake::PeerNotifier::start(store.clone(), &tasks, shutdown.clone());
        let relay = Relay {
            inner: Arc::new(RelayInner {
                store,
                new_events,
                dispatchers: Mutex::new(HashMap::new()),
                shutdown,
                tasks,
                peer_notifier,
                stream_permits: Arc::new(tokio::sync::Semaphore::new(config.max_streams)),
                buffer_budget: Arc::new(BufferBudget::new(config.max_buffered_bytes)),
                config,
            }),
        };
        wake::spawn_listener(
            relay.clone(),
            relay.inner.store.clone(),
            &relay.inner.tasks,
            relay.inner.shutdown.clone(),
        );
        relay
    }

    /// Events were committed by this process: wake local dispatchers now and tell the
    /// other gateways with one coalesced notification.
    pub fn events_committed(&self) {
        metrics::wakeup("publish");
        self.wake_all();
        self.inner.peer_notifier.events();
    }

    /// Makes every local dispatcher look for work.
    pub fn wake_all(&self) {
        self.inner
            .new_events
            .send_modify(|generation| *generation += 1);
    }

    /// Another gateway settled leases of the subscription: if they were this process's,
    /// its dispatcher learns at once that their room is free again.
    fn settled_elsewhere(&self, settled: Settled) {
        if let Some(dispatcher) = self.dispatcher(settled.subscription_id) {
            dispatcher.settled_elsewhere(settled.made_due, settled.leases.as_deref());
        }
    }

    /// Notifications may have been lost (the LISTEN connection was re-established): look
    /// for new events and re-read every lease.
    fn missed_notifications(&self) {
        let dispatchers: Vec<Arc<Dispatcher>> = self
            .inner
            .dispatchers
            .lock()
            .expect("dispatchers lock")
            .values()
            .cloned()
            .collect();
        for dispatcher in dispatchers {
            dispatcher.settled_elsewhere(true, None);
        }
        self.wake_all();
    }

    /// Tells the dispatcher of the subscription in this process about settled
    /// deliveries, and other gateways about those that were not leased here.
    fn settled(&self, subscription_id: i64, acks: &[AckId], settlement: Settlement) {
        let elsewhere = match self.dispatcher(subscription_id) {
            Some(dispatcher) => dispatcher.settled(acks, settlement),
            None => acks.to_vec(),
        };
        if elsewhere.is_empty() {
            return;
        }
        let leases = (elsewhere.len() <= Settled::MAX_NAMED_LEASES).then(|| {
            elsewhere
                .iter()
                .map(|ack| (ack.position, ack.lease_token))
                .collect()
        });
        self.inner.peer_notifier.settled(Settled {
            subscription_id,
            made_due: matches!(settlement, Settlement::Nacked { .. }),
            leases,
        });
    }

    /// Opens a delivery stream on the subscription that holds at most `max_in_flight`
    /// unsettled deliveries and, beyond its first, `max_in_flight_bytes` of them (0: the
    /// configured defaults).
    pub async fn subscribe(
        &self,
        name: &SubscriptionName,
        max_in_flight: u32,
        max_in_flight_bytes: u64,
    ) -> Result<DeliveryStream> {
        let config = &self.inner.config;
        let limits = StreamLimits {
            deliveries: match max_in_flight {
                0 => config.default_max_in_flight,
                n if n > config.max_in_flight_limit => {
                    return Err(Error::invalid(
                        "max_in_flight",
                        format!("must be at most {}, got {n}", config.max_in_flight_limit),
                    ));
                }
                n => n,
            } as usize,
            bytes: match max_in_flight_bytes {
                0 => config.default_max_in_flight_bytes,
                n if n > config.max_in_flight_bytes_limit => {
                    return Err(Error::invalid(
                        "max_in_flight_bytes",
                        format!(
                            "must be at most {}, got {n}",
                            config.max_in_flight_bytes_limit
                        ),
                    ));
                }
                n => n,
            },
        };
        if self.inner.shutdown.is_cancelled() {
            return Err(Error::ShuttingDown);
        }
        let permit = self
            .inner
            .stream_permits
            .clone()
            .try_acquire_owned()
            .map_err(|_| {
                Error::Overloaded(format!(
                    "this gateway already serves {} Subscribe streams; retry later or use another instance",
                    config.max_streams
                ))
            })?;
        let subscription = self.find_subscription(name).await?;
        let mut dispatchers = self.inner.dispatchers.lock().expect("dispatchers lock");
        let permit = match dispatchers.get(&subscription.id) {
            Some(dispatcher) => match dispatcher.attach(limits, permit) {
                Ok(stream) => return Ok(stream),
                // That dispatcher is retiring: start a new one.
                Err(permit) => permit,
            },
            None => permit,
        };
        let dispatcher = Dispatcher::new(
            self.inner.store.clone(),
            self.inner.tasks.clone(),
            subscription,
            self.inner.buffer_budget.clone(),
        );
        let Ok(stream) = dispatcher.attach(limits, permit) else {
            unreachable!("a new dispatcher accepts streams");
        };
        dispatchers.insert(dispatcher.subscription_id(), dispatcher.clone());
        self.inner
            .tasks
            .spawn(dispatcher::run(dispatcher, self.clone()));
        Ok(stream)
    }

    /// Acks deliveries; returns the ack ids that were stale.
    pub async fn ack(&self, name: &SubscriptionName, acks: &[AckId]) -> Result<Vec<AckId>> {
        let subscription = self.find_subscription(name).await?;
        let acked = self.inner.store.ack(&subscription, acks).await?;
        let acked: std::collections::HashSet<i64> = acked.into_iter().collect();
        let (settled, stale): (Vec<AckId>, Vec<AckId>) =
            acks.iter().partition(|ack| acked.contains(&ack.position));
        metrics::acked(name.as_str(), settled.len() as u64);
        if !settled.is_empty() {
            self.settled(subscription.id, &settled, Settlement::Acked);
        }
        if subscription.settings.ordered && !settled.is_empty() {
            // The acks may have released waiting events of their aggregates; the stream
            // that gets them may be on another gateway.
            self.events_committed();
        }
        Ok(stale)
    }

    /// Nacks one delivery; `None` when its lease is stale.
    pub async fn nack(
        &self,
        name: &SubscriptionName,
        ack: AckId,
        reason: &str,
        retry_after: Option<Duration>,
        dead_letter: bool,
    ) -> Result<Option<NackOutcome>> {
        if reason.len() > MAX_REASON_BYTES {
            return Err(Error::invalid(
                "reason",
                format!("must be at most {MAX_REASON_BYTES} bytes"),
            ));
        }
        check_text("reason", reason)?;
        if retry_after.is_some_and(|delay| delay > MAX_BACKOFF) {
            return Err(Error::invalid(
                "retry_after",
                format!(
                    "must be at most {}",
                    humantime::format_duration(MAX_BACKOFF)
                ),
            ));
        }
        let subscription = self.find_subscription(name).await?;
        let delay = retry_after.unwrap_or_else(|| {
            subscription
                .settings
                .backoff(u32::try_from(ack.attempt).unwrap_or(1))
        });
        let outcome = self
            .inner
            .store
            .nack(&subscription, ack, reason, delay, dead_letter)
            .await?;
        if let Some(outcome) = outcome {
            metrics::nacked(name.as_str());
            if outcome.dead_lettered {
                metrics::dead_lettered(name.as_str(), 1);
                if subscription.settings.ordered {
                    self.events_committed();
                }
            }
            self.settled(
                subscription.id,
                &[ack],
                Settlement::Nacked {
                    retry_at: outcome.retry_at,
                },
            );
        }
        Ok(outcome)
    }

    /// Extends leases to `extension` from now; returns the stale ack ids.
    pub async fn extend(
        &self,
        name: &SubscriptionName,
        acks: &[AckId],
        extension: Duration,
    ) -> Result<Vec<AckId>> {
        let subscription = self.find_subscription(name).await?;
        let extended = self
            .inner
            .store
            .extend_leases(subscription.id, acks, extension)
            .await?;
        let deadlines: HashMap<i64, DateTime<Utc>> = extended.into_iter().collect();
        if let Some(dispatcher) = self.dispatcher(subscription.id) {
            dispatcher.extended(acks, &deadlines);
        }
        Ok(acks
            .iter()
            .filter(|ack| !deadlines.contains_key(&ack.position))
            .copied()
            .collect())
    }

    /// Ends every stream, gives their leases back and waits for the relay's tasks.
    pub async fn shutdown(&self) {
        self.inner.shutdown.cancel();
        self.inner.tasks.close();
        self.inner.tasks.wait().await;
    }

    /// The subscription as this process's dispatcher last saw it, or from the database.
    async fn find_subscription(&self, name: &SubscriptionName) -> Result<Subscription> {
        let cached = self
            .inner
            .dispatchers
            .lock()
            .expect("dispatchers lock")
            .values()
            .map(|dispatcher| dispatcher.subscription())
            .find(|subscription| &subscription.name == name);
        if let Some(subscription) = cached {
            return Ok(subscription);
        }
        crate::subscriptions::find(&self.inner.store, name).await
    }

    fn dispatcher(&self, subscription_id: i64) -> Option<Arc<Dispatcher>> {
        self.inner
            .dispatchers
            .lock()
            .expect("dispatchers lock")
            .get(&subscription_id)
            .cloned()
    }
}
