//! The web console: server-rendered pages over the same core operations the Admin RPCs
//! call — stats, dead letters, events — and the forms that requeue, resolve and seek.
//! Like `api`, it only translates (HTTP forms and pages to domain values and back),
//! checks who may do what and maps errors, in [`ConsoleError`]'s one exhaustive mapping.
//!
//! Security as strict as gRPC: with tokens configured, signing in takes a token with the
//! admin or viewer role (viewers see but change nothing); the session is an HttpOnly,
//! SameSite=Strict cookie (Secure under TLS) that expires; every action is a POST
//! carrying the session's CSRF token. Without tokens it answers only to names that DNS
//! cannot rebind ([`hosts`]). Every asset is embedded, a strict content-security policy
//! allows no inline script or style, and under TLS browsers are told to keep to it (HSTS).
//!
//! - [`hosts`]: the names a token-less console answers to.
//! - [`session`]: sessions, cookies and CSRF tokens.
//! - [`params`]: query strings and forms parsed into domain values.
//! - [`pages`]: the handlers.
//! - [`views`]: the HTML.
//! - [`tls`]: TLS with the gRPC server's files.

mod hosts;
mod pages;
mod params;
mod session;
pub mod tls;
mod views;

use std::{sync::Arc, time::Duration};

use axum::{
    Router,
    extract::{Request, State},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    middleware::{Next, from_fn_with_state, map_response_with_state},
    response::{IntoResponse, Redirect, Response},
    routing::{get, post},
};
use tokio::net::TcpListener;
use tokio_rustls::rustls::ServerConfig;
use tokio_util::sync::CancellationToken;

use crate::{
    auth::{Authenticator, Principal},
    delivery::Relay,
    domain::AllowedHosts,
    error::Error,
    operations::Operations,
    rates::DeliveryRates,
    subscriptions::Subscriptions,
};
pub use session::{Session, SessionState, Sessions};

/// Allows the console's own scripts, styles and images and nothing else: no inline
/// script or style, no framing, forms only to itself.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     img-src 'self'; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; \
     base-uri 'none'";

/// Under TLS: browsers that have seen the console once reach it only over TLS for a year
/// (no plain-HTTP first request a network attacker could answer).
const STRICT_TRANSPORT_SECURITY: &str = "max-age=31536000";

/// What the console's handlers share; cheap to clone.
#[derive(Clone)]
pub struct Console {
    inner: Arc<ConsoleInner>,
}

struct ConsoleInner {
    subscriptions: Subscriptions,
    operations: Operations,
    relay: Relay,
    rates: DeliveryRates,
    sessions: Sessions,
    /// `None`: authentication is off, and every browser gets an anonymous admin session.
    authenticator: Option<Authenticator>,
    /// Names besides loopback names and addresses that the console answers to without
    /// authentication.
    allowed_hosts: AllowedHosts,
}

impl Console {
    pub fn new(
        subscriptions: Subscriptions,
        operations: Operations,
        relay: Relay,
        rates: DeliveryRates,
        sessions: Sessions,
        authenticator: Option<Authenticator>,
        allowed_hosts: AllowedHosts,
    ) -> Console {
        Console {
            inner: Arc::new(ConsoleInner {
                subscriptions,
                operations,
                relay,
                rates,
                sessions,
                authenticator,
                allowed_hosts,
            }),
        }
    }

    /// Every page, action and asset; `tls` when the console is served over TLS.
    pub fn router(self, tls: bool) -> Router {
        Router::new()
            .route("/", get(pages::overview))
            .route("/sign-in", get(pages::sign_in_page).post(pages::sign_in))
            .route("/sign-out", post(pages::sign_out))
            .route("/subscriptions/{name}", get(pages::subscription))
            .route(
                "/subscriptions/{name}/dead-letters",
                post(pages::dead_letter_action),
            )
            .route("/subscriptions/{name}/seek", post(pages::seek))
            .route("/subscriptions/{name}/pause", post(pages::pause))
            .route("/subscriptions/{name}/resume", post(pages::resume))
            .route("/events", get(pages::find_event))
            .route("/events/{id}", get(pages::event))
            .route("/events/{id}/requeue", post(pages::requeue_event))
            .route("/assets/{file}", get(pages::asset))
            .fallback(pages::not_found)
            .layer(from_fn_with_state(self.clone(), find_session))
            .layer(from_fn_with_state(self.clone(), check_host))
            .layer(map_response_with_state(tls, security_headers))
            .with_state(self)
    }
}

