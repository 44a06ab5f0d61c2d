//! The run's totals: a table for people and one JSON line (the last line of standard
//! output) for programs, followed by the violations, if any.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    time::Duration,
};

use serde::Serialize;
use tokio::time::Instant;
use uuid::Uuid;

use crate::{
    chaos::ChaosCounters,
    check::{LOST_KINDS, Operated, Violation},
    consumers::{Answer, Journal, JournalState, Role, SettleKind, is_poison},
    database::Snapshot,
    exactly_once::{Fate, reacts},
    ledger::{Ledger, LedgerState, Published, Route},
    operator::Pause,
};

/// Violations printed in full; the rest are only counted.
const SHOWN_VIOLATIONS: usize = 50;

#[derive(Debug, Serialize)]
pub struct Totals {
    pub seed: u64,
    pub run_seconds: f64,
    pub drain_seconds: f64,
    pub drained: bool,
    pub published_rpc: usize,
    pub published_sql: usize,
    pub rolled_back: usize,
    pub in_doubt: usize,
    pub rpc_calls: u64,
    pub rpc_retries: u64,
    pub rpc_errors: BTreeMap<String, u64>,
    pub sql_transactions: u64,
    pub sql_commit_unknown: u64,
    pub identical_republishes: u64,
    pub conflicting_republishes: u64,
    pub bad_inputs_refused: u64,
    pub held_transactions: u64,
    /// Samples of the gateways' sessions looking for one left idle in a transaction.
    pub idle_in_transaction_checks: u64,
    /// Rows the gateway wrote in its own tables per event of the burst drained after
    /// the run.
    pub burst_row_writes_per_event: f64,
    pub delivered: usize,
    pub redelivered: usize,
    pub acked: usize,
    pub stale_acks: usize,
    pub failed_acks: usize,
    /// Failed Ack and Nack calls by gRPC code.
    pub settle_errors: BTreeMap<String, usize>,
    pub nacked: usize,
    pub forgotten: u64,
    pub settled_elsewhere: u64,
    pub streams_opened: u64,
    pub subscribe_failures: u64,
    pub stream_ends: BTreeMap<String, u64>,
    pub gateway_kills: u64,
    pub graceful_restarts: u64,
    pub connection_cuts: u64,
    pub connections_cut: u64,
    pub source_outages: u64,
    /// Events published with a `deliver_at` ahead, and those of them delivered (pulled or
    /// pushed) on some subscription.
    pub scheduled_published: usize,
    pub scheduled_delivered: usize,
    /// Events published with an `expires_at`, those of them delivered on some
    /// subscription, and the sum of the subscriptions' `expired_total`.
    pub expiring_published: usize,
    pub expiring_delivered: usize,
    pub expired: u64,
    /// The dead-letter subscription: poison events among its committed ones, nacks
    /// applied, dead letters listed at the end, dead letters requeued during the run and
    /// how many of those were delivered again.
    pub poison_events: usize,
    pub poison_nacks: u64,
    pub dead_letters: usize,
    pub dead_letters_requeued: u64,
    pub requeued_redelivered: usize,
    /// Pauses of the paused subscription, and deliveries after a pause ended of events
    /// committed while it lasted.
    pub pauses: usize,
    pub delivered_after_pause: usize,
    /// Seeks, acked events they had to replay, and how many of those were delivered
    /// again.
    pub seeks: usize,
    pub seek_replays_expected: usize,
    pub seek_replayed: usize,
    /// Push requests received, those answered with an error, and distinct events answered
    /// 2xx.
    pub push_requests: usize,
    pub push_errors_answered: usize,
    pub pushed_events: usize,
    /// Admin calls of the operator tried again on another gateway.
    pub admin_retried_calls: u64,
    pub subscriptions: Vec<SubscriptionTotals>,
    /// On ordered subscriptions, from the ack of one event to the arrival of the next
    /// event of its aggregate (already committed then), by where the ack went.
    pub ordered_handoff_same_gateway: Latencies,
    pub ordered_handoff_other_gateway: Latencies,
    pub lost: usize,
    pub violations: usize,
    pub violation_kinds: BTreeMap<&'static str, usize>,
}

