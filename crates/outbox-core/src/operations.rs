//! Operator actions on delivered events: requeues, dead-letter triage and stats, over
//! every source (or the one named).

use std::{collections::HashMap, sync::Arc};

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::{
    delivery::Relay,
    domain::{
        Consumers, DeadLetter, DeadLetterGroup, DeadLetterSelection, DeliveryState, Event,
        EventDeliveries, OutboxStats, PushStopped, SourceName, Subscription, SubscriptionId,
        SubscriptionName, SubscriptionStats, SubscriptionStatus, check_event_key, check_text,
    },
    drain::{DrainStatus, StatusBoard},
    error::{Error, Result},
    metrics,
    push::PushBoard,
    sink::SinkCatalog,
    sources::{Source, SourceHealth},
    storage::{DeliveryFacts, RequeueRefusal},
};

/// Longest `resolved_by` and `notes` of a resolved dead letter.
const MAX_RESOLVED_BY_BYTES: usize = 255;
const MAX_NOTES_BYTES: usize = 4096;
/// Dead letters per page when the caller does not say, and at most.
pub const DEFAULT_PAGE_SIZE: usize = 100;
pub const MAX_PAGE_SIZE: usize = 1000;
/// Most error groups a dead-letter summary shows.
pub const MAX_DEAD_LETTER_GROUPS: usize = 50;
/// Most events an aggregate lookup returns.
pub const MAX_AGGREGATE_EVENTS: usize = 100;

/// One page of dead letters and where the next one starts.
#[derive(Debug)]
pub struct DeadLetterPage {
    pub dead_letters: Vec<DeadLetter>,
    pub next_page: Option<PageToken>,
}

/// Where a dead-letter listing resumes: after this (dead-lettered time, source,
/// position), the listing order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageToken {
    pub dead_lettered_at: DateTime<Utc>,
    pub source: SourceName,
    pub position: i64,
}

impl PageToken {
    pub fn encode(&self) -> String {
        format!(
            "{}.{}.{}",
            self.dead_lettered_at.timestamp_micros(),
            self.position,
            self.source
        )
    }

    /// Tokens issued before there were several sources (no source part) resume in
    /// `default`.
    pub fn decode(field: &str, token: &str) -> Result<PageToken> {
        let invalid = || Error::invalid(field, "is not a page token from a previous listing");
        let mut parts = token.splitn(3, '.');
        let micros: i64 = parts
            .next()
            .and_then(|part| part.parse().ok())
            .ok_or_else(invalid)?;
        let position: i64 = parts
            .next()
            .and_then(|part| part.parse().ok())
            .ok_or_else(invalid)?;
        let source = match parts.next() {
            None => SourceName::default_source(),
            Some(name) => SourceName::parse(field, name).map_err(|_| invalid())?,
        };
        Ok(PageToken {
            dead_lettered_at: DateTime::from_timestamp_micros(micros).ok_or_else(invalid)?,
            source,
            position,
        })
    }

    /// What to ask one source for: its dead letters after this token in listing order.
    fn after_in(&self, source: &SourceName) -> (DateTime<Utc>, i64) {
        let position = match source.cmp(&self.source) {
            std::cmp::Ordering::Less => i64::MAX,
            std::cmp::Ordering::Equal => self.position,
            std::cmp::Ordering::Greater => i64::MIN,
        };
        (self.dead_lettered_at, position)
    }
}

