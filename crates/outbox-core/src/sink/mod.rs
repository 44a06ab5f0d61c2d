//! Sink delivery: the gateway drains a sink subscription itself (see [`crate::drain`])
//! and publishes each event into a broker — NATS JetStream, or Kafka — through a
//! [`SinkClient`] the gateway provides, settling a delivery only once the broker
//! confirmed it durably.
//!
//! The sinks themselves (broker connections) are the operator's: named in the
//! configuration file and gathered in a [`SinkCatalog`]; a subscription refers to one by
//! name, so an API caller can never point the gateway at a host of its choosing.

pub mod message;

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use futures_util::{StreamExt, future::BoxFuture, stream::FuturesUnordered};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

pub use message::SinkMessage;

use crate::{
    delivery::Relay,
    domain::{AckId, Delivery, SinkConfig, SinkKind, Subscription},
    drain::{self, Drains, StatusBoard, hold_lease, send_acks},
    error::{Error, Result},
    metrics,
    storage::{Store, StoreError},
    tasks::{RestartDelays, TaskName, keep_running},
};

/// Longest wait for the broker's confirmation of one message.
pub const SINK_TIMEOUT: Duration = Duration::from_secs(10);
/// Deliveries one sinker holds at once: messages awaiting the broker's confirmation,
/// and acks awaiting their statement. Pipelining is what makes a broker fast.
const SINK_IN_FLIGHT: u32 = 1000;
/// Longest part of a broker's refusal kept as a retry's or dead letter's error.
const MAX_REASON_CHARS: usize = 1024;

/// Why a message was not confirmed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SinkFailure {
    /// Worth retrying: the broker is unreachable, slow, or said to try again.
    #[error("{0}")]
    Transient(String),
    /// Would fail every time: no stream or topic takes it, it is too large, or the
    /// gateway may not publish there.
    #[error("{0}")]
    Permanent(String),
}

/// A broker connection of the gateway's configuration.
pub trait SinkClient: Send + Sync + 'static {
    fn kind(&self) -> SinkKind;

    /// Sends one message and waits until the broker confirmed it durably (JetStream's
    /// PubAck; Kafka's acks=all), within [`SINK_TIMEOUT`].
    fn send(
        &self,
        message: SinkMessage,
    ) -> BoxFuture<'static, std::result::Result<(), SinkFailure>>;

    /// Whether the broker answers now; why not otherwise.
    fn check(&self) -> BoxFuture<'static, std::result::Result<(), String>>;
}

/// The gateway's sinks, by name, with what the last check of each broker found. Cheap
/// to clone.
#[derive(Clone, Default)]
pub struct SinkCatalog {
    sinks: Arc<BTreeMap<String, Arc<dyn SinkClient>>>,
    /// By sink name: the last [`SinkCatalog::statuses`] answer (none before the first).
    last_checks: Arc<Mutex<BTreeMap<String, std::result::Result<(), String>>>>,
}

impl SinkCatalog {
    pub fn new(sinks: impl IntoIterator<Item = (String, Arc<dyn SinkClient>)>) -> Self {
        SinkCatalog {
            sinks: Arc::new(sinks.into_iter().collect()),
            last_checks: Arc::default(),
        }
    }

    /// Why the last check found the broker of `sink` unreachable; `None` when it
    /// answered, or was not checked yet.
    pub fn unreachable(&self, sink: &str) -> Option<String> {
        self.last_checks
            .lock()
            .expect("sink checks lock")
            .get(sink)
            .and_then(|outcome| outcome.clone().err())
    }

    /// Whether each checked sink's broker answered its last check, by sink name.
    pub fn last_checks(&self) -> Vec<(String, bool)> {
        self.last_checks
            .lock()
            .expect("sink checks lock")
            .iter()
            .map(|(name, outcome)| (name.clone(), outcome.is_ok()))
            .collect()
    }

    pub fn get(&self, name: &str) -> Option<&Arc<dyn SinkClient>> {
        self.sinks.get(name)
    }

