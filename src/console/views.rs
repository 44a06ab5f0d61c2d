//! The console's HTML, rendered on the server: every figure and list is in the page
//! itself; scripts only refresh it and show times in the browser's zone. Figures are
//! `<data>` elements whose `value` is the exact number.

use std::time::Duration;

use axum::http::StatusCode;
use chrono::{DateTime, SecondsFormat, Utc};
use maud::{DOCTYPE, Markup, html};

use super::session::Notice;
use crate::{
    domain::{
        BEHIND_AFTER, DeadLetter, DeadLetterGroup, DeliveryState, Event, EventDeliveries,
        OutboxStats, SourceName, StartPosition, StatusKind, Subscription, SubscriptionName,
        SubscriptionStats, SubscriptionStatus, is_json_content_type,
    },
    drain::DrainStatus,
    operations::{PageToken, SourceStatus},
    rates::{SubscriptionRates, WINDOW},
};

/// Most payload bytes a page shows.
const MAX_SHOWN_PAYLOAD: usize = 64 * 1024;

/// Who is looking, and what the page's forms need.
pub struct Frame {
    pub user: String,
    pub admin: bool,
    /// Without authentication there is nothing to sign out of.
    pub signed_in: bool,
    pub csrf: String,
    pub notice: Option<Notice>,
}

fn layout(title: &str, frame: Option<&Frame>, content: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · outbox-gateway" }
                link rel="stylesheet" href="/assets/console.css";
                link rel="icon" href="/assets/favicon.svg" type="image/svg+xml";
                script src="/assets/console.js" defer {}
            }
            body {
                a.skip href="#main" { "Skip to content" }
                header.top {
                    a.brand href="/" { span.logo aria-hidden="true" { "⇄" } " outbox-gateway" }
                    @if let Some(frame) = frame {
                        nav aria-label="Main" {
                            a href="/" { "Overview" }
                            a href="/events" { "Find event" }
                        }
                        form.lookup action="/events" method="get" role="search" {
                            label.visually-hidden for="lookup-id" { "Event id" }
                            input #lookup-id name="id" type="search" placeholder="Event id (UUID)"
                                autocomplete="off" spellcheck="false";
                            button type="submit" { "Find" }
                        }
                        div.who {
                            span { (frame.user) " · " (if frame.admin { "admin" } else { "viewer" }) }
                            @if frame.signed_in {
                                form method="post" action="/sign-out" {
                                    (csrf_field(frame))
                                    button.link type="submit" { "Sign out" }
                                }
                            }
                        }
                    }
                }
                main #main {
                    @if let Some(notice) = frame.and_then(|frame| frame.notice.as_ref()) {
                        p.notice.success[notice.success].failure[!notice.success] role="status" {
                            (notice.text)
                        }
                    }
                    (content)
                }
            }
        }
    }
}

fn csrf_field(frame: &Frame) -> Markup {
    html! { input type="hidden" name="csrf" value=(frame.csrf); }
}

/// A row of the overview.
pub struct OverviewRow {
    /// Its one status, as GetStats and the CLI show it.
    pub status: SubscriptionStatus,
    pub stats: SubscriptionStats,
    pub rates: Option<SubscriptionRates>,
    /// Subscribe streams open on this gateway.
    pub streams: usize,
    /// Why its stats could not be computed; the row says so instead of the page
    /// failing for every subscription.
    pub error: Option<String>,
}

pub fn overview(
    frame: &Frame,
    rows: &[OverviewRow],
    outbox: &OutboxStats,
    sources: &[SourceStatus],
    now: DateTime<Utc>,
) -> Markup {
    let content = html! {
        h1 { "Overview" }
        section #outbox data-refresh aria-labelledby="outbox-title" {
            h2 #outbox-title { "Outbox" }
            (outbox_cards(outbox))
        }
        // One source is the gateway's own database; its health is the page's.
        @if sources.len() > 1 {
            section #sources data-refresh aria-labelledby="sources-title" {
                h2 #sources-title { "Sources" }
                (sources_table(sources, now))
            }
        }
        section #subscriptions data-refresh aria-labelledby="subscriptions-title" {
            h2 #subscriptions-title { "Subscriptions" }
            @if rows.is_empty() {
                div.empty {
                    p { strong { "No subscriptions yet." } }
                    p {
                        "Create one with "
                        code { "outbox-gateway subscriptions create NAME --event-type 'order.*'" }
                        " or the CreateSubscription RPC; it appears here with its lag and dead letters."
                    }
                }
            } @else {
                div.table-wrap {
                    table.figures {
                        caption.visually-hidden { "Delivery figures per subscription" }
                        thead {
                            tr {
                                th scope="col" { "Subscription" }
                                th scope="col" { "Status" }
                                th.num scope="col" { "Pending" }
                                th.num scope="col" { "In flight" }
                                th.num scope="col" { "Awaiting retry" }
                                th.num scope="col" { "Dead letters" }
                                th.num scope="col" { "Lag" }
                                th.num scope="col" { "Oldest unacked" }
                                th scope="col" { "Delivered / acked" }
                                th.num scope="col" { abbr title="Subscribe streams on this gateway" { "Streams" } }
                            }
                        }
                        tbody {
                            @for row in rows {
                                (overview_row(row, outbox, now))
                            }
                        }
                    }
                }
            }
        }
        p.updated data-refresh #updated {
            "Figures as of " (time(now)) ". They refresh every few seconds."
        }
    };
    layout("Overview", Some(frame), content)
}

fn sources_table(sources: &[SourceStatus], now: DateTime<Utc>) -> Markup {
    html! {
        div.table-wrap {
            table.figures {
                caption.visually-hidden { "The source databases relayed from" }
                thead { tr {
                    th scope="col" { "Source" }
                    th scope="col" { "Status" }
                    th.num scope="col" { "Events stored" }
                    th scope="col" { "Newest event" }
                    th.num scope="col" { "Oldest open transaction" }
                    th.num scope="col" { "Schema" }
                } }
                tbody {
                    @for source in sources {
                        tr data-source=(source.name.as_str()) {
                            th scope="row" { (source.name) }
                            td {
                                @if source.health.connected {
                                    span.badge.ok { "Reachable" }
                                } @else {
                                    span.badge.alert { "Unreachable" }
                                    @if let Some(error) = &source.health.last_error {
                                        div.sub.error { (error_text(error)) }
                                    }
                                }
                                div.sub { "for " (optional_age(Some(source.health.since), now)) }
                            }
                            @match &source.outbox {
                                Some(outbox) => {
                                    td.num { data data-stat=(format!("source.{}.events_stored", source.name)) value=(outbox.events_stored) { (count(outbox.events_stored)) } }
                                    td { (optional_time(outbox.newest_event_at)) }
                                    td.num { (duration(outbox.oldest_open_transaction_age)) }
                                }
                                None => { td.num { "–" } td { "–" } td.num { "–" } }
                            }
                            td.num { @if let Some(version) = source.schema_version { (version) } @else { "–" } }
                        }
                    }
                }
            }
        }
    }
}