/// A subscription's stats in total and per source it reads (sources that cannot be
/// reached are left out of both).
#[derive(Debug, Clone)]
pub struct SubscriptionStatsReport {
    /// The one state to show for it, from its total, pause, push and consumers.
    pub status: SubscriptionStatus,
    pub total: SubscriptionStats,
    pub per_source: Vec<SubscriptionStats>,
    /// Of a push subscription: its requests as this gateway process saw them, and why
    /// pushing stopped, if it did.
    pub push: Option<PushStats>,
    /// A sink subscription's messages, as this gateway process sent them (other
    /// replicas keep their own).
    pub sink: Option<DrainStatus>,
    /// Events recorded as consumed with `outbox_consume`, in every source reachable.
    pub consumption_records: u64,
    /// Subscribe streams open on it in this gateway process (other replicas hold their
    /// own); whether any is open anywhere shows in `status`.
    pub streams_here: usize,
    /// Why some of its stats could not be computed (logged in full): shown for this
    /// subscription alone, so one failing query does not fail every shared view.
    pub error: Option<String>,
}

/// A push subscription's stats.
#[derive(Debug, Clone, Default)]
pub struct PushStats {
    /// Requests of this gateway process (other replicas keep their own).
    pub requests: DrainStatus,
    pub stopped: Option<PushStopped>,
}

/// One source as an operator sees it.
#[derive(Debug, Clone)]
pub struct SourceStatus {
    pub name: SourceName,
    pub health: SourceHealth,
    /// Its outbox, when it could be read.
    pub outbox: Option<OutboxStats>,
    /// The newest migration applied there, when it could be read.
    pub schema_version: Option<i64>,
}

#[derive(Clone)]
pub struct Operations {
    relay: Relay,
    /// What this process's pushers report.
    push_board: PushBoard,
    /// What this process's sinkers report.
    sink_board: StatusBoard,
    /// Whether each sink's broker answers.
    sinks: SinkCatalog,
}

impl Operations {
    pub fn new(
        relay: Relay,
        push_board: PushBoard,
        sink_board: StatusBoard,
        sinks: SinkCatalog,
    ) -> Self {
        Operations {
            relay,
            push_board,
            sink_board,
            sinks,
        }
    }

    /// The sources asked for: the named one (INVALID_ARGUMENT when unknown) or all.
    fn sources(&self, only: Option<&SourceName>) -> Result<Vec<Arc<Source>>> {
        match only {
            Some(name) => self
                .relay
                .sources()
                .by_name(name.as_str())
                .cloned()
                .map(|source| vec![source])
                .ok_or_else(|| {
                    Error::invalid(
                        "source",
                        format!("{name:?} is not a source of this gateway"),
                    )
                }),
            None => Ok(self.relay.sources().iter().cloned().collect()),
        }
    }

    /// Makes one event deliverable again for the named subscription, or for every
    /// subscription it matches; returns how many delivery records were requeued. The
    /// event is looked up in the named source, or in every source. With
    /// `forget_consumption`, what `outbox_consume` recorded of the event for those
    /// subscriptions goes too, so their consumers run it again.
    pub async fn requeue_event(
        &self,
        id: Uuid,
        subscription: Option<&SubscriptionName>,
        source: Option<&SourceName>,
        forget_consumption: bool,
    ) -> Result<u64> {
        for candidate in self.sources(source)? {
            if let Some((position, event)) = candidate
                .store
                .event_by_id(id)
                .await
                .map_err(|error| candidate.error(error))?
            {
                return self
                    .requeue(
                        &candidate,
                        position,
                        &event,
                        subscription,
                        forget_consumption,
                    )
                    .await;
            }
        }
        Err(Error::NotFound(format!("event {id} does not exist")))
    }

    /// The same for the latest event of an aggregate with the given type (the latest
    /// over every source, unless one is named).
    pub async fn requeue_latest(
        &self,
        aggregate_type: &str,
        aggregate_id: &str,
        event_type: &str,
        subscription: Option<&SubscriptionName>,
        source: Option<&SourceName>,
        forget_consumption: bool,
    ) -> Result<u64> {
        check_event_key(aggregate_type, aggregate_id, event_type)?;
        let mut latest: Option<(Arc<Source>, i64, Event)> = None;
        for candidate in self.sources(source)? {
            let found = candidate
                .store
                .latest_event(aggregate_type, aggregate_id, event_type)
                .await
                .map_err(|error| candidate.error(error))?;
            if let Some((position, event)) = found
                && latest
                    .as_ref()
                    .is_none_or(|(_, _, best)| event.created_at > best.created_at)
            {
                latest = Some((candidate, position, event));
            }
        }
        let (source, position, event) = latest.ok_or_else(|| {
            Error::NotFound(format!(
                "no {event_type} event of aggregate {aggregate_type}/{aggregate_id}"
            ))
        })?;
        self.requeue(&source, position, &event, subscription, forget_consumption)
            .await
    }

