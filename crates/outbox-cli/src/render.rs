//! How the CLI shows gateway answers: JSON values for `--json`, aligned text otherwise.

use std::time::Duration;

use outbox_client::proto;
use outbox_domain::{StatusKind, is_json_content_type};
use serde_json::{Value, json};

pub fn timestamp(timestamp: &Option<prost_types::Timestamp>) -> Value {
    timestamp
        .as_ref()
        .and_then(|t| chrono::DateTime::from_timestamp(t.seconds, t.nanos.max(0) as u32))
        .map_or(Value::Null, |t| {
            json!(t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true))
        })
}

pub fn duration(duration: &Option<prost_types::Duration>) -> String {
    duration
        .and_then(|d| Duration::try_from(d).ok())
        .map_or_else(
            || "-".into(),
            |d| humantime::format_duration(round_to_millis(d)).to_string(),
        )
}

fn round_to_millis(duration: Duration) -> Duration {
    Duration::from_millis(duration.as_millis() as u64)
}

/// A payload as JSON when its content type says JSON, as text when it is UTF-8, else as
/// hex.
fn payload(event: &proto::Event) -> (&'static str, Value) {
    if is_json_content_type(&event.content_type)
        && let Ok(value) = serde_json::from_slice::<Value>(&event.payload)
    {
        return ("payload", value);
    }
    match std::str::from_utf8(&event.payload) {
        Ok(text) => ("payload_text", json!(text)),
        Err(_) => (
            "payload_hex",
            json!(
                event
                    .payload
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<String>()
            ),
        ),
    }
}

pub fn event(event: &proto::Event) -> Value {
    let (payload_key, payload) = payload(event);
    let mut value = json!({
        "id": event.id,
        "aggregate_type": event.aggregate_type,
        "aggregate_id": event.aggregate_id,
        "aggregate_version": event.aggregate_version,
        "event_type": event.event_type,
        "content_type": event.content_type,
        "metadata": event.metadata,
        "occurred_at": timestamp(&event.occurred_at),
        "created_at": timestamp(&event.created_at),
        "source": event.source,
        "deliver_at": timestamp(&event.deliver_at),
        "expires_at": timestamp(&event.expires_at),
    });
    value[payload_key] = payload;
    value
}

pub fn delivery(delivery: &proto::Delivery) -> Value {
    json!({
        "ack_id": delivery.ack_id,
        "attempt": delivery.attempt,
        "ack_deadline": timestamp(&delivery.ack_deadline),
        "event": delivery.event.as_ref().map(event),
    })
}

/// How a subscription's events leave the gateway: `pull` (Subscribe streams), `push`
/// (HTTP requests) or `sink` (into a broker, named in `sink.name`).
fn kind(subscription: &proto::Subscription) -> &'static str {
    match (&subscription.push, &subscription.sink) {
        (Some(_), _) => "push",
        (None, Some(_)) => "sink",
        (None, None) => "pull",
    }
}

/// [`kind`] for a table cell: a sink with its broker's name, `sink:<name>`.
pub fn kind_text(subscription: &proto::Subscription) -> String {
    match &subscription.sink {
        Some(sink) if subscription.push.is_none() => format!("sink:{}", sink.name),
        _ => kind(subscription).to_owned(),
    }
}

/// `text` on one line of at most `max_chars` characters: whitespace runs (a filter
/// written over several lines) become one space, and a longer text ends in `…`; `-` for
/// none.
pub fn shortened(text: &str, max_chars: usize) -> String {
    let one_line = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if one_line.is_empty() {
        return "-".to_owned();
    }
    if one_line.chars().count() <= max_chars {
        return one_line;
    }
    let mut kept: String = one_line.chars().take(max_chars.saturating_sub(1)).collect();
    kept.truncate(kept.trim_end().len());
    kept.push('…');
    kept
}

