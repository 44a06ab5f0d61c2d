//! One subscription's dispatcher in this process: claims deliveries for the streams
//! attached here, as much as their flow control allows ([`super::flow`]), and hands them
//! out; learns of settlements here and on other gateways; sleeps until there is room and
//! work.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, atomic::AtomicU64},
    time::{Duration, Instant},
};

use chrono::{DateTime, Utc};
use tokio::sync::{Notify, OwnedSemaphorePermit, mpsc};
use tokio_util::task::TaskTracker;

use super::{
    Relay,
    flow::{BufferBudget, StreamLimits, Streams},
    stream::DeliveryStream,
};
use crate::{
    domain::{AckId, Delivery, Subscription},
    error::Error,
    metrics,
    storage::{ClaimLimits, Store},
    telemetry,
};

/// How often a claim looks for due records when nothing here made one due.
const DUE_CHECK_INTERVAL: Duration = Duration::from_millis(100);
/// First retry delay after a failed claim; doubles up to the poll interval.
const FAILED_CLAIM_FIRST_DELAY: Duration = Duration::from_millis(100);

pub(super) struct Dispatcher {
    store: Store,
    /// Tracks lease releases so shutdown waits for them.
    tasks: TaskTracker,
    subscription_id: i64,
    /// Lease tokens are `token_base + claim number`: unique per claim, so an ack id never
    /// names two leases even when a requeue resets the attempt count.
    token_base: i64,
    claims: std::sync::atomic::AtomicI64,
    /// Latest settings seen; refreshed by every claim.
    subscription: Mutex<Subscription>,
    state: Mutex<State>,
    /// Room was freed, a stream came or went, or a retry was scheduled.
    changed: Notify,
    /// The gateway-wide bound on deliveries waiting in memory for their streams.
    budget: Arc<BufferBudget>,
}

#[derive(Default)]
struct State {
    streams: Streams,
    /// Earliest retry this process scheduled through a nack.
    retry_at: Option<DateTime<Utc>>,
    /// Another gateway settled leases of this subscription: re-read ours.
    refresh_pending: bool,
    /// Something made a delivery due (a nack, a release, an expired lease, an ack that
    /// may free an ordered aggregate, a wake-up from a requeue or another gateway): the
    /// next claim looks for due records.
    due_pending: bool,
    /// Set when the dispatcher stops; later streams need a new dispatcher.
    closed: bool,
}

/// How deliveries were settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Settlement {
    Acked,
    /// Nacked; `retry_at` is unset when dead-lettered.
    Nacked {
        retry_at: Option<DateTime<Utc>>,
    },
}

impl Dispatcher {
    pub(super) fn new(
        store: Store,
        tasks: TaskTracker,
        subscription: Subscription,
        budget: Arc<BufferBudget>,
    ) -> Arc<Dispatcher> {
        Arc::new(Dispatcher {
            store,
            tasks,
            subscription_id: subscription.id,
            token_base: rand::random::<i64>(),
            claims: std::sync::atomic::AtomicI64::new(0),
            subscription: Mutex::new(subscription),
            state: Mutex::new(State::default()),
            changed: Notify::new(),
            budget,
        })
    }

    pub(super) fn subscription_id(&self) -> i64 {
        self.subscription_id
    }

    pub(super) fn subscription(&self) -> Subscription {
        self.subscription.lock().expect("subscription lock").clone()
    }

    /// Adds a stream holding `permit`; gives the permit back when this dispatcher is
    /// already stopping.
    pub(super) fn attach(
        self: &Arc<Self>,
        limits: StreamLimits,
        permit: OwnedSemaphorePermit,
    ) -> Result<DeliveryStream, OwnedSemaphorePermit> {
        let mut state = self.state.lock().expect("dispatcher lock");
        if state.closed {
            return Err(permit);
        }
        // The channel never fills: a stream is only sent what its room allows.
        let (sender, receiver) = mpsc::channel(limits.deliveries);
        let buffered = Arc::new(AtomicU64::new(0));
        let id = state.streams.attach(limits, sender, buffered.clone());
        drop(state);
        self.changed.notify_one();
        Ok(DeliveryStream::new(
            receiver,
            self.clone(),
            id,
            buffered,
            self.budget.clone(),
            permit,
        ))
    }

