//! The operator: during the chaos phase it pauses a subscription and resumes it, pauses
//! it again until a time, seeks another back in time, requeues dead letters, and
//! requeues events the exactly-once subscription consumed, each through the Admin API of
//! whichever gateway answers; it logs what it did and when, for the checks. At the end
//! it reads the dead-letter queues and every subscription's figures the same way.

use std::{
    collections::{HashMap, HashSet},
    future::Future,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use chrono::{DateTime, Utc};
use outbox_client::proto::{self, admin_client::AdminClient};
use rand::{Rng, SeedableRng, rngs::StdRng, seq::IndexedRandom};
use tokio::time::Instant;
use tonic::{Code, transport::Channel};
use uuid::Uuid;

use crate::{
    check::Violation,
    cluster::Cluster,
    consumers::{Journal, Role, SubscriptionSpec},
};

/// Longest one Admin call may take before it counts as failed.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest the operator keeps retrying one operation on other gateways.
const GIVE_UP_AFTER: Duration = Duration::from_secs(30);
/// How long the first pause lasts until the operator resumes it.
const PAUSE_FOR: Duration = Duration::from_secs(3);
/// How far ahead the second pause's `until` lies.
const PAUSE_UNTIL: Duration = Duration::from_secs(3);
/// How far back the seek goes: far enough that every event written before that time
/// has been handed out already (the longest a transaction is held open is 8 s), since
/// a seek to a time skips what was written before it and not yet handed out.
const SEEK_BACK: Duration = Duration::from_secs(15);
/// Time between requeues of dead letters, and most dead letters requeued at once.
const REQUEUE_EVERY: Duration = Duration::from_secs(4);
const REQUEUE_AT_MOST: usize = 20;
/// Consumed events requeued at once, and how long before their consuming transaction
/// must have committed (so that the gateway has most likely settled their delivery).
const REQUEUE_CONSUMED: usize = 5;
const CONSUMED_AGO: Duration = Duration::from_secs(3);

/// One pause and its end.
#[derive(Debug, Clone)]
pub struct Pause {
    /// When the PauseSubscription call was answered OK.
    pub answered: Instant,
    /// When it ended at the earliest: the first ResumeSubscription call was sent, or its
    /// `until` came.
    pub ended: Instant,
    /// Whether `until` ended it.
    pub by_until: bool,
}

/// One seek.
#[derive(Debug, Clone)]
pub struct Seek {
    /// When the first SeekSubscription call was sent, and the one answered OK was.
    pub sent: Instant,
    pub answered: Instant,
    /// The time it went back to: events written at or after it are replayed.
    pub to: DateTime<Utc>,
}

/// One requeue of dead letters.
#[derive(Debug, Clone)]
pub struct Requeue {
    /// When the first RequeueDeadLetters call was sent.
    pub sent: Instant,
    /// Requeued ids that must be delivered again, with attempt 1: those that were not
    /// dead-lettered as expired, of events without an expiry.
    pub redelivery_expected: Vec<Uuid>,
    /// Requeued dead letters that had expired, times the calls made: each requeue of one
    /// counts it as expired once more.
    pub expired_requeued: u64,
    pub requeued: u64,
}

/// One event of the exactly-once subscription requeued after it was consumed.
#[derive(Debug, Clone)]
pub struct ConsumedRequeue {
    /// When the first RequeueEvent call was sent.
    pub sent: Instant,
    pub event: Uuid,
}

/// What the operator did.
#[derive(Debug, Default)]
pub struct OperationsLog {
    pub pauses: Vec<Pause>,
    pub seeks: Vec<Seek>,
    pub requeues: Vec<Requeue>,
    /// Consumed events requeued with a call answered OK that requeued them: each must be
    /// delivered again (and be found consumed).
    pub consumed_requeues: Vec<ConsumedRequeue>,
    /// Admin calls that failed on a gateway and were tried again on another.
    pub retried_calls: u64,
    pub violations: Vec<Violation>,
}

#[derive(Debug, Default)]
pub struct Operations {
    log: Mutex<OperationsLog>,
}

impl Operations {
    pub fn log(&self) -> MutexGuard<'_, OperationsLog> {
        self.log.lock().expect("operations lock")
    }

    fn violation(&self, kind: &'static str, detail: String) {
        self.log().violations.push(Violation::new(kind, detail));
    }
}

