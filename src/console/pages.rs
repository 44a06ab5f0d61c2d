//! The console's handlers: each checks the session (and, for an action, its CSRF token
//! and the admin role), parses the query or form into domain values, calls the core and
//! renders a page or redirects to one.

use axum::{
    body::Bytes,
    extract::{Path, RawQuery, State},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Redirect, Response},
};
use chrono::Utc;
use url::{Position, Url};

use super::{
    Console, ConsoleError,
    params::{self, Params},
    session::{Notice, Session, SessionState},
    views::{self, Frame},
};
use crate::{
    audit::{self, Selector, Via},
    domain::{DeadLetterSelection, SourceName, SubscriptionName},
    error::Error,
};

type Page = Result<Response, ConsoleError>;

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

impl Console {
    fn frame(&self, session: &Session) -> Frame {
        Frame {
            user: session.principal.name.clone(),
            admin: session.principal.is_admin(),
            signed_in: self.inner.authenticator.is_some(),
            csrf: session.csrf.clone(),
            notice: self.inner.sessions.take_notice(session),
        }
    }

    /// Shows `text` on the next page of this session.
    fn notify(&self, session: &Session, text: String) {
        self.inner.sessions.set_notice(
            session,
            Notice {
                success: true,
                text,
            },
        );
    }
}

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
    let (figures, outbox) = inner.operations.stats(Some(&name)).await?;
    let figures = figures
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
        status: &figures.status,
        stats: &figures.total,
        per_source: &figures.per_source,
        sources: &sources,
        outbox: &outbox,
        rates: rates.as_ref(),
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

fn plural(count: u64) -> &'static str {
    if count == 1 { "" } else { "s" }
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
        .requeue_event(id, subscription.as_ref(), source.as_ref())
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

pub async fn sign_in_page(
    State(console): State<Console>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> Page {
    let query = Params::parse(query.unwrap_or_default().as_bytes());
    let next = local_path(query.get("next"))?;
    if console.inner.authenticator.is_none() || is_signed_in(&console, &headers) {
        return Ok(Redirect::to(&next).into_response());
    }
    Ok(views::sign_in(&next, None, query.flag("ended").unwrap_or(false)).into_response())
}

fn is_signed_in(console: &Console, headers: &HeaderMap) -> bool {
    let cookie = headers
        .get(header::COOKIE)
        .and_then(|value| value.to_str().ok());
    matches!(console.inner.sessions.find(cookie), SessionState::Active(_))
}

pub async fn sign_in(State(console): State<Console>, headers: HeaderMap, body: Bytes) -> Page {
    same_origin(&headers)?;
    let form = Params::parse(&body);
    // Before the token: a refused `next` starts no session.
    let next = local_path(form.get("next"))?;
    let Some(authenticator) = &console.inner.authenticator else {
        return Ok(Redirect::to(&next).into_response());
    };
    let refused = |status: StatusCode, message: &str| -> Page {
        Ok((status, views::sign_in(&next, Some(message), false)).into_response())
    };
    let Some(token) = form.get("token") else {
        return refused(StatusCode::BAD_REQUEST, "token: enter a token to sign in.");
    };
    let principal = match authenticator.authenticate_token(token) {
        Ok(principal) => principal,
        Err(_) => {
            tracing::info!("refused a console sign-in with an unknown token");
            return refused(
                StatusCode::UNAUTHORIZED,
                "That token is not known to this gateway.",
            );
        }
    };
    if let Err(error) = principal.check_view() {
        tracing::info!(principal = %principal.name, "refused a console sign-in without the viewer or admin role");
        return refused(StatusCode::FORBIDDEN, &error.to_string());
    }
    tracing::info!(principal = %principal.name, admin = principal.is_admin(), "console sign-in");
    let (_, cookie) = console.inner.sessions.create(principal);
    let mut response = Redirect::to(&next).into_response();
    if let Ok(cookie) = HeaderValue::from_str(&cookie) {
        response.headers_mut().append(header::SET_COOKIE, cookie);
    }
    Ok(response)
}

pub async fn sign_out(
    State(console): State<Console>,
    session: Session,
    headers: HeaderMap,
    body: Bytes,
) -> Page {
    same_origin(&headers)?;
    session.check_csrf(Params::parse(&body).get("csrf"))?;
    let sessions = &console.inner.sessions;
    sessions.remove(&session);
    let mut response = Redirect::to("/sign-in").into_response();
    if let Ok(cookie) = HeaderValue::from_str(&sessions.removal_cookie()) {
        response.headers_mut().append(header::SET_COOKIE, cookie);
    }
    Ok(response)
}

pub async fn asset(Path(file): Path<String>) -> Page {
    let (content_type, body): (&str, &'static str) = match file.as_str() {
        "console.css" => (
            "text/css; charset=utf-8",
            include_str!("assets/console.css"),
        ),
        "console.js" => (
            "text/javascript; charset=utf-8",
            include_str!("assets/console.js"),
        ),
        "favicon.svg" => ("image/svg+xml", include_str!("assets/favicon.svg")),
        _ => return Err(ConsoleError::NoPage),
    };
    Ok((
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "public, max-age=300"),
        ],
        body,
    )
        .into_response())
}

pub async fn not_found() -> ConsoleError {
    ConsoleError::NoPage
}

