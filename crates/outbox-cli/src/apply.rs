//! `apply` and `export`: subscriptions as code. `apply -f FILE` makes the gateway's
//! subscriptions what a [`manifest`](crate::manifest) file says, printing what it
//! creates, changes field by field, leaves and deletes; `export` writes the current
//! ones in the same format.
//!
//! Every entry is first checked by the gateway itself (`validate_only`), so one invalid
//! entry refuses the whole file, named by its path (`subscriptions[3].ack_deadline`),
//! before anything changes.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::Read,
    path::{Path, PathBuf},
};

use chrono::Utc;
use serde_json::{Value, json};
use tonic::{Code, Status};

use outbox_client::{AuthenticatedChannel, proto};

use crate::{
    CliError, Target, confirm, count, describe,
    manifest::{self, SubscriptionSpec, SubscriptionsFile},
    usage,
};

type Admin = proto::admin_client::AdminClient<AuthenticatedChannel>;

#[derive(Debug, clap::Args)]
pub struct ApplyArgs {
    /// The subscriptions file (YAML, see docs/subscriptions.schema.json); `-` reads
    /// standard input.
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    file: PathBuf,
    /// Show what would change, and change nothing.
    #[arg(long)]
    dry_run: bool,
    /// Also delete the subscriptions the file does not name, with their delivery records
    /// and dead letters (asks first).
    #[arg(long)]
    prune: bool,
    /// Do not ask before pruning (for scripts and jobs).
    #[arg(long, short = 'y')]
    yes: bool,
}

#[derive(Debug, clap::Args)]
pub struct ExportArgs {
    /// Write the file here instead of to standard output.
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    output: Option<PathBuf>,
    /// Write the file format's JSON Schema instead (for editors), without asking the
    /// gateway.
    #[arg(long)]
    schema: bool,
}

/// The settings UpdateSubscription can change, as its update mask names them.
const CHANGEABLE: [&str; 14] = [
    "event_types",
    "aggregate_types",
    "metadata_match",
    "filter",
    "transform",
    "ack_deadline",
    "max_attempts",
    "retry_backoff_min",
    "retry_backoff_max",
    "persistent_event_types",
    "max_event_age",
    "dead_letter_expired",
    "push",
    "sink",
];

/// Settings chosen at creation, and why they cannot change.
const FIXED: [(&str, &str); 3] = [
    (
        "ordered",
        "it would break the order of the events in flight",
    ),
    ("sources", "the read positions are kept per source"),
    (
        "expire_after_idle",
        "it is set when the subscription is created",
    ),
];

/// One setting that differs: its path in the file, and both values.
#[derive(Debug)]
struct Change {
    field: String,
    from: Option<Value>,
    to: Option<Value>,
}

/// What applying one entry of the file does.
#[derive(Debug)]
enum Step {
    Create,
    Change {
        /// The update mask of the settings that differ; empty when only the pause does.
        mask: Vec<String>,
        changes: Vec<Change>,
        pause: Option<PauseChange>,
    },
    Unchanged,
}

/// How the pause of a subscription must change.
#[derive(Debug, Clone)]
enum PauseChange {
    Pause {
        reason: String,
        until: Option<prost_types::Timestamp>,
    },
    Resume,
}

/// A file entry: where it is, what it asks for.
struct Entry {
    index: usize,
    spec: SubscriptionSpec,
}

impl Entry {
    /// A refusal of the gateway about this entry, named by the entry's path.
    fn refused(&self, status: Status) -> CliError {
        match status.code() {
            Code::InvalidArgument
            | Code::FailedPrecondition
            | Code::AlreadyExists
            | Code::OutOfRange => {
                let message = status.message();
                let detail = message
                    .strip_prefix("subscription.")
                    .or_else(|| message.strip_prefix("subscription:").map(str::trim_start));
                usage(match detail {
                    Some(detail) => format!("subscriptions[{}].{detail}", self.index),
                    None => format!("subscriptions[{}]: {message}", self.index),
                })
            }
            _ => CliError::Failed(describe(status)),
        }
    }

