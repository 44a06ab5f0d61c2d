//! Conversions between protobuf messages and domain types, with the field names that
//! error messages use.

use std::{collections::BTreeMap, time::Duration};

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::{
    delivery::AckWriter,
    domain::{
        AckId, DEFAULT_CONTENT_TYPE, DeadLetter, DeadLetterGroup, DeadLetterSelection, Delivery,
        DeliveryState, Echo, Event, EventDeliveries, EventFilter, NewEvent, OutboxStats,
        PatternSet, PayloadTransform, PushConfig, PushFormat, PushInput, Refusal, SinkConfig,
        SinkInput, SourceName, StartPosition, StatusKind, Subscription, SubscriptionName,
        SubscriptionPatch, SubscriptionSettings, SubscriptionStats, Template, check_timestamp,
        fingerprint, parse_event_id,
    },
    error::{Error, Result},
    operations::{SourceStatus, SubscriptionStatsReport},
    proto,
    sources::Sources,
    subscriptions::SubscriptionChange,
};

pub(super) fn new_event(index: usize, input: proto::EventInput) -> Result<NewEvent> {
    let field = |name: &str| format!("events[{index}].{name}");
    let id = if input.id.is_empty() {
        None
    } else {
        Some(event_id(&field("id"), &input.id)?)
    };
    let occurred_at = input
        .occurred_at
        .map(|timestamp| timestamp_to_datetime(&field("occurred_at"), timestamp))
        .transpose()?;
    Ok(NewEvent {
        id,
        aggregate_type: input.aggregate_type,
        aggregate_id: input.aggregate_id,
        aggregate_version: input.aggregate_version,
        event_type: input.event_type,
        payload: input.payload,
        content_type: if input.content_type.is_empty() {
            DEFAULT_CONTENT_TYPE.to_owned()
        } else {
            input.content_type
        },
        metadata: input.metadata.into_iter().collect(),
        occurred_at,
        deliver_at: optional_timestamp(&field("deliver_at"), input.deliver_at)?,
        expires_at: optional_timestamp(&field("expires_at"), input.expires_at)?,
    })
}

pub(super) fn event(event: Event) -> proto::Event {
    proto::Event {
        source: event.source.as_str().to_owned(),
        // Without the formatting machinery, which cost more than the encoding.
        id: event
            .id
            .hyphenated()
            .encode_lower(&mut Uuid::encode_buffer())
            .to_owned(),
        aggregate_type: event.aggregate_type,
        aggregate_id: event.aggregate_id,
        aggregate_version: event.aggregate_version,
        event_type: event.event_type,
        payload: event.payload,
        content_type: event.content_type,
        metadata: event.metadata,
        occurred_at: Some(datetime_to_timestamp(event.occurred_at)),
        created_at: Some(datetime_to_timestamp(event.created_at)),
        deliver_at: event.deliver_at.map(datetime_to_timestamp),
        expires_at: event.expires_at.map(datetime_to_timestamp),
        // Transaction ids are never negative (`pg_current_xact_id()`).
        transaction_id: u64::try_from(event.transaction_id).unwrap_or_default(),
    }
}

pub(super) fn delivery(delivery: Delivery, ack_writer: &AckWriter) -> proto::Delivery {
    proto::Delivery {
        ack_id: ack_writer.text(&delivery),
        attempt: delivery.attempt,
        event: Some(event(delivery.event)),
        ack_deadline: Some(datetime_to_timestamp(delivery.ack_deadline)),
    }
}

pub(super) fn subscription_name(field: &str, name: &str) -> Result<SubscriptionName> {
    Ok(SubscriptionName::parse(field, name)?)
}

pub(super) fn ack_ids(field: &str, ack_ids: &[String], sources: &Sources) -> Result<Vec<AckId>> {
    if ack_ids.is_empty() {
        return Err(Error::invalid(field, "must contain at least one ack id"));
    }
    // The field's name is written only for an ack id that is refused: a request carries
    // hundreds of them.
    ack_ids
        .iter()
        .enumerate()
        .map(|(index, text)| {
            parse_ack_id(text, sources)
                .ok_or_else(|| not_an_ack_id(&format!("{field}[{index}]"), text))
        })
        .collect()
}

