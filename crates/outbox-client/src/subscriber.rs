//! [`Subscriber`]: runs a handler for each delivery of a subscription.

use std::{future::Future, sync::Arc, time::Duration};

use tokio::{
    sync::{OwnedSemaphorePermit, Semaphore, mpsc},
    task::JoinSet,
};
use tokio_util::sync::CancellationToken;

use crate::{
    AuthenticatedChannel, ClientError, Connection, GatewayChannel,
    proto::{self, subscriber_client::SubscriberClient},
    retry::{Reconnect, is_transient},
};

/// Acks are sent in batches of at most this many, at least every `ACK_FLUSH_INTERVAL`.
const ACK_BATCH: usize = 500;
const ACK_FLUSH_INTERVAL: Duration = Duration::from_millis(10);

/// How a delivery whose handler succeeded is settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settle {
    /// The subscriber acks it.
    ByAck,
    /// The handler's transaction recorded it with `outbox_consume`; the gateway settles it
    /// when that commits.
    #[cfg(feature = "sqlx")]
    ByCommit,
}

/// The future a [`Subscriber::run_exactly_once`] handler returns: it may borrow the
/// connection of the consuming transaction.
#[cfg(feature = "sqlx")]
pub type TransactionFuture<'c> =
    std::pin::Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send + 'c>>;

/// A database failure of the consuming transaction. `outbox_consume` refusing the
/// arguments (SQLSTATE 22023: an ack id of a deleted subscription, say) cannot pass;
/// anything else (a lost connection, a serialization failure) may.
#[cfg(feature = "sqlx")]
fn database_error(error: sqlx::Error) -> HandlerError {
    let refused = error
        .as_database_error()
        .and_then(|error| error.code())
        .is_some_and(|code| code == "22023");
    if refused {
        HandlerError::permanent(error.to_string())
    } else {
        HandlerError::transient(error.to_string())
    }
}

/// Why a handler failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandlerError {
    /// Recorded with the delivery, and shown with the dead letter.
    pub reason: String,
    /// Retrying cannot help: send the event to the dead-letter queue now.
    pub permanent: bool,
    /// Retry after this delay instead of the subscription's backoff.
    pub retry_after: Option<Duration>,
}

impl HandlerError {
    /// A failure that may pass: the event comes back after the subscription's backoff.
    pub fn transient(reason: impl Into<String>) -> Self {
        HandlerError {
            reason: reason.into(),
            permanent: false,
            retry_after: None,
        }
    }

    /// A failure no retry can fix: the event goes to the dead-letter queue.
    pub fn permanent(reason: impl Into<String>) -> Self {
        HandlerError {
            reason: reason.into(),
            permanent: true,
            retry_after: None,
        }
    }
}

/// Consumes a subscription with a handler.
///
/// ```no_run
/// use outbox_client::{Connection, HandlerError, Subscriber};
/// use tokio_util::sync::CancellationToken;
///
/// # async fn example() -> Result<(), outbox_client::ClientError> {
/// let shutdown = CancellationToken::new();
/// Subscriber::new(Connection::new("http://127.0.0.1:50051"), "billing")
///     .run(
///         |delivery| async move {
///             let event = delivery.event.unwrap_or_default();
///             println!("{} {}", event.event_type, event.id);
///             Ok::<(), HandlerError>(())
///         },
///         shutdown,
///     )
///     .await
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Subscriber {
    connection: Connection,
    subscription: String,
    concurrency: usize,
    max_in_flight: u32,
}

impl Subscriber {
    /// Reads `subscription` through `connection`, 16 handlers at a time.
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
    /// subscription, a missing permission) and for invalid connection settings.
    pub async fn run<H, F>(
        &self,
        handler: H,
        shutdown: CancellationToken,
    ) -> Result<(), ClientError>
    where
        H: Fn(proto::Delivery) -> F + Send + Sync + 'static,
        F: Future<Output = Result<(), HandlerError>> + Send + 'static,
    {
        self.run_settling(handler, Settle::ByAck, shutdown).await
    }

