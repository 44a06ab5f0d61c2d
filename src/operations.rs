//! Operator actions on delivered events: requeues, dead-letter triage and figures.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::{
    delivery::Relay,
    domain::{
        DeadLetter, DeadLetterSelection, Event, OutboxStats, PatternSet, Subscription,
        SubscriptionName, SubscriptionStats, check_text,
    },
    error::{Error, Result},
    metrics,
    storage::{RequeueRefusal, Store},
};

/// Longest `resolved_by` and `notes` of a resolved dead letter.
const MAX_RESOLVED_BY_BYTES: usize = 255;
const MAX_NOTES_BYTES: usize = 4096;
/// Dead letters per page when the caller does not say, and at most.
pub const DEFAULT_PAGE_SIZE: usize = 100;
pub const MAX_PAGE_SIZE: usize = 1000;

/// One page of dead letters and where the next one starts.
#[derive(Debug)]
pub struct DeadLetterPage {
    pub dead_letters: Vec<DeadLetter>,
    pub next_page: Option<PageToken>,
}

/// Where a dead-letter listing resumes: after this (dead-lettered time, position).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageToken {
    pub dead_lettered_at: DateTime<Utc>,
    pub position: i64,
}

impl PageToken {
    pub fn encode(&self) -> String {
        format!(
            "{}.{}",
            self.dead_lettered_at.timestamp_micros(),
            self.position
        )
    }

    pub fn decode(field: &str, token: &str) -> Result<PageToken> {
        let invalid = || Error::invalid(field, "is not a page token from a previous listing");
        let (micros, position) = token.split_once('.').ok_or_else(invalid)?;
        let micros: i64 = micros.parse().map_err(|_| invalid())?;
        Ok(PageToken {
            dead_lettered_at: DateTime::from_timestamp_micros(micros).ok_or_else(invalid)?,
            position: position.parse().map_err(|_| invalid())?,
        })
    }
}

#[derive(Clone)]
pub struct Operations {
    store: Store,
    relay: Relay,
}

impl Operations {
    pub fn new(store: Store, relay: Relay) -> Self {
        Operations { store, relay }
    }

    /// Makes one event deliverable again for the named subscription, or for every
    /// subscription it matches; returns how many delivery records were requeued.
    pub async fn requeue_event(
        &self,
        id: Uuid,
        subscription: Option<&SubscriptionName>,
    ) -> Result<u64> {
        let (position, event) = self
            .store
            .event_by_id(id)
            .await?
            .ok_or_else(|| Error::NotFound(format!("event {id} does not exist")))?;
        self.requeue(position, &event, subscription).await
    }

    /// The same for the latest event of an aggregate with the given type.
    pub async fn requeue_latest(
        &self,
        aggregate_type: &str,
        aggregate_id: &str,
        event_type: &str,
        subscription: Option<&SubscriptionName>,
    ) -> Result<u64> {
        for (field, value) in [
            ("aggregate_type", aggregate_type),
            ("aggregate_id", aggregate_id),
            ("event_type", event_type),
        ] {
            if value.is_empty() {
                return Err(Error::invalid(field, "is required"));
            }
            check_text(field, value)?;
        }
        let (position, event) = self
            .store
            .latest_event(aggregate_type, aggregate_id, event_type)
            .await?
            .ok_or_else(|| {
                Error::NotFound(format!(
                    "no {event_type} event of aggregate {aggregate_type}/{aggregate_id}"
                ))
            })?;
        self.requeue(position, &event, subscription).await
    }

