//! What one push request carries: the event as a CloudEvent 1.0 (binary or structured
//! HTTP mode) or several as a CloudEvents JSON batch, the trace context, the
//! subscription's extra headers and the Standard Webhooks signature. Pure: no I/O, so it
//! is tested on its own.
//!
//! Attribute mapping (also in docs/push.md):
//! - `id`: the event id; `type`: the event type; `subject`: the aggregate id;
//!   `time`: `occurred_at`; `datacontenttype`: the event's content type.
//! - `source`: `/sources/<source>/aggregates/<aggregate type>` (percent-encoded), so a
//!   receiver tells the source database and the aggregate type apart. In binary mode it
//!   is header-encoded once more, like every attribute, so the decoded header is the
//!   structured `source` exactly.
//! - extension `transactionid`: the id of the database transaction that wrote the event
//!   (equal for the events of one transaction);
//! - extension `aggregateversion` when the producer gave one; every metadata key that is
//!   a valid attribute name (`[a-z0-9]{1,20}`, not a CloudEvents attribute) as an
//!   extension; `traceparent` / `tracestate` as plain HTTP headers.

use std::{borrow::Cow, collections::BTreeMap};

use base64::{Engine, engine::general_purpose::STANDARD as BASE64};
use chrono::{DateTime, SecondsFormat, Utc};
use percent_encoding::{AsciiSet, CONTROLS, NON_ALPHANUMERIC, utf8_percent_encode};
use sha2::{Digest, Sha256};

use crate::domain::{
    Event, PushFormat, PushSecret, TRACE_CONTEXT_KEYS, is_json_content_type, webhook_signature,
};

/// Header values in binary mode: the CloudEvents HTTP binding percent-encodes spaces,
/// double quotes, percent signs and everything outside printable ASCII.
const HEADER_VALUE_ESCAPES: &AsciiSet = &CONTROLS.add(b' ').add(b'"').add(b'%');
/// A path segment of `source`: everything but unreserved characters.
const SEGMENT_ESCAPES: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// Attributes CloudEvents defines; a metadata key of that name is not an extension.
const CONTEXT_ATTRIBUTES: [&str; 12] = [
    "specversion",
    "id",
    "type",
    "source",
    "subject",
    "time",
    "datacontenttype",
    "dataschema",
    "data",
    "data_base64",
    "aggregateversion",
    "transactionid",
];

pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json";
pub const BATCH_CONTENT_TYPE: &str = "application/cloudevents-batch+json";

/// Headers and body of one request, before the transport adds its own.
#[derive(Debug)]
pub struct PushRequest {
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// The `source` attribute of an event.
pub fn ce_source(event: &Event) -> String {
    format!(
        "/sources/{}/aggregates/{}",
        utf8_percent_encode(event.source.as_str(), SEGMENT_ESCAPES),
        utf8_percent_encode(&event.aggregate_type, SEGMENT_ESCAPES)
    )
}

/// Metadata entries that become CloudEvents extension attributes, by name.
fn extensions(event: &Event) -> impl Iterator<Item = (&str, &str)> {
    event.metadata_by_key().into_iter().filter(|(key, _)| {
        (1..=20).contains(&key.len())
            && key
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
            && !CONTEXT_ATTRIBUTES.contains(key)
            && !TRACE_CONTEXT_KEYS.contains(key)
    })
}

fn ce_time(time: DateTime<Utc>) -> String {
    time.to_rfc3339_opts(SecondsFormat::AutoSi, true)
}

/// How a protocol binding names CloudEvents attributes in its headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderPrefix {
    /// `ce-`: the HTTP and NATS bindings.
    Dash,
    /// `ce_`: the Kafka binding.
    Underscore,
}

impl HeaderPrefix {
    fn name(self, dash: &'static str, underscore: &'static str) -> Cow<'static, str> {
        Cow::Borrowed(match self {
            HeaderPrefix::Dash => dash,
            HeaderPrefix::Underscore => underscore,
        })
    }

    fn extension(self, name: &str) -> Cow<'static, str> {
        Cow::Owned(match self {
            HeaderPrefix::Dash => format!("ce-{name}"),
            HeaderPrefix::Underscore => format!("ce_{name}"),
        })
    }
}