pub fn subscription(subscription: &proto::Subscription) -> Value {
    json!({
        "name": subscription.name,
        "kind": kind(subscription),
        "event_types": subscription.event_types,
        "aggregate_types": subscription.aggregate_types,
        "metadata_match": subscription.metadata_match,
        "filter": subscription.filter,
        "transform": subscription.transform,
        "ack_deadline": duration(&subscription.ack_deadline),
        "max_attempts": subscription.max_attempts,
        "retry_backoff_min": duration(&subscription.retry_backoff_min),
        "retry_backoff_max": duration(&subscription.retry_backoff_max),
        "ordered": subscription.ordered,
        "persistent_event_types": subscription.persistent_event_types,
        "sources": subscription.sources,
        "max_event_age": subscription.max_event_age.map(|age| duration(&Some(age))),
        "dead_letter_expired": subscription.dead_letter_expired,
        "created_at": timestamp(&subscription.created_at),
        "paused": subscription.paused,
        "pause_reason": subscription.pause_reason,
        "paused_at": timestamp(&subscription.paused_at),
        "paused_until": timestamp(&subscription.paused_until),
        "expire_after_idle": subscription.expire_after_idle.as_ref().map(|_| duration(&subscription.expire_after_idle)),
        "push": subscription.push.as_ref().map(push),
        "sink": subscription.sink.as_ref().map(|sink| json!({
            "name": sink.name,
            "subject": sink.subject,
            "topic": sink.topic,
            "key": sink.key,
        })),
        "push_stopped": subscription.push_stopped.as_ref().map(|stopped| json!({
            "at": timestamp(&stopped.at),
            "reason": stopped.reason,
        })),
    })
}

/// A subscription as `key: value` lines.
pub fn subscription_text(subscription: &proto::Subscription) {
    let list = |values: &[String]| {
        if values.is_empty() {
            "*".to_owned()
        } else {
            values.join(", ")
        }
    };
    let mut metadata: Vec<String> = subscription
        .metadata_match
        .iter()
        .map(|(key, value)| format!("{key}={value}"))
        .collect();
    metadata.sort();
    let max_attempts = match subscription.max_attempts {
        Some(0) => "0 (retries forever)".to_owned(),
        Some(attempts) => attempts.to_string(),
        None => "-".to_owned(),
    };
    let lines = [
        ("name", subscription.name.clone()),
        ("event types", list(&subscription.event_types)),
        ("aggregate types", list(&subscription.aggregate_types)),
        ("metadata match", list(&metadata)),
        ("filter", or_dash(&subscription.filter)),
        ("transform", or_dash(&subscription.transform)),
        ("ack deadline", duration(&subscription.ack_deadline)),
        ("max attempts", max_attempts),
        (
            "retry backoff",
            format!(
                "{} to {}",
                duration(&subscription.retry_backoff_min),
                duration(&subscription.retry_backoff_max)
            ),
        ),
        (
            "ordered",
            if subscription.ordered { "yes" } else { "no" }.into(),
        ),
        (
            "persistent event types",
            if subscription.persistent_event_types.is_empty() {
                "-".into()
            } else {
                subscription.persistent_event_types.join(", ")
            },
        ),
        (
            "sources",
            if subscription.sources.is_empty() {
                "all".into()
            } else {
                subscription.sources.join(", ")
            },
        ),
        (
            "expires",
            match subscription.expire_after_idle {
                Some(_) => format!(
                    "after {} without a reader",
                    duration(&subscription.expire_after_idle)
                ),
                None => "never".into(),
            },
        ),
        (
            "delivery",
            match (&subscription.push, &subscription.sink) {
                (Some(push), _) if push.max_batch_events > 1 => format!(
                    "push to {} in batches of up to {} events (wait {})",
                    push.endpoint,
                    push.max_batch_events,
                    duration(&push.max_batch_wait)
                ),
                (Some(push), _) => format!("push to {}", push.endpoint),
                (None, Some(sink)) if !sink.subject.is_empty() => {
                    format!("sink {} (subject {})", sink.name, sink.subject)
                }
                (None, Some(sink)) => format!(
                    "sink {} (topic {}{})",
                    sink.name,
                    sink.topic,
                    if sink.key.is_empty() {
                        String::new()
                    } else {
                        format!(", key {}", sink.key)
                    }
                ),
                (None, None) => "pull (Subscribe streams)".to_owned(),
            },
        ),
        (
            "created at",
            timestamp(&subscription.created_at)
                .as_str()
                .unwrap_or("-")
                .to_owned(),
        ),
    ];
    for (label, value) in lines {
        println!("{:<23} {value}", format!("{label}:"));
    }
    if let Some(pause) = pause_text(subscription) {
        println!("{:<23} {pause}", "paused:");
    }
    if let Some(stopped) = &subscription.push_stopped {
        println!(
            "{:<23} {} ({})",
            "push stopped:",
            stopped.reason,
            timestamp(&stopped.at).as_str().unwrap_or("-")
        );
    }
    // Shown only by the call that created or rotated it.
    if let Some(push) = subscription
        .push
        .as_ref()
        .filter(|push| !push.signing_secret.is_empty())
    {
        println!(
            "{:<23} {} (shown once: store it now)",
            "signing secret:", push.signing_secret
        );
    }
}

