//! The checks: what the consumers and the push receiver saw against what the producers
//! know, what the operator did and what the Admin API shows at the end.
//!
//! Times are the consumers' own: a delivery's arrival, and when each ack or nack was
//! sent and answered. A lease is known to have been live from (before) the arrival of a
//! delivery until the ack or nack that the gateway applied was sent, because those are
//! compare-and-set on a live lease. Two such intervals that overlap prove two leases at
//! once; a delivery arriving inside another's interval proves the same, given that a
//! delivery reaches its consumer well within its ack deadline (seconds).

use std::{
    collections::{HashMap, HashSet},
    fmt,
    time::Duration,
};

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio::time::Instant;
use uuid::Uuid;

use crate::{
    consumers::{
        Answer, Journal, JournalState, POISON_REASON, Received, Role, SettleKind, date_time,
        is_poison, is_settled,
    },
    database::Snapshot,
    exactly_once::reacts,
    ledger::{Ledger, Published},
    operator::{AdminView, OperationsLog},
};

/// One broken guarantee (or a failure of the run that hides one).
#[derive(Debug, Clone, Serialize)]
pub struct Violation {
    pub kind: &'static str,
    pub detail: String,
}

impl Violation {
    pub fn new(kind: &'static str, detail: impl Into<String>) -> Violation {
        Violation {
            kind,
            detail: detail.into(),
        }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.detail)
    }
}

/// Kinds that count as lost events.
pub const LOST_KINDS: [&str; 2] = ["never delivered", "never acked"];

/// Most a delivery may arrive before its `deliver_at`: the gateways, PostgreSQL and the
/// consumers read the clock of one machine.
const SCHEDULE_SKEW: chrono::TimeDelta = chrono::TimeDelta::milliseconds(5);
/// Most a delivery may arrive after its `expires_at`: it was leased before then, and a
/// lease granted reaches its consumer (or its push request starts) within this on a
/// busy machine.
const EXPIRY_SLACK: chrono::TimeDelta = chrono::TimeDelta::seconds(1);
/// How long after a PauseSubscription call was answered deliveries leased before it may
/// still arrive: one poll interval (200 ms) for the other gateways to read the pause, and
/// time for a delivery on its way, on a busy machine.
const PAUSE_GRACE: Duration = Duration::from_secs(1);
/// How long after a SeekSubscription call was answered a delivery may arrive that was
/// claimed before the seek took effect.
const SEEK_GRACE: Duration = Duration::from_secs(1);

/// What the operator did and what the Admin API showed at the end.
pub struct Operated<'a> {
    pub log: &'a OperationsLog,
    pub view: &'a AdminView,
}

/// Runs every check; `origin` is the start of the run, to print times relative to it.
pub fn run(
    ledger: &Ledger,
    journal: &Journal,
    snapshot: &Snapshot,
    operated: Operated,
    origin: Instant,
) -> Vec<Violation> {
    let ledger = ledger.state();
    let state = journal.state();
    let mut checker = Checker {
        journal,
        state: &state,
        snapshot,
        operated,
        now: Utc::now(),
        origin,
        committed: ledger.committed.clone(),
        committed_at: ledger.committed_at.clone(),
        rolled_back: ledger.rolled_back.clone(),
        violations: Vec::new(),
    };
    // Publishes left in doubt are settled by what the outbox holds.
    for (id, event) in &ledger.in_doubt {
        if snapshot.stored.contains(id) {
            checker.committed.insert(*id, event.clone());
        } else {
            checker.rolled_back.insert(*id, event.clone());
        }
    }
    checker.storage();
    checker.deliveries_are_known();
    checker.everything_acked();
    checker.no_delivery_after_ack();
    checker.one_lease_at_a_time();
    checker.order_per_aggregate();
    checker.schedules_and_expiries();
    checker.expiry_counters();
    checker.dead_letters();
    checker.requeued_delivered_again();
    checker.seek_replays();
    checker.nothing_while_paused();
    checker.exactly_once();
    checker.violations.extend(state.violations.iter().cloned());
    checker.violations
}

