//! Consumers: several Subscribe streams per subscription, spread over the gateways and
//! reconnecting to any live one, settling each delivery after a short random delay —
//! mostly acks, sometimes a nack with a short `retry_after`, now and then nothing at all
//! (the lease runs out); on the dead-letter subscription they nack the poison events
//! every time and ack the others. They use the raw gRPC stubs so that the [`Journal`]
//! records exactly when each delivery arrived and how each ack and nack was answered.
//! The push subscription has no streams: the push receiver journals its requests. The
//! exactly-once subscription's streams are read by the consumers of [`exactly_once`],
//! which consume in transactions instead of acking.

use std::{
    collections::{HashMap, HashSet},
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use anyhow::Context;
use chrono::{DateTime, Utc};
use outbox_client::proto::{self, admin_client::AdminClient, subscriber_client::SubscriberClient};
use rand::{Rng, SeedableRng, rngs::StdRng};
use tokio::{
    sync::mpsc,
    task::JoinSet,
    time::{Instant, timeout},
};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::{
    check::Violation,
    cluster::Cluster,
    database::{ChaosDatabase, Unsettled},
    exactly_once::{self, Consumption},
    ledger::{Ledger, Published},
};

/// Longest an Ack or Nack call may take before it counts as failed.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Deliveries a stream may hold at once.
const MAX_IN_FLIGHT: u32 = 16;
/// Acks are sent in batches of at most this many, at least every `ACK_FLUSH`.
const ACK_BATCH: usize = 50;
const ACK_FLUSH: Duration = Duration::from_millis(15);

/// A subscription of the run and how its consumers behave.
#[derive(Debug, Clone)]
pub struct SubscriptionSpec {
    pub name: &'static str,
    /// Event-type patterns; empty for every event.
    pub event_types: &'static [&'static str],
    pub ordered: bool,
    /// Competing streams, spread over the gateways.
    pub streams: usize,
    pub ack_deadline: Duration,
    /// Whether consumers sometimes leave a delivery unsettled until its lease expires.
    pub forgets: bool,
    /// What else the subscription exercises.
    pub role: Role,
}

/// The feature a subscription exercises besides plain delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Nothing else.
    Plain,
    /// A small `max_attempts` and `dead_letter_expired`; its consumers nack the events
    /// [`is_poison`] chooses every time, and an operator requeues some dead letters.
    DeadLetters,
    /// An operator seeks it back in time during the run.
    Seek,
    /// An operator pauses it twice during the run: resumed by a call, and by `until`.
    Pause,
    /// Pushed by the gateways to the run's HTTP receiver; no streams.
    Push,
    /// Consumed with `outbox_consume` in transactions of the run's database, with a side
    /// effect and some reaction events, and never acked ([`exactly_once`]).
    ExactlyOnce,
}

/// `max_attempts` of the dead-letter subscription.
pub const DEAD_LETTER_MAX_ATTEMPTS: u32 = 3;
/// The reason its consumers give when they nack a poison event.
pub const POISON_REASON: &str = "chaos: poison event";

/// Whether the consumers of the dead-letter subscription fail on this event every time
/// (a quarter of the events, chosen by the random bits of the id).
pub fn is_poison(event: Uuid) -> bool {
    event.as_bytes()[15].is_multiple_of(4)
}

/// Whether a poison event is dead-lettered by its first nack (`dead_letter = true`)
/// rather than after `max_attempts` nacks.
fn dead_letter_at_once(event: Uuid) -> bool {
    event.as_bytes()[15].is_multiple_of(8)
}

/// Whether `event_type` matches `pattern`, `*` standing for one dot-separated segment (the
/// only wildcard the run's subscriptions use). Written here rather than taken from the
/// gateway: the check must not share the code it checks.
fn matches_pattern(pattern: &str, event_type: &str) -> bool {
    let mut patterns = pattern.split('.');
    let mut segments = event_type.split('.');
    loop {
        match (patterns.next(), segments.next()) {
            (None, None) => return true,
            (Some("*"), Some(_)) => {}
            (Some(expected), Some(segment)) if expected == segment => {}
            _ => return false,
        }
    }
}

