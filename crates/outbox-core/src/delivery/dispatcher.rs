//! One subscription's dispatcher in this process: claims deliveries for the streams
//! attached here from every source the subscription reads, as much as their flow control
//! allows ([`super::flow`]), and hands them out; learns of settlements here and on other
//! gateways; sleeps until there is room and work.
//!
//! Each source is claimed on its own (a claim is one transaction in one database), when
//! it has news: the source's scout ([`super::scout`]) saw events there the subscription
//! may select, or a delivery there became due. Nothing is claimed merely because time
//! passed or another subscription's events arrived: the scout polls for all of them. A
//! source that is down or failing is skipped until it is back, so it never holds the
//! others up. While the subscription is paused nothing is claimed.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use chrono::{DateTime, Utc};
use tokio::sync::{Notify, OwnedSemaphorePermit, mpsc};

use super::{
    Relay,
    flow::{BufferBudget, CLAIM_LINGER, StreamLimits, Streams, WORTHWHILE_CLAIM},
    stream::DeliveryStream,
};
use crate::{
    domain::{
        AckId, DEFAULT_CONTENT_TYPE, Delivery, LeaseId, LeaseKey, SourceId, Subscription,
        SubscriptionId,
    },
    error::Error,
    metrics,
    sources::{Source, Sources},
    storage::{Claim, ClaimHandover, ClaimLimits, StoreError},
    tasks::SubsystemTasks,
    trace_context,
};

/// How often a claim looks for due records when nothing here made one due.
const DUE_CHECK_INTERVAL: Duration = Duration::from_millis(100);
/// First retry delay after a failed claim on a source; doubles up to the poll interval.
const FAILED_CLAIM_FIRST_DELAY: Duration = Duration::from_millis(100);
/// How long no claim follows another on a source after one there leased nothing. Most
/// such are another gateway's claim taking the read position first (it queued for the
/// subscription's lock earlier), which happens again while the gateways compete.
const FOLLOWING_REST: Duration = Duration::from_secs(1);
/// How long releases wait for a busy pool before leaving leases to their deadline.
const RELEASE_PATIENCE: Duration = Duration::from_secs(30);

pub(super) struct Dispatcher {
    sources: Sources,
    /// Tracks lease releases so shutdown waits for them.
    tasks: SubsystemTasks,
    subscription_id: SubscriptionId,
    /// Lease tokens are `token_base + claim number`: unique per claim, so an ack id never
    /// names two leases even when a requeue resets the attempt count.
    token_base: i64,
    claims: std::sync::atomic::AtomicI64,
    /// The definition as last read from the `default` source.
    /// Shared, so the loop and every settlement read it without copying it.
    subscription: Mutex<Arc<Subscription>>,
    state: Mutex<State>,
    /// Room was freed, a stream came or went, or a retry was scheduled.
    changed: Notify,
    /// The gateway-wide bound on deliveries waiting in memory for their streams.
    budget: Arc<BufferBudget>,
    /// Held from reading the definition until the claims made with it end, so that a
    /// pause taken here can wait for claims that did not see it.
    claiming: tokio::sync::Mutex<()>,
    /// Bumped when what the scouts look at changes (a filter, the sources read).
    audience: Arc<AtomicU64>,
}

#[derive(Default)]
struct State {
    streams: Streams,
    /// What this dispatcher knows per source.
    sources: HashMap<SourceId, SourceState>,
    /// Another gateway settled leases of this subscription without naming them: re-read
    /// ours in these sources.
    refresh: Vec<SourceId>,
    /// The definition changed (or may have): read it again.
    definition_stale: bool,
    /// Set when the dispatcher stops; later streams need a new dispatcher.
    closed: bool,
    /// Leases to give back, and whether a task is giving them back now.
    releases: Vec<(LeaseKey, i64)>,
    releasing: bool,
}

/// A dispatcher's view of one source.
struct SourceState {
    /// Events may wait there: the scout saw some the subscription may select, or the
    /// dispatcher has not claimed there yet (or failed to, or the source came back).
    news: bool,
    /// Something made a delivery due there (a nack, a release, an expired lease, an ack
    /// that may free an ordered aggregate, a requeue): the next claim looks for due
    /// records.
    due_pending: bool,
    /// Earliest retry this process scheduled there through a nack.
    retry_at: Option<DateTime<Utc>>,
    last_due_check: Option<Instant>,
    /// The last claim took all its limits allowed: more may be waiting there.
    more_waiting: bool,
    /// After a failed claim, not before this; the delay doubles while failures go on.
    failing: Option<(Instant, Duration)>,
    /// The source was down when last looked at (its leases' room was freed then).
    down: bool,
    /// No claim follows another there before this ([`FOLLOWING_REST`]).
    no_following_until: Option<Instant>,
}

impl Default for SourceState {
    fn default() -> Self {
        SourceState {
            news: true,
            due_pending: false,
            retry_at: None,
            last_due_check: None,
            more_waiting: false,
            failing: None,
            down: false,
            no_following_until: None,
        }
    }
}

