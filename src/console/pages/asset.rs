//! The console's static assets: stylesheet, script, icons.

use axum::{extract::Path, http::header, response::IntoResponse};

use super::Page;
use crate::console::ConsoleError;

pub async fn asset(Path(file): Path<String>) -> Page {
    let (content_type, body): (&str, &'static str) = match file.as_str() {
        "console.css" => (
            "text/css; charset=utf-8",
            include_str!("../assets/console.css"),
        ),
        "console.js" => (
            "text/javascript; charset=utf-8",
            include_str!("../assets/console.js"),
        ),
        "favicon.svg" => ("image/svg+xml", include_str!("../assets/favicon.svg")),
        _ => return Err(ConsoleError::NoPage),
    };
    Ok((
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "public, max-age=300"),
        ],
        body,
    )
        .into_response())
}
