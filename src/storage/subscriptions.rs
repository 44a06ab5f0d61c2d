//! Subscription rows.

use std::{collections::BTreeMap, time::Duration};

use chrono::{DateTime, Utc};
use sqlx::{Row, postgres::PgRow, types::Json};

use super::{
    Result, Store, StoreError,
    deliveries::{LockMode, lock_subscription},
};
use crate::domain::{
    PatternSet, StartPosition, Subscription, SubscriptionName, SubscriptionSettings,
};

impl Store {
    /// Creates a subscription positioned at `start`. A taken name is
    /// [`StoreError::UniqueViolation`].
    pub async fn create_subscription(
        &self,
        name: &SubscriptionName,
        settings: &SubscriptionSettings,
        start: StartPosition,
    ) -> Result<Subscription> {
        let (start_latest, not_before) = start_columns(start);
        let row = sqlx::query(concat!(
            "INSERT INTO outbox_subscriptions (name, event_types, aggregate_types, metadata_match, \
                 ack_deadline_ms, max_attempts, retry_backoff_min_ms, retry_backoff_max_ms, ordered, \
                 persistent_event_types, cursor_xact_id, cursor_position, pending_xact_ids, \
                 pending_positions, not_before) \
             SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, \
                 start.xact_id, 0, start.pending_xact_ids, start.pending_positions, $12 \
             FROM (",
            start_position_sql!("$11"),
            ") AS start \
             RETURNING ",
            subscription_columns!()
        ))
        .bind(name.as_str())
        .bind(settings.event_types.to_strings())
        .bind(&settings.aggregate_types)
        .bind(Json(&settings.metadata_match))
        .bind(millis(settings.ack_deadline))
        .bind(settings.max_attempts as i32)
        .bind(millis(settings.retry_backoff_min))
        .bind(millis(settings.retry_backoff_max))
        .bind(settings.ordered)
        .bind(settings.persistent_event_types.to_strings())
        .bind(start_latest)
        .bind(not_before)
        .fetch_one(&self.pool)
        .await?;
        subscription_from_row(&row)
    }

    pub async fn subscription(&self, name: &SubscriptionName) -> Result<Option<Subscription>> {
        let row = sqlx::query(concat!(
            "SELECT ",
            subscription_columns!(),
            " FROM outbox_subscriptions WHERE name = $1"
        ))
        .bind(name.as_str())
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(subscription_from_row).transpose()
    }

    pub async fn subscriptions(&self) -> Result<Vec<Subscription>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            subscription_columns!(),
            " FROM outbox_subscriptions ORDER BY name"
        ))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(subscription_from_row).collect()
    }

    /// Deletes a subscription and all its delivery records; false when it did not exist.
    pub async fn delete_subscription(&self, name: &SubscriptionName) -> Result<bool> {
        let mut transaction = self.pool.begin().await?;
        // Waits for a running claim so it cannot leave records behind.
        let Some(id) = lock_by_name(&mut transaction, name).await? else {
            return Ok(false);
        };
        for statement in [
            "DELETE FROM outbox_deliveries WHERE subscription_id = $1",
            "DELETE FROM outbox_subscription_counters WHERE subscription_id = $1",
        ] {
            sqlx::query(statement)
                .bind(id)
                .execute(&mut *transaction)
                .await?;
        }
        sqlx::query("DELETE FROM outbox_subscriptions WHERE id = $1")
            .bind(id)
            .execute(&mut *transaction)
            .await?;
        transaction.commit().await?;
        Ok(true)
    }
}

/// Takes the named subscription's exclusive lock (waiting for a running claim) and
/// returns its id; `None` when it does not exist.
pub(super) async fn lock_by_name(
    connection: &mut sqlx::PgConnection,
    name: &SubscriptionName,
) -> Result<Option<i64>> {
    let id: Option<i64> = sqlx::query_scalar("SELECT id FROM outbox_subscriptions WHERE name = $1")
        .bind(name.as_str())
        .fetch_optional(&mut *connection)
        .await?;
    if let Some(id) = id {
        lock_subscription(connection, id, LockMode::Exclusive).await?;
    }
    Ok(id)
}

