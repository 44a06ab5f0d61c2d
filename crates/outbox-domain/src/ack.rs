//! Ack ids: opaque to clients, they name one lease of one event — its source, its
//! position, the attempt and the lease holder's token — so settling a delivery is a
//! compare-and-set that a late ack from a lost lease can never win.
//!
//! Text form: `position-attempt-token` (decimal, decimal, 16 hex digits) for the
//! `default` source, `source/position-attempt-token` for any other; ack ids issued before
//! there were several sources stay valid. Ack ids handed to Subscribe consumers end in
//! `-seal` (16 hex digits, see [`AckSeal`]), which the gateway's own settlement ignores and
//! `outbox_consume` checks.

use super::{
    lease::{LeaseId, LeaseKey},
    source::{SourceId, SourceName},
    subscription::SubscriptionId,
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
        let mut parts = lease.splitn(4, '-');
        let position = parts.next()?.parse::<i64>().ok().filter(|p| *p > 0)?;
        let attempt = parts.next()?.parse::<i32>().ok().filter(|a| *a > 0)?;
        let lease_token = hex_u64(parts.next()?)? as i64;
        // The seal proves where the ack id came from to `outbox_consume`; a lease is
        // settled by compare-and-set, which needs no proof.
        if let Some(seal) = parts.next() {
            hex_u64(seal)?;
        }
        Some(AckId {
            source,
            position,
            attempt,
            lease_token,
        })
    }

    /// The text form, given the name of this ack id's source.
    pub fn to_text(&self, source: &SourceName) -> String {
        let mut text = String::with_capacity(TEXT_CAPACITY);
        self.write_text(source, &mut text);
        text
    }

    // Written piece by piece rather than with `write!`: every delivery writes one, and
    // the formatting machinery cost more than the HMAC of the seal.
    fn write_text(&self, source: &SourceName, out: &mut String) {
        if !source.is_default() {
            out.push_str(source.as_str());
            out.push('/');
        }
        out.push_str(itoa::Buffer::new().format(self.position));
        out.push('-');
        out.push_str(itoa::Buffer::new().format(self.attempt));
        out.push('-');
        push_hex_u64(out, self.lease_token as u64);
    }
}

/// Room for the text form of most ack ids, seal included, so writing one allocates once.
const TEXT_CAPACITY: usize = 64;

/// Appends `value` as exactly 16 lowercase hex digits.
fn push_hex_u64(out: &mut String, value: u64) {
    let mut digits = [0u8; 16];
    hex::encode_to_slice(value.to_be_bytes(), &mut digits).expect("16 digits for 8 bytes");
    out.push_str(std::str::from_utf8(&digits).expect("hex digits are ASCII"));
}

/// Exactly 16 hex digits.
fn hex_u64(text: &str) -> Option<u64> {
    if text.len() != 16 {
        return None;
    }
    u64::from_str_radix(text, 16).ok()
}

/// Seals ack ids for `outbox_consume`: HMAC-SHA256, under a key shared by every source of
/// the gateway, of `subscription_id:ack_id`, cut to 64 bits. A consumer's database can
/// then tell an ack id the gateway handed out for a subscription from a forged one, or
/// one of another subscription, without asking the gateway.
#[derive(Clone)]
pub struct AckSeal {
    key: Vec<u8>,
    hmac: ring::hmac::Key,
}

impl std::fmt::Debug for AckSeal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AckSeal(..)")
    }
}

impl AckSeal {
    /// Bytes of a newly generated key.
    pub const KEY_BYTES: usize = 32;

    pub fn new(key: Vec<u8>) -> AckSeal {
        let hmac = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &key);
        AckSeal { key, hmac }
    }

    /// A new random key.
    pub fn generate() -> AckSeal {
        AckSeal::new((0..Self::KEY_BYTES).map(|_| rand::random::<u8>()).collect())
    }

    pub fn key(&self) -> &[u8] {
        &self.key
    }

    /// HMAC's inner and outer pads of the key (a key of at most one SHA-256 block), with
    /// which `outbox_consume` computes the HMAC from `sha256()` alone.
    pub fn pads(&self) -> (Vec<u8>, Vec<u8>) {
        let mut block = [0u8; 64];
        block[..self.key.len().min(64)].copy_from_slice(&self.key[..self.key.len().min(64)]);
        (
            block.iter().map(|byte| byte ^ 0x36).collect(),
            block.iter().map(|byte| byte ^ 0x5c).collect(),
        )
    }

    /// The text form of `ack` with its seal for `subscription`.
    pub fn seal(&self, subscription: SubscriptionId, ack: &AckId, source: &SourceName) -> String {
        // `subscription_id:` then the ack id, in one buffer: the MAC's input is its
        // prefix, and the seal is appended to the ack id after it.
        let mut text = String::with_capacity(TEXT_CAPACITY);
        text.push_str(itoa::Buffer::new().format(subscription.0));
        text.push(':');
        let ack_starts = text.len();
        ack.write_text(source, &mut text);
        let tag = ring::hmac::sign(&self.hmac, text.as_bytes());
        let seal = u64::from_be_bytes(tag.as_ref()[..8].try_into().expect("8 bytes"));
        text.push('-');
        push_hex_u64(&mut text, seal);
        text.drain(..ack_starts);
        text
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
        let ack = AckId {
            source: SourceId(1),
            position: 42,
            attempt: 3,
            lease_token: -7,
        };
        let billing = SourceName::parse("source", "billing").unwrap();
        assert_eq!(ack.to_text(&billing), "billing/42-3-fffffffffffffff9");
        assert!(
            !AckId::parse("1-1-0000000000000001", sources)
                .unwrap()
                .to_text(&SourceName::default_source())
                .contains('/')
        );
    }

    #[test]
    fn sealed_text_parses_as_the_same_lease() {
        let ack = AckId {
            source: SourceId(1),
            position: 7,
            attempt: 1,
            lease_token: 99,
        };
        let seal = AckSeal::new(b"key".to_vec());
        let billing = SourceName::parse("source", "billing").unwrap();
        let sealed = seal.seal(SubscriptionId(5), &ack, &billing);
        assert_eq!(sealed.len(), ack.to_text(&billing).len() + 17);
        assert_eq!(AckId::parse(&sealed, sources), Some(ack));
        assert_ne!(sealed, seal.seal(SubscriptionId(6), &ack, &billing));
        assert_ne!(
            sealed,
            AckSeal::new(b"other".to_vec()).seal(SubscriptionId(5), &ack, &billing)
        );
    }

    #[test]
    fn the_pads_give_the_same_hmac_from_plain_sha256() {
        use sha2::{Digest, Sha256};
        let seal = AckSeal::new(b"a key".to_vec());
        let ack = AckId {
            source: SourceId(0),
            position: 3,
            attempt: 2,
            lease_token: -1,
        };
        let sealed = seal.seal(SubscriptionId(11), &ack, &SourceName::default_source());
        let (inner, outer) = seal.pads();
        let message = format!("11:{}", ack.to_text(&SourceName::default_source()));
        let inner_hash = Sha256::new()
            .chain_update(&inner)
            .chain_update(message.as_bytes())
            .finalize();
        let hmac = Sha256::new()
            .chain_update(&outer)
            .chain_update(inner_hash)
            .finalize();
        assert!(sealed.ends_with(&format!("-{}", hex::encode(&hmac[..8]))));
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
            "1-1-0000000000000001-",
            "1-1-0000000000000001-00000000000000zz",
            "1-1-0000000000000001-0000000000000000-0000000000000000",
        ] {
            assert_eq!(AckId::parse(bad, sources), None, "{bad:?}");
        }
    }
}
