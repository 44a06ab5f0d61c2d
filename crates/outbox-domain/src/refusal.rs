//! Why the domain refuses something, in terms a caller can act on. The core error wraps
//! it, so the domain needs nothing from the layers above or below it.

/// Result alias of the domain's checks.
pub type Result<T, E = Refusal> = std::result::Result<T, E>;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The input is malformed; `field` names the offending field (`events[3].event_type`).
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
    /// No valid credentials.
    #[error("{0}")]
    Unauthenticated(String),
    /// Valid credentials that do not allow this call.
    #[error("{0}")]
    PermissionDenied(String),
}

impl Refusal {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Refusal::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }
}