    fn path(&self, field: &str) -> String {
        format!("subscriptions[{}].{field}", self.index)
    }
}

pub(crate) async fn apply(target: &Target, args: ApplyArgs) -> Result<(), CliError> {
    let entries = read_file(&args.file)?;
    let mut admin = target.connect(true).await?.admin();
    let current = list(&mut admin).await?;
    let mut plan = Vec::with_capacity(entries.len());
    for entry in &entries {
        let step = plan_entry(&mut admin, entry, current.get(&entry.spec.name)).await?;
        plan.push(step);
    }
    let named: BTreeSet<&str> = entries
        .iter()
        .map(|entry| entry.spec.name.as_str())
        .collect();
    // Subscriptions that delete themselves when idle (those `tail` makes) are not the
    // file's to keep or prune.
    let stale: Vec<String> = current
        .values()
        .filter(|subscription| {
            !named.contains(subscription.name.as_str()) && subscription.expire_after_idle.is_none()
        })
        .map(|subscription| subscription.name.clone())
        .collect();
    let mut report = Report {
        dry_run: args.dry_run,
        ..Report::default()
    };
    let prune = args.prune && !args.dry_run;
    if prune && !stale.is_empty() && !args.yes {
        confirm(&format!(
            "delete {}, which the file does not name, with their delivery records and dead letters: {}",
            count(stale.len() as u64, "subscription"),
            stale.join(", ")
        ))?;
    }
    for (entry, step) in entries.iter().zip(plan) {
        let step = match args.dry_run {
            true => step,
            false => execute(&mut admin, entry, step, &mut report).await?,
        };
        report.record(&entry.spec.name, step);
    }
    if prune {
        for name in &stale {
            match admin
                .delete_subscription(proto::DeleteSubscriptionRequest { name: name.clone() })
                .await
            {
                // Deleted meanwhile, by another apply or an operator.
                Err(status) if status.code() == Code::NotFound => {}
                other => {
                    other.map_err(describe)?;
                }
            }
        }
    }
    report.record_stale(stale, args.prune);
    report.print(target);
    Ok(())
}

pub(crate) async fn export(target: &Target, args: ExportArgs) -> Result<(), CliError> {
    let text = match args.schema {
        true => manifest::schema(),
        false => exported(target).await?,
    };
    match args.output {
        Some(path) => std::fs::write(&path, text)
            .map_err(|error| format!("cannot write {}: {error}", path.display()))?,
        None => print!("{text}"),
    }
    Ok(())
}

/// The gateway's subscriptions as a file.
async fn exported(target: &Target) -> Result<String, CliError> {
    let mut admin = target.connect(true).await?.admin();
    let file = SubscriptionsFile {
        subscriptions: list(&mut admin)
            .await?
            .values()
            .map(SubscriptionSpec::from_proto)
            .collect(),
    };
    let yaml = serde_yaml_ng::to_string(&file)
        .map_err(|error| format!("cannot write the subscriptions as YAML: {error}"))?;
    Ok(format!(
        "# Subscriptions written by `outbox-gateway export`; `outbox-gateway apply -f FILE`\n\
         # makes a gateway's subscriptions these. Push header values are fingerprints of the\n\
         # stored ones, which apply keeps; write a value (or ${{VARIABLE}}) to set another.\n{yaml}"
    ))
}

