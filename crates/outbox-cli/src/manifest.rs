//! The subscriptions file of `apply` and `export`: YAML whose top-level `subscriptions`
//! lists subscriptions with the field names of the API's `Subscription` message,
//! durations as text (`30s`, `15m`) and enums by short lowercase names. The same types
//! give the file's JSON Schema (docs/subscriptions.schema.json).
//!
//! A spec holds only what differs from the defaults, so `export` writes short files and
//! two specs compare equal exactly when the subscriptions behave alike.

use std::{collections::BTreeMap, time::Duration};

use chrono::{DateTime, Utc};
use outbox_domain::{
    DEFAULT_PUSH_BATCH_BYTES, DEFAULT_PUSH_CONCURRENCY, DEFAULT_PUSH_TIMEOUT, SinkConfig,
    SubscriptionSettings,
};
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Deserializer, Serialize, Serializer, de::DeserializeSeed};

use outbox_client::proto;

/// A subscriptions file.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(
    deny_unknown_fields,
    expecting = "a mapping with a `subscriptions` list"
)]
#[schemars(
    title = "outbox-gateway subscriptions",
    description = "Subscriptions of an outbox-gateway, as `outbox-gateway apply -f FILE` reads them and `outbox-gateway export` writes them."
)]
pub struct SubscriptionsFile {
    // Required, not empty by default, so that an empty file (what a failed `export >
    // file` leaves) never prunes everything.
    /// The subscriptions; with `apply --prune`, those not listed are deleted. For none, write `subscriptions: []`.
    pub subscriptions: Vec<SubscriptionSpec>,
}

/// One subscription. Omitted settings take their defaults (as on create).
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(
    deny_unknown_fields,
    expecting = "a subscription: a mapping with its `name` and settings"
)]
pub struct SubscriptionSpec {
    /// Unique name: [a-z0-9][a-z0-9._-]{0,127}.
    #[schemars(regex(pattern = r"^[a-z0-9][a-z0-9._-]{0,127}$"))]
    pub name: String,
    /// Event-type patterns (`order.created`, `order.*`, `order.**`); none: every type.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub event_types: Vec<String>,
    /// Exact aggregate types; none: every aggregate type.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aggregate_types: Vec<String>,
    /// Metadata an event must carry with exactly these values.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata_match: BTreeMap<String, String>,
    /// A CEL expression the event must satisfy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter: Option<String>,
    /// A CEL expression whose value (a map or a list) is delivered as the JSON payload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transform: Option<String>,
    /// Where it begins when created: `latest` (the default), `earliest`, or an RFC 3339
    /// time. Only read on create.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<Start>,
    /// Lease length of a delivery [default: 30s].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ack_deadline: Option<Interval>,
    /// Deliveries before an event is dead-lettered; 0 retries forever [default: 10; 0
    /// with a sink].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    /// Smallest retry backoff [default: 1s].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_backoff_min: Option<Interval>,
    /// Largest retry backoff [default: 15m].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_backoff_max: Option<Interval>,
    /// Deliver the events of one aggregate one at a time, in order. Set at creation.
    #[serde(default, skip_serializing_if = "is_false")]
    pub ordered: bool,
    /// Event-type patterns whose events never dead-letter.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub persistent_event_types: Vec<String>,
    /// The source databases it reads; none: every source. Set at creation.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<String>,
    /// Events older than this are not delivered: they expire.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_event_age: Option<Interval>,
    /// Dead-letter expired events instead of dropping them.
    #[serde(default, skip_serializing_if = "is_false")]
    pub dead_letter_expired: bool,
    /// Deleted by the gateway once no stream has read it for this long. Set at creation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expire_after_idle: Option<Interval>,
    /// `true`: hands out nothing new (deliveries already out still settle); `false`: is
    /// resumed. Omitted: paused or not as an operator left it, so that a pause made
    /// during an incident outlives the next apply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused: Option<bool>,
    /// Why it is paused (with `paused: true`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_reason: Option<String>,
    /// When the pause ends by itself (RFC 3339, with `paused: true`); none: when resumed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_until: Option<DateTime<Utc>>,
    /// Push delivery to an HTTP endpoint; cannot be set beside `sink`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub push: Option<PushSpec>,
    /// Publishing into a broker of the gateway's configuration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sink: Option<SinkSpec>,
}

