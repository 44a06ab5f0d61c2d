//! The relay: hands committed events to Subscribe streams and settles their deliveries.
//!
//! Each gateway process runs one [`dispatcher`] per subscription that has streams
//! attached here. The dispatcher claims work for all of them at once (batched claims
//! sized by their free room) and spreads it over them; several processes compete for
//! the same subscription through the database, never through memory. Each source's
//! [`scout`] reads what was committed there once for all dispatchers and wakes those it
//! concerns; it reads when this process publishes, on PostgreSQL NOTIFY (direct writers
//! and other gateways, see [`wake`]) and on a periodic poll, the safety net.

mod consumed;
mod dispatcher;
mod flow;
mod scout;
mod stream;
mod wake;

use std::{
    collections::{HashMap, HashSet},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use chrono::{DateTime, Utc};
use tokio::sync::watch;
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use crate::tasks::SubsystemTasks;

use dispatcher::{Dispatcher, Settlement};
use flow::{BufferBudget, StreamLimits, UnprovenClaims};
use futures_util::future::join_all;
pub use stream::{AckWriter, DeliveryStream};

use crate::{
    domain::{
        ATTACHED_HEARTBEAT, AckId, LeaseId, MAX_BACKOFF, SourceId, Subscription, SubscriptionId,
        SubscriptionName, check_text,
    },
    error::{Error, Result},
    metrics,
    sources::{Source, Sources},
    storage::{NackOutcome, Settled},
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
    /// Largest payload a subscription's transform may make: a larger one is
    /// dead-lettered with the reason. The gateway sets it to `--max-payload-bytes` as the
    /// relay starts, so that it never delivers a payload larger than it would accept.
    pub max_payload_bytes: usize,
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
            claim_batch_size: 1000,
            max_streams: 10_000,
            max_payload_bytes: crate::domain::PublishLimits::default().max_payload_bytes,
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
    sources: Sources,
    config: DeliveryConfig,
    /// Bumped whenever a subscription's definition changed here.
    definitions: watch::Sender<u64>,
    /// Per source (by id): its scout, told when new events may have committed there.
    scouts: Vec<Arc<scout::ScoutHandle>>,
    /// Bumped when dispatchers come or go or a filter changes: the scouts look again at
    /// whom they read for.
    audience: Arc<AtomicU64>,
    /// Dispatchers of this process by subscription id.
    dispatchers: Mutex<HashMap<SubscriptionId, Arc<Dispatcher>>>,
    shutdown: CancellationToken,
    tasks: SubsystemTasks,
    /// Per source (by id): tells the other gateways on that database of news here.
    peer_notifiers: Vec<wake::PeerNotifier>,
    /// Per source (by id): wakes its settler of `outbox_consume` records.
    consumption_settlers: Vec<Arc<tokio::sync::Notify>>,
    /// One permit per open Subscribe stream.
    stream_permits: Arc<tokio::sync::Semaphore>,
    /// Deliveries waiting in memory for their streams, across all subscriptions.
    buffer_budget: Arc<BufferBudget>,
    /// Taken by a dispatcher claiming only for streams that have not settled anything.
    unproven_claims: UnprovenClaims,
}

/// What became of the ack ids of one Ack call.
#[derive(Debug, Default)]
pub struct AckOutcome {
    /// Not applied: their lease expired, was taken over, or was settled already.
    pub stale: Vec<AckId>,
    /// Of sources that cannot be reached right now: retry them.
    pub unavailable: Vec<AckId>,
}

/// The ids of `request` that are in `chosen`, in the request's order.
fn in_request_order(request: &[AckId], chosen: &[AckId]) -> Vec<AckId> {
    if chosen.is_empty() {
        return Vec::new();
    }
    let chosen: HashSet<&AckId> = chosen.iter().collect();
    request
        .iter()
        .filter(|ack| chosen.contains(ack))
        .copied()
        .collect()
}

impl Relay {
    /// Starts the relay's background tasks on `tasks`, the process's tracker: per source,
    /// the NOTIFY listener and the notifier that tells other gateways about this one's
    /// news. They stop when `shutdown` is cancelled or [`Relay::shutdown`] is called.
    pub fn start(
        sources: Sources,
        config: DeliveryConfig,
        shutdown: CancellationToken,
        tasks: &TaskTracker,
    ) -> Relay {
        let tasks = SubsystemTasks::on(tasks);
        let peer_notifiers = sources
            .iter()
            .map(|source| wake::PeerNotifier::start(source.store.clone(), &tasks, shutdown.clone()))
            .collect();
        let consumption_settlers = (0..sources.len()).map(|_| Arc::default()).collect();
        let relay = Relay {
            inner: Arc::new(RelayInner {
                scouts: sources.iter().map(|_| Arc::default()).collect(),
                audience: Arc::new(AtomicU64::new(0)),
                sources,
                definitions: watch::channel(0).0,
                dispatchers: Mutex::new(HashMap::new()),
                shutdown,
                tasks,
                peer_notifiers,
                consumption_settlers,
                stream_permits: Arc::new(tokio::sync::Semaphore::new(config.max_streams)),
                buffer_budget: Arc::new(BufferBudget::new(config.max_buffered_bytes)),
                unproven_claims: UnprovenClaims::default(),
                config,
            }),
        };
        for (source, settler) in relay
            .inner
            .sources
            .iter()
            .zip(&relay.inner.consumption_settlers)
        {
            relay.inner.tasks.spawn(consumed::run(
                relay.clone(),
                source.clone(),
                settler.clone(),
            ));
        }
        for (source, scout) in relay.inner.sources.iter().zip(&relay.inner.scouts) {
            wake::spawn_listener(
                relay.clone(),
                source.clone(),
                &relay.inner.tasks,
                relay.inner.shutdown.clone(),
            );
            relay
                .inner
                .tasks
                .spawn(scout::run(relay.clone(), source.clone(), scout.clone()));
        }
        relay
            .inner
            .tasks
            .spawn(record_attached_streams(relay.clone()));
        relay.inner.tasks.spawn(refresh_definitions(relay.clone()));
        relay
    }

    pub fn sources(&self) -> &Sources {
        &self.inner.sources
    }

    /// Events were committed in `source` by this process: wake local dispatchers now and
    /// tell the other gateways with one coalesced notification.
    pub fn events_committed(&self, source: SourceId) {
        metrics::wakeup("publish");
        self.wake(source);
        if let Some(notifier) = self.inner.peer_notifiers.get(usize::from(source.0)) {
            notifier.events();
        }
    }

    /// Has the scout of `source` look for new events there.
    fn wake(&self, source: SourceId) {
        if let Some(scout) = self.inner.scouts.get(usize::from(source.0)) {
            scout.request();
        }
    }

    /// A consumer committed `outbox_consume` records in `source`: settle them.
    fn consumed(&self, source: SourceId) {
        if let Some(settler) = self.inner.consumption_settlers.get(usize::from(source.0)) {
            settler.notify_one();
        }
    }

    /// Changes whenever the dispatchers of this process, or what they select, changed.
    fn audience_generation(&self) -> u64 {
        self.inner.audience.load(Ordering::Relaxed)
    }

    /// Another gateway settled leases of the subscription in `source`: if they were this
    /// process's, its dispatcher learns at once that their room is free again.
    fn settled_elsewhere(&self, source: SourceId, settled: Settled) {
        if let Some(dispatcher) = self.dispatcher(settled.subscription_id) {
            dispatcher.settled_elsewhere(source, settled.made_due, settled.leases.as_deref());
        }
    }

    /// Notifications of `source` may have been lost (its LISTEN connection was
    /// re-established): look for new events there and re-read every lease there.
    fn missed_notifications(&self, source: SourceId) {
        for dispatcher in self.all_dispatchers() {
            dispatcher.settled_elsewhere(source, true, None);
        }
        self.wake(source);
        self.consumed(source);
    }

    /// Tells the other gateways on `source` that deliveries of the subscription may have
    /// become due there: their dispatcher of it claims at once.
    fn announce_due(&self, subscription_id: SubscriptionId, source: SourceId) {
        if let Some(notifier) = self.inner.peer_notifiers.get(usize::from(source.0)) {
            notifier.settled(Settled {
                subscription_id,
                made_due: true,
                leases: Some(Vec::new()),
            });
        }
    }

    fn all_dispatchers(&self) -> Vec<Arc<Dispatcher>> {
        self.inner
            .dispatchers
            .lock()
            .expect("dispatchers lock")
            .values()
            .cloned()
            .collect()
    }

    /// Tells the dispatcher of the subscription in this process about settled
    /// deliveries, and other gateways about those that were not leased here.
    fn settled(&self, subscription_id: SubscriptionId, acks: &[AckId], settlement: Settlement) {
        let elsewhere = match self.dispatcher(subscription_id) {
            Some(dispatcher) => dispatcher.settled(acks, settlement),
            None => acks.to_vec(),
        };
        let mut by_source: HashMap<SourceId, Vec<LeaseId>> = HashMap::new();
        for ack in &elsewhere {
            by_source.entry(ack.source).or_default().push(ack.lease());
        }
        for (source, leases) in by_source {
            let Some(notifier) = self.inner.peer_notifiers.get(usize::from(source.0)) else {
                continue;
            };
            notifier.settled(Settled {
                subscription_id,
                made_due: matches!(settlement, Settlement::Nacked { .. }),
                leases: (leases.len() <= Settled::MAX_NAMED_LEASES).then_some(leases),
            });
        }
    }

    /// Opens a delivery stream on the subscription that holds at most `max_in_flight`
    /// unsettled deliveries and, beyond its first, `max_in_flight_bytes` of them (0: the
    /// configured defaults), and takes at most `max_deliveries` in all (0: no end). A
    /// push subscription is FAILED_PRECONDITION: the gateway itself drains it.
    pub async fn subscribe(
        &self,
        name: &SubscriptionName,
        max_in_flight: u32,
        max_in_flight_bytes: u64,
        max_deliveries: u32,
    ) -> Result<DeliveryStream> {
        let total = (max_deliveries > 0).then_some(u64::from(max_deliveries));
        self.open_stream(name, max_in_flight, max_in_flight_bytes, total, false)
            .await
    }

    /// The stream a pusher or sinker drains: like [`Relay::subscribe`], for a push or
    /// sink subscription, holding at most the configured limit of unsettled deliveries
    /// whatever its settings ask for.
    pub(crate) async fn subscribe_for_drain(
        &self,
        name: &SubscriptionName,
        max_in_flight: u32,
    ) -> Result<DeliveryStream> {
        let max_in_flight = max_in_flight.min(self.inner.config.max_in_flight_limit);
        self.open_stream(name, max_in_flight, 0, None, true).await
    }

    async fn open_stream(
        &self,
        name: &SubscriptionName,
        max_in_flight: u32,
        max_in_flight_bytes: u64,
        total: Option<u64>,
        for_drain: bool,
    ) -> Result<DeliveryStream> {
        let config = &self.inner.config;
        let deliveries = match max_in_flight {
            0 => config.default_max_in_flight,
            n if n > config.max_in_flight_limit => {
                return Err(Error::invalid(
                    "max_in_flight",
                    format!("must be at most {}, got {n}", config.max_in_flight_limit),
                ));
            }
            n => n,
        } as usize;
        let bytes = match max_in_flight_bytes {
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
        let mut subscription = self.find_subscription(name).await?;
        if subscription.settings.drained_by_gateway() && !for_drain {
            // The dispatcher's copy may predate a switch to pull.
            subscription = (self.inner.sources.default_source().store)
                .subscription(name)
                .await?
                .ok_or_else(|| Error::subscription_not_found(name))?;
        }
        if !for_drain {
            let refuse = |what: &str| {
                Err(Error::FailedPrecondition(format!(
                    "subscription {name:?} is a {what}; clear it with UpdateSubscription (`outbox-gateway subscriptions update {name} --pull`) to read it with Subscribe"
                )))
            };
            if subscription.settings.push.is_some() {
                return refuse("push subscription: the gateway sends its events to its endpoint");
            }
            if let Some(sink) = &subscription.settings.sink {
                return refuse(&format!(
                    "sink subscription: the gateway publishes its events into sink {:?}",
                    sink.name
                ));
            }
        }
        let limits = StreamLimits {
            deliveries,
            bytes,
            total,
            ack_deadline: subscription.settings.ack_deadline,
        };
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
            self.inner.sources.clone(),
            self.inner.tasks.clone(),
            subscription,
            self.inner.buffer_budget.clone(),
            self.inner.audience.clone(),
        );
        let Ok(stream) = dispatcher.attach(limits, permit) else {
            unreachable!("a new dispatcher accepts streams");
        };
        dispatchers.insert(dispatcher.subscription_id(), dispatcher.clone());
        self.inner.audience.fetch_add(1, Ordering::Relaxed);
        self.inner
            .tasks
            .spawn(dispatcher::run(dispatcher, self.clone()));
        Ok(stream)
    }

    /// Acks deliveries, in every source they came from at once. Ack ids of a source that
    /// cannot be reached come back as unavailable, the others are applied.
    pub async fn ack(&self, name: &SubscriptionName, acks: &[AckId]) -> Result<AckOutcome> {
        let subscription = self.find_subscription(name).await?;
        self.ack_subscription(&subscription, acks).await
    }

    async fn ack_subscription(
        &self,
        subscription: &Subscription,
        acks: &[AckId],
    ) -> Result<AckOutcome> {
        let mut by_source: HashMap<SourceId, Vec<AckId>> = HashMap::new();
        for ack in acks {
            by_source.entry(ack.source).or_default().push(*ack);
        }
        let applied = join_all(by_source.into_iter().map(|(source_id, acks)| async move {
            let outcome = match self.inner.sources.get(source_id) {
                // Known to be down: answer at once rather than wait for a connection
                // attempt to time out; the health probe notices when it is back.
                Some(source) if !source.is_connected() => Err(None),
                Some(source) => source.store.ack(subscription, &acks).await.map_err(Some),
                None => Ok(Vec::new()),
            };
            (source_id, acks, outcome)
        }))
        .await;
        let mut outcome = AckOutcome::default();
        let mut settled = Vec::new();
        for (source, acks, applied) in applied {
            let acked: HashSet<AckId> = match applied {
                Ok(applied) => applied.into_iter().collect(),
                Err(None) => {
                    outcome.unavailable.extend(acks);
                    continue;
                }
                Err(Some(error)) if error.is_unavailable() => {
                    tracing::debug!(source = source.0, %error, "acks of an unreachable source");
                    outcome.unavailable.extend(acks);
                    continue;
                }
                Err(Some(error)) => return Err(error.into()),
            };
            let (done, stale): (Vec<AckId>, Vec<AckId>) =
                acks.into_iter().partition(|ack| acked.contains(ack));
            if let Some(name) = self.inner.sources.get(source) {
                metrics::acked(
                    subscription.name.as_str(),
                    name.name.as_str(),
                    done.len() as u64,
                );
            }
            if subscription.settings.ordered && !done.is_empty() {
                // The acks may have released waiting events of their aggregates; the
                // stream that gets them may be on another gateway.
                self.due(subscription.id, source);
            }
            settled.extend(done);
            outcome.stale.extend(stale);
        }
        if !settled.is_empty() {
            self.settled(subscription.id, &settled, Settlement::Acked);
        }
        // Sources answer in any order; callers get the ids back in the order they sent.
        outcome.stale = in_request_order(acks, &outcome.stale);
        outcome.unavailable = in_request_order(acks, &outcome.unavailable);
        Ok(outcome)
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
        let source = self.source(ack.source)?;
        let outcome = source
            .store
            .nack(&subscription, ack, reason, delay, dead_letter)
            .await
            .map_err(|error| source.error(error))?;
        if let Some(outcome) = outcome {
            metrics::nacked(name.as_str(), source.name.as_str());
            if outcome.dead_lettered {
                metrics::dead_lettered(name.as_str(), source.name.as_str(), 1);
                if subscription.settings.ordered {
                    self.due(subscription.id, ack.source);
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

    /// Extends leases to `extension` from now; returns the stale ack ids. Refused as
    /// unavailable when a source of the ack ids cannot be reached.
    pub async fn extend(
        &self,
        name: &SubscriptionName,
        acks: &[AckId],
        extension: Duration,
    ) -> Result<Vec<AckId>> {
        let subscription = self.find_subscription(name).await?;
        let mut by_source: HashMap<SourceId, Vec<AckId>> = HashMap::new();
        for ack in acks {
            by_source.entry(ack.source).or_default().push(*ack);
        }
        let mut deadlines: HashMap<AckId, DateTime<Utc>> = HashMap::new();
        for (source_id, acks) in by_source {
            let source = self.source(source_id)?;
            let extended = source
                .store
                .extend_leases(subscription.id, &acks, extension)
                .await
                .map_err(|error| source.error(error))?;
            deadlines.extend(extended);
        }
        if let Some(dispatcher) = self.dispatcher(subscription.id) {
            dispatcher.extended(&deadlines);
        }
        Ok(acks
            .iter()
            .filter(|ack| !deadlines.contains_key(ack))
            .copied()
            .collect())
    }

    /// Something in `source` may have become due for the subscription (a requeue, an
    /// ack that freed an aggregate, reclaimed leases): its dispatcher here looks, and
    /// other gateways hear of it.
    pub fn due(&self, subscription_id: SubscriptionId, source: SourceId) {
        if let Some(dispatcher) = self.dispatcher(subscription_id) {
            dispatcher.due_in(source);
        }
        self.announce_due(subscription_id, source);
    }

    /// The subscription's definition or read position changed: its dispatcher and the
    /// pushers here read it again and claim now; other gateways claim at once and take
    /// the definition at their next reading of all of them (within a poll interval).
    pub fn subscription_changed(&self, subscription_id: SubscriptionId) {
        let dispatcher = self.dispatcher(subscription_id);
        if let Some(dispatcher) = &dispatcher {
            dispatcher.definition_changed();
        }
        self.inner
            .definitions
            .send_modify(|generation| *generation += 1);
        for source in self.inner.sources.iter() {
            if let Some(dispatcher) = &dispatcher {
                dispatcher.news_in(source.id);
            }
            self.due(subscription_id, source.id);
        }
    }

    /// Pauses the subscription: nothing new goes out until it is resumed or `until`
    /// passes; deliveries already out still settle. Dispatchers here stop at once, on
    /// other gateways when they next read the definition (within a poll interval). The
    /// relay calls this itself, with a reason saying why, when it has to stop a
    /// subscription it cannot serve; ResumeSubscription clears such a pause like any.
    pub async fn pause(
        &self,
        name: &SubscriptionName,
        reason: &str,
        until: Option<DateTime<Utc>>,
    ) -> Result<Subscription> {
        let paused = self
            .inner
            .sources
            .default_source()
            .store
            .pause_subscription(name, reason, until)
            .await?
            .ok_or_else(|| Error::subscription_not_found(name))?;
        if let Some(dispatcher) = self.dispatcher(paused.id) {
            dispatcher.install_definition(paused.clone()).await;
        }
        self.subscription_changed(paused.id);
        Ok(paused)
    }

    /// Changes whenever a subscription of this process's definitions changed.
    pub(crate) fn watch_definitions(&self) -> watch::Receiver<u64> {
        self.inner.definitions.subscribe()
    }

    /// Whether the relay is stopping.
    pub(crate) fn stopping(&self) -> CancellationToken {
        self.inner.shutdown.clone()
    }

    /// Tracks a task the relay's shutdown waits for.
    pub(crate) fn track<F>(&self, task: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.inner.tasks.spawn(task);
    }

    /// Ends every stream, gives their leases back and waits for the relay's tasks.
    pub async fn shutdown(&self) {
        self.inner.shutdown.cancel();
        self.inner.tasks.close_and_wait().await;
    }

    /// The source an ack id names; unavailable at once when it is known to be down.
    fn source(&self, id: SourceId) -> Result<&Arc<Source>> {
        let source =
            self.inner.sources.get(id).ok_or_else(|| {
                Error::invalid("ack_id", "names a source this gateway does not have")
            })?;
        if !source.is_connected() {
            return Err(Error::SourceUnavailable(source.name.clone()));
        }
        Ok(source)
    }

    /// Settles the subscription's deliveries of the events at `positions` in `source`
    /// whatever their lease: they were consumed (see [`consumed`]). Whoever holds their
    /// leases re-reads them.
    async fn settle_consumed(
        &self,
        subscription: &Subscription,
        source: &Source,
        positions: &[i64],
    ) -> Result<()> {
        let settled = source
            .store
            .settle_consumed(subscription, positions)
            .await
            .map_err(|error| source.error(error))?;
        if settled.is_empty() {
            return Ok(());
        }
        metrics::acked(
            subscription.name.as_str(),
            source.name.as_str(),
            settled.len() as u64,
        );
        if subscription.settings.ordered {
            self.due(subscription.id, source.id);
        }
        // Their leases are not named: whoever holds them re-reads its leases there.
        let settled = Settled {
            subscription_id: subscription.id,
            made_due: false,
            leases: None,
        };
        if let Some(notifier) = self.inner.peer_notifiers.get(usize::from(source.id.0)) {
            notifier.settled(settled.clone());
        }
        self.settled_elsewhere(source.id, settled);
        Ok(())
    }

    /// The subscription with this id (`None`: deleted), from a dispatcher of this
    /// process if there is one.
    async fn subscription_by_id(&self, id: SubscriptionId) -> Result<Option<Subscription>> {
        if let Some(dispatcher) = self.dispatcher(id) {
            return Ok(Some(Subscription::clone(&dispatcher.subscription())));
        }
        Ok((self.inner.sources.default_source().store)
            .subscription_by_id(id)
            .await?)
    }

    /// The subscription as this process's dispatcher last saw it, or from the database.
    async fn find_subscription(&self, name: &SubscriptionName) -> Result<Subscription> {
        let cached = self
            .all_dispatchers()
            .iter()
            .map(|dispatcher| dispatcher.subscription())
            .find(|subscription| &subscription.name == name);
        if let Some(subscription) = cached {
            return Ok(Subscription::clone(&subscription));
        }
        (self.inner.sources.default_source().store)
            .subscription(name)
            .await?
            .ok_or_else(|| Error::subscription_not_found(name))
    }

    /// Subscribe streams open in this process, by subscription id.
    pub fn stream_counts(&self) -> HashMap<SubscriptionId, usize> {
        // One lock at a time: the map is let go before each dispatcher's is taken.
        let dispatchers: Vec<(SubscriptionId, Arc<Dispatcher>)> = self
            .inner
            .dispatchers
            .lock()
            .expect("dispatchers lock")
            .iter()
            .map(|(id, dispatcher)| (*id, dispatcher.clone()))
            .collect();
        dispatchers
            .into_iter()
            .map(|(id, dispatcher)| (id, dispatcher.stream_count()))
            .collect()
    }

    /// Subscriptions with at least one Subscribe stream open in this process.
    pub fn attached_subscriptions(&self) -> Vec<SubscriptionId> {
        self.stream_counts()
            .into_iter()
            .filter(|(_, streams)| *streams > 0)
            .map(|(id, _)| id)
            .collect()
    }

    fn dispatcher(&self, subscription_id: SubscriptionId) -> Option<Arc<Dispatcher>> {
        self.inner
            .dispatchers
            .lock()
            .expect("dispatchers lock")
            .get(&subscription_id)
            .cloned()
    }
}

/// Re-reads the definitions of every subscription with a dispatcher here once per poll
/// interval, in one statement: changes made through other gateways (a pause, a new
/// filter) reach this one's dispatchers within a poll interval, and a deleted
/// subscription's streams end.
async fn refresh_definitions(relay: Relay) {
    let mut polls = tokio::time::interval(relay.inner.config.poll_interval);
    polls.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = polls.tick() => {}
            () = relay.inner.shutdown.cancelled() => return,
        }
        let dispatchers = relay.all_dispatchers();
        if dispatchers.is_empty() {
            continue;
        }
        let ids: Vec<SubscriptionId> = dispatchers.iter().map(|d| d.subscription_id()).collect();
        let definitions = &relay.sources().default_source().store;
        let found = match definitions.subscriptions_by_ids(&ids).await {
            Ok(found) => found,
            Err(error) => {
                tracing::debug!(%error, "cannot read the subscriptions; keeping their last settings");
                continue;
            }
        };
        let mut by_id: HashMap<SubscriptionId, Subscription> =
            found.into_iter().map(|s| (s.id, s)).collect();
        for dispatcher in dispatchers {
            match by_id.remove(&dispatcher.subscription_id()) {
                Some(subscription) => dispatcher.set_definition(subscription),
                // Deleted: the dispatcher reads it, finds it gone and ends its streams.
                None => dispatcher.definition_changed(),
            }
        }
    }
}

/// Records, every [`ATTACHED_HEARTBEAT`], which subscriptions have streams in this
/// process, so that none of them is taken for unused and expired by any gateway, nor
/// shown as having no consumer.
async fn record_attached_streams(relay: Relay) {
    let mut beats = tokio::time::interval(ATTACHED_HEARTBEAT);
    beats.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = beats.tick() => {}
            () = relay.inner.shutdown.cancelled() => return,
        }
        let attached = relay.attached_subscriptions();
        if attached.is_empty() {
            continue;
        }
        let definitions = &relay.sources().default_source().store;
        if let Err(error) = definitions.touch_attached(&attached).await {
            tracing::debug!(%error, "cannot record the attached streams; retrying");
        }
    }
}
