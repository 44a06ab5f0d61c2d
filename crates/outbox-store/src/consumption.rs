//! Consumption records: what `outbox_consume` (migration 0013) wrote in a consumer's
//! database, which is one of the gateway's sources. The gateway keeps there the key ack
//! ids are sealed with and the names of the subscriptions, takes the consumed acks off
//! the queue to settle them, and deletes records once their event is gone.

use sqlx::{Postgres, Transaction};

use super::{Result, Store};
use outbox_domain::{SourceName, SubscriptionId};

/// The channel `outbox_consume` notifies on when its transaction commits.
pub(crate) const CONSUMED_CHANNEL: &str = "outbox_consumed";

/// A delivery a consumer recorded with `outbox_consume` (consumed then, or found
/// consumed before) whose lease the gateway has yet to settle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumedAck {
    pub subscription_id: SubscriptionId,
    /// As the consumer gave it (its event may be in another database than this one).
    pub ack_id: String,
}

/// Consumed acks taken off this database's queue for settling, in a transaction that
/// keeps other gateways from taking them too: [`ConsumedAcks::settled`] commits,
/// putting back those that could not be settled yet; dropping it puts back all.
pub struct ConsumedAcks {
    transaction: Transaction<'static, Postgres>,
    pub acks: Vec<ConsumedAck>,
}

impl ConsumedAcks {
    /// Done: the acks are off the queue, but for `retry`, put back for a later round.
    pub async fn settled(mut self, retry: &[ConsumedAck]) -> Result<()> {
        if !retry.is_empty() {
            let (subscriptions, ack_ids): (Vec<i64>, Vec<&str>) = retry
                .iter()
                .map(|ack| (ack.subscription_id.0, ack.ack_id.as_str()))
                .unzip();
            sqlx::query(
                "INSERT INTO outbox_consumed_acks (subscription_id, ack_id) \
                 SELECT * FROM unnest($1::bigint[], $2::text[])",
            )
            .bind(subscriptions)
            .bind(ack_ids)
            .execute(&mut *self.transaction)
            .await?;
        }
        self.transaction.commit().await?;
        Ok(())
    }

    /// Puts every ack back, for this or another gateway to try again.
    pub async fn abandon(self) -> Result<()> {
        self.transaction.rollback().await?;
        Ok(())
    }
}

impl Store {
    /// The ack key of this gateway, kept in its `default` database: the one stored, or
    /// `candidate` stored now when there is none.
    pub async fn ack_key(&self, candidate: &[u8], pads: (&[u8], &[u8])) -> Result<Vec<u8>> {
        sqlx::query(
            "INSERT INTO outbox_consume_key (key, inner_pad, outer_pad) VALUES ($1, $2, $3) \
             ON CONFLICT (singleton) DO NOTHING",
        )
        .bind(candidate)
        .bind(pads.0)
        .bind(pads.1)
        .execute(&self.pool)
        .await?;
        Ok(sqlx::query_scalar("SELECT key FROM outbox_consume_key")
            .fetch_one(&self.pool)
            .await?)
    }

