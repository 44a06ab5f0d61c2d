//! NATS JetStream sinks, on async-nats: each message is published with its headers and
//! settles once JetStream's PubAck says the stream stored it. What cannot succeed by
//! retrying — no stream takes the subject, the message is larger than the server or
//! stream allows, the gateway may not publish there — is a permanent failure; anything
//! else (the server unreachable or restarting, no answer in time) is transient.

use std::{
    borrow::Cow,
    str::FromStr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use async_nats::{
    ConnectOptions, Event, HeaderMap, HeaderName, HeaderValue, ServerAddr, ServerError,
    connection::State,
    jetstream::{
        self,
        context::{GetStreamByNameErrorKind, PublishErrorKind},
        message::PublishMessage,
    },
};
use futures_util::{FutureExt, future::BoxFuture};

use super::SinkSettings;
use crate::{
    domain::SinkKind,
    sink::{SinkClient, SinkFailure, SinkMessage},
};

/// Publishes awaiting their PubAck at once, over all of this sink's subscriptions.
const MAX_ACKS_PENDING: usize = 4096;
/// Longest wait at start for the first connection before carrying on without it.
const FIRST_CONNECTION_WAIT: Duration = Duration::from_secs(2);
/// Longest wait for JetStream's answer when checking whether it is reachable.
const CHECK_TIMEOUT: Duration = Duration::from_secs(3);
/// JetStream's codes for a message larger than the stream takes (payload, headers).
const TOO_LARGE_CODES: [u64; 2] = [10054, 10097];

/// Checks a `kind = "nats"` sink's settings.
pub(super) fn validate(sink: &SinkSettings) -> Result<(), String> {
    if sink.servers.is_empty() {
        return Err("servers must name at least one NATS server (nats://host:port)".into());
    }
    for (index, server) in sink.servers.iter().enumerate() {
        ServerAddr::from_str(server)
            .map_err(|error| format!("servers[{index}] {server:?} is not a NATS URL: {error}"))?;
    }
    if sink.user.is_some() != sink.password.is_some() {
        return Err("user and password go together".into());
    }
    let ways = [
        sink.credentials_file.is_some(),
        sink.token.is_some(),
        sink.user.is_some(),
    ];
    if ways.iter().filter(|set| **set).count() > 1 {
        return Err("set one of credentials_file, token, or user and password".into());
    }
    Ok(())
}

pub(super) struct NatsSink {
    client: async_nats::Client,
    /// Shared by every send: cloning a context copies more than a pointer.
    jetstream: Arc<jetstream::Context>,
    /// The servers, for messages.
    servers: String,
    /// The newest permissions violation the server reported, and when: it comes apart
    /// from the publish it refuses, which then times out.
    violation: Arc<Mutex<Option<(Instant, String)>>>,
}

impl NatsSink {
    /// Connects, waiting at most [`FIRST_CONNECTION_WAIT`] for the first connection:
    /// a server that is down is connected to once it is up.
    pub(super) async fn connect(sink: &SinkSettings) -> Result<NatsSink, String> {
        let violation = Arc::new(Mutex::new(None));
        let name = sink.name.clone();
        let recorded = violation.clone();
        let (connected, mut first_connection) = tokio::sync::watch::channel(false);
        let mut options = ConnectOptions::new()
            .name(format!("outbox-gateway sink {}", sink.name))
            .retry_on_initial_connect()
            .max_reconnects(None)
            .connection_timeout(Duration::from_secs(5))
            .event_callback(move |event| {
                let (name, recorded) = (name.clone(), recorded.clone());
                if matches!(event, Event::Connected) {
                    connected.send_replace(true);
                }
                async move {
                    match event {
                        Event::Connected => tracing::info!(sink = %name, "connected to NATS"),
                        Event::Disconnected => {
                            tracing::warn!(sink = %name, "disconnected from NATS; reconnecting");
                        }
                        Event::ServerError(ServerError::Other(message))
                            if message.to_lowercase().contains("permissions violation") =>
                        {
                            tracing::warn!(sink = %name, %message, "NATS refused a publish");
                            *recorded.lock().expect("violation lock") =
                                Some((Instant::now(), message));
                        }
                        other => tracing::debug!(sink = %name, event = %other, "NATS event"),
                    }
                }
            });
        if let Some(path) = &sink.credentials_file {
            options = options.credentials_file(path).await.map_err(|error| {
                format!("cannot read credentials_file {}: {error}", path.display())
            })?;
        }
        if let Some(token) = &sink.token {
            options = options.token(token.clone());
        }
        if let (Some(user), Some(password)) = (&sink.user, &sink.password) {
            options = options.user_and_password(user.clone(), password.clone());
        }
        if let Some(path) = &sink.tls_ca_file {
            options = options.add_root_certificates(path.clone());
        }
        options = options.require_tls(sink.tls_required);
        let servers: Vec<ServerAddr> = sink
            .servers
            .iter()
            .map(|server| ServerAddr::from_str(server).map_err(|error| error.to_string()))
            .collect::<Result<_, _>>()?;
        let client = options
            .connect(servers.clone())
            .await
            .map_err(|error| format!("cannot connect: {error}"))?;
        // A moment for the first connection, so that a reachable broker is reported
        // reachable from the start; a broker that is down is connected to later.
        let _ = tokio::time::timeout(
            FIRST_CONNECTION_WAIT,
            first_connection.wait_for(|connected| *connected),
        )
        .await;
        let jetstream = jetstream::ContextBuilder::new()
            .timeout(crate::sink::SINK_TIMEOUT)
            .max_ack_inflight(MAX_ACKS_PENDING)
            .backpressure_on_inflight(true)
            .build(client.clone());
        Ok(NatsSink {
            client,
            jetstream: Arc::new(jetstream),
            // Shown in errors and ListSinks: without credentials a URL may carry.
            servers: servers_shown(&servers),
            violation,
        })
    }
}

impl SinkClient for NatsSink {
    fn kind(&self) -> SinkKind {
        SinkKind::Nats
    }

    fn send(&self, message: SinkMessage) -> BoxFuture<'static, Result<(), SinkFailure>> {
        let (jetstream, violation) = (self.jetstream.clone(), self.violation.clone());
        async move {
            let mut headers = HeaderMap::new();
            for (name, value) in message.headers {
                let name = match name {
                    // The gateway's own names, valid as they are.
                    Cow::Borrowed(name) => Ok(HeaderName::from_static(name)),
                    Cow::Owned(name) => HeaderName::from_str(&name).map_err(|_| name),
                };
                match (name, HeaderValue::try_from(value)) {
                    (Ok(name), Ok(value)) => headers.append(name, value),
                    (Err(name), _) => {
                        return Err(SinkFailure::Permanent(format!(
                            "header {name:?} cannot be carried by NATS"
                        )));
                    }
                    (Ok(name), Err(_)) => {
                        return Err(SinkFailure::Permanent(format!(
                            "the value of header {name} cannot be carried by NATS"
                        )));
                    }
                }
            }
            let subject = message.destination;
            let publish = PublishMessage::build()
                .payload(message.payload.into())
                .headers(headers);
            // The context bounds both the send and the wait for the PubAck by
            // SINK_TIMEOUT.
            let sent = async {
                jetstream
                    .send_publish(subject.clone(), publish)
                    .await?
                    .await
            };
            let error = match sent.await {
                // A duplicate is confirmed too: the stream holds the message already.
                Ok(_ack) => return Ok(()),
                Err(error) => error,
            };
            Err(classify(&jetstream, &violation, &subject, error).await)
        }
        .boxed()
    }

    fn check(&self) -> BoxFuture<'static, Result<(), String>> {
        let (client, servers) = (self.client.clone(), self.servers.clone());
        async move {
            if client.connection_state() != State::Connected {
                return Err(format!("not connected to {servers}"));
            }
            // Any answer of JetStream's account API will do: its shape varies between
            // server versions, and nothing here needs its contents.
            let info = client.request("$JS.API.INFO", bytes::Bytes::new());
            match tokio::time::timeout(CHECK_TIMEOUT, info).await {
                Ok(Ok(answer)) if answer.status.is_none() => Ok(()),
                Ok(Ok(answer)) => Err(format!(
                    "JetStream at {servers} does not answer ({})",
                    answer
                        .description
                        .unwrap_or_else(|| "no responders: is JetStream enabled?".into())
                )),
                Ok(Err(error)) => Err(format!("JetStream at {servers} does not answer: {error}")),
                Err(_) => Err(format!(
                    "JetStream at {servers} did not answer within {CHECK_TIMEOUT:?}"
                )),
            }
        }
        .boxed()
    }
}