/// The file's entries, checked for what needs no gateway: YAML and field types, names
/// given once, environment variables set.
fn read_file(path: &Path) -> Result<Vec<Entry>, CliError> {
    let shown = path.display();
    let mut text = String::new();
    let read = if path.as_os_str() == "-" {
        std::io::stdin().read_to_string(&mut text).map(|_| ())
    } else {
        std::fs::read_to_string(path).map(|read| text = read)
    };
    read.map_err(|error| usage(format!("cannot read {shown}: {error}")))?;
    let deserializer = serde_yaml_ng::Deserializer::from_str(&text);
    let file: SubscriptionsFile =
        serde_path_to_error::deserialize(deserializer).map_err(|error| {
            let path = error.path().to_string();
            let message = error.into_inner().to_string();
            // The YAML parser starts some messages with a path of its own.
            let message = match message.split_once(": ") {
                Some((start, rest)) if start.starts_with("subscriptions") => rest,
                _ => &message,
            };
            match path.as_str() {
                "." => usage(format!("{shown}: {message}")),
                _ => usage(format!("{shown}: {path}: {message}")),
            }
        })?;
    let mut seen = BTreeMap::new();
    let mut entries = Vec::with_capacity(file.subscriptions.len());
    for (index, mut spec) in file.subscriptions.into_iter().enumerate() {
        if let Some(first) = seen.insert(spec.name.clone(), index) {
            return Err(usage(format!(
                "{shown}: subscriptions[{index}].name: {:?} is named already by subscriptions[{first}]",
                spec.name
            )));
        }
        if let Some(push) = &mut spec.push {
            for (header, value) in &mut push.headers {
                *value = expand_variables(value).map_err(|message| {
                    usage(format!(
                        "{shown}: subscriptions[{index}].push.headers.{header}: {message}"
                    ))
                })?;
            }
        }
        entries.push(Entry { index, spec });
    }
    Ok(entries)
}

/// Replaces each `${NAME}` with the environment variable's value.
fn expand_variables(value: &str) -> Result<String, String> {
    let mut expanded = String::with_capacity(value.len());
    let mut rest = value;
    while let Some(start) = rest.find("${") {
        expanded.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| "\"${\" without its closing \"}\"".to_owned())?;
        let name = &after[..end];
        let valid = !name.is_empty()
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            return Err(format!("${{{name}}} is not an environment variable name"));
        }
        let value = std::env::var(name)
            .map_err(|_| format!("the environment variable {name} is not set"))?;
        expanded.push_str(&value);
        rest = &after[end + 1..];
    }
    expanded.push_str(rest);
    Ok(expanded)
}

/// Whether a header value is a fingerprint the gateway showed instead of the value.
fn is_fingerprint(value: &str) -> bool {
    value
        .strip_prefix("sha256:")
        .is_some_and(|hex| hex.len() == 12 && hex.chars().all(|c| c.is_ascii_hexdigit()))
}

async fn list(admin: &mut Admin) -> Result<BTreeMap<String, proto::Subscription>, CliError> {
    Ok(admin
        .list_subscriptions(proto::ListSubscriptionsRequest {})
        .await
        .map_err(describe)?
        .into_inner()
        .subscriptions
        .into_iter()
        .map(|subscription| (subscription.name.clone(), subscription))
        .collect())
}

async fn get(admin: &mut Admin, name: &str) -> Result<proto::Subscription, CliError> {
    Ok(admin
        .get_subscription(proto::GetSubscriptionRequest {
            name: name.to_owned(),
        })
        .await
        .map_err(describe)?
        .into_inner())
}

