//! Publishing: validates a batch, stores it atomically and idempotently, wakes the relay.

use std::collections::HashMap;

use uuid::Uuid;

use crate::{
    delivery::Relay,
    domain::{NewEvent, PublishLimits},
    error::{Error, Result},
    storage::Store,
};

/// What became of one published event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    pub id: Uuid,
    /// An identical event with this id was already stored.
    pub duplicate: bool,
}

#[derive(Clone)]
pub struct Publisher {
    store: Store,
    relay: Relay,
    limits: PublishLimits,
}

impl Publisher {
    pub fn new(store: Store, relay: Relay, limits: PublishLimits) -> Self {
        Publisher {
            store,
            relay,
            limits,
        }
    }

    /// Stores the batch in one transaction: all of it, or nothing when any event is
    /// invalid or conflicts with a stored event of the same id.
    pub async fn publish(&self, mut events: Vec<NewEvent>) -> Result<Vec<Published>> {
        if events.is_empty() {
            return Err(Error::invalid("events", "must contain at least one event"));
        }
        if events.len() > self.limits.max_batch_events {
            return Err(Error::invalid(
                "events",
                format!(
                    "has {} events, more than the limit of {}",
                    events.len(),
                    self.limits.max_batch_events
                ),
            ));
        }
        for (index, event) in events.iter().enumerate() {
            event.validate(index, &self.limits)?;
        }
        let ids: Vec<Uuid> = events
            .iter()
            .map(|event| event.id.unwrap_or_else(Uuid::now_v7))
            .collect();
        for (event, id) in events.iter_mut().zip(&ids) {
            event.id = event.id.or(Some(*id));
        }

        // The same id twice in one batch: the later copy is a duplicate of the first when
        // identical, a conflict otherwise.
        let mut first_index: HashMap<Uuid, usize> = HashMap::with_capacity(ids.len());
        let mut repeated_in_batch = vec![false; ids.len()];
        for (index, id) in ids.iter().enumerate() {
            if let Some(&first) = first_index.get(id) {
                if events[first] != events[index] {
                    return Err(Error::AlreadyExists(format!(
                        "events[{index}].id: {id} is used by events[{first}] with different content"
                    )));
                }
                repeated_in_batch[index] = true;
            } else {
                first_index.insert(*id, index);
            }
        }
        let unique: Vec<usize> = (0..ids.len()).filter(|&i| !repeated_in_batch[i]).collect();
        let unique_ids: Vec<Uuid> = unique.iter().map(|&i| ids[i]).collect();
        let unique_events: Vec<&NewEvent> = unique.iter().map(|&i| &events[i]).collect();

        let mut transaction = self.store.begin_publish().await?;
        let inserted = transaction.insert(&unique_ids, &unique_events).await?;
        let inserted: std::collections::HashSet<Uuid> = inserted.into_iter().collect();
        if inserted.len() < unique_ids.len() {
            let existing_ids: Vec<Uuid> = unique_ids
                .iter()
                .filter(|id| !inserted.contains(id))
                .copied()
                .collect();
            let stored = transaction.find(&existing_ids).await?;
            for stored_event in &stored {
                let index = first_index[&stored_event.id];
                if !events[index].matches_stored(stored_event) {
                    return Err(Error::AlreadyExists(format!(
                        "events[{index}].id: event {} already exists with different content",
                        stored_event.id
                    )));
                }
            }
        }
        transaction.commit().await?;
        if !inserted.is_empty() {
            self.relay.events_committed();
        }
        Ok(ids
            .iter()
            .enumerate()
            .map(|(index, id)| Published {
                id: *id,
                duplicate: repeated_in_batch[index] || !inserted.contains(id),
            })
            .collect())
    }
}
