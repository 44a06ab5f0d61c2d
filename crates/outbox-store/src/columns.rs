//! Columns several groups of statements share: a subscription's read position in a
//! source (its cursor), subscription ids, start positions, the metadata filter and
//! durations in milliseconds.

use std::{collections::BTreeMap, time::Duration};

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Postgres, Row, postgres::PgArguments, query::Query, types::Json};

use super::Result;
use outbox_domain::{StartPosition, SubscriptionId, SubscriptionSettings};

/// Subscription ids as a `bigint[]` parameter.
pub(super) fn id_values(ids: &[SubscriptionId]) -> Vec<i64> {
    ids.iter().map(|id| id.0).collect()
}

/// Subscription ids read back from a `bigint` column.
pub(super) fn from_id_values(values: Vec<i64>) -> Vec<SubscriptionId> {
    values.into_iter().map(SubscriptionId).collect()
}

/// How far a subscription has read in one database.
#[derive(Debug, Clone, PartialEq)]
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

/// The subscription's read position in this database; `None` when it has none here.
pub(super) async fn cursor(
    connection: &mut PgConnection,
    subscription_id: SubscriptionId,
) -> Result<Option<Cursor>> {
    let row = sqlx::query(
        "SELECT cursor_xact_id, cursor_position, pending_xact_ids, pending_positions, not_before \
         FROM outbox_cursors WHERE subscription_id = $1",
    )
    .bind(subscription_id.0)
    .fetch_optional(connection)
    .await?;
    row.map(|row| {
        Ok(Cursor {
            xact_id: row.try_get("cursor_xact_id")?,
            position: row.try_get("cursor_position")?,
            pending_xact_ids: row.try_get("pending_xact_ids")?,
            pending_positions: row.try_get("pending_positions")?,
            not_before: row.try_get("not_before")?,
        })
    })
    .transpose()
}

/// Binds, in this order, what selects the subscription's rows past its cursor: the
/// event-type regex, aggregate types, metadata match, not_before, and the pending
/// transactions with how far each was taken (as `subscription_stats.sql`,
/// `peek_new.sql` and `claim_fresh.sql` number their parameters).
pub(super) fn bind_unread<'q>(
    query: Query<'q, Postgres, PgArguments>,
    settings: &'q SubscriptionSettings,
    cursor: &'q Cursor,
) -> Query<'q, Postgres, PgArguments> {
    query
        .bind(settings.event_types.to_regex())
        .bind(&settings.aggregate_types)
        .bind(metadata_filter(settings))
        .bind(cursor.not_before)
        .bind(&cursor.pending_xact_ids)
        .bind(&cursor.pending_positions)
}

/// A start position as stored: its kind ('latest', 'earliest' or 'time') and time.
pub(super) fn start_columns(start: StartPosition) -> (&'static str, Option<DateTime<Utc>>) {
    match start {
        StartPosition::Latest => ("latest", None),
        StartPosition::Earliest => ("earliest", None),
        StartPosition::Time(time) => ("time", Some(time)),
    }
}

/// The metadata filter as a statement parameter: NULL when it matches everything, so the
/// custom plan drops it and estimates row counts without its default selectivity.
fn metadata_filter(settings: &SubscriptionSettings) -> Option<Json<&BTreeMap<String, String>>> {
    (!settings.metadata_match.is_empty()).then_some(Json(&settings.metadata_match))
}

pub(super) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}
