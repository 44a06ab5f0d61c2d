//! The source databases the gateway relays from: `default` (the gateway's own database,
//! which also holds the subscription definitions) and each `[[sources]]` entry.
//!
//! Every source is self-contained — its events, each subscription's read position and
//! delivery records live next to each other — so a claim or an ack is one statement in
//! one database, and a source that is down only pauses its own share: the others flow on,
//! and it resumes by itself when it is back. This module connects to the sources (one
//! that is down at start-up does not stop the gateway), prepares their schema, and
//! watches whether each is reachable.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use chrono::{DateTime, Utc};
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use crate::{
    domain::{AckSeal, DEFAULT_SOURCE, EngineProblem, SourceId, SourceName, Subscription},
    error::Error,
    storage::{Store, StoreConfig, StoreError},
};

/// Whether a source can be used right now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceHealth {
    pub connected: bool,
    /// It was checked at least once (a source not yet checked counts as not connected).
    pub checked: bool,
    /// Why it is not (in the gateway's words), and since when its state last changed.
    pub last_error: Option<String>,
    pub since: DateTime<Utc>,
}

/// One source database.
pub struct Source {
    pub id: SourceId,
    pub name: SourceName,
    pub store: Store,
    /// Install or upgrade the schema (true), or only check it.
    migrate: bool,
    /// The schema was migrated or checked: from then on a check only pings.
    prepared: std::sync::atomic::AtomicBool,
    /// The ack key is installed here (`default` keeps the original).
    key_installed: std::sync::atomic::AtomicBool,
    health: Mutex<SourceHealth>,
    /// It answered at least once since the start: answering after being down is then
    /// "again", and not before.
    answered_before: std::sync::atomic::AtomicBool,
    /// Bumped whenever the source's health changes; dispatchers resume on it.
    changed: watch::Sender<u64>,
    /// Asks the health watch to check this source now rather than at its next round: a
    /// call just found it unreachable.
    check_now: Notify,
}

impl Source {
    /// A store error of this source as the core reports it: unreachable names the source.
    pub fn error(&self, error: StoreError) -> Error {
        if error.is_unavailable() {
            tracing::debug!(source = %self.name, %error, "source unavailable");
            self.check_now.notify_one();
            Error::SourceUnavailable(self.name.clone())
        } else {
            error.into()
        }
    }

    pub fn health(&self) -> SourceHealth {
        self.health.lock().expect("health lock").clone()
    }

    pub fn is_connected(&self) -> bool {
        self.health.lock().expect("health lock").connected
    }

