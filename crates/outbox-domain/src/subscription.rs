//! Subscriptions: a name, filters over the outbox, and the delivery policy.

use std::{collections::BTreeMap, fmt, time::Duration};

use chrono::{DateTime, Utc};

use super::refusal::{Refusal, Result};
use super::{
    expression::{EventFilter, PayloadTransform},
    input::{Echo, check_filter_size, check_text, check_texts},
    pattern::PatternSet,
    push::{PushConfig, PushSecret, PushStopped},
    sink::SinkConfig,
    source::SourceName,
};

pub const MIN_ACK_DEADLINE: Duration = Duration::from_secs(1);
pub const MAX_ACK_DEADLINE: Duration = Duration::from_secs(12 * 60 * 60);
/// Longest retry backoff a subscription may set, and longest `retry_after` of a nack.
pub const MAX_BACKOFF: Duration = Duration::from_secs(7 * 24 * 60 * 60);
/// Longest `max_event_age`: far beyond any retention, and within what the database's
/// time arithmetic holds.
pub const MAX_EVENT_AGE: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);
/// Most deliveries a subscription may allow before dead-lettering (the database counts
/// attempts in 32 bits).
pub const MAX_ATTEMPTS: u32 = i32::MAX as u32;

/// A validated subscription name: `[a-z0-9][a-z0-9._-]{0,127}`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SubscriptionName(String);

