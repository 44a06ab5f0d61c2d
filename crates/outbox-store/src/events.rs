//! Writing and reading outbox events.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use sqlx::{
    Column, Connection, PgConnection, PgPool, Postgres, Row, Type,
    pool::PoolConnection,
    postgres::{PgArguments, PgRow},
    query::Query,
    types::Json,
};
use tokio::time::Instant;
use uuid::Uuid;

use super::{Result, Store, StoreError};
use outbox_domain::{Event, NewEvent, SourceName};

/// The connection one publish committer keeps from statement to statement. Taking a
/// connection from sqlx's pool and giving it back costs more than a small INSERT: sqlx
/// pings every connection it takes back, a round trip from a task of its own.
pub struct PublishConnection {
    source: SourceName,
    pool: PgPool,
    held: Option<PoolConnection<Postgres>>,
    last_used: Instant,
    /// The connection was lost, or a transaction on it could not be ended: it is given
    /// back to the pool at once (which tests it and closes it if it is broken) instead of
    /// being kept, so it can never sit idle in a transaction.
    broken: bool,
}

/// A transaction that publishes events. End it with [`commit`](Self::commit) or
/// [`rollback`](Self::rollback) on every path: merely dropped, sqlx only queues the
/// rollback until the connection's next use, and a kept connection left idle in a
/// transaction holds every relay's read horizon back.
pub struct PublishTransaction<'c> {
    source: SourceName,
    transaction: sqlx::Transaction<'c, Postgres>,
    broken: &'c mut bool,
}

impl Store {
    pub fn publish_connection(&self) -> PublishConnection {
        PublishConnection {
            source: self.source.clone(),
            pool: self.publish_pool.clone(),
            held: None,
            last_used: Instant::now(),
            broken: false,
        }
    }
}

impl PublishConnection {
    async fn connection(&mut self) -> Result<&mut PgConnection> {
        self.release_if_broken();
        if let Some(connection) = &mut self.held
            && self.last_used.elapsed() >= super::IDLE_BEFORE_PING
            && connection.ping().await.is_err()
        {
            self.held = None;
        }
        let connection = match &mut self.held {
            Some(connection) => connection,
            none => none.insert(self.pool.acquire().await?),
        };
        self.last_used = Instant::now();
        Ok(connection)
    }

    /// Stores events whose ids are all new, in one autocommitted statement. `false` (and
    /// nothing written) when some id is already stored: the caller then needs a
    /// [`PublishTransaction`] to tell duplicates from conflicts.
    pub async fn insert_new_events(&mut self, ids: &[Uuid], events: &[&NewEvent]) -> Result<bool> {
        let metadata = metadata_json(events);
        let insert = bind_events(
            sqlx::query(include_str!("queries/insert_events.sql")),
            ids,
            events,
            &metadata,
        );
        let outcome = insert.execute(self.connection().await?).await;
        match outcome.map_err(StoreError::from) {
            Ok(_) => Ok(true),
            Err(StoreError::UniqueViolation { constraint })
                if constraint == "outbox_events_pkey" =>
            {
                Ok(false)
            }
            Err(error) => {
                self.broken = error.is_unavailable();
                self.release_if_broken();
                Err(error)
            }
        }
    }

    /// Gives a connection that failed back to the pool now rather than at the next
    /// statement: the pool tests it, flushing any rollback still queued on it, or closes
    /// it.
    pub fn release_if_broken(&mut self) {
        if std::mem::take(&mut self.broken) {
            self.held = None;
        }
    }

    pub async fn begin(&mut self) -> Result<PublishTransaction<'_>> {
        self.connection().await?;
        let PublishConnection {
            held,
            broken,
            source,
            ..
        } = self;
        let connection = held.as_mut().expect("connection() keeps one");
        match connection.begin().await {
            Ok(transaction) => Ok(PublishTransaction {
                source: source.clone(),
                transaction,
                broken,
            }),
            Err(error) => {
                *broken = true;
                Err(error.into())
            }
        }
    }
}

