//! Background upkeep: reclaiming expired leases, deleting old events in bounded
//! batches and vacuuming the delivery table. Each step runs in its own short transaction
//! behind a try-lock (the vacuum skips a table another gateway is vacuuming), so several
//! gateways never do the same step at once and none waits for another.

use std::time::Duration;

use sqlx::Row;

use super::{
    Result, Store,
    columns::millis,
    deliveries::{Moved, promote_waiting, split_batches},
    locks::SUBSCRIPTION_LOCK_CLASS,
};
use outbox_domain::Subscription;

/// Advisory lock keys of the maintenance steps (first key; the second is below).
const MAINTENANCE_LOCK_CLASS: i32 = 0x6f62_7802;
const RETENTION_LOCK: i32 = 1;

/// What reclaiming a subscription's expired leases did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reclaimed {
    pub leases: u64,
    /// Of those, leases that had used their last attempt.
    pub dead_lettered: u64,
}

/// What one force-expiry batch removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForceExpired {
    pub deleted: u64,
    /// Deleted events some subscription had not finished with.
    pub still_needed: u64,
}

impl Store {
    /// Vacuums the delivery table (and the counters acks update) once at least
    /// `min_dead_rows` dead rows have piled up; returns how many there were, or `None` when
    /// it was not yet due. Every ack deletes a record and every claim inserts one, and
    /// autovacuum, when it runs at all, visits this table too rarely for that rate: its
    /// indexes fill with dead entries that claims and acks must step over. The queue of
    /// consumed acks (`outbox_consume`), read whole at every settling round, goes with it.
    /// With several gateways, a vacuum already running is skipped rather than waited for.
    pub async fn vacuum_deliveries(&self, min_dead_rows: i64) -> Result<Option<i64>> {
        let dead_rows: i64 = sqlx::query_scalar(
            "SELECT coalesce(max(n_dead_tup), 0) FROM pg_stat_user_tables \
             WHERE relid IN ('outbox_deliveries'::regclass, 'outbox_delivery_batches'::regclass, \
                             'outbox_consumed_acks'::regclass)",
        )
        .fetch_one(&self.pool)
        .await?;
        if dead_rows < min_dead_rows {
            return Ok(None);
        }
        sqlx::raw_sql(
            "VACUUM (SKIP_LOCKED) outbox_deliveries, outbox_delivery_batches, \
             outbox_subscription_counters, outbox_consumed_acks",
        )
        .execute(&self.pool)
        .await?;
        Ok(Some(dead_rows))
    }

    /// Turns the subscription's expired leases into retries (or dead letters); `None`
    /// when a claim holds the subscription right now (the claim re-leases them itself).
    pub async fn reclaim_expired_leases(
        &self,
        subscription: &Subscription,
    ) -> Result<Option<Reclaimed>> {
        run_in_transaction!(self.pool, |transaction| {
            let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1, $2::int)")
                .bind(SUBSCRIPTION_LOCK_CLASS)
                .bind(subscription.id.0)
                .fetch_one(&mut *transaction)
                .await?;
            if !locked {
                return Ok(None);
            }
            let settings = &subscription.settings;
            split_batches(&mut *transaction, subscription.id, Moved::Expired).await?;
            let rows = sqlx::query(include_str!("queries/reclaim_expired.sql"))
                .bind(subscription.id.0)
                .bind(settings.max_attempts as i32)
                .bind(settings.persistent_event_types.to_regex())
                .fetch_all(&mut *transaction)
                .await?;
            let mut freed_keys = Vec::new();
            let mut dead_lettered = 0;
            for row in &rows {
                let state: &str = row.try_get("state")?;
                if state == "dead" {
                    dead_lettered += 1;
                    if let Some(key) = row.try_get::<Option<i64>, _>("ordering_key")? {
                        freed_keys.push(key);
                    }
                }
            }
            promote_waiting(transaction, subscription.id, &freed_keys).await?;
            Ok(Some(Reclaimed {
                leases: rows.len() as u64,
                dead_lettered,
            }))
        })
    }

    /// Deletes one batch of events past retention that no subscription needs; `None`
    /// when another gateway is doing it.
    pub async fn delete_retired_events(
        &self,
        retention: Duration,
        batch_size: usize,
    ) -> Result<Option<u64>> {
        run_in_transaction!(self.pool, |transaction| {
            if !try_lock(transaction, RETENTION_LOCK).await? {
                return Ok(None);
            }
            let lowest = lowest_cursor(transaction).await?;
            let deleted = sqlx::query(include_str!("queries/retention.sql"))
                .bind(millis(retention))
                .bind(lowest.xact_id)
                .bind(lowest.position)
                .bind(batch_size as i64)
                .bind(&lowest.pending_xact_ids)
                .execute(&mut *transaction)
                .await?
                .rows_affected();
            // A requeue racing this batch may have recreated a record for a deleted event.
            sqlx::query(
                "DELETE FROM outbox_deliveries d \
             WHERE NOT EXISTS (SELECT 1 FROM outbox_events e WHERE e.position = d.position)",
            )
            .execute(&mut *transaction)
            .await?;
            Ok(Some(deleted))
        })
    }

    /// Hard maximum retention: deletes one batch of events older than `max_retention`
    /// whatever their state; `None` when another gateway is doing it.
    pub async fn force_expire_events(
        &self,
        max_retention: Duration,
        batch_size: usize,
    ) -> Result<Option<ForceExpired>> {
        run_in_transaction!(self.pool, |transaction| {
            if !try_lock(transaction, RETENTION_LOCK).await? {
                return Ok(None);
            }
            let lowest = lowest_cursor(transaction).await?;
            let row = sqlx::query(include_str!("queries/force_expire.sql"))
                .bind(millis(max_retention))
                .bind(lowest.xact_id)
                .bind(lowest.position)
                .bind(batch_size as i64)
                .bind(&lowest.pending_xact_ids)
                .fetch_one(&mut *transaction)
                .await?;
            Ok(Some(ForceExpired {
                deleted: row.try_get::<i64, _>("deleted")?.max(0) as u64,
                still_needed: row.try_get::<i64, _>("still_needed")?.max(0) as u64,
            }))
        })
    }
}

/// How far every subscription has read: the lowest cursor (with no subscription, past
/// every event) and every transaction some subscription still waits for.
struct ReadByAll {
    xact_id: i64,
    position: i64,
    pending_xact_ids: Vec<i64>,
}

async fn lowest_cursor(connection: &mut sqlx::PgConnection) -> Result<ReadByAll> {
    let row = sqlx::query(
        "SELECT (SELECT ARRAY[cursor_xact_id, cursor_position] FROM outbox_cursors \
                 ORDER BY cursor_xact_id, cursor_position LIMIT 1) AS lowest, \
                (SELECT coalesce(array_agg(DISTINCT x), '{}') \
                 FROM outbox_cursors, unnest(pending_xact_ids) AS x) AS pending",
    )
    .fetch_one(connection)
    .await?;
    let lowest: Option<Vec<i64>> = row.try_get("lowest")?;
    let (xact_id, position) = match lowest.as_deref() {
        Some([xact_id, position]) => (*xact_id, *position),
        _ => (i64::MAX, i64::MAX),
    };
    Ok(ReadByAll {
        xact_id,
        position,
        pending_xact_ids: row.try_get("pending")?,
    })
}

async fn try_lock(connection: &mut sqlx::PgConnection, key: i32) -> Result<bool> {
    Ok(
        sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1, $2)")
            .bind(MAINTENANCE_LOCK_CLASS)
            .bind(key)
            .fetch_one(connection)
            .await?,
    )
}