fn servers_shown(servers: &[ServerAddr]) -> String {
    servers
        .iter()
        .map(|server| format!("{}://{}:{}", server.scheme(), server.host(), server.port()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Tells a failure that retrying can cure from one it cannot.
async fn classify(
    jetstream: &jetstream::Context,
    violation: &Mutex<Option<(Instant, String)>>,
    subject: &str,
    error: jetstream::context::PublishError,
) -> SinkFailure {
    match error.kind() {
        PublishErrorKind::MaxPayloadExceeded => SinkFailure::Permanent(format!(
            "the message is larger than the NATS server accepts: {error}"
        )),
        // No responder: no stream takes the subject — or JetStream is not up yet after
        // a restart. Asked directly, JetStream tells the two apart.
        PublishErrorKind::StreamNotFound => match jetstream.stream_by_subject(subject).await {
            Err(lookup) if lookup.kind() == GetStreamByNameErrorKind::NotFound => {
                SinkFailure::Permanent(format!("no JetStream stream takes subject {subject:?}"))
            }
            _ => SinkFailure::Transient(format!(
                "JetStream did not answer for subject {subject:?} (starting, or unreachable)"
            )),
        },
        PublishErrorKind::TimedOut => {
            let refused = violation
                .lock()
                .expect("violation lock")
                .as_ref()
                .filter(|(at, message)| {
                    at.elapsed() < crate::sink::SINK_TIMEOUT * 2
                        && message.contains(&format!("\"{subject}\""))
                })
                .map(|(_, message)| message.clone());
            match refused {
                Some(message) => SinkFailure::Permanent(format!("NATS refused: {message}")),
                None => SinkFailure::Transient(format!(
                    "no confirmation from JetStream within {:?}",
                    crate::sink::SINK_TIMEOUT
                )),
            }
        }
        PublishErrorKind::Other => {
            let too_large = std::error::Error::source(&error)
                .and_then(|source| source.downcast_ref::<jetstream::Error>())
                .is_some_and(|refusal| TOO_LARGE_CODES.contains(&refusal.error_code().0));
            if too_large {
                SinkFailure::Permanent(format!("JetStream refused the message: {error}"))
            } else {
                SinkFailure::Transient(format!("JetStream did not store the message: {error}"))
            }
        }
        _ => SinkFailure::Transient(format!("JetStream did not confirm the message: {error}")),
    }
}
