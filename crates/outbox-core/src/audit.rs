//! The audit trail: one INFO line under the `audit` tracing target for every change an
//! administrator makes — over gRPC (the CLI included) or the console — saying who (the
//! token's name, or `anonymous` on a gateway without tokens), through what, which action
//! on which subscription and selection, and how many records it changed. Operators route
//! the target on its own (`RUST_LOG=info,audit=info` keeps it; a JSON log shipper can
//! filter on `"target":"audit"`).
//!
//! The adapters call [`record`] once the core has answered: they know the caller, the
//! core knows the count. Refused calls are logged where they are refused (the
//! authentication layer, the console's sign-in); dry runs and readings change nothing
//! and leave no line.

use std::fmt::Write as _;

use uuid::Uuid;

use crate::domain::{DeadLetterSelection, SourceName, StartPosition, SubscriptionName};

/// The tracing target of audit lines.
pub const TARGET: &str = "audit";

/// The door an action came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// The gRPC API, which the CLI uses.
    Grpc,
    /// The web console.
    Console,
}

impl Via {
    pub fn as_str(self) -> &'static str {
        match self {
            Via::Grpc => "grpc",
            Via::Console => "console",
        }
    }
}

/// Which subscription an action changed: one, or every one an event reaches.
#[derive(Debug, Clone, Copy)]
pub enum Target<'a> {
    One(&'a SubscriptionName),
    /// A requeue of an event on every subscription that received it.
    Every,
}

impl std::fmt::Display for Target<'_> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::One(name) => write!(formatter, "{name}"),
            Target::Every => formatter.write_str("*"),
        }
    }
}

impl<'a> From<&'a SubscriptionName> for Target<'a> {
    fn from(name: &'a SubscriptionName) -> Self {
        Target::One(name)
    }
}

impl<'a> From<Option<&'a SubscriptionName>> for Target<'a> {
    fn from(name: Option<&'a SubscriptionName>) -> Self {
        name.map_or(Target::Every, Target::One)
    }
}

/// Logs one audit line. `selector` says what the action took within the subscription
/// (see [`Selector`]); `changed` counts the records it changed.
pub fn record(
    principal: &str,
    via: Via,
    action: &str,
    subscription: Target<'_>,
    selector: &Selector,
    changed: u64,
) {
    let via = via.as_str();
    if selector.0.is_empty() {
        tracing::info!(target: TARGET, principal, via, action, %subscription, changed, "admin action");
    } else {
        let selector = selector.0.as_str();
        tracing::info!(target: TARGET, principal, via, action, %subscription, selector, changed, "admin action");
    }
}

/// Most event ids an audit line lists; more are counted.
const MAX_LISTED_IDS: usize = 10;

/// What an action took, as `key=value` pairs (values quoted where they are free text).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector(String);

impl Selector {
    pub fn none() -> Selector {
        Selector::default()
    }

    /// Adds `key=value`.
    pub fn with(mut self, key: &str, value: impl std::fmt::Display) -> Selector {
        if !self.0.is_empty() {
            self.0.push(' ');
        }
        let _ = write!(self.0, "{key}={value}");
        self
    }

    /// Adds `key="text"`, quoted and escaped: free text may hold spaces and quotes.
    pub fn with_text(self, key: &str, text: &str) -> Selector {
        self.with(key, format_args!("{text:?}"))
    }

    /// Adds `key=value` when there is a value.
    pub fn with_some(self, key: &str, value: Option<impl std::fmt::Display>) -> Selector {
        match value {
            Some(value) => self.with(key, value),
            None => self,
        }
    }

    pub fn event(self, id: Uuid, source: Option<&SourceName>) -> Selector {
        self.with("event", id).with_some("source", source)
    }

    pub fn start(self, key: &str, position: &StartPosition) -> Selector {
        match position {
            StartPosition::Earliest => self.with(key, "earliest"),
            StartPosition::Latest => self.with(key, "latest"),
            StartPosition::Time(time) => self.with(key, time.to_rfc3339()),
        }
    }

    /// The dead letters a bulk requeue or resolve takes; `all` when it takes every one
    /// its selectors match (or every one, without selectors).
    pub fn dead_letters(mut self, selection: &DeadLetterSelection, all: bool) -> Selector {
        if all {
            self = self.with("all", true);
        }
        if !selection.ids.is_empty() {
            let listed: Vec<String> = selection
                .ids
                .iter()
                .take(MAX_LISTED_IDS)
                .map(Uuid::to_string)
                .collect();
            let more = selection.ids.len().saturating_sub(MAX_LISTED_IDS);
            let mut ids = listed.join(",");
            if more > 0 {
                let _ = write!(ids, ",+{more} more");
            }
            self = self.with("ids", ids);
        }
        if !selection.event_types.is_empty() {
            self = self.with("event_types", selection.event_types.to_strings().join(","));
        }
        if let Some(kind) = &selection.aggregate_type {
            self = self.with_text("aggregate_type", kind);
        }
        if let Some(id) = &selection.aggregate_id {
            self = self.with_text("aggregate_id", id);
        }
        if let Some(error) = &selection.last_error {
            self = self.with_text("last_error", error);
        }
        self.with_some(
            "dead_lettered_after",
            selection.dead_lettered_after.map(|time| time.to_rfc3339()),
        )
        .with_some(
            "dead_lettered_before",
            selection.dead_lettered_before.map(|time| time.to_rfc3339()),
        )
        .with_some("source", selection.source.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::PatternSet;

    #[test]
    fn a_selection_reads_as_key_value_pairs() {
        let selection = DeadLetterSelection {
            event_types: PatternSet::parse(&["order.*"]).unwrap(),
            last_error: Some("HTTP 500: \"down\"".into()),
            ..DeadLetterSelection::default()
        };
        assert_eq!(
            Selector::none().dead_letters(&selection, true).0,
            r#"all=true event_types=order.* last_error="HTTP 500: \"down\"""#
        );
        assert_eq!(
            Selector::none()
                .dead_letters(&DeadLetterSelection::default(), false)
                .0,
            ""
        );
    }

    #[test]
    fn many_ids_are_counted_rather_than_listed() {
        let selection = DeadLetterSelection {
            ids: (0..12).map(|_| Uuid::new_v4()).collect(),
            ..DeadLetterSelection::default()
        };
        let selector = Selector::none().dead_letters(&selection, false).0;
        assert_eq!(selector.matches(',').count(), 10, "{selector}");
        assert!(selector.ends_with(",+2 more"), "{selector}");
    }
}
