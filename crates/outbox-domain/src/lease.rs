//! How leases are named: a claim leases an event to one consumer until its deadline, and
//! the token of that claim tells this lease from an earlier or later one of the same
//! event, so a settlement of a lost lease never touches its successor.

use super::source::SourceId;

/// One lease in one source: the event's position and the token of the claim that leased
/// it (the store's `(position, lease_token)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseId {
    pub position: i64,
    pub token: i64,
}

impl LeaseId {
    /// Where this gateway keeps the lease, when it came from `source`.
    pub fn key_in(self, source: SourceId) -> LeaseKey {
        LeaseKey {
            source,
            position: self.position,
        }
    }
}

/// Where a lease of one subscription lives in this gateway: its source and the event's
/// position there. An event has at most one lease of a subscription at a time, so the key
/// names it until it is settled, expires or is leased anew.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseKey {
    pub source: SourceId,
    pub position: i64,
}

impl LeaseKey {
    /// The lease kept here, named as its source knows it.
    pub fn with_token(self, token: i64) -> LeaseId {
        LeaseId {
            position: self.position,
            token,
        }
    }
}
