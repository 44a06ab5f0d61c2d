//! Domain types shared by publishing, subscriptions and delivery, with the validation
//! that guards them. Nothing here knows about gRPC or SQL.

mod ack;
mod delivery;
mod event;
mod operations;
mod pattern;
mod subscription;

pub use ack::AckId;
pub use delivery::Delivery;
pub use event::{
    DEFAULT_CONTENT_TYPE, Event, NewEvent, PublishLimits, TRACE_CONTEXT_KEYS, is_json_content_type,
};
pub use operations::{
    DeadLetter, DeadLetterSelection, OutboxStats, SubscriptionPatch, SubscriptionStats,
};
pub use pattern::{EventTypePattern, PatternSet};
pub use subscription::{
    MAX_ACK_DEADLINE, MIN_ACK_DEADLINE, StartPosition, Subscription, SubscriptionName,
    SubscriptionSettings,
};
