//! A Rust client for the gateway: a [`Publisher`] whose retries are idempotent, and a
//! [`Subscriber`] that runs your handler for each delivery with bounded concurrency,
//! acks on success, nacks on failure, extends the lease of slow handlers, reconnects
//! with backoff and drains in-flight work on shutdown.
//!
//! ```no_run
//! use outbox_gateway::client::{Connection, HandlerError, Publisher, Subscriber};
//! use outbox_gateway::proto::EventInput;
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let connection = Connection::new("http://127.0.0.1:50051").token("s3cret");
//! let publisher = Publisher::new(connection.clone());
//! publisher
//!     .publish(vec![EventInput {
//!         aggregate_type: "order".into(),
//!         aggregate_id: "o-42".into(),
//!         event_type: "order.created".into(),
//!         payload: br#"{"total": 42}"#.to_vec(),
//!         ..Default::default()
//!     }])
//!     .await?;
//!
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! Subscriber::new(connection, "billing")
//!     .concurrency(8)
//!     .run(
//!         |delivery| async move {
//!             let event = delivery.event.unwrap_or_default();
//!             if event.payload.is_empty() {
//!                 return Err(HandlerError::permanent("empty payload"));
//!             }
//!             println!("{} {}", event.event_type, event.id);
//!             Ok(())
//!         },
//!         shutdown.clone(),
//!     )
//!     .await?;
//! # Ok(())
//! # }
//! ```

use std::{future::Future, sync::Arc, time::Duration};

use tokio::{
    sync::{Semaphore, mpsc},
    task::JoinSet,
};
use tokio_util::sync::CancellationToken;
use tonic::{
    Code, Request, Status,
    metadata::{Ascii, MetadataValue},
    service::{Interceptor, interceptor::InterceptedService},
    transport::{Channel, Endpoint},
};

use crate::proto::{self, publisher_client::PublisherClient, subscriber_client::SubscriberClient};

const RETRY_FIRST_DELAY: Duration = Duration::from_millis(100);
const RETRY_MAX_DELAY: Duration = Duration::from_secs(10);
/// Acks are sent in batches of at most this many, at least every `ACK_FLUSH_INTERVAL`.
const ACK_BATCH: usize = 500;
const ACK_FLUSH_INTERVAL: Duration = Duration::from_millis(10);

/// Where the gateway is and how to authenticate. Cheap to clone; connects lazily.
#[derive(Debug, Clone)]
pub struct Connection {
    endpoint: String,
    token: Option<String>,
}

impl Connection {
    pub fn new(endpoint: impl Into<String>) -> Self {
        Connection {
            endpoint: endpoint.into(),
            token: None,
        }
    }

    /// Sends `authorization: Bearer <token>` with every call.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    fn channel(&self) -> Result<AuthenticatedChannel, ClientError> {
        let channel = Endpoint::from_shared(self.endpoint.clone())
            .map_err(|error| ClientError::Config(format!("invalid endpoint: {error}")))?
            .connect_timeout(Duration::from_secs(5))
            .connect_lazy();
        let token = self
            .token
            .as_ref()
            .map(|token| format!("Bearer {token}").parse())
            .transpose()
            .map_err(|_| ClientError::Config("the token must be printable ASCII".into()))?;
        Ok(InterceptedService::new(channel, AddToken(token)))
    }
}

type AuthenticatedChannel = InterceptedService<Channel, AddToken>;

#[derive(Debug, Clone)]
struct AddToken(Option<MetadataValue<Ascii>>);

impl Interceptor for AddToken {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(token) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", token.clone());
        }
        Ok(request)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{0}")]
    Config(String),
    /// The gateway refused the call; retrying the same call will not help.
    #[error("the gateway refused the call: {0}")]
    Refused(Status),
    /// Still failing after the retries the caller allowed.
    #[error("the gateway stayed unavailable: {0}")]
    Unavailable(Status),
}

/// Calls worth retrying: the gateway or its database may come back. A connection cut
/// mid-call surfaces as UNKNOWN or CANCELLED too.
fn is_transient(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable
            | Code::ResourceExhausted
            | Code::DeadlineExceeded
            | Code::Aborted
            | Code::Unknown
            | Code::Cancelled
    )
}

/// Publishes events; a retried call re-sends the same event ids, so the gateway stores
/// each event once however often a call is retried.
#[derive(Debug, Clone)]
pub struct Publisher {
    /// One connection for every call (created lazily, so `new` must run inside the Tokio
    /// runtime); an invalid endpoint is reported by `publish`.
    client: Result<PublisherClient<AuthenticatedChannel>, String>,
    max_attempts: u32,
}

