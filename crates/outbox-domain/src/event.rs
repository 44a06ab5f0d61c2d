//! Events as producers send them (`NewEvent`) and as the outbox stores them (`Event`).

use std::{
    collections::{BTreeMap, HashMap},
    time::Duration,
};

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::refusal::{Refusal, Result};
use super::{
    input::{Echo, check_json, check_text, check_timestamp},
    source::SourceName,
};

/// Longest aggregate type, aggregate id, event type or content type, in bytes.
const MAX_IDENTIFIER_BYTES: usize = 255;
/// Longest metadata key, in bytes; the database enforces the same bound.
const MAX_METADATA_KEY_BYTES: usize = 128;
/// Longest metadata value, in bytes: metadata is for filtering and tracing, not for
/// payload. Publish enforces it; the table allows more for direct SQL writers, whose
/// rows the gateway handles all the same.
const MAX_METADATA_VALUE_BYTES: usize = 1024;
pub const DEFAULT_CONTENT_TYPE: &str = "application/json";
/// Metadata keys carrying W3C trace context from producer to consumer.
pub const TRACE_CONTEXT_KEYS: [&str; 2] = ["traceparent", "tracestate"];

/// Limits on what one Publish call may carry; configurable.
#[derive(Debug, Clone)]
pub struct PublishLimits {
    pub max_batch_events: usize,
    pub max_payload_bytes: usize,
    pub max_metadata_entries: usize,
    /// Sum of the lengths of all metadata keys and values of one event.
    pub max_metadata_bytes: usize,
    /// Furthest ahead of now an event's `deliver_at` may be.
    pub max_schedule_ahead: Duration,
}

impl Default for PublishLimits {
    fn default() -> Self {
        PublishLimits {
            max_batch_events: 1000,
            max_payload_bytes: 1024 * 1024,
            max_metadata_entries: 64,
            max_metadata_bytes: 16 * 1024,
            max_schedule_ahead: Duration::from_secs(90 * 24 * 60 * 60),
        }
    }
}

/// An event to publish. `id` and `occurred_at` are `None` when the producer left them to
/// the gateway; an omitted field is not compared when deciding whether a re-publish is
/// identical.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    pub id: Option<Uuid>,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub aggregate_version: Option<i64>,
    pub event_type: String,
    pub payload: Vec<u8>,
    pub content_type: String,
    pub metadata: BTreeMap<String, String>,
    pub occurred_at: Option<DateTime<Utc>>,
    /// Delivered to no subscription before this time.
    pub deliver_at: Option<DateTime<Utc>>,
    /// Delivered to no subscription from this time on.
    pub expires_at: Option<DateTime<Utc>>,
}

impl NewEvent {
    /// Checks every rule the outbox table's constraints also enforce, so bad input is
    /// answered with the field's name instead of a constraint violation.
    pub fn validate(&self, index: usize, limits: &PublishLimits) -> Result<()> {
        let field = |name: &str| format!("events[{index}].{name}");
        check_identifier(&self.aggregate_type, || field("aggregate_type"))?;
        check_identifier(&self.aggregate_id, || field("aggregate_id"))?;
        if let Some(occurred_at) = self.occurred_at {
            check_timestamp(field("occurred_at"), occurred_at)?;
        }
        self.validate_times(limits, Utc::now(), field)?;
        check_event_type(&self.event_type)
            .map_err(|message| Refusal::invalid(field("event_type"), message))?;
        if let Some(version) = self.aggregate_version
            && version < 1
        {
            return Err(Refusal::invalid(
                field("aggregate_version"),
                format!("must be at least 1, got {version}"),
            ));
        }
        if self.content_type.is_empty() || self.content_type.len() > MAX_IDENTIFIER_BYTES {
            return Err(Refusal::invalid(
                field("content_type"),
                format!("must be 1 to {MAX_IDENTIFIER_BYTES} bytes"),
            ));
        }
        // A media type is ASCII; keeping it so makes "is this JSON?" one rule that Rust
        // and PostgreSQL (which lowercases beyond ASCII) cannot answer differently.
        if !self
            .content_type
            .bytes()
            .all(|byte| (0x20..0x7f).contains(&byte))
        {
            return Err(Refusal::invalid(
                field("content_type"),
                "must be printable ASCII, like \"application/json\"",
            ));
        }
        if self.payload.len() > limits.max_payload_bytes {
            return Err(Refusal::invalid(
                field("payload"),
                format!(
                    "is {} bytes, more than the limit of {} bytes",
                    self.payload.len(),
                    limits.max_payload_bytes
                ),
            ));
        }
        if is_json_content_type(&self.content_type)
            && let Err(error) = check_json(&self.payload)
        {
            return Err(Refusal::invalid(
                field("payload"),
                format!(
                    "{error} (content type {:?} requires JSON)",
                    self.content_type
                ),
            ));
        }
        self.validate_metadata(limits, &field("metadata"))
    }

