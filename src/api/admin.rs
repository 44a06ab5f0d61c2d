//! `outbox.v1.Admin`.

use tonic::{Request, Response, Status};

use super::{auth, convert, status_from};
use crate::{
    audit::{self, Selector, Via},
    domain::DeadLetterSelection,
    operations::{Operations, PageToken},
    proto::{self, admin_server::Admin as AdminService},
    subscriptions::Subscriptions,
};

pub struct AdminApi {
    subscriptions: Subscriptions,
    operations: Operations,
}

impl AdminApi {
    pub fn new(subscriptions: Subscriptions, operations: Operations) -> Self {
        AdminApi {
            subscriptions,
            operations,
        }
    }
}

#[tonic::async_trait]
impl AdminService for AdminApi {
    #[tracing::instrument(skip_all)]
    async fn create_subscription(
        &self,
        request: Request<proto::CreateSubscriptionRequest>,
    ) -> Result<Response<proto::Subscription>, Status> {
        let who = admin(&request)?;
        let request = request.into_inner();
        let convert::NewSubscription {
            name,
            settings,
            sources,
            start,
            expire_after_idle,
        } = convert::new_subscription(request.subscription).map_err(status_from)?;
        let selector = Selector::none().start("start", &start);
        let created = self
            .subscriptions
            .create(
                name,
                settings,
                sources,
                start,
                expire_after_idle,
                request.validate_only,
            )
            .await
            .map_err(status_from)?;
        if !request.validate_only {
            let name = &created.subscription.name;
            record(&who, "CreateSubscription", name.into(), &selector, 1);
            let settings = &created.subscription.settings;
            if settings.sink.is_some() && settings.max_attempts == 0 {
                // The default for sinks, unlike every other subscription's: said where
                // operators look, beside the `max attempts` the answer shows.
                tracing::info!(subscription = %name, "sink subscription retries its events until the broker confirms them (max_attempts 0): an outage never dead-letters them, a refusal still does at once");
            }
        }
        Ok(Response::new(convert::changed_subscription(created)))
    }

    #[tracing::instrument(skip_all, fields(subscription = %request.get_ref().name))]
    async fn get_subscription(
        &self,
        request: Request<proto::GetSubscriptionRequest>,
    ) -> Result<Response<proto::Subscription>, Status> {
        auth::principal(&request)?
            .check_view()
            .map_err(status_from)?;
        let name =
            convert::subscription_name("name", &request.into_inner().name).map_err(status_from)?;
        let subscription = self.subscriptions.get(&name).await.map_err(status_from)?;
        Ok(Response::new(convert::subscription(subscription)))
    }

    #[tracing::instrument(skip_all)]
    async fn list_subscriptions(
        &self,
        request: Request<proto::ListSubscriptionsRequest>,
    ) -> Result<Response<proto::ListSubscriptionsResponse>, Status> {
        auth::principal(&request)?
            .check_view()
            .map_err(status_from)?;
        let subscriptions = self.subscriptions.list().await.map_err(status_from)?;
        Ok(Response::new(proto::ListSubscriptionsResponse {
            subscriptions: subscriptions
                .into_iter()
                .map(convert::subscription)
                .collect(),
        }))
    }

    #[tracing::instrument(skip_all, fields(subscription = %request.get_ref().name))]
    async fn delete_subscription(
        &self,
        request: Request<proto::DeleteSubscriptionRequest>,
    ) -> Result<Response<proto::DeleteSubscriptionResponse>, Status> {
        let who = admin(&request)?;
        let name =
            convert::subscription_name("name", &request.into_inner().name).map_err(status_from)?;
        self.subscriptions
            .delete(&name)
            .await
            .map_err(status_from)?;
        record(
            &who,
            "DeleteSubscription",
            (&name).into(),
            &Selector::none(),
            1,
        );
        Ok(Response::new(proto::DeleteSubscriptionResponse {}))
    }