/// Serves the console on `listener` (with TLS when `tls` is given) until `shutdown`, then
/// lets running requests finish for at most `grace`.
pub async fn serve(
    console: Console,
    listener: TcpListener,
    tls: Option<Arc<ServerConfig>>,
    shutdown: CancellationToken,
    grace: Duration,
) -> std::io::Result<()> {
    let address = listener.local_addr()?;
    let router = console.router(tls.is_some());
    tracing::info!(%address, tls = tls.is_some(), "serving the web console");
    match tls {
        None => {
            let serving = axum::serve(listener, router.into_make_service())
                .with_graceful_shutdown(shutdown.clone().cancelled_owned());
            within_grace(serving.into_future(), shutdown, grace).await
        }
        Some(config) => {
            let serving = axum::serve(
                tls::TlsListener::new(listener, config)?,
                router.into_make_service(),
            )
            .with_graceful_shutdown(shutdown.clone().cancelled_owned());
            within_grace(serving.into_future(), shutdown, grace).await
        }
    }
}

/// Runs `serving` until it ends, or until `grace` after `shutdown`: requests still
/// running then are cut.
async fn within_grace(
    serving: impl Future<Output = std::io::Result<()>>,
    shutdown: CancellationToken,
    grace: Duration,
) -> std::io::Result<()> {
    let mut serving = std::pin::pin!(serving);
    tokio::select! {
        result = &mut serving => return result,
        _ = shutdown.cancelled() => {}
    }
    match tokio::time::timeout(grace, serving).await {
        Ok(result) => result,
        Err(_) => {
            tracing::warn!(
                ?grace,
                "console requests still running after the grace period were cut"
            );
            Ok(())
        }
    }
}

/// Without authentication, refuses a request for a name a DNS server could have pointed
/// at the console (see [`hosts`]), before any session is made for it. Both the request's
/// authority (absolute-form) and its Host header must pass. With or without it, a
/// request with more than one Host header is refused, as RFC 9112 (3.2) requires: which
/// one counts is ambiguous, and a proxy in front may have checked another than ours.
async fn check_host(State(console): State<Console>, request: Request, next: Next) -> Response {
    if request
        .headers()
        .get_all(header::HOST)
        .iter()
        .nth(1)
        .is_some()
    {
        tracing::info!("refused a console request with more than one host header");
        return ConsoleError::SeveralHosts.into_response();
    }
    if console.inner.authenticator.is_some() {
        // Tokens guard it: a rebound page has no token to sign in with.
        return next.run(request).await;
    }
    let host_header = request
        .headers()
        .get(header::HOST)
        .map(|value| String::from_utf8_lossy(value.as_bytes()).into_owned());
    let authority = request
        .uri()
        .authority()
        .map(|authority| authority.to_string());
    let named: Vec<String> = authority.into_iter().chain(host_header).collect();
    let allowed = &console.inner.allowed_hosts;
    let refused = if named.is_empty() {
        Some("(no Host header)".to_owned())
    } else {
        named
            .iter()
            .find(|name| !hosts::is_allowed(name, allowed))
            .map(|name| hosts::host_of(name).unwrap_or_else(|| name.clone()))
    };
    if let Some(host) = refused {
        tracing::info!(%host, "refused a console request for a host name it does not answer without tokens");
        return ConsoleError::UnknownHost(host).into_response();
    }
    next.run(request).await
}