struct Checker<'a> {
    journal: &'a Journal,
    state: &'a JournalState,
    snapshot: &'a Snapshot,
    operated: Operated<'a>,
    /// When the checks began: after the drain.
    now: DateTime<Utc>,
    origin: Instant,
    committed: HashMap<Uuid, Published>,
    /// When each event was known committed (none for publishes settled at the end).
    committed_at: HashMap<Uuid, Instant>,
    rolled_back: HashMap<Uuid, Published>,
    violations: Vec<Violation>,
}

/// A lease as the consumers saw it: from arrival until the applied settlement was sent
/// (`None` when no settlement was applied, so only the arrival is known live).
struct Lease<'a> {
    received: &'a Received,
    until: Option<Instant>,
}

impl<'a> Checker<'a> {
    fn at(&self, instant: Instant) -> String {
        format!("t+{}ms", instant.duration_since(self.origin).as_millis())
    }

    fn describe(&self, received: &Received) -> String {
        format!(
            "{} v{} attempt {} via gateway {} stream {} at {}",
            received.event,
            received.version.unwrap_or_default(),
            received.attempt,
            received.gateway,
            received.stream,
            self.at(received.at)
        )
    }

    /// Every delivery of an event on a subscription, with how it was settled and when
    /// its stream ended, for a violation's detail.
    fn history(&self, subscription: usize, event: Uuid) -> String {
        let deliveries: Vec<String> = (self.state.received.iter())
            .filter(|received| received.subscription == subscription && received.event == event)
            .map(|received| {
                let settlements: Vec<String> = (self.state.settlements.get(&received.ack_id))
                    .into_iter()
                    .flatten()
                    .filter(|settlement| settlement.sent >= received.at)
                    .map(|settlement| {
                        format!(
                            "{:?} sent {} {:?}",
                            settlement.kind,
                            self.at(settlement.sent),
                            settlement.answer
                        )
                    })
                    .collect();
                let stream_end = (self.state.stream_ended_at.get(&received.stream))
                    .map_or("open".to_owned(), |at| format!("ended {}", self.at(*at)));
                format!(
                    "attempt {} at {} (stream {} {stream_end}) {settlements:?}",
                    received.attempt,
                    self.at(received.at),
                    received.stream
                )
            })
            .collect();
        let event = self.committed.get(&event);
        let created_at = (self.state.received.iter())
            .find(|received| {
                received.subscription == subscription
                    && Some(&received.event) == event.map(|e| &e.id)
            })
            .and_then(|received| received.created_at);
        format!(
            "{} (written {created_at:?}, deliver_at {:?}, expires_at {:?})",
            deliveries.join("; "),
            event.and_then(|event| event.deliver_at),
            event.and_then(|event| event.expires_at),
        )
    }