    #[tracing::instrument(skip_all)]
    async fn update_subscription(
        &self,
        request: Request<proto::UpdateSubscriptionRequest>,
    ) -> Result<Response<proto::Subscription>, Status> {
        let who = admin(&request)?;
        let request = request.into_inner();
        let fields = request
            .update_mask
            .as_ref()
            .map(|mask| mask.paths.join(","))
            .unwrap_or_default();
        let (name, patch) = convert::subscription_patch(request.subscription, request.update_mask)
            .map_err(status_from)?;
        let updated = self
            .subscriptions
            .update(&name, patch, request.validate_only)
            .await
            .map_err(status_from)?;
        if !request.validate_only {
            let selector = Selector::none().with("fields", fields);
            record(&who, "UpdateSubscription", (&name).into(), &selector, 1);
        }
        Ok(Response::new(convert::changed_subscription(updated)))
    }

    #[tracing::instrument(skip_all, fields(subscription = %request.get_ref().name))]
    async fn pause_subscription(
        &self,
        request: Request<proto::PauseSubscriptionRequest>,
    ) -> Result<Response<proto::Subscription>, Status> {
        let who = admin(&request)?;
        let request = request.into_inner();
        let name = convert::subscription_name("name", &request.name).map_err(status_from)?;
        let until = convert::optional_timestamp("until", request.until).map_err(status_from)?;
        let subscription = self
            .subscriptions
            .pause(&name, &request.reason, until)
            .await
            .map_err(status_from)?;
        let selector = Selector::none()
            .with_text("reason", &request.reason)
            .with_some("until", until.map(|until| until.to_rfc3339()));
        record(&who, "PauseSubscription", (&name).into(), &selector, 1);
        Ok(Response::new(convert::subscription(subscription)))
    }

    #[tracing::instrument(skip_all, fields(subscription = %request.get_ref().name))]
    async fn resume_subscription(
        &self,
        request: Request<proto::ResumeSubscriptionRequest>,
    ) -> Result<Response<proto::Subscription>, Status> {
        let who = admin(&request)?;
        let name =
            convert::subscription_name("name", &request.into_inner().name).map_err(status_from)?;
        let subscription = self
            .subscriptions
            .resume(&name)
            .await
            .map_err(status_from)?;
        record(
            &who,
            "ResumeSubscription",
            (&name).into(),
            &Selector::none(),
            1,
        );
        Ok(Response::new(convert::subscription(subscription)))
    }

    #[tracing::instrument(skip_all, fields(subscription = %request.get_ref().subscription))]
    async fn seek_subscription(
        &self,
        request: Request<proto::SeekSubscriptionRequest>,
    ) -> Result<Response<proto::SeekSubscriptionResponse>, Status> {
        let who = admin(&request)?;
        let request = request.into_inner();
        let name = convert::subscription_name("subscription", &request.subscription)
            .map_err(status_from)?;
        let to = request
            .to
            .ok_or_else(|| crate::error::Error::invalid("to", "is required"))
            .map_err(status_from)?;
        let to = convert::start_position("to", Some(to)).map_err(status_from)?;
        let selector = Selector::none().start("to", &to);
        self.subscriptions
            .seek(&name, to)
            .await
            .map_err(status_from)?;
        record(&who, "SeekSubscription", (&name).into(), &selector, 1);
        Ok(Response::new(proto::SeekSubscriptionResponse {}))
    }

    #[tracing::instrument(skip_all, fields(id = %request.get_ref().id))]
    async fn requeue_event(
        &self,
        request: Request<proto::RequeueEventRequest>,
    ) -> Result<Response<proto::RequeueResponse>, Status> {
        let who = admin(&request)?;
        let request = request.into_inner();
        let id = convert::event_id("id", &request.id).map_err(status_from)?;
        let subscription =
            convert::optional_subscription_name("subscription", &request.subscription)
                .map_err(status_from)?;
        let source = convert::optional_source("source", &request.source).map_err(status_from)?;
        let requeued_count = self
            .operations
            .requeue_event(
                id,
                subscription.as_ref(),
                source.as_ref(),
                request.forget_consumption,
            )
            .await
            .map_err(status_from)?;
        let mut selector = Selector::none().event(id, source.as_ref());
        if request.forget_consumption {
            selector = selector.with("forget_consumption", "true");
        }
        let target = subscription.as_ref().into();
        record(&who, "RequeueEvent", target, &selector, requeued_count);
        Ok(Response::new(proto::RequeueResponse { requeued_count }))
    }

