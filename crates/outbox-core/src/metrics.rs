//! Metrics: names, labels, descriptions and the calls that record them, through the
//! `metrics` facade. Label values stay bounded — subscription names, RPC methods, status
//! codes and at most `MAX_EVENT_TYPE_LABELS` event types; never an event or aggregate
//! id. The exporter is the gateway's; without one installed every call here is a no-op.

use std::{
    collections::HashSet,
    sync::{LazyLock, Mutex},
    time::Duration,
};

use metrics::{Histogram, counter, gauge, histogram};

use crate::domain::{OutboxStats, StatusKind, SubscriptionStats};

/// Distinct event types given their own label; later ones count as "other".
const MAX_EVENT_TYPE_LABELS: usize = 256;
/// `# HELP` text of every metric, for the exporter to serve.
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        "outbox_rpc_requests_total",
        "gRPC calls finished, by method and final status code (a stream counts when it ends)"
    );
    describe_histogram!(
        "outbox_rpc_duration_seconds",
        Unit::Seconds,
        "duration of gRPC calls, by method (a stream's whole life)"
    );
    describe_counter!(
        "outbox_events_published_total",
        "events stored by Publish, by event type (at most 256 types, the rest as \"other\")"
    );
    describe_counter!(
        "outbox_deliveries_total",
        "deliveries leased to Subscribe streams or push senders, first attempts and redeliveries"
    );
    describe_counter!(
        "outbox_redeliveries_total",
        "deliveries after the first attempt (expired lease, nack or retry)"
    );
    describe_histogram!(
        "outbox_commit_to_delivery_seconds",
        Unit::Seconds,
        "time from an event's creation to its first delivery"
    );
    describe_histogram!(
        "outbox_claim_duration_seconds",
        Unit::Seconds,
        "time one claim of a subscription's deliveries in one source took, commit included; \
         its claims there take turns (a second reading on while the one before commits), so \
         a rate of the sum of 1 or more means they run back to back and more streams add no \
         throughput"
    );
    describe_counter!(
        "outbox_acks_total",
        "deliveries acknowledged (by Ack, or a push endpoint's 2xx answer)"
    );
    describe_counter!(
        "outbox_task_panics_total",
        "background tasks that panicked and were restarted, by task (pusher, push_supervisor, maintenance, ...)"
    );
    describe_histogram!(
        "outbox_deliver_to_ack_seconds",
        Unit::Seconds,
        "time from delivery to acknowledgement"
    );
    describe_counter!(
        "outbox_nacks_total",
        "deliveries refused by their consumer with Nack"
    );
    describe_counter!(
        "outbox_dead_letters_total",
        "deliveries dead-lettered (attempts exhausted or refused for good)"
    );
    describe_counter!(
        "outbox_requeued_total",
        "delivery records sent back for delivery by a requeue (dead letters or delivered events)"
    );
    describe_counter!(
        "outbox_relay_wakeups_total",
        "times the relay looked for work, by cause: publish, notify or poll"
    );
    describe_gauge!(
        "outbox_subscription_backlog",
        "events matching the subscription that are due and not yet delivered (scheduled ones are in outbox_subscription_scheduled)"
    );
    describe_gauge!(
        "outbox_subscription_in_flight",
        "deliveries leased to a stream and not yet settled"
    );
    describe_gauge!(
        "outbox_subscription_awaiting_retry",
        "deliveries waiting for their retry backoff"
    );
    describe_gauge!(
        "outbox_subscription_dead_letters",
        "unresolved dead letters"
    );
    describe_gauge!(
        "outbox_subscription_oldest_unacked_age_seconds",
        Unit::Seconds,
        "how long the oldest due event not yet acked or dead-lettered has been due (since its creation, or its deliver_at when later), 0 when none"
    );
    describe_gauge!(
        "outbox_subscription_late_transactions",
        "transactions that finished after the subscription's cursor passed them; their events go out at the next claim"
    );
    describe_gauge!(
        "outbox_source_up",
        "1 while the source database can be reached, 0 while it cannot"
    );
    describe_gauge!("outbox_events_stored", "events in the outbox table");
    describe_gauge!(
        "outbox_oldest_open_transaction_age_seconds",
        Unit::Seconds,
        "age of the oldest transaction still open in the cluster that has written anything, 0 when none; it holds back vacuum (a long one is usually a mistake) and its own events until it commits, not the delivery of others"
    );
    describe_gauge!(
        "outbox_build_info",
        "always 1, labelled with the version of the running gateway and the git commit it was built from (\"unknown\" when built outside a git checkout)"
    );
    describe_gauge!(
        "outbox_subscription_status",
        "1 for the subscription's status (as GetStats, the console and the CLI show it), 0 for every other: push_stopped, paused, dead_letters, no_consumer, behind, delivering, scheduled_only, caught_up; every replica computes it from the database"
    );
    describe_gauge!(
        "outbox_subscription_streams",
        "Subscribe streams open on the subscription in this gateway process (per replica: sum over the replicas for the total; push and sink subscriptions have none)"
    );
    describe_gauge!(
        "outbox_sink_up",
        "1 while the sink's broker answers this gateway, 0 while it does not"
    );
    describe_counter!(
        "process_cpu_seconds_total",
        Unit::Seconds,
        "user and system CPU time of the gateway process, in whole seconds"
    );
    describe_gauge!(
        "process_resident_memory_bytes",
        Unit::Bytes,
        "resident memory of the gateway process"
    );
    describe_gauge!(
        "process_open_fds",
        "file descriptors the gateway process holds open (connections included)"
    );
    describe_gauge!(
        "process_max_fds",
        "most file descriptors the gateway process may open"
    );
    describe_gauge!(
        "process_start_time_seconds",
        Unit::Seconds,
        "when the gateway process started, in seconds since the Unix epoch"
    );
    describe_gauge!(
        "outbox_db_pool_connections",
        "connections of the main pool, by state: idle or in_use"
    );
    describe_gauge!(
        "outbox_subscription_scheduled",
        "events of the subscription waiting for their deliver_at"
    );
    describe_counter!(
        "outbox_events_expired_total",
        "events a subscription let expire (by their expires_at or its max_event_age) instead of delivering them"
    );
    describe_counter!(
        "outbox_events_filtered_total",
        "events a subscription's filter passed over (those it failed on included)"
    );
    describe_counter!(
        "outbox_filter_errors_total",
        "events a subscription's filter could not be evaluated on (passed over)"
    );
    describe_counter!(
        "outbox_transform_errors_total",
        "deliveries a subscription's transform failed on (dead-lettered)"
    );
    describe_counter!(
        "outbox_push_requests_total",
        "requests of push subscriptions to their endpoints, by HTTP status or failure"
    );
    describe_histogram!(
        "outbox_push_duration_seconds",
        Unit::Seconds,
        "time from sending a push request to its answer"
    );
    describe_counter!(
        "outbox_sink_messages_total",
        "messages of sink subscriptions to their brokers, by outcome: confirmed, retried (a transient failure) or refused (dead-lettered unless persistent)"
    );
    describe_histogram!(
        "outbox_sink_duration_seconds",
        Unit::Seconds,
        "time from sending a message to a broker to its confirmation or failure"
    );
}

