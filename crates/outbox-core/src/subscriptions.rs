//! Subscription management: create, read, list, change, pause and resume, seek and
//! delete.
//!
//! Definitions live in the `default` source. Each source a subscription reads holds its
//! read position there; it is created with the subscription, or — for a source that was
//! down then, or is added later — when the subscription first reads it, starting the same
//! way ([`Subscription::late_start`]). [`Subscriptions::reconcile`] repairs what a source
//! missed while it was down.

use std::{collections::HashSet, sync::Arc, time::Duration};

use futures_util::future::join_all;

use chrono::{DateTime, Utc};

use crate::{
    delivery::Relay,
    domain::{
        AllowedHosts, Pause, PushSecret, SourceName, StartPosition, Subscription, SubscriptionId,
        SubscriptionName, SubscriptionPatch, SubscriptionSettings, check_expire_after_idle,
    },
    error::{Error, Result},
    push::PushBoard,
    sink::{SinkCatalog, SinkStatus},
    sources::Source,
    storage::{NewDefinition, PreparedSeek, Store, StoreError},
};

#[derive(Clone)]
pub struct Subscriptions {
    relay: Relay,
    /// Destinations push subscriptions may send to (`[push] allowed_hosts`).
    push_hosts: AllowedHosts,
    /// Where this process's pushers take their signing keys from.
    push_board: PushBoard,
    /// The brokers sink subscriptions may publish to (`[[sinks]]`).
    sinks: SinkCatalog,
}

/// How long a rotated-out signing key keeps signing unless the rotation says.
pub const DEFAULT_KEEP_PREVIOUS_SECRET: std::time::Duration =
    std::time::Duration::from_secs(24 * 60 * 60);
/// Longest time a rotated-out signing key may keep signing.
pub const MAX_KEEP_PREVIOUS_SECRET: std::time::Duration =
    std::time::Duration::from_secs(30 * 24 * 60 * 60);

/// A subscription as a create or update left it.
#[derive(Debug)]
pub struct SubscriptionChange {
    pub subscription: Subscription,
    /// The signing key this change made (pushing was turned on): shown to the caller
    /// once, never again.
    pub new_secret: Option<PushSecret>,
}

impl Subscriptions {
    pub fn new(
        relay: Relay,
        push_hosts: AllowedHosts,
        push_board: PushBoard,
        sinks: SinkCatalog,
    ) -> Self {
        Subscriptions {
            relay,
            push_hosts,
            push_board,
            sinks,
        }
    }

    /// Gives a push subscription a new signing key; the previous one keeps signing
    /// beside it for `keep_previous_for` (default [`DEFAULT_KEEP_PREVIOUS_SECRET`]; keys
    /// rotated out earlier keep their own end). Returns the new key and when the
    /// previous one stops.
    pub async fn rotate_push_secret(
        &self,
        name: &SubscriptionName,
        keep_previous_for: Option<std::time::Duration>,
    ) -> Result<(PushSecret, DateTime<Utc>)> {
        let keep_previous_for = keep_previous_for.unwrap_or(DEFAULT_KEEP_PREVIOUS_SECRET);
        if keep_previous_for > MAX_KEEP_PREVIOUS_SECRET {
            return Err(Error::invalid(
                "keep_previous_for",
                format!(
                    "must be at most {}",
                    humantime::format_duration(MAX_KEEP_PREVIOUS_SECRET)
                ),
            ));
        }
        let subscription = self.get(name).await?;
        if subscription.settings.push.is_none() {
            return Err(Error::FailedPrecondition(format!(
                "subscription {name:?} is not a push subscription: it has no signing secret"
            )));
        }
        let now = Utc::now();
        let previous_expires_at =
            now + chrono::Duration::from_std(keep_previous_for).unwrap_or(chrono::Duration::zero());
        let new_secret = PushSecret::generate();
        let mut secrets = vec![new_secret.clone()];
        for mut previous in subscription.push_secrets {
            if previous.expires_at.is_none() {
                previous.expires_at = Some(previous_expires_at);
            }
            if previous.is_live(now) {
                secrets.push(previous);
            }
        }
        let rotated = self
            .definitions()
            .set_push_secrets(name, &secrets)
            .await?
            .ok_or_else(|| Error::subscription_not_found(name))?;
        self.push_board
            .set_keys(rotated.id, rotated.push_secrets.clone());
        self.relay.subscription_changed(rotated.id);
        Ok((new_secret, previous_expires_at))
    }

    fn check_push(&self, settings: &SubscriptionSettings) -> Result<()> {
        match &settings.push {
            Some(push) => Ok(self.push_hosts.check("subscription.push.endpoint", push)?),
            None => Ok(()),
        }
    }

    /// The gateway's sinks, with whether each broker answers now.
    pub async fn sinks(&self) -> Vec<SinkStatus> {
        self.sinks.statuses().await
    }

