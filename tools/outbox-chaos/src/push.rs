//! The HTTP receiver of the push subscription: an axum server on a loopback port that
//! records every request (its event, from the CloudEvents binary-mode headers) in the
//! [`Journal`] and answers mostly 204, sometimes 503 or 500 (which the gateways must
//! retry), after a short random delay.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use anyhow::Context;
use axum::{
    Router,
    extract::State,
    http::{HeaderMap, StatusCode},
    routing::post,
};
use chrono::Utc;
use rand::Rng;
use tokio::{net::TcpListener, time::Instant};
use tokio_util::sync::CancellationToken;

use crate::{
    check::Violation,
    consumers::{Journal, Pushed},
};

/// Share of requests answered with an error, half 503 and half 500.
const ERROR_RATE: f64 = 0.08;

/// Starts the receiver; it answers until `stop`. Returns its endpoint URL.
pub async fn start(journal: Arc<Journal>, stop: CancellationToken) -> anyhow::Result<String> {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .context("cannot listen for push requests")?;
    let address: SocketAddr = listener.local_addr()?;
    let app = Router::new()
        .route("/hook", post(receive))
        .with_state(journal);
    tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(stop.cancelled_owned())
            .await;
        if let Err(error) = served {
            eprintln!("outbox-chaos: push receiver failed: {error}");
        }
    });
    Ok(format!("http://{address}/hook"))
}

async fn receive(State(journal): State<Arc<Journal>>, headers: HeaderMap) -> StatusCode {
    let at = Instant::now();
    let wall = Utc::now();
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|value| value.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let (event_id, webhook_id, event_type) =
        (header("ce-id"), header("webhook-id"), header("ce-type"));
    let Ok(event) = event_id.parse() else {
        journal.violation(Violation::new(
            "push request",
            format!("a push request without a valid ce-id: {headers:?}"),
        ));
        return StatusCode::BAD_REQUEST;
    };
    // Standard Webhooks: the webhook id is the event id, the same on every retry.
    if webhook_id != event_id {
        journal.violation(Violation::new(
            "push request",
            format!("webhook-id {webhook_id:?} is not the event id {event_id}"),
        ));
    }
    let (delay, status) = {
        let mut rng = rand::rng();
        let status = if rng.random_bool(ERROR_RATE) {
            if rng.random_bool(0.5) {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        } else {
            StatusCode::NO_CONTENT
        };
        (Duration::from_millis(rng.random_range(0..30)), status)
    };
    tokio::time::sleep(delay).await;
    let mut state = journal.state();
    state.pushed.push(Pushed {
        event,
        event_type,
        at,
        wall,
        status: status.as_u16(),
    });
    if status.is_success() {
        state.pushed_ok.insert(event);
    }
    status
}
