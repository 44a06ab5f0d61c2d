//! Gateway configuration: command-line flags, then environment variables, then an
//! optional TOML file, then defaults. [`Settings`] is the raw, layered form (every field
//! optional, one definition serving clap and serde); [`Config`] the validated result.
//! `docs/configuration.md` is the reference for every setting.

use std::{net::SocketAddr, path::PathBuf, str::FromStr, time::Duration};

use serde::Deserialize;

use crate::{
    auth::TokenConfig,
    delivery::DeliveryConfig,
    domain::{AllowedHosts, PublishLimits},
    maintenance::MaintenanceConfig,
    push::PushSettings,
    sinks::SinkSettings,
    sources::{SourceSettings, SourcesSettings},
};
// Defined by the parts they configure; named here too, where the settings are read.
pub use crate::{console::tls::TlsFiles, telemetry::LogFormat};

// The defaults of the gateway's own settings, each written once; those of the parts it
// configures are their `Default` impls (`DeliveryConfig`, `PublishLimits`,
// `MaintenanceConfig`). The `[default: ...]` in each flag's help is checked against
// them by tests/it/configuration.rs.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/outbox";
pub const DEFAULT_LISTEN: &str = "127.0.0.1:50051";
pub const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:9464";
pub const DEFAULT_CONSOLE_LISTEN: &str = "127.0.0.1:9465";
const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;
const DEFAULT_MAX_CONCURRENT_STREAMS: u32 = 256;
const DEFAULT_RPC_TIMEOUT: Duration = Duration::from_secs(30);
const DEFAULT_CONNECTION_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
const DEFAULT_HTTP2_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const DEFAULT_HTTP2_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_TCP_KEEPALIVE: Duration = Duration::from_secs(60);
const DEFAULT_DB_MAX_CONNECTIONS: u32 = 10;
const DEFAULT_DB_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_DB_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);
const DEFAULT_DB_IDLE_IN_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
const DEFAULT_HEALTH_CHECK_INTERVAL: Duration = Duration::from_secs(1);
const DEFAULT_METRICS_REFRESH_INTERVAL: Duration = Duration::from_secs(10);
const DEFAULT_CONSOLE_SESSION_TTL: Duration = Duration::from_secs(8 * 60 * 60);
const DEFAULT_LOG_LEVEL: &str = "info";

