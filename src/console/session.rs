//! Console sessions: signing in with a token, an HttpOnly, SameSite=Strict cookie (Secure
//! under TLS) naming a session kept in this process's memory until it expires, and the
//! per-session token every action must carry against cross-site request forgery.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::{extract::FromRequestParts, http::request::Parts};
use cookie::{Cookie, SameSite};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::ConsoleError;
use crate::auth::Principal;

/// The session cookie's name.
pub const COOKIE: &str = "outbox_console_session";
/// Most sessions kept at once; past it the one closest to expiry goes first.
const MAX_SESSIONS: usize = 10_000;

/// Every session of this process; cheap to clone.
#[derive(Clone)]
pub struct Sessions {
    records: Arc<Mutex<HashMap<[u8; 32], Record>>>,
    ttl: Duration,
    /// Cookies carry the Secure attribute (the console speaks TLS).
    secure: bool,
}

struct Record {
    principal: Principal,
    csrf: String,
    expires_at: Instant,
    /// What the last action did, shown once on the next page.
    notice: Option<Notice>,
}

/// A signed-in browser, as a request sees it.
#[derive(Debug, Clone)]
pub struct Session {
    /// SHA-256 of the cookie value: the key, so the value itself is never stored.
    key: [u8; 32],
    pub principal: Principal,
    /// The token forms carry back.
    pub csrf: String,
}

/// The outcome of an action, shown on the page it leads to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    pub success: bool,
    pub text: String,
}

/// What a request's cookie says.
#[derive(Debug, Clone)]
pub enum SessionState {
    Active(Box<Session>),
    /// A cookie naming a session that expired or no longer exists (the gateway
    /// restarted, or the browser signed out elsewhere).
    Ended,
    Missing,
}

impl Sessions {
    pub fn new(ttl: Duration, secure: bool) -> Sessions {
        Sessions {
            records: Arc::new(Mutex::new(HashMap::new())),
            ttl,
            secure,
        }
    }

    /// Starts a session; returns it and the Set-Cookie value naming it.
    pub fn create(&self, principal: Principal) -> (Session, String) {
        let value = hex::encode(rand::random::<[u8; 32]>());
        let csrf = hex::encode(rand::random::<[u8; 32]>());
        let key = digest(&value);
        let now = Instant::now();
        let mut records = self.records.lock().expect("sessions lock");
        records.retain(|_, record| record.expires_at > now);
        if records.len() >= MAX_SESSIONS
            && let Some(oldest) = records
                .iter()
                .min_by_key(|(_, record)| record.expires_at)
                .map(|(key, _)| *key)
        {
            records.remove(&oldest);
        }
        records.insert(
            key,
            Record {
                principal: principal.clone(),
                csrf: csrf.clone(),
                expires_at: now + self.ttl,
                notice: None,
            },
        );
        let cookie = Cookie::build((COOKIE, value))
            .path("/")
            .http_only(true)
            .same_site(SameSite::Strict)
            .secure(self.secure)
            .max_age(cookie::time::Duration::seconds(
                self.ttl.as_secs().try_into().unwrap_or(i64::MAX),
            ))
            .build();
        (
            Session {
                key,
                principal,
                csrf,
            },
            cookie.to_string(),
        )
    }

    /// The session a Cookie header names.
    pub fn find(&self, cookie_header: Option<&str>) -> SessionState {
        let Some(value) = cookie_header.and_then(session_cookie) else {
            return SessionState::Missing;
        };
        let key = digest(&value);
        let mut records = self.records.lock().expect("sessions lock");
        match records.get(&key) {
            Some(record) if record.expires_at > Instant::now() => {
                SessionState::Active(Box::new(Session {
                    key,
                    principal: record.principal.clone(),
                    csrf: record.csrf.clone(),
                }))
            }
            Some(_) => {
                records.remove(&key);
                SessionState::Ended
            }
            None => SessionState::Ended,
        }
    }

    pub fn remove(&self, session: &Session) {
        self.records
            .lock()
            .expect("sessions lock")
            .remove(&session.key);
    }

    /// The Set-Cookie value that makes the browser forget its session.
    pub fn removal_cookie(&self) -> String {
        Cookie::build((COOKIE, ""))
            .path("/")
            .http_only(true)
            .same_site(SameSite::Strict)
            .secure(self.secure)
            .max_age(cookie::time::Duration::ZERO)
            .build()
            .to_string()
    }

    pub fn set_notice(&self, session: &Session, notice: Notice) {
        if let Some(record) = self
            .records
            .lock()
            .expect("sessions lock")
            .get_mut(&session.key)
        {
            record.notice = Some(notice);
        }
    }

    pub fn take_notice(&self, session: &Session) -> Option<Notice> {
        self.records
            .lock()
            .expect("sessions lock")
            .get_mut(&session.key)
            .and_then(|record| record.notice.take())
    }
}

impl Session {
    /// Refuses a form whose CSRF token is missing or not this session's.
    pub fn check_csrf(&self, presented: Option<&str>) -> Result<(), ConsoleError> {
        let presented = presented.unwrap_or_default();
        if bool::from(presented.as_bytes().ct_eq(self.csrf.as_bytes())) {
            Ok(())
        } else {
            Err(ConsoleError::Forgery)
        }
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Session {
    type Rejection = ConsoleError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let ended = match parts.extensions.get::<SessionState>() {
            Some(SessionState::Active(session)) => return Ok(session.as_ref().clone()),
            Some(SessionState::Ended) => true,
            Some(SessionState::Missing) | None => false,
        };
        // Pages send the browser to sign in and back; an action is refused.
        let return_to = (parts.method == axum::http::Method::GET).then(|| {
            parts
                .uri
                .path_and_query()
                .map_or("/".to_owned(), |path| path.as_str().to_owned())
        });
        Err(ConsoleError::SignIn { ended, return_to })
    }
}

fn digest(value: &str) -> [u8; 32] {
    Sha256::digest(value.as_bytes()).into()
}

/// The value of the session cookie in a Cookie header.
fn session_cookie(header: &str) -> Option<String> {
    Cookie::split_parse(header)
        .filter_map(Result::ok)
        .find(|cookie| cookie.name() == COOKIE)
        .map(|cookie| cookie.value().to_owned())
        .filter(|value| !value.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_expire_and_cookies_are_strict() {
        let sessions = Sessions::new(Duration::from_millis(50), true);
        let (session, cookie) = sessions.create(Principal::anonymous());
        for attribute in ["HttpOnly", "SameSite=Strict", "Secure", "Path=/"] {
            assert!(cookie.contains(attribute), "{cookie}");
        }
        let header = format!("other=1; {}", cookie.split(';').next().unwrap());
        assert!(matches!(
            sessions.find(Some(&header)),
            SessionState::Active(found) if found.csrf == session.csrf
        ));
        session.check_csrf(Some(&session.csrf)).unwrap();
        assert!(session.check_csrf(Some("forged")).is_err());
        assert!(session.check_csrf(None).is_err());
        std::thread::sleep(Duration::from_millis(60));
        assert!(matches!(sessions.find(Some(&header)), SessionState::Ended));
        assert!(matches!(sessions.find(None), SessionState::Missing));
    }
}
