//! Which names the console answers to when no tokens are configured: a guard against DNS
//! rebinding. Without tokens every browser that reaches the console is an admin, and a
//! page of any site can reach a loopback console through a name its DNS server points at
//! 127.0.0.1 (`http://rebind.example:9465`): to the browser that is the site's own origin,
//! so neither the same-origin policy nor the Origin check stops it. Such a name is the one
//! thing the page cannot hide, as the Host header. Loopback names (which browsers resolve
//! themselves, never through DNS) and literal addresses cannot be rebound; any other name
//! must be listed by the operator.

use std::net::{IpAddr, Ipv6Addr};

use crate::domain::AllowedHosts;

/// The host of a Host header (or request authority), lowercase, an IPv6 address without
/// brackets, without a trailing dot; `None` when it is not `host[:port]`.
pub fn host_of(authority: &str) -> Option<String> {
    let (host, port) = match authority.strip_prefix('[') {
        Some(rest) => {
            let (address, after) = rest.split_once(']')?;
            address.parse::<Ipv6Addr>().ok()?;
            (address, after)
        }
        None => {
            let end = authority.find(':').unwrap_or(authority.len());
            authority.split_at(end)
        }
    };
    let port_ok = port.is_empty()
        || port
            .strip_prefix(':')
            .is_some_and(|digits| digits.len() <= 5 && digits.bytes().all(|b| b.is_ascii_digit()));
    let host = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
    (port_ok && !host.is_empty()).then_some(host)
}

/// Whether a token-less console answers a request for `authority`: a literal address, a
/// loopback name, or a name the operator listed.
pub fn is_allowed(authority: &str, listed: &AllowedHosts) -> bool {
    let Some(host) = host_of(authority) else {
        return false;
    };
    host.parse::<IpAddr>().is_ok()
        || host == "localhost"
        || host.ends_with(".localhost")
        || listed.allowance(&host).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_names_and_literal_addresses_are_answered() {
        let none = AllowedHosts::default();
        for allowed in [
            "127.0.0.1",
            "127.0.0.1:9465",
            "10.1.2.3:80",
            "[::1]",
            "[::1]:9465",
            "[fd00::1]:9465",
            "localhost",
            "LOCALHOST:9465",
            "localhost.:9465",
            "console.localhost:9465",
        ] {
            assert!(is_allowed(allowed, &none), "{allowed}");
        }
        for refused in [
            "rebind.example",
            "rebind.example:9465",
            "localhost.evil.example",
            "127.0.0.1.evil.example:9465",
            "evil-localhost",
            "::1",
            "[::1",
            "[evil.example]:80",
            "127.0.0.1:port",
            "127.0.0.1:+80",
            "localhost:9465:1",
            "",
            ":9465",
        ] {
            assert!(!is_allowed(refused, &none), "{refused}");
        }
    }

    #[test]
    fn listed_names_are_answered_too() {
        let listed = AllowedHosts::parse(&[
            "console.internal".to_owned(),
            "*.ops.example.com".to_owned(),
        ])
        .unwrap();
        for allowed in [
            "console.internal",
            "Console.Internal:9465",
            "gw-1.ops.example.com:9465",
        ] {
            assert!(is_allowed(allowed, &listed), "{allowed}");
        }
        for refused in [
            "internal",
            "ops.example.com",
            "console.internal.evil.example",
        ] {
            assert!(!is_allowed(refused, &listed), "{refused}");
        }
    }
}
