//! The scout: one reader per source that looks at each newly committed row once, for
//! every subscription with streams in this process, so that an idle subscription costs
//! the database next to nothing.
//!
//! Without it, every dispatcher would claim whenever anything was committed and once per
//! poll interval, matching or not: 2,000 idle subscriptions meant thousands of claims a
//! second. The scout instead:
//! - reads the rows committed past its own read position (one statement, whatever the
//!   number of subscriptions) when told of news and once per poll interval, and wakes
//!   only the dispatchers whose filter may select one of them;
//! - once per poll interval, moves the read position of every subscription the rows it
//!   read do not concern to its own, in one compare-and-set statement, so they never
//!   have to claim merely to pass other subscriptions' events;
//! - once per poll interval, asks in one statement which subscriptions have deliveries
//!   due (retries, scheduled events, leases that expired on a gateway that is gone) and
//!   wakes those.
//!
//! Moving a subscription's position is sound because the scout's position has the
//! subscription's shape and rules (`queries/scan_new.sql`). A subscription read up to C
//! may be moved to the scout's newest position R when the scout's reads since some
//! position L of its own hold every row the subscription would read after C, and none
//! of those rows may be selected by its filter. They hold all of them when L is at or
//! before C in reading order and every transaction C still waits for is one L waits for
//! too (with nothing of it read) or one L has not passed. R is newer than C (C was read
//! from the database before the reads that ended at R began), so the transactions R
//! waits for are exactly those the subscription must wait for from R on. The move only
//! happens where the position is still C: a claim, a seek or another gateway that moved
//! it first wins, and a claim that read C before the move simply writes its own
//! successor of C over R, which is as valid.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::sync::Notify;

use super::{Relay, dispatcher::Dispatcher};
use crate::{
    domain::{Subscription, SubscriptionId},
    sources::Source,
    storage::{PositionMove, ReadPosition, ScannedRow, SubscriptionPosition},
};

/// Most rows one read returns; more are read at once by the next.
const SCAN_LIMIT: usize = 5_000;
/// How much of what it read the scout keeps to move positions with: every read of the
/// last few poll intervals, up to this many rows (the oldest go first).
const HISTORY_ROWS: usize = 50_000;
const HISTORY_POLLS: u32 = 4;
/// Most subscriptions the scout cannot vouch for that it asks to claim once per round,
/// so that a new scout does not set thousands of claims off at once.
const CLAIMS_ASKED_PER_ROUND: usize = 100;

/// Tells a source's scout to read now.
#[derive(Default)]
pub(super) struct ScoutHandle {
    requested: Notify,
}

impl ScoutHandle {
    /// Something may have been committed: read (requests coalesce).
    pub(super) fn request(&self) {
        self.requested.notify_one();
    }
}

/// A read the scout made: where it started and what it returned.
struct Read {
    from: ReadPosition,
    rows: Vec<ScannedRow>,
    at: Instant,
}

/// The subscriptions with streams here that read the source, and which of them each
/// event type may concern, computed once per type.
struct Audience {
    generation: u64,
    dispatchers: Vec<(Arc<Dispatcher>, Arc<Subscription>)>,
    by_event_type: HashMap<String, Vec<usize>>,
}

impl Audience {
    /// Indices of the dispatchers whose filter may select `row`.
    fn selecting<'a>(&'a mut self, row: &'a ScannedRow) -> impl Iterator<Item = usize> + 'a {
        if !self.by_event_type.contains_key(&row.event_type) {
            if self.by_event_type.len() > 10_000 {
                self.by_event_type.clear();
            }
            let candidates = self
                .dispatchers
                .iter()
                .enumerate()
                .filter(|(_, (_, subscription))| {
                    let types = &subscription.settings.event_types;
                    types.is_empty() || types.matches(&row.event_type)
                })
                .map(|(index, _)| index)
                .collect();
            self.by_event_type
                .insert(row.event_type.clone(), candidates);
        }
        let dispatchers = &self.dispatchers;
        self.by_event_type[&row.event_type]
            .iter()
            .copied()
            .filter(move |&index| {
                dispatchers[index].1.settings.may_select(
                    &row.event_type,
                    &row.aggregate_type,
                    &row.metadata,
                )
            })
    }
}

