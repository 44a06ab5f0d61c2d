//! outbox-cli: the client-side subcommands of the `outbox-gateway` binary. They talk to
//! a running gateway over gRPC. Every command prints readable text, or JSON with
//! `--json`, and exits non-zero with one clear line on failure.
//!
//! # Layout
//! - Owns: the client commands' flags (clap) and what each does, the connection
//!   [`context`] profiles, and how answers are rendered.
//! - May depend on: `outbox-client` (the gRPC client and the generated API) and
//!   `outbox-domain` (token digests, status kinds). Never on the gateway's core, store or
//!   server: a client command works against any gateway, local or remote.

pub mod context;
mod render;

use std::{
    collections::HashMap,
    io::BufRead,
    sync::atomic::{AtomicU8, Ordering},
    time::Duration,
};

use outbox_client::{
    ClientError, Connection, GatewayChannel,
    health::{HealthCheckRequest, health_check_response::ServingStatus},
};
use serde_json::{Value, json};
use tonic::{Code, Status};

use outbox_client::proto;

/// Where a client subcommand finds the gateway, and how it prints.
#[derive(Debug, Clone, clap::Args)]
pub struct Target {
    /// The gateway's gRPC endpoint: http://HOST:PORT, https://HOST:PORT, or HOST:PORT
    /// (plain, or TLS when --ca or --cert is given). [default: the context's, else
    /// http://127.0.0.1:50051]
    #[arg(long, env = "OUTBOX_ENDPOINT", global = true)]
    pub endpoint: Option<String>,
    /// Saved connection to use (see `outbox-gateway context`); flags and environment
    /// variables given as well win over its settings. Without it, the selected context
    /// is used unless --endpoint names another gateway.
    #[arg(long, env = "OUTBOX_CONTEXT", global = true)]
    pub context: Option<String>,
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

/// Why a client command failed, and the exit code that says so.
#[derive(Debug)]
pub enum CliError {
    /// The command line asks for something the command cannot do (exit code 2, as for
    /// the usage errors clap finds).
    Usage(String),
    /// The gateway could not be reached or refused the call, or the work failed (1).
    Failed(String),
}

impl CliError {
    pub fn message(&self) -> &str {
        match self {
            CliError::Usage(message) | CliError::Failed(message) => message,
        }
    }

    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(_) => 2,
            CliError::Failed(_) => 1,
        }
    }
}

impl From<String> for CliError {
    fn from(message: String) -> Self {
        CliError::Failed(message)
    }
}

/// A usage error: the command line asks for something the command cannot do.
fn usage(message: impl Into<String>) -> CliError {
    CliError::Usage(message.into())
}

/// What [`describe`] or [`explain_connect_failure`] noticed about a failure that only the
/// command's [`Target`] can explain further (one command runs per process).
static NOTICED: AtomicU8 = AtomicU8::new(NOTICED_NOTHING);
const NOTICED_NOTHING: u8 = 0;
/// The answer was not gRPC: maybe the endpoint is another port of the gateway.
const NOTICED_NOT_GRPC: u8 = 1;
/// The gateway asked for a token.
const NOTICED_UNAUTHENTICATED: u8 = 2;

fn notice(what: u8) {
    NOTICED.store(what, Ordering::Relaxed);
}

/// The connection settings of a command: its flags and environment over its context.
struct Resolved {
    endpoint: String,
    token: Option<String>,
    ca: Option<std::path::PathBuf>,
    cert: Option<std::path::PathBuf>,
    key: Option<std::path::PathBuf>,
}

/// Where client commands look when neither a flag nor a context names a gateway.
const DEFAULT_ENDPOINT: &str = "http://127.0.0.1:50051";

impl Target {
    /// The selected context this command does not use because --endpoint (or
    /// OUTBOX_ENDPOINT) names the gateway.
    fn bypassed_context(&self) -> Option<String> {
        if self.context.is_some() || self.endpoint.is_none() {
            return None;
        }
        context::load().ok()?.current
    }

    /// A failed command's message, with what only the command's settings can add: that
    /// the endpoint speaks HTTP, not gRPC; that a selected context was left unused.
    async fn explain(&self, message: String) -> String {
        match NOTICED.load(Ordering::Relaxed) {
            NOTICED_NOT_GRPC => {
                let Ok(resolved) = self.resolve() else {
                    return message;
                };
                let endpoint = endpoint_url(&resolved);
                if speaks_http1(&endpoint, self.timeout).await {
                    format!(
                        "cannot use {endpoint}: that port speaks HTTP, not gRPC: is it --listen (default 50051)? The metrics and the console listen on ports of their own"
                    )
                } else {
                    message
                }
            }
            NOTICED_UNAUTHENTICATED => match self.bypassed_context() {
                Some(name) => format!(
                    "{message}; the selected context {name:?} was not used because --endpoint (or OUTBOX_ENDPOINT) was given: add --context {name} to use it"
                ),
                None => message,
            },
            _ => message,
        }
    }