#[derive(Debug, Serialize)]
pub struct SubscriptionTotals {
    pub name: &'static str,
    /// Committed events it selects.
    pub expected: usize,
    pub delivered: usize,
    pub redelivered: usize,
    pub acked: usize,
    /// The figures of the exactly-once subscription.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exactly_once: Option<ExactlyOnceTotals>,
}

/// What the exactly-once consumers did and left behind.
#[derive(Debug, Default, Serialize)]
pub struct ExactlyOnceTotals {
    /// Side-effect rows, and the events they are of.
    pub side_effects: u64,
    pub consumed_events: usize,
    /// Reaction events stored, and the consumed events that publish one.
    pub reactions: u64,
    pub reactions_expected: usize,
    /// Committed consuming transactions whose `outbox_consume` returned true, and those
    /// where it returned false (a redelivery of an event consumed before).
    pub consumed_first: usize,
    pub consumed_again: usize,
    /// Crashes before the commit and right after it, and transactions held open past the
    /// lease.
    pub crashes_before_commit: usize,
    pub crashes_after_commit: usize,
    pub stalls: usize,
    /// Consumed events the operator requeued, and those of them delivered again.
    pub requeued: usize,
    pub requeued_redelivered: usize,
    /// `consumption_records` in GetStats at the end.
    pub consumption_records: u64,
}

impl ExactlyOnceTotals {
    fn gather(
        index: usize,
        name: &str,
        state: &JournalState,
        snapshot: &Snapshot,
        operated: &Operated,
    ) -> ExactlyOnceTotals {
        let effects = &snapshot.effects;
        let committed = |first: bool| {
            (state.consumptions.iter())
                .filter(|c| c.committed == Some(true) && c.first == Some(first))
                .count()
        };
        let fated = |fate: Fate| {
            (state.consumptions.iter())
                .filter(|c| c.fate == fate)
                .count()
        };
        let requeues = &operated.log.consumed_requeues;
        ExactlyOnceTotals {
            side_effects: effects.rows.values().sum(),
            consumed_events: effects.rows.len(),
            reactions: effects.reactions.values().sum(),
            reactions_expected: effects.rows.keys().filter(|id| reacts(**id)).count(),
            consumed_first: committed(true),
            consumed_again: committed(false),
            crashes_before_commit: fated(Fate::CrashBeforeCommit),
            crashes_after_commit: (state.consumptions.iter())
                .filter(|c| c.fate == Fate::CrashAfterCommit && c.committed == Some(true))
                .count(),
            stalls: fated(Fate::Stall),
            requeued: requeues.len(),
            requeued_redelivered: (requeues.iter())
                .filter(|requeue| {
                    (state.received.iter()).any(|r| {
                        r.subscription == index && r.event == requeue.event && r.at > requeue.sent
                    })
                })
                .count(),
            consumption_records: (operated.view.stats.get(name))
                .map_or(0, |stats| stats.consumption_records),
        }
    }
}

/// Median, 90th percentile and maximum of some delays, in milliseconds.
#[derive(Debug, Default, Serialize)]
pub struct Latencies {
    pub count: usize,
    pub p50_ms: u128,
    pub p90_ms: u128,
    pub max_ms: u128,
}

impl Latencies {
    fn of(mut delays: Vec<Duration>) -> Latencies {
        delays.sort();
        let at = |quantile: f64| {
            let index = ((delays.len() as f64 - 1.0) * quantile).round() as usize;
            delays.get(index).map_or(0, Duration::as_millis)
        };
        Latencies {
            count: delays.len(),
            p50_ms: at(0.5),
            p90_ms: at(0.9),
            max_ms: at(1.0),
        }
    }
}

impl std::fmt::Display for Latencies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "p50 {} ms, p90 {} ms, max {} ms ({} handoffs)",
            self.p50_ms, self.p90_ms, self.max_ms, self.count
        )
    }
}

