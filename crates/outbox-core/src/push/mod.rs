//! Push delivery: the gateway drains a push subscription itself and sends each event to
//! the subscription's HTTP endpoint as a signed CloudEvent.
//!
//! A pusher is a consumer like any Subscribe stream: it takes deliveries from the relay
//! with leases (so ordering per aggregate, retries, dead letters and sharing the work
//! among gateway replicas are the relay's, unchanged) and settles each one by the
//! endpoint's answer. The [`Pushers`] supervisor runs one pusher per push subscription
//! in this process and restarts it when the definition changes.

pub mod request;
mod sender;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use tokio::{sync::mpsc, task::JoinSet};
use tokio_util::sync::CancellationToken;

pub use sender::{Answer, Failure, PushSender};

use crate::{
    delivery::Relay,
    domain::{
        AckId, AllowedHosts, Delivery, PushSecret, Subscription, SubscriptionId, SubscriptionName,
        SubscriptionSettings,
    },
    error::Error,
    metrics,
    tasks::{RestartDelays, TaskName, keep_running},
};

/// Longest part of a refusing endpoint's body kept in the dead letter's error.
const MAX_BODY_IN_ERROR: usize = 1024;
/// Lease held beyond the request timeout, for settling after the answer.
const SETTLE_MARGIN: Duration = Duration::from_secs(5);
/// Deliveries a pusher leases per request it may have in flight.
const LEASE_AHEAD: u32 = 4;
/// Wait before retrying to open a pusher's stream after a failure.
const REOPEN_DELAY: Duration = Duration::from_secs(1);

/// Push settings of the gateway (`[push]` in the configuration file).
#[derive(Debug, Clone, Default)]
pub struct PushSettings {
    pub allowed_hosts: AllowedHosts,
    /// PEM file of extra certificate authorities trusted for https endpoints.
    pub ca_file: Option<std::path::PathBuf>,
    /// How often definitions are re-read when no change was announced here.
    pub poll_interval: Duration,
}

/// What this process knows of a push subscription's requests.
#[derive(Debug, Clone, PartialEq)]
pub struct PushStatus {
    pub in_flight: u64,
    /// HTTP status of the last answer (0: none yet, or the last request got no answer).
    pub last_status: u16,
    /// The last failure: a refusing status with its body, a timeout, a connection error.
    pub last_error: Option<String>,
    pub last_error_at: Option<DateTime<Utc>>,
    pub requests_total: u64,
    /// Requests per second of the last [`RATE_WINDOW_SECONDS`], by second.
    rate_buckets: [u64; RATE_WINDOW_SECONDS],
    /// The second (since [`RATE_EPOCH`]) of the newest bucket.
    rate_second: u64,
}

impl Default for PushStatus {
    fn default() -> Self {
        PushStatus {
            in_flight: 0,
            last_status: 0,
            last_error: None,
            last_error_at: None,
            requests_total: 0,
            rate_buckets: [0; RATE_WINDOW_SECONDS],
            rate_second: rate_now(),
        }
    }
}

const RATE_WINDOW_SECONDS: usize = 60;
static RATE_EPOCH: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);

fn rate_now() -> u64 {
    RATE_EPOCH.elapsed().as_secs()
}

impl PushStatus {
    /// Moves the window to `second`, emptying the buckets it passes.
    fn advance(&mut self, second: u64) {
        let passed = second.saturating_sub(self.rate_second);
        for step in 1..=passed.min(RATE_WINDOW_SECONDS as u64) {
            self.rate_buckets[((self.rate_second + step) % RATE_WINDOW_SECONDS as u64) as usize] =
                0;
        }
        self.rate_second = self.rate_second.max(second);
    }

    fn count_request(&mut self) {
        let second = rate_now();
        self.advance(second);
        self.rate_buckets[(second % RATE_WINDOW_SECONDS as u64) as usize] += 1;
        self.requests_total += 1;
    }

    /// Requests per second over the last minute (or since the first request, when that
    /// is more recent).
    pub fn rate(&self) -> f64 {
        let mut current = self.clone();
        current.advance(rate_now());
        let total: u64 = current.rate_buckets.iter().sum();
        let span = (RATE_EPOCH.elapsed().as_secs_f64()).clamp(1.0, RATE_WINDOW_SECONDS as f64);
        total as f64 / span
    }
}

