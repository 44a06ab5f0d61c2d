//! Flow control for the streams of one dispatcher: how many deliveries and bytes each
//! stream holds unsettled, how much the dispatcher may claim for them, and which stream
//! takes each delivery. Pure bookkeeping without I/O, kept apart so its rules can be read
//! and tested on their own.
//!
//! The rules:
//! - a stream holds at most `max_in_flight` unsettled deliveries and, beyond its first,
//!   at most `max_in_flight_bytes` of them (so one delivery larger than the limit still
//!   goes out, and a stream exceeds its byte limit by at most one delivery);
//! - a stream that asked for at most `max_deliveries` in all takes no more once it has
//!   them, whatever it settles: a consumer that reads a fixed number never has one more
//!   leased that it would only give back, at the cost of an attempt;
//! - deliveries waiting in this process's memory for their stream to send them count
//!   against one gateway-wide budget; while it is spent, only a stream that has nothing
//!   waiting may take a delivery, one at a time. Memory stays bounded whatever consumers
//!   do, and a stream that reads keeps receiving;
//! - a stream whose leases expired is offered one delivery at a time, after a rest of 1 s
//!   doubling to a minute while it keeps letting leases expire; each settlement ends the
//!   rest and widens what it may hold by one, back up to `max_in_flight` (as TCP's slow
//!   start: the window doubles each round trip). A consumer that reads and never acks
//!   would otherwise have all its deliveries re-leased to it wave after wave, and that
//!   work starves the healthy subscriptions;
//! - a new stream starts the same way, with a window of [`INITIAL_WINDOW`] (or its
//!   `max_in_flight` when smaller) that each settlement widens by one, and that also
//!   doubles each growth step it goes without settling, up to `max_in_flight`. The step
//!   is a sixteenth of the subscription's ack deadline (at most [`LONGEST_GROWTH_STEP`]),
//!   so the window reaches 100 within a quarter of the deadline and 1,000 within half
//!   of it: a consumer that collects a batch before it acks any gets it well before its
//!   first lease expires, whatever the deadline, while a thousand streams that read and
//!   never ack cannot lease their whole `max_in_flight` each in the moment they attach.
//!   The window grows into a claim only while the stream has taken out everything it
//!   was sent: one that does not read is not sent more for its age alone;
//! - a claim smaller than half of what the streams may hold, and smaller than
//!   [`WORTHWHILE_CLAIM`], waits up to [`CLAIM_LINGER`] for more room while every stream
//!   still holds at least half its window, so its consumer has work meanwhile (Kafka's
//!   `fetch.min.bytes` and `fetch.max.wait.ms`). Acks free room a hundred at a time;
//!   claiming each time would make many small claims, and a claim costs the database as
//!   much to start as to read a few hundred events. The threshold is fixed, not a part
//!   of the largest claim: a larger `claim_batch_size` lets a claim take more when there
//!   is room for it, and does not make a stream wait longer before it is refilled;
//! - a stream is *proven* once it has settled something since it attached or since its
//!   leases last expired. A dispatcher whose streams with room are all unproven claims
//!   only in its turn ([`UnprovenClaims`]): one such claim at a time in the process, each
//!   that leased something followed by a rest as long as it took, so they never take more
//!   than half of one pool connection, and the claims of streams that do settle never
//!   queue behind them.

use std::{
    collections::{HashMap, hash_map::Entry},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use chrono::{DateTime, Utc};
use tokio::sync::{Notify, mpsc};

use crate::{
    domain::{Delivery, LeaseId, LeaseKey, SourceId},
    error::Error,
    storage::ClaimLimits,
};

/// What a new stream may hold unsettled before its first settlement (TCP's initial
/// window is ten segments too).
pub const INITIAL_WINDOW: usize = 10;
/// How long a small claim may wait for more room (see the module's rules).
pub const CLAIM_LINGER: Duration = Duration::from_millis(2);

/// A claim of at least this many deliveries goes at once: its fixed cost, about that of
/// reading a few hundred events, is already spread thin (see the module's rules).
pub const WORTHWHILE_CLAIM: usize = 250;

/// A new stream's window doubles each time a sixteenth of its ack deadline passes
/// without a settlement (see the module's rules)...
const GROWTH_STEPS_PER_DEADLINE: u32 = 16;
/// ...and at least this often, so a long deadline does not make a batch consumer wait
/// long for its window.
pub const LONGEST_GROWTH_STEP: Duration = Duration::from_secs(1);
/// The shortest step, whatever the deadline: the dispatcher wakes for each step.
const SHORTEST_GROWTH_STEP: Duration = Duration::from_millis(10);

/// How long a new stream's window takes to double without a settlement, for leases of
/// `ack_deadline`.
fn growth_step(ack_deadline: Duration) -> Duration {
    (ack_deadline / GROWTH_STEPS_PER_DEADLINE).clamp(SHORTEST_GROWTH_STEP, LONGEST_GROWTH_STEP)
}

/// Claims made only for unproven streams (new, or whose leases expired unsettled), at
/// most this many at once in the whole process.
const UNPROVEN_CLAIMS_AT_ONCE: usize = 1;

/// The gateway-wide turn a dispatcher takes while it claims for unproven streams only.
/// Streams that read and never ack can be many (a thousand attaching at once), and each
/// claim for them is a transaction holding a pool connection and deliveries to send:
/// one turn at a time, each turn that leased something followed by a rest as long as it
/// took, they use at most half of one connection and leave the rest of the process to
/// the subscriptions whose consumers settle. A turn that found nothing to lease (streams
/// of subscriptions with no new events) costs no rest, so it never delays the others.
#[derive(Debug)]
pub struct UnprovenClaims {
    turns: tokio::sync::Semaphore,
    /// The next turn starts no earlier than this.
    rested_at: std::sync::Mutex<tokio::time::Instant>,
}

impl Default for UnprovenClaims {
    fn default() -> Self {
        UnprovenClaims {
            turns: tokio::sync::Semaphore::new(UNPROVEN_CLAIMS_AT_ONCE),
            rested_at: std::sync::Mutex::new(tokio::time::Instant::now()),
        }
    }
}

impl UnprovenClaims {
    /// Waits for the turn and for the rest after the previous one; the turn ends when
    /// the returned value is dropped.
    pub async fn turn(&self) -> UnprovenTurn<'_> {
        let permit = self
            .turns
            .acquire()
            .await
            .expect("the semaphore is never closed");
        let rested_at = *self.rested_at.lock().expect("unproven claims lock");
        tokio::time::sleep_until(rested_at).await;
        UnprovenTurn {
            claims: self,
            started: tokio::time::Instant::now(),
            leased: false,
            _permit: permit,
        }
    }
}

