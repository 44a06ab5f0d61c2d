//! Publishing: validates a batch, stores it atomically and idempotently, wakes the relay.
//!
//! Concurrent Publish calls are coalesced into shared transactions (group commit): a
//! few committer tasks each take every call waiting in the queue, store them with one
//! INSERT, commit once, and answer each call only after that commit. One transaction
//! per group instead of one per call is what lets many small publishes outrun
//! PostgreSQL's one-row-per-transaction commit rate. Each call stays atomic and
//! isolated: bad input is refused before queueing, and a call whose event id conflicts
//! with stored content is taken out of its group, which is then retried without it.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
};

use tokio::sync::{Mutex, mpsc, oneshot};
use uuid::Uuid;

use crate::{
    delivery::Relay,
    domain::{NewEvent, PublishLimits, SourceName},
    error::{Error, Result},
    metrics,
    sources::Sources,
    storage::{PUBLISH_CONNECTIONS, PublishConnection, PublishTransaction, Store, StoreError},
    trace_context::TraceHeaders,
};

/// Committer tasks, one per publishing connection: several transactions in flight keep
/// PostgreSQL's cores busy (and its group commit fed) while each gathers the calls that
/// queued meanwhile.
const COMMITTERS: usize = PUBLISH_CONNECTIONS;
/// A group stops growing at this many events: coalescing pays for small calls, while
/// calls that are already large batches lose parallelism when merged.
const MAX_GROUP_EVENTS: usize = 500;
/// Calls waiting for a committer before Publish answers UNAVAILABLE.
const QUEUE_CAPACITY: usize = 4096;

/// What became of one published event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    pub id: Uuid,
    /// An identical event with this id was already stored.
    pub duplicate: bool,
}

#[derive(Clone)]
pub struct Publisher {
    limits: PublishLimits,
    sources: Sources,
    /// Per source (by id): the calls waiting for that source's committers.
    queues: Arc<Vec<mpsc::Sender<Call>>>,
}

/// One validated Publish call waiting for a committer.
struct Call {
    /// Events with their ids resolved, one per distinct id.
    events: Vec<NewEvent>,
    reply: oneshot::Sender<Result<HashSet<Uuid>>>,
}

impl Call {
    fn ids(&self) -> impl Iterator<Item = Uuid> + '_ {
        self.events
            .iter()
            .map(|event| event.id.expect("ids are resolved before queueing"))
    }
}

impl Publisher {
    /// Starts the committer tasks of every source; they stop when every `Publisher`
    /// clone is dropped.
    pub fn new(relay: Relay, limits: PublishLimits) -> Self {
        let queues = relay
            .sources()
            .iter()
            .map(|source| {
                let (queue, receiver) = mpsc::channel(QUEUE_CAPACITY);
                let receiver = Arc::new(Mutex::new(receiver));
                for _ in 0..COMMITTERS {
                    tokio::spawn(commit_groups(
                        source.store.clone(),
                        relay.clone(),
                        receiver.clone(),
                        MAX_GROUP_EVENTS,
                    ));
                }
                queue
            })
            .collect();
        Publisher {
            limits,
            sources: relay.sources().clone(),
            queues: Arc::new(queues),
        }
    }