static EVENT_TYPES: LazyLock<Mutex<HashSet<String>>> = LazyLock::new(Default::default);

fn event_type_label(event_type: &str) -> String {
    let mut known = EVENT_TYPES.lock().expect("event type labels");
    if known.contains(event_type) {
        return event_type.to_owned();
    }
    if known.len() < MAX_EVENT_TYPE_LABELS {
        known.insert(event_type.to_owned());
        return event_type.to_owned();
    }
    "other".to_owned()
}

/// Newly stored events (duplicates not counted).
pub fn published<'a>(event_types: impl Iterator<Item = &'a str>) {
    for event_type in event_types {
        counter!("outbox_events_published_total", "event_type" => event_type_label(event_type))
            .increment(1);
    }
}

/// Deliveries handed to streams; `redelivered` of them were not first attempts.
pub fn delivered(subscription: &str, source: &str, delivered: u64, redelivered: u64) {
    let labels = per_source(subscription, source);
    counter!("outbox_deliveries_total", &labels).increment(delivered);
    if redelivered > 0 {
        counter!("outbox_redeliveries_total", &labels).increment(redelivered);
    }
}

/// Time from an event's creation to its first delivery, one record per delivery: the
/// handle is looked up once per claim, not once per event.
pub fn commit_to_delivery(subscription: &str) -> Histogram {
    histogram!("outbox_commit_to_delivery_seconds", "subscription" => subscription.to_owned())
}