    fn check_sink(&self, settings: &SubscriptionSettings) -> Result<()> {
        match &settings.sink {
            Some(sink) => self.sinks.check("subscription.sink", sink),
            None => Ok(()),
        }
    }

    fn definitions(&self) -> &Store {
        &self.relay.sources().default_source().store
    }

    /// Creates a subscription; with `validate_only`, checks it as creating would (its
    /// name included) and returns it as it would be, changing nothing.
    pub async fn create(
        &self,
        name: SubscriptionName,
        settings: SubscriptionSettings,
        sources: Vec<SourceName>,
        start: StartPosition,
        expire_after_idle: Option<Duration>,
        validate_only: bool,
    ) -> Result<SubscriptionChange> {
        settings.validate("subscription")?;
        check_expire_after_idle("subscription.expire_after_idle", expire_after_idle)?;
        self.check_push(&settings)?;
        self.check_sink(&settings)?;
        for (index, source) in sources.iter().enumerate() {
            if self.relay.sources().by_name(source.as_str()).is_none() {
                return Err(Error::invalid(
                    format!("subscription.sources[{index}]"),
                    format!("{source:?} is not a source of this gateway"),
                ));
            }
        }
        if validate_only {
            if self.definitions().subscription(&name).await?.is_some() {
                return Err(already_exists(&name));
            }
            let now = Utc::now();
            let subscription = Subscription {
                id: SubscriptionId(0),
                name,
                settings,
                sources,
                start,
                expire_after_idle,
                created_at: now,
                pause: None,
                push_secrets: Vec::new(),
                push_stopped: None,
                last_attached_at: now,
            };
            return Ok(SubscriptionChange {
                subscription,
                new_secret: None,
            });
        }
        let new_secret = settings.push.as_ref().map(|_| PushSecret::generate());
        let secrets: Vec<PushSecret> = new_secret.iter().cloned().collect();
        let reads_default =
            sources.is_empty() || sources.contains(&self.relay.sources().default_source().name);
        let subscription = match self
            .definitions()
            .create_subscription(
                &NewDefinition {
                    name: &name,
                    settings: &settings,
                    sources: &sources,
                    start,
                    expire_after_idle,
                    secrets: &secrets,
                },
                reads_default,
            )
            .await
        {
            Err(StoreError::UniqueViolation { .. }) => return Err(already_exists(&name)),
            result => result?,
        };
        // Its other sources start reading now; one that is down starts when it is back.
        let id = subscription.id;
        let reading = self.relay.sources().of(&subscription);
        on_each_reachable(
            reading.iter().skip(usize::from(reads_default)),
            &subscription.name,
            "the subscription starts reading the source",
            |store| store.create_cursor(id, start),
        )
        .await;
        // Consumers may record its ack ids in any source at once.
        on_each_reachable(
            self.relay.sources().iter(),
            &subscription.name,
            "consumers there can record the subscription's ack ids",
            |store| store.add_consumer_subscription(id, subscription.name.as_str()),
        )
        .await;
        if subscription.settings.drained_by_gateway() {
            self.relay.subscription_changed(subscription.id);
        }
        Ok(SubscriptionChange {
            subscription,
            new_secret,
        })
    }

    pub async fn get(&self, name: &SubscriptionName) -> Result<Subscription> {
        self.definitions()
            .subscription(name)
            .await?
            .ok_or_else(|| Error::subscription_not_found(name))
    }

    pub async fn list(&self) -> Result<Vec<Subscription>> {
        Ok(self.definitions().subscriptions().await?)
    }

    /// Changes the settings the patch names; filters apply to events not yet handed out.
    /// Setting `push` switches to push delivery (a pull or sink subscription gets a new
    /// signing key) and resumes a push that stopped; setting `sink` switches to the
    /// sink; clearing either switches to pull. With `validate_only`, checks the change
    /// and returns the subscription as it would be, changing nothing.
    pub async fn update(
        &self,
        name: &SubscriptionName,
        patch: SubscriptionPatch,
        validate_only: bool,
    ) -> Result<SubscriptionChange> {
        let mut subscription = self.get(name).await?;
        let previous_push = subscription.settings.push.clone();
        let push_named = patch.push.is_some();
        let sink_named = patch.sink.is_some();
        patch.apply(&mut subscription.settings);
        // Setting one way of delivery the gateway drains switches from the other.
        if sink_named && !push_named && subscription.settings.sink.is_some() {
            subscription.settings.push = None;
            subscription.push_secrets.clear();
            subscription.push_stopped = None;
        }
        if push_named && !sink_named && subscription.settings.push.is_some() {
            subscription.settings.sink = None;
        }
        subscription.settings.validate("subscription")?;
        if sink_named {
            self.check_sink(&subscription.settings)?;
        }
        let mut new_secret = None;
        if push_named {
            self.check_push(&subscription.settings)?;
            subscription.push_stopped = None;
            match (&mut subscription.settings.push, previous_push) {
                (Some(push), Some(previous)) => push.keep_fingerprinted_headers(&previous),
                (Some(_), None) if validate_only => {}
                (Some(_), None) => {
                    let secret = PushSecret::generate();
                    subscription.push_secrets = vec![secret.clone()];
                    new_secret = Some(secret);
                }
                (None, _) => subscription.push_secrets.clear(),
            }
        }
        if validate_only {
            return Ok(SubscriptionChange {
                subscription,
                new_secret,
            });
        }
        let updated = self
            .definitions()
            .update_subscription(&subscription)
            .await?
            .ok_or_else(|| Error::subscription_not_found(name))?;
        self.relay.subscription_changed(updated.id);
        Ok(SubscriptionChange {
            subscription: updated,
            new_secret,
        })
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
            .ok_or_else(|| Error::subscription_not_found(name))?;
        self.relay.subscription_changed(resumed.id);
        Ok(resumed)
    }