    /// Every sink by name, in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Arc<dyn SinkClient>)> {
        self.sinks
            .iter()
            .map(|(name, client)| (name.as_str(), client))
    }

    /// Every sink, in name order, with whether its broker answers now (checked at once,
    /// and kept for [`SinkCatalog::unreachable`]).
    pub async fn statuses(&self) -> Vec<SinkStatus> {
        let checks = self.iter().map(|(name, client)| {
            let (name, kind, check) = (name.to_owned(), client.kind(), client.check());
            async move {
                SinkStatus {
                    name,
                    kind,
                    reachable: check.await,
                }
            }
        });
        let statuses = futures_util::future::join_all(checks).await;
        let mut last_checks = self.last_checks.lock().expect("sink checks lock");
        for status in &statuses {
            last_checks.insert(status.name.clone(), status.reachable.clone());
        }
        drop(last_checks);
        statuses
    }

    /// Checks that the sink settings in the request field `prefix` name a sink of this
    /// gateway and fit its kind.
    pub fn check(&self, prefix: &str, config: &SinkConfig) -> Result<()> {
        let Some(client) = self.get(&config.name) else {
            let known: Vec<&str> = self.sinks.keys().map(String::as_str).collect();
            return Err(Error::invalid(
                format!("{prefix}.name"),
                if known.is_empty() {
                    format!(
                        "{:?} is not a sink of this gateway: it has none (`[[sinks]]` in its configuration file)",
                        config.name
                    )
                } else {
                    format!(
                        "{:?} is not a sink of this gateway; its sinks are {}",
                        config.name,
                        known.join(", ")
                    )
                },
            ));
        };
        Ok(config.check_kind(prefix, client.kind())?)
    }
}

/// A sink as operators see it.
#[derive(Debug, Clone)]
pub struct SinkStatus {
    pub name: String,
    pub kind: SinkKind,
    /// Why the broker cannot be reached, when it cannot.
    pub reachable: std::result::Result<(), String>,
}

/// Runs this process's sinkers.
pub struct Sinkers;

impl Sinkers {
    /// Starts the supervisor as a relay task: it stops with the relay. `poll_interval`:
    /// how often definitions are re-read when no change was announced here.
    pub fn start(relay: Relay, catalog: SinkCatalog, board: StatusBoard, poll_interval: Duration) {
        let stop = relay.stopping();
        let drains = SinkDrains {
            relay: relay.clone(),
            catalog,
            board,
        };
        let start = {
            let relay = relay.clone();
            move || drain::supervise(relay.clone(), drains.clone(), poll_interval)
        };
        relay.track(keep_running(
            TaskName::single("sink_supervisor"),
            RestartDelays::default(),
            stop,
            start,
            |_| {},
        ));
    }
}

/// Sink subscriptions as [`Drains`]: one [`Sinker`] each.
#[derive(Clone)]
struct SinkDrains {
    relay: Relay,
    catalog: SinkCatalog,
    board: StatusBoard,
}

impl Drains for SinkDrains {
    const TASK: &'static str = "sinker";

    async fn wanted(&self, store: &Store) -> std::result::Result<Vec<Subscription>, StoreError> {
        store.sink_subscriptions().await
    }

    fn board(&self) -> &StatusBoard {
        &self.board
    }

    fn drain(
        self,
        subscription: Arc<Subscription>,
        stop: CancellationToken,
    ) -> impl Future<Output = ()> + Send + 'static {
        let sink = subscription
            .settings
            .sink
            .as_ref()
            .map_or_else(String::new, |sink| sink.name.clone());
        Sinker {
            metrics: metrics::SinkMetrics::new(subscription.name.as_str(), &sink),
            relay: self.relay.clone(),
            catalog: self.catalog.clone(),
            subscription,
            board: self.board.clone(),
            stop,
        }
        .run()
    }
}

/// Publishes one subscription's deliveries until stopped.
struct Sinker {
    relay: Relay,
    catalog: SinkCatalog,
    /// As it was when the sinker started: a change of settings restarts it.
    subscription: Arc<Subscription>,
    board: StatusBoard,
    stop: CancellationToken,
    metrics: metrics::SinkMetrics,
}

