//! The raw SQL ceiling of delivery: the same work as the gateway's relay — claim events
//! past a subscription's cursor, 100 at a time under the subscription's lock, reading
//! their rows back, record the lease, and delete it when acked — done straight through
//! SQL by a hand-written loop on the same tables, with as many workers as the gateway
//! run had streams. It leaves out what the gateway adds on top (gRPC, leases handed to
//! streams, flow control, filters, retries, transactions passed while open), so gateway
//! ÷ raw says what that costs.
//!
//! Two ways of recording leases: the gateway's, one row of `outbox_delivery_batches`
//! per claim, and the one before it, a row of `outbox_deliveries` per event, kept as a
//! second reference (and the only one on a schema from before claim batches).

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use anyhow::Context;
use sqlx::{PgPool, Row};
use tokio::{task::JoinSet, time::Instant};

use crate::database::{BenchDatabase, Notify};

/// Events each claim takes (the gateway's streams ack in batches of 100 too).
const CLAIM_BATCH: i64 = 100;

/// How a raw loop records its leases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bookkeeping {
    /// One `outbox_deliveries` record per event, deleted by primary key when acked.
    PerEvent,
    /// One `outbox_delivery_batches` row per claim, deleted when the claim is acked.
    PerClaim,
}

impl Bookkeeping {
    /// Leases recorded this way exist in the bench database's schema.
    pub async fn available(self, database: &BenchDatabase) -> anyhow::Result<bool> {
        match self {
            Bookkeeping::PerEvent => Ok(true),
            Bookkeeping::PerClaim => database.has_claim_batches().await,
        }
    }

    fn claim_statement(self) -> String {
        let record = match self {
            Bookkeeping::PerEvent => {
                "leased AS (
    INSERT INTO outbox_deliveries (subscription_id, position, state, attempt, lease_token, due_at)
    SELECT $1, b.position, 'in_flight', 1, $5, now() + interval '30 seconds'
    FROM batch b
    RETURNING position
)"
            }
            Bookkeeping::PerClaim => {
                "batch_row AS (
    INSERT INTO outbox_delivery_batches (subscription_id, lease_token, chunk, due_at, positions)
    SELECT $1, $5, 0, now() + interval '30 seconds', array_agg(b.position ORDER BY b.xact_id, b.position)
    FROM batch b
    HAVING count(*) > 0
    RETURNING positions
),
leased AS (
    SELECT p.position FROM batch_row r CROSS JOIN unnest(r.positions) AS p(position)
)"
            }
        };
        format!(
            "\
WITH batch AS (
    SELECT e.xact_id, e.position
    FROM outbox_events e
    WHERE (e.xact_id, e.position) > ($2, $3)
    ORDER BY e.xact_id, e.position
    LIMIT $4
),
{record},
moved AS (
    UPDATE outbox_cursors c
    SET cursor_xact_id = last.xact_id, cursor_position = last.position
    FROM (SELECT xact_id, position FROM batch ORDER BY xact_id DESC, position DESC LIMIT 1) last
    WHERE c.subscription_id = $1
)
SELECT e.position, e.id, e.aggregate_type, e.aggregate_id, e.event_type, e.payload,
       e.content_type, e.metadata, e.created_at
FROM leased l
JOIN outbox_events e ON e.position = l.position"
        )
    }

    /// Settles one claim's leases.
    async fn ack(
        self,
        pool: &PgPool,
        subscription_id: i64,
        token: i64,
        positions: &[i64],
    ) -> anyhow::Result<()> {
        match self {
            Bookkeeping::PerEvent => {
                sqlx::query(
                    "DELETE FROM outbox_deliveries \
                     WHERE subscription_id = $1 AND position = ANY ($2)",
                )
                .bind(subscription_id)
                .bind(positions)
                .execute(pool)
                .await?;
            }
            Bookkeeping::PerClaim => {
                sqlx::query(
                    "DELETE FROM outbox_delivery_batches \
                     WHERE subscription_id = $1 AND lease_token = $2 AND chunk = 0",
                )
                .bind(subscription_id)
                .bind(token)
                .execute(pool)
                .await?;
            }
        }
        Ok(())
    }
}

/// What a raw drain did.
#[derive(Debug, Clone, Copy)]
pub struct RawOutcome {
    pub acked: u64,
    pub seconds: f64,
}

impl RawOutcome {
    pub fn per_second(&self) -> f64 {
        self.acked as f64 / self.seconds
    }
}

