//! Push subscriptions: where and how their events are sent, which destinations the
//! operator allows, and the Standard Webhooks signing secrets.

use std::{collections::BTreeMap, fmt, net::IpAddr, time::Duration};

use base64::{Engine, engine::general_purpose::STANDARD as BASE64};
use chrono::{DateTime, Utc};
use sha2::{Digest, Sha256};
use url::{Host, Url};

use super::input::Echo;
use super::refusal::{Refusal, Result};

pub const DEFAULT_PUSH_TIMEOUT: Duration = Duration::from_secs(10);
pub const MIN_PUSH_TIMEOUT: Duration = Duration::from_secs(1);
pub const MAX_PUSH_TIMEOUT: Duration = Duration::from_secs(5 * 60);
pub const DEFAULT_PUSH_CONCURRENCY: u32 = 16;
pub const MAX_PUSH_CONCURRENCY: u32 = 1000;
/// Most events one batched request may carry.
pub const MAX_PUSH_BATCH_EVENTS: u32 = 1000;
/// Bytes of events a batched request carries at most unless set (one event larger than
/// that still goes, alone).
pub const DEFAULT_PUSH_BATCH_BYTES: u64 = 1024 * 1024;
pub const MAX_PUSH_BATCH_BYTES: u64 = 64 * 1024 * 1024;
/// Longest a batch may wait to fill.
pub const MAX_PUSH_BATCH_WAIT: Duration = Duration::from_secs(60);
/// Slowest rate limit, in requests per second: one request every 1,000 s. Slower is
/// no push at all, and the pause between requests would overflow a duration.
pub const MIN_PUSH_RATE: f64 = 0.001;
/// Fastest rate limit, in requests per second.
pub const MAX_PUSH_RATE: f64 = 1_000_000.0;
/// Longest endpoint URL accepted.
const MAX_ENDPOINT_BYTES: usize = 2048;
/// Most extra headers, and longest value of one.
const MAX_HEADERS: usize = 32;
const MAX_HEADER_VALUE_BYTES: usize = 4096;
/// Random bytes of a signing key (Standard Webhooks asks for 24 to 64).
const SECRET_BYTES: usize = 32;
pub const SECRET_PREFIX: &str = "whsec_";

/// Headers the gateway sets on every request; an extra header must not override them,
/// or the signature and the CloudEvents attributes could lie.
const RESERVED_HEADERS: [&str; 12] = [
    "content-type",
    "content-length",
    "content-encoding",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "upgrade",
    "te",
    "trailer",
    "host",
    "traceparent",
    "tracestate",
];
const RESERVED_HEADER_PREFIXES: [&str; 3] = ["webhook-", "ce-", "proxy-"];

/// CloudEvents HTTP mode of a push subscription.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PushFormat {
    /// Attributes in `ce-*` headers, the payload as the body.
    #[default]
    Binary,
    /// One `application/cloudevents+json` document.
    Structured,
}

/// Where and how a push subscription sends its events.
#[derive(Clone, PartialEq)]
pub struct PushConfig {
    pub endpoint: Url,
    /// Extra headers; the values are secrets (never logged, shown as fingerprints).
    pub headers: BTreeMap<String, String>,
    pub format: PushFormat,
    pub timeout: Duration,
    pub max_concurrency: u32,
    /// Requests started per second at most; `None`: no limit.
    pub rate_limit: Option<f64>,
    /// Most events per request: 1 sends each event as its own CloudEvent; more sends
    /// CloudEvents JSON batches.
    pub max_batch_events: u32,
    /// Most bytes of events per batch (payloads plus a fixed allowance each).
    pub max_batch_bytes: u64,
    /// Longest a batch waits for more events once it has one.
    pub max_batch_wait: Duration,
}