/// What the Admin API shows once the run has drained.
#[derive(Debug, Default)]
pub struct AdminView {
    /// Unresolved dead letters of every subscription, by subscription name and event.
    pub dead_letters: HashMap<(String, Uuid), proto::DeadLetter>,
    /// `expired_total` of every subscription, by name.
    pub expired_total: HashMap<String, u64>,
    /// Every subscription's figures, by name.
    pub stats: HashMap<String, proto::SubscriptionStats>,
}

/// The operations planned over the chaos phase.
#[derive(Debug, Clone, Copy)]
enum Action {
    Pause,
    Resume,
    PauseUntil,
    Seek,
    Requeue,
    RequeueConsumed,
}

pub struct Operator {
    cluster: Arc<Cluster>,
    journal: Arc<Journal>,
    operations: Arc<Operations>,
    rng: StdRng,
}

impl Operator {
    pub fn new(
        cluster: Arc<Cluster>,
        journal: Arc<Journal>,
        operations: Arc<Operations>,
        seed: u64,
    ) -> Operator {
        Operator {
            cluster,
            journal,
            operations,
            rng: StdRng::seed_from_u64(seed ^ 0x6f70_6572),
        }
    }

    fn subscription(&self, role: Role) -> (usize, &'static str) {
        let index = (self.journal.specs.iter())
            .position(|spec| spec.role == role)
            .expect("a subscription for every role");
        (index, self.journal.specs[index].name)
    }

    /// Carries out the plan over `duration` from now; every operation ends (the pause is
    /// resumed) before the chaos phase does.
    pub async fn run(mut self, duration: Duration) {
        let started = Instant::now();
        let at = |fraction: f64| started + duration.mul_f64(fraction);
        let mut plan = vec![
            (at(0.2), Action::Pause),
            (at(0.2) + PAUSE_FOR, Action::Resume),
            (at(0.45), Action::Seek),
            (at(0.4), Action::RequeueConsumed),
            (at(0.7), Action::RequeueConsumed),
        ];
        // In a run too short for both, the resume would end the second pause early.
        if at(0.65) > at(0.2) + PAUSE_FOR + Duration::from_secs(1) {
            plan.push((at(0.65), Action::PauseUntil));
        }
        let mut requeue_at = at(0.3);
        while requeue_at < at(0.85) {
            plan.push((requeue_at, Action::Requeue));
            requeue_at += REQUEUE_EVERY;
        }
        plan.sort_by_key(|(at, _)| *at);
        for (when, action) in plan {
            tokio::time::sleep_until(when).await;
            match action {
                Action::Pause => self.pause(None).await,
                Action::Resume => self.resume().await,
                Action::PauseUntil => self.pause(Some(PAUSE_UNTIL)).await,
                Action::Seek => self.seek().await,
                Action::Requeue => self.requeue().await,
                Action::RequeueConsumed => self.requeue_consumed().await,
            }
        }
    }

    /// Pauses the pause subscription, until resumed or for `lasting`.
    async fn pause(&self, lasting: Option<Duration>) {
        let (_, name) = self.subscription(Role::Pause);
        let until = lasting.map(|lasting| Utc::now() + lasting);
        let request = proto::PauseSubscriptionRequest {
            name: name.into(),
            reason: "chaos: operator pause".into(),
            until: until.map(crate::producers::timestamp),
        };
        let Some((_, answered, answer)) = admin(
            &self.cluster,
            &self.operations,
            "PauseSubscription",
            |mut client| {
                let request = request.clone();
                async move { client.pause_subscription(request).await }
            },
        )
        .await
        else {
            return;
        };
        match (answer, until) {
            (Ok(subscription), _) if !subscription.paused => self.operations.violation(
                "pause",
                format!("PauseSubscription answered a subscription not paused: {subscription:?}"),
            ),
            (Ok(_), None) => {
                eprintln!("outbox-chaos: paused {name}");
                self.operations.log().pauses.push(Pause {
                    answered,
                    // Set by the resume.
                    ended: answered,
                    by_until: false,
                });
            }
            (Ok(_), Some(until)) => {
                eprintln!("outbox-chaos: paused {name} until {until}");
                let left = (until - Utc::now()).to_std().unwrap_or_default();
                self.operations.log().pauses.push(Pause {
                    answered,
                    ended: Instant::now() + left,
                    by_until: true,
                });
            }
            // A retry that came after `until`: the pause is over, nothing to check.
            (Err(status), Some(until))
                if status.code() == Code::InvalidArgument && until <= Utc::now() => {}
            (Err(status), _) => self
                .operations
                .violation("pause", format!("PauseSubscription refused: {status}")),
        }
    }

