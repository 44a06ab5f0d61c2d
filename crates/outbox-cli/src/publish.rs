//! `publish`: publish one event from flags, or many from JSON lines on stdin.

use std::{collections::HashMap, io::BufRead};

use serde_json::{Value, json};

use outbox_client::proto;

use crate::{Target, count, describe, parse_key_value, parse_time};

#[derive(Debug, clap::Args)]
pub struct PublishArgs {
    /// Read events as JSON lines from standard input instead of flags. Each line is an
    /// object with the EventInput fields; `payload` is any JSON value, `deliver_at` and
    /// `expires_at` RFC 3339 times.
    #[arg(long, conflicts_with_all = ["aggregate_type", "aggregate_id", "event_type"])]
    stdin: bool,
    /// Most events per Publish call with --stdin (the gateway's limit is
    /// --max-batch-events, 1000 by default); calls also stay under 4 MiB.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..))]
    batch_size: u32,
    /// Aggregate type, e.g. order (required without --stdin).
    #[arg(long)]
    aggregate_type: Option<String>,
    /// Aggregate id, e.g. o-42 (required without --stdin).
    #[arg(long)]
    aggregate_id: Option<String>,
    /// Event type, e.g. order.created (required without --stdin).
    #[arg(long)]
    event_type: Option<String>,
    /// JSON payload.
    #[arg(long, default_value = "{}")]
    payload: String,
    /// Event id (UUID); generated when omitted.
    #[arg(long)]
    id: Option<String>,
    /// Version of the aggregate this event brings it to (optional).
    #[arg(long)]
    aggregate_version: Option<i64>,
    /// Metadata entry KEY=VALUE; repeatable.
    #[arg(long = "metadata", value_parser = parse_key_value)]
    metadata: Vec<(String, String)>,
    /// The source database to write to (`default` when omitted).
    #[arg(long, default_value = "")]
    source: String,
    /// Deliver no earlier than this RFC 3339 time (every event published).
    #[arg(long, value_parser = parse_time, conflicts_with = "delay")]
    deliver_at: Option<prost_types::Timestamp>,
    /// Deliver no earlier than this long from now, e.g. 15m.
    #[arg(long, value_parser = humantime::parse_duration)]
    delay: Option<std::time::Duration>,
    /// Deliver no more from this RFC 3339 time on.
    #[arg(long, value_parser = parse_time, conflicts_with = "ttl")]
    expires_at: Option<prost_types::Timestamp>,
    /// Deliver no more once the event has been deliverable this long (from now, or from
    /// its delivery time when scheduled), e.g. 10m.
    #[arg(long, value_parser = humantime::parse_duration)]
    ttl: Option<std::time::Duration>,
}

impl PublishArgs {
    /// The delivery time the flags ask for.
    fn deliver_at(&self) -> Result<Option<prost_types::Timestamp>, String> {
        match (self.deliver_at, self.delay) {
            (Some(at), _) => Ok(Some(at)),
            (None, Some(delay)) => Ok(Some(from_now(
                "delay",
                std::time::SystemTime::now(),
                delay,
            )?)),
            (None, None) => Ok(None),
        }
    }

    /// The expiry the flags ask for, for an event delivered at `deliver_at`: a TTL counts
    /// from then (or from now, when that is earlier or unset).
    fn expires_at(
        &self,
        deliver_at: Option<prost_types::Timestamp>,
    ) -> Result<Option<prost_types::Timestamp>, String> {
        match (self.expires_at, self.ttl) {
            (Some(at), _) => Ok(Some(at)),
            (None, Some(ttl)) => {
                let now = std::time::SystemTime::now();
                let deliverable = deliver_at
                    .and_then(|at| std::time::SystemTime::try_from(at).ok())
                    .map_or(now, |at| at.max(now));
                Ok(Some(from_now("ttl", deliverable, ttl)?))
            }
            (None, None) => Ok(None),
        }
    }
}

/// `from` plus the duration given with `--flag`.
fn from_now(
    flag: &str,
    from: std::time::SystemTime,
    by: std::time::Duration,
) -> Result<prost_types::Timestamp, String> {
    from.checked_add(by)
        .map(prost_types::Timestamp::from)
        .ok_or_else(|| format!("--{flag} {} is too long", humantime::format_duration(by)))
}

/// An event line of `publish --stdin`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct EventLine {
    #[serde(default)]
    id: String,
    aggregate_type: String,
    aggregate_id: String,
    #[serde(default)]
    aggregate_version: Option<i64>,
    event_type: String,
    #[serde(default)]
    payload: Value,
    #[serde(default)]
    metadata: HashMap<String, String>,
    /// RFC 3339; overrides --deliver-at/--delay for this event.
    #[serde(default)]
    deliver_at: Option<String>,
    /// RFC 3339; overrides --expires-at/--ttl for this event.
    #[serde(default)]
    expires_at: Option<String>,
}

/// An optional RFC 3339 time of a `publish --stdin` line.
fn line_time(
    number: usize,
    field: &str,
    text: Option<&str>,
) -> Result<Option<prost_types::Timestamp>, String> {
    text.map(|text| parse_time(text).map_err(|error| format!("line {number}: {field}: {error}")))
        .transpose()
}

/// Largest encoded size of one Publish call `publish --stdin` sends, well under the
/// gateway's default 16 MiB message limit.
const MAX_PUBLISH_CALL_BYTES: usize = 4 * 1024 * 1024;