fn overview_row(row: &OverviewRow, outbox: &OutboxStats, now: DateTime<Utc>) -> Markup {
    let stats = &row.stats;
    let name = stats.name.as_str();
    let kind = row.status.kind();
    let alert = matches!(
        kind,
        StatusKind::PushStopped | StatusKind::SinkUnreachable | StatusKind::DeadLetters
    );
    html! {
        tr.alert[alert].warn[kind.needs_attention() && !alert] data-subscription=(name) {
            th scope="row" { a href=(subscription_href(&stats.name)) { (name) } }
            td {
                @if let Some(error) = &row.error {
                    span.badge.bad title=(error) { "Figures unavailable" }
                    span.sub.below { (error) }
                } @else {
                    (status_badge(&row.status))
                }
            }
            td.num { (figure(name, "pending", stats.pending)) }
            td.num { (figure(name, "in_flight", stats.in_flight)) }
            td.num { (figure(name, "awaiting_retry", stats.awaiting_retry)) }
            td.num { (figure(name, "dead_lettered", stats.dead_lettered)) }
            td.num {
                (figure(name, "lag_events", stats.lag_events()))
                @if stats.oldest_unacked_at.is_some() {
                    span.sub.below { (duration(lag(stats, outbox, now))) " behind" }
                }
            }
            td.num { (optional_age(stats.oldest_unacked_at, now)) }
            td { (sparkline(row.rates.as_ref(), now)) }
            td.num { (row.streams) }
        }
    }
}

/// The status in the words GetStats and the CLI use, what it means on hover.
fn status_badge(status: &SubscriptionStatus) -> Markup {
    let kind = status.kind();
    let class = match kind {
        StatusKind::PushStopped | StatusKind::SinkUnreachable | StatusKind::DeadLetters => "bad",
        StatusKind::Paused | StatusKind::Behind | StatusKind::NoConsumer => "warn",
        StatusKind::Delivering => "busy",
        StatusKind::ScheduledOnly => "muted",
        StatusKind::CaughtUp => "good",
    };
    html! {
        span class=(format!("badge {class}")) data-status=(kind.label()) title=(status.detail()) {
            (capitalized(kind.label()))
        }
    }
}

fn outbox_cards(outbox: &OutboxStats) -> Markup {
    let old_transaction = outbox.oldest_open_transaction_age > BEHIND_AFTER;
    html! {
        dl.cards {
            div.card {
                dt { "Events stored" }
                dd { data data-stat="outbox.events_stored" value=(outbox.events_stored) { (count(outbox.events_stored)) } }
            }
            div.card {
                dt { "Oldest event" }
                dd { (optional_time(outbox.oldest_event_at)) }
            }
            div.card {
                dt { "Newest event" }
                dd { (optional_time(outbox.newest_event_at)) }
            }
            div.card.warn[old_transaction] {
                dt { "Oldest open transaction" }
                dd {
                    (duration(outbox.oldest_open_transaction_age))
                    @if old_transaction {
                        span.sub { " — holds back vacuum; it usually is a mistake" }
                    }
                }
            }
            div.card.warn[outbox.events_force_expired > 0] {
                dt { "Force-expired events" }
                dd { data data-stat="outbox.events_force_expired" value=(outbox.events_force_expired) { (count(outbox.events_force_expired)) } }
            }
        }
    }
}

/// What the subscription page shows.
pub struct SubscriptionView<'a> {
    pub subscription: &'a Subscription,
    /// Its one status, as GetStats and the CLI show it.
    pub status: &'a SubscriptionStatus,
    /// Its stats over all its sources, and in each.
    pub stats: &'a SubscriptionStats,
    pub per_source: &'a [SubscriptionStats],
    /// The sources it reads.
    pub sources: &'a [SourceName],
    pub outbox: &'a OutboxStats,
    pub rates: Option<&'a SubscriptionRates>,
    /// A sink subscription's messages, as this gateway process sent them.
    pub sink: Option<&'a DrainStatus>,
    pub streams: usize,
    pub groups: &'a [DeadLetterGroup],
    /// Dead letters the filter matches, and the listed page of them.
    pub matching: u64,
    pub dead_letters: &'a [DeadLetter],
    pub next_page: Option<PageToken>,
    /// The filter as the query gave it (name, value), to fill in the form and carry on.
    pub filter: &'a [(&'static str, String)],
    pub include_resolved: bool,
    pub paged: bool,
    pub now: DateTime<Utc>,
}

