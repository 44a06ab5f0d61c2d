//! The broker connections of sink subscriptions (`[[sinks]]` in the configuration
//! file): their settings, checked at start, and the clients the core's sinkers publish
//! through (a [`SinkClient`] each).

mod kafka;
mod nats;

use std::{fmt, path::PathBuf, sync::Arc};

use serde::Deserialize;

use crate::{
    domain::SinkKind,
    sink::{SinkCatalog, SinkClient},
};

/// One `[[sinks]]` table.
#[derive(Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SinkSettings {
    /// `[a-z0-9][a-z0-9_-]{0,62}`: what subscriptions name it by.
    pub name: String,
    /// `nats` (JetStream) or `kafka`.
    pub kind: String,
    /// NATS server URLs (`nats://host:port`, `tls://host:port`).
    #[serde(default)]
    pub servers: Vec<String>,
    /// Kafka bootstrap brokers (`host:port`).
    #[serde(default)]
    pub brokers: Vec<String>,
    /// A NATS credentials file (JWT and NKey seed).
    #[serde(default)]
    pub credentials_file: Option<PathBuf>,
    /// A NATS token.
    #[serde(default)]
    pub token: Option<String>,
    /// A user and its password: NATS's, or Kafka's SASL credentials.
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub password: Option<String>,
    /// Kafka: `PLAIN` (the default with a user), `SCRAM-SHA-256` or `SCRAM-SHA-512`.
    #[serde(default)]
    pub sasl_mechanism: Option<String>,
    /// PEM file of certificate authorities trusted for the broker's TLS certificate
    /// (for Kafka, setting it also turns TLS on).
    #[serde(default)]
    pub tls_ca_file: Option<PathBuf>,
    /// Refuse to connect without TLS (for Kafka: connect with TLS).
    #[serde(default)]
    pub tls_required: bool,
}

/// Credentials are never shown.
impl fmt::Debug for SinkSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hidden = |set: bool| if set { "(set)" } else { "(unset)" };
        f.debug_struct("SinkSettings")
            .field("name", &self.name)
            .field("kind", &self.kind)
            .field("servers", &self.servers)
            .field("brokers", &self.brokers)
            .field("credentials_file", &self.credentials_file)
            .field("token", &hidden(self.token.is_some()))
            .field("user", &self.user)
            .field("password", &hidden(self.password.is_some()))
            .field("sasl_mechanism", &self.sasl_mechanism)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_required", &self.tls_required)
            .finish()
    }
}

impl SinkSettings {
    /// The kind, once [`validate`] accepted the settings.
    fn sink_kind(&self) -> Option<SinkKind> {
        match self.kind.as_str() {
            "nats" => Some(SinkKind::Nats),
            "kafka" => Some(SinkKind::Kafka),
            _ => None,
        }
    }
}

/// Checks every sink's settings; the message names the entry (`sinks[1] ("orders")`).
pub fn validate(sinks: &[SinkSettings]) -> Result<(), String> {
    for (index, sink) in sinks.iter().enumerate() {
        let invalid = |message: String| format!("sinks[{index}] ({:?}): {message}", sink.name);
        let mut name = sink.name.bytes();
        let well_formed = name
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
            && name.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
            && sink.name.len() <= 63;
        if !well_formed {
            return Err(invalid("name must match [a-z0-9][a-z0-9_-]{0,62}".into()));
        }
        if sinks[..index].iter().any(|other| other.name == sink.name) {
            return Err(invalid("the name is used by an earlier sink".into()));
        }
        // Each kind's settings, and those of the other kind that it does not take.
        let (checked, foreign): (_, &[(&str, bool)]) = match sink.sink_kind() {
            Some(SinkKind::Nats) => (
                nats::validate(sink),
                &[
                    ("brokers", !sink.brokers.is_empty()),
                    ("sasl_mechanism", sink.sasl_mechanism.is_some()),
                ],
            ),
            Some(SinkKind::Kafka) => (
                kafka::validate(sink),
                &[
                    ("servers", !sink.servers.is_empty()),
                    ("credentials_file", sink.credentials_file.is_some()),
                    ("token", sink.token.is_some()),
                ],
            ),
            None => {
                return Err(invalid(format!(
                    "kind {:?} is not a sink kind; use \"nats\" (JetStream) or \"kafka\"",
                    sink.kind
                )));
            }
        };
        checked.map_err(invalid)?;
        if let Some((field, _)) = foreign.iter().find(|(_, set)| *set) {
            return Err(invalid(format!(
                "{field} is not a setting of a {} sink",
                sink.kind
            )));
        }
    }
    Ok(())
}

/// Builds a client for every sink. Connections are made in the background: a broker
/// that is down at start is connected to once it is up, and its subscriptions wait.
pub async fn connect(sinks: &[SinkSettings]) -> Result<SinkCatalog, String> {
    let mut clients: Vec<(String, Arc<dyn SinkClient>)> = Vec::new();
    for sink in sinks {
        let client: Arc<dyn SinkClient> = match sink.sink_kind() {
            Some(SinkKind::Nats) => Arc::new(
                nats::NatsSink::connect(sink)
                    .await
                    .map_err(|message| format!("sink {:?}: {message}", sink.name))?,
            ),
            Some(SinkKind::Kafka) => Arc::new(
                kafka::KafkaSink::connect(sink)
                    .map_err(|message| format!("sink {:?}: {message}", sink.name))?,
            ),
            None => {
                return Err(format!(
                    "sink {:?}: unknown kind {:?}",
                    sink.name, sink.kind
                ));
            }
        };
        clients.push((sink.name.clone(), client));
    }
    Ok(SinkCatalog::new(clients))
}
