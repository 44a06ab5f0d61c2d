//! The one error type of the client.

use std::path::PathBuf;

use tonic::Status;

/// Why a client call, or setting up a connection, failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The endpoint is not a valid URI.
    #[error("invalid endpoint {endpoint:?}: {reason}")]
    InvalidEndpoint {
        /// The endpoint as given.
        endpoint: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The bearer token cannot be sent as gRPC metadata.
    #[error("the token must be printable ASCII")]
    InvalidToken,
    /// A TLS file (CA certificate, client certificate or key) cannot be read.
    #[error("cannot read {}: {source}", path.display())]
    ReadFile {
        /// The file.
        path: PathBuf,
        /// Why it cannot be read.
        source: std::io::Error,
    },
    /// The TLS settings were rejected.
    #[error("invalid TLS settings: {0}")]
    Tls(#[source] tonic::transport::Error),
    /// The gateway could not be reached (eager connections only).
    #[error("cannot reach the gateway at {endpoint}: {source}")]
    Connect {
        /// The endpoint tried.
        endpoint: String,
        /// The transport's error.
        source: tonic::transport::Error,
    },
    /// The gateway refused the call; retrying the same call will not help.
    #[error("the gateway refused the call: {0}")]
    Refused(Status),
    /// Still failing after the retries the caller allowed.
    #[error("the gateway stayed unavailable: {0}")]
    Unavailable(Status),
}