    #[tracing::instrument(skip_all)]
    async fn requeue_latest(
        &self,
        request: Request<proto::RequeueLatestRequest>,
    ) -> Result<Response<proto::RequeueResponse>, Status> {
        let who = admin(&request)?;
        let request = request.into_inner();
        let subscription =
            convert::optional_subscription_name("subscription", &request.subscription)
                .map_err(status_from)?;
        let source = convert::optional_source("source", &request.source).map_err(status_from)?;
        let requeued_count = self
            .operations
            .requeue_latest(
                &request.aggregate_type,
                &request.aggregate_id,
                &request.event_type,
                subscription.as_ref(),
                source.as_ref(),
                request.forget_consumption,
            )
            .await
            .map_err(status_from)?;
        let mut selector = Selector::none()
            .with_text("aggregate_type", &request.aggregate_type)
            .with_text("aggregate_id", &request.aggregate_id);
        if !request.event_type.is_empty() {
            selector = selector.with("event_type", &request.event_type);
        }
        let mut selector = selector.with_some("source", source.as_ref());
        if request.forget_consumption {
            selector = selector.with("forget_consumption", "true");
        }
        let target = subscription.as_ref().into();
        record(&who, "RequeueLatest", target, &selector, requeued_count);
        Ok(Response::new(proto::RequeueResponse { requeued_count }))
    }

    #[tracing::instrument(skip_all, fields(subscription = %request.get_ref().subscription))]
    async fn list_dead_letters(
        &self,
        request: Request<proto::ListDeadLettersRequest>,
    ) -> Result<Response<proto::ListDeadLettersResponse>, Status> {
        auth::principal(&request)?
            .check_view()
            .map_err(status_from)?;
        let request = request.into_inner();
        let name = convert::subscription_name("subscription", &request.subscription)
            .map_err(status_from)?;
        let selection = convert::dead_letter_selection(convert::Selectors {
            ids: &[],
            event_types: &request.event_types,
            aggregate_type: &request.aggregate_type,
            aggregate_id: &request.aggregate_id,
            last_error: &request.last_error,
            dead_lettered_after: request.dead_lettered_after,
            dead_lettered_before: request.dead_lettered_before,
            source: &request.source,
        })
        .map_err(status_from)?;
        let page = match request.page_token.as_str() {
            "" => None,
            token => Some(PageToken::decode("page_token", token).map_err(status_from)?),
        };
        let page = self
            .operations
            .list_dead_letters(
                &name,
                &selection,
                request.include_resolved,
                request.page_size as usize,
                page,
            )
            .await
            .map_err(status_from)?;
        Ok(Response::new(proto::ListDeadLettersResponse {
            dead_letters: page
                .dead_letters
                .into_iter()
                .map(convert::dead_letter)
                .collect(),
            next_page_token: page
                .next_page
                .map(|token| token.encode())
                .unwrap_or_default(),
        }))
    }

    #[tracing::instrument(skip_all, fields(subscription = %request.get_ref().subscription))]
    async fn requeue_dead_letters(
        &self,
        request: Request<proto::RequeueDeadLettersRequest>,
    ) -> Result<Response<proto::RequeueResponse>, Status> {
        let who = admin(&request)?;
        let request = request.into_inner();
        let name = convert::subscription_name("subscription", &request.subscription)
            .map_err(status_from)?;
        let selection = convert::dead_letter_selection(convert::Selectors {
            ids: &request.ids,
            event_types: &request.event_types,
            aggregate_type: &request.aggregate_type,
            aggregate_id: &request.aggregate_id,
            last_error: &request.last_error,
            dead_lettered_after: request.dead_lettered_after,
            dead_lettered_before: request.dead_lettered_before,
            source: &request.source,
        })
        .map_err(status_from)?;
        let requeued_count = if request.validate_only {
            self.operations
                .count_requeue_dead_letters(&name, &selection, request.all)
                .await
                .map_err(status_from)?
        } else {
            let selector = Selector::none().dead_letters(&selection, request.all);
            let requeued = self
                .operations
                .requeue_dead_letters(&name, selection, request.all)
                .await
                .map_err(status_from)?;
            record(
                &who,
                "RequeueDeadLetters",
                (&name).into(),
                &selector,
                requeued,
            );
            requeued
        };
        Ok(Response::new(proto::RequeueResponse { requeued_count }))
    }

