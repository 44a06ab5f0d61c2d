//! The HTTP client of push delivery, on hyper (the core's pushers send through it as a
//! [`PushSender`]): TLS verified against the public web roots
//! (plus an optional CA file), no redirects, no proxies, and a resolver that re-checks
//! every resolved address against `[push] allowed_hosts`, so an allowed name cannot lead
//! to a loopback or link-local address the operator did not list.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use bytes::Bytes;
use futures_util::future::BoxFuture;
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::{
    client::legacy::{
        Client,
        connect::{HttpConnector, dns::Name},
    },
    rt::TokioExecutor,
};
use url::Url;

use crate::{
    domain::AllowedHosts,
    push::{Answer, Failure, PushSender, PushSettings, request::PushRequest},
};

/// Most bytes of a response body read (the first KiB goes into a dead letter's error).
const MAX_BODY_READ: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum PushClientError {
    #[error("cannot read the push CA file {path}: {message}")]
    CaFile {
        path: std::path::PathBuf,
        message: String,
    },
    #[error("cannot build the push HTTP client: {0}")]
    Build(String),
}

type Resolver = tower::util::BoxCloneSyncService<
    Name,
    std::vec::IntoIter<SocketAddr>,
    Box<dyn std::error::Error + Send + Sync>,
>;

pub struct PushClient {
    http: Client<HttpsConnector<HttpConnector<Resolver>>, Full<Bytes>>,
}

impl PushClient {
    pub fn new(settings: &PushSettings) -> Result<PushClient, PushClientError> {
        let mut roots = rustls::RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        };
        if let Some(path) = &settings.ca_file {
            use rustls_pki_types::{CertificateDer, pem::PemObject};
            let ca_error = |message: String| PushClientError::CaFile {
                path: path.clone(),
                message,
            };
            let pem = std::fs::read(path).map_err(|error| ca_error(error.to_string()))?;
            let mut added = 0;
            for certificate in CertificateDer::pem_slice_iter(&pem) {
                let certificate = certificate.map_err(|error| ca_error(error.to_string()))?;
                roots
                    .add(certificate)
                    .map_err(|error| ca_error(error.to_string()))?;
                added += 1;
            }
            if added == 0 {
                return Err(ca_error("holds no PEM certificate".into()));
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|error| PushClientError::Build(error.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let allowed_hosts = settings.allowed_hosts.clone();
        let resolver: Resolver =
            tower::util::BoxCloneSyncService::new(tower::service_fn(move |name: Name| {
                resolve(allowed_hosts.clone(), name)
            }));
        let mut http = HttpConnector::new_with_resolver(resolver);
        http.enforce_http(false);
        http.set_nodelay(true);
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector(http);
        Ok(PushClient {
            http: Client::builder(TokioExecutor::new()).build(https),
        })
    }

    /// POSTs the request and reads the start of the answer, all within `timeout`.
    /// Redirects are answers like any other: never followed.
    pub async fn send(
        &self,
        endpoint: &Url,
        request: PushRequest,
        timeout: Duration,
    ) -> Result<Answer, Failure> {
        let mut builder = http::Request::post(endpoint.as_str()).header(
            http::header::USER_AGENT,
            concat!("outbox-gateway/", env!("CARGO_PKG_VERSION")),
        );
        for (name, value) in request.headers {
            builder = builder.header(name, value);
        }
        let http_request = builder
            .body(Full::new(Bytes::from(request.body)))
            .map_err(|error| Failure::Other(error.to_string()))?;
        let exchange = async {
            let response = self.http.request(http_request).await.map_err(|error| {
                if error.is_connect() {
                    Failure::Connect(describe(&error))
                } else {
                    Failure::Other(describe(&error))
                }
            })?;
            let status = response.status().as_u16();
            let retry_after = response
                .headers()
                .get(http::header::RETRY_AFTER)
                .and_then(|value| value.to_str().ok())
                .and_then(parse_retry_after);
            let mut body = Vec::new();
            let mut incoming = response.into_body();
            while body.len() < MAX_BODY_READ {
                match incoming.frame().await {
                    Some(Ok(frame)) => {
                        if let Some(data) = frame.data_ref() {
                            body.extend_from_slice(data);
                        }
                    }
                    // A body cut short still leaves the status to act on.
                    Some(Err(_)) | None => break,
                }
            }
            body.truncate(MAX_BODY_READ);
            Ok(Answer {
                status,
                retry_after,
                body,
            })
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .unwrap_or(Err(Failure::Timeout(timeout)))
    }
}

impl PushSender for PushClient {
    fn send<'a>(
        &'a self,
        endpoint: &'a Url,
        request: PushRequest,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Answer, Failure>> {
        Box::pin(PushClient::send(self, endpoint, request, timeout))
    }
}

/// The error with its causes: a client error's own message rarely says what went wrong.
fn describe(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// `Retry-After` as delta-seconds or an HTTP date.
fn parse_retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = chrono::DateTime::parse_from_rfc2822(value).ok()?;
    Some(
        (at.with_timezone(&chrono::Utc) - chrono::Utc::now())
            .to_std()
            .unwrap_or_default(),
    )
}

/// Resolves with the system resolver and keeps only the addresses the host may use.
async fn resolve(
    allowed_hosts: AllowedHosts,
    name: Name,
) -> Result<std::vec::IntoIter<SocketAddr>, Box<dyn std::error::Error + Send + Sync>> {
    let host = name.as_str().to_ascii_lowercase();
    let Some(allowance) = allowed_hosts.allowance(&host) else {
        return Err(format!("host {host:?} is not allowed by [push] allowed_hosts").into());
    };
    let addresses: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0))
        .await?
        .filter(|address| AllowedHosts::address_allowed(allowance, address.ip()))
        .collect();
    if addresses.is_empty() {
        return Err(format!(
            "host {host:?} resolves only to addresses [push] allowed_hosts does not allow (loopback and link-local need the host listed exactly)"
        )
        .into());
    }
    Ok(addresses.into_iter())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_takes_seconds_and_dates() {
        assert_eq!(parse_retry_after("2"), Some(Duration::from_secs(2)));
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT"),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("soon"), None);
    }
}
