//! outbox-store: every SQL statement of the gateway, the connection pool and the schema
//! migrations (from the top-level `migrations/`). Nothing outside this crate sees
//! `sqlx`; callers get domain types and a [`StoreError`].
//!
//! # Layout
//! - Owns: the [`Store`] (one pool on one source database) and its statements, grouped
//!   by what they touch — events and publishing, subscription definitions and read
//!   positions, deliveries and leases (claim batches, records of their own, acks applied
//!   in groups), operations (requeue, seek, stats), inspection,
//!   maintenance (reclaim, retention), reading new rows; the subscription lock and the
//!   columns several groups share; the SQL files under `queries/`.
//! - May depend on: `outbox-domain` and sqlx (with tokio underneath). Never on the core
//!   or a transport (tonic, axum, hyper, maud): the store does not call back into rules.

/// The columns `subscriptions::subscription_from_row` reads; macros keep queries
/// `&'static str`.
macro_rules! subscription_columns {
    () => {
        "id, name, event_types, aggregate_types, metadata_match, ack_deadline_ms, max_attempts, \
         retry_backoff_min_ms, retry_backoff_max_ms, ordered, persistent_event_types, sources, \
         start_kind, start_time, created_at, paused_at, pause_reason, paused_until, \
         max_event_age_ms, dead_letter_expired, expire_after_idle_ms, push, push_secrets, \
         push_stopped_at, push_stopped_reason, last_attached_at, sink, filter, transform"
    };
}

/// Where a subscription starts reading in one source, as one row (`xact_id`,
/// `pending_xact_ids`, `pending_positions`), for a start (or seek) whose parameter
/// `$latest` is true for the latest event, false for the earliest. The latest: every
/// transaction that starts after this snapshot, and those running now (remembered as
/// pending: they commit after the subscription began); nothing waits for the oldest of
/// them.
macro_rules! start_position_sql {
    ($latest:literal) => {
        concat!(
            "SELECT CASE WHEN ",
            $latest,
            " THEN pg_snapshot_xmax(snapshot.s)::text::bigint ELSE 0 END \
                 AS xact_id, \
             CASE WHEN ",
            $latest,
            " THEN ARRAY(SELECT x::text::bigint FROM pg_snapshot_xip(snapshot.s) x) \
                 ELSE '{}' END AS pending_xact_ids, \
             CASE WHEN ",
            $latest,
            " THEN ARRAY(SELECT 0::bigint FROM pg_snapshot_xip(snapshot.s) x) \
                 ELSE '{}' END AS pending_positions \
             FROM (SELECT pg_current_snapshot() AS s) AS snapshot"
        )
    };
}

/// The columns `events::event_from_row` reads.
macro_rules! event_columns {
    () => {
        "id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, content_type, \
         metadata, occurred_at, created_at, deliver_at, expires_at, xact_id"
    };
}

/// [`event_columns`] of the outbox table aliased `e`, for joins with tables that share
/// column names.
macro_rules! qualified_event_columns {
    () => {
        "e.id, e.aggregate_type, e.aggregate_id, e.aggregate_version, e.event_type, e.payload, \
         e.content_type, e.metadata, e.occurred_at, e.created_at, e.deliver_at, e.expires_at, \
         e.xact_id"
    };
}

/// Runs `$body` in one transaction on `$pool`, with `$transaction` the transaction's
/// `&mut PgConnection`: commits when the body returns `Ok`, rolls back when it returns
/// `Err`, so every path ends its transaction (dropped, sqlx would only queue the
/// rollback until the connection's next use). The body is an async block: `?` and
/// `return` end the body, not the calling function, and an early `return Ok(..)` commits
/// too, so a body returns early with `Ok` only before it has written anything.
///
/// A transaction PostgreSQL chose as a deadlock's victim, or aborted for a
/// serialization failure, wrote nothing: it runs again, up to
/// [`TRANSACTION_ATTEMPTS`] times in all, so such a race (deleting a subscription while
/// its streams give their leases back) never reaches a caller as a failure. The body
/// must therefore be able to run more than once.
///
/// `begin = STATEMENT` opens the transaction with that statement instead of `BEGIN`
/// (e.g. [`GENERIC_PLANS`]); when it fails after its `BEGIN`, what it opened is rolled
/// back ([`end_failed_begin`]).
macro_rules! run_in_transaction {
    ($pool:expr, |$transaction:ident| $body:block) => {
        run_in_transaction!($pool, begin = "BEGIN", |$transaction| $body)
    };
    ($pool:expr, begin = $begin:expr, |$transaction:ident| $body:block) => {
        $crate::run_again_on_conflict(|| async {
            let mut connection = $pool.acquire().await?;
            let failed = match sqlx::Connection::begin_with(&mut *connection, $begin).await {
                Ok(mut transaction) => {
                    let outcome: $crate::Result<_> = async {
                        let $transaction: &mut sqlx::PgConnection = &mut *transaction;
                        $body
                    }
                    .await;
                    return match outcome {
                        Ok(value) => {
                            transaction.commit().await?;
                            Ok(value)
                        }
                        Err(error) => {
                            if let Err(rollback_error) = transaction.rollback().await {
                                // The body's error is the one to report; this often
                                // follows from it (a connection that broke).
                                tracing::debug!(error = %rollback_error, "could not roll back a transaction");
                            }
                            Err(error)
                        }
                    };
                }
                Err(error) => error,
            };
            $crate::end_failed_begin(&mut connection).await;
            Err($crate::StoreError::from(failed))
        })
        .await
    };
}