impl SubscriptionSpec {
    pub fn all() -> Vec<SubscriptionSpec> {
        let spec = |name, event_types: &'static [&'static str], ordered, streams, forgets, role| {
            SubscriptionSpec {
                name,
                event_types,
                ordered,
                streams,
                ack_deadline: Duration::from_secs(if ordered { 5 } else { 3 }),
                forgets,
                role,
            }
        };
        // The subscriptions of the features each take one event type, so they add
        // little load.
        vec![
            spec("chaos-all", &[], false, 6, true, Role::Plain),
            spec("chaos-ordered", &[], true, 3, false, Role::Plain),
            spec("chaos-orders", &["order.*"], false, 3, true, Role::Plain),
            spec(
                "chaos-dead",
                &["invoice.issued"],
                false,
                2,
                false,
                Role::DeadLetters,
            ),
            spec("chaos-seek", &["order.paid"], false, 2, true, Role::Seek),
            spec(
                "chaos-paused",
                &["order.created"],
                false,
                2,
                true,
                Role::Pause,
            ),
            spec(
                "chaos-push",
                &["shipment.sent.eu"],
                false,
                0,
                false,
                Role::Push,
            ),
            // Two event types (and no reactions, which only the unfiltered subscriptions
            // take): enough events to crash on, fewer than every event.
            spec(
                "chaos-exactly-once",
                &["order.created", "invoice.issued"],
                false,
                3,
                false,
                Role::ExactlyOnce,
            ),
        ]
    }

    /// Deliveries before an event is dead-lettered; 0 for never.
    pub fn max_attempts(&self) -> u32 {
        match self.role {
            Role::DeadLetters => DEAD_LETTER_MAX_ATTEMPTS,
            _ => 0,
        }
    }

    /// Whether expired events go to its dead-letter queue rather than being dropped.
    pub fn dead_letter_expired(&self) -> bool {
        self.role == Role::DeadLetters
    }

    /// Whether an event of this type belongs to the subscription.
    pub fn matches(&self, event_type: &str) -> bool {
        self.event_types.is_empty()
            || self
                .event_types
                .iter()
                .any(|pattern| matches_pattern(pattern, event_type))
    }

    /// Creates the subscription from the earliest event; a push subscription sends to
    /// `push_endpoint`.
    pub async fn create(&self, cluster: &Cluster, push_endpoint: &str) -> anyhow::Result<()> {
        let subscription = proto::Subscription {
            name: self.name.into(),
            event_types: self.event_types.iter().map(|t| t.to_string()).collect(),
            start: Some(proto::StartPosition {
                position: Some(proto::start_position::Position::Boundary(
                    proto::Boundary::Earliest as i32,
                )),
            }),
            ack_deadline: prost_types::Duration::try_from(self.ack_deadline).ok(),
            max_attempts: Some(self.max_attempts()),
            dead_letter_expired: self.dead_letter_expired(),
            push: (self.role == Role::Push).then(|| proto::PushConfig {
                endpoint: push_endpoint.to_owned(),
                // Shorter than the default, so that a push lost with a killed gateway is
                // sent again within the run.
                timeout: Some(prost_types::Duration {
                    seconds: 2,
                    nanos: 0,
                }),
                ..Default::default()
            }),
            retry_backoff_min: Some(prost_types::Duration {
                seconds: 0,
                nanos: 100_000_000,
            }),
            retry_backoff_max: Some(prost_types::Duration {
                seconds: 1,
                nanos: 0,
            }),
            ordered: self.ordered,
            ..Default::default()
        };
        AdminClient::new(cluster.channel(0))
            .create_subscription(proto::CreateSubscriptionRequest {
                subscription: Some(subscription),
                validate_only: false,
            })
            .await
            .with_context(|| format!("cannot create subscription {}", self.name))?;
        Ok(())
    }
}