impl Publisher {
    pub fn new(connection: Connection) -> Self {
        Publisher {
            client: connection
                .channel()
                .map(PublisherClient::new)
                .map_err(|error| error.to_string()),
            max_attempts: 5,
        }
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
    ) -> Result<Vec<proto::PublishResult>, ClientError> {
        for event in &mut events {
            if event.id.is_empty() {
                event.id = uuid::Uuid::now_v7().to_string();
            }
        }
        let mut client = self.client.clone().map_err(ClientError::Config)?;
        let mut delay = RETRY_FIRST_DELAY;
        let mut attempt = 1;
        loop {
            let request = proto::PublishRequest {
                events: events.clone(),
            };
            match client.publish(request).await {
                Ok(response) => return Ok(response.into_inner().results),
                Err(status) if !is_transient(&status) => return Err(ClientError::Refused(status)),
                Err(status) if attempt >= self.max_attempts => {
                    return Err(ClientError::Unavailable(status));
                }
                Err(_) => {
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(RETRY_MAX_DELAY);
                    attempt += 1;
                }
            }
        }
    }
}

/// Why a handler failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandlerError {
    pub reason: String,
    /// Retrying cannot help: send the event to the dead-letter queue now.
    pub permanent: bool,
    /// Retry after this delay instead of the subscription's backoff.
    pub retry_after: Option<Duration>,
}

impl HandlerError {
    pub fn transient(reason: impl Into<String>) -> Self {
        HandlerError {
            reason: reason.into(),
            permanent: false,
            retry_after: None,
        }
    }

    pub fn permanent(reason: impl Into<String>) -> Self {
        HandlerError {
            reason: reason.into(),
            permanent: true,
            retry_after: None,
        }
    }
}

/// Consumes a subscription with a handler.
#[derive(Debug, Clone)]
pub struct Subscriber {
    connection: Connection,
    subscription: String,
    concurrency: usize,
    max_in_flight: u32,
}

impl Subscriber {
    pub fn new(connection: Connection, subscription: impl Into<String>) -> Self {
        Subscriber {
            connection,
            subscription: subscription.into(),
            concurrency: 16,
            max_in_flight: 0,
        }
    }

    /// Handlers running at once (default 16).
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency.max(1);
        self
    }

    /// Deliveries the stream may hold (default: twice the concurrency).
    pub fn max_in_flight(mut self, max_in_flight: u32) -> Self {
        self.max_in_flight = max_in_flight;
        self
    }

    /// Runs until `shutdown`, then stops taking deliveries, lets running handlers finish
    /// and sends their acks. Reconnects with backoff when the stream or the gateway goes
    /// away; returns an error only for refusals that retrying cannot fix (an unknown
    /// subscription, a missing permission).
    pub async fn run<H, F>(
        &self,
        handler: H,
        shutdown: CancellationToken,
    ) -> Result<(), ClientError>
    where
        H: Fn(proto::Delivery) -> F + Send + Sync + 'static,
        F: Future<Output = Result<(), HandlerError>> + Send + 'static,
    {
        let channel = self.connection.channel()?;
        let handler = Arc::new(handler);
        let permits = Arc::new(Semaphore::new(self.concurrency));
        let (acks, ack_queue) = mpsc::channel::<String>(ACK_BATCH * 4);
        let acker = tokio::spawn(send_acks(
            SubscriberClient::new(channel.clone()),
            self.subscription.clone(),
            ack_queue,
        ));
        let mut handlers = JoinSet::new();
        let max_in_flight = match self.max_in_flight {
            0 => (self.concurrency * 2) as u32,
            n => n,
        };
        let mut delay = RETRY_FIRST_DELAY;
        let result = loop {
            let mut client = SubscriberClient::new(channel.clone());
            let request = proto::SubscribeRequest {
                subscription: self.subscription.clone(),
                max_in_flight,
                ..Default::default()
            };
            let opened = tokio::select! {
                opened = client.subscribe(request) => opened,
                _ = shutdown.cancelled() => break Ok(()),
            };
            let mut stream = match opened {
                Ok(response) => response.into_inner(),
                Err(status) if !is_transient(&status) => break Err(ClientError::Refused(status)),
                Err(status) => {
                    tracing::debug!(%status, retry_in = ?delay, "cannot subscribe yet");
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = shutdown.cancelled() => break Ok(()),
                    }
                    delay = (delay * 2).min(RETRY_MAX_DELAY);
                    continue;
                }
            };
            loop {
                let message = tokio::select! {
                    message = stream.message() => message,
                    _ = shutdown.cancelled() => break,
                };
                let delivery = match message {
                    Ok(Some(delivery)) => delivery,
                    Ok(None) => break,
                    Err(status) => {
                        tracing::debug!(%status, "delivery stream ended");
                        break;
                    }
                };
                delay = RETRY_FIRST_DELAY;
                let permit = permits.clone().acquire_owned().await.expect("never closed");
                handlers.spawn(handle(
                    handler.clone(),
                    delivery,
                    SubscriberClient::new(channel.clone()),
                    self.subscription.clone(),
                    acks.clone(),
                    permit,
                ));
                // Reap finished handlers so the set stays small.
                while handlers.try_join_next().is_some() {}
            }
            if shutdown.is_cancelled() {
                break Ok(());
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(RETRY_MAX_DELAY);
        };
        // Drain: running handlers finish and their acks go out.
        while handlers.join_next().await.is_some() {}
        drop(acks);
        let _ = acker.await;
        result
    }
}