/// The event's CloudEvents attributes but `datacontenttype` (the transport's content
/// type) as headers of the binding's binary mode, each value encoded as the HTTP binding
/// asks (the NATS and Kafka bindings carry the same values).
pub fn binary_attributes(event: &Event, prefix: HeaderPrefix) -> Vec<(Cow<'static, str>, String)> {
    let encode = |value: &str| utf8_percent_encode(value, HEADER_VALUE_ESCAPES).to_string();
    let name = |dash, underscore| prefix.name(dash, underscore);
    let mut attributes = Vec::with_capacity(8 + event.metadata.len());
    attributes.extend([
        (name("ce-specversion", "ce_specversion"), "1.0".to_owned()),
        (name("ce-id", "ce_id"), event.id.to_string()),
        (name("ce-type", "ce_type"), encode(&event.event_type)),
        // Like every attribute: the receiver decodes the header, and must get the same
        // `source` as structured mode sends, its own escapes intact.
        (name("ce-source", "ce_source"), encode(&ce_source(event))),
        (
            name("ce-subject", "ce_subject"),
            encode(&event.aggregate_id),
        ),
        (name("ce-time", "ce_time"), ce_time(event.occurred_at)),
        (
            name("ce-transactionid", "ce_transactionid"),
            event.transaction_id.to_string(),
        ),
    ]);
    if let Some(version) = event.aggregate_version {
        attributes.push((
            name("ce-aggregateversion", "ce_aggregateversion"),
            version.to_string(),
        ));
    }
    for (key, value) in extensions(event) {
        attributes.push((prefix.extension(key), encode(value)));
    }
    attributes
}

/// The event's `traceparent` and `tracestate`, when they can travel as header values.
pub fn trace_headers(event: &Event) -> impl Iterator<Item = (&'static str, &String)> {
    TRACE_CONTEXT_KEYS.into_iter().filter_map(|key| {
        event
            .metadata
            .get(key)
            .filter(|value| http::HeaderValue::from_str(value).is_ok())
            .map(|value| (key, value))
    })
}

/// Builds the request for `event`, signed at `now` with every live key of `secrets`.
pub fn build(
    event: &Event,
    format: PushFormat,
    extra_headers: &BTreeMap<String, String>,
    secrets: &[PushSecret],
    now: DateTime<Utc>,
) -> PushRequest {
    let id = event.id.to_string();
    let mut headers = owned(extra_headers);
    let body = match format {
        PushFormat::Binary => {
            for (name, value) in binary_attributes(event, HeaderPrefix::Dash) {
                headers.push((name.into_owned(), value));
            }
            headers.push(("content-type".into(), event.content_type.clone()));
            event.payload.clone()
        }
        PushFormat::Structured => {
            headers.push(("content-type".into(), STRUCTURED_CONTENT_TYPE.into()));
            serde_json::to_vec(&structured(event)).expect("a JSON value serializes")
        }
    };
    for (key, value) in trace_headers(event) {
        headers.push((key.to_owned(), value.clone()));
    }
    sign(headers, body, &id, secrets, now)
}

/// Builds one request carrying `events` as a CloudEvents JSON batch, signed at `now`
/// with every live key of `secrets`. Its `webhook-id` names the batch by its events, so
/// the same events sent again keep it.
pub fn build_batch(
    events: &[&Event],
    extra_headers: &BTreeMap<String, String>,
    secrets: &[PushSecret],
    now: DateTime<Utc>,
) -> PushRequest {
    let mut headers = owned(extra_headers);
    headers.push(("content-type".into(), BATCH_CONTENT_TYPE.into()));
    let documents: Vec<serde_json::Value> = events.iter().map(|event| structured(event)).collect();
    let body = serde_json::to_vec(&documents).expect("a JSON value serializes");
    let mut digest = Sha256::new();
    for event in events {
        digest.update(event.id.as_bytes());
    }
    let id = format!("batch_{}", hex::encode(&digest.finalize()[..16]));
    sign(headers, body, &id, secrets, now)
}

/// The subscription's extra headers, which every request starts with.
fn owned(extra_headers: &BTreeMap<String, String>) -> Vec<(String, String)> {
    extra_headers
        .iter()
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect()
}

/// The Standard Webhooks headers over `body`, added to `headers`.
fn sign(
    mut headers: Vec<(String, String)>,
    body: Vec<u8>,
    id: &str,
    secrets: &[PushSecret],
    now: DateTime<Utc>,
) -> PushRequest {
    let timestamp = now.timestamp();
    headers.push(("webhook-id".into(), id.to_owned()));
    headers.push(("webhook-timestamp".into(), timestamp.to_string()));
    headers.push((
        "webhook-signature".into(),
        webhook_signature(secrets, now, id, timestamp, &body),
    ));
    PushRequest { headers, body }
}