/// Settings of `outbox-gateway serve`. Each is a flag, an environment variable and a
/// key of the configuration file.
#[derive(Debug, Default, Clone, clap::Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// TOML file with any of these settings (keys are the flag names with `_`).
    #[arg(long, env = "OUTBOX_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,

    /// PostgreSQL connection URL (postgres:// or postgresql://). The database is created
    /// when missing. [default: postgres://postgres@127.0.0.1:5432/outbox]
    // Its value may hold a password: never shown in --help.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,

    /// Without --database-url: the directory of the private PostgreSQL cluster the
    /// gateway runs itself when nothing answers at the default URL (in `postgres/` under
    /// it, reached through a Unix socket only). Given, that cluster is used even when a
    /// server answers at the default URL. When not given: $XDG_DATA_HOME/outbox-gateway
    /// (~/.local/share/outbox-gateway), or /var/lib/outbox-gateway as root; a cluster
    /// there while a server also answers at the default URL is refused, naming both. A
    /// directory another user can change is refused.
    #[arg(long, env = "OUTBOX_DATA_DIR")]
    pub data_dir: Option<PathBuf>,

    /// The directory of PostgreSQL's server binaries (initdb, pg_ctl) for the private
    /// cluster. When not given: found on PATH, through `pg_config --bindir`, or in the
    /// usual package locations.
    #[arg(long, env = "OUTBOX_POSTGRES_BIN")]
    pub postgres_bin: Option<PathBuf>,

    /// Address the gRPC server listens on, HOST:PORT; a host name is resolved.
    /// [default: 127.0.0.1:50051]
    #[arg(long, env = "OUTBOX_LISTEN")]
    pub listen: Option<String>,

    /// Bearer tokens and their roles; configuration file only (`[[tokens]]` tables).
    #[arg(skip)]
    pub tokens: Option<Vec<TokenConfig>>,

    /// Further databases to relay from, besides `--database-url` (the source `default`);
    /// configuration file only (`[[sources]]` tables).
    #[arg(skip)]
    pub sources: Option<Vec<SourceConfig>>,

    /// Push subscriptions: the destinations they may send to and extra trusted CAs;
    /// configuration file only (a `[push]` table).
    #[arg(skip)]
    pub push: Option<PushFileSettings>,

    /// Brokers sink subscriptions publish into; configuration file only (`[[sinks]]`
    /// tables).
    #[arg(skip)]
    pub sinks: Option<Vec<SinkSettings>>,

    /// Allow listening beyond loopback with no tokens configured: anyone who can reach
    /// the port may publish, read and administer.
    #[arg(long, env = "OUTBOX_INSECURE_NO_AUTH", num_args = 0..=1, default_missing_value = "true")]
    pub insecure_no_auth: Option<bool>,

    /// PEM certificate chain for TLS; with --tls-key, the server speaks only TLS.
    #[arg(long, env = "OUTBOX_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of --tls-cert.
    #[arg(long, env = "OUTBOX_TLS_KEY")]
    pub tls_key: Option<PathBuf>,

    /// PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS).
    #[arg(long, env = "OUTBOX_TLS_CLIENT_CA")]
    pub tls_client_ca: Option<PathBuf>,

    /// Largest gRPC message accepted, in bytes. [default: 16777216]
    #[arg(long, env = "OUTBOX_MAX_MESSAGE_BYTES")]
    pub max_message_bytes: Option<usize>,

    /// Most concurrent calls (HTTP/2 streams) on one client connection. [default: 256]
    #[arg(long, env = "OUTBOX_MAX_CONCURRENT_STREAMS")]
    pub max_concurrent_streams: Option<u32>,

    /// Most Subscribe streams open at once in this gateway. [default: 10000]
    #[arg(long, env = "OUTBOX_MAX_SUBSCRIBE_STREAMS")]
    pub max_subscribe_streams: Option<usize>,

    /// Longest a unary call may take before DEADLINE_EXCEEDED. [default: 30s]
    #[arg(long, env = "OUTBOX_RPC_TIMEOUT")]
    pub rpc_timeout: Option<DurationSetting>,

    /// A gRPC client connection that sends nothing for this long is closed: one that
    /// never completes its TLS or HTTP/2 handshake, or stops answering keepalive pings.
    /// Longer than the keepalive interval plus its timeout. [default: 30s]
    #[arg(long, env = "OUTBOX_CONNECTION_IDLE_TIMEOUT")]
    pub connection_idle_timeout: Option<DurationSetting>,

    /// The gateway pings a gRPC connection (HTTP/2 PING) that has sent nothing for this
    /// long, even without calls on it. [default: 10s]
    #[arg(long, env = "OUTBOX_HTTP2_KEEPALIVE_INTERVAL")]
    pub http2_keepalive_interval: Option<DurationSetting>,

    /// A connection that does not answer a keepalive ping within this is closed.
    /// [default: 10s]
    #[arg(long, env = "OUTBOX_HTTP2_KEEPALIVE_TIMEOUT")]
    pub http2_keepalive_timeout: Option<DurationSetting>,

    /// Idle time before the operating system probes a gRPC connection's peer (TCP
    /// keepalive). [default: 60s]
    #[arg(long, env = "OUTBOX_TCP_KEEPALIVE")]
    pub tcp_keepalive: Option<DurationSetting>,

    /// Do not apply pending schema migrations at start.
    #[arg(long, env = "OUTBOX_NO_MIGRATE", num_args = 0..=1, default_missing_value = "true")]
    pub no_migrate: Option<bool>,

    /// Most database connections in the pool. [default: 10]
    #[arg(long, env = "OUTBOX_DB_MAX_CONNECTIONS")]
    pub db_max_connections: Option<u32>,

    /// How long start-up waits for PostgreSQL to answer before giving up. [default: 10s]
    #[arg(long, env = "OUTBOX_DB_CONNECT_TIMEOUT")]
    pub db_connect_timeout: Option<DurationSetting>,

    /// How long a request waits for a database connection before UNAVAILABLE. [default: 5s]
    #[arg(long, env = "OUTBOX_DB_ACQUIRE_TIMEOUT")]
    pub db_acquire_timeout: Option<DurationSetting>,

    /// PostgreSQL ends a gateway session left idle inside a transaction this long (a
    /// guard: the gateway ends every transaction it opens). [default: 10s]
    #[arg(long, env = "OUTBOX_DB_IDLE_IN_TRANSACTION_TIMEOUT")]
    pub db_idle_in_transaction_timeout: Option<DurationSetting>,

    /// Most events in one Publish call. [default: 1000]
    #[arg(long, env = "OUTBOX_MAX_BATCH_EVENTS")]
    pub max_batch_events: Option<usize>,

    /// Largest event payload, in bytes. [default: 1048576]
    #[arg(long, env = "OUTBOX_MAX_PAYLOAD_BYTES")]
    pub max_payload_bytes: Option<usize>,

    /// Most metadata entries of one event. [default: 64]
    #[arg(long, env = "OUTBOX_MAX_METADATA_ENTRIES")]
    pub max_metadata_entries: Option<usize>,

    /// Most bytes of metadata keys and values of one event. [default: 16384]
    #[arg(long, env = "OUTBOX_MAX_METADATA_BYTES")]
    pub max_metadata_bytes: Option<usize>,

    /// Furthest ahead an event's deliver_at may be. [default: 90d]
    #[arg(long, env = "OUTBOX_MAX_SCHEDULE_AHEAD")]
    pub max_schedule_ahead: Option<DurationSetting>,

    /// Safety-net poll of the relay when no wake-up arrives. [default: 1s]
    #[arg(long, env = "OUTBOX_POLL_INTERVAL")]
    pub poll_interval: Option<DurationSetting>,

    /// max_in_flight of a Subscribe call that leaves it 0. [default: 100]
    #[arg(long, env = "OUTBOX_DEFAULT_MAX_IN_FLIGHT")]
    pub default_max_in_flight: Option<u32>,

    /// Largest max_in_flight a Subscribe call may ask for. [default: 10000]
    #[arg(long, env = "OUTBOX_MAX_IN_FLIGHT_LIMIT")]
    pub max_in_flight_limit: Option<u32>,

    /// max_in_flight_bytes of a Subscribe call that leaves it 0. [default: 16777216]
    #[arg(long, env = "OUTBOX_DEFAULT_MAX_IN_FLIGHT_BYTES")]
    pub default_max_in_flight_bytes: Option<u64>,

    /// Largest max_in_flight_bytes a Subscribe call may ask for. [default: 268435456]
    #[arg(long, env = "OUTBOX_MAX_IN_FLIGHT_BYTES_LIMIT")]
    pub max_in_flight_bytes_limit: Option<u64>,

    /// Most bytes of deliveries held in memory for Subscribe streams that have not read
    /// them yet, across all streams; past it, only streams with nothing waiting receive,
    /// one delivery at a time. [default: 268435456]
    #[arg(long, env = "OUTBOX_MAX_BUFFERED_BYTES")]
    pub max_buffered_bytes: Option<u64>,

    /// Most deliveries one claim leases. [default: 1000]
    #[arg(long, env = "OUTBOX_CLAIM_BATCH_SIZE")]
    pub claim_batch_size: Option<usize>,

    /// How long in-flight calls may take to finish at shutdown. [default: 10s]
    #[arg(long, env = "OUTBOX_SHUTDOWN_GRACE")]
    pub shutdown_grace: Option<DurationSetting>,

    /// How often the health service checks the database. [default: 1s]
    #[arg(long, env = "OUTBOX_HEALTH_CHECK_INTERVAL")]
    pub health_check_interval: Option<DurationSetting>,

    /// Do not run background maintenance (lease reclaim, retention) in this process.
    #[arg(long, env = "OUTBOX_NO_MAINTENANCE", num_args = 0..=1, default_missing_value = "true")]
    pub no_maintenance: Option<bool>,

    /// How often maintenance runs. [default: 30s]
    #[arg(long, env = "OUTBOX_MAINTENANCE_INTERVAL")]
    pub maintenance_interval: Option<DurationSetting>,

    /// Events older than this are deleted once no subscription needs them. [default: 72h]
    #[arg(long, env = "OUTBOX_RETENTION")]
    pub retention: Option<DurationSetting>,

    /// Events older than this are deleted even when a subscription still needs them.
    /// [default: off]
    #[arg(long, env = "OUTBOX_MAX_RETENTION")]
    pub max_retention: Option<DurationSetting>,

    /// Most events one retention batch deletes. [default: 1000]
    #[arg(long, env = "OUTBOX_RETENTION_BATCH_SIZE")]
    pub retention_batch_size: Option<usize>,

    /// Address of the Prometheus endpoint (`/metrics`), or `off`. [default: 127.0.0.1:9464]
    #[arg(long, env = "OUTBOX_METRICS_LISTEN")]
    pub metrics_listen: Option<String>,

    /// How often per-subscription gauges (backlog, in flight, ...) are recomputed.
    /// [default: 10s]
    #[arg(long, env = "OUTBOX_METRICS_REFRESH_INTERVAL")]
    pub metrics_refresh_interval: Option<DurationSetting>,

    /// Address of the web console, or `off`. It uses the TLS flags of the gRPC server.
    /// [default: 127.0.0.1:9465]
    #[arg(long, env = "OUTBOX_CONSOLE_LISTEN")]
    pub console_listen: Option<String>,

    /// How long a console sign-in lasts. [default: 8h]
    #[arg(long, env = "OUTBOX_CONSOLE_SESSION_TTL")]
    pub console_session_ttl: Option<DurationSetting>,

    /// Host names the console answers to without tokens, besides localhost, *.localhost
    /// and IP addresses (a guard against DNS rebinding): `console.internal`,
    /// `*.example.com` or `*`. Repeat the flag or separate names with commas.
    #[arg(long, env = "OUTBOX_CONSOLE_ALLOWED_HOSTS", value_delimiter = ',')]
    pub console_allowed_hosts: Option<Vec<String>>,

    /// Log format: text or json. [default: text]
    #[arg(long, env = "OUTBOX_LOG_FORMAT")]
    pub log_format: Option<LogFormat>,

    /// Log filter in RUST_LOG syntax; RUST_LOG itself wins. [default: info]
    #[arg(long, env = "OUTBOX_LOG_LEVEL")]
    pub log_level: Option<String>,
}

