//! Sink subscriptions: the configured broker connection they publish to, and the
//! templates that name each message's NATS subject, or Kafka topic and key.
//!
//! A template is text with placeholders for event fields — `{aggregate_type}`,
//! `{aggregate_id}`, `{event_type}`, `{source}` — and `{{` / `}}` for literal braces.
//! In a subject, `{field:tokens}` keeps the value's dots as token separators
//! (`order.created` → `order.created`) instead of escaping them into one token.
//! A value put into a subject or topic is escaped so it can add no wildcard or empty
//! token and never reach a system subject (docs/sinks.md lists the escapes).

use std::fmt;

use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};

use super::event::Event;
use super::input::Echo;
use super::refusal::{Refusal, Result};

/// Longest template accepted.
const MAX_TEMPLATE_BYTES: usize = 1024;
/// Longest NATS subject sent: far below the server's control-line limit (4 KiB by
/// default), which a longer one would break the connection on.
const MAX_SUBJECT_BYTES: usize = 2048;
/// Longest Kafka topic name the broker accepts.
const MAX_TOPIC_BYTES: usize = 249;
/// Default Kafka key: one aggregate's events go to one partition, in order.
pub const DEFAULT_KAFKA_KEY: &str = "{aggregate_type}/{aggregate_id}";

/// Characters a value cannot carry into a NATS subject: token separators and
/// wildcards, whitespace and control characters, `$` (system subjects begin with it),
/// `%` (the escape itself) and everything outside ASCII.
const SUBJECT_VALUE_ESCAPES: &AsciiSet = &CONTROLS
    .add(b' ')
    .add(b'.')
    .add(b'*')
    .add(b'>')
    .add(b'$')
    .add(b'%');

/// What a placeholder's value becomes in a subject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    /// `{field}`: one token, its dots escaped.
    Token,
    /// `{field:tokens}`: split on its dots into tokens, each escaped as [`Form::Token`],
    /// so subscribers can match its parts with `*` (`orders.order.*`).
    Tokens,
}

/// The suffix that asks for [`Form::Tokens`].
const TOKENS_SUFFIX: &str = ":tokens";

/// Whether a subject beginning with `first_token` is one the server or clients reserve
/// for replies: request-reply inboxes (`_INBOX.…`, and the `_INBOX_…` prefixes clients
/// are commonly given instead), the server's service-import replies (`_R_.…`) and its
/// gateway replies (`_GR_.…`). A sink publishing there would answer someone's request.
/// (`$…` subjects cannot be reached: a value's `$` is always escaped.)
fn is_reply_token(first_token: &str) -> bool {
    first_token.starts_with("_INBOX") || first_token == "_R_" || first_token == "_GR_"
}

/// Appends `value` to a subject as one token: escaped, and `_` when empty (a subject has
/// no empty tokens).
fn push_subject_token(value: &str, out: &mut String) {
    if value.is_empty() {
        out.push('_');
    } else {
        out.extend(utf8_percent_encode(value, SUBJECT_VALUE_ESCAPES));
    }
}

/// The broker protocol of a configured sink.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SinkKind {
    /// NATS JetStream.
    Nats,
    /// Kafka, or a broker speaking its protocol.
    Kafka,
}

impl SinkKind {
    pub fn as_str(self) -> &'static str {
        match self {
            SinkKind::Nats => "nats",
            SinkKind::Kafka => "kafka",
        }
    }
}

impl fmt::Display for SinkKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An event field a template can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EventField {
    AggregateType,
    AggregateId,
    EventType,
    Source,
}