/// Ack-to-next-arrival delays on ordered subscriptions: (ack to the stream's gateway,
/// ack to another gateway).
fn ordered_handoffs(
    ledger: &LedgerState,
    state: &JournalState,
    journal: &Journal,
) -> (Latencies, Latencies) {
    let mut first_arrival = HashMap::new();
    for received in &state.received {
        if journal.specs[received.subscription].ordered {
            first_arrival
                .entry((received.subscription, received.event))
                .or_insert(received);
        }
    }
    let mut acked = HashMap::new();
    for received in &state.received {
        let applied = (state
            .settlements
            .get(&received.ack_id)
            .into_iter()
            .flatten())
        .find(|s| s.kind == SettleKind::Ack && s.answer == Answer::Applied);
        if let Some(settlement) = applied {
            let same_gateway = settlement.gateway == received.gateway;
            acked.insert(
                (received.subscription, received.event),
                (settlement.sent, same_gateway),
            );
        }
    }
    let mut by_aggregate: HashMap<&str, Vec<&Published>> = HashMap::new();
    for event in ledger.committed.values() {
        by_aggregate
            .entry(&event.aggregate)
            .or_default()
            .push(event);
    }
    let (mut same, mut other) = (Vec::new(), Vec::new());
    for events in by_aggregate.values_mut() {
        events.sort_by_key(|event| event.version);
        for pair in events.windows(2) {
            for subscription in 0..journal.specs.len() {
                let (Some((ack_sent, same_gateway)), Some(next), Some(committed)) = (
                    acked.get(&(subscription, pair[0].id)),
                    first_arrival.get(&(subscription, pair[1].id)),
                    ledger.committed_at.get(&pair[1].id),
                ) else {
                    continue;
                };
                if committed < ack_sent && next.at > *ack_sent {
                    let delay = next.at - *ack_sent;
                    if *same_gateway { &mut same } else { &mut other }.push(delay);
                }
            }
        }
    }
    (Latencies::of(same), Latencies::of(other))
}

/// How long the run took.
pub struct Timing {
    pub run: Duration,
    pub drain: Duration,
    pub drained: bool,
}

/// Figures of the features the operator and the special subscriptions exercise.
struct FeatureTotals {
    scheduled_delivered: usize,
    expiring_delivered: usize,
    poison_events: usize,
    requeued_redelivered: usize,
    delivered_after_pause: usize,
    seek_replayed: usize,
}

impl FeatureTotals {
    fn gather(
        ledger: &LedgerState,
        state: &JournalState,
        journal: &Journal,
        operated: &Operated,
    ) -> FeatureTotals {
        let delivered: HashSet<Uuid> = (state.received.iter().map(|r| r.event))
            .chain(state.pushed.iter().map(|p| p.event))
            .collect();
        let delivered_with = |has: fn(&Published) -> bool| {
            (ledger.committed.values())
                .filter(|event| has(event) && delivered.contains(&event.id))
                .count()
        };
        let role_index = |role| journal.specs.iter().position(|spec| spec.role == role);
        let poison_events = role_index(Role::DeadLetters).map_or(0, |index| {
            (ledger.committed.values())
                .filter(|event| journal.specs[index].matches(&event.event_type))
                .filter(|event| is_poison(event.id))
                .count()
        });
        let requeued_redelivered = role_index(Role::DeadLetters).map_or(0, |index| {
            (operated.log.requeues.iter())
                .flat_map(|requeue| {
                    (requeue.redelivery_expected.iter()).map(move |id| (requeue.sent, *id))
                })
                .filter(|(sent, id)| {
                    (state.received.iter())
                        .any(|r| r.subscription == index && r.event == *id && r.at > *sent)
                })
                .count()
        });
        let delivered_after_pause = role_index(Role::Pause).map_or(0, |index| {
            let during = |pause: &Pause, at: &Instant| *at > pause.answered && *at < pause.ended;
            (state.received.iter())
                .filter(|r| r.subscription == index)
                .filter(|r| {
                    operated.log.pauses.iter().any(|pause| {
                        r.at > pause.ended
                            && ledger
                                .committed_at
                                .get(&r.event)
                                .is_some_and(|at| during(pause, at))
                    })
                })
                .count()
        });
        let seek_replayed = (state.replay_expected.iter())
            .filter(|((subscription, id), sent)| {
                (state.received.iter())
                    .any(|r| r.subscription == *subscription && r.event == *id && r.at > **sent)
            })
            .count();
        FeatureTotals {
            scheduled_delivered: delivered_with(|event| event.deliver_at.is_some()),
            expiring_delivered: delivered_with(|event| event.expires_at.is_some()),
            poison_events,
            requeued_redelivered,
            delivered_after_pause,
            seek_replayed,
        }
    }
}

