//! The HTTP client of push delivery: TLS verified against the public web roots (plus an
//! optional CA file), no redirects, no proxies, and a resolver that re-checks every
//! resolved address against `[push] allowed_hosts`, so an allowed name cannot lead to a
//! loopback or link-local address the operator did not list.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use url::Url;

use super::{PushSettings, request::PushRequest};
use crate::domain::AllowedHosts;

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

/// An endpoint's answer.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    /// `Retry-After` in seconds or as an HTTP date, when given.
    pub retry_after: Option<Duration>,
    /// The start of the body.
    pub body: Vec<u8>,
}

/// A request that got no answer.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("cannot connect: {0}")]
    Connect(String),
    #[error("request failed: {0}")]
    Other(String),
}

impl Failure {
    /// The `code` label of the request counter.
    pub fn code(&self) -> &'static str {
        match self {
            Failure::Timeout(_) => "timeout",
            Failure::Connect(_) => "connect_error",
            Failure::Other(_) => "error",
        }
    }
}

pub struct PushClient {
    http: reqwest::Client,
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
        let mut tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|error| PushClientError::Build(error.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let http = reqwest::Client::builder()
            .tls_backend_preconfigured(tls)
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .dns_resolver(Arc::new(CheckedResolver {
                allowed_hosts: settings.allowed_hosts.clone(),
            }))
            .user_agent(concat!("outbox-gateway/", env!("CARGO_PKG_VERSION")))
            .tcp_nodelay(true)
            .build()
            .map_err(|error| PushClientError::Build(error.to_string()))?;
        Ok(PushClient { http })
    }

    /// POSTs the request and reads the start of the answer, all within `timeout`.
    pub async fn send(
        &self,
        endpoint: &Url,
        request: PushRequest,
        timeout: Duration,
    ) -> Result<Answer, Failure> {
        let mut builder = self.http.post(endpoint.clone()).timeout(timeout);
        for (name, value) in request.headers {
            builder = builder.header(name, value);
        }
        let exchange = async {
            let mut response = builder.body(request.body).send().await?;
            let status = response.status().as_u16();
            let retry_after = response
                .headers()
                .get(http::header::RETRY_AFTER)
                .and_then(|value| value.to_str().ok())
                .and_then(parse_retry_after);
            let mut body = Vec::new();
            while body.len() < MAX_BODY_READ {
                match response.chunk().await? {
                    Some(chunk) => body.extend_from_slice(&chunk),
                    None => break,
                }
            }
            body.truncate(MAX_BODY_READ);
            Ok::<_, reqwest::Error>(Answer {
                status,
                retry_after,
                body,
            })
        };
        match tokio::time::timeout(timeout, exchange).await {
            Err(_) => Err(Failure::Timeout(timeout)),
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(error)) if error.is_timeout() => Err(Failure::Timeout(timeout)),
            Ok(Err(error)) if error.is_connect() => Err(Failure::Connect(describe(&error))),
            Ok(Err(error)) => Err(Failure::Other(describe(&error))),
        }
    }
}

/// The error with its causes: reqwest's own message rarely says what went wrong.
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
struct CheckedResolver {
    allowed_hosts: AllowedHosts,
}

impl Resolve for CheckedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let host = name.as_str().to_ascii_lowercase();
        let allowance = self.allowed_hosts.allowance(&host);
        Box::pin(async move {
            let Some(allowance) = allowance else {
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
            Ok(Box::new(addresses.into_iter()) as Addrs)
        })
    }
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
