//! The Prometheus exporter: the process-wide recorder and `GET /metrics`, without the
//! series of subscriptions deleted since. The metric names and the calls that record
//! them are the core's `metrics`; the RPC metrics, recorded by the per-RPC layer, are here.

use std::{
    collections::HashSet,
    sync::{LazyLock, Mutex},
    time::Duration,
};

use metrics::{counter, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use metrics_util::MetricKindMask;

use crate::metrics::describe;

/// Latency buckets, in seconds.
const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// The process's metrics, ready to be rendered for a scrape.
#[derive(Clone)]
pub struct MetricsEndpoint {
    handle: PrometheusHandle,
}

impl MetricsEndpoint {
    /// Installs the process-wide recorder, with a description of every metric. Gauges not
    /// refreshed for `stale_after` disappear (a deleted subscription's stats, for
    /// instance). Only the first gateway of a process owns the recorder: a later one
    /// (tests run several) serves an endpoint of its own that stays empty.
    pub fn install(stale_after: Duration) -> Result<MetricsEndpoint, String> {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
            .map(|builder| {
                builder
                    .idle_timeout(MetricKindMask::GAUGE, Some(stale_after))
                    .build_recorder()
            })
            .map_err(|error| format!("cannot set up metrics: {error}"))?;
        let handle = recorder.handle();
        if metrics::set_global_recorder(recorder).is_err() {
            tracing::warn!("metrics are already recorded by another gateway of this process");
        }
        describe();
        crate::metrics::task_panic_counters();
        Ok(MetricsEndpoint { handle })
    }

    /// Serves `GET /metrics` on `listener` until `shutdown`; every other path is 404.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) {
        let upkeep = self.handle.clone();
        // Histograms keep their samples in buffers until drained; this runs beside the
        // server and ends with it.
        let upkeep = async move {
            let mut interval = tokio::time::interval(Duration::from_secs(5));
            loop {
                interval.tick().await;
                upkeep.run_upkeep();
            }
        };
        let handle = self.handle;
        let router = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let handle = handle.clone();
                async move {
                    (
                        [(
                            axum::http::header::CONTENT_TYPE,
                            "text/plain; version=0.0.4",
                        )],
                        without_deleted_subscriptions(&handle.render()),
                    )
                }
            }),
        );
        let serve = axum::serve(listener, router).with_graceful_shutdown(shutdown);
        tokio::select! {
            result = serve => {
                if let Err(error) = result {
                    tracing::warn!(%error, "metrics endpoint stopped");
                }
            }
            () = upkeep => {}
        }
    }
}

/// The subscriptions the stats refreshes saw, and those that vanished between two
/// of them (deleted): a deleted subscription's series — its counters too, which never go
/// idle — leave the endpoint, while one created since the last refresh shows at once.
#[derive(Default)]
struct KnownSubscriptions {
    last_seen: HashSet<String>,
    deleted: HashSet<String>,
}

static KNOWN_SUBSCRIPTIONS: LazyLock<Mutex<KnownSubscriptions>> = LazyLock::new(Default::default);

/// Records the subscriptions that exist now.
pub fn existing_subscriptions(names: HashSet<String>) {
    let mut known = KNOWN_SUBSCRIPTIONS.lock().expect("subscriptions lock");
    let gone: Vec<String> = known.last_seen.difference(&names).cloned().collect();
    known.deleted.extend(gone);
    known.deleted.retain(|name| !names.contains(name));
    known.last_seen = names;
}

/// The exposition text without the samples of deleted subscriptions.
fn without_deleted_subscriptions(text: &str) -> String {
    let known = KNOWN_SUBSCRIPTIONS.lock().expect("subscriptions lock");
    if known.deleted.is_empty() {
        return text.to_owned();
    }
    let mut kept = String::with_capacity(text.len());
    for line in text.lines() {
        // Subscription names are [a-z0-9._-]: no escapes inside the label value.
        let subscription = line
            .split_once("subscription=\"")
            .and_then(|(_, rest)| rest.split_once('"'))
            .map(|(name, _)| name);
        if subscription.is_some_and(|name| known.deleted.contains(name)) && !line.starts_with('#') {
            continue;
        }
        kept.push_str(line);
        kept.push('\n');
    }
    kept
}

pub fn rpc_finished(method: &str, code: tonic::Code, elapsed: Duration) {
    let method = method.to_owned();
    counter!("outbox_rpc_requests_total", "method" => method.clone(), "code" => format!("{code:?}"))
        .increment(1);
    histogram!("outbox_rpc_duration_seconds", "method" => method).record(elapsed.as_secs_f64());
}
