//! Subscription definitions (kept in the `default` source) and read positions (kept in
//! every source, one per subscription that reads it).

use std::{collections::BTreeMap, time::Duration};

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Row, postgres::PgRow, types::Json};

use super::{
    Result, Store, StoreError,
    columns::{from_id_values, id_values, millis, start_columns},
    locks::{LockMode, lock_subscription},
};
use outbox_domain::{
    DEFAULT_PUSH_BATCH_BYTES, EventFilter, PatternSet, Pause, PayloadTransform, PushConfig,
    PushFormat, PushSecret, PushStopped, SinkConfig, SourceName, StartPosition, Subscription,
    SubscriptionId, SubscriptionName, SubscriptionSettings, Template,
};

/// What a new subscription's definition is stored with.
pub struct NewDefinition<'a> {
    pub name: &'a SubscriptionName,
    pub settings: &'a SubscriptionSettings,
    pub sources: &'a [SourceName],
    pub start: StartPosition,
    pub expire_after_idle: Option<Duration>,
    /// Push signing secrets (empty for a pull subscription).
    pub secrets: &'a [PushSecret],
}

impl Store {
    /// Stores a new subscription's definition and, when it reads this database too, its
    /// read position here, in one transaction. A taken name is
    /// [`StoreError::UniqueViolation`].
    pub async fn create_subscription(
        &self,
        new: &NewDefinition<'_>,
        reads_here: bool,
    ) -> Result<Subscription> {
        let NewDefinition {
            name,
            settings,
            sources,
            start,
            expire_after_idle,
            secrets,
        } = *new;
        let (start_kind, start_time) = start_columns(start);
        run_in_transaction!(self.pool, |transaction| {
            let row = sqlx::query(concat!(
            "INSERT INTO outbox_subscriptions (name, event_types, aggregate_types, metadata_match, \
                 ack_deadline_ms, max_attempts, retry_backoff_min_ms, retry_backoff_max_ms, ordered, \
                 persistent_event_types, sources, start_kind, start_time, max_event_age_ms, \
                 dead_letter_expired, expire_after_idle_ms, push, push_secrets, sink, filter, \
                 transform) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, \
                     $17, $18, $19, $20, $21) \
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
        .bind(source_names(sources))
        .bind(start_kind)
        .bind(start_time)
        .bind(settings.max_event_age.map(millis))
        .bind(settings.dead_letter_expired)
        .bind(expire_after_idle.map(millis))
        .bind(stored_push(settings.push.as_ref()))
        .bind(Json(stored_secrets(secrets)))
        .bind(stored_sink(settings.sink.as_ref()))
        .bind(settings.filter.as_ref().map(EventFilter::as_str))
        .bind(settings.transform.as_ref().map(PayloadTransform::as_str))
        .fetch_one(&mut *transaction)
        .await?;
            let subscription = subscription_from_row(&row)?;
            if reads_here {
                insert_cursor(transaction, subscription.id, start).await?;
            }
            Ok(subscription)
        })
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

    pub async fn subscription_by_id(&self, id: SubscriptionId) -> Result<Option<Subscription>> {
        let row = sqlx::query(concat!(
            "SELECT ",
            subscription_columns!(),
            " FROM outbox_subscriptions WHERE id = $1"
        ))
        .bind(id.0)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(subscription_from_row).transpose()
    }

    /// The definitions of these subscriptions that still exist.
    pub async fn subscriptions_by_ids(&self, ids: &[SubscriptionId]) -> Result<Vec<Subscription>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            subscription_columns!(),
            " FROM outbox_subscriptions WHERE id = ANY ($1)"
        ))
        .bind(id_values(ids))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(subscription_from_row).collect()
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

    /// Records that streams are attached to these subscriptions now: idle ones expire by
    /// it, and an operator's view tells from it whether a subscription has a consumer.
    pub async fn touch_attached(&self, subscription_ids: &[SubscriptionId]) -> Result<()> {
        sqlx::query("UPDATE outbox_subscriptions SET last_attached_at = now() WHERE id = ANY ($1)")
            .bind(id_values(subscription_ids))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Replaces the record of the Subscribe streams `gateway` holds with `streams` (per
    /// subscription, none of them 0), refreshing its time, and drops the records other
    /// gateways left more than `lifetime` ago (they died without removing theirs).
    pub async fn record_streams(
        &self,
        gateway: uuid::Uuid,
        streams: &[(SubscriptionId, u32)],
        lifetime: Duration,
    ) -> Result<()> {
        let ids: Vec<i64> = streams.iter().map(|(id, _)| id.0).collect();
        let counts: Vec<i32> = streams
            .iter()
            .map(|(_, count)| i32::try_from(*count).unwrap_or(i32::MAX))
            .collect();
        // Its own rows are never among the dead ones: one statement may not both delete
        // and upsert a row.
        sqlx::query(
            "WITH dropped AS ( \
                 DELETE FROM outbox_subscription_streams \
                 WHERE (gateway = $1 AND NOT subscription_id = ANY ($2)) \
                    OR (gateway <> $1 AND seen_at < now() - $4 * interval '1 millisecond') \
             ) \
             INSERT INTO outbox_subscription_streams (subscription_id, gateway, streams, seen_at) \
             SELECT id, $1, count, now() FROM unnest($2::bigint[], $3::int[]) AS held (id, count) \
             ON CONFLICT (subscription_id, gateway) \
             DO UPDATE SET streams = EXCLUDED.streams, seen_at = EXCLUDED.seen_at",
        )
        .bind(gateway)
        .bind(ids)
        .bind(counts)
        .bind(millis(lifetime))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Removes the record of `gateway`'s streams: it stops holding any.
    pub async fn forget_streams(&self, gateway: uuid::Uuid) -> Result<()> {
        sqlx::query("DELETE FROM outbox_subscription_streams WHERE gateway = $1")
            .bind(gateway)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Subscriptions a gateway recorded Subscribe streams on within `lifetime`.
    pub async fn subscriptions_with_streams(
        &self,
        lifetime: Duration,
    ) -> Result<Vec<SubscriptionId>> {
        let ids: Vec<i64> = sqlx::query_scalar(
            "SELECT DISTINCT subscription_id FROM outbox_subscription_streams \
             WHERE seen_at >= now() - $1 * interval '1 millisecond'",
        )
        .bind(millis(lifetime))
        .fetch_all(&self.pool)
        .await?;
        Ok(from_id_values(ids))
    }

    /// Subscriptions with no stream attached anywhere for longer than their
    /// `expire_after_idle`, leaving out `attached_here` (streams of this process not yet
    /// recorded).
    pub async fn idle_expired(
        &self,
        attached_here: &[SubscriptionId],
    ) -> Result<Vec<SubscriptionName>> {
        let names: Vec<String> = sqlx::query_scalar(
            "SELECT name FROM outbox_subscriptions \
             WHERE expire_after_idle_ms IS NOT NULL \
               AND last_attached_at < now() - expire_after_idle_ms * interval '1 millisecond' \
               AND NOT id = ANY ($1) \
             ORDER BY name",
        )
        .bind(id_values(attached_here))
        .fetch_all(&self.pool)
        .await?;
        names
            .iter()
            .map(|name| {
                SubscriptionName::parse("name", name)
                    .map_err(|error| StoreError::Corrupt(error.to_string()))
            })
            .collect()
    }

    /// The push subscriptions that are pushing (set and not stopped).
    pub async fn active_push_subscriptions(&self) -> Result<Vec<Subscription>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            subscription_columns!(),
            " FROM outbox_subscriptions \
             WHERE push IS NOT NULL AND push_stopped_at IS NULL ORDER BY name"
        ))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(subscription_from_row).collect()
    }

    /// The sink subscriptions.
    pub async fn sink_subscriptions(&self) -> Result<Vec<Subscription>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            subscription_columns!(),
            " FROM outbox_subscriptions WHERE sink IS NOT NULL ORDER BY name"
        ))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(subscription_from_row).collect()
    }

    /// Deletes a subscription's definition, and its read position and delivery records
    /// in this database; the id it had, or `None` when it did not exist.
    pub async fn delete_subscription(
        &self,
        name: &SubscriptionName,
    ) -> Result<Option<SubscriptionId>> {
        run_in_transaction!(self.pool, |transaction| {
            let id: Option<i64> =
                sqlx::query_scalar("SELECT id FROM outbox_subscriptions WHERE name = $1")
                    .bind(name.as_str())
                    .fetch_optional(&mut *transaction)
                    .await?;
            let Some(id) = id.map(SubscriptionId) else {
                return Ok(None);
            };
            // Waits for a running claim so it cannot leave records behind.
            lock_subscription(transaction, id, LockMode::Exclusive).await?;
            delete_reading(transaction, id).await?;
            sqlx::query("DELETE FROM outbox_subscriptions WHERE id = $1")
                .bind(id.0)
                .execute(&mut *transaction)
                .await?;
            Ok(Some(id))
        })
    }

    /// Pauses the subscription with `reason` until `until` (or until resumed). Pausing a
    /// paused one replaces its reason and end but keeps when it began; a pause whose end
    /// has passed is over, so pausing again begins a new one. `None` when it does not exist.
    pub async fn pause_subscription(
        &self,
        name: &SubscriptionName,
        reason: &str,
        until: Option<DateTime<Utc>>,
    ) -> Result<Option<Subscription>> {
        let row = sqlx::query(concat!(
            "UPDATE outbox_subscriptions SET \
                 paused_at = CASE WHEN paused_at IS NOT NULL \
                                   AND (paused_until IS NULL OR paused_until > now()) \
                              THEN paused_at ELSE now() END, \
                 pause_reason = $2, paused_until = $3, updated_at = now() \
             WHERE name = $1 RETURNING ",
            subscription_columns!()
        ))
        .bind(name.as_str())
        .bind(reason)
        .bind(until)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(subscription_from_row).transpose()
    }

    /// Ends the subscription's pause, if any; `None` when it does not exist.
    pub async fn resume_subscription(
        &self,
        name: &SubscriptionName,
    ) -> Result<Option<Subscription>> {
        let row = sqlx::query(concat!(
            "UPDATE outbox_subscriptions SET paused_at = NULL, pause_reason = NULL, \
                 paused_until = NULL, push_stopped_at = NULL, push_stopped_reason = NULL, \
                 updated_at = CASE WHEN paused_at IS NULL AND push_stopped_at IS NULL \
                                   THEN updated_at ELSE now() END \
             WHERE name = $1 RETURNING ",
            subscription_columns!()
        ))
        .bind(name.as_str())
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(subscription_from_row).transpose()
    }

    /// Starts the subscription reading this database at `start`, unless it already does.
    pub async fn create_cursor(
        &self,
        subscription_id: SubscriptionId,
        start: StartPosition,
    ) -> Result<()> {
        let mut connection = self.pool.acquire().await?;
        insert_cursor(&mut connection, subscription_id, start).await
    }

    /// Forgets everything of the subscription in this database: its read position and
    /// delivery records (dead letters included).
    pub async fn delete_cursor(&self, subscription_id: SubscriptionId) -> Result<()> {
        run_in_transaction!(self.pool, |transaction| {
            lock_subscription(transaction, subscription_id, LockMode::Exclusive).await?;
            delete_reading(transaction, subscription_id).await?;
            Ok(())
        })
    }

    /// Stops pushing for the subscription (its endpoint is gone) unless it already
    /// stopped, or no longer pushes; true when this call stopped it.
    pub async fn stop_push(&self, subscription_id: SubscriptionId, reason: &str) -> Result<bool> {
        let stopped = sqlx::query(
            "UPDATE outbox_subscriptions SET push_stopped_at = now(), push_stopped_reason = $2, \
                 updated_at = now() \
             WHERE id = $1 AND push IS NOT NULL AND push_stopped_at IS NULL",
        )
        .bind(subscription_id.0)
        .bind(reason)
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(stopped > 0)
    }

    /// Replaces a push subscription's signing keys; the subscription as it is now, or
    /// `None` when there is no push subscription of that name.
    pub async fn set_push_secrets(
        &self,
        name: &SubscriptionName,
        secrets: &[PushSecret],
    ) -> Result<Option<Subscription>> {
        let row = sqlx::query(concat!(
            "UPDATE outbox_subscriptions SET push_secrets = $2, updated_at = now() \
             WHERE name = $1 AND push IS NOT NULL RETURNING ",
            subscription_columns!()
        ))
        .bind(name.as_str())
        .bind(Json(stored_secrets(secrets)))
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(subscription_from_row).transpose()
    }

    /// The subscriptions that read this database (have a read position here).
    pub async fn cursor_subscription_ids(&self) -> Result<Vec<SubscriptionId>> {
        Ok(from_id_values(
            sqlx::query_scalar("SELECT subscription_id FROM outbox_cursors ORDER BY 1")
                .fetch_all(&self.pool)
                .await?,
        ))
    }
}