/// The event as a structured-mode CloudEvent: `data` for a JSON payload, `data_base64`
/// for any other.
fn structured(event: &Event) -> serde_json::Value {
    let mut document = serde_json::Map::new();
    let mut put = |key: &str, value: serde_json::Value| {
        document.insert(key.to_owned(), value);
    };
    put("specversion", "1.0".into());
    put("id", event.id.to_string().into());
    put("type", event.event_type.clone().into());
    put("source", ce_source(event).into());
    put("subject", event.aggregate_id.clone().into());
    put("time", ce_time(event.occurred_at).into());
    put("datacontenttype", event.content_type.clone().into());
    put("transactionid", event.transaction_id.to_string().into());
    if let Some(version) = event.aggregate_version {
        put("aggregateversion", version.into());
    }
    for (key, value) in extensions(event) {
        put(key, value.into());
    }
    let json_data = is_json_content_type(&event.content_type)
        .then(|| serde_json::from_slice::<serde_json::Value>(&event.payload).ok())
        .flatten();
    match json_data {
        Some(data) => put("data", data),
        None => put("data_base64", BASE64.encode(&event.payload).into()),
    }
    serde_json::Value::Object(document)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::SourceName;

    fn event() -> Event {
        Event {
            source: SourceName::default_source(),
            id: uuid::Uuid::nil(),
            aggregate_type: "order line".into(),
            aggregate_id: "o-1".into(),
            aggregate_version: Some(3),
            event_type: "order.created".into(),
            payload: br#"{"a":1}"#.to_vec(),
            content_type: "application/json".into(),
            deliver_at: None,
            expires_at: None,
            transaction_id: 1,
            metadata: [
                ("tenant".to_owned(), "acme corp".to_owned()),
                ("Not-An-Attribute".to_owned(), "x".to_owned()),
                ("traceparent".to_owned(), "00-abc-def-01".to_owned()),
            ]
            .into(),
            occurred_at: DateTime::from_timestamp(1_700_000_000, 0).unwrap(),
            created_at: DateTime::from_timestamp(1_700_000_001, 0).unwrap(),
        }
    }

    fn header<'a>(request: &'a PushRequest, name: &str) -> Option<&'a str> {
        request
            .headers
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }

    #[test]
    fn binary_mode_puts_attributes_in_headers() {
        let secret = PushSecret::generate();
        let request = build(
            &event(),
            PushFormat::Binary,
            &BTreeMap::new(),
            &[secret],
            Utc::now(),
        );
        assert_eq!(request.body, br#"{"a":1}"#);
        assert_eq!(
            header(&request, "ce-source"),
            Some("/sources/default/aggregates/order%2520line")
        );
        assert_eq!(header(&request, "ce-tenant"), Some("acme%20corp"));
        assert_eq!(header(&request, "ce-aggregateversion"), Some("3"));
        assert_eq!(header(&request, "ce-traceparent"), None);
        assert_eq!(header(&request, "traceparent"), Some("00-abc-def-01"));
        assert_eq!(header(&request, "ce-time"), Some("2023-11-14T22:13:20Z"));
        assert_eq!(header(&request, "ce-transactionid"), Some("1"));
        assert!(
            header(&request, "webhook-signature")
                .unwrap()
                .starts_with("v1,")
        );
    }

    #[test]
    fn structured_mode_embeds_json_and_base64_data() {
        let request = build(
            &event(),
            PushFormat::Structured,
            &BTreeMap::new(),
            &[PushSecret::generate()],
            Utc::now(),
        );
        let document: serde_json::Value = serde_json::from_slice(&request.body).unwrap();
        assert_eq!(document["data"]["a"], 1);
        assert_eq!(document["aggregateversion"], 3);
        assert_eq!(document["tenant"], "acme corp");
        let mut binary = event();
        binary.content_type = "application/octet-stream".into();
        binary.payload = vec![0, 1, 2];
        let request = build(
            &binary,
            PushFormat::Structured,
            &BTreeMap::new(),
            &[PushSecret::generate()],
            Utc::now(),
        );
        let document: serde_json::Value = serde_json::from_slice(&request.body).unwrap();
        assert_eq!(document["data_base64"], "AAEC");
    }
}
