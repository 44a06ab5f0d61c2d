//! `outbox.v1.Subscriber`.

use std::pin::Pin;

use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use super::{auth, convert, status_from};
use crate::{
    delivery::{MAX_EXTENSION, Relay},
    domain::MIN_ACK_DEADLINE,
    error::Error,
    proto::{self, subscriber_server::Subscriber as SubscriberService},
};

/// Most ack ids in one Ack or ExtendAckDeadline call.
const MAX_ACK_IDS: usize = 10_000;

pub struct SubscriberApi {
    relay: Relay,
}

impl SubscriberApi {
    pub fn new(relay: Relay) -> Self {
        SubscriberApi { relay }
    }
}

type DeliveryStream = Pin<Box<dyn Stream<Item = Result<proto::Delivery, Status>> + Send>>;

#[tonic::async_trait]
impl SubscriberService for SubscriberApi {
    type SubscribeStream = DeliveryStream;

    #[tracing::instrument(skip_all, fields(subscription = %request.get_ref().subscription))]
    async fn subscribe(
        &self,
        request: Request<proto::SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        let principal = auth::principal(&request)?.clone();
        let request = request.into_inner();
        let name = convert::subscription_name("subscription", &request.subscription)
            .map_err(status_from)?;
        principal.check_subscription(&name).map_err(status_from)?;
        let stream = self
            .relay
            .subscribe(
                &name,
                request.max_in_flight,
                request.max_in_flight_bytes,
                request.max_deliveries,
            )
            .await
            .map_err(status_from)?;
        let ack_writer = stream.ack_writer();
        let stream = stream.map(move |item| {
            item.map(|delivery| convert::delivery(delivery, &ack_writer))
                .map_err(status_from)
        });
        Ok(Response::new(Box::pin(stream)))
    }

    #[tracing::instrument(skip_all, fields(subscription = %request.get_ref().subscription, count = request.get_ref().ack_ids.len()))]
    async fn ack(
        &self,
        request: Request<proto::AckRequest>,
    ) -> Result<Response<proto::AckResponse>, Status> {
        let principal = auth::principal(&request)?.clone();
        let request = request.into_inner();
        let name = convert::subscription_name("subscription", &request.subscription)
            .map_err(status_from)?;
        principal.check_subscription(&name).map_err(status_from)?;
        check_count(&request.ack_ids).map_err(status_from)?;
        let sources = self.relay.sources();
        let acks = convert::ack_ids("ack_ids", &request.ack_ids, sources).map_err(status_from)?;
        let outcome = self.relay.ack(&name, &acks).await.map_err(status_from)?;
        Ok(Response::new(proto::AckResponse {
            stale_ack_ids: convert::as_requested(&request.ack_ids, &acks, &outcome.stale),
            unavailable_ack_ids: convert::as_requested(
                &request.ack_ids,
                &acks,
                &outcome.unavailable,
            ),
        }))
    }

    #[tracing::instrument(skip_all, fields(subscription = %request.get_ref().subscription))]
    async fn nack(
        &self,
        request: Request<proto::NackRequest>,
    ) -> Result<Response<proto::NackResponse>, Status> {
        let principal = auth::principal(&request)?.clone();
        let request = request.into_inner();
        let name = convert::subscription_name("subscription", &request.subscription)
            .map_err(status_from)?;
        principal.check_subscription(&name).map_err(status_from)?;
        let ack = convert::ack_id("ack_id", &request.ack_id, self.relay.sources())
            .map_err(status_from)?;
        let retry_after =
            convert::optional_duration("retry_after", request.retry_after).map_err(status_from)?;
        let outcome = self
            .relay
            .nack(
                &name,
                ack,
                &request.reason,
                retry_after,
                request.dead_letter,
            )
            .await
            .map_err(status_from)?
            .ok_or_else(|| {
                Error::FailedPrecondition(format!(
                    "ack_id: {} is stale: its lease expired or the delivery was settled",
                    request.ack_id
                ))
            })
            .map_err(status_from)?;
        Ok(Response::new(proto::NackResponse {
            dead_lettered: outcome.dead_lettered,
            retry_at: outcome.retry_at.map(convert::datetime_to_timestamp),
        }))
    }

    #[tracing::instrument(skip_all, fields(subscription = %request.get_ref().subscription, count = request.get_ref().ack_ids.len()))]
    async fn extend_ack_deadline(
        &self,
        request: Request<proto::ExtendAckDeadlineRequest>,
    ) -> Result<Response<proto::ExtendAckDeadlineResponse>, Status> {
        let principal = auth::principal(&request)?.clone();
        let request = request.into_inner();
        let name = convert::subscription_name("subscription", &request.subscription)
            .map_err(status_from)?;
        principal.check_subscription(&name).map_err(status_from)?;
        check_count(&request.ack_ids).map_err(status_from)?;
        let acks = convert::ack_ids("ack_ids", &request.ack_ids, self.relay.sources())
            .map_err(status_from)?;
        let extension = convert::optional_duration("extension", request.extension)
            .map_err(status_from)?
            .ok_or_else(|| Error::invalid("extension", "is required"))
            .map_err(status_from)?;
        if !(MIN_ACK_DEADLINE..=MAX_EXTENSION).contains(&extension) {
            return Err(status_from(Error::invalid(
                "extension",
                format!(
                    "must be between {} and {}",
                    humantime::format_duration(MIN_ACK_DEADLINE),
                    humantime::format_duration(MAX_EXTENSION)
                ),
            )));
        }
        let stale = self
            .relay
            .extend(&name, &acks, extension)
            .await
            .map_err(status_from)?;
        Ok(Response::new(proto::ExtendAckDeadlineResponse {
            stale_ack_ids: convert::as_requested(&request.ack_ids, &acks, &stale),
        }))
    }
}

fn check_count(ack_ids: &[String]) -> Result<(), Error> {
    if ack_ids.len() > MAX_ACK_IDS {
        return Err(Error::invalid(
            "ack_ids",
            format!(
                "has {} ids, more than the limit of {MAX_ACK_IDS}",
                ack_ids.len()
            ),
        ));
    }
    Ok(())
}
