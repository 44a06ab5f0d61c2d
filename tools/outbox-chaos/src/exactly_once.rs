//! The exactly-once subscription's consumers. To the gateways each looks like a process
//! of its own: one Subscribe stream and one connection to the run's database (the
//! gateways' `default` source), consuming every delivery in one transaction there —
//! `outbox_consume` first; only when it returns true, a row in
//! `chaos_exactly_once_effects` (which has no unique constraint, so a second row for an
//! event would show) and, for the events [`reacts`] chooses, a reaction event published
//! with `outbox_publish`; then COMMIT. They never call Ack: the gateway settles a
//! delivery when its consumption commits. Until the drain one now and then crashes — its
//! transaction and connection dropped before the COMMIT, or its stream and connection
//! dropped right after it — or holds its transaction open past the lease, so events come
//! again while and after they are consumed, and `outbox_consume` must answer false to
//! all but one of their transactions.
//!
//! The reaction events go into the ledger like any producer's (committed, rolled back or
//! in doubt), so the unfiltered subscriptions, which select them, are checked on them as
//! on every other event; no other subscription selects their type.

use std::{collections::HashMap, sync::Arc, time::Duration};

use rand::{Rng, SeedableRng, rngs::StdRng};
use sqlx::{Connection, PgConnection, PgPool};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::{
    check::Violation,
    cluster::Cluster,
    consumers::{Journal, JournaledStream, Received, SubscriptionSpec},
    database::ChaosDatabase,
    ledger::{Ledger, Published, Route},
};

/// The reaction events' type and aggregate type; their aggregate id is the id of the
/// event whose consumption published them.
pub const REACTION_TYPE: &str = "shipment.requested";
const REACTION_AGGREGATE: &str = "shipment";
/// Deliveries a stream may hold at once; they are consumed one after another.
const MAX_IN_FLIGHT: u32 = 4;
/// Per mille of the deliveries before the drain: crashes before and right after the
/// COMMIT, and transactions held open past the lease.
const CRASH_BEFORE_COMMIT: u32 = 30;
const CRASH_AFTER_COMMIT: u32 = 30;
const STALL: u32 = 2;
/// How long past the ack deadline a stalled transaction stays open.
const STALL_PAST_DEADLINE: Duration = Duration::from_secs(1);
/// `application_name` of the consumers' connections: the fault injector cuts only the
/// gateways', so the consumers lose theirs only when they crash.
const APPLICATION: &str = "outbox-chaos-consumer";

/// Whether consuming the event publishes a reaction: a quarter of the events, chosen by
/// random bits of the id that [`crate::consumers::is_poison`] does not read.
pub fn reacts(event: Uuid) -> bool {
    event.as_bytes()[13].is_multiple_of(4)
}

/// Creates the side-effect table in the run's database.
pub async fn create_table(database: &ChaosDatabase) -> anyhow::Result<()> {
    sqlx::query(
        "CREATE TABLE chaos_exactly_once_effects ( \
             event_id    uuid NOT NULL, \
             ack_id      text NOT NULL, \
             consumed_at timestamptz NOT NULL DEFAULT clock_timestamp())",
    )
    .execute(database.pool())
    .await?;
    Ok(())
}

/// What the consumers left in the run's database.
#[derive(Debug, Default)]
pub struct Effects {
    /// Side-effect rows, by consumed event.
    pub rows: HashMap<Uuid, u64>,
    /// Reaction events stored, by the event whose consumption published them.
    pub reactions: HashMap<Uuid, u64>,
}

impl Effects {
    pub async fn read(pool: &PgPool) -> anyhow::Result<Effects> {
        let rows: Vec<(Uuid, i64)> = sqlx::query_as(
            "SELECT event_id, count(*) FROM chaos_exactly_once_effects GROUP BY event_id",
        )
        .fetch_all(pool)
        .await?;
        let reactions: Vec<(String, i64)> = sqlx::query_as(
            "SELECT aggregate_id, count(*) FROM outbox_events \
             WHERE aggregate_type = $1 AND event_type = $2 GROUP BY aggregate_id",
        )
        .bind(REACTION_AGGREGATE)
        .bind(REACTION_TYPE)
        .fetch_all(pool)
        .await?;
        let count = |count: i64| count.max(0) as u64;
        Ok(Effects {
            rows: rows.into_iter().map(|(id, n)| (id, count(n))).collect(),
            reactions: reactions
                .into_iter()
                .map(|(id, n)| (id.parse().unwrap_or_default(), count(n)))
                .collect(),
        })
    }
}

/// What a consumer does with one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Consumes it and commits.
    Commit,
    /// Crashes before the COMMIT: the transaction and the connection are dropped, and the
    /// server rolls the transaction back.
    CrashBeforeCommit,
    /// Crashes right after the COMMIT answered, before anything else: the stream and the
    /// connection are dropped.
    CrashAfterCommit,
    /// Holds the transaction open past the lease's deadline, then commits: the event is
    /// delivered again meanwhile, and its settlement comes with a stale ack id.
    Stall,
}