/// A subscription's status and push requests as `key: value` lines.
pub fn status_text(stats: &proto::SubscriptionStats) {
    if status_kind(stats).is_some() {
        println!(
            "{:<23} {} ({})",
            "status:",
            status_label(stats),
            stats.status_detail
        );
    }
    if let Some(push) = push_text(stats) {
        println!("{:<23} {push}", "push requests:");
    }
    if let Some(sink) = sink_text(stats) {
        println!("{:<23} {sink}", "sink messages:");
    }
    if let Some(filtered) = filter_text(stats) {
        println!("{:<23} {filtered}", "filtered:");
    }
    if stats.consumption_records > 0 {
        println!(
            "{:<23} {} (outbox_consume)",
            "consumed records:", stats.consumption_records
        );
    }
}

/// Whether a subscription's stats count sink messages (a sink subscription that sent
/// something, or failed to).
fn sends_to_sink(stats: &proto::SubscriptionStats) -> bool {
    stats.sink_sent_total > 0 || stats.sink_in_flight > 0 || !stats.sink_last_error.is_empty()
}

/// A sink subscription's messages in a line: how many sent and confirmed, the last
/// failure; `None` when there were none.
pub fn sink_text(stats: &proto::SubscriptionStats) -> Option<String> {
    if !sends_to_sink(stats) {
        return None;
    }
    let mut text = format!(
        "{} sent, {} confirmed ({:.1}/s), {} in flight",
        stats.sink_sent_total, stats.sink_confirmed_total, stats.sink_rate, stats.sink_in_flight
    );
    if !stats.sink_last_error.is_empty() {
        text.push_str(&format!(
            "; last error {}: {}",
            timestamp(&stats.sink_last_error_at).as_str().unwrap_or("-"),
            stats.sink_last_error
        ));
    }
    Some(text)
}

/// A pause in force in words: since when, until when, and why.
pub fn pause_text(subscription: &proto::Subscription) -> Option<String> {
    if !subscription.paused {
        return None;
    }
    let mut text = format!(
        "since {}",
        timestamp(&subscription.paused_at).as_str().unwrap_or("-")
    );
    match timestamp(&subscription.paused_until).as_str() {
        Some(until) => text.push_str(&format!(" until {until}")),
        None => text.push_str(" until resumed"),
    }
    if !subscription.pause_reason.is_empty() {
        text.push_str(&format!(": {}", subscription.pause_reason));
    }
    Some(text)
}

fn push(push: &proto::PushConfig) -> Value {
    let mut value = json!({
        "endpoint": push.endpoint,
        "headers": push.headers,
        "format": match proto::PushFormat::try_from(push.format) {
            Ok(proto::PushFormat::CloudeventsStructured) => "structured",
            _ => "binary",
        },
        "timeout": duration(&push.timeout),
        "max_concurrency": push.max_concurrency,
        "rate_limit": push.rate_limit,
        "max_batch_events": push.max_batch_events.max(1),
    });
    if push.max_batch_events > 1 {
        value["max_batch_bytes"] = json!(push.max_batch_bytes);
        value["max_batch_wait"] = json!(duration(&push.max_batch_wait));
    }
    // Shown only by the call that made it.
    if !push.signing_secret.is_empty() {
        value["signing_secret"] = json!(push.signing_secret);
    }
    value
}

