//! The gRPC adapters: each handler converts the request into domain types, calls the
//! core and converts the answer back. Errors become statuses in exactly one place
//! ([`status_from`]); internal details are logged, never sent to clients.

mod admin;
mod auth;
mod convert;
mod deadline;
mod limits;
mod publisher;
mod subscriber;

pub use admin::AdminApi;
pub use auth::AuthLayer;
pub use deadline::RpcTimeoutLayer;
pub use limits::{
    HeaderLimitLayer, MAX_HEADER_LIST_BYTES, MAX_REQUEST_METADATA_BYTES, MessageLimitLayer,
};
pub use publisher::PublisherApi;
pub use subscriber::SubscriberApi;

use tonic::Status;

use crate::error::Error;

/// The one mapping from core errors (and the domain's refusals they wrap) to gRPC
/// statuses. No wildcard arm: a new error variant must be given its status here.
pub(crate) fn status_from(error: impl Into<Error>) -> Status {
    match error.into() {
        Error::InvalidArgument { field, message } => {
            Status::invalid_argument(bounded(format!("{field}: {message}")))
        }
        Error::NotFound(message) => Status::not_found(bounded(message)),
        Error::AlreadyExists(message) => Status::already_exists(bounded(message)),
        Error::FailedPrecondition(message) => Status::failed_precondition(bounded(message)),
        Error::Unauthenticated(message) => Status::unauthenticated(bounded(message)),
        Error::PermissionDenied(message) => Status::permission_denied(bounded(message)),
        Error::Unavailable(source) if source.is_pool_exhausted() => {
            tracing::debug!(error = %source, "no database connection free");
            Status::unavailable(
                "no database connection became free in time (the gateway is at its connection limit, or the database is slow to answer); retry later",
            )
        }
        Error::Unavailable(source) => {
            // The loss itself is logged once by the health monitor, not once per call.
            tracing::debug!(error = %source, "database unavailable");
            Status::unavailable("the database is unavailable; retry later")
        }
        // A gateway with one database names no source.
        Error::SourceUnavailable(source) if source.is_default() => {
            Status::unavailable("the database is unavailable; retry later")
        }
        Error::SourceUnavailable(source) => Status::unavailable(format!(
            "source {source:?} cannot be reached right now; retry later"
        )),
        Error::Overloaded(message) => Status::resource_exhausted(bounded(message)),
        Error::ShuttingDown => Status::unavailable("the gateway is shutting down; reconnect"),
        Error::Internal(source) => {
            tracing::error!(error = %source, "internal error");
            Status::internal("internal error")
        }
    }
}

/// Longest status message sent. Messages echo caller input (shortened where it is
/// quoted), and clients refuse metadata beyond a few kilobytes: this is the last guard.
const MAX_MESSAGE_BYTES: usize = 1024;

fn bounded(mut message: String) -> String {
    if message.len() > MAX_MESSAGE_BYTES {
        let mut cut = MAX_MESSAGE_BYTES;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
        message.push('…');
    }
    message
}
