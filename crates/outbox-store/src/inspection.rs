//! What an operator looks into: dead letters counted and grouped by error and resolved in
//! bulk by a selection, an event's state on every subscription, an aggregate's events,
//! and the delivery counters the rates are sampled from.

use chrono::{DateTime, Utc};
use sqlx::Row;
use uuid::Uuid;

use super::{
    Result, Store, StoreError, columns::id_values, events::events_from_rows,
    operations::bind_selection,
};
use outbox_domain::{DeadLetterGroup, DeadLetterSelection, Event, Subscription, SubscriptionId};

/// The facts about one event on one subscription that its delivery state is made of.
#[derive(Debug, Clone, Default)]
pub struct DeliveryFacts {
    /// The subscription's read position here has passed the event.
    pub handed_out: bool,
    /// The event is older than the time the subscription started or was sought to.
    pub skipped: bool,
    /// The delivery record, when the event is unfinished there.
    pub record: Option<DeliveryRecord>,
}

/// A row of the delivery table.
#[derive(Debug, Clone)]
pub struct DeliveryRecord {
    /// `in_flight`, `retry`, `waiting` or `dead`.
    pub state: String,
    pub attempt: u32,
    pub due_at: Option<DateTime<Utc>>,
    /// The lease or retry time has passed.
    pub overdue: bool,
    pub last_error: Option<String>,
    pub dead_lettered_at: Option<DateTime<Utc>>,
    pub resolved_at: Option<DateTime<Utc>>,
    pub resolved_by: Option<String>,
    pub notes: Option<String>,
}

/// Deliveries made and acks applied on one subscription since it began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterTotals {
    pub subscription_id: SubscriptionId,
    pub delivered: u64,
    pub acked: u64,
}

