//! The core error: what can go wrong in publishing, subscriptions and delivery, in
//! terms a client can act on. It wraps the domain's refusals and the store's errors;
//! `api` maps each variant to one gRPC status code.

use crate::{
    domain::{Refusal, SubscriptionName},
    storage::StoreError,
};

/// Result alias of the core.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request is malformed; `field` names the offending field (`events[3].event_type`).
    #[error("{field}: {message}")]
    InvalidArgument { field: String, message: String },
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    /// No valid credentials.
    #[error("{0}")]
    Unauthenticated(String),
    /// Valid credentials that do not allow this call.
    #[error("{0}")]
    PermissionDenied(String),
    /// The database cannot be reached; the client may retry.
    #[error("database unavailable")]
    Unavailable(#[source] StoreError),
    /// A source database the call needs cannot be reached; the client may retry.
    #[error("source {0} is unavailable")]
    SourceUnavailable(crate::domain::SourceName),
    /// Too much work is waiting; the client should retry shortly.
    #[error("{0}")]
    Overloaded(String),
    /// The gateway is stopping; the client should reconnect (to another instance).
    #[error("the gateway is shutting down")]
    ShuttingDown,
    /// A bug or an unexpected database answer. Logged in full, shown to clients as
    /// generic text.
    #[error("internal error")]
    Internal(#[source] StoreError),
}

impl Error {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::InvalidArgument {
            field: field.into(),
            message: message.into(),
        }
    }

    pub fn subscription_not_found(name: &SubscriptionName) -> Self {
        Error::NotFound(format!("subscription {name:?} does not exist"))
    }
}

/// The domain's refusals keep their meaning (and their field) in the core error.
impl From<Refusal> for Error {
    fn from(refusal: Refusal) -> Self {
        match refusal {
            Refusal::Invalid { field, message } => Error::InvalidArgument { field, message },
            Refusal::Unauthenticated(message) => Error::Unauthenticated(message),
            Refusal::PermissionDenied(message) => Error::PermissionDenied(message),
        }
    }
}

impl From<StoreError> for Error {
    fn from(error: StoreError) -> Self {
        if error.is_unavailable() {
            Error::Unavailable(error)
        } else {
            Error::Internal(error)
        }
    }
}