    async fn resume(&self) {
        let (_, name) = self.subscription(Role::Pause);
        let request = proto::ResumeSubscriptionRequest { name: name.into() };
        let Some((sent, _, answer)) = admin(
            &self.cluster,
            &self.operations,
            "ResumeSubscription",
            |mut client| {
                let request = request.clone();
                async move { client.resume_subscription(request).await }
            },
        )
        .await
        else {
            return;
        };
        eprintln!("outbox-chaos: resumed {name}");
        match answer {
            Ok(subscription) if subscription.paused => self.operations.violation(
                "pause",
                format!("ResumeSubscription answered a paused subscription: {subscription:?}"),
            ),
            Ok(_) => {
                if let Some(pause) = (self.operations.log().pauses.iter_mut())
                    .rev()
                    .find(|pause| !pause.by_until)
                {
                    pause.ended = sent;
                }
            }
            Err(status) => self
                .operations
                .violation("pause", format!("ResumeSubscription refused: {status}")),
        }
    }

    /// Seeks the seek subscription `SEEK_BACK` into the past.
    async fn seek(&self) {
        let (index, name) = self.subscription(Role::Seek);
        let to = Utc::now() - SEEK_BACK;
        let request = proto::SeekSubscriptionRequest {
            subscription: name.into(),
            to: Some(proto::StartPosition {
                position: Some(proto::start_position::Position::Time(
                    crate::producers::timestamp(to),
                )),
            }),
        };
        let Some((sent, answered, answer)) = admin(
            &self.cluster,
            &self.operations,
            "SeekSubscription",
            |mut client| {
                let request = request.clone();
                async move { client.seek_subscription(request).await }
            },
        )
        .await
        else {
            return;
        };
        if let Err(status) = answer {
            self.operations
                .violation("seek", format!("SeekSubscription refused: {status}"));
            return;
        }
        let replays_expected = self.journal.expect_replay(index, sent, to);
        eprintln!(
            "outbox-chaos: sought {name} back to {to}, {replays_expected} acked events to replay"
        );
        self.operations
            .log()
            .seeks
            .push(Seek { sent, answered, to });
    }