    /// `deliver_at` within the schedule horizon; `expires_at` not before `occurred_at`
    /// (the publish time when unset) and after `deliver_at`, as the table's constraints
    /// also require.
    fn validate_times(
        &self,
        limits: &PublishLimits,
        now: DateTime<Utc>,
        field: impl Fn(&str) -> String,
    ) -> Result<()> {
        if let Some(deliver_at) = self.deliver_at {
            check_timestamp(field("deliver_at"), deliver_at)?;
            let horizon = chrono::Duration::from_std(limits.max_schedule_ahead)
                .ok()
                .and_then(|ahead| now.checked_add_signed(ahead))
                .unwrap_or(DateTime::<Utc>::MAX_UTC);
            if deliver_at > horizon {
                return Err(Refusal::invalid(
                    field("deliver_at"),
                    format!(
                        "must be at most {} ahead (--max-schedule-ahead)",
                        humantime::format_duration(limits.max_schedule_ahead)
                    ),
                ));
            }
        }
        if let Some(expires_at) = self.expires_at {
            check_timestamp(field("expires_at"), expires_at)?;
            if expires_at < self.occurred_at.unwrap_or(now) {
                return Err(Refusal::invalid(
                    field("expires_at"),
                    "must not be before occurred_at (the publish time when unset)",
                ));
            }
            if self
                .deliver_at
                .is_some_and(|deliver_at| expires_at <= deliver_at)
            {
                return Err(Refusal::invalid(
                    field("expires_at"),
                    "must be after deliver_at",
                ));
            }
        }
        Ok(())
    }

    fn validate_metadata(&self, limits: &PublishLimits, field: &str) -> Result<()> {
        if self.metadata.len() > limits.max_metadata_entries {
            return Err(Refusal::invalid(
                field,
                format!(
                    "has {} entries, more than the limit of {}",
                    self.metadata.len(),
                    limits.max_metadata_entries
                ),
            ));
        }
        let mut total_bytes = 0;
        for (key, value) in &self.metadata {
            if key.is_empty() || key.len() > MAX_METADATA_KEY_BYTES {
                return Err(Refusal::invalid(
                    field,
                    format!(
                        "key {} must be 1 to {MAX_METADATA_KEY_BYTES} bytes",
                        Echo(key)
                    ),
                ));
            }
            check_text(format!("{field}[{}]", Echo(key)), value)?;
            if value.len() > MAX_METADATA_VALUE_BYTES {
                return Err(Refusal::invalid(
                    format!("{field}[{}]", Echo(key)),
                    format!(
                        "is {} bytes, more than the limit of {MAX_METADATA_VALUE_BYTES}",
                        value.len()
                    ),
                ));
            }
            check_text(format!("{field} key {}", Echo(key)), key)?;
            total_bytes += key.len() + value.len();
        }
        if total_bytes > limits.max_metadata_bytes {
            return Err(Refusal::invalid(
                field,
                format!(
                    "keys and values total {total_bytes} bytes, more than the limit of {}",
                    limits.max_metadata_bytes
                ),
            ));
        }
        Ok(())
    }

    /// True when `stored` is this event re-published: every field the producer gave is
    /// equal. Trace-context metadata is not part of an event's identity: a retry usually
    /// travels in a new trace.
    pub fn matches_stored(&self, stored: &Event) -> bool {
        fn identity<'a>(
            metadata: impl IntoIterator<Item = (&'a String, &'a String)>,
        ) -> BTreeMap<&'a str, &'a str> {
            metadata
                .into_iter()
                .filter(|(key, _)| !TRACE_CONTEXT_KEYS.contains(&key.as_str()))
                .map(|(key, value)| (key.as_str(), value.as_str()))
                .collect()
        }
        self.id.is_none_or(|id| id == stored.id)
            && self.aggregate_type == stored.aggregate_type
            && self.aggregate_id == stored.aggregate_id
            && self.aggregate_version == stored.aggregate_version
            && self.event_type == stored.event_type
            && self.payload == stored.payload
            && self.content_type == stored.content_type
            && identity(&self.metadata) == identity(&stored.metadata)
            && self
                .occurred_at
                .is_none_or(|occurred_at| occurred_at == stored.occurred_at)
            && self
                .deliver_at
                .is_none_or(|deliver_at| Some(deliver_at) == stored.deliver_at)
            && self
                .expires_at
                .is_none_or(|expires_at| Some(expires_at) == stored.expires_at)
    }
}