/// One claim of `subscription` in `source` that ran to its commit, leasing or not.
pub fn claimed(subscription: &str, source: &str, took: Duration) {
    histogram!(
        "outbox_claim_duration_seconds",
        &per_source(subscription, source)
    )
    .record(took.as_secs_f64());
}

pub fn acked(subscription: &str, source: &str, acks: u64) {
    counter!("outbox_acks_total", &per_source(subscription, source)).increment(acks);
}

/// Time from handing a delivery to a stream to its ack (acks reaching this process), one
/// record per ack: the handle is looked up once per ack call.
pub fn deliver_to_ack(subscription: &str) -> Histogram {
    histogram!("outbox_deliver_to_ack_seconds", "subscription" => subscription.to_owned())
}

/// The request metrics of one push subscription, registered once rather than looked up
/// for every request.
pub struct PushRequestMetrics {
    subscription: String,
    duration: metrics::Histogram,
    /// By `code`: the HTTP status, or `timeout`, `connect_error` or `error` when there was
    /// no answer.
    requests: Mutex<std::collections::HashMap<String, metrics::Counter>>,
}

impl PushRequestMetrics {
    pub fn new(subscription: &str) -> PushRequestMetrics {
        PushRequestMetrics {
            subscription: subscription.to_owned(),
            duration: histogram!(
                "outbox_push_duration_seconds",
                "subscription" => subscription.to_owned()
            ),
            requests: Mutex::new(std::collections::HashMap::new()),
        }
    }

    pub fn request(&self, code: &str, elapsed: Duration) {
        self.duration.record(elapsed.as_secs_f64());
        let mut requests = self.requests.lock().expect("push metrics lock");
        match requests.get(code) {
            Some(counter) => counter.increment(1),
            None => {
                let counter = counter!(
                    "outbox_push_requests_total",
                    "subscription" => self.subscription.clone(),
                    "code" => code.to_owned()
                );
                counter.increment(1);
                requests.insert(code.to_owned(), counter);
            }
        }
    }
}

/// The message metrics of one sink subscription, registered once rather than looked up
/// for every message.
pub struct SinkMetrics {
    duration: metrics::Histogram,
    /// By outcome, in [`SinkMetrics::OUTCOMES`] order.
    messages: [metrics::Counter; 3],
}

impl SinkMetrics {
    pub const OUTCOMES: [&str; 3] = ["confirmed", "retried", "refused"];

    pub fn new(subscription: &str, sink: &str) -> SinkMetrics {
        let counter = |outcome: &'static str| {
            counter!(
                "outbox_sink_messages_total",
                "subscription" => subscription.to_owned(),
                "sink" => sink.to_owned(),
                "outcome" => outcome
            )
        };
        SinkMetrics {
            duration: histogram!(
                "outbox_sink_duration_seconds",
                "subscription" => subscription.to_owned(),
                "sink" => sink.to_owned()
            ),
            messages: Self::OUTCOMES.map(counter),
        }
    }

    /// One message's outcome (one of [`SinkMetrics::OUTCOMES`]) and how long it took.
    pub fn message(&self, outcome: &str, elapsed: Duration) {
        self.duration.record(elapsed.as_secs_f64());
        if let Some(index) = Self::OUTCOMES.iter().position(|known| *known == outcome) {
            self.messages[index].increment(1);
        }
    }
}