/// Push delivery settings. The signing secret is never in the file: it is printed once,
/// when pushing is turned on.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(
    deny_unknown_fields,
    expecting = "push settings: a mapping with an `endpoint`"
)]
pub struct PushSpec {
    /// http:// or https:// URL; its host must be in the gateway's `[push] allowed_hosts`.
    pub endpoint: String,
    /// Extra headers sent with every request. Values may name environment variables as
    /// `${NAME}`; `export` writes the fingerprint of a stored value ("sha256:" and 12 hex
    /// digits), which `apply` keeps as it is.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// CloudEvents HTTP mode [default: binary].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<PushFormatName>,
    /// How long one request may take [default: 10s].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<Interval>,
    /// Most requests in flight at once [default: 16].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrency: Option<u32>,
    /// Most requests started per second; none: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<f64>,
    /// Most events per request, as a CloudEvents JSON batch [default: 1].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_batch_events: Option<u32>,
    /// Most bytes of events per batch [default: 1048576].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_batch_bytes: Option<u64>,
    /// How long a batch waits for more events once it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_batch_wait: Option<Interval>,
}

/// CloudEvents HTTP mode of push requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum PushFormatName {
    /// Attributes in ce-* headers, the payload as the body.
    Binary,
    /// One application/cloudevents+json document.
    Structured,
}

/// Sink delivery settings.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(
    deny_unknown_fields,
    expecting = "sink settings: a mapping with the sink's `name`"
)]
pub struct SinkSpec {
    /// A sink of the gateway's configuration (`outbox-gateway sinks` lists them).
    pub name: String,
    /// NATS sinks: the subject template, e.g. `orders.{aggregate_type}.{event_type}`;
    /// `{event_type:tokens}` keeps the value's dots as subject tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    /// Kafka sinks: the topic template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topic: Option<String>,
    /// Kafka sinks: the key template [default: `{aggregate_type}/{aggregate_id}`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

fn is_false(value: &bool) -> bool {
    !value
}

/// A duration written as text: `30s`, `15m`, `1h 30m`, `250ms`; at most
/// [`LONGEST_INTERVAL`], so that every one is a duration of the API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interval(pub Duration);

impl Serialize for Interval {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(&humantime::format_duration(self.0))
    }
}

impl<'de> Deserialize<'de> for Interval {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        let duration = humantime::parse_duration(&text).map_err(|error| {
            serde::de::Error::custom(format!(
                "{text:?} is not a duration such as 30s, 15m or 1h 30m: {error}"
            ))
        })?;
        if duration > LONGEST_INTERVAL {
            return Err(serde::de::Error::custom(format!(
                "{text:?} is longer than any setting takes (at most 10000 years)"
            )));
        }
        Ok(Interval(duration))
    }
}

/// The longest duration the API carries (that of `google.protobuf.Duration`, about
/// 10,000 years); a longer one cannot be sent, so the file refuses it instead of
/// leaving the setting unset.
pub const LONGEST_INTERVAL: Duration = Duration::from_secs(315_576_000_000);

impl JsonSchema for Interval {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Duration".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "description": "A duration: numbers with units (ns, us, ms, s, m, h, d), e.g. 30s, 15m, 1h 30m.",
            "pattern": r"^\s*(\d+\s*(nsec|ns|usec|us|msec|ms|seconds|second|sec|s|minutes|minute|min|m|hours|hour|hr|h|days|day|d|weeks|week|w|months|month|M|years|year|y)\s*)+$"
        })
    }
}

/// Where a subscription begins: `latest`, `earliest` or an RFC 3339 time.
#[derive(Debug, Clone, PartialEq)]
pub struct Start(pub proto::StartPosition);

impl Serialize for Start {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use proto::start_position::Position;
        match &self.0.position {
            Some(Position::Boundary(boundary)) if *boundary == proto::Boundary::Earliest as i32 => {
                serializer.serialize_str("earliest")
            }
            Some(Position::Time(time)) => serializer.collect_str(
                &DateTime::from_timestamp(time.seconds, time.nanos.max(0) as u32)
                    .unwrap_or_default()
                    .to_rfc3339(),
            ),
            _ => serializer.serialize_str("latest"),
        }
    }
}

