//! `dlq`: list, inspect, requeue and resolve dead letters.

use serde_json::json;

use outbox_client::proto;

use crate::{CliError, Target, confirm, count, describe, parse_time, render, usage};

#[derive(Debug, clap::Subcommand)]
pub enum DeadLetterCommand {
    /// List dead letters, oldest first.
    List {
        /// The subscription.
        subscription: String,
        /// Only events matching this pattern; repeatable.
        #[arg(long = "event-type")]
        event_types: Vec<String>,
        /// Include resolved dead letters.
        #[arg(long)]
        include_resolved: bool,
        /// Dead letters per page (1 to 1000).
        #[arg(long, default_value_t = 100)]
        page_size: u32,
        /// Continue a listing (the token the previous page printed).
        #[arg(long, default_value = "")]
        page_token: String,
        /// Only this source database (`default`, or a `[[sources]]` name); every source
        /// when omitted.
        #[arg(long, default_value = "")]
        source: String,
    },
    /// A subscription's unresolved dead letters grouped by last error, largest group
    /// first.
    Summarize {
        /// The subscription.
        subscription: String,
        /// Only this source database (`default`, or a `[[sources]]` name); every source
        /// when omitted.
        #[arg(long, default_value = "")]
        source: String,
    },
    /// Send dead letters back for delivery, attempts reset.
    Requeue {
        /// The subscription.
        subscription: String,
        #[command(flatten)]
        select: DeadLetterSelector,
    },
    /// Mark dead letters handled without redelivering them: one by its id, or those the
    /// selectors choose.
    Resolve {
        /// The subscription.
        subscription: String,
        /// The dead letter's event id.
        id: Option<String>,
        #[command(flatten)]
        select: DeadLetterSelector,
        /// Who handled it.
        #[arg(long = "by")]
        resolved_by: String,
        /// What was done.
        #[arg(long, default_value = "")]
        notes: String,
    },
}

/// Which dead letters `dlq requeue` and `dlq resolve` take: those every given selector
/// chooses, or every one with --all.
#[derive(Debug, clap::Args)]
pub struct DeadLetterSelector {
    /// Event id; repeatable.
    #[arg(long = "id")]
    ids: Vec<String>,
    /// Event-type pattern; repeatable.
    #[arg(long = "event-type")]
    event_types: Vec<String>,
    /// Only events of this aggregate type.
    #[arg(long)]
    aggregate_type: Option<String>,
    /// Only events of this aggregate id.
    #[arg(long)]
    aggregate_id: Option<String>,
    /// Only dead letters whose last error is exactly this.
    #[arg(long)]
    last_error: Option<String>,
    /// Only dead letters dead-lettered at or after this RFC 3339 time.
    #[arg(long, value_parser = parse_time)]
    after: Option<prost_types::Timestamp>,
    /// Only dead letters dead-lettered before this RFC 3339 time.
    #[arg(long, value_parser = parse_time)]
    before: Option<prost_types::Timestamp>,
    /// Take every unresolved dead letter (asks first).
    #[arg(long)]
    all: bool,
    /// Only this source database (`default`, or a `[[sources]]` name); every source
    /// when omitted.
    #[arg(long, default_value = "")]
    source: String,
    /// Do not ask for confirmation (for scripts).
    #[arg(long, short = 'y')]
    yes: bool,
}

impl DeadLetterSelector {
    fn chooses_nothing(&self) -> bool {
        self.ids.is_empty()
            && self.event_types.is_empty()
            && self.aggregate_type.is_none()
            && self.aggregate_id.is_none()
            && self.last_error.is_none()
            && self.after.is_none()
            && self.before.is_none()
            && !self.all
    }

