//! Event-type patterns: exact types, `*` for exactly one segment and a trailing `**` for
//! one or more segments. Patterns are matched in the database as one POSIX regular
//! expression per pattern set, so a claim filters events without shipping them.

use std::fmt;

use super::input::Echo;

/// One validated pattern, e.g. `order.*` or `billing.**`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventTypePattern(String);

impl EventTypePattern {
    pub fn parse(pattern: &str) -> Result<Self, String> {
        if pattern.is_empty() {
            return Err("pattern must not be empty".into());
        }
        if pattern.len() > 255 {
            return Err(format!("pattern is {} bytes, more than 255", pattern.len()));
        }
        let segments: Vec<&str> = pattern.split('.').collect();
        for (index, segment) in segments.iter().enumerate() {
            let is_last = index + 1 == segments.len();
            match *segment {
                "" => return Err(format!("{} has an empty segment", Echo(pattern))),
                "*" => {}
                "**" if is_last => {}
                "**" => {
                    return Err(format!(
                        "{}: `**` may only be the last segment",
                        Echo(pattern)
                    ));
                }
                literal
                    if literal
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') => {}
                _ => {
                    return Err(format!(
                        "{}: segments are [A-Za-z0-9_-], `*` or a final `**`",
                        Echo(pattern)
                    ));
                }
            }
        }
        Ok(EventTypePattern(pattern.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The pattern as an unanchored POSIX regex body.
    fn regex_body(&self) -> String {
        const SEGMENT: &str = "[A-Za-z0-9_-]+";
        let segments: Vec<String> = self
            .0
            .split('.')
            .map(|segment| match segment {
                "*" => SEGMENT.to_owned(),
                "**" => format!("{SEGMENT}(\\.{SEGMENT})*"),
                // Literal segments only hold [A-Za-z0-9_-]: nothing to escape but the
                // dot separators added below.
                literal => literal.to_owned(),
            })
            .collect();
        segments.join("\\.")
    }

    pub fn matches(&self, event_type: &str) -> bool {
        fn matches_from(pattern: &[&str], event: &[&str]) -> bool {
            match (pattern.first(), event.first()) {
                (Some(&"**"), _) => !event.is_empty(),
                (Some(&"*"), Some(_)) => matches_from(&pattern[1..], &event[1..]),
                (Some(literal), Some(segment)) => {
                    literal == segment && matches_from(&pattern[1..], &event[1..])
                }
                (None, None) => true,
                _ => false,
            }
        }
        let pattern: Vec<&str> = self.0.split('.').collect();
        let event: Vec<&str> = event_type.split('.').collect();
        matches_from(&pattern, &event)
    }
}

impl fmt::Display for EventTypePattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Patterns of which any may match; empty matches nothing by itself (callers decide what
/// an empty set means).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PatternSet(Vec<EventTypePattern>);

impl PatternSet {
    /// Parses every pattern; the error names the index of the first bad one.
    pub fn parse<S: AsRef<str>>(patterns: &[S]) -> Result<Self, (usize, String)> {
        patterns
            .iter()
            .enumerate()
            .map(|(index, pattern)| {
                EventTypePattern::parse(pattern.as_ref()).map_err(|e| (index, e))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(PatternSet)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Holds the set to the bounds of a filter list, naming `field`. Not part of
    /// [`PatternSet::parse`]: sets stored before the bounds still load.
    pub fn check_size(&self, field: &str) -> super::refusal::Result<()> {
        let bytes = self.0.iter().map(|pattern| pattern.0.len()).sum();
        super::input::check_filter_size(field, self.0.len(), bytes)
    }

    pub fn patterns(&self) -> &[EventTypePattern] {
        &self.0
    }

    pub fn to_strings(&self) -> Vec<String> {
        self.0.iter().map(|p| p.0.clone()).collect()
    }

    /// One anchored regex matching any pattern of the set, or `None` for an empty set.
    pub fn to_regex(&self) -> Option<String> {
        if self.0.is_empty() {
            return None;
        }
        let alternatives: Vec<String> = self.0.iter().map(EventTypePattern::regex_body).collect();
        Some(format!("^({})$", alternatives.join("|")))
    }

    pub fn matches(&self, event_type: &str) -> bool {
        self.0.iter().any(|pattern| pattern.matches(event_type))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_star_matches_exactly_one_segment() {
        let pattern = EventTypePattern::parse("order.*").unwrap();
        assert!(pattern.matches("order.created"));
        assert!(!pattern.matches("order.item.added"));
        assert!(!pattern.matches("order"));
        assert!(!pattern.matches("invoice.created"));
    }

    #[test]
    fn double_star_matches_one_or_more_trailing_segments() {
        let pattern = EventTypePattern::parse("order.**").unwrap();
        assert!(pattern.matches("order.created"));
        assert!(pattern.matches("order.item.added"));
        assert!(!pattern.matches("order"));
        assert!(
            EventTypePattern::parse("**")
                .unwrap()
                .matches("anything.at.all")
        );
    }

    #[test]
    fn rejects_malformed_patterns() {
        for bad in [
            "",
            "order..created",
            "**.created",
            "order.**.x",
            "order.cre*ted",
            ".order",
        ] {
            assert!(
                EventTypePattern::parse(bad).is_err(),
                "{bad:?} should be rejected"
            );
        }
    }

    #[test]
    fn regex_agrees_with_the_matcher() {
        // The database evaluates `to_regex`; check its shape on the cases above.
        let set = PatternSet::parse(&["order.*", "billing.**", "user.created"]).unwrap();
        assert_eq!(
            set.to_regex().unwrap(),
            "^(order\\.[A-Za-z0-9_-]+|billing\\.[A-Za-z0-9_-]+(\\.[A-Za-z0-9_-]+)*|user\\.created)$"
        );
        assert!(PatternSet::default().to_regex().is_none());
        assert_eq!(
            PatternSet::parse(&["a", "b.*.**", "c..d"]).unwrap_err().0,
            2
        );
    }
}
