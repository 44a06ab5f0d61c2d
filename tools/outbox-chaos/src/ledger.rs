//! What the producers know: which events committed, which were rolled back, and which
//! publishes ended in doubt; with counters of the errors met on the way.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Mutex, MutexGuard},
};

use chrono::{DateTime, Utc};
use tokio::time::Instant;
use uuid::Uuid;

use crate::check::Violation;

/// How an event was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Rpc,
    Sql,
    /// Published with `outbox_publish` by the exactly-once consumers, in the transaction
    /// that consumed another event.
    Reaction,
}

/// One event a producer tried to publish.
#[derive(Debug, Clone)]
pub struct Published {
    pub id: Uuid,
    /// `aggregate_type/aggregate_id`.
    pub aggregate: String,
    pub version: i64,
    pub event_type: String,
    pub route: Route,
    /// Delivered to no subscription before this time (a scheduled event).
    pub deliver_at: Option<DateTime<Utc>>,
    /// Delivered to no subscription from this time on (an expiring event).
    pub expires_at: Option<DateTime<Utc>>,
}

impl Published {
    /// Whether the event has expired by `now`.
    pub fn expired_by(&self, now: DateTime<Utc>) -> bool {
        self.expires_at.is_some_and(|expires_at| expires_at <= now)
    }
}

#[derive(Debug, Default)]
pub struct Ledger {
    state: Mutex<LedgerState>,
}

#[derive(Debug, Default)]
pub struct LedgerState {
    /// Known committed: a Publish that returned OK, a COMMIT that returned OK, or a
    /// commit whose answer was lost and whose rows were found afterwards.
    pub committed: HashMap<Uuid, Published>,
    /// When each committed event was known committed.
    pub committed_at: HashMap<Uuid, Instant>,
    /// Known rolled back: never stored.
    pub rolled_back: HashMap<Uuid, Published>,
    /// Publishes whose outcome stayed unknown (settled against the database at the end).
    pub in_doubt: HashMap<Uuid, Published>,
    /// Publish calls made, and how many of them were retries of a failed call.
    pub rpc_calls: u64,
    pub rpc_retries: u64,
    /// Failed Publish calls by gRPC code.
    pub rpc_errors: BTreeMap<String, u64>,
    pub sql_transactions: u64,
    /// COMMITs whose answer was lost (settled by looking the rows up).
    pub sql_commit_unknown: u64,
    /// Statements that failed inside a SQL transaction (it was rolled back).
    pub sql_errors: u64,
    /// Re-publishes of committed events with identical content, answered as duplicates.
    pub identical_republishes: u64,
    /// Re-publishes with different content, refused with ALREADY_EXISTS.
    pub conflicting_republishes: u64,
    /// Publishes with input the database cannot store (NUL, invalid UTF-8 in JSON),
    /// refused with INVALID_ARGUMENT.
    pub bad_inputs_refused: u64,
    /// Transactions held open for seconds while everything else flowed.
    pub held_transactions: u64,
    pub violations: Vec<Violation>,
}

impl Ledger {
    pub fn state(&self) -> MutexGuard<'_, LedgerState> {
        self.state.lock().expect("ledger lock")
    }

    pub fn committed(&self, events: &[Published]) {
        let mut state = self.state();
        let now = Instant::now();
        for event in events {
            state.committed_at.insert(event.id, now);
            state.in_doubt.remove(&event.id);
            state.committed.insert(event.id, event.clone());
        }
    }

    pub fn rolled_back(&self, events: &[Published]) {
        let mut state = self.state();
        for event in events {
            state.rolled_back.insert(event.id, event.clone());
        }
    }

    pub fn in_doubt(&self, events: &[Published]) {
        let mut state = self.state();
        for event in events {
            state.in_doubt.insert(event.id, event.clone());
        }
    }

    pub fn rpc_call(&self, retry: bool) {
        let mut state = self.state();
        state.rpc_calls += 1;
        if retry {
            state.rpc_retries += 1;
        }
    }

    pub fn rpc_error(&self, code: tonic::Code) {
        *self
            .state()
            .rpc_errors
            .entry(format!("{code:?}"))
            .or_default() += 1;
    }

    pub fn violation(&self, violation: Violation) {
        self.state().violations.push(violation);
    }
}
