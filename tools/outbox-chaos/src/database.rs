//! The throw-away database of a chaos run: created on the server given, reached by the
//! SQL producers and the checks through a pool of its own (`application_name =
//! outbox-chaos`, so cutting the gateways' connections spares it), dropped at the end.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
};

use anyhow::Context;
use outbox_testkit::ThrowawayDatabase;
use sqlx::{PgPool, postgres::PgPoolOptions};
use uuid::Uuid;

/// `application_name` of the gateways' connections, which the fault injector cuts.
const GATEWAY_APPLICATION: &str = "outbox-gateway";

#[derive(Debug, Clone)]
pub struct ChaosDatabase {
    database: Arc<ThrowawayDatabase>,
    pool: PgPool,
}

/// Delivery records still in the database at the end: `(subscription, event id)` → state.
pub type Unsettled = HashMap<(String, Uuid), String>;

/// What the database holds once the consumers have stopped.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// Ids of every stored event.
    pub stored: HashSet<Uuid>,
    pub unsettled: Unsettled,
}

impl ChaosDatabase {
    /// Creates `outbox_chaos_<random>` on the server at `server_url`.
    pub async fn create(server_url: &str) -> anyhow::Result<ChaosDatabase> {
        let database = ThrowawayDatabase::create(server_url, "outbox_chaos").await?;
        let pool = PgPoolOptions::new()
            .max_connections(12)
            .connect_with(database.connect_options().application_name("outbox-chaos"))
            .await
            .with_context(|| format!("cannot connect to {}", database.name()))?;
        Ok(ChaosDatabase {
            database: Arc::new(database),
            pool,
        })
    }

    pub fn name(&self) -> &str {
        self.database.name()
    }

    pub fn url(&self) -> String {
        self.database.url().to_owned()
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Terminates every connection a gateway holds to this database; returns how many.
    pub async fn cut_gateway_connections(&self) -> anyhow::Result<u64> {
        let cut: i64 = sqlx::query_scalar(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE datname = $1 AND application_name = $2",
        )
        .bind(self.name())
        .bind(GATEWAY_APPLICATION)
        .fetch_one(&self.pool)
        .await?;
        Ok(cut as u64)
    }

    /// Gateway sessions idle inside a transaction for longer than `at_least`, with the
    /// last statement each ran. The gateway ends every transaction it opens, so any is a
    /// defect: it would hold back vacuum (and once held back every delivery).
    pub async fn gateway_sessions_idle_in_transaction(
        &self,
        at_least: std::time::Duration,
    ) -> anyhow::Result<Vec<String>> {
        Ok(sqlx::query_scalar(
            "SELECT coalesce(query, '') FROM pg_stat_activity \
             WHERE datname = $1 AND application_name = $2 \
               AND state LIKE 'idle in transaction%' \
               AND state_change < now() - $3 * interval '1 millisecond'",
        )
        .bind(self.name())
        .bind(GATEWAY_APPLICATION)
        .bind(at_least.as_millis() as i64)
        .fetch_all(&self.pool)
        .await?)
    }

    /// Whether an event with this id is stored: settles a SQL commit whose answer was lost.
    pub async fn is_stored(&self, id: Uuid) -> anyhow::Result<bool> {
        Ok(
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM outbox_events WHERE id = $1)")
                .bind(id)
                .fetch_one(&self.pool)
                .await?,
        )
    }

    /// Delivery records that still exist (in flight, awaiting retry, waiting, dead).
    pub async fn unsettled_records(&self) -> anyhow::Result<Unsettled> {
        let rows: Vec<(String, Uuid, String)> = sqlx::query_as(
            "SELECT s.name, e.id, d.state FROM outbox_deliveries d \
             JOIN outbox_subscriptions s ON s.id = d.subscription_id \
             JOIN outbox_events e ON e.position = d.position",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(subscription, id, state)| ((subscription, id), state))
            .collect())
    }

    pub async fn final_state(&self) -> anyhow::Result<Snapshot> {
        let stored: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM outbox_events")
            .fetch_all(&self.pool)
            .await?;
        Ok(Snapshot {
            stored: stored.into_iter().collect(),
            unsettled: self.unsettled_records().await?,
        })
    }

    /// Closes the pool, keeping the database.
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// Closes the pool and drops the database with whatever is still connected to it.
    pub async fn drop_database(&self) {
        self.pool.close().await;
        if let Err(error) = self.database.drop_database().await {
            eprintln!("outbox-chaos: {error}");
        }
    }
}
