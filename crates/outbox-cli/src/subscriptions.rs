//! `subscriptions`: list, show, create, update, pause, resume, seek and delete subscriptions.

use std::time::Duration;

use serde_json::json;

use outbox_client::proto;

use crate::{
    CliError, Target, confirm, count, parse_key_value, parse_position, parse_until, refused,
    render, usage,
};

#[derive(Debug, clap::Args)]
pub struct SubscriptionSettingsArgs {
    /// Event-type pattern (`order.created`, `order.*`, `order.**`); repeatable.
    #[arg(long = "event-type")]
    event_types: Vec<String>,
    /// Aggregate type; repeatable.
    #[arg(long = "aggregate-type")]
    aggregate_types: Vec<String>,
    /// Metadata that must match, as KEY=VALUE; repeatable.
    #[arg(long = "metadata", value_parser = parse_key_value)]
    metadata_match: Vec<(String, String)>,
    /// A CEL expression the event must satisfy, e.g.
    /// 'payload.total > 1000.0 && metadata.tenant == "acme"' (see "Filters and
    /// transforms" in docs/subscriptions.md).
    #[arg(long)]
    filter: Option<String>,
    /// A CEL expression whose value (a map or a list) is delivered as the JSON payload,
    /// e.g. '{"id": payload.id, "total": payload.total}'.
    #[arg(long)]
    transform: Option<String>,
    /// Lease length of a delivery, e.g. 30s.
    #[arg(long, value_parser = humantime::parse_duration)]
    ack_deadline: Option<Duration>,
    /// Deliveries before dead-lettering; 0 retries forever [default: 10; 0 for a sink
    /// subscription].
    #[arg(long)]
    max_attempts: Option<u32>,
    /// Smallest retry backoff.
    #[arg(long, value_parser = humantime::parse_duration)]
    retry_backoff_min: Option<Duration>,
    /// Largest retry backoff.
    #[arg(long, value_parser = humantime::parse_duration)]
    retry_backoff_max: Option<Duration>,
    /// Event-type pattern that never dead-letters; repeatable.
    #[arg(long = "persistent-event-type")]
    persistent_event_types: Vec<String>,
    /// Let events older than this expire instead of delivering them, e.g. 10m.
    #[arg(long, value_parser = humantime::parse_duration)]
    max_event_age: Option<Duration>,
    /// Dead-letter expired events (error "expired") instead of dropping them; `false` to
    /// switch it off again.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    dead_letter_expired: Option<bool>,
}

impl SubscriptionSettingsArgs {
    fn into_subscription(self, name: String) -> proto::Subscription {
        let duration =
            |d: Option<Duration>| d.and_then(|d| prost_types::Duration::try_from(d).ok());
        proto::Subscription {
            name,
            event_types: self.event_types,
            aggregate_types: self.aggregate_types,
            metadata_match: self.metadata_match.into_iter().collect(),
            filter: self.filter.unwrap_or_default(),
            transform: self.transform.unwrap_or_default(),
            ack_deadline: duration(self.ack_deadline),
            max_attempts: self.max_attempts,
            retry_backoff_min: duration(self.retry_backoff_min),
            retry_backoff_max: duration(self.retry_backoff_max),
            persistent_event_types: self.persistent_event_types,
            max_event_age: duration(self.max_event_age),
            dead_letter_expired: self.dead_letter_expired.unwrap_or(false),
            ..Default::default()
        }
    }

    /// The update-mask paths of the settings given on the command line.
    fn given_paths(&self) -> Vec<String> {
        let given = [
            ("event_types", !self.event_types.is_empty()),
            ("aggregate_types", !self.aggregate_types.is_empty()),
            ("metadata_match", !self.metadata_match.is_empty()),
            ("filter", self.filter.is_some()),
            ("transform", self.transform.is_some()),
            ("ack_deadline", self.ack_deadline.is_some()),
            ("max_attempts", self.max_attempts.is_some()),
            ("retry_backoff_min", self.retry_backoff_min.is_some()),
            ("retry_backoff_max", self.retry_backoff_max.is_some()),
            (
                "persistent_event_types",
                !self.persistent_event_types.is_empty(),
            ),
            ("max_event_age", self.max_event_age.is_some()),
            ("dead_letter_expired", self.dead_letter_expired.is_some()),
        ];
        given
            .into_iter()
            .filter(|(_, given)| *given)
            .map(|(path, _)| path.to_owned())
            .collect()
    }
}