impl Totals {
    #[allow(clippy::too_many_arguments)]
    pub fn gather(
        ledger: &Ledger,
        journal: &Journal,
        snapshot: &Snapshot,
        counters: &ChaosCounters,
        operated: Operated,
        violations: &[Violation],
        timing: Timing,
        seed: u64,
    ) -> Totals {
        let ledger = ledger.state();
        let state = journal.state();
        let features = FeatureTotals::gather(&ledger, &state, journal, &operated);
        let published_with = |has: fn(&Published) -> bool| {
            ledger.committed.values().filter(|event| has(event)).count()
        };
        let published = |route| {
            (ledger.committed.values())
                .filter(|event| event.route == route)
                .count()
        };
        let settlements = |kind, answer: fn(&Answer) -> bool| {
            (state.settlements.values())
                .flatten()
                .filter(|s| s.kind == kind && answer(&s.answer))
                .count()
        };
        let subscriptions: Vec<SubscriptionTotals> = (journal.specs.iter().enumerate())
            .map(|(index, spec)| {
                // A push subscription's deliveries are the receiver's requests, and its
                // acks the events answered 2xx. The exactly-once subscription is never
                // acked: its acks are the events a committed transaction consumed.
                let (delivered, distinct, acked) = if spec.role == Role::Push {
                    let distinct: HashSet<Uuid> = state.pushed.iter().map(|p| p.event).collect();
                    (state.pushed.len(), distinct.len(), state.pushed_ok.len())
                } else {
                    let received = state.received.iter().filter(|r| r.subscription == index);
                    let distinct: HashSet<Uuid> = received.clone().map(|r| r.event).collect();
                    let acked = match spec.role {
                        Role::ExactlyOnce => state.consumed.len(),
                        _ => state.acked.iter().filter(|(s, _)| *s == index).count(),
                    };
                    (received.count(), distinct.len(), acked)
                };
                SubscriptionTotals {
                    name: spec.name,
                    expected: (ledger.committed.values())
                        .filter(|event| spec.matches(&event.event_type))
                        .count(),
                    delivered,
                    redelivered: delivered - distinct,
                    acked,
                    exactly_once: (spec.role == Role::ExactlyOnce).then(|| {
                        ExactlyOnceTotals::gather(index, spec.name, &state, snapshot, &operated)
                    }),
                }
            })
            .collect();
        let mut settle_errors = BTreeMap::new();
        for settlement in state.settlements.values().flatten() {
            if let Answer::Failed(code) = &settlement.answer {
                *settle_errors.entry(code.clone()).or_default() += 1;
            }
        }
        let (ordered_handoff_same_gateway, ordered_handoff_other_gateway) =
            ordered_handoffs(&ledger, &state, journal);
        let mut violation_kinds = BTreeMap::new();
        for violation in violations {
            *violation_kinds.entry(violation.kind).or_default() += 1;
        }
        Totals {
            seed,
            run_seconds: timing.run.as_secs_f64(),
            drain_seconds: timing.drain.as_secs_f64(),
            drained: timing.drained,
            published_rpc: published(Route::Rpc),
            published_sql: published(Route::Sql),
            rolled_back: ledger.rolled_back.len(),
            in_doubt: ledger.in_doubt.len(),
            rpc_calls: ledger.rpc_calls,
            rpc_retries: ledger.rpc_retries,
            rpc_errors: ledger.rpc_errors.clone(),
            sql_transactions: ledger.sql_transactions,
            sql_commit_unknown: ledger.sql_commit_unknown,
            identical_republishes: ledger.identical_republishes,
            conflicting_republishes: ledger.conflicting_republishes,
            bad_inputs_refused: ledger.bad_inputs_refused,
            held_transactions: ledger.held_transactions,
            idle_in_transaction_checks: ChaosCounters::get(&counters.idle_in_transaction_checks),
            burst_row_writes_per_event: 0.0,
            delivered: subscriptions.iter().map(|s| s.delivered).sum(),
            redelivered: subscriptions.iter().map(|s| s.redelivered).sum(),
            acked: state.acked.len(),
            stale_acks: settlements(SettleKind::Ack, |a| *a == Answer::Stale),
            failed_acks: settlements(SettleKind::Ack, |a| matches!(a, Answer::Failed(_))),
            settle_errors,
            nacked: settlements(SettleKind::Nack, |a| *a == Answer::Applied),
            forgotten: state.forgotten,
            settled_elsewhere: state.settled_elsewhere,
            streams_opened: state.streams_opened,
            subscribe_failures: state.subscribe_failures,
            stream_ends: state.stream_ends.clone().into_iter().collect(),
            gateway_kills: ChaosCounters::get(&counters.kills),
            graceful_restarts: ChaosCounters::get(&counters.graceful_restarts),
            connection_cuts: ChaosCounters::get(&counters.connection_cuts),
            connections_cut: ChaosCounters::get(&counters.connections_cut),
            source_outages: ChaosCounters::get(&counters.source_outages),
            scheduled_published: published_with(|event| event.deliver_at.is_some()),
            scheduled_delivered: features.scheduled_delivered,
            expiring_published: published_with(|event| event.expires_at.is_some()),
            expiring_delivered: features.expiring_delivered,
            expired: operated.view.expired_total.values().sum(),
            poison_events: features.poison_events,
            poison_nacks: state.poison_nacks,
            dead_letters: operated.view.dead_letters.len(),
            dead_letters_requeued: (operated.log.requeues.iter())
                .map(|requeue| requeue.requeued)
                .sum(),
            requeued_redelivered: features.requeued_redelivered,
            pauses: operated.log.pauses.len(),
            delivered_after_pause: features.delivered_after_pause,
            seeks: operated.log.seeks.len(),
            seek_replays_expected: state.replay_expected.len(),
            seek_replayed: features.seek_replayed,
            push_requests: state.pushed.len(),
            push_errors_answered: (state.pushed.iter())
                .filter(|pushed| !(200..300).contains(&pushed.status))
                .count(),
            pushed_events: state.pushed_ok.len(),
            admin_retried_calls: operated.log.retried_calls,
            subscriptions,
            ordered_handoff_same_gateway,
            ordered_handoff_other_gateway,
            lost: violations
                .iter()
                .filter(|v| LOST_KINDS.contains(&v.kind))
                .count(),
            violations: violations.len(),
            violation_kinds,
        }
    }
}

