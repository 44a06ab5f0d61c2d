//! The subscription page — its settings, stats and dead letters — and its actions:
//! requeue or resolve dead letters, seek, pause, resume.

use axum::{
    body::Bytes,
    extract::{Path, RawQuery, State},
    http::HeaderMap,
    response::{IntoResponse, Redirect},
};
use chrono::Utc;

use super::{Page, authorize_action, plural, record};
use crate::{
    audit::Selector,
    console::{
        Console,
        params::{self, Params},
        session::Session,
        views,
    },
    domain::{DeadLetterSelection, SourceName, SubscriptionName},
    error::Error,
};

/// The parameters of the dead-letter listing (its filter, the zone its times are in, its
/// page size), carried from page to action and back.
const FILTER_FIELDS: [&str; 9] = [
    "event_type",
    "aggregate_type",
    "aggregate_id",
    "error",
    "after",
    "before",
    "source",
    "tz",
    "page_size",
];

pub async fn subscription(
    State(console): State<Console>,
    Path(name): Path<String>,
    session: Session,
    RawQuery(query): RawQuery,
) -> Page {
    session.principal.check_view()?;
    let name = params::subscription_name(&name)?;
    let query = Params::parse(query.unwrap_or_default().as_bytes());
    let filter = params::dead_letter_filter(&query)?;
    let include_resolved = query.flag("include_resolved")?;
    let page_size = params::page_size(&query)?;
    let page = params::page(&query)?;
    let paged = page.is_some();
    let inner = &console.inner;
    let subscription = inner.subscriptions.get(&name).await?;
    let (reports, outbox) = inner.operations.stats(Some(&name)).await?;
    let report = reports
        .into_iter()
        .next()
        .ok_or_else(|| Error::NotFound(format!("subscription {name:?} does not exist")))?;
    let groups = inner
        .operations
        .dead_letter_groups(&name, &DeadLetterSelection::default())
        .await?;
    let sources: Vec<SourceName> = inner
        .relay
        .sources()
        .of(&subscription)
        .iter()
        .map(|source| source.name.clone())
        .collect();
    let matching = inner
        .operations
        .count_dead_letters(&name, &filter, include_resolved)
        .await?;
    let listing = inner
        .operations
        .list_dead_letters(&name, &filter, include_resolved, page_size, page)
        .await?;
    let carried = carried_filter(&query);
    let streams = inner
        .relay
        .stream_counts()
        .get(&subscription.id)
        .copied()
        .unwrap_or(0);
    let rates = inner.rates.of(&name);
    let frame = console.frame(&session);
    let view = views::SubscriptionView {
        subscription: &subscription,
        status: &report.status,
        stats: &report.total,
        per_source: &report.per_source,
        sources: &sources,
        outbox: &outbox,
        rates: rates.as_ref(),
        sink: report.sink.as_ref(),
        streams,
        groups: &groups,
        matching,
        dead_letters: &listing.dead_letters,
        next_page: listing.next_page,
        filter: &carried,
        include_resolved,
        paged,
        now: Utc::now(),
    };
    Ok(views::subscription(&frame, &view).into_response())
}

/// The filter parameters a query or form gave, as given.
fn carried_filter(params: &Params) -> Vec<(&'static str, String)> {
    FILTER_FIELDS
        .iter()
        .filter_map(|field| Some((*field, params.get(field)?.to_owned())))
        .collect()
}

/// What a dead-letter form asks for.
#[derive(Clone, Copy)]
enum Verb {
    Requeue,
    Resolve,
}

pub async fn dead_letter_action(
    State(console): State<Console>,
    Path(name): Path<String>,
    session: Session,
    headers: HeaderMap,
    body: Bytes,
) -> Page {
    let form = Params::parse(&body);
    authorize_action(&session, &headers, &form)?;
    let name = params::subscription_name(&name)?;
    let (verb, matching) = match form.get("action") {
        Some("requeue-selected") => (Verb::Requeue, false),
        Some("requeue-matching") => (Verb::Requeue, true),
        Some("resolve-selected") => (Verb::Resolve, false),
        Some("resolve-matching") => (Verb::Resolve, true),
        Some(_) | None => {
            return Err(Error::invalid(
                "action",
                "must be requeue-selected, requeue-matching, resolve-selected or resolve-matching",
            )
            .into());
        }
    };
    let filter = params::dead_letter_filter(&form)?;
    let include_resolved = form.flag("include_resolved")?;
    let (selection, chosen) = if matching {
        let chosen = describe_filter(&filter);
        (filter, chosen)
    } else {
        let ids = params::event_ids(&form)?;
        let chosen = format!("chosen by id ({} selected)", ids.len());
        (
            DeadLetterSelection {
                ids,
                ..DeadLetterSelection::default()
            },
            chosen,
        )
    };
    let notes = form.get("notes").unwrap_or_default();
    let resolver = session.principal.name.as_str();
    let operations = &console.inner.operations;
    let back = filtered_page(&name, &form, include_resolved);
    if !form.flag("confirm")? {
        let count = match verb {
            Verb::Requeue => {
                operations
                    .count_requeue_dead_letters(&name, &selection, matching)
                    .await?
            }
            Verb::Resolve => {
                operations
                    .count_resolve_dead_letters(&name, &selection, matching, resolver, notes)
                    .await?
            }
        };
        let mut names = vec!["csrf", "action", "id", "notes", "include_resolved"];
        names.extend(FILTER_FIELDS);
        let fields = resubmitted(&form, &names);
        let frame = console.frame(&session);
        let confirmation = views::DeadLetterConfirmation {
            subscription: &name,
            verb: match verb {
                Verb::Requeue => "requeue",
                Verb::Resolve => "resolve",
            },
            count,
            chosen,
            notes,
            fields,
            back,
        };
        return Ok(views::confirm_dead_letters(&frame, &confirmation).into_response());
    }
    let action = form.get("action").unwrap_or_default();
    let selector = Selector::none().dead_letters(&selection, matching);
    let text = match verb {
        Verb::Requeue => {
            let requeued = operations
                .requeue_dead_letters(&name, selection, matching)
                .await?;
            record(&session, action, (&name).into(), &selector, requeued);
            format!(
                "Requeued {requeued} dead letter{} of {name}.",
                plural(requeued)
            )
        }
        Verb::Resolve => {
            let resolved = operations
                .resolve_dead_letters(&name, selection, matching, resolver, notes)
                .await?;
            record(&session, action, (&name).into(), &selector, resolved);
            format!(
                "Resolved {resolved} dead letter{} of {name}.",
                plural(resolved)
            )
        }
    };
    console.notify(&session, text);
    Ok(Redirect::to(&back).into_response())
}