impl<'de> Deserialize<'de> for Start {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        crate::parse_position(&text)
            .map(Start)
            .map_err(serde::de::Error::custom)
    }
}

impl JsonSchema for Start {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Start".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "latest, earliest, or an RFC 3339 time.",
            "anyOf": [
                { "type": "string", "enum": ["latest", "earliest"] },
                {
                    "type": "string",
                    "format": "date-time",
                    "pattern": r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$"
                }
            ]
        })
    }
}

/// The file's JSON Schema, as published in docs/subscriptions.schema.json.
pub fn schema() -> String {
    let schema = schemars::schema_for!(SubscriptionsFile);
    let mut text = serde_json::to_string_pretty(&schema).expect("a schema is JSON");
    text.push('\n');
    text
}

fn duration(value: Option<Interval>) -> Option<prost_types::Duration> {
    // A file's intervals always fit; one built otherwise is sent as the longest
    // duration, which the gateway refuses, rather than as none (the default).
    value.map(|Interval(duration)| {
        prost_types::Duration::try_from(duration).unwrap_or(prost_types::Duration {
            seconds: i64::MAX,
            nanos: 999_999_999,
        })
    })
}

/// A duration of the API; `None` when unset or zero.
fn interval(value: &Option<prost_types::Duration>) -> Option<Interval> {
    let value = value.as_ref()?;
    let duration = Duration::try_from(*value).ok()?;
    (!duration.is_zero()).then_some(Interval(duration))
}

/// The gateway's default `max_attempts`, which a sink subscription's differs from.
fn default_max_attempts(sink: bool) -> u32 {
    if sink {
        SinkConfig::DEFAULT_MAX_ATTEMPTS
    } else {
        SubscriptionSettings::default().max_attempts
    }
}

/// The value unless it is the default.
fn unless<T: PartialEq>(value: T, default: T) -> Option<T> {
    (value != default).then_some(value)
}

fn text(value: &str) -> Option<String> {
    (!value.is_empty()).then(|| value.to_owned())
}

impl SubscriptionSpec {
    /// The subscription to create, defaults filled in so that an update mask naming any
    /// field sets it to what the file says.
    pub fn to_proto(&self) -> proto::Subscription {
        let defaults = SubscriptionSettings::default();
        let or_default = |value: Option<Interval>, default: Duration| {
            duration(Some(value.unwrap_or(Interval(default))))
        };
        proto::Subscription {
            name: self.name.clone(),
            event_types: self.event_types.clone(),
            aggregate_types: self.aggregate_types.clone(),
            metadata_match: self.metadata_match.clone().into_iter().collect(),
            filter: self.filter.clone().unwrap_or_default(),
            transform: self.transform.clone().unwrap_or_default(),
            start: self.start.as_ref().map(|start| start.0),
            ack_deadline: or_default(self.ack_deadline, defaults.ack_deadline),
            max_attempts: Some(
                self.max_attempts
                    .unwrap_or(default_max_attempts(self.sink.is_some())),
            ),
            retry_backoff_min: or_default(self.retry_backoff_min, defaults.retry_backoff_min),
            retry_backoff_max: or_default(self.retry_backoff_max, defaults.retry_backoff_max),
            ordered: self.ordered,
            persistent_event_types: self.persistent_event_types.clone(),
            sources: self.sources.clone(),
            max_event_age: duration(self.max_event_age),
            dead_letter_expired: self.dead_letter_expired,
            expire_after_idle: duration(self.expire_after_idle),
            push: self.push.as_ref().map(|push| proto::PushConfig {
                endpoint: push.endpoint.clone(),
                headers: push.headers.clone().into_iter().collect(),
                format: match push.format {
                    None | Some(PushFormatName::Binary) => proto::PushFormat::CloudeventsBinary,
                    Some(PushFormatName::Structured) => proto::PushFormat::CloudeventsStructured,
                } as i32,
                timeout: duration(push.timeout),
                max_concurrency: push.max_concurrency.unwrap_or(0),
                rate_limit: push.rate_limit,
                max_batch_events: push.max_batch_events.unwrap_or(0),
                max_batch_bytes: push.max_batch_bytes.unwrap_or(0),
                max_batch_wait: duration(push.max_batch_wait),
                signing_secret: String::new(),
            }),
            sink: self.sink.as_ref().map(|sink| proto::SinkConfig {
                name: sink.name.clone(),
                subject: sink.subject.clone().unwrap_or_default(),
                topic: sink.topic.clone().unwrap_or_default(),
                key: sink.key.clone().unwrap_or_default(),
            }),
            ..Default::default()
        }
    }

