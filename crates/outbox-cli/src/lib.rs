//! outbox-cli: the client-side subcommands of the `outbox-gateway` binary. They talk to
//! a running gateway over gRPC. Every command prints readable text, or JSON with
//! `--json`, and exits non-zero with one clear line on failure.
//!
//! # Layout
//! - Owns: the client commands' flags (clap) and what each does, one file per command
//!   (`subscriptions`, `apply` for `apply` and `export` over the [`manifest`] file,
//!   `dead_letters` for `dlq` (alias `dead-letters`), `events`, `requeue`, `stats`,
//!   `publish`, `tail`, `pull`, `sources`, `health`, `token`); the connection
//!   [`context`] profiles; how answers are rendered. This file keeps what they share:
//!   the target gateway and how a failure to reach it is explained, the errors, the
//!   flag parsers and the dispatch; `stop`, the signals that end a command running
//!   until interrupted.
//! - May depend on: `outbox-client` (the gRPC client and the generated API) and
//!   `outbox-domain` (token digests, status kinds). Never on the gateway's core, store or
//!   server: a client command works against any gateway, local or remote.

mod apply;
pub mod context;
mod dead_letters;
mod events;
mod health;
mod manifest;
mod publish;
mod pull;
mod render;
mod requeue;
mod sinks;
mod sources;
mod stats;
mod stop;
mod subscriptions;
mod tail;
mod token;

use std::{
    sync::atomic::{AtomicU8, Ordering},
    time::Duration,
};

use outbox_client::{ClientError, Connection, GatewayChannel};
use serde_json::Value;
use tonic::{Code, Status};

use outbox_client::proto;

pub use apply::{ApplyArgs, ExportArgs};
use apply::{apply, export};
use dead_letters::dead_letters;
pub use dead_letters::{DeadLetterCommand, DeadLetterSelector};
pub use events::EventCommand;
use events::events;
pub use health::health;
pub use publish::PublishArgs;
use publish::publish;
pub use pull::PullArgs;
use pull::pull;
pub use requeue::RequeueArgs;
use requeue::requeue;
use sinks::sinks;
use sources::sources;
use stats::stats;
use stop::StopSignals;
use subscriptions::subscriptions;
pub use subscriptions::{
    ClearArgs, PushArgs, PushFormatArg, SubscriptionCommand, SubscriptionSettingsArgs,
};
pub use tail::TailArgs;
use tail::tail;
pub use token::{RoleArg, TokenCommand, token};

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
    /// The input is invalid: the command line, a file it reads, or settings the gateway
    /// refuses as invalid (exit code 2, as for the usage errors clap finds).
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

/// A call the gateway refused, as the command's error: input it finds invalid is a
/// usage error (exit code 2), as a bad flag is; anything else is a failure (1).
fn refused(status: Status) -> CliError {
    match status.code() {
        Code::InvalidArgument | Code::OutOfRange => CliError::Usage(describe(status)),
        _ => CliError::Failed(describe(status)),
    }
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
    /// Make the subscriptions what a YAML file says: create, change and (with --prune)
    /// delete, printing each change.
    Apply {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        args: ApplyArgs,
    },
    /// Write the subscriptions as a file `apply` reads.
    Export {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        args: ExportArgs,
    },
    /// Create, list, show, change, pause, resume, delete or seek subscriptions.
    Subscriptions {
        #[command(flatten)]
        target: Target,
        // Boxed: its settings make it far larger than the other commands.
        #[command(subcommand)]
        command: Box<SubscriptionCommand>,
    },
    /// List, summarize, requeue or resolve a subscription's dead letters.
    // `dead-letters` is the console's word for them.
    #[command(visible_alias = "dead-letters")]
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
        /// Refresh the table until interrupted (Ctrl-C or SIGTERM).
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
    /// List the brokers sink subscriptions can publish into (`[[sinks]]` of the
    /// gateway's configuration) and whether each is reachable.
    Sinks {
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
        ClientCommand::Apply { target, .. }
        | ClientCommand::Export { target, .. }
        | ClientCommand::Subscriptions { target, .. }
        | ClientCommand::Dlq { target, .. }
        | ClientCommand::Events { target, .. }
        | ClientCommand::Requeue { target, .. }
        | ClientCommand::Stats { target, .. }
        | ClientCommand::Publish { target, .. }
        | ClientCommand::Tail { target, .. }
        | ClientCommand::Sources { target }
        | ClientCommand::Sinks { target }
        | ClientCommand::Pull { target, .. }
        | ClientCommand::Health { target } => target.clone(),
    };
    let result = match command {
        ClientCommand::Apply { target, args } => apply(&target, args).await,
        ClientCommand::Export { target, args } => export(&target, args).await,
        ClientCommand::Subscriptions { target, command } => subscriptions(&target, *command).await,
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
        ClientCommand::Sinks { target } => sinks(&target).await.map_err(CliError::from),
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
}