/// One delivery as a consumer received it.
#[derive(Debug, Clone)]
pub struct Received {
    /// Index into the journal's subscriptions.
    pub subscription: usize,
    pub event: Uuid,
    /// `aggregate_type/aggregate_id`.
    pub aggregate: String,
    pub event_type: String,
    pub version: Option<i64>,
    pub attempt: u32,
    pub ack_id: String,
    pub at: Instant,
    /// The arrival by the clock the gateways and PostgreSQL share with this machine, to
    /// compare with `deliver_at` and `expires_at`.
    pub wall: DateTime<Utc>,
    /// When the event was written, as the gateway has it (a seek to a time replays the
    /// events written at or after it).
    pub created_at: Option<DateTime<Utc>>,
    /// The event's expiry, as delivered.
    pub expires_at: Option<DateTime<Utc>>,
    pub stream: u64,
    pub gateway: usize,
}

/// What a stream's reader passes on: a delivery with the moments it arrived, or how the
/// stream ended.
type Arrival = Result<(proto::Delivery, Instant, DateTime<Utc>), String>;

/// A Subscribe stream a consumer reads, journaled. A task of its own reads the stream
/// and timestamps each delivery as it comes off the connection: a consumer busy with
/// the previous one (stalled past its lease, on purpose) must not make a delivery look
/// later than the gateway sent it. Dropping it ends the stream.
pub struct JournaledStream {
    arrivals: mpsc::UnboundedReceiver<Arrival>,
    pub id: u64,
    gateway: usize,
    /// The subscription's index in the run's list.
    subscription: usize,
}

impl JournaledStream {
    /// Opens a stream of `subscription` (its index and name) on `gateway` and journals
    /// it; `None` when the call failed (counted) or the run stopped first.
    pub async fn open(
        cluster: &Cluster,
        gateway: usize,
        subscription: (usize, &str),
        max_in_flight: u32,
        journal: &Journal,
        stop: &CancellationToken,
    ) -> Option<JournaledStream> {
        let mut client = SubscriberClient::new(cluster.channel(gateway));
        let request = proto::SubscribeRequest {
            subscription: subscription.1.into(),
            max_in_flight,
            ..Default::default()
        };
        let opened = tokio::select! {
            opened = timeout(CALL_TIMEOUT, client.subscribe(request)) => opened,
            _ = stop.cancelled() => return None,
        };
        match opened {
            Ok(Ok(response)) => Some(JournaledStream {
                arrivals: read_arrivals(response.into_inner()),
                id: journal.stream_opened(),
                gateway,
                subscription: subscription.0,
            }),
            _ => {
                journal.state().subscribe_failures += 1;
                None
            }
        }
    }

    /// The next delivery, journaled as it arrives; or how the stream ended (`stopped`
    /// when the run stops first).
    pub async fn next(
        &mut self,
        journal: &Journal,
        stop: &CancellationToken,
    ) -> Result<Received, String> {
        let arrival = tokio::select! {
            arrival = self.arrivals.recv() => arrival,
            _ = stop.cancelled() => return Err("stopped".to_owned()),
        };
        let (delivery, at, wall) = arrival.unwrap_or_else(|| Err("closed".to_owned()))?;
        let received = Received::arrived(
            self.subscription,
            delivery,
            (at, wall),
            self.id,
            self.gateway,
        );
        journal.state().received.push(received.clone());
        Ok(received)
    }
}

/// Reads `stream` until it ends or the receiver is dropped, timestamping each delivery.
fn read_arrivals(
    mut stream: tonic::Streaming<proto::Delivery>,
) -> mpsc::UnboundedReceiver<Arrival> {
    let (sender, arrivals) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let message = tokio::select! {
                message = stream.message() => message,
                // The consumer let the stream go: close it.
                _ = sender.closed() => return,
            };
            let arrival = match message {
                Ok(Some(delivery)) => Ok((delivery, Instant::now(), Utc::now())),
                Ok(None) => Err("closed".to_owned()),
                Err(status) => Err(format!("{:?}", status.code())),
            };
            let ended = arrival.is_err();
            if sender.send(arrival).is_err() || ended {
                return;
            }
        }
    });
    arrivals
}