/// Header values are secrets: only their fingerprints are shown.
impl fmt::Debug for PushConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let headers: BTreeMap<&str, String> = self
            .headers
            .iter()
            .map(|(name, value)| (name.as_str(), fingerprint(value)))
            .collect();
        f.debug_struct("PushConfig")
            .field("endpoint", &self.endpoint.as_str())
            .field("headers", &headers)
            .field("format", &self.format)
            .field("timeout", &self.timeout)
            .field("max_concurrency", &self.max_concurrency)
            .field("rate_limit", &self.rate_limit)
            .field("max_batch_events", &self.max_batch_events)
            .field("max_batch_bytes", &self.max_batch_bytes)
            .field("max_batch_wait", &self.max_batch_wait)
            .finish()
    }
}

/// Push settings as a request gives them: unset values take their defaults.
#[derive(Debug, Default)]
pub struct PushInput {
    pub endpoint: String,
    pub headers: BTreeMap<String, String>,
    pub format: PushFormat,
    pub timeout: Option<Duration>,
    pub max_concurrency: u32,
    pub rate_limit: Option<f64>,
    /// 0: 1.
    pub max_batch_events: u32,
    /// 0: [`DEFAULT_PUSH_BATCH_BYTES`].
    pub max_batch_bytes: u64,
    pub max_batch_wait: Option<Duration>,
}

impl PushConfig {
    /// Validates the shape of push settings given in the request field `prefix`
    /// (`subscription.push`); whether the host is allowed is [`AllowedHosts::check`].
    pub fn parse(prefix: &str, input: PushInput) -> Result<PushConfig> {
        let field = |name: &str| format!("{prefix}.{name}");
        if input.endpoint.len() > MAX_ENDPOINT_BYTES {
            return Err(Refusal::invalid(
                field("endpoint"),
                format!("must be at most {MAX_ENDPOINT_BYTES} bytes"),
            ));
        }
        // The URL parser strips tabs, newlines and surrounding control characters: what
        // it would store is not what was given.
        if input.endpoint.chars().any(char::is_control) {
            return Err(Refusal::invalid(
                field("endpoint"),
                "must not contain control characters (such as NUL, tab or newline)",
            ));
        }
        let endpoint = Url::parse(&input.endpoint).map_err(|error| {
            Refusal::invalid(
                field("endpoint"),
                format!("{} is not a URL: {error}", Echo(&input.endpoint)),
            )
        })?;
        if !matches!(endpoint.scheme(), "http" | "https") {
            return Err(Refusal::invalid(
                field("endpoint"),
                "must be an http:// or https:// URL",
            ));
        }
        if endpoint.host().is_none() {
            return Err(Refusal::invalid(field("endpoint"), "must name a host"));
        }
        if !endpoint.username().is_empty() || endpoint.password().is_some() {
            return Err(Refusal::invalid(
                field("endpoint"),
                "must not carry credentials; send them in `headers` (kept secret)",
            ));
        }
        if endpoint.fragment().is_some() {
            return Err(Refusal::invalid(
                field("endpoint"),
                "must not have a fragment",
            ));
        }
        if input.headers.len() > MAX_HEADERS {
            return Err(Refusal::invalid(
                field("headers"),
                format!("at most {MAX_HEADERS} headers"),
            ));
        }
        let mut headers = BTreeMap::new();
        for (name, value) in input.headers {
            let lower = name.to_ascii_lowercase();
            let header_field = format!("{}[{}]", field("headers"), Echo(&name));
            if http::HeaderName::from_bytes(lower.as_bytes()).is_err() {
                return Err(Refusal::invalid(header_field, "is not a valid header name"));
            }
            if RESERVED_HEADERS.contains(&lower.as_str())
                || RESERVED_HEADER_PREFIXES
                    .iter()
                    .any(|prefix| lower.starts_with(prefix))
            {
                return Err(Refusal::invalid(
                    header_field,
                    "is set by the gateway (signature, CloudEvents, trace context or transport) and cannot be overridden",
                ));
            }
            if value.len() > MAX_HEADER_VALUE_BYTES || http::HeaderValue::from_str(&value).is_err()
            {
                return Err(Refusal::invalid(
                    header_field,
                    format!(
                        "value must be visible ASCII (and spaces), at most {MAX_HEADER_VALUE_BYTES} bytes"
                    ),
                ));
            }
            if headers.insert(lower, value).is_some() {
                return Err(Refusal::invalid(header_field, "is given twice"));
            }
        }
        let timeout = input.timeout.unwrap_or(DEFAULT_PUSH_TIMEOUT);
        if !(MIN_PUSH_TIMEOUT..=MAX_PUSH_TIMEOUT).contains(&timeout) {
            return Err(Refusal::invalid(
                field("timeout"),
                format!(
                    "must be between {} and {}",
                    humantime::format_duration(MIN_PUSH_TIMEOUT),
                    humantime::format_duration(MAX_PUSH_TIMEOUT)
                ),
            ));
        }
        let max_concurrency = match input.max_concurrency {
            0 => DEFAULT_PUSH_CONCURRENCY,
            n if n > MAX_PUSH_CONCURRENCY => {
                return Err(Refusal::invalid(
                    field("max_concurrency"),
                    format!("must be at most {MAX_PUSH_CONCURRENCY}"),
                ));
            }
            n => n,
        };
        if let Some(rate) = input.rate_limit
            && !(MIN_PUSH_RATE..=MAX_PUSH_RATE).contains(&rate)
        {
            return Err(Refusal::invalid(
                field("rate_limit"),
                format!(
                    "must be a number of requests per second from {MIN_PUSH_RATE} to {MAX_PUSH_RATE}, got {rate}"
                ),
            ));
        }
        let max_batch_events = match input.max_batch_events {
            0 => 1,
            n if n > MAX_PUSH_BATCH_EVENTS => {
                return Err(Refusal::invalid(
                    field("max_batch_events"),
                    format!("must be at most {MAX_PUSH_BATCH_EVENTS}"),
                ));
            }
            n => n,
        };
        let max_batch_bytes = match input.max_batch_bytes {
            0 => DEFAULT_PUSH_BATCH_BYTES,
            n if n > MAX_PUSH_BATCH_BYTES => {
                return Err(Refusal::invalid(
                    field("max_batch_bytes"),
                    format!("must be at most {MAX_PUSH_BATCH_BYTES}"),
                ));
            }
            n => n,
        };
        let max_batch_wait = input.max_batch_wait.unwrap_or_default();
        if max_batch_wait > MAX_PUSH_BATCH_WAIT {
            return Err(Refusal::invalid(
                field("max_batch_wait"),
                format!(
                    "must be at most {}",
                    humantime::format_duration(MAX_PUSH_BATCH_WAIT)
                ),
            ));
        }
        if max_batch_events == 1 && (input.max_batch_bytes > 0 || !max_batch_wait.is_zero()) {
            return Err(Refusal::invalid(
                field("max_batch_events"),
                "must be more than 1 for max_batch_bytes or max_batch_wait to apply",
            ));
        }
        Ok(PushConfig {
            endpoint,
            headers,
            format: input.format,
            timeout,
            max_concurrency,
            rate_limit: input.rate_limit,
            max_batch_events,
            max_batch_bytes,
            max_batch_wait,
        })
    }

