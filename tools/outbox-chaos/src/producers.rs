//! Producers: some publish over gRPC through every gateway with the client library's
//! idempotent `Publisher`, others write events with SQL in their own transactions and
//! roll some of them back. Each producer owns its aggregates and writes their events one
//! after another with increasing `aggregate_version`: the next event of an aggregate is
//! written only once the previous one is known committed or rolled back, so publish
//! order is the order the ordered subscription must keep.

use std::{sync::Arc, time::Duration};

use chrono::{DateTime, SubsecRound, Utc};
use outbox_client::{ClientError, Connection, Publisher, proto};
use rand::{Rng, SeedableRng, rngs::StdRng, seq::IndexedRandom};
use tokio::{task::JoinSet, time::Instant};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::{
    check::Violation,
    cluster::Cluster,
    database::{ChaosDatabase, Databases},
    ledger::{Ledger, Published, Route},
};

/// Event types the producers pick from; the filtered subscription takes `order.*`.
pub const EVENT_TYPES: &[&str] = &[
    "order.created",
    "order.paid",
    "order.item.added",
    "invoice.issued",
    "shipment.sent.eu",
];
/// Aggregates each producer owns.
const AGGREGATES_PER_PRODUCER: usize = 12;
/// Longest a Publish call may take before it counts as a hang (the gateways answer
/// DEADLINE_EXCEEDED after 10 s).
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(15);
/// Longest a producer keeps retrying one batch whose outcome is unknown.
const RESOLVE_WITHIN: Duration = Duration::from_secs(60);
/// Share of SQL transactions rolled back.
const ROLLBACK_RATE: f64 = 0.2;
/// Percent of the events published over gRPC that are scheduled (`deliver_at`), and the
/// percent up to which the following ones expire (`expires_at`).
const SCHEDULED_PERCENT: u32 = 6;
const EXPIRING_UNTIL: u32 = 14;

/// The running producers.
pub struct Producers {
    tasks: JoinSet<()>,
}

impl Producers {
    /// Waits for every producer to finish its current batch and stop.
    pub async fn join(mut self) {
        while self.tasks.join_next().await.is_some() {}
    }
}

pub fn spawn_all(
    cluster: Arc<Cluster>,
    databases: &Databases,
    ledger: Arc<Ledger>,
    rpc_producers: usize,
    sql_producers: usize,
    stop: CancellationToken,
) -> Producers {
    let mut tasks = JoinSet::new();
    for index in 0..rpc_producers {
        // The first one publishes to the second source, when there is one.
        let source = match (index, databases.0.len()) {
            (0, 2..) => crate::REMOTE_SOURCE,
            _ => "",
        };
        let producer = RpcProducer {
            name: format!("rpc{index}"),
            publishers: cluster
                .endpoints()
                .map(|endpoint| {
                    Publisher::new(Connection::new(endpoint))
                        .max_attempts(2)
                        .source(source)
                })
                .collect(),
            ledger: ledger.clone(),
        };
        tasks.spawn(producer.run(stop.clone()));
    }
    for index in 0..sql_producers {
        // Spread over the sources: each writes its own service's database.
        let producer = SqlProducer {
            name: format!("sql{index}"),
            database: databases.0[index % databases.0.len()].clone(),
            ledger: ledger.clone(),
        };
        tasks.spawn(producer.run(stop.clone()));
    }
    Producers { tasks }
}

/// An aggregate and the version its next event gets.
struct Aggregate {
    aggregate_type: &'static str,
    id: String,
    next_version: i64,
    /// Set when an event of it ended in doubt: its order can no longer be vouched for.
    retired: bool,
}

impl Aggregate {
    fn owned_by(producer: &str, aggregate_type: &'static str) -> Vec<Aggregate> {
        (0..AGGREGATES_PER_PRODUCER)
            .map(|index| Aggregate {
                aggregate_type,
                id: format!("{producer}-a{index}"),
                next_version: 1,
                retired: false,
            })
            .collect()
    }

    fn key(&self) -> String {
        format!("{}/{}", self.aggregate_type, self.id)
    }

