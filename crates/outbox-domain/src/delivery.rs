//! A delivery: one lease of one event to one subscription.

use chrono::{DateTime, Utc};

use super::{AckId, Event};

/// Bytes counted for a delivery beyond its payload: ids, types, metadata and framing,
/// roughly. The claim statements use the same allowance.
pub const DELIVERY_OVERHEAD_BYTES: u64 = 256;

#[derive(Debug, Clone, PartialEq)]
pub struct Delivery {
    pub ack_id: AckId,
    /// 1 for the first delivery of the event to this subscription.
    pub attempt: u32,
    /// When the lease ends unless acked or extended.
    pub ack_deadline: DateTime<Utc>,
    pub event: Event,
}

impl Delivery {
    /// What flow control counts for this delivery: its payload and a fixed allowance.
    pub fn size(&self) -> u64 {
        Delivery::size_of_payload(self.event.payload.len())
    }

    /// What flow control counts for a delivery whose payload is `payload_bytes` long.
    pub fn size_of_payload(payload_bytes: usize) -> u64 {
        payload_bytes as u64 + DELIVERY_OVERHEAD_BYTES
    }
}
