//! Types of the operator's view: dead letters, delivery stats, requeue selections and
//! subscription changes.

use std::{collections::BTreeMap, time::Duration};

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::refusal::{Refusal, Result};
use super::{
    Event, EventFilter, PatternSet, PayloadTransform, PushConfig, SinkConfig, SourceName,
    SubscriptionName, SubscriptionSettings, check_text, check_timestamp,
};

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
                    return Err(Refusal::invalid(field, "must be 1 to 255 bytes"));
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
            return Err(Refusal::invalid(
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

/// Delivery stats of one subscription, in one source or over all it reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriptionStats {
    pub name: SubscriptionName,
    /// The source they count; `None` for the total over its sources.
    pub source: Option<SourceName>,
    /// Due and not handed out yet (scheduled events are counted in `scheduled` only).
    pub pending: u64,
    pub in_flight: u64,
    pub awaiting_retry: u64,
    pub dead_lettered: u64,
    /// When the oldest due event not yet acked or dead-lettered became due: its
    /// creation, or its `deliver_at` when later. Scheduled events do not count.
    pub oldest_unacked_at: Option<DateTime<Utc>>,
    pub delivered_total: u64,
    pub acked_total: u64,
    /// Transactions that were still running when the subscription's cursor passed them
    /// and have finished since: their events are picked up at the next claim, so this
    /// stays near zero.
    pub late_transactions: u64,
    /// Events it let expire (dropped or dead-lettered) since it began.
    pub expired_total: u64,
    /// Events waiting for their `deliver_at`; not in `pending` nor in the lag.
    pub scheduled: u64,
    /// When the next of them is due.
    pub next_scheduled_at: Option<DateTime<Utc>>,
    /// Events its `filter` passed over (errors included) since it began.
    pub filtered_total: u64,
    /// Events its `filter` could not be evaluated on (passed over too).
    pub filter_errors_total: u64,
    /// The last of those errors, and when.
    pub last_filter_error: Option<(String, DateTime<Utc>)>,
}

impl SubscriptionStats {
    pub fn lag_events(&self) -> u64 {
        self.pending + self.in_flight + self.awaiting_retry
    }
}

/// An oldest due, unacked event older than this makes a subscription behind.
pub const BEHIND_AFTER: Duration = Duration::from_secs(60);

/// The one thing an operator most needs to know about a subscription: the most pressing
/// of its states, in this order. GetStats, the console and the CLI all show this one.
#[derive(Debug, Clone, PartialEq)]
pub enum SubscriptionStatus {
    /// A push subscription whose endpoint stopped it (410 Gone); resuming restarts it.
    PushStopped {
        at: DateTime<Utc>,
        reason: String,
    },
    /// A sink subscription whose sink's broker does not answer: its events wait, and
    /// resends count as attempts, not as the event's fault.
    SinkUnreachable {
        sink: String,
        /// What the last check of the broker found, naming the broker.
        reason: String,
    },
    /// Paused by an operator (or by the gateway itself); nothing new goes out.
    Paused {
        reason: String,
        since: DateTime<Utc>,
        until: Option<DateTime<Utc>>,
    },
    /// Unresolved dead letters wait for someone to requeue or resolve them.
    DeadLetters {
        count: u64,
    },
    /// A pull subscription with due events and no Subscribe stream on any gateway; the
    /// last one was seen (or the subscription created) at `since`. It outranks
    /// [`SubscriptionStatus::Behind`]: the lag is its consequence, the missing consumer
    /// what to fix.
    NoConsumer {
        since: DateTime<Utc>,
        /// When the oldest due event became due, when it has waited longer than
        /// [`BEHIND_AFTER`].
        behind_since: Option<DateTime<Utc>>,
    },
    /// The oldest due event has waited longer than [`BEHIND_AFTER`] since `since`.
    Behind {
        since: DateTime<Utc>,
    },
    /// Due events are going out, none of them late.
    Delivering {
        events: u64,
    },
    /// Nothing due; events wait for their `deliver_at`, the next at `next_at`.
    ScheduledOnly {
        count: u64,
        next_at: Option<DateTime<Utc>>,
    },
    CaughtUp,
}

/// The kinds of [`SubscriptionStatus`], with the words every view uses for them; ordered
/// most pressing first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum StatusKind {
    PushStopped,
    SinkUnreachable,
    Paused,
    DeadLetters,
    NoConsumer,
    Behind,
    Delivering,
    ScheduledOnly,
    CaughtUp,
}