pub(super) fn ack_id(field: &str, text: &str, sources: &Sources) -> Result<AckId> {
    parse_ack_id(text, sources).ok_or_else(|| not_an_ack_id(field, text))
}

fn parse_ack_id(text: &str, sources: &Sources) -> Option<AckId> {
    AckId::parse(text, |name| sources.id_of(name))
}

fn not_an_ack_id(field: &str, text: &str) -> Error {
    Error::invalid(
        field,
        format!("{} is not an ack id from this gateway", Echo(text)),
    )
}

/// The ack ids of a request (`texts`, parsed as `parsed`) that are among `chosen`, as
/// the caller wrote them and in its order.
pub(super) fn as_requested(texts: &[String], parsed: &[AckId], chosen: &[AckId]) -> Vec<String> {
    if chosen.is_empty() {
        return Vec::new();
    }
    let chosen: std::collections::HashSet<&AckId> = chosen.iter().collect();
    texts
        .iter()
        .zip(parsed)
        .filter(|(_, ack)| chosen.contains(ack))
        .map(|(text, _)| text.clone())
        .collect()
}

/// An optional CEL expression: empty means none.
fn optional_expression<T>(
    field: &str,
    text: &str,
    parse: fn(&str, &str) -> std::result::Result<T, Refusal>,
) -> Result<Option<T>> {
    if text.is_empty() {
        return Ok(None);
    }
    Ok(parse(field, text).map(Some)?)
}

/// An optional source name: empty means none.
pub(super) fn optional_source(field: &str, name: &str) -> Result<Option<SourceName>> {
    if name.is_empty() {
        return Ok(None);
    }
    Ok(SourceName::parse(field, name).map(Some)?)
}

/// A new subscription from its message: name, settings (defaults for unset fields),
/// sources and start position.
/// A CreateSubscription request, parsed.
pub(super) struct NewSubscription {
    pub name: SubscriptionName,
    pub settings: SubscriptionSettings,
    pub sources: Vec<SourceName>,
    pub start: StartPosition,
    pub expire_after_idle: Option<Duration>,
}

pub(super) fn new_subscription(message: Option<proto::Subscription>) -> Result<NewSubscription> {
    let message = message.ok_or_else(|| Error::invalid("subscription", "is required"))?;
    let name = subscription_name("subscription.name", &message.name)?;
    let defaults = SubscriptionSettings::default();
    let sink = message
        .sink
        .map(|sink| sink_config("subscription.sink", sink))
        .transpose()?;
    let default_max_attempts = match sink {
        Some(_) => SinkConfig::DEFAULT_MAX_ATTEMPTS,
        None => defaults.max_attempts,
    };
    let settings = SubscriptionSettings {
        event_types: patterns("subscription.event_types", &message.event_types)?,
        aggregate_types: message.aggregate_types,
        metadata_match: message
            .metadata_match
            .into_iter()
            .collect::<BTreeMap<_, _>>(),
        filter: optional_expression("subscription.filter", &message.filter, EventFilter::parse)?,
        transform: optional_expression(
            "subscription.transform",
            &message.transform,
            PayloadTransform::parse,
        )?,
        ack_deadline: optional_duration("subscription.ack_deadline", message.ack_deadline)?
            .unwrap_or(defaults.ack_deadline),
        max_attempts: message.max_attempts.unwrap_or(default_max_attempts),
        retry_backoff_min: optional_duration(
            "subscription.retry_backoff_min",
            message.retry_backoff_min,
        )?
        .unwrap_or(defaults.retry_backoff_min),
        retry_backoff_max: optional_duration(
            "subscription.retry_backoff_max",
            message.retry_backoff_max,
        )?
        .unwrap_or(defaults.retry_backoff_max),
        ordered: message.ordered,
        persistent_event_types: patterns(
            "subscription.persistent_event_types",
            &message.persistent_event_types,
        )?,
        max_event_age: optional_duration("subscription.max_event_age", message.max_event_age)?,
        dead_letter_expired: message.dead_letter_expired,
        push: message
            .push
            .map(|push| push_config("subscription.push", push))
            .transpose()?,
        sink,
    };
    let start = start_position("subscription.start", message.start)?;
    let sources = message
        .sources
        .iter()
        .enumerate()
        .map(|(index, source)| {
            SourceName::parse(&format!("subscription.sources[{index}]"), source)
                .map_err(Error::from)
        })
        .collect::<Result<Vec<_>>>()?;
    let expire_after_idle =
        optional_duration("subscription.expire_after_idle", message.expire_after_idle)?;
    Ok(NewSubscription {
        name,
        settings,
        sources,
        start,
        expire_after_idle,
    })
}