/// Shown as the quoted name, as messages name it.
impl fmt::Debug for SubscriptionName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl SubscriptionName {
    pub fn parse(field: &str, name: &str) -> Result<Self> {
        let mut bytes = name.bytes();
        let first_ok = bytes
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
        let rest_ok = bytes.all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'_' || b == b'-'
        });
        if !first_ok || !rest_ok || name.len() > 128 {
            return Err(Refusal::invalid(
                field,
                format!(
                    "{} is not a valid subscription name: [a-z0-9][a-z0-9._-]{{0,127}}",
                    Echo(name)
                ),
            ));
        }
        Ok(SubscriptionName(name.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SubscriptionName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Where a subscription starts reading, or where a seek moves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartPosition {
    Latest,
    Earliest,
    /// Events written at or after this time.
    Time(DateTime<Utc>),
}

/// What a subscription selects and how it delivers.
#[derive(Debug, Clone, PartialEq)]
pub struct SubscriptionSettings {
    pub event_types: PatternSet,
    pub aggregate_types: Vec<String>,
    pub metadata_match: BTreeMap<String, String>,
    /// A CEL expression over the event, ANDed with the filters above.
    pub filter: Option<EventFilter>,
    /// A CEL expression whose value, as JSON, is the payload delivered.
    pub transform: Option<PayloadTransform>,
    pub ack_deadline: Duration,
    /// 0 retries forever.
    pub max_attempts: u32,
    pub retry_backoff_min: Duration,
    pub retry_backoff_max: Duration,
    pub ordered: bool,
    pub persistent_event_types: PatternSet,
    /// Events older than this (since they became deliverable) expire instead of going
    /// out; `None`: no limit.
    pub max_event_age: Option<Duration>,
    /// Expired events go to the dead-letter queue (error "expired") instead of vanishing.
    pub dead_letter_expired: bool,
    /// Push delivery to an HTTP endpoint; `None` for a pull subscription.
    pub push: Option<PushConfig>,
    /// Publishing into a broker; `None` unless the gateway drains it into a sink.
    pub sink: Option<SinkConfig>,
}

impl Default for SubscriptionSettings {
    fn default() -> Self {
        SubscriptionSettings {
            event_types: PatternSet::default(),
            aggregate_types: Vec::new(),
            metadata_match: BTreeMap::new(),
            filter: None,
            transform: None,
            ack_deadline: Duration::from_secs(30),
            max_attempts: 10,
            retry_backoff_min: Duration::from_secs(1),
            retry_backoff_max: Duration::from_secs(15 * 60),
            ordered: false,
            persistent_event_types: PatternSet::default(),
            max_event_age: None,
            dead_letter_expired: false,
            push: None,
            sink: None,
        }
    }
}

impl SubscriptionSettings {
    /// Whether the gateway itself drains the subscription (push or sink) instead of
    /// waiting for Subscribe streams.
    pub fn drained_by_gateway(&self) -> bool {
        self.push.is_some() || self.sink.is_some()
    }

    /// Whether the filter may select an event of this type, aggregate type and metadata,
    /// as the database's filter would (`queries/claim_new.sql`). It errs only towards
    /// yes: the relay moves a subscription past events this says no to without asking
    /// the database, so a wrong no would skip an event, a wrong yes costs one claim.
    pub fn may_select(
        &self,
        event_type: &str,
        aggregate_type: &str,
        metadata: &serde_json::Value,
    ) -> bool {
        let type_matches = self.event_types.is_empty() || self.event_types.matches(event_type);
        let aggregate_matches = self.aggregate_types.is_empty()
            || self.aggregate_types.iter().any(|t| t == aggregate_type);
        // `metadata @> match`: every pair present with that string value. Anything but
        // an object of strings (a direct writer's own shape) is left to the database.
        let metadata_matches = match metadata {
            serde_json::Value::Object(fields) => {
                self.metadata_match
                    .iter()
                    .all(|(key, value)| match fields.get(key) {
                        Some(serde_json::Value::String(found)) => found == value,
                        Some(serde_json::Value::Array(_) | serde_json::Value::Object(_)) => true,
                        _ => false,
                    })
            }
            _ => true,
        };
        type_matches && aggregate_matches && metadata_matches
    }

    /// Checks the rules that parsing alone cannot; `prefix` is the request field holding
    /// the settings (`subscription`).
    pub fn validate(&self, prefix: &str) -> Result<()> {
        let field = |name: &str| format!("{prefix}.{name}");
        if self.push.is_some() && self.sink.is_some() {
            return Err(Refusal::invalid(
                field("sink"),
                "cannot be set beside push: a subscription is pulled, pushed or drained into a sink",
            ));
        }
        if !(MIN_ACK_DEADLINE..=MAX_ACK_DEADLINE).contains(&self.ack_deadline) {
            return Err(Refusal::invalid(
                field("ack_deadline"),
                format!(
                    "must be between {} and {}",
                    humantime::format_duration(MIN_ACK_DEADLINE),
                    humantime::format_duration(MAX_ACK_DEADLINE)
                ),
            ));
        }
        if self.retry_backoff_max > MAX_BACKOFF {
            return Err(Refusal::invalid(
                field("retry_backoff_max"),
                format!(
                    "must be at most {}",
                    humantime::format_duration(MAX_BACKOFF)
                ),
            ));
        }
        if self.retry_backoff_min > self.retry_backoff_max {
            return Err(Refusal::invalid(
                field("retry_backoff_min"),
                "must not exceed retry_backoff_max",
            ));
        }
        if let Some(age) = self.max_event_age
            && (age.is_zero() || age > MAX_EVENT_AGE)
        {
            return Err(Refusal::invalid(
                field("max_event_age"),
                format!(
                    "must be positive and at most {} (leave it unset for no limit)",
                    humantime::format_duration(MAX_EVENT_AGE)
                ),
            ));
        }
        if self.max_attempts > MAX_ATTEMPTS {
            return Err(Refusal::invalid(
                field("max_attempts"),
                format!("must be at most {MAX_ATTEMPTS} (0 retries forever)"),
            ));
        }
        self.event_types.check_size(&field("event_types"))?;
        self.persistent_event_types
            .check_size(&field("persistent_event_types"))?;
        check_filter_size(
            field("aggregate_types"),
            self.aggregate_types.len(),
            self.aggregate_types.iter().map(String::len).sum(),
        )?;
        check_filter_size(
            field("metadata_match"),
            self.metadata_match.len(),
            self.metadata_match
                .iter()
                .map(|(key, value)| key.len() + value.len())
                .sum(),
        )?;
        for (index, aggregate_type) in self.aggregate_types.iter().enumerate() {
            if aggregate_type.is_empty() || aggregate_type.len() > 255 {
                return Err(Refusal::invalid(
                    format!("{prefix}.aggregate_types[{index}]"),
                    "must be 1 to 255 bytes",
                ));
            }
        }
        check_texts(&field("aggregate_types"), &self.aggregate_types)?;
        for (key, value) in &self.metadata_match {
            if key.is_empty() || key.len() > 128 {
                return Err(Refusal::invalid(
                    field("metadata_match"),
                    format!("key {} must be 1 to 128 bytes", Echo(key)),
                ));
            }
            check_text(field("metadata_match"), key)?;
            check_text(format!("{}[{}]", field("metadata_match"), Echo(key)), value)?;
        }
        Ok(())
    }

    /// Delay before retry number `attempt + 1` after delivery `attempt` failed:
    /// min × 2^(attempt−1), capped at max.
    pub fn backoff(&self, attempt: u32) -> Duration {
        let factor = 2f64.powi(attempt.saturating_sub(1).min(64) as i32);
        Duration::try_from_secs_f64(self.retry_backoff_min.as_secs_f64() * factor)
            .unwrap_or(Duration::MAX)
            .min(self.retry_backoff_max)
    }
}

/// A stored subscription's id: the key of its definition, read positions and deliveries
/// in every source, and of its advisory lock. Names stay the callers' handle; the id is
/// the gateway's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SubscriptionId(pub i64);

impl std::fmt::Display for SubscriptionId {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(formatter)
    }
}

/// A stored subscription.
#[derive(Debug, Clone, PartialEq)]
pub struct Subscription {
    pub id: SubscriptionId,
    pub name: SubscriptionName,
    pub settings: SubscriptionSettings,
    /// The sources it reads; empty: every source, including ones added later.
    pub sources: Vec<SourceName>,
    /// Where it started, applied in each source as it begins reading it.
    pub start: StartPosition,
    /// Deleted once no stream has been attached for this long; `None`: never.
    pub expire_after_idle: Option<Duration>,
    pub created_at: DateTime<Utc>,
    /// Set while (or since) it was paused: as stored, possibly past its `until`; see
    /// [`Subscription::pause_in_force`].
    pub pause: Option<Pause>,
    /// Signing keys of a push subscription, newest first.
    pub push_secrets: Vec<PushSecret>,
    /// Set when pushing stopped (410 Gone) until an administrator resumes it
    /// (ResumeSubscription, or setting `push` again).
    pub push_stopped: Option<PushStopped>,
    /// When a gateway last recorded a Subscribe stream attached to it (every
    /// [`ATTACHED_HEARTBEAT`] while one is); its creation time until then.
    pub last_attached_at: DateTime<Utc>,
}

/// Longest pause reason kept.
pub const MAX_PAUSE_REASON_BYTES: usize = 1024;

/// A stop of new deliveries: set by an operator, or by the gateway itself when a
/// subscription cannot be served (its reason says which); resuming clears it either way.
#[derive(Debug, Clone, PartialEq)]
pub struct Pause {
    pub reason: String,
    /// When it was paused.
    pub since: DateTime<Utc>,
    /// It ends by itself at this time; `None`: until resumed.
    pub until: Option<DateTime<Utc>>,
}

impl Pause {
    /// Checks a requested pause: a reason of plain, bounded text and an end in the future.
    pub fn validate(reason: &str, until: Option<DateTime<Utc>>, now: DateTime<Utc>) -> Result<()> {
        if reason.len() > MAX_PAUSE_REASON_BYTES {
            return Err(Refusal::invalid(
                "reason",
                format!("must be at most {MAX_PAUSE_REASON_BYTES} bytes"),
            ));
        }
        check_text("reason", reason)?;
        if until.is_some_and(|until| until <= now) {
            return Err(Refusal::invalid("until", "must be in the future"));
        }
        Ok(())
    }

    pub fn in_force(&self, now: DateTime<Utc>) -> bool {
        self.until.is_none_or(|until| now < until)
    }
}

/// Shortest `expire_after_idle`: well above how often gateways report the streams they
/// hold ([`ATTACHED_HEARTBEAT`]), so an attached subscription is never taken for idle.
pub const MIN_EXPIRE_AFTER_IDLE: Duration = Duration::from_secs(10);

/// How often each gateway records that its streams are still attached.
pub const ATTACHED_HEARTBEAT: Duration = Duration::from_secs(2);

/// How long a gateway's record of the Subscribe streams it holds counts after it last
/// refreshed it (every [`ATTACHED_HEARTBEAT`]). A gateway that stops removes its record;
/// one that dies cannot, and its streams died with it: past this age they are taken for
/// gone. Several heartbeats long, so a slow database round does not drop a live stream.
pub const STREAMS_RECORD_LIFETIME: Duration = Duration::from_secs(15);

/// Longest `expire_after_idle`: as for `max_event_age`, the database's time arithmetic
/// must hold it (the expiry sweep subtracts it from now for every subscription).
pub const MAX_EXPIRE_AFTER_IDLE: Duration = MAX_EVENT_AGE;

/// Checks an `expire_after_idle` given at creation (`field` names it).
pub fn check_expire_after_idle(field: &str, expire_after_idle: Option<Duration>) -> Result<()> {
    match expire_after_idle {
        Some(idle) if !(MIN_EXPIRE_AFTER_IDLE..=MAX_EXPIRE_AFTER_IDLE).contains(&idle) => {
            Err(Refusal::invalid(
                field,
                format!(
                    "must be between {} and {}",
                    humantime::format_duration(MIN_EXPIRE_AFTER_IDLE),
                    humantime::format_duration(MAX_EXPIRE_AFTER_IDLE)
                ),
            ))
        }
        _ => Ok(()),
    }
}

impl Subscription {
    /// Whether it reads events of this source.
    pub fn reads(&self, source: &SourceName) -> bool {
        self.sources.is_empty() || self.sources.contains(source)
    }

    /// The pause that holds now, if any (one whose `until` passed has ended).
    pub fn pause_in_force(&self, now: DateTime<Utc>) -> Option<&Pause> {
        self.pause.as_ref().filter(|pause| pause.in_force(now))
    }

    /// Where it starts in a source it begins reading only now (added later, or down when
    /// the subscription was created): the same events as at creation. "Latest" meant the
    /// events created from then on.
    pub fn late_start(&self) -> StartPosition {
        match self.start {
            StartPosition::Latest => StartPosition::Time(self.created_at),
            start => start,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn may_select_agrees_with_the_filter_and_errs_towards_yes() {
        let settings = SubscriptionSettings {
            event_types: PatternSet::parse(&["order.*"]).unwrap(),
            aggregate_types: vec!["order".into()],
            metadata_match: BTreeMap::from([("tenant".to_owned(), "acme".to_owned())]),
            ..SubscriptionSettings::default()
        };
        let acme = serde_json::json!({"tenant": "acme", "trace": "x"});
        assert!(settings.may_select("order.created", "order", &acme));
        assert!(!settings.may_select("invoice.created", "order", &acme));
        assert!(!settings.may_select("order.created", "invoice", &acme));
        assert!(!settings.may_select(
            "order.created",
            "order",
            &serde_json::json!({"tenant": "other"})
        ));
        assert!(!settings.may_select("order.created", "order", &serde_json::json!({})));
        // Shapes only the database can judge.
        assert!(settings.may_select(
            "order.created",
            "order",
            &serde_json::json!({"tenant": ["acme"]})
        ));
        assert!(settings.may_select("order.created", "order", &serde_json::json!(null)));
        // No filter selects everything.
        assert!(SubscriptionSettings::default().may_select("a", "b", &serde_json::json!({})));
    }

    #[test]
    fn names_follow_the_documented_shape() {
        for good in ["orders", "0-billing.v2_eu", &"a".repeat(128)] {
            SubscriptionName::parse("name", good).unwrap();
        }
        for bad in ["", "Orders", "-orders", "orders!", &"a".repeat(129)] {
            assert!(SubscriptionName::parse("name", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn backoff_doubles_and_caps() {
        let settings = SubscriptionSettings::default();
        assert_eq!(settings.backoff(1), Duration::from_secs(1));
        assert_eq!(settings.backoff(2), Duration::from_secs(2));
        assert_eq!(settings.backoff(5), Duration::from_secs(16));
        assert_eq!(settings.backoff(11), Duration::from_secs(15 * 60));
        assert_eq!(settings.backoff(u32::MAX), Duration::from_secs(15 * 60));
    }

    #[test]
    fn max_event_age_is_positive_and_bounded() {
        let mut settings = SubscriptionSettings {
            max_event_age: Some(Duration::from_secs(60)),
            ..Default::default()
        };
        settings.validate("subscription").unwrap();
        for bad in [Duration::ZERO, MAX_EVENT_AGE + Duration::from_secs(1)] {
            settings.max_event_age = Some(bad);
            assert!(settings.validate("subscription").is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_pause_ends_at_its_until() {
        let now = Utc::now();
        let mut pause = Pause {
            reason: "deploy".into(),
            since: now,
            until: None,
        };
        assert!(pause.in_force(now + chrono::Duration::days(365)));
        pause.until = Some(now + chrono::Duration::seconds(1));
        assert!(pause.in_force(now));
        assert!(!pause.in_force(now + chrono::Duration::seconds(1)));
    }

    #[test]
    fn a_pause_must_end_in_the_future_with_a_plain_reason() {
        let now = Utc::now();
        Pause::validate("deploy", Some(now + chrono::Duration::seconds(1)), now).unwrap();
        Pause::validate("", None, now).unwrap();
        assert!(Pause::validate("deploy", Some(now), now).is_err());
        assert!(Pause::validate(&"x".repeat(MAX_PAUSE_REASON_BYTES + 1), None, now).is_err());
        assert!(Pause::validate("nul\0", None, now).is_err());
    }

    #[test]
    fn rejects_inverted_backoff_and_out_of_range_deadline() {
        let mut settings = SubscriptionSettings {
            retry_backoff_min: Duration::from_secs(10),
            retry_backoff_max: Duration::from_secs(1),
            ..Default::default()
        };
        assert!(settings.validate("subscription").is_err());
        settings.retry_backoff_max = Duration::from_secs(10);
        settings.validate("subscription").unwrap();
        settings.ack_deadline = Duration::from_millis(10);
        assert!(settings.validate("subscription").is_err());
    }
}