    #[tracing::instrument(skip_all, fields(subscription = %request.get_ref().subscription, id = %request.get_ref().id))]
    async fn resolve_dead_letter(
        &self,
        request: Request<proto::ResolveDeadLetterRequest>,
    ) -> Result<Response<proto::DeadLetter>, Status> {
        let who = admin(&request)?;
        let request = request.into_inner();
        let name = convert::subscription_name("subscription", &request.subscription)
            .map_err(status_from)?;
        let id = convert::event_id("id", &request.id).map_err(status_from)?;
        let source = convert::optional_source("source", &request.source).map_err(status_from)?;
        let dead_letter = self
            .operations
            .resolve_dead_letter(
                &name,
                id,
                &request.resolved_by,
                &request.notes,
                source.as_ref(),
            )
            .await
            .map_err(status_from)?;
        let selector = Selector::none().event(id, source.as_ref());
        record(&who, "ResolveDeadLetter", (&name).into(), &selector, 1);
        Ok(Response::new(convert::dead_letter(dead_letter)))
    }

    #[tracing::instrument(skip_all, fields(subscription = %request.get_ref().subscription))]
    async fn resolve_dead_letters(
        &self,
        request: Request<proto::ResolveDeadLettersRequest>,
    ) -> Result<Response<proto::ResolveDeadLettersResponse>, Status> {
        let who = admin(&request)?;
        let request = request.into_inner();
        let name = convert::subscription_name("subscription", &request.subscription)
            .map_err(status_from)?;
        let selection = convert::dead_letter_selection(convert::Selectors {
            ids: &request.ids,
            event_types: &request.event_types,
            aggregate_type: &request.aggregate_type,
            aggregate_id: &request.aggregate_id,
            last_error: &request.last_error,
            dead_lettered_after: request.dead_lettered_after,
            dead_lettered_before: request.dead_lettered_before,
            source: &request.source,
        })
        .map_err(status_from)?;
        let (by, notes) = (&request.resolved_by, &request.notes);
        let resolved_count = if request.validate_only {
            self.operations
                .count_resolve_dead_letters(&name, &selection, request.all, by, notes)
                .await
                .map_err(status_from)?
        } else {
            let selector = Selector::none().dead_letters(&selection, request.all);
            let resolved = self
                .operations
                .resolve_dead_letters(&name, selection, request.all, by, notes)
                .await
                .map_err(status_from)?;
            record(
                &who,
                "ResolveDeadLetters",
                (&name).into(),
                &selector,
                resolved,
            );
            resolved
        };
        Ok(Response::new(proto::ResolveDeadLettersResponse {
            resolved_count,
        }))
    }

    #[tracing::instrument(skip_all, fields(subscription = %request.get_ref().subscription))]
    async fn summarize_dead_letters(
        &self,
        request: Request<proto::SummarizeDeadLettersRequest>,
    ) -> Result<Response<proto::DeadLetterSummary>, Status> {
        auth::principal(&request)?
            .check_view()
            .map_err(status_from)?;
        let request = request.into_inner();
        let name = convert::subscription_name("subscription", &request.subscription)
            .map_err(status_from)?;
        let selection = DeadLetterSelection {
            source: convert::optional_source("source", &request.source).map_err(status_from)?,
            ..DeadLetterSelection::default()
        };
        let groups = self
            .operations
            .dead_letter_groups(&name, &selection)
            .await
            .map_err(status_from)?;
        Ok(Response::new(proto::DeadLetterSummary {
            groups: groups.into_iter().map(convert::dead_letter_group).collect(),
        }))
    }

