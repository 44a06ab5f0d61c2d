//! Operator actions: requeues, dead-letter triage, seeks, setting changes and stats.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Row};
use uuid::Uuid;

use super::{
    Result, Store, StoreError,
    columns::{Cursor, bind_unread, cursor, millis, start_columns},
    deliveries::{Moved, split_batches},
    events::{event_from_row, events_from_rows},
    locks::{LockMode, lock_subscription},
    subscriptions::{insert_cursor, subscription_from_row},
};
use outbox_domain::{
    DeadLetter, DeadLetterSelection, Event, EventFilter, OutboxStats, PayloadTransform,
    StartPosition, Subscription, SubscriptionId, SubscriptionName, SubscriptionStats,
};

/// A seek made in one database and not yet committed (see [`Store::prepare_seek`]). End
/// it with [`commit`](Self::commit) or [`rollback`](Self::rollback): merely dropped, its
/// lock is held until the connection's next use.
pub struct PreparedSeek {
    transaction: sqlx::Transaction<'static, sqlx::Postgres>,
}

impl PreparedSeek {
    pub async fn commit(self) -> Result<()> {
        self.transaction.commit().await?;
        Ok(())
    }

    pub async fn rollback(self) {
        if let Err(error) = self.transaction.rollback().await {
            tracing::debug!(%error, "could not roll back a seek");
        }
    }
}

/// Why a requeue changed nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequeueRefusal {
    /// The event is leased to a consumer of this subscription right now.
    InFlight { subscription: SubscriptionName },
}

impl Store {
    pub async fn event_by_id(&self, id: Uuid) -> Result<Option<(i64, Event)>> {
        let row = sqlx::query(concat!(
            "SELECT position, ",
            event_columns!(),
            " FROM outbox_events WHERE id = $1"
        ))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.map(|row| {
            Ok((
                row.try_get("position")?,
                event_from_row(&row, &self.source)?,
            ))
        })
        .transpose()
    }

    /// The most recent event of an aggregate with the given type.
    pub async fn latest_event(
        &self,
        aggregate_type: &str,
        aggregate_id: &str,
        event_type: &str,
    ) -> Result<Option<(i64, Event)>> {
        let row = sqlx::query(concat!(
            "SELECT position, ",
            event_columns!(),
            " FROM outbox_events \
             WHERE aggregate_type = $1 AND aggregate_id = $2 AND event_type = $3 \
             ORDER BY xact_id DESC, position DESC LIMIT 1"
        ))
        .bind(aggregate_type)
        .bind(aggregate_id)
        .bind(event_type)
        .fetch_optional(&self.pool)
        .await?;
        row.map(|row| {
            Ok((
                row.try_get("position")?,
                event_from_row(&row, &self.source)?,
            ))
        })
        .transpose()
    }

