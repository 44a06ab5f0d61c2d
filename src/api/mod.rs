//! The gRPC adapters: each handler converts the request into domain types, calls the
//! core and converts the answer back. Errors become statuses in exactly one place
//! ([`status_from`]); internal details are logged, never sent to clients.

mod admin;
mod auth;
mod convert;
mod limits;
mod publisher;
mod subscriber;

pub use admin::AdminApi;
pub use auth::AuthLayer;
pub use limits::MessageLimitLayer;
pub use publisher::PublisherApi;
pub use subscriber::SubscriberApi;

use tonic::Status;

use crate::error::Error;

/// The one mapping from domain errors to gRPC statuses. No wildcard arm: a new error
/// variant must be given its status here.
pub(crate) fn status_from(error: Error) -> Status {
    match error {
        Error::InvalidArgument { field, message } => {
            Status::invalid_argument(format!("{field}: {message}"))
        }
        Error::NotFound(message) => Status::not_found(message),
        Error::AlreadyExists(message) => Status::already_exists(message),
        Error::FailedPrecondition(message) => Status::failed_precondition(message),
        Error::Unauthenticated(message) => Status::unauthenticated(message),
        Error::PermissionDenied(message) => Status::permission_denied(message),
        Error::Unavailable(source) => {
            tracing::warn!(error = %source, "database unavailable");
            Status::unavailable("the database is unavailable; retry later")
        }
        Error::Overloaded(message) => Status::resource_exhausted(message),
        Error::ShuttingDown => Status::unavailable("the gateway is shutting down; reconnect"),
        Error::Internal(source) => {
            tracing::error!(error = %source, "internal error");
            Status::internal("internal error")
        }
    }
}

impl From<Error> for Status {
    fn from(error: Error) -> Status {
        status_from(error)
    }
}