    /// Whether requests carry CloudEvents JSON batches rather than one event each.
    pub fn batched(&self) -> bool {
        self.max_batch_events > 1
    }

    /// The pause between two request starts that `rate_limit` asks for. A rate stored
    /// before the bounds were checked is held to them, so this never fails.
    pub fn request_interval(&self) -> Option<Duration> {
        self.rate_limit.map(|rate| {
            let rate = if rate.is_nan() {
                MAX_PUSH_RATE
            } else {
                rate.clamp(MIN_PUSH_RATE, MAX_PUSH_RATE)
            };
            Duration::from_secs_f64(1.0 / rate)
        })
    }

    /// The endpoint's host as `allowed_hosts` names it: lowercase, IPv6 without brackets.
    pub fn host(&self) -> String {
        host_text(&self.endpoint)
    }

    /// Keeps the stored value of each header that `previous` had and this one gives as
    /// that value's fingerprint (a client sending back what Get showed).
    pub fn keep_fingerprinted_headers(&mut self, previous: &PushConfig) {
        for (name, value) in &mut self.headers {
            if let Some(stored) = previous.headers.get(name)
                && *value == fingerprint(stored)
            {
                value.clone_from(stored);
            }
        }
    }
}

fn host_text(url: &Url) -> String {
    match url.host() {
        Some(Host::Domain(domain)) => domain.to_ascii_lowercase(),
        Some(Host::Ipv4(ip)) => ip.to_string(),
        Some(Host::Ipv6(ip)) => ip.to_string(),
        None => String::new(),
    }
}