    /// Makes one event deliverable again, attempts reset, on each given subscription
    /// that has already handed it out; returns the subscriptions where it was requeued.
    /// All or nothing: refused when the event is in flight on any of them.
    pub async fn requeue_event<'a>(
        &self,
        subscriptions: &'a [Subscription],
        position: i64,
    ) -> Result<Result<Vec<&'a SubscriptionName>, RequeueRefusal>> {
        run_in_transaction!(self.pool, |transaction| {
            // Every check comes before the first requeue: a refusal returns before anything
            // is written, and the transaction commits nothing.
            for subscription in subscriptions {
                lock_subscription(transaction, subscription.id, LockMode::Exclusive).await?;
                let in_flight: bool = sqlx::query_scalar(
                    "SELECT EXISTS (SELECT 1 FROM outbox_delivery_records \
                 WHERE subscription_id = $1 AND position = $2 AND state = 'in_flight' \
                   AND due_at > now())",
                )
                .bind(subscription.id.0)
                .bind(position)
                .fetch_one(&mut *transaction)
                .await?;
                if in_flight {
                    return Ok(Err(RequeueRefusal::InFlight {
                        subscription: subscription.name.clone(),
                    }));
                }
            }
            let mut requeued = Vec::new();
            for subscription in subscriptions {
                let Some(cursor) = cursor(transaction, subscription.id).await? else {
                    continue;
                };
                if handed_out(transaction, &cursor, position).await?
                    && requeue_positions(transaction, subscription, &[position]).await? > 0
                {
                    requeued.push(&subscription.name);
                }
            }
            Ok(Ok(requeued))
        })
    }

    /// Sends the selected dead letters of a subscription back for delivery; an empty
    /// selection takes every unresolved one. Resolved ones only when chosen by id.
    pub async fn requeue_dead_letters(
        &self,
        subscription: &Subscription,
        selection: &DeadLetterSelection,
    ) -> Result<u64> {
        run_in_transaction!(self.pool, |transaction| {
            lock_subscription(transaction, subscription.id, LockMode::Exclusive).await?;
            let rows = bind_selection(
                sqlx::query(concat!(
                    "SELECT d.position FROM outbox_deliveries d \
                 JOIN outbox_events e ON e.position = d.position WHERE ",
                    include_str!("queries/dead_letter_selection.sql")
                )),
                subscription,
                selection,
                !selection.ids.is_empty(),
            )
            .fetch_all(&mut *transaction)
            .await?;
            let positions = rows
                .iter()
                .map(|row| row.try_get("position"))
                .collect::<Result<Vec<i64>, _>>()?;
            let requeued = requeue_positions(transaction, subscription, &positions).await?;
            Ok(requeued)
        })
    }

    /// One page of the selected dead letters, oldest first, starting after `after`.
    pub async fn dead_letters(
        &self,
        subscription: &Subscription,
        selection: &DeadLetterSelection,
        include_resolved: bool,
        after: Option<(DateTime<Utc>, i64)>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>> {
        let rows = bind_selection(
            sqlx::query(concat!(
                "SELECT d.attempt, d.last_error, d.dead_lettered_at, d.resolved_at, \
                        d.resolved_by, d.notes, d.position, ",
                qualified_event_columns!(),
                " FROM outbox_deliveries d JOIN outbox_events e ON e.position = d.position \
                 WHERE ",
                include_str!("queries/dead_letter_selection.sql"),
                " AND ($10::timestamptz IS NULL OR (d.dead_lettered_at, d.position) > ($10, $11)) \
                 ORDER BY d.dead_lettered_at, d.position LIMIT $12"
            )),
            subscription,
            selection,
            include_resolved,
        )
        .bind(after.map(|(at, _)| at))
        .bind(after.map(|(_, position)| position))
        .bind(limit as i64)
        .fetch_all(&self.pool)
        .await?;
        // A page of rows: their event columns found once.
        let events = events_from_rows(&rows, &self.source)?;
        rows.iter()
            .zip(events)
            .map(|(row, event)| dead_letter_from_row(&subscription.name, event, row))
            .collect()
    }

    /// Marks a dead letter handled; `None` when the event is no dead letter there.
    pub async fn resolve_dead_letter(
        &self,
        subscription: &Subscription,
        event_id: Uuid,
        resolved_by: &str,
        notes: &str,
    ) -> Result<Option<DeadLetter>> {
        let row = sqlx::query(concat!(
            "WITH resolved AS ( \
                 UPDATE outbox_deliveries d \
                 SET resolved_at = now(), resolved_by = $3, notes = $4, updated_at = now() \
                 FROM outbox_events e \
                 WHERE d.subscription_id = $1 AND d.state = 'dead' \
                   AND e.position = d.position AND e.id = $2 \
                 RETURNING d.position, d.attempt, d.last_error, d.dead_lettered_at, \
                           d.resolved_at, d.resolved_by, d.notes \
             ) \
             SELECT r.attempt, r.last_error, r.dead_lettered_at, r.resolved_at, r.resolved_by, \
                    r.notes, r.position, ",
            event_columns!(),
            " FROM resolved r JOIN outbox_events USING (position)"
        ))
        .bind(subscription.id.0)
        .bind(event_id)
        .bind(resolved_by)
        .bind(notes)
        .fetch_optional(&self.pool)
        .await?;
        row.map(|row| {
            let event = event_from_row(&row, &self.source)?;
            dead_letter_from_row(&subscription.name, event, &row)
        })
        .transpose()
    }

    /// Moves the subscription's read position in this database, or starts it there at
    /// `to`, in a transaction left open: a seek across sources prepares every one before
    /// it commits any, so a source that fails changes nothing in the others.
    pub async fn prepare_seek(
        &self,
        subscription_id: SubscriptionId,
        to: StartPosition,
    ) -> Result<PreparedSeek> {
        super::run_again_on_conflict(|| async {
            let mut prepared = PreparedSeek {
                transaction: self.pool.begin().await?,
            };
            match seek(&mut prepared.transaction, subscription_id, to).await {
                Ok(()) => Ok(prepared),
                Err(error) => {
                    prepared.rollback().await;
                    Err(error)
                }
            }
        })
        .await
    }

    /// Stores a subscription's new settings (not its name, start or ordering), push
    /// settings, signing keys and stop included.
    pub async fn update_subscription(
        &self,
        subscription: &Subscription,
    ) -> Result<Option<Subscription>> {
        let settings = &subscription.settings;
        let row = sqlx::query(concat!(
            "UPDATE outbox_subscriptions SET event_types = $2, aggregate_types = $3, \
                 metadata_match = $4, ack_deadline_ms = $5, max_attempts = $6, \
                 retry_backoff_min_ms = $7, retry_backoff_max_ms = $8, \
                 persistent_event_types = $9, max_event_age_ms = $10, \
                 dead_letter_expired = $11, push = $12, push_secrets = $13, \
                 push_stopped_at = $14, push_stopped_reason = $15, sink = $16, \
                 filter = $17, transform = $18, updated_at = now() \
             WHERE name = $1 RETURNING ",
            subscription_columns!()
        ))
        .bind(subscription.name.as_str())
        .bind(settings.event_types.to_strings())
        .bind(&settings.aggregate_types)
        .bind(sqlx::types::Json(&settings.metadata_match))
        .bind(millis(settings.ack_deadline))
        .bind(settings.max_attempts as i32)
        .bind(millis(settings.retry_backoff_min))
        .bind(millis(settings.retry_backoff_max))
        .bind(settings.persistent_event_types.to_strings())
        .bind(settings.max_event_age.map(millis))
        .bind(settings.dead_letter_expired)
        .bind(super::subscriptions::stored_push(settings.push.as_ref()))
        .bind(sqlx::types::Json(super::subscriptions::stored_secrets(
            &subscription.push_secrets,
        )))
        .bind(subscription.push_stopped.as_ref().map(|stopped| stopped.at))
        .bind(
            subscription
                .push_stopped
                .as_ref()
                .map(|stopped| stopped.reason.as_str()),
        )
        .bind(super::subscriptions::stored_sink(settings.sink.as_ref()))
        .bind(settings.filter.as_ref().map(EventFilter::as_str))
        .bind(settings.transform.as_ref().map(PayloadTransform::as_str))
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(subscription_from_row).transpose()
    }

    pub async fn subscription_stats(
        &self,
        subscription: &Subscription,
    ) -> Result<Option<SubscriptionStats>> {
        let mut connection = self.pool.acquire().await?;
        let Some(cursor) = cursor(&mut connection, subscription.id).await? else {
            return Ok(None);
        };
        let settings = &subscription.settings;
        let row = bind_unread(
            sqlx::query(include_str!("queries/subscription_stats.sql"))
                .bind(subscription.id.0)
                .bind(cursor.xact_id)
                .bind(cursor.position),
            settings,
            &cursor,
        )
        .fetch_one(&mut *connection)
        .await?;
        let count =
            |column: &str| -> Result<u64> { Ok(row.try_get::<i64, _>(column)?.max(0) as u64) };
        Ok(Some(SubscriptionStats {
            name: subscription.name.clone(),
            source: Some(self.source.clone()),
            pending: count("pending")?,
            in_flight: count("in_flight")?,
            awaiting_retry: count("awaiting_retry")?,
            dead_lettered: count("dead_lettered")?,
            oldest_unacked_at: row.try_get("oldest_unacked")?,
            delivered_total: count("delivered")?,
            acked_total: count("acked")?,
            late_transactions: count("late_transactions")?,
            expired_total: count("expired")?,
            scheduled: count("scheduled")?,
            next_scheduled_at: row.try_get("next_scheduled")?,
            filtered_total: count("filtered")?,
            filter_errors_total: count("filter_errors")?,
            last_filter_error: row
                .try_get::<Option<String>, _>("last_filter_error")?
                .zip(row.try_get::<Option<DateTime<Utc>>, _>("last_filter_error_at")?),
        }))
    }

    pub async fn outbox_stats(&self) -> Result<OutboxStats> {
        let row = sqlx::query(
            "SELECT count(*) AS events, min(created_at) AS oldest, max(created_at) AS newest, \
                 (SELECT coalesce(extract(epoch FROM max(now() - xact_start)), 0)::float8 \
                  FROM pg_stat_activity WHERE backend_xid IS NOT NULL) AS oldest_transaction, \
                 (SELECT coalesce(max(value), 0) FROM outbox_gateway_counters \
                  WHERE name = 'events_force_expired') AS force_expired \
             FROM outbox_events",
        )
        .fetch_one(&self.pool)
        .await?;
        let oldest_transaction: f64 = row.try_get("oldest_transaction")?;
        Ok(OutboxStats {
            events_stored: row.try_get::<i64, _>("events")?.max(0) as u64,
            oldest_event_at: row.try_get("oldest")?,
            newest_event_at: row.try_get("newest")?,
            oldest_open_transaction_age: Duration::from_secs_f64(oldest_transaction.max(0.0)),
            events_force_expired: row.try_get::<i64, _>("force_expired")?.max(0) as u64,
        })
    }
}