    /// A receiver that changes whenever the source goes down or comes back.
    pub fn watch(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// What `work` on this source yields, or `None` at once when the source is known to be
    /// down, or as soon as it is found down while `work` waits: a connection attempt to a
    /// server that went away takes the whole acquire timeout. `work` is dropped then, so
    /// it must not hold a transaction of its own (a dropped transaction stays open on its
    /// connection until the connection's next use): wait this way for what another task
    /// carries out, such as a publish committer's answer.
    pub async fn unless_down<F: Future>(&self, work: F) -> Option<F::Output> {
        let mut changes = self.changed.subscribe();
        if !self.is_connected() {
            return None;
        }
        let went_down = async {
            while changes.changed().await.is_ok() {
                if !self.is_connected() {
                    return;
                }
            }
            // The sources are being dropped: let `work` finish.
            std::future::pending::<()>().await
        };
        tokio::select! {
            biased;
            output = work => Some(output),
            () = went_down => {
                tracing::debug!(source = %self.name, "gave up waiting for a source found unreachable");
                None
            }
        }
    }

    /// Records the outcome of a check; logs one line when the state changes, and one
    /// when a source is first found down. Returns whether the state changed.
    fn record(&self, outcome: Result<(), String>) -> bool {
        let mut health = self.health.lock().expect("health lock");
        let connected = outcome.is_ok();
        let first = !health.checked;
        let changed = health.connected != connected;
        let answered_before = self
            .answered_before
            .fetch_or(connected, std::sync::atomic::Ordering::Relaxed);
        match &outcome {
            // Coming up for the first time is no news.
            Ok(()) if first => {
                tracing::debug!(source = %self.name, "source is reachable")
            }
            Ok(()) if changed && self.name.is_default() => {
                tracing::info!("the database is reachable again")
            }
            // Down at the start, and answering for the first time.
            Ok(()) if changed && !answered_before => tracing::info!(
                source = %self.name,
                "source is reachable, for the first time since the start; its deliveries begin"
            ),
            Ok(()) if changed => tracing::info!(source = %self.name, "source is reachable again"),
            Err(error) if (changed || first) && self.name.is_default() => {
                tracing::warn!(%error, "lost the database; calls answer UNAVAILABLE and deliveries pause until it is back")
            }
            Err(error) if first => {
                tracing::warn!(source = %self.name, %error, "source is unreachable; its deliveries wait until it answers, the other sources go on")
            }
            Err(error) if changed => {
                tracing::warn!(source = %self.name, %error, "source is unreachable; its deliveries pause, the other sources go on")
            }
            _ => {}
        }
        if changed {
            health.since = Utc::now();
            self.changed.send_modify(|generation| *generation += 1);
        }
        health.checked = true;
        health.connected = connected;
        health.last_error = outcome.err();
        changed
    }
}

/// Every source of this gateway, `default` first; cheap to clone.
#[derive(Clone)]
pub struct Sources {
    list: Arc<Vec<Arc<Source>>>,
    /// The key ack ids are sealed with for `outbox_consume`, read from `default` by
    /// [`Sources::prepare`] and installed in every other source as it is prepared.
    seal: Arc<std::sync::OnceLock<AckSeal>>,
}

/// How to reach the databases, as the configuration resolved it.
#[derive(Debug, Clone)]
pub struct SourcesSettings {
    /// The `default` database (`--database-url`).
    pub database_url: String,
    /// Longest wait for `default` at start-up.
    pub connect_timeout: Duration,
    pub acquire_timeout: Duration,
    pub idle_in_transaction_timeout: Duration,
    /// Every other source, in configuration order (ids 1, 2, …).
    pub sources: Vec<SourceSettings>,
}

/// One source besides `default`.
#[derive(Debug, Clone)]
pub struct SourceSettings {
    pub name: String,
    pub database_url: String,
    pub max_connections: u32,
    /// Install or upgrade the schema at start (true), or only check it.
    pub migrate: bool,
}

/// Why a database could not be reached at start-up.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error(
        "cannot connect to PostgreSQL at {target}: {source}. Point the gateway at your database with --database-url or DATABASE_URL"
    )]
    Connect { target: String, source: StoreError },
    #[error(
        "no answer from PostgreSQL at {target} within {}: is a PostgreSQL server listening there? Point the gateway at your database with --database-url or DATABASE_URL, or wait longer with --db-connect-timeout",
        humantime::format_duration(*timeout)
    )]
    Timeout { target: String, timeout: Duration },
    #[error("cannot use PostgreSQL at {target}: {problem}")]
    Engine {
        target: String,
        problem: EngineProblem,
    },
}

/// Connects to a database at start-up (creating it when missing), saying what it waits
/// for and giving up after `timeout`: a port that accepts connections but does not speak
/// PostgreSQL would otherwise keep the gateway waiting silently.
pub async fn connect_within(
    store_config: &StoreConfig,
    timeout: Duration,
) -> Result<Store, ConnectError> {
    let target = crate::storage::describe_target(&store_config.database_url);
    // Not `target`: JSON logs already have a key of that name (the module).
    tracing::info!(database = %target, "connecting to PostgreSQL");
    let connect = async {
        let facts = crate::storage::inspect_engine_at(store_config).await?;
        if let Some(problem) = facts.problem() {
            return Ok(Err(problem));
        }
        Store::connect(store_config).await.map(Ok)
    };
    match tokio::time::timeout(timeout, connect).await {
        Ok(Ok(Ok(store))) => Ok(store),
        Ok(Ok(Err(problem))) => Err(ConnectError::Engine { target, problem }),
        Ok(Err(source)) => Err(ConnectError::Connect { target, source }),
        Err(_) => Err(ConnectError::Timeout { target, timeout }),
    }
}