/// Opens a transaction whose statements run with cached generic plans, probing tables by
/// index. For the delivery hot path (claims; the batch ack's function has the same
/// settings of its own, see migration 0015): their statements are large, and
/// planning them anew on every call, as the pool otherwise does ([`CLAIM_SETTINGS`]), cost
/// as much PostgreSQL CPU as running them; they are written so that a generic plan
/// serves them well. A generic plan is made once per connection, when the tables may
/// still be empty, and kept until their statistics change; with sequential scans off it
/// probes the delivery tables by index whatever their size then, rather than scanning a
/// table that has grown since for every row.
pub(crate) const GENERIC_PLANS: &str =
    "BEGIN; SET LOCAL plan_cache_mode = force_generic_plan; SET LOCAL enable_seqscan = off";

/// Rolls back what a failed opening statement of [`run_in_transaction`] may have left.
/// When a statement after its `BEGIN` fails (the subscription's lock of a claim, see
/// [`locks::begin_locked`], ended by a `lock_timeout`, a deadlock or a cancel), the
/// session stays in an aborted transaction that sqlx does not know of, and the pool
/// would hand it on so: every later statement on it would fail.
pub(crate) async fn end_failed_begin(connection: &mut PgConnection) {
    if let Err(error) = sqlx::raw_sql("ROLLBACK").execute(connection).await {
        tracing::debug!(%error, "could not roll back after a failed BEGIN");
    }
}

/// How many times [`run_again_on_conflict`] runs what keeps losing races.
pub const TRANSACTION_ATTEMPTS: u32 = 3;

/// Runs `attempt` (one statement, or a whole transaction for [`run_in_transaction`])
/// again when PostgreSQL aborted it to end a deadlock or a serialization conflict: it
/// wrote nothing, and a caller (an ack racing a subscription's deletion) must not see
/// INTERNAL for it.
async fn run_again_on_conflict<T, E, F, Fut>(mut attempt: F) -> Result<T>
where
    StoreError: From<E>,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut attempts = 1;
    loop {
        match attempt().await.map_err(StoreError::from) {
            Err(error) if error.is_conflict() && attempts < TRANSACTION_ATTEMPTS => {
                tracing::debug!(%error, attempts, "lost a race with another transaction; runs again");
                attempts += 1;
            }
            outcome => return outcome,
        }
    }
}

mod ack_groups;
mod columns;
mod consumption;
mod deliveries;
mod events;
mod inspection;
mod locks;
mod maintenance;
mod operations;
mod reading;
mod subscriptions;

use std::{str::FromStr, time::Duration};

use sqlx::{
    Connection, Executor, PgConnection, Row,
    postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgSslMode},
};

pub use consumption::{ConsumedAck, ConsumedAcks};
pub use deliveries::{Claim, ClaimHandover, ClaimLimits, HandoverSender, NackOutcome};
pub use events::{PublishConnection, PublishTransaction};
pub use inspection::{CounterTotals, DeliveryFacts, DeliveryRecord};
pub use maintenance::{ForceExpired, Reclaimed};
pub use operations::{PreparedSeek, RequeueRefusal};
pub use reading::{PositionMove, ReadPosition, ScannedRow, ScannedRows, SubscriptionPosition};
pub use subscriptions::NewDefinition;

use outbox_domain::{EngineFacts, LeaseId, SourceId, SourceName, SubscriptionId};