/// What applying the entry does, checked by the gateway without changing anything.
async fn plan_entry(
    admin: &mut Admin,
    entry: &Entry,
    current: Option<&proto::Subscription>,
) -> Result<Step, CliError> {
    let Some(current) = current else {
        check_fingerprints(entry, None)?;
        let checked = admin
            .create_subscription(proto::CreateSubscriptionRequest {
                subscription: Some(entry.spec.to_proto()),
                validate_only: true,
            })
            .await;
        return match checked {
            Ok(_) => Ok(Step::Create),
            // Created since the list was read, by another apply: compare with it.
            Err(status) if status.code() == Code::AlreadyExists => {
                let current = get(admin, &entry.spec.name).await?;
                Box::pin(plan_entry(admin, entry, Some(&current))).await
            }
            Err(status) => Err(entry.refused(status)),
        };
    };
    let existing = SubscriptionSpec::from_proto(current);
    let wanted = serde_json::to_value(&entry.spec).expect("a spec is JSON");
    let stored = serde_json::to_value(&existing).expect("a spec is JSON");
    for (field, why) in FIXED {
        if wanted.get(field) != stored.get(field) {
            return Err(usage(format!(
                "{}: cannot change after creation ({why}): it is {} and the file says {}; delete the subscription, or create one under another name",
                entry.path(field),
                shown(stored.get(field)),
                shown(wanted.get(field)),
            )));
        }
    }
    check_fingerprints(entry, current.push.as_ref())?;
    let would_be = admin
        .update_subscription(proto::UpdateSubscriptionRequest {
            subscription: Some(entry.spec.to_proto()),
            update_mask: Some(prost_types::FieldMask {
                paths: CHANGEABLE.iter().map(|path| path.to_string()).collect(),
            }),
            validate_only: true,
        })
        .await
        .map_err(|status| entry.refused(status))?
        .into_inner();
    let would_be =
        serde_json::to_value(SubscriptionSpec::from_proto(&would_be)).expect("a spec is JSON");
    let mut mask = Vec::new();
    let mut changes = Vec::new();
    for field in CHANGEABLE {
        let before = stored.get(field);
        let after = would_be.get(field);
        if before != after {
            mask.push(field.to_owned());
            changes.extend(differences(field, before, after));
        }
    }
    let pause = pause_change(&entry.spec, &existing);
    if let Some(change) = &pause {
        let to = match change {
            PauseChange::Pause { .. } => Some(Value::Bool(true)),
            PauseChange::Resume => Some(Value::Bool(false)),
        };
        changes.push(Change {
            field: "paused".into(),
            from: existing.paused.map(Value::Bool),
            to,
        });
        for field in ["pause_reason", "paused_until"] {
            if wanted.get(field) != stored.get(field) {
                changes.push(Change {
                    field: field.into(),
                    from: stored.get(field).cloned(),
                    to: wanted.get(field).cloned(),
                });
            }
        }
    }
    Ok(if changes.is_empty() {
        Step::Unchanged
    } else {
        Step::Change {
            mask,
            changes,
            pause,
        }
    })
}

/// A header value that is a fingerprint keeps a stored value, so it must be the
/// fingerprint of the value stored for that header.
fn check_fingerprints(entry: &Entry, current: Option<&proto::PushConfig>) -> Result<(), CliError> {
    let Some(push) = &entry.spec.push else {
        return Ok(());
    };
    for (header, value) in &push.headers {
        // Header names are case-insensitive; the gateway keeps them in lowercase.
        let stored = current.and_then(|current| {
            current
                .headers
                .iter()
                .find(|(name, _)| name.eq_ignore_ascii_case(header))
                .map(|(_, stored)| stored)
        });
        if is_fingerprint(value) && stored != Some(value) {
            return Err(usage(format!(
                "{}: {value} is the fingerprint of a value the gateway does not hold for this header; write the value itself (or ${{VARIABLE}})",
                entry.path(&format!("push.headers.{header}"))
            )));
        }
    }
    Ok(())
}

/// The changes of one setting: field by field inside `push` and `sink`.
fn differences(field: &str, before: Option<&Value>, after: Option<&Value>) -> Vec<Change> {
    match (before, after) {
        (Some(Value::Object(before)), Some(Value::Object(after))) => {
            let keys: BTreeSet<&String> = before.keys().chain(after.keys()).collect();
            keys.into_iter()
                .filter(|key| before.get(*key) != after.get(*key))
                .map(|key| Change {
                    field: format!("{field}.{key}"),
                    from: before.get(key).cloned(),
                    to: after.get(key).cloned(),
                })
                .collect()
        }
        _ => vec![Change {
            field: field.into(),
            from: before.cloned(),
            to: after.cloned(),
        }],
    }
}