impl PublishTransaction<'_> {
    /// Inserts the events (whose ids are given separately, already resolved) in one
    /// statement and returns the ids that were new; the others already existed.
    pub async fn insert(&mut self, ids: &[Uuid], events: &[&NewEvent]) -> Result<Vec<Uuid>> {
        let metadata = metadata_json(events);
        let rows = bind_events(
            sqlx::query(concat!(
                include_str!("queries/insert_events.sql"),
                "ON CONFLICT (id) DO NOTHING RETURNING id"
            )),
            ids,
            events,
            &metadata,
        )
        .fetch_all(&mut *self.transaction)
        .await;
        let rows = self.broken_on_error(rows)?;
        rows.iter()
            .map(|row| Ok(row.try_get::<Uuid, _>("id")?))
            .collect()
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
        .await;
        let source = self.source.clone();
        events_from_rows(&self.broken_on_error(rows)?, &source)
    }

    pub async fn commit(self) -> Result<()> {
        let PublishTransaction {
            transaction,
            broken,
            ..
        } = self;
        transaction.commit().await.map_err(|error| {
            *broken = true;
            error.into()
        })
    }

    /// Rolls back now. When that fails the connection is marked broken, so it is not
    /// kept (see [`PublishConnection::release_if_broken`]).
    pub async fn rollback(self) -> Result<()> {
        let PublishTransaction {
            transaction,
            broken,
            ..
        } = self;
        transaction.rollback().await.map_err(|error| {
            *broken = true;
            error.into()
        })
    }

    fn broken_on_error<T>(&mut self, outcome: sqlx::Result<T>) -> Result<T> {
        outcome.map_err(|error| {
            let error = StoreError::from(error);
            *self.broken |= error.is_unavailable();
            error
        })
    }
}

fn metadata_json(events: &[&NewEvent]) -> Vec<String> {
    events
        .iter()
        .map(|event| serde_json::to_string(&event.metadata).expect("string map serializes"))
        .collect()
}

/// Binds a batch as the column arrays both insert statements take ($1 ids ... $9
/// occurred_at, $10 deliver_at, $11 expires_at).
fn bind_events<'q>(
    statement: Query<'q, Postgres, PgArguments>,
    ids: &'q [Uuid],
    events: &[&'q NewEvent],
    metadata: &'q [String],
) -> Query<'q, Postgres, PgArguments> {
    statement
        .bind(ids)
        .bind(column(events, |e| e.aggregate_type.as_str()))
        .bind(column(events, |e| e.aggregate_id.as_str()))
        .bind(column(events, |e| e.aggregate_version))
        .bind(column(events, |e| e.event_type.as_str()))
        .bind(column(events, |e| e.payload.as_slice()))
        .bind(column(events, |e| e.content_type.as_str()))
        .bind(metadata)
        .bind(column(events, |e| e.occurred_at))
        .bind(column(events, |e| e.deliver_at))
        .bind(column(events, |e| e.expires_at))
}

/// One field of every event, as the array bound to one column.
fn column<'q, T>(events: &[&'q NewEvent], field: impl Fn(&'q NewEvent) -> T) -> Vec<T> {
    events.iter().map(|event| field(event)).collect()
}

/// Reads the event columns (`id` through `created_at`) of a row of `source`.
pub(super) fn event_from_row(row: &PgRow, source: &SourceName) -> Result<Event> {
    EventColumns::of(row)?.event(row, source)
}

/// The events in `rows`, rows of one result, its columns found once.
pub(super) fn events_from_rows(rows: &[PgRow], source: &SourceName) -> Result<Vec<Event>> {
    let Some(first) = rows.first() else {
        return Ok(Vec::new());
    };
    let columns = EventColumns::of(first)?;
    rows.iter().map(|row| columns.event(row, source)).collect()
}

/// Where the event columns sit in the rows of one result, their types checked. sqlx
/// finds a column named by text through a hash of the name, and checks the type of
/// every value it decodes, for every row and column; a claim of hundreds of events
/// does both once.
#[derive(Debug, Clone, Copy)]
pub(super) struct EventColumns {
    id: usize,
    aggregate_type: usize,
    aggregate_id: usize,
    aggregate_version: usize,
    event_type: usize,
    payload: usize,
    content_type: usize,
    metadata: usize,
    occurred_at: usize,
    created_at: usize,
    deliver_at: usize,
    expires_at: usize,
    xact_id: usize,
}

