//! `tail`: follow new events through an ephemeral subscription until interrupted.

use std::time::Duration;

use outbox_client::GatewayChannel;
use tonic::{Code, Status};

use outbox_client::proto;

use crate::{StopSignals, Target, describe, parse_position, pause_notice, render};

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

pub(crate) async fn tail(target: &Target, args: TailArgs) -> Result<(), String> {
    // Listening before the ephemeral subscription exists: a signal that arrived between
    // its creation and the first wait would otherwise end the process and leave it.
    let mut stop = StopSignals::install();
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
                    validate_only: false,
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
        () = stop.received() => Ok(()),
        // The reader went away while nothing was being written (`tail | head -1` with the
        // other deliveries in backoff): a normal end, as a failed write is.
        () = stdout_reader_gone() => Ok(()),
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

/// How often [`stdout_reader_gone`] looks at standard output: well within the second a
/// closed pipe must end tail in, at the cost of a few system calls a second.
const STDOUT_CHECK_INTERVAL: Duration = Duration::from_millis(200);

/// Resolves once standard output is a pipe (or socket, or terminal) whose other end is
/// gone, even while no delivery comes to write; never on a system where that cannot be
/// seen, and never when standard output is a file.
///
/// A write is what otherwise notices (EPIPE), and with every delivery in backoff or none
/// published the next write may be minutes away. So tail asks poll(2) without waiting,
/// every [`STDOUT_CHECK_INTERVAL`]: Linux reports a pipe without a reader as POLLERR, the
/// BSDs and macOS as POLLHUP, and a hung-up terminal as POLLHUP everywhere. POLLOUT is
/// asked for, and ignored, so that a system reporting a pipe's end only alongside an
/// event it was asked about reports it too. A look with a zero timeout from the runtime, rather than a thread
/// blocked in poll(2), needs no thread to end and no descriptor made non-blocking (that
/// would change the file description other processes share). Where poll(2) says
/// nothing, tail still ends at its next write.
async fn stdout_reader_gone() {
    #[cfg(unix)]
    {
        let mut checks = tokio::time::interval(STDOUT_CHECK_INTERVAL);
        checks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            checks.tick().await;
            match stdout_state() {
                StdoutState::Open => {}
                StdoutState::ReaderGone => return,
                // Not a descriptor poll(2) can watch: a failed write is the only sign.
                StdoutState::Unwatchable => break,
            }
        }
    }
    std::future::pending::<()>().await
}

#[cfg(unix)]
enum StdoutState {
    Open,
    ReaderGone,
    Unwatchable,
}

/// Standard output's state as a poll(2) that does not wait reports it.
#[cfg(unix)]
fn stdout_state() -> StdoutState {
    let mut descriptor = libc::pollfd {
        fd: libc::STDOUT_FILENO,
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: one valid pollfd, a count of 1, and a zero timeout; poll writes only
    // `revents`.
    let ready = unsafe { libc::poll(&mut descriptor, 1, 0) };
    if ready < 0 {
        return match std::io::Error::last_os_error().raw_os_error() {
            // A signal came first: look again at the next tick.
            Some(libc::EINTR) | Some(libc::EAGAIN) => StdoutState::Open,
            _ => StdoutState::Unwatchable,
        };
    }
    if descriptor.revents & libc::POLLNVAL != 0 {
        return StdoutState::Unwatchable;
    }
    if descriptor.revents & (libc::POLLERR | libc::POLLHUP) != 0 {
        return StdoutState::ReaderGone;
    }
    StdoutState::Open
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