pub fn dead_letter(dead_letter: &proto::DeadLetter) -> Value {
    json!({
        "subscription": dead_letter.subscription,
        "event": dead_letter.event.as_ref().map(event),
        "attempts": dead_letter.attempts,
        "last_error": dead_letter.last_error,
        "dead_lettered_at": timestamp(&dead_letter.dead_lettered_at),
        "resolved": dead_letter.resolved,
        "resolved_at": timestamp(&dead_letter.resolved_at),
        "resolved_by": dead_letter.resolved_by,
        "notes": dead_letter.notes,
    })
}

pub fn stats(stats: &proto::Stats) -> Value {
    let outbox = stats.outbox.unwrap_or_default();
    json!({
        "subscriptions": stats.subscriptions.iter().map(|s| with_push_stats(s, json!({
            "name": s.name,
            "status": status_label(s),
            "status_detail": s.status_detail,
            "pending": s.pending,
            "in_flight": s.in_flight,
            "awaiting_retry": s.awaiting_retry,
            "dead_lettered": s.dead_lettered,
            "lag_events": s.lag_events,
            "lag_seconds": s.lag.map_or(0.0, |d| d.seconds as f64 + d.nanos as f64 / 1e9),
            "oldest_unacked_age_seconds": s.oldest_unacked_age.map_or(0.0, |d| d.seconds as f64 + d.nanos as f64 / 1e9),
            "delivered_total": s.delivered_total,
            "acked_total": s.acked_total,
            "expired_total": s.expired_total,
            "filtered_total": s.filtered_total,
            "filter_errors_total": s.filter_errors_total,
            "last_filter_error": s.last_filter_error,
            "last_filter_error_at": timestamp(&s.last_filter_error_at),
            "scheduled": s.scheduled,
            "next_scheduled_at": timestamp(&s.next_scheduled_at),
        }))).collect::<Vec<_>>(),
        "outbox": {
            "events_stored": outbox.events_stored,
            "oldest_event_at": timestamp(&outbox.oldest_event_at),
            "newest_event_at": timestamp(&outbox.newest_event_at),
            "oldest_open_transaction_age_seconds": outbox.oldest_open_transaction_age.map_or(0.0, |d| d.seconds as f64 + d.nanos as f64 / 1e9),
            "events_force_expired": outbox.events_force_expired,
        },
    })
}

/// The kind of a subscription's status, `None` when the gateway gave none (an older
/// gateway, or a figure per source).
pub fn status_kind(stats: &proto::SubscriptionStats) -> Option<StatusKind> {
    Some(match stats.status() {
        proto::SubscriptionStatus::Unspecified => return None,
        proto::SubscriptionStatus::PushStopped => StatusKind::PushStopped,
        proto::SubscriptionStatus::SinkUnreachable => StatusKind::SinkUnreachable,
        proto::SubscriptionStatus::Paused => StatusKind::Paused,
        proto::SubscriptionStatus::DeadLetters => StatusKind::DeadLetters,
        proto::SubscriptionStatus::Behind => StatusKind::Behind,
        proto::SubscriptionStatus::NoConsumer => StatusKind::NoConsumer,
        proto::SubscriptionStatus::Delivering => StatusKind::Delivering,
        proto::SubscriptionStatus::ScheduledOnly => StatusKind::ScheduledOnly,
        proto::SubscriptionStatus::CaughtUp => StatusKind::CaughtUp,
    })
}

/// The status in the words the console shows too.
pub fn status_label(stats: &proto::SubscriptionStats) -> &'static str {
    status_kind(stats).map_or("-", StatusKind::label)
}