    /// Stores the batch atomically: all of it, or nothing when any event is invalid or
    /// conflicts with a stored event of the same id. The caller's trace context is
    /// stored in the metadata of each event that does not carry one already, so the
    /// consumer can continue the producer's trace.
    pub async fn publish(
        &self,
        source: &SourceName,
        mut events: Vec<NewEvent>,
        trace: &TraceHeaders,
    ) -> Result<Vec<Published>> {
        self.validate(&events)?;
        let queue = self
            .sources
            .id_of(source.as_str())
            .and_then(|id| self.queues.get(usize::from(id.0)))
            .ok_or_else(|| {
                Error::invalid(
                    "source",
                    format!("{source:?} is not a source of this gateway"),
                )
            })?;
        for event in &mut events {
            event.id = Some(event.id.unwrap_or_else(Uuid::now_v7));
        }
        let ids: Vec<Uuid> = events
            .iter()
            .map(|event| event.id.expect("resolved"))
            .collect();

        // The same id twice in one call: the later copy is a duplicate of the first when
        // identical, a conflict otherwise.
        let mut first_index: HashMap<Uuid, usize> = HashMap::with_capacity(ids.len());
        let mut repeated = vec![false; ids.len()];
        for (index, id) in ids.iter().enumerate() {
            match first_index.get(id) {
                Some(&first) if events[first] != events[index] => {
                    return Err(Error::AlreadyExists(format!(
                        "events[{index}].id: {id} is used by events[{first}] with different content"
                    )));
                }
                Some(_) => repeated[index] = true,
                None => {
                    first_index.insert(*id, index);
                }
            }
        }
        let mut unique: Vec<NewEvent> = events
            .into_iter()
            .zip(&repeated)
            .filter(|(_, repeated)| !**repeated)
            .map(|(event, _)| event)
            .collect();
        if let Some(traceparent) = &trace.traceparent {
            for event in &mut unique {
                if !event.metadata.contains_key("traceparent") {
                    event
                        .metadata
                        .insert("traceparent".into(), traceparent.clone());
                    if let Some(tracestate) = trace.tracestate.as_ref().filter(|t| t.len() <= 512) {
                        event
                            .metadata
                            .insert("tracestate".into(), tracestate.clone());
                    }
                }
            }
        }
        let event_types: Vec<(Uuid, String)> = unique
            .iter()
            .map(|event| (event.id.expect("resolved"), event.event_type.clone()))
            .collect();

        // A source known to be down answers at once rather than after a connection
        // attempt's whole timeout; so does one found down while the call waits (what it
        // wrote, if anything, is then unknown, as with any UNAVAILABLE: retrying with the
        // same ids is safe).
        let source = self
            .sources
            .by_name(source.as_str())
            .expect("looked up above");
        let unavailable = || Error::SourceUnavailable(source.name.clone());
        let (reply, answer) = oneshot::channel();
        if !source.is_connected() {
            return Err(unavailable());
        }
        queue
            .try_send(Call {
                events: unique,
                reply,
            })
            .map_err(|_| {
                Error::Overloaded("too many Publish calls are waiting; retry shortly".into())
            })?;
        let inserted = source
            .unless_down(answer)
            .await
            .ok_or_else(unavailable)?
            .map_err(|_| Error::ShuttingDown)??;
        metrics::published(
            event_types
                .iter()
                .filter(|(id, _)| inserted.contains(id))
                .map(|(_, event_type)| event_type.as_str()),
        );
        Ok(ids
            .iter()
            .zip(repeated)
            .map(|(id, repeated)| Published {
                id: *id,
                duplicate: repeated || !inserted.contains(id),
            })
            .collect())
    }

    fn validate(&self, events: &[NewEvent]) -> Result<()> {
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
        Ok(())
    }
}

/// A committer: takes every waiting call (up to `max_group_events` events), commits them
/// together and answers each, on a connection of its own.
async fn commit_groups(
    store: Store,
    relay: Relay,
    queue: Arc<Mutex<mpsc::Receiver<Call>>>,
    max_group_events: usize,
) {
    let mut connection = store.publish_connection();
    loop {
        let group = {
            let mut queue = queue.lock().await;
            let Some(first) = queue.recv().await else {
                return;
            };
            let mut size = first.events.len();
            let mut group = vec![first];
            while size < max_group_events {
                match queue.try_recv() {
                    Ok(call) => {
                        size += call.events.len();
                        group.push(call);
                    }
                    Err(_) => break,
                }
            }
            group
        };
        if commit(&mut connection, group).await {
            relay.events_committed(store.source_id());
        }
    }
}

/// Commits a group and answers its calls; true when anything new was stored.
async fn commit(connection: &mut PublishConnection, mut group: Vec<Call>) -> bool {
    // Calls reusing an id of an earlier call in the group go in a group of their own, so
    // each call's duplicate flags and conflicts are judged against committed rows only.
    let mut seen = HashSet::new();
    let (mut now, mut later) = (Vec::with_capacity(group.len()), Vec::new());
    for call in group.drain(..) {
        if call.ids().all(|id| !seen.contains(&id)) {
            seen.extend(call.ids());
            now.push(call);
        } else {
            later.push(call);
        }
    }
    let mut stored_any = false;
    for group in std::iter::once(now).chain(later.into_iter().map(|call| vec![call])) {
        stored_any |= commit_distinct(connection, group).await;
    }
    stored_any
}