/// What this process knows of its push subscriptions, by subscription id: how their
/// requests fare, and the signing keys to use. Cheap to clone.
#[derive(Clone, Default)]
pub struct PushBoard {
    inner: Arc<Mutex<HashMap<SubscriptionId, PushStatus>>>,
    /// Read for every request, so a rotated key applies at once, without restarting
    /// the pusher; written by the supervisor from the definitions (a rotation on
    /// another replica) and by a rotation here.
    keys: Arc<Mutex<HashMap<SubscriptionId, Vec<PushSecret>>>>,
}

impl PushBoard {
    /// Signing keys for the subscription's next requests.
    pub fn set_keys(&self, subscription_id: SubscriptionId, keys: Vec<PushSecret>) {
        self.keys
            .lock()
            .expect("push keys lock")
            .insert(subscription_id, keys);
    }

    fn keys(&self, subscription_id: SubscriptionId) -> Vec<PushSecret> {
        self.keys
            .lock()
            .expect("push keys lock")
            .get(&subscription_id)
            .cloned()
            .unwrap_or_default()
    }

    pub fn get(&self, subscription_id: SubscriptionId) -> Option<PushStatus> {
        self.inner
            .lock()
            .expect("push statuses lock")
            .get(&subscription_id)
            .cloned()
    }

    fn update(&self, subscription_id: SubscriptionId, change: impl FnOnce(&mut PushStatus)) {
        change(
            self.inner
                .lock()
                .expect("push statuses lock")
                .entry(subscription_id)
                .or_default(),
        );
    }

    fn forget(&self, subscription_id: SubscriptionId) {
        self.inner
            .lock()
            .expect("push statuses lock")
            .remove(&subscription_id);
        self.keys
            .lock()
            .expect("push keys lock")
            .remove(&subscription_id);
    }
}

/// Runs this process's pushers.
pub struct Pushers;

impl Pushers {
    /// Starts the supervisor as a relay task: it stops with the relay.
    pub fn start(
        relay: Relay,
        settings: PushSettings,
        statuses: PushBoard,
        client: Arc<dyn PushSender>,
    ) {
        let stop = relay.stopping();
        let start = {
            let relay = relay.clone();
            move || {
                supervise(
                    relay.clone(),
                    client.clone(),
                    settings.clone(),
                    statuses.clone(),
                )
            }
        };
        relay.track(keep_running(
            TaskName::single("push_supervisor"),
            RestartDelays::default(),
            stop,
            start,
            |_| {},
        ));
    }
}

/// A running pusher.
struct Running {
    settings: SubscriptionSettings,
    stop: CancellationToken,
    /// Tells this pusher from an earlier one of the same subscription when it ends.
    generation: u64,
}