    async fn requeue(
        &self,
        source: &Source,
        position: i64,
        event: &Event,
        only: Option<&SubscriptionName>,
        forget_consumption: bool,
    ) -> Result<u64> {
        let targets = match only {
            Some(name) => {
                let subscription = self.subscription(name).await?;
                if !subscription.reads(&source.name) || !subscription.settings.matches(event) {
                    return Err(Error::FailedPrecondition(format!(
                        "event {} does not match the filters of subscription {name:?}",
                        event.id
                    )));
                }
                vec![subscription]
            }
            None => self
                .subscriptions()
                .await?
                .into_iter()
                .filter(|subscription| {
                    subscription.reads(&source.name) && subscription.settings.matches(event)
                })
                .collect(),
        };
        let outcome = source
            .store
            .requeue_event(&targets, position)
            .await
            .map_err(|error| source.error(error))?;
        match outcome {
            Ok(requeued_on) => {
                for name in &requeued_on {
                    metrics::requeued(name.as_str(), source.name.as_str(), 1);
                }
                let requeued: Vec<&Subscription> = targets
                    .iter()
                    .filter(|target| requeued_on.contains(&&target.name))
                    .collect();
                if forget_consumption && !requeued.is_empty() {
                    // Before the redelivery is announced, so it is consumed afresh.
                    let ids: Vec<SubscriptionId> = requeued.iter().map(|s| s.id).collect();
                    self.forget_consumption(&ids, source, position).await?;
                }
                for subscription in requeued {
                    self.relay.due(subscription.id, source.id);
                }
                Ok(requeued_on.len() as u64)
            }
            Err(RequeueRefusal::InFlight { subscription }) => {
                Err(Error::FailedPrecondition(format!(
                    "event {} is in flight on subscription {subscription:?}; settle it or wait for its ack deadline",
                    event.id
                )))
            }
        }
    }

    /// Deletes what `outbox_consume` recorded of the event at `position` in `source` for
    /// the subscriptions, in every source (a consumer's database can be any of them).
    /// Refused, having forgotten what it could, when a source cannot be reached.
    async fn forget_consumption(
        &self,
        subscriptions: &[SubscriptionId],
        source: &Source,
        position: i64,
    ) -> Result<()> {
        for consumers in self.relay.sources().iter() {
            let forgotten = consumers
                .store
                .forget_consumption(subscriptions, &source.name, position)
                .await
                .map_err(|error| consumers.error(error))?;
            if forgotten > 0 {
                tracing::info!(source = %consumers.name, event_source = %source.name, position, forgotten, "forgot consumption records of a requeued event");
            }
        }
        Ok(())
    }