impl StatusKind {
    /// Every kind, most pressing first: for views that list them all (a gauge per kind).
    pub const ALL: [StatusKind; 9] = [
        StatusKind::PushStopped,
        StatusKind::SinkUnreachable,
        StatusKind::Paused,
        StatusKind::DeadLetters,
        StatusKind::NoConsumer,
        StatusKind::Behind,
        StatusKind::Delivering,
        StatusKind::ScheduledOnly,
        StatusKind::CaughtUp,
    ];

    /// The status in the words the console, the CLI and the docs use.
    pub fn label(self) -> &'static str {
        match self {
            StatusKind::PushStopped => "push stopped",
            StatusKind::SinkUnreachable => "sink unreachable",
            StatusKind::Paused => "paused",
            StatusKind::DeadLetters => "dead letters",
            StatusKind::NoConsumer => "no consumer",
            StatusKind::Behind => "behind",
            StatusKind::Delivering => "delivering",
            StatusKind::ScheduledOnly => "scheduled only",
            StatusKind::CaughtUp => "caught up",
        }
    }

    /// Whether an operator has something to do (or to look into).
    pub fn needs_attention(self) -> bool {
        matches!(
            self,
            StatusKind::PushStopped
                | StatusKind::SinkUnreachable
                | StatusKind::Paused
                | StatusKind::DeadLetters
                | StatusKind::NoConsumer
                | StatusKind::Behind
        )
    }
}

/// Where a subscription's consumers stand, for its status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Consumers {
    /// A push or sink subscription: the gateway itself delivers.
    Gateway,
    /// A sink subscription whose sink's broker did not answer the last check: why, in
    /// words naming the broker.
    SinkUnreachable { sink: String, reason: String },
    /// A Subscribe stream is attached on some gateway now.
    Attached,
    /// None attached on any gateway; one was last seen (or the subscription was
    /// created) then.
    Absent { since: DateTime<Utc> },
}

impl SubscriptionStatus {
    /// The status of a subscription with these stats (its total over its sources) and
    /// consumers, at `now`.
    pub fn of(
        subscription: &super::Subscription,
        stats: &SubscriptionStats,
        consumers: Consumers,
        now: DateTime<Utc>,
    ) -> SubscriptionStatus {
        if subscription.settings.push.is_some()
            && let Some(stopped) = &subscription.push_stopped
        {
            return SubscriptionStatus::PushStopped {
                at: stopped.at,
                reason: stopped.reason.clone(),
            };
        }
        if let Consumers::SinkUnreachable { sink, reason } = &consumers {
            return SubscriptionStatus::SinkUnreachable {
                sink: sink.clone(),
                reason: reason.clone(),
            };
        }
        if let Some(pause) = subscription.pause_in_force(now) {
            return SubscriptionStatus::Paused {
                reason: pause.reason.clone(),
                since: pause.since,
                until: pause.until,
            };
        }
        if stats.dead_lettered > 0 {
            return SubscriptionStatus::DeadLetters {
                count: stats.dead_lettered,
            };
        }
        let waited = |since: DateTime<Utc>| (now - since).to_std().unwrap_or_default();
        let behind_since = stats
            .oldest_unacked_at
            .filter(|since| waited(*since) > BEHIND_AFTER);
        let events = stats.lag_events();
        if events > 0
            && let Consumers::Absent { since } = consumers
        {
            return SubscriptionStatus::NoConsumer {
                since,
                behind_since,
            };
        }
        if let Some(since) = behind_since {
            return SubscriptionStatus::Behind { since };
        }
        if events > 0 {
            return SubscriptionStatus::Delivering { events };
        }
        if stats.scheduled > 0 {
            return SubscriptionStatus::ScheduledOnly {
                count: stats.scheduled,
                next_at: stats.next_scheduled_at,
            };
        }
        SubscriptionStatus::CaughtUp
    }

