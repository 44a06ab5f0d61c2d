//! The throw-away database of a chaos run: created on the server given, reached by the
//! SQL producers and the checks through a pool of its own (`application_name =
//! outbox-chaos`, so cutting the gateways' connections spares it), dropped at the end.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
};

use anyhow::Context;
use outbox_testkit::{GATEWAY_APPLICATION, ThrowawayDatabase};
use sqlx::{ConnectOptions, PgConnection, PgPool, postgres::PgPoolOptions};
use uuid::Uuid;

use crate::exactly_once::Effects;

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
    /// What the exactly-once consumers wrote in the gateway's database.
    pub effects: Effects,
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

    /// A connection of its own, outside the pool, named `application_name`: dropping it
    /// ends its session, as a crashed client's ends.
    pub async fn connect(&self, application_name: &str) -> anyhow::Result<PgConnection> {
        self.database
            .connect_options()
            .application_name(application_name)
            .connect()
            .await
            .with_context(|| format!("cannot connect to {}", self.name()))
    }

    /// Terminates every connection a gateway holds to this database; returns how many.
    pub async fn cut_gateway_connections(&self) -> anyhow::Result<u64> {
        Ok(outbox_testkit::cut_gateway_sessions(&self.pool, self.name()).await?)
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

    /// Delivery records that still exist here (in flight, awaiting retry, waiting, dead),
    /// with subscription names from `names` (definitions live in the gateway's database).
    async fn unsettled_here(&self, names: &HashMap<i64, String>) -> anyhow::Result<Unsettled> {
        let rows: Vec<(i64, Uuid, String)> = sqlx::query_as(
            "SELECT d.subscription_id, e.id, d.state FROM outbox_delivery_records d \
             JOIN outbox_events e ON e.position = d.position",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .filter_map(|(subscription, id, state)| {
                Some(((names.get(&subscription)?.clone(), id), state))
            })
            .collect())
    }

    async fn subscription_names(&self) -> anyhow::Result<HashMap<i64, String>> {
        let rows: Vec<(i64, String)> = sqlx::query_as("SELECT id, name FROM outbox_subscriptions")
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.into_iter().collect())
    }
}

/// The databases of a run: the gateway's own first, then the other sources'.
#[derive(Debug, Clone)]
pub struct Databases(pub Vec<ChaosDatabase>);

impl Databases {
    pub fn gateway(&self) -> &ChaosDatabase {
        &self.0[0]
    }

    /// Delivery records that still exist in any source.
    pub async fn unsettled_records(&self) -> anyhow::Result<Unsettled> {
        let names = self.gateway().subscription_names().await?;
        let mut unsettled = Unsettled::new();
        for database in &self.0 {
            unsettled.extend(database.unsettled_here(&names).await?);
        }
        Ok(unsettled)
    }

    pub async fn final_state(&self) -> anyhow::Result<Snapshot> {
        let mut stored = HashSet::new();
        for database in &self.0 {
            let ids: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM outbox_events")
                .fetch_all(&database.pool)
                .await?;
            stored.extend(ids);
        }
        Ok(Snapshot {
            stored,
            unsettled: self.unsettled_records().await?,
            effects: Effects::read(&self.gateway().pool).await?,
        })
    }

    /// Rows written so far in the gateways' tables over every source
    /// ([`outbox_testkit::gateway_row_writes`]).
    pub async fn bookkeeping_row_writes(&self) -> anyhow::Result<u64> {
        let mut total = 0;
        for database in &self.0 {
            total += outbox_testkit::gateway_row_writes(&database.pool)
                .await
                .with_context(|| {
                    format!("cannot read the table statistics of {}", database.name())
                })?;
        }
        Ok(total)
    }

    /// [`Databases::bookkeeping_row_writes`] once the counts stop moving: sessions that
    /// ended flush their statistics as they go (given at most five seconds).
    pub async fn settled_row_writes(&self) -> anyhow::Result<u64> {
        let half_a_second = std::time::Duration::from_millis(500);
        outbox_testkit::settled(
            half_a_second,
            std::time::Duration::from_secs(5),
            half_a_second,
            || self.bookkeeping_row_writes(),
        )
        .await
    }

    /// Terminates the gateways' connections to every source.
    pub async fn cut_gateway_connections(&self) -> anyhow::Result<u64> {
        let mut cut = 0;
        for database in &self.0 {
            // A source that is down has nothing to cut.
            cut += database.cut_gateway_connections().await.unwrap_or(0);
        }
        Ok(cut)
    }
}

impl ChaosDatabase {
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
