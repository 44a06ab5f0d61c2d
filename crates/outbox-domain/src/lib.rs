//! outbox-domain: the gateway's domain types shared by publishing, subscriptions and
//! delivery, with the validation that guards them and the rules of who may call what.
//!
//! # Layout
//! - Owns: events, subscriptions and their ids and settings, event-type patterns, CEL
//!   filters and transforms, push
//!   configurations and signatures, sink destinations and their templates, sources, ack ids and leases, dead-letter selections
//!   and stats, the [`auth`] rules (tokens, roles, scopes), and [`Refusal`] — why the
//!   domain refuses an input.
//! - May depend on: plain data and parsing crates (serde, chrono, uuid, http types, url,
//!   hashing). Never on sqlx, tokio or tonic: nothing here knows about SQL, tasks or
//!   gRPC, and every layer above can use it.

mod ack;
pub mod auth;
mod delivery;
mod engine;
mod event;
mod expression;
mod input;
mod lease;
mod operations;
mod pattern;
mod push;
mod refusal;
mod sink;
mod source;
mod subscription;

pub use ack::{AckId, AckSeal};
pub use delivery::{DELIVERY_OVERHEAD_BYTES, Delivery};
pub use engine::{EngineFacts, EngineProblem, OLDEST_SUPPORTED_VERSION_NUM};
pub use event::{
    DEFAULT_CONTENT_TYPE, Event, NewEvent, PublishLimits, TRACE_CONTEXT_KEYS, check_event_key,
    is_json_content_type, parse_event_id,
};
pub use expression::{
    EXPRESSION_VARIABLES, EvaluationError, EventFilter, MAX_EXPRESSION_BYTES, PayloadTransform,
};
pub use input::{
    Echo, MAX_FILTER_BYTES, MAX_FILTER_ENTRIES, MAX_JSON_DEPTH, check_filter_size, check_json,
    check_text, check_texts, check_timestamp, earliest_timestamp, latest_timestamp,
};
pub use lease::{LeaseId, LeaseKey};
pub use operations::{
    BEHIND_AFTER, Consumers, DeadLetter, DeadLetterGroup, DeadLetterSelection, DeliveryState,
    EventDeliveries, OutboxStats, StatusKind, SubscriptionPatch, SubscriptionStats,
    SubscriptionStatus,
};
pub use pattern::{EventTypePattern, PatternSet};
pub use push::{
    Allowance, AllowedHosts, DEFAULT_PUSH_BATCH_BYTES, DEFAULT_PUSH_CONCURRENCY,
    DEFAULT_PUSH_TIMEOUT, PushConfig, PushFormat, PushInput, PushSecret, PushStopped, fingerprint,
    webhook_signature,
};
pub use refusal::Refusal;
pub use sink::{DEFAULT_KAFKA_KEY, SinkConfig, SinkInput, SinkKind, Template};
pub use source::{DEFAULT_SOURCE, SourceId, SourceName};
pub use subscription::{
    ATTACHED_HEARTBEAT, MAX_ACK_DEADLINE, MAX_ATTEMPTS, MAX_BACKOFF, MAX_PAUSE_REASON_BYTES,
    MIN_ACK_DEADLINE, MIN_EXPIRE_AFTER_IDLE, Pause, STREAMS_RECORD_LIFETIME, StartPosition,
    Subscription, SubscriptionId, SubscriptionName, SubscriptionSettings, check_expire_after_idle,
};