pub(super) async fn insert_cursor(
    connection: &mut PgConnection,
    subscription_id: SubscriptionId,
    start: StartPosition,
) -> Result<()> {
    let (start_kind, not_before) = start_columns(start);
    sqlx::query(concat!(
        "INSERT INTO outbox_cursors (subscription_id, cursor_xact_id, cursor_position, \
             pending_xact_ids, pending_positions, not_before) \
         SELECT $1, start.xact_id, 0, start.pending_xact_ids, start.pending_positions, $3 \
         FROM (",
        start_position_sql!("$2"),
        ") AS start \
         ON CONFLICT (subscription_id) DO NOTHING"
    ))
    .bind(subscription_id.0)
    .bind(start_kind == "latest")
    .bind(not_before)
    .execute(connection)
    .await?;
    Ok(())
}

/// Deletes a subscription's read position, delivery records and counters here; the
/// caller holds the subscription's lock.
async fn delete_reading(
    connection: &mut PgConnection,
    subscription_id: SubscriptionId,
) -> Result<()> {
    for statement in [
        "DELETE FROM outbox_deliveries WHERE subscription_id = $1",
        "DELETE FROM outbox_delivery_batches WHERE subscription_id = $1",
        "DELETE FROM outbox_subscription_counters WHERE subscription_id = $1",
        "DELETE FROM outbox_cursors WHERE subscription_id = $1",
    ] {
        sqlx::query(statement)
            .bind(subscription_id.0)
            .execute(&mut *connection)
            .await?;
    }
    Ok(())
}