pub fn subscription(frame: &Frame, view: &SubscriptionView) -> Markup {
    let name = &view.subscription.name;
    let content = html! {
        nav.crumbs aria-label="Breadcrumb" { a href="/" { "Overview" } " › " span aria-current="page" { (name) } }
        h1 { (name) }
        (status_banner(frame, view))
        section #figures data-refresh aria-label="Delivery figures" {
            (subscription_cards(view))
            @if view.per_source.len() > 1 {
                (per_source_table(view))
            }
        }
        div.columns {
            section #settings aria-labelledby="settings-title" {
                h2 #settings-title { "Settings" }
                (settings(view.subscription, view.sink))
            }
            @if frame.admin {
                (pause_form(frame, view.subscription))
                section #seek aria-labelledby="seek-title" {
                    h2 #seek-title { "Replay or skip" }
                    p.hint { "Moves the read position only: deliveries in flight, awaiting retry or dead keep their state." }
                    form.stack method="post" action=(format!("{}/seek", subscription_href(name))) {
                        (csrf_field(frame))
                        input type="hidden" name="tz" value="0" data-timezone;
                        fieldset.choices {
                            legend { "Seek to" }
                            label { input type="radio" name="to" value="earliest"; " the earliest retained event (replay)" }
                            label { input type="radio" name="to" value="latest"; " the latest event (skip the backlog)" }
                            label.inline-input {
                                input type="radio" name="to" value="time"; " a time: "
                                input type="datetime-local" name="time" step="1" aria-label="Time to seek to";
                            }
                        }
                        button type="submit" { "Seek…" }
                    }
                }
            }
        }
        section #groups data-refresh aria-labelledby="groups-title" {
            h2 #groups-title { "Dead letters by error" }
            @if view.groups.is_empty() {
                p.empty { "No unresolved dead letters." }
            } @else {
                div.table-wrap {
                    table {
                        thead { tr {
                            th scope="col" { "Last error" }
                            th.num scope="col" { "Count" }
                            th scope="col" { "First" }
                            th scope="col" { "Last" }
                            th scope="col" { "Example" }
                        } }
                        tbody {
                            @for group in view.groups {
                                tr {
                                    th scope="row" {
                                        a href=(format!("{}?error={}#dead-letters", subscription_href(name), super::encode(&group.last_error))) title="Show these dead letters" {
                                            (error_text(&group.last_error))
                                        }
                                    }
                                    td.num { data value=(group.count) { (count(group.count)) } }
                                    td { (time(group.first_dead_lettered_at)) }
                                    td { (time(group.last_dead_lettered_at)) }
                                    td { a.mono href=(format!("/events/{}", group.example_event_id)) { (short_id(&group.example_event_id.to_string())) } }
                                }
                            }
                        }
                    }
                }
            }
        }
        section #dead-letters aria-labelledby="dead-letters-title" {
            h2 #dead-letters-title { "Dead letters" }
            (filter_form(view))
            p.matching {
                data #matching value=(view.matching) { (count(view.matching)) }
                (if view.matching == 1 { " dead letter matches" } else { " dead letters match" })
                (if view.include_resolved { " (resolved ones included)." } else { "." })
            }
            @if view.dead_letters.is_empty() {
                p.empty {
                    @if view.paged { "No more dead letters on this page. " a href=(filtered_href(name, view.filter, view.include_resolved)) { "Back to the first page" } }
                    @else if !is_filtered(view.filter) { "This subscription has no dead letters. Events that exhaust their attempts, or that a consumer rejects for good, land here." }
                    @else { "No dead letters match this filter." }
                }
            } @else {
                form #dead-letter-actions method="post" action=(format!("{}/dead-letters", subscription_href(name))) {
                    (csrf_field(frame))
                    @for (field, value) in view.filter {
                        input type="hidden" name=(field) value=(value);
                    }
                    @if view.include_resolved { input type="hidden" name="include_resolved" value="on"; }
                    div.table-wrap {
                        table.dead-letters {
                            thead { tr {
                                @if frame.admin {
                                    th scope="col" {
                                        input type="checkbox" data-select-all="id" aria-label="Select every dead letter on this page" hidden;
                                    }
                                }
                                th scope="col" { "Event" }
                                th scope="col" { "Type" }
                                th scope="col" { "Aggregate" }
                                th.num scope="col" { "Attempts" }
                                th scope="col" { "Last error" }
                                th scope="col" { "Dead-lettered" }
                            } }
                            tbody {
                                @for letter in view.dead_letters {
                                    (dead_letter_row(frame, letter))
                                }
                            }
                        }
                    }
                    @if let Some(next) = &view.next_page {
                        nav.pages aria-label="Pages" {
                            @if view.paged { a href=(filtered_href(name, view.filter, view.include_resolved)) { "« First page" } }
                            a href=(format!("{}&page={}#dead-letters", filtered_href(name, view.filter, view.include_resolved).trim_end_matches("#dead-letters"), next.encode())) rel="next" { "Next page »" }
                        }
                    } @else if view.paged {
                        nav.pages aria-label="Pages" { a href=(filtered_href(name, view.filter, view.include_resolved)) { "« First page" } }
                    }
                    @if frame.admin {
                        fieldset.actions {
                            legend { "Act on dead letters" }
                            p.hint { "Requeueing sends them back for delivery with attempts reset; resolving marks them handled without delivering them. You confirm with the exact count first." }
                            div.buttons {
                                button type="submit" name="action" value="requeue-selected" { "Requeue selected" }
                                button.primary type="submit" name="action" value="requeue-matching" {
                                    "Requeue all " (count(view.matching)) " matching"
                                }
                            }
                            label for="notes" { "Note for resolving (who handled it and how)" }
                            textarea #notes name="notes" rows="2" maxlength="4096" {}
                            div.buttons {
                                button type="submit" name="action" value="resolve-selected" { "Resolve selected" }
                                button type="submit" name="action" value="resolve-matching" {
                                    "Resolve all " (count(view.matching)) " matching"
                                }
                            }
                        }
                    }
                }
            }
        }
    };
    layout(name.as_str(), Some(frame), content)
}

/// The status first, with what it means and, when something stopped deliveries, the
/// Resume that restarts them right there.
fn status_banner(frame: &Frame, view: &SubscriptionView) -> Markup {
    let kind = view.status.kind();
    let stopped = matches!(kind, StatusKind::PushStopped | StatusKind::Paused);
    html! {
        section #status data-refresh aria-label="Status" {
            p.status-line {
                (status_badge(view.status)) " "
                span #status-detail { (capitalized(&view.status.detail())) "." }
            }
            @if stopped && frame.admin {
                form.inline method="post" action=(format!("{}/resume", subscription_href(&view.subscription.name))) {
                    (csrf_field(frame))
                    button.primary type="submit" { "Resume" }
                }
            }
        }
    }
}

fn subscription_cards(view: &SubscriptionView) -> Markup {
    let stats = view.stats;
    let name = stats.name.as_str();
    let oldest_age = age_since(stats.oldest_unacked_at, view.now);
    html! {
        dl.cards {
            div.card { dt { "Pending" } dd { (figure(name, "pending", stats.pending)) } }
            div.card { dt { "In flight" } dd { (figure(name, "in_flight", stats.in_flight)) } }
            div.card { dt { "Awaiting retry" } dd { (figure(name, "awaiting_retry", stats.awaiting_retry)) } }
            div.card.alert[stats.dead_lettered > 0] { dt { "Dead letters" } dd { (figure(name, "dead_lettered", stats.dead_lettered)) } }
            div.card {
                dt { "Lag" }
                dd {
                    (figure(name, "lag_events", stats.lag_events()))
                    @if stats.oldest_unacked_at.is_some() {
                        span.sub { " events, " (duration(lag(stats, view.outbox, view.now))) " behind" }
                    }
                }
            }
            div.card.warn[oldest_age > BEHIND_AFTER] { dt { "Oldest unacked" } dd { (optional_age(stats.oldest_unacked_at, view.now)) } }
            div.card {
                dt { "Scheduled" }
                dd {
                    (figure(name, "scheduled", stats.scheduled))
                    @if let Some(next) = stats.next_scheduled_at {
                        span.sub { " next " (time(next)) }
                    }
                }
            }
            div.card { dt { "Expired" } dd { (figure(name, "expired_total", stats.expired_total)) } }
            @if view.subscription.settings.filter.is_some() || stats.filtered_total > 0 {
                div.card {
                    dt { "Passed over by the filter" }
                    dd { (figure(name, "filtered_total", stats.filtered_total)) }
                }
                div.card.warn[stats.filter_errors_total > 0] {
                    dt { "Filter errors" }
                    dd { (figure(name, "filter_errors_total", stats.filter_errors_total)) }
                }
            }
            @if let Some((error, at)) = &stats.last_filter_error {
                div.card.wide.warn {
                    dt { "Last filter error" }
                    dd { code { (error) } span.sub { " " (time(*at)) } }
                }
            }
            div.card { dt { (handed_out_word(view)) " in total" } dd { (figure(name, "delivered_total", stats.delivered_total)) } }
            div.card { dt { "Acked in total" } dd { (figure(name, "acked_total", stats.acked_total)) } }
            div.card { dt { "Streams on this gateway" } dd { (view.streams) } }
            div.card.wide {
                dt { "Deliveries and acks per second, last 15 min" }
                dd { (rate_chart(view.rates, view.now, handed_out_word(view))) }
            }
        }
    }
}

