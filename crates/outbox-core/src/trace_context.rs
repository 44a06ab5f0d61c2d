//! W3C trace context as the core carries it: the `traceparent` / `tracestate` of a call
//! or an event, the links from a delivery's span to its producer, and whether spans leave
//! the process at all (the exporter itself is the gateway's telemetry).

use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::{
    propagation::{Extractor, TextMapPropagator},
    trace::TraceContextExt,
};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Set once spans are exported; per-delivery spans are only made then.
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Spans leave the process from now on.
pub fn set_exporting() {
    EXPORTING.store(true, Ordering::Relaxed);
}

/// True when spans leave the process (an OTLP endpoint is configured).
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// W3C `traceparent` / `tracestate` values as they travel with a call or an event.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceHeaders {
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
}

impl TraceHeaders {
    /// The trace headers of a request, when the traceparent is well-formed.
    pub fn from_headers(headers: &http::HeaderMap) -> TraceHeaders {
        Self::from_lookup(|name| headers.get(name).and_then(|value| value.to_str().ok()))
    }

    /// The trace headers `lookup` finds by name, when the traceparent is well-formed.
    pub fn from_lookup<'a>(lookup: impl Fn(&str) -> Option<&'a str>) -> TraceHeaders {
        let value = |name: &str| lookup(name).map(str::to_owned);
        match value("traceparent").filter(|traceparent| is_traceparent(traceparent)) {
            Some(traceparent) => TraceHeaders {
                traceparent: Some(traceparent),
                tracestate: value("tracestate"),
            },
            None => TraceHeaders::default(),
        }
    }
}

/// `version-traceid-spanid-flags`, lowercase hex, the all-zero ids refused.
pub fn is_traceparent(value: &str) -> bool {
    let parts: Vec<&str> = value.split('-').collect();
    let hex = |part: &str, len: usize| {
        part.len() == len
            && part
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    parts.len() == 4
        && hex(parts[0], 2)
        && parts[0] != "ff"
        && hex(parts[1], 32)
        && parts[1].bytes().any(|b| b != b'0')
        && hex(parts[2], 16)
        && parts[2].bytes().any(|b| b != b'0')
        && hex(parts[3], 2)
}

struct MapExtractor<'a>(&'a dyn Fn(&str) -> Option<&'a str>);

impl Extractor for MapExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        (self.0)(key)
    }

    fn keys(&self) -> Vec<&str> {
        vec!["traceparent", "tracestate"]
    }
}

pub fn remote_context(traceparent: &str, tracestate: Option<&str>) -> opentelemetry::Context {
    let lookup = move |key: &str| match key {
        "traceparent" => Some(traceparent),
        "tracestate" => tracestate,
        _ => None,
    };
    TraceContextPropagator::new().extract(&MapExtractor(&lookup))
}

/// Links `span` to the producer context an event carries in its metadata.
pub fn link_to_producer(span: &Span, metadata: &std::collections::HashMap<String, String>) {
    if let Some(traceparent) = metadata.get("traceparent").filter(|t| is_traceparent(t)) {
        let context = remote_context(traceparent, metadata.get("tracestate").map(String::as_str));
        let span_context = context.span().span_context().clone();
        if span_context.is_valid() {
            span.add_link(span_context);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_only_well_formed_traceparents() {
        assert!(is_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        ));
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(!is_traceparent(bad), "{bad:?}");
        }
    }
}