/// Puts the [`SessionState`] the request's cookie names into its extensions. Without
/// authentication a browser without a session gets an anonymous one, so that its forms
/// carry a CSRF token too; a request that is refused or fails leaves none behind.
async fn find_session(
    State(console): State<Console>,
    mut request: Request,
    next: Next,
) -> Response {
    let sessions = &console.inner.sessions;
    let cookie_header = request
        .headers()
        .get(header::COOKIE)
        .and_then(|value| value.to_str().ok());
    let mut new_session = None;
    let state = match sessions.find(cookie_header) {
        SessionState::Active(session) => SessionState::Active(session),
        ended_or_missing => {
            if console.inner.authenticator.is_none() {
                let (session, cookie) = sessions.create(Principal::anonymous());
                new_session = Some((session.clone(), cookie));
                SessionState::Active(Box::new(session))
            } else {
                ended_or_missing
            }
        }
    };
    request.extensions_mut().insert(state);
    let mut response = next.run(request).await;
    if let Some((session, cookie)) = new_session {
        let status = response.status();
        if status.is_client_error() || status.is_server_error() {
            sessions.remove(&session);
        } else if let Ok(cookie) = HeaderValue::from_str(&cookie) {
            response.headers_mut().append(header::SET_COOKIE, cookie);
        }
    }
    response
}

async fn security_headers(State(tls): State<bool>, mut response: Response) -> Response {
    add_security_headers(response.headers_mut(), tls);
    response
}

/// The headers every answer carries; `tls` when the console is served over TLS.
fn add_security_headers(headers: &mut HeaderMap, tls: bool) {
    if tls {
        headers.insert(
            header::STRICT_TRANSPORT_SECURITY,
            HeaderValue::from_static(STRICT_TRANSPORT_SECURITY),
        );
    }
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::REFERRER_POLICY,
        // Not no-referrer: with it, browsers send `Origin: null` on the console's own forms.
        HeaderValue::from_static("same-origin"),
    );
    headers
        .entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
}

/// Why a page or action was not served.
#[derive(Debug)]
pub enum ConsoleError {
    /// What the core refused or failed at.
    Domain(Error),
    /// No session: a page sends the browser to sign in and back to `return_to`; an
    /// action (no `return_to`) is refused. `ended` when the cookie named a session that
    /// expired.
    SignIn {
        ended: bool,
        return_to: Option<String>,
    },
    /// An action without this session's CSRF token, or from another site.
    Forgery,
    /// No such page.
    NoPage,
    /// Without tokens, a request for a host name (this one) that is neither a loopback
    /// name, an address nor listed in `console_allowed_hosts`.
    UnknownHost(String),
    /// A request with more than one Host header.
    SeveralHosts,
}

impl From<crate::domain::Refusal> for ConsoleError {
    fn from(refusal: crate::domain::Refusal) -> Self {
        ConsoleError::Domain(refusal.into())
    }
}

impl From<Error> for ConsoleError {
    fn from(error: Error) -> Self {
        ConsoleError::Domain(error)
    }
}