impl Received {
    /// A delivery of `subscription` that came off stream `stream` of `gateway` at `at`
    /// (`wall` by the shared clock).
    pub fn arrived(
        subscription: usize,
        delivery: proto::Delivery,
        (at, wall): (Instant, DateTime<Utc>),
        stream: u64,
        gateway: usize,
    ) -> Received {
        let event = delivery.event.unwrap_or_default();
        Received {
            subscription,
            event: event.id.parse().unwrap_or_default(),
            aggregate: format!("{}/{}", event.aggregate_type, event.aggregate_id),
            event_type: event.event_type,
            version: event.aggregate_version,
            attempt: delivery.attempt,
            ack_id: delivery.ack_id,
            at,
            wall,
            created_at: event.created_at.and_then(date_time),
            expires_at: event.expires_at.and_then(date_time),
            stream,
            gateway,
        }
    }
}

/// One request of a push subscription as the run's HTTP receiver got it.
#[derive(Debug, Clone)]
pub struct Pushed {
    pub event: Uuid,
    pub event_type: String,
    pub at: Instant,
    pub wall: DateTime<Utc>,
    /// What the receiver answered.
    pub status: u16,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettleKind {
    Ack,
    Nack,
}

/// How the gateway answered an ack or a nack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Answered OK and not stale: the lease was live when it was applied.
    Applied,
    /// Stale (`stale_ack_ids`, or FAILED_PRECONDITION for a nack): nothing changed.
    Stale,
    /// The call failed: it may or may not have been applied.
    Failed(String),
}

/// One ack or nack of one delivery.
#[derive(Debug, Clone)]
pub struct Settlement {
    pub kind: SettleKind,
    /// The gateway the call went to.
    pub gateway: usize,
    pub sent: Instant,
    pub answered: Instant,
    pub answer: Answer,
}

/// Everything the consumers saw, for the checks.
pub struct Journal {
    pub specs: Vec<SubscriptionSpec>,
    state: Mutex<JournalState>,
    next_stream: AtomicU64,
}

#[derive(Debug, Default)]
pub struct JournalState {
    /// In order of arrival.
    pub received: Vec<Received>,
    /// By ack id.
    pub settlements: HashMap<String, Vec<Settlement>>,
    /// `(subscription, event)` pairs with an ack answered OK.
    pub acked: HashSet<(usize, Uuid)>,
    /// Pairs with an ack whose call failed (it may have been applied).
    pub ack_failed: HashSet<(usize, Uuid)>,
    pub streams_opened: u64,
    pub subscribe_failures: u64,
    /// Streams that ended with an error, by gRPC code (or "closed").
    pub stream_ends: HashMap<String, u64>,
    /// When each stream ended, by stream id.
    pub stream_ended_at: HashMap<u64, Instant>,
    pub forgotten: u64,
    /// Settlements applied by a gateway other than the one whose stream received the
    /// delivery.
    pub settled_elsewhere: u64,
    /// Requests of the push subscription, in order of arrival.
    pub pushed: Vec<Pushed>,
    /// Events of the push subscription the receiver answered with a 2xx.
    pub pushed_ok: HashSet<Uuid>,
    /// Pairs acked before a seek that the seek must deliver again, with when the seek
    /// was sent; their acks no longer count as settling them.
    pub replay_expected: HashMap<(usize, Uuid), Instant>,
    /// Nacks applied on the dead-letter subscription, poison or not.
    pub poison_nacks: u64,
    /// The consuming transactions of the exactly-once subscription, in order.
    pub consumptions: Vec<Consumption>,
    /// Events of the exactly-once subscription that a committed transaction consumed:
    /// its `outbox_consume` returned true, or false (an earlier one had).
    pub consumed: HashSet<Uuid>,
    /// Answers that broke a promise of the API as they came in.
    pub violations: Vec<Violation>,
}

impl Journal {
    pub fn new(specs: Vec<SubscriptionSpec>) -> Journal {
        Journal {
            specs,
            state: Mutex::new(JournalState::default()),
            next_stream: AtomicU64::new(0),
        }
    }