/// Drains the backlog through `subscriptions` fresh subscriptions (created directly,
/// starting at the earliest event) with `workers` workers each, until each has taken
/// `target` events or `limit` passes; then removes them and their records.
pub async fn drain(
    database: &BenchDatabase,
    bookkeeping: Bookkeeping,
    subscriptions: usize,
    workers: usize,
    target: u64,
    limit: Duration,
) -> anyhow::Result<RawOutcome> {
    let pool = database
        .pool((subscriptions * workers) as u32 + 1, Notify::Suppress)
        .await?;
    let mut ids = Vec::new();
    for index in 0..subscriptions {
        let id: i64 = sqlx::query_scalar(
            "WITH created AS ( \
                 INSERT INTO outbox_subscriptions (name, ack_deadline_ms, max_attempts, \
                     retry_backoff_min_ms, retry_backoff_max_ms) \
                 VALUES ($1, 30000, 10, 1000, 900000) RETURNING id) \
             INSERT INTO outbox_cursors (subscription_id, cursor_xact_id, cursor_position) \
             SELECT id, 0, 0 FROM created RETURNING subscription_id",
        )
        .bind(format!("raw-{index}"))
        .fetch_one(&pool)
        .await
        .context("cannot create a raw subscription")?;
        ids.push(id);
    }
    let started = Instant::now();
    let deadline = started + limit;
    let acked = Arc::new(AtomicU64::new(0));
    let claim_statement: Arc<str> = bookkeeping.claim_statement().into();
    let mut tasks = JoinSet::new();
    for &subscription_id in &ids {
        let taken = Arc::new(AtomicU64::new(0));
        for worker in 0..workers {
            let (pool, taken, acked) = (pool.clone(), taken.clone(), acked.clone());
            let claim_statement = claim_statement.clone();
            tasks.spawn(async move {
                // A token per claim, as the gateway's.
                let tokens = ((subscription_id << 40) + ((worker as i64) << 32))..;
                for token in tokens {
                    if taken.load(Ordering::Relaxed) >= target || Instant::now() >= deadline {
                        break;
                    }
                    let positions = claim(&pool, &claim_statement, subscription_id, token).await?;
                    if positions.is_empty() {
                        break;
                    }
                    taken.fetch_add(positions.len() as u64, Ordering::Relaxed);
                    bookkeeping
                        .ack(&pool, subscription_id, token, &positions)
                        .await?;
                    acked.fetch_add(positions.len() as u64, Ordering::Relaxed);
                }
                anyhow::Ok(())
            });
        }
    }
    while let Some(result) = tasks.join_next().await {
        result.context("a raw worker panicked")??;
    }
    let seconds = started.elapsed().as_secs_f64();
    for id in ids {
        let records = match bookkeeping {
            Bookkeeping::PerEvent => "DELETE FROM outbox_deliveries WHERE subscription_id = $1",
            Bookkeeping::PerClaim => {
                "DELETE FROM outbox_delivery_batches WHERE subscription_id = $1"
            }
        };
        for statement in [
            records,
            "DELETE FROM outbox_cursors WHERE subscription_id = $1",
            "DELETE FROM outbox_subscriptions WHERE id = $1",
        ] {
            sqlx::query(statement).bind(id).execute(&pool).await?;
        }
    }
    pool.close().await;
    Ok(RawOutcome {
        acked: acked.load(Ordering::Relaxed),
        seconds,
    })
}

/// One claim: lock the subscription row and read its cursor (one statement: a row lock
/// returns the row as its previous holder left it), take the next events and move the
/// cursor, reading the events back; returns their positions.
async fn claim(
    pool: &PgPool,
    statement: &str,
    subscription_id: i64,
    token: i64,
) -> anyhow::Result<Vec<i64>> {
    let mut transaction = pool.begin().await?;
    let (cursor_xact_id, cursor_position): (i64, i64) = sqlx::query_as(
        "SELECT cursor_xact_id, cursor_position FROM outbox_cursors \
         WHERE subscription_id = $1 FOR UPDATE",
    )
    .bind(subscription_id)
    .fetch_one(&mut *transaction)
    .await?;
    let rows = sqlx::query(sqlx::AssertSqlSafe(statement))
        .bind(subscription_id)
        .bind(cursor_xact_id)
        .bind(cursor_position)
        .bind(CLAIM_BATCH)
        .bind(token)
        .fetch_all(&mut *transaction)
        .await?;
    transaction.commit().await?;
    rows.iter()
        .map(|row| Ok(row.try_get::<i64, _>("position")?))
        .collect()
}