/// Result alias of the storage layer.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database cannot be reached (down, restarting, connections exhausted).
    #[error("cannot reach PostgreSQL: {}", in_our_words(.0))]
    Unavailable(#[source] sqlx::Error),
    /// A unique constraint refused a row.
    #[error("unique constraint {constraint} violated")]
    UniqueViolation { constraint: String },
    /// A check constraint refused a row: one the gateway's validation does not know of,
    /// such as an operator's own rule on the outbox table.
    #[error("check constraint {constraint} violated")]
    CheckViolation { constraint: String },
    #[error("database error: {}", in_our_words(.0))]
    Database(#[source] sqlx::Error),
    /// A stored value the gateway cannot read back, e.g. a pattern edited by hand.
    #[error("stored data is malformed: {0}")]
    Corrupt(String),
    #[error("schema migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// One failure reported to several callers (a group of coalesced calls).
    #[error("{0}")]
    Shared(std::sync::Arc<StoreError>),
}

impl StoreError {
    pub fn is_unavailable(&self) -> bool {
        match self {
            StoreError::Unavailable(_) => true,
            StoreError::Shared(inner) => inner.is_unavailable(),
            _ => false,
        }
    }

    /// No connection of the pool became free in time. While the health probe still
    /// reaches the database this is back-pressure (every connection is busy), not an
    /// outage.
    pub fn is_pool_exhausted(&self) -> bool {
        match self {
            StoreError::Unavailable(sqlx::Error::PoolTimedOut) => true,
            StoreError::Shared(inner) => inner.is_pool_exhausted(),
            _ => false,
        }
    }

    /// PostgreSQL aborted the transaction to end a deadlock or a serialization
    /// conflict; it wrote nothing and may run again.
    pub fn is_conflict(&self) -> bool {
        match self {
            StoreError::Database(sqlx::Error::Database(db)) => {
                matches!(db.code().as_deref(), Some("40P01" | "40001"))
            }
            StoreError::Shared(inner) => inner.is_conflict(),
            _ => false,
        }
    }

    /// The check constraint that refused a row, if that is what went wrong.
    pub fn check_violation(&self) -> Option<&str> {
        match self {
            StoreError::CheckViolation { constraint } => Some(constraint),
            StoreError::Shared(inner) => inner.check_violation(),
            _ => None,
        }
    }
}

/// A driver error in the gateway's words: PostgreSQL's own message with its SQLSTATE,
/// never the driver's decoration (such as the server's source line, "at line 938").
fn in_our_words(error: &sqlx::Error) -> String {
    match error {
        sqlx::Error::Database(db) => match db.code() {
            Some(code) => format!("{} (SQLSTATE {code})", db.message()),
            None => db.message().to_owned(),
        },
        sqlx::Error::Io(io) => format!("connection failed: {io}"),
        sqlx::Error::Tls(tls) => format!("TLS with the database failed: {tls}"),
        sqlx::Error::Protocol(_) => {
            "the connection broke off, or the server does not speak the PostgreSQL protocol".into()
        }
        sqlx::Error::PoolTimedOut => "no database connection became free in time".into(),
        sqlx::Error::PoolClosed => "the connection pool is closed (shutting down)".into(),
        sqlx::Error::WorkerCrashed => "the connection's worker stopped".into(),
        sqlx::Error::Configuration(error) => format!("invalid connection settings: {error}"),
        other => other.to_string(),
    }
}

impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> Self {
        let unavailable = match &error {
            // A connection cut mid-handshake surfaces as a protocol error.
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed => true,
            sqlx::Error::Database(db) => {
                let code = db.code().unwrap_or_default();
                // Connection exceptions, shutdowns, "cannot connect now", too many clients,
                // and a database that no longer exists (dropped or renamed).
                code.starts_with("08")
                    || code.starts_with("57P")
                    || code == "53300"
                    || code == "3D000"
            }
            _ => false,
        };
        if unavailable {
            return StoreError::Unavailable(error);
        }
        if let sqlx::Error::Database(db) = &error {
            let constraint = db.constraint().unwrap_or_default().to_owned();
            match db.code().as_deref() {
                Some("23505") => return StoreError::UniqueViolation { constraint },
                Some("23514") => return StoreError::CheckViolation { constraint },
                _ => {}
            }
        }
        StoreError::Database(error)
    }
}

/// A pooled connection idle this long is pinged before it is handed out.
const IDLE_BEFORE_PING: Duration = Duration::from_secs(1);

/// Where and how to connect.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Which source this database is, and its place in the gateway's list of sources.
    pub source: SourceName,
    pub source_id: SourceId,
    pub database_url: String,
    pub max_connections: u32,
    pub acquire_timeout: Duration,
    /// Sessions left idle inside a transaction this long are ended by PostgreSQL.
    pub idle_in_transaction_timeout: Duration,
}

/// Connections set apart for publishing, beside the main pool: one per publish
/// committer.
pub const PUBLISH_CONNECTIONS: usize = 4;

/// Handle to one source database; cheap to clone.
#[derive(Debug, Clone)]
pub struct Store {
    /// The source this database is; stamped on every event and ack id read from it.
    source: SourceName,
    source_id: SourceId,
    pool: PgPool,
    publish_pool: PgPool,
    /// One connection of its own for health checks: whether the database answers must
    /// not depend on whether the main pool has a connection free. A pool busy with work
    /// is back-pressure; only this probe failing means the database is lost.
    probe: std::sync::Arc<Probe>,
    /// Concurrent ack calls, applied together per subscription.
    ack_groups: std::sync::Arc<ack_groups::AckGroups>,
}

impl Store {
    /// Connects to the gateway's own database, creating it first when it does not exist
    /// yet.
    pub async fn connect(config: &StoreConfig) -> Result<Store> {
        let options = connect_options(config)?;
        create_database_if_missing(&options).await?;
        let pool = pool_options(config, CLAIM_SETTINGS)
            .connect_with(options.clone())
            .await?;
        Ok(Store::with_pool(config, pool, options))
    }

    /// A handle to a service's database that connects on first use: a source that is
    /// down when the gateway starts does not stop it. Its database is never created.
    pub fn connect_lazy(config: &StoreConfig) -> Result<Store> {
        let options = connect_options(config)?;
        let pool = pool_options(config, CLAIM_SETTINGS).connect_lazy_with(options.clone());
        Ok(Store::with_pool(config, pool, options))
    }