    /// Runs `handler` for each delivery inside a transaction of `pool`'s database, which
    /// must be one of the gateway's sources: the transaction first records the delivery
    /// with `outbox_consume`, then runs the handler (unless a committed transaction
    /// consumed the event before: then the handler is skipped) and commits. What the
    /// handler writes with the connection it is given — its side effects, events it
    /// publishes with `outbox_publish` — therefore happens exactly once per event, and
    /// the gateway settles the delivery when the transaction commits: no ack is sent.
    /// A handler error rolls the transaction back and nacks, as with [`Subscriber::run`].
    ///
    /// ```no_run
    /// use outbox_client::{Connection, HandlerError, Subscriber};
    /// use tokio_util::sync::CancellationToken;
    ///
    /// # async fn example(pool: sqlx::PgPool) -> Result<(), outbox_client::ClientError> {
    /// Subscriber::new(Connection::new("http://127.0.0.1:50051"), "shipping")
    ///     .run_exactly_once(
    ///         pool,
    ///         |delivery, connection| {
    ///             Box::pin(async move {
    ///                 let event = delivery.event.unwrap_or_default();
    ///                 sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)")
    ///                     .bind(&event.aggregate_id)
    ///                     .execute(&mut *connection)
    ///                     .await
    ///                     .map_err(|error| HandlerError::transient(error.to_string()))?;
    ///                 Ok(())
    ///             })
    ///         },
    ///         CancellationToken::new(),
    ///     )
    ///     .await
    /// # }
    /// ```
    #[cfg(feature = "sqlx")]
    pub async fn run_exactly_once<H>(
        &self,
        pool: sqlx::PgPool,
        handler: H,
        shutdown: CancellationToken,
    ) -> Result<(), ClientError>
    where
        H: for<'c> Fn(proto::Delivery, &'c mut sqlx::PgConnection) -> TransactionFuture<'c>
            + Send
            + Sync
            + 'static,
    {
        let handler = Arc::new(handler);
        let subscription = self.subscription.clone();
        let in_transaction = move |delivery: proto::Delivery| {
            let (pool, handler, subscription) =
                (pool.clone(), handler.clone(), subscription.clone());
            async move {
                let mut transaction = pool.begin().await.map_err(database_error)?;
                let first: bool = sqlx::query_scalar("SELECT outbox_consume($1, $2)")
                    .bind(&subscription)
                    .bind(&delivery.ack_id)
                    .fetch_one(&mut *transaction)
                    .await
                    .map_err(database_error)?;
                if first {
                    // An error drops the transaction: rolled back.
                    handler(delivery, &mut transaction).await?;
                }
                transaction.commit().await.map_err(database_error)
            }
        };
        self.run_settling(in_transaction, Settle::ByCommit, shutdown)
            .await
    }

    async fn run_settling<H, F>(
        &self,
        handler: H,
        settle: Settle,
        shutdown: CancellationToken,
    ) -> Result<(), ClientError>
    where
        H: Fn(proto::Delivery) -> F + Send + Sync + 'static,
        F: Future<Output = Result<(), HandlerError>> + Send + 'static,
    {
        let channel = self.connection.connect_lazy()?;
        let handler = Arc::new(handler);
        let permits = Arc::new(Semaphore::new(self.concurrency));
        let (acks, ack_queue) = mpsc::channel::<String>(ACK_BATCH * 4);
        let acker = tokio::spawn(send_acks(
            channel.subscriber(),
            self.subscription.clone(),
            ack_queue,
        ));
        let mut handlers = JoinSet::new();
        let max_in_flight = match self.max_in_flight {
            0 => (self.concurrency * 2) as u32,
            n => n,
        };
        let mut reconnect = Reconnect::new();
        // The stream open at shutdown stays open until the running handlers' acks are
        // sent: closing it gives its leases back, and an ack after that is stale.
        let mut open_at_shutdown = None;
        let result = loop {
            let request = proto::SubscribeRequest {
                subscription: self.subscription.clone(),
                max_in_flight,
                ..Default::default()
            };
            let mut client = channel.subscriber();
            let opened = tokio::select! {
                opened = client.subscribe(request) => opened,
                _ = shutdown.cancelled() => break Ok(()),
            };
            match opened {
                Ok(response) => {
                    let mut stream = response.into_inner();
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
                        reconnect.reset();
                        // Waiting for a free handler ends at shutdown too: a handler must
                        // not start after it, and the stream gives this delivery back.
                        let permit = tokio::select! {
                            permit = permits.clone().acquire_owned() => permit.expect("never closed"),
                            _ = shutdown.cancelled() => break,
                        };
                        handlers.spawn(handle(
                            handler.clone(),
                            delivery,
                            channel.clone(),
                            self.subscription.clone(),
                            (settle == Settle::ByAck).then(|| acks.clone()),
                            permit,
                        ));
                        // Reap finished handlers so the set stays small.
                        while handlers.try_join_next().is_some() {}
                    }
                    if shutdown.is_cancelled() {
                        open_at_shutdown = Some(stream);
                        break Ok(());
                    }
                }
                Err(status) if !is_transient(&status) => break Err(ClientError::Refused(status)),
                Err(status) => tracing::debug!(%status, "cannot subscribe yet"),
            }
            let delay = reconnect.next_delay();
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = shutdown.cancelled() => break Ok(()),
            }
        };
        // Drain: running handlers finish and their acks go out; then the stream closes
        // and gives back what was never handled.
        while handlers.join_next().await.is_some() {}
        drop(acks);
        let _ = acker.await;
        drop(open_at_shutdown);
        result
    }
}

async fn handle<H, F>(
    handler: Arc<H>,
    delivery: proto::Delivery,
    channel: GatewayChannel,
    subscription: String,
    // `None`: a success is settled by the handler's commit, not by an ack.
    acks: Option<mpsc::Sender<String>>,
    _permit: OwnedSemaphorePermit,
) where
    H: Fn(proto::Delivery) -> F + Send + Sync + 'static,
    F: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    let mut client = channel.subscriber();
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
            if let Some(acks) = acks {
                let _ = acks.send(ack_id).await;
            }
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
