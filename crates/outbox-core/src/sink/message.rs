//! What one message into a broker carries (also in docs/sinks.md). Pure: no I/O, so it
//! is tested on its own.
//!
//! - NATS: the subject from the subscription's template; `Nats-Msg-Id` = the event id
//!   and the subscription's name, so JetStream's duplicate window drops a re-send of one
//!   subscription's delivery but keeps what two subscriptions publish of one event into
//!   the same stream; the CloudEvents attributes in `ce-` headers (the NATS binding's
//!   binary mode) and `content-type`.
//! - Kafka: the topic and key from their templates; the attributes in `ce_` headers (the
//!   Kafka binding's binary mode) and `content-type`.
//! - Both: `traceparent` / `tracestate`, and `outbox-event-id`, `outbox-source`,
//!   `outbox-aggregate-type`, `outbox-aggregate-id` and `outbox-metadata` (the whole
//!   metadata as a JSON object: keys that are no CloudEvents attribute name are kept
//!   too), with the payload as published as the body.

use std::{borrow::Cow, sync::LazyLock};

use crate::{
    domain::{DEFAULT_KAFKA_KEY, Event, SinkConfig, SinkKind, SubscriptionName, Template},
    push::request::{HeaderPrefix, binary_attributes, trace_headers},
};

/// The Kafka key when a subscription sets none, parsed once.
static DEFAULT_KEY: LazyLock<Template> = LazyLock::new(|| {
    Template::parse("key", DEFAULT_KAFKA_KEY).expect("the default key is a template")
});

/// One message, before the broker client adds its own framing.
#[derive(Debug, Clone, PartialEq)]
pub struct SinkMessage {
    /// The NATS subject or the Kafka topic.
    pub destination: String,
    /// The Kafka key; `None` for NATS.
    pub key: Option<String>,
    /// Names are mostly fixed: borrowed, so a message allocates only its values.
    pub headers: Vec<(Cow<'static, str>, String)>,
    pub payload: Vec<u8>,
}

/// The message for `event` of `subscription`; an error (the event can never be sent) when
/// its subject or topic would be invalid.
pub fn build(
    event: &Event,
    subscription: &SubscriptionName,
    config: &SinkConfig,
    kind: SinkKind,
) -> Result<SinkMessage, String> {
    let missing = |what: &str| format!("the subscription's sink has no {what}");
    let (destination, key, prefix) = match kind {
        SinkKind::Nats => {
            let subject = config.subject.as_ref().ok_or_else(|| missing("subject"))?;
            (subject.subject(event)?, None, HeaderPrefix::Dash)
        }
        SinkKind::Kafka => {
            let topic = config.topic.as_ref().ok_or_else(|| missing("topic"))?;
            let key = config.key.as_ref().unwrap_or(&DEFAULT_KEY).key(event);
            (topic.topic(event)?, Some(key), HeaderPrefix::Underscore)
        }
    };
    let mut headers = binary_attributes(event, prefix);
    let id = headers[1].1.clone();
    let fixed = |name: &'static str, value: String| (Cow::Borrowed(name), value);
    if kind == SinkKind::Nats {
        headers.push(fixed("Nats-Msg-Id", nats_msg_id(&id, subscription)));
    }
    headers.push(fixed("content-type", event.content_type.clone()));
    for (name, value) in trace_headers(event) {
        headers.push(fixed(name, value.clone()));
    }
    headers.push(fixed("outbox-event-id", id));
    headers.push(fixed("outbox-source", event.source.as_str().to_owned()));
    headers.push(fixed(
        "outbox-aggregate-type",
        escape_header(&event.aggregate_type),
    ));
    headers.push(fixed(
        "outbox-aggregate-id",
        escape_header(&event.aggregate_id),
    ));
    if !event.metadata.is_empty() {
        headers.push(fixed(
            "outbox-metadata",
            serde_json::to_string(&event.metadata_by_key()).expect("a map of strings serializes"),
        ));
    }
    Ok(SinkMessage {
        destination,
        key,
        headers,
        payload: event.payload.clone(),
    })
}

/// `<event id>/<subscription>`: stable across re-sends of one subscription's delivery,
/// and different for each subscription (a name never holds `/`).
fn nats_msg_id(event_id: &str, subscription: &SubscriptionName) -> String {
    format!("{event_id}/{subscription}")
}

/// A value as a header can carry it: line breaks and other control characters (which
/// would end a NATS header line) as JSON escapes them; anything else as it is.
fn escape_header(value: &str) -> String {
    if value.chars().any(char::is_control) {
        let quoted = serde_json::to_string(value).expect("a string serializes");
        quoted[1..quoted.len() - 1].to_owned()
    } else {
        value.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::SourceName;

    fn event() -> Event {
        Event {
            source: SourceName::default_source(),
            id: uuid::Uuid::from_u128(7),
            aggregate_type: "order".into(),
            aggregate_id: "o-1\nx".into(),
            aggregate_version: Some(2),
            event_type: "order.created".into(),
            payload: br#"{"total":3}"#.to_vec(),
            content_type: "application/json".into(),
            deliver_at: None,
            expires_at: None,
            transaction_id: 1,
            metadata: [
                ("tenant".to_owned(), "acme".to_owned()),
                ("Not An Attribute".to_owned(), "kept".to_owned()),
                ("traceparent".to_owned(), "00-abc-def-01".to_owned()),
            ]
            .into(),
            occurred_at: chrono::DateTime::from_timestamp(1_700_000_000, 0).unwrap(),
            created_at: chrono::DateTime::from_timestamp(1_700_000_001, 0).unwrap(),
        }
    }

    fn header<'a>(message: &'a SinkMessage, name: &str) -> Option<&'a str> {
        message
            .headers
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }

    fn config(subject: Option<&str>, topic: Option<&str>) -> SinkConfig {
        let template = |text: &str| Template::parse("t", text).unwrap();
        SinkConfig {
            name: "out".into(),
            subject: subject.map(template),
            topic: topic.map(template),
            key: None,
        }
    }

    fn subscription(name: &str) -> SubscriptionName {
        SubscriptionName::parse("name", name).unwrap()
    }

    #[test]
    fn two_subscriptions_publish_one_event_under_two_msg_ids_and_a_re_send_under_the_same() {
        let nats = config(Some("orders.{aggregate_type}"), None);
        let msg_id = |name: &str| {
            let message = build(&event(), &subscription(name), &nats, SinkKind::Nats).unwrap();
            header(&message, "Nats-Msg-Id").unwrap().to_owned()
        };
        assert_ne!(msg_id("audit"), msg_id("billing"));
        assert_eq!(msg_id("audit"), msg_id("audit"));
    }

    #[test]
    fn nats_messages_carry_the_msg_id_and_cloudevents_headers() {
        let message = build(
            &event(),
            &subscription("orders-out"),
            &config(Some("orders.{aggregate_type}.{event_type}"), None),
            SinkKind::Nats,
        )
        .unwrap();
        assert_eq!(message.destination, "orders.order.order%2Ecreated");
        assert_eq!(message.key, None);
        let id = uuid::Uuid::from_u128(7).to_string();
        assert_eq!(
            header(&message, "Nats-Msg-Id"),
            Some(format!("{id}/orders-out").as_str())
        );
        assert_eq!(header(&message, "ce-id"), Some(id.as_str()));
        assert_eq!(header(&message, "ce-type"), Some("order.created"));
        assert_eq!(header(&message, "ce-subject"), Some("o-1%0Ax"));
        assert_eq!(header(&message, "ce-tenant"), Some("acme"));
        assert_eq!(header(&message, "ce-aggregateversion"), Some("2"));
        assert_eq!(header(&message, "ce-transactionid"), Some("1"));
        assert_eq!(header(&message, "traceparent"), Some("00-abc-def-01"));
        assert_eq!(header(&message, "content-type"), Some("application/json"));
        assert_eq!(header(&message, "outbox-aggregate-id"), Some("o-1\\nx"));
        let metadata: serde_json::Value =
            serde_json::from_str(header(&message, "outbox-metadata").unwrap()).unwrap();
        assert_eq!(metadata["Not An Attribute"], "kept");
        assert_eq!(message.payload, br#"{"total":3}"#);
    }

    #[test]
    fn kafka_messages_take_topic_key_and_underscore_headers() {
        let message = build(
            &event(),
            &subscription("orders-out"),
            &config(None, Some("orders")),
            SinkKind::Kafka,
        )
        .unwrap();
        assert_eq!(message.destination, "orders");
        assert_eq!(message.key.as_deref(), Some("order/o-1\nx"));
        assert_eq!(header(&message, "ce_type"), Some("order.created"));
        assert_eq!(header(&message, "Nats-Msg-Id"), None);
        let unfit = build(
            &event(),
            &subscription("orders-out"),
            &config(None, Some("{aggregate_id}{aggregate_id}")),
            SinkKind::Kafka,
        );
        assert!(unfit.is_ok(), "escaped to underscores: {unfit:?}");
    }
}
