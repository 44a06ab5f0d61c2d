//! Who may call what: bearer tokens (stored only as SHA-256 digests) with roles, and the
//! authorization rules of each role. Transport-free: `api` reads the header and asks.

use globset::{GlobBuilder, GlobSet, GlobSetBuilder};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::{NewEvent, PatternSet, Refusal, SourceName, SubscriptionName};

type Result<T, E = Refusal> = std::result::Result<T, E>;

/// One token of the configuration file.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TokenConfig {
    /// Who holds it; appears in logs, never the token itself.
    pub name: String,
    /// SHA-256 of the token, hex (`outbox-gateway token generate` prints both).
    pub sha256: String,
    pub roles: Vec<Role>,
    /// Publisher scope: event-type patterns it may publish (empty: any).
    #[serde(default)]
    pub event_types: Vec<String>,
    /// Publisher scope: aggregate types it may publish (empty: any).
    #[serde(default)]
    pub aggregate_types: Vec<String>,
    /// Subscriber scope: subscription names it may read, `*` matching any run of
    /// characters, e.g. `billing-*` (empty: any).
    #[serde(default)]
    pub subscriptions: Vec<String>,
    /// Publisher scope: sources (databases) it may publish to (empty: any).
    #[serde(default)]
    pub sources: Vec<String>,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Publisher,
    Subscriber,
    Admin,
    /// Reads stats, settings and dead letters (the web console's read-only pages and
    /// the Admin service's reading calls) and changes nothing.
    Viewer,
}

/// The authenticated caller and what it may do.
#[derive(Debug, Clone)]
pub struct Principal {
    pub name: String,
    publisher: Option<PublishScope>,
    /// Subscription-name patterns it may read (empty: any).
    subscriber: Option<GlobSet>,
    admin: bool,
    viewer: bool,
}

#[derive(Debug, Clone, PartialEq)]
struct PublishScope {
    event_types: PatternSet,
    aggregate_types: Vec<String>,
    sources: Vec<String>,
}

impl Principal {
    /// Everything allowed: the caller when authentication is off.
    pub fn anonymous() -> Principal {
        Principal {
            name: "anonymous".into(),
            publisher: Some(PublishScope {
                event_types: PatternSet::default(),
                aggregate_types: Vec::new(),
                sources: Vec::new(),
            }),
            subscriber: Some(GlobSet::empty()),
            admin: true,
            viewer: true,
        }
    }

    /// Every event must be within the publisher scope, and so must the source.
    pub fn check_publish(&self, events: &[NewEvent], source: &SourceName) -> Result<()> {
        let Some(scope) = &self.publisher else {
            return Err(self.denied("publish events (the publisher role)"));
        };
        if !scope.sources.is_empty() && !scope.sources.iter().any(|s| s == source.as_str()) {
            return Err(Refusal::PermissionDenied(format!(
                "source: {:?} may not publish to source {source:?}",
                self.name
            )));
        }
        for (index, event) in events.iter().enumerate() {
            if !scope.event_types.is_empty() && !scope.event_types.matches(&event.event_type) {
                return Err(Refusal::PermissionDenied(format!(
                    "events[{index}].event_type: {:?} may not publish {:?}",
                    self.name, event.event_type
                )));
            }
            if !scope.aggregate_types.is_empty()
                && !scope.aggregate_types.contains(&event.aggregate_type)
            {
                return Err(Refusal::PermissionDenied(format!(
                    "events[{index}].aggregate_type: {:?} may not publish {:?} events",
                    self.name, event.aggregate_type
                )));
            }
        }
        Ok(())
    }

    pub fn check_subscription(&self, subscription: &SubscriptionName) -> Result<()> {
        let Some(patterns) = &self.subscriber else {
            return Err(self.denied("read subscriptions (the subscriber role)"));
        };
        if patterns.is_empty() || patterns.is_match(subscription.as_str()) {
            return Ok(());
        }
        Err(Refusal::PermissionDenied(format!(
            "subscription: {:?} may not read {subscription:?}",
            self.name
        )))
    }

    pub fn check_admin(&self) -> Result<()> {
        if self.admin {
            Ok(())
        } else {
            Err(self.denied("administer the gateway (the admin role)"))
        }
    }