fn per_source_table(view: &SubscriptionView) -> Markup {
    let name = view.subscription.name.as_str();
    html! {
        div.table-wrap {
            table.figures #per-source {
                caption { "Per source" }
                thead { tr {
                    th scope="col" { "Source" }
                    th.num scope="col" { "Pending" }
                    th.num scope="col" { "In flight" }
                    th.num scope="col" { "Awaiting retry" }
                    th.num scope="col" { "Dead letters" }
                    th.num scope="col" { "Oldest unacked" }
                } }
                tbody {
                    @for stats in view.per_source {
                        @let source = stats.source.as_ref().map_or("", |source| source.as_str());
                        @let key = format!("{name}.{source}");
                        tr data-source=(source) {
                            th scope="row" { (source) }
                            td.num { (figure(&key, "pending", stats.pending)) }
                            td.num { (figure(&key, "in_flight", stats.in_flight)) }
                            td.num { (figure(&key, "awaiting_retry", stats.awaiting_retry)) }
                            td.num { (figure(&key, "dead_lettered", stats.dead_lettered)) }
                            td.num { (optional_age(stats.oldest_unacked_at, view.now)) }
                        }
                    }
                }
            }
        }
    }
}

/// Resume when paused (by an operator, or stopped by a push endpoint's 410), else pause.
fn pause_form(frame: &Frame, subscription: &Subscription) -> Markup {
    let stopped =
        subscription.pause_in_force(Utc::now()).is_some() || subscription.push_stopped.is_some();
    let href = subscription_href(&subscription.name);
    html! {
        section #pause aria-labelledby="pause-title" {
            h2 #pause-title { "Pause or resume" }
            @if stopped {
                p.hint { "Nothing new goes out; acks of deliveries already out still apply." }
                form.stack method="post" action=(format!("{href}/resume")) {
                    (csrf_field(frame))
                    button type="submit" { "Resume" }
                }
            } @else {
                p.hint { "Stops handing out new deliveries on every gateway; the backlog waits." }
                form.stack method="post" action=(format!("{href}/pause")) {
                    (csrf_field(frame))
                    label { "Reason " input type="text" name="reason" maxlength="1024" placeholder="downstream outage"; }
                    button type="submit" { "Pause" }
                }
            }
        }
    }
}

fn settings(subscription: &Subscription, sink_status: Option<&DrainStatus>) -> Markup {
    let settings = &subscription.settings;
    let list = |values: Vec<String>| -> Markup {
        html! {
            @if values.is_empty() { span.sub { "all" } }
            @else { @for value in values { code { (value) } " " } }
        }
    };
    html! {
        dl.settings {
            dt { "Sources" }
            dd {
                @if subscription.sources.is_empty() { span.sub { "all" } }
                @else { @for source in &subscription.sources { code { (source) } " " } }
            }
            dt { "Event types" } dd { (list(settings.event_types.to_strings())) }
            dt { "Aggregate types" } dd { (list(settings.aggregate_types.clone())) }
            dt { "Metadata match" }
            dd {
                @if settings.metadata_match.is_empty() { span.sub { "none" } }
                @for (key, value) in &settings.metadata_match { code { (key) "=" (value) } " " }
            }
            dt { "Filter" }
            dd {
                @match &settings.filter {
                    Some(filter) => { code { (filter.as_str()) } }
                    None => { span.sub { "none" } }
                }
            }
            dt { "Transform" }
            dd {
                @match &settings.transform {
                    Some(transform) => { code { (transform.as_str()) } }
                    None => { span.sub { "payload as published" } }
                }
            }
            dt { "Ack deadline" } dd { (duration(settings.ack_deadline)) }
            dt { "Max attempts" } dd { @if settings.max_attempts == 0 { "unlimited" } @else { (settings.max_attempts) } }
            dt { "Retry backoff" } dd { (duration(settings.retry_backoff_min)) " doubling to " (duration(settings.retry_backoff_max)) }
            dt { "Ordered per aggregate" } dd { (if settings.ordered { "yes" } else { "no" }) }
            dt { "Never dead-lettered" } dd {
                @if settings.persistent_event_types.is_empty() { span.sub { "none" } }
                @else { (list(settings.persistent_event_types.to_strings())) }
            }
            dt { "Expiry" }
            dd {
                @match settings.max_event_age {
                    Some(age) => { "events older than " (duration(age)) }
                    None => { span.sub { "only events' own expires_at" } }
                }
                (if settings.dead_letter_expired { "; expired events are dead-lettered" } else { "; expired events are dropped" })
            }
            dt { "Paused" }
            dd {
                @match subscription.pause_in_force(Utc::now()) {
                    Some(pause) => {
                        strong { "paused" } " since " (time(pause.since))
                        @if let Some(until) = pause.until { " until " (time(until)) }
                        @if !pause.reason.is_empty() { ": " (pause.reason) }
                    }
                    None => { span.sub { "no" } }
                }
            }
            dt { "Delivery" }
            dd {
                @match &settings.push {
                    None if settings.sink.is_some() => {
                        @let sink = settings.sink.as_ref().expect("checked");
                        "into sink " code { (sink.name) }
                        @if let Some(subject) = &sink.subject { ", subject " code { (subject.as_str()) } }
                        @if let Some(topic) = &sink.topic { ", topic " code { (topic.as_str()) } }
                        @if let Some(key) = &sink.key { ", key " code { (key.as_str()) } }
                        @if let Some(status) = sink_status {
                            br;
                            (count(status.confirmed_total)) " confirmed of "
                            (count(status.requests_total)) " sent by this gateway, "
                            (status.in_flight) " awaiting the broker"
                            @if let (Some(error), Some(at)) = (&status.last_error, status.last_error_at) {
                                br; strong { "last error " } (time(at)) ": " (error_text(error))
                            }
                        }
                    }
                    None => { "pull (Subscribe streams)" }
                    Some(push) => {
                        "push to " code { (push.endpoint.as_str()) }
                        ", " (match push.format {
                            crate::domain::PushFormat::Binary => "binary",
                            crate::domain::PushFormat::Structured => "structured",
                        }) " CloudEvents, " (push.max_concurrency) " in flight, timeout "
                        (duration(push.timeout))
                        @if push.batched() {
                            ", in batches of up to " (push.max_batch_events) " events (wait "
                            (duration(push.max_batch_wait)) ")"
                        }
                        @if let Some(stopped) = &subscription.push_stopped {
                            br; strong { "stopped " } (time(stopped.at)) ": " (stopped.reason)
                        }
                    }
                }
            }
            dt { "Created" } dd { (time(subscription.created_at)) }
        }
    }
}

