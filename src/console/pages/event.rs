//! The event page: finding an event by id, where it stands with each subscription, and
//! requeueing it.

use axum::{
    body::Bytes,
    extract::{Path, RawQuery, State},
    http::HeaderMap,
    response::{IntoResponse, Redirect},
};

use super::{Page, authorize_action, plural, record};
use crate::{
    audit::Selector,
    console::{
        Console,
        params::{self, Params},
        session::Session,
        views,
    },
    error::Error,
};

pub async fn find_event(
    State(console): State<Console>,
    session: Session,
    RawQuery(query): RawQuery,
) -> Page {
    session.principal.check_view()?;
    let query = Params::parse(query.unwrap_or_default().as_bytes());
    if let Some(id) = query.get("id") {
        let id = params::event_id("id", id)?;
        let source = params::source(&query)?;
        return Ok(Redirect::to(&views::event_href(id, source.as_ref())).into_response());
    }
    let frame = console.frame(&session);
    let aggregate = match (query.get("aggregate_type"), query.get("aggregate_id")) {
        (None, None) => return Ok(views::find_event(&frame, None).into_response()),
        (Some(_), None) => {
            return Err(Error::invalid("aggregate_id", "is required with aggregate_type").into());
        }
        (None, Some(_)) => {
            return Err(Error::invalid("aggregate_type", "is required with aggregate_id").into());
        }
        (Some(kind), Some(id)) => (kind, id),
    };
    let events = console
        .inner
        .operations
        .aggregate_events(aggregate.0, aggregate.1)
        .await?;
    Ok(views::find_event(&frame, Some((aggregate.0, aggregate.1, &events))).into_response())
}

pub async fn event(
    State(console): State<Console>,
    Path(id): Path<String>,
    session: Session,
    RawQuery(query): RawQuery,
) -> Page {
    session.principal.check_view()?;
    let id = params::event_id("id", &id)?;
    let query = Params::parse(query.unwrap_or_default().as_bytes());
    let source = params::source(&query)?;
    let found = console
        .inner
        .operations
        .event_deliveries(id, source.as_ref())
        .await?;
    let frame = console.frame(&session);
    Ok(views::event(&frame, &found).into_response())
}

pub async fn requeue_event(
    State(console): State<Console>,
    Path(id): Path<String>,
    session: Session,
    headers: HeaderMap,
    body: Bytes,
) -> Page {
    let form = Params::parse(&body);
    authorize_action(&session, &headers, &form)?;
    let id = params::event_id("id", &id)?;
    let subscription = form
        .get("subscription")
        .map(params::subscription_name)
        .transpose()?;
    let source = params::source(&form)?;
    let requeued = console
        .inner
        .operations
        .requeue_event(id, subscription.as_ref(), source.as_ref(), false)
        .await?;
    let selector = Selector::none().event(id, source.as_ref());
    let target = subscription.as_ref().into();
    record(&session, "requeue-event", target, &selector, requeued);
    let on = subscription.map_or("every matching subscription".to_owned(), |name| {
        name.to_string()
    });
    console.notify(
        &session,
        format!(
            "Requeued event {id} on {on} ({requeued} delivery record{}).",
            plural(requeued)
        ),
    );
    Ok(Redirect::to(&views::event_href(id, source.as_ref())).into_response())
}
