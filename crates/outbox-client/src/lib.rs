//! The Rust client of outbox-gateway, a gRPC gateway that relays transactional-outbox
//! events from PostgreSQL to durable, filtered subscriptions.
//!
//! - [`Publisher`] publishes batches atomically; it gives every event an id before the
//!   first try, so a retried call stores each event once.
//! - [`Subscriber`] runs your handler for each delivery with bounded concurrency, acks on
//!   success, nacks on failure, extends the lease of slow handlers, reconnects with
//!   backoff and drains in-flight work on shutdown.
//! - [`Connection`] says where the gateway is and how to reach it: bearer token, TLS (CA
//!   certificate, client certificate and key), timeouts. [`Connection::connect`] yields a
//!   [`GatewayChannel`] with the raw generated stubs, for calls the two types above do
//!   not cover (administration, health checks).
//! - [`proto`] holds the generated types and stubs of the `outbox.v1` API.
//!
//! ```no_run
//! use outbox_client::{Connection, HandlerError, Publisher, Subscriber, proto::EventInput};
//! use tokio_util::sync::CancellationToken;
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
//! let shutdown = CancellationToken::new();
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
//!
//! # Layout
//! - `connection`: [`Connection`], [`GatewayChannel`] and the bearer-token interceptor.
//! - `publisher`: [`Publisher`].
//! - `subscriber`: [`Subscriber`] and [`HandlerError`].
//! - `retry`: which failures are worth retrying, and the one backoff policy.
//! - `error`: [`ClientError`].
//!
//! # Features
//! - `server`: also compiles the gRPC server traits (`proto::*_server`); the gateway
//!   uses them, clients do not need them.
//! - `sqlx`: [`Subscriber::run_exactly_once`], handlers that run inside a transaction of
//!   the consumer's own database, recorded with `outbox_consume` (exactly-once
//!   consumption, see docs/exactly-once.md in the gateway's repository).

#![warn(missing_docs)]

mod connection;
mod error;
mod publisher;
mod retry;
mod subscriber;

pub use connection::{AuthenticatedChannel, BearerToken, Connection, GatewayChannel};
pub use error::ClientError;
pub use publisher::Publisher;
#[cfg(feature = "sqlx")]
pub use subscriber::TransactionFuture;
pub use subscriber::{HandlerError, Subscriber};
/// The tonic the stubs are built on, for its `Status` and `Code` without a second
/// dependency to keep in step.
pub use tonic;
/// The generated health-check API (`grpc.health.v1`) the gateway serves.
pub use tonic_health::pb as health;

/// The README's example, compiled as a doc test.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

/// Generated protobuf types and gRPC stubs of `outbox.v1` (see `proto/outbox/v1/outbox.proto`).
pub mod proto {
    #![allow(missing_docs, clippy::all)]
    tonic::include_proto!("outbox.v1");

    /// Encoded descriptors of `proto/`, for gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/outbox_descriptor.bin"));
}

#[cfg(test)]
mod tests {
    /// docs/api.md shows each message, enum and service with the comment right above it;
    /// one without would stand there undescribed.
    #[test]
    fn every_message_enum_and_service_of_the_proto_is_described() {
        let proto = include_str!("../proto/outbox/v1/outbox.proto");
        let lines: Vec<&str> = proto.lines().collect();
        let undescribed: Vec<&str> = lines
            .iter()
            .enumerate()
            .filter(|(_, line)| {
                ["message ", "enum ", "service "]
                    .iter()
                    .any(|keyword| line.starts_with(keyword))
            })
            .filter(|(index, _)| {
                *index == 0
                    || !lines[index - 1].starts_with("// ")
                    || lines[index - 1].trim() == "//"
            })
            .map(|(_, line)| line.split_whitespace().nth(1).unwrap_or(line))
            .collect();
        assert!(undescribed.is_empty(), "no comment above: {undescribed:?}");
    }
}