/// How the pause must change for the subscription to be as the file says; `None` also
/// when the file does not say. A pause whose end has passed is no pause.
fn pause_change(wanted: &SubscriptionSpec, existing: &SubscriptionSpec) -> Option<PauseChange> {
    let ended = wanted.paused_until.is_some_and(|until| until <= Utc::now());
    let paused = wanted.paused? && !ended;
    let existing_paused = existing.paused == Some(true);
    let same = (&wanted.pause_reason, wanted.paused_until)
        == (&existing.pause_reason, existing.paused_until);
    match (paused, existing_paused) {
        (false, false) => None,
        (false, true) => Some(PauseChange::Resume),
        (true, true) if same => None,
        (true, _) => Some(PauseChange::Pause {
            reason: wanted.pause_reason.clone().unwrap_or_default(),
            until: wanted.paused_until.map(|until| prost_types::Timestamp {
                seconds: until.timestamp(),
                nanos: until.timestamp_subsec_nanos() as i32,
            }),
        }),
    }
}

/// Carries out a planned step; returns the step as it was done (a create that lost a
/// race with another apply becomes a change).
async fn execute(
    admin: &mut Admin,
    entry: &Entry,
    step: Step,
    report: &mut Report,
) -> Result<Step, CliError> {
    let name = &entry.spec.name;
    let step = match step {
        Step::Create => {
            match admin
                .create_subscription(proto::CreateSubscriptionRequest {
                    subscription: Some(entry.spec.to_proto()),
                    validate_only: false,
                })
                .await
            {
                Ok(created) => {
                    let created = created.into_inner();
                    if let Some(push) = created.push.filter(|push| !push.signing_secret.is_empty())
                    {
                        report
                            .signing_secrets
                            .insert(name.clone(), push.signing_secret);
                    }
                    let pause = pause_change(&entry.spec, &SubscriptionSpec::default());
                    if let Some(pause) = &pause {
                        set_pause(admin, entry, pause).await?;
                    }
                    return Ok(Step::Create);
                }
                // Another apply created it since this one looked: make it as the file says.
                Err(status) if status.code() == Code::AlreadyExists => {
                    let current = get(admin, name).await?;
                    plan_entry(admin, entry, Some(&current)).await?
                }
                Err(status) => return Err(entry.refused(status)),
            }
        }
        step => step,
    };
    if let Step::Change { mask, pause, .. } = &step {
        if !mask.is_empty() {
            let updated = admin
                .update_subscription(proto::UpdateSubscriptionRequest {
                    subscription: Some(entry.spec.to_proto()),
                    update_mask: Some(prost_types::FieldMask {
                        paths: mask.clone(),
                    }),
                    validate_only: false,
                })
                .await
                .map_err(|status| entry.refused(status))?
                .into_inner();
            if let Some(push) = updated.push.filter(|push| !push.signing_secret.is_empty()) {
                report
                    .signing_secrets
                    .insert(name.clone(), push.signing_secret);
            }
        }
        if let Some(pause) = pause {
            set_pause(admin, entry, pause).await?;
        }
    }
    Ok(step)
}

async fn set_pause(admin: &mut Admin, entry: &Entry, pause: &PauseChange) -> Result<(), CliError> {
    let name = entry.spec.name.clone();
    let result = match pause.clone() {
        PauseChange::Pause { reason, until } => admin
            .pause_subscription(proto::PauseSubscriptionRequest {
                name,
                reason,
                until,
            })
            .await
            .map(drop),
        PauseChange::Resume => admin
            .resume_subscription(proto::ResumeSubscriptionRequest { name })
            .await
            .map(drop),
    };
    result.map_err(|status| match status.code() {
        Code::InvalidArgument => {
            let field = status.message().split(':').next().unwrap_or_default();
            let field = match field {
                "reason" => "pause_reason",
                "until" => "paused_until",
                _ => "paused",
            };
            usage(format!("{}: {}", entry.path(field), status.message()))
        }
        _ => CliError::Failed(describe(status)),
    })
}

