//! `apply` and `export`: subscriptions as code. `apply -f FILE` makes the gateway's
//! subscriptions what a [`manifest`](crate::manifest) file says, printing what it
//! creates, changes field by field, leaves and deletes; `export` writes the current
//! ones in the same format.
//!
//! Every part of every entry is checked before anything changes: here what needs no
//! gateway (the file's shape, types, variables, pause reasons), then by the gateway
//! itself (`validate_only`). One invalid entry refuses the whole file; every problem is
//! reported, each as `FILE:LINE:COLUMN: subscriptions[3].ack_deadline: ...`.

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
    manifest::{self, Problem, SubscriptionSpec, SubscriptionsFile},
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

/// Settings chosen at creation, why they cannot change, and what their absence from
/// the file means.
const FIXED: [(&str, &str, &str); 3] = [
    (
        "ordered",
        "it would break the order of the events in flight",
        "false",
    ),
    (
        "sources",
        "the read positions are kept per source",
        "every source",
    ),
    (
        "expire_after_idle",
        "it is set when the subscription is created",
        "never",
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

/// A subscriptions file as read: its name as messages show it, its text (to find a
/// field in), and its entries.
struct SourceFile {
    shown: String,
    text: String,
    entries: Vec<Entry>,
}

impl SourceFile {
    /// The problems, each located in the file and on a line of its own.
    fn lines(&self, problems: &[Problem]) -> Vec<String> {
        problems
            .iter()
            .map(|problem| {
                let at = problem
                    .at
                    .or_else(|| manifest::locate(&self.text, &problem.path));
                Problem {
                    at,
                    ..problem.clone()
                }
                .line(&self.shown)
            })
            .collect()
    }

    /// A failure while applying: its problems, located, or the failure itself.
    fn failure(&self, unplanned: Unplanned) -> CliError {
        match unplanned {
            Unplanned::Problems(problems) => usage(self.lines(&problems).join("\n")),
            Unplanned::Failed(error) => error,
        }
    }

    /// The refusal of the file for its problems: every one, so that one run shows all
    /// there is to fix.
    fn refusal(&self, problems: &[Problem]) -> CliError {
        let lines = self.lines(problems);
        usage(match lines.as_slice() {
            [one] => one.clone(),
            _ => format!(
                "{}: {} problems, nothing was changed:\n{}",
                self.shown,
                lines.len(),
                lines.join("\n")
            ),
        })
    }
}

/// A file entry: where it is, what it asks for, and what is wrong with it that needs
/// no gateway to see.
struct Entry {
    index: usize,
    spec: SubscriptionSpec,
    problems: Vec<Problem>,
}

/// Why an entry has no plan: problems of the file, or a failure to ask the gateway.
enum Unplanned {
    Problems(Vec<Problem>),
    Failed(CliError),
}

impl From<CliError> for Unplanned {
    fn from(error: CliError) -> Self {
        Unplanned::Failed(error)
    }
}

impl Entry {
    /// A refusal of the gateway about this entry, as a problem of the field it names.
    fn refused(&self, status: Status) -> Unplanned {
        match status.code() {
            Code::InvalidArgument
            | Code::FailedPrecondition
            | Code::AlreadyExists
            | Code::OutOfRange => {
                let message = status.message();
                let field = message
                    .strip_prefix("subscription.")
                    .and_then(|detail| detail.split_once(": "));
                let problem = match field {
                    Some((field, message)) => Problem::of(self.path(field), message),
                    None => Problem::of(
                        self.path(""),
                        message
                            .strip_prefix("subscription:")
                            .map_or(message, str::trim_start),
                    ),
                };
                Unplanned::Problems(vec![problem])
            }
            _ => Unplanned::Failed(CliError::Failed(describe(status))),
        }
    }

    /// The path of one of its fields; of the entry itself for "".
    fn path(&self, field: &str) -> String {
        match field {
            "" => format!("subscriptions[{}]", self.index),
            field => format!("subscriptions[{}].{field}", self.index),
        }
    }
}

pub(crate) async fn apply(target: &Target, args: ApplyArgs) -> Result<(), CliError> {
    let file = read_file(&args.file)?;
    let mut admin = target.connect(true).await?.admin();
    let current = list(&mut admin).await?;
    // Every entry is checked, the gateway's checks included, before the first change;
    // all problems are gathered, so one run shows everything there is to fix.
    let mut plan = Vec::with_capacity(file.entries.len());
    let mut problems = Vec::new();
    for entry in &file.entries {
        match plan_entry(&mut admin, entry, current.get(&entry.spec.name)).await {
            Ok(step) => plan.push((entry, step)),
            Err(Unplanned::Problems(found)) => problems.extend(found),
            Err(Unplanned::Failed(error)) => return Err(error),
        }
    }
    let stale = stale(&file.entries, &current);
    let mut report = Report {
        dry_run: args.dry_run,
        ..Report::default()
    };
    if !problems.is_empty() {
        // A dry run still shows what the rest of the file would do.
        if args.dry_run {
            for (entry, step) in plan {
                report.record(&entry.spec.name, step);
            }
            report.record_stale(stale, args.prune);
            report.problems = file.lines(&problems);
            report.print(target);
        }
        return Err(file.refusal(&problems));
    }
    let prune = args.prune && !args.dry_run;
    if prune && !stale.is_empty() && !args.yes {
        confirm(&format!(
            "delete {}, which the file does not name, with their delivery records and dead letters: {}",
            count(stale.len() as u64, "subscription"),
            stale.join(", ")
        ))?;
    }
    for (entry, step) in plan {
        let step = match args.dry_run {
            true => step,
            false => execute(&mut admin, &file, entry, step, &mut report).await?,
        };
        report.record(&entry.spec.name, step);
    }
    if prune {
        delete(&mut admin, &stale).await?;
    }
    report.record_stale(stale, args.prune);
    report.print(target);
    Ok(())
}

/// The subscriptions the file does not name. Those that delete themselves when idle
/// (those `tail` makes) are not the file's to keep or prune.
fn stale(entries: &[Entry], current: &BTreeMap<String, proto::Subscription>) -> Vec<String> {
    let named: BTreeSet<&str> = entries
        .iter()
        .map(|entry| entry.spec.name.as_str())
        .collect();
    current
        .values()
        .filter(|subscription| {
            !named.contains(subscription.name.as_str()) && subscription.expire_after_idle.is_none()
        })
        .map(|subscription| subscription.name.clone())
        .collect()
}

async fn delete(admin: &mut Admin, names: &[String]) -> Result<(), CliError> {
    for name in names {
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

/// The file and its entries, checked for what needs no gateway: YAML and field types,
/// names given once, environment variables set, pauses the gateway would refuse.
fn read_file(path: &Path) -> Result<SourceFile, CliError> {
    let shown = match path.as_os_str() == "-" {
        true => "<stdin>".to_owned(),
        false => path.display().to_string(),
    };
    let mut text = String::new();
    let read = if path.as_os_str() == "-" {
        std::io::stdin().read_to_string(&mut text).map(|_| ())
    } else {
        std::fs::read_to_string(path).map(|read| text = read)
    };
    read.map_err(|error| usage(format!("cannot read {shown}: {error}")))?;
    let file = manifest::parse(&text).map_err(|problem| usage(problem.line(&shown)))?;
    let mut seen = BTreeMap::new();
    let mut entries = Vec::with_capacity(file.subscriptions.len());
    for (index, mut spec) in file.subscriptions.into_iter().enumerate() {
        let mut entry_problems = Vec::new();
        let at = |field: &str| format!("subscriptions[{index}].{field}");
        if let Some(first) = seen.insert(spec.name.clone(), index) {
            entry_problems.push(Problem::of(
                at("name"),
                format!("{:?} is named already by subscriptions[{first}]", spec.name),
            ));
        }
        if let Some(push) = &mut spec.push {
            for (header, value) in &mut push.headers {
                match expand_variables(value) {
                    Ok(expanded) => *value = expanded,
                    Err(message) => entry_problems
                        .push(Problem::of(at(&format!("push.headers.{header}")), message)),
                }
            }
        }
        // PauseSubscription has no validate_only: its checks are made here, so that a
        // pause is never refused after the entries before it were applied. An end that
        // has passed is no pause (see pause_change), so only the reason is checked.
        let reason = spec.pause_reason.as_deref().unwrap_or_default();
        if let Err(outbox_domain::Refusal::Invalid { message, .. }) =
            outbox_domain::Pause::validate(reason, None, Utc::now())
        {
            entry_problems.push(Problem::of(at("pause_reason"), message));
        }
        entries.push(Entry {
            index,
            spec,
            problems: entry_problems,
        });
    }
    Ok(SourceFile {
        shown,
        text,
        entries,
    })
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
) -> Result<Step, Unplanned> {
    let Some(current) = current else {
        let mut problems = entry.problems.clone();
        problems.extend(fingerprint_problems(entry, None));
        if !problems.is_empty() {
            return Err(Unplanned::Problems(problems));
        }
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
    let mut problems = entry.problems.clone();
    for (field, why, unset) in FIXED {
        if wanted.get(field) != stored.get(field) {
            let value =
                |value: Option<&Value>| value.map_or(unset.to_owned(), |value| shown(Some(value)));
            problems.push(Problem::of(
                entry.path(field),
                format!(
                    "cannot change after creation ({why}): it is {} and the file says {}; delete the subscription, or create one under another name",
                    value(stored.get(field)),
                    value(wanted.get(field)),
                ),
            ));
        }
    }
    problems.extend(fingerprint_problems(entry, current.push.as_ref()));
    if !problems.is_empty() {
        return Err(Unplanned::Problems(problems));
    }
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
            // Not paused is `false`, as the file says it, not "(unset)".
            from: Some(Value::Bool(existing.paused == Some(true))),
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
fn fingerprint_problems(entry: &Entry, current: Option<&proto::PushConfig>) -> Vec<Problem> {
    let Some(push) = &entry.spec.push else {
        return Vec::new();
    };
    let mut problems = Vec::new();
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
            problems.push(Problem::of(
                entry.path(&format!("push.headers.{header}")),
                format!("{value} is the fingerprint of a value the gateway does not hold for this header; write the value itself (or ${{VARIABLE}})"),
            ));
        }
    }
    problems
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
            from: switch_or_value(field, before),
            to: switch_or_value(field, after),
        }],
    }
}

/// A setting's value as a change shows it: a switch left out of a spec (which keeps only
/// what differs from the defaults) is `false`, not unset.
fn switch_or_value(field: &str, value: Option<&Value>) -> Option<Value> {
    match (field, value) {
        ("dead_letter_expired", None) => Some(Value::Bool(false)),
        (_, value) => value.cloned(),
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
    file: &SourceFile,
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
                        set_pause(admin, entry, pause)
                            .await
                            .map_err(|unplanned| file.failure(unplanned))?;
                    }
                    return Ok(Step::Create);
                }
                // Another apply created it since this one looked: make it as the file says.
                Err(status) if status.code() == Code::AlreadyExists => {
                    let current = get(admin, name).await?;
                    plan_entry(admin, entry, Some(&current))
                        .await
                        .map_err(|unplanned| file.failure(unplanned))?
                }
                Err(status) => return Err(file.failure(entry.refused(status))),
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
                .map_err(|status| file.failure(entry.refused(status)))?
                .into_inner();
            if let Some(push) = updated.push.filter(|push| !push.signing_secret.is_empty()) {
                report
                    .signing_secrets
                    .insert(name.clone(), push.signing_secret);
            }
        }
        if let Some(pause) = pause {
            set_pause(admin, entry, pause)
                .await
                .map_err(|unplanned| file.failure(unplanned))?;
        }
    }
    Ok(step)
}

async fn set_pause(admin: &mut Admin, entry: &Entry, pause: &PauseChange) -> Result<(), Unplanned> {
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
            let (field, message) = status
                .message()
                .split_once(": ")
                .unwrap_or(("", status.message()));
            let field = match field {
                "reason" => "pause_reason",
                "until" => "paused_until",
                _ => "paused",
            };
            Unplanned::Problems(vec![Problem::of(entry.path(field), message)])
        }
        _ => Unplanned::Failed(CliError::Failed(describe(status))),
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
    /// What refuses the file, one located line each; a dry run shows them beside the
    /// plan of the rest.
    problems: Vec<String>,
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
            "problems": self.problems,
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
        match (self.dry_run, self.problems.len()) {
            (true, 0) => println!("dry run, nothing was changed: {summary}"),
            (true, problems) => println!(
                "dry run, nothing was changed: {summary}; the file is refused for {}",
                count(problems as u64, "problem")
            ),
            (false, _) => println!("{summary}"),
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