/// One dispatcher's turn at claiming for unproven streams.
#[derive(Debug)]
pub struct UnprovenTurn<'a> {
    claims: &'a UnprovenClaims,
    started: tokio::time::Instant,
    leased: bool,
    _permit: tokio::sync::SemaphorePermit<'a>,
}

impl UnprovenTurn<'_> {
    /// Notes that the turn leased deliveries: the next turn rests first.
    pub fn leased(&mut self) {
        self.leased = true;
    }
}

impl Drop for UnprovenTurn<'_> {
    fn drop(&mut self) {
        if !self.leased {
            return;
        }
        let now = tokio::time::Instant::now();
        *self.claims.rested_at.lock().expect("unproven claims lock") =
            now + now.saturating_duration_since(self.started);
    }
}

/// What one stream may hold unsettled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamLimits {
    pub deliveries: usize,
    pub bytes: u64,
    /// Most deliveries it takes in all; `None`: no end.
    pub total: Option<u64>,
    /// How long its leases last: a new stream's window grows in time for a consumer
    /// that collects a batch to have it before the first lease expires.
    pub ack_deadline: Duration,
}

/// Bytes of deliveries waiting in this process's memory for their streams, across all
/// streams of all subscriptions, and the bound on them.
#[derive(Debug)]
pub struct BufferBudget {
    used: AtomicU64,
    limit: u64,
    /// Signalled when a spent budget becomes available again.
    pub freed: Notify,
}

impl BufferBudget {
    pub fn new(limit: u64) -> Self {
        BufferBudget {
            used: AtomicU64::new(0),
            limit,
            freed: Notify::new(),
        }
    }

    pub fn is_spent(&self) -> bool {
        self.used.load(Ordering::Relaxed) >= self.limit
    }

    fn remaining(&self) -> u64 {
        self.limit.saturating_sub(self.used.load(Ordering::Relaxed))
    }

    fn add(&self, bytes: u64) {
        self.used.fetch_add(bytes, Ordering::Relaxed);
    }

    pub fn release(&self, bytes: u64) {
        let before = self.used.fetch_sub(bytes, Ordering::Relaxed);
        if before >= self.limit && before - bytes < self.limit {
            self.freed.notify_waiters();
        }
    }
}

/// A delivery sent to a stream and not settled yet.
#[derive(Debug)]
pub struct Lease {
    pub stream_id: u64,
    pub token: i64,
    pub deadline: DateTime<Utc>,
    /// When the delivery was handed to its stream; for the deliver-to-ack latency.
    pub leased_at: Instant,
    size: u64,
}

pub type DeliverySender = mpsc::Sender<Result<Delivery, Error>>;

struct Slot {
    id: u64,
    limits: StreamLimits,
    in_flight: usize,
    in_flight_bytes: u64,
    /// Bytes sent into the stream's channel and not yet taken out by it; shared with the
    /// stream, which subtracts what it takes.
    buffered: Arc<AtomicU64>,
    sender: DeliverySender,
    /// How many unsettled deliveries it may hold now: [`INITIAL_WINDOW`] at first, cut
    /// to one when its leases expire, widened by each settlement up to
    /// `limits.deliveries` (and with time while `growing_since` is set; see
    /// [`Slot::window`]).
    window: usize,
    /// Set from attaching until its first settlement or stall: its window doubles each
    /// growth step since then, so a consumer that acks only after collecting many
    /// deliveries is never stuck below what it waits for.
    growing_since: Option<Instant>,
    /// It settled something since it attached or since its leases last expired.
    proven: bool,
    /// Times in a row its leases expired with no settlement between.
    stalls: u32,
    /// Deliveries it may still take in all (`StreamLimits::total`); `None`: no end.
    remaining: Option<u64>,
    /// It takes nothing before this (its leases expired unsettled).
    resting_until: Option<DateTime<Utc>>,
}

/// First pause of a stream whose leases expired, doubling while it stays stalled.
const FIRST_REST: chrono::TimeDelta = chrono::TimeDelta::seconds(1);
const LONGEST_REST: chrono::TimeDelta = chrono::TimeDelta::seconds(60);

impl Slot {
    /// How many unsettled deliveries it may hold at `now`.
    fn window(&self, now: Instant) -> usize {
        let Some(since) = self.growing_since else {
            return self.window;
        };
        let doublings =
            now.saturating_duration_since(since).as_millis() / self.growth_step().as_millis();
        let doublings = u32::try_from(doublings).unwrap_or(u32::MAX).min(32);
        self.window
            .saturating_mul(1usize << doublings)
            .min(self.limits.deliveries)
    }

    /// When a claim may next lease more for it without a settlement, if none can now
    /// and its window still grows: at its next growth step (by which time it may also
    /// have taken out what it was sent).
    fn next_growth(&self, now: Instant) -> Option<Instant> {
        let since = self.growing_since?;
        if self.in_flight >= self.limits.deliveries || self.room(now) > 0 {
            return None;
        }
        let step = self.growth_step().as_millis();
        let next = (now.saturating_duration_since(since).as_millis() / step + 1) * step;
        Some(since + Duration::from_millis(u64::try_from(next).unwrap_or(u64::MAX)))
    }

    fn growth_step(&self) -> Duration {
        growth_step(self.limits.ack_deadline)
    }

    /// What a claim may lease for it at `now`: the room in its window, which grows with
    /// time into a claim only while it has taken out everything it was sent.
    fn room(&self, now: Instant) -> usize {
        let window = match self.buffered.load(Ordering::Relaxed) {
            0 => self.window(now),
            _ => self.window,
        };
        window.saturating_sub(self.in_flight)
    }