pub(super) fn subscription(subscription: Subscription) -> proto::Subscription {
    let pause = subscription.pause_in_force(Utc::now()).cloned();
    let settings = subscription.settings;
    proto::Subscription {
        paused: pause.is_some(),
        pause_reason: pause
            .as_ref()
            .map(|pause| pause.reason.clone())
            .unwrap_or_default(),
        paused_until: pause
            .as_ref()
            .and_then(|pause| pause.until)
            .map(datetime_to_timestamp),
        paused_at: pause
            .as_ref()
            .map(|pause| datetime_to_timestamp(pause.since)),
        name: subscription.name.as_str().to_owned(),
        event_types: settings.event_types.to_strings(),
        aggregate_types: settings.aggregate_types,
        metadata_match: settings.metadata_match.into_iter().collect(),
        filter: settings
            .filter
            .as_ref()
            .map(|filter| filter.as_str().to_owned())
            .unwrap_or_default(),
        transform: settings
            .transform
            .as_ref()
            .map(|transform| transform.as_str().to_owned())
            .unwrap_or_default(),
        start: None,
        ack_deadline: Some(duration_to_proto(settings.ack_deadline)),
        max_attempts: Some(settings.max_attempts),
        retry_backoff_min: Some(duration_to_proto(settings.retry_backoff_min)),
        retry_backoff_max: Some(duration_to_proto(settings.retry_backoff_max)),
        ordered: settings.ordered,
        persistent_event_types: settings.persistent_event_types.to_strings(),
        max_event_age: settings.max_event_age.map(duration_to_proto),
        dead_letter_expired: settings.dead_letter_expired,
        created_at: Some(datetime_to_timestamp(subscription.created_at)),
        expire_after_idle: subscription.expire_after_idle.map(duration_to_proto),
        sources: subscription
            .sources
            .iter()
            .map(|source| source.as_str().to_owned())
            .collect(),
        push: settings.push.map(|push| proto::PushConfig {
            endpoint: push.endpoint.as_str().to_owned(),
            headers: push
                .headers
                .iter()
                .map(|(name, value)| (name.clone(), fingerprint(value)))
                .collect(),
            format: match push.format {
                PushFormat::Binary => proto::PushFormat::CloudeventsBinary,
                PushFormat::Structured => proto::PushFormat::CloudeventsStructured,
            } as i32,
            timeout: Some(duration_to_proto(push.timeout)),
            max_concurrency: push.max_concurrency,
            rate_limit: push.rate_limit,
            max_batch_events: push.max_batch_events,
            max_batch_bytes: if push.batched() {
                push.max_batch_bytes
            } else {
                0
            },
            max_batch_wait: push
                .batched()
                .then(|| duration_to_proto(push.max_batch_wait)),
            signing_secret: String::new(),
        }),
        push_stopped: subscription.push_stopped.map(|stopped| proto::PushStopped {
            at: Some(datetime_to_timestamp(stopped.at)),
            reason: stopped.reason,
        }),
        sink: settings.sink.map(|sink| {
            let text = |template: Option<Template>| {
                template.map_or_else(String::new, |t| t.as_str().to_owned())
            };
            proto::SinkConfig {
                name: sink.name,
                subject: text(sink.subject),
                topic: text(sink.topic),
                key: text(sink.key),
            }
        }),
    }
}

