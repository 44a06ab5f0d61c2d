//! Which failures are worth retrying, and the one backoff policy of the client: it
//! serves the publisher's retries and the subscriber's reconnects.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use tonic::{Code, Status};

const FIRST_DELAY: Duration = Duration::from_millis(100);
const MAX_DELAY: Duration = Duration::from_secs(10);

/// Calls worth retrying: the gateway or its database may come back. A connection cut
/// mid-call surfaces as UNKNOWN or CANCELLED too, and a stream reset by a gateway that
/// shuts down as INTERNAL "h2 protocol error" (the gateway's own internal errors never
/// say that).
pub(crate) fn is_transient(status: &Status) -> bool {
    match status.code() {
        Code::Unavailable
        | Code::ResourceExhausted
        | Code::DeadlineExceeded
        | Code::Aborted
        | Code::Unknown
        | Code::Cancelled => true,
        Code::Internal => status.message().contains("h2 protocol error"),
        _ => false,
    }
}

/// Delays doubling from 100 ms to at most 10 s; `retries` of them, or without end.
pub(crate) fn backoff(retries: Option<usize>) -> ExponentialBuilder {
    let builder = ExponentialBuilder::new()
        .with_factor(2.0)
        .with_min_delay(FIRST_DELAY)
        .with_max_delay(MAX_DELAY);
    match retries {
        Some(retries) => builder.with_max_times(retries),
        None => builder.without_max_times(),
    }
}

/// The delays between reconnects; starts over once a connection has worked.
pub(crate) struct Reconnect(ExponentialBackoff);

impl Reconnect {
    pub(crate) fn new() -> Self {
        Reconnect(backoff(None).build())
    }

    /// How long to wait before the next attempt.
    pub(crate) fn next_delay(&mut self) -> Duration {
        self.0.next().unwrap_or(MAX_DELAY)
    }

    /// The connection worked: the next failure waits the shortest delay again.
    pub(crate) fn reset(&mut self) {
        *self = Reconnect::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconnect_delays_double_up_to_the_cap_and_start_over_after_a_reset() {
        let mut reconnect = Reconnect::new();
        // Whole milliseconds: the factor is an f32, so the products are a hair off.
        let delays: Vec<u128> = (0..9).map(|_| reconnect.next_delay().as_millis()).collect();
        assert_eq!(
            delays,
            [100, 200, 400, 800, 1600, 3200, 6400, 10_000, 10_000]
        );
        reconnect.reset();
        assert_eq!(reconnect.next_delay(), FIRST_DELAY);
    }

    #[test]
    fn only_failures_that_may_pass_are_transient() {
        assert!(is_transient(&Status::unavailable("down")));
        assert!(is_transient(&Status::cancelled("cut")));
        assert!(is_transient(&Status::internal(
            "h2 protocol error: http2 error"
        )));
        assert!(!is_transient(&Status::internal("internal error")));
        assert!(!is_transient(&Status::invalid_argument("bad")));
        assert!(!is_transient(&Status::permission_denied("no")));
    }
}