    /// [`Slot::window`] now; the clock is read only while the window grows by itself
    /// (a proven stream's never does), as this is asked for every delivery placed.
    fn current_window(&self) -> usize {
        match self.growing_since {
            None => self.window,
            Some(_) => self.window(Instant::now()),
        }
    }

    fn can_take(&self, budget: &BufferBudget) -> bool {
        self.resting_until.is_none_or(|until| until <= Utc::now())
            && self.remaining != Some(0)
            && !self.sender.is_closed()
            // Full with deliveries whose leases expired before it read them.
            && self.sender.capacity() > 0
            && self.in_flight < self.current_window()
            && (self.in_flight == 0 || self.in_flight_bytes < self.limits.bytes)
            && (!budget.is_spent() || self.buffered.load(Ordering::Relaxed) == 0)
    }

    /// Gives back the room `lease` took.
    fn free(&mut self, lease: &Lease) {
        self.in_flight = self.in_flight.saturating_sub(1);
        self.in_flight_bytes = self.in_flight_bytes.saturating_sub(lease.size);
    }
}

/// The streams of one dispatcher and the leases they hold.
#[derive(Default)]
pub struct Streams {
    slots: Vec<Slot>,
    /// Looked up for every delivery placed and every ack: a hasher cheaper than SipHash
    /// (the keys are positions the database gave out, not input a caller chooses).
    leases: foldhash::HashMap<LeaseKey, Lease>,
    next_id: u64,
    /// Next stream to offer a delivery to, so a batch spreads evenly.
    round_robin: usize,
}

impl Streams {
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn has_leases(&self) -> bool {
        !self.leases.is_empty()
    }