fn sink_config(field: &str, message: proto::SinkConfig) -> Result<SinkConfig> {
    Ok(SinkConfig::parse(
        field,
        SinkInput {
            name: message.name,
            subject: message.subject,
            topic: message.topic,
            key: message.key,
        },
    )?)
}

/// A created or updated subscription, with the signing key the change made (shown
/// only here).
pub(super) fn changed_subscription(change: SubscriptionChange) -> proto::Subscription {
    let mut message = subscription(change.subscription);
    if let (Some(push), Some(secret)) = (&mut message.push, change.new_secret) {
        push.signing_secret = secret.text();
    }
    message
}

fn push_config(field: &str, message: proto::PushConfig) -> Result<PushConfig> {
    let format = match proto::PushFormat::try_from(message.format) {
        Ok(proto::PushFormat::Unspecified | proto::PushFormat::CloudeventsBinary) => {
            PushFormat::Binary
        }
        Ok(proto::PushFormat::CloudeventsStructured) => PushFormat::Structured,
        Err(_) => {
            return Err(Error::invalid(
                format!("{field}.format"),
                format!("{} is not a PushFormat", message.format),
            ));
        }
    };
    PushConfig::parse(
        field,
        PushInput {
            endpoint: message.endpoint,
            headers: message.headers.into_iter().collect(),
            format,
            timeout: optional_duration(&format!("{field}.timeout"), message.timeout)?,
            max_concurrency: message.max_concurrency,
            rate_limit: message.rate_limit,
            max_batch_events: message.max_batch_events,
            max_batch_bytes: message.max_batch_bytes,
            max_batch_wait: optional_duration(
                &format!("{field}.max_batch_wait"),
                message.max_batch_wait,
            )?,
        },
    )
    .map_err(Error::from)
}

fn patterns(field: &str, patterns: &[String]) -> Result<PatternSet> {
    let set = PatternSet::parse(patterns)
        .map_err(|(index, message)| Error::invalid(format!("{field}[{index}]"), message))?;
    set.check_size(field)?;
    Ok(set)
}

pub(super) fn start_position(
    field: &str,
    start: Option<proto::StartPosition>,
) -> Result<StartPosition> {
    use proto::start_position::Position;
    match start.and_then(|start| start.position) {
        None => Ok(StartPosition::Latest),
        Some(Position::Boundary(boundary)) => match proto::Boundary::try_from(boundary) {
            Ok(proto::Boundary::Unspecified | proto::Boundary::Latest) => Ok(StartPosition::Latest),
            Ok(proto::Boundary::Earliest) => Ok(StartPosition::Earliest),
            Err(_) => Err(Error::invalid(
                format!("{field}.boundary"),
                format!("{boundary} is not a known boundary"),
            )),
        },
        Some(Position::Time(timestamp)) => Ok(StartPosition::Time(timestamp_to_datetime(
            &format!("{field}.time"),
            timestamp,
        )?)),
    }
}

/// A non-negative protobuf duration, or `None` when unset. Only the normalized form is
/// accepted (nanos within ±999,999,999 and of the same sign as the seconds): anything
/// else would silently mean another duration than the one written.
pub(super) fn optional_duration(
    field: &str,
    duration: Option<prost_types::Duration>,
) -> Result<Option<Duration>> {
    let Some(duration) = duration else {
        return Ok(None);
    };
    if duration.nanos.unsigned_abs() >= 1_000_000_000 {
        return Err(Error::invalid(
            field,
            "nanos must be between -999999999 and 999999999",
        ));
    }
    if duration.seconds < 0 || duration.nanos < 0 {
        return Err(Error::invalid(field, "must be a non-negative duration"));
    }
    Ok(Some(Duration::new(
        duration.seconds as u64,
        duration.nanos as u32,
    )))
}