    /// Another gateway settled leases of this subscription, perhaps some of ours: forget
    /// the named ones, or re-read which are still live before the next claim when they
    /// are not named; look for due records when a nack made one due.
    pub(super) fn settled_elsewhere(&self, made_due: bool, leases: Option<&[(i64, i64)]>) {
        let mut state = self.state.lock().expect("dispatcher lock");
        match leases {
            Some(leases) => {
                for &(position, token) in leases {
                    state.streams.forget_matching(position, token);
                }
            }
            None => state.refresh_pending = true,
        }
        state.due_pending |= made_due;
        drop(state);
        self.changed.notify_one();
    }

    /// Forgets settled leases of this dispatcher and, for a nack, schedules its retry;
    /// returns the acks that named no lease of this dispatcher (settled for another
    /// gateway, or stale here).
    pub(super) fn settled(&self, acks: &[AckId], settlement: Settlement) -> Vec<AckId> {
        let subscription = self.subscription();
        let name = subscription.name;
        let mut elsewhere = Vec::new();
        let mut state = self.state.lock().expect("dispatcher lock");
        for ack in acks {
            match state.streams.forget_matching(ack.position, ack.lease_token) {
                Some(lease) => {
                    if settlement == Settlement::Acked {
                        metrics::deliver_to_ack(name.as_str(), lease.leased_at.elapsed());
                    }
                }
                None => elsewhere.push(*ack),
            }
        }
        // A nack schedules a retry; an ack on an ordered subscription may release the
        // next event of its aggregate.
        state.due_pending |=
            matches!(settlement, Settlement::Nacked { .. }) || subscription.settings.ordered;
        if let Settlement::Nacked {
            retry_at: Some(retry_at),
        } = settlement
        {
            state.retry_at = Some(state.retry_at.map_or(retry_at, |at| at.min(retry_at)));
        }
        drop(state);
        self.changed.notify_one();
        elsewhere
    }

    pub(super) fn extended(&self, acks: &[AckId], deadlines: &HashMap<i64, DateTime<Utc>>) {
        let mut state = self.state.lock().expect("dispatcher lock");
        for ack in acks {
            if let Some(deadline) = deadlines.get(&ack.position) {
                state
                    .streams
                    .extend(ack.position, ack.lease_token, *deadline);
            }
        }
    }

    /// Removes a stream that ended; its unsettled deliveries go to other streams at once.
    pub(super) fn detach(self: &Arc<Self>, stream_id: u64) {
        let mut state = self.state.lock().expect("dispatcher lock");
        let orphaned = state.streams.detach(stream_id);
        drop(state);
        if !orphaned.is_empty() {
            self.release_in_background(orphaned);
        }
        self.changed.notify_one();
    }

    /// Gives leases back so other streams get them at once rather than at their deadline;
    /// once they are back, the next claim looks for them.
    fn release_in_background(self: &Arc<Self>, leases: Vec<(i64, i64)>) {
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let dispatcher = self.clone();
        self.tasks.spawn(async move {
            if let Err(error) = dispatcher
                .store
                .release_leases(dispatcher.subscription_id, &leases)
                .await
            {
                tracing::warn!(subscription_id = dispatcher.subscription_id, %error, "could not release leases; they expire at their deadline");
            }
            dispatcher.state.lock().expect("dispatcher lock").due_pending = true;
            dispatcher.changed.notify_one();
        });
    }

    /// Hands claimed deliveries to streams with room; returns the leases no stream could
    /// take.
    fn distribute(&self, deliveries: Vec<Delivery>) -> Vec<(i64, i64)> {
        self.observe(&deliveries);
        let mut state = self.state.lock().expect("dispatcher lock");
        let mut undelivered = Vec::new();
        for delivery in deliveries {
            if let Err(lease) = state.streams.place(delivery, &self.budget) {
                undelivered.push(lease);
            }
        }
        undelivered
    }
}

