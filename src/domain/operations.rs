//! Types of the operator's view: dead letters, delivery figures, requeue selections and
//! subscription changes.

use std::{collections::BTreeMap, time::Duration};

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{
    Event, PatternSet, PushConfig, SourceName, SubscriptionName, SubscriptionSettings, check_text,
    check_timestamp,
};
use crate::error::{Error, Result};

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

/// Which dead letters a listing, count, bulk requeue or bulk resolve takes; every given
/// selector must hold.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeadLetterSelection {
    /// Event ids; dead letters chosen by id are requeued even when resolved.
    pub ids: Vec<Uuid>,
    pub event_types: PatternSet,
    /// Exact aggregate type and id of the event.
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    /// Exact last error (a dead letter without one has the empty error).
    pub last_error: Option<String>,
    /// Dead-lettered at or after this time.
    pub dead_lettered_after: Option<DateTime<Utc>>,
    /// Dead-lettered before this time.
    pub dead_lettered_before: Option<DateTime<Utc>>,
    /// Only dead letters of events in this source; it narrows the others, and alone
    /// selects nothing in particular (a bulk action still needs `all`).
    pub source: Option<SourceName>,
}

impl DeadLetterSelection {
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
            && self.event_types.is_empty()
            && self.aggregate_type.is_none()
            && self.aggregate_id.is_none()
            && self.last_error.is_none()
            && self.dead_lettered_after.is_none()
            && self.dead_lettered_before.is_none()
    }

    /// Refuses what no dead letter could match or the database could not take; the error
    /// names the selector.
    pub fn validate(&self) -> Result<()> {
        for (field, value) in [
            ("aggregate_type", &self.aggregate_type),
            ("aggregate_id", &self.aggregate_id),
        ] {
            if let Some(value) = value {
                if value.is_empty() || value.len() > 255 {
                    return Err(Error::invalid(field, "must be 1 to 255 bytes"));
                }
                check_text(field, value)?;
            }
        }
        if let Some(error) = &self.last_error {
            check_text("last_error", error)?;
        }
        for (field, time) in [
            ("dead_lettered_after", self.dead_lettered_after),
            ("dead_lettered_before", self.dead_lettered_before),
        ] {
            if let Some(time) = time {
                check_timestamp(field, time)?;
            }
        }
        if let (Some(after), Some(before)) = (self.dead_lettered_after, self.dead_lettered_before)
            && after >= before
        {
            return Err(Error::invalid(
                "dead_lettered_after",
                "must be earlier than dead_lettered_before",
            ));
        }
        Ok(())
    }
}

/// Unresolved dead letters of a subscription that share their last error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterGroup {
    /// The last error; empty for dead letters without one.
    pub last_error: String,
    pub count: u64,
    pub first_dead_lettered_at: DateTime<Utc>,
    pub last_dead_lettered_at: DateTime<Utc>,
    /// The most recently dead-lettered event of the group.
    pub example_event_id: Uuid,
}

impl DeadLetterGroup {
    /// Adds the same error's group from another source.
    pub fn merge(&mut self, other: DeadLetterGroup) {
        self.count += other.count;
        self.first_dead_lettered_at = self
            .first_dead_lettered_at
            .min(other.first_dead_lettered_at);
        if other.last_dead_lettered_at > self.last_dead_lettered_at {
            self.last_dead_lettered_at = other.last_dead_lettered_at;
            self.example_event_id = other.example_event_id;
        }
    }
}

/// Where one event stands on one subscription.
#[derive(Debug, Clone, PartialEq)]
pub enum DeliveryState {
    /// The subscription's filters do not select the event.
    NotMatched,
    /// Not handed out yet.
    Pending,
    /// Written before the time the subscription was started or sought to.
    Skipped,
    /// Handed out and settled: acked, or passed over because the subscription started
    /// after it was written (`before_subscription`).
    Acked { before_subscription: bool },
    /// Leased to a consumer until `deadline`.
    InFlight {
        attempt: u32,
        deadline: DateTime<Utc>,
    },
    /// Due for another attempt at `next_try` (an expired lease is due at once).
    AwaitingRetry {
        attempt: u32,
        next_try: DateTime<Utc>,
        last_error: Option<String>,
    },
    /// Behind an unfinished earlier event of its aggregate (ordered subscriptions).
    Waiting { attempt: u32 },
    Dead {
        attempts: u32,
        last_error: Option<String>,
        dead_lettered_at: Option<DateTime<Utc>>,
        resolved_at: Option<DateTime<Utc>>,
        resolved_by: Option<String>,
        notes: Option<String>,
    },
}

impl DeliveryState {
    /// Whether a requeue of the event on this subscription can take effect now.
    pub fn can_requeue(&self) -> bool {
        matches!(
            self,
            DeliveryState::Acked { .. }
                | DeliveryState::AwaitingRetry { .. }
                | DeliveryState::Waiting { .. }
                | DeliveryState::Dead { .. }
        )
    }
}

/// An event and where it stands on every subscription.
#[derive(Debug, Clone, PartialEq)]
pub struct EventDeliveries {
    pub event: Event,
    /// One entry per subscription, ordered by name.
    pub subscriptions: Vec<(SubscriptionName, DeliveryState)>,
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
    /// Events it let expire (dropped or dead-lettered) since it began.
    pub expired_total: u64,
    /// Events waiting for their `deliver_at` (counted in `pending` too).
    pub scheduled: u64,
    /// When the next of them is due.
    pub next_scheduled_at: Option<DateTime<Utc>>,
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
    /// `Some(None)` removes the limit.
    pub max_event_age: Option<Option<Duration>>,
    pub dead_letter_expired: Option<bool>,
    /// `Some(None)` switches to pull.
    pub push: Option<Option<PushConfig>>,
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
            persistent_event_types,
            max_event_age,
            dead_letter_expired,
            push
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