/// The unresolved dead letters a filter takes, in words, for the confirmation (requeues
/// and resolves by filter take unresolved dead letters only).
fn describe_filter(filter: &DeadLetterSelection) -> String {
    let mut parts = Vec::new();
    if !filter.event_types.is_empty() {
        parts.push(format!(
            "of event type {}",
            filter.event_types.to_strings().join(" or ")
        ));
    }
    match (&filter.aggregate_type, &filter.aggregate_id) {
        (Some(kind), Some(id)) => parts.push(format!("of aggregate {kind}/{id}")),
        (Some(kind), None) => parts.push(format!("of aggregate type {kind}")),
        (None, Some(id)) => parts.push(format!("of aggregate id {id}")),
        (None, None) => {}
    }
    if let Some(error) = &filter.last_error {
        parts.push(format!("whose last error is {error:?}"));
    }
    let format_time = |time: chrono::DateTime<Utc>| time.format("%Y-%m-%d %H:%M:%S UTC");
    if let Some(after) = filter.dead_lettered_after {
        parts.push(format!("dead-lettered from {}", format_time(after)));
    }
    if let Some(before) = filter.dead_lettered_before {
        parts.push(format!("dead-lettered before {}", format_time(before)));
    }
    if parts.is_empty() {
        "all unresolved ones".to_owned()
    } else {
        format!("the unresolved ones {}", parts.join(", "))
    }
}

/// The form's fields named in `names`, to send again.
fn resubmitted(form: &Params, names: &[&str]) -> Vec<(String, String)> {
    names
        .iter()
        .flat_map(|name| {
            form.all(name)
                .map(|value| ((*name).to_owned(), value.to_owned()))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The subscription page with the form's filter.
fn filtered_page(name: &SubscriptionName, form: &Params, include_resolved: bool) -> String {
    let mut query = form_urlencoded::Serializer::new(String::new());
    for (field, value) in carried_filter(form) {
        query.append_pair(field, &value);
    }
    if include_resolved {
        query.append_pair("include_resolved", "on");
    }
    format!("/subscriptions/{name}?{}#dead-letters", query.finish())
}

pub async fn seek(
    State(console): State<Console>,
    Path(name): Path<String>,
    session: Session,
    headers: HeaderMap,
    body: Bytes,
) -> Page {
    let form = Params::parse(&body);
    authorize_action(&session, &headers, &form)?;
    let name = params::subscription_name(&name)?;
    let to = params::seek_target(&form)?;
    let subscriptions = &console.inner.subscriptions;
    if !form.flag("confirm")? {
        // Only an existing subscription is worth confirming.
        subscriptions.get(&name).await?;
        let fields = resubmitted(&form, &["csrf", "to", "time", "tz"]);
        let frame = console.frame(&session);
        return Ok(views::confirm_seek(&frame, &name, &to, &fields).into_response());
    }
    let selector = Selector::none().start("to", &to);
    subscriptions.seek(&name, to).await?;
    record(&session, "seek", (&name).into(), &selector, 1);
    console.notify(&session, format!("Moved the read position of {name}."));
    Ok(Redirect::to(&views::subscription_href(&name)).into_response())
}

/// Pausing is reversible at once, so it asks for no confirmation.
pub async fn pause(
    State(console): State<Console>,
    Path(name): Path<String>,
    session: Session,
    headers: HeaderMap,
    body: Bytes,
) -> Page {
    let form = Params::parse(&body);
    authorize_action(&session, &headers, &form)?;
    let name = params::subscription_name(&name)?;
    let reason = form.get("reason").unwrap_or_default();
    console
        .inner
        .subscriptions
        .pause(&name, reason, None)
        .await?;
    let selector = Selector::none().with_text("reason", reason);
    record(&session, "pause", (&name).into(), &selector, 1);
    console.notify(
        &session,
        format!("Paused {name}: nothing new goes out until it is resumed."),
    );
    Ok(Redirect::to(&views::subscription_href(&name)).into_response())
}

pub async fn resume(
    State(console): State<Console>,
    Path(name): Path<String>,
    session: Session,
    headers: HeaderMap,
    body: Bytes,
) -> Page {
    let form = Params::parse(&body);
    authorize_action(&session, &headers, &form)?;
    let name = params::subscription_name(&name)?;
    console.inner.subscriptions.resume(&name).await?;
    record(&session, "resume", (&name).into(), &Selector::none(), 1);
    console.notify(&session, format!("Resumed {name}."));
    Ok(Redirect::to(&views::subscription_href(&name)).into_response())
}