    /// One page of a subscription's selected dead letters over its sources, oldest
    /// first.
    pub async fn list_dead_letters(
        &self,
        name: &SubscriptionName,
        selection: &DeadLetterSelection,
        include_resolved: bool,
        page_size: usize,
        page: Option<PageToken>,
    ) -> Result<DeadLetterPage> {
        selection.validate()?;
        let subscription = self.subscription(name).await?;
        let page_size = match page_size {
            0 => DEFAULT_PAGE_SIZE,
            n if n > MAX_PAGE_SIZE => {
                return Err(Error::invalid(
                    "page_size",
                    format!("must be at most {MAX_PAGE_SIZE}"),
                ));
            }
            n => n,
        };
        let mut dead_letters = Vec::new();
        for candidate in self.sources_of(&subscription, selection.source.as_ref())? {
            // One more than asked tells whether another page follows.
            dead_letters.extend(
                candidate
                    .store
                    .dead_letters(
                        &subscription,
                        selection,
                        include_resolved,
                        page.as_ref().map(|token| token.after_in(&candidate.name)),
                        page_size + 1,
                    )
                    .await
                    .map_err(|error| candidate.error(error))?,
            );
        }
        dead_letters.sort_by(|a, b| {
            (a.dead_lettered_at, &a.event.source, a.position).cmp(&(
                b.dead_lettered_at,
                &b.event.source,
                b.position,
            ))
        });
        let next_page = if dead_letters.len() > page_size {
            dead_letters.truncate(page_size);
            dead_letters.last().map(|last| PageToken {
                dead_lettered_at: last.dead_lettered_at,
                source: last.event.source.clone(),
                position: last.position,
            })
        } else {
            None
        };
        Ok(DeadLetterPage {
            dead_letters,
            next_page,
        })
    }

    /// Sends the selected dead letters back for delivery with attempts reset, however
    /// many they are; returns how many.
    pub async fn requeue_dead_letters(
        &self,
        name: &SubscriptionName,
        selection: DeadLetterSelection,
        all: bool,
    ) -> Result<u64> {
        let (subscription, sources) = self.bulk_target(name, &selection, all, "requeue").await?;
        let mut requeued = 0;
        for candidate in sources {
            let here = candidate
                .store
                .requeue_dead_letters(&subscription, &selection)
                .await
                .map_err(|error| candidate.error(error))?;
            if here > 0 {
                metrics::requeued(name.as_str(), candidate.name.as_str(), here);
                self.relay.due(subscription.id, candidate.id);
            }
            requeued += here;
        }
        Ok(requeued)
    }

    /// How many dead letters [`Operations::requeue_dead_letters`] would requeue now.
    pub async fn count_requeue_dead_letters(
        &self,
        name: &SubscriptionName,
        selection: &DeadLetterSelection,
        all: bool,
    ) -> Result<u64> {
        let (subscription, sources) = self.bulk_target(name, selection, all, "requeue").await?;
        // Resolved dead letters are requeued only when chosen by id.
        self.count_in(
            &subscription,
            &sources,
            selection,
            !selection.ids.is_empty(),
        )
        .await
    }

    /// How many dead letters the selection takes, resolved ones too when asked.
    pub async fn count_dead_letters(
        &self,
        name: &SubscriptionName,
        selection: &DeadLetterSelection,
        include_resolved: bool,
    ) -> Result<u64> {
        selection.validate()?;
        let subscription = self.subscription(name).await?;
        let sources = self.sources_of(&subscription, selection.source.as_ref())?;
        self.count_in(&subscription, &sources, selection, include_resolved)
            .await
    }

    async fn count_in(
        &self,
        subscription: &Subscription,
        sources: &[Arc<Source>],
        selection: &DeadLetterSelection,
        include_resolved: bool,
    ) -> Result<u64> {
        let mut count = 0;
        for source in sources {
            count += source
                .store
                .count_dead_letters(subscription, selection, include_resolved)
                .await
                .map_err(|error| source.error(error))?;
        }
        Ok(count)
    }

    /// The selected unresolved dead letters grouped by last error over the
    /// subscription's sources, largest group first (at most [`MAX_DEAD_LETTER_GROUPS`]).
    pub async fn dead_letter_groups(
        &self,
        name: &SubscriptionName,
        selection: &DeadLetterSelection,
    ) -> Result<Vec<DeadLetterGroup>> {
        selection.validate()?;
        let subscription = self.subscription(name).await?;
        let mut groups: Vec<DeadLetterGroup> = Vec::new();
        for source in self.sources_of(&subscription, selection.source.as_ref())? {
            let here = source
                .store
                .dead_letter_groups(&subscription, selection, MAX_DEAD_LETTER_GROUPS)
                .await
                .map_err(|error| source.error(error))?;
            for group in here {
                match groups.iter_mut().find(|g| g.last_error == group.last_error) {
                    Some(same) => same.merge(group),
                    None => groups.push(group),
                }
            }
        }
        groups.sort_by(|a, b| {
            b.count
                .cmp(&a.count)
                .then_with(|| a.last_error.cmp(&b.last_error))
        });
        groups.truncate(MAX_DEAD_LETTER_GROUPS);
        Ok(groups)
    }

