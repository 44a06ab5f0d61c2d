//! Rules every caller-supplied value must meet before it reaches the database, so that
//! whatever the protobuf allows is either stored faithfully or refused with a message
//! naming the field — never refused by PostgreSQL as an internal error.

use std::fmt;

use chrono::{DateTime, Utc};

use super::refusal::{Refusal, Result};

/// Deepest nesting of arrays and objects a JSON payload may have: serde_json's (its
/// recursion limit of 128 admits 127 levels), which
/// parses payloads for filters, transforms and push bodies, so that every payload
/// Publish accepts is one they can read (a deeper one would fail each filter, and be
/// delivered as text by a transform). Common consumer libraries stop near there too;
/// PostgreSQL's own parser goes past ten thousand.
pub const MAX_JSON_DEPTH: usize = 127;

/// Earliest and latest instants accepted anywhere: the range of protobuf's `Timestamp`
/// (years 1 to 9999), well inside PostgreSQL's `timestamptz`.
pub fn earliest_timestamp() -> DateTime<Utc> {
    DateTime::from_timestamp(-62_135_596_800, 0).expect("0001-01-01T00:00:00Z")
}

pub fn latest_timestamp() -> DateTime<Utc> {
    DateTime::from_timestamp(253_402_300_799, 999_999_000).expect("9999-12-31T23:59:59.999999Z")
}

/// An instant within [`earliest_timestamp`] and [`latest_timestamp`].
pub fn check_timestamp(field: impl Into<String>, time: DateTime<Utc>) -> Result<()> {
    if time < earliest_timestamp() || time > latest_timestamp() {
        return Err(Refusal::invalid(
            field,
            "must be between 0001-01-01T00:00:00Z and 9999-12-31T23:59:59Z",
        ));
    }
    Ok(())
}

/// PostgreSQL text cannot hold the NUL character.
pub fn check_text(field: impl Into<String>, value: &str) -> Result<()> {
    if value.contains('\0') {
        return Err(Refusal::invalid(
            field,
            "must not contain the NUL character",
        ));
    }
    Ok(())
}

/// Checks every string of a list with [`check_text`], naming the index.
pub fn check_texts<S: AsRef<str>>(field: &str, values: &[S]) -> Result<()> {
    for (index, value) in values.iter().enumerate() {
        check_text(format!("{field}[{index}]"), value.as_ref())?;
    }
    Ok(())
}

/// Most entries of one filter list (event-type patterns, aggregate types, metadata
/// pairs). Event-type patterns become one regular expression per list, which PostgreSQL
/// refuses as "too complex" somewhere past a few hundred kilobytes; these bounds keep
/// the worst case near 64 KB of expression, which it compiles, and are far beyond what
/// a subscription needs.
pub const MAX_FILTER_ENTRIES: usize = 100;
/// Most bytes of one filter list, all entries together.
pub const MAX_FILTER_BYTES: usize = 8 * 1024;

/// Holds a filter list of `entries` entries totalling `bytes` bytes to the bounds above.
pub fn check_filter_size(field: impl Into<String>, entries: usize, bytes: usize) -> Result<()> {
    if entries > MAX_FILTER_ENTRIES || bytes > MAX_FILTER_BYTES {
        return Err(Refusal::invalid(
            field,
            format!(
                "has {entries} entries of {bytes} bytes in all; at most {MAX_FILTER_ENTRIES} entries \
                 and {MAX_FILTER_BYTES} bytes are allowed"
            ),
        ));
    }
    Ok(())
}

/// A JSON document as PostgreSQL's `json` type accepts it: UTF-8 throughout (also
/// inside strings, which a parser skipping over them would not check), well-formed, and
/// nested at most [`MAX_JSON_DEPTH`] deep. The error says what is wrong.
pub fn check_json(payload: &[u8]) -> std::result::Result<(), String> {
    let text =
        std::str::from_utf8(payload).map_err(|error| format!("is not valid UTF-8: {error}"))?;
    let depth = json_depth(text.as_bytes());
    if depth > MAX_JSON_DEPTH {
        return Err(format!(
            "nests arrays and objects {depth} deep, more than the limit of {MAX_JSON_DEPTH}"
        ));
    }
    serde_json::from_str::<serde::de::IgnoredAny>(text)
        .map(|_| ())
        .map_err(|error| format!("is not valid JSON: {error}"))
}

/// The deepest nesting of brackets outside strings; cheap enough for every payload.
fn json_depth(bytes: &[u8]) -> usize {
    let (mut depth, mut deepest) = (0usize, 0usize);
    let (mut in_string, mut escaped) = (false, false);
    for &byte in bytes {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

/// A caller's value quoted in a message, cut short when long: error messages travel in
/// gRPC metadata, which clients cap at a few kilobytes.
pub struct Echo<'a>(pub &'a str);

/// Characters of a value that an error message repeats.
const ECHO_CHARS: usize = 64;

impl fmt::Display for Echo<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.char_indices().nth(ECHO_CHARS) {
            None => write!(f, "{:?}", self.0),
            Some((cut, _)) => write!(f, "{:?}… ({} bytes)", &self.0[..cut], self.0.len()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_must_be_utf8_well_formed_and_shallow() {
        assert!(check_json(br#"{"a": ["x", {"b": null}]}"#).is_ok());
        assert!(check_json(b"{\"a\": \"\xff\"}").is_err());
        assert!(check_json(b"{\"a\": ").is_err());
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert!(check_json(deep(MAX_JSON_DEPTH).as_bytes()).is_ok());
        assert!(check_json(deep(MAX_JSON_DEPTH + 1).as_bytes()).is_err());
        // What Publish accepts, a filter or transform can parse: one limit everywhere.
        let deepest_object = format!(
            "{}1{}",
            r#"{"a":"#.repeat(MAX_JSON_DEPTH),
            "}".repeat(MAX_JSON_DEPTH)
        );
        assert!(check_json(deepest_object.as_bytes()).is_ok());
        assert!(serde_json::from_str::<serde_json::Value>(&deepest_object).is_ok());
        assert!(serde_json::from_str::<serde_json::Value>(&deep(MAX_JSON_DEPTH)).is_ok());
        assert!(serde_json::from_str::<serde_json::Value>(&deep(MAX_JSON_DEPTH + 1)).is_err());
        // Brackets inside strings do not count.
        let quoted = format!("[\"{}\"]", "[".repeat(10_000));
        assert!(check_json(quoted.as_bytes()).is_ok());
        assert!(check_json(br#"["\"[[[", 1]"#).is_ok());
    }

    #[test]
    fn echoes_are_bounded() {
        assert_eq!(Echo("short").to_string(), "\"short\"");
        let long = "é".repeat(10_000);
        let echoed = Echo(&long).to_string();
        assert!(echoed.len() < 200, "{echoed}");
        assert!(echoed.ends_with("(20000 bytes)"), "{echoed}");
    }

    #[test]
    fn nul_is_refused() {
        assert!(check_text("x", "a\0b").is_err());
        assert!(check_text("x", "ab").is_ok());
        assert!(check_texts("xs", &["a", "b\0"]).is_err());
    }
}