/// `subscriptions update` flags that take a setting back to "none", where the field
/// mask allows it. The other settings (ack deadline, attempts, backoff) always have a
/// value: give the one wanted.
#[derive(Debug, clap::Args)]
pub struct ClearArgs {
    /// Match every event type again (drop the --event-type patterns).
    #[arg(long, conflicts_with = "event_types")]
    clear_event_types: bool,
    /// Match every aggregate type again.
    #[arg(long, conflicts_with = "aggregate_types")]
    clear_aggregate_types: bool,
    /// Drop the metadata the events must match.
    #[arg(long, conflicts_with = "metadata_match")]
    clear_metadata: bool,
    /// Drop the --filter expression.
    #[arg(long, conflicts_with = "filter")]
    clear_filter: bool,
    /// Deliver payloads as published again (drop the --transform expression).
    #[arg(long, conflicts_with = "transform")]
    clear_transform: bool,
    /// Let every event type dead-letter again.
    #[arg(long, conflicts_with = "persistent_event_types")]
    clear_persistent_event_types: bool,
    /// Let events of any age be delivered again (drop --max-event-age).
    #[arg(long, conflicts_with = "max_event_age")]
    no_max_event_age: bool,
}

impl ClearArgs {
    /// The update-mask paths of the settings to clear: sent empty, they clear.
    fn paths(&self) -> Vec<String> {
        [
            ("event_types", self.clear_event_types),
            ("aggregate_types", self.clear_aggregate_types),
            ("metadata_match", self.clear_metadata),
            ("filter", self.clear_filter),
            ("transform", self.clear_transform),
            ("persistent_event_types", self.clear_persistent_event_types),
            ("max_event_age", self.no_max_event_age),
        ]
        .into_iter()
        .filter(|(_, clear)| *clear)
        .map(|(path, _)| path.to_owned())
        .collect()
    }
}

/// Push delivery settings of `subscriptions create` and `update`.
#[derive(Debug, clap::Args)]
pub struct PushArgs {
    /// Push each event to this http(s) URL as a signed CloudEvent instead of waiting
    /// for Subscribe streams (its host must be in the gateway's `[push] allowed_hosts`).
    #[arg(long)]
    push_endpoint: Option<String>,
    /// Extra header sent with every push, as KEY=VALUE (kept secret); repeatable.
    #[arg(long = "push-header", value_parser = parse_key_value, requires = "push_endpoint")]
    push_headers: Vec<(String, String)>,
    /// CloudEvents mode: binary (attributes as headers) or structured (one JSON document).
    #[arg(long, value_enum, requires = "push_endpoint")]
    push_format: Option<PushFormatArg>,
    /// Longest a push request may take, e.g. 10s.
    #[arg(long, value_parser = humantime::parse_duration, requires = "push_endpoint")]
    push_timeout: Option<Duration>,
    /// Most push requests in flight at once.
    #[arg(long, requires = "push_endpoint")]
    push_max_concurrency: Option<u32>,
    /// Most push requests started per second.
    #[arg(long, requires = "push_endpoint")]
    push_rate_limit: Option<f64>,
    /// Push up to this many events per request, as a CloudEvents JSON batch.
    #[arg(long, requires = "push_endpoint")]
    push_batch: Option<u32>,
    /// Most bytes of events per batch [default: 1 MiB].
    #[arg(long, requires = "push_batch")]
    push_batch_bytes: Option<u64>,
    /// How long a batch waits for more events once it has one, e.g. 50ms.
    #[arg(long, value_parser = humantime::parse_duration, requires = "push_batch")]
    push_batch_wait: Option<Duration>,
}

/// Sink delivery settings of `subscriptions create` and `update`.
#[derive(Debug, clap::Args)]
pub struct SinkArgs {
    /// Publish each event into this sink of the gateway's configuration (`outbox-gateway
    /// sinks` lists them) instead of waiting for Subscribe streams.
    #[arg(long, conflicts_with = "push_endpoint")]
    sink: Option<String>,
    /// NATS sinks: the subject template, e.g. 'orders.{aggregate_type}.{event_type}';
    /// '{event_type:tokens}' keeps the value's dots as subject tokens.
    #[arg(long, requires = "sink")]
    subject: Option<String>,
    /// Kafka sinks: the topic template, e.g. 'orders' or 'orders-{aggregate_type}'.
    #[arg(long, requires = "sink")]
    topic: Option<String>,
    /// Kafka sinks: the key template [default: {aggregate_type}/{aggregate_id}]. (Not
    /// `--key`: that is the client certificate's key, on every command.)
    #[arg(long, requires = "sink")]
    sink_key: Option<String>,
}