async fn handle<H, F>(
    handler: Arc<H>,
    delivery: proto::Delivery,
    mut client: SubscriberClient<AuthenticatedChannel>,
    subscription: String,
    acks: mpsc::Sender<String>,
    _permit: tokio::sync::OwnedSemaphorePermit,
) where
    H: Fn(proto::Delivery) -> F + Send + Sync + 'static,
    F: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    let ack_id = delivery.ack_id.clone();
    let lease = lease_length(&delivery);
    let work = handler(delivery);
    tokio::pin!(work);
    // Extend the lease at half its length for as long as the handler runs.
    let mut extend = tokio::time::interval_at(tokio::time::Instant::now() + lease / 2, lease / 2);
    let outcome = loop {
        tokio::select! {
            outcome = &mut work => break outcome,
            _ = extend.tick() => {
                let request = proto::ExtendAckDeadlineRequest {
                    subscription: subscription.clone(),
                    ack_ids: vec![ack_id.clone()],
                    extension: prost_types::Duration::try_from(lease).ok(),
                };
                if let Err(status) = client.extend_ack_deadline(request).await {
                    tracing::debug!(%status, "could not extend a lease");
                }
            }
        }
    };
    match outcome {
        Ok(()) => {
            let _ = acks.send(ack_id).await;
        }
        Err(error) => {
            let request = proto::NackRequest {
                subscription,
                ack_id,
                reason: error.reason,
                retry_after: error
                    .retry_after
                    .and_then(|delay| prost_types::Duration::try_from(delay).ok()),
                dead_letter: error.permanent,
            };
            if let Err(status) = client.nack(request).await {
                // The lease runs out and the event comes back anyway.
                tracing::debug!(%status, "could not nack");
            }
        }
    }
}

/// The lease length of a delivery, as granted (at least one second).
fn lease_length(delivery: &proto::Delivery) -> Duration {
    let deadline = delivery
        .ack_deadline
        .and_then(|t| std::time::SystemTime::try_from(t).ok())
        .and_then(|deadline| deadline.duration_since(std::time::SystemTime::now()).ok())
        .unwrap_or(Duration::from_secs(30));
    deadline.max(Duration::from_secs(1))
}

/// Sends acks in batches until every sender is gone.
async fn send_acks(
    mut client: SubscriberClient<AuthenticatedChannel>,
    subscription: String,
    mut queue: mpsc::Receiver<String>,
) {
    let mut batch = Vec::with_capacity(ACK_BATCH);
    loop {
        let Some(first) = queue.recv().await else {
            return;
        };
        batch.push(first);
        let flush_at = tokio::time::Instant::now() + ACK_FLUSH_INTERVAL;
        while batch.len() < ACK_BATCH {
            match tokio::time::timeout_at(flush_at, queue.recv()).await {
                Ok(Some(ack_id)) => batch.push(ack_id),
                _ => break,
            }
        }
        let request = proto::AckRequest {
            subscription: subscription.clone(),
            ack_ids: std::mem::take(&mut batch),
        };
        if let Err(status) = client.ack(request).await {
            // Unacked deliveries come back after their deadline: at least once holds.
            tracing::warn!(%status, "could not send acks");
        }
    }
}