/// True when the subscription has handed the event out (or filtered it away): the
/// cursor has passed it, and it is not a row of a transaction the subscription still
/// waits for.
async fn handed_out(connection: &mut PgConnection, cursor: &Cursor, position: i64) -> Result<bool> {
    Ok(sqlx::query_scalar(
        "SELECT (e.xact_id, e.position) <= ($1, $2) \
                AND NOT EXISTS (SELECT 1 FROM unnest($4::bigint[], $5::bigint[]) AS p(xact_id, taken) \
                                WHERE p.xact_id = e.xact_id AND e.position > p.taken) \
         FROM outbox_events e WHERE e.position = $3",
    )
    .bind(cursor.xact_id)
    .bind(cursor.position)
    .bind(position)
    .bind(&cursor.pending_xact_ids)
    .bind(&cursor.pending_positions)
    .fetch_optional(connection)
    .await?
    .unwrap_or(false))
}

async fn requeue_positions(
    connection: &mut PgConnection,
    subscription: &Subscription,
    positions: &[i64],
) -> Result<u64> {
    if positions.is_empty() {
        return Ok(0);
    }
    split_batches(
        &mut *connection,
        subscription.id,
        Moved::Positions(positions),
    )
    .await?;
    let requeued = sqlx::query(include_str!("queries/requeue.sql"))
        .bind(subscription.id.0)
        .bind(positions)
        .bind(subscription.settings.ordered)
        .execute(connection)
        .await?;
    Ok(requeued.rows_affected())
}