fn source_names(sources: &[SourceName]) -> Vec<&str> {
    sources.iter().map(SourceName::as_str).collect()
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
    let corrupt = |error: outbox_domain::Refusal| StoreError::Corrupt(error.to_string());
    let sources = row
        .try_get::<Vec<String>, _>("sources")?
        .iter()
        .map(|source| SourceName::parse("sources", source).map_err(corrupt))
        .collect::<Result<Vec<_>>>()?;
    let start_kind: String = row.try_get("start_kind")?;
    let start = match (start_kind.as_str(), row.try_get("start_time")?) {
        ("earliest", _) => StartPosition::Earliest,
        ("time", Some(time)) => StartPosition::Time(time),
        _ => StartPosition::Latest,
    };
    Ok(Subscription {
        id: SubscriptionId(row.try_get("id")?),
        name: SubscriptionName::parse("name", &name).map_err(corrupt)?,
        settings: SubscriptionSettings {
            event_types: patterns(row, "event_types")?,
            aggregate_types: row.try_get("aggregate_types")?,
            metadata_match: metadata_match.0,
            filter: row
                .try_get::<Option<&str>, _>("filter")?
                .map(|text| EventFilter::from_stored("filter", text).map_err(corrupt))
                .transpose()?,
            transform: row
                .try_get::<Option<&str>, _>("transform")?
                .map(|text| PayloadTransform::from_stored("transform", text).map_err(corrupt))
                .transpose()?,
            ack_deadline: duration(row, "ack_deadline_ms")?,
            max_attempts: max_attempts.max(0) as u32,
            retry_backoff_min: duration(row, "retry_backoff_min_ms")?,
            retry_backoff_max: duration(row, "retry_backoff_max_ms")?,
            ordered: row.try_get("ordered")?,
            persistent_event_types: patterns(row, "persistent_event_types")?,
            max_event_age: row
                .try_get::<Option<i64>, _>("max_event_age_ms")?
                .map(|ms| Duration::from_millis(ms.max(0) as u64)),
            dead_letter_expired: row.try_get("dead_letter_expired")?,
            push: row
                .try_get::<Option<Json<StoredPush>>, _>("push")
                .map_err(|error| StoreError::Corrupt(format!("push: {error}")))?
                .map(|stored| stored.0.into_config())
                .transpose()?,
            sink: row
                .try_get::<Option<Json<StoredSink>>, _>("sink")
                .map_err(|error| StoreError::Corrupt(format!("sink: {error}")))?
                .map(|stored| stored.0.into_config())
                .transpose()?,
        },
        sources,
        start,
        expire_after_idle: row
            .try_get::<Option<i64>, _>("expire_after_idle_ms")?
            .map(|ms| Duration::from_millis(ms.max(0) as u64)),
        created_at: row.try_get("created_at")?,
        pause: row
            .try_get::<Option<DateTime<Utc>>, _>("paused_at")?
            .map(|since| -> Result<Pause> {
                Ok(Pause {
                    reason: row
                        .try_get::<Option<String>, _>("pause_reason")?
                        .unwrap_or_default(),
                    since,
                    until: row.try_get("paused_until")?,
                })
            })
            .transpose()?,
        push_secrets: row
            .try_get::<Json<Vec<StoredSecret>>, _>("push_secrets")
            .map_err(|error| StoreError::Corrupt(format!("push_secrets: {error}")))?
            .0
            .into_iter()
            .map(StoredSecret::into_secret)
            .collect::<Result<Vec<_>>>()?,
        push_stopped: match row.try_get::<Option<DateTime<Utc>>, _>("push_stopped_at")? {
            Some(at) => Some(PushStopped {
                at,
                reason: row
                    .try_get::<Option<String>, _>("push_stopped_reason")?
                    .unwrap_or_default(),
            }),
            None => None,
        },
        last_attached_at: row.try_get("last_attached_at")?,
    })
}