    fn with_pool(config: &StoreConfig, pool: PgPool, options: PgConnectOptions) -> Store {
        // The publishing INSERT plans the same way whatever its arrays hold, so it keeps
        // PostgreSQL's cached plan (re-planning cost 0.2 ms of a 100-event call), and
        // its connections are its own: a committer keeps one while it publishes.
        let publish_pool = pool_options(
            &StoreConfig {
                max_connections: PUBLISH_CONNECTIONS as u32,
                ..config.clone()
            },
            &[],
        )
        .connect_lazy_with(options.clone());
        let probe = std::sync::Arc::new(Probe {
            connection: tokio::sync::Mutex::new(None),
            options,
            timeout: config.acquire_timeout,
        });
        Store {
            source: config.source.clone(),
            source_id: config.source_id,
            pool,
            publish_pool,
            probe,
            ack_groups: Default::default(),
        }
    }

    /// The source this database is.
    pub fn source(&self) -> &SourceName {
        &self.source
    }

    pub fn source_id(&self) -> SourceId {
        self.source_id
    }
}

/// How the gateway connects to a database. Its session settings are set after
/// connecting ([`pool_options`]), not in the startup packet: PgBouncer refuses startup
/// parameters it does not know (`options`, and sqlx's `extra_float_digits`, which
/// servers since PostgreSQL 12 need not be told).
fn connect_options(config: &StoreConfig) -> Result<PgConnectOptions> {
    let mut options = PgConnectOptions::from_str(&config.database_url)
        .map_err(StoreError::Database)?
        .application_name("outbox-gateway")
        .extra_float_digits(None);
    // TLS to a database on this machine protects nothing, and sqlx splits statements
    // over 16 KiB into two TLS writes, the second waiting ~40 ms for a delayed ACK.
    if !config.database_url.contains("sslmode") && is_loopback(options.get_host()) {
        options = options.ssl_mode(PgSslMode::Disable);
    }
    Ok(options)
}

/// Settings of the main pool's sessions besides [`session_settings`]: a generic plan
/// cannot see the parameters, and the `$n IS NULL OR …` filters of many statements then
/// make it expect one row and read a whole table (the claim's once bitmap-scanned and
/// sorted the whole backlog: 130 ms instead of 0.5 ms for 500 of 50,000 events): plan
/// with the actual parameters. The claim and the batch ack, written for it, run on
/// generic plans ([`GENERIC_PLANS`], and the settings of the function
/// `outbox_ack_batches`).
const CLAIM_SETTINGS: &[(&str, &str)] = &[("plan_cache_mode", "force_custom_plan")];

/// What every gateway session sets first, then `extra`. The gateway wakes its relay in
/// process; its inserts must not NOTIFY. Every transaction the gateway opens is ended on
/// every path; should one ever be left open, PostgreSQL ends the session rather than let
/// it hold back vacuum.
fn session_settings(config: &StoreConfig, extra: &[(&str, &str)]) -> String {
    let idle_in_transaction = config.idle_in_transaction_timeout.as_millis().to_string();
    [
        ("outbox.suppress_notify", "on"),
        (
            "idle_in_transaction_session_timeout",
            idle_in_transaction.as_str(),
        ),
    ]
    .iter()
    .chain(extra)
    .map(|(name, value)| format!("SET {name} = '{value}';"))
    .collect()
}

impl Store {
    /// Applies pending migrations. Safe to run from several gateways at once: sqlx holds
    /// an advisory lock meanwhile.
    pub async fn migrate(&self) -> Result<()> {
        sqlx::migrate!("../../migrations").run(&self.pool).await?;
        Ok(())
    }

    /// True when every migration this build knows has been applied. Asked on the health
    /// probe's own connection.
    pub async fn is_migrated(&self) -> Result<bool> {
        Ok(self.schema_version().await? >= latest_schema_version())
    }

    /// The newest migration applied to this database (0: none), asked on the health
    /// probe's own connection.
    pub async fn schema_version(&self) -> Result<i64> {
        let applied: Option<i64> = self
            .probe
            .check(|connection| {
                Box::pin(async move {
                    sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations WHERE success")
                        .fetch_one(connection)
                        .await
                        .or_else(|error| match &error {
                            // No migrations table yet.
                            sqlx::Error::Database(db) if db.code().as_deref() == Some("42P01") => {
                                Ok(None)
                            }
                            _ => Err(error),
                        })
                })
            })
            .await?;
        Ok(applied.unwrap_or_default())
    }

    /// Whether the database answers, on the health probe's own connection: a main pool
    /// whose connections are all busy does not make it look lost.
    pub async fn ping(&self) -> Result<()> {
        self.probe
            .check(|connection| Box::pin(connection.ping()))
            .await
    }

    /// Connections open and, of those, idle.
    pub fn pool_usage(&self) -> (u32, usize) {
        (self.pool.size(), self.pool.num_idle())
    }