fn duration_to_proto(duration: Duration) -> prost_types::Duration {
    prost_types::Duration::try_from(duration).unwrap_or(prost_types::Duration {
        seconds: i64::MAX,
        nanos: 0,
    })
}

/// Truncated to microseconds, PostgreSQL's precision, so a stored time compares equal to
/// the one that was sent.
fn timestamp_to_datetime(field: &str, timestamp: prost_types::Timestamp) -> Result<DateTime<Utc>> {
    let nanos = u32::try_from(timestamp.nanos)
        .ok()
        .filter(|n| *n < 1_000_000_000)
        .ok_or_else(|| Error::invalid(field, "nanos must be between 0 and 999999999"))?;
    let time = DateTime::from_timestamp(timestamp.seconds, nanos / 1000 * 1000)
        .unwrap_or(DateTime::<Utc>::MAX_UTC);
    check_timestamp(field, time)?;
    Ok(time)
}

pub(super) fn datetime_to_timestamp(datetime: DateTime<Utc>) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: datetime.timestamp(),
        nanos: datetime.timestamp_subsec_nanos() as i32,
    }
}

/// An optional subscription name: empty means none.
pub(super) fn optional_subscription_name(
    field: &str,
    name: &str,
) -> Result<Option<SubscriptionName>> {
    if name.is_empty() {
        return Ok(None);
    }
    subscription_name(field, name).map(Some)
}

pub(super) fn event_id(field: &str, id: &str) -> Result<Uuid> {
    Ok(parse_event_id(field, id)?)
}

pub(super) fn event_type_patterns(field: &str, values: &[String]) -> Result<PatternSet> {
    patterns(field, values)
}

pub(super) fn optional_timestamp(
    field: &str,
    timestamp: Option<prost_types::Timestamp>,
) -> Result<Option<DateTime<Utc>>> {
    timestamp
        .map(|timestamp| timestamp_to_datetime(field, timestamp))
        .transpose()
}

/// The subscription to change and the changes named by the field mask.
pub(super) fn subscription_patch(
    message: Option<proto::Subscription>,
    mask: Option<prost_types::FieldMask>,
) -> Result<(SubscriptionName, SubscriptionPatch)> {
    let message = message.ok_or_else(|| Error::invalid("subscription", "is required"))?;
    let name = subscription_name("subscription.name", &message.name)?;
    let paths = mask.map(|mask| mask.paths).unwrap_or_default();
    if paths.is_empty() {
        return Err(Error::invalid(
            "update_mask",
            "must name at least one field to change",
        ));
    }
    let mut patch = SubscriptionPatch::default();
    for (index, path) in paths.iter().enumerate() {
        let field = |name: &str| format!("subscription.{name}");
        match path.as_str() {
            "event_types" => {
                patch.event_types = Some(patterns(&field(path), &message.event_types)?);
            }
            "aggregate_types" => patch.aggregate_types = Some(message.aggregate_types.clone()),
            "metadata_match" => {
                patch.metadata_match = Some(message.metadata_match.clone().into_iter().collect());
            }
            "ack_deadline" => {
                patch.ack_deadline = Some(required_duration(&field(path), message.ack_deadline)?)
            }
            "max_attempts" => {
                patch.max_attempts = Some(message.max_attempts.ok_or_else(|| {
                    Error::invalid(field(path), "is required by the update mask")
                })?);
            }
            "retry_backoff_min" => {
                patch.retry_backoff_min =
                    Some(required_duration(&field(path), message.retry_backoff_min)?);
            }
            "retry_backoff_max" => {
                patch.retry_backoff_max =
                    Some(required_duration(&field(path), message.retry_backoff_max)?);
            }
            "persistent_event_types" => {
                patch.persistent_event_types =
                    Some(patterns(&field(path), &message.persistent_event_types)?);
            }
            // Unset removes the limit.
            "max_event_age" => {
                patch.max_event_age = Some(optional_duration(&field(path), message.max_event_age)?);
            }
            "dead_letter_expired" => patch.dead_letter_expired = Some(message.dead_letter_expired),
            // Empty removes it.
            "filter" => {
                patch.filter = Some(optional_expression(
                    &field(path),
                    &message.filter,
                    EventFilter::parse,
                )?);
            }
            "transform" => {
                patch.transform = Some(optional_expression(
                    &field(path),
                    &message.transform,
                    PayloadTransform::parse,
                )?);
            }
            "push" => {
                patch.push = Some(
                    message
                        .push
                        .clone()
                        .map(|push| push_config("subscription.push", push))
                        .transpose()?,
                );
            }
            "sink" => {
                patch.sink = Some(
                    message
                        .sink
                        .clone()
                        .map(|sink| sink_config("subscription.sink", sink))
                        .transpose()?,
                );
            }
            "name" | "start" | "ordered" | "created_at" | "sources" | "expire_after_idle"
            | "push_stopped" => {
                return Err(Error::invalid(
                    format!("update_mask.paths[{index}]"),
                    format!("{} cannot be changed", Echo(path)),
                ));
            }
            "paused" | "pause_reason" | "paused_until" | "paused_at" => {
                return Err(Error::invalid(
                    format!("update_mask.paths[{index}]"),
                    format!(
                        "{} changes only through PauseSubscription and ResumeSubscription",
                        Echo(path)
                    ),
                ));
            }
            _ => {
                return Err(Error::invalid(
                    format!("update_mask.paths[{index}]"),
                    format!("{} is not a field of Subscription", Echo(path)),
                ));
            }
        }
    }
    Ok((name, patch))
}