/// Commits calls whose ids are all distinct. A call conflicting with stored content is
/// answered ALREADY_EXISTS and the rest are retried without it; if the database refuses
/// the group for another reason, each call is tried alone so one cannot fail another.
async fn commit_distinct(connection: &mut PublishConnection, mut group: Vec<Call>) -> bool {
    loop {
        if group.is_empty() {
            return false;
        }
        let attempt = try_commit(connection, &group).await;
        connection.release_if_broken();
        match attempt {
            Ok(Attempt::Committed(inserted)) => {
                let stored_any = !inserted.is_empty();
                for call in group {
                    let mine: HashSet<Uuid> =
                        call.ids().filter(|id| inserted.contains(id)).collect();
                    let _ = call.reply.send(Ok(mine));
                }
                return stored_any;
            }
            Ok(Attempt::Conflicts(conflicts)) => {
                let (refused, rest): (Vec<Call>, Vec<Call>) = group
                    .into_iter()
                    .partition(|call| call.ids().any(|id| conflicts.contains(&id)));
                for call in refused {
                    let (index, id) = call
                        .ids()
                        .enumerate()
                        .find(|(_, id)| conflicts.contains(id))
                        .expect("partitioned on a conflicting id");
                    let _ = call.reply.send(Err(Error::AlreadyExists(format!(
                        "events[{index}].id: event {id} already exists with different content"
                    ))));
                }
                group = rest;
            }
            Err(error) if group.len() > 1 && !error.is_unavailable() => {
                let mut stored_any = false;
                for call in group {
                    stored_any |= Box::pin(commit_distinct(connection, vec![call])).await;
                }
                return stored_any;
            }
            Err(error) => {
                let error = Arc::new(error);
                for call in group {
                    let _ = call.reply.send(Err(refusal(&error)));
                }
                return false;
            }
        }
    }
}

/// What a caller is told when the database refused its call. A check constraint the
/// gateway's validation does not know (an operator's own rule on the outbox table) is
/// the caller's input being refused, not a fault of the gateway.
fn refusal(error: &Arc<StoreError>) -> Error {
    match error.check_violation() {
        Some(constraint) => Error::invalid(
            "events",
            format!("refused by the database: constraint {constraint:?} does not hold"),
        ),
        None => StoreError::Shared(error.clone()).into(),
    }
}

enum Attempt {
    /// Committed; these ids were new.
    Committed(HashSet<Uuid>),
    /// Rolled back: these ids are stored with different content.
    Conflicts(HashSet<Uuid>),
}

async fn try_commit(
    connection: &mut PublishConnection,
    group: &[Call],
) -> Result<Attempt, StoreError> {
    let ids: Vec<Uuid> = group.iter().flat_map(Call::ids).collect();
    let events: Vec<&NewEvent> = group.iter().flat_map(|call| call.events.iter()).collect();
    if connection.insert_new_events(&ids, &events).await? {
        return Ok(Attempt::Committed(ids.into_iter().collect()));
    }
    // Some id is already stored: insert the rest and judge those in one transaction,
    // which every path ends explicitly before the connection is used again.
    let mut transaction = connection.begin().await?;
    match insert_and_judge(&mut transaction, &ids, &events).await {
        Ok(attempt @ Attempt::Committed(_)) => {
            transaction.commit().await?;
            Ok(attempt)
        }
        Ok(attempt @ Attempt::Conflicts(_)) => {
            transaction.rollback().await?;
            Ok(attempt)
        }
        Err(error) => {
            // A failed rollback marks the connection broken; the statement's error is
            // the one to report.
            let _ = transaction.rollback().await;
            Err(error)
        }
    }
}

/// Inserts the events whose ids are new and compares the others with their stored rows.
async fn insert_and_judge(
    transaction: &mut PublishTransaction<'_>,
    ids: &[Uuid],
    events: &[&NewEvent],
) -> Result<Attempt, StoreError> {
    let inserted: HashSet<Uuid> = transaction.insert(ids, events).await?.into_iter().collect();
    if inserted.len() == ids.len() {
        return Ok(Attempt::Committed(inserted));
    }
    let existing: Vec<Uuid> = ids
        .iter()
        .filter(|id| !inserted.contains(id))
        .copied()
        .collect();
    let by_id: HashMap<Uuid, &NewEvent> = ids.iter().copied().zip(events.iter().copied()).collect();
    let conflicts: HashSet<Uuid> = transaction
        .find(&existing)
        .await?
        .into_iter()
        .filter(|stored| !by_id[&stored.id].matches_stored(stored))
        .map(|stored| stored.id)
        .collect();
    if conflicts.is_empty() {
        Ok(Attempt::Committed(inserted))
    } else {
        Ok(Attempt::Conflicts(conflicts))
    }
}
