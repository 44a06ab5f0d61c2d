//! Subscription management: create, read, list, change, pause and resume, seek and
//! delete.
//!
//! Definitions live in the `default` source. Each source a subscription reads holds its
//! read position there; it is created with the subscription, or — for a source that was
//! down then, or is added later — when the subscription first reads it, starting the same
//! way ([`Subscription::late_start`]). [`Subscriptions::reconcile`] repairs what a source
//! missed while it was down.

use std::{collections::HashSet, time::Duration};

use chrono::{DateTime, Utc};

use crate::{
    delivery::Relay,
    domain::{
        Pause, SourceName, StartPosition, Subscription, SubscriptionName, SubscriptionPatch,
        SubscriptionSettings, check_expire_after_idle,
    },
    error::{Error, Result},
    sources::Source,
    storage::{Store, StoreError},
};

#[derive(Clone)]
pub struct Subscriptions {
    relay: Relay,
}

impl Subscriptions {
    pub fn new(relay: Relay) -> Self {
        Subscriptions { relay }
    }

    fn definitions(&self) -> &Store {
        &self.relay.sources().default_source().store
    }

    pub async fn create(
        &self,
        name: SubscriptionName,
        settings: SubscriptionSettings,
        sources: Vec<SourceName>,
        start: StartPosition,
        expire_after_idle: Option<Duration>,
    ) -> Result<Subscription> {
        settings.validate("subscription")?;
        check_expire_after_idle("subscription.expire_after_idle", expire_after_idle)?;
        for (index, source) in sources.iter().enumerate() {
            if self.relay.sources().by_name(source.as_str()).is_none() {
                return Err(Error::invalid(
                    format!("subscription.sources[{index}]"),
                    format!("{source:?} is not a source of this gateway"),
                ));
            }
        }
        let reads_default =
            sources.is_empty() || sources.contains(&self.relay.sources().default_source().name);
        let subscription = match self
            .definitions()
            .create_subscription(
                &name,
                &settings,
                &sources,
                start,
                expire_after_idle,
                reads_default,
            )
            .await
        {
            Err(StoreError::UniqueViolation { .. }) => {
                return Err(Error::AlreadyExists(format!(
                    "subscription.name: subscription {name:?} already exists"
                )));
            }
            result => result?,
        };
        // Its other sources start reading now; one that is down starts when it is back.
        for source in self
            .relay
            .sources()
            .of(&subscription)
            .iter()
            .skip(usize::from(reads_default))
        {
            if let Err(error) = source.store.create_cursor(subscription.id, start).await {
                tracing::info!(subscription = %subscription.name, source = %source.name, %error, "the subscription starts reading the source once it is reachable");
            }
        }
        Ok(subscription)
    }

    pub async fn get(&self, name: &SubscriptionName) -> Result<Subscription> {
        find(self.definitions(), name).await
    }

    pub async fn list(&self) -> Result<Vec<Subscription>> {
        Ok(self.definitions().subscriptions().await?)
    }

    /// Changes the settings the patch names; filters apply to events not yet handed out.
    pub async fn update(
        &self,
        name: &SubscriptionName,
        patch: SubscriptionPatch,
    ) -> Result<Subscription> {
        let mut subscription = self.get(name).await?;
        patch.apply(&mut subscription.settings);
        subscription.settings.validate("subscription")?;
        let updated = self
            .definitions()
            .update_subscription(&subscription)
            .await?
            .ok_or_else(|| not_found(name))?;
        self.relay.subscription_changed(updated.id);
        Ok(updated)
    }

    /// Stops new deliveries of the subscription until [`Subscriptions::resume`] or
    /// `until`; deliveries already out still settle. See [`Relay::pause`].
    pub async fn pause(
        &self,
        name: &SubscriptionName,
        reason: &str,
        until: Option<DateTime<Utc>>,
    ) -> Result<Subscription> {
        Pause::validate(reason, until, Utc::now())?;
        self.relay.pause(name, reason, until).await
    }

    /// Ends the subscription's pause, whoever set it; a no-op when it is not paused.
    pub async fn resume(&self, name: &SubscriptionName) -> Result<Subscription> {
        let resumed = self
            .definitions()
            .resume_subscription(name)
            .await?
            .ok_or_else(|| not_found(name))?;
        self.relay.subscription_changed(resumed.id);
        Ok(resumed)
    }

    /// Moves the subscription's read position in every source it reads (replay or skip
    /// ahead). Refused, changing nothing, when one of them cannot be reached.
    pub async fn seek(&self, name: &SubscriptionName, to: StartPosition) -> Result<()> {
        let subscription = self.get(name).await?;
        let sources = self.relay.sources().of(&subscription);
        for source in &sources {
            if source.store.ping().await.is_err() {
                return Err(Error::SourceUnavailable(source.name.clone()));
            }
        }
        for source in &sources {
            if !source.store.seek(subscription.id, to).await? {
                source.store.create_cursor(subscription.id, to).await?;
            }
        }
        self.relay.subscription_changed(subscription.id);
        Ok(())
    }

    /// Deletes the subscription; its streams in this process end at once, elsewhere at
    /// their gateway's next claim. Its read positions and records in other sources go
    /// now, or once a source that is down is back.
    pub async fn delete(&self, name: &SubscriptionName) -> Result<()> {
        let Some(id) = self.definitions().delete_subscription(name).await? else {
            return Err(not_found(name));
        };
        for source in self.relay.sources().iter().skip(1) {
            if let Err(error) = source.store.delete_cursor(id).await {
                tracing::info!(subscription = %name, source = %source.name, %error, "the subscription's records there go once the source is reachable");
            }
        }
        self.relay.subscription_changed(id);
        Ok(())
    }

    /// Brings a source up to date with the definitions: forgets subscriptions deleted
    /// while it was down (or that do not read it), and starts the ones that read it but
    /// have no read position there yet.
    pub async fn reconcile(&self, source: &Source) -> Result<()> {
        let subscriptions = self.list().await?;
        let reading: HashSet<i64> = subscriptions
            .iter()
            .filter(|subscription| subscription.reads(&source.name))
            .map(|subscription| subscription.id)
            .collect();
        let present: HashSet<i64> = source
            .store
            .cursor_subscription_ids()
            .await?
            .into_iter()
            .collect();
        for orphan in present.difference(&reading) {
            source.store.delete_cursor(*orphan).await?;
        }
        for subscription in subscriptions
            .iter()
            .filter(|subscription| reading.contains(&subscription.id))
            .filter(|subscription| !present.contains(&subscription.id))
        {
            source
                .store
                .create_cursor(subscription.id, subscription.late_start())
                .await?;
        }
        Ok(())
    }
}

/// The named subscription, or NOT_FOUND.
pub(crate) async fn find(definitions: &Store, name: &SubscriptionName) -> Result<Subscription> {
    definitions
        .subscription(name)
        .await?
        .ok_or_else(|| not_found(name))
}

pub(crate) fn not_found(name: &SubscriptionName) -> Error {
    Error::NotFound(format!("subscription {name:?} does not exist"))
}