    /// Requeues some of the dead-letter subscription's dead letters, by id.
    async fn requeue(&mut self) {
        let (_, name) = self.subscription(Role::DeadLetters);
        let Some(listed) = list_dead_letters(&self.cluster, name, &self.operations).await else {
            return;
        };
        let count = (listed.len() / 2)
            .clamp(1, REQUEUE_AT_MOST)
            .min(listed.len());
        let chosen: Vec<&proto::DeadLetter> =
            listed.choose_multiple(&mut self.rng, count).collect();
        if chosen.is_empty() {
            return;
        }
        let ids: Vec<String> = (chosen.iter())
            .filter_map(|dead| Some(dead.event.as_ref()?.id.clone()))
            .collect();
        let request = proto::RequeueDeadLettersRequest {
            subscription: name.into(),
            ids: ids.clone(),
            ..Default::default()
        };
        let calls = std::sync::atomic::AtomicU32::new(0);
        let Some((sent, _, answer)) = admin(
            &self.cluster,
            &self.operations,
            "RequeueDeadLetters",
            |mut client| {
                calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let request = request.clone();
                async move { client.requeue_dead_letters(request).await }
            },
        )
        .await
        else {
            return;
        };
        let requeued = match answer {
            Ok(response) => response.requeued_count,
            Err(status) => {
                self.operations
                    .violation("requeue", format!("RequeueDeadLetters refused: {status}"));
                return;
            }
        };
        // Nothing else touches these dead letters: each chosen one is requeued, unless an
        // earlier call that failed on its way back did it already.
        let first_call = calls.load(std::sync::atomic::Ordering::Relaxed) == 1;
        if first_call && requeued != ids.len() as u64 {
            self.operations.violation(
                "requeue",
                format!(
                    "RequeueDeadLetters of {} ids answered {requeued}",
                    ids.len()
                ),
            );
        }
        let redelivery_expected = (chosen.iter())
            .filter(|dead| dead.last_error != "expired")
            .filter_map(|dead| dead.event.as_ref())
            .filter(|event| event.expires_at.is_none())
            .filter_map(|event| event.id.parse().ok())
            .collect();
        // Each call may have requeued them (again).
        let expired_requeued = (chosen.iter())
            .filter(|dead| dead.last_error == "expired")
            .count() as u64
            * u64::from(calls.load(std::sync::atomic::Ordering::Relaxed));
        eprintln!("outbox-chaos: requeued {requeued} dead letters of {name}");
        self.operations.log().requeues.push(Requeue {
            // A failed call may have been applied: the first one sent is the earliest the
            // dead letters went back.
            sent,
            redelivery_expected,
            expired_requeued,
            requeued,
        });
    }

    /// Requeues a few events the exactly-once subscription consumed a while ago, with a
    /// RequeueEvent call each that keeps their consumption records: each must be
    /// delivered again, and its consumers must find it consumed. Events that expire are
    /// left out (one may expire before it is delivered again).
    async fn requeue_consumed(&mut self) {
        let (index, name) = self.subscription(Role::ExactlyOnce);
        let Some(committed_before) = Instant::now().checked_sub(CONSUMED_AGO) else {
            return;
        };
        let mut candidates: Vec<Uuid> = {
            let state = self.journal.state();
            let expiring: HashSet<Uuid> = (state.received.iter())
                .filter(|received| received.subscription == index)
                .filter(|received| received.expires_at.is_some())
                .map(|received| received.event)
                .collect();
            (state.consumptions.iter())
                .filter(|consumption| consumption.committed == Some(true))
                .filter(|consumption| consumption.ended < committed_before)
                .filter(|consumption| !expiring.contains(&consumption.event))
                .map(|consumption| consumption.event)
                .collect()
        };
        candidates.sort();
        candidates.dedup();
        let chosen: Vec<Uuid> = (candidates.choose_multiple(&mut self.rng, REQUEUE_CONSUMED))
            .copied()
            .collect();
        let mut requeued = 0;
        for event in chosen {
            let request = proto::RequeueEventRequest {
                id: event.to_string(),
                subscription: name.into(),
                ..Default::default()
            };
            let Some((sent, _, answer)) = admin(
                &self.cluster,
                &self.operations,
                "RequeueEvent",
                |mut client| {
                    let request = request.clone();
                    async move { client.requeue_event(request).await }
                },
            )
            .await
            else {
                continue;
            };
            match answer {
                Ok(response) if response.requeued_count > 0 => {
                    requeued += 1;
                    (self.operations.log().consumed_requeues).push(ConsumedRequeue { sent, event });
                }
                // Nothing requeued, or refused while in flight: its delivery is not settled
                // yet, or an earlier call whose answer was lost requeued it and it is out
                // again. Either way nothing more to expect.
                Ok(_) => {}
                Err(status) if status.code() == Code::FailedPrecondition => {}
                Err(status) => self.operations.violation(
                    "requeue",
                    format!("RequeueEvent of {event}, consumed on {name}, refused: {status}"),
                ),
            }
        }
        eprintln!("outbox-chaos: requeued {requeued} consumed events of {name}");
    }
}

