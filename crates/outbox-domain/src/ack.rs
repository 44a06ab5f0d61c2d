//! Ack ids: opaque to clients, they name one lease of one event — its source, its
//! position, the attempt and the lease holder's token — so settling a delivery is a
//! compare-and-set that a late ack from a lost lease can never win.
//!
//! Text form: `position-attempt-token` (decimal, decimal, 16 hex digits) for the
//! `default` source, `source/position-attempt-token` for any other; ack ids issued before
//! there were several sources stay valid.

use super::{
    lease::{LeaseId, LeaseKey},
    source::{SourceId, SourceName},
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AckId {
    pub source: SourceId,
    pub position: i64,
    pub attempt: i32,
    pub lease_token: i64,
}

impl AckId {
    /// The lease this ack id settles, in its source.
    pub fn lease(&self) -> LeaseId {
        LeaseId {
            position: self.position,
            token: self.lease_token,
        }
    }

    /// Where this gateway keeps the lease.
    pub fn lease_key(&self) -> LeaseKey {
        self.lease().key_in(self.source)
    }

    /// Parses the text form; `source_id` finds a source by name (`None`: not one of this
    /// gateway's). `None` for anything malformed.
    pub fn parse(text: &str, source_id: impl Fn(&str) -> Option<SourceId>) -> Option<AckId> {
        let (source, lease) = match text.split_once('/') {
            Some((name, lease)) => (source_id(name)?, lease),
            None => (source_id(super::source::DEFAULT_SOURCE)?, text),
        };
        let mut parts = lease.splitn(3, '-');
        let position = parts.next()?.parse::<i64>().ok().filter(|p| *p > 0)?;
        let attempt = parts.next()?.parse::<i32>().ok().filter(|a| *a > 0)?;
        let token = parts.next()?;
        if token.len() != 16 {
            return None;
        }
        let lease_token = u64::from_str_radix(token, 16).ok()? as i64;
        Some(AckId {
            source,
            position,
            attempt,
            lease_token,
        })
    }

    /// The text form, given the name of this ack id's source.
    pub fn to_text(&self, source: &SourceName) -> String {
        let lease = format!(
            "{}-{}-{:016x}",
            self.position, self.attempt, self.lease_token as u64
        );
        if source.is_default() {
            lease
        } else {
            format!("{source}/{lease}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sources(name: &str) -> Option<SourceId> {
        match name {
            "default" => Some(SourceId(0)),
            "billing" => Some(SourceId(1)),
            _ => None,
        }
    }

    #[test]
    fn round_trips_through_text() {
        for (source, name) in [(0, "default"), (1, "billing")] {
            let ack = AckId {
                source: SourceId(source),
                position: 42,
                attempt: 3,
                lease_token: -7,
            };
            let name = SourceName::parse("source", name).unwrap();
            assert_eq!(AckId::parse(&ack.to_text(&name), sources), Some(ack));
        }
        assert!(
            !AckId::parse("1-1-0000000000000001", sources)
                .unwrap()
                .to_text(&SourceName::default_source())
                .contains('/')
        );
    }

    #[test]
    fn rejects_malformed_text() {
        for bad in [
            "",
            "1-1",
            "x-1-0000000000000001",
            "1-0-0000000000000001",
            "1-1-01",
            "-1-1-0000000000000001",
            "1-1-000000000000000g",
            "unknown/1-1-0000000000000001",
            "billing/",
            "/1-1-0000000000000001",
        ] {
            assert_eq!(AckId::parse(bad, sources), None, "{bad:?}");
        }
    }
}
