//! How the pushers send a request: through a [`PushSender`] the gateway provides (its
//! HTTP client), so the core carries no HTTP stack, and what comes back.

use std::time::Duration;

use futures_util::future::BoxFuture;
use url::Url;

use super::request::PushRequest;

/// Sends one push request and reads the start of the answer, all within `timeout`.
/// Redirects are answers like any other: never followed.
pub trait PushSender: Send + Sync + 'static {
    fn send<'a>(
        &'a self,
        endpoint: &'a Url,
        request: PushRequest,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Answer, Failure>>;
}

/// An endpoint's answer.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    /// `Retry-After` in seconds or as an HTTP date, when given.
    pub retry_after: Option<Duration>,
    /// The start of the body.
    pub body: Vec<u8>,
}

/// A request that got no answer.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("cannot connect: {0}")]
    Connect(String),
    #[error("request failed: {0}")]
    Other(String),
}

impl Failure {
    /// The `code` label of the request counter.
    pub fn code(&self) -> &'static str {
        match self {
            Failure::Timeout(_) => "timeout",
            Failure::Connect(_) => "connect_error",
            Failure::Other(_) => "error",
        }
    }
}
