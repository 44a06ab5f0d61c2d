//! [`ThrowawayDatabase`]: a database created for one test or one run, under a random
//! name, and dropped afterwards.

use std::str::FromStr;

use sqlx::{Connection, Executor, PgConnection, postgres::PgConnectOptions};

/// Why a throw-away database could not be created or dropped.
#[derive(Debug, thiserror::Error)]
pub enum DatabaseError {
    /// The server URL does not parse.
    #[error("invalid PostgreSQL URL {url:?}: {source}")]
    InvalidUrl {
        /// The URL as given.
        url: String,
        /// Why it does not parse.
        source: sqlx::Error,
    },
    /// The server does not answer.
    #[error("cannot connect to PostgreSQL at {server}: {source}")]
    Connect {
        /// Host, port and user tried.
        server: String,
        /// The driver's error.
        source: sqlx::Error,
    },
    /// The server refused the statement.
    #[error("cannot {action} database {name}: {source}")]
    Statement {
        /// `create` or `drop`.
        action: &'static str,
        /// The database.
        name: String,
        /// The server's error.
        source: sqlx::Error,
    },
}

/// A database of its own on a PostgreSQL server, named `<prefix>_<random>`. Nothing drops
/// it by itself: call [`ThrowawayDatabase::drop_database`] (or
/// [`ThrowawayDatabase::drop_blocking`] from a `Drop`), or keep it to look at.
#[derive(Debug)]
pub struct ThrowawayDatabase {
    name: String,
    /// The server, without a database.
    server: PgConnectOptions,
    url: String,
}

impl ThrowawayDatabase {
    /// Creates the database on the server at `server_url`; a database named in the URL
    /// is ignored, its query parameters (e.g. `sslmode`) are kept.
    pub async fn create(server_url: &str, prefix: &str) -> Result<Self, DatabaseError> {
        let server =
            PgConnectOptions::from_str(server_url).map_err(|source| DatabaseError::InvalidUrl {
                url: server_url.to_owned(),
                source,
            })?;
        let name = format!("{prefix}_{}", uuid::Uuid::new_v4().simple());
        let database = ThrowawayDatabase {
            url: database_url(server_url, &name),
            name,
            server,
        };
        database
            .run_on_server("create", format!("CREATE DATABASE {}", database.name))
            .await?;
        Ok(database)
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A connection URL of the database: the server URL with the database replaced.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Options to connect to the database, to build pools with.
    pub fn connect_options(&self) -> PgConnectOptions {
        self.server.clone().database(&self.name)
    }

    /// Drops the database, cutting off any connection left.
    pub async fn drop_database(&self) -> Result<(), DatabaseError> {
        self.run_on_server(
            "drop",
            format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name),
        )
        .await
    }

    /// [`ThrowawayDatabase::drop_database`] for a `Drop` impl, which may run inside a
    /// runtime that cannot be blocked on: the work runs on a thread of its own. Errors are
    /// ignored; the database is left behind then.
    pub fn drop_blocking(&self) {
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                if let Ok(runtime) = runtime {
                    let _ = runtime.block_on(self.drop_database());
                }
            });
        });
    }

    async fn run_on_server(
        &self,
        action: &'static str,
        statement: String,
    ) -> Result<(), DatabaseError> {
        let mut admin = PgConnection::connect_with(&self.server.clone().database("postgres"))
            .await
            .map_err(|source| DatabaseError::Connect {
                server: format!(
                    "{}:{} as {:?}",
                    self.server.get_host(),
                    self.server.get_port(),
                    self.server.get_username()
                ),
                source,
            })?;
        // The name is ours: a fixed prefix and a UUID, nothing a caller typed.
        let result = admin.execute(sqlx::AssertSqlSafe(statement)).await;
        let _ = admin.close().await;
        result.map(drop).map_err(|source| DatabaseError::Statement {
            action,
            name: self.name.clone(),
            source,
        })
    }
}

/// `server_url` with its database path replaced by `database` (query parameters kept).
fn database_url(server_url: &str, database: &str) -> String {
    let (base, query) = match server_url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (server_url, None),
    };
    let authority_start = base.find("://").map_or(0, |index| index + 3);
    let path_start = base[authority_start..]
        .find('/')
        .map_or(base.len(), |index| authority_start + index);
    let mut url = format!("{}/{database}", &base[..path_start]);
    if let Some(query) = query {
        url.push('?');
        url.push_str(query);
    }
    url
}

/// Rows written so far (inserted, updated, deleted) in the gateway's tables other than
/// `outbox_events`: what delivery bookkeeping costs the database. The counts come from
/// `pg_stat_user_tables`, which other sessions update only when they flush their
/// statistics (within a second while busy, ten seconds once idle, and as they end).
pub async fn gateway_row_writes(executor: impl sqlx::PgExecutor<'_>) -> Result<u64, sqlx::Error> {
    let writes: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)::bigint \
         FROM pg_stat_user_tables \
         WHERE relname LIKE 'outbox\\_%' AND relname <> 'outbox_events'",
    )
    .fetch_one(executor)
    .await?;
    Ok(writes.max(0) as u64)
}

/// `application_name` of the gateway's database sessions (what a fault injector cuts).
pub const GATEWAY_APPLICATION: &str = "outbox-gateway";

/// Closes every session the gateway holds on database `database`, as a database restart
/// or a network cut would; returns how many it closed.
pub async fn cut_gateway_sessions(
    executor: impl sqlx::PgExecutor<'_>,
    database: &str,
) -> Result<u64, sqlx::Error> {
    let cut: i64 = sqlx::query_scalar(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE datname = $1 AND application_name = $2",
    )
    .bind(database)
    .bind(GATEWAY_APPLICATION)
    .fetch_one(executor)
    .await?;
    Ok(cut.max(0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn creates_a_database_and_drops_it() {
        let database = ThrowawayDatabase::create(&crate::test_server_url(), "outbox_testkit")
            .await
            .expect("PostgreSQL must be running for the tests (see README)");
        assert!(database.name().starts_with("outbox_testkit_"));
        let mut connection = PgConnection::connect(database.url()).await.unwrap();
        let current: String = sqlx::query_scalar("SELECT current_database()")
            .fetch_one(&mut connection)
            .await
            .unwrap();
        assert_eq!(current, database.name());
        // Dropping cuts off connections that are still open.
        database.drop_blocking();
        assert!(connection.ping().await.is_err());
        assert!(
            PgConnection::connect_with(&database.connect_options())
                .await
                .is_err()
        );
    }

    #[test]
    fn replaces_the_database_of_a_url() {
        assert_eq!(
            database_url("postgres://postgres@127.0.0.1:5432", "b"),
            "postgres://postgres@127.0.0.1:5432/b"
        );
        assert_eq!(
            database_url("postgres://postgres@127.0.0.1:5432/", "b"),
            "postgres://postgres@127.0.0.1:5432/b"
        );
        assert_eq!(
            database_url("postgres://u:p@localhost/postgres?sslmode=disable", "b"),
            "postgres://u:p@localhost/b?sslmode=disable"
        );
    }
}