    pub fn kind(&self) -> StatusKind {
        match self {
            SubscriptionStatus::PushStopped { .. } => StatusKind::PushStopped,
            SubscriptionStatus::SinkUnreachable { .. } => StatusKind::SinkUnreachable,
            SubscriptionStatus::Paused { .. } => StatusKind::Paused,
            SubscriptionStatus::DeadLetters { .. } => StatusKind::DeadLetters,
            SubscriptionStatus::NoConsumer { .. } => StatusKind::NoConsumer,
            SubscriptionStatus::Behind { .. } => StatusKind::Behind,
            SubscriptionStatus::Delivering { .. } => StatusKind::Delivering,
            SubscriptionStatus::ScheduledOnly { .. } => StatusKind::ScheduledOnly,
            SubscriptionStatus::CaughtUp => StatusKind::CaughtUp,
        }
    }

    /// What the status means for this subscription, in one sentence of plain text
    /// (times in UTC): what GetStats and the CLI show next to the status.
    pub fn detail(&self) -> String {
        let at = |time: &DateTime<Utc>| time.format("%Y-%m-%d %H:%M:%S UTC").to_string();
        match self {
            SubscriptionStatus::PushStopped {
                at: stopped,
                reason,
            } => format!(
                "{reason} at {}: pushing stopped until it is resumed",
                at(stopped)
            ),
            SubscriptionStatus::SinkUnreachable { sink, reason } => format!(
                "sink {sink:?} cannot reach its broker ({reason}): its events wait and are sent once the broker answers"
            ),
            SubscriptionStatus::Paused {
                reason,
                since,
                until,
            } => {
                let mut text = format!("paused since {}", at(since));
                if let Some(until) = until {
                    text.push_str(&format!(" until {}", at(until)));
                }
                if !reason.is_empty() {
                    text.push_str(&format!(": {reason}"));
                }
                text
            }
            SubscriptionStatus::DeadLetters { count } => {
                format!("{count} unresolved dead letter{}", plural(*count))
            }
            SubscriptionStatus::NoConsumer {
                since,
                behind_since,
            } => {
                let mut text = format!(
                    "events are due and no consumer is attached on any gateway (one was last seen at {})",
                    at(since)
                );
                if let Some(waiting) = behind_since {
                    text.push_str(&format!(
                        "; the oldest due event has waited since {}",
                        at(waiting)
                    ));
                }
                text
            }
            SubscriptionStatus::Behind { since } => {
                format!("the oldest due event has waited since {}", at(since))
            }
            SubscriptionStatus::Delivering { events } => {
                format!("{events} event{} on the way", plural(*events))
            }
            SubscriptionStatus::ScheduledOnly { count, next_at } => {
                let mut text = format!("{count} event{} scheduled", plural(*count));
                if let Some(next) = next_at {
                    text.push_str(&format!(", the next due at {}", at(next)));
                }
                text
            }
            SubscriptionStatus::CaughtUp => "nothing waits".to_owned(),
        }
    }
}

fn plural(count: u64) -> &'static str {
    if count == 1 { "" } else { "s" }
}

/// Stats of an outbox.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OutboxStats {
    pub events_stored: u64,
    pub oldest_event_at: Option<DateTime<Utc>>,
    pub newest_event_at: Option<DateTime<Utc>>,
    pub oldest_open_transaction_age: Duration,
    pub events_force_expired: u64,
}

