//! The broker connections of sink subscriptions (`[[sinks]]` in the configuration
//! file): their settings, checked at start, and the clients the core's sinkers publish
//! through (a [`SinkClient`] each).

mod nats;

use std::{fmt, path::PathBuf, sync::Arc};

use serde::Deserialize;

use crate::{
    domain::SinkKind,
    sink::{SinkCatalog, SinkClient},
};

/// One `[[sinks]]` table.
#[derive(Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SinkSettings {
    /// `[a-z0-9][a-z0-9_-]{0,62}`: what subscriptions name it by.
    pub name: String,
    /// `nats` (JetStream).
    pub kind: String,
    /// NATS server URLs (`nats://host:port`, `tls://host:port`).
    #[serde(default)]
    pub servers: Vec<String>,
    /// A NATS credentials file (JWT and NKey seed).
    #[serde(default)]
    pub credentials_file: Option<PathBuf>,
    /// A NATS token.
    #[serde(default)]
    pub token: Option<String>,
    /// A NATS user and its password.
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub password: Option<String>,
    /// PEM file of certificate authorities trusted for the broker's TLS certificate.
    #[serde(default)]
    pub tls_ca_file: Option<PathBuf>,
    /// Refuse to connect without TLS.
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
            .field("credentials_file", &self.credentials_file)
            .field("token", &hidden(self.token.is_some()))
            .field("user", &self.user)
            .field("password", &hidden(self.password.is_some()))
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
        match sink.sink_kind() {
            Some(SinkKind::Nats) => nats::validate(sink).map_err(invalid)?,
            Some(SinkKind::Kafka) => {
                return Err(invalid(
                    "kind \"kafka\": Kafka sinks are not available in this version; kind \"nats\" (JetStream) is".into(),
                ));
            }
            None => {
                return Err(invalid(format!(
                    "kind {:?} is not a sink kind; use \"nats\" (JetStream)",
                    sink.kind
                )));
            }
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
            Some(SinkKind::Kafka) | None => {
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
