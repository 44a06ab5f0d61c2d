//! Sources: the databases the gateway relays events from, each named. `default` is the
//! gateway's own database (`--database-url`), which also holds the subscription
//! definitions.

use std::{fmt, sync::Arc};

use super::input::Echo;
use super::refusal::{Refusal, Result};

/// The name of the gateway's own database as a source.
pub const DEFAULT_SOURCE: &str = "default";

/// A validated source name: `[a-z0-9][a-z0-9_-]{0,62}`. Cheap to clone: every event
/// carries one.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SourceName(Arc<str>);

impl SourceName {
    pub fn parse(field: &str, name: &str) -> Result<Self> {
        let mut bytes = name.bytes();
        let first_ok = bytes
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
        let rest_ok =
            bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
        if !first_ok || !rest_ok || name.len() > 63 {
            return Err(Refusal::invalid(
                field,
                format!(
                    "{} is not a valid source name: [a-z0-9][a-z0-9_-]{{0,62}}",
                    Echo(name)
                ),
            ));
        }
        Ok(SourceName(name.into()))
    }

    pub fn default_source() -> Self {
        SourceName(DEFAULT_SOURCE.into())
    }

    pub fn is_default(&self) -> bool {
        &*self.0 == DEFAULT_SOURCE
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SourceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for SourceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A source's place in this gateway's list (`default` is 0): compact for leases and ack
/// ids in memory. Ack ids name sources by name on the wire, since replicas may list their
/// sources in another order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct SourceId(pub u16);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_documented_shape() {
        for good in ["default", "orders", "billing-eu_2", &"a".repeat(63)] {
            SourceName::parse("name", good).unwrap();
        }
        for bad in ["", "Orders", "-x", "a.b", "a/b", &"a".repeat(64)] {
            assert!(SourceName::parse("name", bad).is_err(), "{bad:?}");
        }
        assert!(SourceName::default_source().is_default());
    }
}