impl OutboxStats {
    /// The stats of several outboxes together.
    pub fn sum(outboxes: &[OutboxStats]) -> OutboxStats {
        OutboxStats {
            events_stored: outboxes.iter().map(|o| o.events_stored).sum(),
            oldest_event_at: outboxes.iter().filter_map(|o| o.oldest_event_at).min(),
            newest_event_at: outboxes.iter().filter_map(|o| o.newest_event_at).max(),
            oldest_open_transaction_age: outboxes
                .iter()
                .map(|o| o.oldest_open_transaction_age)
                .max()
                .unwrap_or_default(),
            events_force_expired: outboxes.iter().map(|o| o.events_force_expired).sum(),
        }
    }
}

/// Settings an update changes; `None` keeps the current value.
#[derive(Debug, Clone, Default)]
pub struct SubscriptionPatch {
    pub event_types: Option<PatternSet>,
    pub aggregate_types: Option<Vec<String>>,
    pub metadata_match: Option<BTreeMap<String, String>>,
    /// `Some(None)` removes the filter.
    pub filter: Option<Option<EventFilter>>,
    /// `Some(None)` removes the transform.
    pub transform: Option<Option<PayloadTransform>>,
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
    /// `Some(None)` switches to pull.
    pub sink: Option<Option<SinkConfig>>,
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
            filter,
            transform,
            ack_deadline,
            max_attempts,
            retry_backoff_min,
            retry_backoff_max,
            persistent_event_types,
            max_event_age,
            dead_letter_expired,
            push,
            sink
        );
    }
}