/// Runs the scout of `source` until the relay stops.
pub(super) async fn run(relay: Relay, source: Arc<Source>, handle: Arc<ScoutHandle>) {
    let poll_interval = relay.inner.config.poll_interval;
    let shutdown = relay.inner.shutdown.clone();
    let mut scout = Scout {
        relay,
        source,
        position: None,
        history: VecDeque::new(),
        audience: None,
    };
    let mut polls = tokio::time::interval(poll_interval);
    polls.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let round = tokio::select! {
            _ = handle.requested.notified() => false,
            _ = polls.tick() => true,
            _ = shutdown.cancelled() => return,
        };
        if !scout.source.is_connected() {
            continue;
        }
        scout.refresh_audience();
        if scout.audience().dispatchers.is_empty() {
            // Nobody to read for; a later reader starts from then.
            scout.position = None;
            scout.history.clear();
            continue;
        }
        if let Err(error) = scout.pass(round, poll_interval).await {
            tracing::debug!(source = %scout.source.name, %error, "the scout could not read; retrying");
        }
    }
}

struct Scout {
    relay: Relay,
    source: Arc<Source>,
    /// Where its reading stands; `None` until it first reads.
    position: Option<ReadPosition>,
    history: VecDeque<Read>,
    audience: Option<Audience>,
}

impl Scout {
    fn audience(&mut self) -> &mut Audience {
        self.audience.as_mut().expect("refreshed before use")
    }

    /// Takes the dispatchers of this process anew when they or their definitions changed.
    fn refresh_audience(&mut self) {
        let generation = self.relay.audience_generation();
        if self
            .audience
            .as_ref()
            .is_some_and(|audience| audience.generation == generation)
        {
            return;
        }
        let dispatchers = self
            .relay
            .all_dispatchers()
            .into_iter()
            .map(|dispatcher| {
                let subscription = dispatcher.subscription();
                (dispatcher, subscription)
            })
            .filter(|(_, subscription)| subscription.reads(&self.source.name))
            .collect();
        self.audience = Some(Audience {
            generation,
            dispatchers,
            by_event_type: HashMap::new(),
        });
    }

    /// Reads what is new and wakes whom it concerns; on a `round`, also moves idle
    /// subscriptions along and wakes those with deliveries due.
    async fn pass(&mut self, round: bool, poll_interval: Duration) -> crate::storage::Result<()> {
        let store = self.source.store.clone();
        if self.position.is_none() {
            self.position = Some(store.latest_read_position().await?);
            // What was committed before could not be vouched for: everyone looks once.
            let source = self.source.id;
            for (dispatcher, _) in &self.audience().dispatchers {
                dispatcher.news_in(source);
            }
        }
        let ids: Vec<SubscriptionId> = self
            .audience()
            .dispatchers
            .iter()
            .map(|(dispatcher, _)| dispatcher.subscription_id())
            .collect();
        // Read before the rows, so that where the reading below ends is newer than every
        // position read here.
        let positions = match round {
            true => Some(store.read_positions(&ids).await?),
            false => None,
        };
        loop {
            let from = self.position.clone().expect("set above");
            let scanned = store.scan_new_events(&from, SCAN_LIMIT).await?;
            self.wake_selected(&scanned.rows);
            self.position = Some(scanned.next);
            self.history.push_back(Read {
                from,
                rows: scanned.rows,
                at: Instant::now(),
            });
            if scanned.complete {
                break;
            }
        }
        self.forget_old_reads(poll_interval);
        let Some(positions) = positions else {
            return Ok(());
        };
        let due = store.subscriptions_with_due_deliveries(&ids).await?;
        let source = self.source.id;
        for (dispatcher, _) in &self.audience().dispatchers {
            if due.contains(&dispatcher.subscription_id()) {
                dispatcher.due_in(source);
            }
        }
        self.move_idle(&positions).await
    }

    fn wake_selected(&mut self, rows: &[ScannedRow]) {
        let source = self.source.id;
        let audience = self.audience();
        let mut woken = HashSet::new();
        for row in rows {
            woken.extend(audience.selecting(row));
        }
        for index in woken {
            audience.dispatchers[index].0.news_in(source);
        }
    }

    fn forget_old_reads(&mut self, poll_interval: Duration) {
        let keep_for = poll_interval * HISTORY_POLLS;
        let mut rows: usize = self.history.iter().map(|read| read.rows.len()).sum();
        while let Some(oldest) = self.history.front() {
            // The newest read stays: it holds where reading stands.
            if self.history.len() == 1 || (oldest.at.elapsed() < keep_for && rows <= HISTORY_ROWS) {
                break;
            }
            rows -= oldest.rows.len();
            self.history.pop_front();
        }
    }