    /// Reading stats, settings and dead letters: the viewer role, or the admin role.
    pub fn check_view(&self) -> Result<()> {
        if self.viewer || self.admin {
            Ok(())
        } else {
            Err(self.denied("view the gateway's state (the viewer or admin role)"))
        }
    }

    /// True when [`Principal::check_admin`] passes.
    pub fn is_admin(&self) -> bool {
        self.admin
    }

    fn denied(&self, what: &str) -> Refusal {
        Refusal::PermissionDenied(format!("{:?} may not {what}", self.name))
    }
}

/// The subscriber scope's patterns: `*` matches any run of characters, everything else
/// matches itself. globset's other wildcards (`?`, `[...]`, `{a,b}`) are escaped, so the
/// configuration means what it always meant.
fn subscription_patterns(patterns: &[String]) -> std::result::Result<GlobSet, globset::Error> {
    let mut set = GlobSetBuilder::new();
    for pattern in patterns {
        let mut glob = pattern
            .split('*')
            .map(globset::escape)
            .collect::<Vec<_>>()
            .join("*");
        // A run of stars means the same as one; globset would read `**` as a path wildcard.
        while glob.contains("**") {
            glob = glob.replace("**", "*");
        }
        set.add(
            GlobBuilder::new(&glob)
                .literal_separator(false)
                .backslash_escape(false)
                .build()?,
        );
    }
    set.build()
}

/// Checks bearer tokens against the configured digests.
#[derive(Debug, Clone)]
pub struct Authenticator {
    tokens: Vec<([u8; 32], Principal)>,
}

impl Authenticator {
    /// Validates the configured tokens; the error names the offending entry.
    pub fn new(tokens: &[TokenConfig]) -> std::result::Result<Authenticator, String> {
        let mut entries = Vec::with_capacity(tokens.len());
        for (index, token) in tokens.iter().enumerate() {
            let field = format!("tokens[{index}] ({:?})", token.name);
            let digest = decode_digest(&token.sha256)
                .ok_or_else(|| format!("{field}: sha256 must be 64 hex digits"))?;
            if token.roles.is_empty() {
                return Err(format!("{field}: give at least one role"));
            }
            let event_types = PatternSet::parse(&token.event_types)
                .map_err(|(i, error)| format!("{field}: event_types[{i}]: {error}"))?;
            let subscriptions = subscription_patterns(&token.subscriptions)
                .map_err(|error| format!("{field}: subscriptions: {error}"))?;
            let has = |role| token.roles.contains(&role);
            entries.push((
                digest,
                Principal {
                    name: token.name.clone(),
                    publisher: has(Role::Publisher).then(|| PublishScope {
                        event_types,
                        aggregate_types: token.aggregate_types.clone(),
                        sources: token.sources.clone(),
                    }),
                    subscriber: has(Role::Subscriber).then_some(subscriptions),
                    admin: has(Role::Admin),
                    viewer: has(Role::Viewer),
                },
            ));
        }
        Ok(Authenticator { tokens: entries })
    }