/// An event as stored in the outbox.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// The database it was written to.
    pub source: SourceName,
    pub id: Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub aggregate_version: Option<i64>,
    pub event_type: String,
    pub payload: Vec<u8>,
    pub content_type: String,
    /// A `HashMap`, as the protobuf message it goes out in has it: the map moves there
    /// as it is instead of being built again for every delivery.
    pub metadata: HashMap<String, String>,
    pub occurred_at: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
    pub deliver_at: Option<DateTime<Utc>>,
    pub expires_at: Option<DateTime<Utc>>,
    /// The id of the database transaction that wrote it (with its epoch, as
    /// `pg_current_xact_id()`): equal for the events of one transaction.
    pub transaction_id: i64,
}

impl Event {
    /// The metadata by key, as every view of the event lists it (the map has no order).
    pub fn metadata_by_key(&self) -> BTreeMap<&str, &str> {
        self.metadata
            .iter()
            .map(|(key, value)| (key.as_str(), value.as_str()))
            .collect()
    }
}

/// `application/json` and `application/*+json`, parameters ignored; the same rule as the
/// database function `outbox_is_json_content_type`.
pub fn is_json_content_type(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    let Some(subtype) = essence.strip_prefix("application/") else {
        return false;
    };
    if subtype == "json" {
        return true;
    }
    subtype.strip_suffix("+json").is_some_and(|prefix| {
        !prefix.is_empty()
            && prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._+-".contains(&b))
    })
}

/// An event id as the API takes it: a UUID in its canonical text form (lowercase hex,
/// hyphenated 8-4-4-4-12), the form every answer and every stored id has. Other
/// spellings the UUID parser accepts (braces, `urn:uuid:`, no hyphens, upper case) are
/// refused rather than silently rewritten, so an id compares equal as text wherever
/// it travels.
pub fn parse_event_id(field: impl Into<String>, text: &str) -> Result<Uuid> {
    match Uuid::try_parse(text) {
        Ok(id) if id.hyphenated().to_string() == text => Ok(id),
        Ok(id) => Err(Refusal::invalid(
            field,
            format!("{} is not in canonical form; send it as {id}", Echo(text)),
        )),
        Err(_) => Err(Refusal::invalid(
            field,
            format!(
                "{} is not an event id (a UUID in canonical form, like {})",
                Echo(text),
                Uuid::nil()
            ),
        )),
    }
}

/// The aggregate and event type that name events in a lookup (such as RequeueLatest),
/// held to the rules Publish applies, so a value no event can have is refused as the
/// caller's mistake instead of answered "not found".
pub fn check_event_key(aggregate_type: &str, aggregate_id: &str, event_type: &str) -> Result<()> {
    check_identifier(aggregate_type, || "aggregate_type".into())?;
    check_identifier(aggregate_id, || "aggregate_id".into())?;
    check_event_type(event_type).map_err(|message| Refusal::invalid("event_type", message))
}

fn check_identifier(value: &str, field: impl Fn() -> String) -> Result<()> {
    if value.is_empty() {
        return Err(Refusal::invalid(field(), "must not be empty"));
    }
    check_text(field(), value)?;
    if value.len() > MAX_IDENTIFIER_BYTES {
        return Err(Refusal::invalid(
            field(),
            format!("is {} bytes, more than {MAX_IDENTIFIER_BYTES}", value.len()),
        ));
    }
    Ok(())
}