/// Why the sources could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SourcesError {
    #[error("source {name:?}: {message}")]
    Invalid { name: String, message: String },
    #[error(
        "source {name:?}: its outbox schema is missing or older than this gateway's; run `outbox-gateway migrate --source {name}` or set migrate = true"
    )]
    NotMigrated { name: String },
    #[error("source {name:?}: {problem}")]
    Engine {
        name: String,
        problem: EngineProblem,
    },
}

impl Sources {
    /// `default` (connected already) and a handle to every configured source; those are
    /// reached on first use.
    pub fn new(default: Store, config: &SourcesSettings) -> Result<Sources, SourcesError> {
        let mut list = vec![Arc::new(Source::new(default, true))];
        for (index, source) in config.sources.iter().enumerate() {
            let id = SourceId(u16::try_from(index + 1).map_err(|_| SourcesError::Invalid {
                name: source.name.clone(),
                message: "too many sources".into(),
            })?);
            let store =
                Store::connect_lazy(&store_config(config, source, id)?).map_err(|error| {
                    SourcesError::Invalid {
                        name: source.name.clone(),
                        message: error.to_string(),
                    }
                })?;
            list.push(Arc::new(Source::new(store, source.migrate)));
        }
        Ok(Sources {
            list: Arc::new(list),
            seal: Arc::default(),
        })
    }

    /// Only `default`: for tools that work on one database.
    pub fn single(default: Store) -> Sources {
        Sources {
            list: Arc::new(vec![Arc::new(Source::new(default, true))]),
            seal: Arc::default(),
        }
    }

    /// The key that seals ack ids for `outbox_consume`; `None` until it could be read
    /// from `default` (by [`Sources::prepare`], or once its schema is migrated, by
    /// [`Sources::watch`]).
    pub fn ack_seal(&self) -> Option<&AckSeal> {
        self.seal.get()
    }

    /// Reads the key from `default`, storing a new one there when it has none, unless it
    /// was read already; `None` while that fails (say, the schema is not migrated yet).
    async fn load_ack_seal(&self) -> Option<&AckSeal> {
        if let Some(seal) = self.seal.get() {
            return Some(seal);
        }
        let candidate = AckSeal::generate();
        let pads = candidate.pads();
        match (self.default_source().store)
            .ack_key(candidate.key(), (&pads.0, &pads.1))
            .await
        {
            Ok(key) => Some(self.seal.get_or_init(|| AckSeal::new(key))),
            Err(error) => {
                tracing::debug!(%error, "cannot read the ack key yet");
                None
            }
        }
    }

    pub fn default_source(&self) -> &Arc<Source> {
        &self.list[0]
    }

    pub fn get(&self, id: SourceId) -> Option<&Arc<Source>> {
        self.list.get(usize::from(id.0))
    }

    pub fn by_name(&self, name: &str) -> Option<&Arc<Source>> {
        self.list.iter().find(|source| source.name.as_str() == name)
    }