fn required_duration(field: &str, duration: Option<prost_types::Duration>) -> Result<Duration> {
    optional_duration(field, duration)?
        .ok_or_else(|| Error::invalid(field, "is required by the update mask"))
}

pub(super) fn dead_letter(dead_letter: DeadLetter) -> proto::DeadLetter {
    proto::DeadLetter {
        source: dead_letter.event.source.as_str().to_owned(),
        subscription: dead_letter.subscription.as_str().to_owned(),
        event: Some(event(dead_letter.event)),
        attempts: dead_letter.attempts,
        last_error: dead_letter.last_error.unwrap_or_default(),
        dead_lettered_at: Some(datetime_to_timestamp(dead_letter.dead_lettered_at)),
        resolved: dead_letter.resolved_at.is_some(),
        resolved_at: dead_letter.resolved_at.map(datetime_to_timestamp),
        resolved_by: dead_letter.resolved_by.unwrap_or_default(),
        notes: dead_letter.notes.unwrap_or_default(),
    }
}

/// The selectors of the dead-letter RPCs, as given.
pub(super) struct Selectors<'a> {
    pub ids: &'a [String],
    pub event_types: &'a [String],
    pub aggregate_type: &'a str,
    pub aggregate_id: &'a str,
    pub last_error: &'a str,
    pub dead_lettered_after: Option<prost_types::Timestamp>,
    pub dead_lettered_before: Option<prost_types::Timestamp>,
    pub source: &'a str,
}

/// The selection the selectors make; empty strings and unset times select everything.
pub(super) fn dead_letter_selection(given: Selectors<'_>) -> Result<DeadLetterSelection> {
    let text = |text: &str| (!text.is_empty()).then(|| text.to_owned());
    Ok(DeadLetterSelection {
        ids: given
            .ids
            .iter()
            .enumerate()
            .map(|(index, id)| event_id(&format!("ids[{index}]"), id))
            .collect::<Result<Vec<_>>>()?,
        event_types: event_type_patterns("event_types", given.event_types)?,
        aggregate_type: text(given.aggregate_type),
        aggregate_id: text(given.aggregate_id),
        last_error: text(given.last_error),
        dead_lettered_after: optional_timestamp("dead_lettered_after", given.dead_lettered_after)?,
        dead_lettered_before: optional_timestamp(
            "dead_lettered_before",
            given.dead_lettered_before,
        )?,
        source: optional_source("source", given.source)?,
    })
}