impl SubscriptionSettings {
    /// True when the subscription's filters select the event (a filter that cannot be
    /// evaluated on it does not).
    pub fn matches(&self, event: &Event) -> bool {
        (self.event_types.is_empty() || self.event_types.matches(&event.event_type))
            && (self.aggregate_types.is_empty()
                || self.aggregate_types.contains(&event.aggregate_type))
            && self
                .metadata_match
                .iter()
                .all(|(key, value)| event.metadata.get(key) == Some(value))
            && self
                .filter
                .as_ref()
                .is_none_or(|filter| filter.matches(event) == Ok(true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Pause, PushStopped, StartPosition, Subscription, SubscriptionId};

    fn subscription(now: DateTime<Utc>) -> Subscription {
        Subscription {
            id: SubscriptionId(1),
            name: SubscriptionName::parse("name", "work").unwrap(),
            settings: SubscriptionSettings::default(),
            sources: Vec::new(),
            start: StartPosition::Latest,
            expire_after_idle: None,
            created_at: now,
            pause: None,
            push_secrets: Vec::new(),
            push_stopped: None,
            last_attached_at: now,
        }
    }

    fn stats() -> SubscriptionStats {
        SubscriptionStats {
            name: SubscriptionName::parse("name", "work").unwrap(),
            source: None,
            pending: 0,
            in_flight: 0,
            awaiting_retry: 0,
            dead_lettered: 0,
            oldest_unacked_at: None,
            delivered_total: 0,
            acked_total: 0,
            late_transactions: 0,
            expired_total: 0,
            filtered_total: 0,
            filter_errors_total: 0,
            last_filter_error: None,
            scheduled: 0,
            next_scheduled_at: None,
        }
    }

    #[test]
    fn each_status_outranks_the_ones_after_it() {
        let now = Utc::now();
        let minutes_ago = |minutes| now - chrono::Duration::minutes(minutes);
        let gone = Consumers::Absent {
            since: minutes_ago(5),
        };
        let kind = |subscription: &Subscription, stats: &SubscriptionStats, consumers| {
            SubscriptionStatus::of(subscription, stats, consumers, now).kind()
        };

        let mut subscription = subscription(minutes_ago(10));
        let mut stats = stats();
        assert_eq!(
            kind(&subscription, &stats, gone.clone()),
            StatusKind::CaughtUp
        );
        stats.scheduled = 3;
        assert_eq!(
            kind(&subscription, &stats, gone.clone()),
            StatusKind::ScheduledOnly
        );
        stats.pending = 2;
        stats.oldest_unacked_at = Some(now - chrono::Duration::seconds(5));
        assert_eq!(
            kind(&subscription, &stats, Consumers::Attached),
            StatusKind::Delivering
        );
        // No stream anywhere reads as such at once, however recently one left: the
        // gateways say when their last stream goes, so there is nothing to wait for.
        let just_left = Consumers::Absent {
            since: now - chrono::Duration::seconds(1),
        };
        assert_eq!(
            kind(&subscription, &stats, just_left),
            StatusKind::NoConsumer
        );
        assert_eq!(
            kind(&subscription, &stats, gone.clone()),
            StatusKind::NoConsumer
        );
        assert_eq!(
            kind(&subscription, &stats, Consumers::Gateway),
            StatusKind::Delivering
        );
        stats.oldest_unacked_at = Some(minutes_ago(2));
        assert_eq!(
            kind(&subscription, &stats, Consumers::Attached),
            StatusKind::Behind
        );
        // The missing consumer is why it is behind: that is what to show.
        let orphaned = SubscriptionStatus::of(&subscription, &stats, gone.clone(), now);
        assert_eq!(orphaned.kind(), StatusKind::NoConsumer);
        assert!(
            orphaned
                .detail()
                .contains("the oldest due event has waited since"),
            "{}",
            orphaned.detail()
        );
        stats.dead_lettered = 1;
        assert_eq!(
            kind(&subscription, &stats, gone.clone()),
            StatusKind::DeadLetters
        );
        subscription.pause = Some(Pause {
            reason: "deploy".into(),
            since: minutes_ago(1),
            until: Some(now + chrono::Duration::minutes(30)),
        });
        let paused = SubscriptionStatus::of(&subscription, &stats, gone.clone(), now);
        assert_eq!(paused.kind(), StatusKind::Paused);
        assert!(paused.detail().ends_with(": deploy"), "{}", paused.detail());
        assert!(paused.detail().contains(" until "), "{}", paused.detail());
        // Pushing stopped outranks all; it counts only while `push` is set.
        subscription.push_stopped = Some(PushStopped {
            at: minutes_ago(1),
            reason: "the endpoint answered 410 Gone".into(),
        });
        assert_eq!(
            kind(&subscription, &stats, gone.clone()),
            StatusKind::Paused
        );
        subscription.settings.push = Some(crate::PushConfig {
            endpoint: "https://example.com/hook".parse().unwrap(),
            headers: BTreeMap::new(),
            format: crate::PushFormat::Binary,
            timeout: Duration::from_secs(10),
            max_concurrency: 1,
            rate_limit: None,
            max_batch_events: 1,
            max_batch_bytes: crate::DEFAULT_PUSH_BATCH_BYTES,
            max_batch_wait: Duration::ZERO,
        });
        let stopped = SubscriptionStatus::of(&subscription, &stats, Consumers::Gateway, now);
        assert_eq!(stopped.kind(), StatusKind::PushStopped);
        assert!(
            stopped.detail().contains("410 Gone"),
            "{}",
            stopped.detail()
        );
        // A sink's broker that does not answer outranks a pause and dead letters.
        subscription.push_stopped = None;
        subscription.settings.push = None;
        let unreachable = SubscriptionStatus::of(
            &subscription,
            &stats,
            Consumers::SinkUnreachable {
                sink: "events".into(),
                reason: "Kafka at k1:9092 does not answer: timed out".into(),
            },
            now,
        );
        assert_eq!(unreachable.kind(), StatusKind::SinkUnreachable);
        assert!(
            unreachable
                .detail()
                .starts_with("sink \"events\" cannot reach its broker (Kafka at k1:9092"),
            "{}",
            unreachable.detail()
        );
        // A pause that has ended is no pause.
        subscription.push_stopped = None;
        subscription.pause.as_mut().unwrap().until = Some(minutes_ago(0));
        assert_eq!(
            kind(&subscription, &stats, Consumers::Gateway),
            StatusKind::DeadLetters
        );
    }
}