    /// Marks every selected unresolved dead letter handled without redelivering it,
    /// however many they are; returns how many.
    pub async fn resolve_dead_letters(
        &self,
        name: &SubscriptionName,
        selection: DeadLetterSelection,
        all: bool,
        resolved_by: &str,
        notes: &str,
    ) -> Result<u64> {
        check_resolution(resolved_by, notes)?;
        let (subscription, sources) = self.bulk_target(name, &selection, all, "resolve").await?;
        let mut resolved = 0;
        for source in sources {
            resolved += source
                .store
                .resolve_dead_letters(&subscription, &selection, resolved_by, notes)
                .await
                .map_err(|error| source.error(error))?;
        }
        Ok(resolved)
    }

    /// How many dead letters [`Operations::resolve_dead_letters`] would resolve now, with
    /// the same checks.
    pub async fn count_resolve_dead_letters(
        &self,
        name: &SubscriptionName,
        selection: &DeadLetterSelection,
        all: bool,
        resolved_by: &str,
        notes: &str,
    ) -> Result<u64> {
        check_resolution(resolved_by, notes)?;
        let (subscription, sources) = self.bulk_target(name, selection, all, "resolve").await?;
        self.count_in(&subscription, &sources, selection, false)
            .await
    }

    /// The subscription and sources of a bulk action on dead letters, once the selection
    /// is valid and says what it takes: at least one selector, or `all`.
    async fn bulk_target(
        &self,
        name: &SubscriptionName,
        selection: &DeadLetterSelection,
        all: bool,
        verb: &str,
    ) -> Result<(Subscription, Vec<Arc<Source>>)> {
        if selection.is_empty() && !all {
            return Err(Error::invalid(
                "all",
                format!(
                    "give a selector (ids, event_types, aggregate_type, aggregate_id, last_error, dead_lettered_after or dead_lettered_before), or set all = true to {verb} every dead letter"
                ),
            ));
        }
        selection.validate()?;
        let subscription = self.subscription(name).await?;
        let sources = self.sources_of(&subscription, selection.source.as_ref())?;
        Ok((subscription, sources))
    }

    pub async fn resolve_dead_letter(
        &self,
        name: &SubscriptionName,
        id: Uuid,
        resolved_by: &str,
        notes: &str,
        source: Option<&SourceName>,
    ) -> Result<DeadLetter> {
        check_resolution(resolved_by, notes)?;
        let subscription = self.subscription(name).await?;
        for candidate in self.sources_of(&subscription, source)? {
            if let Some(dead_letter) = candidate
                .store
                .resolve_dead_letter(&subscription, id, resolved_by, notes)
                .await
                .map_err(|error| candidate.error(error))?
            {
                return Ok(dead_letter);
            }
        }
        Err(Error::NotFound(format!(
            "event {id} is not a dead letter of subscription {name:?}"
        )))
    }

