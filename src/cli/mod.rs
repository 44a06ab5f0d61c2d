//! Client-side subcommands of the `outbox-gateway` binary: they talk to a running
//! gateway over gRPC. Every command prints readable text, or JSON with `--json`, and
//! exits non-zero with one clear line on failure.

mod render;

use std::{collections::HashMap, io::BufRead, time::Duration};

use outbox_client::{
    ClientError, Connection, GatewayChannel,
    health::{HealthCheckRequest, health_check_response::ServingStatus},
};
use serde_json::{Value, json};
use tonic::{Code, Status};

use crate::proto;

/// Where a client subcommand finds the gateway, and how it prints.
#[derive(Debug, Clone, clap::Args)]
pub struct Target {
    /// The gateway's gRPC endpoint.
    #[arg(
        long,
        env = "OUTBOX_ENDPOINT",
        default_value = "http://127.0.0.1:50051",
        global = true
    )]
    pub endpoint: String,
    /// Give up on a call after this long (not applied to `tail` streams).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration, global = true)]
    pub timeout: Duration,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    /// Bearer token for a gateway that requires authentication.
    #[arg(long, env = "OUTBOX_TOKEN", global = true, hide_env_values = true)]
    pub token: Option<String>,
    /// PEM CA certificate that signed the gateway's certificate (TLS).
    #[arg(long, env = "OUTBOX_CA", global = true)]
    pub ca: Option<std::path::PathBuf>,
    /// PEM client certificate, for gateways that require mutual TLS.
    #[arg(long, env = "OUTBOX_CERT", global = true, requires = "key")]
    pub cert: Option<std::path::PathBuf>,
    /// PEM private key of --cert.
    #[arg(long, env = "OUTBOX_KEY", global = true, requires = "cert")]
    pub key: Option<std::path::PathBuf>,
}

impl Target {
    /// Connects to the gateway; `per_call_timeout` applies --timeout to every call too
    /// (not to `tail`, whose stream lasts).
    async fn connect(&self, per_call_timeout: bool) -> Result<GatewayChannel, String> {
        let mut connection = Connection::new(&self.endpoint).connect_timeout(self.timeout);
        if per_call_timeout {
            connection = connection.timeout(self.timeout);
        }
        if let Some(token) = &self.token {
            connection = connection.token(token);
        }
        if let Some(ca) = &self.ca {
            connection = connection.ca_certificate(ca);
        }
        if let (Some(cert), Some(key)) = (&self.cert, &self.key) {
            connection = connection.identity(cert, key);
        }
        connection.connect().await.map_err(|error| match error {
            ClientError::InvalidEndpoint { endpoint, reason } => {
                format!("invalid --endpoint {endpoint:?}: {reason}")
            }
            ClientError::InvalidToken => "--token must be printable ASCII".to_owned(),
            ClientError::ReadFile { .. } | ClientError::Tls(_) | ClientError::Connect { .. } => {
                error.to_string()
            }
            ClientError::Refused(status) | ClientError::Unavailable(status) => describe(status),
        })
    }

    /// Prints `value` as JSON, or runs `text` to print it readably.
    fn print(&self, value: Value, text: impl FnOnce()) {
        if self.json {
            println!("{value}");
        } else {
            text();
        }
    }
}

/// One line for a refused call: the status code and the gateway's message.
fn describe(status: Status) -> String {
    match status.code() {
        Code::Unavailable => format!("gateway unavailable: {}", status.message()),
        code => format!("{}: {}", code_name(code), status.message()),
    }
}

fn code_name(code: Code) -> &'static str {
    match code {
        Code::InvalidArgument => "invalid argument",
        Code::NotFound => "not found",
        Code::AlreadyExists => "already exists",
        Code::FailedPrecondition => "failed precondition",
        Code::Unauthenticated => "unauthenticated",
        Code::PermissionDenied => "permission denied",
        Code::DeadlineExceeded => "deadline exceeded",
        _ => "error",
    }
}