    pub async fn close(&self) {
        self.probe.close();
        tokio::join!(self.pool.close(), self.publish_pool.close());
    }

    /// Tells every gateway listening on this database that events were committed (when
    /// `events`) and that deliveries of the given subscriptions were settled here
    /// (settlements that reached this gateway for leases another one handed out), in one
    /// statement.
    pub async fn notify_listeners(&self, events: bool, settled: &[Settled]) -> Result<()> {
        let channels = events
            .then_some((EVENTS_CHANNEL, String::new()))
            .into_iter()
            .chain(
                settled
                    .iter()
                    .map(|settled| (SETTLED_CHANNEL, settled.payload())),
            );
        let (channels, payloads): (Vec<&str>, Vec<String>) = channels.unzip();
        sqlx::query("SELECT pg_notify(c, p) FROM unnest($1::text[], $2::text[]) AS n(c, p)")
            .bind(channels)
            .bind(payloads)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// A connection that receives the commit-time notifications of event writers and
    /// consumers, and the settlement notices of other gateways.
    pub async fn listen(&self) -> Result<EventListener> {
        let mut listener = sqlx::postgres::PgListener::connect_with(&self.pool).await?;
        listener
            .listen_all([
                EVENTS_CHANNEL,
                SETTLED_CHANNEL,
                consumption::CONSUMED_CHANNEL,
            ])
            .await?;
        Ok(EventListener { listener })
    }
}

impl Store {
    /// What the server says of itself, for the start to refuse one the relay cannot serve
    /// ([`EngineFacts::problem`]).
    pub async fn inspect_engine(&self) -> Result<EngineFacts> {
        inspect_engine(&self.probe.options).await
    }
}

/// [`Store::inspect_engine`] before the store exists: when its database does not exist
/// yet, the server's maintenance database answers.
pub async fn inspect_engine_at(config: &StoreConfig) -> Result<EngineFacts> {
    let options = connect_options(config)?;
    match inspect_engine(&options).await {
        Err(StoreError::Unavailable(sqlx::Error::Database(db)))
            if db.code().as_deref() == Some("3D000") =>
        {
            inspect_engine(&options.database("postgres")).await
        }
        other => other,
    }
}

/// Asks on two connections of its own, in the simple query protocol (a pooler in
/// transaction mode breaks named prepared statements before it could be recognised).
async fn inspect_engine(options: &PgConnectOptions) -> Result<EngineFacts> {
    const BACKEND: &str = "SELECT pg_backend_pid()::text";
    let text = |row: &sqlx::postgres::PgRow, column: usize| row.try_get::<String, _>(column);
    let mut first = PgConnection::connect_with(options).await?;
    let about = sqlx::raw_sql("SELECT version(), current_setting('server_version_num')")
        .fetch_one(&mut first)
        .await?;
    let version_num = text(&about, 1)?;
    let mut facts = EngineFacts {
        version: text(&about, 0)?,
        version_num: version_num.parse().map_err(|_| {
            StoreError::Corrupt(format!(
                "server_version_num {version_num:?} is not a number"
            ))
        })?,
        read_only: false,
        in_recovery: false,
        sessions_shared: false,
    };
    // An engine that is not PostgreSQL, or an old one, may lack what is asked next.
    if facts.problem().is_some() {
        return Ok(facts);
    }
    let state = sqlx::raw_sql(
        "SELECT current_setting('transaction_read_only'), pg_is_in_recovery()::text, pg_backend_pid()::text",
    )
    .fetch_one(&mut first)
    .await?;
    facts.read_only = text(&state, 0)? == "on";
    facts.in_recovery = text(&state, 1)? == "true";
    let first_backend = text(&state, 2)?;
    // A pooler in transaction mode lends a server session to a client for one
    // transaction. While a second client holds one open, the first is lent either that
    // same session (which it used last: PgBouncer lends the most recent first) or,
    // asking again, another: directly, or pooled per session, it keeps its own.
    let mut second = PgConnection::connect_with(options).await?;
    sqlx::raw_sql("BEGIN").execute(&mut second).await?;
    let held = text(&sqlx::raw_sql(BACKEND).fetch_one(&mut second).await?, 0)?;
    let again = text(&sqlx::raw_sql(BACKEND).fetch_one(&mut first).await?, 0)?;
    facts.sessions_shared = held == first_backend || again != first_backend;
    let _ = sqlx::raw_sql("ROLLBACK").execute(&mut second).await;
    let _ = second.close().await;
    let _ = first.close().await;
    Ok(facts)
}

/// The newest migration this build knows.
pub fn latest_schema_version() -> i64 {
    sqlx::migrate!("../../migrations")
        .iter()
        .map(|migration| migration.version)
        .max()
        .unwrap_or_default()
}

/// The channel `outbox_notify_insert()` notifies on.
const EVENTS_CHANNEL: &str = "outbox_events";
/// The channel on which a gateway names subscriptions whose leases it settled for
/// another gateway; the payload is the subscription id.
const SETTLED_CHANNEL: &str = "outbox_settled";

/// Leases of a subscription settled on a gateway other than the one holding them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settled {
    pub subscription_id: SubscriptionId,
    /// A nack made a delivery due for another attempt.
    pub made_due: bool,
    /// The settled leases, so their holder can forget them without asking the
    /// database; `None` when too many to name in one notification (the holder then
    /// re-reads its leases).
    pub leases: Option<Vec<LeaseId>>,
}