impl EventField {
    const ALL: [(&'static str, EventField); 4] = [
        ("aggregate_type", EventField::AggregateType),
        ("aggregate_id", EventField::AggregateId),
        ("event_type", EventField::EventType),
        ("source", EventField::Source),
    ];

    fn value(self, event: &Event) -> &str {
        match self {
            EventField::AggregateType => &event.aggregate_type,
            EventField::AggregateId => &event.aggregate_id,
            EventField::EventType => &event.event_type,
            EventField::Source => event.source.as_str(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Text(String),
    Field(EventField, Form),
}

/// A parsed template, kept with the text it was written as.
#[derive(Clone, PartialEq, Eq)]
pub struct Template {
    text: String,
    parts: Vec<Part>,
}

impl fmt::Debug for Template {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.text, f)
    }
}

impl Template {
    /// Parses the template given in the request field `field`.
    pub fn parse(field: &str, text: &str) -> Result<Template> {
        let refuse = |message: String| Err(Refusal::invalid(field, message));
        if text.len() > MAX_TEMPLATE_BYTES {
            return refuse(format!("must be at most {MAX_TEMPLATE_BYTES} bytes"));
        }
        if let Some(c) = text.chars().find(|c| c.is_control()) {
            return refuse(format!("must not contain control characters, found {c:?}"));
        }
        let mut parts = Vec::new();
        let mut literal = String::new();
        let mut rest = text;
        while let Some(c) = rest.chars().next() {
            if let Some(after) = rest.strip_prefix("{{") {
                literal.push('{');
                rest = after;
            } else if let Some(after) = rest.strip_prefix("}}") {
                literal.push('}');
                rest = after;
            } else if c == '{' {
                let Some(end) = rest.find('}') else {
                    return refuse(format!(
                        "{} has a `{{` without its `}}` (write `{{{{` for a literal brace)",
                        Echo(text)
                    ));
                };
                let placeholder = &rest[1..end];
                let (name, form) = match placeholder.strip_suffix(TOKENS_SUFFIX) {
                    Some(name) => (name, Form::Tokens),
                    None => (placeholder, Form::Token),
                };
                let Some((_, field_name)) =
                    EventField::ALL.iter().find(|(known, _)| *known == name)
                else {
                    return refuse(format!(
                        "{} is not a field a template can name; use {{aggregate_type}}, {{aggregate_id}}, {{event_type}} or {{source}} (in a subject, {{event_type:tokens}} and the like keep the value's dots as tokens)",
                        Echo(&rest[..=end])
                    ));
                };
                if !literal.is_empty() {
                    parts.push(Part::Text(std::mem::take(&mut literal)));
                }
                parts.push(Part::Field(*field_name, form));
                rest = &rest[end + 1..];
            } else if c == '}' {
                return refuse(format!(
                    "{} has a `}}` without its `{{` (write `}}}}` for a literal brace)",
                    Echo(text)
                ));
            } else {
                literal.push(c);
                rest = &rest[c.len_utf8()..];
            }
        }
        if !literal.is_empty() {
            parts.push(Part::Text(literal));
        }
        Ok(Template {
            text: text.to_owned(),
            parts,
        })
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The template filled in from `event`, each value passed through `escape` with the
    /// form its placeholder asks for.
    fn render(&self, event: &Event, escape: impl Fn(&str, Form, &mut String)) -> String {
        let mut rendered = String::new();
        for part in &self.parts {
            match part {
                Part::Text(text) => rendered.push_str(text),
                Part::Field(field, form) => escape(field.value(event), *form, &mut rendered),
            }
        }
        rendered
    }

    /// Whether a placeholder asks for [`Form::Tokens`]: only a subject has tokens.
    fn has_tokens_form(&self) -> bool {
        self.parts
            .iter()
            .any(|part| matches!(part, Part::Field(_, Form::Tokens)))
    }

    /// The template with every field standing for `value`, unescaped: what its literal
    /// parts make of a subject or topic.
    fn sample(&self, value: &str) -> String {
        let mut sample = String::new();
        for part in &self.parts {
            match part {
                Part::Text(text) => sample.push_str(text),
                Part::Field(..) => sample.push_str(value),
            }
        }
        sample
    }

    /// The NATS subject of `event`; an error when it would be too long, or a reply
    /// subject that escaping cannot avoid.
    pub fn subject(&self, event: &Event) -> std::result::Result<String, String> {
        let mut subject = self.render(event, |value, form, out| match form {
            Form::Token => push_subject_token(value, out),
            Form::Tokens => {
                for (index, token) in value.split('.').enumerate() {
                    if index > 0 {
                        out.push('.');
                    }
                    push_subject_token(token, out);
                }
            }
        });
        let first_token = subject.split('.').next().unwrap_or_default();
        if is_reply_token(first_token) {
            // A first token of literal text alone is refused at creation: a value made
            // this one.
            if matches!(self.parts.first(), Some(Part::Field(..))) {
                // The `_` is the value's: escaped, the event lands beside its peers
                // instead of in someone's inbox.
                subject.replace_range(..1, "%5F");
            } else {
                // The `_` is the template's own (`_{aggregate_type}.…`), and the value
                // completed it: no escape of the value keeps the subject recognisable.
                return Err(format!(
                    "the subject would be {}, a reply subject (_INBOX…, _R_, _GR_) a sink never publishes to",
                    Echo(&subject)
                ));
            }
        }
        if subject.len() > MAX_SUBJECT_BYTES {
            return Err(format!(
                "the subject would be {} bytes, more than the {MAX_SUBJECT_BYTES} a subject may have",
                subject.len()
            ));
        }
        Ok(subject)
    }

    /// The Kafka topic of `event`; an error when it would not be a valid topic name.
    pub fn topic(&self, event: &Event) -> std::result::Result<String, String> {
        let topic = self.render(event, |value, _, out| {
            out.extend(
                value
                    .chars()
                    .map(|c| if is_topic_char(c) { c } else { '_' }),
            );
        });
        if topic.is_empty() || topic == "." || topic == ".." || topic.len() > MAX_TOPIC_BYTES {
            return Err(format!(
                "the topic would be {}, not a valid topic name (1 to {MAX_TOPIC_BYTES} of [A-Za-z0-9._-], not . or ..)",
                Echo(&topic)
            ));
        }
        Ok(topic)
    }

    /// The Kafka key of `event`: the values as they are.
    pub fn key(&self, event: &Event) -> String {
        self.render(event, |value, _, out| out.push_str(value))
    }

    /// Refuses a template whose literal parts could not make a subject one publishes
    /// to: empty tokens, wildcards, whitespace, or a system or reply subject (`$…`,
    /// `_INBOX.…`, `_R_.…`, `_GR_.…`).
    fn check_subject(&self, field: &str) -> Result<()> {
        let sample = self.sample("x");
        let refuse = |message: String| Err(Refusal::invalid(field, message));
        if sample.is_empty() {
            return refuse("must not be empty".into());
        }
        if let Some(c) = sample
            .chars()
            .find(|c| c.is_whitespace() || matches!(c, '*' | '>'))
        {
            return refuse(format!(
                "{} contains {c:?}: a subject published to has no wildcards or whitespace",
                Echo(&self.text)
            ));
        }
        if sample.split('.').any(str::is_empty) {
            return refuse(format!(
                "{} has an empty token: a subject is dot-separated tokens, none empty",
                Echo(&self.text)
            ));
        }
        let first_token = sample.split('.').next().unwrap_or_default();
        if sample.starts_with('$') || is_reply_token(first_token) {
            return refuse(format!(
                "{} is a system subject ($…, _INBOX…, _R_.… or _GR_.…), which a sink must not publish to",
                Echo(&self.text)
            ));
        }
        Ok(())
    }

    /// Refuses a template whose literal parts hold characters a topic name cannot, or
    /// that can only make `.` or `..` (names Kafka reserves).
    fn check_topic(&self, field: &str) -> Result<()> {
        let sample = self.sample("x");
        if sample.is_empty() {
            return Err(Refusal::invalid(field, "must not be empty"));
        }
        // A placeholder makes the sample longer than its literal text, so only a
        // template without one can be `.` or `..`, and then every topic it makes is.
        if sample == "." || sample == ".." {
            return Err(Refusal::invalid(
                field,
                format!("{} is not a valid topic name", Echo(&self.text)),
            ));
        }
        if let Some(c) = sample.chars().find(|c| !is_topic_char(*c)) {
            return Err(Refusal::invalid(
                field,
                format!(
                    "{} contains {c:?}: a topic name holds only [A-Za-z0-9._-]",
                    Echo(&self.text)
                ),
            ));
        }
        if sample.len() > MAX_TOPIC_BYTES {
            return Err(Refusal::invalid(
                field,
                format!("must make topic names of at most {MAX_TOPIC_BYTES} bytes"),
            ));
        }
        Ok(())
    }
}

fn is_topic_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')
}

/// Where a sink subscription publishes: a sink of the gateway's configuration, and how
/// each event's subject (NATS) or topic and key (Kafka) are made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SinkConfig {
    /// Name of a `[[sinks]]` entry of the gateway's configuration.
    pub name: String,
    pub subject: Option<Template>,
    pub topic: Option<Template>,
    /// `None`: [`DEFAULT_KAFKA_KEY`].
    pub key: Option<Template>,
}

/// Sink settings as a request gives them: empty strings are unset.
#[derive(Debug, Default)]
pub struct SinkInput {
    pub name: String,
    pub subject: String,
    pub topic: String,
    pub key: String,
}

impl SinkConfig {
    /// `max_attempts` of a sink subscription whose request sets none: unlimited. A sink
    /// dead-letters what the broker refuses for good at once, whatever the attempts; what
    /// it retries is the broker being unreachable or slow, the event not at fault, and
    /// an outage longer than the backoff series must not dead-letter every event of it.
    pub const DEFAULT_MAX_ATTEMPTS: u32 = 0;

