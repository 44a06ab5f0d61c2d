//! Prometheus metrics: names, labels and the exporter. Label values stay bounded —
//! subscription names, RPC methods, status codes and at most `MAX_EVENT_TYPE_LABELS`
//! event types; never an event or aggregate id. Without an installed exporter every
//! call here is a no-op.

use std::{
    collections::HashSet,
    net::SocketAddr,
    sync::{LazyLock, Mutex},
    time::Duration,
};

use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use metrics_util::MetricKindMask;

use crate::{domain::OutboxStats, domain::SubscriptionStats};

/// Distinct event types given their own label; later ones count as "other".
const MAX_EVENT_TYPE_LABELS: usize = 256;
/// Latency buckets, in seconds.
const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Serves `/metrics` on `listen`. Gauges not refreshed for `stale_after` disappear (a
/// deleted subscription's figures, for instance).
pub fn install(listen: SocketAddr, stale_after: Duration) -> Result<(), String> {
    PrometheusBuilder::new()
        .with_http_listener(listen)
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
        .and_then(|builder| {
            builder
                .idle_timeout(MetricKindMask::GAUGE, Some(stale_after))
                .install()
        })
        .map_err(|error| format!("cannot serve metrics on {listen}: {error}"))
}

pub fn rpc_finished(method: &str, code: tonic::Code, elapsed: Duration) {
    let method = method.to_owned();
    counter!("outbox_rpc_requests_total", "method" => method.clone(), "code" => format!("{code:?}"))
        .increment(1);
    histogram!("outbox_rpc_duration_seconds", "method" => method).record(elapsed.as_secs_f64());
}

static EVENT_TYPES: LazyLock<Mutex<HashSet<String>>> = LazyLock::new(Default::default);

fn event_type_label(event_type: &str) -> String {
    let mut known = EVENT_TYPES.lock().expect("event type labels");
    if known.contains(event_type) {
        return event_type.to_owned();
    }
    if known.len() < MAX_EVENT_TYPE_LABELS {
        known.insert(event_type.to_owned());
        return event_type.to_owned();
    }
    "other".to_owned()
}

/// Newly stored events (duplicates not counted).
pub fn published<'a>(event_types: impl Iterator<Item = &'a str>) {
    for event_type in event_types {
        counter!("outbox_events_published_total", "event_type" => event_type_label(event_type))
            .increment(1);
    }
}

/// Deliveries handed to streams; `redelivered` of them were not first attempts.
pub fn delivered(subscription: &str, source: &str, delivered: u64, redelivered: u64) {
    let labels = per_source(subscription, source);
    counter!("outbox_deliveries_total", &labels).increment(delivered);
    if redelivered > 0 {
        counter!("outbox_redeliveries_total", &labels).increment(redelivered);
    }
}

/// Time from an event's creation to its first delivery.
pub fn commit_to_delivery(subscription: &str, elapsed: Duration) {
    histogram!("outbox_commit_to_delivery_seconds", "subscription" => subscription.to_owned())
        .record(elapsed.as_secs_f64());
}

pub fn acked(subscription: &str, source: &str, acks: u64) {
    counter!("outbox_acks_total", &per_source(subscription, source)).increment(acks);
}

/// Time from handing a delivery to a stream to its ack (acks reaching this process).
pub fn deliver_to_ack(subscription: &str, elapsed: Duration) {
    histogram!("outbox_deliver_to_ack_seconds", "subscription" => subscription.to_owned())
        .record(elapsed.as_secs_f64());
}

/// The request metrics of one push subscription, registered once rather than looked up
/// for every request.
pub struct PushRequestMetrics {
    subscription: String,
    duration: metrics::Histogram,
    /// By `code`: the HTTP status, or `timeout`, `connect_error` or `error` when there was
    /// no answer.
    requests: Mutex<std::collections::HashMap<String, metrics::Counter>>,
}

impl PushRequestMetrics {
    pub fn new(subscription: &str) -> PushRequestMetrics {
        PushRequestMetrics {
            subscription: subscription.to_owned(),
            duration: histogram!(
                "outbox_push_duration_seconds",
                "subscription" => subscription.to_owned()
            ),
            requests: Mutex::new(std::collections::HashMap::new()),
        }
    }

    pub fn request(&self, code: &str, elapsed: Duration) {
        self.duration.record(elapsed.as_secs_f64());
        let mut requests = self.requests.lock().expect("push metrics lock");
        match requests.get(code) {
            Some(counter) => counter.increment(1),
            None => {
                let counter = counter!(
                    "outbox_push_requests_total",
                    "subscription" => self.subscription.clone(),
                    "code" => code.to_owned()
                );
                counter.increment(1);
                requests.insert(code.to_owned(), counter);
            }
        }
    }
}

pub fn nacked(subscription: &str, source: &str) {
    counter!("outbox_nacks_total", &per_source(subscription, source)).increment(1);
}

pub fn dead_lettered(subscription: &str, source: &str, count: u64) {
    counter!(
        "outbox_dead_letters_total",
        &per_source(subscription, source)
    )
    .increment(count);
}

pub fn requeued(subscription: &str, source: &str, count: u64) {
    counter!("outbox_requeued_total", &per_source(subscription, source)).increment(count);
}

/// The labels of a subscription's figures in one source.
fn per_source(subscription: &str, source: &str) -> [(&'static str, String); 2] {
    [
        ("subscription", subscription.to_owned()),
        ("source", source.to_owned()),
    ]
}

/// Why the relay looked for work: `publish` (this process), `notify` (LISTEN) or `poll`.
pub fn wakeup(cause: &'static str) {
    counter!("outbox_relay_wakeups_total", "cause" => cause).increment(1);
}

/// The lag gauges of one subscription in one source.
pub fn subscription_figures(stats: &SubscriptionStats, now: chrono::DateTime<chrono::Utc>) {
    let labels = per_source(
        stats.name.as_str(),
        stats.source.as_ref().map_or("", |source| source.as_str()),
    );
    gauge!("outbox_subscription_backlog", &labels).set(stats.pending as f64);
    gauge!("outbox_subscription_in_flight", &labels).set(stats.in_flight as f64);
    gauge!("outbox_subscription_awaiting_retry", &labels).set(stats.awaiting_retry as f64);
    gauge!("outbox_subscription_dead_letters", &labels).set(stats.dead_lettered as f64);
    let age = stats
        .oldest_unacked_at
        .map_or(0.0, |at| (now - at).num_milliseconds().max(0) as f64 / 1e3);
    gauge!("outbox_subscription_oldest_unacked_age_seconds", &labels).set(age);
    gauge!("outbox_subscription_late_transactions", &labels).set(stats.late_transactions as f64);
}

/// 1 while the source can be reached, 0 while it cannot.
pub fn source_up(source: &str, up: bool) {
    gauge!("outbox_source_up", "source" => source.to_owned()).set(if up { 1.0 } else { 0.0 });
}

pub fn outbox_figures(stats: &OutboxStats) {
    gauge!("outbox_events_stored").set(stats.events_stored as f64);
    gauge!("outbox_oldest_open_transaction_age_seconds")
        .set(stats.oldest_open_transaction_age.as_secs_f64());
}

pub fn pool(size: u32, idle: usize) {
    gauge!("outbox_db_pool_connections", "state" => "idle").set(idle as f64);
    gauge!("outbox_db_pool_connections", "state" => "in_use")
        .set(size.saturating_sub(idle as u32) as f64);
}