    /// An event and where it stands on every subscription. The event is looked up in the
    /// named source, or in every source in configuration order.
    pub async fn event_deliveries(
        &self,
        id: Uuid,
        source: Option<&SourceName>,
    ) -> Result<EventDeliveries> {
        for candidate in self.sources(source)? {
            let Some((position, event)) = candidate
                .store
                .event_by_id(id)
                .await
                .map_err(|error| candidate.error(error))?
            else {
                continue;
            };
            let subscriptions = self.subscriptions().await?;
            let facts = candidate
                .store
                .delivery_facts(position, &subscriptions)
                .await
                .map_err(|error| candidate.error(error))?;
            let subscriptions = subscriptions
                .into_iter()
                .zip(facts)
                .map(|(subscription, facts)| {
                    let state = if subscription.reads(&candidate.name) {
                        delivery_state(&subscription, &event, &facts)
                    } else {
                        DeliveryState::NotMatched
                    };
                    (subscription.name, state)
                })
                .collect();
            return Ok(EventDeliveries {
                event,
                subscriptions,
            });
        }
        Err(Error::NotFound(format!("event {id} does not exist")))
    }

    /// The latest events of an aggregate over every source, newest first (at most
    /// [`MAX_AGGREGATE_EVENTS`]).
    pub async fn aggregate_events(
        &self,
        aggregate_type: &str,
        aggregate_id: &str,
    ) -> Result<Vec<Event>> {
        for (field, value) in [
            ("aggregate_type", aggregate_type),
            ("aggregate_id", aggregate_id),
        ] {
            if value.is_empty() || value.len() > 255 {
                return Err(Error::invalid(field, "must be 1 to 255 bytes"));
            }
            check_text(field, value)?;
        }
        let mut events = Vec::new();
        for source in self.relay.sources().iter() {
            events.extend(
                source
                    .store
                    .aggregate_events(aggregate_type, aggregate_id, MAX_AGGREGATE_EVENTS)
                    .await
                    .map_err(|error| source.error(error))?
                    .into_iter()
                    .map(|(_, event)| event),
            );
        }
        events.sort_by_key(|event| std::cmp::Reverse(event.created_at));
        events.truncate(MAX_AGGREGATE_EVENTS);
        Ok(events)
    }

    /// Stats of one subscription or of all — each in total and per source — and of
    /// the outbox over every reachable source.
    pub async fn stats(
        &self,
        only: Option<&SubscriptionName>,
    ) -> Result<(Vec<SubscriptionStatsReport>, OutboxStats)> {
        let subscriptions = match only {
            Some(name) => vec![self.subscription(name).await?],
            None => self.subscriptions().await?,
        };
        let mut reports = Vec::with_capacity(subscriptions.len());
        let mut consumption_records: HashMap<SubscriptionId, u64> = HashMap::new();
        let only_id = only
            .and(subscriptions.first())
            .map(|subscription| subscription.id);
        for source in self.relay.sources().iter().filter(|s| s.is_connected()) {
            let counts = match source.store.count_consumptions(only_id).await {
                Ok(counts) => counts,
                Err(error) => {
                    // Only this count is missing then; the figures are still shown.
                    tracing::warn!(source = %source.name, %error, "cannot count consumption records");
                    continue;
                }
            };
            for (id, count) in counts {
                *consumption_records.entry(id).or_default() += count;
            }
        }
        let streams_here = self.relay.stream_counts();
        let attached = match crate::streams::attached_anywhere(&self.relay).await {
            Ok(attached) => attached,
            Err(error) => {
                // Then only this gateway's streams are known: the others' may be there.
                tracing::warn!(%error, "cannot read which subscriptions have streams");
                streams_here
                    .iter()
                    .filter(|(_, streams)| **streams > 0)
                    .map(|(id, _)| *id)
                    .collect()
            }
        };
        let now = Utc::now();
        for subscription in &subscriptions {
            let mut per_source = Vec::new();
            let mut error = None;
            for source in self.relay.sources().of(subscription) {
                if !source.is_connected() {
                    continue;
                }
                match source.store.subscription_stats(subscription).await {
                    Ok(Some(stats)) => per_source.push(stats),
                    // A subscription deleted meanwhile simply drops out of the stats.
                    Ok(None) => {}
                    Err(failure) => {
                        tracing::warn!(
                            subscription = %subscription.name,
                            source = %source.name,
                            error = %failure,
                            "cannot compute a subscription's figures"
                        );
                        // The client sees the error's category, never database text.
                        error = Some(format!(
                            "its figures in source {} could not be computed ({}); the gateway log has the cause",
                            source.name,
                            source.error(failure)
                        ));
                    }
                }
            }
            let total = total(subscription, &per_source);
            let unreachable = subscription.settings.sink.as_ref().and_then(|sink| {
                self.sinks
                    .unreachable(&sink.name)
                    .map(|reason| (sink.name.clone(), reason))
            });
            let consumers = if let Some((sink, reason)) = unreachable {
                Consumers::SinkUnreachable { sink, reason }
            } else if subscription.settings.drained_by_gateway() {
                Consumers::Gateway
            } else if attached.contains(&subscription.id) {
                Consumers::Attached
            } else {
                Consumers::Absent {
                    since: subscription.last_attached_at,
                }
            };
            reports.push(SubscriptionStatsReport {
                error,
                status: SubscriptionStatus::of(subscription, &total, consumers, now),
                total,
                per_source,
                push: subscription.settings.push.as_ref().map(|_| PushStats {
                    requests: self.push_board.get(subscription.id).unwrap_or_default(),
                    stopped: subscription.push_stopped.clone(),
                }),
                sink: subscription
                    .settings
                    .sink
                    .as_ref()
                    .map(|_| self.sink_board.get(subscription.id).unwrap_or_default()),
                consumption_records: consumption_records
                    .get(&subscription.id)
                    .copied()
                    .unwrap_or_default(),
                streams_here: streams_here
                    .get(&subscription.id)
                    .copied()
                    .unwrap_or_default(),
            });
        }
        let mut outboxes = Vec::new();
        for source in self.relay.sources().iter().filter(|s| s.is_connected()) {
            outboxes.push(source.store.outbox_stats().await?);
        }
        Ok((reports, OutboxStats::sum(&outboxes)))
    }