/// What a subscription's filter passed over, in a line; `None` when it passed nothing.
pub fn filter_text(stats: &proto::SubscriptionStats) -> Option<String> {
    if stats.filtered_total == 0 && stats.last_filter_error.is_empty() {
        return None;
    }
    let mut text = format!(
        "{} events passed over, {} of them on errors",
        stats.filtered_total, stats.filter_errors_total
    );
    if !stats.last_filter_error.is_empty() {
        text.push_str(&format!(
            "; last error {}: {}",
            timestamp(&stats.last_filter_error_at)
                .as_str()
                .unwrap_or("-"),
            stats.last_filter_error
        ));
    }
    Some(text)
}

fn or_dash(text: &str) -> String {
    if text.is_empty() { "-" } else { text }.to_owned()
}

/// A push subscription's requests in a line: how many, the last answer, the last
/// failure; `None` for a pull subscription.
pub fn push_text(stats: &proto::SubscriptionStats) -> Option<String> {
    let pushes = stats.push_requests_total > 0
        || stats.push_in_flight > 0
        || !stats.push_last_error.is_empty()
        || !stats.push_stopped_reason.is_empty();
    if !pushes {
        return None;
    }
    let mut text = format!(
        "{} requests ({:.1}/s), {} events in flight, last answer {}",
        stats.push_requests_total,
        stats.push_rate,
        stats.push_in_flight,
        match stats.push_last_status {
            0 => "none".to_owned(),
            status => status.to_string(),
        }
    );
    if !stats.push_last_error.is_empty() {
        text.push_str(&format!(
            "; last error {}: {}",
            timestamp(&stats.push_last_error_at).as_str().unwrap_or("-"),
            stats.push_last_error
        ));
    }
    if !stats.push_stopped_reason.is_empty() {
        text.push_str(&format!("; stopped: {}", stats.push_stopped_reason));
    }
    Some(text)
}

/// Adds a push subscription's request stats, a sink subscription's messages and the
/// records of `outbox_consume`.
fn with_push_stats(stats: &proto::SubscriptionStats, mut value: Value) -> Value {
    let pushes = stats.push_requests_total > 0
        || stats.push_in_flight > 0
        || !stats.push_last_error.is_empty()
        || !stats.push_stopped_reason.is_empty();
    if pushes {
        value["push"] = json!({
            "in_flight": stats.push_in_flight,
            "last_status": stats.push_last_status,
            "last_error": stats.push_last_error,
            "last_error_at": timestamp(&stats.push_last_error_at),
            "requests_total": stats.push_requests_total,
            "rate": stats.push_rate,
            "stopped_reason": stats.push_stopped_reason,
        });
    }
    if stats.consumption_records > 0 {
        value["consumption_records"] = json!(stats.consumption_records);
    }
    if sends_to_sink(stats) {
        value["sink"] = json!({
            "in_flight": stats.sink_in_flight,
            "last_error": stats.sink_last_error,
            "last_error_at": timestamp(&stats.sink_last_error_at),
            "sent_total": stats.sink_sent_total,
            "confirmed_total": stats.sink_confirmed_total,
            "rate": stats.sink_rate,
        });
    }
    value
}

pub fn source(source: &proto::Source) -> Value {
    json!({
        "name": source.name,
        "status": source_status(source),
        "last_error": source.last_error,
        "since": timestamp(&source.since),
        "events_stored": source.events_stored,
        "oldest_event_at": timestamp(&source.oldest_event_at),
        "oldest_open_transaction_age_seconds": source.oldest_open_transaction_age.map_or(0.0, |d| d.seconds as f64 + d.nanos as f64 / 1e9),
        "schema_version": source.schema_version,
    })
}

fn source_status(source: &proto::Source) -> &'static str {
    match source.status() {
        proto::SourceStatus::Connected => "connected",
        proto::SourceStatus::Unavailable => "unavailable",
        proto::SourceStatus::Unspecified => "unknown",
    }
}