    /// Adds a stream; returns its id.
    pub fn attach(
        &mut self,
        limits: StreamLimits,
        sender: DeliverySender,
        buffered: Arc<AtomicU64>,
    ) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.slots.push(Slot {
            id,
            limits,
            in_flight: 0,
            in_flight_bytes: 0,
            buffered,
            sender,
            window: INITIAL_WINDOW.min(limits.deliveries),
            growing_since: Some(Instant::now()),
            proven: false,
            stalls: 0,
            remaining: limits.total,
            resting_until: None,
        });
        id
    }

    /// Removes a stream; returns its leases (key, token), which nobody holds now.
    pub fn detach(&mut self, stream_id: u64) -> Vec<(LeaseKey, i64)> {
        self.slots.retain(|slot| slot.id != stream_id);
        let orphaned: Vec<(LeaseKey, i64)> = self
            .leases
            .iter()
            .filter(|(_, lease)| lease.stream_id == stream_id)
            .map(|(key, lease)| (*key, lease.token))
            .collect();
        for (key, _) in &orphaned {
            self.leases.remove(key);
        }
        orphaned
    }

    /// Removes every stream; returns their senders and all leases.
    pub fn take_all(&mut self) -> (Vec<DeliverySender>, Vec<(LeaseKey, i64)>) {
        let senders = self.slots.drain(..).map(|slot| slot.sender).collect();
        let leases = self
            .leases
            .drain()
            .map(|(key, lease)| (key, lease.token))
            .collect();
        (senders, leases)
    }

    /// What the next claim may lease for these streams (at most `batch` deliveries), or
    /// `None` when no stream can take anything now.
    pub fn claim_limits(&self, batch: usize, budget: &BufferBudget) -> Option<ClaimLimits> {
        if budget.is_spent() {
            // One at a time, for a stream that has nothing waiting in memory.
            return self
                .slots
                .iter()
                .any(|slot| slot.can_take(budget))
                .then_some(ClaimLimits { count: 1, bytes: 1 });
        }
        let (mut count, mut bytes) = (0usize, 0u64);
        let now = Instant::now();
        for slot in self.slots.iter().filter(|slot| slot.can_take(budget)) {
            let room = slot.room(now);
            count += slot.remaining.map_or(room, |remaining| {
                room.min(usize::try_from(remaining).unwrap_or(room))
            });
            bytes = bytes.saturating_add(
                slot.limits
                    .bytes
                    .saturating_sub(slot.in_flight_bytes)
                    .max(1),
            );
        }
        (count > 0).then(|| ClaimLimits {
            count: count.min(batch),
            // What the streams may hold, but no more than may wait in memory: the rest
            // could not be handed out.
            bytes: bytes.min(budget.remaining()).max(1),
        })
    }

    /// Whether a claim within `limits` may wait for more room: it is below half of what
    /// the streams that can take a delivery may hold (at most `batch`), below
    /// [`WORTHWHILE_CLAIM`], and each of them still holds at least half its window.
    pub fn claim_can_wait(&self, limits: ClaimLimits, batch: usize, budget: &BufferBudget) -> bool {
        if budget.is_spent() || limits.count >= WORTHWHILE_CLAIM {
            return false;
        }
        let now = Instant::now();
        let mut capacity = 0usize;
        for slot in self.slots.iter().filter(|slot| slot.can_take(budget)) {
            let window = slot.window(now);
            if slot.in_flight * 2 < window {
                return false;
            }
            capacity += slot.remaining.map_or(window, |remaining| {
                window.min(usize::try_from(remaining).unwrap_or(window))
            });
        }
        limits.count * 2 < capacity.min(batch)
    }

    /// Whether every stream that can take a delivery now is unproven (and one can): a
    /// claim for them waits for the gateway-wide [`UnprovenClaims`] permit.
    pub fn only_unproven_can_take(&self, budget: &BufferBudget) -> bool {
        let (any, proven) = self
            .slots
            .iter()
            .filter(|slot| slot.can_take(budget))
            .fold((false, false), |(_, proven), slot| {
                (true, proven || slot.proven)
            });
        any && !proven
    }

    /// Sends a delivery to the next stream that can take it and records its lease, taken
    /// at `leased_at`; when none can, returns its lease (key, token), which nobody holds.
    pub fn place(
        &mut self,
        delivery: Delivery,
        budget: &BufferBudget,
        leased_at: Instant,
    ) -> Result<(), (LeaseKey, i64)> {
        let size = delivery.size();
        let (key, token, deadline) = (
            delivery.ack_id.lease_key(),
            delivery.ack_id.lease_token,
            delivery.ack_deadline,
        );
        // The source leased the event anew, so an older lease of it here is over (it
        // expired, or was nacked on another gateway that has not told us yet): its
        // stream's room comes back. Left in place, it would stay counted for good.
        self.remove_lease(key);
        let mut delivery = delivery;
        let count = self.slots.len();
        for offset in 0..count {
            let index = (self.round_robin + offset) % count;
            let slot = &mut self.slots[index];
            if !slot.can_take(budget) {
                continue;
            }
            // Counted before the send: the stream may take it out at once.
            slot.buffered.fetch_add(size, Ordering::Relaxed);
            budget.add(size);
            match slot.sender.try_send(Ok(delivery)) {
                Ok(()) => {
                    slot.in_flight += 1;
                    if let Some(remaining) = &mut slot.remaining {
                        *remaining -= 1;
                    }
                    slot.in_flight_bytes += size;
                    let stream_id = slot.id;
                    self.leases.insert(
                        key,
                        Lease {
                            stream_id,
                            token,
                            deadline,
                            leased_at,
                            size,
                        },
                    );
                    self.round_robin = index + 1;
                    return Ok(());
                }
                Err(mpsc::error::TrySendError::Full(returned))
                | Err(mpsc::error::TrySendError::Closed(returned)) => {
                    slot.buffered.fetch_sub(size, Ordering::Relaxed);
                    budget.release(size);
                    delivery = returned.expect("only deliveries are sent here");
                }
            }
        }
        Err((key, token))
    }

    /// Forgets the settled lease at `key` when `token` names it, freeing its stream's
    /// room; a stream that settles is proven, rests no more and may hold one more than
    /// before, up to its limit.
    pub fn forget_matching(&mut self, key: LeaseKey, token: i64) -> Option<Lease> {
        // One lookup: this runs for every ack.
        let lease = match self.leases.entry(key) {
            Entry::Occupied(entry) if entry.get().token == token => entry.remove(),
            _ => return None,
        };
        self.settled(&lease);
        Some(lease)
    }

    /// Frees the room of `lease`, settled and no longer recorded, in its stream.
    fn settled(&mut self, lease: &Lease) {
        if let Some(slot) = self.slots.iter_mut().find(|s| s.id == lease.stream_id) {
            slot.free(lease);
            slot.stalls = 0;
            slot.resting_until = None;
            slot.proven = true;
            slot.window = (slot.current_window() + 1).min(slot.limits.deliveries);
            // From here on settlements widen it, as TCP's acks do.
            slot.growing_since = None;
        }
    }

    /// [`Streams::forget_matching`] whatever the lease's token.
    #[cfg(test)]
    fn forget(&mut self, key: LeaseKey) -> Option<Lease> {
        let token = self.leases.get(&key)?.token;
        self.forget_matching(key, token)
    }

    fn remove_lease(&mut self, key: LeaseKey) -> Option<Lease> {
        let lease = self.leases.remove(&key)?;
        if let Some(slot) = self.slots.iter_mut().find(|s| s.id == lease.stream_id) {
            slot.free(&lease);
        }
        Some(lease)
    }

    pub fn extend(&mut self, key: LeaseKey, token: i64, deadline: DateTime<Utc>) {
        if let Some(lease) = self.leases.get_mut(&key)
            && lease.token == token
        {
            lease.deadline = deadline;
        }
    }

    /// Leases whose deadline here has passed, by source. The database may hold a later
    /// one: an extension that reached another gateway moved it only there.
    pub fn overdue(&self, now: DateTime<Utc>) -> HashMap<SourceId, Vec<LeaseId>> {
        let mut overdue: HashMap<SourceId, Vec<LeaseId>> = HashMap::new();
        for (key, lease) in &self.leases {
            if lease.deadline <= now {
                overdue
                    .entry(key.source)
                    .or_default()
                    .push(key.with_token(lease.token));
            }
        }
        overdue
    }

    /// Forgets leases whose deadline passed: they are no longer this process's to count.
    /// Their streams rest, then take one at a time — unless their source could not be
    /// asked (`unanswered`): a source that is down never makes a consumer look stalled,
    /// so its outage does not slow what the others deliver. Returns the sources the
    /// leases belonged to.
    pub fn expire(&mut self, now: DateTime<Utc>, unanswered: &[SourceId]) -> Vec<SourceId> {
        let expired: Vec<LeaseKey> = self
            .leases
            .iter()
            .filter(|(_, lease)| lease.deadline <= now)
            .map(|(key, _)| *key)
            .collect();
        let mut stalled = Vec::new();
        for key in &expired {
            if let Some(lease) = self.remove_lease(*key)
                && !unanswered.contains(&key.source)
            {
                stalled.push(lease.stream_id);
            }
        }
        stalled.sort_unstable();
        stalled.dedup();
        for slot in self
            .slots
            .iter_mut()
            .filter(|slot| stalled.contains(&slot.id))
        {
            let rest = FIRST_REST * 2i32.pow(slot.stalls.min(6));
            slot.resting_until = Some(now + rest.min(LONGEST_REST));
            slot.stalls = slot.stalls.saturating_add(1);
            slot.window = 1;
            slot.growing_since = None;
            slot.proven = false;
        }
        let mut sources: Vec<SourceId> = expired.into_iter().map(|key| key.source).collect();
        sources.sort();
        sources.dedup();
        sources
    }

    /// Forgets every lease of a source that went down, freeing its streams' room without
    /// counting a stall: nobody can settle those deliveries until the source is back
    /// (an ack then still reaches its lease there), and they must not hold room that
    /// the other sources' deliveries could use.
    pub fn forget_source(&mut self, source: SourceId) -> usize {
        let leases = self.leases_of(source);
        for lease in &leases {
            self.remove_lease(lease.key_in(source));
        }
        leases.len()
    }

    /// When the next lease expires, the next resting stream may take again or the next
    /// full new stream's window grows.
    pub fn next_deadline(&self) -> Option<DateTime<Utc>> {
        let now = Utc::now();
        let instant = Instant::now();
        let growths = self.slots.iter().filter_map(|slot| {
            let at = slot.next_growth(instant)?;
            Some(now + chrono::TimeDelta::from_std(at - instant).ok()?)
        });
        self.leases
            .values()
            .map(|lease| lease.deadline)
            .chain(
                self.slots
                    .iter()
                    .filter_map(|slot| slot.resting_until)
                    .filter(|until| *until > now),
            )
            .chain(growths)
            .min()
    }

    /// The leases of one source.
    pub fn leases_of(&self, source: SourceId) -> Vec<LeaseId> {
        self.leases
            .iter()
            .filter(|(key, _)| key.source == source)
            .map(|(key, lease)| key.with_token(lease.token))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use chrono::Utc;
    use uuid::Uuid;

    use super::*;
    use crate::domain::{AckId, Event};

    fn delivery(position: i64, payload_bytes: usize) -> Delivery {
        Delivery {
            ack_id: AckId {
                source: SourceId(0),
                position,
                attempt: 1,
                lease_token: 7,
            },
            attempt: 1,
            ack_deadline: Utc::now() + chrono::Duration::seconds(30),
            event: Event {
                source: crate::domain::SourceName::default_source(),
                id: Uuid::nil(),
                aggregate_type: "a".into(),
                aggregate_id: "1".into(),
                aggregate_version: None,
                event_type: "e".into(),
                payload: vec![0; payload_bytes],
                content_type: "application/octet-stream".into(),
                metadata: Default::default(),
                occurred_at: Utc::now(),
                created_at: Utc::now(),
                deliver_at: None,
                expires_at: None,
                transaction_id: 1,
            },
        }
    }

    /// The leases of the tests' streams: their window grows each second.
    const ACK_DEADLINE: Duration = Duration::from_secs(16);

    /// The key of the lease of the event at `position` in the default source.
    fn key(position: i64) -> LeaseKey {
        LeaseKey {
            source: SourceId(0),
            position,
        }
    }

    fn stream(
        streams: &mut Streams,
        deliveries: usize,
        bytes: u64,
    ) -> (u64, mpsc::Receiver<Result<Delivery, Error>>, Arc<AtomicU64>) {
        let (sender, receiver) = mpsc::channel(deliveries);
        let buffered = Arc::new(AtomicU64::new(0));
        let id = streams.attach(
            StreamLimits {
                deliveries,
                bytes,
                total: None,
                ack_deadline: ACK_DEADLINE,
            },
            sender,
            buffered.clone(),
        );
        (id, receiver, buffered)
    }

    /// Places a delivery at each of `positions`, each read by the stream of `receiver`.
    fn hand_out(
        streams: &mut Streams,
        receiver: &mut mpsc::Receiver<Result<Delivery, Error>>,
        budget: &BufferBudget,
        positions: impl IntoIterator<Item = i64>,
    ) {
        for position in positions {
            streams
                .place(delivery(position, 10), budget, Instant::now())
                .unwrap();
            assert!(receiver.try_recv().is_ok());
        }
    }

    /// The next claim's size for a batch of `batch`, and whether it may wait.
    fn next_claim(streams: &Streams, budget: &BufferBudget, batch: usize) -> (usize, bool) {
        let limits = streams.claim_limits(batch, budget).unwrap();
        (limits.count, streams.claim_can_wait(limits, batch, budget))
    }

    #[test]
    fn a_stream_takes_deliveries_until_its_count_or_bytes_run_out() {
        let budget = BufferBudget::new(u64::MAX);
        let mut streams = Streams::default();
        let (_, mut receiver, _) = stream(&mut streams, 3, 10_000);
        let limits = streams.claim_limits(500, &budget).unwrap();
        assert_eq!((limits.count, limits.bytes), (3, 10_000));

        // The first delivery goes out however large; then the stream is over its bytes.
        streams
            .place(delivery(1, 50_000), &budget, Instant::now())
            .unwrap();
        assert!(streams.claim_limits(500, &budget).is_none());
        assert!(
            streams
                .place(delivery(2, 10), &budget, Instant::now())
                .is_err()
        );
        assert!(receiver.try_recv().is_ok());
        streams.forget(key(1));
        assert!(streams.claim_limits(500, &budget).is_some());

        for position in 2..5 {
            streams
                .place(delivery(position, 10), &budget, Instant::now())
                .unwrap();
        }
        assert!(streams.claim_limits(500, &budget).is_none(), "3 in flight");
    }

    #[test]
    fn a_small_claim_waits_only_while_every_stream_holds_half_its_window() {
        let budget = BufferBudget::new(u64::MAX);
        let mut streams = Streams::default();
        let (_, mut receiver, _) = stream(&mut streams, 10, u64::MAX);
        assert_eq!(
            next_claim(&streams, &budget, 500),
            (10, false),
            "nothing in flight"
        );
        hand_out(&mut streams, &mut receiver, &budget, 1..10);
        assert_eq!(next_claim(&streams, &budget, 500), (1, true));
        assert_eq!(
            next_claim(&streams, &budget, 2),
            (1, false),
            "half the batch goes at once"
        );

        for position in 1..6 {
            streams.forget(key(position));
        }
        assert_eq!(
            next_claim(&streams, &budget, 500),
            (6, false),
            "half the window free"
        );
        hand_out(&mut streams, &mut receiver, &budget, 10..12);
        assert_eq!(next_claim(&streams, &budget, 500), (4, true));

        let (_, _idle, _) = stream(&mut streams, 10, u64::MAX);
        assert_eq!(
            next_claim(&streams, &budget, 500),
            (14, false),
            "a stream with little in flight does not wait for the others"
        );
    }

    #[test]
    fn a_claim_worth_its_cost_goes_at_once_however_large_the_batch() {
        let budget = BufferBudget::new(u64::MAX);
        let mut streams = Streams::default();
        let (_, mut receiver, _) = stream(&mut streams, 1000, u64::MAX);
        // Each settlement widens the new stream's window by one, up to 1000.
        let mut position = 0;
        while streams.claim_limits(usize::MAX, &budget).unwrap().count < 1000 {
            position += 1;
            hand_out(&mut streams, &mut receiver, &budget, [position]);
            streams.forget(key(position));
        }
        let can_wait = |streams: &Streams, batch| next_claim(streams, &budget, batch).1;

        let first = position + 1;
        hand_out(&mut streams, &mut receiver, &budget, first..first + 700);
        assert!(!can_wait(&streams, 1000), "300 free go at once");
        assert!(!can_wait(&streams, 500));
        hand_out(
            &mut streams,
            &mut receiver,
            &budget,
            first + 700..first + 800,
        );
        assert!(can_wait(&streams, 1000), "200 free wait for more");
        assert!(can_wait(&streams, 500));
        assert!(!can_wait(&streams, 300), "but not past half the batch");
    }

    #[test]
    fn a_stream_with_a_total_takes_no_more_once_it_has_them_whatever_it_settles() {
        let budget = BufferBudget::new(u64::MAX);
        let mut streams = Streams::default();
        let (sender, mut receiver) = mpsc::channel(5);
        let limits = StreamLimits {
            deliveries: 5,
            bytes: u64::MAX,
            total: Some(2),
            ack_deadline: ACK_DEADLINE,
        };
        streams.attach(limits, sender, Arc::new(AtomicU64::new(0)));
        assert_eq!(streams.claim_limits(500, &budget).unwrap().count, 2);
        streams
            .place(delivery(1, 10), &budget, Instant::now())
            .unwrap();
        assert_eq!(streams.claim_limits(500, &budget).unwrap().count, 1);
        streams
            .place(delivery(2, 10), &budget, Instant::now())
            .unwrap();
        assert!(receiver.try_recv().is_ok() && receiver.try_recv().is_ok());
        streams.forget(key(1));
        streams.forget(key(2));
        assert!(
            streams.claim_limits(500, &budget).is_none(),
            "settling frees no room beyond the total"
        );
        assert!(
            streams
                .place(delivery(3, 10), &budget, Instant::now())
                .is_err()
        );
    }

    #[test]
    fn an_event_leased_anew_frees_the_room_of_its_old_lease() {
        let budget = BufferBudget::new(u64::MAX);
        let mut streams = Streams::default();
        let (first, mut first_receiver, _) = stream(&mut streams, 1, u64::MAX);
        let (second, _second_receiver, _) = stream(&mut streams, 1, u64::MAX);
        streams
            .place(delivery(1, 10), &budget, Instant::now())
            .unwrap();
        assert_eq!(streams.leases[&key(1)].stream_id, first);
        assert!(first_receiver.try_recv().is_ok());

        // Nacked on another gateway and leased again before the notice arrived.
        let mut again = delivery(1, 10);
        again.ack_id.attempt = 2;
        again.ack_id.lease_token = 8;
        streams.place(again, &budget, Instant::now()).unwrap();
        assert_eq!(streams.leases[&key(1)].stream_id, second);
        assert_eq!(
            streams.slots[0].in_flight, 0,
            "the old lease's room is free"
        );
        assert_eq!(streams.slots[1].in_flight, 1);
        let limits = streams
            .claim_limits(500, &budget)
            .expect("the first stream has room");
        assert_eq!(limits.count, 1);
    }

    #[test]
    fn a_spent_budget_serves_only_streams_with_nothing_waiting() {
        let budget = BufferBudget::new(1_000);
        let mut streams = Streams::default();
        let (_, _stalled, _) = stream(&mut streams, 100, u64::MAX);
        let (_, mut reading, reading_buffered) = stream(&mut streams, 100, u64::MAX);

        // Spend the budget: one delivery waits in each channel.
        for position in 1..=2 {
            streams
                .place(delivery(position, 400), &budget, Instant::now())
                .unwrap();
        }
        assert!(budget.is_spent());
        assert!(streams.claim_limits(500, &budget).is_none());
        assert!(
            streams
                .place(delivery(3, 400), &budget, Instant::now())
                .is_err()
        );

        // The reading stream takes what waits for it; it may then take one more.
        while let Ok(Ok(taken)) = reading.try_recv() {
            reading_buffered.fetch_sub(taken.size(), Ordering::Relaxed);
        }
        let limits = streams.claim_limits(500, &budget).unwrap();
        assert_eq!((limits.count, limits.bytes), (1, 1));
        streams
            .place(delivery(4, 400), &budget, Instant::now())
            .unwrap();
        assert!(
            reading.try_recv().is_ok(),
            "it went to the stream that reads"
        );
    }

    #[test]
    fn forgetting_a_lease_frees_its_stream_and_expiry_forgets_old_leases() {
        let budget = BufferBudget::new(u64::MAX);
        let mut streams = Streams::default();
        let (_, _receiver, _) = stream(&mut streams, 1, u64::MAX);
        let mut late = delivery(1, 10);
        late.ack_deadline = Utc::now() - chrono::Duration::seconds(1);
        streams.place(late, &budget, Instant::now()).unwrap();
        assert!(
            streams.forget_matching(key(1), 8).is_none(),
            "another token"
        );
        assert!(streams.claim_limits(500, &budget).is_none());
        let now = Utc::now();
        assert_eq!(streams.expire(now, &[]), vec![SourceId(0)]);
        assert!(!streams.has_leases());
        // Its stream let the lease expire: it rests a second before taking more, and the
        // dispatcher is woken then.
        assert!(streams.claim_limits(500, &budget).is_none());
        assert_eq!(streams.next_deadline(), Some(now + FIRST_REST));
    }

    #[test]
    fn a_down_source_never_makes_a_stream_rest_nor_holds_its_room() {
        let budget = BufferBudget::new(u64::MAX);
        let mut streams = Streams::default();
        let (_, mut receiver, _) = stream(&mut streams, 2, u64::MAX);
        let down = SourceId(1);
        let mut late = delivery(1, 10);
        late.ack_id.source = down;
        late.ack_deadline = Utc::now() - chrono::Duration::seconds(1);
        streams.place(late, &budget, Instant::now()).unwrap();
        while receiver.try_recv().is_ok() {}
        // Its source could not be asked whether it was settled: no stall.
        assert_eq!(streams.expire(Utc::now(), &[down]), vec![down]);
        assert!(streams.slots[0].resting_until.is_none());
        assert_eq!(streams.claim_limits(500, &budget).unwrap().count, 2);

        // A source that goes down gives back the room of every lease it holds.
        let mut held = delivery(2, 10);
        held.ack_id.source = down;
        streams.place(held, &budget, Instant::now()).unwrap();
        streams
            .place(delivery(3, 10), &budget, Instant::now())
            .unwrap();
        while receiver.try_recv().is_ok() {}
        assert!(streams.claim_limits(500, &budget).is_none());
        assert_eq!(streams.forget_source(down), 1);
        assert_eq!(streams.claim_limits(500, &budget).unwrap().count, 1);
        assert!(streams.slots[0].resting_until.is_none());
        assert_eq!(
            streams.leases_of(SourceId(0)),
            vec![key(3).with_token(streams.leases[&key(3)].token)]
        );
    }

    #[test]
    fn a_stream_that_keeps_letting_leases_expire_rests_longer_until_it_settles() {
        let budget = BufferBudget::new(u64::MAX);
        let mut streams = Streams::default();
        let (_, _stalled, _) = stream(&mut streams, 10, u64::MAX);
        let (reading_id, mut reading, _) = stream(&mut streams, 10, u64::MAX);
        let expired = |position| {
            let mut late = delivery(position, 10);
            late.ack_deadline = Utc::now() - chrono::Duration::seconds(1);
            late
        };
        let mut rests = Vec::new();
        for round in 0..8 {
            // Its rest is over (time passed); it takes the next delivery and lets it expire.
            streams.slots[0].resting_until = None;
            streams.round_robin = 0;
            streams
                .place(expired(round), &budget, Instant::now())
                .unwrap();
            let now = Utc::now();
            streams.expire(now, &[]);
            let slot = &streams.slots[0];
            rests.push((slot.resting_until.unwrap() - now).num_seconds());
        }
        assert_eq!(rests, [1, 2, 4, 8, 16, 32, 60, 60]);
        // The resting stream is skipped; the other takes the next delivery.
        streams
            .place(delivery(100, 10), &budget, Instant::now())
            .unwrap();
        assert_eq!(streams.leases[&key(100)].stream_id, reading_id);
        assert!(reading.try_recv().is_ok());

        // A settlement by the stalled stream makes it trusted again.
        streams.slots[0].resting_until = None;
        streams.round_robin = 0;
        streams
            .place(delivery(101, 10), &budget, Instant::now())
            .unwrap();
        streams.forget(key(101));
        assert_eq!(streams.slots[0].stalls, 0);
        assert!(streams.slots[0].resting_until.is_none());
    }

    #[test]
    fn a_stream_whose_leases_expired_holds_one_then_one_more_per_settlement() {
        let budget = BufferBudget::new(u64::MAX);
        let mut streams = Streams::default();
        let (_, mut receiver, _) = stream(&mut streams, 4, u64::MAX);
        for position in 0..4 {
            let mut late = delivery(position, 10);
            late.ack_deadline = Utc::now() - chrono::Duration::seconds(1);
            streams.place(late, &budget, Instant::now()).unwrap();
        }
        streams.expire(Utc::now(), &[]);
        streams.slots[0].resting_until = None;
        // Its channel is full of the expired deliveries until it reads them.
        assert!(streams.claim_limits(500, &budget).is_none());
        while receiver.try_recv().is_ok() {}
        let mut offered = Vec::new();
        let mut position = 10;
        for _ in 0..5 {
            // Everything it may hold now goes out, is read and is settled.
            let limits = streams.claim_limits(500, &budget).unwrap();
            offered.push(limits.count);
            for _ in 0..limits.count {
                position += 1;
                streams
                    .place(delivery(position, 10), &budget, Instant::now())
                    .unwrap();
                assert!(receiver.try_recv().is_ok());
                streams.forget(key(position));
            }
        }
        assert_eq!(
            offered,
            [1, 2, 4, 4, 4],
            "doubling each round trip up to its limit"
        );
    }

    #[test]
    fn a_new_stream_starts_with_a_small_window_that_doubles_each_round_trip() {
        let budget = BufferBudget::new(u64::MAX);
        let mut streams = Streams::default();
        let (_, mut receiver, _) = stream(&mut streams, 100, u64::MAX);
        let mut offered = Vec::new();
        let mut position = 0;
        for _ in 0..6 {
            // Everything it may hold now goes out, is read and is settled.
            let limits = streams.claim_limits(500, &budget).unwrap();
            offered.push(limits.count);
            for _ in 0..limits.count {
                position += 1;
                streams
                    .place(delivery(position, 10), &budget, Instant::now())
                    .unwrap();
            }
            assert!(streams.claim_limits(500, &budget).is_none(), "window full");
            for settled in position - limits.count as i64 + 1..=position {
                assert!(receiver.try_recv().is_ok());
                streams.forget(key(settled));
            }
        }
        assert_eq!(offered, [INITIAL_WINDOW, 20, 40, 80, 100, 100]);
    }

    #[test]
    fn a_new_stream_that_never_settles_still_gets_its_whole_window_in_time() {
        let budget = BufferBudget::new(u64::MAX);
        let mut streams = Streams::default();
        let (_, mut receiver, buffered) = stream(&mut streams, 100, u64::MAX);
        for position in 0..INITIAL_WINDOW as i64 {
            streams
                .place(delivery(position, 10), &budget, Instant::now())
                .unwrap();
        }
        while receiver.try_recv().is_ok() {}
        // Its consumer read them all.
        buffered.store(0, Ordering::Relaxed);
        // It holds all it may and settled nothing: the dispatcher wakes when it grows.
        assert!(streams.claim_limits(500, &budget).is_none());
        let growth = streams.next_deadline().unwrap() - Utc::now();
        assert!(
            growth <= chrono::TimeDelta::from_std(growth_step(ACK_DEADLINE)).unwrap(),
            "{growth}"
        );
        let mut held = Vec::new();
        for elapsed in 1..=5 {
            // A consumer that acks only once it has collected, say, 100 deliveries.
            streams.slots[0].growing_since =
                Instant::now().checked_sub(growth_step(ACK_DEADLINE) * elapsed);
            let limits = streams
                .claim_limits(500, &budget)
                .unwrap_or(ClaimLimits { count: 0, bytes: 0 });
            for _ in 0..limits.count {
                let position = streams.leases.len() as i64;
                streams
                    .place(delivery(position, 10), &budget, Instant::now())
                    .unwrap();
                assert!(receiver.try_recv().is_ok());
            }
            buffered.store(0, Ordering::Relaxed);
            held.push(streams.slots[0].in_flight);
        }
        assert_eq!(
            held,
            [20, 40, 80, 100, 100],
            "doubling with time up to its limit"
        );
        assert!(
            streams.next_deadline().unwrap() > Utc::now() + chrono::TimeDelta::seconds(20),
            "only its leases' deadlines are left to wake for"
        );
    }

    /// What a new stream of `max_in_flight` with leases of `ack_deadline`, whose consumer
    /// reads everything and acks nothing yet, holds once `elapsed` has passed.
    fn held_after(max_in_flight: usize, ack_deadline: Duration, elapsed: Duration) -> usize {
        let budget = BufferBudget::new(u64::MAX);
        let mut streams = Streams::default();
        let (sender, mut receiver) = mpsc::channel(max_in_flight);
        let buffered = Arc::new(AtomicU64::new(0));
        streams.attach(
            StreamLimits {
                deliveries: max_in_flight,
                bytes: u64::MAX,
                total: None,
                ack_deadline,
            },
            sender,
            buffered.clone(),
        );
        streams.slots[0].growing_since = Instant::now().checked_sub(elapsed);
        let limits = streams.claim_limits(10_000, &budget).unwrap();
        for position in 0..limits.count as i64 {
            streams
                .place(delivery(position, 10), &budget, Instant::now())
                .unwrap();
            assert!(receiver.try_recv().is_ok());
        }
        streams.slots[0].in_flight
    }

    #[test]
    fn a_consumer_that_collects_a_batch_has_it_well_inside_its_ack_deadline() {
        for seconds in [1, 2, 10, 30, 600] {
            let deadline = Duration::from_secs(seconds);
            let quarter = (deadline / 4).min(LONGEST_GROWTH_STEP * 4);
            assert_eq!(
                held_after(100, deadline, quarter),
                100,
                "a batch of 100 with a {seconds} s deadline, after {quarter:?}"
            );
            let half = (deadline / 2).min(LONGEST_GROWTH_STEP * 7);
            assert_eq!(
                held_after(1_000, deadline, half),
                1_000,
                "a batch of 1,000 with a {seconds} s deadline, after {half:?}"
            );
        }
        // Still a slow start: nothing beyond the initial window in the first step.
        assert_eq!(
            held_after(100, Duration::from_secs(2), Duration::ZERO),
            INITIAL_WINDOW
        );
        assert_eq!(
            held_after(100, Duration::from_secs(2), Duration::from_millis(130)),
            2 * INITIAL_WINDOW
        );
    }

    #[test]
    fn a_new_stream_is_not_sent_more_for_its_age_while_it_does_not_read() {
        let budget = BufferBudget::new(u64::MAX);
        let mut streams = Streams::default();
        let (_, mut receiver, buffered) = stream(&mut streams, 100, u64::MAX);
        for position in 0..INITIAL_WINDOW as i64 {
            streams
                .place(delivery(position, 10), &budget, Instant::now())
                .unwrap();
        }
        // Long enough to have grown to 100, but everything it was sent still waits.
        streams.slots[0].growing_since = Instant::now().checked_sub(growth_step(ACK_DEADLINE) * 10);
        assert!(streams.claim_limits(500, &budget).is_none());
        // The dispatcher looks again at the next step rather than never.
        let next = streams.next_deadline().unwrap() - Utc::now();
        assert!(
            next <= chrono::TimeDelta::from_std(growth_step(ACK_DEADLINE)).unwrap(),
            "{next}"
        );
        // Once it has read them, it gets what its age allows.
        while receiver.try_recv().is_ok() {}
        buffered.store(0, Ordering::Relaxed);
        assert_eq!(streams.claim_limits(500, &budget).unwrap().count, 90);
    }

    #[tokio::test(start_paused = true)]
    async fn a_turn_that_leased_is_followed_by_a_rest_as_long_as_it_took() {
        let claims = UnprovenClaims::default();
        let start = tokio::time::Instant::now();
        drop(claims.turn().await);
        drop(claims.turn().await);
        assert_eq!(
            start.elapsed(),
            Duration::ZERO,
            "turns that leased nothing never rest"
        );

        let mut turn = claims.turn().await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        turn.leased();
        drop(turn);
        let rested_from = tokio::time::Instant::now();
        drop(claims.turn().await);
        assert_eq!(rested_from.elapsed(), Duration::from_millis(300));
    }

    #[test]
    fn only_streams_that_settled_claim_without_the_unproven_permit() {
        let budget = BufferBudget::new(u64::MAX);
        let mut streams = Streams::default();
        assert!(
            !streams.only_unproven_can_take(&budget),
            "nothing to claim for"
        );
        let (_, mut receiver, _) = stream(&mut streams, 10, u64::MAX);
        assert!(streams.only_unproven_can_take(&budget), "new");
        streams
            .place(delivery(1, 10), &budget, Instant::now())
            .unwrap();
        assert!(receiver.try_recv().is_ok());
        streams.forget(key(1));
        assert!(!streams.only_unproven_can_take(&budget), "it settled");

        // Its leases expire unsettled: unproven again until it settles once more.
        let mut late = delivery(2, 10);
        late.ack_deadline = Utc::now() - chrono::Duration::seconds(1);
        streams.place(late, &budget, Instant::now()).unwrap();
        assert!(receiver.try_recv().is_ok());
        streams.expire(Utc::now(), &[]);
        streams.slots[0].resting_until = None;
        assert!(streams.only_unproven_can_take(&budget), "stalled");

        // A proven stream beside it claims for both without waiting.
        let (_, mut other, _) = stream(&mut streams, 10, u64::MAX);
        streams.round_robin = 1;
        streams
            .place(delivery(3, 10), &budget, Instant::now())
            .unwrap();
        assert!(other.try_recv().is_ok());
        streams.forget(key(3));
        assert!(!streams.only_unproven_can_take(&budget));
    }
}