/// Push settings as stored in the `push` column.
#[derive(serde::Serialize, serde::Deserialize)]
pub(super) struct StoredPush {
    endpoint: String,
    headers: BTreeMap<String, String>,
    structured: bool,
    timeout_ms: u64,
    max_concurrency: u32,
    rate_limit: Option<f64>,
    // Absent in rows stored before batches: one event per request.
    #[serde(default)]
    max_batch_events: u32,
    #[serde(default)]
    max_batch_bytes: u64,
    #[serde(default)]
    max_batch_wait_ms: u64,
}

impl From<&PushConfig> for StoredPush {
    fn from(config: &PushConfig) -> Self {
        StoredPush {
            endpoint: config.endpoint.as_str().to_owned(),
            headers: config.headers.clone(),
            structured: config.format == PushFormat::Structured,
            timeout_ms: u64::try_from(config.timeout.as_millis()).unwrap_or(u64::MAX),
            max_concurrency: config.max_concurrency,
            rate_limit: config.rate_limit,
            max_batch_events: config.max_batch_events,
            max_batch_bytes: config.max_batch_bytes,
            max_batch_wait_ms: u64::try_from(config.max_batch_wait.as_millis()).unwrap_or(u64::MAX),
        }
    }
}

impl StoredPush {
    fn into_config(self) -> Result<PushConfig> {
        Ok(PushConfig {
            endpoint: self
                .endpoint
                .parse()
                .map_err(|error| StoreError::Corrupt(format!("push.endpoint: {error}")))?,
            headers: self.headers,
            format: if self.structured {
                PushFormat::Structured
            } else {
                PushFormat::Binary
            },
            timeout: Duration::from_millis(self.timeout_ms),
            max_concurrency: self.max_concurrency,
            rate_limit: self.rate_limit,
            max_batch_events: self.max_batch_events.max(1),
            max_batch_bytes: if self.max_batch_bytes == 0 {
                DEFAULT_PUSH_BATCH_BYTES
            } else {
                self.max_batch_bytes
            },
            max_batch_wait: Duration::from_millis(self.max_batch_wait_ms),
        })
    }
}

