//! One subscription's dispatcher in this process: claims deliveries for the streams
//! attached here, spreads them over those streams, and keeps the lease bookkeeping that
//! flow control needs (how many unsettled deliveries each stream holds).

use std::{
    collections::HashMap,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::{Duration, Instant},
};

use chrono::{DateTime, Utc};
use tokio::sync::{Notify, OwnedSemaphorePermit, mpsc};
use tokio_stream::Stream;
use tokio_util::task::TaskTracker;

use super::Relay;
use crate::{
    domain::{AckId, Delivery, Subscription},
    error::Error,
    metrics,
    storage::Store,
    telemetry,
};

/// When committed events wait behind an older open transaction (anywhere in the
/// cluster), nothing wakes the dispatcher as that transaction ends: it looks again after
/// this delay, doubling up to `HELD_BACK_MAX_DELAY`.
const HELD_BACK_FIRST_DELAY: Duration = Duration::from_millis(1);
const HELD_BACK_MAX_DELAY: Duration = Duration::from_millis(100);
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
}

#[derive(Default)]
struct State {
    streams: Vec<StreamSlot>,
    leases: HashMap<i64, Lease>,
    next_stream_id: u64,
    /// Next stream to offer a delivery to, so a batch spreads evenly.
    round_robin: usize,
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

struct StreamSlot {
    id: u64,
    max_in_flight: usize,
    in_flight: usize,
    sender: mpsc::Sender<Result<Delivery, Error>>,
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

struct Lease {
    stream_id: u64,
    token: i64,
    deadline: DateTime<Utc>,
    /// When the delivery was handed to its stream; for the deliver-to-ack latency.
    leased_at: Instant,
}

impl Dispatcher {
    pub(super) fn new(
        store: Store,
        tasks: TaskTracker,
        subscription: Subscription,
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
        max_in_flight: usize,
        permit: OwnedSemaphorePermit,
    ) -> Result<DeliveryStream, OwnedSemaphorePermit> {
        let mut state = self.state.lock().expect("dispatcher lock");
        if state.closed {
            return Err(permit);
        }
        // The channel never fills: a stream is only sent what its room allows.
        let (sender, receiver) = mpsc::channel(max_in_flight);
        let id = state.next_stream_id;
        state.next_stream_id += 1;
        state.streams.push(StreamSlot {
            id,
            max_in_flight,
            in_flight: 0,
            sender,
        });
        drop(state);
        self.changed.notify_one();
        Ok(DeliveryStream {
            receiver,
            dispatcher: self.clone(),
            stream_id: id,
            _permit: permit,
        })
    }

