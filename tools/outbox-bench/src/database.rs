//! The throw-away benchmark database: created on the PostgreSQL server named by
//! `--postgres-url`, reset between scenarios, dropped at the end. Also the bulk work the
//! scenarios do directly in SQL: filling a backlog, vacuuming, checkpointing, and the
//! connection pools of the direct-SQL writers.

use std::{str::FromStr, time::Duration};

use anyhow::{Context, anyhow, bail};
use outbox_testkit::{DatabaseError, ThrowawayDatabase};
use sqlx::{
    Connection, Executor, PgConnection, PgPool,
    postgres::{PgConnectOptions, PgPoolOptions},
};
use tokio::task::JoinSet;
use uuid::Uuid;

use crate::workload;

/// Rows per backlog statement (and so per transaction).
const BACKLOG_CHUNK: usize = 10_000;
/// Connections filling a backlog in parallel.
const BACKLOG_WRITERS: usize = 2;

/// Whether a direct-SQL writer's transactions send the outbox NOTIFY.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notify {
    /// Like the gateway's own connections (`outbox.suppress_notify=on`): the ceiling for
    /// the throughput comparisons, since NOTIFY serializes commits.
    Suppress,
    /// Like any other direct writer: the trigger notifies once per transaction, which is
    /// how a gateway hears about rows it did not write.
    Send,
}

pub struct BenchDatabase {
    database: ThrowawayDatabase,
    /// The server it lives on, for databases of other services on the same cluster.
    server_url: String,
    /// Whether resets and fills end with a CHECKPOINT (off for smoke tests, where a
    /// checkpoint after a TRUNCATE can take longer than the measurement).
    checkpoints: bool,
}

impl BenchDatabase {
    /// Creates `outbox_bench_<random>` on the server at `server_url`. Unless the URL
    /// sets `sslmode`, every connection (the gateway's and the direct writers') uses
    /// `sslmode=disable`: TLS protects nothing on loopback, and it splits statements
    /// larger than one TLS record (16 KiB) into several writes, which sqlx (no
    /// TCP_NODELAY) can leave waiting on a delayed ACK for ~40 ms.
    pub async fn create(server_url: &str, checkpoints: bool) -> anyhow::Result<BenchDatabase> {
        let server_url = &without_tls_unless_set(server_url);
        let server = PgConnectOptions::from_str(server_url)
            .with_context(|| format!("invalid --postgres-url {server_url:?}"))?;
        let host = server.get_host();
        if !is_local_host(host) {
            bail!(
                "--postgres-url names host {host:?}: outbox-bench drives load only against this \
                 machine, so PostgreSQL must be on a loopback address (127.0.0.1, ::1, localhost) \
                 or a Unix socket"
            );
        }
        let database = ThrowawayDatabase::create(server_url, "outbox_bench")
            .await
            .map_err(|error| match error {
                DatabaseError::Connect { .. } => {
                    anyhow!("{error}; is it running? (point --postgres-url at it)")
                }
                DatabaseError::InvalidUrl { .. } | DatabaseError::Statement { .. } => error.into(),
            })?;
        Ok(BenchDatabase {
            database,
            server_url: server_url.clone(),
            checkpoints,
        })
    }

    pub fn name(&self) -> &str {
        self.database.name()
    }

    /// Another benchmark database on the same server: a second service's database.
    pub async fn sibling(&self) -> anyhow::Result<BenchDatabase> {
        BenchDatabase::create(&self.server_url, self.checkpoints).await
    }

    /// Connection URL of the benchmark database, for the gateway.
    pub fn url(&self) -> &str {
        self.database.url()
    }

    /// A pool of direct connections, like a producer service's, with every connection
    /// open already (so no run pays for connecting).
    pub async fn pool(&self, connections: u32, notify: Notify) -> anyhow::Result<PgPool> {
        let mut options = self.connect_options();
        if notify == Notify::Suppress {
            options = options.options([("outbox.suppress_notify", "on")]);
        }
        let pool = PgPoolOptions::new()
            .max_connections(connections)
            .acquire_timeout(Duration::from_secs(30))
            // No ping before each statement: the ceiling is what the server can do.
            .test_before_acquire(false)
            .connect_with(options)
            .await
            .with_context(|| format!("cannot connect to {}", self.name()))?;
        let mut open = Vec::with_capacity(connections as usize);
        for _ in 0..connections {
            open.push(
                pool.acquire()
                    .await
                    .with_context(|| format!("cannot connect to {}", self.name()))?,
            );
        }
        drop(open);
        Ok(pool)
    }