/// A signing key as stored in the `push_secrets` column.
#[derive(serde::Serialize, serde::Deserialize)]
pub(super) struct StoredSecret {
    key: String,
    /// Unix milliseconds.
    expires_at_ms: Option<i64>,
}

impl StoredSecret {
    fn into_secret(self) -> Result<PushSecret> {
        use base64::Engine;
        Ok(PushSecret {
            key: base64::engine::general_purpose::STANDARD
                .decode(&self.key)
                .map_err(|error| StoreError::Corrupt(format!("push_secrets: {error}")))?,
            expires_at: self
                .expires_at_ms
                .and_then(DateTime::<Utc>::from_timestamp_millis),
        })
    }
}

pub(super) fn stored_secrets(secrets: &[PushSecret]) -> Vec<StoredSecret> {
    use base64::Engine;
    secrets
        .iter()
        .map(|secret| StoredSecret {
            key: base64::engine::general_purpose::STANDARD.encode(&secret.key),
            expires_at_ms: secret.expires_at.map(|at| at.timestamp_millis()),
        })
        .collect()
}

pub(super) fn stored_push(config: Option<&PushConfig>) -> Option<Json<StoredPush>> {
    config.map(StoredPush::from).map(Json)
}

/// Sink settings as stored in the `sink` column: the templates as written.
#[derive(serde::Serialize, serde::Deserialize)]
pub(super) struct StoredSink {
    name: String,
    subject: Option<String>,
    topic: Option<String>,
    key: Option<String>,
}

impl StoredSink {
    fn into_config(self) -> Result<SinkConfig> {
        let template = |field: &str, text: Option<String>| {
            text.map(|text| Template::parse(field, &text))
                .transpose()
                .map_err(|error| StoreError::Corrupt(error.to_string()))
        };
        Ok(SinkConfig {
            subject: template("sink.subject", self.subject)?,
            topic: template("sink.topic", self.topic)?,
            key: template("sink.key", self.key)?,
            name: self.name,
        })
    }
}

pub(super) fn stored_sink(config: Option<&SinkConfig>) -> Option<Json<StoredSink>> {
    let text = |template: &Option<Template>| template.as_ref().map(|t| t.as_str().to_owned());
    config.map(|config| {
        Json(StoredSink {
            name: config.name.clone(),
            subject: text(&config.subject),
            topic: text(&config.topic),
            key: text(&config.key),
        })
    })
}
