//! Query strings and submitted forms turned into domain values. Every refusal is an
//! invalid-argument error naming the parameter, as the gRPC conversions name fields.

use chrono::{DateTime, FixedOffset, NaiveDateTime, TimeZone, Utc};
use uuid::Uuid;

use crate::{
    domain::{
        DeadLetterSelection, Echo, PatternSet, Refusal, SourceName, StartPosition,
        SubscriptionName, parse_event_id,
    },
    error::{Error, Result},
    operations::{MAX_PAGE_SIZE, PageToken},
};

/// Dead letters per page of the console's listing unless the query says otherwise.
pub const DEFAULT_PAGE_SIZE: usize = 50;

/// The name/value pairs of a query string or a urlencoded form, in order.
#[derive(Debug, Clone, Default)]
pub struct Params(Vec<(String, String)>);

impl Params {
    pub fn parse(encoded: &[u8]) -> Params {
        Params(
            form_urlencoded::parse(encoded)
                .map(|(name, value)| (name.into_owned(), value.into_owned()))
                .collect(),
        )
    }

    /// The first value of `name`, trimmed; `None` when absent or blank.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.trim())
            .filter(|value| !value.is_empty())
    }

    /// Every non-blank value of `name`.
    pub fn all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.0
            .iter()
            .filter(move |(key, _)| key == name)
            .map(|(_, value)| value.trim())
            .filter(|value| !value.is_empty())
    }

    /// A checkbox or flag: absent is false.
    pub fn flag(&self, name: &str) -> Result<bool> {
        match self.get(name) {
            None => Ok(false),
            Some("on" | "1" | "true" | "yes") => Ok(true),
            Some("0" | "false" | "no") => Ok(false),
            Some(other) => Err(Error::invalid(
                name,
                format!("{} is not on or off", Echo(other)),
            )),
        }
    }
}

/// The dead-letter filter of the subscription page: event-type patterns (separated by
/// spaces or commas), aggregate type and id, last error, a dead-lettered time range
/// (RFC 3339, or a date and time in the browser's zone `tz`, minutes east of UTC) and
/// the source.
pub fn dead_letter_filter(params: &Params) -> Result<DeadLetterSelection> {
    let patterns: Vec<&str> = params
        .get("event_type")
        .map(|text| {
            text.split([' ', ','])
                .filter(|pattern| !pattern.is_empty())
                .collect()
        })
        .unwrap_or_default();
    let event_types = PatternSet::parse(&patterns).map_err(|(index, message)| {
        Error::invalid(
            "event_type",
            format!("{}: {message}", Echo(patterns[index])),
        )
    })?;
    event_types.check_size("event_type")?;
    let selection = DeadLetterSelection {
        ids: Vec::new(),
        event_types,
        aggregate_type: params.get("aggregate_type").map(str::to_owned),
        aggregate_id: params.get("aggregate_id").map(str::to_owned),
        last_error: params.get("error").map(str::to_owned),
        dead_lettered_after: time(params, "after")?,
        dead_lettered_before: time(params, "before")?,
        source: source(params)?,
    };
    selection.validate().map_err(|error| match error {
        // The domain names its own fields; the console names its parameters.
        Refusal::Invalid { field, message } => Error::InvalidArgument {
            field: match field.as_str() {
                "dead_lettered_after" => "after".to_owned(),
                "dead_lettered_before" => "before".to_owned(),
                "last_error" => "error".to_owned(),
                _ => field,
            },
            message: message.replace("dead_lettered_before", "before"),
        },
        other => other.into(),
    })?;
    Ok(selection)
}

/// `source`: the source (database) to look in; absent: every source.
pub fn source(params: &Params) -> Result<Option<SourceName>> {
    params
        .get("source")
        .map(|name| SourceName::parse("source", name))
        .transpose()
        .map_err(Error::from)
}

/// The chosen dead letters' event ids (`id`, repeated).
pub fn event_ids(params: &Params) -> Result<Vec<Uuid>> {
    let ids = params
        .all("id")
        .map(|id| event_id("id", id))
        .collect::<Result<Vec<_>>>()?;
    if ids.is_empty() {
        return Err(Error::invalid("id", "select at least one dead letter"));
    }
    Ok(ids)
}

/// An event id in canonical form; surrounding whitespace (a pasted id) is dropped.
pub fn event_id(field: &str, text: &str) -> Result<Uuid> {
    Ok(parse_event_id(field, text.trim())?)
}

pub fn subscription_name(text: &str) -> Result<SubscriptionName> {
    Ok(SubscriptionName::parse("subscription", text)?)
}

/// `page_size`: 1 to the listing's maximum.
pub fn page_size(params: &Params) -> Result<usize> {
    match params.get("page_size") {
        None => Ok(DEFAULT_PAGE_SIZE),
        Some(text) => text
            .parse::<usize>()
            .ok()
            .filter(|size| (1..=MAX_PAGE_SIZE).contains(size))
            .ok_or_else(|| {
                Error::invalid(
                    "page_size",
                    format!("{} is not a number from 1 to {MAX_PAGE_SIZE}", Echo(text)),
                )
            }),
    }
}