    pub fn state(&self) -> MutexGuard<'_, JournalState> {
        self.state.lock().expect("journal lock")
    }

    /// Counts a stream opened and gives it its id.
    pub fn stream_opened(&self) -> u64 {
        self.state().streams_opened += 1;
        self.next_stream.fetch_add(1, Ordering::Relaxed)
    }

    /// Records how and when stream `stream` ended.
    pub fn stream_ended(&self, stream: u64, end: String) {
        let mut state = self.state();
        *state.stream_ends.entry(end).or_default() += 1;
        state.stream_ended_at.insert(stream, Instant::now());
    }

    fn record_settlement(&self, received: &Received, settlement: Settlement) {
        let mut state = self.state();
        let pair = (received.subscription, received.event);
        if settlement.answer == Answer::Applied && settlement.gateway != received.gateway {
            state.settled_elsewhere += 1;
        }
        if settlement.kind == SettleKind::Ack {
            match settlement.answer {
                Answer::Applied => {
                    state.acked.insert(pair);
                }
                Answer::Failed(_) => {
                    state.ack_failed.insert(pair);
                }
                Answer::Stale => {}
            }
        }
        state
            .settlements
            .entry(received.ack_id.clone())
            .or_default()
            .push(settlement);
    }

    /// `(subscription, event)` pairs still to be settled (see [`is_settled`]), counted
    /// per subscription.
    pub fn outstanding(&self, ledger: &Ledger, unsettled: &Unsettled) -> Vec<usize> {
        let ledger = ledger.state();
        let state = self.state();
        let now = Utc::now();
        let mut outstanding = vec![0; self.specs.len()];
        for event in ledger.committed.values() {
            for (index, spec) in self.specs.iter().enumerate() {
                if spec.matches(&event.event_type)
                    && !is_settled(&state, unsettled, index, spec, event, now)
                {
                    outstanding[index] += 1;
                }
            }
        }
        outstanding
    }

    /// After a seek to `not_before` sent at `seek_sent`: the pairs of `subscription`
    /// written at or after that time, acked before the seek was sent and not delivered
    /// since, must be delivered again; they no longer count as acked until they are.
    /// Events that expire are left out (the replay may find them expired). Returns how
    /// many pairs are expected.
    pub fn expect_replay(
        &self,
        subscription: usize,
        seek_sent: Instant,
        not_before: DateTime<Utc>,
    ) -> usize {
        let mut state = self.state();
        let mut acked_before = HashSet::new();
        let mut touched_since = HashSet::new();
        for received in &state.received {
            if received.subscription != subscription {
                continue;
            }
            let pair = (subscription, received.event);
            if received.at >= seek_sent {
                touched_since.insert(pair);
            }
            for settlement in state
                .settlements
                .get(&received.ack_id)
                .into_iter()
                .flatten()
            {
                if settlement.kind == SettleKind::Ack && settlement.answer == Answer::Applied {
                    if settlement.answered < seek_sent {
                        acked_before.insert(pair);
                    } else {
                        touched_since.insert(pair);
                    }
                }
            }
        }
        let replayed: Vec<(usize, Uuid)> = (state.received.iter())
            .filter(|received| {
                received.subscription == subscription
                    && received.expires_at.is_none()
                    && received.created_at.is_some_and(|at| at >= not_before)
            })
            .map(|received| (subscription, received.event))
            .filter(|pair| acked_before.contains(pair) && !touched_since.contains(pair))
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        for pair in &replayed {
            state.acked.remove(pair);
            state.ack_failed.remove(pair);
            state.replay_expected.insert(*pair, seek_sent);
        }
        replayed.len()
    }

    pub fn violation(&self, violation: Violation) {
        self.state().violations.push(violation);
    }
}

