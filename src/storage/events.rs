//! Writing and reading outbox events.

use std::collections::BTreeMap;

use sqlx::{Postgres, Row, postgres::PgRow, types::Json};
use uuid::Uuid;

use super::{Result, Store, StoreError};
use crate::domain::{Event, NewEvent};

/// A transaction that publishes events; dropped without `commit`, it rolls back.
pub struct PublishTransaction {
    transaction: sqlx::Transaction<'static, Postgres>,
}

impl Store {
    pub async fn begin_publish(&self) -> Result<PublishTransaction> {
        Ok(PublishTransaction {
            transaction: self.pool.begin().await?,
        })
    }
}

impl PublishTransaction {
    /// Inserts the events (whose ids are given separately, already resolved) in one
    /// statement and returns the ids that were new; the others already existed.
    pub async fn insert(&mut self, ids: &[Uuid], events: &[&NewEvent]) -> Result<Vec<Uuid>> {
        let metadata: Vec<String> = events
            .iter()
            .map(|event| serde_json::to_string(&event.metadata).expect("string map serializes"))
            .collect();
        let inserted = sqlx::query_scalar(include_str!("queries/insert_events.sql"))
            .bind(ids)
            .bind(
                events
                    .iter()
                    .map(|e| e.aggregate_type.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(
                events
                    .iter()
                    .map(|e| e.aggregate_id.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(
                events
                    .iter()
                    .map(|e| e.aggregate_version)
                    .collect::<Vec<_>>(),
            )
            .bind(
                events
                    .iter()
                    .map(|e| e.event_type.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(
                events
                    .iter()
                    .map(|e| e.payload.as_slice())
                    .collect::<Vec<_>>(),
            )
            .bind(
                events
                    .iter()
                    .map(|e| e.content_type.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(metadata)
            .bind(events.iter().map(|e| e.occurred_at).collect::<Vec<_>>())
            .fetch_all(&mut *self.transaction)
            .await?;
        Ok(inserted)
    }

    /// Reads stored events by id, seeing rows committed by concurrent publishers.
    pub async fn find(&mut self, ids: &[Uuid]) -> Result<Vec<Event>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            event_columns!(),
            " FROM outbox_events WHERE id = ANY ($1)"
        ))
        .bind(ids)
        .fetch_all(&mut *self.transaction)
        .await?;
        rows.iter().map(event_from_row).collect()
    }

    pub async fn commit(self) -> Result<()> {
        self.transaction.commit().await?;
        Ok(())
    }
}

/// Reads the event columns (`id` through `created_at`) of a row.
pub(super) fn event_from_row(row: &PgRow) -> Result<Event> {
    let metadata: Json<BTreeMap<String, String>> = row
        .try_get("metadata")
        .map_err(|error| StoreError::Corrupt(format!("event metadata: {error}")))?;
    Ok(Event {
        id: row.try_get("id")?,
        aggregate_type: row.try_get("aggregate_type")?,
        aggregate_id: row.try_get("aggregate_id")?,
        aggregate_version: row.try_get("aggregate_version")?,
        event_type: row.try_get("event_type")?,
        payload: row.try_get("payload")?,
        content_type: row.try_get("content_type")?,
        metadata: metadata.0,
        occurred_at: row.try_get("occurred_at")?,
        created_at: row.try_get("created_at")?,
    })
}