pub(super) fn dead_letter_group(group: DeadLetterGroup) -> proto::DeadLetterGroup {
    proto::DeadLetterGroup {
        last_error: group.last_error,
        count: group.count,
        first_dead_lettered_at: Some(datetime_to_timestamp(group.first_dead_lettered_at)),
        last_dead_lettered_at: Some(datetime_to_timestamp(group.last_dead_lettered_at)),
        example_event_id: group.example_event_id.to_string(),
    }
}

pub(super) fn event_deliveries(found: EventDeliveries) -> proto::EventDeliveries {
    proto::EventDeliveries {
        event: Some(event(found.event)),
        subscriptions: found
            .subscriptions
            .into_iter()
            .map(|(name, state)| subscription_delivery(name, state))
            .collect(),
    }
}

fn subscription_delivery(
    name: SubscriptionName,
    state: DeliveryState,
) -> proto::SubscriptionDelivery {
    use proto::DeliveryState as State;
    let mut delivery = proto::SubscriptionDelivery {
        subscription: name.as_str().to_owned(),
        ..Default::default()
    };
    let state = match state {
        DeliveryState::NotMatched => State::NotMatched,
        DeliveryState::Pending => State::Pending,
        DeliveryState::Skipped => State::Skipped,
        DeliveryState::Acked { .. } => State::Acked,
        DeliveryState::InFlight { attempt, deadline } => {
            delivery.attempt = attempt;
            delivery.due_at = Some(datetime_to_timestamp(deadline));
            State::InFlight
        }
        DeliveryState::AwaitingRetry {
            attempt,
            next_try,
            last_error,
        } => {
            delivery.attempt = attempt;
            delivery.due_at = Some(datetime_to_timestamp(next_try));
            delivery.last_error = last_error.unwrap_or_default();
            State::AwaitingRetry
        }
        DeliveryState::Waiting { attempt } => {
            delivery.attempt = attempt;
            State::Waiting
        }
        DeliveryState::Dead {
            attempts,
            last_error,
            dead_lettered_at,
            resolved_at,
            resolved_by,
            notes,
        } => {
            delivery.attempt = attempts;
            delivery.last_error = last_error.unwrap_or_default();
            delivery.dead_lettered_at = dead_lettered_at.map(datetime_to_timestamp);
            delivery.resolved_at = resolved_at.map(datetime_to_timestamp);
            delivery.resolved_by = resolved_by.unwrap_or_default();
            delivery.notes = notes.unwrap_or_default();
            State::Dead
        }
    };
    delivery.state = state as i32;
    delivery
}

pub(super) fn stats(
    subscriptions: Vec<SubscriptionStatsReport>,
    outbox: OutboxStats,
) -> proto::Stats {
    let now = Utc::now();
    let newest = outbox.newest_event_at;
    proto::Stats {
        subscriptions: subscriptions
            .into_iter()
            .map(|report| {
                let push = report.push.unwrap_or_default();
                let requests = &push.requests;
                let sink = report.sink.unwrap_or_default();
                proto::SubscriptionStats {
                    sources: report
                        .per_source
                        .into_iter()
                        .map(|stats| subscription_stats(stats, now, newest))
                        .collect(),
                    push_in_flight: requests.in_flight,
                    push_last_status: u32::from(requests.last_status),
                    push_last_error: requests.last_error.clone().unwrap_or_default(),
                    push_last_error_at: requests.last_error_at.map(datetime_to_timestamp),
                    push_requests_total: requests.requests_total,
                    push_rate: requests.rate(),
                    push_stopped_reason: push
                        .stopped
                        .map(|stopped| stopped.reason)
                        .unwrap_or_default(),
                    sink_in_flight: sink.in_flight,
                    sink_last_error: sink.last_error.clone().unwrap_or_default(),
                    sink_last_error_at: sink.last_error_at.map(datetime_to_timestamp),
                    sink_sent_total: sink.requests_total,
                    sink_confirmed_total: sink.confirmed_total,
                    sink_rate: sink.rate(),
                    consumption_records: report.consumption_records,
                    error: report.error.unwrap_or_default(),
                    status: subscription_status(report.status.kind()) as i32,
                    status_detail: report.status.detail(),
                    ..subscription_stats(report.total, now, newest)
                }
            })
            .collect(),
        outbox: Some(proto::OutboxStats {
            events_stored: outbox.events_stored,
            oldest_event_at: outbox.oldest_event_at.map(datetime_to_timestamp),
            newest_event_at: newest.map(datetime_to_timestamp),
            oldest_open_transaction_age: Some(duration_to_proto(
                outbox.oldest_open_transaction_age,
            )),
            events_force_expired: outbox.events_force_expired,
        }),
    }
}