/// One consuming transaction.
#[derive(Debug, Clone)]
pub struct Consumption {
    pub event: Uuid,
    pub attempt: u32,
    /// When the delivery arrived, and when the transaction ended.
    pub arrived: Instant,
    pub ended: Instant,
    /// What `outbox_consume` returned; `None` when a statement failed.
    pub first: Option<bool>,
    pub fate: Fate,
    /// Whether the transaction committed; `None` when the answer to its COMMIT was lost
    /// and the database could not tell.
    pub committed: Option<bool>,
}

/// One consumer of the exactly-once subscription.
pub struct Consumer {
    pub cluster: Arc<Cluster>,
    /// Where it consumes: the gateways' `default` source.
    pub database: ChaosDatabase,
    /// Told of the reaction events.
    pub ledger: Arc<Ledger>,
    pub journal: Arc<Journal>,
    /// Index of the exactly-once subscription in the journal's.
    pub subscription: usize,
    /// The gateway it connects to first.
    pub home: usize,
    pub stop: CancellationToken,
    /// Set for the drain: from then on it neither crashes nor stalls.
    pub calm: CancellationToken,
}

impl Consumer {
    fn spec(&self) -> &SubscriptionSpec {
        &self.journal.specs[self.subscription]
    }

    /// Lives one life after another, each on another gateway than the last, until `stop`.
    pub async fn run(self) {
        let mut rng = StdRng::from_os_rng();
        let mut gateway = self.home;
        while !self.stop.is_cancelled() {
            self.live(gateway, &mut rng).await;
            if self.stop.is_cancelled() {
                break;
            }
            gateway = (gateway + rng.random_range(1..=self.cluster.len())) % self.cluster.len();
            let pause = Duration::from_millis(rng.random_range(50..300));
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = self.stop.cancelled() => {}
            }
        }
    }

    /// One life: a connection and a stream on `gateway`, deliveries consumed until the
    /// stream ends, the consumer stops or it crashes. Both are dropped at the end, as a
    /// crashed process's are: the server rolls back a transaction left open, and the
    /// gateway takes back the deliveries the stream held.
    async fn live(&self, gateway: usize, rng: &mut StdRng) {
        let mut connection = match self.database.connect(APPLICATION).await {
            Ok(connection) => connection,
            Err(error) => {
                eprintln!("outbox-chaos: exactly-once consumer cannot connect: {error}");
                return;
            }
        };
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
        let end = loop {
            let received = match stream.next(&self.journal, &self.stop).await {
                Ok(received) => received,
                Err(end) => break end,
            };
            let fate = self.fate(rng);
            if let Err(end) = self.consume(&mut connection, &received, fate).await {
                break end.to_owned();
            }
        };
        let stream_id = stream.id;
        drop(connection);
        drop(stream);
        self.journal.stream_ended(stream_id, end);
    }

    fn fate(&self, rng: &mut StdRng) -> Fate {
        if self.calm.is_cancelled() {
            return Fate::Commit;
        }
        let draw = rng.random_range(0..1000);
        if draw < CRASH_BEFORE_COMMIT {
            Fate::CrashBeforeCommit
        } else if draw < CRASH_BEFORE_COMMIT + CRASH_AFTER_COMMIT {
            Fate::CrashAfterCommit
        } else if draw < CRASH_BEFORE_COMMIT + CRASH_AFTER_COMMIT + STALL {
            Fate::Stall
        } else {
            Fate::Commit
        }
    }

    /// Consumes one delivery in a transaction as `fate` has it, and journals what came of
    /// it. `Err` ends the consumer's life, saying why.
    async fn consume(
        &self,
        connection: &mut PgConnection,
        received: &Received,
        fate: Fate,
    ) -> Result<(), &'static str> {
        let reaction = reacts(received.event).then(|| Published {
            id: Uuid::now_v7(),
            aggregate: format!("{REACTION_AGGREGATE}/{}", received.event),
            version: 1,
            event_type: REACTION_TYPE.to_owned(),
            route: Route::Reaction,
            deliver_at: None,
            expires_at: None,
        });
        let mut transaction = match connection.begin().await {
            Ok(transaction) => transaction,
            Err(error) => {
                self.failed(received, error);
                return Err("consumer error");
            }
        };
        let first = match self
            .write(&mut transaction, received, reaction.as_ref())
            .await
        {
            Ok(first) => first,
            Err(error) => {
                // Rolled back with everything it wrote, the reaction too if it got that far.
                drop(transaction);
                self.ended(received, None, fate, Some(false), reaction.as_ref());
                self.failed(received, error);
                return Err("consumer error");
            }
        };
        // The reaction this transaction wrote.
        let written = reaction.filter(|_| first);
        match fate {
            Fate::CrashBeforeCommit => {
                drop(transaction);
                self.ended(received, Some(first), fate, Some(false), written.as_ref());
                return Err("crashed before commit");
            }
            Fate::Stall => {
                let hold = self.spec().ack_deadline + STALL_PAST_DEADLINE;
                tokio::select! {
                    _ = tokio::time::sleep(hold) => {}
                    _ = self.stop.cancelled() => {}
                }
            }
            Fate::Commit | Fate::CrashAfterCommit => {}
        }
        let committed = match transaction.commit().await {
            Ok(()) => Some(true),
            Err(error) => {
                eprintln!(
                    "outbox-chaos: exactly-once consumer: COMMIT of {} failed: {error}",
                    received.event
                );
                self.commit_outcome(received, first).await
            }
        };
        self.ended(received, Some(first), fate, committed, written.as_ref());
        match (committed, fate) {
            (Some(true), Fate::CrashAfterCommit) => Err("crashed after commit"),
            (Some(true), _) => Ok(()),
            _ => Err("consumer error"),
        }
    }

    /// The statements: `outbox_consume` first; the side effect and the reaction only when
    /// it returned true. Returns what it returned.
    async fn write(
        &self,
        transaction: &mut PgConnection,
        received: &Received,
        reaction: Option<&Published>,
    ) -> Result<bool, sqlx::Error> {
        let first: bool = sqlx::query_scalar("SELECT outbox_consume($1, $2)")
            .bind(self.spec().name)
            .bind(&received.ack_id)
            .fetch_one(&mut *transaction)
            .await?;
        if !first {
            return Ok(false);
        }
        sqlx::query("INSERT INTO chaos_exactly_once_effects (event_id, ack_id) VALUES ($1, $2)")
            .bind(received.event)
            .bind(&received.ack_id)
            .execute(&mut *transaction)
            .await?;
        if let Some(reaction) = reaction {
            sqlx::query("SELECT outbox_publish($1, $2, $3, $4::jsonb, '{}'::jsonb, $5, $6)")
                .bind(REACTION_AGGREGATE)
                .bind(received.event.to_string())
                .bind(REACTION_TYPE)
                .bind(format!(r#"{{"consumed":"{}"}}"#, received.event))
                .bind(reaction.id)
                .bind(reaction.version)
                .execute(&mut *transaction)
                .await?;
        }
        Ok(true)
    }

    /// Whether a transaction whose COMMIT got no answer committed, as the database tells:
    /// by its side-effect row. One whose `outbox_consume` returned false wrote nothing of
    /// its own to look up (its event was consumed before, either way).
    async fn commit_outcome(&self, received: &Received, first: bool) -> Option<bool> {
        if !first {
            return None;
        }
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT FROM chaos_exactly_once_effects \
             WHERE event_id = $1 AND ack_id = $2)",
        )
        .bind(received.event)
        .bind(&received.ack_id)
        .fetch_one(self.database.pool())
        .await
        .ok()
    }

    /// Journals a transaction that ended, and tells the ledger what became of the
    /// reaction it may have written.
    fn ended(
        &self,
        received: &Received,
        first: Option<bool>,
        fate: Fate,
        committed: Option<bool>,
        reaction: Option<&Published>,
    ) {
        if let Some(reaction) = reaction {
            let reaction = std::slice::from_ref(reaction);
            match committed {
                Some(true) => self.ledger.committed(reaction),
                Some(false) => self.ledger.rolled_back(reaction),
                None => self.ledger.in_doubt(reaction),
            }
        }
        let mut state = self.journal.state();
        // False means that an earlier transaction consumed the event and committed.
        if committed == Some(true) || first == Some(false) {
            state.consumed.insert(received.event);
        }
        state.consumptions.push(Consumption {
            event: received.event,
            attempt: received.attempt,
            arrived: received.at,
            ended: Instant::now(),
            first,
            fate,
            committed,
        });
    }

    /// A statement of a consuming transaction failed. The run's database stays up and the
    /// consumers' connections are never cut, so every failure is one to look into (an ack
    /// id `outbox_consume` refused, most likely).
    fn failed(&self, received: &Received, error: sqlx::Error) {
        self.journal.violation(Violation::new(
            "consume failed",
            format!(
                "{}: {} attempt {} (ack id {}): {error}",
                self.spec().name,
                received.event,
                received.attempt,
                received.ack_id
            ),
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_unfiltered_subscriptions_select_the_reactions() {
        for spec in SubscriptionSpec::all() {
            assert_eq!(
                spec.matches(REACTION_TYPE),
                spec.event_types.is_empty(),
                "{}",
                spec.name
            );
        }
    }
}