    /// Moves the subscription's read position in every source it reads (replay or skip
    /// ahead). Refused, changing nothing, when one of them cannot be reached: each
    /// source's seek is prepared, holding its lock, before any commits. Only a source
    /// lost between the commits themselves leaves the others moved.
    pub async fn seek(&self, name: &SubscriptionName, to: StartPosition) -> Result<()> {
        let subscription = self.get(name).await?;
        let sources = self.relay.sources().of(&subscription);
        let mut prepared = Vec::with_capacity(sources.len());
        for source in &sources {
            match source.store.prepare_seek(subscription.id, to).await {
                Ok(seek) => prepared.push(seek),
                Err(error) => {
                    roll_back(prepared).await;
                    return Err(source.error(error));
                }
            }
        }
        let mut prepared = prepared.into_iter();
        for source in &sources {
            let seek = prepared.next().expect("one prepared seek per source");
            if let Err(error) = seek.commit().await {
                roll_back(prepared).await;
                return Err(source.error(error));
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
            return Err(Error::subscription_not_found(name));
        };
        on_each_reachable(
            self.relay.sources().iter(),
            name,
            "the subscription's records there go",
            |store| async move {
                store.remove_consumer_subscription(id).await?;
                match store.source().is_default() {
                    true => Ok(()),
                    false => store.delete_cursor(id).await,
                }
            },
        )
        .await;
        self.relay.subscription_changed(id);
        Ok(())
    }

    /// Brings a source up to date with the definitions: forgets subscriptions deleted
    /// while it was down (or that do not read it), starts the ones that read it but
    /// have no read position there yet, and makes its consumers know exactly the
    /// subscriptions there are.
    pub async fn reconcile(&self, source: &Source) -> Result<()> {
        let subscriptions = self.list().await?;
        let consumable: Vec<(SubscriptionId, &str)> = subscriptions
            .iter()
            .map(|subscription| (subscription.id, subscription.name.as_str()))
            .collect();
        source
            .store
            .sync_consumer_subscriptions(&consumable)
            .await?;
        let reading: HashSet<SubscriptionId> = subscriptions
            .iter()
            .filter(|subscription| subscription.reads(&source.name))
            .map(|subscription| subscription.id)
            .collect();
        let present: HashSet<SubscriptionId> = source
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

/// Runs `step` in each of `sources` side by side, and in none known to be down: what it
/// would do there is left to [`Subscriptions::reconcile`], which the maintenance pass
/// runs once the source is back. An admin call never waits for a source that cannot
/// answer (its connection attempts would take the whole acquire timeout). `deferred`
/// says what waits for the source, in the log line of each deferral.
async fn on_each_reachable<'a, Step, Done>(
    sources: impl IntoIterator<Item = &'a Arc<Source>>,
    subscription: &SubscriptionName,
    deferred: &str,
    step: Step,
) where
    Step: Fn(&'a Store) -> Done,
    Done: Future<Output = std::result::Result<(), StoreError>>,
{
    join_all(sources.into_iter().map(|source| {
        let done = source.is_connected().then(|| step(&source.store));
        async move {
            match done {
                None => {
                    tracing::info!(%subscription, source = %source.name, "source is unreachable: {deferred} once it is back");
                }
                Some(done) => {
                    if let Err(error) = done.await {
                        tracing::info!(%subscription, source = %source.name, %error, "{deferred} once the source is reachable");
                    }
                }
            }
        }
    }))
    .await;
}

async fn roll_back(seeks: impl IntoIterator<Item = PreparedSeek>) {
    for seek in seeks {
        seek.rollback().await;
    }
}

fn already_exists(name: &SubscriptionName) -> Error {
    Error::AlreadyExists(format!(
        "subscription.name: subscription {name:?} already exists"
    ))
}
