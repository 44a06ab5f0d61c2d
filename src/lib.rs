//! outbox-gateway: a gRPC gateway for the transactional outbox pattern on PostgreSQL.
//!
//! Services publish events in the same transaction as their business change — through
//! the `Publish` RPC or by inserting into the outbox table — and the gateway relays every
//! committed event to durable, filtered subscriptions that consumers read over a
//! server-streaming `Subscribe` RPC and settle with `Ack` / `Nack`.
//!
//! # Layout
//! This package holds the transports and the wiring; what the gateway does lives in the
//! crates under `crates/`, and dependencies point one way:
//!
//! ```text
//! outbox-gateway (api, console, config, server) ──► outbox-core ──► outbox-store ──► outbox-domain
//!        │                                                  └───────────────────────────┘
//!        └──► outbox-cli ──► outbox-client
//! ```
//!
//! Here:
//! - [`config`]: layered settings (flags, environment, TOML file, defaults), turned into
//!   the settings structs the crates below define.
//! - [`api`]: thin gRPC adapters, authentication and the one error-to-status mapping.
//! - [`console`]: the web console, an HTTP adapter over the same core operations.
//! - [`push_client`]: the HTTP client push requests go out through.
//! - [`sinks`]: the broker connections (`[[sinks]]`) sink subscriptions publish into.
//! - [`connections`]: closing client connections that send nothing.
//! - [`local_database`]: the private PostgreSQL a gateway given no database runs itself.
//! - [`telemetry`]: logs, the trace exporter, the per-RPC layer.
//! - [`metrics_endpoint`]: the Prometheus exporter and the RPC metrics.
//! - [`server`]: wires it all together and serves until shutdown ([`run`]).
//!
//! Re-exported under the paths they always had:
//! - from `outbox-domain`: [`domain`] (events, subscriptions, patterns, ack ids and their
//!   validation) and [`auth`] (bearer tokens, roles and their scopes);
//! - from `outbox-store`: [`storage`] (every SQL statement, the pool and the migrations);
//! - from `outbox-core`: [`publish`], [`subscriptions`], [`operations`], [`sources`],
//!   [`maintenance`], [`delivery`] (the relay), [`push`] (push scheduling), [`sink`] (sink
//!   scheduling), [`drain`], [`rates`],
//!   [`audit`], [`tasks`], [`metrics`], [`trace_context`] and the core [`error`];
//! - from `outbox-cli`: [`cli`], the binary's client subcommands;
//! - from `outbox-client`: [`proto`], the generated API types.

pub mod api;
pub mod config;
pub mod connections;
pub mod console;
pub mod local_database;
pub mod metrics_endpoint;
pub mod push_client;
pub mod server;
pub mod sinks;
pub mod telemetry;

pub use config::Config;
pub use outbox_cli as cli;
pub use outbox_core::{
    audit, delivery, domain, drain, error, maintenance, metrics, operations, publish, push, rates,
    sink, sources, storage, streams, subscriptions, tasks, trace_context,
};
pub use outbox_domain::auth;
pub use server::{RunError, run, run_with_console};

/// Generated protobuf types and gRPC stubs of `outbox.v1`: one copy, in the client crate.
pub use outbox_client::proto;