/// Settings of `outbox-gateway migrate`: only those it uses. The configuration file
/// may hold the others (it is shared with `serve`).
#[derive(Debug, Default, Clone, clap::Args)]
pub struct MigrateSettings {
    /// TOML file with any of the `serve` settings (keys are the flag names with `_`).
    #[arg(long, env = "OUTBOX_CONFIG")]
    pub config: Option<PathBuf>,

    /// PostgreSQL connection URL (postgres:// or postgresql://). The database is created
    /// when missing. [default: postgres://postgres@127.0.0.1:5432/outbox]
    // Its value may hold a password: never shown in --help.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,

    /// How long to wait for PostgreSQL to answer before giving up. [default: 10s]
    #[arg(long, env = "OUTBOX_DB_CONNECT_TIMEOUT")]
    pub db_connect_timeout: Option<DurationSetting>,

    /// Log format: text or json. [default: text]
    #[arg(long, env = "OUTBOX_LOG_FORMAT")]
    pub log_format: Option<LogFormat>,

    /// Log filter in RUST_LOG syntax; RUST_LOG itself wins. [default: info]
    #[arg(long, env = "OUTBOX_LOG_LEVEL")]
    pub log_level: Option<String>,
}

impl From<MigrateSettings> for Settings {
    fn from(migrate: MigrateSettings) -> Settings {
        Settings {
            config: migrate.config,
            database_url: migrate.database_url,
            db_connect_timeout: migrate.db_connect_timeout,
            log_format: migrate.log_format,
            log_level: migrate.log_level,
            ..Settings::default()
        }
    }
}

/// A duration written like `500ms`, `1s` or `2m`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DurationSetting(pub Duration);

impl FromStr for DurationSetting {
    type Err = humantime::DurationError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        humantime::parse_duration(text).map(DurationSetting)
    }
}

impl<'de> Deserialize<'de> for DurationSetting {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// One `[[sources]]` table: a database the gateway relays events from.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// `[a-z0-9][a-z0-9_-]{0,62}`; `default` is the database of `--database-url`.
    pub name: String,
    /// PostgreSQL connection URL of the service's database.
    pub database_url: String,
    /// Most connections to it. [default: 5]
    #[serde(default)]
    pub max_connections: Option<u32>,
    /// Install or upgrade the outbox schema there at start (default); when false, check
    /// it and refuse to start if it is missing or older.
    #[serde(default)]
    pub migrate: Option<bool>,
}

/// The `[push]` table.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PushFileSettings {
    /// Hosts push endpoints may name: `hooks.example.com`, `*.internal.example.com`,
    /// `*`, or an address. Empty (the default): pushing is off. Loopback and link-local
    /// addresses only when listed exactly.
    #[serde(default)]
    pub allowed_hosts: Vec<String>,
    /// PEM file of certificate authorities trusted besides the public web roots.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
}

/// Connections to a source when its table does not say.
pub const DEFAULT_SOURCE_CONNECTIONS: u32 = 5;