/// Prints the table, the violations (to standard error) and the JSON line.
pub fn print(totals: &Totals, violations: &[Violation]) {
    let rows: Vec<(&str, String)> = vec![
        ("seed", totals.seed.to_string()),
        (
            "run / drain",
            format!(
                "{:.1} s / {:.1} s{}",
                totals.run_seconds,
                totals.drain_seconds,
                if totals.drained { "" } else { " (timed out)" }
            ),
        ),
        ("published by RPC", totals.published_rpc.to_string()),
        ("published by SQL", totals.published_sql.to_string()),
        ("rolled back (SQL)", totals.rolled_back.to_string()),
        ("in doubt", totals.in_doubt.to_string()),
        (
            "Publish calls / retries",
            format!("{} / {}", totals.rpc_calls, totals.rpc_retries),
        ),
        ("Publish errors", format!("{:?}", totals.rpc_errors)),
        (
            "SQL transactions / commit unknown",
            format!(
                "{} / {}",
                totals.sql_transactions, totals.sql_commit_unknown
            ),
        ),
        (
            "re-publishes identical / conflicting",
            format!(
                "{} / {}",
                totals.identical_republishes, totals.conflicting_republishes
            ),
        ),
        ("bad inputs refused", totals.bad_inputs_refused.to_string()),
        (
            "transactions held open",
            totals.held_transactions.to_string(),
        ),
        (
            "idle-in-transaction checks",
            totals.idle_in_transaction_checks.to_string(),
        ),
        ("delivered", totals.delivered.to_string()),
        ("redelivered", totals.redelivered.to_string()),
        ("acked (answered OK)", totals.acked.to_string()),
        (
            "acks stale / failed",
            format!("{} / {}", totals.stale_acks, totals.failed_acks),
        ),
        ("Ack / Nack errors", format!("{:?}", totals.settle_errors)),
        ("nacked", totals.nacked.to_string()),
        (
            "settled on another gateway than the stream's",
            totals.settled_elsewhere.to_string(),
        ),
        ("left to expire", totals.forgotten.to_string()),
        (
            "streams opened / refused",
            format!("{} / {}", totals.streams_opened, totals.subscribe_failures),
        ),
        ("stream ends", format!("{:?}", totals.stream_ends)),
        ("gateway kills (-9)", totals.gateway_kills.to_string()),
        ("graceful restarts", totals.graceful_restarts.to_string()),
        (
            "connection cuts (connections)",
            format!("{} ({})", totals.connection_cuts, totals.connections_cut),
        ),
        ("source outages", totals.source_outages.to_string()),
        (
            "scheduled published / delivered",
            format!(
                "{} / {}",
                totals.scheduled_published, totals.scheduled_delivered
            ),
        ),
        (
            "expiring published / delivered / expired",
            format!(
                "{} / {} / {}",
                totals.expiring_published, totals.expiring_delivered, totals.expired
            ),
        ),
        (
            "poison events / nacks / dead letters",
            format!(
                "{} / {} / {}",
                totals.poison_events, totals.poison_nacks, totals.dead_letters
            ),
        ),
        (
            "dead letters requeued / delivered again",
            format!(
                "{} / {}",
                totals.dead_letters_requeued, totals.requeued_redelivered
            ),
        ),
        (
            "pauses / delivered after a pause",
            format!("{} / {}", totals.pauses, totals.delivered_after_pause),
        ),
        (
            "seeks / replays expected / replayed",
            format!(
                "{} / {} / {}",
                totals.seeks, totals.seek_replays_expected, totals.seek_replayed
            ),
        ),
        (
            "push requests / errors answered / events",
            format!(
                "{} / {} / {}",
                totals.push_requests, totals.push_errors_answered, totals.pushed_events
            ),
        ),
        (
            "admin calls retried",
            totals.admin_retried_calls.to_string(),
        ),
        (
            "ordered handoff, ack to same gateway",
            totals.ordered_handoff_same_gateway.to_string(),
        ),
        (
            "ordered handoff, ack to other gateway",
            totals.ordered_handoff_other_gateway.to_string(),
        ),
        (
            "row writes per event of a burst",
            format!("{:.3}", totals.burst_row_writes_per_event),
        ),
        ("lost", totals.lost.to_string()),
        ("violations", totals.violations.to_string()),
    ];
    let width = rows.iter().map(|(name, _)| name.len()).max().unwrap_or(0);
    println!("outbox-chaos totals");
    for (name, value) in &rows {
        println!("  {name:<width$}  {value}");
    }
    println!(
        "  {:<24} {:>8} {:>10} {:>12} {:>8}",
        "subscription", "expected", "delivered", "redelivered", "acked"
    );
    for s in &totals.subscriptions {
        println!(
            "  {:<24} {:>8} {:>10} {:>12} {:>8}",
            s.name, s.expected, s.delivered, s.redelivered, s.acked
        );
        if let Some(e) = &s.exactly_once {
            println!(
                "    side-effect rows / events {} / {}, reactions / expected {} / {}, \
                 consumption records {}",
                e.side_effects,
                e.consumed_events,
                e.reactions,
                e.reactions_expected,
                e.consumption_records
            );
            println!(
                "    consumed first / again {} / {}, crashes before / after commit {} / {}, \
                 stalled past the lease {}, requeued / delivered again {} / {}",
                e.consumed_first,
                e.consumed_again,
                e.crashes_before_commit,
                e.crashes_after_commit,
                e.stalls,
                e.requeued,
                e.requeued_redelivered
            );
        }
    }
    for violation in violations.iter().take(SHOWN_VIOLATIONS) {
        eprintln!("VIOLATION {violation}");
    }
    if violations.len() > SHOWN_VIOLATIONS {
        eprintln!(
            "... and {} more violations: {:?}",
            violations.len() - SHOWN_VIOLATIONS,
            totals.violation_kinds
        );
    }
    println!(
        "{}",
        serde_json::to_string(totals).expect("totals serialize")
    );
}