impl Dispatcher {
    /// Counts deliveries and, when traces are exported, gives each a span linked to the
    /// trace of the call that published its event.
    fn observe(&self, deliveries: &[Delivery]) {
        if deliveries.is_empty() {
            return;
        }
        let name = self.subscription().name;
        let now = Utc::now();
        let redelivered = deliveries.iter().filter(|d| d.attempt > 1).count() as u64;
        metrics::delivered(name.as_str(), deliveries.len() as u64, redelivered);
        for delivery in deliveries.iter().filter(|d| d.attempt == 1) {
            let waited = (now - delivery.event.created_at)
                .to_std()
                .unwrap_or_default();
            metrics::commit_to_delivery(name.as_str(), waited);
        }
        if telemetry::exporting() {
            for delivery in deliveries {
                let span = tracing::info_span!(
                    "deliver",
                    otel.kind = "producer",
                    subscription = %name,
                    event_id = %delivery.event.id,
                    event_type = %delivery.event.event_type,
                    attempt = delivery.attempt,
                );
                telemetry::link_to_producer(&span, &delivery.event.metadata);
            }
        }
    }
}

/// The dispatcher's loop: claim while there is room and work, otherwise sleep until a
/// wake-up, a settlement, a lease deadline, a scheduled retry or the poll interval.
pub(super) async fn run(dispatcher: Arc<Dispatcher>, relay: Relay) {
    let config = relay.inner.config.clone();
    let budget = dispatcher.budget.clone();
    let mut new_events = relay.inner.new_events.subscribe();
    let shutdown = relay.inner.shutdown.clone();
    let mut retry_delay: Option<Duration> = None;
    let mut last_refresh = Instant::now();
    let mut last_due_check = Instant::now() - DUE_CHECK_INTERVAL;

    loop {
        let (limits, refresh, full) = {
            let mut state = dispatcher.state.lock().expect("dispatcher lock");
            if state.streams.expire(Utc::now()) {
                state.due_pending = true;
            }
            if state.streams.is_empty() {
                drop(state);
                if retire(&dispatcher, &relay) {
                    return;
                }
                continue;
            }
            let has_leases = state.streams.has_leases();
            let refresh = std::mem::take(&mut state.refresh_pending) && has_leases;
            let limits = state.streams.claim_limits(config.claim_batch_size, &budget);
            (limits, refresh, limits.is_none() && has_leases)
        };

        // Room freed on another gateway counts before deciding how much to claim. When
        // full, the lease view is re-read once per poll interval even without a notice
        // (notifications are hints).
        if refresh || (full && last_refresh.elapsed() >= config.poll_interval) {
            refresh_leases(&dispatcher).await;
            last_refresh = Instant::now();
            if refresh {
                continue;
            }
        }
        if let Some(limits) = limits {
            match claim(&dispatcher, limits, &mut last_due_check).await {
                Ok(Claimed::Some { full_batch }) => {
                    retry_delay = None;
                    if full_batch {
                        tokio::task::yield_now().await;
                        continue;
                    }
                }
                Ok(Claimed::SubscriptionGone) => {
                    end_streams(&dispatcher, &relay, || {
                        Error::NotFound("the subscription was deleted".into())
                    });
                    return;
                }
                Err(()) => {
                    retry_delay = Some(retry_delay.map_or(FAILED_CLAIM_FIRST_DELAY, |d| {
                        (d * 2).min(config.poll_interval)
                    }));
                }
            }
        }

        let mut sleep_for = retry_delay.unwrap_or(config.poll_interval);
        let (next_deadline, retry_at) = {
            let state = dispatcher.state.lock().expect("dispatcher lock");
            (state.streams.next_deadline(), state.retry_at)
        };
        for at in [next_deadline, retry_at].into_iter().flatten() {
            let until = (at - Utc::now()).to_std().unwrap_or_default();
            sleep_for = sleep_for.min(until + Duration::from_millis(1));
        }
        tokio::select! {
            changed = new_events.changed() => {
                if changed.is_err() {
                    return;
                }
                // Requeues, reclaimed leases and other gateways' ordered acks announce
                // themselves this way too: look for due records as well as new events.
                dispatcher.state.lock().expect("dispatcher lock").due_pending = true;
            }
            _ = dispatcher.changed.notified() => {}
            // Streams elsewhere in this process read what waited for them.
            _ = budget.freed.notified(), if budget.is_spent() => {}
            _ = tokio::time::sleep(sleep_for) => {
                if sleep_for == config.poll_interval {
                    metrics::wakeup("poll");
                }
                let mut state = dispatcher.state.lock().expect("dispatcher lock");
                if state.retry_at.is_some_and(|at| at <= Utc::now()) {
                    state.retry_at = None;
                    state.due_pending = true;
                }
            }
            _ = shutdown.cancelled() => {
                end_streams(&dispatcher, &relay, || Error::ShuttingDown);
                return;
            }
        }
    }
}