/// The validated configuration `run` needs.
#[derive(Debug, Clone)]
pub struct Config {
    pub database_url: String,
    /// Whether `database_url` was configured (flag, environment or file) rather than
    /// defaulted: without it, the gateway may run a private cluster (see
    /// [`crate::local_database`]).
    pub database_url_given: bool,
    /// `--data-dir`: where the private cluster lives; given, it is used.
    pub data_dir: Option<PathBuf>,
    /// `--postgres-bin`: where the private cluster's server binaries are.
    pub postgres_bin: Option<PathBuf>,
    pub listen: SocketAddr,
    /// Empty: authentication is off (only allowed on loopback or when insecure).
    pub tokens: Vec<TokenConfig>,
    /// Databases relayed from besides `database_url`, validated.
    pub sources: Vec<SourceConfig>,
    pub insecure_no_auth: bool,
    pub tls: Option<TlsFiles>,
    pub max_message_bytes: usize,
    pub max_concurrent_streams: u32,
    pub rpc_timeout: Duration,
    /// Client connections that send nothing this long are closed.
    pub connection_idle_timeout: Duration,
    /// HTTP/2 pings keep quiet but healthy connections from the idle timeout, and find
    /// the ones whose peer is gone.
    pub http2_keepalive_interval: Duration,
    pub http2_keepalive_timeout: Duration,
    pub tcp_keepalive: Duration,
    pub migrate: bool,
    pub db_max_connections: u32,
    /// Bound on connecting (and creating the database) at start-up.
    pub db_connect_timeout: Duration,
    pub db_acquire_timeout: Duration,
    pub db_idle_in_transaction_timeout: Duration,
    pub limits: PublishLimits,
    pub delivery: DeliveryConfig,
    pub maintenance: MaintenanceConfig,
    pub push: PushSettings,
    /// Broker connections of sink subscriptions, validated.
    pub sinks: Vec<SinkSettings>,
    pub shutdown_grace: Duration,
    pub health_check_interval: Duration,
    /// `None`: no metrics endpoint.
    pub metrics_listen: Option<SocketAddr>,
    pub metrics_refresh_interval: Duration,
    /// `None`: no web console.
    pub console_listen: Option<SocketAddr>,
    /// How long a console sign-in lasts.
    pub console_session_ttl: Duration,
    /// Names a token-less console answers to besides loopback names and addresses.
    pub console_allowed_hosts: AllowedHosts,
    /// How often the console's delivery and ack rates are sampled (not a setting: tests
    /// shorten it).
    pub console_rate_interval: Duration,
    pub log_format: LogFormat,
    pub log_level: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read configuration file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid configuration file {path}: {source}")]
    Parse {
        path: PathBuf,
        source: Box<toml::de::Error>,
    },
    #[error("invalid setting {setting}: {message}")]
    Invalid {
        setting: &'static str,
        message: String,
    },
}

/// Parses `HOST:PORT` (an IP address or a host name, resolved now) for `setting`.
fn socket_address(setting: &'static str, text: &str) -> Result<SocketAddr, ConfigError> {
    use std::net::ToSocketAddrs;
    if let Ok(address) = text.parse() {
        return Ok(address);
    }
    let invalid = |message: String| ConfigError::Invalid { setting, message };
    if text
        .rsplit_once(':')
        .is_none_or(|(_, port)| port.parse::<u16>().is_err())
    {
        return Err(invalid(format!("{text:?} is not HOST:PORT")));
    }
    let addresses: Vec<SocketAddr> = text
        .to_socket_addrs()
        .map_err(|error| invalid(format!("cannot resolve {text:?}: {error}")))?
        .collect();
    // `localhost` often resolves to ::1 first; IPv4 serves clients that dial 127.0.0.1
    // as well as those that dial the name.
    addresses
        .iter()
        .find(|address| address.is_ipv4())
        .or(addresses.first())
        .copied()
        .ok_or_else(|| invalid(format!("{text:?} resolves to no address")))
}

/// Refuses a URL that is not PostgreSQL's, before anything connects with it. The
/// message never repeats the URL: it may hold a password.
pub fn check_database_url(database_url: &str) -> Result<(), String> {
    match database_url.split_once("://") {
        Some(("postgres" | "postgresql", _)) => Ok(()),
        Some((scheme, _)) => Err(format!(
            "must be a PostgreSQL URL (postgres://...), not {scheme}://"
        )),
        None => Err("must be a PostgreSQL URL such as postgres://user@host:5432/database".into()),
    }
}

impl Default for Config {
    fn default() -> Self {
        Config::from_settings(Settings::default()).expect("defaults are valid")
    }
}