    /// Another gateway settled leases of this subscription, perhaps some of ours: forget
    /// the named ones, or re-read which are still live before the next claim when they
    /// are not named; look for due records when a nack made one due.
    pub(super) fn settled_elsewhere(&self, made_due: bool, leases: Option<&[(i64, i64)]>) {
        let mut state = self.state.lock().expect("dispatcher lock");
        match leases {
            Some(leases) => {
                for &(position, token) in leases {
                    if state
                        .leases
                        .get(&position)
                        .is_some_and(|lease| lease.token == token)
                    {
                        state.forget_lease(position);
                    }
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
            let leased_at = state
                .leases
                .get(&ack.position)
                .filter(|lease| lease.token == ack.lease_token)
                .map(|lease| lease.leased_at);
            match leased_at {
                Some(leased_at) => {
                    if settlement == Settlement::Acked {
                        metrics::deliver_to_ack(name.as_str(), leased_at.elapsed());
                    }
                    state.forget_lease(ack.position);
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
            if let (Some(lease), Some(deadline)) = (
                state.leases.get_mut(&ack.position),
                deadlines.get(&ack.position),
            ) && lease.token == ack.lease_token
            {
                lease.deadline = *deadline;
            }
        }
    }

    fn detach(&self, stream_id: u64) {
        let mut state = self.state.lock().expect("dispatcher lock");
        state.streams.retain(|slot| slot.id != stream_id);
        let orphaned: Vec<(i64, i64)> = state
            .leases
            .iter()
            .filter(|(_, lease)| lease.stream_id == stream_id)
            .map(|(position, lease)| (*position, lease.token))
            .collect();
        for (position, _) in &orphaned {
            state.leases.remove(position);
        }
        drop(state);
        if !orphaned.is_empty() {
            self.release_in_background(orphaned);
        }
        self.changed.notify_one();
    }

    /// Gives leases back so other streams get them at once rather than at their deadline.
    fn release_in_background(&self, leases: Vec<(i64, i64)>) {
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        self.state.lock().expect("dispatcher lock").due_pending = true;
        let store = self.store.clone();
        let subscription_id = self.subscription_id;
        self.tasks.spawn(async move {
            if let Err(error) = store
                .release_leases(subscription_id, &leases)
                .await
            {
                tracing::warn!(subscription_id, %error, "could not release leases; they expire at their deadline");
            }
        });
    }

    /// Hands claimed deliveries to streams with room; returns the leases no stream could
    /// take.
    fn distribute(&self, deliveries: Vec<Delivery>) -> Vec<(i64, i64)> {
        self.observe(&deliveries);
        let mut state = self.state.lock().expect("dispatcher lock");
        let mut undelivered = Vec::new();
        'deliveries: for mut delivery in deliveries {
            let (position, token, deadline) = (
                delivery.ack_id.position,
                delivery.ack_id.lease_token,
                delivery.ack_deadline,
            );
            let stream_count = state.streams.len();
            for offset in 0..stream_count {
                let index = (state.round_robin + offset) % stream_count;
                let slot = &mut state.streams[index];
                if slot.in_flight >= slot.max_in_flight {
                    continue;
                }
                match slot.sender.try_send(Ok(delivery)) {
                    Ok(()) => {
                        slot.in_flight += 1;
                        let stream_id = slot.id;
                        state.leases.insert(
                            position,
                            Lease {
                                stream_id,
                                token,
                                deadline,
                                leased_at: Instant::now(),
                            },
                        );
                        state.round_robin = index + 1;
                        continue 'deliveries;
                    }
                    Err(mpsc::error::TrySendError::Full(returned))
                    | Err(mpsc::error::TrySendError::Closed(returned)) => {
                        delivery = returned.expect("only deliveries are sent here");
                    }
                }
            }
            undelivered.push((position, token));
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

impl State {
    fn forget_lease(&mut self, position: i64) {
        if let Some(lease) = self.leases.remove(&position)
            && let Some(slot) = self.streams.iter_mut().find(|s| s.id == lease.stream_id)
        {
            slot.in_flight = slot.in_flight.saturating_sub(1);
        }
    }

    fn room(&self) -> usize {
        self.streams
            .iter()
            .filter(|slot| !slot.sender.is_closed())
            .map(|slot| slot.max_in_flight.saturating_sub(slot.in_flight))
            .sum()
    }
}

/// The dispatcher's loop: claim while there is room and work, otherwise sleep until a
/// wake-up, a lease deadline, a scheduled retry or the poll interval.
pub(super) async fn run(dispatcher: Arc<Dispatcher>, relay: Relay) {
    let config = relay.inner.config.clone();
    let mut new_events = relay.inner.new_events.subscribe();
    let shutdown = relay.inner.shutdown.clone();
    let mut retry_delay: Option<Duration> = None;
    let mut last_refresh = Instant::now();
    let mut last_due_check = Instant::now() - DUE_CHECK_INTERVAL;

    loop {
        let now = Utc::now();
        let (room, refresh) = {
            let mut state = dispatcher.state.lock().expect("dispatcher lock");
            expire_leases(&mut state, now);
            if state.streams.is_empty() {
                drop(state);
                if retire(&dispatcher, &relay) {
                    return;
                }
                continue;
            }
            let refresh = std::mem::take(&mut state.refresh_pending) && !state.leases.is_empty();
            (state.room(), refresh)
        };

        // Room freed on another gateway counts before deciding how much to claim. When
        // full, the lease view is re-read once per poll interval even without a notice
        // (notifications are hints).
        if refresh || (room == 0 && last_refresh.elapsed() >= config.poll_interval) {
            refresh_leases(&dispatcher).await;
            last_refresh = Instant::now();
            if refresh {
                continue;
            }
        }
        let mut claimed_full_batch = false;
        if room > 0 {
            let limit = room.min(config.claim_batch_size);
            let lease_token = dispatcher.token_base.wrapping_add(
                dispatcher
                    .claims
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            );
            // Looking for due records walks an index that every ack leaves dead entries
            // in: do it when something made a record due, else now and then (acks and
            // nacks on other gateways, expired leases of crashed ones).
            let include_due = {
                let mut state = dispatcher.state.lock().expect("dispatcher lock");
                let due = state.due_pending || last_due_check.elapsed() >= DUE_CHECK_INTERVAL;
                state.due_pending &= !due;
                due
            };
            if include_due {
                last_due_check = Instant::now();
            }
            match dispatcher
                .store
                .claim(dispatcher.subscription_id, lease_token, limit, include_due)
                .await
            {
                Ok(None) => {
                    end_streams(&dispatcher, &relay, || {
                        Error::NotFound("the subscription was deleted".into())
                    });
                    return;
                }
                Ok(Some(claim)) => {
                    claimed_full_batch = claim.deliveries.len() == limit;
                    if claim.dead_lettered > 0 {
                        let name = dispatcher.subscription().name;
                        metrics::dead_lettered(name.as_str(), claim.dead_lettered);
                    }
                    retry_delay = claim.held_back.then(|| {
                        retry_delay.map_or(HELD_BACK_FIRST_DELAY, |d| {
                            (d * 2).min(HELD_BACK_MAX_DELAY).min(config.poll_interval)
                        })
                    });
                    dispatcher
                        .subscription
                        .lock()
                        .expect("subscription lock")
                        .settings = claim.settings;
                    let undelivered = dispatcher.distribute(claim.deliveries);
                    if !undelivered.is_empty() {
                        dispatcher.release_in_background(undelivered);
                    }
                }
                Err(error) => {
                    let delay = retry_delay.map_or(FAILED_CLAIM_FIRST_DELAY, |d| {
                        (d * 2).min(config.poll_interval)
                    });
                    tracing::warn!(subscription_id = dispatcher.subscription_id, %error, retry_in = ?delay, "claim failed");
                    retry_delay = Some(delay);
                }
            }
        }
        if claimed_full_batch {
            tokio::task::yield_now().await;
            continue;
        }

        let mut sleep_for = retry_delay.unwrap_or(config.poll_interval);
        let (next_deadline, retry_at) = {
            let state = dispatcher.state.lock().expect("dispatcher lock");
            (
                state.leases.values().map(|lease| lease.deadline).min(),
                state.retry_at,
            )
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

/// Drops leases whose deadline passed: they are no longer this process's to count.
fn expire_leases(state: &mut State, now: DateTime<Utc>) {
    let expired: Vec<i64> = state
        .leases
        .iter()
        .filter(|(_, lease)| lease.deadline <= now)
        .map(|(position, _)| *position)
        .collect();
    if !expired.is_empty() {
        state.due_pending = true;
    }
    for position in expired {
        state.forget_lease(position);
    }
}

/// Asks the database which leases are still held: acks and extensions that reached
/// another gateway process are only visible there.
async fn refresh_leases(dispatcher: &Dispatcher) {
    let leases: Vec<(i64, i64)> = {
        let state = dispatcher.state.lock().expect("dispatcher lock");
        state
            .leases
            .iter()
            .map(|(position, lease)| (*position, lease.token))
            .collect()
    };
    match dispatcher
        .store
        .live_leases(dispatcher.subscription_id, &leases)
        .await
    {
        Ok(live) => {
            let live: HashMap<i64, DateTime<Utc>> = live.into_iter().collect();
            let mut state = dispatcher.state.lock().expect("dispatcher lock");
            for (position, _) in leases {
                match live.get(&position) {
                    Some(deadline) => {
                        if let Some(lease) = state.leases.get_mut(&position) {
                            lease.deadline = *deadline;
                        }
                    }
                    None => state.forget_lease(position),
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
    let (streams, leases) = {
        let mut dispatchers = relay.inner.dispatchers.lock().expect("dispatchers lock");
        let mut state = dispatcher.state.lock().expect("dispatcher lock");
        state.closed = true;
        dispatchers.remove(&dispatcher.subscription_id);
        let leases: Vec<(i64, i64)> = state
            .leases
            .drain()
            .map(|(position, lease)| (position, lease.token))
            .collect();
        (std::mem::take(&mut state.streams), leases)
    };
    for slot in &streams {
        // The channel may be full of unsent deliveries; those leases are given back too.
        let _ = slot.sender.try_send(Err(reason()));
    }
    if !leases.is_empty() {
        dispatcher.release_in_background(leases);
    }
}

/// The stream a Subscribe call returns. Dropping it (the client went away) gives its
/// unsettled deliveries back for redelivery at once.
pub struct DeliveryStream {
    receiver: mpsc::Receiver<Result<Delivery, Error>>,
    dispatcher: Arc<Dispatcher>,
    stream_id: u64,
    /// Counts against the gateway's limit of open streams until dropped.
    _permit: OwnedSemaphorePermit,
}

impl Stream for DeliveryStream {
    type Item = Result<Delivery, Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.receiver.poll_recv(cx)
    }
}

impl Drop for DeliveryStream {
    fn drop(&mut self) {
        self.dispatcher.detach(self.stream_id);
    }
}
