//! The overview page: every subscription with its stats and state.

use axum::{extract::State, response::IntoResponse};
use chrono::Utc;

use super::Page;
use crate::{
    console::{Console, ConsoleError, session::Session, views},
    domain::{SubscriptionId, SubscriptionName},
};

pub async fn overview(State(console): State<Console>, session: Session) -> Page {
    session.principal.check_view()?;
    let inner = &console.inner;
    let (reports, outbox) = inner.operations.stats(None).await?;
    let ids = subscription_ids(&console).await?;
    let streams = inner.relay.stream_counts();
    let mut rows: Vec<views::OverviewRow> = reports
        .into_iter()
        .map(|report| views::OverviewRow {
            status: report.status,
            rates: inner.rates.of(&report.total.name),
            streams: ids
                .get(&report.total.name)
                .and_then(|id| streams.get(id))
                .copied()
                .unwrap_or(0),
            stats: report.total,
            error: report.error,
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
) -> Result<std::collections::HashMap<SubscriptionName, SubscriptionId>, ConsoleError> {
    Ok(console
        .inner
        .subscriptions
        .list()
        .await?
        .into_iter()
        .map(|subscription| (subscription.name, subscription.id))
        .collect())
}