    /// A subscription as the gateway shows it, defaults left out. Its start is not kept
    /// by the gateway, so it is never written.
    pub fn from_proto(subscription: &proto::Subscription) -> Self {
        let defaults = SubscriptionSettings::default();
        let setting = |value: &Option<prost_types::Duration>, default: Duration| {
            interval(value).and_then(|value| unless(value, Interval(default)))
        };
        SubscriptionSpec {
            name: subscription.name.clone(),
            event_types: subscription.event_types.clone(),
            aggregate_types: subscription.aggregate_types.clone(),
            metadata_match: subscription.metadata_match.clone().into_iter().collect(),
            filter: text(&subscription.filter),
            transform: text(&subscription.transform),
            start: None,
            ack_deadline: setting(&subscription.ack_deadline, defaults.ack_deadline),
            max_attempts: subscription.max_attempts.and_then(|attempts| {
                unless(attempts, default_max_attempts(subscription.sink.is_some()))
            }),
            retry_backoff_min: setting(&subscription.retry_backoff_min, defaults.retry_backoff_min),
            retry_backoff_max: setting(&subscription.retry_backoff_max, defaults.retry_backoff_max),
            ordered: subscription.ordered,
            persistent_event_types: subscription.persistent_event_types.clone(),
            sources: subscription.sources.clone(),
            max_event_age: interval(&subscription.max_event_age),
            dead_letter_expired: subscription.dead_letter_expired,
            expire_after_idle: interval(&subscription.expire_after_idle),
            paused: subscription.paused.then_some(true),
            pause_reason: subscription
                .paused
                .then(|| text(&subscription.pause_reason))
                .flatten(),
            paused_until: subscription.paused_until.as_ref().and_then(|until| {
                DateTime::from_timestamp(until.seconds, until.nanos.max(0) as u32)
            }),
            push: subscription.push.as_ref().map(|push| PushSpec {
                endpoint: push.endpoint.clone(),
                headers: push.headers.clone().into_iter().collect(),
                format: (push.format == proto::PushFormat::CloudeventsStructured as i32)
                    .then_some(PushFormatName::Structured),
                timeout: setting(&push.timeout, DEFAULT_PUSH_TIMEOUT),
                max_concurrency: unless(push.max_concurrency, 0)
                    .and_then(|concurrency| unless(concurrency, DEFAULT_PUSH_CONCURRENCY)),
                rate_limit: push.rate_limit,
                max_batch_events: (push.max_batch_events > 1).then_some(push.max_batch_events),
                max_batch_bytes: unless(push.max_batch_bytes, 0)
                    .and_then(|bytes| unless(bytes, DEFAULT_PUSH_BATCH_BYTES)),
                max_batch_wait: interval(&push.max_batch_wait),
            }),
            sink: subscription.sink.as_ref().map(|sink| SinkSpec {
                name: sink.name.clone(),
                subject: text(&sink.subject),
                topic: text(&sink.topic),
                key: text(&sink.key),
            }),
        }
    }
}

/// Where in the file something is: 1-based, as editors count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Position {
    pub line: usize,
    pub column: usize,
}

/// Something wrong with the file: where, the path of the field
/// (`subscriptions[3].ack_deadline`; empty for the file as a whole), and what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub at: Option<Position>,
    pub path: String,
    pub message: String,
}

impl Problem {
    /// A problem of a field; [`locate`] finds it in the file.
    pub fn of(path: impl Into<String>, message: impl Into<String>) -> Self {
        Problem {
            at: None,
            path: path.into(),
            message: message.into(),
        }
    }