impl Sinker {
    async fn run(self) {
        let subscription = self.subscription.clone();
        let Some(config) = subscription.settings.sink.clone() else {
            return;
        };
        let name = subscription.name.clone();
        let Some(client) = self.catalog.get(&config.name).cloned() else {
            // The operator removed the sink from the configuration since the
            // subscription was made: its events wait, and stats say why.
            let reason = format!(
                "sink {:?} is not in this gateway's configuration: nothing is sent",
                config.name
            );
            tracing::warn!(subscription = %name, "{reason}");
            self.board
                .update(subscription.id, |status| status.failed(reason));
            self.stop.cancelled().await;
            return;
        };
        if let Err(error) = config.check_kind("sink", client.kind()) {
            let reason = format!("not sending: {error}");
            tracing::warn!(subscription = %name, "{reason}");
            self.board
                .update(subscription.id, |status| status.failed(reason));
            self.stop.cancelled().await;
            return;
        }
        let Some(mut stream) =
            drain::open_stream(&self.relay, &name, SINK_IN_FLIGHT, &self.stop).await
        else {
            return;
        };
        tracing::info!(subscription = %name, sink = %config.name, "sending to the sink");
        // The sends run on this task, not one task each: a message costs the broker
        // client little CPU, and a task per message would cost more than that.
        let mut sends = FuturesUnordered::new();
        let (acks, acks_to_send) = mpsc::unbounded_channel();
        let acker = tokio::spawn(send_acks(self.relay.clone(), name.clone(), acks_to_send));
        let this = Arc::new(self);
        loop {
            tokio::select! {
                _ = this.stop.cancelled() => break,
                Some(()) = sends.next(), if !sends.is_empty() => {}
                item = stream.next() => match item {
                    // The stream holds at most SINK_IN_FLIGHT deliveries unsettled,
                    // which bounds the sends at once.
                    Some(Ok(delivery)) => {
                        sends.push(this.clone().send(client.clone(), delivery, acks.clone()));
                    }
                    Some(Err(error)) => {
                        tracing::debug!(subscription = %name, %error, "sink stream ended");
                        break;
                    }
                    None => break,
                },
            }
        }
        // Settle what is in flight before the stream (and with it the leases) goes.
        while sends.next().await.is_some() {}
        drop(acks);
        let _ = acker.await;
        drop(stream);
        tracing::info!(subscription = %name, "stopped sending to the sink");
    }

    /// Publishes one delivery and settles it by the broker's answer.
    async fn send(
        self: Arc<Self>,
        client: Arc<dyn SinkClient>,
        delivery: Delivery,
        acks: mpsc::UnboundedSender<AckId>,
    ) {
        let subscription = &self.subscription;
        let Some(config) = subscription.settings.sink.as_ref() else {
            return;
        };
        let (id, name) = (subscription.id, &subscription.name);
        self.board.update(id, |status| status.in_flight += 1);
        if !hold_lease(&self.relay, name, &delivery, SINK_TIMEOUT).await {
            self.board.update(id, |status| {
                status.in_flight = status.in_flight.saturating_sub(1)
            });
            return;
        }
        let started = std::time::Instant::now();
        let outcome = match message::build(&delivery.event, name, config, client.kind()) {
            Ok(message) => client.send(message).await,
            Err(reason) => Err(SinkFailure::Permanent(reason)),
        };
        let outcome_label = match &outcome {
            Ok(()) => "confirmed",
            Err(SinkFailure::Transient(_)) => "retried",
            Err(SinkFailure::Permanent(_)) => "refused",
        };
        self.metrics.message(outcome_label, started.elapsed());
        self.board.update(id, |status| {
            status.in_flight = status.in_flight.saturating_sub(1);
            status.count_send(outcome.is_ok());
            if let Err(failure) = &outcome {
                status.failed(failure.to_string());
            }
        });
        let (reason, dead_letter) = match outcome {
            Ok(()) => {
                // Acked in batches: one statement for many confirmations.
                let _ = acks.send(delivery.ack_id);
                return;
            }
            Err(SinkFailure::Transient(reason)) => (reason, false),
            Err(SinkFailure::Permanent(reason)) => (reason, true),
        };
        let reason: String = reason
            .chars()
            .take(MAX_REASON_CHARS)
            .map(|c| if c == '\0' { '\u{fffd}' } else { c })
            .collect();
        // A refusal dead-letters by the subscription's rules: a persistent event type
        // keeps retrying at the capped backoff instead.
        // Boxed like `hold_lease`'s extension: a large future, needed only on failure.
        let nacked = Box::pin(
            self.relay
                .nack(name, delivery.ack_id, &reason, None, dead_letter),
        );
        if let Err(error) = nacked.await {
            tracing::warn!(subscription = %name, %error, "cannot settle a sink delivery; its lease will expire and it is sent again");
        }
    }
}