    /// Empties every outbox table: each scenario starts from an empty database.
    pub async fn reset(&self) -> anyhow::Result<()> {
        let mut connection = self.connect().await?;
        // A gateway may still be reading these tables: its statements can take their
        // locks in another order than TRUNCATE, and PostgreSQL then ends one side of the
        // deadlock. Ours is simply tried again.
        let mut attempts = 0;
        loop {
            attempts += 1;
            match connection
                .execute(
                    // Claim batches exist from schema 11 on; a run may compare an older build.
                    "DO $$ BEGIN \
                         TRUNCATE outbox_events, outbox_deliveries, outbox_cursors, \
                                  outbox_subscriptions CASCADE; \
                         IF to_regclass('outbox_delivery_batches') IS NOT NULL THEN \
                             TRUNCATE outbox_delivery_batches; \
                         END IF; \
                     END $$",
                )
                .await
            {
                Ok(_) => break,
                Err(sqlx::Error::Database(error))
                    if error.code().as_deref() == Some("40P01") && attempts < 5 => {}
                Err(error) => return Err(error).context("cannot empty the outbox tables"),
            }
        }
        self.checkpoint(&mut connection).await;
        Ok(())
    }

    /// Inserts `events` events scheduled `ahead` from now (their deliver_at), straight
    /// into the outbox table, then settles.
    pub async fn fill_scheduled(&self, events: u64, ahead: Duration) -> anyhow::Result<()> {
        let mut connection = self.connect().await?;
        sqlx::query(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, \
                 deliver_at) \
             SELECT 'reminder', 'rem-' || (n % 1000), 'reminder.due', '{}', \
                    now() + $2 * interval '1 millisecond' \
             FROM generate_series(1, $1) AS n",
        )
        .bind(i64::try_from(events).unwrap_or(i64::MAX))
        .bind(i64::try_from(ahead.as_millis()).unwrap_or(i64::MAX))
        .execute(&mut connection)
        .await
        .context("cannot insert the scheduled events")?;
        drop(connection);
        self.settle().await
    }

    /// The schema has claim batches (`outbox_delivery_batches`, schema 11 on); a run may
    /// compare a build from before them.
    pub async fn has_claim_batches(&self) -> anyhow::Result<bool> {
        let mut connection = self.connect().await?;
        Ok(
            sqlx::query_scalar("SELECT to_regclass('outbox_delivery_batches') IS NOT NULL")
                .fetch_one(&mut connection)
                .await?,
        )
    }

    /// Delivery records of every subscription: in flight, awaiting a retry or a
    /// scheduled time, waiting, dead.
    pub async fn delivery_records(&self) -> anyhow::Result<u64> {
        let mut connection = self.connect().await?;
        let batches = self.has_claim_batches().await?;
        let records = if batches {
            "SELECT count(*) FROM outbox_delivery_records"
        } else {
            "SELECT count(*) FROM outbox_deliveries"
        };
        let count: i64 = sqlx::query_scalar(records)
            .fetch_one(&mut connection)
            .await
            .context("cannot count delivery records")?;
        Ok(count.max(0) as u64)
    }

    /// Rows written so far in the gateway's tables ([`outbox_testkit::gateway_row_writes`]:
    /// read this once the counts have stopped moving,
    /// [`BenchDatabase::settled_bookkeeping`]), and the server's WAL position in bytes.
    pub async fn bookkeeping(&self) -> anyhow::Result<Bookkeeping> {
        let mut connection = self.connect().await?;
        let row_writes = outbox_testkit::gateway_row_writes(&mut connection)
            .await
            .context("cannot read the table statistics")?;
        let wal_bytes: i64 =
            sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint")
                .fetch_one(&mut connection)
                .await
                .context("cannot read the WAL position")?;
        Ok(Bookkeeping {
            row_writes,
            wal_bytes: wal_bytes.max(0) as u64,
        })
    }

    /// [`BenchDatabase::bookkeeping`] once the row counts have not moved for `quiet`
    /// (at most four times that), with the WAL position read at once: what the run wrote,
    /// not the idle gateway after it.
    pub async fn settled_bookkeeping(&self, quiet: Duration) -> anyhow::Result<Bookkeeping> {
        let now = self.bookkeeping().await?;
        let row_writes =
            outbox_testkit::settled(quiet, quiet * 4, Duration::from_millis(250), || async {
                anyhow::Ok(self.bookkeeping().await?.row_writes)
            })
            .await?;
        Ok(Bookkeeping {
            row_writes,
            wal_bytes: now.wal_bytes,
        })
    }

    /// Empties the outbox table only (between runs that publish into it).
    pub async fn truncate_events(&self) -> anyhow::Result<()> {
        let mut connection = self.connect().await?;
        connection
            .execute("TRUNCATE outbox_events")
            .await
            .context("cannot empty outbox_events")?;
        self.checkpoint(&mut connection).await;
        Ok(())
    }

    /// The server settings that most affect the figures, for the run's header.
    pub async fn describe_server(&self) -> anyhow::Result<String> {
        let mut connection = self.connect().await?;
        let (version, shared_buffers, synchronous_commit, autovacuum): (
            String,
            String,
            String,
            String,
        ) = sqlx::query_as(
            "SELECT current_setting('server_version'), current_setting('shared_buffers'), \
                 current_setting('synchronous_commit'), current_setting('autovacuum')",
        )
        .fetch_one(&mut connection)
        .await?;
        Ok(format!(
            "PostgreSQL {version} (shared_buffers {shared_buffers}, synchronous_commit {synchronous_commit}, autovacuum {autovacuum})"
        ))
    }

    pub async fn count_events(&self) -> anyhow::Result<u64> {
        let mut connection = self.connect().await?;
        let count: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_events")
            .fetch_one(&mut connection)
            .await?;
        Ok(count as u64)
    }

    /// Inserts `events` events straight into the outbox table, `BACKLOG_CHUNK` rows per
    /// transaction over a few connections, then vacuums, analyzes and checkpoints, so
    /// delivery starts from settled tables and fresh planner statistics.
    pub async fn fill_backlog(&self, events: u64) -> anyhow::Result<()> {
        let pool = self.pool(BACKLOG_WRITERS as u32, Notify::Suppress).await?;
        let chunks = events.div_ceil(BACKLOG_CHUNK as u64);
        let mut writers = JoinSet::new();
        for writer in 0..BACKLOG_WRITERS as u64 {
            let pool = pool.clone();
            writers.spawn(async move {
                let mut ids = Vec::with_capacity(BACKLOG_CHUNK);
                for chunk in (writer..chunks).step_by(BACKLOG_WRITERS) {
                    let rows = (events - chunk * BACKLOG_CHUNK as u64).min(BACKLOG_CHUNK as u64);
                    ids.clear();
                    ids.extend((0..rows).map(|_| Uuid::now_v7()));
                    workload::insert_backlog_chunk(&pool, &ids).await?;
                }
                anyhow::Ok(())
            });
        }
        while let Some(result) = writers.join_next().await {
            result.context("a backlog writer panicked")??;
        }
        pool.close().await;
        self.settle().await
    }

    /// Vacuums and analyzes the outbox tables and checkpoints: what autovacuum would have
    /// done by the time a real backlog had built up, and no checkpoint left pending to
    /// land in the middle of the next measurement.
    pub async fn settle(&self) -> anyhow::Result<()> {
        let mut connection = self.connect().await?;
        connection
            .execute("VACUUM (ANALYZE) outbox_events, outbox_deliveries, outbox_subscriptions")
            .await
            .context("cannot vacuum the outbox tables")?;
        self.checkpoint(&mut connection).await;
        Ok(())
    }

    /// Opens a transaction in another database of the same server that writes a row and
    /// stays open until released: another service's batch job or a session left open.
    pub async fn hold_transaction_elsewhere(&self) -> anyhow::Result<HeldTransaction> {
        let database = ThrowawayDatabase::create(&self.server_url, "outbox_bench_other").await?;
        let mut connection = PgConnection::connect_with(&database.connect_options())
            .await
            .with_context(|| format!("cannot connect to {}", database.name()))?;
        connection
            .execute(
                "CREATE TABLE batch_job (id serial PRIMARY KEY, note text); \
                 BEGIN; INSERT INTO batch_job (note) VALUES ('held open');",
            )
            .await
            .context("cannot open the held transaction")?;
        Ok(HeldTransaction {
            database: Some(database),
            connection,
        })
    }

    /// Opens a transaction in this database that writes a row of a table of its own and
    /// stays open until released: it holds this database's xmin horizon, so that no row
    /// version of the outbox tables made meanwhile can be vacuumed away.
    pub async fn hold_transaction_here(&self) -> anyhow::Result<HeldTransaction> {
        let mut connection = self.connect().await?;
        connection
            .execute(
                "CREATE TABLE IF NOT EXISTS bench_batch_job (id serial PRIMARY KEY, note text); \
                 BEGIN; INSERT INTO bench_batch_job (note) VALUES ('held open');",
            )
            .await
            .context("cannot open the held transaction")?;
        Ok(HeldTransaction {
            database: None,
            connection,
        })
    }

    /// Dead and live row versions of each outbox table, as the statistics collector last
    /// counted them, by table name.
    pub async fn row_versions(&self) -> anyhow::Result<Vec<(String, i64, i64)>> {
        let mut connection = self.connect().await?;
        Ok(sqlx::query_as(
            "SELECT relname::text, n_dead_tup, n_live_tup FROM pg_stat_user_tables \
             WHERE relname LIKE 'outbox%' ORDER BY n_dead_tup DESC, relname",
        )
        .fetch_all(&mut connection)
        .await?)
    }

    /// Drops the database, cutting off any connection left.
    pub async fn drop_database(&self) -> anyhow::Result<()> {
        Ok(self.database.drop_database().await?)
    }

    /// Flushes dirty buffers now rather than during the next measurement. Needs
    /// superuser or pg_checkpoint; without them the benchmark goes on without it.
    async fn checkpoint(&self, connection: &mut PgConnection) {
        if !self.checkpoints {
            return;
        }
        if let Err(error) = connection.execute("CHECKPOINT").await {
            eprintln!("note: CHECKPOINT failed ({error}); figures may include checkpoint pauses");
        }
    }

    async fn connect(&self) -> anyhow::Result<PgConnection> {
        PgConnection::connect_with(&self.connect_options())
            .await
            .with_context(|| format!("cannot connect to {}", self.name()))
    }

    fn connect_options(&self) -> PgConnectOptions {
        self.database
            .connect_options()
            .application_name("outbox-bench")
    }
}