pub fn sources_table(sources: &[proto::Source]) {
    let rows: Vec<Vec<String>> = sources
        .iter()
        .map(|source| {
            vec![
                source.name.clone(),
                source_status(source).to_owned(),
                timestamp(&source.since).as_str().unwrap_or("").to_owned(),
                source.events_stored.to_string(),
                duration(&source.oldest_open_transaction_age),
                source.schema_version.to_string(),
                source.last_error.clone(),
            ]
        })
        .collect();
    table(
        &[
            "SOURCE",
            "STATUS",
            "SINCE",
            "EVENTS",
            "OLDEST OPEN TXN",
            "SCHEMA",
            "LAST ERROR",
        ],
        &rows,
    );
}

/// Prints rows as left-aligned columns under a header.
/// An age rounded to what a reader takes in at a glance: whole seconds beyond a minute,
/// milliseconds below; `-` for none.
fn age(duration: &Option<prost_types::Duration>) -> String {
    match duration.and_then(|d| Duration::try_from(d).ok()) {
        None => "-".into(),
        Some(age) if age.is_zero() => "0s".into(),
        Some(age) if age >= Duration::from_secs(60) => {
            humantime::format_duration(Duration::from_secs(age.as_secs())).to_string()
        }
        Some(age) => humantime::format_duration(round_to_millis(age)).to_string(),
    }
}

pub fn table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        println!("{}", padded.join("  ").trim_end());
    };
    line(header.iter().map(|h| h.to_string()).collect());
    for row in rows {
        line(row.clone());
    }
}

pub fn stats_table(stats: &proto::Stats) {
    let rows: Vec<Vec<String>> = stats
        .subscriptions
        .iter()
        .map(|s| {
            vec![
                s.name.clone(),
                status_label(s).to_owned(),
                s.pending.to_string(),
                s.scheduled.to_string(),
                s.in_flight.to_string(),
                s.awaiting_retry.to_string(),
                s.dead_lettered.to_string(),
                s.lag_events.to_string(),
                age(&s.oldest_unacked_age),
                age(&s.lag),
                s.delivered_total.to_string(),
                s.acked_total.to_string(),
            ]
        })
        .collect();
    table(
        &[
            "SUBSCRIPTION",
            "STATUS",
            "PENDING",
            "SCHEDULED",
            "IN FLIGHT",
            "RETRY",
            "DEAD",
            "LAG",
            "OLDEST UNACKED",
            "BEHIND NEWEST",
            "DELIVERED",
            "ACKED",
        ],
        &rows,
    );
    // What the columns cannot hold: why each subscription that needs a look does, and
    // how its pushes go.
    let mut notes = Vec::new();
    for s in &stats.subscriptions {
        let kind = status_kind(s);
        if kind.is_some_and(|kind| kind.needs_attention() || kind == StatusKind::ScheduledOnly) {
            notes.push(format!("{}: {}", s.name, s.status_detail));
        }
        if let Some(push) = push_text(s) {
            notes.push(format!("{}: push {push}", s.name));
        }
        if !s.last_filter_error.is_empty() {
            notes.push(format!(
                "{}: filter failed on {} events, last: {}",
                s.name, s.filter_errors_total, s.last_filter_error
            ));
        }
    }
    if !notes.is_empty() {
        println!();
        for note in notes {
            println!("{note}");
        }
    }
    if let Some(outbox) = &stats.outbox {
        println!();
        println!(
            "outbox: {} events stored, oldest {}, newest {}, oldest open transaction {}{}",
            outbox.events_stored,
            timestamp(&outbox.oldest_event_at).as_str().unwrap_or("-"),
            timestamp(&outbox.newest_event_at).as_str().unwrap_or("-"),
            duration(&outbox.oldest_open_transaction_age),
            if outbox.events_force_expired > 0 {
                format!(", {} events force-expired", outbox.events_force_expired)
            } else {
                String::new()
            }
        );
    }
}

pub fn dead_letter_group(group: &proto::DeadLetterGroup) -> Value {
    json!({
        "last_error": group.last_error,
        "count": group.count,
        "first_dead_lettered_at": timestamp(&group.first_dead_lettered_at),
        "last_dead_lettered_at": timestamp(&group.last_dead_lettered_at),
        "example_event_id": group.example_event_id,
    })
}

