//! Push delivery: the gateway drains a push subscription itself (see [`crate::drain`])
//! and sends each event to the subscription's HTTP endpoint as a signed CloudEvent,
//! settling it by the endpoint's answer.

pub mod request;
mod sender;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures_util::{FutureExt, StreamExt};
use tokio::{sync::mpsc, task::JoinSet};
use tokio_util::sync::CancellationToken;

pub use sender::{Answer, Failure, PushSender};

use crate::{
    delivery::Relay,
    domain::{
        AckId, AllowedHosts, Delivery, PushSecret, Subscription, SubscriptionId, SubscriptionName,
    },
    drain::{self, DrainStatus, Drains, StatusBoard, hold_leases, reraise_panic, send_acks},
    error::Error,
    metrics,
    storage::{Store, StoreError},
    tasks::{RestartDelays, TaskName, keep_running},
};

/// Longest part of a refusing endpoint's body kept in the dead letter's error.
const MAX_BODY_IN_ERROR: usize = 1024;
/// Deliveries a pusher leases per request it may have in flight.
const LEASE_AHEAD: u32 = 4;

/// Push settings of the gateway (`[push]` in the configuration file).
#[derive(Debug, Clone, Default)]
pub struct PushSettings {
    pub allowed_hosts: AllowedHosts,
    /// PEM file of extra certificate authorities trusted for https endpoints.
    pub ca_file: Option<std::path::PathBuf>,
    /// How often definitions are re-read when no change was announced here.
    pub poll_interval: Duration,
}

/// What this process knows of its push subscriptions, by subscription id: how their
/// requests fare, and the signing keys to use. Cheap to clone.
#[derive(Clone, Default)]
pub struct PushBoard {
    statuses: StatusBoard,
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

    pub fn get(&self, subscription_id: SubscriptionId) -> Option<DrainStatus> {
        self.statuses.get(subscription_id)
    }
}

/// Runs this process's pushers.
pub struct Pushers;