/// How far a subscription has read.
#[derive(Debug, Clone)]
pub(super) struct Cursor {
    pub xact_id: i64,
    pub position: i64,
    /// Transactions that were still running when the cursor passed them, and for each
    /// the position up to which its rows were already taken (0: none).
    pub pending_xact_ids: Vec<i64>,
    pub pending_positions: Vec<i64>,
    /// Events created before this are skipped.
    pub not_before: Option<DateTime<Utc>>,
}

/// A subscription with its cursor; `None` when it does not exist.
pub(super) async fn subscription_with_cursor(
    connection: &mut sqlx::PgConnection,
    subscription_id: i64,
) -> Result<Option<(Subscription, Cursor)>> {
    let row = sqlx::query(concat!(
        "SELECT ",
        subscription_columns!(),
        ", cursor_xact_id, cursor_position, pending_xact_ids, pending_positions, not_before \
         FROM outbox_subscriptions WHERE id = $1"
    ))
    .bind(subscription_id)
    .fetch_optional(connection)
    .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let cursor = Cursor {
        xact_id: row.try_get("cursor_xact_id")?,
        position: row.try_get("cursor_position")?,
        pending_xact_ids: row.try_get("pending_xact_ids")?,
        pending_positions: row.try_get("pending_positions")?,
        not_before: row.try_get("not_before")?,
    };
    Ok(Some((subscription_from_row(&row)?, cursor)))
}

/// Whether the cursor starts at the read horizon, and the earliest creation time.
pub(super) fn start_columns(start: StartPosition) -> (bool, Option<DateTime<Utc>>) {
    match start {
        StartPosition::Latest => (true, None),
        StartPosition::Earliest => (false, None),
        StartPosition::Time(time) => (false, Some(time)),
    }
}

/// The metadata filter as a statement parameter: NULL when it matches everything, so the
/// custom plan drops it and estimates row counts without its default selectivity.
pub(super) fn metadata_filter(
    settings: &SubscriptionSettings,
) -> Option<Json<&BTreeMap<String, String>>> {
    (!settings.metadata_match.is_empty()).then_some(Json(&settings.metadata_match))
}

pub(super) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

fn patterns(row: &PgRow, column: &str) -> Result<PatternSet> {
    let stored: Vec<String> = row.try_get(column)?;
    PatternSet::parse(&stored)
        .map_err(|(index, error)| StoreError::Corrupt(format!("{column}[{index}]: {error}")))
}

fn duration(row: &PgRow, column: &str) -> Result<Duration> {
    let ms: i64 = row.try_get(column)?;
    Ok(Duration::from_millis(ms.max(0) as u64))
}

pub(super) fn subscription_from_row(row: &PgRow) -> Result<Subscription> {
    let name: String = row.try_get("name")?;
    let metadata_match: Json<BTreeMap<String, String>> = row
        .try_get("metadata_match")
        .map_err(|error| StoreError::Corrupt(format!("metadata_match: {error}")))?;
    let max_attempts: i32 = row.try_get("max_attempts")?;
    Ok(Subscription {
        id: row.try_get("id")?,
        name: SubscriptionName::parse("name", &name)
            .map_err(|error| StoreError::Corrupt(error.to_string()))?,
        settings: SubscriptionSettings {
            event_types: patterns(row, "event_types")?,
            aggregate_types: row.try_get("aggregate_types")?,
            metadata_match: metadata_match.0,
            ack_deadline: duration(row, "ack_deadline_ms")?,
            max_attempts: max_attempts.max(0) as u32,
            retry_backoff_min: duration(row, "retry_backoff_min_ms")?,
            retry_backoff_max: duration(row, "retry_backoff_max_ms")?,
            ordered: row.try_get("ordered")?,
            persistent_event_types: patterns(row, "persistent_event_types")?,
        },
        created_at: row.try_get("created_at")?,
    })
}