/// The audit line of a change made in the console.
fn record(
    session: &Session,
    action: &str,
    subscription: audit::Target<'_>,
    selector: &Selector,
    changed: u64,
) {
    let who = session.principal.name.as_str();
    audit::record(who, Via::Console, action, subscription, selector, changed);
}

/// An action needs the session's CSRF token, a request from the console's own pages and
/// the admin role.
fn authorize_action(
    session: &Session,
    headers: &HeaderMap,
    form: &Params,
) -> Result<(), ConsoleError> {
    same_origin(headers)?;
    session.check_csrf(form.get("csrf"))?;
    session.principal.check_admin()?;
    Ok(())
}

/// Refuses a form that the browser says another site sent: by its Sec-Fetch-Site header
/// where it sends one, else by its Origin. (The CSRF token is the main defence; this one
/// also covers the sign-in form, which has no session yet.)
fn same_origin(headers: &HeaderMap) -> Result<(), ConsoleError> {
    let header = |name| {
        headers
            .get(name)
            .and_then(|value: &HeaderValue| value.to_str().ok())
    };
    if let Some(site) = header("sec-fetch-site") {
        return match site {
            "same-origin" | "none" => Ok(()),
            _ => Err(ConsoleError::Forgery),
        };
    }
    if let (Some(origin), Some(host)) = (header("origin"), header("host"))
        && origin != "null"
        && origin.split_once("://").map_or(origin, |(_, rest)| rest) != host
    {
        return Err(ConsoleError::Forgery);
    }
    Ok(())
}

/// A path on this console to return to after signing in; anything else is the overview.
/// Only a path that a browser reads exactly as written qualifies: browsers drop tabs and
/// newlines from a Location and read `\\` as `/`, so `/\t/evil.example` or
/// `/\\evil.example` would leave for another host, and a path the URL parser rewrites
/// (dot segments, characters it percent-encodes) is not what was checked. What comes back
/// is therefore already percent-encoded and safe as a Location. Control characters are
/// refused outright: no link of the console carries them.
fn local_path(next: Option<&str>) -> Result<String, ConsoleError> {
    let Some(next) = next else {
        return Ok("/".to_owned());
    };
    if next.chars().any(char::is_control) {
        return Err(Error::invalid(
            "next",
            "must not contain control characters (it is the console path to return to after signing in)",
        )
        .into());
    }
    Ok(same_origin_path(next).unwrap_or_else(|| "/".to_owned()))
}

/// `next` when it is a path and query of this console that parses to itself.
fn same_origin_path(next: &str) -> Option<String> {
    if !next.starts_with('/')
        || next.starts_with("//")
        || next.contains('\\')
        || next.chars().any(char::is_whitespace)
    {
        return None;
    }
    // Any origin will do: only whether the reference stays on it matters.
    let origin = Url::parse("http://console.invalid/").ok()?;
    let parsed = origin.join(next).ok()?;
    let path = &parsed[Position::BeforePath..];
    (parsed.origin() == origin.origin() && path == next && !path.starts_with("//"))
        .then(|| path.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_in_returns_only_to_paths_that_parse_to_themselves() {
        for local in [
            "/",
            "/subscriptions/orders?x=1",
            "/subscriptions/orders?error=card%20declined&tz=Europe%2FParis",
            "/events/0190b5e5-0000-7000-8000-000000000000?source=billing",
            "/%09/evil.example/",
        ] {
            assert_eq!(local_path(Some(local)).unwrap(), local);
        }
        for foreign in [
            "//evil.example",
            "https://evil.example",
            "/\\evil",
            "\\/evil",
            "x",
            "",
            "/..//evil.example",
            "/.//evil.example",
            "/%2e%2e//evil.example",
            "/ /evil.example",
            "/\u{a0}/evil.example",
            "/\u{3000}/evil.example",
            "/ordérs",
            "/events?q=\"<x>\"",
            "/a/../b",
        ] {
            assert_eq!(local_path(Some(foreign)).unwrap(), "/", "{foreign:?}");
        }
        assert_eq!(local_path(None).unwrap(), "/");
    }

    #[test]
    fn control_characters_in_next_are_refused_naming_the_field() {
        for control in ['\t', '\r', '\n', '\0', '\x01', '\x1b', '\x7f', '\u{85}'] {
            let next = format!("/{control}/evil.example/");
            match local_path(Some(&next)) {
                Err(ConsoleError::Domain(Error::InvalidArgument { field, message })) => {
                    assert_eq!(field, "next");
                    assert!(message.contains("control characters"), "{message}");
                }
                other => panic!("{next:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn forms_from_other_sites_are_refused() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut headers = HeaderMap::new();
            for (name, value) in pairs {
                headers.insert(*name, HeaderValue::from_static(value));
            }
            headers
        };
        assert!(same_origin(&headers(&[("host", "127.0.0.1:9465")])).is_ok());
        assert!(
            same_origin(&headers(&[
                ("host", "127.0.0.1:9465"),
                ("origin", "http://127.0.0.1:9465")
            ]))
            .is_ok()
        );
        assert!(
            same_origin(&headers(&[
                ("host", "127.0.0.1:9465"),
                ("origin", "http://evil.example")
            ]))
            .is_err()
        );
        assert!(same_origin(&headers(&[("sec-fetch-site", "cross-site")])).is_err());
    }
}