fn filter_form(view: &SubscriptionView) -> Markup {
    let value = |field: &str| -> Option<String> {
        view.filter
            .iter()
            .find(|(name, _)| *name == field)
            .map(|(_, value)| value.clone())
    };
    let href = subscription_href(&view.subscription.name);
    html! {
        form.filter method="get" action=(format!("{href}#dead-letters")) aria-label="Filter dead letters" {
            input type="hidden" name="tz" value=(value("tz").unwrap_or_else(|| "0".into())) data-timezone;
            @if let Some(size) = value("page_size") { input type="hidden" name="page_size" value=(size); }
            label { "Event type" input name="event_type" value=[value("event_type")] placeholder="order.*"; }
            label { "Aggregate type" input name="aggregate_type" value=[value("aggregate_type")] placeholder="order"; }
            label { "Aggregate id" input name="aggregate_id" value=[value("aggregate_id")]; }
            label { "Last error" input name="error" value=[value("error")]; }
            label { "Dead-lettered from" input type="datetime-local" step="1" name="after" value=[value("after")]; }
            label { "until" input type="datetime-local" step="1" name="before" value=[value("before")]; }
            @if view.sources.len() > 1 {
                @let chosen = value("source");
                label {
                    "Source"
                    select name="source" {
                        option value="" selected[chosen.is_none()] { "All" }
                        @for source in view.sources {
                            option value=(source.as_str()) selected[chosen.as_deref() == Some(source.as_str())] { (source) }
                        }
                    }
                }
            }
            label.check { input type="checkbox" name="include_resolved" checked[view.include_resolved]; " Include resolved" }
            div.buttons {
                button type="submit" { "Filter" }
                @if is_filtered(view.filter) || view.include_resolved {
                    a.button href=(format!("{href}#dead-letters")) { "Clear" }
                }
            }
        }
    }
}

fn dead_letter_row(frame: &Frame, letter: &DeadLetter) -> Markup {
    let id = letter.event.id.to_string();
    html! {
        tr.resolved[letter.resolved_at.is_some()] {
            @if frame.admin {
                td { input type="checkbox" name="id" value=(id) aria-label=(format!("Select {id}")); }
            }
            td { a.mono href=(event_href(letter.event.id, Some(&letter.event.source))) title=(id) { (short_id(&id)) } }
            td { code { (letter.event.event_type) } }
            td { (letter.event.aggregate_type) "/" (letter.event.aggregate_id) }
            td.num { (letter.attempts) }
            td.error {
                (error_text(letter.last_error.as_deref().unwrap_or_default()))
                @if let (Some(at), Some(by)) = (letter.resolved_at, &letter.resolved_by) {
                    div.sub {
                        "Resolved by " (by) " " (time(at))
                        @if let Some(notes) = letter.notes.as_deref().filter(|notes| !notes.is_empty()) { ": " (notes) }
                    }
                }
            }
            td { (time(letter.dead_lettered_at)) }
        }
    }
}

/// A bulk action on dead letters, to confirm.
pub struct DeadLetterConfirmation<'a> {
    pub subscription: &'a SubscriptionName,
    /// "requeue" or "resolve".
    pub verb: &'static str,
    pub count: u64,
    /// What was chosen, in words.
    pub chosen: String,
    pub notes: &'a str,
    /// The form's fields, sent again with `confirm`.
    pub fields: Vec<(String, String)>,
    pub back: String,
}

pub fn confirm_dead_letters(frame: &Frame, confirmation: &DeadLetterConfirmation) -> Markup {
    let noun = if confirmation.count == 1 {
        "dead letter"
    } else {
        "dead letters"
    };
    let title = format!(
        "{} {} {noun}?",
        capitalized(confirmation.verb),
        count(confirmation.count)
    );
    let content = html! {
        nav.crumbs aria-label="Breadcrumb" {
            a href="/" { "Overview" } " › "
            a href=(subscription_href(confirmation.subscription)) { (confirmation.subscription) } " › "
            span aria-current="page" { "Confirm" }
        }
        @if confirmation.count == 0 {
            h1 { "Nothing to " (confirmation.verb) }
            p { "No dead letters of " strong { (confirmation.subscription) } " are " (confirmation.chosen) "." }
            p { a.button href=(confirmation.back) { "Back" } }
        } @else {
            h1 { (title) }
            div.confirm {
                p {
                    data #confirm-count value=(confirmation.count) { (count(confirmation.count)) } " " (noun)
                    " of " strong { (confirmation.subscription) } ", " (confirmation.chosen) ", "
                    @if confirmation.verb == "requeue" {
                        "will be delivered again with their attempts reset."
                    } @else {
                        "will be marked resolved by " strong { (frame.user) } " and not delivered."
                    }
                }
                @if confirmation.verb == "resolve" && !confirmation.notes.is_empty() {
                    p { "Note: " q { (confirmation.notes) } }
                }
                form method="post" {
                    @for (field, value) in &confirmation.fields {
                        input type="hidden" name=(field) value=(value);
                    }
                    input type="hidden" name="confirm" value="1";
                    div.buttons {
                        button.primary type="submit" { (capitalized(confirmation.verb)) " " (count(confirmation.count)) " " (noun) }
                        a.button href=(confirmation.back) { "Cancel" }
                    }
                }
            }
        }
    };
    layout(&title, Some(frame), content)
}

pub fn confirm_seek(
    frame: &Frame,
    name: &SubscriptionName,
    to: &StartPosition,
    fields: &[(String, String)],
) -> Markup {
    let content = html! {
        nav.crumbs aria-label="Breadcrumb" {
            a href="/" { "Overview" } " › " a href=(subscription_href(name)) { (name) } " › "
            span aria-current="page" { "Confirm" }
        }
        h1 { "Seek " (name) "?" }
        div.confirm {
            p {
                @match to {
                    StartPosition::Earliest => { "Every retained event that matches will be delivered again, from the earliest on." }
                    StartPosition::Latest => { "Every event not yet handed out is skipped: delivery continues with events committed from now on." }
                    StartPosition::Time(at) => { "Events written at or after " (time(*at)) " will be delivered again; earlier ones not yet handed out are skipped." }
                }
            }
            p.hint { "Deliveries in flight, awaiting retry or dead keep their state, and an event that still has such a record is not duplicated." }
            form method="post" {
                @for (field, value) in fields { input type="hidden" name=(field) value=(value); }
                input type="hidden" name="confirm" value="1";
                div.buttons {
                    button.primary type="submit" { "Seek" }
                    a.button href=(subscription_href(name)) { "Cancel" }
                }
            }
        }
    };
    layout("Confirm seek", Some(frame), content)
}