    fn name(&self, subscription: usize) -> &'static str {
        self.journal.specs[subscription].name
    }

    fn violation(&mut self, kind: &'static str, detail: String) {
        self.violations.push(Violation::new(kind, detail));
    }

    /// Committed events are stored; rolled-back ones are not.
    fn storage(&mut self) {
        let missing: Vec<Uuid> = (self.committed.keys())
            .filter(|id| !self.snapshot.stored.contains(id))
            .copied()
            .collect();
        for id in missing {
            self.violation(
                "committed event missing",
                format!("{id} is not in the outbox"),
            );
        }
        let stored: Vec<Uuid> = (self.rolled_back.keys())
            .filter(|id| self.snapshot.stored.contains(id))
            .copied()
            .collect();
        for id in stored {
            self.violation("rolled-back event stored", format!("{id} is in the outbox"));
        }
    }

    /// Every delivery is of a committed event its subscription selects.
    fn deliveries_are_known(&mut self) {
        for received in &self.state.received {
            let name = self.name(received.subscription);
            if self.rolled_back.contains_key(&received.event) {
                let detail = format!("{name}: {}", self.describe(received));
                self.violation("rolled-back event delivered", detail);
            } else if !self.committed.contains_key(&received.event) {
                let detail = format!("{name}: {}", self.describe(received));
                self.violation("unknown event delivered", detail);
            } else if !self.journal.specs[received.subscription].matches(&received.event_type) {
                let detail = format!("{name}: {} of type {}", received.event, received.event_type);
                self.violation("filtered-out event delivered", detail);
            }
        }
        let Some(push) = self.spec_index(Role::Push) else {
            return;
        };
        let name = self.name(push);
        for pushed in &self.state.pushed {
            let detail = format!("{name}: {} pushed at {}", pushed.event, self.at(pushed.at));
            if self.rolled_back.contains_key(&pushed.event) {
                self.violation("rolled-back event delivered", detail);
            } else if !self.committed.contains_key(&pushed.event) {
                self.violation("unknown event delivered", detail);
            } else if !self.journal.specs[push].matches(&pushed.event_type) {
                self.violation("filtered-out event delivered", detail);
            }
        }
    }

    fn spec_index(&self, role: Role) -> Option<usize> {
        self.journal.specs.iter().position(|spec| spec.role == role)
    }

    /// Every committed event is delivered and acked on every subscription it matches.
    fn everything_acked(&mut self) {
        let mut delivered: HashSet<(usize, Uuid)> = (self.state.received.iter())
            .map(|received| (received.subscription, received.event))
            .collect();
        if let Some(push) = self.spec_index(Role::Push) {
            delivered.extend(self.state.pushed.iter().map(|pushed| (push, pushed.event)));
        }
        let mut lost = Vec::new();
        for event in self.committed.values() {
            for (index, spec) in self.journal.specs.iter().enumerate() {
                if !spec.matches(&event.event_type)
                    || is_settled(
                        self.state,
                        &self.snapshot.unsettled,
                        index,
                        spec,
                        event,
                        self.now,
                    )
                {
                    continue;
                }
                let record = self
                    .snapshot
                    .unsettled
                    .get(&(spec.name.to_owned(), event.id))
                    .map_or("no delivery record", String::as_str);
                let kind = if delivered.contains(&(index, event.id)) {
                    LOST_KINDS[1]
                } else {
                    LOST_KINDS[0]
                };
                lost.push((
                    kind,
                    format!(
                        "{}: {} ({} v{}, {:?}), {record}",
                        spec.name, event.id, event.aggregate, event.version, event.route
                    ),
                ));
            }
        }
        lost.sort();
        for (kind, detail) in lost {
            self.violation(kind, detail);
        }
    }

    /// No event is delivered again once an ack of it was answered OK; except once after
    /// a seek that replays it, which begins its deliveries afresh.
    fn no_delivery_after_ack(&mut self) {
        let mut by_pair: HashMap<(usize, Uuid), Vec<&Received>> = HashMap::new();
        for received in &self.state.received {
            by_pair
                .entry((received.subscription, received.event))
                .or_default()
                .push(received);
        }
        let mut found = Vec::new();
        for receipts in by_pair.values_mut() {
            receipts.sort_by_key(|received| received.at);
            let epochs = match self.seek_replay(receipts) {
                Some(replay) => vec![
                    (&receipts[..replay], Some(receipts[replay].at)),
                    (&receipts[replay..], None),
                ],
                None => vec![(&receipts[..], None)],
            };
            for (epoch, end) in epochs {
                let start = epoch[0].at;
                let acked = (epoch.iter())
                    .flat_map(|received| self.state.settlements.get(&received.ack_id))
                    .flatten()
                    .filter(|s| s.kind == SettleKind::Ack && s.answer == Answer::Applied)
                    .filter(|s| s.sent >= start && end.is_none_or(|end| s.sent < end))
                    .map(|s| s.answered)
                    .min();
                let Some(acked) = acked else { continue };
                for received in epoch.iter().filter(|received| received.at > acked) {
                    let detail = format!(
                        "{}: {} after its ack was answered OK at {}; its deliveries: {}",
                        self.name(received.subscription),
                        self.describe(received),
                        self.at(acked),
                        self.history(received.subscription, received.event)
                    );
                    found.push(Violation::new("delivered after ack", detail));
                }
            }
        }
        self.violations.extend(found);
    }

    /// Of one event's deliveries on the seek subscription (in order of arrival), the one
    /// a seek replays, when the event was written at or after the time sought and had
    /// been committed or handed out before the seek was answered (or so soon after that
    /// it may have been claimed before): the first delivery to arrive after both the seek
    /// was sent and the event's first ack was answered. A replay skips an event only
    /// while it has a delivery record, so one in flight, awaiting a retry or scheduled
    /// for later at the seek is replayed once it is acked, whenever the replay reaches
    /// it.
    fn seek_replay(&self, receipts: &[&Received]) -> Option<usize> {
        if self.journal.specs[receipts[0].subscription].role != Role::Seek {
            return None;
        }
        self.operated.log.seeks.iter().find_map(|seek| {
            let written_after = receipts[0].created_at.is_some_and(|at| at >= seek.to);
            let before_seek = |at: &Instant| *at < seek.answered + SEEK_GRACE;
            let existed_before = before_seek(&receipts[0].at)
                || (self.committed_at.get(&receipts[0].event)).is_some_and(before_seek);
            if !written_after || !existed_before {
                return None;
            }
            let first_acked = (receipts.iter())
                .flat_map(|received| self.state.settlements.get(&received.ack_id))
                .flatten()
                .filter(|s| s.kind == SettleKind::Ack && s.answer == Answer::Applied)
                .map(|s| s.answered)
                .min()?;
            (receipts.iter())
                .position(|received| received.at > seek.sent && received.at > first_acked)
        })
    }

    /// No event is leased twice at once; on ordered subscriptions, no aggregate has two
    /// events leased at once.
    fn one_lease_at_a_time(&mut self) {
        let mut applied_settlement: HashMap<&str, Instant> = HashMap::new();
        for (ack_id, settlements) in &self.state.settlements {
            if let Some(settlement) = settlements.iter().find(|s| s.answer == Answer::Applied) {
                applied_settlement.insert(ack_id.as_str(), settlement.sent);
            }
        }
        let mut by_event: HashMap<(usize, Uuid), Vec<Lease>> = HashMap::new();
        let mut by_aggregate: HashMap<(usize, &str), Vec<Lease>> = HashMap::new();
        for received in &self.state.received {
            let until = applied_settlement.get(received.ack_id.as_str()).copied();
            let lease = || Lease { received, until };
            by_event
                .entry((received.subscription, received.event))
                .or_default()
                .push(lease());
            if self.journal.specs[received.subscription].ordered {
                by_aggregate
                    .entry((received.subscription, received.aggregate.as_str()))
                    .or_default()
                    .push(lease());
            }
        }
        for leases in by_event.values_mut() {
            leases.sort_by_key(|lease| lease.received.at);
            self.overlaps("event leased twice at once", leases);
        }
        for leases in by_aggregate.values_mut() {
            leases.sort_by_key(|lease| lease.received.at);
            self.overlaps("aggregate in flight twice at once", leases);
        }
    }

    fn overlaps(&mut self, kind: &'static str, leases: &[Lease]) {
        for (index, first) in leases.iter().enumerate() {
            let Some(until) = first.until else { continue };
            for second in &leases[index + 1..] {
                // `second` arrived after `first` (sorted by arrival); the pair overlaps when
                // it arrived before `first` was settled.
                if second.received.at < until {
                    let detail = format!(
                        "{}: {} was live until {} when {} arrived",
                        self.name(first.received.subscription),
                        self.describe(first.received),
                        self.at(until),
                        self.describe(second.received)
                    );
                    self.violation(kind, detail);
                }
            }
        }
    }

    /// On ordered subscriptions, per aggregate: first deliveries follow publish order,
    /// and no event arrives before the previous one was acked.
    fn order_per_aggregate(&mut self) {
        let mut by_aggregate: HashMap<&str, Vec<&Published>> = HashMap::new();
        for event in self.committed.values() {
            by_aggregate
                .entry(&event.aggregate)
                .or_default()
                .push(event);
        }
        for events in by_aggregate.values_mut() {
            events.sort_by_key(|event| event.version);
        }
        let mut found = Vec::new();
        let ordered: Vec<usize> = (0..self.journal.specs.len())
            .filter(|&index| self.journal.specs[index].ordered)
            .collect();
        for subscription in ordered {
            let mut arrivals: HashMap<Uuid, Vec<&Received>> = HashMap::new();
            for received in &self.state.received {
                if received.subscription == subscription {
                    arrivals.entry(received.event).or_default().push(received);
                }
            }
            for receipts in arrivals.values_mut() {
                receipts.sort_by_key(|received| received.at);
            }
            let mut ack_sent: HashMap<Uuid, Instant> = HashMap::new();
            for (event, receipts) in &arrivals {
                if let Some(sent) = self.earliest_possible_ack(receipts) {
                    ack_sent.insert(*event, sent);
                }
            }
            for events in by_aggregate.values() {
                let spec = &self.journal.specs[subscription];
                let events: Vec<&&Published> = events
                    .iter()
                    .filter(|event| spec.matches(&event.event_type))
                    .collect();
                for pair in events.windows(2) {
                    let (previous, next) = (pair[0], pair[1]);
                    let (Some(previous_arrivals), Some(next_arrivals)) =
                        (arrivals.get(&previous.id), arrivals.get(&next.id))
                    else {
                        continue;
                    };
                    let next_first = next_arrivals[0];
                    if next_first.at < previous_arrivals[0].at {
                        let detail = format!(
                            "{}: {} v{} first arrived at {}, before v{} at {}",
                            self.name(subscription),
                            next.aggregate,
                            next.version,
                            self.at(next_first.at),
                            previous.version,
                            self.at(previous_arrivals[0].at)
                        );
                        found.push(Violation::new("out of order", detail));
                    } else if let Some(acked) = ack_sent.get(&previous.id)
                        && next_first.at < *acked
                    {
                        let detail = format!(
                            "{}: {} v{} arrived at {}, before v{} was acked (sent {})",
                            self.name(subscription),
                            next.aggregate,
                            next.version,
                            self.at(next_first.at),
                            previous.version,
                            self.at(*acked)
                        );
                        found.push(Violation::new("delivered before previous acked", detail));
                    }
                }
            }
        }
        self.violations.extend(found);
    }

    /// No delivery (pulled or pushed) of a scheduled event arrives before its
    /// `deliver_at`, and none of an expiring event after its `expires_at`.
    fn schedules_and_expiries(&mut self) {
        let push = self.spec_index(Role::Push);
        let arrivals = (self.state.received.iter())
            .map(|received| {
                (
                    received.subscription,
                    received.event,
                    received.wall,
                    received.attempt,
                )
            })
            .chain(push.into_iter().flat_map(|push| {
                (self.state.pushed.iter()).map(move |pushed| (push, pushed.event, pushed.wall, 0))
            }));
        let mut found = Vec::new();
        for (subscription, id, wall, attempt) in arrivals {
            let Some(event) = self.committed.get(&id) else {
                continue;
            };
            let name = self.name(subscription);
            if let Some(deliver_at) = event.deliver_at
                && wall < deliver_at - SCHEDULE_SKEW
            {
                found.push(Violation::new(
                    "delivered before deliver_at",
                    format!("{name}: {id} (attempt {attempt}) arrived at {wall}, scheduled for {deliver_at}"),
                ));
            }
            if let Some(expires_at) = event.expires_at
                && wall > expires_at + EXPIRY_SLACK
            {
                found.push(Violation::new(
                    "delivered after expiry",
                    format!("{name}: {id} (attempt {attempt}) arrived at {wall}, expired at {expires_at}"),
                ));
            }
        }
        self.violations.extend(found);
    }

    /// Each subscription's `expired_total` counts at least the expiring events it never
    /// settled otherwise (dropped, or dead-lettered as expired), and no more than the
    /// expiring events it selects (plus, on the dead-letter subscription, the expired dead
    /// letters requeued, which expire again).
    fn expiry_counters(&mut self) {
        let mut found = Vec::new();
        for (index, spec) in self.journal.specs.iter().enumerate() {
            let Some(&expired_total) = self.operated.view.expired_total.get(spec.name) else {
                found.push(Violation::new(
                    "stats",
                    format!("{}: no expired_total", spec.name),
                ));
                continue;
            };
            let expiring: Vec<&Published> = (self.committed.values())
                .filter(|event| event.expires_at.is_some() && spec.matches(&event.event_type))
                .collect();
            let not_delivered = (expiring.iter())
                .filter(|event| match spec.role {
                    Role::Push => !self.state.pushed_ok.contains(&event.id),
                    Role::DeadLetters => self
                        .operated
                        .view
                        .dead_letters
                        .get(&(spec.name.to_owned(), event.id))
                        .is_some_and(|dead| dead.last_error == "expired"),
                    Role::ExactlyOnce => !self.snapshot.effects.rows.contains_key(&event.id),
                    _ => {
                        let pair = (index, event.id);
                        !self.state.acked.contains(&pair) && !self.state.ack_failed.contains(&pair)
                    }
                })
                .count() as u64;
            let expired_again: u64 = match spec.role {
                Role::DeadLetters => (self.operated.log.requeues.iter())
                    .map(|requeue| requeue.expired_requeued)
                    .sum(),
                _ => 0,
            };
            if expired_total < not_delivered
                || expired_total > expiring.len() as u64 + expired_again
            {
                found.push(Violation::new(
                    "expired count",
                    format!(
                        "{}: expired_total {expired_total}, but {not_delivered} of its {} expiring \
                         events went undelivered",
                        spec.name,
                        expiring.len()
                    ),
                ));
            }
        }
        self.violations.extend(found);
    }

    /// On the dead-letter subscription: the Admin API lists every poison event as a dead
    /// letter (nacked, or expired before that), and every other event it did not ack
    /// (its leases ran out, or it expired); it lists nothing acked or unknown, and no
    /// event is delivered more than `max_attempts` times between requeues.
    fn dead_letters(&mut self) {
        let Some(index) = self.spec_index(Role::DeadLetters) else {
            return;
        };
        let spec = &self.journal.specs[index];
        let max_attempts = spec.max_attempts();
        let mut found = Vec::new();
        for event in self.committed.values() {
            if !spec.matches(&event.event_type) {
                continue;
            }
            let listed = (self.operated.view.dead_letters).get(&(spec.name.to_owned(), event.id));
            let acked = self.state.acked.contains(&(index, event.id));
            let detail = |what: &str| format!("{}: {} {what}", spec.name, event.id);
            match (listed, acked) {
                (Some(dead), true) => found.push(Violation::new(
                    "acked event dead-lettered",
                    detail(&format!(
                        "was acked, yet is listed as a dead letter: {}",
                        dead.last_error
                    )),
                )),
                (None, false) if !self.state.ack_failed.contains(&(index, event.id)) => {
                    found.push(Violation::new(
                        "dead letter not listed",
                        detail("was neither acked nor listed as a dead letter"),
                    ))
                }
                (None, _) if is_poison(event.id) => found.push(Violation::new(
                    "poison event acked",
                    detail("fails every time, yet is not a dead letter"),
                )),
                (Some(dead), false) => {
                    // Any event's leases may run out (a killed gateway's), its last attempt
                    // may be given back by a stream that closed (the rule of
                    // docs/subscriptions.md: it is dead-lettered, not delivered once more),
                    // or it may expire.
                    const ANY_EVENT: [&str; 3] = [
                        "ack deadline exceeded",
                        "stream closed before settling",
                        "expired",
                    ];
                    let poison = is_poison(event.id) && dead.last_error == POISON_REASON;
                    if !poison && !ANY_EVENT.contains(&dead.last_error.as_str()) {
                        found.push(Violation::new(
                            "dead letter error",
                            detail(&format!("dead-lettered with {:?}", dead.last_error)),
                        ));
                    }
                    let dead_lettered_at = dead.dead_lettered_at.and_then(date_time);
                    if dead.last_error == "expired"
                        && (event.expires_at.zip(dead_lettered_at))
                            .is_none_or(|(expires, dead_at)| expires > dead_at)
                    {
                        found.push(Violation::new(
                            "dead letter error",
                            detail(&format!(
                                "dead-lettered as expired at {dead_lettered_at:?}, expiring at {:?}",
                                event.expires_at
                            )),
                        ));
                    }
                    if dead.attempts > max_attempts {
                        found.push(Violation::new(
                            "too many attempts",
                            detail(&format!("dead-lettered after {} attempts", dead.attempts)),
                        ));
                    }
                }
                (None, _) => {}
            }
        }
        for (subscription, id) in self.operated.view.dead_letters.keys() {
            if !self.committed.contains_key(id) {
                found.push(Violation::new(
                    "unknown dead letter",
                    format!("{subscription}: {id} is not a committed event"),
                ));
            }
        }
        for received in &self.state.received {
            if received.subscription == index && received.attempt > max_attempts {
                found.push(Violation::new(
                    "too many attempts",
                    format!(
                        "{}: {}; its deliveries: {}",
                        spec.name,
                        self.describe(received),
                        self.history(index, received.event)
                    ),
                ));
            }
        }
        self.violations.extend(found);
    }

    /// Every dead letter requeued (not as expired) is delivered again, first as attempt 1.
    fn requeued_delivered_again(&mut self) {
        let Some(index) = self.spec_index(Role::DeadLetters) else {
            return;
        };
        let mut found = Vec::new();
        for requeue in &self.operated.log.requeues {
            for id in &requeue.redelivery_expected {
                let next = (self.state.received.iter())
                    .find(|r| r.subscription == index && r.event == *id && r.at > requeue.sent);
                match next {
                    Some(received) if received.attempt == 1 => {}
                    Some(received) => found.push(Violation::new(
                        "requeue",
                        format!(
                            "requeued at {}, delivered as {}",
                            self.at(requeue.sent),
                            self.describe(received)
                        ),
                    )),
                    None => found.push(Violation::new(
                        "requeue",
                        format!(
                            "{id} requeued at {} was never delivered again",
                            self.at(requeue.sent)
                        ),
                    )),
                }
            }
        }
        self.violations.extend(found);
    }

    /// Every event a seek had to replay was delivered again after it.
    fn seek_replays(&mut self) {
        let mut found = Vec::new();
        for (&(subscription, id), &sent) in &self.state.replay_expected {
            let replayed = (self.state.received.iter())
                .any(|r| r.subscription == subscription && r.event == id && r.at > sent);
            if !replayed {
                found.push(Violation::new(
                    "seek not replayed",
                    format!(
                        "{}: {id}, acked before the seek sent at {}, was not delivered again",
                        self.name(subscription),
                        self.at(sent)
                    ),
                ));
            }
        }
        self.violations.extend(found);
    }

    /// Nothing arrives on the paused subscription from `PAUSE_GRACE` after a pause was
    /// answered until it was resumed (or its `until` came).
    fn nothing_while_paused(&mut self) {
        let Some(index) = self.spec_index(Role::Pause) else {
            return;
        };
        let mut found = Vec::new();
        for pause in &self.operated.log.pauses {
            let from = pause.answered + PAUSE_GRACE;
            for received in &self.state.received {
                if received.subscription == index && received.at > from && received.at < pause.ended
                {
                    found.push(Violation::new(
                        "delivered while paused",
                        format!(
                            "{}: {}, paused from {} to {}",
                            self.name(index),
                            self.describe(received),
                            self.at(pause.answered),
                            self.at(pause.ended)
                        ),
                    ));
                }
            }
        }
        self.violations.extend(found);
    }

    /// On the exactly-once subscription, by what its consumers left in the database:
    /// every committed event it selects has exactly one side-effect row (or none, when it
    /// expires: it may have been dropped as expired before a transaction consumed it, as
    /// on every subscription that drops expired events), and one reaction event when
    /// [`reacts`] chooses it, none otherwise; no other event has a row or a reaction. At
    /// the end GetStats shows nothing of it pending, in flight or awaiting retry, and one
    /// consumption record per consumed event. Every consumed event the operator requeued
    /// was delivered again (and, by the counts, not consumed again).
    fn exactly_once(&mut self) {
        let Some(index) = self.spec_index(Role::ExactlyOnce) else {
            return;
        };
        let spec = &self.journal.specs[index];
        let effects = &self.snapshot.effects;
        let mut found = Vec::new();
        let mut selected = HashSet::new();
        for event in self.committed.values() {
            if !spec.matches(&event.event_type) {
                continue;
            }
            selected.insert(event.id);
            let rows = effects.rows.get(&event.id).copied().unwrap_or(0);
            let reactions = effects.reactions.get(&event.id).copied().unwrap_or(0);
            let detail = |what: String| {
                format!(
                    "{}: {} ({} v{}, {:?}) {what}; its consuming transactions: {}",
                    spec.name,
                    event.id,
                    event.aggregate,
                    event.version,
                    event.route,
                    self.consumptions(event.id)
                )
            };
            match rows {
                0 if event.expires_at.is_some() => {}
                0 => found.push(Violation::new(
                    "side effect missing",
                    detail("has no side-effect row".into()),
                )),
                1 => {}
                _ => found.push(Violation::new(
                    "side effect duplicated",
                    detail(format!("has {rows} side-effect rows")),
                )),
            }
            let expected = u64::from(rows > 0 && reacts(event.id));
            if reactions != expected {
                let kind = if reactions > expected {
                    "reaction duplicated"
                } else {
                    "reaction missing"
                };
                found.push(Violation::new(
                    kind,
                    detail(format!(
                        "has {reactions} reaction events, {expected} expected"
                    )),
                ));
            }
        }
        for (id, rows) in &effects.rows {
            if !selected.contains(id) {
                found.push(Violation::new(
                    "side effect of another event",
                    format!(
                        "{}: {rows} side-effect rows of {id}, not a committed event it selects",
                        spec.name
                    ),
                ));
            }
        }
        for (id, reactions) in &effects.reactions {
            if !selected.contains(id) {
                found.push(Violation::new(
                    "reaction to another event",
                    format!(
                        "{}: {reactions} reaction events to {id}, not a committed event it \
                         selects",
                        spec.name
                    ),
                ));
            }
        }
        // Without figures (a violation of its own, see `expiry_counters`) there is nothing
        // to compare.
        if let Some(stats) = self.operated.view.stats.get(spec.name) {
            if stats.pending > 0 || stats.in_flight > 0 || stats.awaiting_retry > 0 {
                found.push(Violation::new(
                    "consumption unsettled",
                    format!(
                        "{}: at the end {} pending, {} in flight, {} awaiting retry",
                        spec.name, stats.pending, stats.in_flight, stats.awaiting_retry
                    ),
                ));
            }
            if stats.consumption_records != effects.rows.len() as u64 {
                found.push(Violation::new(
                    "consumption records",
                    format!(
                        "{}: {} consumption records, {} events with a side effect",
                        spec.name,
                        stats.consumption_records,
                        effects.rows.len()
                    ),
                ));
            }
        }
        for requeue in &self.operated.log.consumed_requeues {
            let again = (self.state.received.iter()).any(|r| {
                r.subscription == index && r.event == requeue.event && r.at > requeue.sent
            });
            if !again {
                found.push(Violation::new(
                    "requeue",
                    format!(
                        "{}: {}, consumed and requeued at {}, was never delivered again",
                        spec.name,
                        requeue.event,
                        self.at(requeue.sent)
                    ),
                ));
            }
        }
        found.sort_by(|a, b| (a.kind, &a.detail).cmp(&(b.kind, &b.detail)));
        self.violations.extend(found);
    }

    /// An event's consuming transactions on the exactly-once subscription, for a
    /// violation's detail.
    fn consumptions(&self, event: Uuid) -> String {
        let consumptions: Vec<String> = (self.state.consumptions.iter())
            .filter(|consumption| consumption.event == event)
            .map(|consumption| {
                format!(
                    "attempt {} arrived {}, ended {}: outbox_consume {:?}, {:?}, committed {:?}",
                    consumption.attempt,
                    self.at(consumption.arrived),
                    self.at(consumption.ended),
                    consumption.first,
                    consumption.fate,
                    consumption.committed
                )
            })
            .collect();
        if consumptions.is_empty() {
            return "none".to_owned();
        }
        consumptions.join("; ")
    }

    /// When the ack that settled an event was sent: the applied one, or else the first
    /// ack whose answer was lost.
    fn earliest_possible_ack(&self, receipts: &[&Received]) -> Option<Instant> {
        let settlements = || {
            receipts
                .iter()
                .filter_map(|received| self.state.settlements.get(&received.ack_id))
                .flatten()
                .filter(|settlement| settlement.kind == SettleKind::Ack)
        };
        settlements()
            .find(|settlement| settlement.answer == Answer::Applied)
            .or_else(|| {
                settlements()
                    .filter(|settlement| matches!(settlement.answer, Answer::Failed(_)))
                    .min_by_key(|settlement| settlement.sent)
            })
            .map(|settlement| settlement.sent)
    }
}