pub fn nacked(subscription: &str, source: &str) {
    counter!("outbox_nacks_total", &per_source(subscription, source)).increment(1);
}

pub fn dead_lettered(subscription: &str, source: &str, count: u64) {
    counter!(
        "outbox_dead_letters_total",
        &per_source(subscription, source)
    )
    .increment(count);
}

/// Events a subscription let expire (dead-lettered or dropped) instead of delivering.
pub fn expired(subscription: &str, count: u64) {
    counter!("outbox_events_expired_total", "subscription" => subscription.to_owned())
        .increment(count);
}

/// Events a subscription's filter passed over, `errors` of them because it failed on
/// them.
pub fn filtered(subscription: &str, count: u64, errors: u64) {
    let label = || ("subscription", subscription.to_owned());
    counter!("outbox_events_filtered_total", &[label()]).increment(count);
    counter!("outbox_filter_errors_total", &[label()]).increment(errors);
}

/// Deliveries a subscription's transform failed on.
pub fn transform_failed(subscription: &str) {
    counter!("outbox_transform_errors_total", "subscription" => subscription.to_owned())
        .increment(1);
}

pub fn requeued(subscription: &str, source: &str, count: u64) {
    counter!("outbox_requeued_total", &per_source(subscription, source)).increment(count);
}

/// A background task panicked (and is being restarted).
pub fn task_panicked(task: &'static str) {
    counter!("outbox_task_panics_total", "task" => task).increment(1);
}

/// The `task` labels of the gateway's restartable background tasks: a new kind of task
/// belongs here, so that its panics are counted from 0.
pub const TASKS: [&str; 10] = [
    "pusher",
    "push_supervisor",
    "sinker",
    "sink_supervisor",
    "maintenance",
    "source_watch",
    "figures",
    "sink_health_monitor",
    "health_monitor",
    "stream_record",
];

/// Puts `outbox_task_panics_total` of every task on the endpoint at 0: an alert on its
/// `increase()` then works from the first panic on.
pub fn task_panic_counters() {
    for task in TASKS {
        counter!("outbox_task_panics_total", "task" => task).increment(0);
    }
}

/// The word of a status in `outbox_subscription_status{status}`: the status as every
/// view names it, with `_` for spaces so PromQL matchers need no quoting surprises.
pub fn status_label(kind: StatusKind) -> &'static str {
    match kind {
        StatusKind::PushStopped => "push_stopped",
        StatusKind::SinkUnreachable => "sink_unreachable",
        StatusKind::Paused => "paused",
        StatusKind::DeadLetters => "dead_letters",
        StatusKind::NoConsumer => "no_consumer",
        StatusKind::Behind => "behind",
        StatusKind::Delivering => "delivering",
        StatusKind::ScheduledOnly => "scheduled_only",
        StatusKind::CaughtUp => "caught_up",
    }
}

/// A subscription's status: 1 on its own, 0 on every other, so each status's series
/// is always there (an alert `== 1` then clears when the status changes, rather than
/// its series vanishing).
pub fn subscription_status(subscription: &str, status: StatusKind) {
    for kind in StatusKind::ALL {
        gauge!(
            "outbox_subscription_status",
            "subscription" => subscription.to_owned(),
            "status" => status_label(kind)
        )
        .set(if kind == status { 1.0 } else { 0.0 });
    }
}

/// Subscribe streams open on a subscription in this process.
pub fn subscription_streams(subscription: &str, streams: usize) {
    gauge!("outbox_subscription_streams", "subscription" => subscription.to_owned())
        .set(streams as f64);
}

/// 1 while the sink's broker answers, 0 while it does not.
pub fn sink_up(sink: &str, up: bool) {
    gauge!("outbox_sink_up", "sink" => sink.to_owned()).set(if up { 1.0 } else { 0.0 });
}

