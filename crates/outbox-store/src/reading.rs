//! What the relay's scout asks of a source for all its subscriptions at once: the rows
//! committed past a read position, the subscriptions' read positions, which of them
//! have deliveries due, and moving the positions of those the new rows do not concern.
//! One statement each, whatever the number of subscriptions.

use sqlx::{Row, types::Json};

use outbox_domain::SubscriptionId;

use super::{
    Result, Store,
    columns::{from_id_values, id_values},
};

/// A read position: how far reading went in a source. The same shape as a
/// subscription's (see `queries/claim_new.sql`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadPosition {
    pub xact_id: i64,
    pub position: i64,
    /// Transactions still running when the cursor passed them, ascending.
    pub pending_xact_ids: Vec<i64>,
    /// For each pending transaction, the position up to which its rows were read.
    pub pending_positions: Vec<i64>,
}

/// A subscription's read position as stored, with the start time it skips events before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriptionPosition {
    pub subscription_id: SubscriptionId,
    pub at: ReadPosition,
    pub not_before: Option<chrono::DateTime<chrono::Utc>>,
}

/// What was read of the rows past a read position.
#[derive(Debug)]
pub struct ScannedRows {
    pub rows: Vec<ScannedRow>,
    /// Where reading stands after these rows.
    pub next: ReadPosition,
    /// Nothing more was visible: reading again now would find nothing.
    pub complete: bool,
}

/// What a subscription's filter looks at in a row of the outbox.
#[derive(Debug)]
pub struct ScannedRow {
    pub position: i64,
    pub event_type: String,
    pub aggregate_type: String,
    pub metadata: serde_json::Value,
}

/// A subscription whose read position moves from `from` to `to`, if it is still `from`.
#[derive(Debug)]
pub struct PositionMove<'a> {
    pub subscription: &'a SubscriptionPosition,
    pub to: &'a ReadPosition,
}

impl Store {
    /// Where reading would start if it began now: past everything committed, with every
    /// running transaction pending (as a subscription that starts at the latest event).
    pub async fn latest_read_position(&self) -> Result<ReadPosition> {
        let row = sqlx::query(start_position_sql!("true"))
            .fetch_one(&self.pool)
            .await?;
        let pending_xact_ids: Vec<i64> = row.try_get("pending_xact_ids")?;
        Ok(ReadPosition {
            xact_id: row.try_get("xact_id")?,
            position: 0,
            pending_positions: vec![0; pending_xact_ids.len()],
            pending_xact_ids,
        })
    }

    /// Reads at most `limit` rows past `from`, in the order subscriptions read them.
    pub async fn scan_new_events(&self, from: &ReadPosition, limit: usize) -> Result<ScannedRows> {
        let rows = sqlx::query(include_str!("queries/scan_new.sql"))
            .bind(from.xact_id)
            .bind(from.position)
            .bind(&from.pending_xact_ids)
            .bind(&from.pending_positions)
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(&self.pool)
            .await?;
        let first = rows.first().expect("the summary row is always there");
        let next = ReadPosition {
            xact_id: first.try_get("cursor_xact_id")?,
            position: first.try_get("cursor_position")?,
            pending_xact_ids: first.try_get("pending_xact_ids")?,
            pending_positions: first.try_get("pending_positions")?,
        };
        let complete = first.try_get("complete")?;
        let mut scanned = Vec::with_capacity(rows.len());
        for row in &rows {
            let Some(position) = row.try_get::<Option<i64>, _>("position")? else {
                continue;
            };
            let Json(metadata) = row.try_get("metadata")?;
            scanned.push(ScannedRow {
                position,
                event_type: row.try_get("event_type")?,
                aggregate_type: row.try_get("aggregate_type")?,
                metadata,
            });
        }
        Ok(ScannedRows {
            rows: scanned,
            next,
            complete,
        })
    }