impl SourceState {
    /// Whether a claim on this source has something to look for now.
    fn wants_claim(&self, now: Instant) -> bool {
        if self.failing.is_some_and(|(not_before, _)| now < not_before) {
            return false;
        }
        self.news
            || self.more_waiting
            || self.due_pending
            || self.retry_at.is_some_and(|at| at <= Utc::now())
    }
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
        sources: Sources,
        tasks: SubsystemTasks,
        subscription: Subscription,
        budget: Arc<BufferBudget>,
        audience: Arc<AtomicU64>,
    ) -> Arc<Dispatcher> {
        Arc::new(Dispatcher {
            sources,
            tasks,
            subscription_id: subscription.id,
            token_base: rand::random::<i64>(),
            claims: std::sync::atomic::AtomicI64::new(0),
            subscription: Mutex::new(Arc::new(subscription)),
            state: Mutex::new(State::default()),
            changed: Notify::new(),
            budget,
            claiming: tokio::sync::Mutex::new(()),
            audience,
        })
    }

    /// Takes a definition just written here (a pause) and returns once no claim made
    /// with the previous one is still running: what is published afterwards goes out
    /// under the new definition.
    pub(super) async fn install_definition(&self, subscription: Subscription) {
        self.set_definition(subscription);
        drop(self.claiming.lock().await);
    }

    /// Takes the definition as read from the database.
    pub(super) fn set_definition(&self, subscription: Subscription) {
        let mut current = self.subscription.lock().expect("subscription lock");
        if current.settings != subscription.settings || current.sources != subscription.sources {
            self.audience.fetch_add(1, Ordering::Relaxed);
        }
        *current = Arc::new(subscription);
    }

    pub(super) fn subscription_id(&self) -> SubscriptionId {
        self.subscription_id
    }

    pub(super) fn ack_writer(&self) -> super::AckWriter {
        super::AckWriter {
            seal: self.sources.ack_seal().cloned(),
            subscription: self.subscription_id,
        }
    }

    pub(super) fn stream_count(&self) -> usize {
        self.state.lock().expect("dispatcher lock").streams.len()
    }

    pub(super) fn subscription(&self) -> Arc<Subscription> {
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
        // The channel fills only with deliveries whose leases expired before the stream
        // read them: it is sent no more than its room allows.
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

    /// A stream's channel has room again.
    pub(super) fn channel_drained(&self) {
        self.changed.notify_one();
    }

    /// The definition changed: read it again before the next claim.
    pub(super) fn definition_changed(&self) {
        self.state.lock().expect("dispatcher lock").definition_stale = true;
        self.changed.notify_one();
    }

    /// The scout saw events in `source` this subscription may select.
    pub(super) fn news_in(&self, source: SourceId) {
        self.state
            .lock()
            .expect("dispatcher lock")
            .sources
            .entry(source)
            .or_default()
            .news = true;
        self.changed.notify_one();
    }

    /// Something in `source` may have become due (a requeue, an ordered ack elsewhere).
    pub(super) fn due_in(&self, source: SourceId) {
        self.state
            .lock()
            .expect("dispatcher lock")
            .sources
            .entry(source)
            .or_default()
            .due_pending = true;
        self.changed.notify_one();
    }

    /// Another gateway settled leases of this subscription in `source`, perhaps some of
    /// ours: forget the named ones, or re-read which are still live before the next claim
    /// when they are not named; look for due records when a nack made one due.
    pub(super) fn settled_elsewhere(
        &self,
        source: SourceId,
        made_due: bool,
        leases: Option<&[LeaseId]>,
    ) {
        let mut state = self.state.lock().expect("dispatcher lock");
        match leases {
            Some(leases) => {
                for lease in leases {
                    state
                        .streams
                        .forget_matching(lease.key_in(source), lease.token);
                }
            }
            None => {
                if !state.refresh.contains(&source) {
                    state.refresh.push(source);
                }
            }
        }
        state.sources.entry(source).or_default().due_pending |= made_due;
        drop(state);
        self.changed.notify_one();
    }

    /// Forgets settled leases of this dispatcher and, for a nack, schedules its retry;
    /// returns the acks that named no lease of this dispatcher (settled for another
    /// gateway, or stale here).
    pub(super) fn settled(&self, acks: &[AckId], settlement: Settlement) -> Vec<AckId> {
        let subscription = self.subscription();
        let name = &subscription.name;
        let mut elsewhere = Vec::new();
        let deliver_to_ack = metrics::deliver_to_ack(name.as_str());
        let now = Instant::now();
        let mut state = self.state.lock().expect("dispatcher lock");
        for ack in acks {
            match state
                .streams
                .forget_matching(ack.lease_key(), ack.lease_token)
            {
                Some(lease) => {
                    if settlement == Settlement::Acked {
                        let held = now.saturating_duration_since(lease.leased_at);
                        deliver_to_ack.record(held.as_secs_f64());
                    }
                }
                None => elsewhere.push(*ack),
            }
            // A nack schedules a retry; an ack on an ordered subscription may release the
            // next event of its aggregate.
            let source = state.sources.entry(ack.source).or_default();
            source.due_pending |=
                matches!(settlement, Settlement::Nacked { .. }) || subscription.settings.ordered;
            if let Settlement::Nacked {
                retry_at: Some(retry_at),
            } = settlement
            {
                source.retry_at = Some(source.retry_at.map_or(retry_at, |at| at.min(retry_at)));
            }
        }
        drop(state);
        self.changed.notify_one();
        elsewhere
    }

    pub(super) fn extended(&self, deadlines: &HashMap<AckId, DateTime<Utc>>) {
        let mut state = self.state.lock().expect("dispatcher lock");
        for (ack, deadline) in deadlines {
            state
                .streams
                .extend(ack.lease_key(), ack.lease_token, *deadline);
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
    /// once they are back, the next claim looks for them. Releases asked for while one
    /// is under way join the next statement, so thousands of streams ending at once
    /// make a few statements rather than queue for every connection of the pool.
    fn release_in_background(self: &Arc<Self>, leases: Vec<(LeaseKey, i64)>) {
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let mut state = self.state.lock().expect("dispatcher lock");
        state.releases.extend(leases);
        if std::mem::replace(&mut state.releasing, true) {
            return;
        }
        drop(state);
        self.tasks.spawn(self.clone().release_pending());
    }

    /// Releases what waits to be released until nothing does. A pool with no connection
    /// free is waited out (back-pressure, for up to [`RELEASE_PATIENCE`]); any other
    /// failure leaves the leases to expire at their deadline.
    async fn release_pending(self: Arc<Self>) {
        let started = Instant::now();
        let mut delay = FAILED_CLAIM_FIRST_DELAY;
        loop {
            let leases = {
                let mut state = self.state.lock().expect("dispatcher lock");
                if state.releases.is_empty() {
                    state.releasing = false;
                    return;
                }
                std::mem::take(&mut state.releases)
            };
            let mut by_source: HashMap<SourceId, Vec<LeaseId>> = HashMap::new();
            for (key, token) in leases {
                by_source
                    .entry(key.source)
                    .or_default()
                    .push(key.with_token(token));
            }
            let mut busy = false;
            for (source_id, leases) in by_source {
                let Some(source) = self.sources.get(source_id).cloned() else {
                    continue;
                };
                if !source.is_connected() {
                    // Its leases expire there by themselves; asking would only wait for
                    // a connection attempt to time out (at shutdown too).
                    tracing::debug!(subscription_id = self.subscription_id.0, source = %source.name, "source is unreachable; its leases expire at their deadline");
                    continue;
                }
                match source
                    .store
                    .release_leases(self.subscription_id, &leases)
                    .await
                {
                    Ok(_) => self.due_in(source_id),
                    Err(error)
                        if error.is_pool_exhausted()
                            && source.is_connected()
                            && started.elapsed() < RELEASE_PATIENCE =>
                    {
                        busy = true;
                        let mut state = self.state.lock().expect("dispatcher lock");
                        state.releases.extend(
                            leases
                                .into_iter()
                                .map(|lease| (lease.key_in(source_id), lease.token)),
                        );
                    }
                    Err(error) => {
                        tracing::warn!(subscription_id = self.subscription_id.0, source = %source.name, %error, "could not release leases; they expire at their deadline");
                    }
                }
            }
            if busy {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
        }
    }

    /// Hands claimed deliveries to streams with room; returns the leases no stream could
    /// take.
    fn distribute(&self, deliveries: Vec<Delivery>) -> Vec<(LeaseKey, i64)> {
        self.observe(&deliveries);
        let mut state = self.state.lock().expect("dispatcher lock");
        let mut undelivered = Vec::new();
        let leased_at = Instant::now();
        for delivery in deliveries {
            if let Err(lease) = state.streams.place(delivery, &self.budget, leased_at) {
                undelivered.push(lease);
            }
        }
        undelivered
    }

    /// Counts deliveries and, when traces are exported, gives each a span linked to the
    /// trace of the call that published its event.
    fn observe(&self, deliveries: &[Delivery]) {
        if deliveries.is_empty() {
            return;
        }
        let subscription = self.subscription();
        let name = &subscription.name;
        let now = Utc::now();
        let redelivered = deliveries.iter().filter(|d| d.attempt > 1).count() as u64;
        // One claim reads one source.
        let source = deliveries[0].event.source.as_str();
        metrics::delivered(name.as_str(), source, deliveries.len() as u64, redelivered);
        let commit_to_delivery = metrics::commit_to_delivery(name.as_str());
        for delivery in deliveries.iter().filter(|d| d.attempt == 1) {
            // A scheduled event counts from its delivery time, not from its writing.
            let deliverable = delivery
                .event
                .deliver_at
                .map_or(delivery.event.created_at, |at| {
                    at.max(delivery.event.created_at)
                });
            let waited = (now - deliverable).to_std().unwrap_or_default();
            commit_to_delivery.record(waited.as_secs_f64());
        }
        if trace_context::exporting() {
            for delivery in deliveries {
                // The messaging conventions' names; what they have no name for is
                // under `outbox.`.
                let span = tracing::info_span!(
                    "deliver",
                    otel.name = %format_args!("deliver {name}"),
                    otel.kind = "producer",
                    "messaging.system" = "outbox",
                    "messaging.operation.type" = "send",
                    "messaging.operation.name" = "deliver",
                    "messaging.destination.name" = %name,
                    "messaging.message.id" = %delivery.event.id,
                    "outbox.source" = %delivery.event.source,
                    "outbox.event_type" = %delivery.event.event_type,
                    "outbox.delivery.attempt" = delivery.attempt,
                );
                trace_context::link_to_producer(&span, &delivery.event.metadata);
            }
        }
    }
}

/// The dispatcher's loop: claim while there is room and work, otherwise sleep until a
/// wake-up, a settlement, a lease deadline, a scheduled retry or the poll interval.
pub(super) async fn run(dispatcher: Arc<Dispatcher>, relay: Relay) {
    let config = relay.inner.config.clone();
    let budget = dispatcher.budget.clone();
    let shutdown = relay.inner.shutdown.clone();
    let mut last_refresh = Instant::now();
    // Rotates which source is claimed first, so a busy one cannot starve the others.
    let mut first_source = 0usize;
    // Until when the small claim due now waits for more room, if it does.
    let mut linger_deadline: Option<Instant> = None;

    // Wakes the loop when a source goes down or comes back.
    let mut health: Vec<_> = dispatcher
        .sources
        .iter()
        .map(|source| source.watch())
        .collect();

    loop {
        follow_source_health(&dispatcher);
        let checked_at = Utc::now();
        let overdue = dispatcher
            .state
            .lock()
            .expect("dispatcher lock")
            .streams
            .overdue(checked_at);
        let any_overdue = !overdue.is_empty();
        let mut unanswered = Vec::new();
        for (source, leases) in overdue {
            if !reread_leases(&dispatcher, source, leases, Missing::Expired).await {
                unanswered.push(source);
            }
        }
        let (mut limits, room, refresh, full, only_unproven) = {
            let mut state = dispatcher.state.lock().expect("dispatcher lock");
            // Only what the sources were asked about: leases that fell due since are the
            // next turn's, which their deadline wakes.
            if any_overdue {
                for source in state.streams.expire(checked_at, &unanswered) {
                    state.sources.entry(source).or_default().due_pending = true;
                }
            }
            if state.streams.is_empty() {
                drop(state);
                if retire(&dispatcher, &relay) {
                    return;
                }
                continue;
            }
            let has_leases = state.streams.has_leases();
            let refresh: Vec<SourceId> = match has_leases {
                true => std::mem::take(&mut state.refresh),
                false => {
                    state.refresh.clear();
                    Vec::new()
                }
            };
            // All the streams' room, of which one claim takes at most a batch.
            let room = state.streams.claim_limits(usize::MAX, &budget);
            let mut limits = room.map(|room| ClaimLimits {
                count: room.count.min(config.claim_batch_size),
                ..room
            });
            let full = limits.is_none() && has_leases;
            // A small claim waits a moment for more room (see the flow control's rules).
            let can_wait = limits.is_some_and(|limits| {
                state
                    .streams
                    .claim_can_wait(limits, config.claim_batch_size, &budget)
            });
            match can_wait {
                true => {
                    let deadline =
                        *linger_deadline.get_or_insert_with(|| Instant::now() + CLAIM_LINGER);
                    match Instant::now() < deadline {
                        true => limits = None,
                        false => linger_deadline = None,
                    }
                }
                false => linger_deadline = None,
            }
            let only_unproven = state.streams.only_unproven_can_take(&budget);
            (limits, room, refresh, full, only_unproven)
        };

        // Room freed on another gateway counts before deciding how much to claim. When
        // full, the lease view is re-read once per poll interval even without a notice
        // (notifications are hints).
        if !refresh.is_empty() {
            for source in refresh {
                refresh_leases(&dispatcher, source).await;
            }
            last_refresh = Instant::now();
            continue;
        }
        if full && last_refresh.elapsed() >= config.poll_interval {
            for source in dispatcher.sources.iter() {
                refresh_leases(&dispatcher, source.id).await;
            }
            last_refresh = Instant::now();
        }
        let definition_stale = std::mem::take(
            &mut dispatcher
                .state
                .lock()
                .expect("dispatcher lock")
                .definition_stale,
        );
        // The relay re-reads every dispatcher's definition once per poll interval, in one
        // statement; this reads it at once when it is known to have changed.
        if definition_stale && !read_definition(&dispatcher).await {
            end_streams(&dispatcher, &relay, || {
                Error::NotFound("the subscription was deleted".into())
            });
            return;
        }
        // Claims for streams that have not settled anything yet take paced turns across
        // the process, so they cannot fill the pool ahead of streams that do settle. The
        // turn is taken only when there is something to claim, and given back before
        // sleeping.
        let has_news = dispatcher
            .sources
            .iter()
            .any(|source| source.is_connected() && wants_claim(&dispatcher, source));
        let mut unproven_turn = match limits.is_some() && only_unproven && has_news {
            true => {
                let turn = tokio::select! {
                    turn = relay.inner.unproven_claims.turn() => turn,
                    _ = shutdown.cancelled() => {
                        end_streams(&dispatcher, &relay, || Error::ShuttingDown);
                        return;
                    }
                };
                // Streams may have settled, left or come meanwhile.
                limits = dispatcher
                    .state
                    .lock()
                    .expect("dispatcher lock")
                    .streams
                    .claim_limits(config.claim_batch_size, &budget);
                Some(turn)
            }
            false => None,
        };
        let claiming = dispatcher.claiming.lock().await;
        let subscription = dispatcher.subscription();
        // Paused: nothing new goes out; settlements, lease expiry and definition reads go
        // on, and the loop wakes when the pause ends by itself.
        let paused = subscription.pause_in_force(Utc::now()).is_some();
        if let Some(limits) = limits.filter(|_| !paused) {
            let sources = dispatcher.sources.of(&subscription);
            let count = sources.len().max(1);
            first_source = (first_source + 1) % count;
            let mut remaining = limits;
            // Unproven streams' claims take one turn at a time: none follows another.
            let mut room_left = room.filter(|_| unproven_turn.is_none());
            let mut full_batch = false;
            for source in sources
                .iter()
                .cycle()
                .skip(first_source)
                .take(sources.len())
            {
                if !source.is_connected() || !wants_claim(&dispatcher, source) {
                    continue;
                }
                // A claim may be followed by another when the room left after it holds
                // a worthwhile one.
                let follow_room = room_left.filter(|room| {
                    room.count
                        >= remaining
                            .count
                            .saturating_add(worthwhile_following(config.claim_batch_size))
                        && may_follow(&dispatcher, source)
                });
                match claim(
                    &dispatcher,
                    &relay,
                    &subscription,
                    source,
                    remaining,
                    follow_room,
                )
                .await
                {
                    Claimed::Some {
                        count,
                        bytes,
                        again,
                    } => {
                        remaining.count = remaining.count.saturating_sub(count);
                        remaining.bytes = remaining.bytes.saturating_sub(bytes).max(1);
                        if let Some(room) = room_left.as_mut() {
                            room.count = room.count.saturating_sub(count);
                            room.bytes = room.bytes.saturating_sub(bytes).max(1);
                        }
                        if let Some(turn) = unproven_turn.as_mut().filter(|_| count > 0) {
                            turn.leased();
                        }
                        if remaining.count == 0 || bytes >= limits.bytes {
                            full_batch = true;
                            break;
                        }
                        // Read on at once rather than at the next wake-up.
                        full_batch |= again;
                    }
                    Claimed::NotReadingYet => {
                        // Deleted, or not reading this source yet.
                        if !read_definition(&dispatcher).await {
                            end_streams(&dispatcher, &relay, || {
                                Error::NotFound("the subscription was deleted".into())
                            });
                            return;
                        }
                        start_reading(&dispatcher, &subscription, source).await;
                    }
                    Claimed::Failed => {}
                }
            }
            if full_batch {
                drop(claiming);
                drop(unproven_turn);
                continue;
            }
        }
        drop(claiming);
        drop(unproven_turn);
        // Without room, news waits: the settlement, expiry or stream that makes room wakes
        // the loop, and the news is still there then.
        let mut sleep_for = next_wake(&dispatcher, config.poll_interval);
        if let Some(deadline) = linger_deadline {
            sleep_for = sleep_for.min(deadline.saturating_duration_since(Instant::now()));
        }
        tokio::select! {
            _ = dispatcher.changed.notified() => {}
            _ = any_changed(&mut health) => {}
            // Streams elsewhere in this process read what waited for them.
            _ = budget.freed.notified(), if budget.is_spent() => {}
            _ = tokio::time::sleep(sleep_for) => {
                if sleep_for == config.poll_interval {
                    metrics::wakeup("poll");
                }
            }
            _ = shutdown.cancelled() => {
                end_streams(&dispatcher, &relay, || Error::ShuttingDown);
                return;
            }
        }
    }
}

/// Frees the room of leases whose source went down (nobody can settle them meanwhile),
/// and claims at once from a source that came back.
fn follow_source_health(dispatcher: &Dispatcher) {
    let mut state = dispatcher.state.lock().expect("dispatcher lock");
    for source in dispatcher.sources.iter() {
        let connected = source.is_connected();
        let known = state.sources.entry(source.id).or_default();
        if connected != known.down {
            continue;
        }
        known.down = !connected;
        if connected {
            known.failing = None;
            known.news = true;
            known.due_pending = true;
        } else {
            state.streams.forget_source(source.id);
        }
    }
}

/// Resolves when any of `watches` sees a change.
async fn any_changed(watches: &mut [tokio::sync::watch::Receiver<u64>]) {
    if watches.is_empty() {
        return std::future::pending().await;
    }
    let changes = watches.iter_mut().map(|watch| Box::pin(watch.changed()));
    if futures_util::future::select_all(changes).await.0.is_err() {
        // The gateway is stopping (the sources are gone): the shutdown branch ends us.
        std::future::pending::<()>().await;
    }
}

/// Until the next lease deadline, scheduled retry or end of a pause, at most the poll
/// interval; sooner when a failing source may be tried again.
fn next_wake(dispatcher: &Dispatcher, poll_interval: Duration) -> Duration {
    let subscription = dispatcher.subscription();
    let pause = subscription.pause_in_force(Utc::now());
    let state = dispatcher.state.lock().expect("dispatcher lock");
    let mut sleep_for = poll_interval;
    // While paused nothing is claimed, so a due retry or a source to try again must not
    // wake the loop (it would spin); the end of the pause does.
    let retries = state
        .sources
        .values()
        .filter_map(|source| source.retry_at)
        .filter(|_| pause.is_none());
    let instants = state
        .streams
        .next_deadline()
        .into_iter()
        .chain(retries)
        .chain(pause.and_then(|pause| pause.until));
    for at in instants {
        let until = (at - Utc::now()).to_std().unwrap_or_default();
        sleep_for = sleep_for.min(until + Duration::from_millis(1));
    }
    let now = Instant::now();
    let retries_after_failure = state
        .sources
        .values()
        .filter_map(|source| source.failing)
        .filter(|_| pause.is_none());
    for (not_before, _) in retries_after_failure {
        sleep_for = sleep_for.min(not_before.saturating_duration_since(now));
    }
    sleep_for
}

fn wants_claim(dispatcher: &Dispatcher, source: &Source) -> bool {
    let state = dispatcher.state.lock().expect("dispatcher lock");
    state
        .sources
        .get(&source.id)
        .is_none_or(|known| known.wants_claim(Instant::now()))
}

enum Claimed {
    /// Claimed this many deliveries and bytes (perhaps none); `again`: claim again at
    /// once, room or not used up — the read was full of events that did not go out
    /// (scheduled, expired), or it freed aggregates whose next events are due now.
    Some {
        count: usize,
        bytes: u64,
        again: bool,
    },
    /// The subscription has no read position in this source yet.
    NotReadingYet,
    Failed,
}

impl Claimed {
    /// This claim and a `following` one that leased, together.
    fn and(self, following: Claimed) -> Claimed {
        match (self, following) {
            (
                Claimed::Some {
                    count,
                    bytes,
                    again,
                },
                Claimed::Some {
                    count: more,
                    bytes: more_bytes,
                    again: again_too,
                },
            ) => Claimed::Some {
                count: count + more,
                bytes: bytes + more_bytes,
                again: again || again_too,
            },
            // The first claim's failure still backs the source off.
            (first, _) => first,
        }
    }
}

/// One claim on one source within `limits`, handed out to the streams. A failure is
/// logged and backs the source off.
///
/// With `follow_room` (all the room the streams have, more than `limits`), a second claim
/// reads on from where the first leaves the read position while the first leases and
/// commits ([`crate::storage::Store::claim_following`]), within the room the first
/// leaves; one subscription's claims then overlap rather than run one at a time.
async fn claim(
    dispatcher: &Arc<Dispatcher>,
    relay: &Relay,
    subscription: &Subscription,
    source: &Source,
    limits: ClaimLimits,
    follow_room: Option<ClaimLimits>,
) -> Claimed {
    let lease_token = next_lease_token(dispatcher);
    // Looking for due records walks an index that every ack leaves dead entries in: do
    // it when something made a record due, else now and then (acks and nacks on other
    // gateways, expired leases of crashed ones).
    let include_due = {
        let mut state = dispatcher.state.lock().expect("dispatcher lock");
        let known = state.sources.entry(source.id).or_default();
        let now = Instant::now();
        let due = known.due_pending
            || known.retry_at.is_some_and(|at| at <= Utc::now())
            || known
                .last_due_check
                .is_none_or(|at| now.duration_since(at) >= DUE_CHECK_INTERVAL);
        if due {
            known.due_pending = false;
            known.last_due_check = Some(now);
            if known.retry_at.is_some_and(|at| at <= Utc::now()) {
                known.retry_at = None;
            }
        }
        known.news = false;
        due
    };
    let (handover, handed_over) = tokio::sync::oneshot::channel();
    let following = follow(
        dispatcher,
        relay,
        subscription,
        source,
        follow_room,
        handed_over,
    );
    let started = Instant::now();
    let leading = source.store.claim_handing_over(
        subscription,
        lease_token,
        limits,
        include_due,
        follow_room.map(|_| handover),
    );
    let (leading, mut following) = (std::pin::pin!(leading), std::pin::pin!(following));
    // The following claim may end first, having found nothing to do.
    let (outcome, followed) = match futures_util::future::select(leading, following.as_mut()).await
    {
        futures_util::future::Either::Left((outcome, _)) => (outcome, None),
        futures_util::future::Either::Right((followed, leading)) => (leading.await, Some(followed)),
    };
    let claimed = match outcome {
        Ok(Some(claim)) => {
            metrics::claimed(
                subscription.name.as_str(),
                source.name.as_str(),
                started.elapsed(),
            );
            hand_out(dispatcher, relay, subscription, source, limits, claim)
        }
        Ok(None) => Claimed::NotReadingYet,
        Err(error) => claim_failed(dispatcher, relay, source, &error),
    };
    // Awaited whatever became of the first: what it leased must reach the streams.
    let followed = match followed {
        Some(followed) => followed,
        None => following.await,
    };
    match followed.and_then(|followed| followed.hand_out(dispatcher, relay, subscription, source)) {
        Some(second) => claimed.and(second),
        None => claimed,
    }
}

/// Backs `source` off after a failed claim, and logs the failure.
fn claim_failed(
    dispatcher: &Dispatcher,
    relay: &Relay,
    source: &Source,
    error: &StoreError,
) -> Claimed {
    let mut state = dispatcher.state.lock().expect("dispatcher lock");
    let known = state.sources.entry(source.id).or_default();
    let delay = known
        .failing
        .map_or(FAILED_CLAIM_FIRST_DELAY, |(_, delay)| {
            (delay * 2).min(relay.inner.config.poll_interval)
        });
    known.failing = Some((Instant::now() + delay, delay));
    known.news = true;
    known.due_pending = true;
    drop(state);
    // A lost connection is logged once, by the health monitor.
    if source.is_connected() && !error.is_unavailable() {
        tracing::warn!(subscription_id = dispatcher.subscription_id.0, source = %source.name, %error, retry_in = ?delay, "claim failed");
    } else {
        tracing::debug!(subscription_id = dispatcher.subscription_id.0, source = %source.name, %error, retry_in = ?delay, "claim failed");
    }
    Claimed::Failed
}

/// What a claim that followed another made, within `limits`.
struct Followed {
    outcome: Result<Option<Claim>, StoreError>,
    limits: ClaimLimits,
    started: Instant,
}

/// The claim that follows one on `source` once that one handed over its read position
/// (see [`claim`]), within what it leaves of `room`: `None` when it handed nothing over
/// or what is left holds no worthwhile claim (250 deliveries, or a whole batch when
/// batches are smaller).
async fn follow(
    dispatcher: &Dispatcher,
    relay: &Relay,
    subscription: &Subscription,
    source: &Source,
    room: Option<ClaimLimits>,
    handed_over: tokio::sync::oneshot::Receiver<ClaimHandover>,
) -> Option<Followed> {
    let handover = handed_over.await.ok()?;
    let room = room?;
    let batch = relay.inner.config.claim_batch_size;
    let limits = ClaimLimits {
        count: room.count.saturating_sub(handover.leased).min(batch),
        bytes: room.bytes.saturating_sub(handover.bytes),
    };
    if limits.count < worthwhile_following(batch) || limits.bytes == 0 {
        return None;
    }
    let lease_token = next_lease_token(dispatcher);
    let started = Instant::now();
    let outcome = source
        .store
        .claim_following(subscription, lease_token, limits, handover)
        .await;
    Some(Followed {
        outcome,
        limits,
        started,
    })
}

/// Whether a claim on `source` may be followed by another now.
fn may_follow(dispatcher: &Dispatcher, source: &Source) -> bool {
    let state = dispatcher.state.lock().expect("dispatcher lock");
    state
        .sources
        .get(&source.id)
        .and_then(|known| known.no_following_until)
        .is_none_or(|until| Instant::now() >= until)
}

/// The fewest deliveries a following claim is made for.
fn worthwhile_following(batch: usize) -> usize {
    WORTHWHILE_CLAIM.min(batch)
}

impl Followed {
    /// Hands out what the claim leased; `None` when it leased nothing (the next claim
    /// reads those events), a failure logged.
    fn hand_out(
        self,
        dispatcher: &Arc<Dispatcher>,
        relay: &Relay,
        subscription: &Subscription,
        source: &Source,
    ) -> Option<Claimed> {
        match self.outcome {
            Ok(Some(claim)) => {
                metrics::claimed(
                    subscription.name.as_str(),
                    source.name.as_str(),
                    self.started.elapsed(),
                );
                tracing::debug!(subscription_id = dispatcher.subscription_id.0, source = %source.name, deliveries = claim.deliveries.len(), "following claim leased");
                Some(hand_out(
                    dispatcher,
                    relay,
                    subscription,
                    source,
                    self.limits,
                    claim,
                ))
            }
            Ok(None) => {
                let mut state = dispatcher.state.lock().expect("dispatcher lock");
                let known = state.sources.entry(source.id).or_default();
                known.no_following_until = Some(Instant::now() + FOLLOWING_REST);
                None
            }
            Err(error) => {
                // The next claim reads on from the read position, and fails in turn,
                // backing the source off, when the source is in trouble.
                let mut state = dispatcher.state.lock().expect("dispatcher lock");
                state.sources.entry(source.id).or_default().news = true;
                tracing::debug!(subscription_id = dispatcher.subscription_id.0, source = %source.name, %error, "following claim failed");
                None
            }
        }
    }
}

/// The next lease token: `token_base + claim number`.
fn next_lease_token(dispatcher: &Dispatcher) -> i64 {
    dispatcher.token_base.wrapping_add(
        dispatcher
            .claims
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
    )
}

/// Records what `claim` (made within `limits`) says about its source and hands its
/// deliveries to the streams.
fn hand_out(
    dispatcher: &Arc<Dispatcher>,
    relay: &Relay,
    subscription: &Subscription,
    source: &Source,
    limits: ClaimLimits,
    claim: Claim,
) -> Claimed {
    let count = claim.deliveries.len();
    let bytes: u64 = claim.deliveries.iter().map(Delivery::size).sum();
    {
        let mut state = dispatcher.state.lock().expect("dispatcher lock");
        let known = state.sources.entry(source.id).or_default();
        known.failing = None;
        known.more_waiting =
            count >= limits.count || bytes >= limits.bytes || claim.read_full_batch;
        known.due_pending |= claim.made_due;
        // Wake when the first event it scheduled here is due (the due claim takes it).
        if let Some(due) = claim.next_scheduled {
            known.retry_at = Some(known.retry_at.map_or(due, |at| at.min(due)));
        }
    }
    if claim.dead_lettered > 0 {
        metrics::dead_lettered(
            subscription.name.as_str(),
            source.name.as_str(),
            claim.dead_lettered,
        );
    }
    if claim.expired > 0 {
        metrics::expired(subscription.name.as_str(), claim.expired);
    }
    if claim.filtered > 0 {
        metrics::filtered(
            subscription.name.as_str(),
            claim.filtered,
            claim.filter_errors,
        );
    }
    let deliveries = transformed(dispatcher, relay, subscription, claim.deliveries);
    let undelivered = dispatcher.distribute(deliveries);
    if !undelivered.is_empty() {
        dispatcher.release_in_background(undelivered);
    }
    Claimed::Some {
        count,
        bytes,
        again: claim.read_full_batch || claim.made_due,
    }
}

/// The deliveries with the subscription's transform applied to their payloads. Those it
/// fails on are dead-lettered with the error, in the background, as a nack would (their
/// aggregates freed on an ordered subscription): it would fail on every attempt.
fn transformed(
    dispatcher: &Arc<Dispatcher>,
    relay: &Relay,
    subscription: &Subscription,
    deliveries: Vec<Delivery>,
) -> Vec<Delivery> {
    let Some(transform) = &subscription.settings.transform else {
        return deliveries;
    };
    let mut failed = Vec::new();
    let max_bytes = relay.inner.config.max_payload_bytes;
    let deliveries = deliveries
        .into_iter()
        .filter_map(
            |mut delivery| match transform.apply_within(&delivery.event, max_bytes) {
                Ok(payload) => {
                    delivery.event.payload = payload;
                    delivery.event.content_type = DEFAULT_CONTENT_TYPE.to_owned();
                    Some(delivery)
                }
                Err(error) => {
                    let reason: String = format!("transform: {error}")
                        .replace('\0', " ")
                        .chars()
                        .take(1000)
                        .collect();
                    failed.push((delivery.ack_id, reason));
                    None
                }
            },
        )
        .collect();
    if !failed.is_empty() {
        let (relay, name) = (relay.clone(), subscription.name.clone());
        dispatcher.tasks.spawn(async move {
            for (ack, reason) in failed {
                metrics::transform_failed(name.as_str());
                // A stale lease was settled by someone else meanwhile; on failure the
                // lease expires, and the next attempt fails the same way.
                if let Err(error) = relay.nack(&name, ack, &reason, None, true).await {
                    tracing::warn!(subscription = %name, %error, "cannot dead-letter an event the transform failed on");
                }
            }
        });
    }
    deliveries
}

/// The subscription reads a source it has no read position in yet (the source was added
/// later, or was down when the subscription was created): it starts there as it started
/// everywhere else.
async fn start_reading(dispatcher: &Dispatcher, subscription: &Subscription, source: &Source) {
    if let Err(error) = source
        .store
        .create_cursor(subscription.id, subscription.late_start())
        .await
    {
        tracing::warn!(subscription = %subscription.name, source = %source.name, %error, "cannot start reading the source");
    }
    // Claim it again at once.
    dispatcher
        .state
        .lock()
        .expect("dispatcher lock")
        .sources
        .entry(source.id)
        .or_default()
        .news = true;
}

/// Reads the definition again from `default`; false when the subscription is gone. While
/// `default` cannot be reached, the definition last read stands.
async fn read_definition(dispatcher: &Dispatcher) -> bool {
    let definitions = &dispatcher.sources.default_source().store;
    match definitions
        .subscription_by_id(dispatcher.subscription_id)
        .await
    {
        Ok(Some(subscription)) => {
            dispatcher.set_definition(subscription);
            true
        }
        Ok(None) => false,
        Err(error) => {
            tracing::debug!(subscription_id = dispatcher.subscription_id.0, %error, "cannot read the subscription; keeping its last settings");
            true
        }
    }
}

/// Asks a source which of our leases there are still held: acks and extensions that
/// reached another gateway process are only visible there.
async fn refresh_leases(dispatcher: &Dispatcher, source_id: SourceId) {
    let leases = dispatcher
        .state
        .lock()
        .expect("dispatcher lock")
        .streams
        .leases_of(source_id);
    reread_leases(dispatcher, source_id, leases, Missing::Settled).await;
}

/// What became of a lease the source no longer holds.
enum Missing {
    /// Settled elsewhere: forget it, freeing its stream's room.
    Settled,
    /// Its deadline passed (we are asking about overdue leases): it expires here next.
    Expired,
}

/// Takes the deadlines of `leases` from their source: a lease it still holds keeps its
/// deadline there. Without an answer (the source is down) nothing changes, and it
/// returns false.
async fn reread_leases(
    dispatcher: &Dispatcher,
    source_id: SourceId,
    leases: Vec<LeaseId>,
    missing: Missing,
) -> bool {
    let Some(source) = dispatcher.sources.get(source_id) else {
        return false;
    };
    if leases.is_empty() {
        return true;
    }
    if !source.is_connected() {
        return false;
    }
    match source
        .store
        .live_leases(dispatcher.subscription_id, &leases)
        .await
    {
        Ok(live) => {
            let live: HashMap<i64, DateTime<Utc>> = live.into_iter().collect();
            let mut state = dispatcher.state.lock().expect("dispatcher lock");
            for lease in leases {
                let (key, token) = (lease.key_in(source_id), lease.token);
                match (live.get(&lease.position), &missing) {
                    (Some(deadline), _) => state.streams.extend(key, token, *deadline),
                    (None, Missing::Settled) => {
                        state.streams.forget_matching(key, token);
                    }
                    (None, Missing::Expired) => {}
                }
            }
            true
        }
        Err(error) => {
            tracing::debug!(subscription_id = dispatcher.subscription_id.0, source = %source.name, %error, "lease refresh failed");
            false
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
    dispatcher.audience.fetch_add(1, Ordering::Relaxed);
    true
}

/// Ends every stream with the error `reason` makes and gives all leases back.
fn end_streams(dispatcher: &Arc<Dispatcher>, relay: &Relay, reason: fn() -> Error) {
    let (senders, leases) = {
        let mut dispatchers = relay.inner.dispatchers.lock().expect("dispatchers lock");
        let mut state = dispatcher.state.lock().expect("dispatcher lock");
        state.closed = true;
        dispatchers.remove(&dispatcher.subscription_id);
        dispatcher.audience.fetch_add(1, Ordering::Relaxed);
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