    fn resolve(&self) -> Result<Resolved, String> {
        let saved = match (&self.context, &self.endpoint) {
            (Some(name), _) => context::chosen(Some(name))?,
            // Another gateway than the selected context's: its token and files must not
            // go there.
            (None, Some(_)) => None,
            (None, None) => context::chosen(None)?,
        }
        .unwrap_or_default();
        // A client certificate comes with its key: both from the flags, or both saved.
        let (cert, key) = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => (Some(cert.clone()), Some(key.clone())),
            _ => (saved.cert, saved.key),
        };
        Ok(Resolved {
            endpoint: self
                .endpoint
                .clone()
                .or(saved.endpoint)
                .unwrap_or_else(|| DEFAULT_ENDPOINT.to_owned()),
            token: self.token.clone().or(saved.token),
            ca: self.ca.clone().or(saved.ca),
            cert,
            key,
        })
    }

    /// Connects to the gateway; `per_call_timeout` applies --timeout to every call too
    /// (not to `tail`, whose stream lasts).
    async fn connect(&self, per_call_timeout: bool) -> Result<GatewayChannel, String> {
        let resolved = self.resolve()?;
        let endpoint = endpoint_url(&resolved);
        let mut connection = Connection::new(&endpoint).connect_timeout(self.timeout);
        if per_call_timeout {
            connection = connection.timeout(self.timeout);
        }
        if let Some(token) = &resolved.token {
            connection = connection.token(token);
        }
        if let Some(ca) = &resolved.ca {
            connection = connection.ca_certificate(ca);
        }
        if let (Some(cert), Some(key)) = (&resolved.cert, &resolved.key) {
            connection = connection.identity(cert, key);
        }
        connection.connect().await.map_err(|error| match error {
            ClientError::InvalidEndpoint { endpoint, reason } => {
                format!("invalid --endpoint {endpoint:?}: {reason}")
            }
            ClientError::InvalidToken => "--token must be printable ASCII".to_owned(),
            ClientError::Connect { endpoint, source } => {
                format!(
                    "cannot reach the gateway at {endpoint}: {}",
                    explain_connect_failure(&source, &endpoint, self.timeout)
                )
            }
            ClientError::ReadFile { .. } | ClientError::Tls(_) => error.to_string(),
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

/// The endpoint as a URL: `host:port` alone (as grpcurl takes it) means http://, or
/// https:// when a CA or client certificate is given.
fn endpoint_url(resolved: &Resolved) -> String {
    if resolved.endpoint.contains("://") {
        return resolved.endpoint.clone();
    }
    let scheme = if resolved.ca.is_some() || resolved.cert.is_some() {
        "https"
    } else {
        "http"
    };
    format!("{scheme}://{}", resolved.endpoint)
}

/// Whether the server at a plain `http://` endpoint answers an HTTP/1.1 request: the
/// gateway's metrics and console ports do, its gRPC port (HTTP/2 only) does not.
async fn speaks_http1(endpoint: &str, timeout: Duration) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Some(rest) = endpoint.strip_prefix("http://") else {
        return false;
    };
    let authority = rest.split('/').next().unwrap_or(rest);
    let probe = async {
        let mut stream = tokio::net::TcpStream::connect(authority).await.ok()?;
        let request = format!("HEAD / HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut answer = [0u8; 7];
        stream.read_exact(&mut answer).await.ok()?;
        Some(&answer == b"HTTP/1.")
    };
    tokio::time::timeout(timeout.min(Duration::from_secs(5)), probe)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}

/// Says in a few words why a connection failed, from the transport error's causes.
fn explain_connect_failure(
    error: &(dyn std::error::Error + 'static),
    endpoint: &str,
    timeout: Duration,
) -> String {
    let mut causes = Vec::new();
    let mut io_kind = None;
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(error) = cause {
        if let Some(io) = error.downcast_ref::<std::io::Error>() {
            io_kind.get_or_insert(io.kind());
        }
        causes.push(error.to_string());
        cause = error.source();
    }
    let said = |needle: &str| {
        causes
            .iter()
            .any(|text| text.to_lowercase().contains(needle))
    };
    let tls = endpoint.starts_with("https://");
    if said("dns error") || said("failed to lookup address") || said("name or service not known") {
        return "the host name was not found".into();
    }
    match io_kind {
        Some(std::io::ErrorKind::ConnectionRefused) => {
            return "connection refused: is the gateway running and listening on that port?".into();
        }
        Some(std::io::ErrorKind::TimedOut) => {
            return format!(
                "no answer within {} (--timeout)",
                humantime::format_duration(timeout)
            );
        }
        _ => {}
    }
    if said("timed out") || said("deadline") {
        return format!(
            "no answer within {} (--timeout)",
            humantime::format_duration(timeout)
        );
    }
    if tls && (said("invalidcontenttype") || said("corrupt message") || said("invalid content")) {
        return "the gateway does not speak TLS there: use http:// in --endpoint".into();
    }
    if tls && (said("certificate") || said("unknownissuer")) {
        return format!(
            "its TLS certificate is not trusted ({}): pass the CA that signed it with --ca",
            causes.last().cloned().unwrap_or_default()
        );
    }
    if !tls {
        notice(NOTICED_NOT_GRPC);
        return format!(
            "the connection failed during the HTTP/2 handshake ({}); if the gateway serves TLS, use https:// in --endpoint (and --ca)",
            causes.last().cloned().unwrap_or_default()
        );
    }
    causes
        .last()
        .cloned()
        .unwrap_or_else(|| "unknown error".into())
}

/// Asks on the terminal before a destructive step described by `what`; refuses when
/// there is no terminal to ask (scripts pass --yes).
fn confirm(what: &str) -> Result<(), String> {
    use std::io::{IsTerminal, Write};
    if !std::io::stdin().is_terminal() {
        return Err(format!(
            "this would {what}; pass --yes to confirm when not at a terminal"
        ));
    }
    eprint!("This will {what}. Continue? [y/N] ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    std::io::stdin()
        .read_line(&mut answer)
        .map_err(|error| format!("cannot read the answer: {error}"))?;
    match answer.trim().to_ascii_lowercase().as_str() {
        "y" | "yes" => Ok(()),
        _ => Err("cancelled; nothing was changed".into()),
    }
}

/// "1 dead letter", "2 dead letters".
fn count(number: u64, noun: &str) -> String {
    match (number, noun.strip_suffix('y')) {
        (1, _) => format!("1 {noun}"),
        (_, Some(stem)) => format!("{number} {stem}ies"),
        _ => format!("{number} {noun}s"),
    }
}

/// One line for a refused call: the status code and the gateway's message.
fn describe(status: Status) -> String {
    // The client's own timer, not the gateway, ended the call.
    if status.message() == "Timeout expired" {
        return "no answer from the gateway within --timeout".into();
    }
    // What a plain HTTP/2 client sees of a server that expects TLS: the server hangs up.
    let hung_up = status.message().contains("h2 protocol error")
        || (status.code() == Code::Unknown && status.message() == "transport error")
        || (status.code() == Code::Cancelled && status.message() == "operation was canceled");
    // What a gRPC client makes of an HTTP server's answer, such as the console's 404 page.
    let not_grpc = status
        .message()
        .contains("while receiving response with status")
        || status.message().contains("mapped from HTTP status code");
    if hung_up || not_grpc {
        notice(NOTICED_NOT_GRPC);
    }
    if not_grpc {
        return format!(
            "the answer is not gRPC ({}): is --endpoint the gateway's gRPC address?",
            status.message()
        );
    }
    if hung_up {
        return format!(
            "the gateway hung up ({}): if it serves TLS, use https:// in --endpoint (and --ca)",
            status.message()
        );
    }
    match status.code() {
        Code::Unavailable => format!("gateway unavailable: {}", status.message()),
        Code::Unauthenticated => {
            notice(NOTICED_UNAUTHENTICATED);
            format!(
                "unauthenticated: {}; pass --token, set OUTBOX_TOKEN, or use a context that holds one (outbox-gateway context save NAME --token ...)",
                status.message()
            )
        }
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
    /// Create, list, show, change, pause, resume, delete or seek subscriptions.
    Subscriptions {
        #[command(flatten)]
        target: Target,
        #[command(subcommand)]
        command: SubscriptionCommand,
    },
    /// List, summarize, requeue or resolve a subscription's dead letters.
    Dlq {
        #[command(flatten)]
        target: Target,
        #[command(subcommand)]
        command: DeadLetterCommand,
    },
    /// Show an event and where it stands on every subscription.
    Events {
        #[command(flatten)]
        target: Target,
        #[command(subcommand)]
        command: EventCommand,
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
    /// Take up to --max deliveries of a subscription, print them, and settle them:
    /// --ack, --nack (retry later) or --dead-letter; without one they go back at once.
    Pull {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        args: PullArgs,
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
    },
    /// List all subscriptions.
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
        /// Stop pushing: consumers read the subscription with Subscribe again.
        #[arg(long, conflicts_with = "push_endpoint")]
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

#[derive(Debug, clap::Subcommand)]
pub enum DeadLetterCommand {
    /// List dead letters, oldest first.
    List {
        /// The subscription.
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
    /// A subscription's unresolved dead letters grouped by last error, largest group
    /// first.
    Summarize {
        /// The subscription.
        subscription: String,
        /// Only this source database (`default`, or a `[[sources]]` name); every source
        /// when omitted.
        #[arg(long, default_value = "")]
        source: String,
    },
    /// Send dead letters back for delivery, attempts reset.
    Requeue {
        /// The subscription.
        subscription: String,
        #[command(flatten)]
        select: DeadLetterSelector,
    },
    /// Mark dead letters handled without redelivering them: one by its id, or those the
    /// selectors choose.
    Resolve {
        /// The subscription.
        subscription: String,
        /// The dead letter's event id.
        id: Option<String>,
        #[command(flatten)]
        select: DeadLetterSelector,
        /// Who handled it.
        #[arg(long = "by")]
        resolved_by: String,
        /// What was done.
        #[arg(long, default_value = "")]
        notes: String,
    },
}

/// Which dead letters `dlq requeue` and `dlq resolve` take: those every given selector
/// chooses, or every one with --all.
#[derive(Debug, clap::Args)]
pub struct DeadLetterSelector {
    /// Event id; repeatable.
    #[arg(long = "id")]
    ids: Vec<String>,
    /// Event-type pattern; repeatable.
    #[arg(long = "event-type")]
    event_types: Vec<String>,
    /// Only events of this aggregate type.
    #[arg(long)]
    aggregate_type: Option<String>,
    /// Only events of this aggregate id.
    #[arg(long)]
    aggregate_id: Option<String>,
    /// Only dead letters whose last error is exactly this.
    #[arg(long)]
    last_error: Option<String>,
    /// Only dead letters dead-lettered at or after this RFC 3339 time.
    #[arg(long, value_parser = parse_time)]
    after: Option<prost_types::Timestamp>,
    /// Only dead letters dead-lettered before this RFC 3339 time.
    #[arg(long, value_parser = parse_time)]
    before: Option<prost_types::Timestamp>,
    /// Take every unresolved dead letter (asks first).
    #[arg(long)]
    all: bool,
    /// Only this source database (`default`, or a `[[sources]]` name); every source
    /// when omitted.
    #[arg(long, default_value = "")]
    source: String,
    /// Do not ask for confirmation (for scripts).
    #[arg(long, short = 'y')]
    yes: bool,
}

impl DeadLetterSelector {
    fn chooses_nothing(&self) -> bool {
        self.ids.is_empty()
            && self.event_types.is_empty()
            && self.aggregate_type.is_none()
            && self.aggregate_id.is_none()
            && self.last_error.is_none()
            && self.after.is_none()
            && self.before.is_none()
            && !self.all
    }

    fn requeue_request(&self, subscription: &str) -> proto::RequeueDeadLettersRequest {
        proto::RequeueDeadLettersRequest {
            subscription: subscription.to_owned(),
            ids: self.ids.clone(),
            event_types: self.event_types.clone(),
            dead_lettered_before: self.before,
            all: self.all,
            source: self.source.clone(),
            aggregate_type: self.aggregate_type.clone().unwrap_or_default(),
            aggregate_id: self.aggregate_id.clone().unwrap_or_default(),
            last_error: self.last_error.clone().unwrap_or_default(),
            dead_lettered_after: self.after,
            validate_only: false,
        }
    }

    fn resolve_request(
        &self,
        subscription: &str,
        resolved_by: &str,
        notes: &str,
    ) -> proto::ResolveDeadLettersRequest {
        proto::ResolveDeadLettersRequest {
            subscription: subscription.to_owned(),
            ids: self.ids.clone(),
            event_types: self.event_types.clone(),
            aggregate_type: self.aggregate_type.clone().unwrap_or_default(),
            aggregate_id: self.aggregate_id.clone().unwrap_or_default(),
            last_error: self.last_error.clone().unwrap_or_default(),
            dead_lettered_after: self.after,
            dead_lettered_before: self.before,
            all: self.all,
            resolved_by: resolved_by.to_owned(),
            notes: notes.to_owned(),
            validate_only: false,
            source: self.source.clone(),
        }
    }
}

/// What `outbox-gateway events` does.
#[derive(Debug, clap::Subcommand)]
pub enum EventCommand {
    /// Show an event: its fields and payload, and on every subscription whether it is
    /// pending, in flight, awaiting retry, acked or dead.
    Get {
        /// The event's id (UUID).
        id: String,
        /// The source database holding it (default: the first that has it).
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
    /// Aggregate type of the event (with --latest).
    #[arg(long)]
    aggregate_type: Option<String>,
    /// Aggregate id of the event (with --latest).
    #[arg(long)]
    aggregate_id: Option<String>,
    /// Event type of the event (with --latest).
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

#[derive(Debug, clap::Args)]
pub struct PullArgs {
    /// Subscription to pull from.
    subscription: String,
    /// Most deliveries to take (1 to 1000).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    max: u32,
    /// How long to wait for the first delivery.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    wait: Duration,
    /// Acknowledge what was pulled: done, never delivered again.
    #[arg(long, group = "settlement")]
    ack: bool,
    /// Give what was pulled back for a retry (after the subscription's backoff, or
    /// --retry-after).
    #[arg(long, group = "settlement")]
    nack: bool,
    /// With --nack: retry after this long instead of the subscription's backoff.
    #[arg(long, requires = "nack", value_parser = humantime::parse_duration)]
    retry_after: Option<Duration>,
    /// Send what was pulled to the dead-letter queue now; needs --reason.
    #[arg(long, group = "settlement", requires = "reason")]
    dead_letter: bool,
    /// Why (recorded as the delivery's last error) with --nack or --dead-letter.
    #[arg(long)]
    reason: Option<String>,
}

#[derive(Debug, clap::Args)]
pub struct TailArgs {
    /// Subscription to read. Without it, an ephemeral subscription is created from the
    /// filter flags and deleted on exit (should tail be killed outright, the gateway
    /// deletes it after 5 minutes without a reader).
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

/// A point in time: RFC 3339, or a duration from now.
fn parse_until(text: &str) -> Result<prost_types::Timestamp, String> {
    if let Ok(time) = parse_time(text) {
        return Ok(time);
    }
    let delay = humantime::parse_duration(text)
        .map_err(|_| format!("{text:?} is neither an RFC 3339 time nor a duration like 30m"))?;
    let at = chrono::Duration::from_std(delay)
        .ok()
        .and_then(|delay| chrono::Utc::now().checked_add_signed(delay))
        .ok_or_else(|| format!("{text:?} is too far in the future"))?;
    Ok(prost_types::Timestamp {
        seconds: at.timestamp(),
        nanos: at.timestamp_subsec_nanos() as i32,
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
pub async fn run(command: ClientCommand) -> Result<(), CliError> {
    let target = match &command {
        ClientCommand::Subscriptions { target, .. }
        | ClientCommand::Dlq { target, .. }
        | ClientCommand::Events { target, .. }
        | ClientCommand::Requeue { target, .. }
        | ClientCommand::Stats { target, .. }
        | ClientCommand::Publish { target, .. }
        | ClientCommand::Tail { target, .. }
        | ClientCommand::Sources { target }
        | ClientCommand::Pull { target, .. }
        | ClientCommand::Health { target } => target.clone(),
    };
    let result = match command {
        ClientCommand::Subscriptions { target, command } => subscriptions(&target, command).await,
        ClientCommand::Dlq { target, command } => dead_letters(&target, command).await,
        ClientCommand::Events { target, command } => {
            events(&target, command).await.map_err(CliError::from)
        }
        ClientCommand::Requeue { target, args } => {
            requeue(&target, args).await.map_err(CliError::from)
        }
        ClientCommand::Stats {
            target,
            subscription,
            watch,
            interval,
        } => stats(&target, subscription.unwrap_or_default(), watch, interval)
            .await
            .map_err(CliError::from),
        ClientCommand::Publish { target, args } => {
            publish(&target, args).await.map_err(CliError::from)
        }
        ClientCommand::Tail { target, args } => tail(&target, args).await.map_err(CliError::from),
        ClientCommand::Sources { target } => sources(&target).await.map_err(CliError::from),
        ClientCommand::Pull { target, args } => pull(&target, args).await,
        ClientCommand::Health { target } => health(&target).await.map_err(CliError::from),
    };
    match result {
        Err(CliError::Failed(message)) => Err(CliError::Failed(target.explain(message).await)),
        other => other,
    }
}

/// Makes a write to a closed standard output (`outbox-gateway stats | head -1`) end the
/// command quietly with exit code 0 instead of a panic. Rust ignores SIGPIPE, so
/// `println!` panics when the reader has gone; restoring SIGPIPE's default instead
/// would also kill the CLI when it writes to a gRPC connection the gateway has reset.
/// `tail` handles its own writes, so that it can delete its ephemeral subscription.
pub fn exit_quietly_on_closed_stdout() {
    let closed = format!(
        "failed printing to stdout: {}",
        std::io::Error::from_raw_os_error(EPIPE)
    );
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied());
        if message == Some(closed.as_str()) {
            std::process::exit(0);
        }
        default_hook(info);
    }));
}

/// The "broken pipe" error number (the same on Linux, the BSDs and macOS).
const EPIPE: i32 = 32;

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

async fn subscriptions(target: &Target, command: SubscriptionCommand) -> Result<(), CliError> {
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
        } => {
            let subscription = proto::Subscription {
                start: Some(start),
                ordered,
                sources,
                expire_after_idle: expire_after_idle
                    .and_then(|idle| prost_types::Duration::try_from(idle).ok()),
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
                            s.paused.to_string(),
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
                .map_err(describe)?
                .into_inner();
            // The text also says how it is doing, in the words of `stats` and the console.
            let figures = match target.json {
                true => None,
                false => admin
                    .get_stats(proto::GetStatsRequest { subscription: name })
                    .await
                    .ok()
                    .and_then(|stats| stats.into_inner().subscriptions.into_iter().next()),
            };
            target.print(render::subscription(&subscription), || {
                render::subscription_text(&subscription);
                if let Some(figures) = &figures {
                    render::status_text(figures);
                }
            });
        }
        SubscriptionCommand::Update {
            name,
            settings,
            push,
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
            if push.is_some() || pull {
                paths.push("push".into());
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
        SubscriptionCommand::Delete { name, yes } => {
            if !yes {
                let stats = admin
                    .get_stats(proto::GetStatsRequest {
                        subscription: name.clone(),
                    })
                    .await
                    .map_err(describe)?
                    .into_inner();
                let figures = stats.subscriptions.first().cloned().unwrap_or_default();
                confirm(&format!(
                    "delete subscription {name}, dropping {} in flight, {} awaiting retry and {}",
                    count(figures.in_flight, "delivery"),
                    count(figures.awaiting_retry, "delivery"),
                    count(figures.dead_lettered, "unresolved dead letter"),
                ))?;
            }
            admin
                .delete_subscription(proto::DeleteSubscriptionRequest { name: name.clone() })
                .await
                .map_err(describe)?;
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
                .map_err(describe)?;
            show(paused.into_inner());
        }
        SubscriptionCommand::Resume { name } => {
            let resumed = admin
                .resume_subscription(proto::ResumeSubscriptionRequest { name })
                .await
                .map_err(describe)?;
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
                    .map_err(describe)?
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

async fn dead_letters(target: &Target, command: DeadLetterCommand) -> Result<(), CliError> {
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
        DeadLetterCommand::Summarize {
            subscription,
            source,
        } => {
            let summary = admin
                .summarize_dead_letters(proto::SummarizeDeadLettersRequest {
                    subscription: subscription.clone(),
                    source,
                })
                .await
                .map_err(describe)?
                .into_inner();
            let value = json!({
                "groups": summary.groups.iter().map(render::dead_letter_group).collect::<Vec<_>>(),
            });
            target.print(value, || {
                if summary.groups.is_empty() {
                    println!("no unresolved dead letters in {subscription}");
                    return;
                }
                let time = |at: &Option<prost_types::Timestamp>| {
                    render::timestamp(at).as_str().unwrap_or("-").to_owned()
                };
                let rows: Vec<Vec<String>> = summary
                    .groups
                    .iter()
                    .map(|group| {
                        vec![
                            group.count.to_string(),
                            time(&group.first_dead_lettered_at),
                            time(&group.last_dead_lettered_at),
                            group.example_event_id.clone(),
                            if group.last_error.is_empty() {
                                "-".into()
                            } else {
                                group.last_error.clone()
                            },
                        ]
                    })
                    .collect();
                render::table(
                    &["COUNT", "FIRST", "LAST", "EXAMPLE EVENT", "LAST ERROR"],
                    &rows,
                );
            });
        }
        DeadLetterCommand::Requeue {
            subscription,
            select,
        } => {
            if select.chooses_nothing() {
                return Err(usage(
                    "choose dead letters with --id, --event-type, --aggregate-type, --aggregate-id, --last-error, --after or --before, or take every one with --all",
                ));
            }
            let asked_ids = select.ids.len() as u64;
            if select.all && !select.yes {
                let would = admin
                    .requeue_dead_letters(proto::RequeueDeadLettersRequest {
                        validate_only: true,
                        ..select.requeue_request(&subscription)
                    })
                    .await
                    .map_err(describe)?
                    .into_inner()
                    .requeued_count;
                confirm(&format!(
                    "requeue all {} of {subscription} for delivery",
                    count(would, "unresolved dead letter")
                ))?;
            }
            let requeued = admin
                .requeue_dead_letters(select.requeue_request(&subscription))
                .await
                .map_err(describe)?
                .into_inner()
                .requeued_count;
            if asked_ids > 0 && requeued < asked_ids {
                return Err(format!(
                    "requeued {} of {asked_ids}: the others are not unresolved dead letters of {subscription} (see `dlq list {subscription} --include-resolved`)",
                    count(requeued, "dead letter")
                )
                .into());
            }
            target.print(json!({ "requeued_count": requeued }), || {
                println!("requeued {}", count(requeued, "dead letter"))
            });
        }
        DeadLetterCommand::Resolve {
            subscription,
            id,
            mut select,
            resolved_by,
            notes,
        } => {
            // One dead letter by its id: the record it became.
            if let Some(id) = &id
                && select.chooses_nothing()
            {
                let letter = admin
                    .resolve_dead_letter(proto::ResolveDeadLetterRequest {
                        subscription,
                        id: id.clone(),
                        resolved_by,
                        notes,
                        source: select.source,
                    })
                    .await
                    .map_err(describe)?
                    .into_inner();
                target.print(render::dead_letter(&letter), || println!("resolved {id}"));
                return Ok(());
            }
            select.ids.extend(id);
            if select.chooses_nothing() {
                return Err(usage(
                    "choose dead letters by ID, or with --id, --event-type, --aggregate-type, --aggregate-id, --last-error, --after or --before, or take every one with --all",
                ));
            }
            let asked_ids = select.ids.len() as u64;
            if select.all && !select.yes {
                let would = admin
                    .resolve_dead_letters(proto::ResolveDeadLettersRequest {
                        validate_only: true,
                        ..select.resolve_request(&subscription, &resolved_by, &notes)
                    })
                    .await
                    .map_err(describe)?
                    .into_inner()
                    .resolved_count;
                confirm(&format!(
                    "resolve all {} of {subscription} without delivering them",
                    count(would, "unresolved dead letter")
                ))?;
            }
            let resolved = admin
                .resolve_dead_letters(select.resolve_request(&subscription, &resolved_by, &notes))
                .await
                .map_err(describe)?
                .into_inner()
                .resolved_count;
            if asked_ids > 0 && resolved < asked_ids {
                return Err(format!(
                    "resolved {} of {asked_ids}: the others are not unresolved dead letters of {subscription} (see `dlq list {subscription} --include-resolved`)",
                    count(resolved, "dead letter")
                )
                .into());
            }
            target.print(json!({ "resolved_count": resolved }), || {
                println!("resolved {}", count(resolved, "dead letter"))
            });
        }
    }
    Ok(())
}

async fn events(target: &Target, command: EventCommand) -> Result<(), String> {
    let mut admin = target.connect(true).await?.admin();
    match command {
        EventCommand::Get { id, source } => {
            let deliveries = admin
                .get_event(proto::GetEventRequest { id, source })
                .await
                .map_err(describe)?
                .into_inner();
            target.print(render::event_deliveries(&deliveries), || {
                render::event_deliveries_text(&deliveries)
            });
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
        println!("requeued on {}", count(requeued, "subscription"))
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

async fn publish(target: &Target, args: PublishArgs) -> Result<(), String> {
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

async fn tail(target: &Target, args: TailArgs) -> Result<(), String> {
    let gateway = target.connect(false).await?;
    let mut admin = gateway.admin();
    let (name, ephemeral) = match args.subscription {
        Some(name) => {
            // It streams on: deliveries come once the pause ends.
            if let Some(paused) = pause_notice(&gateway, &name).await {
                eprintln!("outbox-gateway: {paused}");
            }
            (name, false)
        }
        None => {
            let name = format!("tail-{}", uuid::Uuid::new_v4().simple());
            admin
                .create_subscription(proto::CreateSubscriptionRequest {
                    subscription: Some(proto::Subscription {
                        name: name.clone(),
                        event_types: args.event_types,
                        aggregate_types: args.aggregate_types,
                        start: Some(args.from),
                        expire_after_idle: prost_types::Duration::try_from(TAIL_EXPIRE_AFTER_IDLE)
                            .ok(),
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
    // Every way out (a signal, a closed pipe, the limit, an error) passes here, so an
    // ephemeral subscription is always deleted.
    let result = tokio::select! {
        result = stream_deliveries(&gateway, &name, max_in_flight, !args.no_ack, args.limit) => result,
        () = terminated() => Ok(()),
    };
    if ephemeral
        && let Err(status) = admin
            .delete_subscription(proto::DeleteSubscriptionRequest { name: name.clone() })
            .await
    {
        eprintln!(
            "outbox-gateway: could not delete the ephemeral subscription {name} ({}); the gateway removes it once unused",
            describe(status)
        );
    }
    result
}

/// How long the ephemeral subscription of a `tail` that vanished without deleting it
/// (killed with SIGKILL, its machine lost) outlives it: long enough to ride out a gateway
/// restart while tail reconnects.
const TAIL_EXPIRE_AFTER_IDLE: Duration = Duration::from_secs(5 * 60);

/// Completes on SIGINT (Ctrl-C) or SIGTERM.
async fn terminated() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = terminate.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}

/// Whether a call failed because the gateway stopped or the connection broke (a
/// restart), rather than because the gateway refused it.
fn gateway_went_away(status: &Status) -> bool {
    match status.code() {
        Code::Unavailable | Code::Cancelled => true,
        // Transport failures surface as UNKNOWN with the transport's words, and a stream
        // reset by a closing server as INTERNAL "h2 protocol error" (the gateway's own
        // internal errors never say that).
        Code::Internal => status.message().contains("h2 protocol error"),
        Code::Unknown => {
            let message = status.message();
            [
                "h2 protocol error",
                "transport error",
                "connection",
                "broken pipe",
            ]
            .iter()
            .any(|words| message.contains(words))
        }
        _ => false,
    }
}

/// Why nothing comes from a subscription that is paused: its pause in words, with how to
/// end it; `None` when it is not paused, or when this token may not read it (a
/// subscriber's token need not see definitions).
async fn pause_notice(gateway: &GatewayChannel, name: &str) -> Option<String> {
    let subscription = gateway
        .admin()
        .get_subscription(proto::GetSubscriptionRequest {
            name: name.to_owned(),
        })
        .await
        .ok()?
        .into_inner();
    let pause = render::pause_text(&subscription)?;
    Some(format!(
        "subscription {name} is paused {pause}; nothing is handed out until `outbox-gateway subscriptions resume {name}`"
    ))
}

/// Longest wait between attempts to reach a gateway that went away.
const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(5);

/// Prints deliveries as JSON lines (acking each unless `ack` is false) until `limit`,
/// the end of the stream, or a closed standard output. A stream broken because the
/// gateway went away (a restart) is opened again once it is back.
async fn stream_deliveries(
    gateway: &GatewayChannel,
    subscription: &str,
    max_in_flight: u32,
    ack: bool,
    limit: Option<u64>,
) -> Result<(), String> {
    use std::io::Write;
    let mut subscriber = gateway.subscriber();
    let mut seen = 0;
    let mut reconnect_delay = Duration::from_millis(100);
    let mut announced_loss = false;
    while limit.is_none_or(|limit| seen < limit) {
        // With a limit, the stream takes no more than is left to print: one it leased
        // beyond would go back when tail ends, at the cost of an attempt.
        let max_deliveries = limit.map_or(0, |limit| u32::try_from(limit - seen).unwrap_or(0));
        let opened = subscriber
            .subscribe(proto::SubscribeRequest {
                subscription: subscription.to_owned(),
                max_in_flight,
                max_deliveries,
                ..Default::default()
            })
            .await;
        let mut stream = match opened {
            Ok(stream) => stream.into_inner(),
            Err(status) if gateway_went_away(&status) => {
                if !announced_loss {
                    eprintln!("outbox-gateway: lost the gateway; reconnecting");
                    announced_loss = true;
                }
                tokio::time::sleep(reconnect_delay).await;
                reconnect_delay = (reconnect_delay * 2).min(MAX_RECONNECT_DELAY);
                continue;
            }
            Err(status) => return Err(describe(status)),
        };
        if announced_loss {
            eprintln!("outbox-gateway: reconnected");
            announced_loss = false;
        }
        reconnect_delay = Duration::from_millis(100);
        while limit.is_none_or(|limit| seen < limit) {
            let delivery = match stream.message().await {
                Ok(Some(delivery)) => delivery,
                Ok(None) => return Ok(()),
                // The gateway stopped or the connection broke: open the stream again.
                Err(status) if gateway_went_away(&status) => break,
                Err(status) => return Err(describe(status)),
            };
            let mut stdout = std::io::stdout().lock();
            let written =
                writeln!(stdout, "{}", render::delivery(&delivery)).and_then(|()| stdout.flush());
            match written {
                Ok(()) => {}
                // The reader went away (`tail | head -1`): a normal end, not an error.
                Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
                Err(error) => return Err(format!("cannot write to standard output: {error}")),
            }
            drop(stdout);
            seen += 1;
            if ack {
                let acked = subscriber
                    .ack(proto::AckRequest {
                        subscription: subscription.to_owned(),
                        ack_ids: vec![delivery.ack_id],
                    })
                    .await;
                match acked {
                    Ok(_) => {}
                    // Not applied: the delivery comes again once the gateway is back.
                    Err(status) if gateway_went_away(&status) => break,
                    Err(status) => return Err(describe(status)),
                }
            }
        }
    }
    Ok(())
}

/// After the first delivery, how long `pull` waits for more before it settles.
const PULL_LINGER: Duration = Duration::from_millis(300);

/// Takes up to `--max` deliveries on a stream of its own, prints them and settles them
/// before the stream closes (closing it gives unsettled deliveries back at once).
async fn pull(target: &Target, args: PullArgs) -> Result<(), CliError> {
    if args.reason.is_some() && !(args.nack || args.dead_letter) {
        return Err(usage("--reason goes with --nack or --dead-letter"));
    }
    let gateway = target.connect(false).await?;
    if let Some(paused) = pause_notice(&gateway, &args.subscription).await {
        return Err(CliError::Failed(paused));
    }
    let mut subscriber = gateway.subscriber();
    let mut stream = subscriber
        .subscribe(proto::SubscribeRequest {
            subscription: args.subscription.clone(),
            max_in_flight: args.max,
            // Settling frees room on the stream: without this it would lease more while
            // the acks are under way, then give them back on closing, each at the cost
            // of an attempt.
            max_deliveries: args.max,
            ..Default::default()
        })
        .await
        .map_err(describe)?
        .into_inner();
    let mut deliveries = Vec::new();
    let mut wait = args.wait;
    while deliveries.len() < args.max as usize {
        match tokio::time::timeout(wait, stream.message()).await {
            Ok(Ok(Some(delivery))) => deliveries.push(delivery),
            Ok(Ok(None)) | Err(_) => break,
            Ok(Err(status)) => return Err(describe(status).into()),
        }
        wait = PULL_LINGER;
    }
    let settlement = if args.ack {
        "acked"
    } else if args.dead_letter {
        "dead-lettered"
    } else if args.nack {
        "nacked"
    } else {
        "released"
    };
    let retry_after = args
        .retry_after
        .and_then(|delay| prost_types::Duration::try_from(delay).ok());
    if args.ack && !deliveries.is_empty() {
        let answer = subscriber
            .ack(proto::AckRequest {
                subscription: args.subscription.clone(),
                ack_ids: deliveries.iter().map(|d| d.ack_id.clone()).collect(),
            })
            .await
            .map_err(describe)?
            .into_inner();
        if !answer.stale_ack_ids.is_empty() || !answer.unavailable_ack_ids.is_empty() {
            return Err(CliError::Failed(format!(
                "{} not acked (lease lost or source unreachable): {}",
                count(
                    (answer.stale_ack_ids.len() + answer.unavailable_ack_ids.len()) as u64,
                    "delivery"
                ),
                [answer.stale_ack_ids, answer.unavailable_ack_ids]
                    .concat()
                    .join(", ")
            )));
        }
    }
    if args.nack || args.dead_letter {
        for delivery in &deliveries {
            subscriber
                .nack(proto::NackRequest {
                    subscription: args.subscription.clone(),
                    ack_id: delivery.ack_id.clone(),
                    reason: args.reason.clone().unwrap_or_default(),
                    retry_after,
                    dead_letter: args.dead_letter,
                })
                .await
                .map_err(describe)?;
        }
    }
    drop(stream);
    for delivery in &deliveries {
        let mut value = render::delivery(delivery);
        value["settled"] = json!(settlement);
        target.print(value, || {
            let event = delivery.event.clone().unwrap_or_default();
            println!(
                "{}  {}  {}/{}  attempt {}  {}  {}",
                event.id,
                event.event_type,
                event.aggregate_type,
                event.aggregate_id,
                delivery.attempt,
                settlement,
                String::from_utf8_lossy(&event.payload)
            );
        });
    }
    if deliveries.is_empty() && !target.json {
        eprintln!(
            "no deliveries within {}",
            humantime::format_duration(args.wait)
        );
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
        .map_err(|status| format!("health check failed: {}", describe(status)))?;
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
        /// Role of the token (publisher, subscriber, admin or viewer); repeatable.
        /// `pull` and `tail` need subscriber, the other client commands admin (or viewer
        /// for those that only read). [default: publisher and subscriber]
        #[arg(long = "role", value_enum)]
        roles: Vec<RoleArg>,
        /// Print JSON (token, name, sha256) instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print the SHA-256 of a token read from standard input.
    Hash {
        /// Print JSON ({"sha256": ...}) instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// A role `token generate` writes into the configuration snippet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RoleArg {
    Publisher,
    Subscriber,
    Admin,
    Viewer,
}

impl RoleArg {
    fn name(self) -> &'static str {
        match self {
            RoleArg::Publisher => "publisher",
            RoleArg::Subscriber => "subscriber",
            RoleArg::Admin => "admin",
            RoleArg::Viewer => "viewer",
        }
    }
}

pub fn token(command: TokenCommand) -> Result<(), String> {
    match command {
        TokenCommand::Generate { name, roles, json } => {
            let mut roles: Vec<&str> = if roles.is_empty() {
                vec!["publisher", "subscriber"]
            } else {
                roles.into_iter().map(RoleArg::name).collect()
            };
            roles = roles
                .iter()
                .enumerate()
                .filter(|(index, role)| !roles[..*index].contains(role))
                .map(|(_, role)| *role)
                .collect();
            let token: String = (0..32)
                .map(|_| format!("{:02x}", rand::random::<u8>()))
                .collect();
            let sha256 = outbox_domain::auth::token_digest(&token);
            if json {
                println!(
                    "{}",
                    json!({ "token": token, "name": name, "sha256": sha256, "roles": roles })
                );
                return Ok(());
            }
            println!("token:  {token}");
            println!();
            println!("[[tokens]]");
            println!("name = {name:?}");
            println!("sha256 = \"{sha256}\"");
            let roles: Vec<String> = roles.iter().map(|role| format!("{role:?}")).collect();
            println!("roles = [{}]", roles.join(", "));
        }
        TokenCommand::Hash { json } => {
            let mut token = String::new();
            std::io::stdin()
                .read_line(&mut token)
                .map_err(|error| format!("cannot read standard input: {error}"))?;
            let sha256 = outbox_domain::auth::token_digest(token.trim_end_matches(['\r', '\n']));
            if json {
                println!("{}", json!({ "sha256": sha256 }));
            } else {
                println!("{sha256}");
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_read_naturally() {
        assert_eq!(count(1, "dead letter"), "1 dead letter");
        assert_eq!(count(0, "dead letter"), "0 dead letters");
        assert_eq!(count(2, "delivery"), "2 deliveries");
        assert_eq!(count(1, "delivery"), "1 delivery");
    }

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