    /// The principal of an `authorization: Bearer <token>` header value.
    pub fn authenticate(&self, authorization: Option<&str>) -> Result<Principal> {
        // RFC 7235: the scheme is a case-insensitive token, then at least one space.
        let token = authorization
            .and_then(|value| value.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
            .filter(|token| !token.is_empty())
            .ok_or_else(|| {
                Refusal::Unauthenticated("send a bearer token in the authorization metadata".into())
            })?;
        self.authenticate_token(token)
    }

    /// The principal of a token itself (a console sign-in).
    pub fn authenticate_token(&self, token: &str) -> Result<Principal> {
        let presented: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        // Compare against every digest without stopping early, in constant time each.
        let mut found = None;
        for (digest, principal) in &self.tokens {
            if bool::from(digest.ct_eq(&presented)) {
                found = Some(principal);
            }
        }
        found
            .cloned()
            .ok_or_else(|| Refusal::Unauthenticated("unknown token".into()))
    }
}

fn decode_digest(hex: &str) -> Option<[u8; 32]> {
    let mut digest = [0u8; 32];
    hex::decode_to_slice(hex, &mut digest).ok()?;
    Some(digest)
}

/// Hex SHA-256 of a token, as the configuration stores it.
pub fn token_digest(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(token: &str, roles: Vec<Role>) -> TokenConfig {
        TokenConfig {
            name: "svc".into(),
            sha256: token_digest(token),
            roles,
            event_types: vec!["billing.**".into()],
            aggregate_types: vec![],
            subscriptions: vec!["billing-*".into()],
            sources: vec![],
        }
    }

    #[test]
    fn authenticates_only_known_tokens() {
        let auth = Authenticator::new(&[config("s3cret", vec![Role::Subscriber])]).unwrap();
        assert_eq!(
            auth.authenticate(Some("Bearer s3cret")).unwrap().name,
            "svc"
        );
        assert!(matches!(
            auth.authenticate(Some("Bearer nope")),
            Err(Refusal::Unauthenticated(_))
        ));
        assert!(matches!(
            auth.authenticate(None),
            Err(Refusal::Unauthenticated(_))
        ));
        assert!(matches!(
            auth.authenticate(Some("s3cret")),
            Err(Refusal::Unauthenticated(_))
        ));
        for scheme in ["bearer", "BEARER", "bEaReR"] {
            assert_eq!(
                auth.authenticate(Some(&format!("{scheme} s3cret")))
                    .unwrap()
                    .name,
                "svc"
            );
        }
        assert!(matches!(
            auth.authenticate(Some("Basic s3cret")),
            Err(Refusal::Unauthenticated(_))
        ));
    }

    #[test]
    fn scopes_limit_what_a_role_allows() {
        let auth = Authenticator::new(&[config("t", vec![Role::Subscriber])]).unwrap();
        let principal = auth.authenticate(Some("Bearer t")).unwrap();
        let name = |n: &str| SubscriptionName::parse("subscription", n).unwrap();
        principal.check_subscription(&name("billing-eu")).unwrap();
        assert!(principal.check_subscription(&name("orders")).is_err());
        assert!(principal.check_admin().is_err());
        assert!(
            principal
                .check_publish(&[], &SourceName::default_source())
                .is_err(),
            "no publisher role"
        );
        assert!(principal.check_view().is_err(), "no viewer role");
    }

    #[test]
    fn viewers_read_and_admins_read_and_change() {
        let auth = Authenticator::new(&[
            TokenConfig {
                name: "viewer".into(),
                ..config("v", vec![Role::Viewer])
            },
            config("a", vec![Role::Admin]),
        ])
        .unwrap();
        let viewer = auth.authenticate(Some("Bearer v")).unwrap();
        viewer.check_view().unwrap();
        assert!(viewer.check_admin().is_err());
        assert!(!viewer.is_admin());
        let admin = auth.authenticate(Some("Bearer a")).unwrap();
        admin.check_view().unwrap();
        admin.check_admin().unwrap();
    }

    #[test]
    fn globs_match_any_run_of_characters() {
        let matches = |pattern: &str, name: &str| {
            subscription_patterns(&[pattern.to_owned()])
                .unwrap()
                .is_match(name)
        };
        assert!(matches("billing-*", "billing-eu"));
        assert!(matches("*-eu", "billing-eu"));
        assert!(matches("a*b*c", "a-x-b-y-c"));
        assert!(matches("a**c", "a.b.c"));
        assert!(!matches("billing-*", "orders"));
        assert!(matches("orders", "orders"));
        assert!(!matches("orders", "orders-eu"));
        // Only `*` is a wildcard.
        assert!(!matches("order?", "orders"));
        assert!(matches("order?", "order?"));
        assert!(!matches("{a,b}", "a"));
        assert!(!matches("[ab]", "a"));
    }

    #[test]
    fn digests_are_lowercase_hex_of_sha256() {
        assert_eq!(
            token_digest("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let upper = token_digest("abc").to_uppercase();
        assert_eq!(decode_digest(&upper), decode_digest(&token_digest("abc")));
        assert_eq!(decode_digest("ab"), None);
        assert_eq!(decode_digest(&"zz".repeat(32)), None);
    }

    #[test]
    fn rejects_malformed_configuration() {
        let mut bad = config("t", vec![Role::Admin]);
        bad.sha256 = "xyz".into();
        assert!(Authenticator::new(&[bad]).unwrap_err().contains("sha256"));
        assert!(
            Authenticator::new(&[config("t", vec![])])
                .unwrap_err()
                .contains("role")
        );
    }
}