/// A transaction held open; see [`BenchDatabase::hold_transaction_elsewhere`] and
/// [`BenchDatabase::hold_transaction_here`].
pub struct HeldTransaction {
    /// The other database it was opened in, if any.
    database: Option<ThrowawayDatabase>,
    connection: PgConnection,
}

impl HeldTransaction {
    /// Rolls the transaction back and drops its database, if it has one of its own.
    pub async fn release(mut self) -> anyhow::Result<()> {
        self.connection.execute("ROLLBACK").await?;
        self.connection.close().await?;
        if let Some(database) = self.database {
            database.drop_database().await?;
        }
        Ok(())
    }
}

/// `server_url` with `sslmode=disable` added when it does not choose an sslmode.
fn without_tls_unless_set(server_url: &str) -> String {
    if server_url.contains("sslmode=") {
        server_url.to_owned()
    } else if server_url.contains('?') {
        format!("{server_url}&sslmode=disable")
    } else {
        format!("{server_url}?sslmode=disable")
    }
}

fn is_local_host(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost"
        || host.starts_with('/')
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|address| address.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disables_tls_unless_the_url_chooses() {
        assert_eq!(
            without_tls_unless_set("postgres://postgres@127.0.0.1:5432"),
            "postgres://postgres@127.0.0.1:5432?sslmode=disable"
        );
        assert_eq!(
            without_tls_unless_set("postgres://h/db?application_name=x"),
            "postgres://h/db?application_name=x&sslmode=disable"
        );
        assert_eq!(
            without_tls_unless_set("postgres://h?sslmode=require"),
            "postgres://h?sslmode=require"
        );
    }

    #[test]
    fn accepts_only_local_hosts() {
        for host in [
            "127.0.0.1",
            "127.0.0.2",
            "::1",
            "[::1]",
            "localhost",
            "/run/postgresql",
        ] {
            assert!(is_local_host(host), "{host}");
        }
        for host in ["10.0.0.5", "db.example.com", "192.168.1.2"] {
            assert!(!is_local_host(host), "{host}");
        }
    }
}

/// Counters of what the gateway's bookkeeping wrote; see [`BenchDatabase::bookkeeping`].
#[derive(Debug, Clone, Copy)]
pub struct Bookkeeping {
    pub row_writes: u64,
    pub wal_bytes: u64,
}
