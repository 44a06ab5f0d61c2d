//! Ack calls of one subscription that arrive while one is being applied wait and are
//! then applied together, in one statement (group commit for acks).
//!
//! A claim's leases share one row of `outbox_delivery_batches`, so two acks of one claim
//! change the same row: applied side by side, each would wait for the other's commit to
//! be flushed, and a consumer acking one event per call would get one commit per flush.
//! Combined, one statement settles whatever accumulated meanwhile, with one write per
//! row touched. Each call is still answered only once its own acks are durable.
//!
//! The statement runs on a task of its own, so a caller that goes away (its RPC was
//! cancelled) never cuts short the acks of the others.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use tokio::sync::oneshot;

use super::{Result, Store, StoreError};
use outbox_domain::{AckId, Subscription, SubscriptionId};

type Answer = oneshot::Sender<Result<Vec<AckId>, Arc<StoreError>>>;

/// The ack groups of one database, by subscription.
#[derive(Debug, Default)]
pub(crate) struct AckGroups {
    subscriptions: Mutex<HashMap<SubscriptionId, Arc<Mutex<Group>>>>,
}

#[derive(Debug, Default)]
struct Group {
    waiting: Vec<(Vec<AckId>, Answer)>,
    /// A task is applying acks of this subscription; it takes what waits when done.
    applying: bool,
}

impl Store {
    /// Acks deliveries; returns the ack ids that settled a lease (the rest were stale).
    /// Concurrent calls for one subscription are applied together.
    pub async fn ack(&self, subscription: &Subscription, acks: &[AckId]) -> Result<Vec<AckId>> {
        let group = self
            .ack_groups
            .subscriptions
            .lock()
            .expect("ack groups")
            .entry(subscription.id)
            .or_default()
            .clone();
        let (answer, answered) = oneshot::channel();
        let start = {
            let mut waiting = group.lock().expect("ack group");
            waiting.waiting.push((acks.to_vec(), answer));
            !std::mem::replace(&mut waiting.applying, true)
        };
        if start {
            tokio::spawn(apply_while_waiting(
                self.clone(),
                subscription.clone(),
                group,
            ));
        }
        match answered.await {
            Ok(answer) => answer.map_err(StoreError::Shared),
            Err(_) => Err(StoreError::Corrupt(
                "the task applying acks ended without an answer".into(),
            )),
        }
    }
}

/// Applies the group's waiting acks, one statement per round, until none wait. The
/// rounds share one connection, given back when none wait: the pool takes a connection
/// back with a round trip of its own (sqlx pings it), which would double each round's.
async fn apply_while_waiting(store: Store, subscription: Subscription, group: Arc<Mutex<Group>>) {
    let mut connection = None;
    loop {
        let callers = {
            let mut waiting = group.lock().expect("ack group");
            if waiting.waiting.is_empty() {
                waiting.applying = false;
                return;
            }
            std::mem::take(&mut waiting.waiting)
        };
        let all: Vec<AckId> = callers
            .iter()
            .flat_map(|(acks, _)| acks.iter().copied())
            .collect();
        match store
            .ack_together(&mut connection, &subscription, &all)
            .await
        {
            Ok(acked) => {
                // An ack id named by two callers settled one lease: the first one named it.
                let mut unclaimed: foldhash::HashSet<AckId> = acked.into_iter().collect();
                for (acks, answer) in callers {
                    let theirs = acks
                        .into_iter()
                        .filter(|ack| unclaimed.remove(ack))
                        .collect();
                    let _ = answer.send(Ok(theirs));
                }
            }
            Err(error) => {
                let error = Arc::new(error);
                for (_, answer) in callers {
                    let _ = answer.send(Err(error.clone()));
                }
            }
        }
    }
}