    /// Every source: whether it is reachable, its outbox and its schema version.
    pub async fn sources_status(&self) -> Vec<SourceStatus> {
        let mut statuses = Vec::new();
        for source in self.relay.sources().iter() {
            let (outbox, schema_version) = if source.is_connected() {
                (
                    source.store.outbox_stats().await.ok(),
                    source.store.schema_version().await.ok(),
                )
            } else {
                (None, None)
            };
            statuses.push(SourceStatus {
                name: source.name.clone(),
                health: source.health(),
                outbox,
                schema_version,
            });
        }
        statuses
    }

    /// The sources of a subscription to work on: the named one (which it must read) or
    /// all it reads. One that cannot be reached refuses the call.
    fn sources_of(
        &self,
        subscription: &Subscription,
        only: Option<&SourceName>,
    ) -> Result<Vec<Arc<Source>>> {
        let sources: Vec<Arc<Source>> = self
            .sources(only)?
            .into_iter()
            .filter(|source| subscription.reads(&source.name))
            .collect();
        if let Some(down) = sources.iter().find(|source| !source.is_connected()) {
            return Err(Error::SourceUnavailable(down.name.clone()));
        }
        Ok(sources)
    }

    async fn subscription(&self, name: &SubscriptionName) -> Result<Subscription> {
        (self.relay.sources().default_source().store)
            .subscription(name)
            .await?
            .ok_or_else(|| Error::subscription_not_found(name))
    }

    async fn subscriptions(&self) -> Result<Vec<Subscription>> {
        Ok(self
            .relay
            .sources()
            .default_source()
            .store
            .subscriptions()
            .await?)
    }
}