impl EventColumns {
    /// The columns of `row`'s result.
    pub(super) fn of(row: &PgRow) -> Result<EventColumns> {
        Ok(EventColumns {
            id: typed_column_at::<Uuid>(row, "id")?,
            aggregate_type: typed_column_at::<String>(row, "aggregate_type")?,
            aggregate_id: typed_column_at::<String>(row, "aggregate_id")?,
            aggregate_version: typed_column_at::<i64>(row, "aggregate_version")?,
            event_type: typed_column_at::<String>(row, "event_type")?,
            payload: typed_column_at::<Vec<u8>>(row, "payload")?,
            content_type: typed_column_at::<String>(row, "content_type")?,
            metadata: typed_column_at::<Json<HashMap<String, String>>>(row, "metadata")?,
            occurred_at: typed_column_at::<DateTime<Utc>>(row, "occurred_at")?,
            created_at: typed_column_at::<DateTime<Utc>>(row, "created_at")?,
            deliver_at: typed_column_at::<DateTime<Utc>>(row, "deliver_at")?,
            expires_at: typed_column_at::<DateTime<Utc>>(row, "expires_at")?,
            xact_id: typed_column_at::<i64>(row, "xact_id")?,
        })
    }

    /// The id of the transaction that wrote the event in `row`.
    pub(super) fn transaction_id(&self, row: &PgRow) -> Result<i64> {
        Ok(row.try_get_unchecked(self.xact_id)?)
    }

    /// The length of the payload of the event in `row`, without copying it.
    pub(super) fn payload_len(&self, row: &PgRow) -> Result<usize> {
        Ok(row.try_get_unchecked::<&[u8], _>(self.payload)?.len())
    }

    /// The metadata of the event in `row`. Most events have none: `{}` is taken as it
    /// is, without parsing JSON or allocating a map.
    fn metadata(&self, row: &PgRow) -> Result<HashMap<String, String>> {
        // The column's bytes as sent: jsonb's binary format is a version byte (1) and
        // the text.
        let raw: &[u8] = row.try_get_unchecked(self.metadata)?;
        if matches!(raw, b"\x01{}" | b"{}") {
            return Ok(HashMap::new());
        }
        let metadata: Json<HashMap<String, String>> = row
            .try_get_unchecked(self.metadata)
            .map_err(|error| StoreError::Corrupt(format!("event metadata: {error}")))?;
        Ok(metadata.0)
    }

    /// The event in `row`, a row of the result these columns were found in (so the
    /// values' types need no check).
    pub(super) fn event(&self, row: &PgRow, source: &SourceName) -> Result<Event> {
        let metadata = self.metadata(row)?;
        Ok(Event {
            source: source.clone(),
            id: row.try_get_unchecked(self.id)?,
            aggregate_type: row.try_get_unchecked(self.aggregate_type)?,
            aggregate_id: row.try_get_unchecked(self.aggregate_id)?,
            aggregate_version: row.try_get_unchecked(self.aggregate_version)?,
            event_type: row.try_get_unchecked(self.event_type)?,
            payload: row.try_get_unchecked(self.payload)?,
            content_type: row.try_get_unchecked(self.content_type)?,
            metadata,
            occurred_at: row.try_get_unchecked(self.occurred_at)?,
            created_at: row.try_get_unchecked(self.created_at)?,
            deliver_at: row.try_get_unchecked(self.deliver_at)?,
            expires_at: row.try_get_unchecked(self.expires_at)?,
            transaction_id: row.try_get_unchecked(self.xact_id)?,
        })
    }
}

/// Where the column `name` sits in `row`'s result.
pub(super) fn column_at(row: &PgRow, name: &str) -> Result<usize> {
    Ok(row.try_column(name)?.ordinal())
}

/// Where the column `name` sits in `row`'s result, checked to hold values of `T` (or
/// NULL): the result's rows are then decoded with `try_get_unchecked`, which leaves out
/// the check that `try_get` makes for every value.
pub(super) fn typed_column_at<T: Type<Postgres>>(row: &PgRow, name: &str) -> Result<usize> {
    let column = row.try_column(name)?;
    let found = column.type_info();
    if !T::compatible(found) {
        return Err(StoreError::Corrupt(format!(
            "column {name} holds {found} where {} was expected",
            T::type_info()
        )));
    }
    Ok(column.ordinal())
}