/// How a header value is shown: "sha256:" and the first 12 hex digits of its SHA-256.
pub fn fingerprint(value: &str) -> String {
    let digest = Sha256::digest(value.as_bytes());
    format!("sha256:{}", &hex::encode(digest)[..12])
}

/// Pushing stopped until an administrator resumes it.
#[derive(Debug, Clone, PartialEq)]
pub struct PushStopped {
    pub at: DateTime<Utc>,
    pub reason: String,
}

/// A Standard Webhooks signing key.
#[derive(Clone, PartialEq)]
pub struct PushSecret {
    pub key: Vec<u8>,
    /// When a rotated-out key stops being used; `None` for the current key.
    pub expires_at: Option<DateTime<Utc>>,
}

impl fmt::Debug for PushSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PushSecret")
            .field("key", &"<secret>")
            .field("expires_at", &self.expires_at)
            .finish()
    }
}

impl PushSecret {
    pub fn generate() -> PushSecret {
        PushSecret {
            key: (0..SECRET_BYTES).map(|_| rand::random::<u8>()).collect(),
            expires_at: None,
        }
    }

    /// The form receivers configure: `whsec_` and the base64 key.
    pub fn text(&self) -> String {
        format!("{SECRET_PREFIX}{}", BASE64.encode(&self.key))
    }

    pub fn is_live(&self, now: DateTime<Utc>) -> bool {
        self.expires_at.is_none_or(|at| at > now)
    }
}

/// The `webhook-signature` header value: `v1,<base64 HMAC-SHA256 of id.timestamp.body>`
/// under each live key, space-separated (two during a rotation's overlap).
pub fn webhook_signature(
    secrets: &[PushSecret],
    now: DateTime<Utc>,
    id: &str,
    timestamp: i64,
    body: &[u8],
) -> String {
    let mut signatures = Vec::with_capacity(secrets.len());
    for secret in secrets.iter().filter(|secret| secret.is_live(now)) {
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &secret.key);
        let mut context = ring::hmac::Context::with_key(&key);
        context.update(id.as_bytes());
        context.update(b".");
        context.update(timestamp.to_string().as_bytes());
        context.update(b".");
        context.update(body);
        signatures.push(format!("v1,{}", BASE64.encode(context.sign().as_ref())));
    }
    signatures.join(" ")
}

/// The hosts the operator allows: push destinations (`[push] allowed_hosts`), and the names
/// a console without tokens answers to (`console_allowed_hosts`). Exact host names or
/// addresses, `*.example.com` (any subdomain) or `*` (any host). For push, loopback, link-local,
/// unspecified and multicast addresses are allowed only for an entry naming the host
/// exactly, both as written in the endpoint and after name resolution.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowedHosts {
    entries: Vec<HostEntry>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum HostEntry {
    Exact(String),
    /// `*.example.com`, kept as `.example.com`.
    Subdomains(String),
    Any,
}

/// How a host is allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allowance {
    /// Named exactly: any address it resolves to.
    Explicit,
    /// By a wildcard: only ordinary addresses.
    Wildcard,
}