impl Settled {
    /// Most leases one notification names: a NOTIFY payload holds under 8000 bytes.
    pub const MAX_NAMED_LEASES: usize = 150;

    /// `id:a|d:position.token,...`, or `id:a|d:*` when the leases are not named.
    fn payload(&self) -> String {
        let kind = if self.made_due { 'd' } else { 'a' };
        let leases = match &self.leases {
            None => "*".to_owned(),
            Some(leases) => leases
                .iter()
                .map(|lease| format!("{}.{}", lease.position, lease.token))
                .collect::<Vec<_>>()
                .join(","),
        };
        format!("{}:{kind}:{leases}", self.subscription_id)
    }

    fn parse(payload: &str) -> Option<Settled> {
        let mut parts = payload.splitn(3, ':');
        let subscription_id = SubscriptionId(parts.next()?.parse().ok()?);
        let made_due = match parts.next()? {
            "d" => true,
            "a" => false,
            _ => return None,
        };
        let leases = match parts.next()? {
            "*" => None,
            "" => Some(Vec::new()),
            leases => Some(
                leases
                    .split(',')
                    .map(|lease| {
                        let (position, token) = lease.split_once('.')?;
                        Some(LeaseId {
                            position: position.parse().ok()?,
                            token: token.parse().ok()?,
                        })
                    })
                    .collect::<Option<Vec<_>>>()?,
            ),
        };
        Some(Settled {
            subscription_id,
            made_due,
            leases,
        })
    }
}

/// What a notification says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// Events may have been committed.
    Events,
    /// Leases were settled on another gateway.
    Settled(Settled),
    /// A consumer committed `outbox_consume` records.
    Consumed,
    /// The connection was lost and re-established: notifications may have been missed.
    Reconnected,
}

/// A dedicated LISTEN connection.
pub struct EventListener {
    listener: sqlx::postgres::PgListener,
}

impl EventListener {
    /// Waits for the next notification.
    pub async fn next(&mut self) -> Result<Notice> {
        let Some(notification) = self.listener.try_recv().await? else {
            return Ok(Notice::Reconnected);
        };
        Ok(match notification.channel() {
            // A payload not from a gateway is harmless as a general wake-up.
            SETTLED_CHANNEL => {
                Settled::parse(notification.payload()).map_or(Notice::Events, Notice::Settled)
            }
            consumption::CONSUMED_CHANNEL => Notice::Consumed,
            _ => Notice::Events,
        })
    }
}

fn is_loopback(host: &str) -> bool {
    host == "localhost"
        || host.starts_with('/')
        || host
            .trim_matches(['[', ']'])
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// What makes two URLs the same database (host, port, database name), or why the URL
/// cannot be read.
pub fn database_identity(database_url: &str) -> std::result::Result<String, String> {
    let options = PgConnectOptions::from_str(database_url)
        .map_err(|_| "is not a PostgreSQL connection URL".to_owned())?;
    Ok(format!(
        "{}:{}/{}",
        server_of(&options),
        options.get_port(),
        options.get_database().unwrap_or(options.get_username())
    ))
}

/// The host, or the directory of the Unix socket when it connects through one.
fn server_of(options: &PgConnectOptions) -> String {
    match options.get_socket() {
        Some(directory) => directory.display().to_string(),
        None => options.get_host().to_owned(),
    }
}

/// Describes a connection target without its password, for messages.
pub fn describe_target(database_url: &str) -> String {
    match PgConnectOptions::from_str(database_url) {
        Ok(options) => format!(
            "{}:{} (database {:?}, user {:?})",
            server_of(&options),
            options.get_port(),
            options.get_database().unwrap_or("postgres"),
            options.get_username()
        ),
        Err(_) => "an unparsable DATABASE_URL".to_owned(),
    }
}

async fn create_database_if_missing(options: &PgConnectOptions) -> Result<()> {
    let Some(database) = options.get_database() else {
        return Ok(());
    };
    match PgConnection::connect_with(options).await {
        Ok(connection) => {
            let _ = connection.close().await;
            return Ok(());
        }
        Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("3D000") => {}
        Err(error) => return Err(error.into()),
    }
    let mut maintenance = PgConnection::connect_with(&options.clone().database("postgres")).await?;
    let quoted = format!("\"{}\"", database.replace('"', "\"\""));
    match maintenance
        .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {quoted}")))
        .await
    {
        Ok(_) => tracing::info!(database, "created database"),
        // Another gateway created it meanwhile.
        Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("42P04") => {}
        Err(error) => return Err(error.into()),
    }
    let _ = maintenance.close().await;
    Ok(())
}

/// The health probe's connection. Not a pool: a pool keeps retrying a refused connection
/// until its acquire timeout, so a server that went away would look alive that long, and
/// every call waiting for it would wait as long. The probe connects once per check, and
/// a refusal is an answer at once.
#[derive(Debug)]
struct Probe {
    connection: tokio::sync::Mutex<Option<PgConnection>>,
    options: PgConnectOptions,
    /// Longest wait for a connection (or an answer) from a server that does not refuse.
    timeout: Duration,
}

impl Probe {
    /// Runs `check` on the probe's connection, connecting first when there is none. When
    /// the connection turns out broken (the server restarted, or cut it), a new one
    /// answers for the server as it is now; any other failure is the check's answer.
    async fn check<T>(
        &self,
        check: impl for<'c> Fn(
            &'c mut PgConnection,
        ) -> futures_util::future::BoxFuture<'c, sqlx::Result<T>>,
    ) -> Result<T> {
        let mut held = self.connection.lock().await;
        if let Some(connection) = held.as_mut() {
            match tokio::time::timeout(self.timeout, check(connection)).await {
                Ok(Ok(value)) => return Ok(value),
                Ok(Err(error)) => {
                    let error = StoreError::from(error);
                    if !error.is_unavailable() {
                        return Err(error);
                    }
                    *held = None;
                }
                Err(_) => *held = None,
            }
        }
        let (connection, value) = tokio::time::timeout(self.timeout, async {
            let mut connection = PgConnection::connect_with(&self.options).await?;
            let value = check(&mut connection).await?;
            Ok::<_, sqlx::Error>((connection, value))
        })
        .await
        .map_err(|_| StoreError::Unavailable(sqlx::Error::PoolTimedOut))??;
        *held = Some(connection);
        Ok(value)
    }

    /// Drops the connection; one in use by a check is dropped with it (closing politely
    /// could wait for a server that went away).
    fn close(&self) {
        if let Ok(mut held) = self.connection.try_lock() {
            held.take();
        }
    }
}