fn subscription_status(kind: StatusKind) -> proto::SubscriptionStatus {
    match kind {
        StatusKind::PushStopped => proto::SubscriptionStatus::PushStopped,
        StatusKind::SinkUnreachable => proto::SubscriptionStatus::SinkUnreachable,
        StatusKind::Paused => proto::SubscriptionStatus::Paused,
        StatusKind::DeadLetters => proto::SubscriptionStatus::DeadLetters,
        StatusKind::Behind => proto::SubscriptionStatus::Behind,
        StatusKind::NoConsumer => proto::SubscriptionStatus::NoConsumer,
        StatusKind::Delivering => proto::SubscriptionStatus::Delivering,
        StatusKind::ScheduledOnly => proto::SubscriptionStatus::ScheduledOnly,
        StatusKind::CaughtUp => proto::SubscriptionStatus::CaughtUp,
    }
}

fn age(since: Option<DateTime<Utc>>, until: DateTime<Utc>) -> prost_types::Duration {
    duration_to_proto(since.map_or(Duration::ZERO, |since| {
        (until - since).to_std().unwrap_or_default()
    }))
}

fn subscription_stats(
    stats: SubscriptionStats,
    now: DateTime<Utc>,
    newest: Option<DateTime<Utc>>,
) -> proto::SubscriptionStats {
    proto::SubscriptionStats {
        name: stats.name.as_str().to_owned(),
        source: stats
            .source
            .as_ref()
            .map(|source| source.as_str().to_owned())
            .unwrap_or_default(),
        pending: stats.pending,
        in_flight: stats.in_flight,
        awaiting_retry: stats.awaiting_retry,
        dead_lettered: stats.dead_lettered,
        oldest_unacked_age: Some(age(stats.oldest_unacked_at, now)),
        lag_events: stats.lag_events(),
        lag: Some(age(stats.oldest_unacked_at, newest.unwrap_or(now))),
        delivered_total: stats.delivered_total,
        acked_total: stats.acked_total,
        late_transactions: stats.late_transactions,
        sources: Vec::new(),
        expired_total: stats.expired_total,
        scheduled: stats.scheduled,
        next_scheduled_at: stats.next_scheduled_at.map(datetime_to_timestamp),
        filtered_total: stats.filtered_total,
        filter_errors_total: stats.filter_errors_total,
        last_filter_error: stats
            .last_filter_error
            .as_ref()
            .map(|(error, _)| error.clone())
            .unwrap_or_default(),
        last_filter_error_at: stats
            .last_filter_error
            .as_ref()
            .map(|(_, at)| datetime_to_timestamp(*at)),
        ..Default::default()
    }
}

pub(super) fn source_status(status: SourceStatus) -> proto::Source {
    let outbox = status.outbox.unwrap_or_default();
    proto::Source {
        name: status.name.as_str().to_owned(),
        status: if status.health.connected {
            proto::SourceStatus::Connected
        } else {
            proto::SourceStatus::Unavailable
        } as i32,
        last_error: status.health.last_error.unwrap_or_default(),
        since: Some(datetime_to_timestamp(status.health.since)),
        events_stored: outbox.events_stored,
        oldest_event_at: outbox.oldest_event_at.map(datetime_to_timestamp),
        oldest_open_transaction_age: Some(duration_to_proto(outbox.oldest_open_transaction_age)),
        schema_version: status.schema_version.unwrap_or_default(),
    }
}