    /// The problem as one line, `FILE:LINE:COLUMN: PATH: MESSAGE`, as compilers and
    /// YAML tools write them, so that editors jump to it.
    pub fn line(&self, file: &str) -> String {
        let at = match self.at {
            Some(Position { line, column }) => format!("{file}:{line}:{column}"),
            None => file.to_owned(),
        };
        match self.path.as_str() {
            "" => format!("{at}: {}", self.message),
            path => format!("{at}: {path}: {}", self.message),
        }
    }
}

/// Deepest nesting of flow collections (`[...]`, `{...}`) read. A subscription needs
/// five levels; the YAML parser's time grows with the square of the nesting (100,000
/// levels took 40 s to refuse), so deeper is refused before parsing.
pub const MAX_NESTING: usize = 64;

/// What a file must hold, said where it does not.
const WHAT_A_FILE_HOLDS: &str = "a subscriptions file is a mapping whose `subscriptions` lists them (`subscriptions: [{name: orders}]`); for none, and with --prune to delete them all, write `subscriptions: []`";

/// Reads a subscriptions file. A file without a `subscriptions` list (empty, only
/// comments, `subscriptions:` without a value) is refused: it is what a failed
/// `export > file` leaves, and applied with --prune it would delete everything.
pub fn parse(text: &str) -> Result<SubscriptionsFile, Problem> {
    if let Some(at) = too_deep(text) {
        return Err(Problem {
            at: Some(at),
            path: String::new(),
            message: format!(
                "nested more than {MAX_NESTING} deep; a subscriptions file needs a few levels"
            ),
        });
    }
    // The shape first, which the typed reading would take for an empty list or say in
    // the words of the types.
    let shape = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(text).ok();
    let missing = |what: &str| Problem::of("", format!("{what}; {WHAT_A_FILE_HOLDS}"));
    match &shape {
        Some(serde_yaml_ng::Value::Null) => {
            return Err(missing(
                "holds no `subscriptions` list (it is empty, or only comments)",
            ));
        }
        Some(serde_yaml_ng::Value::Mapping(mapping)) => match mapping.get("subscriptions") {
            Some(serde_yaml_ng::Value::Null) => {
                return Err(Problem {
                    at: locate(text, "subscriptions"),
                    ..Problem::of(
                        "subscriptions",
                        "has no value; list the subscriptions, or write `subscriptions: []` for none (with --prune: delete them all)",
                    )
                });
            }
            None if mapping.is_empty() => return Err(missing("holds no `subscriptions` list")),
            _ => {}
        },
        Some(other) => {
            let found = match other {
                serde_yaml_ng::Value::Sequence(_) => "a list",
                serde_yaml_ng::Value::String(_) => "text",
                serde_yaml_ng::Value::Number(_) => "a number",
                serde_yaml_ng::Value::Bool(_) => "true or false",
                _ => "a tagged value",
            };
            return Err(Problem {
                at: Some(Position { line: 1, column: 1 }),
                ..missing(&format!("holds {found}, not a mapping"))
            });
        }
        None => {}
    }
    let deserializer = serde_yaml_ng::Deserializer::from_str(text);
    serde_path_to_error::deserialize(deserializer).map_err(|error| {
        let path = match error.path().to_string() {
            root if root == "." => String::new(),
            path => path,
        };
        let error = error.into_inner();
        let marked = error.location().map(|location| Position {
            line: location.line(),
            column: location.column(),
        });
        // The parser marks an error of a field's own checks (a duration) at its entry,
        // and an unknown key at the key; the later of that and where the path leads is
        // the field itself.
        let at = marked.max(locate(text, &path));
        let mut message = error.to_string();
        // The parser ends its messages with the location and starts some with its own
        // path; both are said once, in front.
        if let Some(Position { line, column }) = marked {
            let suffix = format!(" at line {line} column {column}");
            if let Some(bare) = message.strip_suffix(&suffix) {
                message = bare.to_owned();
            }
        }
        // The parser's path is that of the node it stood at: the field's, or its entry's.
        if let Some((start, rest)) = message.split_once(": ")
            && !start.is_empty()
            && !start.contains(' ')
            && path.starts_with(start)
        {
            message = rest.to_owned();
        }
        Problem { at, path, message }
    })
}

