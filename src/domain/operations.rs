//! Types of the operator's view: dead letters, delivery figures, requeue selections and
//! subscription changes.

use std::{collections::BTreeMap, time::Duration};

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{Event, PatternSet, SourceName, SubscriptionName, SubscriptionSettings};

/// An event in a subscription's dead-letter queue.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetter {
    pub subscription: SubscriptionName,
    pub event: Event,
    /// Where the dead letter sits in the listing order; pages resume after it.
    pub position: i64,
    pub attempts: u32,
    pub last_error: Option<String>,
    pub dead_lettered_at: DateTime<Utc>,
    pub resolved_at: Option<DateTime<Utc>>,
    pub resolved_by: Option<String>,
    pub notes: Option<String>,
}

/// Which dead letters a bulk requeue takes; every given selector must hold.
#[derive(Debug, Clone, Default)]
pub struct DeadLetterSelection {
    /// Event ids; dead letters chosen by id are requeued even when resolved.
    pub ids: Vec<Uuid>,
    pub event_types: PatternSet,
    pub dead_lettered_before: Option<DateTime<Utc>>,
}

impl DeadLetterSelection {
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty() && self.event_types.is_empty() && self.dead_lettered_before.is_none()
    }
}

/// Delivery figures of one subscription, in one source or over all it reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriptionStats {
    pub name: SubscriptionName,
    /// The source they count; `None` for the total over its sources.
    pub source: Option<SourceName>,
    pub pending: u64,
    pub in_flight: u64,
    pub awaiting_retry: u64,
    pub dead_lettered: u64,
    /// Creation time of the oldest event not yet acked or dead-lettered.
    pub oldest_unacked_at: Option<DateTime<Utc>>,
    pub delivered_total: u64,
    pub acked_total: u64,
    /// Transactions that were still running when the subscription's cursor passed them
    /// and have finished since: their events are picked up at the next claim, so this
    /// stays near zero.
    pub late_transactions: u64,
}

impl SubscriptionStats {
    pub fn lag_events(&self) -> u64 {
        self.pending + self.in_flight + self.awaiting_retry
    }
}

/// Figures of an outbox.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OutboxStats {
    pub events_stored: u64,
    pub oldest_event_at: Option<DateTime<Utc>>,
    pub newest_event_at: Option<DateTime<Utc>>,
    pub oldest_open_transaction_age: Duration,
    pub events_force_expired: u64,
}

/// Settings an update changes; `None` keeps the current value.
#[derive(Debug, Clone, Default)]
pub struct SubscriptionPatch {
    pub event_types: Option<PatternSet>,
    pub aggregate_types: Option<Vec<String>>,
    pub metadata_match: Option<BTreeMap<String, String>>,
    pub ack_deadline: Option<Duration>,
    pub max_attempts: Option<u32>,
    pub retry_backoff_min: Option<Duration>,
    pub retry_backoff_max: Option<Duration>,
    pub persistent_event_types: Option<PatternSet>,
}

impl SubscriptionPatch {
    pub fn apply(self, settings: &mut SubscriptionSettings) {
        macro_rules! apply {
            ($($field:ident),*) => {
                $(if let Some(value) = self.$field { settings.$field = value; })*
            };
        }
        apply!(
            event_types,
            aggregate_types,
            metadata_match,
            ack_deadline,
            max_attempts,
            retry_backoff_min,
            retry_backoff_max,
            persistent_event_types
        );
    }
}

impl SubscriptionSettings {
    /// True when the subscription's filters select the event.
    pub fn matches(&self, event: &Event) -> bool {
        (self.event_types.is_empty() || self.event_types.matches(&event.event_type))
            && (self.aggregate_types.is_empty()
                || self.aggregate_types.contains(&event.aggregate_type))
            && self
                .metadata_match
                .iter()
                .all(|(key, value)| event.metadata.get(key) == Some(value))
    }
}