/// Client commands of the binary.
#[derive(Debug, clap::Subcommand)]
pub enum ClientCommand {
    /// Create, list, show, change, delete or seek subscriptions.
    Subscriptions {
        #[command(flatten)]
        target: Target,
        #[command(subcommand)]
        command: SubscriptionCommand,
    },
    /// List, requeue or resolve a subscription's dead letters.
    Dlq {
        #[command(flatten)]
        target: Target,
        #[command(subcommand)]
        command: DeadLetterCommand,
    },
    /// Make one event deliverable again: by id, or the latest of an aggregate.
    Requeue {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        args: RequeueArgs,
    },
    /// Show delivery figures per subscription and of the outbox.
    Stats {
        #[command(flatten)]
        target: Target,
        /// Only this subscription.
        #[arg(long)]
        subscription: Option<String>,
        /// Refresh the table until interrupted.
        #[arg(long)]
        watch: bool,
        /// Refresh interval of --watch.
        #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
        interval: Duration,
    },
    /// Publish one event from flags, or JSON lines from standard input.
    Publish {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        args: PublishArgs,
    },
    /// Stream a subscription's deliveries as JSON lines, acking each.
    Tail {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        args: TailArgs,
    },
    /// List the source databases the gateway relays from and whether each is reachable.
    Sources {
        #[command(flatten)]
        target: Target,
    },
    /// Ask the gateway whether it is healthy (exit 0 when SERVING).
    Health {
        #[command(flatten)]
        target: Target,
    },
}

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
    /// Lease length of a delivery, e.g. 30s.
    #[arg(long, value_parser = humantime::parse_duration)]
    ack_deadline: Option<Duration>,
    /// Deliveries before dead-lettering; 0 retries forever.
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
            ack_deadline: duration(self.ack_deadline),
            max_attempts: self.max_attempts,
            retry_backoff_min: duration(self.retry_backoff_min),
            retry_backoff_max: duration(self.retry_backoff_max),
            persistent_event_types: self.persistent_event_types,
            ..Default::default()
        }
    }

    /// The update-mask paths of the settings given on the command line.
    fn given_paths(&self) -> Vec<String> {
        let given = [
            ("event_types", !self.event_types.is_empty()),
            ("aggregate_types", !self.aggregate_types.is_empty()),
            ("metadata_match", !self.metadata_match.is_empty()),
            ("ack_deadline", self.ack_deadline.is_some()),
            ("max_attempts", self.max_attempts.is_some()),
            ("retry_backoff_min", self.retry_backoff_min.is_some()),
            ("retry_backoff_max", self.retry_backoff_max.is_some()),
            (
                "persistent_event_types",
                !self.persistent_event_types.is_empty(),
            ),
        ];
        given
            .into_iter()
            .filter(|(_, given)| *given)
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
            signing_secret: String::new(),
        })
    }
}

#[derive(Debug, clap::Subcommand)]
pub enum SubscriptionCommand {
    /// Create a subscription.
    Create {
        name: String,
        #[command(flatten)]
        settings: SubscriptionSettingsArgs,
        /// Where it starts: latest, earliest, or an RFC 3339 time.
        #[arg(long, default_value = "latest", value_parser = parse_position)]
        start: proto::StartPosition,
        /// Deliver the events of one aggregate one at a time, in order.
        #[arg(long)]
        ordered: bool,
        #[command(flatten)]
        push: PushArgs,
    },
    /// List all subscriptions.
    List,
    /// Show one subscription.
    Get { name: String },
    /// Change the given settings of a subscription (the others stay).
    Update {
        name: String,
        #[command(flatten)]
        settings: SubscriptionSettingsArgs,
        /// The push settings replace the current ones (a pull subscription becomes a
        /// push one and gets a signing secret, printed once); a stopped push resumes.
        #[command(flatten)]
        push: PushArgs,
        /// Stop pushing: consumers read the subscription with Subscribe again.
        #[arg(long, conflicts_with = "push_endpoint")]
        pull: bool,
    },
    /// Give a push subscription a new signing secret (printed once); the previous one
    /// keeps signing beside it for --keep-previous-for.
    RotateSecret {
        name: String,
        /// How long the previous secret still signs, e.g. 24h (the default) or 0s.
        #[arg(long, value_parser = humantime::parse_duration)]
        keep_previous_for: Option<Duration>,
    },
    /// Delete a subscription with its delivery records and dead letters.
    Delete { name: String },
    /// Replay from a time or the earliest event, or skip ahead to now.
    Seek {
        name: String,
        /// latest, earliest, or an RFC 3339 time.
        #[arg(long, value_parser = parse_position)]
        to: proto::StartPosition,
    },
}