fn pool_options(config: &StoreConfig, extra_settings: &[(&str, &str)]) -> PgPoolOptions {
    let settings: std::sync::Arc<str> = session_settings(config, extra_settings).into();
    PgPoolOptions::new()
        .max_connections(config.max_connections)
        .acquire_timeout(config.acquire_timeout)
        .after_connect(move |connection, _| {
            let settings = settings.clone();
            Box::pin(async move {
                sqlx::raw_sql(sqlx::AssertSqlSafe(settings.to_string()))
                    .execute(connection)
                    .await?;
                Ok(())
            })
        })
        // sqlx pings every connection it hands out: a round trip before each statement.
        // Only a connection that sat idle may have been dropped meanwhile; one in steady
        // use would have failed its last statement already.
        .test_before_acquire(false)
        .before_acquire(|connection, meta| {
            Box::pin(async move {
                if meta.idle_for >= IDLE_BEFORE_PING {
                    connection.ping().await?;
                }
                Ok(true)
            })
        })
}

/// A store on a database of its own for a test, with `max_connections` in its main
/// pool.
#[cfg(test)]
pub(crate) async fn throwaway_store(
    max_connections: u32,
    idle_in_transaction_timeout: Duration,
) -> (outbox_testkit::ThrowawayDatabase, Store) {
    let database =
        outbox_testkit::ThrowawayDatabase::create(&outbox_testkit::test_server_url(), "storage")
            .await
            .expect("a database");
    let store = Store::connect(&StoreConfig {
        source: SourceName::default_source(),
        source_id: SourceId(0),
        database_url: database.url().to_owned(),
        max_connections,
        acquire_timeout: Duration::from_secs(30),
        idle_in_transaction_timeout,
    })
    .await
    .expect("connect");
    (database, store)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    fn lease(position: i64, token: i64) -> LeaseId {
        LeaseId { position, token }
    }

    #[test]
    fn settlement_notices_round_trip() {
        for settled in [
            Settled {
                subscription_id: SubscriptionId(7),
                made_due: true,
                leases: Some(vec![lease(1, -5), lease(42, i64::MAX)]),
            },
            Settled {
                subscription_id: SubscriptionId(8),
                made_due: false,
                leases: None,
            },
        ] {
            assert_eq!(Settled::parse(&settled.payload()), Some(settled));
        }
        let most = Settled {
            subscription_id: SubscriptionId(i64::MAX),
            made_due: true,
            leases: Some(vec![lease(i64::MAX, i64::MIN); Settled::MAX_NAMED_LEASES]),
        };
        assert!(most.payload().len() < 8000);
        assert_eq!(Settled::parse("x:a:*"), None);
    }

    /// A transaction PostgreSQL picks as a deadlock's victim runs again rather than
    /// failing its caller.
    #[tokio::test]
    async fn a_deadlock_victim_runs_again() {
        let (database, pool, other) = deadlock_ahead().await;
        let runs = AtomicU32::new(0);
        let contended = async {
            let outcome: Result<()> = run_in_transaction!(pool, |transaction| {
                runs.fetch_add(1, Ordering::Relaxed);
                sqlx::query("SELECT 1 FROM rows WHERE id = 2 FOR UPDATE")
                    .execute(&mut *transaction)
                    .await?;
                sqlx::query("SELECT 1 FROM rows WHERE id = 1 FOR UPDATE")
                    .execute(&mut *transaction)
                    .await?;
                Ok(())
            });
            outcome
        };
        let (outcome, ()) = tokio::join!(contended, close_the_cycle(&pool, other));
        outcome.expect("the victim ran again and committed");
        assert_eq!(runs.load(Ordering::Relaxed), 2);
        pool.close().await;
        database.drop_database().await.expect("drop");
    }

    /// The same for a statement run on its own, as an ack is.
    #[tokio::test]
    async fn a_statement_that_is_a_deadlock_victim_runs_again() {
        let (database, pool, other) = deadlock_ahead().await;
        let runs = AtomicU32::new(0);
        let contended = run_again_on_conflict(|| {
            runs.fetch_add(1, Ordering::Relaxed);
            // Locks row 2, then row 1.
            sqlx::query("SELECT 1 FROM rows WHERE id IN (1, 2) ORDER BY id DESC FOR UPDATE")
                .execute(&pool)
        });
        let (outcome, ()) = tokio::join!(contended, close_the_cycle(&pool, other));
        outcome.expect("the victim ran again");
        assert_eq!(runs.load(Ordering::Relaxed), 2);
        pool.close().await;
        database.drop_database().await.expect("drop");
    }

    /// A database with a table `rows` (ids 1 and 2), a pool on it, and a transaction
    /// holding row 1.
    async fn deadlock_ahead() -> (
        outbox_testkit::ThrowawayDatabase,
        PgPool,
        sqlx::Transaction<'static, sqlx::Postgres>,
    ) {
        let database = outbox_testkit::ThrowawayDatabase::create(
            &outbox_testkit::test_server_url(),
            "storage",
        )
        .await
        .expect("a database");
        let pool = PgPoolOptions::new()
            .max_connections(3)
            .connect(database.url())
            .await
            .expect("connect");
        sqlx::raw_sql("CREATE TABLE rows (id int PRIMARY KEY); INSERT INTO rows VALUES (1), (2)")
            .execute(&pool)
            .await
            .unwrap();
        let mut holding_row_1 = pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM rows WHERE id = 1 FOR UPDATE")
            .execute(&mut *holding_row_1)
            .await
            .unwrap();
        (database, pool, holding_row_1)
    }

    /// Once another session waits for row 1 (holding row 2), asks for row 2 in the
    /// transaction holding row 1, then commits. The other session waited first, so its
    /// deadlock check (after `deadlock_timeout`) is the one that finds the cycle: it is
    /// the victim.
    async fn close_the_cycle(
        pool: &PgPool,
        mut holding_row_1: sqlx::Transaction<'static, sqlx::Postgres>,
    ) {
        outbox_testkit::poll_until(
            Duration::from_secs(30),
            Duration::from_millis(20),
            || async {
                let waiting: bool = sqlx::query_scalar(
                    "SELECT EXISTS (SELECT 1 FROM pg_stat_activity \
                  WHERE wait_event_type = 'Lock' AND datname = current_database())",
                )
                .fetch_one(pool)
                .await
                .unwrap();
                waiting.then_some(())
            },
        )
        .await
        .expect("the contended side waits for row 1");
        sqlx::query("SELECT 1 FROM rows WHERE id = 2 FOR UPDATE")
            .execute(&mut *holding_row_1)
            .await
            .expect("the other side is not the victim");
        holding_row_1.commit().await.unwrap();
    }

    /// The second guard behind ending every transaction: PostgreSQL itself ends a session
    /// of the gateway's that is left idle inside a transaction, in both pools.
    #[tokio::test]
    async fn sessions_left_idle_in_a_transaction_are_ended() {
        // One connection for the session left open, one to watch it.
        let (database, store) = throwaway_store(2, Duration::from_millis(1500)).await;
        for pool in [&store.pool, &store.publish_pool] {
            let mut connection = pool.acquire().await.expect("a connection");
            let shown: String = sqlx::query_scalar("SHOW idle_in_transaction_session_timeout")
                .fetch_one(&mut *connection)
                .await
                .unwrap();
            assert_eq!(shown, "1500ms");
            // Opened by hand: no sqlx transaction guard exists to roll it back.
            sqlx::query("BEGIN")
                .execute(&mut *connection)
                .await
                .unwrap();
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut *connection)
                .await
                .unwrap();
            let observer = &store.pool;
            let ended = outbox_testkit::poll_until(
                Duration::from_secs(30),
                Duration::from_millis(100),
                || async move {
                    let alive: bool = sqlx::query_scalar(
                        "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)",
                    )
                    .bind(pid)
                    .fetch_one(observer)
                    .await
                    .unwrap();
                    (!alive).then_some(())
                },
            )
            .await;
            assert!(
                ended.is_some(),
                "session {pid} stayed idle in its transaction"
            );
            connection.close_on_drop();
        }
        store.pool.close().await;
        store.publish_pool.close().await;
        database.drop_database().await.expect("drop");
    }
}