pub(crate) async fn publish(target: &Target, args: PublishArgs) -> Result<(), String> {
    use std::io::IsTerminal;
    let deliver_at = args.deliver_at()?;
    let events = if args.stdin {
        read_event_lines(&args, deliver_at)?
    } else {
        let missing: Vec<&str> = [
            ("--aggregate-type", args.aggregate_type.is_none()),
            ("--aggregate-id", args.aggregate_id.is_none()),
            ("--event-type", args.event_type.is_none()),
        ]
        .into_iter()
        .filter(|(_, missing)| *missing)
        .map(|(flag, _)| flag)
        .collect();
        if !missing.is_empty() {
            let hint = if std::io::stdin().is_terminal() {
                ""
            } else {
                "; standard input is not a terminal: to publish the JSON lines piped into it, add --stdin"
            };
            return Err(format!("give {}{hint}", missing.join(", ")));
        }
        serde_json::from_str::<Value>(&args.payload)
            .map_err(|error| format!("--payload is not JSON: {error}"))?;
        let expires_at = args.expires_at(deliver_at)?;
        vec![proto::EventInput {
            id: args.id.unwrap_or_default(),
            aggregate_type: args.aggregate_type.unwrap_or_default(),
            aggregate_id: args.aggregate_id.unwrap_or_default(),
            aggregate_version: args.aggregate_version,
            event_type: args.event_type.unwrap_or_default(),
            payload: args.payload.into_bytes(),
            metadata: args.metadata.into_iter().collect(),
            deliver_at,
            expires_at,
            ..Default::default()
        }]
    };
    if events.is_empty() {
        return Err("no events to publish".into());
    }
    let total = events.len();
    let batches = batches(events, args.batch_size as usize, MAX_PUBLISH_CALL_BYTES);
    let show_progress = batches.len() > 1;
    let progress_on_terminal = std::io::stderr().is_terminal();
    let mut publisher = target.connect(true).await?.publisher();
    let mut published = 0;
    for batch in batches {
        let size = batch.len();
        let results = publisher
            .publish(proto::PublishRequest {
                events: batch,
                source: args.source.clone(),
            })
            .await
            .map_err(|status| {
                let failed = describe(status);
                if published == 0 {
                    failed
                } else {
                    format!(
                        "events {} to {}: {failed}; the {} before were published",
                        published + 1,
                        published + size,
                        count(published as u64, "event")
                    )
                }
            })?
            .into_inner()
            .results;
        for result in results {
            let value = json!({ "id": result.id, "duplicate": result.duplicate });
            target.print(value, || {
                println!(
                    "{}{}",
                    result.id,
                    if result.duplicate { " (duplicate)" } else { "" }
                )
            });
        }
        published += size;
        if show_progress {
            if progress_on_terminal {
                eprint!("\rpublished {published} of {total} events");
                if published == total {
                    eprintln!();
                }
            } else {
                eprintln!("published {published} of {total} events");
            }
        }
    }
    Ok(())
}

/// Reads `publish --stdin`'s JSON lines.
fn read_event_lines(
    args: &PublishArgs,
    deliver_at: Option<prost_types::Timestamp>,
) -> Result<Vec<proto::EventInput>, String> {
    let mut events = Vec::new();
    for (number, line) in std::io::stdin().lock().lines().enumerate() {
        let line = line.map_err(|error| format!("cannot read standard input: {error}"))?;
        if line.trim().is_empty() {
            continue;
        }
        let event: EventLine =
            serde_json::from_str(&line).map_err(|error| format!("line {}: {error}", number + 1))?;
        let line_deliver_at =
            line_time(number + 1, "deliver_at", event.deliver_at.as_deref())?.or(deliver_at);
        let line_expires_at =
            match line_time(number + 1, "expires_at", event.expires_at.as_deref())? {
                Some(at) => Some(at),
                None => args.expires_at(line_deliver_at)?,
            };
        events.push(proto::EventInput {
            deliver_at: line_deliver_at,
            expires_at: line_expires_at,
            id: event.id,
            aggregate_type: event.aggregate_type,
            aggregate_id: event.aggregate_id,
            aggregate_version: event.aggregate_version,
            event_type: event.event_type,
            payload: event.payload.to_string().into_bytes(),
            metadata: event.metadata,
            ..Default::default()
        });
    }
    Ok(events)
}

/// Splits events into Publish calls of at most `max_events` events and, unless one
/// event alone is larger, `max_bytes` encoded.
fn batches(
    events: Vec<proto::EventInput>,
    max_events: usize,
    max_bytes: usize,
) -> Vec<Vec<proto::EventInput>> {
    use prost::Message;
    let mut batches = Vec::new();
    let mut batch = Vec::new();
    let mut bytes = 0;
    for event in events {
        // Field tag and length prefix of the repeated field: a few bytes more.
        let size = event.encoded_len() + 8;
        if !batch.is_empty() && (batch.len() == max_events || bytes + size > max_bytes) {
            batches.push(std::mem::take(&mut batch));
            bytes = 0;
        }
        bytes += size;
        batch.push(event);
    }
    if !batch.is_empty() {
        batches.push(batch);
    }
    batches
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_respect_the_count_and_the_size() {
        let event = |payload_bytes: usize| proto::EventInput {
            aggregate_type: "order".into(),
            aggregate_id: "o-1".into(),
            event_type: "order.created".into(),
            payload: vec![b'x'; payload_bytes],
            ..Default::default()
        };
        let sizes = |batches: Vec<Vec<proto::EventInput>>| -> Vec<usize> {
            batches.iter().map(Vec::len).collect()
        };
        assert_eq!(
            sizes(batches(
                (0..1500).map(|_| event(10)).collect(),
                500,
                1 << 20
            )),
            [500, 500, 500]
        );
        assert_eq!(
            sizes(batches((0..5).map(|_| event(400)).collect(), 500, 1000)),
            [2, 2, 1]
        );
        // One event larger than the limit still goes, alone.
        assert_eq!(
            sizes(batches(vec![event(5000), event(10)], 500, 1000)),
            [1, 1]
        );
    }
}
