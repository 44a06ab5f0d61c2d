//! The console's handlers, one file per page with its actions: each checks the session
//! (and, for an action, its CSRF token and the admin role), parses the query or form into
//! domain values, calls the core and renders a page or redirects to one. This file keeps
//! what they share: the page frame, the audit record, the checks of an action's origin
//! and role, and where a sign-in may return to.

mod asset;
mod event;
mod overview;
mod sign_in;
mod subscription;

use axum::{
    http::{HeaderMap, HeaderValue},
    response::Response,
};
use url::{Position, Url};

use super::{
    Console, ConsoleError,
    params::Params,
    session::{Notice, Session},
    views::Frame,
};
use crate::{
    audit::{self, Selector, Via},
    error::Error,
};

pub use asset::asset;
pub use event::{event, find_event, requeue_event};
pub use overview::overview;
pub use sign_in::{sign_in, sign_in_page, sign_out};
pub use subscription::{dead_letter_action, pause, resume, seek, subscription};

type Page = Result<Response, ConsoleError>;

impl Console {
    fn frame(&self, session: &Session) -> Frame {
        Frame {
            user: session.principal.name.clone(),
            admin: session.principal.is_admin(),
            signed_in: self.inner.authenticator.is_some(),
            csrf: session.csrf.clone(),
            notice: self.inner.sessions.take_notice(session),
        }
    }

    /// Shows `text` on the next page of this session.
    fn notify(&self, session: &Session, text: String) {
        self.inner.sessions.set_notice(
            session,
            Notice {
                success: true,
                text,
            },
        );
    }
}

fn plural(count: u64) -> &'static str {
    if count == 1 { "" } else { "s" }
}

pub async fn not_found() -> ConsoleError {
    ConsoleError::NoPage
}

/// The audit line of a change made in the console.
fn record(
    session: &Session,
    action: &str,
    subscription: audit::Target<'_>,
    selector: &Selector,
    changed: u64,
) {
    let who = session.principal.name.as_str();
    audit::record(who, Via::Console, action, subscription, selector, changed);
}

/// An action needs the session's CSRF token, a request from the console's own pages and
/// the admin role.
fn authorize_action(
    session: &Session,
    headers: &HeaderMap,
    form: &Params,
) -> Result<(), ConsoleError> {
    same_origin(headers)?;
    session.check_csrf(form.get("csrf"))?;
    session.principal.check_admin()?;
    Ok(())
}

/// Refuses a form that the browser says another site sent: by its Sec-Fetch-Site header
/// where it sends one, else by its Origin. (The CSRF token is the main defence; this one
/// also covers the sign-in form, which has no session yet.)
fn same_origin(headers: &HeaderMap) -> Result<(), ConsoleError> {
    let header = |name| {
        headers
            .get(name)
            .and_then(|value: &HeaderValue| value.to_str().ok())
    };
    if let Some(site) = header("sec-fetch-site") {
        return match site {
            "same-origin" | "none" => Ok(()),
            _ => Err(ConsoleError::Forgery),
        };
    }
    if let (Some(origin), Some(host)) = (header("origin"), header("host"))
        && origin != "null"
        && origin.split_once("://").map_or(origin, |(_, rest)| rest) != host
    {
        return Err(ConsoleError::Forgery);
    }
    Ok(())
}

/// A path on this console to return to after signing in; anything else is the overview.
/// Only a path that a browser reads exactly as written qualifies: browsers drop tabs and
/// newlines from a Location and read `\\` as `/`, so `/\t/evil.example` or
/// `/\\evil.example` would leave for another host, and a path the URL parser rewrites
/// (dot segments, characters it percent-encodes) is not what was checked. What comes back
/// is therefore already percent-encoded and safe as a Location. Control characters are
/// refused outright: no link of the console carries them.
fn local_path(next: Option<&str>) -> Result<String, ConsoleError> {
    let Some(next) = next else {
        return Ok("/".to_owned());
    };
    if next.chars().any(char::is_control) {
        return Err(Error::invalid(
            "next",
            "must not contain control characters (it is the console path to return to after signing in)",
        )
        .into());
    }
    Ok(same_origin_path(next).unwrap_or_else(|| "/".to_owned()))
}

/// `next` when it is a path and query of this console that parses to itself.
fn same_origin_path(next: &str) -> Option<String> {
    if !next.starts_with('/')
        || next.starts_with("//")
        || next.contains('\\')
        || next.chars().any(char::is_whitespace)
    {
        return None;
    }
    // Any origin will do: only whether the reference stays on it matters.
    let origin = Url::parse("http://console.invalid/").ok()?;
    let parsed = origin.join(next).ok()?;
    let path = &parsed[Position::BeforePath..];
    (parsed.origin() == origin.origin() && path == next && !path.starts_with("//"))
        .then(|| path.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_in_returns_only_to_paths_that_parse_to_themselves() {
        for local in [
            "/",
            "/subscriptions/orders?x=1",
            "/subscriptions/orders?error=card%20declined&tz=Europe%2FParis",
            "/events/0190b5e5-0000-7000-8000-000000000000?source=billing",
            "/%09/evil.example/",
        ] {
            assert_eq!(local_path(Some(local)).unwrap(), local);
        }
        for foreign in [
            "//evil.example",
            "https://evil.example",
            "/\\evil",
            "\\/evil",
            "x",
            "",
            "/..//evil.example",
            "/.//evil.example",
            "/%2e%2e//evil.example",
            "/ /evil.example",
            "/\u{a0}/evil.example",
            "/\u{3000}/evil.example",
            "/ordérs",
            "/events?q=\"<x>\"",
            "/a/../b",
        ] {
            assert_eq!(local_path(Some(foreign)).unwrap(), "/", "{foreign:?}");
        }
        assert_eq!(local_path(None).unwrap(), "/");
    }

    #[test]
    fn control_characters_in_next_are_refused_naming_the_field() {
        for control in ['\t', '\r', '\n', '\0', '\x01', '\x1b', '\x7f', '\u{85}'] {
            let next = format!("/{control}/evil.example/");
            match local_path(Some(&next)) {
                Err(ConsoleError::Domain(Error::InvalidArgument { field, message })) => {
                    assert_eq!(field, "next");
                    assert!(message.contains("control characters"), "{message}");
                }
                other => panic!("{next:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn forms_from_other_sites_are_refused() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut headers = HeaderMap::new();
            for (name, value) in pairs {
                headers.insert(*name, HeaderValue::from_static(value));
            }
            headers
        };
        assert!(same_origin(&headers(&[("host", "127.0.0.1:9465")])).is_ok());
        assert!(
            same_origin(&headers(&[
                ("host", "127.0.0.1:9465"),
                ("origin", "http://127.0.0.1:9465")
            ]))
            .is_ok()
        );
        assert!(
            same_origin(&headers(&[
                ("host", "127.0.0.1:9465"),
                ("origin", "http://evil.example")
            ]))
            .is_err()
        );
        assert!(same_origin(&headers(&[("sec-fetch-site", "cross-site")])).is_err());
    }
}