    fn requeue_request(&self, subscription: &str) -> proto::RequeueDeadLettersRequest {
        proto::RequeueDeadLettersRequest {
            subscription: subscription.to_owned(),
            ids: self.ids.clone(),
            event_types: self.event_types.clone(),
            dead_lettered_before: self.before,
            all: self.all,
            source: self.source.clone(),
            aggregate_type: self.aggregate_type.clone().unwrap_or_default(),
            aggregate_id: self.aggregate_id.clone().unwrap_or_default(),
            last_error: self.last_error.clone().unwrap_or_default(),
            dead_lettered_after: self.after,
            validate_only: false,
        }
    }

    fn resolve_request(
        &self,
        subscription: &str,
        resolved_by: &str,
        notes: &str,
    ) -> proto::ResolveDeadLettersRequest {
        proto::ResolveDeadLettersRequest {
            subscription: subscription.to_owned(),
            ids: self.ids.clone(),
            event_types: self.event_types.clone(),
            aggregate_type: self.aggregate_type.clone().unwrap_or_default(),
            aggregate_id: self.aggregate_id.clone().unwrap_or_default(),
            last_error: self.last_error.clone().unwrap_or_default(),
            dead_lettered_after: self.after,
            dead_lettered_before: self.before,
            all: self.all,
            resolved_by: resolved_by.to_owned(),
            notes: notes.to_owned(),
            validate_only: false,
            source: self.source.clone(),
        }
    }
}