    pub fn id_of(&self, name: &str) -> Option<SourceId> {
        self.by_name(name).map(|source| source.id)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<Source>> {
        self.list.iter()
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The sources a subscription reads (unknown names are skipped: a replica configured
    /// without that source serves the others).
    pub fn of(&self, subscription: &Subscription) -> Vec<Arc<Source>> {
        self.list
            .iter()
            .filter(|source| subscription.reads(&source.name))
            .cloned()
            .collect()
    }

    /// Prepares every non-default source's schema now when it is reachable: migrates it
    /// (migrate = true) or checks it. A source that is unreachable is left to
    /// [`Sources::watch`]; one whose schema is missing while migrate = false stops the
    /// start.
    pub async fn prepare(&self) -> Result<(), SourcesError> {
        self.load_ack_seal().await;
        for source in self.list.iter().skip(1) {
            match source.prepare(self.ack_seal()).await {
                Ok(()) => {
                    source.record(Ok(()));
                }
                Err(PrepareError::NotMigrated) => {
                    return Err(SourcesError::NotMigrated {
                        name: source.name.to_string(),
                    });
                }
                Err(PrepareError::Engine(problem)) => {
                    return Err(SourcesError::Engine {
                        name: source.name.to_string(),
                        problem,
                    });
                }
                Err(PrepareError::Store(error)) => {
                    source.record(Err(probe_failure(&error)));
                }
            }
        }
        Ok(())
    }

    /// Checks every source every `interval` until `stop`, recording whether it is
    /// reachable (and, for a source that was down, preparing its schema first). The
    /// sources are checked side by side, so one that takes its whole connect timeout to
    /// fail does not delay noticing that another is back.
    pub async fn watch(self, interval: Duration, stop: CancellationToken) {
        loop {
            let seal = self.load_ack_seal().await.cloned();
            let seal = &seal;
            futures_util::future::join_all(self.list.iter().skip(1).map(|source| async move {
                let outcome = match source.prepare(seal.as_ref()).await {
                    Ok(()) => Ok(()),
                    Err(PrepareError::NotMigrated) => Err(
                        "its outbox schema is missing or older than this gateway's; run `outbox-gateway migrate`".to_owned(),
                    ),
                    Err(PrepareError::Engine(problem)) => Err(problem.to_string()),
                    Err(PrepareError::Store(error)) => Err(probe_failure(&error)),
                };
                source.record(outcome);
            }))
            .await;
            let asked = self
                .list
                .iter()
                .map(|source| Box::pin(source.check_now.notified()));
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                // A call found a source unreachable: confirm it now, so that the others'
                // calls stop waiting for it (see `Source::unless_down`).
                _ = futures_util::future::select_all(asked) => {}
                _ = stop.cancelled() => return,
            }
        }
    }

    /// Records that `default` answered or not (its health is watched with the gateway's).
    pub fn record_default(&self, outcome: Result<(), String>) {
        self.default_source().record(outcome);
    }

    pub async fn close(&self) {
        for source in self.list.iter() {
            source.store.close().await;
        }
    }
}

/// Whether `name` is a configured source, or why not (naming the `--source` flag).
pub fn check_source_name(config: &SourcesSettings, name: &str) -> Result<(), String> {
    if name == DEFAULT_SOURCE || config.sources.iter().any(|source| source.name == name) {
        return Ok(());
    }
    let mut known = vec![DEFAULT_SOURCE.to_owned()];
    known.extend(config.sources.iter().map(|source| source.name.clone()));
    Err(format!(
        "--source: no source named {name:?}; configured: {}",
        known.join(", ")
    ))
}

/// Installs or upgrades the outbox schema in the source named `only`, or in every source
/// (`default` first) when `None` — the `outbox-gateway migrate` deploy step. Returns one
/// line per source migrated; stops at the first source that fails, naming it.
pub async fn migrate(config: &SourcesSettings, only: Option<&str>) -> Result<Vec<String>, String> {
    if let Some(name) = only {
        check_source_name(config, name)?;
    }
    let mut done = Vec::new();
    let wanted = |name: &str| only.is_none_or(|only| only == name);
    if wanted(DEFAULT_SOURCE) {
        let store = connect_within(&default_store_config(config, 1), config.connect_timeout)
            .await
            .map_err(|error| format!("source \"default\": {error}"))?;
        done.push(migrate_store(&store, &config.database_url).await?);
    }
    for (index, source) in config.sources.iter().enumerate() {
        if !wanted(&source.name) {
            continue;
        }
        let id = SourceId(u16::try_from(index + 1).unwrap_or(u16::MAX));
        let mut store_config =
            store_config(config, source, id).map_err(|error| error.to_string())?;
        store_config.max_connections = 1;
        let store = Store::connect_lazy(&store_config)
            .map_err(|error| format!("source {:?}: {}", source.name, error))?;
        done.push(migrate_store(&store, &source.database_url).await?);
    }
    Ok(done)
}

async fn migrate_store(store: &Store, database_url: &str) -> Result<String, String> {
    let target = crate::storage::describe_target(database_url);
    let outcome = match store.inspect_engine().await.map(|facts| facts.problem()) {
        Ok(Some(problem)) => {
            store.close().await;
            return Err(format!(
                "source {:?}: cannot use PostgreSQL at {target}: {problem}",
                store.source().as_str()
            ));
        }
        Ok(None) => store.migrate().await,
        Err(error) => Err(error),
    };
    store.close().await;
    outcome.map_err(|error| {
        format!(
            "source {:?} at {target}: {}",
            store.source().as_str(),
            error
        )
    })?;
    Ok(format!(
        "schema of source {:?} at {target} is up to date",
        store.source().as_str()
    ))
}

enum PrepareError {
    NotMigrated,
    /// A server the relay cannot serve: it stays down until it is replaced.
    Engine(EngineProblem),
    Store(StoreError),
}

impl Source {
    fn new(store: Store, migrate: bool) -> Source {
        let (changed, _) = watch::channel(0);
        let is_default = store.source().is_default();
        Source {
            id: store.source_id(),
            name: store.source().clone(),
            store,
            migrate,
            prepared: std::sync::atomic::AtomicBool::new(is_default),
            key_installed: std::sync::atomic::AtomicBool::new(is_default),
            health: Mutex::new(SourceHealth {
                // `default` is connected by the time it is registered; the others are
                // known once first checked.
                connected: is_default,
                checked: is_default,
                last_error: (!is_default).then(|| "not checked yet".to_owned()),
                since: Utc::now(),
            }),
            answered_before: std::sync::atomic::AtomicBool::new(is_default),
            changed,
            check_now: Notify::new(),
        }
    }

    /// Migrates the schema, or checks it is current, and installs the ack key; once
    /// both are done, only checks that the source answers.
    async fn prepare(&self, seal: Option<&AckSeal>) -> Result<(), PrepareError> {
        use std::sync::atomic::Ordering;
        let key_missing = !self.key_installed.load(Ordering::Relaxed);
        if self.prepared.load(Ordering::Relaxed) {
            if !(key_missing && seal.is_some()) {
                return self.store.ping().await.map_err(PrepareError::Store);
            }
        } else if let Some(problem) = self
            .store
            .inspect_engine()
            .await
            .map_err(PrepareError::Store)?
            .problem()
        {
            return Err(PrepareError::Engine(problem));
        } else if self.migrate {
            self.store.migrate().await.map_err(PrepareError::Store)?;
        } else {
            match self.store.is_migrated().await {
                Ok(true) => {}
                Ok(false) => return Err(PrepareError::NotMigrated),
                Err(error) => return Err(PrepareError::Store(error)),
            }
        }
        self.prepared.store(true, Ordering::Relaxed);
        if let Some(seal) = seal.filter(|_| key_missing) {
            let (inner, outer) = seal.pads();
            self.store
                .install_ack_key(seal.key(), (&inner, &outer))
                .await
                .map_err(PrepareError::Store)?;
            self.key_installed.store(true, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// How to reach `default`, the database of `--database-url`, with `max_connections`.
pub fn default_store_config(config: &SourcesSettings, max_connections: u32) -> StoreConfig {
    StoreConfig {
        source: SourceName::default_source(),
        source_id: SourceId(0),
        database_url: config.database_url.clone(),
        max_connections,
        acquire_timeout: config.acquire_timeout,
        idle_in_transaction_timeout: config.idle_in_transaction_timeout,
    }
}

fn store_config(
    config: &SourcesSettings,
    source: &SourceSettings,
    id: SourceId,
) -> Result<StoreConfig, SourcesError> {
    Ok(StoreConfig {
        source: SourceName::parse("name", &source.name).map_err(|error| SourcesError::Invalid {
            name: source.name.clone(),
            message: error.to_string(),
        })?,
        source_id: id,
        database_url: source.database_url.clone(),
        max_connections: source.max_connections,
        acquire_timeout: config.acquire_timeout,
        idle_in_transaction_timeout: config.idle_in_transaction_timeout,
    })
}

/// Why a health probe failed, in the source's status and the log. The probe has a
/// connection of its own, so running out of time means no connection could be opened
/// (the server refuses or does not answer), never a busy pool.
fn probe_failure(error: &StoreError) -> String {
    if error.is_pool_exhausted() {
        "cannot reach PostgreSQL: no connection could be opened in time".to_owned()
    } else {
        error.to_string()
    }
}