impl AllowedHosts {
    /// Parses the configured list; the error names the bad entry.
    pub fn parse(entries: &[String]) -> std::result::Result<AllowedHosts, String> {
        let mut parsed = Vec::with_capacity(entries.len());
        for entry in entries {
            let lower = entry.trim().to_ascii_lowercase();
            let lower = lower
                .strip_prefix('[')
                .and_then(|rest| rest.strip_suffix(']'))
                .map(str::to_owned)
                .unwrap_or(lower);
            let valid_name = |name: &str| {
                !name.is_empty()
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
            };
            let parsed_entry = if lower == "*" {
                HostEntry::Any
            } else if let Some(suffix) = lower.strip_prefix("*.") {
                if !valid_name(suffix) {
                    return Err(format!("{entry:?} is not a host pattern"));
                }
                HostEntry::Subdomains(format!(".{suffix}"))
            } else if lower.parse::<IpAddr>().is_ok() || valid_name(&lower) {
                HostEntry::Exact(lower)
            } else {
                return Err(format!(
                    "{entry:?} is neither a host name, an address, \"*.domain\" nor \"*\""
                ));
            };
            parsed.push(parsed_entry);
        }
        Ok(AllowedHosts { entries: parsed })
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether and how `host` (lowercase, IPv6 without brackets) is allowed.
    pub fn allowance(&self, host: &str) -> Option<Allowance> {
        let mut found = None;
        for entry in &self.entries {
            match entry {
                HostEntry::Exact(name) if name == host => return Some(Allowance::Explicit),
                HostEntry::Subdomains(suffix) if host.ends_with(suffix.as_str()) => {
                    found = Some(Allowance::Wildcard);
                }
                HostEntry::Any => found = Some(Allowance::Wildcard),
                _ => {}
            }
        }
        found
    }

    /// Whether an address a host resolved to (or is) may be connected to.
    pub fn address_allowed(allowance: Allowance, address: IpAddr) -> bool {
        allowance == Allowance::Explicit || !is_special(address)
    }

    /// Refuses an endpoint whose host is not allowed, naming `field`.
    pub fn check(&self, field: &str, config: &PushConfig) -> Result<()> {
        let host = config.host();
        if self.is_empty() {
            return Err(Refusal::invalid(
                field,
                "pushing is off on this gateway: its configuration allows no destinations ([push] allowed_hosts)",
            ));
        }
        let Some(allowance) = self.allowance(&host) else {
            return Err(Refusal::invalid(
                field,
                format!(
                    "host {} is not allowed by the gateway's [push] allowed_hosts",
                    Echo(&host)
                ),
            ));
        };
        if let Ok(address) = host.parse::<IpAddr>()
            && !Self::address_allowed(allowance, address)
        {
            return Err(Refusal::invalid(
                field,
                format!(
                    "{} is a loopback, link-local or otherwise special address: [push] allowed_hosts must list it exactly",
                    Echo(&host)
                ),
            ));
        }
        Ok(())
    }
}

/// Addresses a wildcard must not reach: this machine, its link, nowhere or everywhere.
fn is_special(address: IpAddr) -> bool {
    match address {
        IpAddr::V4(v4) => {
            v4.is_loopback()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_multicast()
                || v4.is_broadcast()
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_special(IpAddr::V4(v4));
            }
            v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (v6.segments()[0] & 0xffc0) == 0xfe80
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(endpoint: &str) -> PushConfig {
        PushConfig::parse(
            "push",
            PushInput {
                endpoint: endpoint.into(),
                ..Default::default()
            },
        )
        .unwrap()
    }

    #[test]
    fn rate_limits_are_bounded_and_their_interval_never_fails() {
        let with_rate = |rate: f64| {
            PushConfig::parse(
                "push",
                PushInput {
                    endpoint: "https://hooks.example.com/x".into(),
                    rate_limit: Some(rate),
                    ..Default::default()
                },
            )
        };
        for rate in [MIN_PUSH_RATE, 1.0, MAX_PUSH_RATE] {
            with_rate(rate).unwrap();
        }
        for rate in [1e-300, 0.0009, 0.0, -1.0, 2e6, f64::NAN, f64::INFINITY] {
            match with_rate(rate) {
                Err(Refusal::Invalid { field, .. }) => assert_eq!(field, "push.rate_limit"),
                other => panic!("{rate}: {other:?}"),
            }
        }
        // A rate stored before the bounds were checked is held to them.
        let mut stored = config("https://hooks.example.com/x");
        stored.rate_limit = Some(1e-300);
        assert_eq!(stored.request_interval(), Some(Duration::from_secs(1000)));
        stored.rate_limit = Some(4.0);
        assert_eq!(stored.request_interval(), Some(Duration::from_millis(250)));
        stored.rate_limit = None;
        assert_eq!(stored.request_interval(), None);
    }

    #[test]
    fn wildcards_do_not_reach_loopback_but_exact_entries_do() {
        let allowed = AllowedHosts::parse(&["*.example.com".into(), "127.0.0.1".into()]).unwrap();
        allowed
            .check("push.endpoint", &config("https://hooks.example.com/x"))
            .unwrap();
        allowed
            .check("push.endpoint", &config("http://127.0.0.1:8080/"))
            .unwrap();
        assert!(
            allowed
                .check("push.endpoint", &config("https://example.org/"))
                .is_err()
        );
        let any = AllowedHosts::parse(&["*".into()]).unwrap();
        assert!(
            any.check("push.endpoint", &config("http://127.0.0.1/"))
                .is_err()
        );
        assert!(
            any.check("push.endpoint", &config("http://[::1]/"))
                .is_err()
        );
        assert!(
            any.check("push.endpoint", &config("http://169.254.169.254/"))
                .is_err()
        );
        any.check("push.endpoint", &config("https://203.0.113.9/"))
            .unwrap();
        assert_eq!(
            any.allowance("localhost"),
            Some(Allowance::Wildcard),
            "a wildcard name is re-checked after resolution"
        );
        assert!(!AllowedHosts::address_allowed(
            Allowance::Wildcard,
            "127.0.0.1".parse().unwrap()
        ));
        assert!(
            AllowedHosts::default()
                .check("push.endpoint", &config("https://example.com/"))
                .is_err()
        );
    }

    #[test]
    fn reserved_headers_and_bad_endpoints_are_refused() {
        for header in ["webhook-signature", "CE-id", "Content-Type", "traceparent"] {
            let input = PushInput {
                endpoint: "https://example.com/".into(),
                headers: [(header.to_owned(), "x".to_owned())].into(),
                ..Default::default()
            };
            assert!(PushConfig::parse("push", input).is_err(), "{header}");
        }
        for endpoint in [
            "ftp://example.com/",
            "not a url",
            "https://user:pw@example.com/",
        ] {
            let input = PushInput {
                endpoint: endpoint.into(),
                ..Default::default()
            };
            assert!(PushConfig::parse("push", input).is_err(), "{endpoint}");
        }
    }

    #[test]
    fn batches_are_bounded_and_off_by_default() {
        let parse = |events: u32, bytes: u64, wait: Option<Duration>| {
            PushConfig::parse(
                "push",
                PushInput {
                    endpoint: "https://example.com/".into(),
                    max_batch_events: events,
                    max_batch_bytes: bytes,
                    max_batch_wait: wait,
                    ..Default::default()
                },
            )
        };
        let single = parse(0, 0, None).unwrap();
        assert!(!single.batched());
        let batched = parse(100, 0, Some(Duration::from_millis(50))).unwrap();
        assert!(batched.batched());
        assert_eq!(batched.max_batch_bytes, DEFAULT_PUSH_BATCH_BYTES);
        for (events, bytes, wait, field) in [
            (1001, 0, None, "push.max_batch_events"),
            (10, MAX_PUSH_BATCH_BYTES + 1, None, "push.max_batch_bytes"),
            (10, 0, Some(Duration::from_secs(61)), "push.max_batch_wait"),
            (1, 1000, None, "push.max_batch_events"),
            (
                0,
                0,
                Some(Duration::from_millis(5)),
                "push.max_batch_events",
            ),
        ] {
            let refusal = parse(events, bytes, wait).unwrap_err().to_string();
            assert!(refusal.starts_with(field), "{refusal}");
        }
    }

    #[test]
    fn signature_follows_standard_webhooks() {
        // The example of the Standard Webhooks specification's reference libraries.
        let key = BASE64.decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let secret = PushSecret {
            key,
            expires_at: None,
        };
        let signature = webhook_signature(
            &[secret],
            Utc::now(),
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            br#"{"test": 2432232314}"#,
        );
        assert_eq!(signature, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }
}