/// A delivery state as a JSON word: `in_flight`, `dead`, ...
fn delivery_state(state: i32) -> String {
    proto::DeliveryState::try_from(state)
        .map(|state| {
            state
                .as_str_name()
                .trim_start_matches("DELIVERY_STATE_")
                .to_ascii_lowercase()
        })
        .unwrap_or_else(|_| format!("unknown ({state})"))
}

pub fn event_deliveries(deliveries: &proto::EventDeliveries) -> Value {
    json!({
        "event": deliveries.event.as_ref().map(event),
        "subscriptions": deliveries.subscriptions.iter().map(|entry| json!({
            "subscription": entry.subscription,
            "state": delivery_state(entry.state),
            "attempt": entry.attempt,
            "due_at": timestamp(&entry.due_at),
            "last_error": entry.last_error,
            "dead_lettered_at": timestamp(&entry.dead_lettered_at),
            "resolved_at": timestamp(&entry.resolved_at),
            "resolved_by": entry.resolved_by,
            "notes": entry.notes,
        })).collect::<Vec<_>>(),
    })
}

/// An event, then one row per subscription saying where it stands there.
pub fn event_deliveries_text(deliveries: &proto::EventDeliveries) {
    let event = deliveries.event.clone().unwrap_or_default();
    let time =
        |at: &Option<prost_types::Timestamp>| timestamp(at).as_str().unwrap_or("-").to_owned();
    for (label, value) in [
        ("id", event.id.clone()),
        ("event type", event.event_type.clone()),
        (
            "aggregate",
            format!("{}/{}", event.aggregate_type, event.aggregate_id),
        ),
        ("source", event.source.clone()),
        ("created at", time(&event.created_at)),
        (
            "payload",
            String::from_utf8_lossy(&event.payload).into_owned(),
        ),
    ] {
        println!("{:<23} {value}", format!("{label}:"));
    }
    println!();
    let rows: Vec<Vec<String>> = deliveries
        .subscriptions
        .iter()
        .map(|entry| {
            let resolved = if entry.resolved_at.is_some() {
                format!(" (resolved by {})", entry.resolved_by)
            } else {
                String::new()
            };
            vec![
                entry.subscription.clone(),
                format!(
                    "{}{resolved}",
                    delivery_state(entry.state).replace('_', " ")
                ),
                // 0: not delivered yet, or settled for good (an acked event's record
                // is gone, with its count).
                match entry.attempt {
                    0 => "-".to_owned(),
                    attempt => attempt.to_string(),
                },
                time(&entry.due_at),
                entry.last_error.clone(),
            ]
        })
        .collect();
    table(
        &["SUBSCRIPTION", "STATE", "ATTEMPT", "DUE AT", "LAST ERROR"],
        &rows,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shortened_texts_keep_to_one_line_and_the_width() {
        assert_eq!(shortened("", 10), "-");
        assert_eq!(shortened("  \n ", 10), "-");
        assert_eq!(shortened("a == 1", 10), "a == 1");
        assert_eq!(
            shortened("payload.total > 10\n  && metadata.x == 'y'", 100),
            "payload.total > 10 && metadata.x == 'y'"
        );
        let cut = shortened("payload.total > 1000.0 && region == 'eu'", 16);
        assert_eq!(cut, "payload.total >…");
        assert_eq!(cut.chars().count(), 16);
        assert_eq!(shortened("ééééé", 3).chars().count(), 3);
    }

    #[test]
    fn kinds_name_how_events_leave() {
        let pull = proto::Subscription::default();
        assert_eq!((kind(&pull), kind_text(&pull)), ("pull", "pull".to_owned()));
        let push = proto::Subscription {
            push: Some(proto::PushConfig::default()),
            ..Default::default()
        };
        assert_eq!((kind(&push), kind_text(&push)), ("push", "push".to_owned()));
        let sink = proto::Subscription {
            sink: Some(proto::SinkConfig {
                name: "bus".into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(
            (kind(&sink), kind_text(&sink)),
            ("sink", "sink:bus".to_owned())
        );
    }
}