/// `page`: where the listing resumes.
pub fn page(params: &Params) -> Result<Option<PageToken>> {
    params
        .get("page")
        .map(|token| PageToken::decode("page", token))
        .transpose()
}

/// Where a seek goes: `to` is earliest, latest or time (then `time`, in the zone `tz`).
pub fn seek_target(params: &Params) -> Result<StartPosition> {
    match params.get("to") {
        Some("earliest") => Ok(StartPosition::Earliest),
        Some("latest") => Ok(StartPosition::Latest),
        Some("time") => time(params, "time")?
            .map(StartPosition::Time)
            .ok_or_else(|| Error::invalid("time", "is required to seek to a time")),
        Some(other) => Err(Error::invalid(
            "to",
            format!("{} is not earliest, latest or time", Echo(other)),
        )),
        None => Err(Error::invalid("to", "choose earliest, latest or time")),
    }
}

/// A point in time: RFC 3339 with its offset, or a date and time (as a browser's
/// datetime-local field sends it) in the zone given by `tz`, minutes east of UTC.
pub fn time(params: &Params, field: &str) -> Result<Option<DateTime<Utc>>> {
    let Some(text) = params.get(field) else {
        return Ok(None);
    };
    if let Ok(time) = DateTime::parse_from_rfc3339(text) {
        return Ok(Some(time.with_timezone(&Utc)));
    }
    let local = [
        "%Y-%m-%dT%H:%M",
        "%Y-%m-%dT%H:%M:%S",
        "%Y-%m-%d %H:%M",
        "%Y-%m-%d %H:%M:%S",
    ]
    .iter()
    .find_map(|format| NaiveDateTime::parse_from_str(text, format).ok())
    .ok_or_else(|| {
        Error::invalid(
            field,
            format!(
                "{} is not a time: write 2025-01-31T14:30 or RFC 3339 such as 2025-01-31T14:30:00Z",
                Echo(text)
            ),
        )
    })?;
    let offset = zone(params)?;
    offset
        .from_local_datetime(&local)
        .single()
        .map(|time| Some(time.with_timezone(&Utc)))
        .ok_or_else(|| Error::invalid(field, format!("{} is not a valid time", Echo(text))))
}

/// `tz`: the browser's offset from UTC in minutes (its scripts fill it in); UTC without.
fn zone(params: &Params) -> Result<FixedOffset> {
    let Some(text) = params.get("tz") else {
        return Ok(FixedOffset::east_opt(0).expect("UTC"));
    };
    text.parse::<i32>()
        .ok()
        .filter(|minutes| minutes.abs() <= 18 * 60)
        .and_then(|minutes| FixedOffset::east_opt(minutes * 60))
        .ok_or_else(|| {
            Error::invalid(
                "tz",
                format!(
                    "{} is not an offset from UTC in minutes (-1080 to 1080)",
                    Echo(text)
                ),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(query: &str) -> Params {
        Params::parse(query.as_bytes())
    }

    fn field_of(error: Error) -> String {
        match error {
            Error::InvalidArgument { field, .. } => field,
            other => panic!("not an invalid argument: {other:?}"),
        }
    }

    #[test]
    fn filters_parse_and_bad_parameters_are_named() {
        let filter = dead_letter_filter(&params(
            "event_type=order.*+billing.**&aggregate_type=order&aggregate_id=o-1&error=boom\
             &after=2025-01-31T14:30&tz=60&before=2025-02-01T00:00:00Z",
        ))
        .unwrap();
        assert_eq!(filter.event_types.to_strings(), ["order.*", "billing.**"]);
        assert_eq!(filter.aggregate_id.as_deref(), Some("o-1"));
        assert_eq!(
            filter.dead_lettered_after.unwrap().to_rfc3339(),
            "2025-01-31T13:30:00+00:00"
        );
        assert!(dead_letter_filter(&params("")).unwrap().is_empty());
        for (query, field) in [
            ("event_type=order..x", "event_type"),
            ("after=yesterday", "after"),
            ("before=2025-13-01T00:00", "before"),
            (
                "after=2025-01-02T00:00:00Z&before=2025-01-01T00:00:00Z",
                "after",
            ),
            ("after=2025-01-02T00:00&tz=east", "tz"),
            ("aggregate_id=a%00b", "aggregate_id"),
        ] {
            let error = dead_letter_filter(&params(query)).unwrap_err();
            assert_eq!(field_of(error), field, "{query}");
        }
        assert_eq!(
            field_of(page_size(&params("page_size=0")).unwrap_err()),
            "page_size"
        );
        assert_eq!(field_of(page(&params("page=x")).unwrap_err()), "page");
        assert_eq!(field_of(event_ids(&params("")).unwrap_err()), "id");
        assert_eq!(field_of(event_ids(&params("id=nope")).unwrap_err()), "id");
        assert_eq!(
            field_of(seek_target(&params("to=time")).unwrap_err()),
            "time"
        );
        assert_eq!(field_of(seek_target(&params("to=soon")).unwrap_err()), "to");
        assert_eq!(
            field_of(params("all=maybe").flag("all").unwrap_err()),
            "all"
        );
    }
}