    #[tracing::instrument(skip_all, fields(subscription = %request.get_ref().name))]
    async fn rotate_push_secret(
        &self,
        request: Request<proto::RotatePushSecretRequest>,
    ) -> Result<Response<proto::RotatePushSecretResponse>, Status> {
        let who = admin(&request)?;
        let request = request.into_inner();
        let name = convert::subscription_name("name", &request.name).map_err(status_from)?;
        let keep_previous_for =
            convert::optional_duration("keep_previous_for", request.keep_previous_for)
                .map_err(status_from)?;
        let (secret, previous_expires_at) = self
            .subscriptions
            .rotate_push_secret(&name, keep_previous_for)
            .await
            .map_err(status_from)?;
        let selector =
            Selector::none().with("previous_expires_at", previous_expires_at.to_rfc3339());
        record(&who, "RotatePushSecret", (&name).into(), &selector, 1);
        Ok(Response::new(proto::RotatePushSecretResponse {
            signing_secret: secret.text(),
            previous_expires_at: Some(convert::datetime_to_timestamp(previous_expires_at)),
        }))
    }

    #[tracing::instrument(skip_all, fields(id = %request.get_ref().id))]
    async fn get_event(
        &self,
        request: Request<proto::GetEventRequest>,
    ) -> Result<Response<proto::EventDeliveries>, Status> {
        auth::principal(&request)?
            .check_view()
            .map_err(status_from)?;
        let request = request.into_inner();
        let id = convert::event_id("id", &request.id).map_err(status_from)?;
        let source = convert::optional_source("source", &request.source).map_err(status_from)?;
        let found = self
            .operations
            .event_deliveries(id, source.as_ref())
            .await
            .map_err(status_from)?;
        Ok(Response::new(convert::event_deliveries(found)))
    }

    #[tracing::instrument(skip_all)]
    async fn get_stats(
        &self,
        request: Request<proto::GetStatsRequest>,
    ) -> Result<Response<proto::Stats>, Status> {
        auth::principal(&request)?
            .check_view()
            .map_err(status_from)?;
        let name =
            convert::optional_subscription_name("subscription", &request.into_inner().subscription)
                .map_err(status_from)?;
        let (subscriptions, outbox) = self
            .operations
            .stats(name.as_ref())
            .await
            .map_err(status_from)?;
        Ok(Response::new(convert::stats(subscriptions, outbox)))
    }

    #[tracing::instrument(skip_all)]
    async fn list_sources(
        &self,
        request: Request<proto::ListSourcesRequest>,
    ) -> Result<Response<proto::ListSourcesResponse>, Status> {
        auth::principal(&request)?
            .check_admin()
            .map_err(status_from)?;
        let sources = self.operations.sources_status().await;
        Ok(Response::new(proto::ListSourcesResponse {
            sources: sources.into_iter().map(convert::source_status).collect(),
        }))
    }

    #[tracing::instrument(skip_all)]
    async fn list_sinks(
        &self,
        request: Request<proto::ListSinksRequest>,
    ) -> Result<Response<proto::ListSinksResponse>, Status> {
        auth::principal(&request)?
            .check_admin()
            .map_err(status_from)?;
        let sinks = self.subscriptions.sinks().await;
        Ok(Response::new(proto::ListSinksResponse {
            sinks: sinks
                .into_iter()
                .map(|sink| proto::Sink {
                    name: sink.name,
                    kind: sink.kind.to_string(),
                    reachable: sink.reachable.is_ok(),
                    error: sink.reachable.err().unwrap_or_default(),
                })
                .collect(),
        }))
    }
}

/// The name of a caller with the admin role; refuses anyone else.
fn admin<T>(request: &Request<T>) -> Result<String, Status> {
    let principal = auth::principal(request)?;
    principal.check_admin().map_err(status_from)?;
    Ok(principal.name.clone())
}

/// The audit line of a change made over gRPC.
fn record(
    who: &str,
    rpc: &str,
    subscription: audit::Target<'_>,
    selector: &Selector,
    changed: u64,
) {
    audit::record(who, Via::Grpc, rpc, subscription, selector, changed);
}