/// The one mapping from errors to HTTP answers. No wildcard arm: a new domain error must
/// be given its status here.
impl IntoResponse for ConsoleError {
    fn into_response(self) -> Response {
        let (status, title, message) = match self {
            ConsoleError::SignIn {
                ended,
                return_to: Some(return_to),
            } => {
                let mut target = format!("/sign-in?next={}", encode(&return_to));
                if ended {
                    target.push_str("&ended=1");
                }
                return Redirect::to(&target).into_response();
            }
            ConsoleError::SignIn {
                ended,
                return_to: None,
            } => (
                StatusCode::UNAUTHORIZED,
                "Sign in first",
                if ended {
                    "Your session has ended; sign in again. Nothing was changed."
                } else {
                    "Sign in to use the console. Nothing was changed."
                }
                .to_owned(),
            ),
            ConsoleError::Forgery => (
                StatusCode::FORBIDDEN,
                "Form expired",
                "This form does not carry your session's token (it is from an older session or from another site). Reload the page and try again. Nothing was changed.".to_owned(),
            ),
            ConsoleError::UnknownHost(host) => (
                StatusCode::MISDIRECTED_REQUEST,
                "Unknown host name",
                format!(
                    "This console has no tokens configured, so it answers only to localhost, *.localhost and IP addresses: a page of another site could otherwise reach it through a name its DNS points at this machine (DNS rebinding). To open it as {host:?}, add that name to --console-allowed-hosts (OUTBOX_CONSOLE_ALLOWED_HOSTS, or console_allowed_hosts in the configuration file), or configure [[tokens]]. Nothing was changed."
                ),
            ),
            ConsoleError::SeveralHosts => (
                StatusCode::BAD_REQUEST,
                "Bad request",
                "The request has more than one Host header. Nothing was changed.".to_owned(),
            ),
            ConsoleError::NoPage => (
                StatusCode::NOT_FOUND,
                "Not found",
                "The console has no such page. Nothing was changed.".to_owned(),
            ),
            ConsoleError::Domain(error) => match error {
                Error::InvalidArgument { field, message } => (
                    StatusCode::BAD_REQUEST,
                    "Invalid input",
                    format!("{field}: {message}. Nothing was changed."),
                ),
                Error::NotFound(message) => (
                    StatusCode::NOT_FOUND,
                    "Not found",
                    format!("{message}. Nothing was changed."),
                ),
                Error::AlreadyExists(message) => (
                    StatusCode::CONFLICT,
                    "Already exists",
                    format!("{message}. Nothing was changed."),
                ),
                Error::FailedPrecondition(message) => (
                    StatusCode::CONFLICT,
                    "Not possible now",
                    format!("{message}. Nothing was changed."),
                ),
                Error::Unauthenticated(message) => {
                    (StatusCode::UNAUTHORIZED, "Sign-in refused", message)
                }
                Error::PermissionDenied(message) => (
                    StatusCode::FORBIDDEN,
                    "No permission",
                    format!("{message}. Nothing was changed."),
                ),
                Error::Unavailable(source) => {
                    tracing::warn!(error = %source, "database unavailable");
                    (
                        StatusCode::SERVICE_UNAVAILABLE,
                        "Database unreachable",
                        "The gateway cannot reach its database right now. This page retries by itself; delivery resumes once the database is back.".to_owned(),
                    )
                }
                Error::SourceUnavailable(source) => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "Source unreachable",
                    format!("The gateway cannot reach source {source} right now. This page retries by itself; nothing was changed."),
                ),
                Error::Overloaded(message) => {
                    (StatusCode::SERVICE_UNAVAILABLE, "Overloaded", message)
                }
                Error::ShuttingDown => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "Shutting down",
                    "The gateway is shutting down.".to_owned(),
                ),
                Error::Internal(source) => {
                    tracing::error!(error = %source, "internal error");
                    (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "Internal error",
                        "Something went wrong inside the gateway; its log has the details."
                            .to_owned(),
                    )
                }
            },
        };
        (status, views::error_page(status, title, &message)).into_response()
    }
}

/// Percent-encodes a query value.
fn encode(value: &str) -> String {
    form_urlencoded::byte_serialize(value.as_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_console_served_over_tls_asks_for_hsts() {
        let mut plain = HeaderMap::new();
        add_security_headers(&mut plain, false);
        assert!(!plain.contains_key(header::STRICT_TRANSPORT_SECURITY));
        assert!(plain.contains_key(header::CONTENT_SECURITY_POLICY));
        let mut tls = HeaderMap::new();
        add_security_headers(&mut tls, true);
        assert_eq!(tls[header::STRICT_TRANSPORT_SECURITY], "max-age=31536000");
        assert!(tls.contains_key(header::CONTENT_SECURITY_POLICY));
    }
}