/// Whether the pair needs nothing more from the consumers:
/// - acked: an ack answered OK, or an ack whose call failed and whose delivery record is
///   gone (the ack was applied: on a subscription that never dead-letters nothing else
///   removes a record of an event that does not expire);
/// - dead-lettered, on the subscription that dead-letters;
/// - expired with no record left, on the subscriptions that drop expired events;
/// - on the push subscription: answered 2xx by the receiver (or expired) and no record
///   left, so the gateway took the answer;
/// - on the exactly-once subscription: consumed by a committed transaction (or expired)
///   and no record left, so the gateway settled the delivery on the commit.
pub fn is_settled(
    state: &JournalState,
    unsettled: &Unsettled,
    subscription: usize,
    spec: &SubscriptionSpec,
    event: &Published,
    now: DateTime<Utc>,
) -> bool {
    let pair = (subscription, event.id);
    let record = unsettled
        .get(&(spec.name.to_owned(), event.id))
        .map(String::as_str);
    match spec.role {
        Role::Push => {
            return record.is_none()
                && (state.pushed_ok.contains(&event.id) || event.expired_by(now));
        }
        Role::ExactlyOnce => {
            return record.is_none()
                && (state.consumed.contains(&event.id) || event.expired_by(now));
        }
        Role::Plain | Role::DeadLetters | Role::Seek | Role::Pause => {}
    }
    if state.acked.contains(&pair) {
        return true;
    }
    match record {
        None => {
            state.ack_failed.contains(&pair)
                || (event.expired_by(now) && !spec.dead_letter_expired())
        }
        Some("dead") => spec.role == Role::DeadLetters,
        Some(_) => false,
    }
}

/// The running consumers.
pub struct Consumers {
    tasks: JoinSet<()>,
}

impl Consumers {
    /// Waits for every stream to close and its last acks to be answered.
    pub async fn join(mut self) {
        while self.tasks.join_next().await.is_some() {}
    }
}

/// Starts every consumer stream. `calm` makes them ack everything from then on (the
/// drain); `stop` ends them. The exactly-once subscription's consumers consume in
/// `database` and tell `ledger` of the reaction events they publish.
pub fn spawn_all(
    cluster: Arc<Cluster>,
    journal: Arc<Journal>,
    database: &ChaosDatabase,
    ledger: Arc<Ledger>,
    stop: CancellationToken,
    calm: CancellationToken,
) -> Consumers {
    let mut tasks = JoinSet::new();
    for (subscription, spec) in journal.specs.iter().enumerate() {
        for stream in 0..spec.streams {
            if spec.role == Role::ExactlyOnce {
                let consumer = exactly_once::Consumer {
                    cluster: cluster.clone(),
                    database: database.clone(),
                    ledger: ledger.clone(),
                    journal: journal.clone(),
                    subscription,
                    home: stream % cluster.len(),
                    stop: stop.clone(),
                    calm: calm.clone(),
                };
                tasks.spawn(consumer.run());
                continue;
            }
            let consumer = Consumer {
                cluster: cluster.clone(),
                journal: journal.clone(),
                subscription,
                home: stream % cluster.len(),
                current: AtomicUsize::new(stream % cluster.len()),
                stop: stop.clone(),
                calm: calm.clone(),
            };
            tasks.spawn(consumer.run());
        }
    }
    Consumers { tasks }
}

struct Consumer {
    cluster: Arc<Cluster>,
    journal: Arc<Journal>,
    subscription: usize,
    /// The gateway it connects to first.
    home: usize,
    /// The gateway of the current stream.
    current: AtomicUsize,
    stop: CancellationToken,
    calm: CancellationToken,
}

impl Consumer {
    fn spec(&self) -> &SubscriptionSpec {
        &self.journal.specs[self.subscription]
    }