/// The labels of a subscription's stats in one source.
fn per_source(subscription: &str, source: &str) -> [(&'static str, String); 2] {
    [
        ("subscription", subscription.to_owned()),
        ("source", source.to_owned()),
    ]
}

/// Why the relay looked for work: `publish` (this process), `notify` (LISTEN) or `poll`.
pub fn wakeup(cause: &'static str) {
    counter!("outbox_relay_wakeups_total", "cause" => cause).increment(1);
}

/// Puts every counter of a subscription in one source on the endpoint, at 0 until
/// something happens: a series that only appears with its first increment defeats
/// `rate()` over it and `absent()` alerts.
pub fn subscription_counters(subscription: &str, source: &str) {
    let labels = per_source(subscription, source);
    for name in [
        "outbox_deliveries_total",
        "outbox_redeliveries_total",
        "outbox_acks_total",
        "outbox_nacks_total",
        "outbox_dead_letters_total",
        "outbox_requeued_total",
    ] {
        counter!(name, &labels).increment(0);
    }
    for name in [
        "outbox_events_expired_total",
        "outbox_events_filtered_total",
        "outbox_filter_errors_total",
        "outbox_transform_errors_total",
    ] {
        counter!(name, "subscription" => subscription.to_owned()).increment(0);
    }
}

/// The build — its version and `commit`, the git commit the gateway was built from —
/// and the process's own usage. Gauges are set again on every refresh, since those left
/// alone for a while leave the endpoint.
pub fn build_and_process(commit: &'static str) {
    gauge!(
        "outbox_build_info",
        "version" => env!("CARGO_PKG_VERSION"),
        "commit" => commit
    )
    .set(1.0);
    if let Some(usage) = process::read() {
        counter!("process_cpu_seconds_total").absolute(usage.cpu_seconds as u64);
        gauge!("process_resident_memory_bytes").set(usage.resident_bytes as f64);
        gauge!("process_open_fds").set(usage.open_fds as f64);
        if let Some(max_fds) = usage.max_fds {
            gauge!("process_max_fds").set(max_fds as f64);
        }
        gauge!("process_start_time_seconds").set(usage.start_time_seconds);
    }
}

/// The lag gauges of one subscription in one source.
pub fn subscription_stats(stats: &SubscriptionStats, now: chrono::DateTime<chrono::Utc>) {
    let labels = per_source(
        stats.name.as_str(),
        stats.source.as_ref().map_or("", |source| source.as_str()),
    );
    gauge!("outbox_subscription_backlog", &labels).set(stats.pending as f64);
    gauge!("outbox_subscription_in_flight", &labels).set(stats.in_flight as f64);
    gauge!("outbox_subscription_awaiting_retry", &labels).set(stats.awaiting_retry as f64);
    gauge!("outbox_subscription_dead_letters", &labels).set(stats.dead_lettered as f64);
    let age = stats
        .oldest_unacked_at
        .map_or(0.0, |at| (now - at).num_milliseconds().max(0) as f64 / 1e3);
    gauge!("outbox_subscription_oldest_unacked_age_seconds", &labels).set(age);
    gauge!("outbox_subscription_late_transactions", &labels).set(stats.late_transactions as f64);
    gauge!("outbox_subscription_scheduled", &labels).set(stats.scheduled as f64);
}

/// 1 while the source can be reached, 0 while it cannot.
pub fn source_up(source: &str, up: bool) {
    gauge!("outbox_source_up", "source" => source.to_owned()).set(if up { 1.0 } else { 0.0 });
}

pub fn outbox_stats(stats: &OutboxStats) {
    gauge!("outbox_events_stored").set(stats.events_stored as f64);
    gauge!("outbox_oldest_open_transaction_age_seconds")
        .set(stats.oldest_open_transaction_age.as_secs_f64());
}

pub fn pool(size: u32, idle: usize) {
    gauge!("outbox_db_pool_connections", "state" => "idle").set(idle as f64);
    gauge!("outbox_db_pool_connections", "state" => "in_use")
        .set(size.saturating_sub(idle as u32) as f64);
}

/// The process usage as the Prometheus client libraries name them, read from `/proc`
/// (Linux only; elsewhere there are none).
mod process {
    /// The usage of this process.
    pub struct Usage {
        pub cpu_seconds: f64,
        pub resident_bytes: u64,
        pub open_fds: usize,
        pub max_fds: Option<u64>,
        pub start_time_seconds: f64,
    }

    #[cfg(target_os = "linux")]
    pub fn read() -> Option<Usage> {
        // SAFETY: sysconf only reads a configuration value.
        let ticks_per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        let page_size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if ticks_per_second <= 0 || page_size <= 0 {
            return None;
        }
        let ticks_per_second = ticks_per_second as f64;
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let stat = parse_stat(&stat)?;
        let boot_time = std::fs::read_to_string("/proc/stat")
            .ok()?
            .lines()
            .find_map(|line| line.strip_prefix("btime "))?
            .trim()
            .parse::<u64>()
            .ok()?;
        let open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count();
        let max_fds = std::fs::read_to_string("/proc/self/limits")
            .ok()
            .and_then(|limits| parse_max_open_files(&limits));
        Some(Usage {
            cpu_seconds: (stat.user_ticks + stat.system_ticks) as f64 / ticks_per_second,
            resident_bytes: stat.resident_pages * page_size as u64,
            open_fds,
            max_fds,
            start_time_seconds: boot_time as f64 + stat.start_ticks as f64 / ticks_per_second,
        })
    }

    #[cfg(not(target_os = "linux"))]
    pub fn read() -> Option<Usage> {
        None
    }

    /// The fields of `/proc/self/stat` used here, in clock ticks and pages.
    #[derive(Debug, PartialEq)]
    pub(super) struct Stat {
        pub user_ticks: u64,
        pub system_ticks: u64,
        pub start_ticks: u64,
        pub resident_pages: u64,
    }

    /// Fields after the command name, which is in parentheses and may itself hold spaces
    /// and parentheses: the last `)` ends it. Then `state` is field 3, `utime` 14,
    /// `stime` 15, `starttime` 22 and `rss` 24 (proc(5)).
    pub(super) fn parse_stat(stat: &str) -> Option<Stat> {
        let (_, rest) = stat.rsplit_once(')')?;
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let field = |number: usize| fields.get(number - 3)?.parse::<u64>().ok();
        Some(Stat {
            user_ticks: field(14)?,
            system_ticks: field(15)?,
            start_ticks: field(22)?,
            resident_pages: field(24)?,
        })
    }

    /// The soft limit of `Max open files` in `/proc/self/limits`.
    pub(super) fn parse_max_open_files(limits: &str) -> Option<u64> {
        let line = limits
            .lines()
            .find(|line| line.starts_with("Max open files"))?;
        line["Max open files".len()..]
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    }
}

#[cfg(test)]
mod tests {
    use super::process::{Stat, parse_max_open_files, parse_stat};

    #[test]
    fn reads_proc_stat_past_a_command_name_with_spaces_and_parentheses() {
        let stat = "4242 (outbox (gw) x) S 1 4242 4242 0 -1 4194560 1234 0 0 0 \
                    150 75 0 0 20 0 9 0 8800 123456789 2048 18446744073709551615";
        assert_eq!(
            parse_stat(stat),
            Some(Stat {
                user_ticks: 150,
                system_ticks: 75,
                start_ticks: 8800,
                resident_pages: 2048,
            })
        );
        assert_eq!(parse_stat("4242 (cut short) S 1"), None);
    }

    #[test]
    fn reads_the_soft_open_files_limit() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max processes             127431               127431               processes \n\
                      Max open files            1024                 524288               files     \n";
        assert_eq!(parse_max_open_files(limits), Some(1024));
    }
}