    /// The next event of this aggregate.
    fn next_event(&mut self, rng: &mut StdRng, route: Route) -> (Published, proto::EventInput) {
        let id = Uuid::now_v7();
        let version = self.next_version;
        self.next_version += 1;
        let event_type = *EVENT_TYPES.choose(rng).expect("event types");
        // Only events published over gRPC are scheduled or expire: SQL producers write
        // the plain columns the other tests cover.
        let (deliver_at, expires_at) = match route {
            Route::Rpc => timing(rng),
            Route::Sql | Route::Reaction => (None, None),
        };
        let published = Published {
            id,
            aggregate: self.key(),
            version,
            event_type: event_type.to_owned(),
            route,
            deliver_at,
            expires_at,
        };
        let input = proto::EventInput {
            deliver_at: deliver_at.map(timestamp),
            expires_at: expires_at.map(timestamp),
            // An expiry may not precede `occurred_at`, which would otherwise be the time
            // of a retried call, after a short expiry.
            occurred_at: expires_at.map(|_| timestamp(Utc::now().trunc_subsecs(3))),
            id: id.to_string(),
            aggregate_type: self.aggregate_type.into(),
            aggregate_id: self.id.clone(),
            aggregate_version: Some(version),
            event_type: event_type.into(),
            payload: format!(r#"{{"aggregate":"{}","version":{version}}}"#, self.id).into_bytes(),
            ..Default::default()
        };
        (published, input)
    }
}

/// A `deliver_at` for some events and an `expires_at` for some others: most are neither.
/// Schedules are short so that the run delivers them without lengthening the drain;
/// expiries are either short enough that some events expire before they are delivered
/// (or before a retry), or long enough that they should not.
fn timing(rng: &mut StdRng) -> (Option<DateTime<Utc>>, Option<DateTime<Utc>>) {
    // Whole milliseconds, so that a re-publish compares equal to what was stored.
    let now = Utc::now().trunc_subsecs(3);
    let after = |millis| Some(now + chrono::Duration::milliseconds(millis));
    match rng.random_range(0..100) {
        0..SCHEDULED_PERCENT => (after(rng.random_range(300..2000)), None),
        SCHEDULED_PERCENT..EXPIRING_UNTIL if rng.random_bool(0.4) => {
            (None, after(rng.random_range(20..400)))
        }
        SCHEDULED_PERCENT..EXPIRING_UNTIL => (None, after(rng.random_range(2000..8000))),
        _ => (None, None),
    }
}

pub fn timestamp(at: DateTime<Utc>) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: at.timestamp(),
        nanos: at.timestamp_subsec_nanos() as i32,
    }
}

/// Picks 1 to 3 live aggregates and 1 to 2 consecutive events of each.
fn next_batch(
    aggregates: &mut [Aggregate],
    rng: &mut StdRng,
    route: Route,
) -> Vec<(Published, proto::EventInput)> {
    let live: Vec<usize> = (0..aggregates.len())
        .filter(|&index| !aggregates[index].retired)
        .collect();
    let count = rng.random_range(1..=3).min(live.len());
    let mut batch = Vec::new();
    for &index in live.choose_multiple(rng, count) {
        for _ in 0..rng.random_range(1..=2) {
            batch.push(aggregates[index].next_event(rng, route));
        }
    }
    batch
}

fn retire(aggregates: &mut [Aggregate], events: &[Published]) {
    for aggregate in aggregates.iter_mut() {
        if events
            .iter()
            .any(|event| event.aggregate == aggregate.key())
        {
            aggregate.retired = true;
        }
    }
}

struct RpcProducer {
    name: String,
    /// One per gateway.
    publishers: Vec<Publisher>,
    ledger: Arc<Ledger>,
}

impl RpcProducer {
    async fn run(self, stop: CancellationToken) {
        let mut rng = StdRng::from_os_rng();
        let mut aggregates = Aggregate::owned_by(&self.name, "order");
        while !stop.is_cancelled() {
            let batch = next_batch(&mut aggregates, &mut rng, Route::Rpc);
            if batch.is_empty() {
                break;
            }
            let (published, inputs): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
            if self
                .publish_until_known(&published, inputs.clone(), &mut rng)
                .await
            {
                // Now and then, what a careless or hostile client sends next.
                match rng.random_range(0..20) {
                    0 => self.republish(&inputs, false, &mut rng).await,
                    1 => self.republish(&inputs, true, &mut rng).await,
                    2 => self.publish_bad_input(&inputs[0], &mut rng).await,
                    _ => {}
                }
            } else {
                retire(&mut aggregates, &published);
            }
            pause(&stop, rng.random_range(60..180)).await;
        }
    }