impl SinkArgs {
    fn into_sink(self) -> Option<proto::SinkConfig> {
        Some(proto::SinkConfig {
            name: self.sink?,
            subject: self.subject.unwrap_or_default(),
            topic: self.topic.unwrap_or_default(),
            key: self.sink_key.unwrap_or_default(),
        })
    }
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum PushFormatArg {
    Binary,
    Structured,
}

impl PushArgs {
    fn into_push(self) -> Option<proto::PushConfig> {
        let endpoint = self.push_endpoint?;
        Some(proto::PushConfig {
            endpoint,
            headers: self.push_headers.into_iter().collect(),
            format: match self.push_format {
                None | Some(PushFormatArg::Binary) => proto::PushFormat::CloudeventsBinary,
                Some(PushFormatArg::Structured) => proto::PushFormat::CloudeventsStructured,
            } as i32,
            timeout: self
                .push_timeout
                .and_then(|d| prost_types::Duration::try_from(d).ok()),
            max_concurrency: self.push_max_concurrency.unwrap_or(0),
            rate_limit: self.push_rate_limit,
            max_batch_events: self.push_batch.unwrap_or(0),
            max_batch_bytes: self.push_batch_bytes.unwrap_or(0),
            max_batch_wait: self
                .push_batch_wait
                .and_then(|d| prost_types::Duration::try_from(d).ok()),
            signing_secret: String::new(),
        })
    }
}

#[derive(Debug, clap::Subcommand)]
pub enum SubscriptionCommand {
    /// Create a subscription.
    Create {
        /// Name: lowercase letters, digits, '.', '_' and '-' (e.g. billing.orders).
        name: String,
        #[command(flatten)]
        settings: SubscriptionSettingsArgs,
        /// Where it starts: latest, earliest, or an RFC 3339 time.
        #[arg(long, default_value = "latest", value_parser = parse_position)]
        start: proto::StartPosition,
        /// Deliver the events of one aggregate one at a time, in order.
        #[arg(long)]
        ordered: bool,
        /// Have the gateway delete it once no stream has read it for this long (at
        /// least 10s), e.g. 1h.
        #[arg(long, value_parser = humantime::parse_duration)]
        expire_after_idle: Option<Duration>,
        /// Read only this source database (`default`, or a `[[sources]]` name);
        /// repeatable. Every source, including ones added later, when omitted.
        #[arg(long = "source", value_name = "NAME")]
        sources: Vec<String>,
        #[command(flatten)]
        push: PushArgs,
        #[command(flatten)]
        sink: SinkArgs,
    },
    /// List all subscriptions: how each delivers (pull, push, sink) and what it takes.
    List,
    /// Show one subscription.
    Get {
        /// The subscription.
        name: String,
    },
    /// Change the given settings of a subscription (the others stay).
    Update {
        /// The subscription.
        name: String,
        #[command(flatten)]
        settings: SubscriptionSettingsArgs,
        /// The push settings replace the current ones (a pull subscription becomes a
        /// push one and gets a signing secret, printed once); a stopped push resumes.
        #[command(flatten)]
        push: PushArgs,
        /// The sink settings replace the current ones (a pull or push subscription
        /// becomes a sink one).
        #[command(flatten)]
        sink: SinkArgs,
        /// Stop pushing or publishing into a sink: consumers read the subscription with
        /// Subscribe again.
        #[arg(long, conflicts_with_all = ["push_endpoint", "sink"])]
        pull: bool,
        #[command(flatten)]
        clear: ClearArgs,
        /// Refused: ordering is chosen at creation (accepted here only to say so).
        #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "true")]
        ordered: Option<bool>,
        /// Refused: the sources are chosen at creation (accepted here only to say so).
        #[arg(long = "source", hide = true, value_name = "NAME")]
        sources: Vec<String>,
    },
    /// Give a push subscription a new signing secret (printed once); the previous one
    /// keeps signing beside it for --keep-previous-for.
    RotateSecret {
        /// The subscription.
        name: String,
        /// How long the previous secret still signs, e.g. 24h (the default) or 0s.
        #[arg(long, value_parser = humantime::parse_duration)]
        keep_previous_for: Option<Duration>,
    },
    /// Stop handing out new deliveries (acks of those already out still apply).
    Pause {
        /// The subscription.
        name: String,
        /// Resume by itself then: an RFC 3339 time, or a duration from now ("30m").
        #[arg(long, value_parser = parse_until)]
        until: Option<prost_types::Timestamp>,
        /// Why, shown with the subscription.
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Hand out deliveries again after a pause.
    Resume {
        /// The subscription.
        name: String,
    },
    /// Delete a subscription with its delivery records and dead letters (asks first).
    Delete {
        /// The subscription.
        name: String,
        /// Do not ask for confirmation (for scripts).
        #[arg(long, short = 'y')]
        yes: bool,
    },
    /// Replay from a time or the earliest event, or skip ahead to now.
    Seek {
        /// The subscription.
        name: String,
        /// latest, earliest (asks first: replays everything stored), or an RFC 3339 time.
        #[arg(long, value_parser = parse_position)]
        to: proto::StartPosition,
        /// Do not ask for confirmation (for scripts).
        #[arg(long, short = 'y')]
        yes: bool,
    },
}

pub(crate) async fn subscriptions(
    target: &Target,
    command: SubscriptionCommand,
) -> Result<(), CliError> {
    let mut admin = target.connect(true).await?.admin();
    let show = |subscription: proto::Subscription| {
        let value = render::subscription(&subscription);
        target.print(value, || render::subscription_text(&subscription));
    };
    match command {
        SubscriptionCommand::Create {
            name,
            settings,
            start,
            ordered,
            expire_after_idle,
            sources,
            push,
            sink,
        } => {
            let subscription = proto::Subscription {
                start: Some(start),
                ordered,
                sources,
                expire_after_idle: expire_after_idle
                    .and_then(|idle| prost_types::Duration::try_from(idle).ok()),
                push: push.into_push(),
                sink: sink.into_sink(),
                ..settings.into_subscription(name)
            };
            let created = admin
                .create_subscription(proto::CreateSubscriptionRequest {
                    subscription: Some(subscription),
                    validate_only: false,
                })
                .await
                .map_err(refused)?;
            show(created.into_inner());
        }
        SubscriptionCommand::List => {
            let list = admin
                .list_subscriptions(proto::ListSubscriptionsRequest {})
                .await
                .map_err(refused)?
                .into_inner()
                .subscriptions;
            let value = json!(list.iter().map(render::subscription).collect::<Vec<_>>());
            target.print(value, || {
                let rows: Vec<Vec<String>> = list
                    .iter()
                    .map(|s| {
                        vec![
                            s.name.clone(),
                            render::kind_text(s),
                            join_or_all(&s.event_types),
                            join_or_all(&s.aggregate_types),
                            render::shortened(&s.filter, LISTED_FILTER_CHARS),
                            render::duration(&s.ack_deadline),
                            s.max_attempts.unwrap_or_default().to_string(),
                            s.ordered.to_string(),
                            s.paused.to_string(),
                        ]
                    })
                    .collect();
                render::table(
                    &[
                        "NAME",
                        "KIND",
                        "EVENT TYPES",
                        "AGGREGATE TYPES",
                        "FILTER",
                        "ACK DEADLINE",
                        "MAX ATTEMPTS",
                        "ORDERED",
                        "PAUSED",
                    ],
                    &rows,
                );
            });
        }
        SubscriptionCommand::Get { name } => {
            let subscription = admin
                .get_subscription(proto::GetSubscriptionRequest { name: name.clone() })
                .await
                .map_err(refused)?
                .into_inner();
            // The text also says how it is doing, in the words of `stats` and the console.
            let subscription_stats = match target.json {
                true => None,
                false => admin
                    .get_stats(proto::GetStatsRequest { subscription: name })
                    .await
                    .ok()
                    .and_then(|stats| stats.into_inner().subscriptions.into_iter().next()),
            };
            target.print(render::subscription(&subscription), || {
                render::subscription_text(&subscription);
                if let Some(subscription_stats) = &subscription_stats {
                    render::status_text(subscription_stats);
                }
            });
        }
        SubscriptionCommand::Update {
            name,
            settings,
            push,
            sink,
            pull,
            clear,
            ordered,
            sources,
        } => {
            if ordered.is_some() {
                return Err(usage(format!(
                    "ordered cannot change after creation: it would break the order of the events in flight; create a new subscription with --ordered (and --start) instead of {name}"
                )));
            }
            if !sources.is_empty() {
                return Err(usage(format!(
                    "sources cannot change after creation: the read positions are kept per source; create a new subscription with --source (and --start) instead of {name}"
                )));
            }
            let mut paths = settings.given_paths();
            paths.extend(clear.paths());
            let push = push.into_push();
            let sink = sink.into_sink();
            if push.is_some() || pull {
                paths.push("push".into());
            }
            if sink.is_some() || pull {
                paths.push("sink".into());
            }
            if paths.is_empty() {
                return Err(usage(
                    "give at least one setting to change (or to clear, e.g. --clear-metadata)",
                ));
            }
            let updated = admin
                .update_subscription(proto::UpdateSubscriptionRequest {
                    subscription: Some(proto::Subscription {
                        push,
                        sink,
                        ..settings.into_subscription(name)
                    }),
                    update_mask: Some(prost_types::FieldMask { paths }),
                    validate_only: false,
                })
                .await
                .map_err(refused)?;
            show(updated.into_inner());
        }
        SubscriptionCommand::RotateSecret {
            name,
            keep_previous_for,
        } => {
            let rotated = admin
                .rotate_push_secret(proto::RotatePushSecretRequest {
                    name,
                    keep_previous_for: keep_previous_for
                        .and_then(|d| prost_types::Duration::try_from(d).ok()),
                })
                .await
                .map_err(refused)?
                .into_inner();
            let previous_expires_at = render::timestamp(&rotated.previous_expires_at)
                .as_str()
                .unwrap_or_default()
                .to_owned();
            target.print(
                json!({
                    "signing_secret": rotated.signing_secret,
                    "previous_expires_at": previous_expires_at,
                }),
                || {
                    println!("signing secret: {}", rotated.signing_secret);
                    println!("the previous secret signs until {previous_expires_at}");
                },
            );
        }
        SubscriptionCommand::Delete { name, yes } => {
            if !yes {
                let stats = admin
                    .get_stats(proto::GetStatsRequest {
                        subscription: name.clone(),
                    })
                    .await
                    .map_err(refused)?
                    .into_inner();
                let subscription_stats = stats.subscriptions.first().cloned().unwrap_or_default();
                confirm(&format!(
                    "delete subscription {name}, dropping {} in flight, {} awaiting retry and {}",
                    count(subscription_stats.in_flight, "delivery"),
                    count(subscription_stats.awaiting_retry, "delivery"),
                    count(subscription_stats.dead_lettered, "unresolved dead letter"),
                ))?;
            }
            admin
                .delete_subscription(proto::DeleteSubscriptionRequest { name: name.clone() })
                .await
                .map_err(refused)?;
            target.print(json!({ "deleted": name }), || println!("deleted {name}"));
        }
        SubscriptionCommand::Pause {
            name,
            until,
            reason,
        } => {
            let paused = admin
                .pause_subscription(proto::PauseSubscriptionRequest {
                    name,
                    reason,
                    until,
                })
                .await
                .map_err(refused)?;
            show(paused.into_inner());
        }
        SubscriptionCommand::Resume { name } => {
            let resumed = admin
                .resume_subscription(proto::ResumeSubscriptionRequest { name })
                .await
                .map_err(refused)?;
            show(resumed.into_inner());
        }
        SubscriptionCommand::Seek { name, to, yes } => {
            let earliest = to.position
                == Some(proto::start_position::Position::Boundary(
                    proto::Boundary::Earliest as i32,
                ));
            if earliest && !yes {
                let stats = admin
                    .get_stats(proto::GetStatsRequest {
                        subscription: name.clone(),
                    })
                    .await
                    .map_err(refused)?
                    .into_inner();
                let stored = stats.outbox.map_or(0, |outbox| outbox.events_stored);
                confirm(&format!(
                    "replay subscription {name} from the earliest stored event ({} stored; those matching its filters are delivered again)",
                    count(stored, "event")
                ))?;
            }
            admin
                .seek_subscription(proto::SeekSubscriptionRequest {
                    subscription: name.clone(),
                    to: Some(to),
                })
                .await
                .map_err(refused)?;
            target.print(json!({ "sought": name }), || println!("moved {name}"));
        }
    }
    Ok(())
}

/// Most characters of a CEL filter `subscriptions list` shows: enough to tell filters
/// apart, few enough to keep a row on a terminal line; `get` shows the whole.
const LISTED_FILTER_CHARS: usize = 40;

fn join_or_all(values: &[String]) -> String {
    if values.is_empty() {
        "*".into()
    } else {
        values.join(",")
    }
}
