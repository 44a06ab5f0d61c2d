//! Ack ids: opaque to clients, they name one lease of one event — its position, the
//! attempt and the lease holder's token — so settling a delivery is a compare-and-set
//! that a late ack from a lost lease can never win.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AckId {
    pub position: i64,
    pub attempt: i32,
    pub lease_token: i64,
}

impl AckId {
    /// Parses the text form `position-attempt-token` (decimal, decimal, hex).
    pub fn parse(text: &str) -> Option<AckId> {
        let mut parts = text.splitn(3, '-');
        let position = parts.next()?.parse::<i64>().ok().filter(|p| *p > 0)?;
        let attempt = parts.next()?.parse::<i32>().ok().filter(|a| *a > 0)?;
        let token = parts.next()?;
        if token.len() != 16 {
            return None;
        }
        let lease_token = u64::from_str_radix(token, 16).ok()? as i64;
        Some(AckId {
            position,
            attempt,
            lease_token,
        })
    }
}

impl fmt::Display for AckId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}-{}-{:016x}",
            self.position, self.attempt, self.lease_token as u64
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_text() {
        let ack = AckId {
            position: 42,
            attempt: 3,
            lease_token: -7,
        };
        assert_eq!(AckId::parse(&ack.to_string()), Some(ack));
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
        ] {
            assert_eq!(AckId::parse(bad), None, "{bad:?}");
        }
    }
}