enum Claimed {
    /// Claimed (perhaps nothing); `full_batch` when the limits were reached, so more may
    /// be waiting.
    Some {
        full_batch: bool,
    },
    SubscriptionGone,
}

/// One claim within `limits`, handed out to the streams. A failure is logged.
async fn claim(
    dispatcher: &Arc<Dispatcher>,
    limits: ClaimLimits,
    last_due_check: &mut Instant,
) -> Result<Claimed, ()> {
    let lease_token = dispatcher.token_base.wrapping_add(
        dispatcher
            .claims
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
    );
    // Looking for due records walks an index that every ack leaves dead entries in: do
    // it when something made a record due, else now and then (acks and nacks on other
    // gateways, expired leases of crashed ones).
    let include_due = {
        let mut state = dispatcher.state.lock().expect("dispatcher lock");
        let due = state.due_pending || last_due_check.elapsed() >= DUE_CHECK_INTERVAL;
        state.due_pending &= !due;
        due
    };
    if include_due {
        *last_due_check = Instant::now();
    }
    let claim = match dispatcher
        .store
        .claim(dispatcher.subscription_id, lease_token, limits, include_due)
        .await
    {
        Ok(Some(claim)) => claim,
        Ok(None) => return Ok(Claimed::SubscriptionGone),
        Err(error) => {
            tracing::warn!(subscription_id = dispatcher.subscription_id, %error, "claim failed");
            return Err(());
        }
    };
    let claimed = claim.deliveries.len();
    let claimed_bytes: u64 = claim.deliveries.iter().map(Delivery::size).sum();
    if claim.dead_lettered > 0 {
        let name = dispatcher.subscription().name;
        metrics::dead_lettered(name.as_str(), claim.dead_lettered);
    }
    dispatcher
        .subscription
        .lock()
        .expect("subscription lock")
        .settings = claim.settings;
    let undelivered = dispatcher.distribute(claim.deliveries);
    if !undelivered.is_empty() {
        dispatcher.release_in_background(undelivered);
    }
    Ok(Claimed::Some {
        full_batch: claimed == limits.count || claimed_bytes >= limits.bytes,
    })
}

/// Asks the database which leases are still held: acks and extensions that reached
/// another gateway process are only visible there.
async fn refresh_leases(dispatcher: &Dispatcher) {
    let leases = dispatcher
        .state
        .lock()
        .expect("dispatcher lock")
        .streams
        .leases();
    match dispatcher
        .store
        .live_leases(dispatcher.subscription_id, &leases)
        .await
    {
        Ok(live) => {
            let live: HashMap<i64, DateTime<Utc>> = live.into_iter().collect();
            let mut state = dispatcher.state.lock().expect("dispatcher lock");
            for (position, token) in leases {
                match live.get(&position) {
                    Some(deadline) => state.streams.extend(position, token, *deadline),
                    None => {
                        state.streams.forget_matching(position, token);
                    }
                }
            }
        }
        Err(error) => {
            tracing::warn!(subscription_id = dispatcher.subscription_id, %error, "lease refresh failed")
        }
    }
}

/// Removes a dispatcher that has no streams left; false when a stream attached meanwhile.
fn retire(dispatcher: &Arc<Dispatcher>, relay: &Relay) -> bool {
    let mut dispatchers = relay.inner.dispatchers.lock().expect("dispatchers lock");
    let mut state = dispatcher.state.lock().expect("dispatcher lock");
    if !state.streams.is_empty() {
        return false;
    }
    state.closed = true;
    dispatchers.remove(&dispatcher.subscription_id);
    true
}

/// Ends every stream with the error `reason` makes and gives all leases back.
fn end_streams(dispatcher: &Arc<Dispatcher>, relay: &Relay, reason: fn() -> Error) {
    let (senders, leases) = {
        let mut dispatchers = relay.inner.dispatchers.lock().expect("dispatchers lock");
        let mut state = dispatcher.state.lock().expect("dispatcher lock");
        state.closed = true;
        dispatchers.remove(&dispatcher.subscription_id);
        state.streams.take_all()
    };
    for sender in &senders {
        // The channel may be full of unsent deliveries; those leases are given back too.
        let _ = sender.try_send(Err(reason()));
    }
    if !leases.is_empty() {
        dispatcher.release_in_background(leases);
    }
}
