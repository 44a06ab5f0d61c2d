//! outbox-core: what the gateway does, whatever carries the calls — publishing, the
//! relay, subscriptions, operations and maintenance — on the domain and the store.
//!
//! # Layout
//! - [`publish`]: idempotent, atomic batch publishing.
//! - [`subscriptions`]: creating, changing, seeking and deleting subscriptions.
//! - [`operations`]: requeues, dead-letter triage and delivery stats.
//! - [`sources`]: the source databases relayed from, and whether each is reachable.
//! - [`maintenance`]: lease reclaim and retention on a timer.
//! - [`delivery`]: the relay — per-subscription dispatchers, leases, wake-ups.
//! - [`push`]: push scheduling — pushers that drain the relay into signed requests
//!   (CloudEvents, Standard Webhooks), sent through a [`push::PushSender`] the gateway
//!   provides.
//! - [`sink`]: sinkers that drain the relay into brokers (NATS JetStream, Kafka)
//!   through the [`sink::SinkClient`]s the gateway provides.
//! - [`drain`]: what pushers and sinkers share — one per subscription, its status.
//! - [`rates`]: delivery and ack rates over the last 15 minutes.
//! - [`streams`]: the record of the Subscribe streams each gateway holds, by which
//!   every replica tells a subscription with no consumer anywhere.
//! - [`audit`]: the audit trail of administrators' changes.
//! - [`tasks`]: long-lived background tasks restarted after a panic, loudly.
//! - [`metrics`]: metric names and the calls that record them (the `metrics` facade;
//!   the exporter is the gateway's).
//! - [`trace_context`]: W3C trace context carried by calls and events.
//! - [`error`]: the core error, wrapping the domain's refusals and the store's errors.
//! - [`domain`] and [`storage`]: the `outbox-domain` and `outbox-store` crates,
//!   re-exported so the core and the transports above it name them one way.
//!
//! May depend on: `outbox-domain`, `outbox-store`, tokio and the tracing/metrics
//! facades. Never on a transport or the command line: no tonic, axum, hyper, maud or
//! clap — the gRPC API, the console, the push HTTP client, the broker clients and the configuration sit
//! above, in the `outbox-gateway` package.

pub use outbox_domain as domain;
pub use outbox_store as storage;

pub mod audit;
pub mod delivery;
pub mod drain;
pub mod error;
pub mod maintenance;
pub mod metrics;
pub mod operations;
pub mod publish;
pub mod push;
pub mod rates;
pub mod sink;
pub mod sources;
pub mod streams;
pub mod subscriptions;
pub mod tasks;
pub mod trace_context;
