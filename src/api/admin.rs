//! `outbox.v1.Admin`.

use tonic::{Request, Response, Status};

use super::convert;
use crate::{
    proto::{self, admin_server::Admin as AdminService},
    subscriptions::Subscriptions,
};

pub struct AdminApi {
    subscriptions: Subscriptions,
}

impl AdminApi {
    pub fn new(subscriptions: Subscriptions) -> Self {
        AdminApi { subscriptions }
    }
}

#[tonic::async_trait]
impl AdminService for AdminApi {
    #[tracing::instrument(skip_all)]
    async fn create_subscription(
        &self,
        request: Request<proto::CreateSubscriptionRequest>,
    ) -> Result<Response<proto::Subscription>, Status> {
        let (name, settings, start) = convert::new_subscription(request.into_inner().subscription)?;
        let subscription = self.subscriptions.create(name, settings, start).await?;
        Ok(Response::new(convert::subscription(subscription)))
    }

    #[tracing::instrument(skip_all, fields(name = %request.get_ref().name))]
    async fn get_subscription(
        &self,
        request: Request<proto::GetSubscriptionRequest>,
    ) -> Result<Response<proto::Subscription>, Status> {
        let name = convert::subscription_name("name", &request.into_inner().name)?;
        let subscription = self.subscriptions.get(&name).await?;
        Ok(Response::new(convert::subscription(subscription)))
    }

    #[tracing::instrument(skip_all)]
    async fn list_subscriptions(
        &self,
        _request: Request<proto::ListSubscriptionsRequest>,
    ) -> Result<Response<proto::ListSubscriptionsResponse>, Status> {
        let subscriptions = self.subscriptions.list().await?;
        Ok(Response::new(proto::ListSubscriptionsResponse {
            subscriptions: subscriptions
                .into_iter()
                .map(convert::subscription)
                .collect(),
        }))
    }

    #[tracing::instrument(skip_all, fields(name = %request.get_ref().name))]
    async fn delete_subscription(
        &self,
        request: Request<proto::DeleteSubscriptionRequest>,
    ) -> Result<Response<proto::DeleteSubscriptionResponse>, Status> {
        let name = convert::subscription_name("name", &request.into_inner().name)?;
        self.subscriptions.delete(&name).await?;
        Ok(Response::new(proto::DeleteSubscriptionResponse {}))
    }
}
