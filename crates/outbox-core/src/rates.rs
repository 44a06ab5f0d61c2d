//! Delivery and ack rates of every subscription over the last 15 minutes, sampled at a
//! fixed interval from the delivery counters that every gateway on the database adds
//! to: the rates cover the whole cluster, and history starts when this process does.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex},
    time::Duration,
};

use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;

use crate::{
    domain::{SubscriptionId, SubscriptionName},
    sources::Sources,
    storage::{CounterTotals, StoreError},
};

/// How far back the rates reach.
pub const WINDOW: Duration = Duration::from_secs(15 * 60);

/// The sampled rates; cheap to clone.
#[derive(Clone)]
pub struct DeliveryRates {
    samples: Arc<Mutex<VecDeque<Sample>>>,
}

struct Sample {
    at: DateTime<Utc>,
    totals: HashMap<SubscriptionName, CounterTotals>,
}

/// Deliveries and acks per second between two samples, ending at `at`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RatePoint {
    pub at: DateTime<Utc>,
    pub delivered_per_second: f64,
    pub acked_per_second: f64,
}

/// One subscription's rates over the window.
#[derive(Debug, Clone, PartialEq)]
pub struct SubscriptionRates {
    /// Oldest first; empty until two samples were taken.
    pub points: Vec<RatePoint>,
    /// Averages over the time the points cover.
    pub delivered_per_second: f64,
    pub acked_per_second: f64,
    /// How much time the points cover (less than [`WINDOW`] after a start).
    pub covered: Duration,
}

impl DeliveryRates {
    /// Samples now and then every `interval` until `stop`.
    pub fn start(sources: Sources, interval: Duration, stop: CancellationToken) -> DeliveryRates {
        let rates = DeliveryRates {
            samples: Arc::new(Mutex::new(VecDeque::new())),
        };
        let sampler = rates.clone();
        tokio::spawn(async move {
            loop {
                // A sample without a source that is down would read as a drop and then
                // a burst; no sample leaves a gap instead.
                match totals(&sources).await {
                    Ok(totals) => sampler.record(Utc::now(), totals, interval),
                    Err(error) => tracing::debug!(%error, "could not sample delivery counters"),
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(interval) => {}
                }
            }
        });
        rates
    }

    fn record(
        &self,
        at: DateTime<Utc>,
        totals: HashMap<SubscriptionName, CounterTotals>,
        interval: Duration,
    ) {
        let mut samples = self.samples.lock().expect("samples lock");
        samples.push_back(Sample { at, totals });
        // One sample older than the window, so the points span all of it.
        let keep_after = at - (WINDOW + interval);
        while samples.front().is_some_and(|oldest| oldest.at < keep_after) {
            samples.pop_front();
        }
    }

    /// The rates of one subscription; `None` before it appears in two samples.
    pub fn of(&self, name: &SubscriptionName) -> Option<SubscriptionRates> {
        let samples = self.samples.lock().expect("samples lock");
        let series: Vec<(DateTime<Utc>, CounterTotals)> = samples
            .iter()
            .filter_map(|sample| Some((sample.at, *sample.totals.get(name)?)))
            .collect();
        drop(samples);
        let mut points = Vec::with_capacity(series.len());
        for pair in series.windows(2) {
            let ((from, before), (to, after)) = (pair[0], pair[1]);
            let seconds = (to - from).as_seconds_f64();
            // A subscription deleted and created again under its name starts over.
            if seconds <= 0.0 || before.subscription_id != after.subscription_id {
                points.clear();
                continue;
            }
            points.push(RatePoint {
                at: to,
                delivered_per_second: after.delivered.saturating_sub(before.delivered) as f64
                    / seconds,
                acked_per_second: after.acked.saturating_sub(before.acked) as f64 / seconds,
            });
        }
        let (first, last) = (points.first()?, points.last()?);
        let start = series
            .iter()
            .rev()
            .nth(points.len())
            .map_or(first.at, |(at, _)| *at);
        let covered = (last.at - start).to_std().unwrap_or_default();
        let seconds = covered.as_secs_f64().max(f64::EPSILON);
        let total = |rate: fn(&RatePoint) -> f64| {
            let mut previous = start;
            points
                .iter()
                .map(|point| {
                    let span = (point.at - previous).as_seconds_f64();
                    previous = point.at;
                    rate(point) * span
                })
                .sum::<f64>()
                / seconds
        };
        Some(SubscriptionRates {
            delivered_per_second: total(|point| point.delivered_per_second),
            acked_per_second: total(|point| point.acked_per_second),
            points,
            covered,
        })
    }
}

/// Every subscription's counters summed over the sources.
async fn totals(sources: &Sources) -> Result<HashMap<SubscriptionName, CounterTotals>, StoreError> {
    let subscriptions = sources.default_source().store.subscriptions().await?;
    let mut by_id: HashMap<SubscriptionId, CounterTotals> = subscriptions
        .iter()
        .map(|subscription| {
            let zero = CounterTotals {
                subscription_id: subscription.id,
                delivered: 0,
                acked: 0,
            };
            (subscription.id, zero)
        })
        .collect();
    for source in sources.iter() {
        for here in source.store.counter_totals().await? {
            if let Some(sum) = by_id.get_mut(&here.subscription_id) {
                sum.delivered += here.delivered;
                sum.acked += here.acked;
            }
        }
    }
    Ok(subscriptions
        .into_iter()
        .filter_map(|subscription| Some((subscription.name, by_id.remove(&subscription.id)?)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn totals(id: i64, delivered: u64, acked: u64) -> HashMap<SubscriptionName, CounterTotals> {
        HashMap::from([(
            SubscriptionName::parse("name", "orders").unwrap(),
            CounterTotals {
                subscription_id: SubscriptionId(id),
                delivered,
                acked,
            },
        )])
    }

    #[test]
    fn rates_are_counter_differences_over_time_and_forget_old_samples() {
        let rates = DeliveryRates {
            samples: Arc::new(Mutex::new(VecDeque::new())),
        };
        let name = SubscriptionName::parse("name", "orders").unwrap();
        let start = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let interval = Duration::from_secs(10);
        rates.record(start, totals(1, 0, 0), interval);
        assert_eq!(rates.of(&name), None, "one sample is no rate");
        rates.record(start + interval, totals(1, 100, 50), interval);
        rates.record(start + interval * 2, totals(1, 100, 150), interval);
        let of_name = rates.of(&name).unwrap();
        assert_eq!(of_name.points.len(), 2);
        assert_eq!(of_name.points[0].delivered_per_second, 10.0);
        assert_eq!(of_name.points[1].acked_per_second, 10.0);
        assert_eq!(of_name.covered, interval * 2);
        assert_eq!(of_name.delivered_per_second, 5.0);
        assert_eq!(of_name.acked_per_second, 7.5);

        // Deleted and created again: the new counters start a new series.
        rates.record(start + interval * 3, totals(2, 1, 1), interval);
        assert_eq!(rates.of(&name), None);

        // Samples older than the window go.
        rates.record(start + WINDOW + interval * 10, totals(2, 1, 1), interval);
        assert_eq!(rates.samples.lock().unwrap().len(), 1);
    }
}