    /// The read positions here of these subscriptions (those without one are left out).
    pub async fn read_positions(
        &self,
        subscription_ids: &[SubscriptionId],
    ) -> Result<Vec<SubscriptionPosition>> {
        let rows = sqlx::query(
            "SELECT subscription_id, cursor_xact_id, cursor_position, pending_xact_ids, \
                 pending_positions, not_before \
             FROM outbox_cursors WHERE subscription_id = ANY ($1)",
        )
        .bind(id_values(subscription_ids))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                Ok(SubscriptionPosition {
                    subscription_id: SubscriptionId(row.try_get("subscription_id")?),
                    at: ReadPosition {
                        xact_id: row.try_get("cursor_xact_id")?,
                        position: row.try_get("cursor_position")?,
                        pending_xact_ids: row.try_get("pending_xact_ids")?,
                        pending_positions: row.try_get("pending_positions")?,
                    },
                    not_before: row.try_get("not_before")?,
                })
            })
            .collect()
    }

    /// Moves each subscription's read position to its target, where it is still what
    /// was read (a claim, a seek or another gateway may have moved it since: that
    /// subscription is left as it is). Returns how many moved.
    pub async fn move_read_positions(&self, moves: &[PositionMove<'_>]) -> Result<u64> {
        if moves.is_empty() {
            return Ok(0);
        }
        // Arrays of arrays must be rectangular in PostgreSQL: the pending lists travel
        // as text and are compared and stored through a cast.
        let text = |ids: &[i64]| {
            let items: Vec<String> = ids.iter().map(i64::to_string).collect();
            format!("{{{}}}", items.join(","))
        };
        let mut ids = Vec::with_capacity(moves.len());
        let (
            mut from_xact,
            mut from_position,
            mut from_pending,
            mut from_taken,
            mut from_not_before,
        ) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut to_xact, mut to_position, mut to_pending, mut to_taken) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for PositionMove { subscription, to } in moves {
            ids.push(subscription.subscription_id.0);
            from_xact.push(subscription.at.xact_id);
            from_position.push(subscription.at.position);
            from_pending.push(text(&subscription.at.pending_xact_ids));
            from_taken.push(text(&subscription.at.pending_positions));
            from_not_before.push(subscription.not_before);
            to_xact.push(to.xact_id);
            to_position.push(to.position);
            to_pending.push(text(&to.pending_xact_ids));
            to_taken.push(text(&to.pending_positions));
        }
        let moved = sqlx::query(
            "UPDATE outbox_cursors c \
             SET cursor_xact_id = m.to_xact, cursor_position = m.to_position, \
                 pending_xact_ids = m.to_pending::bigint[], \
                 pending_positions = m.to_taken::bigint[], updated_at = now() \
             FROM unnest($1::bigint[], $2::bigint[], $3::bigint[], $4::text[], $5::text[], \
                         $6::timestamptz[], $7::bigint[], $8::bigint[], $9::text[], $10::text[]) \
                  AS m(id, from_xact, from_position, from_pending, from_taken, from_not_before, \
                       to_xact, to_position, to_pending, to_taken) \
             WHERE c.subscription_id = m.id \
               AND c.cursor_xact_id = m.from_xact AND c.cursor_position = m.from_position \
               AND c.pending_xact_ids = m.from_pending::bigint[] \
               AND c.pending_positions = m.from_taken::bigint[] \
               AND c.not_before IS NOT DISTINCT FROM m.from_not_before",
        )
        .bind(&ids)
        .bind(&from_xact)
        .bind(&from_position)
        .bind(&from_pending)
        .bind(&from_taken)
        .bind(&from_not_before)
        .bind(&to_xact)
        .bind(&to_position)
        .bind(&to_pending)
        .bind(&to_taken)
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(moved)
    }

    /// Which of these subscriptions have a delivery due here: a retry whose time came, a
    /// scheduled event whose time came, or a lease that expired (its gateway may be gone).
    pub async fn subscriptions_with_due_deliveries(
        &self,
        subscription_ids: &[SubscriptionId],
    ) -> Result<Vec<SubscriptionId>> {
        let due = sqlx::query_scalar(
            "SELECT s.id FROM unnest($1::bigint[]) AS s(id) \
             WHERE EXISTS (SELECT 1 FROM outbox_deliveries d \
                           WHERE d.subscription_id = s.id AND d.due_at <= now()) \
                OR EXISTS (SELECT 1 FROM outbox_delivery_batches b \
                           WHERE b.subscription_id = s.id AND b.due_at <= now())",
        )
        .bind(id_values(subscription_ids))
        .fetch_all(&self.pool)
        .await?;
        Ok(from_id_values(due))
    }

    /// Which of these subscriptions have leases here whose deadline passed.
    pub async fn subscriptions_with_expired_leases(
        &self,
        subscription_ids: &[SubscriptionId],
    ) -> Result<Vec<SubscriptionId>> {
        let expired = sqlx::query_scalar(
            "SELECT s.id FROM unnest($1::bigint[]) AS s(id) \
             WHERE EXISTS (SELECT 1 FROM outbox_deliveries d \
                           WHERE d.subscription_id = s.id AND d.due_at <= now() \
                             AND d.state = 'in_flight') \
                OR EXISTS (SELECT 1 FROM outbox_delivery_batches b \
                           WHERE b.subscription_id = s.id AND b.due_at <= now())",
        )
        .bind(id_values(subscription_ids))
        .fetch_all(&self.pool)
        .await?;
        Ok(from_id_values(expired))
    }
}
