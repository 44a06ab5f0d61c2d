//! The overview page: every subscription with its figures and state.

use axum::{extract::State, response::IntoResponse};
use chrono::Utc;

use super::Page;
use crate::{
    console::{Console, ConsoleError, session::Session, views},
    domain::SubscriptionName,
};

pub async fn overview(State(console): State<Console>, session: Session) -> Page {
    session.principal.check_view()?;
    let inner = &console.inner;
    let (figures, outbox) = inner.operations.stats(None).await?;
    let ids = subscription_ids(&console).await?;
    let streams = inner.relay.stream_counts();
    let mut rows: Vec<views::OverviewRow> = figures
        .into_iter()
        .map(|figures| views::OverviewRow {
            status: figures.status,
            rates: inner.rates.of(&figures.total.name),
            streams: ids
                .get(&figures.total.name)
                .and_then(|id| streams.get(id))
                .copied()
                .unwrap_or(0),
            stats: figures.total,
            error: figures.error,
        })
        .collect();
    // Those that need a look first, most pressing on top; by name within a status.
    rows.sort_by_key(|row| row.status.kind());
    let sources = inner.operations.sources_status().await;
    let frame = console.frame(&session);
    Ok(views::overview(&frame, &rows, &outbox, &sources, Utc::now()).into_response())
}

async fn subscription_ids(
    console: &Console,
) -> Result<std::collections::HashMap<SubscriptionName, i64>, ConsoleError> {
    Ok(console
        .inner
        .subscriptions
        .list()
        .await?
        .into_iter()
        .map(|subscription| (subscription.name, subscription.id))
        .collect())
}