    async fn requeue(
        &self,
        position: i64,
        event: &Event,
        only: Option<&SubscriptionName>,
    ) -> Result<u64> {
        let targets = match only {
            Some(name) => {
                let subscription = self.subscription(name).await?;
                if !subscription.settings.matches(event) {
                    return Err(Error::FailedPrecondition(format!(
                        "event {} does not match the filters of subscription {name:?}",
                        event.id
                    )));
                }
                vec![subscription]
            }
            None => self
                .store
                .subscriptions()
                .await?
                .into_iter()
                .filter(|subscription| subscription.settings.matches(event))
                .collect(),
        };
        match self.store.requeue_event(&targets, position).await? {
            Ok(requeued_on) => {
                for name in &requeued_on {
                    metrics::requeued(name.as_str(), 1);
                }
                let requeued = requeued_on.len() as u64;
                self.wake_if(requeued);
                Ok(requeued)
            }
            Err(RequeueRefusal::InFlight { subscription }) => {
                Err(Error::FailedPrecondition(format!(
                    "event {} is in flight on subscription {subscription:?}; settle it or wait for its ack deadline",
                    event.id
                )))
            }
        }
    }

    pub async fn list_dead_letters(
        &self,
        name: &SubscriptionName,
        event_types: &PatternSet,
        include_resolved: bool,
        page_size: usize,
        page: Option<PageToken>,
    ) -> Result<DeadLetterPage> {
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
        // One more than asked tells whether another page follows.
        let mut dead_letters = self
            .store
            .dead_letters(
                &subscription,
                event_types.to_regex(),
                include_resolved,
                page.map(|token| (token.dead_lettered_at, token.position)),
                page_size + 1,
            )
            .await?;
        let next_page = if dead_letters.len() > page_size {
            dead_letters.truncate(page_size);
            dead_letters.last().map(|last| PageToken {
                dead_lettered_at: last.dead_lettered_at,
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

    pub async fn requeue_dead_letters(
        &self,
        name: &SubscriptionName,
        selection: DeadLetterSelection,
        all: bool,
    ) -> Result<u64> {
        if selection.is_empty() && !all {
            return Err(Error::invalid(
                "all",
                "give ids, event_types or dead_lettered_before, or set all = true to requeue every dead letter",
            ));
        }
        let subscription = self.subscription(name).await?;
        let requeued = self
            .store
            .requeue_dead_letters(&subscription, &selection)
            .await?;
        self.wake_if(requeued);
        Ok(requeued)
    }

    pub async fn resolve_dead_letter(
        &self,
        name: &SubscriptionName,
        id: Uuid,
        resolved_by: &str,
        notes: &str,
    ) -> Result<DeadLetter> {
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
        check_text("notes", notes)?;
        let subscription = self.subscription(name).await?;
        self.store
            .resolve_dead_letter(&subscription, id, resolved_by, notes)
            .await?
            .ok_or_else(|| {
                Error::NotFound(format!(
                    "event {id} is not a dead letter of subscription {name:?}"
                ))
            })
    }

    /// Figures of one subscription or of all, and of the outbox.
    pub async fn stats(
        &self,
        only: Option<&SubscriptionName>,
    ) -> Result<(Vec<SubscriptionStats>, OutboxStats)> {
        let subscriptions = match only {
            Some(name) => vec![self.subscription(name).await?],
            None => self.store.subscriptions().await?,
        };
        let mut figures = Vec::with_capacity(subscriptions.len());
        for subscription in &subscriptions {
            // A subscription deleted meanwhile simply drops out of the figures.
            if let Some(stats) = self.store.subscription_stats(subscription).await? {
                figures.push(stats);
            }
        }
        Ok((figures, self.store.outbox_stats().await?))
    }

    async fn subscription(&self, name: &SubscriptionName) -> Result<Subscription> {
        crate::subscriptions::find(&self.store, name).await
    }

    fn wake_if(&self, requeued: u64) {
        if requeued > 0 {
            self.relay.events_committed();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_tokens_round_trip_and_reject_garbage() {
        let token = PageToken {
            dead_lettered_at: DateTime::from_timestamp_micros(1_700_000_000_123_456).unwrap(),
            position: 42,
        };
        assert_eq!(
            PageToken::decode("page_token", &token.encode()).unwrap(),
            token
        );
        for bad in ["", "1", "x.1", "1.y"] {
            assert!(PageToken::decode("page_token", bad).is_err(), "{bad:?}");
        }
    }
}