pub fn find_event(frame: &Frame, aggregate: Option<(&str, &str, &[Event])>) -> Markup {
    let content = html! {
        h1 { "Find an event" }
        div.columns {
            form.stack method="get" action="/events" {
                h2 { "By id" }
                label { "Event id" input name="id" required placeholder="0192f1c4-…" autocomplete="off" spellcheck="false"; }
                button type="submit" { "Find" }
            }
            form.stack method="get" action="/events" {
                h2 { "By aggregate" }
                label { "Aggregate type" input name="aggregate_type" required value=[aggregate.map(|a| a.0)]; }
                label { "Aggregate id" input name="aggregate_id" required value=[aggregate.map(|a| a.1)]; }
                button type="submit" { "List its events" }
            }
        }
        @if let Some((aggregate_type, aggregate_id, events)) = aggregate {
            section #aggregate-events aria-labelledby="aggregate-title" {
                h2 #aggregate-title { "Events of " (aggregate_type) "/" (aggregate_id) }
                @if events.is_empty() {
                    p.empty { "No stored events of this aggregate (retention may have removed them)." }
                } @else {
                    p.hint { "Newest first, at most " (crate::operations::MAX_AGGREGATE_EVENTS) "." }
                    div.table-wrap {
                        table {
                            thead { tr { th scope="col" { "Event" } th scope="col" { "Type" } th.num scope="col" { "Version" } th scope="col" { "Created" } } }
                            tbody {
                                @for event in events {
                                    tr {
                                        td { a.mono href=(event_href(event.id, Some(&event.source))) { (event.id) } }
                                        td { code { (event.event_type) } }
                                        td.num { @if let Some(version) = event.aggregate_version { (version) } }
                                        td { (time(event.created_at)) }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    };
    layout("Find an event", Some(frame), content)
}

pub fn event(frame: &Frame, found: &EventDeliveries) -> Markup {
    let event = &found.event;
    let id = event.id.to_string();
    let content = html! {
        nav.crumbs aria-label="Breadcrumb" { a href="/events" { "Find event" } " › " span.mono aria-current="page" { (id) } }
        h1 { code { (event.event_type) } }
        section #event aria-label="Event" {
        dl.settings {
            dt { "Event id" } dd.mono { (id) }
            dt { "Source" } dd { (event.source) }
            dt { "Aggregate" }
            dd {
                a href=(format!("/events?aggregate_type={}&aggregate_id={}", super::encode(&event.aggregate_type), super::encode(&event.aggregate_id))) {
                    (event.aggregate_type) "/" (event.aggregate_id)
                }
                @if let Some(version) = event.aggregate_version { span.sub { " version " (version) } }
            }
            dt { "Occurred" } dd { (time(event.occurred_at)) }
            dt { "Written" } dd { (time(event.created_at)) }
            dt { "Trace id" }
            dd.mono {
                @match trace_id(event) { Some(trace) => { (trace) }, None => { span.sub { "none" } } }
            }
        }
        }
        section #deliveries data-refresh aria-labelledby="deliveries-title" {
            h2 #deliveries-title { "On each subscription" }
            @if found.subscriptions.is_empty() {
                p.empty { "There are no subscriptions." }
            } @else {
                div.table-wrap {
                    table {
                        thead { tr {
                            th scope="col" { "Subscription" } th scope="col" { "State" } th scope="col" { "Details" }
                            @if frame.admin { th scope="col" { span.visually-hidden { "Action" } } }
                        } }
                        tbody {
                            @for (name, state) in &found.subscriptions {
                                tr data-subscription=(name.as_str()) {
                                    th scope="row" { a href=(subscription_href(name)) { (name) } }
                                    td { (state_badge(state)) }
                                    td { (state_details(state)) }
                                    @if frame.admin {
                                        td {
                                            @if state.can_requeue() {
                                                form method="post" action=(format!("/events/{id}/requeue")) {
                                                    (csrf_field(frame))
                                                    input type="hidden" name="source" value=(event.source.as_str());
                                                    input type="hidden" name="subscription" value=(name.as_str());
                                                    button type="submit" { "Requeue" }
                                                }
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        section #payload aria-labelledby="payload-title" {
            h2 #payload-title { "Payload " span.sub { (event.content_type) ", " (count(event.payload.len() as u64)) " bytes" } }
            (payload(event))
        }
        section #metadata aria-labelledby="metadata-title" {
            h2 #metadata-title { "Metadata" }
            @if event.metadata.is_empty() {
                p.empty { "No metadata." }
            } @else {
                div.table-wrap {
                    table {
                        thead { tr { th scope="col" { "Key" } th scope="col" { "Value" } } }
                        tbody { @for (key, value) in event.metadata_by_key() { tr { th scope="row" { code { (key) } } td.mono { (value) } } } }
                    }
                }
            }
        }
    };
    layout(&format!("Event {id}"), Some(frame), content)
}

fn state_badge(state: &DeliveryState) -> Markup {
    let (class, text) = match state {
        DeliveryState::NotMatched => ("muted", "not subscribed"),
        DeliveryState::Pending => ("busy", "pending"),
        DeliveryState::Skipped => ("muted", "skipped"),
        DeliveryState::Acked { .. } => ("good", "acked"),
        DeliveryState::InFlight { .. } => ("busy", "in flight"),
        DeliveryState::AwaitingRetry { .. } => ("warn", "awaiting retry"),
        DeliveryState::Waiting { .. } => ("busy", "waiting"),
        DeliveryState::Dead {
            resolved_at: Some(_),
            ..
        } => ("muted", "dead, resolved"),
        DeliveryState::Dead { .. } => ("bad", "dead"),
    };
    html! { span class=(format!("badge {class}")) data-state=(text) { (text) } }
}

fn state_details(state: &DeliveryState) -> Markup {
    html! {
        @match state {
            DeliveryState::NotMatched => { span.sub { "The subscription's filters do not select it." } }
            DeliveryState::Pending => { span.sub { "Not handed out yet." } }
            DeliveryState::Skipped => { span.sub { "Written before the time the subscription started or was sought to." } }
            DeliveryState::Acked { before_subscription } => {
                @if *before_subscription { span.sub { "Or skipped: written before the subscription was created." } }
                @else { span.sub { "Delivered and acked." } }
            }
            DeliveryState::InFlight { attempt, deadline } => { "Attempt " (attempt) ", lease until " (time(*deadline)) }
            DeliveryState::AwaitingRetry { attempt, next_try, last_error } => {
                "After attempt " (attempt) ", next try " (time(*next_try))
                @if let Some(error) = last_error { div.error { (error_text(error)) } }
            }
            DeliveryState::Waiting { attempt } => { "Behind an earlier event of its aggregate (attempt " (attempt) " so far)." }
            DeliveryState::Dead { attempts, last_error, dead_lettered_at, resolved_at, resolved_by, notes } => {
                (attempts) " attempts"
                @if let Some(at) = dead_lettered_at { ", dead-lettered " (time(*at)) }
                @if let Some(error) = last_error { div.error { (error_text(error)) } }
                @if let Some(at) = resolved_at {
                    div.sub {
                        "Resolved " (time(*at))
                        @if let Some(by) = resolved_by { " by " (by) }
                        @if let Some(notes) = notes.as_deref().filter(|notes| !notes.is_empty()) { ": " (notes) }
                    }
                }
            }
        }
    }
}

fn payload(event: &Event) -> Markup {
    let shown = &event.payload[..event.payload.len().min(MAX_SHOWN_PAYLOAD)];
    let cut = shown.len() < event.payload.len();
    let text = if is_json_content_type(&event.content_type) && !cut {
        std::str::from_utf8(shown).ok().map(indent_json)
    } else {
        None
    }
    .or_else(|| {
        let textual = is_json_content_type(&event.content_type)
            || event.content_type.starts_with("text/")
            || event.content_type.contains("xml");
        textual
            .then(|| String::from_utf8(shown.to_vec()).ok())
            .flatten()
    });
    html! {
        @match text {
            Some(text) => {
                pre.payload tabindex="0" { code { (text) } }
                @if cut { p.hint { "The first " (count(MAX_SHOWN_PAYLOAD as u64)) " bytes are shown." } }
            }
            None => {
                p.empty { "Binary payload: " (count(event.payload.len() as u64)) " bytes of " code { (event.content_type) } "." }
            }
        }
    }
}

/// Valid JSON laid out over lines with two-space indents, every token as written (key
/// order, number spelling and escapes stay those of the stored payload).
fn indent_json(json: &str) -> String {
    let mut out = String::with_capacity(json.len() * 2);
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    let newline = |out: &mut String, depth: usize| {
        out.push('\n');
        out.push_str(&"  ".repeat(depth));
    };
    let mut characters = json.chars().peekable();
    while let Some(character) = characters.next() {
        if in_string {
            out.push(character);
            match character {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match character {
            '"' => {
                in_string = true;
                out.push(character);
            }
            '{' | '[' => {
                out.push(character);
                // An empty object or array stays on its line.
                while characters.peek().is_some_and(|next| next.is_whitespace()) {
                    characters.next();
                }
                if matches!(characters.peek(), Some('}' | ']')) {
                    out.push(characters.next().expect("peeked"));
                } else {
                    depth += 1;
                    newline(&mut out, depth);
                }
            }
            '}' | ']' => {
                depth = depth.saturating_sub(1);
                newline(&mut out, depth);
                out.push(character);
            }
            ',' => {
                out.push(character);
                newline(&mut out, depth);
            }
            ':' => out.push_str(": "),
            _ if character.is_whitespace() => {}
            _ => out.push(character),
        }
    }
    out
}

/// The trace id of the event's W3C `traceparent` (`00-<trace id>-<span id>-<flags>`).
fn trace_id(event: &Event) -> Option<&str> {
    let traceparent = event.metadata.get("traceparent")?;
    let trace = traceparent.split('-').nth(1)?;
    (trace.len() == 32 && trace.bytes().all(|byte| byte.is_ascii_hexdigit())).then_some(trace)
}

pub fn sign_in(next: &str, message: Option<&str>, ended: bool) -> Markup {
    let content = html! {
        div.sign-in {
            h1 { "Sign in" }
            @if ended { p.notice.failure role="status" { "Your session has ended; sign in again." } }
            @if let Some(message) = message { p.notice.failure role="alert" { (message) } }
            form.stack method="post" action="/sign-in" {
                input type="hidden" name="next" value=(next);
                label {
                    "Token"
                    input type="password" name="token" required autocomplete="current-password" autofocus;
                }
                button.primary type="submit" { "Sign in" }
            }
            p.hint {
                "A token of the gateway's configuration with the " code { "admin" } " role, or "
                code { "viewer" } " to look without changing anything."
            }
        }
    };
    layout("Sign in", None, content)
}

pub fn error_page(status: StatusCode, title: &str, message: &str) -> Markup {
    let content = html! {
        div.error-page {
            p.status { (status.as_u16()) }
            h1 { (title) }
            p { (message) }
            p { a.button href="/" { "Go to the overview" } }
        }
    };
    layout(title, None, content)
}

/// Whether the listing's parameters narrow it (the zone and page size do not).
fn is_filtered(filter: &[(&'static str, String)]) -> bool {
    filter
        .iter()
        .any(|(name, _)| !matches!(*name, "tz" | "page_size"))
}

/// The event page: of the event in `source` (every source is searched without one, so
/// the default source is left out of the link).
pub fn event_href(id: uuid::Uuid, source: Option<&SourceName>) -> String {
    match source {
        Some(source) if !source.is_default() => format!("/events/{id}?source={source}"),
        _ => format!("/events/{id}"),
    }
}

pub fn subscription_href(name: &SubscriptionName) -> String {
    format!("/subscriptions/{name}")
}

fn filtered_href(
    name: &SubscriptionName,
    filter: &[(&'static str, String)],
    include_resolved: bool,
) -> String {
    let mut query = form_urlencoded::Serializer::new(String::new());
    for (field, value) in filter {
        query.append_pair(field, value);
    }
    if include_resolved {
        query.append_pair("include_resolved", "on");
    }
    format!(
        "{}?{}#dead-letters",
        subscription_href(name),
        query.finish()
    )
}

/// A number with its exact value for scripts and tests.
fn figure(subscription: &str, stat: &str, value: u64) -> Markup {
    html! { data data-stat=(format!("{subscription}.{stat}")) value=(value) { (count(value)) } }
}

fn lag(stats: &SubscriptionStats, outbox: &OutboxStats, now: DateTime<Utc>) -> Duration {
    // As GetStats: how far the oldest unacked event trails the newest event.
    age_since(
        stats.oldest_unacked_at,
        outbox.newest_event_at.unwrap_or(now),
    )
}

fn age_since(since: Option<DateTime<Utc>>, until: DateTime<Utc>) -> Duration {
    since.map_or(Duration::ZERO, |since| {
        (until - since).to_std().unwrap_or_default()
    })
}

/// A UTC time the browser's script shows in its own zone, with how long ago.
fn time(at: DateTime<Utc>) -> Markup {
    html! {
        time datetime=(at.to_rfc3339_opts(SecondsFormat::Millis, true)) data-relative {
            (at.format("%Y-%m-%d %H:%M:%S UTC"))
        }
    }
}

/// How old something is, or a dash when there is nothing.
fn optional_age(since: Option<DateTime<Utc>>, now: DateTime<Utc>) -> Markup {
    html! {
        @match since {
            Some(since) => { (duration(age_since(Some(since), now))) },
            None => { span.sub title="nothing unacked" { "—" } },
        }
    }
}

fn optional_time(at: Option<DateTime<Utc>>) -> Markup {
    html! { @match at { Some(at) => { (time(at)) }, None => { span.sub { "none" } } } }
}

fn error_text(error: &str) -> Markup {
    html! { @if error.is_empty() { span.sub { "(no error given)" } } @else { (error) } }
}

/// The end of an event id: UUIDv7 ids of one moment share their start.
fn short_id(id: &str) -> String {
    match id.len() {
        0..=12 => id.to_owned(),
        length => format!("…{}", &id[length - 12..]),
    }
}

fn capitalized(word: &str) -> String {
    let mut characters = word.chars();
    characters
        .next()
        .map(|first| first.to_uppercase().chain(characters).collect())
        .unwrap_or_default()
}

/// 1234567 as "1,234,567".
fn count(value: u64) -> String {
    let digits = value.to_string();
    let mut grouped = String::with_capacity(digits.len() + digits.len() / 3);
    for (index, digit) in digits.chars().enumerate() {
        if index > 0 && (digits.len() - index).is_multiple_of(3) {
            grouped.push(',');
        }
        grouped.push(digit);
    }
    grouped
}

/// A short human duration: "0 s", "42 s", "3 min 5 s", "2 h 4 min", "3 d 2 h".
fn duration(duration: Duration) -> String {
    let seconds = duration.as_secs();
    match seconds {
        0..60 if duration < Duration::from_secs(1) && !duration.is_zero() => {
            format!("{} ms", duration.as_millis())
        }
        0..60 => format!("{seconds} s"),
        60..3600 => two_units(seconds / 60, "min", seconds % 60, "s"),
        3600..86400 => two_units(seconds / 3600, "h", seconds % 3600 / 60, "min"),
        _ => two_units(seconds / 86400, "d", seconds % 86400 / 3600, "h"),
    }
}

fn two_units(major: u64, major_unit: &str, minor: u64, minor_unit: &str) -> String {
    if minor == 0 {
        format!("{major} {major_unit}")
    } else {
        format!("{major} {major_unit} {minor} {minor_unit}")
    }
}

fn rate(per_second: f64) -> String {
    if per_second >= 100.0 {
        format!("{per_second:.0}/s")
    } else if per_second >= 1.0 {
        format!("{per_second:.1}/s")
    } else if per_second > 0.0 {
        format!("{:.1}/min", per_second * 60.0)
    } else {
        "0/s".to_owned()
    }
}

/// Polyline points of a rate series over the window ending `now`, in a `width` ×
/// `height` box, scaled to `top`.
fn points(
    rates: &SubscriptionRates,
    now: DateTime<Utc>,
    (width, height): (f64, f64),
    top: f64,
    value: fn(&crate::rates::RatePoint) -> f64,
) -> String {
    // Until 15 minutes are sampled, the time sampled so far fills the chart.
    let window = (rates.covered.as_secs_f64()
        + rates
            .points
            .last()
            .map_or(0.0, |last| (now - last.at).as_seconds_f64().max(0.0)))
    .clamp(1.0, WINDOW.as_secs_f64());
    rates
        .points
        .iter()
        .map(|point| {
            let age = (now - point.at).as_seconds_f64().clamp(0.0, window);
            let x = width * (1.0 - age / window);
            let y = height - 1.0 - (height - 2.0) * (value(point) / top).min(1.0);
            format!("{x:.1},{y:.1}")
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn peak(rates: &SubscriptionRates) -> f64 {
    rates
        .points
        .iter()
        .map(|point| point.delivered_per_second.max(point.acked_per_second))
        .fold(0.0, f64::max)
}

fn sparkline(rates: Option<&SubscriptionRates>, now: DateTime<Utc>) -> Markup {
    let Some(rates) = rates else {
        return html! { span.sub { "measuring…" } };
    };
    let top = peak(rates).max(f64::EPSILON);
    let size = (96.0, 28.0);
    html! {
        span.rates {
            svg.spark viewBox="0 0 96 28" width="96" height="28" role="img"
                aria-label=(format!("deliveries {}, acks {}, over the last 15 minutes", rate(rates.delivered_per_second), rate(rates.acked_per_second))) {
                polyline.delivered points=(points(rates, now, size, top, |p| p.delivered_per_second)) {}
                polyline.acked points=(points(rates, now, size, top, |p| p.acked_per_second)) {}
            }
            span.legend {
                span.delivered title="delivered" { (rate(rates.delivered_per_second)) }
                span.acked title="acked" { (rate(rates.acked_per_second)) }
            }
        }
    }
}

/// What each hand-out of an event is, in words: a delivery to a consumer, or — where the
/// gateway sends it itself, to an endpoint or a broker — an attempt, which may fail and be
/// made again (a broker that is down is tried again and again).
fn handed_out_word(view: &SubscriptionView) -> &'static str {
    if view.subscription.settings.drained_by_gateway() {
        "Send attempts"
    } else {
        "Delivered"
    }
}

fn rate_chart(rates: Option<&SubscriptionRates>, now: DateTime<Utc>, handed_out: &str) -> Markup {
    let Some(rates) = rates else {
        return html! { span.sub { "Measuring: rates appear after the first two samples." } };
    };
    let top = peak(rates).max(f64::EPSILON);
    let size = (600.0, 120.0);
    html! {
        figure.chart {
            svg viewBox="0 0 600 120" preserveAspectRatio="none" role="img"
                aria-label=(format!("deliveries and acks per second over the last 15 minutes; peak {}", rate(top))) {
                line.grid x1="0" y1="1" x2="600" y2="1" {}
                line.grid x1="0" y1="60" x2="600" y2="60" {}
                line.grid x1="0" y1="119" x2="600" y2="119" {}
                polyline.delivered points=(points(rates, now, size, top, |p| p.delivered_per_second)) {}
                polyline.acked points=(points(rates, now, size, top, |p| p.acked_per_second)) {}
            }
            figcaption {
                span.key.delivered { (handed_out) " " (rate(rates.delivered_per_second)) }
                span.key.acked { "Acked " (rate(rates.acked_per_second)) }
                span.sub { "peak " (rate(top)) " · averages over " (duration(rates.covered)) }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_is_indented_with_every_token_as_written() {
        assert_eq!(
            indent_json(r#"{"b":1.50,"a":[ ],"s":"x, {y}: \"z\"","n":[1,{"k":null}]}"#),
            "{\n  \"b\": 1.50,\n  \"a\": [],\n  \"s\": \"x, {y}: \\\"z\\\"\",\n  \"n\": [\n    1,\n    {\n      \"k\": null\n    }\n  ]\n}"
        );
        assert_eq!(indent_json("42"), "42");
    }

    #[test]
    fn numbers_and_durations_read_well() {
        assert_eq!(count(0), "0");
        assert_eq!(count(999), "999");
        assert_eq!(count(1000), "1,000");
        assert_eq!(count(1234567), "1,234,567");
        assert_eq!(duration(Duration::ZERO), "0 s");
        assert_eq!(duration(Duration::from_millis(250)), "250 ms");
        assert_eq!(duration(Duration::from_secs(185)), "3 min 5 s");
        assert_eq!(duration(Duration::from_secs(7440)), "2 h 4 min");
        assert_eq!(duration(Duration::from_secs(900)), "15 min");
        assert_eq!(duration(Duration::from_secs(3 * 86400 + 7200)), "3 d 2 h");
        assert_eq!(rate(0.0), "0/s");
        assert_eq!(rate(0.5), "30.0/min");
        assert_eq!(rate(12.34), "12.3/s");
        assert_eq!(rate(1234.5), "1234/s");
    }
}
