//! `outbox.v1.Publisher`.

use tonic::{Request, Response, Status};

use super::{auth, convert, status_from};
use crate::{
    domain::SourceName,
    proto::{self, publisher_server::Publisher as PublisherService},
    publish::Publisher,
    telemetry,
};

pub struct PublisherApi {
    publisher: Publisher,
}

impl PublisherApi {
    pub fn new(publisher: Publisher) -> Self {
        PublisherApi { publisher }
    }
}

#[tonic::async_trait]
impl PublisherService for PublisherApi {
    #[tracing::instrument(skip_all, fields(batch_size = request.get_ref().events.len()))]
    async fn publish(
        &self,
        request: Request<proto::PublishRequest>,
    ) -> Result<Response<proto::PublishResponse>, Status> {
        let principal = auth::principal(&request)?.clone();
        let trace = telemetry::trace_headers(request.metadata());
        let request = request.into_inner();
        let source = convert::optional_source("source", &request.source)
            .map_err(status_from)?
            .unwrap_or_else(SourceName::default_source);
        let events = request
            .events
            .into_iter()
            .enumerate()
            .map(|(index, input)| convert::new_event(index, input))
            .collect::<Result<Vec<_>, _>>()
            .map_err(status_from)?;
        principal
            .check_publish(&events, &source)
            .map_err(status_from)?;
        let results = self
            .publisher
            .publish(&source, events, &trace)
            .await
            .map_err(status_from)?;
        Ok(Response::new(proto::PublishResponse {
            results: results
                .into_iter()
                .map(|published| proto::PublishResult {
                    id: published.id.to_string(),
                    duplicate: published.duplicate,
                })
                .collect(),
        }))
    }
}