/// A value as the diff shows it.
fn shown(value: Option<&Value>) -> String {
    match value {
        None => "(unset)".into(),
        Some(Value::String(text)) => text.clone(),
        Some(value) => value.to_string(),
    }
}

/// What an apply did or, in a dry run, would do.
#[derive(Default)]
struct Report {
    dry_run: bool,
    created: Vec<String>,
    changed: Vec<(String, Vec<Change>)>,
    unchanged: Vec<String>,
    deleted: Vec<String>,
    not_in_file: Vec<String>,
    signing_secrets: BTreeMap<String, String>,
}

impl Report {
    fn record(&mut self, name: &str, step: Step) {
        match step {
            Step::Create => self.created.push(name.to_owned()),
            Step::Change { changes, .. } => self.changed.push((name.to_owned(), changes)),
            Step::Unchanged => self.unchanged.push(name.to_owned()),
        }
    }

    fn record_stale(&mut self, stale: Vec<String>, prune: bool) {
        match prune {
            true => self.deleted = stale,
            false => self.not_in_file = stale,
        }
    }

    fn print(&self, target: &Target) {
        let value = json!({
            "dry_run": self.dry_run,
            "created": self.created,
            "changed": self.changed.iter().map(|(name, changes)| json!({
                "name": name,
                "changes": changes.iter().map(|change| json!({
                    "field": change.field,
                    "from": change.from,
                    "to": change.to,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "unchanged": self.unchanged,
            "deleted": self.deleted,
            "not_in_file": self.not_in_file,
            "signing_secrets": self.signing_secrets,
        });
        target.print(value, || self.print_text());
    }

    fn print_text(&self) {
        let (create, change, delete) = match self.dry_run {
            true => ("would create", "would change", "would delete"),
            false => ("created", "changed", "deleted"),
        };
        for name in &self.created {
            println!("{create} {name}");
            if let Some(secret) = self.signing_secrets.get(name) {
                println!("  signing secret (shown once): {secret}");
            }
        }
        for (name, changes) in &self.changed {
            println!("{change} {name}");
            for change in changes {
                println!(
                    "  {}: {} -> {}",
                    change.field,
                    shown(change.from.as_ref()),
                    shown(change.to.as_ref())
                );
            }
            if let Some(secret) = self.signing_secrets.get(name) {
                println!("  signing secret (shown once): {secret}");
            }
        }
        for name in &self.unchanged {
            println!("unchanged {name}");
        }
        for name in &self.deleted {
            println!("{delete} {name}");
        }
        for name in &self.not_in_file {
            println!("not in the file: {name} (--prune deletes it)");
        }
        let summary = format!(
            "{} created, {} changed, {} unchanged, {} deleted",
            self.created.len(),
            self.changed.len(),
            self.unchanged.len(),
            self.deleted.len()
        );
        match self.dry_run {
            true => println!("dry run, nothing was changed: {summary}"),
            false => println!("{summary}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variables_are_expanded_and_missing_ones_named() {
        // SAFETY: the only test of this process that reads or writes this variable.
        unsafe { std::env::set_var("OUTBOX_APPLY_TEST_TOKEN", "s3cret") };
        assert_eq!(
            expand_variables("Bearer ${OUTBOX_APPLY_TEST_TOKEN}!").unwrap(),
            "Bearer s3cret!"
        );
        assert_eq!(expand_variables("plain").unwrap(), "plain");
        assert!(
            expand_variables("${OUTBOX_APPLY_TEST_UNSET}")
                .unwrap_err()
                .contains("OUTBOX_APPLY_TEST_UNSET is not set")
        );
        assert!(expand_variables("${1A}").is_err());
        assert!(expand_variables("${OPEN").is_err());
    }

    #[test]
    fn fingerprints_are_recognized() {
        assert!(is_fingerprint(&outbox_domain::fingerprint("value")));
        assert!(!is_fingerprint("sha256:short"));
        assert!(!is_fingerprint("Bearer abc"));
    }
}