#[derive(Debug, clap::Subcommand)]
pub enum DeadLetterCommand {
    /// List dead letters, oldest first.
    List {
        subscription: String,
        /// Only events matching this pattern; repeatable.
        #[arg(long = "event-type")]
        event_types: Vec<String>,
        /// Include resolved dead letters.
        #[arg(long)]
        include_resolved: bool,
        /// Dead letters per page (1 to 1000).
        #[arg(long, default_value_t = 100)]
        page_size: u32,
        /// Continue a listing (the token the previous page printed).
        #[arg(long, default_value = "")]
        page_token: String,
        /// Only this source database (`default`, or a `[[sources]]` name); every source
        /// when omitted.
        #[arg(long, default_value = "")]
        source: String,
    },
    /// Send dead letters back for delivery, attempts reset.
    Requeue {
        subscription: String,
        /// Event id; repeatable.
        #[arg(long = "id")]
        ids: Vec<String>,
        /// Event-type pattern; repeatable.
        #[arg(long = "event-type")]
        event_types: Vec<String>,
        /// Only dead letters dead-lettered before this RFC 3339 time.
        #[arg(long, value_parser = parse_time)]
        before: Option<prost_types::Timestamp>,
        /// Requeue every unresolved dead letter.
        #[arg(long)]
        all: bool,
        /// Only this source database (`default`, or a `[[sources]]` name); every source
        /// when omitted.
        #[arg(long, default_value = "")]
        source: String,
    },
    /// Mark a dead letter handled without redelivering it.
    Resolve {
        subscription: String,
        id: String,
        /// Who handled it.
        #[arg(long = "by")]
        resolved_by: String,
        /// What was done.
        #[arg(long, default_value = "")]
        notes: String,
        /// Only this source database (`default`, or a `[[sources]]` name); every source
        /// when omitted.
        #[arg(long, default_value = "")]
        source: String,
    },
}

#[derive(Debug, clap::Args)]
pub struct RequeueArgs {
    /// The event's id.
    #[arg(long, conflicts_with = "latest", required_unless_present = "latest")]
    id: Option<String>,
    /// Requeue the latest event of --aggregate-type/--aggregate-id with --event-type.
    #[arg(long, requires_all = ["aggregate_type", "aggregate_id", "event_type"])]
    latest: bool,
    #[arg(long)]
    aggregate_type: Option<String>,
    #[arg(long)]
    aggregate_id: Option<String>,
    #[arg(long)]
    event_type: Option<String>,
    /// Only for this subscription (default: every matching one).
    #[arg(long, default_value = "")]
    subscription: String,
    /// Only in this source database (default: the event is looked up in every source).
    #[arg(long, default_value = "")]
    source: String,
}

#[derive(Debug, clap::Args)]
pub struct PublishArgs {
    /// Read events as JSON lines from standard input instead of flags. Each line is an
    /// object with the EventInput fields; `payload` is any JSON value.
    #[arg(long, conflicts_with_all = ["aggregate_type", "aggregate_id", "event_type"])]
    stdin: bool,
    #[arg(long, required_unless_present = "stdin")]
    aggregate_type: Option<String>,
    #[arg(long, required_unless_present = "stdin")]
    aggregate_id: Option<String>,
    #[arg(long, required_unless_present = "stdin")]
    event_type: Option<String>,
    /// JSON payload.
    #[arg(long, default_value = "{}")]
    payload: String,
    /// Event id (UUID); generated when omitted.
    #[arg(long)]
    id: Option<String>,
    #[arg(long)]
    aggregate_version: Option<i64>,
    /// Metadata entry KEY=VALUE; repeatable.
    #[arg(long = "metadata", value_parser = parse_key_value)]
    metadata: Vec<(String, String)>,
    /// The source database to write to (`default` when omitted).
    #[arg(long, default_value = "")]
    source: String,
}