    /// Moves every subscription the reads it kept vouch for to where reading stands, and
    /// asks a few it cannot vouch for to claim once (after which it can).
    async fn move_idle(
        &mut self,
        positions: &[SubscriptionPosition],
    ) -> crate::storage::Result<()> {
        let to = self.position.clone().expect("read before moving");
        // The newest read each dispatcher may care about.
        let mut last_selected: HashMap<usize, usize> = HashMap::new();
        {
            let history = &self.history;
            let audience = self.audience.as_mut().expect("refreshed before use");
            for (read_index, read) in history.iter().enumerate() {
                for row in &read.rows {
                    for index in audience.selecting(row) {
                        last_selected.insert(index, read_index);
                    }
                }
            }
        }
        let audience = self.audience.as_ref().expect("refreshed before use");
        let index_of: HashMap<SubscriptionId, usize> = audience
            .dispatchers
            .iter()
            .enumerate()
            .map(|(index, (dispatcher, _))| (dispatcher.subscription_id(), index))
            .collect();
        let mut moves = Vec::new();
        let mut asked = 0;
        for position in positions {
            let Some(&index) = index_of.get(&position.subscription_id) else {
                continue;
            };
            if !is_before(&position.at, &to) {
                continue;
            }
            let first_read = self
                .history
                .iter()
                .position(|read| covers(&read.from, &position.at));
            match first_read {
                Some(first) if last_selected.get(&index).is_none_or(|&last| last < first) => {
                    moves.push(PositionMove {
                        subscription: position,
                        to: &to,
                    });
                }
                // Rows since may concern it: it was woken for them.
                Some(_) => {}
                None if asked < CLAIMS_ASKED_PER_ROUND => {
                    asked += 1;
                    audience.dispatchers[index].0.news_in(self.source.id);
                }
                None => {}
            }
        }
        let moved = self.source.store.move_read_positions(&moves).await?;
        tracing::trace!(source = %self.source.name, moved, "moved idle read positions");
        Ok(())
    }
}

/// Whether `a` is before `b` in reading order.
fn is_before(a: &ReadPosition, b: &ReadPosition) -> bool {
    (a.xact_id, a.position) < (b.xact_id, b.position)
}

/// Whether reading on from the scout's position `from` sees every row a subscription at
/// `at` would read next: `from` is not past `at`, and each transaction `at` waits for
/// with nothing of it read is one `from` waits for the same way, or one `from` has not
/// passed. A subscription that read part of a transaction is not vouched for.
fn covers(from: &ReadPosition, at: &ReadPosition) -> bool {
    if is_before(at, from) {
        return false;
    }
    at.pending_xact_ids
        .iter()
        .zip(&at.pending_positions)
        .all(|(&xact_id, &taken)| {
            taken == 0
                && (xact_id > from.xact_id
                    || from
                        .pending_xact_ids
                        .iter()
                        .zip(&from.pending_positions)
                        .any(|(&waiting, &read)| waiting == xact_id && read == 0))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(xact_id: i64, position: i64, pending: &[(i64, i64)]) -> ReadPosition {
        ReadPosition {
            xact_id,
            position,
            pending_xact_ids: pending.iter().map(|p| p.0).collect(),
            pending_positions: pending.iter().map(|p| p.1).collect(),
        }
    }

    #[test]
    fn a_position_is_covered_from_an_earlier_one_waiting_for_the_same_transactions() {
        let from = at(100, 5, &[(90, 0), (95, 0)]);
        assert!(covers(&from, &at(100, 5, &[(90, 0), (95, 0)])));
        assert!(covers(&from, &at(120, 1, &[(95, 0), (110, 0)])));
        assert!(covers(&from, &at(120, 1, &[])));
    }

    #[test]
    fn nothing_the_scout_read_before_is_vouched_for() {
        let from = at(100, 5, &[(90, 0)]);
        // The subscription is behind the scout.
        assert!(!covers(&from, &at(99, 1, &[])));
        assert!(!covers(&from, &at(100, 4, &[])));
        // It waits for a transaction the scout read, or had passed when it finished.
        assert!(!covers(&from, &at(120, 1, &[(80, 0)])));
        assert!(!covers(&from, &at(120, 1, &[(100, 0)])));
        // It read part of a transaction.
        assert!(!covers(&from, &at(120, 1, &[(90, 3)])));
        // The scout read part of one the subscription waits for.
        assert!(!covers(&at(100, 5, &[(90, 2)]), &at(120, 1, &[(90, 0)])));
    }
}