    /// Publishes the batch, retrying a failed call with the same ids (on any gateway)
    /// until one succeeds; false when the outcome stayed unknown.
    async fn publish_until_known(
        &self,
        published: &[Published],
        inputs: Vec<proto::EventInput>,
        rng: &mut StdRng,
    ) -> bool {
        let deadline = Instant::now() + RESOLVE_WITHIN;
        let mut gateway = rng.random_range(0..self.publishers.len());
        let mut retry = false;
        while Instant::now() < deadline {
            self.ledger.rpc_call(retry);
            let call = self.publishers[gateway].publish(inputs.clone());
            match tokio::time::timeout(PUBLISH_TIMEOUT, call).await {
                Ok(Ok(results)) => {
                    self.check_results(published, &results);
                    self.ledger.committed(published);
                    return true;
                }
                Ok(Err(ClientError::Unavailable(status))) => self.ledger.rpc_error(status.code()),
                Ok(Err(ClientError::Refused(status))) if is_transport_failure(&status) => {
                    self.ledger.rpc_error(status.code())
                }
                Ok(Err(error)) => {
                    self.ledger.violation(Violation::new(
                        "publish refused",
                        format!(
                            "{} events {:?} (retry: {retry}): {error}",
                            self.name,
                            ids(published)
                        ),
                    ));
                    break;
                }
                Err(_) => self.ledger.violation(Violation::new(
                    "rpc hang",
                    format!(
                        "Publish to gateway {gateway} did not answer within {PUBLISH_TIMEOUT:?}"
                    ),
                )),
            }
            retry = true;
            gateway = (gateway + 1) % self.publishers.len();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.ledger.in_doubt(published);
        false
    }

    /// Publishes committed events again: identical, they must all come back as
    /// duplicates; with the first one's payload changed, the call must be refused with
    /// ALREADY_EXISTS (and change nothing, which the checks of delivered content see).
    async fn republish(&self, inputs: &[proto::EventInput], conflicting: bool, rng: &mut StdRng) {
        let mut again = inputs.to_vec();
        if conflicting {
            again[0].payload = br#"{"tampered":true}"#.to_vec();
        }
        let publisher = &self.publishers[rng.random_range(0..self.publishers.len())];
        let answer = tokio::time::timeout(PUBLISH_TIMEOUT, publisher.publish(again)).await;
        let violation = |detail: String| {
            self.ledger.violation(Violation::new(
                "re-publish",
                format!("{}: {detail}", self.name),
            ))
        };
        match (conflicting, answer) {
            (false, Ok(Ok(results))) if results.iter().all(|result| result.duplicate) => {
                self.ledger.state().identical_republishes += 1;
            }
            (false, Ok(Ok(results))) => {
                violation(format!("identical events not all duplicates: {results:?}"))
            }
            (true, Ok(Err(ClientError::Refused(status))))
                if status.code() == tonic::Code::AlreadyExists =>
            {
                self.ledger.state().conflicting_republishes += 1;
            }
            (true, Ok(Ok(results))) => {
                violation(format!("conflicting content accepted: {results:?}"))
            }
            // A dying gateway or a cut connection: says nothing either way.
            (_, Ok(Err(ClientError::Unavailable(_)))) => {}
            (_, Ok(Err(ClientError::Refused(status)))) if is_transport_failure(&status) => {}
            (_, Ok(Err(error))) => violation(format!("answered {error}")),
            (_, Err(_)) => violation("no answer within the timeout".into()),
        }
    }

    /// Publishes an event the database could not store as such: it must be refused with
    /// INVALID_ARGUMENT, never INTERNAL, and nothing is written (a fresh id is used, so a
    /// stored event would also show up as an unexpected delivery).
    async fn publish_bad_input(&self, template: &proto::EventInput, rng: &mut StdRng) {
        let mut bad = template.clone();
        bad.id = Uuid::now_v7().to_string();
        if rng.random_bool(0.5) {
            bad.aggregate_id = format!("{}\0nul", template.aggregate_id);
        } else {
            bad.payload = b"{\"name\": \"\xff\xfe\"}".to_vec();
        }
        let publisher = &self.publishers[rng.random_range(0..self.publishers.len())];
        match tokio::time::timeout(PUBLISH_TIMEOUT, publisher.publish(vec![bad])).await {
            Ok(Err(ClientError::Refused(status)))
                if status.code() == tonic::Code::InvalidArgument =>
            {
                self.ledger.state().bad_inputs_refused += 1;
            }
            Ok(Err(ClientError::Unavailable(_))) => {}
            Ok(Err(ClientError::Refused(status)))
                if is_transport_failure(&status) && status.code() != tonic::Code::Internal => {}
            other => self.ledger.violation(Violation::new(
                "bad input",
                format!("{}: a malformed event was answered {other:?}", self.name),
            )),
        }
    }

    fn check_results(&self, published: &[Published], results: &[proto::PublishResult]) {
        let returned: Vec<&str> = results.iter().map(|result| result.id.as_str()).collect();
        let sent: Vec<String> = published.iter().map(|event| event.id.to_string()).collect();
        if returned != sent {
            self.ledger.violation(Violation::new(
                "publish result",
                format!(
                    "{} sent ids {sent:?}, got results for {returned:?}",
                    self.name
                ),
            ));
        }
    }
}

/// Statuses a broken connection or a dying gateway produces besides UNAVAILABLE: the
/// call may or may not have been carried out.
fn is_transport_failure(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unknown | tonic::Code::Internal | tonic::Code::Cancelled
    )
}