impl Store {
    /// How many dead letters of the subscription the selection takes.
    pub async fn count_dead_letters(
        &self,
        subscription: &Subscription,
        selection: &DeadLetterSelection,
        include_resolved: bool,
    ) -> Result<u64> {
        let row = bind_selection(
            sqlx::query(concat!(
                "SELECT count(*) AS dead_letters FROM outbox_deliveries d \
                 JOIN outbox_events e ON e.position = d.position WHERE ",
                include_str!("queries/dead_letter_selection.sql")
            )),
            subscription,
            selection,
            include_resolved,
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(row.try_get::<i64, _>("dead_letters")?.max(0) as u64)
    }

    /// The selected unresolved dead letters grouped by last error, largest group first.
    pub async fn dead_letter_groups(
        &self,
        subscription: &Subscription,
        selection: &DeadLetterSelection,
        limit: usize,
    ) -> Result<Vec<DeadLetterGroup>> {
        let rows = bind_selection(
            sqlx::query(concat!(
                "WITH groups AS ( \
                     SELECT coalesce(d.last_error, '') AS last_error, \
                            count(*) AS dead_letters, \
                            min(d.dead_lettered_at) AS first_dead_lettered_at, \
                            max(d.dead_lettered_at) AS last_dead_lettered_at, \
                            max(d.position) AS example_position \
                     FROM outbox_deliveries d JOIN outbox_events e ON e.position = d.position \
                     WHERE ",
                include_str!("queries/dead_letter_selection.sql"),
                "    GROUP BY 1 ORDER BY dead_letters DESC, last_error LIMIT $10 \
                 ) \
                 SELECT g.last_error, g.dead_letters, g.first_dead_lettered_at, \
                        g.last_dead_lettered_at, x.id AS example_id \
                 FROM groups g JOIN outbox_events x ON x.position = g.example_position \
                 ORDER BY g.dead_letters DESC, g.last_error"
            )),
            subscription,
            selection,
            false,
        )
        .bind(limit as i64)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                let time = |column: &str| -> Result<DateTime<Utc>> {
                    row.try_get::<Option<DateTime<Utc>>, _>(column)?
                        .ok_or_else(|| StoreError::Corrupt("dead letter without a time".into()))
                };
                Ok(DeadLetterGroup {
                    last_error: row.try_get("last_error")?,
                    count: row.try_get::<i64, _>("dead_letters")?.max(0) as u64,
                    first_dead_lettered_at: time("first_dead_lettered_at")?,
                    last_dead_lettered_at: time("last_dead_lettered_at")?,
                    example_event_id: row.try_get::<Uuid, _>("example_id")?,
                })
            })
            .collect()
    }

    /// Marks every selected unresolved dead letter handled, in one statement; returns how
    /// many.
    pub async fn resolve_dead_letters(
        &self,
        subscription: &Subscription,
        selection: &DeadLetterSelection,
        resolved_by: &str,
        notes: &str,
    ) -> Result<u64> {
        let resolved = bind_selection(
            sqlx::query(concat!(
                "UPDATE outbox_deliveries d \
                 SET resolved_at = now(), resolved_by = $10, notes = $11, updated_at = now() \
                 FROM outbox_events e WHERE e.position = d.position AND ",
                include_str!("queries/dead_letter_selection.sql")
            )),
            subscription,
            selection,
            false,
        )
        .bind(resolved_by)
        .bind(notes)
        .execute(&self.pool)
        .await?;
        Ok(resolved.rows_affected())
    }

    /// The facts of the event at `position` on each of `subscriptions`, in their order.
    /// A subscription without a read position here (it has not read this source yet)
    /// has not handed the event out.
    pub async fn delivery_facts(
        &self,
        position: i64,
        subscriptions: &[Subscription],
    ) -> Result<Vec<DeliveryFacts>> {
        let ids: Vec<SubscriptionId> = subscriptions.iter().map(|s| s.id).collect();
        let rows = sqlx::query(include_str!("queries/event_deliveries.sql"))
            .bind(position)
            .bind(id_values(&ids))
            .fetch_all(&self.pool)
            .await?;
        let mut by_subscription = std::collections::HashMap::with_capacity(rows.len());
        for row in &rows {
            let record = match row.try_get::<Option<String>, _>("state")? {
                None => None,
                Some(state) => Some(DeliveryRecord {
                    state,
                    attempt: row.try_get::<i32, _>("attempt")?.max(0) as u32,
                    due_at: row.try_get("due_at")?,
                    overdue: row.try_get::<Option<bool>, _>("overdue")?.unwrap_or(false),
                    last_error: row.try_get("last_error")?,
                    dead_lettered_at: row.try_get("dead_lettered_at")?,
                    resolved_at: row.try_get("resolved_at")?,
                    resolved_by: row.try_get("resolved_by")?,
                    notes: row.try_get("notes")?,
                }),
            };
            by_subscription.insert(
                SubscriptionId(row.try_get("subscription_id")?),
                DeliveryFacts {
                    handed_out: row
                        .try_get::<Option<bool>, _>("handed_out")?
                        .unwrap_or(false),
                    skipped: row.try_get::<Option<bool>, _>("skipped")?.unwrap_or(false),
                    record,
                },
            );
        }
        Ok(ids
            .iter()
            .map(|id| by_subscription.remove(id).unwrap_or_default())
            .collect())
    }

    /// The latest events of an aggregate, newest first, with their positions.
    pub async fn aggregate_events(
        &self,
        aggregate_type: &str,
        aggregate_id: &str,
        limit: usize,
    ) -> Result<Vec<(i64, Event)>> {
        let rows = sqlx::query(concat!(
            "SELECT position, ",
            event_columns!(),
            " FROM outbox_events WHERE aggregate_type = $1 AND aggregate_id = $2 \
             ORDER BY position DESC LIMIT $3"
        ))
        .bind(aggregate_type)
        .bind(aggregate_id)
        .bind(limit as i64)
        .fetch_all(&self.pool)
        .await?;
        let events = events_from_rows(&rows, &self.source)?;
        rows.iter()
            .zip(events)
            .map(|(row, event)| Ok((row.try_get("position")?, event)))
            .collect()
    }

    /// The delivery counters here of every subscription, by subscription id.
    pub async fn counter_totals(&self) -> Result<Vec<CounterTotals>> {
        let rows = sqlx::query(
            "SELECT subscription_id, coalesce(sum(delivered), 0)::bigint AS delivered, \
                    coalesce(sum(acked), 0)::bigint AS acked \
             FROM outbox_subscription_counters GROUP BY subscription_id",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                Ok(CounterTotals {
                    subscription_id: SubscriptionId(row.try_get("subscription_id")?),
                    delivered: row.try_get::<i64, _>("delivered")?.max(0) as u64,
                    acked: row.try_get::<i64, _>("acked")?.max(0) as u64,
                })
            })
            .collect()
    }
}