/// Event types are dot-separated segments of `[A-Za-z0-9_-]`, at most 255 bytes.
pub(crate) fn check_event_type(event_type: &str) -> std::result::Result<(), String> {
    if event_type.is_empty() {
        return Err("must not be empty".into());
    }
    if event_type.len() > MAX_IDENTIFIER_BYTES {
        return Err(format!(
            "is {} bytes, more than {MAX_IDENTIFIER_BYTES}",
            event_type.len()
        ));
    }
    let segment_ok = |segment: &str| {
        !segment.is_empty()
            && segment
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    };
    if !event_type.split('.').all(segment_ok) {
        return Err(format!(
            "{} must be dot-separated segments of [A-Za-z0-9_-]",
            Echo(event_type)
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event() -> NewEvent {
        NewEvent {
            id: None,
            aggregate_type: "order".into(),
            aggregate_id: "o-1".into(),
            aggregate_version: Some(1),
            event_type: "order.created".into(),
            payload: br#"{"total": 10}"#.to_vec(),
            content_type: DEFAULT_CONTENT_TYPE.into(),
            metadata: BTreeMap::from([("tenant".into(), "acme".into())]),
            occurred_at: None,
            deliver_at: None,
            expires_at: None,
        }
    }

    fn field_of(result: Result<()>) -> String {
        match result {
            Err(Refusal::Invalid { field, .. }) => field,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn accepts_a_well_formed_event() {
        event().validate(0, &PublishLimits::default()).unwrap();
    }

    #[test]
    fn names_the_field_and_index_of_bad_input() {
        let limits = PublishLimits::default();
        let mut bad = event();
        bad.event_type = "order..created".into();
        assert_eq!(field_of(bad.validate(3, &limits)), "events[3].event_type");

        let mut bad = event();
        bad.aggregate_id = "x".repeat(256);
        assert_eq!(field_of(bad.validate(0, &limits)), "events[0].aggregate_id");

        let mut bad = event();
        bad.payload = b"{not json".to_vec();
        assert_eq!(field_of(bad.validate(1, &limits)), "events[1].payload");

        let mut bad = event();
        bad.aggregate_version = Some(0);
        assert_eq!(
            field_of(bad.validate(0, &limits)),
            "events[0].aggregate_version"
        );

        let mut bad = event();
        bad.metadata.insert(String::new(), "v".into());
        assert_eq!(field_of(bad.validate(0, &limits)), "events[0].metadata");

        let mut longest = event();
        longest
            .metadata
            .insert("tenant".into(), "v".repeat(MAX_METADATA_VALUE_BYTES));
        longest.validate(0, &limits).unwrap();
        let mut bad = longest;
        bad.metadata
            .insert("tenant".into(), "v".repeat(MAX_METADATA_VALUE_BYTES + 1));
        assert_eq!(
            field_of(bad.validate(2, &limits)),
            "events[2].metadata[\"tenant\"]"
        );
    }

    #[test]
    fn schedules_and_expiries_are_checked_against_each_other() {
        let limits = PublishLimits::default();
        let now = Utc::now();
        let hours = chrono::Duration::hours;
        let mut scheduled = event();
        scheduled.deliver_at = Some(now + hours(24 * 89));
        scheduled.expires_at = Some(now + hours(24 * 89 + 1));
        scheduled.validate(0, &limits).unwrap();
        scheduled.deliver_at = Some(now + hours(24 * 91));
        assert_eq!(
            field_of(scheduled.validate(0, &limits)),
            "events[0].deliver_at"
        );

        let mut expiring = event();
        expiring.deliver_at = Some(now + hours(2));
        expiring.expires_at = Some(now + hours(1));
        assert_eq!(
            field_of(expiring.validate(0, &limits)),
            "events[0].expires_at"
        );
        expiring.deliver_at = None;
        expiring.occurred_at = Some(now + hours(3));
        assert_eq!(
            field_of(expiring.validate(0, &limits)),
            "events[0].expires_at"
        );
        expiring.occurred_at = None;
        expiring.expires_at = Some(now - hours(1));
        assert_eq!(
            field_of(expiring.validate(0, &limits)),
            "events[0].expires_at"
        );
    }

    #[test]
    fn non_json_payloads_are_not_parsed() {
        let mut binary = event();
        binary.content_type = "application/octet-stream".into();
        binary.payload = vec![0xff, 0x00];
        binary.validate(0, &PublishLimits::default()).unwrap();
    }

    #[test]
    fn event_ids_are_taken_in_canonical_form_only() {
        let id = Uuid::now_v7();
        assert_eq!(parse_event_id("id", &id.to_string()).unwrap(), id);
        for text in [
            format!("{{{id}}}"),
            format!("urn:uuid:{id}"),
            id.simple().to_string(),
            id.to_string().to_uppercase(),
        ] {
            match parse_event_id("id", &text) {
                Err(Refusal::Invalid { field, message }) => {
                    assert_eq!(field, "id");
                    assert!(message.contains(&id.to_string()), "{message}");
                }
                other => panic!("{text}: {other:?}"),
            }
        }
        assert_eq!(field_of(parse_event_id("id", "nope").map(drop)), "id");
    }

    #[test]
    fn event_keys_follow_the_publish_rules() {
        check_event_key("order", "o-1", "order.created").unwrap();
        let field = |result: Result<()>| field_of(result);
        assert_eq!(field(check_event_key("order", "o-1", "fx.*")), "event_type");
        assert_eq!(field(check_event_key("order", "o-1", "")), "event_type");
        let long = "a".repeat(MAX_IDENTIFIER_BYTES + 1);
        assert_eq!(
            field(check_event_key(&long, "o-1", "order.created")),
            "aggregate_type"
        );
        assert_eq!(
            field(check_event_key("order", &long, "order.created")),
            "aggregate_id"
        );
    }

    #[test]
    fn recognises_json_content_types() {
        assert!(is_json_content_type("application/json"));
        assert!(is_json_content_type("Application/JSON; charset=utf-8"));
        assert!(is_json_content_type("application/vnd.acme.order+json"));
        assert!(!is_json_content_type("application/+json"));
        assert!(!is_json_content_type("text/json"));
        assert!(!is_json_content_type("application/jsonx"));
    }
}
