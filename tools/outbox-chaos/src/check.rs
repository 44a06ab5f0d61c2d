//! The checks: what the consumers saw against what the producers know.
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
};

use serde::Serialize;
use tokio::time::Instant;
use uuid::Uuid;

use crate::{
    consumers::{Answer, Journal, JournalState, Received, SettleKind, is_settled},
    database::Snapshot,
    ledger::{Ledger, Published},
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

/// Runs every check; `origin` is the start of the run, to print times relative to it.
pub fn run(
    ledger: &Ledger,
    journal: &Journal,
    snapshot: &Snapshot,
    origin: Instant,
) -> Vec<Violation> {
    let ledger = ledger.state();
    let state = journal.state();
    let mut checker = Checker {
        journal,
        state: &state,
        snapshot,
        origin,
        committed: ledger.committed.clone(),
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
    checker.violations
}

struct Checker<'a> {
    journal: &'a Journal,
    state: &'a JournalState,
    snapshot: &'a Snapshot,
    origin: Instant,
    committed: HashMap<Uuid, Published>,
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
    }

    /// Every committed event is delivered and acked on every subscription it matches.
    fn everything_acked(&mut self) {
        let delivered: HashSet<(usize, Uuid)> = (self.state.received.iter())
            .map(|received| (received.subscription, received.event))
            .collect();
        let mut lost = Vec::new();
        for event in self.committed.values() {
            for (index, spec) in self.journal.specs.iter().enumerate() {
                if !spec.matches(&event.event_type)
                    || is_settled(
                        self.state,
                        &self.snapshot.unsettled,
                        index,
                        spec.name,
                        event.id,
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

    /// First time each ack id's ack was answered OK (not stale).
    fn applied_acks(&self) -> HashMap<&'a str, (Instant, Instant)> {
        let mut applied = HashMap::new();
        for (ack_id, settlements) in &self.state.settlements {
            if let Some(settlement) = settlements
                .iter()
                .find(|s| s.kind == SettleKind::Ack && s.answer == Answer::Applied)
            {
                applied.insert(ack_id.as_str(), (settlement.sent, settlement.answered));
            }
        }
        applied
    }

    /// No event is delivered again once an ack of it was answered OK.
    fn no_delivery_after_ack(&mut self) {
        let applied = self.applied_acks();
        let mut acked_at: HashMap<(usize, Uuid), Instant> = HashMap::new();
        for received in &self.state.received {
            if let Some((_, answered)) = applied.get(received.ack_id.as_str()) {
                let entry = acked_at
                    .entry((received.subscription, received.event))
                    .or_insert(*answered);
                *entry = (*entry).min(*answered);
            }
        }
        for received in &self.state.received {
            if let Some(acked) = acked_at.get(&(received.subscription, received.event))
                && received.at > *acked
            {
                let detail = format!(
                    "{}: {} after its ack was answered OK at {}",
                    self.name(received.subscription),
                    self.describe(received),
                    self.at(*acked)
                );
                self.violation("delivered after ack", detail);
            }
        }
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