/// The resolver's name and notes of a resolved dead letter.
fn check_resolution(resolved_by: &str, notes: &str) -> Result<()> {
    if resolved_by.is_empty() || resolved_by.len() > MAX_RESOLVED_BY_BYTES {
        return Err(Error::invalid(
            "resolved_by",
            format!("must be 1 to {MAX_RESOLVED_BY_BYTES} bytes"),
        ));
    }
    if notes.len() > MAX_NOTES_BYTES {
        return Err(Error::invalid(
            "notes",
            format!("must be at most {MAX_NOTES_BYTES} bytes"),
        ));
    }
    check_text("resolved_by", resolved_by)?;
    Ok(check_text("notes", notes)?)
}

/// Where an event stands on a subscription: its delivery record when it has one (in
/// flight, awaiting retry, waiting or dead), otherwise what the subscription's filters,
/// start time and cursor say. An expired lease counts as awaiting retry, as in the stats.
fn delivery_state(
    subscription: &Subscription,
    event: &Event,
    facts: &DeliveryFacts,
) -> DeliveryState {
    let Some(record) = &facts.record else {
        return if !subscription.settings.matches(event) {
            DeliveryState::NotMatched
        } else if facts.skipped {
            DeliveryState::Skipped
        } else if facts.handed_out {
            DeliveryState::Acked {
                before_subscription: event.created_at < subscription.created_at,
            }
        } else {
            DeliveryState::Pending
        };
    };
    match (record.state.as_str(), record.due_at) {
        ("in_flight", Some(deadline)) if !record.overdue => DeliveryState::InFlight {
            attempt: record.attempt,
            deadline,
        },
        ("in_flight" | "retry", Some(next_try)) => DeliveryState::AwaitingRetry {
            attempt: record.attempt,
            next_try,
            last_error: record.last_error.clone(),
        },
        ("dead", _) => DeliveryState::Dead {
            attempts: record.attempt,
            last_error: record.last_error.clone(),
            dead_lettered_at: record.dead_lettered_at,
            resolved_at: record.resolved_at,
            resolved_by: record.resolved_by.clone(),
            notes: record.notes.clone(),
        },
        _ => DeliveryState::Waiting {
            attempt: record.attempt,
        },
    }
}

/// A subscription's stats over its sources.
fn total(subscription: &Subscription, per_source: &[SubscriptionStats]) -> SubscriptionStats {
    let sum = |figure: fn(&SubscriptionStats) -> u64| per_source.iter().map(figure).sum();
    SubscriptionStats {
        name: subscription.name.clone(),
        source: None,
        pending: sum(|s| s.pending),
        in_flight: sum(|s| s.in_flight),
        awaiting_retry: sum(|s| s.awaiting_retry),
        dead_lettered: sum(|s| s.dead_lettered),
        oldest_unacked_at: per_source.iter().filter_map(|s| s.oldest_unacked_at).min(),
        delivered_total: sum(|s| s.delivered_total),
        acked_total: sum(|s| s.acked_total),
        late_transactions: sum(|s| s.late_transactions),
        expired_total: sum(|s| s.expired_total),
        scheduled: sum(|s| s.scheduled),
        next_scheduled_at: per_source.iter().filter_map(|s| s.next_scheduled_at).min(),
        filtered_total: sum(|s| s.filtered_total),
        filter_errors_total: sum(|s| s.filter_errors_total),
        last_filter_error: per_source
            .iter()
            .filter_map(|s| s.last_filter_error.clone())
            .max_by_key(|(_, at)| *at),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_tokens_round_trip_and_reject_garbage() {
        let token = PageToken {
            dead_lettered_at: DateTime::from_timestamp_micros(1_700_000_000_123_456).unwrap(),
            source: SourceName::parse("source", "billing").unwrap(),
            position: 42,
        };
        assert_eq!(
            PageToken::decode("page_token", &token.encode()).unwrap(),
            token
        );
        let old = PageToken::decode("page_token", "1700000000123456.42").unwrap();
        assert!(old.source.is_default());
        for bad in ["", "1", "x.1", "1.y", "1.2.Bad"] {
            assert!(PageToken::decode("page_token", bad).is_err(), "{bad:?}");
        }
    }
}
