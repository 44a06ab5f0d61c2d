//! Signing in with a bearer token, and out.

use axum::{
    body::Bytes,
    extract::{RawQuery, State},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Redirect},
};

use super::{Page, local_path, same_origin};
use crate::console::{
    Console,
    params::Params,
    session::{Session, SessionState},
    views,
};

pub async fn sign_in_page(
    State(console): State<Console>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> Page {
    let query = Params::parse(query.unwrap_or_default().as_bytes());
    let next = local_path(query.get("next"))?;
    if console.inner.authenticator.is_none() || is_signed_in(&console, &headers) {
        return Ok(Redirect::to(&next).into_response());
    }
    Ok(views::sign_in(&next, None, query.flag("ended").unwrap_or(false)).into_response())
}

fn is_signed_in(console: &Console, headers: &HeaderMap) -> bool {
    let cookie = headers
        .get(header::COOKIE)
        .and_then(|value| value.to_str().ok());
    matches!(console.inner.sessions.find(cookie), SessionState::Active(_))
}

pub async fn sign_in(State(console): State<Console>, headers: HeaderMap, body: Bytes) -> Page {
    same_origin(&headers)?;
    let form = Params::parse(&body);
    // Before the token: a refused `next` starts no session.
    let next = local_path(form.get("next"))?;
    let Some(authenticator) = &console.inner.authenticator else {
        return Ok(Redirect::to(&next).into_response());
    };
    let refused = |status: StatusCode, message: &str| -> Page {
        Ok((status, views::sign_in(&next, Some(message), false)).into_response())
    };
    let Some(token) = form.get("token") else {
        return refused(StatusCode::BAD_REQUEST, "token: enter a token to sign in.");
    };
    let principal = match authenticator.authenticate_token(token) {
        Ok(principal) => principal,
        Err(_) => {
            tracing::info!("refused a console sign-in with an unknown token");
            return refused(
                StatusCode::UNAUTHORIZED,
                "That token is not known to this gateway.",
            );
        }
    };
    if let Err(error) = principal.check_view() {
        tracing::info!(principal = %principal.name, "refused a console sign-in without the viewer or admin role");
        return refused(StatusCode::FORBIDDEN, &error.to_string());
    }
    tracing::info!(principal = %principal.name, admin = principal.is_admin(), "console sign-in");
    let (_, cookie) = console.inner.sessions.create(principal);
    let mut response = Redirect::to(&next).into_response();
    if let Ok(cookie) = HeaderValue::from_str(&cookie) {
        response.headers_mut().append(header::SET_COOKIE, cookie);
    }
    Ok(response)
}

pub async fn sign_out(
    State(console): State<Console>,
    session: Session,
    headers: HeaderMap,
    body: Bytes,
) -> Page {
    same_origin(&headers)?;
    session.check_csrf(Params::parse(&body).get("csrf"))?;
    let sessions = &console.inner.sessions;
    sessions.remove(&session);
    let mut response = Redirect::to("/sign-in").into_response();
    if let Ok(cookie) = HeaderValue::from_str(&sessions.removal_cookie()) {
        response.headers_mut().append(header::SET_COOKIE, cookie);
    }
    Ok(response)
}