pub(crate) async fn dead_letters(
    target: &Target,
    command: DeadLetterCommand,
) -> Result<(), CliError> {
    let mut admin = target.connect(true).await?.admin();
    match command {
        DeadLetterCommand::List {
            subscription,
            event_types,
            include_resolved,
            page_size,
            page_token,
            source,
        } => {
            let page = admin
                .list_dead_letters(proto::ListDeadLettersRequest {
                    subscription,
                    event_types,
                    include_resolved,
                    page_size,
                    page_token,
                    source,
                    ..Default::default()
                })
                .await
                .map_err(describe)?
                .into_inner();
            let value = json!({
                "dead_letters": page.dead_letters.iter().map(render::dead_letter).collect::<Vec<_>>(),
                "next_page_token": page.next_page_token,
            });
            target.print(value, || {
                let rows: Vec<Vec<String>> = page
                    .dead_letters
                    .iter()
                    .map(|letter| {
                        let event = letter.event.clone().unwrap_or_default();
                        vec![
                            event.id,
                            event.event_type,
                            format!("{}/{}", event.aggregate_type, event.aggregate_id),
                            letter.attempts.to_string(),
                            render::timestamp(&letter.dead_lettered_at)
                                .as_str()
                                .unwrap_or("-")
                                .to_owned(),
                            if letter.resolved {
                                format!("by {}", letter.resolved_by)
                            } else {
                                "no".into()
                            },
                            letter.last_error.clone(),
                        ]
                    })
                    .collect();
                render::table(
                    &[
                        "EVENT ID",
                        "EVENT TYPE",
                        "AGGREGATE",
                        "ATTEMPTS",
                        "DEAD-LETTERED AT",
                        "RESOLVED",
                        "LAST ERROR",
                    ],
                    &rows,
                );
                if !page.next_page_token.is_empty() {
                    println!("more: --page-token {}", page.next_page_token);
                }
            });
        }
        DeadLetterCommand::Summarize {
            subscription,
            source,
        } => {
            let summary = admin
                .summarize_dead_letters(proto::SummarizeDeadLettersRequest {
                    subscription: subscription.clone(),
                    source,
                })
                .await
                .map_err(describe)?
                .into_inner();
            let value = json!({
                "groups": summary.groups.iter().map(render::dead_letter_group).collect::<Vec<_>>(),
            });
            target.print(value, || {
                if summary.groups.is_empty() {
                    println!("no unresolved dead letters in {subscription}");
                    return;
                }
                let time = |at: &Option<prost_types::Timestamp>| {
                    render::timestamp(at).as_str().unwrap_or("-").to_owned()
                };
                let rows: Vec<Vec<String>> = summary
                    .groups
                    .iter()
                    .map(|group| {
                        vec![
                            group.count.to_string(),
                            time(&group.first_dead_lettered_at),
                            time(&group.last_dead_lettered_at),
                            group.example_event_id.clone(),
                            if group.last_error.is_empty() {
                                "-".into()
                            } else {
                                group.last_error.clone()
                            },
                        ]
                    })
                    .collect();
                render::table(
                    &["COUNT", "FIRST", "LAST", "EXAMPLE EVENT", "LAST ERROR"],
                    &rows,
                );
            });
        }
        DeadLetterCommand::Requeue {
            subscription,
            select,
        } => {
            if select.chooses_nothing() {
                return Err(usage(
                    "choose dead letters with --id, --event-type, --aggregate-type, --aggregate-id, --last-error, --after or --before, or take every one with --all",
                ));
            }
            let asked_ids = select.ids.len() as u64;
            if select.all && !select.yes {
                let would = admin
                    .requeue_dead_letters(proto::RequeueDeadLettersRequest {
                        validate_only: true,
                        ..select.requeue_request(&subscription)
                    })
                    .await
                    .map_err(describe)?
                    .into_inner()
                    .requeued_count;
                confirm(&format!(
                    "requeue all {} of {subscription} for delivery",
                    count(would, "unresolved dead letter")
                ))?;
            }
            let requeued = admin
                .requeue_dead_letters(select.requeue_request(&subscription))
                .await
                .map_err(describe)?
                .into_inner()
                .requeued_count;
            if asked_ids > 0 && requeued < asked_ids {
                return Err(format!(
                    "requeued {} of {asked_ids}: the others are not unresolved dead letters of {subscription} (see `dlq list {subscription} --include-resolved`)",
                    count(requeued, "dead letter")
                )
                .into());
            }
            target.print(json!({ "requeued_count": requeued }), || {
                println!("requeued {}", count(requeued, "dead letter"))
            });
        }
        DeadLetterCommand::Resolve {
            subscription,
            id,
            mut select,
            resolved_by,
            notes,
        } => {
            // One dead letter by its id: the record it became.
            if let Some(id) = &id
                && select.chooses_nothing()
            {
                let letter = admin
                    .resolve_dead_letter(proto::ResolveDeadLetterRequest {
                        subscription,
                        id: id.clone(),
                        resolved_by,
                        notes,
                        source: select.source,
                    })
                    .await
                    .map_err(describe)?
                    .into_inner();
                target.print(render::dead_letter(&letter), || println!("resolved {id}"));
                return Ok(());
            }
            select.ids.extend(id);
            if select.chooses_nothing() {
                return Err(usage(
                    "choose dead letters by ID, or with --id, --event-type, --aggregate-type, --aggregate-id, --last-error, --after or --before, or take every one with --all",
                ));
            }
            let asked_ids = select.ids.len() as u64;
            if select.all && !select.yes {
                let would = admin
                    .resolve_dead_letters(proto::ResolveDeadLettersRequest {
                        validate_only: true,
                        ..select.resolve_request(&subscription, &resolved_by, &notes)
                    })
                    .await
                    .map_err(describe)?
                    .into_inner()
                    .resolved_count;
                confirm(&format!(
                    "resolve all {} of {subscription} without delivering them",
                    count(would, "unresolved dead letter")
                ))?;
            }
            let resolved = admin
                .resolve_dead_letters(select.resolve_request(&subscription, &resolved_by, &notes))
                .await
                .map_err(describe)?
                .into_inner()
                .resolved_count;
            if asked_ids > 0 && resolved < asked_ids {
                return Err(format!(
                    "resolved {} of {asked_ids}: the others are not unresolved dead letters of {subscription} (see `dlq list {subscription} --include-resolved`)",
                    count(resolved, "dead letter")
                )
                .into());
            }
            target.print(json!({ "resolved_count": resolved }), || {
                println!("resolved {}", count(resolved, "dead letter"))
            });
        }
    }
    Ok(())
}
