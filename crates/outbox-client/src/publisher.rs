//! [`Publisher`]: idempotent, retried publishing.

use backon::Retryable;

use crate::{
    ClientError, Connection, GatewayChannel,
    proto::{self, PublishResult},
    retry::{backoff, is_transient},
};

/// Publishes events; a retried call re-sends the same event ids, so the gateway stores
/// each event once however often a call is retried.
///
/// ```no_run
/// use outbox_client::{Connection, Publisher, proto::EventInput};
///
/// # async fn example() -> Result<(), outbox_client::ClientError> {
/// let publisher = Publisher::new(Connection::new("http://127.0.0.1:50051")).max_attempts(3);
/// let results = publisher
///     .publish(vec![EventInput {
///         aggregate_type: "order".into(),
///         aggregate_id: "o-42".into(),
///         event_type: "order.created".into(),
///         payload: br#"{"total": 42}"#.to_vec(),
///         ..Default::default()
///     }])
///     .await?;
/// println!("stored {} (duplicate: {})", results[0].id, results[0].duplicate);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Publisher {
    connection: Connection,
    /// One channel for every call, connected lazily (so `new` must run inside the Tokio
    /// runtime); `None` when the connection settings are invalid, which `publish` reports.
    channel: Option<GatewayChannel>,
    max_attempts: u32,
    /// The source (database) events go to; empty: the gateway's own.
    source: String,
}

impl Publisher {
    /// A publisher over `connection`, trying each call up to 5 times.
    pub fn new(connection: Connection) -> Self {
        Publisher {
            channel: connection.connect_lazy().ok(),
            connection,
            max_attempts: 5,
            source: String::new(),
        }
    }

    /// Publishes to this source (database) of the gateway instead of its own (`default`).
    pub fn source(mut self, source: impl Into<String>) -> Self {
        self.source = source.into();
        self
    }

    /// How many times a call is tried when the gateway is unavailable (default 5).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// Publishes the batch atomically; events without an id get one first.
    pub async fn publish(
        &self,
        mut events: Vec<proto::EventInput>,
    ) -> Result<Vec<PublishResult>, ClientError> {
        for event in &mut events {
            if event.id.is_empty() {
                event.id = uuid::Uuid::now_v7().to_string();
            }
        }
        let channel = match &self.channel {
            Some(channel) => channel.clone(),
            None => self.connection.connect_lazy()?,
        };
        let call = || {
            let mut publisher = channel.publisher();
            let request = proto::PublishRequest {
                events: events.clone(),
                source: self.source.clone(),
            };
            async move { publisher.publish(request).await }
        };
        let retries = self.max_attempts as usize - 1;
        match call.retry(backoff(Some(retries))).when(is_transient).await {
            Ok(response) => Ok(response.into_inner().results),
            Err(status) if is_transient(&status) => Err(ClientError::Unavailable(status)),
            Err(status) => Err(ClientError::Refused(status)),
        }
    }
}