    async fn run(self) {
        let this = Arc::new(self);
        let (acks, ack_queue) = mpsc::channel(4096);
        let acker = tokio::spawn(this.clone().send_acks(ack_queue));
        let mut handlers = JoinSet::new();
        let mut rng = StdRng::from_os_rng();
        let mut gateway = this.home;
        while !this.stop.is_cancelled() {
            this.consume(gateway, &acks, &mut handlers).await;
            while handlers.try_join_next().is_some() {}
            if this.stop.is_cancelled() {
                break;
            }
            // Reconnect to any gateway, the next one first.
            gateway = (gateway + rng.random_range(1..=this.cluster.len())) % this.cluster.len();
            let pause = Duration::from_millis(rng.random_range(50..300));
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = this.stop.cancelled() => {}
            }
        }
        // Let running handlers settle what they hold, then flush the acks.
        let _ = timeout(Duration::from_secs(10), async {
            while handlers.join_next().await.is_some() {}
        })
        .await;
        drop(acks);
        let _ = timeout(Duration::from_secs(10), acker).await;
    }

    /// Reads one Subscribe stream on `gateway` until it ends or the consumer stops.
    async fn consume(
        self: &Arc<Self>,
        gateway: usize,
        acks: &mpsc::Sender<Received>,
        handlers: &mut JoinSet<()>,
    ) {
        let Some(mut stream) = JournaledStream::open(
            &self.cluster,
            gateway,
            (self.subscription, self.spec().name),
            MAX_IN_FLIGHT,
            &self.journal,
            &self.stop,
        )
        .await
        else {
            return;
        };
        self.current.store(gateway, Ordering::Relaxed);
        let end = loop {
            match stream.next(&self.journal, &self.stop).await {
                Ok(received) => handlers.spawn(self.clone().handle(received, acks.clone())),
                Err(end) => break end,
            };
        };
        self.journal.stream_ended(stream.id, end);
    }

    /// Settles one delivery after a short random delay.
    async fn handle(self: Arc<Self>, received: Received, acks: mpsc::Sender<Received>) {
        let (delay, choice) = {
            let mut rng = rand::rng();
            (rng.random_range(0..25), rng.random_range(0..100))
        };
        tokio::time::sleep(Duration::from_millis(delay)).await;
        if self.spec().role == Role::DeadLetters {
            // Poison events fail for good, also while draining; the others never fail.
            if is_poison(received.event) {
                self.nack(&received, Nack::Poison).await;
            } else {
                let _ = acks.send(received).await;
            }
            return;
        }
        let calm = self.calm.is_cancelled();
        if calm || choice < 88 {
            let _ = acks.send(received).await;
        } else if choice < 97 {
            self.nack(&received, Nack::Retry).await;
        } else if self.spec().forgets {
            self.journal.state().forgotten += 1;
        } else {
            let _ = acks.send(received).await;
        }
    }

    async fn nack(&self, received: &Received, nack: Nack) {
        let retry_after = rand::rng().random_range(50..300);
        let dead_letter = nack == Nack::Poison && dead_letter_at_once(received.event);
        let request = proto::NackRequest {
            subscription: self.spec().name.into(),
            ack_id: received.ack_id.clone(),
            reason: match nack {
                Nack::Retry => "chaos: simulated failure",
                Nack::Poison => POISON_REASON,
            }
            .into(),
            retry_after: Some(prost_types::Duration {
                seconds: 0,
                nanos: retry_after * 1_000_000,
            }),
            dead_letter,
        };
        let gateway = rand::rng().random_range(0..self.cluster.len());
        let mut client = SubscriberClient::new(self.cluster.channel(gateway));
        let sent = Instant::now();
        let answer = match timeout(CALL_TIMEOUT, client.nack(request)).await {
            Ok(Ok(response)) => {
                self.check_nack_response(received, dead_letter, &response.into_inner());
                Answer::Applied
            }
            Ok(Err(status)) if status.code() == tonic::Code::FailedPrecondition => Answer::Stale,
            Ok(Err(status)) => Answer::Failed(format!("{:?}", status.code())),
            Err(_) => Answer::Failed("timeout".into()),
        };
        let settlement = Settlement {
            kind: SettleKind::Nack,
            gateway,
            sent,
            answered: Instant::now(),
            answer,
        };
        self.journal.record_settlement(received, settlement);
    }

    /// A nack goes to the dead-letter queue when it asks to, or when it settles the last
    /// attempt the subscription allows; otherwise it is retried.
    fn check_nack_response(
        &self,
        received: &Received,
        dead_letter: bool,
        response: &proto::NackResponse,
    ) {
        let max_attempts = self.spec().max_attempts();
        let expected = dead_letter || (max_attempts > 0 && received.attempt >= max_attempts);
        if self.spec().role == Role::DeadLetters {
            self.journal.state().poison_nacks += 1;
        }
        if response.dead_lettered != expected || response.retry_at.is_some() == expected {
            self.journal.violation(Violation::new(
                "nack answer",
                format!(
                    "{}: nack of {} attempt {} (dead_letter {dead_letter}, max_attempts \
                     {max_attempts}) answered {response:?}",
                    self.spec().name,
                    received.event,
                    received.attempt
                ),
            ));
        }
    }

    /// Sends acks in batches, half of them to the gateway of the current stream and the
    /// others to a random one; a failed batch is tried once more on another gateway.
    async fn send_acks(self: Arc<Self>, mut queue: mpsc::Receiver<Received>) {
        let mut rng = StdRng::from_os_rng();
        loop {
            let Some(first) = queue.recv().await else {
                return;
            };
            let mut batch = vec![first];
            let flush_at = Instant::now() + ACK_FLUSH;
            while batch.len() < ACK_BATCH {
                match tokio::time::timeout_at(flush_at, queue.recv()).await {
                    Ok(Some(received)) => batch.push(received),
                    _ => break,
                }
            }
            let gateway = if rng.random_bool(0.5) {
                self.current.load(Ordering::Relaxed)
            } else {
                rng.random_range(0..self.cluster.len())
            };
            if !self.ack(gateway, &batch).await {
                tokio::time::sleep(Duration::from_millis(200)).await;
                self.ack((gateway + 1) % self.cluster.len(), &batch).await;
            }
        }
    }

    /// One Ack call; false when it failed (it may or may not have been applied).
    async fn ack(&self, gateway: usize, batch: &[Received]) -> bool {
        let request = proto::AckRequest {
            subscription: self.spec().name.into(),
            ack_ids: batch.iter().map(|r| r.ack_id.clone()).collect(),
        };
        let mut client = SubscriberClient::new(self.cluster.channel(gateway));
        let sent = Instant::now();
        let outcome = timeout(CALL_TIMEOUT, client.ack(request)).await;
        let answered = Instant::now();
        let (stale, unavailable, failure): (HashSet<String>, HashSet<String>, Option<String>) =
            match outcome {
                Ok(Ok(response)) => {
                    let response = response.into_inner();
                    (
                        response.stale_ack_ids.into_iter().collect(),
                        response.unavailable_ack_ids.into_iter().collect(),
                        None,
                    )
                }
                Ok(Err(status)) => (
                    HashSet::new(),
                    HashSet::new(),
                    Some(format!("{:?}", status.code())),
                ),
                Err(_) => (HashSet::new(), HashSet::new(), Some("timeout".into())),
            };
        for received in batch {
            let answer = match &failure {
                Some(code) => Answer::Failed(code.clone()),
                None if stale.contains(&received.ack_id) => Answer::Stale,
                // Its source could not be reached: not applied; it comes back.
                None if unavailable.contains(&received.ack_id) => {
                    Answer::Failed("source unavailable".into())
                }
                None => Answer::Applied,
            };
            let settlement = Settlement {
                kind: SettleKind::Ack,
                gateway,
                sent,
                answered,
                answer,
            };
            self.journal.record_settlement(received, settlement);
        }
        failure.is_none()
    }
}

/// Why a consumer nacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Nack {
    /// A passing failure: retried after a short `retry_after`.
    Retry,
    /// A poison event of the dead-letter subscription.
    Poison,
}

/// A protobuf timestamp as a date, `None` when out of range.
pub fn date_time(timestamp: prost_types::Timestamp) -> Option<DateTime<Utc>> {
    DateTime::from_timestamp(timestamp.seconds, timestamp.nanos.try_into().ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_star_stands_for_exactly_one_segment() {
        assert!(matches_pattern("order.*", "order.created"));
        assert!(matches_pattern("order.created", "order.created"));
        assert!(!matches_pattern("order.*", "order.item.added"));
        assert!(!matches_pattern("order.*", "invoice.issued"));
        assert!(!matches_pattern("order.*", "order"));
        let orders = SubscriptionSpec::all()
            .into_iter()
            .find(|spec| spec.name == "chaos-orders")
            .expect("chaos-orders");
        assert!(orders.matches("order.paid"));
        assert!(!orders.matches("shipment.sent.eu"));
    }
}