impl Config {
    /// Layers flags and environment (`cli`, as clap parsed them) over the file they name.
    pub fn load(cli: Settings) -> Result<Config, ConfigError> {
        let file = match &cli.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.clone(),
                    source,
                })?;
                toml::from_str(&text).map_err(|source| ConfigError::Parse {
                    path: path.clone(),
                    source: Box::new(source),
                })?
            }
            None => Settings::default(),
        };
        Config::from_settings(cli.over(file))
    }

    pub fn from_settings(settings: Settings) -> Result<Config, ConfigError> {
        let delivery_defaults = DeliveryConfig::default();
        let limit_defaults = PublishLimits::default();
        let maintenance_defaults = MaintenanceConfig::default();
        let duration =
            |setting: Option<DurationSetting>, default: Duration| setting.map_or(default, |d| d.0);
        let config = Config {
            database_url_given: settings.database_url.is_some(),
            database_url: settings
                .database_url
                .unwrap_or_else(|| DEFAULT_DATABASE_URL.to_owned()),
            data_dir: settings.data_dir,
            postgres_bin: settings.postgres_bin,
            listen: socket_address(
                "listen",
                settings.listen.as_deref().unwrap_or(DEFAULT_LISTEN),
            )?,
            tokens: settings.tokens.unwrap_or_default(),
            sources: settings.sources.unwrap_or_default(),
            insecure_no_auth: settings.insecure_no_auth.unwrap_or(false),
            tls: match (settings.tls_cert, settings.tls_key) {
                (Some(cert), Some(key)) => Some(TlsFiles {
                    cert,
                    key,
                    client_ca: settings.tls_client_ca,
                }),
                (None, None) if settings.tls_client_ca.is_none() => None,
                _ => {
                    return Err(ConfigError::Invalid {
                        setting: "tls_cert",
                        message: "TLS needs both --tls-cert and --tls-key (and they are required by --tls-client-ca)".into(),
                    });
                }
            },
            max_message_bytes: settings
                .max_message_bytes
                .unwrap_or(DEFAULT_MAX_MESSAGE_BYTES),
            max_concurrent_streams: settings
                .max_concurrent_streams
                .unwrap_or(DEFAULT_MAX_CONCURRENT_STREAMS),
            rpc_timeout: duration(settings.rpc_timeout, DEFAULT_RPC_TIMEOUT),
            connection_idle_timeout: duration(
                settings.connection_idle_timeout,
                DEFAULT_CONNECTION_IDLE_TIMEOUT,
            ),
            http2_keepalive_interval: duration(
                settings.http2_keepalive_interval,
                DEFAULT_HTTP2_KEEPALIVE_INTERVAL,
            ),
            http2_keepalive_timeout: duration(
                settings.http2_keepalive_timeout,
                DEFAULT_HTTP2_KEEPALIVE_TIMEOUT,
            ),
            tcp_keepalive: duration(settings.tcp_keepalive, DEFAULT_TCP_KEEPALIVE),
            migrate: !settings.no_migrate.unwrap_or(false),
            db_max_connections: settings
                .db_max_connections
                .unwrap_or(DEFAULT_DB_MAX_CONNECTIONS),
            db_connect_timeout: duration(settings.db_connect_timeout, DEFAULT_DB_CONNECT_TIMEOUT),
            db_acquire_timeout: duration(settings.db_acquire_timeout, DEFAULT_DB_ACQUIRE_TIMEOUT),
            db_idle_in_transaction_timeout: duration(
                settings.db_idle_in_transaction_timeout,
                DEFAULT_DB_IDLE_IN_TRANSACTION_TIMEOUT,
            ),
            limits: PublishLimits {
                max_batch_events: settings
                    .max_batch_events
                    .unwrap_or(limit_defaults.max_batch_events),
                max_payload_bytes: settings
                    .max_payload_bytes
                    .unwrap_or(limit_defaults.max_payload_bytes),
                max_metadata_entries: settings
                    .max_metadata_entries
                    .unwrap_or(limit_defaults.max_metadata_entries),
                max_metadata_bytes: settings
                    .max_metadata_bytes
                    .unwrap_or(limit_defaults.max_metadata_bytes),
                max_schedule_ahead: duration(
                    settings.max_schedule_ahead,
                    limit_defaults.max_schedule_ahead,
                ),
            },
            delivery: DeliveryConfig {
                poll_interval: duration(settings.poll_interval, delivery_defaults.poll_interval),
                default_max_in_flight: settings
                    .default_max_in_flight
                    .unwrap_or(delivery_defaults.default_max_in_flight),
                max_in_flight_limit: settings
                    .max_in_flight_limit
                    .unwrap_or(delivery_defaults.max_in_flight_limit),
                default_max_in_flight_bytes: settings
                    .default_max_in_flight_bytes
                    .unwrap_or(delivery_defaults.default_max_in_flight_bytes),
                max_in_flight_bytes_limit: settings
                    .max_in_flight_bytes_limit
                    .unwrap_or(delivery_defaults.max_in_flight_bytes_limit),
                max_buffered_bytes: settings
                    .max_buffered_bytes
                    .unwrap_or(delivery_defaults.max_buffered_bytes),
                claim_batch_size: settings
                    .claim_batch_size
                    .unwrap_or(delivery_defaults.claim_batch_size),
                max_streams: settings
                    .max_subscribe_streams
                    .unwrap_or(delivery_defaults.max_streams),
                // `limits.max_payload_bytes`, given to the relay when it starts.
                ..delivery_defaults
            },
            maintenance: MaintenanceConfig {
                enabled: !settings.no_maintenance.unwrap_or(false),
                interval: duration(settings.maintenance_interval, maintenance_defaults.interval),
                retention: duration(settings.retention, maintenance_defaults.retention),
                max_retention: settings.max_retention.map(|d| d.0),
                batch_size: settings
                    .retention_batch_size
                    .unwrap_or(maintenance_defaults.batch_size),
                ..maintenance_defaults
            },
            push: {
                let file = settings.push.unwrap_or_default();
                PushSettings {
                    allowed_hosts: AllowedHosts::parse(&file.allowed_hosts).map_err(|message| {
                        ConfigError::Invalid {
                            setting: "push.allowed_hosts",
                            message,
                        }
                    })?,
                    ca_file: file.ca_file,
                    poll_interval: duration(
                        settings.poll_interval,
                        delivery_defaults.poll_interval,
                    ),
                }
            },
            sinks: {
                let sinks = settings.sinks.unwrap_or_default();
                crate::sinks::validate(&sinks).map_err(|message| ConfigError::Invalid {
                    setting: "sinks",
                    message,
                })?;
                sinks
            },
            shutdown_grace: duration(settings.shutdown_grace, DEFAULT_SHUTDOWN_GRACE),
            health_check_interval: duration(
                settings.health_check_interval,
                DEFAULT_HEALTH_CHECK_INTERVAL,
            ),
            metrics_listen: match settings
                .metrics_listen
                .as_deref()
                .unwrap_or(DEFAULT_METRICS_LISTEN)
            {
                "off" => None,
                address => Some(socket_address("metrics_listen", address)?),
            },
            metrics_refresh_interval: duration(
                settings.metrics_refresh_interval,
                DEFAULT_METRICS_REFRESH_INTERVAL,
            ),
            console_listen: match settings
                .console_listen
                .as_deref()
                .unwrap_or(DEFAULT_CONSOLE_LISTEN)
            {
                "off" => None,
                address => Some(socket_address("console_listen", address)?),
            },
            console_session_ttl: duration(
                settings.console_session_ttl,
                DEFAULT_CONSOLE_SESSION_TTL,
            ),
            console_allowed_hosts: AllowedHosts::parse(
                &settings.console_allowed_hosts.unwrap_or_default(),
            )
            .map_err(|message| ConfigError::Invalid {
                setting: "console_allowed_hosts",
                message,
            })?,
            console_rate_interval: Duration::from_secs(10),
            log_format: settings.log_format.unwrap_or_default(),
            log_level: settings
                .log_level
                .unwrap_or_else(|| DEFAULT_LOG_LEVEL.to_owned()),
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks the settings together, naming the first one that is wrong. Loading a
    /// configuration runs it; a configuration built in code (an embedding program, the
    /// tests) should too.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |setting, message: &str| {
            Err(ConfigError::Invalid {
                setting,
                message: message.to_owned(),
            })
        };
        if let Err(message) = check_database_url(&self.database_url) {
            return Err(ConfigError::Invalid {
                setting: "database_url",
                message: format!("--database-url (DATABASE_URL) {message}"),
            });
        }
        if self.tokens.is_empty() && !self.listen.ip().is_loopback() && !self.insecure_no_auth {
            return Err(ConfigError::Invalid {
                setting: "listen",
                message: format!(
                    "listening on {} without authentication would let anyone who reaches it publish, read and administer: configure [[tokens]] in the configuration file, listen on a loopback address, or pass --insecure-no-auth",
                    self.listen
                ),
            });
        }
        self.validate_sources()?;
        if let Some(console) = self.console_listen
            && self.tokens.is_empty()
            && !console.ip().is_loopback()
            && !self.insecure_no_auth
        {
            return Err(ConfigError::Invalid {
                setting: "console_listen",
                message: format!(
                    "serving the console on {console} without authentication would let anyone who reaches it administer the gateway: configure [[tokens]] in the configuration file, serve it on a loopback address, set it to \"off\", or pass --insecure-no-auth"
                ),
            });
        }
        if self.console_session_ttl < Duration::from_secs(1) {
            return invalid("console_session_ttl", "must be at least 1s");
        }
        if let Err(message) = crate::auth::Authenticator::new(&self.tokens) {
            return Err(ConfigError::Invalid {
                setting: "tokens",
                message,
            });
        }
        if self.max_message_bytes < 64 * 1024 {
            return invalid("max_message_bytes", "must be at least 65536");
        }
        if self.max_concurrent_streams == 0 {
            return invalid("max_concurrent_streams", "must be at least 1");
        }
        for (setting, value) in [
            ("connection_idle_timeout", self.connection_idle_timeout),
            ("http2_keepalive_interval", self.http2_keepalive_interval),
            ("http2_keepalive_timeout", self.http2_keepalive_timeout),
            ("tcp_keepalive", self.tcp_keepalive),
        ] {
            if value < Duration::from_millis(100) {
                return invalid(setting, "must be at least 100ms");
            }
        }
        // A quiet, healthy client sends its first bytes after the keepalive interval,
        // when it answers the ping.
        if self.connection_idle_timeout
            <= self.http2_keepalive_interval + self.http2_keepalive_timeout
        {
            return invalid(
                "connection_idle_timeout",
                "must be longer than http2_keepalive_interval plus http2_keepalive_timeout: a quiet but healthy client sends nothing until it answers a keepalive ping",
            );
        }
        if self.db_max_connections < 2 {
            // One connection is held by the NOTIFY listener.
            return invalid("db_max_connections", "must be at least 2");
        }
        if self.db_idle_in_transaction_timeout < Duration::from_secs(1) {
            return invalid("db_idle_in_transaction_timeout", "must be at least 1s");
        }
        if self.limits.max_batch_events == 0 {
            return invalid("max_batch_events", "must be at least 1");
        }
        if self.limits.max_metadata_bytes > 60 * 1024 {
            return invalid(
                "max_metadata_bytes",
                "must be at most 61440 (the table allows 64 KiB of JSON)",
            );
        }
        let delivery = &self.delivery;
        if delivery.default_max_in_flight == 0
            || delivery.default_max_in_flight > delivery.max_in_flight_limit
        {
            return invalid(
                "default_max_in_flight",
                "must be between 1 and max_in_flight_limit",
            );
        }
        if delivery.default_max_in_flight_bytes == 0
            || delivery.default_max_in_flight_bytes > delivery.max_in_flight_bytes_limit
        {
            return invalid(
                "default_max_in_flight_bytes",
                "must be between 1 and max_in_flight_bytes_limit",
            );
        }
        if delivery.max_buffered_bytes == 0 {
            return invalid("max_buffered_bytes", "must be at least 1");
        }
        if delivery.claim_batch_size == 0 {
            return invalid("claim_batch_size", "must be at least 1");
        }
        if delivery.poll_interval < Duration::from_millis(10) {
            return invalid("poll_interval", "must be at least 10ms");
        }
        let maintenance = &self.maintenance;
        if maintenance.interval < Duration::from_millis(100) {
            return invalid("maintenance_interval", "must be at least 100ms");
        }
        if self.metrics_refresh_interval < Duration::from_millis(100) {
            return invalid("metrics_refresh_interval", "must be at least 100ms");
        }
        if maintenance.batch_size == 0 {
            return invalid("retention_batch_size", "must be at least 1");
        }
        if maintenance
            .max_retention
            .is_some_and(|max| max < maintenance.retention)
        {
            return invalid("max_retention", "must not be shorter than retention");
        }
        Ok(())
    }
}

