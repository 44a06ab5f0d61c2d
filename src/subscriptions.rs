//! Subscription management: create, read, list and delete.

use crate::{
    delivery::Relay,
    domain::{
        StartPosition, Subscription, SubscriptionName, SubscriptionPatch, SubscriptionSettings,
    },
    error::{Error, Result},
    storage::{Store, StoreError},
};

#[derive(Clone)]
pub struct Subscriptions {
    store: Store,
    relay: Relay,
}

impl Subscriptions {
    pub fn new(store: Store, relay: Relay) -> Self {
        Subscriptions { store, relay }
    }

    pub async fn create(
        &self,
        name: SubscriptionName,
        settings: SubscriptionSettings,
        start: StartPosition,
    ) -> Result<Subscription> {
        settings.validate("subscription")?;
        match self
            .store
            .create_subscription(&name, &settings, start)
            .await
        {
            Err(StoreError::UniqueViolation { .. }) => Err(Error::AlreadyExists(format!(
                "subscription.name: subscription {name:?} already exists"
            ))),
            result => Ok(result?),
        }
    }

    pub async fn get(&self, name: &SubscriptionName) -> Result<Subscription> {
        find(&self.store, name).await
    }

    pub async fn list(&self) -> Result<Vec<Subscription>> {
        Ok(self.store.subscriptions().await?)
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
            .store
            .update_subscription(&subscription)
            .await?
            .ok_or_else(|| not_found(name))?;
        self.relay.wake_all();
        Ok(updated)
    }

    /// Moves the subscription's read position (replay or skip ahead).
    pub async fn seek(&self, name: &SubscriptionName, to: StartPosition) -> Result<()> {
        if !self.store.seek(name, to).await? {
            return Err(not_found(name));
        }
        self.relay.wake_all();
        Ok(())
    }

    /// Deletes the subscription; its streams in this process end at once, elsewhere at
    /// their gateway's next claim.
    pub async fn delete(&self, name: &SubscriptionName) -> Result<()> {
        if !self.store.delete_subscription(name).await? {
            return Err(not_found(name));
        }
        self.relay.wake_all();
        Ok(())
    }
}

/// The named subscription, or NOT_FOUND.
pub(crate) async fn find(store: &Store, name: &SubscriptionName) -> Result<Subscription> {
    store
        .subscription(name)
        .await?
        .ok_or_else(|| not_found(name))
}

fn not_found(name: &SubscriptionName) -> Error {
    Error::NotFound(format!("subscription {name:?} does not exist"))
}