    /// Installs the gateway's ack key in this (non-default) source, replacing another.
    pub async fn install_ack_key(&self, key: &[u8], pads: (&[u8], &[u8])) -> Result<()> {
        sqlx::query(
            "INSERT INTO outbox_consume_key (key, inner_pad, outer_pad) VALUES ($1, $2, $3) \
             ON CONFLICT (singleton) DO UPDATE \
             SET key = EXCLUDED.key, inner_pad = EXCLUDED.inner_pad, outer_pad = EXCLUDED.outer_pad \
             WHERE outbox_consume_key.key <> EXCLUDED.key",
        )
        .bind(key)
        .bind(pads.0)
        .bind(pads.1)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Lets consumers of this database record ack ids of the subscription. A deleted
    /// subscription of the same name still listed (it was deleted while this database was
    /// down, and no maintenance pass has caught up since) goes first, with its records:
    /// left there, it would keep the name, so the new subscription's ack ids would be
    /// refused and the old one's accepted.
    pub async fn add_consumer_subscription(&self, id: SubscriptionId, name: &str) -> Result<()> {
        let mut transaction = self.pool.begin().await?;
        sqlx::query(
            "WITH stale AS ( \
                 DELETE FROM outbox_consumer_subscriptions \
                 WHERE name = $2 AND id <> $1 RETURNING id), \
             forgotten AS ( \
                 DELETE FROM outbox_consumptions \
                 WHERE subscription_id IN (SELECT id FROM stale)) \
             DELETE FROM outbox_consumed_acks \
             WHERE subscription_id IN (SELECT id FROM stale)",
        )
        .bind(id.0)
        .bind(name)
        .execute(&mut *transaction)
        .await?;
        sqlx::query(
            "INSERT INTO outbox_consumer_subscriptions (id, name) VALUES ($1, $2) \
             ON CONFLICT DO NOTHING",
        )
        .bind(id.0)
        .bind(name)
        .execute(&mut *transaction)
        .await?;
        transaction.commit().await?;
        Ok(())
    }

    /// Makes this database's list of subscriptions exactly `subscriptions`, forgetting
    /// the consumption records of those no longer in it (deleted subscriptions).
    pub async fn sync_consumer_subscriptions(
        &self,
        subscriptions: &[(SubscriptionId, &str)],
    ) -> Result<()> {
        let (ids, names): (Vec<i64>, Vec<&str>) =
            subscriptions.iter().map(|(id, name)| (id.0, *name)).unzip();
        sqlx::query(
            "WITH listed AS (SELECT * FROM unnest($1::bigint[], $2::text[]) AS l(id, name)), \
             gone AS ( \
                 DELETE FROM outbox_consumer_subscriptions s \
                 WHERE NOT EXISTS (SELECT FROM listed l WHERE l.id = s.id AND l.name = s.name) \
                 RETURNING s.id), \
             forgotten AS ( \
                 DELETE FROM outbox_consumptions c \
                 WHERE c.subscription_id IN (SELECT id FROM gone) \
                   AND c.subscription_id NOT IN (SELECT id FROM listed)), \
             unqueued AS ( \
                 DELETE FROM outbox_consumed_acks a \
                 WHERE a.subscription_id IN (SELECT id FROM gone) \
                   AND a.subscription_id NOT IN (SELECT id FROM listed)) \
             INSERT INTO outbox_consumer_subscriptions (id, name) \
             SELECT l.id, l.name FROM listed l \
             WHERE NOT EXISTS (SELECT FROM outbox_consumer_subscriptions s \
                               WHERE s.id = l.id AND s.name = l.name) \
             ON CONFLICT DO NOTHING",
        )
        .bind(ids)
        .bind(names)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Forgets the subscription (deleted) here: its ack ids are refused from now on and
    /// its consumption records go.
    pub async fn remove_consumer_subscription(&self, id: SubscriptionId) -> Result<()> {
        sqlx::query(
            "WITH gone AS (DELETE FROM outbox_consumer_subscriptions WHERE id = $1), \
                  unqueued AS (DELETE FROM outbox_consumed_acks WHERE subscription_id = $1) \
             DELETE FROM outbox_consumptions WHERE subscription_id = $1",
        )
        .bind(id.0)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Takes up to `limit` consumed acks off this database's queue; `None` when it is
    /// empty. With `probe`, first checks outside a transaction whether there are any
    /// (a poll mostly finds none).
    pub async fn take_consumed_acks(
        &self,
        limit: usize,
        probe: bool,
    ) -> Result<Option<ConsumedAcks>> {
        if probe {
            let any: bool = sqlx::query_scalar("SELECT EXISTS (SELECT FROM outbox_consumed_acks)")
                .fetch_one(&self.pool)
                .await?;
            if !any {
                return Ok(None);
            }
        }
        let mut transaction = self.pool.begin().await?;
        let rows: Vec<(i64, String)> = sqlx::query_as(
            "DELETE FROM outbox_consumed_acks WHERE ctid = ANY (ARRAY( \
                 SELECT ctid FROM outbox_consumed_acks LIMIT $1 FOR UPDATE SKIP LOCKED)) \
             RETURNING subscription_id, ack_id",
        )
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .fetch_all(&mut *transaction)
        .await?;
        if rows.is_empty() {
            transaction.rollback().await?;
            return Ok(None);
        }
        Ok(Some(ConsumedAcks {
            transaction,
            acks: rows
                .into_iter()
                .map(|(subscription_id, ack_id)| ConsumedAck {
                    subscription_id: SubscriptionId(subscription_id),
                    ack_id,
                })
                .collect(),
        }))
    }

    /// Tells consumers of this database that a settler polls it until `for_how_long`
    /// from now, so they need not notify (`None`: it stops polling, they must).
    pub async fn settler_awake(&self, for_how_long: Option<std::time::Duration>) -> Result<()> {
        sqlx::query(
            "UPDATE outbox_consume_key \
             SET settler_awake_until = now() + make_interval(secs => $1::float8)",
        )
        .bind(for_how_long.map(|duration| duration.as_secs_f64()))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The first position still in this database's outbox (or the next to be given when
    /// it is empty): an event before it can never be delivered again.
    pub async fn first_retained_position(&self) -> Result<i64> {
        Ok(sqlx::query_scalar(
            "SELECT coalesce((SELECT min(position) FROM outbox_events), \
                             (SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END \
                              FROM outbox_events_position_seq))",
        )
        .fetch_one(&self.pool)
        .await?)
    }

    /// Deletes up to `limit` consumption records of events of `source` before `before`
    /// (gone from their outbox); how many went.
    pub async fn delete_consumptions_before(
        &self,
        source: &SourceName,
        before: i64,
        limit: usize,
    ) -> Result<u64> {
        Ok(sqlx::query(
            "DELETE FROM outbox_consumptions WHERE ctid = ANY (ARRAY( \
                 SELECT ctid FROM outbox_consumptions \
                 WHERE source = $1 AND position < $2 LIMIT $3))",
        )
        .bind(source.as_str())
        .bind(before)
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .execute(&self.pool)
        .await?
        .rows_affected())
    }

    /// Forgets that the subscriptions consumed the event, so the next delivery of it is
    /// consumed again; how many records went.
    pub async fn forget_consumption(
        &self,
        subscriptions: &[SubscriptionId],
        source: &SourceName,
        position: i64,
    ) -> Result<u64> {
        Ok(sqlx::query(
            "DELETE FROM outbox_consumptions \
             WHERE source = $1 AND position = $2 AND subscription_id = ANY ($3)",
        )
        .bind(source.as_str())
        .bind(position)
        .bind(subscriptions.iter().map(|id| id.0).collect::<Vec<_>>())
        .execute(&self.pool)
        .await?
        .rows_affected())
    }

    /// Consumption records kept in this database, per subscription (only `only`'s when
    /// given).
    pub async fn count_consumptions(
        &self,
        only: Option<SubscriptionId>,
    ) -> Result<Vec<(SubscriptionId, u64)>> {
        let rows: Vec<(i64, i64)> = sqlx::query_as(
            "SELECT subscription_id, count(*) FROM outbox_consumptions \
             WHERE $1::bigint IS NULL OR subscription_id = $1 GROUP BY subscription_id",
        )
        .bind(only.map(|id| id.0))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(id, count)| (SubscriptionId(id), count.try_into().unwrap_or_default()))
            .collect())
    }
}