impl Config {
    /// What the sources module needs to reach the databases, defaults filled in.
    pub fn sources_settings(&self) -> SourcesSettings {
        SourcesSettings {
            database_url: self.database_url.clone(),
            connect_timeout: self.db_connect_timeout,
            acquire_timeout: self.db_acquire_timeout,
            idle_in_transaction_timeout: self.db_idle_in_transaction_timeout,
            sources: (self.sources.iter())
                .map(|source| SourceSettings {
                    name: source.name.clone(),
                    database_url: source.database_url.clone(),
                    max_connections: source.max_connections.unwrap_or(DEFAULT_SOURCE_CONNECTIONS),
                    migrate: source.migrate.unwrap_or(true),
                })
                .collect(),
        }
    }

    /// Names are well formed and distinct, `default` is not redefined, and no two sources
    /// (`default` included) point at the same database.
    fn validate_sources(&self) -> Result<(), ConfigError> {
        let invalid = |index: usize, name: &str, message: String| ConfigError::Invalid {
            setting: "sources",
            message: format!("sources[{index}] ({name:?}): {message}"),
        };
        let mut seen: Vec<(&str, String)> = vec![(
            crate::domain::DEFAULT_SOURCE,
            crate::storage::database_identity(&self.database_url).unwrap_or_default(),
        )];
        for (index, source) in self.sources.iter().enumerate() {
            crate::domain::SourceName::parse("name", &source.name)
                .map_err(|error| invalid(index, &source.name, error.to_string()))?;
            check_database_url(&source.database_url).map_err(|message| {
                invalid(index, &source.name, format!("database_url {message}"))
            })?;
            let identity =
                crate::storage::database_identity(&source.database_url).map_err(|message| {
                    invalid(index, &source.name, format!("database_url {message}"))
                })?;
            if let Some((other, _)) = seen.iter().find(|(name, _)| *name == source.name) {
                return Err(invalid(
                    index,
                    &source.name,
                    format!("the name is already used by {}", describe_source(other)),
                ));
            }
            if let Some((other, _)) = seen.iter().find(|(_, seen)| *seen == identity) {
                return Err(invalid(
                    index,
                    &source.name,
                    format!(
                        "database_url points at the same database as {}",
                        describe_source(other)
                    ),
                ));
            }
            if source.max_connections == Some(0) {
                return Err(invalid(
                    index,
                    &source.name,
                    "max_connections must be at least 1".into(),
                ));
            }
            seen.push((&source.name, identity));
        }
        Ok(())
    }
}

