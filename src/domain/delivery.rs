//! A delivery: one lease of one event to one subscription.

use chrono::{DateTime, Utc};

use super::{AckId, Event};

#[derive(Debug, Clone, PartialEq)]
pub struct Delivery {
    pub ack_id: AckId,
    /// 1 for the first delivery of the event to this subscription.
    pub attempt: u32,
    /// When the lease ends unless acked or extended.
    pub ack_deadline: DateTime<Utc>,
    pub event: Event,
}