#[derive(Debug, clap::Args)]
pub struct TailArgs {
    /// Subscription to read. Without it, an ephemeral subscription is created from the
    /// filter flags and deleted on exit.
    subscription: Option<String>,
    /// Do not ack: deliveries go back at their ack deadline.
    #[arg(long)]
    no_ack: bool,
    /// Unsettled deliveries the stream may hold.
    #[arg(long, default_value_t = 100)]
    max_in_flight: u32,
    /// Stop after this many deliveries.
    #[arg(long)]
    limit: Option<u64>,
    /// Where an ephemeral subscription starts: latest, earliest or an RFC 3339 time.
    #[arg(long, default_value = "latest", value_parser = parse_position, conflicts_with = "subscription")]
    from: proto::StartPosition,
    /// Event-type pattern of an ephemeral subscription; repeatable.
    #[arg(long = "event-type", conflicts_with = "subscription")]
    event_types: Vec<String>,
    /// Aggregate type of an ephemeral subscription; repeatable.
    #[arg(long = "aggregate-type", conflicts_with = "subscription")]
    aggregate_types: Vec<String>,
}

fn parse_key_value(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(key, value)| (key.to_owned(), value.to_owned()))
        .ok_or_else(|| format!("{text:?} is not KEY=VALUE"))
}

fn parse_time(text: &str) -> Result<prost_types::Timestamp, String> {
    let time = chrono::DateTime::parse_from_rfc3339(text)
        .map_err(|error| format!("{text:?} is not an RFC 3339 time: {error}"))?;
    Ok(prost_types::Timestamp {
        seconds: time.timestamp(),
        nanos: time.timestamp_subsec_nanos() as i32,
    })
}

fn parse_position(text: &str) -> Result<proto::StartPosition, String> {
    use proto::start_position::Position;
    let position =
        match text {
            "latest" => Position::Boundary(proto::Boundary::Latest as i32),
            "earliest" => Position::Boundary(proto::Boundary::Earliest as i32),
            time => Position::Time(parse_time(time).map_err(|_| {
                format!("{time:?} is neither latest, earliest nor an RFC 3339 time")
            })?),
        };
    Ok(proto::StartPosition {
        position: Some(position),
    })
}

/// Runs a client command.
pub async fn run(command: ClientCommand) -> Result<(), String> {
    match command {
        ClientCommand::Subscriptions { target, command } => subscriptions(&target, command).await,
        ClientCommand::Dlq { target, command } => dead_letters(&target, command).await,
        ClientCommand::Requeue { target, args } => requeue(&target, args).await,
        ClientCommand::Stats {
            target,
            subscription,
            watch,
            interval,
        } => stats(&target, subscription.unwrap_or_default(), watch, interval).await,
        ClientCommand::Publish { target, args } => publish(&target, args).await,
        ClientCommand::Tail { target, args } => tail(&target, args).await,
        ClientCommand::Sources { target } => sources(&target).await,
        ClientCommand::Health { target } => health(&target).await,
    }
}

async fn sources(target: &Target) -> Result<(), String> {
    let mut admin = target.connect(true).await?.admin();
    let sources = admin
        .list_sources(proto::ListSourcesRequest {})
        .await
        .map_err(describe)?
        .into_inner()
        .sources;
    target.print(
        Value::Array(sources.iter().map(render::source).collect()),
        || render::sources_table(&sources),
    );
    Ok(())
}