    /// Validates the shape of the sink settings in the request field `prefix`
    /// (`subscription.sink`); whether they fit the named sink is [`SinkConfig::check_kind`].
    pub fn parse(prefix: &str, input: SinkInput) -> Result<SinkConfig> {
        let field = |name: &str| format!("{prefix}.{name}");
        if input.name.is_empty() {
            return Err(Refusal::invalid(
                field("name"),
                "is required: the name of a sink of the gateway's configuration",
            ));
        }
        let template = |name: &str, text: &str| {
            (!text.is_empty())
                .then(|| Template::parse(&field(name), text))
                .transpose()
        };
        Ok(SinkConfig {
            subject: template("subject", &input.subject)?,
            topic: template("topic", &input.topic)?,
            key: template("key", &input.key)?,
            name: input.name,
        })
    }

    /// Checks that the settings are those of a sink of `kind`: a NATS sink needs a
    /// subject, a Kafka sink a topic, and neither takes the other's.
    pub fn check_kind(&self, prefix: &str, kind: SinkKind) -> Result<()> {
        let field = |name: &str| format!("{prefix}.{name}");
        let foreign = |name: &str, wanted: &str| {
            Err(Refusal::invalid(
                field(name),
                format!(
                    "does not apply to sink {:?}, a {kind} sink: set {wanted}",
                    self.name
                ),
            ))
        };
        match kind {
            SinkKind::Nats => {
                if self.topic.is_some() {
                    return foreign("topic", "subject");
                }
                if self.key.is_some() {
                    return foreign("key", "subject");
                }
                match &self.subject {
                    Some(subject) => subject.check_subject(&field("subject")),
                    None => Err(Refusal::invalid(
                        field("subject"),
                        format!("is required by sink {:?}, a nats sink", self.name),
                    )),
                }
            }
            SinkKind::Kafka => {
                if self.subject.is_some() {
                    return foreign("subject", "topic");
                }
                for (name, template) in [("topic", &self.topic), ("key", &self.key)] {
                    if template.as_ref().is_some_and(Template::has_tokens_form) {
                        return Err(Refusal::invalid(
                            field(name),
                            format!(
                                "{TOKENS_SUFFIX} splits a value into subject tokens, which a kafka sink has none of"
                            ),
                        ));
                    }
                }
                match &self.topic {
                    Some(topic) => topic.check_topic(&field("topic")),
                    None => Err(Refusal::invalid(
                        field("topic"),
                        format!("is required by sink {:?}, a kafka sink", self.name),
                    )),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SourceName;

    fn event(aggregate_id: &str, event_type: &str) -> Event {
        Event {
            source: SourceName::default_source(),
            id: uuid::Uuid::nil(),
            aggregate_type: "order line".into(),
            aggregate_id: aggregate_id.into(),
            aggregate_version: None,
            event_type: event_type.into(),
            payload: Vec::new(),
            content_type: "application/json".into(),
            deliver_at: None,
            expires_at: None,
            transaction_id: 1,
            metadata: Default::default(),
            occurred_at: chrono::Utc::now(),
            created_at: chrono::Utc::now(),
        }
    }

    fn template(text: &str) -> Template {
        Template::parse("subscription.sink.subject", text).unwrap()
    }

    #[test]
    fn subjects_escape_what_would_add_tokens_or_reach_system_subjects() {
        let subject = template("orders.{aggregate_type}.{event_type}.{aggregate_id}");
        assert_eq!(
            subject
                .subject(&event("a.b*c>d$e%f", "order.created"))
                .unwrap(),
            "orders.order%20line.order%2Ecreated.a%2Eb%2Ac%3Ed%24e%25f"
        );
        assert_eq!(
            subject.subject(&event("", "x")).unwrap(),
            "orders.order%20line.x._"
        );
        assert_eq!(template("{source}.{{literal}}").sample("s"), "s.{literal}");
        let long = "x".repeat(MAX_SUBJECT_BYTES);
        assert!(subject.subject(&event(&long, "x")).is_err());
    }

    #[test]
    fn a_value_never_makes_a_reply_subject() {
        let subject = template("{aggregate_type}.{aggregate_id}");
        let with_type = |aggregate_type: &str| {
            let mut event = event("o-1", "x");
            event.aggregate_type = aggregate_type.into();
            subject.subject(&event)
        };
        assert_eq!(with_type("_INBOX").unwrap(), "%5FINBOX.o-1");
        assert_eq!(with_type("_INBOX_app").unwrap(), "%5FINBOX_app.o-1");
        assert_eq!(with_type("_R_").unwrap(), "%5FR_.o-1");
        assert_eq!(with_type("_GR_").unwrap(), "%5FGR_.o-1");
        assert_eq!(with_type("$JS").unwrap(), "%24JS.o-1");
        // Only a reply subject is escaped: other values keep their `_`.
        assert_eq!(with_type("_orders").unwrap(), "_orders.o-1");
        assert_eq!(with_type("").unwrap(), "_.o-1");
        // Nor can two values, or an empty one's `_`, spell it together.
        let joined = template("{aggregate_type}{aggregate_id}.x");
        let mut event = event("INBOX", "x");
        event.aggregate_type = String::new();
        assert_eq!(joined.subject(&event).unwrap(), "%5FINBOX.x");
        event.aggregate_type = "_IN".into();
        event.aggregate_id = "BOX".into();
        assert_eq!(joined.subject(&event).unwrap(), "%5FINBOX.x");
        // The first of a value's tokens is escaped alike.
        let tokens = template("{event_type:tokens}");
        assert_eq!(
            tokens.subject(&event).unwrap(),
            "x",
            "a plain value is unchanged"
        );
        let mut reply = event.clone();
        reply.event_type = "_INBOX.abc".into();
        assert_eq!(tokens.subject(&reply).unwrap(), "%5FINBOX.abc");
        // The template's own `_` completed by a value cannot be escaped: not sent.
        let completed = template("_{aggregate_type}.x");
        reply.aggregate_type = "INBOX".into();
        let refused = completed.subject(&reply).unwrap_err();
        assert!(refused.contains("reply subject"), "{refused}");
        reply.aggregate_type = "orders".into();
        assert_eq!(completed.subject(&reply).unwrap(), "_orders.x");
    }

    #[test]
    fn a_tokens_placeholder_keeps_the_dots_as_tokens_and_escapes_each() {
        let subject = template("orders.{event_type:tokens}.{aggregate_id}");
        let tokens = |event_type: &str| subject.subject(&event("o.1", event_type)).unwrap();
        assert_eq!(tokens("order.created"), "orders.order.created.o%2E1");
        assert_eq!(tokens("order"), "orders.order.o%2E1");
        // No token of a value can be a wildcard, a system prefix, or empty.
        assert_eq!(tokens("a.*.>"), "orders.a.%2A.%3E.o%2E1");
        assert_eq!(tokens("$x.b c"), "orders.%24x.b%20c.o%2E1");
        assert_eq!(tokens("a..b."), "orders.a._.b._.o%2E1");
        assert_eq!(tokens("."), "orders._._.o%2E1");
        assert_eq!(tokens(""), "orders._.o%2E1");
        for name in ["aggregate_type", "aggregate_id", "source"] {
            Template::parse("f", &format!("a.{{{name}:tokens}}")).unwrap();
        }
        let long = "x.".repeat(MAX_SUBJECT_BYTES / 2);
        assert!(subject.subject(&event("1", &long)).is_err());
    }

    #[test]
    fn topics_and_keys() {
        let topic = template("orders-{aggregate_type}");
        assert_eq!(topic.topic(&event("1", "x")).unwrap(), "orders-order_line");
        assert!(template("{aggregate_id}").topic(&event("..", "x")).is_err());
        assert_eq!(
            template(DEFAULT_KAFKA_KEY).key(&event("o/1", "x")),
            "order line/o/1"
        );
    }

    #[test]
    fn bad_templates_are_refused_with_the_reason() {
        let refused = |text: &str| match Template::parse("f", text) {
            Err(Refusal::Invalid { field, message }) => {
                assert_eq!(field, "f");
                message
            }
            other => panic!("{text}: {other:?}"),
        };
        assert!(refused("a.{nope}").contains("\"{nope}\" is not a field"));
        assert!(refused("a.{event_type").contains("without its `}`"));
        assert!(refused("a}").contains("without its `{`"));
        assert!(refused("a\nb").contains("control"));
        assert!(refused("a.{event_type:token}").contains("is not a field"));
        assert!(refused("a.{event_type:}").contains("is not a field"));
        let subject_refusal = |text: &str| {
            let config = SinkConfig {
                name: "js".into(),
                subject: Some(template(text)),
                topic: None,
                key: None,
            };
            match config.check_kind("subscription.sink", SinkKind::Nats) {
                Err(Refusal::Invalid { field, message }) => {
                    assert_eq!(field, "subscription.sink.subject");
                    message
                }
                other => panic!("{text}: {other:?}"),
            }
        };
        assert!(subject_refusal("orders.*").contains("wildcards"));
        assert!(subject_refusal("orders..x").contains("empty token"));
        assert!(subject_refusal("$JS.API.STREAM.DELETE.{aggregate_id}").contains("system"));
        assert!(subject_refusal("_INBOX.x").contains("system"));
        assert!(subject_refusal("_INBOX_app.{aggregate_id}").contains("system"));
        assert!(subject_refusal("_R_.{aggregate_id}").contains("system"));
        assert!(subject_refusal("_GR_.x").contains("system"));
        let config = SinkConfig {
            name: "js".into(),
            subject: None,
            topic: Some(template("orders")),
            key: None,
        };
        assert!(config.check_kind("s", SinkKind::Nats).is_err());
        assert!(config.check_kind("s", SinkKind::Kafka).is_ok());
        let bad_topic = SinkConfig {
            topic: Some(template("orders/{event_type}")),
            ..config
        };
        assert!(bad_topic.check_kind("s", SinkKind::Kafka).is_err());
    }

    /// The refusal of `config` on a Kafka sink: its field and message.
    fn kafka_refusal(config: SinkConfig) -> (String, String) {
        match config.check_kind("subscription.sink", SinkKind::Kafka) {
            Err(Refusal::Invalid { field, message }) => (field, message),
            other => panic!("{config:?}: {other:?}"),
        }
    }

    fn kafka_config(topic: &str, key: Option<&str>) -> SinkConfig {
        SinkConfig {
            name: "kafka".into(),
            subject: None,
            topic: Some(template(topic)),
            key: key.map(template),
        }
    }

    #[test]
    fn topics_that_can_only_be_dot_or_dot_dot_are_refused_at_creation() {
        for topic in [".", ".."] {
            let (field, message) = kafka_refusal(kafka_config(topic, None));
            assert_eq!(field, "subscription.sink.topic");
            assert!(message.contains("not a valid topic name"), "{message}");
        }
        // With a placeholder, a value makes it a name: sent, or dead-lettered when not.
        for topic in ["...", ".{aggregate_type}", "{aggregate_type}", ".-"] {
            assert!(
                kafka_config(topic, None)
                    .check_kind("s", SinkKind::Kafka)
                    .is_ok(),
                "{topic}"
            );
        }
    }

    #[test]
    fn a_kafka_sink_has_no_tokens_to_split_into() {
        let (field, message) = kafka_refusal(kafka_config("orders.{event_type:tokens}", None));
        assert_eq!(field, "subscription.sink.topic");
        assert!(message.contains(":tokens"), "{message}");
        let (field, _) = kafka_refusal(kafka_config("orders", Some("{aggregate_id:tokens}")));
        assert_eq!(field, "subscription.sink.key");
    }
}