/// Where the first flow collection nested deeper than [`MAX_NESTING`] opens, if one
/// does. A cheap scan that skips comments, quoted text and block scalars; a bracket
/// inside plain text may count, which only matters past 64 unclosed ones.
fn too_deep(text: &str) -> Option<Position> {
    let mut depth = 0usize;
    let (mut line, mut column) = (1usize, 0usize);
    let mut indent = 0usize;
    let mut line_start = true;
    // Inside a quoted scalar: its quote character.
    let mut quote: Option<char> = None;
    let mut comment = false;
    // Inside a block scalar (`|`, `>`): the indentation of the line that began it.
    let mut block_scalar: Option<usize> = None;
    let mut skip_line = false;
    let mut previous = '\n';
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        column += 1;
        if c == '\n' {
            (line, column, indent, line_start) = (line + 1, 0, 0, true);
            (comment, skip_line, previous) = (false, false, c);
            continue;
        }
        if line_start {
            if c == ' ' {
                indent += 1;
                continue;
            }
            line_start = false;
            if let Some(parent) = block_scalar {
                match indent > parent {
                    true => skip_line = true,
                    false => block_scalar = None,
                }
            }
        }
        if comment || skip_line {
            continue;
        }
        if let Some(open) = quote {
            match c {
                '\\' if open == '"' => {
                    chars.next();
                    column += 1;
                }
                '\'' if open == '\'' && chars.peek() == Some(&'\'') => {
                    chars.next();
                    column += 1;
                }
                c if c == open => quote = None,
                _ => {}
            }
            previous = c;
            continue;
        }
        let token_start = previous.is_whitespace() || (depth > 0 && "[{,".contains(previous));
        match c {
            '#' if previous.is_whitespace() => comment = true,
            '\'' | '"' if token_start => quote = Some(c),
            '|' | '>' if token_start && depth == 0 => {
                block_scalar = Some(indent);
                skip_line = true;
            }
            '[' | '{' if token_start || depth > 0 => {
                depth += 1;
                if depth > MAX_NESTING {
                    return Some(Position { line, column });
                }
            }
            ']' | '}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        previous = c;
    }
    None
}

/// Where the value at `path` (`subscriptions[3].push.endpoint`) is in the file, or the
/// deepest part of that path the file holds (at least the entry), so that a refusal of
/// the gateway points into the file as the parser's own errors do.
pub fn locate(text: &str, path: &str) -> Option<Position> {
    let steps = steps(path);
    let deserializer = serde_yaml_ng::Deserializer::from_str(text);
    // The walk always ends in an error, which the parser marks with where it stood.
    let error = Seek { steps: &steps }.deserialize(deserializer).err()?;
    error.location().map(|location| Position {
        line: location.line(),
        column: location.column(),
    })
}

/// One step of a field's path: a key, or a list index.
#[derive(Debug, PartialEq)]
enum Step {
    Key(String),
    Index(usize),
}

/// `subscriptions[3].sources[0]` as its steps.
fn steps(path: &str) -> Vec<Step> {
    let mut steps = Vec::new();
    for part in path.split('.').filter(|part| !part.is_empty()) {
        let mut pieces = part.split('[');
        if let Some(key) = pieces.next().filter(|key| !key.is_empty()) {
            steps.push(Step::Key(key.to_owned()));
        }
        for index in pieces {
            match index.trim_end_matches(']').parse() {
                Ok(index) => steps.push(Step::Index(index)),
                Err(_) => return steps,
            }
        }
    }
    steps
}

/// Walks the document along its steps and stops, with an error, where they end or the
/// file does.
struct Seek<'a> {
    steps: &'a [Step],
}