/// Keeps one pusher per push subscription that has not stopped.
async fn supervise(
    relay: Relay,
    client: Arc<dyn PushSender>,
    settings: PushSettings,
    statuses: PushBoard,
) {
    let shutdown = relay.stopping();
    let mut definitions = relay.watch_definitions();
    let mut running: HashMap<SubscriptionId, Running> = HashMap::new();
    let mut pushers = JoinSet::new();
    let mut generations = 0u64;
    loop {
        let store = &relay.sources().default_source().store;
        match store.active_push_subscriptions().await {
            Ok(subscriptions) => {
                let wanted: HashMap<SubscriptionId, Subscription> = subscriptions
                    .into_iter()
                    .map(|subscription| (subscription.id, subscription))
                    .collect();
                running.retain(|id, pusher| {
                    let keep = wanted
                        .get(id)
                        .is_some_and(|subscription| subscription.settings == pusher.settings);
                    if !keep {
                        pusher.stop.cancel();
                        statuses.forget(*id);
                    }
                    keep
                });
                for (id, subscription) in wanted {
                    statuses.set_keys(id, subscription.push_secrets.clone());
                    if running.contains_key(&id) {
                        continue;
                    }
                    let stop = shutdown.child_token();
                    generations += 1;
                    let generation = generations;
                    running.insert(
                        id,
                        Running {
                            settings: subscription.settings.clone(),
                            stop: stop.clone(),
                            generation,
                        },
                    );
                    let subscription = Arc::new(subscription);
                    let (relay, client, statuses) =
                        (relay.clone(), client.clone(), statuses.clone());
                    let allowed_hosts = settings.allowed_hosts.clone();
                    let start = {
                        let (subscription, statuses, stop) =
                            (subscription.clone(), statuses.clone(), stop.clone());
                        move || {
                            Pusher {
                                metrics: metrics::PushRequestMetrics::new(
                                    subscription.name.as_str(),
                                ),
                                relay: relay.clone(),
                                client: client.clone(),
                                allowed_hosts: allowed_hosts.clone(),
                                subscription: subscription.clone(),
                                statuses: statuses.clone(),
                                stop: stop.clone(),
                            }
                            .run()
                        }
                    };
                    // Shown as the push's last error, where the API and the console
                    // show why pushing fails.
                    let on_panic = move |message: &str| {
                        statuses.update(id, |status| {
                            status.last_error =
                                Some(format!("the pusher panicked and restarts: {message}"));
                            status.last_error_at = Some(Utc::now());
                        });
                    };
                    pushers.spawn(async move {
                        let name = TaskName {
                            task: "pusher",
                            name: subscription.name.as_str(),
                        };
                        keep_running(name, RestartDelays::default(), stop, start, on_panic).await;
                        (id, generation)
                    });
                }
            }
            Err(error) => tracing::debug!(%error, "cannot read push subscriptions"),
        }
        // A pusher that ended by itself (its stream closed, or the push stopped) is
        // forgotten, so the next round starts a new one if the subscription still wants it.
        while let Some(ended) = pushers.try_join_next() {
            match ended {
                Ok((id, generation)) => {
                    if running
                        .get(&id)
                        .is_some_and(|pusher| pusher.generation == generation)
                    {
                        running.remove(&id);
                    }
                }
                // keep_running catches the pusher's panics; this is only for the record.
                Err(error) => tracing::error!(%error, "a pusher task failed"),
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = definitions.changed() => {}
            _ = tokio::time::sleep(settings.poll_interval) => {}
        }
    }
    for pusher in running.values() {
        pusher.stop.cancel();
    }
    while pushers.join_next().await.is_some() {}
}

/// Pushes one subscription's deliveries until stopped.
struct Pusher {
    relay: Relay,
    client: Arc<dyn PushSender>,
    allowed_hosts: AllowedHosts,
    /// As it was when the pusher started: a change of settings restarts the pusher, and
    /// signing keys come from the board.
    subscription: Arc<Subscription>,
    statuses: PushBoard,
    stop: CancellationToken,
    metrics: metrics::PushRequestMetrics,
}

/// What became of one request.
#[derive(Debug, PartialEq)]
enum Verdict {
    Ack,
    /// Retry later: after `after`, or the subscription's backoff.
    Retry {
        reason: String,
        after: Option<Duration>,
    },
    DeadLetter {
        reason: String,
    },
    /// The endpoint is gone: stop pushing to it.
    Gone,
}

impl Pusher {
    fn snapshot(&self) -> Arc<Subscription> {
        self.subscription.clone()
    }

    async fn run(self) {
        let subscription = self.snapshot();
        let Some(push) = subscription.settings.push.clone() else {
            return;
        };
        let name = subscription.name.clone();
        if let Err(error) = self.allowed_hosts.check("push.endpoint", &push) {
            // The operator narrowed allowed_hosts since the subscription was made.
            tracing::warn!(subscription = %name, %error, "not pushing: the endpoint is not allowed");
            self.statuses.update(subscription.id, |status| {
                status.last_error = Some(error.to_string());
                status.last_error_at = Some(Utc::now());
            });
            self.stop.cancelled().await;
            return;
        }
        let mut stream = loop {
            match self
                .relay
                .subscribe_for_push(&name, push.max_concurrency.saturating_mul(LEASE_AHEAD))
                .await
            {
                Ok(stream) => break stream,
                Err(Error::NotFound(_) | Error::ShuttingDown) => return,
                Err(error) => {
                    tracing::warn!(subscription = %name, %error, "cannot start pushing; retrying");
                    tokio::select! {
                        _ = self.stop.cancelled() => return,
                        _ = tokio::time::sleep(REOPEN_DELAY) => {}
                    }
                }
            }
        };
        tracing::info!(subscription = %name, endpoint = %push.endpoint, "pushing");
        let pause = push.request_interval();
        let mut next_start = Instant::now();
        let mut requests = JoinSet::new();
        // At most max_concurrency requests at once; the stream leases a few times that,
        // so each claim takes a worthwhile batch and the next requests are ready.
        let slots = Arc::new(tokio::sync::Semaphore::new(push.max_concurrency as usize));
        let (acks, acks_to_send) = mpsc::unbounded_channel();
        let acker = tokio::spawn(send_acks(self.relay.clone(), name.clone(), acks_to_send));
        let this = Arc::new(self);
        loop {
            let delivery = tokio::select! {
                _ = this.stop.cancelled() => break,
                item = stream.next() => match item {
                    Some(Ok(delivery)) => delivery,
                    Some(Err(error)) => {
                        tracing::debug!(subscription = %name, %error, "push stream ended");
                        break;
                    }
                    None => break,
                },
            };
            if let Some(pause) = pause {
                tokio::select! {
                    _ = this.stop.cancelled() => break,
                    _ = tokio::time::sleep_until(next_start.into()) => {}
                }
                next_start = Instant::now().max(next_start) + pause;
            }
            let permit = tokio::select! {
                _ = this.stop.cancelled() => break,
                permit = slots.clone().acquire_owned() => permit.expect("never closed"),
            };
            let pusher = this.clone();
            let acks = acks.clone();
            requests.spawn(async move {
                pusher.push(delivery, acks).await;
                drop(permit);
            });
            while let Some(done) = requests.try_join_next() {
                reraise_panic(done);
            }
        }
        // Settle what is in flight before the stream (and with it the leases) goes.
        while let Some(done) = requests.join_next().await {
            reraise_panic(done);
        }
        drop(acks);
        let _ = acker.await;
        drop(stream);
        tracing::info!(subscription = %name, "stopped pushing");
    }

    /// Sends one delivery and settles it by the answer.
    async fn push(self: Arc<Self>, delivery: Delivery, acks: mpsc::UnboundedSender<AckId>) {
        let subscription = self.snapshot();
        let Some(push) = subscription.settings.push.as_ref() else {
            return;
        };
        let name = &subscription.name;
        let id = subscription.id;
        self.statuses.update(id, |status| status.in_flight += 1);
        // The request holds the lease for its whole timeout.
        let needed = push.timeout + SETTLE_MARGIN;
        if delivery.ack_deadline < Utc::now() + needed {
            match self.relay.extend(name, &[delivery.ack_id], needed).await {
                // The lease ran out while the delivery waited for a request slot: it is
                // someone else's now (or will be), so sending it would only duplicate.
                Ok(stale) if !stale.is_empty() => {
                    self.statuses.update(id, |status| {
                        status.in_flight = status.in_flight.saturating_sub(1)
                    });
                    return;
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::debug!(subscription = %name, %error, "cannot extend a push lease");
                }
            }
        }
        let now = Utc::now();
        let built = request::build(
            &delivery.event,
            push.format,
            &push.headers,
            &self.statuses.keys(id),
            now,
        );
        let started = Instant::now();
        let answer = self.client.send(&push.endpoint, built, push.timeout).await;
        let elapsed = started.elapsed();
        let (code, verdict) = match answer {
            Ok(answer) => (
                answer.status.to_string(),
                verdict(answer.status, answer.retry_after, &answer.body),
            ),
            Err(failure) => (
                failure.code().to_owned(),
                Verdict::Retry {
                    reason: failure.to_string(),
                    after: None,
                },
            ),
        };
        self.metrics.request(&code, elapsed);
        self.statuses.update(id, |status| {
            status.in_flight = status.in_flight.saturating_sub(1);
            status.count_request();
            status.last_status = code.parse().unwrap_or(0);
            match &verdict {
                Verdict::Ack => {}
                Verdict::Retry { reason, .. } | Verdict::DeadLetter { reason } => {
                    status.last_error = Some(reason.clone());
                    status.last_error_at = Some(Utc::now());
                }
                Verdict::Gone => {
                    status.last_error = Some(GONE_REASON.into());
                    status.last_error_at = Some(Utc::now());
                }
            }
        });
        if verdict == Verdict::Ack {
            // Acked in batches: one statement for many answers.
            let _ = acks.send(delivery.ack_id);
            return;
        }
        self.settle(&subscription, name, delivery, verdict).await;
    }

    async fn settle(
        &self,
        subscription: &Subscription,
        name: &SubscriptionName,
        delivery: Delivery,
        verdict: Verdict,
    ) {
        let ack_id = delivery.ack_id;
        let settled = match verdict {
            Verdict::Ack => self.relay.ack(name, &[ack_id]).await.map(|_| ()),
            Verdict::Retry { reason, after } => {
                let after = after.map(|after| after.min(subscription.settings.retry_backoff_max));
                self.relay
                    .nack(name, ack_id, &reason, after, false)
                    .await
                    .map(|_| ())
            }
            Verdict::DeadLetter { reason } => self
                .relay
                .nack(name, ack_id, &reason, None, true)
                .await
                .map(|_| ()),
            Verdict::Gone => {
                // The delivery stays unsettled: its lease goes back when the pusher
                // stops, and it is pushed again once pushing resumes.
                let store = &self.relay.sources().default_source().store;
                match store.stop_push(subscription.id, GONE_REASON).await {
                    Ok(_) => {
                        tracing::warn!(subscription = %name, "the endpoint answered 410 Gone: pushing stopped");
                        self.relay.subscription_changed(subscription.id);
                        self.stop.cancel();
                        Ok(())
                    }
                    Err(error) => Err(Error::from(error)),
                }
            }
        };
        if let Err(error) = settled {
            tracing::warn!(subscription = %name, %error, "cannot settle a push delivery; its lease will expire and it is pushed again");
        }
    }
}

const GONE_REASON: &str = "the endpoint answered 410 Gone";
/// Most acks applied in one statement.
const ACK_BATCH: usize = 500;

/// A request task's panic is its pusher's: raised again there, so the pusher restarts
/// (and says so) instead of losing a request slot and its in-flight count quietly.
fn reraise_panic(done: Result<(), tokio::task::JoinError>) {
    if let Err(error) = done
        && error.is_panic()
    {
        std::panic::resume_unwind(error.into_panic());
    }
}

/// Acks what the endpoint accepted, as many at a time as have piled up meanwhile, until
/// the pusher's requests are all done.
async fn send_acks(
    relay: Relay,
    name: SubscriptionName,
    mut accepted: mpsc::UnboundedReceiver<AckId>,
) {
    let mut batch = Vec::with_capacity(ACK_BATCH);
    while accepted.recv_many(&mut batch, ACK_BATCH).await > 0 {
        match relay.ack(&name, &batch).await {
            Ok(outcome) if !outcome.stale.is_empty() || !outcome.unavailable.is_empty() => {
                tracing::debug!(subscription = %name, stale = outcome.stale.len(), unavailable = outcome.unavailable.len(), "some push acks were not applied; those events are pushed again");
            }
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(subscription = %name, %error, "cannot ack pushed events; their leases will expire and they are pushed again");
            }
        }
        batch.clear();
    }
}