/// Calls `call` on one gateway after another until one answers, or `GIVE_UP_AFTER`
/// passes. Returns when the first call was sent, and when and how the last was
/// answered; `None` when no gateway answered (a violation: some gateway is always up).
async fn admin<T, F, Fut>(
    cluster: &Cluster,
    operations: &Operations,
    what: &str,
    call: F,
) -> Option<(Instant, Instant, Result<T, tonic::Status>)>
where
    F: Fn(AdminClient<Channel>) -> Fut,
    Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let first_sent = Instant::now();
    let mut gateway = rand::rng().random_range(0..cluster.len());
    while first_sent.elapsed() < GIVE_UP_AFTER {
        let client = AdminClient::new(cluster.channel(gateway));
        let answer = tokio::time::timeout(CALL_TIMEOUT, call(client)).await;
        match answer {
            Ok(Ok(response)) => {
                return Some((first_sent, Instant::now(), Ok(response.into_inner())));
            }
            Ok(Err(status)) if !is_transport_failure(&status) => {
                return Some((first_sent, Instant::now(), Err(status)));
            }
            _ => operations.log().retried_calls += 1,
        }
        gateway = (gateway + 1) % cluster.len();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    operations.violation(
        "admin call",
        format!("{what} got no answer from any gateway within {GIVE_UP_AFTER:?}"),
    );
    None
}

/// A subscription's unresolved dead letters, every page; `None` (and a violation) when
/// no gateway answered.
async fn list_dead_letters(
    cluster: &Cluster,
    name: &str,
    operations: &Operations,
) -> Option<Vec<proto::DeadLetter>> {
    let mut all = Vec::new();
    let mut page_token = String::new();
    loop {
        let request = proto::ListDeadLettersRequest {
            subscription: name.into(),
            page_size: 1000,
            page_token: page_token.clone(),
            ..Default::default()
        };
        let (_, _, answer) = admin(cluster, operations, "ListDeadLetters", |mut client| {
            let request = request.clone();
            async move { client.list_dead_letters(request).await }
        })
        .await?;
        match answer {
            Ok(page) => {
                all.extend(page.dead_letters);
                if page.next_page_token.is_empty() {
                    return Some(all);
                }
                page_token = page.next_page_token;
            }
            Err(status) => {
                operations.violation("dead letters", format!("ListDeadLetters refused: {status}"));
                return None;
            }
        }
    }
}

/// Statuses a broken connection or a dying gateway produces: the call may or may not
/// have been carried out.
fn is_transport_failure(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable
            | Code::Unknown
            | Code::Internal
            | Code::Cancelled
            | Code::DeadlineExceeded
    )
}

/// Reads the dead letters of the subscriptions that dead-letter, and every
/// subscription's expiry counter.
pub async fn final_view(
    cluster: &Cluster,
    specs: &[SubscriptionSpec],
    operations: &Operations,
) -> AdminView {
    let mut view = AdminView::default();
    for spec in specs
        .iter()
        .filter(|spec| spec.max_attempts() > 0 || spec.dead_letter_expired())
    {
        for dead in list_dead_letters(cluster, spec.name, operations)
            .await
            .unwrap_or_default()
        {
            let Some(id) = dead.event.as_ref().and_then(|event| event.id.parse().ok()) else {
                operations.violation(
                    "dead letters",
                    format!("a dead letter without an event id: {dead:?}"),
                );
                continue;
            };
            view.dead_letters.insert((spec.name.to_owned(), id), dead);
        }
    }
    let stats = admin(cluster, operations, "GetStats", |mut client| async move {
        client.get_stats(proto::GetStatsRequest::default()).await
    })
    .await;
    match stats {
        Some((_, _, Ok(stats))) => {
            for subscription in stats.subscriptions {
                if !subscription.error.is_empty() {
                    operations.violation(
                        "stats",
                        format!("{}: {}", subscription.name, subscription.error),
                    );
                }
                view.expired_total
                    .insert(subscription.name.clone(), subscription.expired_total);
                view.stats.insert(subscription.name.clone(), subscription);
            }
        }
        Some((_, _, Err(status))) => {
            operations.violation("stats", format!("GetStats refused: {status}"))
        }
        None => {}
    }
    view
}