impl Pushers {
    /// Starts the supervisor as a relay task: it stops with the relay.
    pub fn start(
        relay: Relay,
        settings: PushSettings,
        board: PushBoard,
        client: Arc<dyn PushSender>,
    ) {
        let stop = relay.stopping();
        let poll_interval = settings.poll_interval;
        let drains = PushDrains {
            relay: relay.clone(),
            client,
            allowed_hosts: settings.allowed_hosts,
            board,
        };
        let start = {
            let relay = relay.clone();
            move || drain::supervise(relay.clone(), drains.clone(), poll_interval)
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

/// Push subscriptions as [`Drains`]: one [`Pusher`] each.
#[derive(Clone)]
struct PushDrains {
    relay: Relay,
    client: Arc<dyn PushSender>,
    allowed_hosts: AllowedHosts,
    board: PushBoard,
}

impl Drains for PushDrains {
    const TASK: &'static str = "pusher";

    async fn wanted(&self, store: &Store) -> Result<Vec<Subscription>, StoreError> {
        store.active_push_subscriptions().await
    }

    fn board(&self) -> &StatusBoard {
        &self.board.statuses
    }

    fn refresh(&self, subscription: &Subscription) {
        self.board
            .set_keys(subscription.id, subscription.push_secrets.clone());
    }

    fn forget(&self, subscription_id: SubscriptionId) {
        self.board
            .keys
            .lock()
            .expect("push keys lock")
            .remove(&subscription_id);
    }

    fn drain(
        self,
        subscription: Arc<Subscription>,
        stop: CancellationToken,
    ) -> impl Future<Output = ()> + Send + 'static {
        Pusher {
            metrics: metrics::PushRequestMetrics::new(subscription.name.as_str()),
            relay: self.relay.clone(),
            client: self.client.clone(),
            allowed_hosts: self.allowed_hosts.clone(),
            subscription,
            board: self.board.clone(),
            stop,
        }
        .run()
    }
}

/// Pushes one subscription's deliveries until stopped.
struct Pusher {
    relay: Relay,
    client: Arc<dyn PushSender>,
    allowed_hosts: AllowedHosts,
    /// As it was when the pusher started: a change of settings restarts the pusher, and
    /// signing keys come from the board.
    subscription: Arc<Subscription>,
    board: PushBoard,
    stop: CancellationToken,
    metrics: metrics::PushRequestMetrics,
}

/// What became of one request.
#[derive(Debug, Clone, PartialEq)]
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
            (self.board.statuses)
                .update(subscription.id, |status| status.failed(error.to_string()));
            self.stop.cancelled().await;
            return;
        }
        // Batches fill from what the stream holds: twice a batch per request slot.
        let in_flight = push
            .max_concurrency
            .saturating_mul(LEASE_AHEAD.max(push.max_batch_events.saturating_mul(2)));
        let Some(mut stream) = drain::open_stream(&self.relay, &name, in_flight, &self.stop).await
        else {
            return;
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
        let mut batcher = Batcher::new(&push);
        loop {
            let first = match batcher.carried.take() {
                Some(delivery) => delivery,
                None => tokio::select! {
                    _ = this.stop.cancelled() => break,
                    item = stream.next() => match item {
                        Some(Ok(delivery)) => delivery,
                        Some(Err(error)) => {
                            tracing::debug!(subscription = %name, %error, "push stream ended");
                            break;
                        }
                        None => break,
                    },
                },
            };
            let (batch, stream_ended) = batcher.fill(first, &mut stream, &this.stop).await;
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
                pusher.push(batch, acks).await;
                drop(permit);
            });
            while let Some(done) = requests.try_join_next() {
                reraise_panic(done);
            }
            if stream_ended {
                break;
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

    /// Sends one request with the deliveries of `batch` (one, unless the subscription
    /// batches) and settles them by the answer.
    async fn push(self: Arc<Self>, batch: Vec<Delivery>, acks: mpsc::UnboundedSender<AckId>) {
        let subscription = self.snapshot();
        let Some(push) = subscription.settings.push.as_ref() else {
            return;
        };
        let name = &subscription.name;
        let id = subscription.id;
        let statuses = &self.board.statuses;
        let count = batch.len() as u64;
        statuses.update(id, |status| status.in_flight += count);
        // The request holds the leases for its whole timeout; one already lost (settled
        // elsewhere) is left out.
        let holds = hold_leases(&self.relay, name, &batch, push.timeout).await;
        let mut held: Vec<Delivery> = batch
            .into_iter()
            .zip(holds)
            .filter_map(|(delivery, held)| held.then_some(delivery))
            .collect();
        let lost = count - held.len() as u64;
        statuses.update(id, |status| {
            status.in_flight = status.in_flight.saturating_sub(lost)
        });
        if held.is_empty() {
            return;
        }
        let count = held.len() as u64;
        let now = chrono::Utc::now();
        let keys = self.board.keys(id);
        let built = if push.batched() {
            let events: Vec<&crate::domain::Event> = held.iter().map(|d| &d.event).collect();
            request::build_batch(&events, &push.headers, &keys, now)
        } else {
            request::build(&held[0].event, push.format, &push.headers, &keys, now)
        };
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
        statuses.update(id, |status| {
            status.in_flight = status.in_flight.saturating_sub(count);
            status.count_send(verdict == Verdict::Ack);
            status.last_status = code.parse().unwrap_or(0);
            match &verdict {
                Verdict::Ack => {}
                Verdict::Retry { reason, .. } | Verdict::DeadLetter { reason } => {
                    status.failed(reason.clone());
                }
                Verdict::Gone => status.failed(GONE_REASON.into()),
            }
        });
        if verdict == Verdict::Ack {
            // Acked in batches: one statement for many answers.
            for delivery in held {
                let _ = acks.send(delivery.ack_id);
            }
            return;
        }
        if verdict == Verdict::Gone {
            // Stopping pushing once is enough; the deliveries stay unsettled.
            self.settle(&subscription, name, held.swap_remove(0), verdict)
                .await;
            return;
        }
        for delivery in held {
            self.settle(&subscription, name, delivery, verdict.clone())
                .await;
        }
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
                let store = &self.relay.sources().default_source().store;
                let stopped = match store.stop_push(subscription.id, GONE_REASON).await {
                    Ok(_) => {
                        tracing::warn!(subscription = %name, "the endpoint answered 410 Gone: pushing stopped");
                        self.relay.subscription_changed(subscription.id);
                        self.stop.cancel();
                        Ok(())
                    }
                    Err(error) => Err(Error::from(error)),
                };
                // Given back with the answer as its last error (the pusher's stop gives
                // back the others), due after the subscription's backoff: not at once,
                // or the stream, still open until this request ends, could take it again
                // and give it back as merely unsettled. Pushed again once pushing
                // resumes.
                if let Err(error) = self
                    .relay
                    .nack(name, ack_id, GONE_REASON, None, false)
                    .await
                {
                    tracing::debug!(subscription = %name, %error, "cannot give back the delivery the endpoint refused; its lease is given back with the pusher's");
                }
                stopped
            }
        };
        if let Err(error) = settled {
            tracing::warn!(subscription = %name, %error, "cannot settle a push delivery; its lease will expire and it is pushed again");
        }
    }
}

const GONE_REASON: &str = "the endpoint answered 410 Gone";

/// Gathers the deliveries of one request: up to `max_batch_events` and
/// `max_batch_bytes`, waiting up to `max_batch_wait` for them once it has the first.
struct Batcher {
    max_events: usize,
    max_bytes: u64,
    wait: Duration,
    /// A delivery that did not fit the last batch: it starts the next.
    carried: Option<Delivery>,
}

impl Batcher {
    fn new(push: &crate::domain::PushConfig) -> Batcher {
        Batcher {
            max_events: push.max_batch_events.max(1) as usize,
            max_bytes: push.max_batch_bytes,
            wait: push.max_batch_wait,
            carried: None,
        }
    }

    /// The batch that starts with `first`, and whether the stream ended (or the pusher
    /// was stopped) meanwhile: the batch still goes.
    async fn fill(
        &mut self,
        first: Delivery,
        stream: &mut crate::delivery::DeliveryStream,
        stop: &CancellationToken,
    ) -> (Vec<Delivery>, bool) {
        let mut bytes = first.size();
        let mut batch = vec![first];
        let deadline = tokio::time::Instant::now() + self.wait;
        while batch.len() < self.max_events && bytes < self.max_bytes {
            // What is ready now, then what arrives before the deadline.
            let next = match stream.next().now_or_never() {
                Some(item) => item,
                None if self.wait.is_zero() => break,
                None => tokio::select! {
                    _ = stop.cancelled() => return (batch, true),
                    _ = tokio::time::sleep_until(deadline) => break,
                    item = stream.next() => item,
                },
            };
            let delivery = match next {
                Some(Ok(delivery)) => delivery,
                Some(Err(_)) | None => return (batch, true),
            };
            if bytes + delivery.size() > self.max_bytes {
                self.carried = Some(delivery);
                break;
            }
            bytes += delivery.size();
            batch.push(delivery);
        }
        (batch, false)
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