/// The settlement an HTTP answer calls for.
fn verdict(status: u16, retry_after: Option<Duration>, body: &[u8]) -> Verdict {
    let described = || {
        let shown = &body[..body.len().min(MAX_BODY_IN_ERROR)];
        let text: String = String::from_utf8_lossy(shown)
            .chars()
            .map(|c| if c == '\0' { '\u{fffd}' } else { c })
            .collect();
        let reason = http::StatusCode::from_u16(status)
            .ok()
            .and_then(|code| code.canonical_reason())
            .unwrap_or("");
        if text.is_empty() {
            format!("HTTP {status} {reason}").trim_end().to_owned()
        } else {
            format!("HTTP {status} {reason}: {text}")
        }
    };
    match status {
        200..=299 => Verdict::Ack,
        410 => Verdict::Gone,
        429 | 503 => Verdict::Retry {
            reason: described(),
            after: retry_after,
        },
        408 | 425 | 500..=599 => Verdict::Retry {
            reason: described(),
            after: None,
        },
        300..=399 => Verdict::DeadLetter {
            reason: format!("{} (redirects are not followed)", described()),
        },
        _ => Verdict::DeadLetter {
            reason: described(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_counts_the_last_minute() {
        let mut status = PushStatus::default();
        for _ in 0..30 {
            status.count_request();
        }
        assert_eq!(status.requests_total, 30);
        assert!(status.rate() > 0.0);
        // A minute later the window is empty again.
        status.advance(rate_now() + RATE_WINDOW_SECONDS as u64);
        assert_eq!(status.rate_buckets.iter().sum::<u64>(), 0);
        assert_eq!(status.requests_total, 30);
    }

    #[test]
    fn answers_map_to_settlements() {
        assert_eq!(verdict(204, None, b""), Verdict::Ack);
        assert_eq!(verdict(410, None, b""), Verdict::Gone);
        assert_eq!(
            verdict(429, Some(Duration::from_secs(2)), b""),
            Verdict::Retry {
                reason: "HTTP 429 Too Many Requests".into(),
                after: Some(Duration::from_secs(2))
            }
        );
        assert!(matches!(
            verdict(502, None, b""),
            Verdict::Retry { after: None, .. }
        ));
        assert!(matches!(verdict(408, None, b""), Verdict::Retry { .. }));
        let long = vec![b'x'; 4000];
        match verdict(400, None, &long) {
            Verdict::DeadLetter { reason } => {
                assert!(reason.starts_with("HTTP 400 Bad Request: xxx"));
                assert_eq!(reason.len(), "HTTP 400 Bad Request: ".len() + 1024);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            verdict(301, None, b""),
            Verdict::DeadLetter { .. }
        ));
    }
}