impl<'de> serde::de::DeserializeSeed<'de> for Seek<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Seek<'_> {
    type Value = ();

    fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
        formatter.write_str("the rest of the path")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        if let Some((Step::Key(wanted), rest)) = self.steps.split_first() {
            while let Some(key) = map.next_key::<serde_yaml_ng::Value>()? {
                // Header names are case-insensitive; the gateway names them in lowercase.
                if key
                    .as_str()
                    .is_some_and(|key| key.eq_ignore_ascii_case(wanted))
                {
                    return map.next_value_seed(Seek { steps: rest });
                }
                map.next_value::<serde::de::IgnoredAny>()?;
            }
        }
        Err(serde::de::Error::custom("here"))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        if let Some((Step::Index(wanted), rest)) = self.steps.split_first() {
            for _ in 0..*wanted {
                if seq.next_element::<serde::de::IgnoredAny>()?.is_none() {
                    break;
                }
            }
            seq.next_element_seed(Seek { steps: rest })?;
        }
        Err(serde::de::Error::custom("here"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_published_schema_is_current() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../docs/subscriptions.schema.json"
        );
        let generated = schema();
        if std::env::var_os("OUTBOX_WRITE_SCHEMA").is_some() {
            std::fs::write(path, &generated).expect("write the schema");
        }
        let published = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            published == generated,
            "docs/subscriptions.schema.json is not what the file's types give; write it again with `OUTBOX_WRITE_SCHEMA=1 cargo test -p outbox-cli schema`"
        );
    }

    #[test]
    fn a_spec_survives_the_api_and_back_without_its_defaults() {
        let file: SubscriptionsFile = serde_yaml_ng::from_str(
            r#"
subscriptions:
  - name: billing
    event_types: [order.*]
    metadata_match: {tenant: acme}
    filter: payload.total > 1000.0
    ack_deadline: 1m
    max_attempts: 10
    retry_backoff_max: 15m
    max_event_age: 1h 30m
    push:
      endpoint: https://billing.example/hooks
      format: structured
      timeout: 10s
      max_batch_events: 100
      max_batch_wait: 50ms
"#,
        )
        .expect("a valid file");
        let spec = &file.subscriptions[0];
        let back = SubscriptionSpec::from_proto(&spec.to_proto());
        // The defaults written out (max_attempts 10, 15m, the push timeout) drop out.
        let expected = SubscriptionSpec {
            max_attempts: None,
            retry_backoff_max: None,
            push: spec.push.clone().map(|push| PushSpec {
                timeout: None,
                ..push
            }),
            ..spec.clone()
        };
        assert_eq!(back, expected);
        assert_eq!(
            back.max_event_age,
            Some(Interval(Duration::from_secs(5400)))
        );
        let yaml = serde_yaml_ng::to_string(&back).expect("serializes");
        assert!(yaml.contains("max_event_age: 1h 30m"), "{yaml}");
        assert!(yaml.contains("format: structured"), "{yaml}");
    }

    #[test]
    fn a_sink_subscription_retries_forever_unless_the_file_says_otherwise() {
        let file: SubscriptionsFile = serde_yaml_ng::from_str(
            r#"
subscriptions:
  - name: orders-out
    sink: {name: events-js, subject: "orders.{event_type:tokens}"}
  - name: orders-limited
    max_attempts: 10
    sink: {name: events-js, subject: "orders.{event_type:tokens}"}
"#,
        )
        .expect("a valid file");
        let [unlimited, limited] = &file.subscriptions[..] else {
            panic!("two subscriptions");
        };
        assert_eq!(unlimited.to_proto().max_attempts, Some(0));
        assert_eq!(
            SubscriptionSpec::from_proto(&unlimited.to_proto()),
            *unlimited
        );
        assert_eq!(limited.to_proto().max_attempts, Some(10));
        assert_eq!(SubscriptionSpec::from_proto(&limited.to_proto()), *limited);
    }

    #[test]
    fn unknown_fields_and_bad_durations_are_refused_with_their_path() {
        let refusal = |text: &str| {
            let deserializer = serde_yaml_ng::Deserializer::from_str(text);
            serde_path_to_error::deserialize::<_, SubscriptionsFile>(deserializer)
                .expect_err("refused")
                .path()
                .to_string()
        };
        assert_eq!(
            refusal("subscriptions:\n  - name: a\n  - name: b\n    ack_deadline: soon\n"),
            "subscriptions[1].ack_deadline"
        );
        assert_eq!(
            refusal("subscriptions:\n  - name: a\n    push: {endpoint: x, formt: binary}\n"),
            "subscriptions[0].push.formt"
        );
        assert_eq!(
            refusal("subscriptions:\n  - name: a\n    start: yesterday\n"),
            "subscriptions[0].start"
        );
    }

    #[test]
    fn a_file_without_a_subscriptions_list_is_refused() {
        for empty in ["", "# only a comment\n", "{}", "---\n"] {
            let problem = parse(empty).expect_err(empty);
            assert!(
                problem.message.contains("holds no `subscriptions` list")
                    && problem.message.contains("`subscriptions: []`"),
                "{empty:?}: {problem:?}"
            );
        }
        let unset = parse("# the subscriptions\nsubscriptions:\n").expect_err("no value");
        assert_eq!(unset.path, "subscriptions");
        assert!(unset.message.contains("`subscriptions: []`"), "{unset:?}");
        let list = parse("- name: orders\n").expect_err("a list");
        assert!(
            list.message
                .starts_with("holds a list, not a mapping; a subscriptions file is a mapping"),
            "{list:?}"
        );
        assert!(
            parse("subscriptions: []\n")
                .unwrap()
                .subscriptions
                .is_empty()
        );
    }

    #[test]
    fn refusals_name_no_types_of_the_code() {
        for file in [
            "subscriptions: [5]\n",
            "subscriptions:\n  - name: a\n    push: 5\n",
            "subscriptions:\n  - name: a\n    sink: [x]\n",
        ] {
            let problem = parse(file).expect_err(file);
            assert!(!problem.message.contains("Spec"), "{problem:?}");
            assert!(problem.at.is_some(), "{problem:?}");
        }
    }

    #[test]
    fn durations_beyond_the_api_are_refused() {
        let problem =
            parse("subscriptions:\n  - name: a\n    ack_deadline: 10000000000000000000s\n")
                .expect_err("too long");
        assert_eq!(problem.path, "subscriptions[0].ack_deadline");
        assert_eq!(
            problem.at,
            Some(Position {
                line: 3,
                column: 19
            })
        );
        assert!(
            problem.message.contains("longer than any setting takes"),
            "{problem:?}"
        );
        let longest = "subscriptions:\n  - name: a\n    max_event_age: 315576000000s\n";
        let file = parse(longest).expect("the longest duration of the API");
        assert!(file.subscriptions[0].to_proto().max_event_age.is_some());
    }

    #[test]
    fn deep_nesting_is_refused_at_once() {
        let deep = format!(
            "subscriptions: {}{}\n",
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        let started = std::time::Instant::now();
        let problem = parse(&deep).expect_err("too deep");
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(
            problem.at,
            Some(Position {
                line: 1,
                column: 16 + MAX_NESTING
            })
        );
        assert!(problem.message.contains("nested more than"), "{problem:?}");
        // Brackets and quotes inside text, comments and block scalars are not nesting.
        let text = format!(
            "# {open}\nsubscriptions:\n  - name: a\n    filter: '{open}'\n    transform: |\n      {open}\n      \"\n    pause_reason: \"{open}\"\n",
            open = "[".repeat(200)
        );
        parse(&text).expect("brackets in text");
    }

    #[test]
    fn fields_are_located_in_the_file() {
        let text = "subscriptions:\n  - name: a\n  - name: b\n    push:\n      endpoint: x\n      headers: {Authorization: y}\n    sources: [default, other]\n";
        let at = |path| locate(text, path).map(|at| (at.line, at.column));
        assert_eq!(at("subscriptions[1]"), Some((3, 5)));
        assert_eq!(at("subscriptions[1].push.endpoint"), Some((5, 17)));
        assert_eq!(
            at("subscriptions[1].push.headers.authorization"),
            Some((6, 32))
        );
        assert_eq!(at("subscriptions[1].sources[1]"), Some((7, 24)));
        // What the file does not hold: the deepest part it does.
        assert_eq!(at("subscriptions[1].ack_deadline"), Some((3, 5)));
        assert_eq!(at("subscriptions[0].push.timeout"), Some((2, 5)));
    }
}