fn ids(events: &[Published]) -> Vec<String> {
    events.iter().map(|event| event.id.to_string()).collect()
}

struct SqlProducer {
    name: String,
    database: ChaosDatabase,
    ledger: Arc<Ledger>,
}

impl SqlProducer {
    async fn run(self, stop: CancellationToken) {
        let mut rng = StdRng::from_os_rng();
        let mut aggregates = Aggregate::owned_by(&self.name, "account");
        while !stop.is_cancelled() {
            let batch = next_batch(&mut aggregates, &mut rng, Route::Sql);
            if batch.is_empty() {
                break;
            }
            let published: Vec<Published> = batch.iter().map(|(p, _)| p.clone()).collect();
            self.ledger.state().sql_transactions += 1;
            match self.write(&batch, &mut rng).await {
                Ok(Outcome::Committed) => self.ledger.committed(&published),
                Ok(Outcome::RolledBack) => self.ledger.rolled_back(&published),
                Err(error) => {
                    self.ledger.state().sql_errors += 1;
                    eprintln!("outbox-chaos: {} transaction failed: {error}", self.name);
                    self.ledger.rolled_back(&published);
                }
                Ok(Outcome::Unknown) => {
                    self.ledger.state().sql_commit_unknown += 1;
                    match self.database.is_stored(published[0].id).await {
                        Ok(true) => self.ledger.committed(&published),
                        Ok(false) => self.ledger.rolled_back(&published),
                        Err(_) => {
                            self.ledger.in_doubt(&published);
                            retire(&mut aggregates, &published);
                        }
                    }
                }
            }
            pause(&stop, rng.random_range(100..300)).await;
        }
    }

    /// One transaction writing the batch, through `outbox_publish` or a plain INSERT,
    /// sometimes held open a while (holding back the read horizon), sometimes rolled
    /// back.
    async fn write(
        &self,
        batch: &[(Published, proto::EventInput)],
        rng: &mut StdRng,
    ) -> Result<Outcome, sqlx::Error> {
        let mut transaction = self.database.pool().begin().await?;
        for (published, input) in batch {
            let payload = String::from_utf8_lossy(&input.payload).into_owned();
            if rng.random_bool(0.5) {
                sqlx::query("SELECT outbox_publish($1, $2, $3, $4::jsonb, '{}'::jsonb, $5, $6)")
                    .bind(&input.aggregate_type)
                    .bind(&input.aggregate_id)
                    .bind(&input.event_type)
                    .bind(payload)
                    .bind(published.id)
                    .bind(published.version)
                    .execute(&mut *transaction)
                    .await?;
            } else {
                sqlx::query(
                    "INSERT INTO outbox_events \
                     (id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) \
                     VALUES ($1, $2, $3, $4, $5, convert_to($6, 'UTF8'))",
                )
                .bind(published.id)
                .bind(&input.aggregate_type)
                .bind(&input.aggregate_id)
                .bind(published.version)
                .bind(&input.event_type)
                .bind(payload)
                .execute(&mut *transaction)
                .await?;
            }
        }
        let hold = if rng.random_bool(0.03) {
            rng.random_range(300..800)
        } else {
            rng.random_range(0..20)
        };
        tokio::time::sleep(Duration::from_millis(hold)).await;
        if rng.random_bool(ROLLBACK_RATE) {
            // A failed ROLLBACK leaves the transaction aborted all the same.
            let _ = transaction.rollback().await;
            return Ok(Outcome::RolledBack);
        }
        Ok(match transaction.commit().await {
            Ok(()) => Outcome::Committed,
            Err(_) => Outcome::Unknown,
        })
    }
}

enum Outcome {
    Committed,
    RolledBack,
    /// COMMIT was sent but its answer was lost.
    Unknown,
}

/// Sleeps `millis`, or less when `stop` fires.
async fn pause(stop: &CancellationToken, millis: u64) {
    tokio::select! {
        _ = tokio::time::sleep(Duration::from_millis(millis)) => {}
        _ = stop.cancelled() => {}
    }
}