/// Binds parameters $1 to $9 of `queries/dead_letter_selection.sql`.
pub(super) fn bind_selection<'q>(
    query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    subscription: &Subscription,
    selection: &'q DeadLetterSelection,
    include_resolved: bool,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    query
        .bind(subscription.id.0)
        .bind(&selection.ids)
        .bind(selection.event_types.to_regex())
        .bind(selection.aggregate_type.as_deref())
        .bind(selection.aggregate_id.as_deref())
        .bind(selection.last_error.as_deref())
        .bind(selection.dead_lettered_after)
        .bind(selection.dead_lettered_before)
        .bind(include_resolved)
}

/// The dead letter in `row`, whose `event` was decoded from it.
pub(super) fn dead_letter_from_row(
    subscription: &SubscriptionName,
    event: Event,
    row: &sqlx::postgres::PgRow,
) -> Result<DeadLetter> {
    let attempts: i32 = row.try_get("attempt")?;
    Ok(DeadLetter {
        subscription: subscription.clone(),
        event,
        position: row.try_get("position")?,
        attempts: attempts.max(0) as u32,
        last_error: row.try_get("last_error")?,
        dead_lettered_at: row
            .try_get::<Option<DateTime<Utc>>, _>("dead_lettered_at")?
            .ok_or_else(|| StoreError::Corrupt("dead letter without a time".into()))?,
        resolved_at: row.try_get("resolved_at")?,
        resolved_by: row.try_get("resolved_by")?,
        notes: row.try_get("notes")?,
    })
}

/// Moves the subscription's read position to `to`, or starts it there when it has none.
async fn seek(
    connection: &mut PgConnection,
    subscription_id: SubscriptionId,
    to: StartPosition,
) -> Result<()> {
    lock_subscription(connection, subscription_id, LockMode::Exclusive).await?;
    // A claim after the seek may read again what the subscription's batches hold in
    // flight; as records, those keep their lease (see claim_new.sql).
    split_batches(&mut *connection, subscription_id, Moved::All).await?;
    let (start_kind, not_before) = start_columns(to);
    let moved = sqlx::query(concat!(
        "UPDATE outbox_cursors c \
         SET cursor_xact_id = start.xact_id, cursor_position = 0, \
             pending_xact_ids = start.pending_xact_ids, \
             pending_positions = start.pending_positions, \
             not_before = $3, updated_at = now() \
         FROM (",
        start_position_sql!("$2"),
        ") AS start WHERE c.subscription_id = $1"
    ))
    .bind(subscription_id.0)
    .bind(start_kind == "latest")
    .bind(not_before)
    .execute(&mut *connection)
    .await?
    .rows_affected();
    if moved == 0 {
        insert_cursor(connection, subscription_id, to).await?;
    }
    Ok(())
}