async fn subscriptions(target: &Target, command: SubscriptionCommand) -> Result<(), String> {
    let mut admin = target.connect(true).await?.admin();
    let show = |subscription: proto::Subscription| {
        let value = render::subscription(&subscription);
        target.print(value.clone(), || {
            println!(
                "{}",
                serde_json::to_string_pretty(&value).unwrap_or_default()
            )
        });
    };
    match command {
        SubscriptionCommand::Create {
            name,
            settings,
            start,
            ordered,
            push,
        } => {
            let subscription = proto::Subscription {
                start: Some(start),
                ordered,
                push: push.into_push(),
                ..settings.into_subscription(name)
            };
            let created = admin
                .create_subscription(proto::CreateSubscriptionRequest {
                    subscription: Some(subscription),
                })
                .await
                .map_err(describe)?;
            show(created.into_inner());
        }
        SubscriptionCommand::List => {
            let list = admin
                .list_subscriptions(proto::ListSubscriptionsRequest {})
                .await
                .map_err(describe)?
                .into_inner()
                .subscriptions;
            let value = json!(list.iter().map(render::subscription).collect::<Vec<_>>());
            target.print(value, || {
                let rows: Vec<Vec<String>> = list
                    .iter()
                    .map(|s| {
                        vec![
                            s.name.clone(),
                            join_or_all(&s.event_types),
                            join_or_all(&s.aggregate_types),
                            render::duration(&s.ack_deadline),
                            s.max_attempts.unwrap_or_default().to_string(),
                            s.ordered.to_string(),
                        ]
                    })
                    .collect();
                render::table(
                    &[
                        "NAME",
                        "EVENT TYPES",
                        "AGGREGATE TYPES",
                        "ACK DEADLINE",
                        "MAX ATTEMPTS",
                        "ORDERED",
                    ],
                    &rows,
                );
            });
        }
        SubscriptionCommand::Get { name } => {
            let subscription = admin
                .get_subscription(proto::GetSubscriptionRequest { name })
                .await
                .map_err(describe)?;
            show(subscription.into_inner());
        }
        SubscriptionCommand::Update {
            name,
            settings,
            push,
            pull,
        } => {
            let mut paths = settings.given_paths();
            let push = push.into_push();
            if push.is_some() || pull {
                paths.push("push".into());
            }
            if paths.is_empty() {
                return Err("give at least one setting to change".into());
            }
            let updated = admin
                .update_subscription(proto::UpdateSubscriptionRequest {
                    subscription: Some(proto::Subscription {
                        push,
                        ..settings.into_subscription(name)
                    }),
                    update_mask: Some(prost_types::FieldMask { paths }),
                })
                .await
                .map_err(describe)?;
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
                .map_err(describe)?
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
        SubscriptionCommand::Delete { name } => {
            admin
                .delete_subscription(proto::DeleteSubscriptionRequest { name: name.clone() })
                .await
                .map_err(describe)?;
            target.print(json!({ "deleted": name }), || println!("deleted {name}"));
        }
        SubscriptionCommand::Seek { name, to } => {
            admin
                .seek_subscription(proto::SeekSubscriptionRequest {
                    subscription: name.clone(),
                    to: Some(to),
                })
                .await
                .map_err(describe)?;
            target.print(json!({ "sought": name }), || println!("moved {name}"));
        }
    }
    Ok(())
}

fn join_or_all(values: &[String]) -> String {
    if values.is_empty() {
        "*".into()
    } else {
        values.join(",")
    }
}

async fn dead_letters(target: &Target, command: DeadLetterCommand) -> Result<(), String> {
    let mut admin = target.connect(true).await?.admin();
    match command {
        DeadLetterCommand::List {
            subscription,
            event_types,
            include_resolved,
            page_size,
            page_token,
            source,
        } => {
            let page = admin
                .list_dead_letters(proto::ListDeadLettersRequest {
                    subscription,
                    event_types,
                    include_resolved,
                    page_size,
                    page_token,
                    source,
                    ..Default::default()
                })
                .await
                .map_err(describe)?
                .into_inner();
            let value = json!({
                "dead_letters": page.dead_letters.iter().map(render::dead_letter).collect::<Vec<_>>(),
                "next_page_token": page.next_page_token,
            });
            target.print(value, || {
                let rows: Vec<Vec<String>> = page
                    .dead_letters
                    .iter()
                    .map(|letter| {
                        let event = letter.event.clone().unwrap_or_default();
                        vec![
                            event.id,
                            event.event_type,
                            format!("{}/{}", event.aggregate_type, event.aggregate_id),
                            letter.attempts.to_string(),
                            render::timestamp(&letter.dead_lettered_at)
                                .as_str()
                                .unwrap_or("-")
                                .to_owned(),
                            if letter.resolved {
                                format!("by {}", letter.resolved_by)
                            } else {
                                "no".into()
                            },
                            letter.last_error.clone(),
                        ]
                    })
                    .collect();
                render::table(
                    &[
                        "EVENT ID",
                        "EVENT TYPE",
                        "AGGREGATE",
                        "ATTEMPTS",
                        "DEAD-LETTERED AT",
                        "RESOLVED",
                        "LAST ERROR",
                    ],
                    &rows,
                );
                if !page.next_page_token.is_empty() {
                    println!("more: --page-token {}", page.next_page_token);
                }
            });
        }
        DeadLetterCommand::Requeue {
            subscription,
            ids,
            event_types,
            before,
            all,
            source,
        } => {
            let requeued = admin
                .requeue_dead_letters(proto::RequeueDeadLettersRequest {
                    subscription,
                    ids,
                    event_types,
                    dead_lettered_before: before,
                    all,
                    source,
                    ..Default::default()
                })
                .await
                .map_err(describe)?
                .into_inner()
                .requeued_count;
            target.print(json!({ "requeued_count": requeued }), || {
                println!("requeued {requeued} dead letters")
            });
        }
        DeadLetterCommand::Resolve {
            subscription,
            id,
            resolved_by,
            notes,
            source,
        } => {
            let letter = admin
                .resolve_dead_letter(proto::ResolveDeadLetterRequest {
                    subscription,
                    id: id.clone(),
                    resolved_by,
                    notes,
                    source,
                })
                .await
                .map_err(describe)?
                .into_inner();
            target.print(render::dead_letter(&letter), || println!("resolved {id}"));
        }
    }
    Ok(())
}

async fn requeue(target: &Target, args: RequeueArgs) -> Result<(), String> {
    let mut admin = target.connect(true).await?.admin();
    let response = match args.id {
        Some(id) => {
            admin
                .requeue_event(proto::RequeueEventRequest {
                    id,
                    subscription: args.subscription,
                    source: args.source,
                })
                .await
        }
        None => {
            admin
                .requeue_latest(proto::RequeueLatestRequest {
                    aggregate_type: args.aggregate_type.unwrap_or_default(),
                    aggregate_id: args.aggregate_id.unwrap_or_default(),
                    event_type: args.event_type.unwrap_or_default(),
                    subscription: args.subscription,
                    source: args.source,
                })
                .await
        }
    };
    let requeued = response.map_err(describe)?.into_inner().requeued_count;
    target.print(json!({ "requeued_count": requeued }), || {
        println!("requeued on {requeued} subscriptions")
    });
    Ok(())
}

async fn stats(
    target: &Target,
    subscription: String,
    watch: bool,
    interval: Duration,
) -> Result<(), String> {
    let mut admin = target.connect(true).await?.admin();
    loop {
        let stats = admin
            .get_stats(proto::GetStatsRequest {
                subscription: subscription.clone(),
            })
            .await
            .map_err(describe)?
            .into_inner();
        target.print(render::stats(&stats), || {
            if watch {
                // Clear the screen and go home, like watch(1).
                print!("\x1b[2J\x1b[H");
            }
            render::stats_table(&stats);
        });
        if !watch {
            return Ok(());
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
    }
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
}

async fn publish(target: &Target, args: PublishArgs) -> Result<(), String> {
    let events = if args.stdin {
        let mut events = Vec::new();
        for (number, line) in std::io::stdin().lock().lines().enumerate() {
            let line = line.map_err(|error| format!("cannot read standard input: {error}"))?;
            if line.trim().is_empty() {
                continue;
            }
            let event: EventLine = serde_json::from_str(&line)
                .map_err(|error| format!("line {}: {error}", number + 1))?;
            events.push(proto::EventInput {
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
        events
    } else {
        serde_json::from_str::<Value>(&args.payload)
            .map_err(|error| format!("--payload is not JSON: {error}"))?;
        vec![proto::EventInput {
            id: args.id.unwrap_or_default(),
            aggregate_type: args.aggregate_type.unwrap_or_default(),
            aggregate_id: args.aggregate_id.unwrap_or_default(),
            aggregate_version: args.aggregate_version,
            event_type: args.event_type.unwrap_or_default(),
            payload: args.payload.into_bytes(),
            metadata: args.metadata.into_iter().collect(),
            ..Default::default()
        }]
    };
    if events.is_empty() {
        return Err("no events to publish".into());
    }
    let mut publisher = target.connect(true).await?.publisher();
    let results = publisher
        .publish(proto::PublishRequest {
            events,
            source: args.source,
        })
        .await
        .map_err(describe)?
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
    Ok(())
}

async fn tail(target: &Target, args: TailArgs) -> Result<(), String> {
    let gateway = target.connect(false).await?;
    let mut admin = gateway.admin();
    let (name, ephemeral) = match args.subscription {
        Some(name) => (name, false),
        None => {
            let name = format!("tail-{}", uuid::Uuid::new_v4().simple());
            admin
                .create_subscription(proto::CreateSubscriptionRequest {
                    subscription: Some(proto::Subscription {
                        name: name.clone(),
                        event_types: args.event_types,
                        aggregate_types: args.aggregate_types,
                        start: Some(args.from),
                        ..Default::default()
                    }),
                })
                .await
                .map_err(describe)?;
            (name, true)
        }
    };
    // Lease no more than will be printed: the rest would wait for their deadline.
    let max_in_flight = match args.limit {
        Some(limit) => args
            .max_in_flight
            .min(u32::try_from(limit).unwrap_or(u32::MAX))
            .max(1),
        None => args.max_in_flight,
    };
    let result = stream_deliveries(&gateway, &name, max_in_flight, !args.no_ack, args.limit).await;
    if ephemeral {
        let _ = admin
            .delete_subscription(proto::DeleteSubscriptionRequest { name })
            .await;
    }
    result
}

async fn stream_deliveries(
    gateway: &GatewayChannel,
    subscription: &str,
    max_in_flight: u32,
    ack: bool,
    limit: Option<u64>,
) -> Result<(), String> {
    let mut subscriber = gateway.subscriber();
    let mut stream = subscriber
        .subscribe(proto::SubscribeRequest {
            subscription: subscription.to_owned(),
            max_in_flight,
            ..Default::default()
        })
        .await
        .map_err(describe)?
        .into_inner();
    let mut seen = 0;
    while limit.is_none_or(|limit| seen < limit) {
        let delivery = tokio::select! {
            message = stream.message() => match message.map_err(describe)? {
                Some(delivery) => delivery,
                None => return Ok(()),
            },
            _ = tokio::signal::ctrl_c() => return Ok(()),
        };
        println!("{}", render::delivery(&delivery));
        if ack {
            subscriber
                .ack(proto::AckRequest {
                    subscription: subscription.to_owned(),
                    ack_ids: vec![delivery.ack_id],
                })
                .await
                .map_err(describe)?;
        }
        seen += 1;
    }
    Ok(())
}

/// Exits 0 when the gateway reports SERVING; for container health checks.
pub async fn health(target: &Target) -> Result<(), String> {
    let mut client = target.connect(true).await?.health();
    let response = client
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .map_err(|status| format!("health check failed: {}", status.message()))?;
    match ServingStatus::try_from(response.into_inner().status) {
        Ok(ServingStatus::Serving) => {
            target.print(json!({ "status": "SERVING" }), || println!("SERVING"));
            Ok(())
        }
        Ok(status) => Err(format!("the gateway reports {}", status.as_str_name())),
        Err(_) => Err("the gateway sent an unknown health status".into()),
    }
}

/// Token management, offline.
#[derive(Debug, clap::Subcommand)]
pub enum TokenCommand {
    /// Print a new random token and the SHA-256 to put in the configuration file.
    Generate {
        /// Name of the token holder, for the printed configuration snippet.
        #[arg(long, default_value = "my-service")]
        name: String,
    },
    /// Print the SHA-256 of a token read from standard input.
    Hash,
}

pub fn token(command: TokenCommand) -> Result<(), String> {
    match command {
        TokenCommand::Generate { name } => {
            let token: String = (0..32)
                .map(|_| format!("{:02x}", rand::random::<u8>()))
                .collect();
            println!("token:  {token}");
            println!();
            println!("[[tokens]]");
            println!("name = {name:?}");
            println!("sha256 = \"{}\"", crate::auth::token_digest(&token));
            println!("roles = [\"publisher\", \"subscriber\"]");
        }
        TokenCommand::Hash => {
            let mut token = String::new();
            std::io::stdin()
                .read_line(&mut token)
                .map_err(|error| format!("cannot read standard input: {error}"))?;
            println!(
                "{}",
                crate::auth::token_digest(token.trim_end_matches(['\r', '\n']))
            );
        }
    }
    Ok(())
}