fn describe_source(name: &str) -> String {
    if name == crate::domain::DEFAULT_SOURCE {
        "the default source (--database-url)".to_owned()
    } else {
        format!("source {name:?}")
    }
}

impl Settings {
    /// These settings, falling back to `lower` for each one left unset.
    fn over(self, lower: Settings) -> Settings {
        macro_rules! layered {
            ($($field:ident),* $(,)?) => {
                Settings { $($field: self.$field.or(lower.$field)),* }
            };
        }
        layered!(
            config,
            database_url,
            data_dir,
            postgres_bin,
            listen,
            tokens,
            sources,
            push,
            sinks,
            insecure_no_auth,
            tls_cert,
            tls_key,
            tls_client_ca,
            max_message_bytes,
            max_concurrent_streams,
            max_subscribe_streams,
            rpc_timeout,
            connection_idle_timeout,
            http2_keepalive_interval,
            http2_keepalive_timeout,
            tcp_keepalive,
            no_migrate,
            db_max_connections,
            db_connect_timeout,
            db_acquire_timeout,
            db_idle_in_transaction_timeout,
            max_batch_events,
            max_payload_bytes,
            max_metadata_entries,
            max_metadata_bytes,
            max_schedule_ahead,
            poll_interval,
            default_max_in_flight,
            max_in_flight_limit,
            default_max_in_flight_bytes,
            max_in_flight_bytes_limit,
            max_buffered_bytes,
            claim_batch_size,
            shutdown_grace,
            health_check_interval,
            no_maintenance,
            maintenance_interval,
            retention,
            max_retention,
            retention_batch_size,
            metrics_listen,
            metrics_refresh_interval,
            console_listen,
            console_session_ttl,
            console_allowed_hosts,
            log_format,
            log_level,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_win_over_the_file_and_defaults_fill_the_rest() {
        let cli = Settings {
            poll_interval: Some("250ms".parse().unwrap()),
            ..Default::default()
        };
        let file: Settings =
            toml::from_str("poll_interval = \"5s\"\nmax_batch_events = 7\n").unwrap();
        let config = Config::from_settings(cli.over(file)).unwrap();
        assert_eq!(config.delivery.poll_interval, Duration::from_millis(250));
        assert_eq!(config.limits.max_batch_events, 7);
        assert_eq!(config.database_url, DEFAULT_DATABASE_URL);
        assert!(config.migrate);
        assert_eq!(
            config.console_listen,
            Some(DEFAULT_CONSOLE_LISTEN.parse().unwrap())
        );
    }

    #[test]
    fn the_console_needs_tokens_beyond_loopback() {
        let open = Settings {
            console_listen: Some("0.0.0.0:9465".into()),
            ..Default::default()
        };
        assert!(matches!(
            Config::from_settings(open.clone()),
            Err(ConfigError::Invalid {
                setting: "console_listen",
                ..
            })
        ));
        let insecure = Settings {
            insecure_no_auth: Some(true),
            ..open
        };
        assert!(Config::from_settings(insecure).is_ok());
        let off = Settings {
            console_listen: Some("off".into()),
            ..Default::default()
        };
        assert_eq!(Config::from_settings(off).unwrap().console_listen, None);
        let bad = Settings {
            console_listen: Some("nowhere".into()),
            ..Default::default()
        };
        assert!(matches!(
            Config::from_settings(bad),
            Err(ConfigError::Invalid {
                setting: "console_listen",
                ..
            })
        ));
    }

    #[test]
    fn the_console_takes_the_host_names_it_answers_to() {
        let settings: Settings = toml::from_str(
            "console_allowed_hosts = [\"console.internal\", \"*.ops.example.com\"]\n",
        )
        .unwrap();
        let config = Config::from_settings(settings).unwrap();
        for name in ["console.internal", "gw.ops.example.com"] {
            assert!(
                config.console_allowed_hosts.allowance(name).is_some(),
                "{name}"
            );
        }
        assert!(Config::default().console_allowed_hosts.is_empty());
        #[derive(clap::Parser)]
        struct Serve {
            #[command(flatten)]
            settings: Settings,
        }
        let flags = <Serve as clap::Parser>::try_parse_from([
            "serve",
            "--console-allowed-hosts",
            "a.internal",
            "--console-allowed-hosts=b.internal,c.internal",
        ])
        .unwrap();
        assert_eq!(
            flags.settings.console_allowed_hosts.unwrap(),
            ["a.internal", "b.internal", "c.internal"]
        );
        let bad = Settings {
            console_allowed_hosts: Some(vec!["http://console.internal/".into()]),
            ..Default::default()
        };
        assert!(matches!(
            Config::from_settings(bad),
            Err(ConfigError::Invalid {
                setting: "console_allowed_hosts",
                ..
            })
        ));
    }

    #[test]
    fn reads_the_push_table_and_refuses_bad_hosts() {
        let settings: Settings = toml::from_str(
            "[push]\nallowed_hosts = [\"hooks.example.com\", \"*.internal.example.com\"]\nca_file = \"/etc/ca.pem\"\n",
        )
        .unwrap();
        let config = Config::from_settings(settings).unwrap();
        assert!(
            config
                .push
                .allowed_hosts
                .allowance("a.internal.example.com")
                .is_some()
        );
        assert_eq!(config.push.ca_file, Some(PathBuf::from("/etc/ca.pem")));
        assert!(
            Config::default().push.allowed_hosts.is_empty(),
            "off by default"
        );
        assert!(toml::from_str::<Settings>("[push]\nallowed = []\n").is_err());
        let settings: Settings =
            toml::from_str("[push]\nallowed_hosts = [\"not a host!\"]\n").unwrap();
        assert!(matches!(
            Config::from_settings(settings),
            Err(ConfigError::Invalid {
                setting: "push.allowed_hosts",
                ..
            })
        ));
    }

    #[test]
    fn reads_sink_tables_and_refuses_bad_ones_naming_the_entry() {
        let sinks = |text: &str| {
            let settings: Settings = toml::from_str(text).unwrap();
            Config::from_settings(settings).map(|config| config.sinks)
        };
        let read = sinks(
            "[[sinks]]\nname = \"events-js\"\nkind = \"nats\"\nservers = [\"nats://127.0.0.1:4222\"]\ntoken = \"s3cret\"\n",
        )
        .unwrap();
        assert_eq!(read[0].name, "events-js");
        assert!(
            !format!("{:?}", read[0]).contains("s3cret"),
            "credentials are never shown"
        );
        for (text, expected) in [
            (
                "name = \"Bad Name\"\nkind = \"nats\"\nservers = [\"nats://h:4222\"]",
                "name must match",
            ),
            (
                "name = \"a\"\nkind = \"nats\"\nservers = []",
                "servers must name",
            ),
            (
                "name = \"a\"\nkind = \"nats\"\nservers = [\"http://h:4222\"]",
                "is not a NATS URL",
            ),
            (
                "name = \"a\"\nkind = \"kafka\"\nbrokers = [\"h:9092\"]\nservers = [\"nats://h:4222\"]",
                "servers is not a setting of a kafka sink",
            ),
            (
                "name = \"a\"\nkind = \"kafka\"\nbrokers = []",
                "brokers must name",
            ),
            (
                "name = \"a\"\nkind = \"kafka\"\nbrokers = [\"kafka://h:9092\"]",
                "is not host:port",
            ),
            (
                "name = \"a\"\nkind = \"kafka\"\nbrokers = [\"h:9092\"]\nsasl_mechanism = \"GSSAPI\"\nuser = \"u\"\npassword = \"p\"",
                "sasl_mechanism \"GSSAPI\" is not one of",
            ),
            (
                "name = \"a\"\nkind = \"nats\"\nservers = [\"nats://h:4222\"]\nbrokers = [\"h:9092\"]",
                "brokers is not a setting of a nats sink",
            ),
            ("name = \"a\"\nkind = \"amqp\"", "not a sink kind"),
            (
                "name = \"a\"\nkind = \"nats\"\nservers = [\"nats://h:4222\"]\nuser = \"u\"",
                "user and password go together",
            ),
            (
                "name = \"a\"\nkind = \"nats\"\nservers = [\"nats://h:4222\"]\ntoken = \"t\"\nuser = \"u\"\npassword = \"p\"",
                "set one of",
            ),
        ] {
            match sinks(&format!("[[sinks]]\n{text}\n")) {
                Err(ConfigError::Invalid {
                    setting: "sinks",
                    message,
                }) => {
                    assert!(message.starts_with("sinks[0]"), "{message}");
                    assert!(message.contains(expected), "{text}: {message}");
                }
                other => panic!("{text}: {other:?}"),
            }
        }
        let twice = "[[sinks]]\nname = \"a\"\nkind = \"nats\"\nservers = [\"nats://h:4222\"]\n";
        match sinks(&format!("{twice}{twice}")) {
            Err(ConfigError::Invalid { message, .. }) => {
                assert!(
                    message.contains("sinks[1]") && message.contains("earlier sink"),
                    "{message}"
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(
            toml::from_str::<Settings>(
                "[[sinks]]\nname = \"a\"\nkind = \"nats\"\nbootstrap = []\n"
            )
            .is_err()
        );
        let kafka = sinks(
            "[[sinks]]\nname = \"events-kafka\"\nkind = \"kafka\"\nbrokers = [\"k1:9092\", \"k2:9092\"]\nuser = \"u\"\npassword = \"kafka-secret\"\nsasl_mechanism = \"SCRAM-SHA-512\"\n",
        )
        .unwrap();
        assert_eq!(kafka[0].brokers, ["k1:9092", "k2:9092"]);
        assert!(!format!("{:?}", kafka[0]).contains("kafka-secret"));
    }

    #[test]
    fn rejects_unknown_file_keys_and_bad_values() {
        assert!(toml::from_str::<Settings>("pole_interval = \"1s\"").is_err());
        let settings = Settings {
            claim_batch_size: Some(0),
            ..Default::default()
        };
        assert!(matches!(
            Config::from_settings(settings),
            Err(ConfigError::Invalid {
                setting: "claim_batch_size",
                ..
            })
        ));
    }

    #[test]
    fn the_idle_timeout_must_outlast_a_keepalive_round() {
        let from_file = |text: &str| {
            Config::from_settings(toml::from_str::<Settings>(text).expect("valid TOML"))
        };
        let config = from_file("connection_idle_timeout = \"5s\"\nhttp2_keepalive_interval = \"2s\"\nhttp2_keepalive_timeout = \"1s\"").unwrap();
        assert_eq!(config.connection_idle_timeout, Duration::from_secs(5));
        assert_eq!(config.http2_keepalive_interval, Duration::from_secs(2));
        assert_eq!(config.http2_keepalive_timeout, Duration::from_secs(1));
        // A quiet client answers only the ping after 2s, by 3s at the latest.
        let error = from_file("connection_idle_timeout = \"3s\"\nhttp2_keepalive_interval = \"2s\"\nhttp2_keepalive_timeout = \"1s\"").unwrap_err();
        assert!(
            matches!(&error, ConfigError::Invalid { setting: "connection_idle_timeout", message } if message.contains("http2_keepalive_interval")),
            "{error}"
        );
        let error = from_file("tcp_keepalive = \"0s\"").unwrap_err();
        assert!(
            matches!(
                &error,
                ConfigError::Invalid {
                    setting: "tcp_keepalive",
                    ..
                }
            ),
            "{error}"
        );
    }

    #[test]
    fn addresses_take_host_names() {
        let resolved = socket_address("listen", "localhost:50051").unwrap();
        assert!(
            resolved.ip().is_loopback() && resolved.port() == 50051,
            "{resolved}"
        );
        assert_eq!(
            socket_address("listen", "127.0.0.1:9").unwrap().to_string(),
            "127.0.0.1:9"
        );
        for bad in ["localhost", "localhost:http", ":"] {
            let error = socket_address("listen", bad).unwrap_err().to_string();
            assert!(error.contains("HOST:PORT"), "{bad}: {error}");
        }
    }

    #[test]
    fn only_postgresql_urls_are_taken() {
        check_database_url("postgres://u@h/db").unwrap();
        check_database_url("postgresql://u@h/db").unwrap();
        let mysql = check_database_url("mysql://root:hunter2@h/db").unwrap_err();
        assert!(
            mysql.contains("mysql://") && !mysql.contains("hunter2"),
            "{mysql}"
        );
        assert!(check_database_url("h:5432/db").is_err());
    }
}
